"""N29 spherical softmax: ``(x_i^2 + eps) / sum_j (x_j^2 + eps)``, a map + row sum (class S)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["spherical_softmax"]

_EPS = Param("eps", 0.01, low=0.0, low_open=True, sample=0.5, row_broadcast=True)


def _square_plus(z, m, eps=0.01, **_):
  return z * z + eps


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
  carries only the row sum (class S). Finite while ``x^2`` fits the float range
  (``|x| < 1.8e19`` in float32).

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
  w = c.sum_normalize(_square_plus(xs, None, **hp), mask, ax)
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
