"""The per-tile math of a normalizer's tile rule, written once.

Every blockwise computation of a normalizer of kernel class E, S or P goes through these
functions: the chunked XLA attention path (``jaxsoft.attention``, implementation
``"xla_chunked"``), the Pallas engine (``kernels_pallas``) and the reference evaluators
of ``jaxsoft.testing``. They are pure ``jnp`` on one tile of scores ``x`` (the key axis
last) with per-row statistics of the same rank and size 1 on that axis, so the same code
runs on a ``[bq, bk]`` tile inside a kernel and on a batched ``[B, K, G, bq, bk]`` tile in
XLA. ``mask`` is a boolean tile or ``None`` (every entry visible).

With ``z = score_map(x, n)`` (n the row's visible count) and the stabiliser ``m``
(class E: the running row max of z; S and P: 0), one row is::

    w_j = numerator(z_j, m) / D,   D = sum_j denominator(z_j, m) + offset(m, n)   (E, S)
    w_j = numerator(z_j, m)                                                     (P)

Forward over key blocks (FlashAttention's online softmax, Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax", arXiv:1805.02867; Dao et al. 2022,
"FlashAttention", arXiv:2205.14135): per row, carry (m, l) and the caller's accumulator
``acc = sum_j numerator(z_j, m) v_j``; for each block :func:`online_update` returns the new
(m, l), the block's numerators and the factor ``alpha = e^{m - m'}`` by which ``acc``
must be rescaled (``None`` for S and P, which carry no max). :func:`finalize` turns (m, l)
into (m, D) and :func:`normalize` divides.

Backward (FlashAttention-2, Dao 2023, arXiv:2307.08691): with dP_j = dO·v_j and
Δ = dO·O, :func:`tile_vjp` recomputes the tile at the saved (m, D) and returns the weights
and the cotangents of the scores and of the array hyperparameters,
``dz_j = (numerator'(z_j)·dP_j − denominator'(z_j)·Δ) / D`` (P: ``numerator'(z_j)·dP_j``),
by ``jax.vjp`` of the rule at fixed m (exact: the weights do not depend on m).
:func:`offset_vjp` adds the offset's part, ``dL/dD = −Δ/D``.

Class T (threshold rules) shares the masking conventions: :func:`threshold_maps`
evaluates a tile's weights and masses at a fixed threshold, and the ``search_*``
functions are the threshold search that finds it, one pass over the key blocks per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft.normalizers.common import safe_divide
from jaxsoft.normalizers.spec import ThresholdRule, TileRule

__all__ = [
    "safe_inverse",
    "scores",
    "running_max",
    "weights",
    "init_rows",
    "online_update",
    "rescale",
    "finalize",
    "normalize",
    "tile_vjp",
    "offset_vjp",
    "threshold_maps",
    "with_row_stats",
    "GAP_TOLERANCE",
    "jumps_at_threshold",
    "max_below",
    "gap_threshold",
    "weight_stabiliser",
    "search_schedule",
    "search_start",
    "search_candidates",
    "search_sums",
    "search_update",
    "search_done",
    "search_threshold",
]

Params = Mapping[str, Any]


def _where(mask, a, b):
  return a if mask is None else jnp.where(mask, a, b)


def safe_inverse(d):
  """``1 / d`` where ``d != 0``, else 0 (a row with nothing visible gets zero weights)."""
  return safe_divide(jnp.ones_like(d), d)


def scores(rule: TileRule | ThresholdRule, x, mask, m, length, hp: Params):
  """``z = score_map(x, n)`` on visible entries, ``m`` on masked ones.

  Masked logits may be ``-inf`` (a bias) or padding: they are replaced by 0 before the
  map and the result by the row's stabiliser, a finite value at the row's scale, so no
  inf or NaN appears there, not even in the unselected branch of a gradient.
  """
  z = rule.score_map(_where(mask, x, jnp.zeros_like(x)), length, **hp)
  return _where(mask, z, m)


def running_max(z, mask, m, m_floor=None):
  """``max(m, max of the visible z)`` along the last axis; ``-inf`` while nothing is visible.

  With ``m_floor`` (a number or a per-row array, ``TileRule.floor_value``) the result is
  at least the floor (once anything is visible). No gradient: the stabiliser cancels in
  the weights.
  """
  block = jnp.max(_where(mask, z, -jnp.inf), axis=-1, keepdims=True)
  m_new = jnp.maximum(m, block)
  if m_floor is not None:
    m_new = jnp.where(m_new == -jnp.inf, m_new, jnp.maximum(m_new, m_floor))
  return jax.lax.stop_gradient(m_new)


def _finite(m):
  """The stabiliser to evaluate with: 0 for a row with nothing visible yet."""
  return jnp.where(m == -jnp.inf, jnp.zeros_like(m), m)


def weights(rule: TileRule, z, mask, m, hp: Params):
  """``(numerator, denominator)`` of a tile of scores at a fixed stabiliser, 0 where masked.

  The denominator is ``None`` for class P, and the numerator array itself when the rule's
  two maps are the same function (softmax), so it is computed once.
  """
  num = _where(mask, rule.numerator(z, m, **hp), 0.0)
  denominator = rule.denominator
  if not rule.normalized or denominator is None:  # (validated: None only for class P)
    return num, None
  if denominator is rule.numerator:
    return num, num
  return num, _where(mask, denominator(z, m, **hp), 0.0)


def init_rows(rule: TileRule, row_shape, dtype):
  """The initial per-row state ``(m, l)``: ``m = -inf`` for class E (0 otherwise), ``l = 0``."""
  m0 = jnp.full(row_shape, -jnp.inf if rule.uses_max else 0.0, dtype)
  return m0, jnp.zeros(row_shape, dtype)


def online_update(rule: TileRule, x, mask, m, l, length, hp: Params):
  """One key block of the online pass: returns ``(m', l', numerators, alpha)``.

  Class E: ``m' = max(m, max z_block)`` (floored by ``rule.floor_value``),
  ``l' = alpha·l + sum_j denominator(z_j, m')`` with ``alpha = e^{m - m'}``; the caller
  rescales its accumulator, ``acc' = alpha·acc + numerators @ v`` (:func:`rescale`).
  Class S: ``m`` stays 0, ``alpha`` is None, ``l' = l + sum_j denominator(z_j, 0)``.
  Class P: nothing is carried: ``alpha`` is None and ``l`` is returned unchanged.
  """
  if rule.uses_max:
    z = rule.score_map(_where(mask, x, jnp.zeros_like(x)), length, **hp)
    m_new = running_max(z, mask, m, rule.floor_value(length, hp))
    m_use = _finite(m_new)
    alpha = jnp.exp(m - m_use)  # 0 while nothing was visible (m = -inf)
    z = _where(mask, z, m_use)
  else:
    m_new = m_use = m
    alpha = None
    z = scores(rule, x, mask, m_use, length, hp)
  num, den = weights(rule, z, mask, m_use, hp)
  if den is not None:
    l = rescale(l, alpha) + jnp.sum(den, axis=-1, keepdims=True)
  return m_new, l, num, alpha


def rescale(acc, alpha):
  """``alpha·acc`` (class E), or ``acc`` itself when there is no running max."""
  return acc if alpha is None else acc * alpha


def finalize(rule: TileRule, m, l, length, hp: Params):
  """``(m, D)`` after the last block: ``D = l + offset(m, n)`` (E, S), 1 for class P.

  ``m`` comes back finite (0 for a row with nothing visible); these two per-row numbers
  are all the backward pass needs.
  """
  m = _finite(m)
  if not rule.normalized:
    return m, jnp.ones_like(l)
  if rule.offset is None:
    return m, l
  return m, l + rule.offset(m, length, **hp)


def normalize(rule: TileRule, acc, d):
  """``acc / D`` (0 for a row whose D is 0); class P returns ``acc`` (its D is 1)."""
  return acc * safe_inverse(d) if rule.normalized else acc


def tile_vjp(rule: TileRule, x, mask, m, d, delta, dp, length, hp_static: Params,
             hp_arrays: Params):
  """Recomputes a tile at the saved ``(m, D)``: returns ``(w, dx, d_hp_arrays)``.

  Args:
    rule: the tile rule.
    x: the tile's logits (as passed to ``score_map``).
    mask: its visibility, or None.
    m, d: the row's stabiliser and denominator from :func:`finalize`.
    delta: ``Δ = rowsum(dO ∘ O)`` per row (unused by class P).
    dp: ``dP = dO·vᵀ`` on the tile.
    length: the row's visible count n.
    hp_static: hyperparameters that get no gradient (Python values, integer arrays).
    hp_arrays: float array hyperparameters (a dict), differentiated.

  Returns:
    ``w`` the weights of the tile (for dV), ``dx`` the cotangent of ``x``, and the
    cotangents of ``hp_arrays`` summed over the tile's key axis (shaped like each array).
  """

  def maps(x_, arrays):
    hp = {**hp_static, **arrays}
    return weights(rule, scores(rule, x_, mask, m, length, hp), mask, m, hp)

  if not rule.normalized:
    num, vjp = jax.vjp(lambda x_, a: maps(x_, a)[0], x, hp_arrays)
    dx, dhp = vjp(dp)
    return num, dx, dhp
  inv = safe_inverse(d)
  if rule.denominator is rule.numerator:  # one cotangent: (dP - Δ) / D
    num, vjp = jax.vjp(lambda x_, a: maps(x_, a)[0], x, hp_arrays)
    dx, dhp = vjp((dp - delta) * inv)
    return num * inv, dx, dhp
  (num, den), vjp = jax.vjp(maps, x, hp_arrays)
  dx, dhp = vjp((dp * inv, jnp.broadcast_to(-delta * inv, den.shape)))
  return num * inv, dx, dhp


def offset_vjp(rule: TileRule, m, d, delta, length, hp_static: Params, hp_arrays: Params):
  """The offset's share of the hyperparameter cotangents (``dL/dD = −Δ/D``), or None.

  None when the rule has no offset (or no row sum) or there are no array
  hyperparameters.
  """
  rule_offset = rule.offset
  if not rule.normalized or rule_offset is None or not hp_arrays:
    return None

  # A row whose D overflowed (an offset far above every score: a sink logit 1e4 over
  # scores -1e4) has O = 0, so Δ = 0 and offset/D <= 1: its share is 0, but the vjp's
  # 0·inf is NaN. The vjp is taken per row, those rows are zeroed, then summed back.
  per_row = {name: jnp.broadcast_to(a, jnp.broadcast_shapes(jnp.shape(a), m.shape))
             for name, a in hp_arrays.items()}

  def offset(arrays):
    return jnp.broadcast_to(rule_offset(m, length, **{**hp_static, **arrays}), m.shape)

  _, vjp = jax.vjp(offset, per_row)
  finite = jnp.isfinite(d)
  (dhp,) = vjp(jnp.where(finite, -delta * safe_inverse(d), 0.0))
  return {name: _sum_to(jnp.where(finite, dhp[name], 0.0), jnp.shape(a))
          for name, a in hp_arrays.items()}


def _sum_to(x, shape):
  """``x`` summed over the axes along which ``shape`` (same rank, or lower) broadcasts."""
  lead = x.ndim - len(shape)
  axes = tuple(range(lead)) + tuple(
      lead + i for i, s in enumerate(shape) if s == 1 and x.shape[lead + i] != 1)
  return jnp.sum(x, axis=axes).reshape(shape) if axes else x


def threshold_maps(rule: ThresholdRule, x, mask, tau, m, length, hp: Params):
  """Class T: ``(weight, mass)`` of a tile at a fixed threshold ``tau``, 0 where masked."""
  z = scores(rule, x, mask, m, length, hp)
  weight = _where(mask, rule.weight(z, tau, m, **hp), 0.0)
  mass = _where(mask, rule.mass(z, tau, **hp), 0.0)
  return weight, mass


def with_row_stats(rule: ThresholdRule, x, mask, length, hp: Params) -> dict:
  """``hp`` with the derived hyperparameters of ``rule.stats`` (none without), from whole
  rows of the logits ``x`` along the last axis (one block); constants, no gradient."""
  if rule.stats is None:
    return dict(hp)
  theta = rule.stats.derive(rule.stats.block(x, mask), length, **hp)
  return {**hp, **jax.lax.stop_gradient(theta)}


# Scores within this relative distance of tau count as tau itself in the gap search: a
# recomputed tile's logits differ by a few ulps between passes (another fusion, another
# kernel), so a score equal to tau must not be taken for the next one below it. 2^-21 of
# 1 + |tau| is at least 4 ulps of tau; a wider margin (2^-16 was used before) also merged
# genuinely distinct scores: top-p's boundary lies inside the bulk of a row's scores,
# where neighbours 1e-6 apart occur in about one row in a thousand.
GAP_TOLERANCE = 2.0 ** -21


def jumps_at_threshold(rule: ThresholdRule, hp: Params) -> bool:
  """Whether the rule's weight jumps at tau (top-k, top-p: ``1[z >= tau] e^{z - m}``; not
  the ``[z - tau]_+`` family, whose weight is 0 there), probed at z = tau = 0, m = 1 with
  the Python-valued hyperparameters ``hp``.

  Such a rule's weights change when a score equal to tau is recomputed one ulp lower by a
  later pass, so its tau is moved into the middle of the gap below it
  (:func:`gap_threshold`, after a sweep of :func:`max_below`); scores within
  ``GAP_TOLERANCE`` (relative) of tau count as tied with it and are kept.
  """
  # Concrete even while a caller is being traced, and outside the caller's mesh (inside
  # jax.shard_map a constant would be placed on the manual mesh and the probe would fail).
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), \
      jax.ensure_compile_time_eval():
    zero = jnp.zeros((), jnp.float32)
    return bool(rule.weight(zero, zero, zero + 1.0, **hp) != 0)


def max_below(z, mask, tau, below):
  """``max(below, the largest visible z clearly below tau)`` per row (by more than
  ``GAP_TOLERANCE (1 + |tau|)``; ``-inf`` while there is none)."""
  under = z < tau - GAP_TOLERANCE * (1.0 + jnp.abs(tau))
  if mask is not None:
    under = jnp.logical_and(under, mask)
  return jnp.maximum(below, jnp.max(jnp.where(under, z, -jnp.inf), axis=-1, keepdims=True))


def gap_threshold(tau, below):
  """Midway between tau and the largest score below it (tau - 1 when there is none)."""
  return jnp.where(below == -jnp.inf, tau - 1.0, 0.5 * (tau + below))


def weight_stabiliser(m):
  """The stabiliser a class-T weight pass evaluates at: m raised by ``GAP_TOLERANCE (1 +
  |m|)``.

  A rule may clamp as ``exp(min(z - m, 0))`` against overflow; at the row's argmax that
  clamp's derivative is a tie (1/2), and a pass whose tile rounds the argmax a few ulps
  above the search's m would halve or drop its gradient. Strictly above every recomputed z
  the clamp is inactive; the uniform factor ``e^{m - m'}`` cancels in the normalisation.
  """
  return m + GAP_TOLERANCE * (1.0 + jnp.abs(m))


# --- class T: the threshold search ------------------------------------------------------
#
# Each step of the search is one pass over a row's key blocks that sums, at a few
# candidate thresholds c, the mass M(c) = sum_j mass(z_j, c) (for a rule with
# ``newton_power`` p also its slope M'(c), by forward-mode autodiff of ``mass``). The
# bracket [lo, hi] (M(lo) >= target > M(hi)) then closes on the candidates either side of
# the root. The next step's candidates are, around the largest tangent root r of
# M^p - target^p found inside the bracket (Newton's point), the pair r -+ e (e = one ulp of
# 1 + |r|, so a Newton point on the root brackets it: M evaluates with rounding noise
# there) and the middle of [r + e, hi] (a bisection companion: every step at least halves
# the bracket); without such a point, multisection (points splitting [lo, hi] evenly).
# For a rule whose M^p is convex (sparsemax, entmax with alpha <= 2) every tangent root is
# below the root, and on sparsemax's fixed support one step is exact (Michelot's
# iteration, Newton on the piecewise-linear M): rows settle in 3-7 steps where
# multisection needs 15.
#
# A row is done once its bracket is within SEARCH_ULPS ulps of 1 + |lo| (a row with
# nothing visible starts done); its threshold is then the last Newton point inside the
# bracket, else the middle of the bracket (:func:`search_threshold`). Drivers with a
# data-dependent loop stop when every row of the block is done; a driver whose number of
# passes is fixed in advance (the Mosaic TPU grid) runs multisection.

SEARCH_ULPS = 4


def search_schedule(rule: ThresholdRule, iterations: int, early_exit: bool):
  """``(candidates per step, most steps, newton)`` for a search of ``iterations`` bits.

  With Newton steps and a loop that can stop early: 3 candidates (the pair around Newton's
  point and a bisection point) and at most ``iterations`` steps (each at least halves the
  bracket). Otherwise multisection with 3 candidates (2 bits per step).
  """
  if rule.newton_power is not None and early_exit:
    return 3, max(1, iterations), True
  return 3, max(1, -(-iterations // 2)), False


def search_start(rule: ThresholdRule, m, length, hp: Params):
  """After the max pass: ``(m, (lo, hi, newton), target)``, each per row.

  ``m`` becomes finite (0 for a row with nothing visible, whose bracket is the single point
  lo, so it starts done); there is no Newton point yet (-inf).
  """
  empty = m == -jnp.inf
  m = jnp.where(empty, 0.0, m)
  lo, hi = rule.bracket(m, length, **hp)
  lo = jnp.broadcast_to(jnp.asarray(lo, m.dtype), m.shape)
  hi = jnp.where(empty, lo, jnp.broadcast_to(jnp.asarray(hi, m.dtype), m.shape))
  target = jnp.broadcast_to(jnp.asarray(rule.target(length, **hp), m.dtype), m.shape)
  return m, (lo, hi, jnp.full_like(lo, -jnp.inf)), target


def _ulp_of(x):
  return float(jnp.finfo(x.dtype).eps) * (1.0 + jnp.abs(x))


def search_candidates(lo, hi, newton, count: int):
  """The ``count`` thresholds of one step, each per row, in increasing order: with a Newton
  point r in [lo, hi], ``r - e``, ``r + e`` and points splitting [r + e, hi] evenly (e one
  ulp of 1 + |r|, clipped to the bracket); else points splitting [lo, hi] evenly."""
  use = jnp.logical_and(newton >= lo, newton <= hi)
  r = jnp.where(use, newton, lo)
  e = _ulp_of(r)
  up = jnp.minimum(r + e, hi)
  near = [jnp.maximum(r - e, lo), up] + [up + (hi - up) * (i / (count - 1))
                                         for i in range(1, count - 1)]
  spread = [lo + (hi - lo) * ((i + 1) / (count + 1)) for i in range(count)]
  return [jnp.where(use, a, b) for a, b in zip(near, spread, strict=True)]


def search_sums(rule: ThresholdRule, z, mask, taus, sums, hp: Params, newton: bool,
                stacked: bool = False):
  """Adds one tile of scores ``z`` to ``sums``: ``[M(c) for c in taus]``, then (with
  ``newton``) ``[M'(c) for c in taus]``; masked entries add nothing.

  ``stacked`` evaluates the candidates along a new leading axis (one reduction for all of
  them: faster in XLA; a Pallas kernel keeps the 2-D tiles of the default)."""
  if stacked:
    tau = jnp.stack(taus)  # [C, ..., rows, 1]
    zc = z[None]
    # array hyperparameters of the tile's rank get the candidates' axis too (explicit
    # ranks: no implicit rank promotion)
    hpc = {name: jnp.asarray(x)[None] if x is not None and 0 < jnp.ndim(x) == z.ndim
           else x for name, x in hp.items()}
    if newton:
      mass, slope = jax.jvp(lambda t: rule.mass(zc, t, **hpc), (tau,), (jnp.ones_like(tau),))
      both = jnp.concatenate([_where(mask, mass, 0.0), _where(mask, slope, 0.0)])
    else:
      both = _where(mask, rule.mass(zc, tau, **hpc), 0.0)
    total = jnp.sum(both, axis=-1, keepdims=True)  # [C or 2C, ..., rows, 1]
    return [a + total[i] for i, a in enumerate(sums)]
  masses, slopes = [], []
  for tau in taus:
    if newton:
      mass, slope = jax.jvp(lambda t: rule.mass(z, t, **hp), (tau,), (jnp.ones_like(tau),))
      slopes.append(jnp.sum(_where(mask, slope, 0.0), axis=-1, keepdims=True))
    else:
      mass = rule.mass(z, tau, **hp)
    masses.append(jnp.sum(_where(mask, mass, 0.0), axis=-1, keepdims=True))
  return [a + b for a, b in zip(sums, masses + slopes, strict=True)]


def search_update(rule: ThresholdRule, state, taus, sums, target, hp: Params, newton: bool):
  """The state ``(lo, hi, newton point)`` after a step that summed ``sums`` at ``taus``
  (:func:`search_sums`)."""
  lo, hi, _ = state
  count = len(taus)
  totals = sums[:count]
  for tau, total in zip(taus, totals, strict=True):
    ok = total >= target  # mass non-increasing in tau: at or below the root
    lo = jnp.where(jnp.logical_and(ok, tau >= lo), tau, lo)
    hi = jnp.where(ok, hi, jnp.minimum(hi, tau))
  point = jnp.full_like(lo, -jnp.inf)
  if newton and rule.newton_power is not None:
    p = rule.newton_power(**hp)
    for tau, total, slope in zip(taus, totals, sums[count:], strict=True):
      # the tangent root of M^p - target^p: tau - M (1 - (target / M)^p) / (p M')
      good = jnp.logical_and(total > 0.0, slope < 0.0)
      safe_total = jnp.where(good, total, 1.0)
      step = safe_total * (1.0 - jnp.power(target / safe_total, p)) / (
          p * jnp.where(good, slope, -1.0))
      root = tau - step
      inside = jnp.logical_and(good, jnp.logical_and(root >= lo, root <= hi))
      point = jnp.maximum(point, jnp.where(inside, root, -jnp.inf))
  return lo, hi, point


def search_done(state):
  """Per row: the bracket is within ``SEARCH_ULPS`` ulps of ``1 + |lo|``."""
  lo, hi, _ = state
  return hi - lo <= SEARCH_ULPS * _ulp_of(lo)


def search_threshold(state, newton: bool):
  """The threshold a search ends with, per row: with Newton steps, on a settled bracket the
  last Newton point inside it, else its middle (the root lies inside: half the error of lo
  and no bias; the support is not empty, the bracket being far narrower than the gap
  between tau and the row max); else, or where the bracket has not settled, lo (mass >=
  target there: top-k keeps k entries).

  The Newton point (a tangent root from the candidates next to the root) is exact to
  rounding on sparsemax's fixed support and quadratically close for a convex ``M^p``,
  where the bracket is 4 ulps of ``1 + |tau|`` wide: on a near-uniform row of 2048 keys,
  whose weights are ~1e-3, the middle left sparsemax attention outputs 2e-6 from float64
  and the Newton point 2e-8 (issue 37). Inside the bracket it is never worse than lo.
  """
  lo, hi, point = state
  if not newton:
    return lo
  settled = jnp.where(jnp.logical_and(point >= lo, point <= hi), point, lo + 0.5 * (hi - lo))
  return jnp.where(search_done(state), settled, lo)
