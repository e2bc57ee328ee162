"""N16 sparsemax: the Euclidean projection of a score row onto the probability simplex.

The threshold is found without sorting: a Michelot/Newton iteration on the piecewise-linear
``f(tau) = sum_j [x_j - tau]_+ - 1`` from the lower bound ``max(x) - 1``, each step one
fused pass over the row, stopping as soon as the support it holds is self-consistent. The
last tau is computed exactly from that support, so the result is the exact projection.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.normalizers import _common as c
from jaxsoft.normalizers._spec import NormalizerSpec, ThresholdRule, identity_score_map, register

__all__ = ["sparsemax"]


def _to_last(a, axis: int):
  return a if axis == a.ndim - 1 else jnp.moveaxis(a, axis, -1)


def _from_last(a, axis: int):
  return a if axis == a.ndim - 1 else jnp.moveaxis(a, -1, axis)


# Rows are solved in blocks of about this many entries (256 KiB of float32), so the few
# passes each threshold solve makes over a block run from cache instead of memory: about
# 3x less time on CPU than passes over the whole [rows, n] array.
BLOCK_ENTRIES = 1 << 16


def map_row_blocks(fn, ym, *row_args):
  """``fn(ym_block, *row_arg_blocks) -> [rows, 1]`` applied over blocks of rows of ``ym``.

  ``row_args`` broadcast to ``ym.shape[:-1] + (1,)``; padding rows are fully masked
  (``-inf``), which every threshold solver handles.
  """
  lead, n = ym.shape[:-1], ym.shape[-1]
  rows = int(np.prod(lead, dtype=np.int64))
  if rows == 0 or n == 0:
    return jnp.zeros(lead + (1,), ym.dtype)
  per = max(1, min(rows, BLOCK_ENTRIES // max(n, 1)))
  nblocks = -(-rows // per)
  pad = nblocks * per - rows
  shape1 = lead + (1,)
  flat = [ym.reshape(rows, n)] + [jnp.broadcast_to(a, shape1).reshape(rows, 1) for a in row_args]
  fill = [-jnp.inf] + [1.0] * len(row_args)
  blocks = [jnp.pad(a, ((0, pad), (0, 0)), constant_values=v).reshape(nblocks, per, -1)
            for a, v in zip(flat, fill, strict=True)]
  if nblocks == 1:
    out = fn(*[b[0] for b in blocks])[None]
  else:
    out = jax.lax.map(lambda bs: fn(*bs), tuple(blocks))
  return out.reshape(nblocks * per, 1)[:rows].reshape(shape1)


def _decouple(t, s):
  """``t`` made to depend on the reduction ``s`` without changing its value.

  XLA:CPU fuses sibling row reductions of one array into a multi-output loop that it does
  not vectorise (about 5x slower than two separate reductions); a data dependency of the
  second reduction on the first keeps them apart.
  """
  return t + 0.0 * s


def relu_sum_and_count(ym, t):
  """``(sum_j [y_j - t]_+, |{j : y_j > t}|)`` over the last axis, for ``-1 <= t`` and ``y <= 0``.

  With ``y <= 0`` and ``t >= -1`` every ``[y - t]_+`` lies in [0, 1], so ``ceil`` of it is the
  support indicator (a cheaper vector op than a compare-and-select).
  """
  s = jnp.sum(jnp.maximum(ym - t, 0.0), axis=-1, keepdims=True)
  d = jnp.maximum(ym - _decouple(t, s), 0.0)
  return s, jnp.sum(jnp.ceil(jnp.minimum(d, 1.0)), axis=-1, keepdims=True)


def sparsemax_threshold(ym):
  """tau with ``sum_j [y_j - tau]_+ = 1`` over the last axis, for rows with ``max y = 0``.

  ``ym`` holds the visible scores minus their row max and ``-inf`` at masked entries, so
  tau lies in ``[-1, 0)``. Michelot's iteration ``tau <- (sum_{y > tau} y - 1) / |{y > tau}|``
  is Newton's method on the convex, decreasing, piecewise-linear ``f(t) = sum [y - t]_+ - 1``:
  started below the root (at -1, where the max entry alone gives ``f >= 0``) it increases
  monotonically and only drops entries outside the final support. When a pass finds the
  same support as the one before, tau is exactly ``(sum_S y - 1) / |S|`` of that support.
  Most rows settle in 3-6 passes; the loop runs until every row has (at most n + 2 passes,
  Michelot's worst case).

  Returns:
    tau of shape ``ym.shape[:-1] + (1,)`` (-1 for rows with no visible entry).
  """
  shape = ym.shape[:-1] + (1,)
  n_max = ym.shape[-1] + 2

  def cond(state):
    i, _, _, done = state
    return jnp.logical_and(i < n_max, ~jnp.all(done))

  def body(state):
    i, t, cnt_prev, done = state
    tot, cnt = relu_sum_and_count(ym, t)
    now_done = cnt == cnt_prev  # same support twice: t is already (sum_S y - 1) / |S|
    # Monotone by construction (rounding could otherwise step back and loop).
    t_new = jnp.maximum(t, t + (tot - 1.0) / jnp.maximum(cnt, 1.0))
    done = jnp.logical_or(done, now_done)
    return i + 1, jnp.where(done, t, t_new), cnt, done

  state = (jnp.asarray(0), jnp.full(shape, -1.0, ym.dtype), jnp.full(shape, -1.0, ym.dtype),
           jnp.zeros(shape, bool))
  return jax.lax.while_loop(cond, body, state)[1]


@jax.custom_jvp
def _sparsemax_last(x, mask):
  """sparsemax over the last axis of float32/64 ``x`` (masked entries hold 0)."""
  ym = jnp.where(mask, x - c.masked_max(x, mask, -1), -jnp.inf)
  return jnp.maximum(ym - map_row_blocks(sparsemax_threshold, ym), 0.0)


@_sparsemax_last.defjvp
def _sparsemax_last_jvp(primals, tangents):
  # J = diag(s) - s s^T / |S|, s the support indicator (Martins & Astudillo 2016, eq. 12).
  x, mask = primals
  x_dot, _ = tangents
  p = _sparsemax_last(x, mask)
  s = (p > 0).astype(p.dtype)
  sv = s * x_dot
  size = jnp.sum(s, axis=-1, keepdims=True)
  return p, sv - s * c.safe_divide(jnp.sum(sv, axis=-1, keepdims=True), size)


@functools.partial(jax.jit, static_argnames=("axis",))
def sparsemax(x, axis: int = -1, where=None):
  r"""Sparsemax (CATALOGUE N16, kernel class T; Martins & Astudillo, ICML 2016).

  .. math::
    \mathrm{sparsemax}(x) = \operatorname*{argmin}_{p \in \Delta} \|p - x\|_2^2
      = [x - \tau(x)]_+, \qquad \sum_{j \in V} [x_j - \tau]_+ = 1

  over the visible entries V of the row. tau is found without a sort (Michelot/Newton
  passes from ``max(x) - 1``, see :func:`sparsemax_threshold`) and is exact: the
  ``(sum_S x - 1) / |S|`` of the support S found. Shift invariant, not scale invariant;
  exact zeros wherever ``x_j <= tau``. The Jacobian is the closed form
  ``J v = s * v - s * (sum(s * v) / |S|)``, s the support indicator (a ``custom_jvp``).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype (computed in float32 for low-precision inputs); a
    row with no visible entry is all zeros, with zero gradient.

  Example:
    >>> sparsemax(jnp.array([1.0, 0.5, -1.0]))  # -> [0.75, 0.25, 0.]
  """
  xs, mask, axis = c.prepare(x, axis, where, "sparsemax")
  p = _from_last(_sparsemax_last(_to_last(xs, axis), _to_last(mask, axis)), axis)
  return c.finish(p, mask, jnp.asarray(x).dtype)


# --- the class-T rule (DESIGN.md §3): mass = weight = [z - tau]_+, target 1. -------------



def _relu_mass(z, tau, *_, **__):
  return jnp.maximum(z - tau, 0.0)


def _unit_target(length, **_):
  return jnp.ones_like(length)


def _sparsemax_bracket(m, length, **_):
  # f(m - 1) >= 1 from the max entry alone; f(m) = 0.
  return m - 1.0, m


SPARSEMAX_RULE = ThresholdRule(
    score_map=identity_score_map,
    mass=_relu_mass,
    target=_unit_target,
    bracket=_sparsemax_bracket,
    weight=_relu_mass,
    iterations=30,
)

SPEC = register(NormalizerSpec(
    name="sparsemax",
    fn=sparsemax,
    kernel_class="T",
    catalogue_id="N16",
    shift_invariant=True,
    can_be_sparse=True,
    smooth=False,
    threshold=SPARSEMAX_RULE,
    description="[x - tau]_+, Euclidean projection onto the simplex",
))
