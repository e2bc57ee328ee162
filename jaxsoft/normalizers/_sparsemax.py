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
from jax.typing import ArrayLike

from jaxsoft.normalizers import _common as c
from jaxsoft.normalizers._spec import NormalizerSpec, ThresholdRule, identity_score_map, register

__all__ = ["sparsemax"]


def relu_sum_and_count(ym, t):
  """``(sum_j [y_j - t]_+, |{j : y_j > t}|)`` over the last axis, for ``-1 <= t`` and ``y <= 0``.

  With ``y <= 0`` and ``t >= -1`` every ``[y - t]_+`` lies in [0, 1], so ``ceil`` of it is the
  support indicator (a cheaper vector op than a compare-and-select).
  """
  s = jnp.sum(jnp.maximum(ym - t, 0.0), axis=-1, keepdims=True)
  d = jnp.maximum(ym - c.decouple(t, s), 0.0)
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
  def step(t, cnt_prev):
    tot, cnt = relu_sum_and_count(ym, t)
    now_done = cnt == cnt_prev  # same support twice: t is already (sum_S y - 1) / |S|
    # Monotone by construction (rounding could otherwise step back and loop).
    t_new = jnp.maximum(t, t + c.safe_divide(tot - 1.0, cnt))
    return (jnp.where(now_done, t, t_new), cnt), now_done

  minus_one = jnp.full(ym.shape[:-1] + (1,), -1.0, ym.dtype)
  return c.passes_until_done(step, (minus_one, minus_one), ym.shape[-1] + 2)[0]


@jax.custom_jvp
def _sparsemax_last(x, mask):
  """sparsemax over the last axis of float32/64 ``x`` (masked entries hold 0)."""
  ym = jnp.where(mask, x - c.masked_max(x, mask, -1), -jnp.inf)
  return jnp.maximum(ym - c.map_row_blocks(sparsemax_threshold, ym), 0.0)


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
@c.dense_rules
def sparsemax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""Sparsemax (feature N16, kernel class T; A. F. T. Martins & R. F. Astudillo 2016).

  From "From Softmax to Sparsemax: A Sparse Model of Attention and Multi-Label
  Classification" (Martins & Astudillo, ICML 2016, arXiv 1602.02068):

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
    >>> import jax.numpy as jnp
    >>> import jaxsoft as js
    >>> jnp.set_printoptions(precision=4)
    >>> js.normalizers.sparsemax(jnp.array([1.0, 0.8, 0.1, -1.0]))  # tau = 0.4
    Array([0.6, 0.4, 0. , 0. ], dtype=float32)
    >>> js.normalizers.sparsemax(jnp.array([5.0, 4.0, 0.5, -5.0]))  # larger gaps: smaller support
    Array([1., 0., 0., 0.], dtype=float32)
  """
  return c.along_axis(_sparsemax_last, x, axis, where, "sparsemax")


# --- the class-T rule (a ThresholdRule): mass = weight = [z - tau]_+, target 1. ----------



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
