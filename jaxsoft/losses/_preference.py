"""L10 preference losses on sequence log-probabilities: S-DPO (softmax DPO over several
negatives) and ADPO (anchored, listwise DPO).

Inputs are per-candidate log-probabilities (e.g. summed token log-probs of a response) of
the policy and of the frozen reference/anchor model. One loss per example comes back, in
the policy log-probabilities' dtype (bf16/fp16 computed in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.losses._classification import softmax_cross_entropy
from jaxsoft.normalizers import common as nc

__all__ = ["adpo_loss", "sdpo_loss"]


def _float_like(a, shape, name, fn) -> jax.Array:
  a = lc.float_input(a, name, fn)
  if a.shape != tuple(shape):
    raise ValueError(f"{fn}: `{name}` of shape {a.shape} must have shape {tuple(shape)}")
  return a.astype(nc.compute_dtype(a.dtype))


def sdpo_loss(chosen_logps: ArrayLike, rejected_logps: ArrayLike, ref_chosen_logps: ArrayLike,
              ref_rejected_logps: ArrayLike, *, beta: ArrayLike = 1.0,
              where: ArrayLike | None = None) -> jax.Array:
  r"""S-DPO: softmax direct preference optimisation with several negatives (feature L10).

  From Y. Chen et al., "On Softmax Direct Preference Optimization for Recommendation"
  (NeurIPS 2024). With implicit
  rewards :math:`r(e) = \beta\,(\log\pi_\theta(e \mid x) - \log\pi_{\mathrm{ref}}(e \mid x))`
  of the preferred item p and the negatives d,

  .. math::
    \ell = -\log\sigma\Bigl(-\log\sum_{d} e^{r_d - r_p}\Bigr)
         = \log\Bigl(1 + \sum_d e^{r_d - r_p}\Bigr)
         = -\log\frac{e^{r_p}}{e^{r_p} + \sum_d e^{r_d}},

  the softmax CE over {p} ∪ negatives with the implicit rewards as logits (target p). One
  negative gives DPO, :math:`-\log\sigma(r_p - r_d)` (R. Rafailov et al. 2023, "Direct
  Preference Optimization: Your Language Model is Secretly a Reward Model"). The
  gradient in :math:`r_d` is the softmax weight of d: hard negatives weigh more.

  Args:
    chosen_logps: ``[...]`` policy log-probabilities of the preferred candidates.
    rejected_logps: ``[..., N]`` policy log-probabilities of the N negatives.
    ref_chosen_logps: ``[...]`` reference log-probabilities of the preferred candidates.
    ref_rejected_logps: ``[..., N]`` reference log-probabilities of the negatives.
    beta: :math:`\beta > 0`.
    where: optional mask: ``[..., N]`` over negatives (a False negative is left out) or
      ``[...]`` over examples (loss 0, zero gradient).

  Returns:
    One loss per example (``chosen_logps``' shape), in ``chosen_logps``' dtype.

  Examples:
    >>> print(js.losses.sdpo_loss(jnp.array([-1.0]), jnp.array([[-2.0, -1.5]]),
    ...                           jnp.array([-1.2]), jnp.array([[-1.8, -1.6]]), beta=0.5))
    [1.0188]

  References:
    Y. Chen et al., 2024, "On Softmax Direct Preference Optimization for Recommendation"
    (NeurIPS).

    R. Rafailov, A. Sharma, E. Mitchell, S. Ermon, C. D. Manning & C. Finn, 2023, "Direct
    Preference Optimization: Your Language Model is Secretly a Reward Model" (NeurIPS).
  """
  fn = "sdpo_loss"
  beta = check_positive(beta, "beta", fn)
  chosen = lc.float_input(chosen_logps, "chosen_logps", fn)
  dtype = chosen.dtype
  rej = jnp.asarray(rejected_logps)
  if rej.ndim != chosen.ndim + 1 or rej.shape[:-1] != chosen.shape:
    raise ValueError(f"{fn}: `rejected_logps` of shape {rej.shape} must be `chosen_logps`' shape "
                     f"{chosen.shape} + (N,)")
  rej = _float_like(rej, rej.shape, "rejected_logps", fn)
  ref_c = _float_like(ref_chosen_logps, chosen.shape, "ref_chosen_logps", fn)
  ref_r = _float_like(ref_rejected_logps, rej.shape, "ref_rejected_logps", fn)
  r_p = beta * (chosen.astype(rej.dtype) - ref_c)
  r_d = beta * (rej - ref_r)
  logits = jnp.concatenate([r_p[..., None], r_d], axis=-1)
  if where is not None:
    where = jnp.asarray(where).astype(bool)
    if where.shape == rej.shape:
      where = jnp.concatenate([jnp.ones(chosen.shape + (1,), bool), where], axis=-1)
    elif where.shape != chosen.shape:
      raise ValueError(f"{fn}: `where` of shape {where.shape} must be {rej.shape} (negatives) or "
                       f"{chosen.shape} (examples)")
  labels = jnp.zeros(chosen.shape, jnp.int32)
  x, mask, _ = lc.prepare(logits, -1, where, fn)
  loss, visible, label_visible = lc.integer_cross_entropy(x, mask, labels, -1)
  return lc.integer_finish(loss, labels, visible, label_visible, None, dtype)


def adpo_loss(logps: ArrayLike, ref_logps: ArrayLike, targets: ArrayLike, *,
              temperature: ArrayLike = 1.0, where: ArrayLike | None = None) -> jax.Array:
  r"""ADPO: anchored, listwise direct preference optimisation (feature L10).

  From "Anchored Direct Preference Optimization" (ADPO, 2025; its authors are not
  recorded here). Over the N candidates of
  a prompt, with policy log-probabilities l and anchor (reference) log-probabilities
  :math:`l_{\mathrm{ref}}`,

  .. math::
    \ell = \mathrm{KL}\Bigl(q \,\Big\|\, \mathrm{softmax}\bigl((l - l_{\mathrm{ref}})
      / \tau_{\mathrm{anc}}\bigr)\Bigr),

  where the target distribution q selects the regime: one-hot (SFT), a teacher
  distribution (distillation), the softmax of rewards (max-entropy RL), or
  :math:`q = (1, 0)` over a pair, which gives DPO with :math:`\beta = 1/\tau`:
  :math:`-\log\sigma\bigl(((l_w - l_l) - (l_{w,\mathrm{ref}} - l_{l,\mathrm{ref}}))/\tau\bigr)`.
  The loss is invariant to adding a constant to all l, and its Hessian in l is
  :math:`(\mathrm{diag}(p) - pp^\top)/\tau^2` (the softmax Fisher metric).

  Args:
    logps: ``[..., N]`` policy log-probabilities of the candidates.
    ref_logps: ``[..., N]`` anchor log-probabilities.
    targets: ``[..., N]`` target distribution q (rows summing to 1 over visible candidates).
    temperature: :math:`\tau_{\mathrm{anc}} > 0`.
    where: optional mask: ``[..., N]`` candidates or ``[...]`` examples.

  Returns:
    One loss per example (``logps``' shape without the last axis), in ``logps``' dtype.

  Examples:
    >>> logps, ref = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.5]])
    >>> print(js.losses.adpo_loss(logps, ref, jnp.array([[1.0, 0.0]])))  # DPO: log(1 + e^-1)
    [0.3133]

  References:
    "Anchored Direct Preference Optimization", 2025 (its authors are not recorded here).

    R. Rafailov, A. Sharma, E. Mitchell, S. Ermon, C. D. Manning & C. Finn, 2023, "Direct
    Preference Optimization: Your Language Model is Secretly a Reward Model" (NeurIPS).
  """
  fn = "adpo_loss"
  tau = check_positive(temperature, "temperature", fn)
  lp = lc.check_logits(logps, fn)
  dtype = lp.dtype
  ref = _float_like(ref_logps, lp.shape, "ref_logps", fn)
  q = _float_like(targets, lp.shape, "targets", fn)
  z = (lp.astype(ref.dtype) - ref) / tau
  ce = softmax_cross_entropy(z, q, where=where)
  _, mask, _ = lc.prepare(z, -1, where, fn)
  pos = mask & (q > 0)
  neg_entropy = jnp.sum(jnp.where(pos, q * jnp.log(jnp.where(pos, q, 1.0)), 0.0), axis=-1)
  return (ce.astype(z.dtype) + neg_entropy).astype(dtype)
