"""Row statistics merged over key blocks: the parts class-R rules are built from.

A class-R normalizer (``NormalizerSpec.row_stats``, a :class:`RowStatsRule`) needs a
statistic of the whole row before any weight. Blockwise, each statistic is a small tuple
per row with four functions (:class:`Statistic`):

* ``init(shape, dtype)``: the value of an empty row;
* ``block(x, mask)``: the value of one key block's visible logits;
* ``merge(a, b)``: the value of two disjoint parts (associative, so any blocking gives the
  same result up to rounding);
* ``tangent(x, mask, final)``: per-row sums over one block whose derivative with respect
  to the block's x equals that of the *final* statistic (0 for components that carry no
  gradient, such as a stabilising max): what a backward pass needs, one block at a time.

The statistics here: :data:`SOFTMAX` (row max m, ``l = sum e^{x-m}``: the online softmax
merge of Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"),
:data:`MOMENTS` (count, mean, M2: Chan, Golub & LeVeque 1979, "Updating formulae and a
pairwise algorithm for computing sample variances"; M2 carried scaled by a power of two,
so that it neither overflows nor underflows), :data:`ENTROPY` (softmax's (m, l) and
``t = sum e^{x-m} (x - m)``, from which ``H = log l - t / l``) and :data:`EXTREMES` (the
visible max and min with their multiplicities, so a tie shares the gradient as
``jnp.max`` does; entries within a relative ``RECOMPUTE_TOLERANCE`` = 2^-16 of the
extreme count as tied, so a tile recomputed by another pass still finds it). :func:`row_stats_rule` joins statistics into one rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxsoft.normalizers.common import safe_divide
from jaxsoft.normalizers.spec import RowStatsRule, TileRule

__all__ = ["Statistic", "SOFTMAX", "MOMENTS", "ENTROPY", "EXTREMES", "row_stats_rule",
           "pow2_scale", "softmax_derived", "softmax_of", "finite_or_zero", "at_row_max"]


@dataclasses.dataclass(frozen=True)
class Statistic:
  """One mergeable row statistic (a tuple of ``size`` per-row arrays); see the module doc."""

  size: int
  init: Callable[..., tuple]
  block: Callable[..., tuple]
  merge: Callable[..., tuple]
  tangent: Callable[..., tuple]


# A logit recomputed by a later pass (another kernel, another fusion) may round a few ulps
# away from the statistics pass's value; within this relative distance of a row's max (or
# min) it still counts as that extreme.
RECOMPUTE_TOLERANCE = 2.0 ** -16


def _tolerance(v):
  return RECOMPUTE_TOLERANCE * (1.0 + jnp.abs(jnp.where(jnp.isfinite(v), v, 0.0)))


def _sum(a):
  return jnp.sum(a, axis=-1, keepdims=True)


def finite_or_zero(m):
  return jnp.where(jnp.isfinite(m), m, 0.0)


# --- softmax: (m, l) ------------------------------------------------------------------


def _softmax_init(shape, dtype):
  return jnp.full(shape, -jnp.inf, dtype), jnp.zeros(shape, dtype)


def _exp_below(x, mask, m):
  """``e^{x - m}`` on visible entries (0 elsewhere; no inf in either branch)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x - finite_or_zero(m), 0.0)), 0.0)


def _softmax_block(x, mask):
  m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1, keepdims=True))
  return m, _sum(_exp_below(x, mask, m))


def _softmax_merge(a, b):
  m = jnp.maximum(a[0], b[0])
  safe = finite_or_zero(m)
  l = 0.0
  for mi, li in (a, b):  # an empty part (m = -inf) has l = 0
    l = l + jnp.where(jnp.isfinite(mi), jnp.exp(finite_or_zero(mi) - safe), 0.0) * li
  return m, l


def _softmax_tangent(x, mask, final):
  m = jax.lax.stop_gradient(final[0])
  return jnp.zeros_like(m), _sum(_exp_below(x, mask, m))


SOFTMAX = Statistic(2, _softmax_init, _softmax_block, _softmax_merge, _softmax_tangent)


def softmax_derived(m, l) -> dict:
  """The derived hyperparameters ``row_max``, ``row_sum`` of :data:`SOFTMAX`'s (m, l)."""
  return {"row_max": finite_or_zero(m), "row_sum": l}


def softmax_of(z, row_max, row_sum):
  """softmax from the row's (m, l): ``e^{z - m} / l``.

  An entry clearly above m (one the caller masks: visible entries have z <= m, up to the
  rounding of a recomputed tile, ``RECOMPUTE_TOLERANCE``) is evaluated at 0 so it cannot
  overflow; a select, not ``min``, whose derivative at the argmax z = m would be 1/2.
  """
  return safe_divide(jnp.exp(jnp.where(z <= row_max + _tolerance(row_max), z - row_max, 0.0)),
                     row_sum)


# --- moments: (count, mean, scale, scaled M2) ---------------------------------------------


def _scale_limit(dtype) -> int:
  """The scales t of :data:`MOMENTS` lie in [2^-L, 2^L], L = 25/32 of the largest binary
  exponent (float32 and bfloat16: 100, float64: 800, float16: 12): normal floats, with
  room for the products with eps of the derived hyperparameters."""
  return int(jnp.finfo(dtype).maxexp) * 25 // 32


def pow2_scale(r):
  """``t = 2^-e`` with ``r t`` in [1/2, 1) (``r >= 0`` without gradient), read off the
  float's exponent bits: exact, and only integer and bit operations (a Pallas kernel
  lowers them). ``t`` is clamped to [2^-L, 2^L] (:func:`_scale_limit`); r = 0 or a
  subnormal r gives the upper limit 2^L, no constraint for the minimum a merge takes.
  """
  info = jnp.finfo(r.dtype)
  ints = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[info.bits]
  field = ((1 << int(info.nexp)) - 1) << int(info.nmant)
  # 2^floor(log2 r) for a normal r (the mantissa cleared), 0 for 0 or a subnormal
  floor = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(r, ints) & field, r.dtype)
  lim = _scale_limit(r.dtype)
  floor = jnp.clip(floor, 2.0 ** (-lim - 1), 2.0 ** (lim - 1))
  return 0.5 / floor  # 1 / 2^(floor(log2 r) + 1): a power of two, exact


def _moments_init(shape, dtype):
  zero = jnp.zeros(shape, dtype)
  return zero, zero, pow2_scale(zero), zero


def _moments_block(x, mask):
  """(count, mean, t, q) of one block's visible entries, two-pass within the block: ``q =
  sum (t (x - mean))^2``, ``t`` (:func:`pow2_scale` of the largest deviation, no
  gradient) bringing the deviations into [-1, 1) exactly."""
  n = _sum(mask).astype(x.dtype)
  mean = safe_divide(_sum(jnp.where(mask, x, 0.0)), n)
  d = jnp.where(mask, x - mean, 0.0)
  t = pow2_scale(jax.lax.stop_gradient(jnp.max(jnp.abs(d), axis=-1, keepdims=True)))
  y = d * t
  return n, mean, t, _sum(y * y)


def _moments_merge(a, b):
  """Chan, Golub & LeVeque's pairwise merge of (count, mean, M2), M2 carried as ``q = t^2
  M2``. The merged ``t`` is the smallest of the parts' and :func:`pow2_scale` of the gap
  between their means, so every deviation from the merged mean stays under 2 once scaled
  (``t |x - mean| <= t |x - mean_a| + t |mean_b - mean_a|``) and ``q`` under ``4 n``;
  every rescale is by a power of two (exact), so a row whose squares fit the float range
  gets M2 bit for bit as unscaled."""
  na, ma, ta, qa = a
  nb, mb, tb, qb = b
  n = na + nb
  delta = mb - ma
  frac = safe_divide(nb, n)
  # the gap between the means matters only when both parts hold entries (an empty part's
  # mean is 0, not a value of the row)
  gap = jnp.where((na > 0) & (nb > 0), delta, 0.0)
  t = jnp.minimum(jnp.minimum(ta, tb), pow2_scale(jax.lax.stop_gradient(jnp.abs(gap))))
  dt = gap * t
  q = qa * jnp.square(t / ta) + qb * jnp.square(t / tb) + dt * dt * na * frac
  return n, ma + delta * frac, t, q


def _moments_tangent(x, mask, final):
  n, mean, t, _ = jax.lax.stop_gradient(final)
  y = jnp.where(mask, (x - mean) * t, 0.0)
  zero = jnp.zeros_like(n)
  # d mean / d x_j = 1/n; d q / d x_j = 2 t^2 (x_j - mean) (the mean's own share sums to
  # 0; t is piecewise constant)
  return zero, safe_divide(_sum(jnp.where(mask, x, 0.0)), n), zero, _sum(y * y)


MOMENTS = Statistic(4, _moments_init, _moments_block, _moments_merge, _moments_tangent)


# --- entropy of softmax: (m, l, t) --------------------------------------------------------


def _entropy_init(shape, dtype):
  return (*_softmax_init(shape, dtype), jnp.zeros(shape, dtype))


def _entropy_block(x, mask):
  """(m, l, t) with ``t = sum e^{x-m} (x - m)``, carried relative to m so that a row far
  from 0 keeps its precision; under a new max m', ``t' = e^{m-m'} (t + l (m - m'))``."""
  m, _ = _softmax_block(x, mask)
  zc = jnp.where(mask, x - finite_or_zero(m), 0.0)
  e = _exp_below(x, mask, m)
  return m, _sum(e), _sum(e * zc)


def _entropy_merge(a, b):
  m = jnp.maximum(a[0], b[0])
  safe = finite_or_zero(m)
  l, t = 0.0, 0.0
  for mi, li, ti in (a, b):
    shift = jnp.where(jnp.isfinite(mi), mi - safe, 0.0)
    scale = jnp.where(jnp.isfinite(mi), jnp.exp(shift), 0.0)
    l = l + scale * li
    t = t + scale * (ti + li * shift)
  return m, l, t


def _entropy_tangent(x, mask, final):
  m = jax.lax.stop_gradient(final[0])
  zc = jnp.where(mask, x - finite_or_zero(m), 0.0)
  e = _exp_below(x, mask, m)
  return jnp.zeros_like(m), _sum(e), _sum(e * zc)


ENTROPY = Statistic(3, _entropy_init, _entropy_block, _entropy_merge, _entropy_tangent)


# --- extremes: (max, its multiplicity, min, its multiplicity) ---------------------------


def _extremes_init(shape, dtype):
  zero = jnp.zeros(shape, dtype)
  return jnp.full(shape, -jnp.inf, dtype), zero, jnp.full(shape, jnp.inf, dtype), zero


def at_row_max(x, hi):
  """Entries tied with the max ``hi`` (within the recomputation tolerance)."""
  return x >= hi - _tolerance(hi)


def _at_min(x, lo):
  return x <= lo + _tolerance(lo)


def _extremes_block(x, mask):
  hi = jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1, keepdims=True)
  lo = jnp.min(jnp.where(mask, x, jnp.inf), axis=-1, keepdims=True)
  n_hi = _sum(mask & at_row_max(x, hi)).astype(x.dtype)
  n_lo = _sum(mask & _at_min(x, lo)).astype(x.dtype)
  return hi, n_hi, lo, n_lo


def _extremes_merge(a, b):
  """The extremes of two parts, the multiplicities of (tolerance-)tied parts added."""
  hi = jnp.maximum(a[0], b[0])
  n_hi = jnp.where(at_row_max(a[0], hi), a[1], 0.0) + jnp.where(at_row_max(b[0], hi), b[1], 0.0)
  lo = jnp.minimum(a[2], b[2])
  n_lo = jnp.where(_at_min(a[2], lo), a[3], 0.0) + jnp.where(_at_min(b[2], lo), b[3], 0.0)
  return hi, n_hi, lo, n_lo


def _extremes_tangent(x, mask, final):
  hi, n_hi, lo, n_lo = jax.lax.stop_gradient(final)
  # each of the k tied entries carries 1/k of the extreme's gradient (as jnp.max does for
  # exact ties; here ties within RECOMPUTE_TOLERANCE, so that a recomputed tile whose max
  # rounds an ulp away still finds it)
  at_hi = jnp.where(mask & at_row_max(x, hi), x, 0.0)
  at_lo = jnp.where(mask & _at_min(x, lo), x, 0.0)
  zero = jnp.zeros_like(n_hi)
  return safe_divide(_sum(at_hi), n_hi), zero, safe_divide(_sum(at_lo), n_lo), zero


EXTREMES = Statistic(4, _extremes_init, _extremes_block, _extremes_merge, _extremes_tangent)


# --- joining statistics into a rule -------------------------------------------------------


def row_stats_rule(parts: tuple[Statistic, ...], derive: Callable[..., dict],
                   second: TileRule | None) -> RowStatsRule:
  """A :class:`RowStatsRule` whose statistics are ``parts`` side by side (one flat tuple).

  ``derive(stats, length, **hp)`` receives the flat tuple (in the order of ``parts``).
  """

  def split(stats):
    out, start = [], 0
    for part in parts:
      out.append(tuple(stats[start:start + part.size]))
      start += part.size
    return out

  def init(shape, dtype):
    return tuple(a for part in parts for a in part.init(shape, dtype))

  def block(x, mask):
    return tuple(a for part in parts for a in part.block(x, mask))

  def merge(a, b):
    return tuple(s for part, pa, pb in zip(parts, split(a), split(b), strict=True)
                 for s in part.merge(pa, pb))

  def tangent(x, mask, final):
    return tuple(s for part, pf in zip(parts, split(final), strict=True)
                 for s in part.tangent(x, mask, pf))

  return RowStatsRule(init=init, block=block, merge=merge, derive=derive, tangent=tangent,
                      second=second)
