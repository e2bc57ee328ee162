"""MIDAM's variance-reduced stochastic smoothed-max pooling: a per-bag moving average of
the inner mean, as an optax-style init/update pair of pure functions (feature L17)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive, concrete, positive_int
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["MidamPoolState", "midam_pool_init", "midam_pool_update"]


class MidamPoolState(NamedTuple):
  """The moving averages of :func:`midam_pool_update`: ``log_u [B]`` (the log of each bag's
  estimate :math:`u_X` of :math:`\\mathrm{mean}_{x \\in X} e^{h(x)/\\tau}`) and ``seen [B]``
  (whether the bag has been sampled yet).

  Examples:
    >>> js.losses.midam_pool_init(2)
    MidamPoolState(log_u=Array([0., 0.], dtype=float32), seen=Array([False, False], dtype=bool))
  """

  log_u: jax.Array
  seen: jax.Array


def midam_pool_init(num_bags: int, dtype: jnp.dtype = jnp.float32) -> MidamPoolState:
  """The empty state of MIDAM's moving-average pooling estimator for ``num_bags`` bags (L17).

  Args:
    num_bags: B >= 1, the number of bags in the data set (bags are named by their index).
    dtype: the floating dtype of the estimates (float32 for bf16/fp16).

  Returns:
    A :class:`MidamPoolState` with no bag seen.

  Examples:
    >>> js.losses.midam_pool_init(3).seen
    Array([False, False, False], dtype=bool)

  References:
    D. Zhu, B. Wang, Z. Chen, Y. Wang, M. Sonka, X. Wu & T. Yang, 2023, "Provable
    Multi-instance Deep AUC Maximization with Stochastic Pooling" (ICML).
  """
  b = positive_int(num_bags, "num_bags", "midam_pool_init")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"midam_pool_init: `dtype` must be a floating dtype, got {dtype}")
  dt = nc.compute_dtype(jnp.dtype(dtype))
  return MidamPoolState(jnp.zeros((b,), dt), jnp.zeros((b,), bool))


def midam_pool_update(state: MidamPoolState, instance_scores: ArrayLike, bag_ids: ArrayLike,
                      *, temperature: float = 1.0, gamma: float = 0.9,
                      where: ArrayLike | None = None) -> tuple[jax.Array, MidamPoolState]:
  r"""MIDAM's stochastic smoothed-max pooling with a moving-average estimator (feature L17).

  From D. Zhu, B. Wang, Z. Chen, Y. Wang, M. Sonka, X. Wu & T. Yang, "Provable
  Multi-instance Deep AUC Maximization with Stochastic Pooling" (ICML 2023). The smoothed
  max :math:`s(X) = \tau\log\mathrm{mean}_{x\in X} e^{h(x)/\tau}` of a bag too large for one
  batch is estimated from a few sampled instances :math:`B_X` per step: each bag keeps

  .. math::
    u_X \leftarrow (1-\gamma)\,u_X + \gamma\,\frac{1}{|B_X|}\sum_{x\in B_X} e^{h(x)/\tau},
    \qquad \hat s(X) = \tau \log u_X,

  and the gradient of a loss :math:`f(\hat s)` is the paper's variance-reduced estimator
  :math:`f'(\hat s)\,\frac{\tau}{u_X}\,\nabla\frac{1}{|B_X|}\sum_{x\in B_X} e^{h(x)/\tau}`
  (the returned ``pooled`` has the value :math:`\hat s` and this gradient). For fixed
  scores u tracks the exact mean (its error shrinks by :math:`1-\gamma` a step with
  whole bags, and it averages the sampling noise otherwise). Kept in the log domain (no
  overflow for large :math:`h/\tau`). [R] A bag's first update sets :math:`u_X` to its
  batch mean (the paper's zero start would bias :math:`\tau\log u` by :math:`\tau\log\gamma`).
  ``pooled`` feeds the AUC loss as single-instance bags:
  ``midam_auc_loss(pooled[:, None], labels, temperature=tau)`` (pooling one value is the
  identity, with gradient 1).

  Args:
    state: the :class:`MidamPoolState` from :func:`midam_pool_init` or the last update.
    instance_scores: ``[b, k]`` scores h of k sampled instances for each of b bags.
    bag_ids: ``int [b]`` the bags' indices into the state, distinct within a batch.
    temperature: τ > 0, a scalar (keep it fixed along a run: u estimates a mean of
      :math:`e^{h/\tau}`).
    gamma: the moving-average rate γ in (0, 1] (1: no averaging, plain stochastic pooling).
    where: optional ``[b, k]`` instance mask, or a ``[b]`` bag mask: a row with no visible
      instance leaves its bag's state unchanged and gets ``pooled`` 0 with zero gradient.

  Returns:
    ``(pooled [b], new_state)``: :math:`\hat s` in ``instance_scores``' dtype and the updated
    state. The arithmetic runs in the state's dtype (float32 by default: pass
    ``dtype=jnp.float64`` to :func:`midam_pool_init` for float64 under x64), so that the state
    keeps one dtype along a ``lax.scan``.

  Examples:
    >>> state = js.losses.midam_pool_init(2)
    >>> h = jnp.array([[1.0, 0.0], [0.0, 0.0]])
    >>> pooled, state = js.losses.midam_pool_update(state, h, jnp.array([0, 1]), gamma=0.5)
    >>> pooled  # the first visit: log mean exp of the sampled instances
    Array([0.6201, 0.    ], dtype=float32)
    >>> pooled, state = js.losses.midam_pool_update(state, h + 2.0, jnp.array([0, 1]), gamma=0.5)
    >>> pooled  # log((e^0.62 + e^2.62) / 2) = 0.62 + log((1 + e^2) / 2)
    Array([2.0539, 1.4338], dtype=float32)

  References:
    D. Zhu, B. Wang, Z. Chen, Y. Wang, M. Sonka, X. Wu & T. Yang, 2023, "Provable
    Multi-instance Deep AUC Maximization with Stochastic Pooling" (ICML).
  """
  fn = "midam_pool_update"
  if not isinstance(state, MidamPoolState):
    raise ValueError(f"{fn}: `state` must be a MidamPoolState (from midam_pool_init), got "
                     f"{type(state).__name__}")
  h = lc.float_input(instance_scores, "instance_scores", fn)
  if h.ndim != 2:
    raise ValueError(f"{fn}: `instance_scores` must be floating [b, k], got {h.shape} {h.dtype}")
  ids = jnp.asarray(bag_ids)
  n_bags = state.log_u.shape[0]
  if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape != h.shape[:1]:
    raise ValueError(f"{fn}: `bag_ids` must be an int array of shape {h.shape[:1]}, got "
                     f"{ids.shape} {ids.dtype}")
  known = concrete(ids)
  if known is not None and known.size and (known.min() < 0 or known.max() >= n_bags
                                           or np.unique(known).size != known.size):
    raise ValueError(f"{fn}: `bag_ids` must be distinct ids in [0, {n_bags})")
  check_positive(temperature, "temperature", fn)
  if jnp.ndim(temperature) != 0:
    raise ValueError(f"{fn}: `temperature` must be a scalar, got shape {jnp.shape(temperature)}")
  g = lc.nonnegative_float(gamma, "gamma", fn)
  if not 0.0 < g <= 1.0:
    raise ValueError(f"{fn}: `gamma` must be in (0, 1], got {gamma!r}")
  dt = state.log_u.dtype
  hc = h.astype(dt)
  if where is None:
    inst = jnp.ones(h.shape, bool)
  else:
    wh = jnp.asarray(where, bool)
    if wh.shape == h.shape[:1]:
      wh = wh[:, None]
    try:
      inst = jnp.broadcast_to(lc.at_rank(wh, 2), h.shape)
    except ValueError:
      raise ValueError(f"{fn}: `where` of shape {wh.shape} must be [b, k] = {h.shape} or "
                       f"[b]") from None
  keep = jnp.any(inst, axis=-1)
  tau = jnp.asarray(temperature, dt)
  # log of the batch mean of e^{h/tau}, 0 (safe) for an empty row
  z = jnp.where(inst, hc / tau, 0.0)
  lm, _ = lc.masked_logsumexp(z, inst, -1)
  lm = lm - jnp.log(jnp.maximum(jnp.sum(inst, -1), 1).astype(dt))
  safe = jnp.where((ids >= 0) & (ids < n_bags), ids, 0)
  old = jax.lax.stop_gradient(state.log_u[safe])
  seen = state.seen[safe]
  moved = jnp.logaddexp(np.log1p(-g) + old, np.log(g) + lm) if g < 1.0 else lm
  new = jnp.where(seen, moved, lm)
  new_sg = jax.lax.stop_gradient(new)
  # value tau log u; gradient tau (m / u) grad(log m) = (tau / u) grad(m)
  ratio = jnp.exp(lm - new_sg)
  pooled = tau * (new_sg + ratio - jax.lax.stop_gradient(ratio))
  pooled = jnp.where(keep, pooled, 0.0)
  log_u = state.log_u.at[safe].set(jnp.where(keep, new_sg, old))
  seen_new = state.seen.at[safe].set(seen | keep)
  return pooled.astype(h.dtype), MidamPoolState(log_u, seen_new)
