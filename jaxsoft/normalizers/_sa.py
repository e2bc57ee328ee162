"""N25 SA-Softmax (self-adjusting softmax): the scores times their softmax weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import _row_stats
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import row_blocks as blocks
from jaxsoft.normalizers.spec import (
    NormalizerSpec,
    TileRule,
    exp_numerator,
    identity_score_map,
    register,
)

__all__ = ["sa_softmax", "sa_softmax_normalized"]


def _inf_limit(posinf, axis, hparams, visible=None):
  """``x_i softmax(x)_i`` as the k visible ``+inf`` logits grow together: ``+inf`` on them
  (``x/k``), 0 on every other entry (a finite score times a weight that tends to 0)."""
  del axis, hparams
  return jnp.where(posinf, jnp.inf, 0.0)


@c.dense_rules(inf_limit=_inf_limit)
def sa_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""SA-Softmax, self-adjusting softmax (feature N25, kernel class E; C. Zheng et al. 2025).

  From "Self-Adjust Softmax" (C. Zheng et al., 2025):

  .. math::
    \mathrm{SA}(x)_i = x_i \cdot \mathrm{softmax}(x)_i

  over the visible entries. Meant to keep attention's gradient alive when softmax
  saturates: ``d(x_i p_i)/dx_j = delta_ij p_i + x_i p_i (delta_ij - p_j)``, whose diagonal
  tends to 1 (not to 0 as softmax's ``p_i (1 - p_i)``) as ``p_i -> 1``. Weights can be
  negative (negative scores), rows do not sum to 1, ``SA(0) = 0``, not shift invariant.
  See :func:`sa_softmax_normalized` for the non-negative variant. ``+inf`` logits: the
  limit, ``+inf`` on each visible ``+inf`` entry and 0 on the others.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros with zero
    gradient.

  Tile rule: numerator ``z e^{z - m}``, denominator ``e^{z - m}`` (class E: both rescale
  by ``e^{m - m'}`` with the running max).

  Examples:
    >>> js.normalizers.sa_softmax(jnp.array([2.0, 1.0, 0.0, -1.0]))
    Array([ 1.2878,  0.2369,  0.    , -0.0321], dtype=float32)

  References:
    C. Zheng et al., 2025, "Self-Adjust Softmax".
  """
  xs, mask, ax = c.prepare(x, axis, where, "sa_softmax")
  w = xs * c.exp_normalize(xs, mask, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)


@c.dense_rules
def sa_softmax_normalized(x: ArrayLike, axis: int = -1,
                          where: ArrayLike | None = None) -> jax.Array:
  r"""SA-Softmax, the normalised-score variant (feature N25, kernel class R; C. Zheng et al. 2025).

  From "Self-Adjust Softmax" (C. Zheng et al., 2025):

  .. math::
    \mathrm{SA}_n(x)_i = \frac{x_i - \min(x_{\min}, 0)}{\max(x_{\max}, 0) - \min(x_{\min}, 0)}
    \cdot \mathrm{softmax}(x)_i

  with ``x_min``, ``x_max`` over the visible entries. The factor lies in [0, 1], so
  ``0 <= SA_n <= softmax`` elementwise and rows sum to at most 1; the entry at
  ``x_min`` gets an exact 0 when ``x_min <= 0``. A row of zeros (0/0 in the factor) gives
  zeros (the paper adds an epsilon there). Not shift invariant. Differentiable away from
  ties of the row's min or max (the gradient of ``min``/``max`` goes to its argument).

  Kernel class R: the factor needs the row's min and max (and softmax's (m, l)) before any
  weight: blockwise attention (``xla_chunked``, ``pallas``) runs a statistics pass over the
  key blocks, then a pointwise pass.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      enter neither the min nor the max.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros with zero
    gradient.

  Examples:
    >>> js.normalizers.sa_softmax_normalized(jnp.array([2.0, 1.0, 0.0, -1.0]))
    Array([0.6439, 0.1579, 0.029 , 0.    ], dtype=float32)

  References:
    C. Zheng et al., 2025, "Self-Adjust Softmax".
  """
  xs, mask, ax = c.prepare(x, axis, where, "sa_softmax_normalized")
  # min and max with their gradients (masked_max carries none: it is a stabiliser there)
  hi = jnp.maximum(jnp.max(jnp.where(mask, xs, -jnp.inf), axis=ax, keepdims=True), 0.0)
  lo = jnp.minimum(jnp.min(jnp.where(mask, xs, jnp.inf), axis=ax, keepdims=True), 0.0)
  # (a fully masked row: hi = lo = 0 and the factor's 0/0 is 0)
  factor = _range_fraction(xs, hi, lo)
  p = c.exp_normalize(xs, mask, ax)
  return c.finish(factor * p, mask, jnp.asarray(x).dtype)


def _sa_numerator(z, m, **_):
  return z * jnp.exp(z - m)


SPEC = register(NormalizerSpec(
    name="sa_softmax",
    fn=sa_softmax,
    kernel_class="E",
    catalogue_id="N25",
    sums_to_one=False,
    at_most_one=False,
    nonnegative=False,
    shift_invariant=False,
    can_be_sparse=True,
    tile=TileRule(score_map=identity_score_map, numerator=_sa_numerator,
                  denominator=exp_numerator),
    description="x * softmax(x)",
))

def _range_fraction(z, hi, lo):
  """``(z - lo) / (hi - lo)`` (0 where hi = lo), numerator and denominator first scaled by a
  power of two bringing ``hi - lo`` near 1 (exact): the quotient's derivative squares the
  denominator, which underflows to 0 for a row of size ~1e-20 (float32), a NaN gradient."""
  t = _row_stats._pow2_inverse(jax.lax.stop_gradient(hi - lo))
  return c.safe_divide((z - lo) * t, (hi - lo) * t)


def _normalized_derive(stats, length, **_):
  m, l, hi, _, lo, _ = stats
  return {**blocks.softmax_derived(m, l), "hi": jnp.maximum(hi, 0.0), "lo": jnp.minimum(lo, 0.0)}


def _normalized_numerator(z, m, row_max=0.0, row_sum=1.0, hi=0.0, lo=0.0, **_):
  return _range_fraction(z, hi, lo) * blocks.softmax_of(z, row_max, row_sum)


# blockwise: softmax's (m, l) and the row's extremes first, then a pointwise (class-P) pass
NORMALIZED_ROW_RULE = blocks.row_stats_rule(
    (blocks.SOFTMAX, blocks.EXTREMES), _normalized_derive,
    TileRule(score_map=identity_score_map, numerator=_normalized_numerator, kernel_class="P"))

SPEC_NORMALIZED = register(NormalizerSpec(
    name="sa_softmax_normalized",
    fn=sa_softmax_normalized,
    kernel_class="R",
    catalogue_id="N25",
    sums_to_one=False,
    shift_invariant=False,
    can_be_sparse=True,
    row_stats=NORMALIZED_ROW_RULE,
    description="(x - min(x_min, 0)) / (max(x_max, 0) - min(x_min, 0)) * softmax(x)",
))
