"""AUC maximisation: the square AUC surrogate on smoothed-max pooled bags of instances
(multi-instance deep AUC maximisation, MIDAM; feature L17)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft import pooling
from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["midam_auc_loss"]


def midam_auc_loss(instance_scores: ArrayLike, bag_labels: ArrayLike, *,
                   temperature: ArrayLike = 1.0, margin: float = 1.0,
                   where: ArrayLike | None = None,
                   bag_where: ArrayLike | None = None) -> jax.Array:
  r"""Multi-instance AUC loss on smoothed-max (log-mean-exp) pooled bags (feature L17).

  From D. Zhu, B. Wang, Z. Chen, Y. Wang, M. Sonka, X. Wu & T. Yang, "Provable
  Multi-instance Deep AUC Maximization with Stochastic Pooling" (ICML 2023). Each bag X
  of instance scores h is pooled by the smoothed max (:func:`jaxsoft.pooling.log_mean_exp`)

  .. math::
    s(X) = \tau \log \frac{1}{|X|} \sum_{x \in X} e^{h(x)/\tau},

  and the bags are scored by the square AUC surrogate over positive/negative bag pairs

  .. math::
    L = \frac{1}{|P||N|} \sum_{i \in P} \sum_{j \in N} \bigl(m - (s_i - s_j)\bigr)^2,

  the pairwise form of the min-max margin objective the paper optimises [R]; the paper's
  stochastic, moving-average estimator of the inner mean (for bags larger than a batch)
  is an optimiser choice left to the caller. :math:`\partial s/\partial h =
  \mathrm{softmax}(h/\tau)` over the visible instances; shift invariant in h.

  Args:
    instance_scores: ``[B, n]`` scores of n instances in each of B bags.
    bag_labels: ``[B]`` labels, 1 (or True) for a positive bag, 0 for a negative one.
    temperature: τ > 0.
    margin: m >= 0.
    where: optional ``[B, n]`` instance mask (False instances are left out of their bag).
    bag_where: optional ``[B]`` bag mask (False bags are left out; so are bags with no
      visible instance).

  Returns:
    A scalar in float32 (float64 for float64 scores); 0, with zero gradient, when there is
    no positive or no negative bag.

  Examples:
    >>> h = jnp.array([[3.0, -1.0], [0.0, 0.0]])
    >>> print(round(float(js.losses.midam_auc_loss(h, jnp.array([1, 0]), margin=1.0)), 4))
    1.7556

  References:
    D. Zhu, B. Wang, Z. Chen, Y. Wang, M. Sonka, X. Wu & T. Yang, 2023, "Provable Multi-instance
    Deep AUC Maximization with Stochastic Pooling" (ICML).
  """
  fn = "midam_auc_loss"
  h = lc.float_input(instance_scores, "instance_scores", fn)
  if h.ndim != 2:
    raise ValueError(f"{fn}: `instance_scores` must be floating [B, n], got {h.shape} {h.dtype}")
  y = jnp.asarray(bag_labels)
  if y.shape != h.shape[:1]:
    raise ValueError(f"{fn}: `bag_labels` must be [B] = {h.shape[:1]}, got {y.shape}")
  if not (jnp.issubdtype(y.dtype, jnp.integer) or y.dtype == jnp.bool_):
    raise ValueError(f"{fn}: `bag_labels` must be integers or booleans, got {y.dtype}")
  check_positive(temperature, "temperature", fn)
  m = lc.nonnegative_float(margin, "margin", fn)
  dtype = nc.compute_dtype(h.dtype)
  hc = h.astype(dtype)
  inst = jnp.ones(h.shape, bool) if where is None else jnp.broadcast_to(
      jnp.asarray(where, bool), h.shape)
  keep = jnp.any(inst, axis=-1)
  if bag_where is not None:
    bw = jnp.asarray(bag_where, bool)
    if bw.shape != h.shape[:1]:
      raise ValueError(f"{fn}: `bag_where` must be [B] = {h.shape[:1]}, got {bw.shape}")
    keep = keep & bw
  s = pooling.log_mean_exp(hc, axis=-1, where=inst, tau=temperature)
  pos = keep & (y == 1)
  neg = keep & (y == 0)
  pair = pos[:, None] & neg[None, :]
  sq = jnp.square(m - (s[:, None] - s[None, :]))
  total = jnp.sum(jnp.where(pair, sq, 0.0))
  return nc.safe_divide(total, jnp.sum(pair).astype(dtype))
