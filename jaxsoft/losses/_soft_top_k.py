"""L09 DEXML's soft top-k operator loss: the positives' log-membership in a differentiable
top-k set of each query's candidates (beside :func:`decoupled_softmax_loss`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.losses import _common as lc
from jaxsoft.losses._contrastive import _multi_positive_inputs
from jaxsoft.normalizers import common as nc

__all__ = ["soft_top_k_loss"]


def soft_top_k_loss(scores: ArrayLike, positives: ArrayLike, *, k: ArrayLike,
                    temperature: ArrayLike = 1.0,
                    where: ArrayLike | None = None) -> jax.Array:
  r"""DEXML's soft top-k operator loss, a surrogate of precision@k (feature L09).

  From N. Gupta, D. Khatri, A. S. Rawat, S. Bhojanapalli, P. Jain & I. S. Dhillon,
  "Dual-Encoders for Extreme Multi-label Classification" (ICLR 2024), whose soft top-k is
  the sigmoid-threshold operator: for query i the threshold :math:`t_i` solves

  .. math::
    \sum_{j \in V_i} \sigma\big(s_{ij}/\tau - t_i\big) = k_i, \qquad
    p_{ij} = \sigma\big(s_{ij}/\tau - t_i\big),

  over the visible candidates :math:`V_i`, so :math:`p_{ij} \in (0, 1)` is candidate j's
  soft membership in the top :math:`k_i` (:math:`\sum_j p_{ij} = k_i`; as
  :math:`\tau \to 0` it tends to the hard top-k indicator), and the loss is the mean
  negative log-membership of the positives :math:`P_i`:

  .. math::
    \ell_i = -\frac{1}{|P_i|} \sum_{p \in P_i} \log p_{ip}.

  The gradient goes through :math:`t_i` by the implicit function theorem,
  :math:`\partial t_i / \partial s_{ij} = w_{ij} / \tau` with
  :math:`w_{ij} = \sigma'_{ij} / \sum_{l \in V_i} \sigma'_{il}` (computed in log space, so
  saturated sigmoids give no NaN); :math:`t_i` itself is found by bisection on a bracket
  that provably holds it, then one Newton step. The loss is invariant to adding a constant
  to a row's scores. A row whose :math:`k_i` reaches its number of visible candidates (all
  of them are in the top k) or with no visible positive has loss 0.

  DEXML's :math:`\sigma(\alpha(s/\tau_0 + t))` is this operator with
  :math:`\tau = \tau_0 / \alpha` (its defaults :math:`\tau_0 = 0.05`, :math:`\alpha = 2`,
  k = 5 give ``temperature=0.025``); it samples at most k positives per query before the
  loss, which is left to the caller here. [R]: the paper's text leaves the operator's
  details out; this follows the authors' released code (nilesh2797/DEXML), with a bracket
  and a Newton step of our own.

  Args:
    scores: ``[B, M]`` similarities.
    positives: ``[B, M]`` boolean (or 0/1) positive labels.
    k: the soft set's size, a real number > 0, one for all queries or ``[B]``
      (e.g. the positives' counts); a traced value is not checked.
    temperature: :math:`\tau > 0`.
    where: optional example (``[B]``) or candidate (``[B, M]``) mask; a masked candidate
      is neither a positive nor a candidate of the top k.

  Returns:
    ``[B]`` losses in ``scores``' dtype.

  Examples:
    >>> s = jnp.array([[2.0, 1.5, -1.0, 0.0]])
    >>> pos = jnp.array([[True, True, False, False]])
    >>> print(js.losses.soft_top_k_loss(s, pos, k=2))
    [0.2928]

  References:
    N. Gupta, D. Khatri, A. S. Rawat, S. Bhojanapalli, P. Jain & I. S. Dhillon, 2024,
    "Dual-Encoders for Extreme Multi-label Classification" (ICLR).
  """
  fn = "soft_top_k_loss"
  x, mask, keep, pos, dtype = _multi_positive_inputs(scores, positives, temperature, where, fn)
  b, m = x.shape
  kk = _sizes(k, b, x.dtype, fn)
  n = jnp.sum(mask, axis=-1).astype(x.dtype)
  n_pos = jnp.sum(pos, axis=-1)
  active = keep & (n_pos > 0) & (kk < n)
  # Rows that need no threshold get a well-posed stand-in problem (every candidate, k = M/2).
  solve_mask = mask | ~active[:, None]
  solve_k = jnp.where(active, kk, m / 2)
  solve_n = jnp.where(active, n, float(m))
  t = _threshold(x, solve_mask, solve_k, solve_n)
  per_pos = jax.nn.softplus(t[:, None] - x)        # -log sigma(x - t)
  loss = nc.safe_divide(jnp.sum(jnp.where(pos, per_pos, 0.0), axis=-1), n_pos)
  return lc.finish(loss, active, dtype)


def _sizes(k, b, dtype, fn):
  values = concrete(k)  # None when traced: the caller vouches for it
  if values is not None:
    if values.dtype == bool or not np.issubdtype(values.dtype, np.number):
      raise TypeError(f"{fn}: `k` must be a number or an array of numbers, got {values.dtype}")
    if not np.all(np.isfinite(values) & (values > 0)):
      raise ValueError(f"{fn}: `k` must be finite and > 0, got {k!r}")
  k = jnp.asarray(k, dtype)
  if k.ndim > 1 or (k.ndim == 1 and k.shape[0] not in (1, b)):
    raise ValueError(f"{fn}: `k` must be a scalar or [B] = ({b},), got shape {k.shape}")
  return jnp.broadcast_to(k, (b,))


def _threshold(x, mask, k, n):
  """The t of ``sum_{mask} sigmoid(x - t) = k`` per row (0 < k < n = visible count), with
  the implicit-function gradient ``dt/dx_j = sigma'_j / sum sigma'``."""
  xs = jax.lax.stop_gradient(x)

  def excess(t):
    # sum sigmoid(z) - k, as (#{z > 0} - k) + sum_{z <= 0} sigmoid(z) - sum_{z > 0} sigmoid(-z):
    # the counted part is exact and the small tails are not lost beside 1's (float32 keeps
    # sigmoid(23) = 1 - 1e-10 as 1)
    z = xs - t[:, None]
    up = z > 0
    tails = jnp.where(up, -jax.nn.sigmoid(-z), jax.nn.sigmoid(z))
    return (jnp.sum(mask & up, axis=-1) - k) + jnp.sum(jnp.where(mask, tails, 0.0), axis=-1)

  # sigma(z) <= e^z gives count(max + log(n/k)) <= k; sigma(z) >= 1 - e^-z gives
  # count(min - log(n/(n-k))) >= k: the root lies in [lo, hi].
  hi = nc.masked_max(xs, mask, -1)[:, 0] + jnp.log(n / k)
  lo = -nc.masked_max(-xs, mask, -1)[:, 0] - jnp.log(n / (n - k))

  def bisect(_, bracket):
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    above = excess(mid) > 0         # the count falls as t grows: the root is above mid
    return jnp.where(above, mid, lo), jnp.where(above, hi, mid)

  steps = jnp.finfo(x.dtype).nmant + 10   # 33 (float32) / 62 (float64) halvings
  lo, hi = jax.lax.fori_loop(0, steps, bisect, (lo, hi))
  t = 0.5 * (lo + hi)
  z = xs - t[:, None]
  log_slope = -jax.nn.softplus(z) - jax.nn.softplus(-z)     # log sigma'(z)
  lse, _ = lc.masked_logsumexp(log_slope, mask, axis=-1)
  step = excess(t) * jnp.exp(-lse)                           # one Newton step
  half = 0.5 * (hi - lo)
  t = t + jnp.clip(jnp.where(jnp.isfinite(step), step, 0.0), -half, half)
  z = xs - t[:, None]
  log_slope = -jax.nn.softplus(z) - jax.nn.softplus(-z)
  lse, _ = lc.masked_logsumexp(log_slope, mask, axis=-1)
  w = jnp.where(mask, jnp.exp(log_slope - lse[:, None]), 0.0)
  return t + jnp.sum(w * (x - xs), axis=-1)             # value t, gradient w
