"""N29 spherical softmax: ``(x_i^2 + eps) / sum_j (x_j^2 + eps)``, a map + row sum (class S)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import _row_stats
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import row_blocks as blocks
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["spherical_softmax"]

_EPS = Param("eps", 0.01, low=0.0, low_open=True, sample=0.5, row_broadcast=True)


def _tile_scale(eps, dtype):
  """The tile rule's fixed power of two ``s`` (no gradient), ``eps s^2`` in [2^-62, 2^-60)
  (s kept within [2^-60, 1]): the squares of large scores come 2^-2k lower (default eps:
  k = 27, the row sum overflows float32 past |x| ~ 2.4e27 / sqrt(n) instead of 1.8e19 /
  sqrt(n)), while the smallest term, and so the row sum D, stays at least 2^-62, whose
  square (in autodiff's derivative of a quotient by D) is still a normal float. A power of
  two (exact): every term rounds as unscaled, and the factor cancels in the ratio."""
  r = jax.lax.stop_gradient(jnp.sqrt(jnp.asarray(eps, dtype)))
  return jnp.clip(blocks.pow2_scale(r) * 2.0 ** -30, 2.0 ** -60, 1.0)


def _square_plus(z, m, eps=0.01, **_):
  """``s^2 (z^2 + eps)``, s = :func:`_tile_scale` (the tile rule's numerator and denominator)."""
  s = _tile_scale(eps, z.dtype)
  y = z * s
  return y * y + (eps * s) * s


def pow2_row_scale(r, exponent: int = 2):
  """``t = 2^-k``, the smallest such power of two (k >= 0) with ``|r| t < 2^exponent``.

  A row scaled by it keeps every rounding of an unscaled evaluation (a product or sum
  of values scaled by powers of two is rounded as the unscaled one, until it falls below
  the smallest normal float), while the largest entry is brought under ``2^exponent``:
  so a homogeneous (or power-of-two-scalable) formula no longer overflows. ``r`` is the
  row's largest magnitude (without gradient); rows already below ``2^exponent`` get
  ``t = 1`` exactly. ``k <= 128 - exponent`` keeps ``t`` a normal float for
  ``exponent >= 2``.
  """
  _, e = jnp.frexp(r)  # r < 2^e
  return jnp.ldexp(jnp.ones_like(r), -jnp.maximum(e - exponent, 0))


@c.dense_rules
def spherical_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                      eps: ArrayLike = 0.01) -> jax.Array:
  r"""Spherical softmax (feature N29, kernel class S; de Brébisson & Vincent 2016).

  A member of the spherical family studied in "An Exploration of Softmax Alternatives
  Belonging to the Spherical Loss Family" (A. de Brébisson & P. Vincent, ICLR 2016,
  arXiv 1511.05042):

  .. math::
    w_i = \frac{x_i^2 + \epsilon}{\sum_{j \in V} (x_j^2 + \epsilon)}

  over the visible entries V. Depends on the scores only through their squares, so it is
  even in each score (``x`` and ``-x`` weigh the same), not shift invariant, and its
  weights decay polynomially, not exponentially, in the score gap. ``eps > 0`` keeps an
  all-zero row uniform and every weight positive. No max is needed: a blockwise pass
  carries only the row sum (class S). The function scales each row by a power of two
  before squaring (exact: the ratio is homogeneous), so it is finite for any finite
  scores. The blockwise form (its tile rule, used by the chunked and Pallas attention
  paths) carries no row statistic (class S), so it scales by a fixed power of two chosen
  from eps (exact: the same roundings): the row sum must fit the float range, so in
  float32 with the default eps it is finite for ``|x| < 2.4e27 / sqrt(n)`` (n the row
  length; unscaled squares stopped at 1.8e19 / sqrt(n)); past that the row's weights are
  NaN (one square overflows) or 0 (only the sum does). For eps below ~1e-18 the scale is
  1, and a row whose every ``x^2 + eps`` is below ~1e-38 has a row sum that underflows
  (zero weights) where the function itself is exact.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    eps: ``eps > 0`` (default 0.01, a choice of this library); a scalar or an array
      broadcast to the rows; differentiable.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1; a row with no visible entry is all
    zeros with zero gradient.

  Examples:
    >>> js.normalizers.spherical_softmax(jnp.array([2.0, -2.0, 1.0, 0.0]))
    Array([0.4436, 0.4436, 0.1117, 0.0011], dtype=float32)

  References:
    A. de Brébisson & P. Vincent, 2016, "An Exploration of Softmax Alternatives Belonging
    to the Spherical Loss Family".
  """
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "spherical_softmax", (_EPS, eps))
  # Homogeneous: (x^2 + eps) / sum = ((t x)^2 + eps t^2) / sum, with t a power of two
  # that brings max(|x|, sqrt eps) into [1/2, 1) (exact): x^2 overflows from |x| ~ 1.8e19
  # in float32, and a row sum of ~1e-30 (tiny x, eps = 1e-30) has a square that underflows
  # to 0 in the quotient's derivative (a NaN gradient). xs holds visible values at masked
  # entries, so its row max |x| is the visible one.
  eps_row = hp["eps"]
  big = jnp.maximum(jnp.max(jnp.abs(xs), axis=ax, keepdims=True), jnp.sqrt(eps_row))
  t = _row_stats._pow2_inverse(jax.lax.stop_gradient(big))
  y = xs * t
  w = c.sum_normalize(y * y + (eps_row * t) * t, mask, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="spherical_softmax",
    fn=spherical_softmax,
    kernel_class="S",
    catalogue_id="N29",
    shift_invariant=False,
    params=(_EPS,),
    tile=TileRule(score_map=identity_score_map, numerator=_square_plus,
                  denominator=_square_plus),
    description="(x^2 + eps) / sum (x^2 + eps)",
))
