"""N24 Taylor softmax: exp replaced by its even-order Taylor polynomial."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import _spherical
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["taylor_softmax", "taylor_exp"]

_ORDER = Param("order", 2, low=2, sample=4, static=True)


def _check_order(order, fn_name: str) -> int:
  """order must be a concrete even int >= 2; ValueError naming `order` otherwise."""
  if isinstance(order, (bool, np.bool_)) or not isinstance(order, (int, np.integer)):
    raise ValueError(f"{fn_name}: `order` must be a Python int (a static even order >= 2), "
                     f"got {order!r}")
  _ORDER.validate(order, fn_name)
  if order % 2:
    raise ValueError(
        f"{fn_name}: `order` must be even (odd truncations of exp take negative values, so "
        f"the weights could be negative), got {order}")
  return int(order)


def taylor_exp(x: ArrayLike, order: int = 2) -> jax.Array:
  r"""The order-m Taylor polynomial of exp, ``sum_{k=0}^{m} x^k / k!`` (Horner form).

  For even m it is strictly positive on the reals (its minimum, at the real root of the
  order-(m-1) polynomial, equals ``x^m / m! > 0``).

  Examples:
    >>> js.normalizers.taylor_exp(jnp.array([-1.0, 0.0, 1.0]))  # 1 + x + x^2/2
    Array([0.5, 1. , 2.5], dtype=float32)

  References:
    Those of :func:`taylor_softmax`.
  """
  order = _check_order(order, "taylor_exp")
  acc = jnp.ones_like(x)
  # Horner: 1 + x(1 + x/2(1 + x/3(... (1 + x/m)))).
  for k in range(order, 0, -1):
    acc = 1.0 + acc * x / k
  return acc


def _scaled_taylor_exp(x, order: int, t):
  """``taylor_exp(x, order) t^order`` for a power of two ``t`` (per row).

  taylor_exp's Horner steps on ``y = t x``: its partial values ``acc_k`` (``acc_m = 1``,
  ``acc_{k-1} = 1 + acc_k x / k``) times ``t^{m-k}`` obey ``b_{k-1} = t^{m-k+1} + b_k y /
  k``, so each step is taylor_exp's own times a power of two and rounds the same (until
  a term falls below the smallest normal float, far below the row's largest); ``t = 1``
  is taylor_exp itself.
  """
  y = x * t
  acc = jnp.ones_like(y)
  tj = jnp.ones_like(t)
  for k in range(order, 0, -1):
    tj = tj * t
    acc = tj + acc * y / k
  return acc


def _scale_exponent(order: int) -> int:
  """log2 of the bound the row's largest |x| is scaled under: about ``order / e``, where
  ``|x|^m / m!`` is near 1; at least 2 (``|t x| < 4``, the bound for m <= 8)."""
  return max(2, math.floor(math.log2(max(order / math.e, 2.0))) + 1)


@c.dense_rules
def taylor_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                   order: int = 2) -> jax.Array:
  r"""Taylor softmax (feature N24, kernel class S; de Brébisson & Vincent 2016; TaylorShift).

  .. math::
    \mathrm{TSM}_m(x)_i = \frac{\sum_{k=0}^{m} x_i^k / k!}{\sum_{j \in V} \sum_{k=0}^{m} x_j^k / k!},
    \qquad m = 2:\ \frac{1 + x_i + x_i^2/2}{\sum_j (1 + x_j + x_j^2/2)}

  over the visible entries V. Only even orders m are allowed: even truncations of exp are
  strictly positive (``1 + x + x^2/2 >= 1/2``), odd ones are not. Growth is polynomial, so
  no max is needed (class S). For a row with large scores the function evaluates
  ``t^m sum_k x^k / k!`` (t a power of two bringing the row's largest |x| near m / e:
  the same roundings, and a factor that cancels), so it is finite for any finite
  scores. The blockwise form (its tile rule, used by the chunked and Pallas attention
  paths) has no row statistic (class S), so it scales by a fixed power of two ``2^-(48 //
  m)`` (exact: the same roundings): the row sum must fit the float range, so in float32
  it is finite for ``|x| < 4e26 / sqrt(n)`` at m = 2 (n the row length; unscaled: 2.6e19
  / sqrt(n)); past that the row's weights are NaN (one term overflows) or 0 (only the sum
  does). Not shift invariant; as m grows it tends to softmax for moderate x.

  The order-2 form is from A. de Brébisson & P. Vincent 2016, "An Exploration of Softmax
  Alternatives Belonging to the Spherical Loss Family" (ICLR 2016, arXiv 1511.05042); as
  attention it is TaylorShift (T. C. Nauen et al. 2024, "TaylorShift: Shifting the
  Complexity of Self-Attention from Squared to Linear (and Back) using Taylor-Softmax",
  arXiv 2403.02920), which evaluates it in linear time.

  Args:
    x: scores.
    order: the even truncation order m >= 2 (a static Python int).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1 (f32 compute); a fully masked row is
    all zeros with zero gradient.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0, -1.0])
    >>> js.normalizers.taylor_softmax(x)  # (1 + x + x^2/2) / sum: 5, 2.5, 1, 0.5 over 9
    Array([0.5556, 0.2778, 0.1111, 0.0556], dtype=float32)
    >>> js.normalizers.taylor_softmax(x, order=4)  # closer to softmax(x)
    Array([0.6316, 0.2444, 0.0902, 0.0338], dtype=float32)

  References:
    A. de Brébisson & P. Vincent, 2016, "An Exploration of Softmax Alternatives Belonging
    to the Spherical Loss Family".

    T. C. Nauen et al., 2024, "TaylorShift: Shifting the Complexity of Self-Attention from
    Squared to Linear (and Back) using Taylor-Softmax".
  """
  order = _check_order(order, "taylor_softmax")
  xs, mask, ax = c.prepare(x, axis, where, "taylor_softmax")
  # The ratio is unchanged when numerator and denominator are both multiplied by t^m: a
  # row whose largest |x| is past 2^_scale_exponent (|x|^m / m! overflows float32 from
  # 2.6e19 for m = 2) is evaluated at t x, t a power of two (xs holds visible values at
  # masked entries: its row max |x| is the visible one).
  big = jax.lax.stop_gradient(jnp.max(jnp.abs(xs), axis=ax, keepdims=True))
  t = _spherical.pow2_row_scale(big, _scale_exponent(order))
  w = c.sum_normalize(_scaled_taylor_exp(xs, order, t), mask, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)



def _tile_scale_exponent(order: int) -> int:
  """k of the tile rule's fixed scale ``t = 2^-k``, ``t^m`` about 2^-48: large scores come
  2^-k lower (m = 2: the row sum overflows float32 past |x| ~ 4e26 / sqrt(n) instead of
  2.6e19 / sqrt(n)), while the scaled polynomial's minimum (taylor_exp's, 1/2 for m = 2,
  0.0027 for m = 20, times t^m) keeps the row sum D at least 2^-57, whose square (in
  autodiff's derivative of a quotient by D) is still a normal float."""
  return 48 // order


def _taylor_tile(z, m, order=2, **_):
  """``t^m taylor_exp(z)`` with ``t = 2^-k`` fixed (:func:`_tile_scale_exponent`): each Horner
  step is taylor_exp's own times a power of two (:func:`_scaled_taylor_exp`), so the
  weights round as unscaled, and the factor cancels in the ratio."""
  t = jnp.full((), 2.0 ** -_tile_scale_exponent(order), z.dtype)
  return _scaled_taylor_exp(z, order, t)


SPEC = register(NormalizerSpec(
    name="taylor_softmax",
    fn=taylor_softmax,
    kernel_class="S",
    catalogue_id="N24",
    shift_invariant=False,
    params=(_ORDER,),
    tile=TileRule(score_map=identity_score_map, numerator=_taylor_tile,
                  denominator=_taylor_tile),
    description="(sum_{k<=m} x^k/k!) / sum_j (...), even m",
))
