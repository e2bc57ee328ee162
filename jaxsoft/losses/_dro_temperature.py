"""TempNet's DRO robust loss: a KL-constrained distributionally robust cross-entropy whose
temperature is a per-example input (feature N31's training loss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc

__all__ = ["tempnet_dro_loss"]


def tempnet_dro_loss(logits: ArrayLike, labels: ArrayLike, temperature: ArrayLike, *,
                     rho: float, axis: lc.Axis = -1,
                     where: ArrayLike | None = None) -> jax.Array:
  r"""TempNet's KL-constrained DRO robust loss with a per-example temperature (N31).

  From Z.-H. Qiu, S. Guo, M. Xu, T. Zhao, L. Zhang & T. Yang, "To Cool or not to Cool?
  Temperature Network Meets Large Foundation Models via DRO" (ICML 2024). With the pairwise
  losses :math:`\ell_j = z_j - z_y` over the m visible classes (for a CLIP row of
  similarities, :math:`s_{ij} - s_{ii}` with label i), the temperature :math:`\tau > 0`
  (TempNet's output for this input) and the DRO radius :math:`\rho \ge 0`,

  .. math::
    L(z, \tau) = \tau \log\Big(\frac{1}{m} \sum_{j} e^{\ell_j / \tau}\Big) + \tau\rho
    = \max_{p:\ \mathrm{KL}(p\,\Vert\,\frac{1}{m}) \le \rho} \sum_j p_j \ell_j
    \quad\text{(at the optimal } \tau\text{)}.

  It lies between :math:`\mathrm{mean}_j \ell_j + \tau\rho` and
  :math:`\max_j \ell_j + \tau\rho`, tends to :math:`\max_j \ell_j` as
  :math:`\tau \to 0^+`; its :math:`\tau`-derivative is
  :math:`\rho - \mathrm{KL}(p \,\Vert\, \mathrm{uniform})` with
  :math:`p = \mathrm{softmax}(\ell/\tau)`, so the optimal temperature makes the KL equal
  ρ, and the robust part (without :math:`\tau\rho`) is non-increasing in τ. For a constant τ
  it is :math:`\tau\,\mathrm{CE}(z/\tau, y) - \tau\log m + \tau\rho`: the temperature-scaled
  cross-entropy, rescaled and shifted. The sum runs over every visible class, the label's
  own :math:`\ell_y = 0` included: the form :math:`\tau\,\mathrm{CE}(z/\tau, y) +
  (\rho - \log V)\,\tau` of the authors' LLM code (its batch mean is left to the caller).

  Args:
    logits: ``[..., K]`` logits (LLM next-token logits, or a row of similarities).
    labels: integer labels of ``logits``' shape without ``axis``.
    temperature: τ > 0 per example, broadcastable to ``labels``' shape (e.g.
      ``js.nn.TempNet.temperature(x)[..., 0]``); differentiable.
    rho: the DRO radius ρ >= 0 (keyword; the paper tunes it per task).
    axis: the class axis (a tuple of axes or None: merged into one, as optax reads it).
    where: optional class mask broadcastable to ``logits`` or an example mask of
      ``labels``' shape (the package convention; masked classes leave the sum and m).

  Returns:
    One loss per example in ``logits``' dtype (float32 compute for bf16/fp16); 0 with zero
    gradient for masked examples, ``+inf`` when the label names no visible class.

  Examples:
    >>> z = jnp.array([[2.0, 0.0, -1.0]])
    >>> print(js.losses.tempnet_dro_loss(z, jnp.array([0]), jnp.array([0.5]), rho=0.1))
    [-0.489]

  References:
    Z.-H. Qiu, S. Guo, M. Xu, T. Zhao, L. Zhang & T. Yang, 2024, "To Cool or not to Cool?
    Temperature Network Meets Large Foundation Models via DRO" (ICML).
  """
  fn = "tempnet_dro_loss"
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  x, mask, ax, dtype = lc.prepare_logits(logits, axis, where, fn)
  y = lc.check_integer_labels(labels, x.shape, ax, fn)
  r = lc.nonnegative_float(rho, "rho", fn)
  check_positive(temperature, "temperature", fn)
  tau0 = lc.float_input(temperature, "temperature", fn)
  if tau0.ndim > y.ndim:
    raise ValueError(f"{fn}: `temperature` of shape {tau0.shape} must broadcast to the "
                     f"examples {y.shape}")
  try:
    tau = jnp.broadcast_to(lc.at_rank(tau0, y.ndim), y.shape).astype(x.dtype)
  except ValueError:
    raise ValueError(f"{fn}: `temperature` of shape {tau0.shape} must broadcast to the "
                     f"examples {y.shape}") from None
  x_y, label_visible = lc.gather_label(x, mask, y, ax)
  ell = (x - jnp.expand_dims(x_y, ax)) / jnp.expand_dims(tau, ax)
  lse, visible = lc.masked_logsumexp(ell, mask, ax)
  m = jnp.sum(mask, axis=ax).astype(x.dtype)
  loss = tau * (lse - jnp.log(jnp.maximum(m, 1.0)) + r)
  return lc.integer_finish(loss, y, visible, label_visible, None, dtype)
