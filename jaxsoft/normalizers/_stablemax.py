"""N19 StableMax: a rational replacement for exp that cannot overflow or collapse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, TileRule, identity_score_map, register

__all__ = ["stablemax", "stablemax_map"]


def stablemax_map(x: ArrayLike) -> jax.Array:
  r"""The positive map ``s(x) = x + 1`` for ``x >= 0`` and ``1 / (1 - x)`` for ``x < 0``.

  ``s > 0``, increasing, C^1 at 0 (``s(0) = s'(0) = 1``); linear growth instead of exp.
  The ``1/(1 - x)`` branch only ever sees x <= 0, so it produces no inf (or NaN
  gradient) at x = 1.

  Examples:
    >>> js.normalizers.stablemax_map(jnp.array([2.0, 0.0, -2.0]))
    Array([3.    , 1.    , 0.3333], dtype=float32)

  References:
    L. Prieto, M. Barsbey, P. A. M. Mediano & T. Birdal, 2025, "Grokking at the Edge of
    Numerical Stability".
  """
  x = jnp.asarray(x)
  # where, not minimum: jnp.minimum splits the gradient 1/2-1/2 at a tie (x = 0). A NaN
  # takes the second branch and stays NaN (`x < 0` would map it to s = 1, a finite weight).
  neg = jnp.where(x >= 0, 0.0, x)
  return jnp.where(x >= 0, x + 1.0, 1.0 / (1.0 - neg))


@c.dense_rules
def stablemax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""StableMax (feature N19, kernel class S; L. Prieto et al., ICLR 2025).

  From "Grokking at the Edge of Numerical Stability" (L. Prieto, M. Barsbey,
  P. A. M. Mediano & T. Birdal, ICLR 2025, arXiv 2501.04697):

  .. math::
    \mathrm{StableMax}(x)_i = \frac{s(x_i)}{\sum_{j \in V} s(x_j)},\qquad
    s(x) = \begin{cases} x + 1 & x \ge 0 \\ \frac{1}{1 - x} & x < 0 \end{cases}

  over the visible entries V. Ratios grow polynomially in the logit gap, so the float32
  "softmax collapse" (loss exactly 0, vanishing gradient) does not happen. Not shift
  invariant. No max is needed (class S): s(x) is at most ``x + 1``; only scores near
  float32's max (~3e38) overflow the row sum.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1 (f32 compute for low precision); a
    row with no visible entry is all zeros with zero gradient.

  Examples:
    >>> js.normalizers.stablemax(jnp.array([2.0, 0.0, -2.0]))
    Array([0.6923, 0.2308, 0.0769], dtype=float32)
    >>> x = jnp.array([120.0, 0.0, 0.0])
    >>> js.normalizers.softmax(x)  # float32: the small weights underflow to exactly 0
    Array([1., 0., 0.], dtype=float32)
    >>> js.normalizers.stablemax(x)  # polynomial, not exponential, in the gap
    Array([0.9837, 0.0081, 0.0081], dtype=float32)

  References:
    L. Prieto, M. Barsbey, P. A. M. Mediano & T. Birdal, 2025, "Grokking at the Edge of
    Numerical Stability".
  """
  xs, mask, ax = c.prepare(x, axis, where, "stablemax")
  w = c.sum_normalize(stablemax_map(xs), mask, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)



def _stablemax_tile(z, m, **_):
  return stablemax_map(z)


SPEC = register(NormalizerSpec(
    name="stablemax",
    fn=stablemax,
    kernel_class="S",
    catalogue_id="N19",
    shift_invariant=False,
    tile=TileRule(score_map=identity_score_map, numerator=_stablemax_tile,
                  denominator=_stablemax_tile),
    description="s(x)/sum s(x), s(x) = x+1 (x>=0), 1/(1-x) (x<0)",
))
