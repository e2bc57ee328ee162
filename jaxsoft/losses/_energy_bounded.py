"""L16 energy-bounded out-of-distribution training loss (Liu et al. 2020): cross-entropy on
the in-distribution batch plus squared hinges that push the free energy of in-distribution
examples below one margin and that of auxiliary outliers above another.

The energy is the one of :func:`~jaxsoft.losses.energy_score` (its negative).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive, finite_float
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["energy_bounded_loss"]


def _energy_rows(logits, axis: lc.Axis, where, temperature, fn: str, name: str):
  """``(x, mask, axis, E, visible)``: the prepared logits and the free energy
  ``E = -T LSE(x / T)`` of each row, with whether the row has a visible class."""
  logits = lc.float_input(logits, name, fn)
  if logits.ndim == 0:
    raise ValueError(f"{fn}: `{name}` must have a class axis, got a scalar")
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn, name)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  lse, visible = lc.masked_logsumexp(x / temperature, mask, axis)
  return x, mask, axis, -temperature * lse, visible, dtype


def _masked_mean(values, keep):
  """Mean of ``values`` over ``keep``; 0 (zero gradient) when nothing is kept."""
  total = jnp.sum(jnp.where(keep, values, jnp.zeros_like(values)))
  return nc.safe_divide(total, jnp.sum(keep).astype(values.dtype))


def energy_bounded_loss(logits: ArrayLike, labels: ArrayLike, outlier_logits: ArrayLike, *,
                        margin_in: float = -25.0, margin_out: float = -7.0,
                        energy_weight: float = 0.1, temperature: ArrayLike = 1.0,
                        axis: lc.Axis = -1, where: ArrayLike | None = None,
                        outlier_where: ArrayLike | None = None) -> jax.Array:
  r"""Energy-bounded OOD training loss: cross-entropy plus energy hinges (feature L16).

  From W. Liu, X. Wang, J. D. Owens & Y. Li, "Energy-based Out-of-distribution Detection"
  (NeurIPS 2020), Sec. 4. With the free energy
  :math:`E(x) = -T \log\sum_k e^{f_k(x)/T}` (minus :func:`~jaxsoft.losses.energy_score`),
  a batch of in-distribution examples :math:`x_{in}` with labels y and a batch of
  auxiliary outliers :math:`x_{out}`:

  .. math::
    \mathcal{L} = \mathbb{E}_{in}\bigl[\mathrm{CE}(f(x_{in}), y)\bigr]
      + \lambda\Bigl(\mathbb{E}_{in}\bigl[\max(0, E(x_{in}) - m_{in})^2\bigr]
      + \mathbb{E}_{out}\bigl[\max(0, m_{out} - E(x_{out}))^2\bigr]\Bigr),

  each :math:`\mathbb{E}` the mean over that batch's visible examples. The hinges leave
  an in-distribution example alone once its energy is below :math:`m_{in}` and an
  outlier once its energy is above :math:`m_{out}`, so the energy gap
  (:func:`~jaxsoft.losses.energy_score` as the OOD score) is trained without pushing
  energies further than the margins. The cross-entropy is the plain one (T = 1); the
  temperature enters the energies only (the paper trains with T = 1). The gradient of
  the in-distribution hinge is :math:`-2\lambda\max(0, E - m_{in})\,
  \mathrm{softmax}(f/T)` per example (over the batch size), and that of the outlier hinge
  :math:`+2\lambda\max(0, m_{out} - E)\,\mathrm{softmax}(f/T)`.

  The defaults :math:`\lambda = 0.1`, :math:`m_{in} = -25`, :math:`m_{out} = -7` are the
  paper's for CIFAR-10 fine-tuning (it tunes the margins per dataset; they depend on the
  scale of the logits).

  Unlike the per-example losses of this package, the result is one scalar per batch (the
  outlier batch has its own size, as in the authors' code, which concatenates the two
  batches through the network and splits the logits).

  Args:
    logits: ``[..., K, ...]`` logits of the in-distribution batch; every position off
      ``axis`` is an example.
    labels: integer class labels of ``logits``' shape without ``axis``.
    outlier_logits: ``[..., K', ...]`` logits of the auxiliary outlier batch (any batch
      shape), class axis ``axis`` too.
    margin_in: :math:`m_{in}`, the energy an in-distribution example should stay below.
    margin_out: :math:`m_{out}`, the energy an outlier should stay above.
    energy_weight: :math:`\lambda \ge 0` (0 gives the mean cross-entropy).
    temperature: T > 0 of the energies.
    axis: the class axis, or a tuple of axes forming it (None: all), as the losses; the
      same for both batches.
    where: optional class or example mask of ``logits`` (as the losses): masked examples
      leave both in-distribution means.
    outlier_where: the same for ``outlier_logits``.

  Returns:
    The scalar loss, in the dtype the two logits promote to (bf16/fp16 computed in
    float32). A batch with no visible example contributes 0 to its terms (both batches
    fully masked give 0 with zero gradient); a label naming no visible class gives
    ``+inf``.

  Examples:
    >>> z_in = jnp.array([[30.0, 0.0], [0.0, 20.0]])   # energies about -30 and -20
    >>> z_out = jnp.array([[1.0, 0.0], [8.0, 7.0]])    # -1.3133 and -8.3133
    >>> y = jnp.array([0, 1])
    >>> ce = js.losses.softmax_cross_entropy_with_integer_labels(z_in, y).mean()
    >>> loss = js.losses.energy_bounded_loss(z_in, y, z_out)
    >>> print(jnp.round(loss - ce, 4))  # 0.1 * (5^2 / 2 + 1.3133^2 / 2): x_in[1], x_out[1]
    1.3362

  References:
    W. Liu, X. Wang, J. D. Owens & Y. Li, 2020, "Energy-based Out-of-distribution
    Detection" (NeurIPS); the authors' code: github.com/wetliu/energy_ood.
  """
  fn = "energy_bounded_loss"
  m_in = finite_float(margin_in, "margin_in", fn)
  m_out = finite_float(margin_out, "margin_out", fn)
  lam = lc.nonnegative_float(energy_weight, "energy_weight", fn)
  t = check_positive(temperature, "temperature", fn)
  x, mask, ax, e_in, vis_in, dtype = _energy_rows(logits, axis, where, t, fn, "logits")
  labels = lc.check_integer_labels(labels, x.shape, ax, fn)
  _, _, _, e_out, vis_out, dtype_out = _energy_rows(
      outlier_logits, axis, outlier_where, t, fn, "outlier_logits")
  ce, _, label_visible = lc.integer_cross_entropy(x, mask, labels, ax)
  ce = jnp.where(label_visible, ce, jnp.inf)
  hinge_in = jnp.square(jnp.maximum(e_in - m_in, 0.0))
  hinge_out = jnp.square(jnp.maximum(m_out - e_out, 0.0))
  loss = (_masked_mean(ce, vis_in)
          + lam * (_masked_mean(hinge_in, vis_in) + _masked_mean(hinge_out, vis_out)))
  return loss.astype(jnp.result_type(dtype, dtype_out))
