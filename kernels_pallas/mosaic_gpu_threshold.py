"""Class T (sparsemax, entmax-1.5, top-k) on the Mosaic-GPU (Hopper, sm_90a) engine.

UNVERIFIED ON HARDWARE, like ``kernels_pallas.mosaic_gpu``: lowered for CUDA by
``jax.export`` (sm_90a, 227 KiB of shared memory assumed) and run in Pallas's GPU
interpreter on a CPU, never on an H100/H200. ``kp.mosaic_gpu_attention`` routes a class-T
normalizer here. Differentiable in reverse mode (a custom VJP): the forward also saves the
threshold tau, the row max m, the weight sum W and the search's live flags, and
``kernels_pallas.mosaic_gpu_threshold_backward`` runs the dQ kernel (two sweeps over the
live key blocks: the implicit-function coefficient, then dQ) and the dK/dV kernel (over
each key block's live query blocks). Forward mode (``jax.jvp``) and second order raise
``UnsupportedDifferentiation`` naming ``kernels_pallas.attention`` (the Triton and
Mosaic-TPU engines) as the way out.

AdaSplash's two kernels (Gonçalves, Treviso & Martins 2025), with the tile math of the
other engines (``jaxsoft.normalizers.tile``'s search, ``kernels_pallas.engine``'s class-T
section). Per query row i, with the scaled logits ``x_j = scale q·k_j``, the visible keys
``V`` (``j < L_b`` with ``key_value_seq_lengths``, ``i - left <= j <= i + right`` with
``local_window_size``, ``j <= i`` causal: one interval, ``mosaic_gpu._visible``),
``z_j = score_map(x_j, |V|)`` and the rule's ``ThresholdRule``::

    m   = max_{j in V} z_j                                   (the max pass)
    tau solves  F(tau) = sum_{j in V} mass(z_j, tau) - target(|V|) = 0
                on the bracket [lo, hi] = bracket(m, |V|)    (the search sweeps)
    O   = sum_j weight(z_j, tau, m') v_j / W,   W = sum_j weight(z_j, tau, m')

(``m' = m + 2^-21 (1 + |m|)``, ``tile.weight_stabiliser``). Sparsemax:
``mass = weight = [z - tau]_+``, target 1; entmax-1.5: ``z = x / 2``,
``mass = weight = [z - tau]_+^2``, target 1; top-k: ``mass = 1[z >= tau]``, target
``min(k, |V|)``, ``weight = 1[z >= tau] e^{z - m'}``.

1. **Search kernel.** A CTA owns ``2 x 64`` query rows of one (batch, head): a TMA
   producer warpgroup streams the key tiles through a 2-slot ring, two consumer
   warpgroups recompute ``Q K^T`` with ``wgmma`` at every pass. Pass 0 takes the row max;
   then at most a fixed number of sweeps (the rule's ``iterations`` for a Newton rule,
   half as many multisection sweeps for top-k; ``tile.search_schedule``) each sum, at 3 candidate
   thresholds, the mass (and, for a rule with ``newton_power`` p, its slope) and close the
   bracket (``tile.search_candidates`` / ``search_update``: Newton steps on
   ``M^p - target^p`` with a bisection companion). After each sweep both consumers post a
   verdict (does any of its rows need another sweep: bracket wider than 4 ulps) in shared
   memory behind a barrier that all three warpgroups wait on; the producer streams the next
   sweep's keys only when a verdict asks for it, so the search stops after the sweeps it
   needs (3-7 for sparsemax and entmax-1.5). A warpgroup that has settled while the other
   goes on only releases the ring slots. Rules whose weight jumps
   at tau (top-k) take one more pass that moves tau into the gap below it
   (``tile.max_below`` / ``gap_threshold``). Every sweep records, per key block, whether
   some visible ``z >= lo`` (lo the bracket's lower end at the sweep's start, ``<= tau``):
   a block without one has zero weights. The last sweep's flags are the live flags.
2. **Block list.** ``engine.live_block_tables`` compacts the flags of the CTA's 128 rows
   (the two warpgroups' flags OR-ed) into ``idx`` (live key blocks in increasing order)
   and ``cnt``.
3. **Attention pass.** The forward kernel's structure (``mosaic_gpu``): a producer
   warpgroup loads the key and value tiles of ``idx[0 .. cnt)`` only, two consumer
   warpgroups run ``S = Q K^T``, the weight tile (class P: no running statistics) and
   ``O += W V`` on the tensor cores, and divide by the row sum of the weights at the end
   (this removes the finite search's residual error, as on the other engines). A row with
   a NaN logit comes out NaN (its max is NaN and no block is live).

Masks. The search kernel's CTA sweeps only the key blocks its 128 rows see, computed
from the mask's parameters (``mosaic_gpu._key_block_range``: the batch entry's key
length, read by the kernel as a scalar, the window and causal); the other blocks are
never loaded, and their flags stay 0, so neither the attention pass nor the backward
loads them. |V| counts the visible keys only (``mosaic_gpu._visible_count``), which sets
the bracket and top-k's target ``min(k, |V|)``. A row that sees no key has ``m = 0``, an
empty bracket and no live block: a zero output, ``W = 0`` and zero gradients. Every key
block is masked elementwise (padding, key length, window, causal) in both kernels: the
masks cost a few elementwise operations per score; splitting the loops into masked and
unmasked blocks, as the softmax kernel does, is left for the GPU session that measures it.

The maps are the rules' own functions traced with custom derivatives inlined
(``mosaic_gpu._primal``). The Newton step's ``(target / M)^p`` is written as ``r`` (p = 1),
``r rsqrt(r)`` (p = 1/2) or ``exp(p log r)``: the Mosaic-GPU lowering has no ``pow``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft.attention.differentiation import first_order_only, refuse_unsupported_ad
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers import tile
from kernels_pallas import engine
from kernels_pallas.engine import UnsupportedError
from kernels_pallas.mosaic_gpu import (
    CLASS_KERNELS,
    _cta,
    _fetch,
    _key_block_range,
    _kv_head,
    _launch,
    _load_row,
    _plgpu,
    _primal,
    _Problem,
    _round_up,
    _scores,
    _specialise,
    _stream,
    _swizzled,
    _visible,
    _visible_count,
    _write_back,
)
from kernels_pallas.mosaic_gpu_threshold_backward import _end, _mask_and_length, threshold_backward

__all__ = ["threshold_attention", "threshold_blocks", "SUPPORTED"]

# The class-T normalizers whose maps lower for Mosaic GPU and are tested (export and
# interpreter): entmax with a traced or non-integer power and top-p (a row-statistics
# pass first) are not.
SUPPORTED = ("sparsemax", "entmax15", "top_k_softmax")

_BQ = 64  # rows per consumer warpgroup (one wgmma M)
_STAGES = 2  # search ring slots


@dataclasses.dataclass(frozen=True)
class _TCfg(_Problem):
  block_k: int
  num_stages: int
  window: tuple[int, int] | None = None  # (left, right): query i sees keys i - left .. i + right
  kv_lengths: bool = False  # a per-batch key length array follows the kernels' inputs

  @property
  def left(self) -> int | None:
    """How far back a query sees (None: unbounded)."""
    return None if self.window is None else self.window[0]

  @property
  def right(self) -> int | None:
    """How far ahead a query sees (None: unbounded; 0 when causal)."""
    if self.causal:
      return 0
    return None if self.window is None else self.window[1]

  @property
  def masked(self) -> bool:
    """Whether some (query, key) pair inside the unpadded lengths is invisible."""
    return self.causal or self.window is not None or self.kv_lengths

  @property
  def rule(self) -> _spec.ThresholdRule:
    return self.spec.threshold


def _schedule(cfg: _TCfg):
  """(candidates per sweep, sweeps, newton, indicator): ``tile.search_schedule`` with an
  early exit (per warpgroup) and whether tau moves into the gap below it."""
  rule = cfg.rule
  count, steps, newton = tile.search_schedule(rule, int(rule.iterations), True)
  hp = {**{k: v for k, v in cfg.spec.defaults.items() if v is not None}, **cfg.hp_dict}
  return count, steps, newton, tile.jumps_at_threshold(rule, hp)


def _power(r, p: float):
  """``r^p`` for ``r > 0`` with the lowering's primitives (no ``pow``)."""
  if p == 1.0:
    return r
  if p == 0.5:
    return r * jax.lax.rsqrt(r)
  return jnp.exp(p * jnp.log(r))


def _search_update(rule, state, taus, sums, target, hp, newton: bool):
  """``tile.search_update`` on row vectors, its power written with :func:`_power`."""
  lo, hi, _ = state
  count = len(taus)
  totals = sums[:count]
  for tau, total in zip(taus, totals, strict=True):
    ok = total >= target
    lo = jnp.where(jnp.logical_and(ok, tau >= lo), tau, lo)
    hi = jnp.where(ok, hi, jnp.minimum(hi, tau))
  point = jnp.full_like(lo, -jnp.inf)
  if newton and rule.newton_power is not None:
    p = float(rule.newton_power(**hp))
    for tau, total, slope in zip(taus, totals, sums[count:], strict=True):
      good = jnp.logical_and(total > 0.0, slope < 0.0)
      safe_total = jnp.where(good, total, 1.0)
      step = safe_total * (1.0 - _power(target / safe_total, p)) / (
          p * jnp.where(good, slope, -1.0))
      root = tau - step
      inside = jnp.logical_and(good, jnp.logical_and(root >= lo, root <= hi))
      point = jnp.maximum(point, jnp.where(inside, root, -jnp.inf))
  return lo, hi, point


def _search(cfg: _TCfg, q, k, interpret, kv_lengths=None):
  """The search kernel on padded q [B, Tp, N, H], k [B, Sp, K, H] (and the int32 [B]
  ``kv_lengths`` when ``cfg.kv_lengths``): returns ``m``, ``tau`` (each [B, N, Tp]
  float32) and the live flags [B, N, Tp / 128, 2, nkp] int32 (one row per consumer
  warpgroup, nkp = the key blocks rounded up to 4). A CTA sweeps only the key blocks its
  rows see (``mosaic_gpu._key_block_range``); the others' flags stay 0."""
  plgpu = _plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  b, tp, n, h = q.shape
  sp, kh = k.shape[1], k.shape[2]
  groups = n // kh
  bq, bk = _BQ, cfg.block_k
  n_kv = sp // bk
  nkp = _round_up(n_kv, 4)
  stages = _STAGES
  dtype = q.dtype
  rule = cfg.rule
  hp = cfg.hp_dict
  count, steps, newton, indicator = _schedule(cfg)
  mask_cfg: Any = cfg  # (mosaic_gpu's mask helpers read left, right, masked and s: _TCfg's)
  score_map, mass = _primal(rule.score_map), _primal(rule.mass)
  slope = _primal(lambda z, t: jax.jvp(lambda t_: rule.mass(z, t_, **hp), (t,),
                                       (jnp.ones_like(t),))[1])
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = wgmma_layout.reduce(1)

  def bcast(row, shape):
    return lax.broadcast_in_dim(row, shape, [0])

  def as_row(x):  # a loop carry in the wgmma row layout (a constant is a splat otherwise)
    return plgpu.layout_cast(x, row_layout)

  def kernel(q_ref, k_ref, len_ref, m_ref, tau_ref, flag_ref, scoped):
    bi, q_head, q_tile, wg = _cta()
    (q_smem2, k_smem), (k_loaded, q_loaded), k_consumed, (st_smem, flag_smem, go_smem), \
        decided = scoped
    end = _end(cfg, len_ref, bi)
    # the key blocks [cta_lo, cta_lo + cta_steps) some row of the CTA sees (all of them
    # without a mask); every sweep runs them
    cta_lo: Any = 0
    cta_steps: Any = n_kv
    if cfg.masked:
      cta_lo, _, _, cta_hi = _key_block_range(mask_cfg, q_tile * (2 * bq), 2 * bq, bk, end)
      cta_steps = cta_hi - cta_lo

    def consumer():
      q_smem = q_smem2.at[wg]
      q_base = q_tile * (2 * bq) + wg * bq
      _fetch(plgpu, [(q_ref.at[bi, pl.ds(q_base, bq), q_head], q_smem, q_loaded.at[wg])])
      flags = flag_smem.at[wg]

      @pl.loop(0, nkp)
      def _clear(j):
        flags[j] = jnp.int32(0)

      def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=wgmma_layout)

      # the rows' visible counts |V| (a row vector): the key interval's length with a
      # mask (0 for a row that sees no key), else S
      if cfg.masked:
        length_tile = _visible_count(mask_cfg, iota(0) + q_base, end)
        length = length_tile.max(axis=1)
      else:
        length = plgpu.layout_cast(jnp.full((bq,), float(cfg.s), jnp.float32), row_layout)
        length_tile = bcast(length, (bq, bk))

      def logits(g, j):
        """The block j's scaled logits and visibility (g the global step: its slot)."""
        slot = lax.rem(g, jnp.array(stages, g.dtype))
        qk = _scores(plgpu, q_smem, k_smem.at[slot], k_loaded.at[slot], k_consumed.at[slot],
                     (bq, bk))
        qpos, k_pos = iota(0) + q_base, iota(1) + j * bk
        mask = jnp.logical_and(qpos < cfg.t, _visible(mask_cfg, qpos, k_pos, end))
        x = jnp.where(mask, qk * cfg.scale, 0.0)
        return score_map(x, length_tile, **hp), mask

      def sweep(p, body, carry):
        def step(j, carry):
          z, mask = logits(p * cta_steps + j, cta_lo + j)
          return body(cta_lo + j, z, mask, carry)
        return lax.fori_loop(0, cta_steps, step, carry)

      def drain(p):  # a skipped sweep: the ring's slots are waited on and released
        def step(j, _):
          slot = lax.rem(p * cta_steps + j, jnp.array(stages, jnp.int32))
          plgpu.barrier_wait(k_loaded.at[slot])
          plgpu.barrier_arrive(k_consumed.at[slot])
        lax.fori_loop(0, cta_steps, step, None)

      # pass 0: the row max of the visible z
      m0 = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
      m = sweep(0, lambda j, z, mask, m: jnp.maximum(
          m, jnp.where(mask, z, -jnp.inf).max(axis=1)), m0)
      nan_row = m != m
      m, state, target = tile.search_start(rule, m, length, hp)
      state = tuple(map(as_row, state))

      def real_sweep(p, state):
        lo = state[0]
        newton_pt = state[2] if newton else jnp.full_like(lo, -jnp.inf)
        taus = tile.search_candidates(lo, state[1], newton_pt, count)
        lo_b = bcast(lo, (bq, bk))
        taus_b = [bcast(c, (bq, bk)) for c in taus]

        def body(j, z, mask, sums):
          masses = [jnp.where(mask, mass(z, c, **hp), 0.0).sum(axis=1) for c in taus_b]
          slopes = ([jnp.where(mask, slope(z, c), 0.0).sum(axis=1) for c in taus_b]
                    if newton else [])
          hit = jnp.where(jnp.logical_and(mask, z >= lo_b), 1.0, 0.0).max(axis=1)
          flags[j] = (jnp.max(hit) > 0.0).astype(jnp.int32)
          return tuple(a + c for a, c in zip(sums, masses + slopes, strict=True))

        zero = as_row(jnp.zeros((bq,), jnp.float32))
        sums = sweep(p, body, (zero,) * (count * (1 + int(newton))))
        return tuple(map(as_row, _search_update(rule, state, taus, list(sums), target, hp,
                                                newton)))

      def settled(state):  # every row of the warpgroup done
        return jnp.min(jnp.where(tile.search_done(state), 1.0, 0.0)) > 0.0

      def search_step(carry):
        p, _, state = carry  # p: the sweep to run (1-based)
        run = jnp.logical_or(p == 1, jnp.logical_not(settled(state)))

        def skip(state):  # settled while the other warpgroup goes on: release its slots
          drain(p)
          return state

        state = lax.cond(run, functools.partial(real_sweep, p), skip, state)
        # the verdicts: another sweep when either warpgroup needs one (the producer reads
        # them too, and streams the next sweep's keys only then; two slots, by parity)
        verdict = lax.rem(p, jnp.int32(2))
        go_smem[verdict, wg] = jnp.where(settled(state), 0, 1).astype(jnp.int32)
        plgpu.barrier_arrive(decided)
        plgpu.barrier_wait(decided)
        more = jnp.logical_and(go_smem[verdict, 0] + go_smem[verdict, 1] > 0, p < steps)
        return p + 1, more.astype(jnp.int32), state

      p_end, _, state = lax.while_loop(lambda c: c[1] > 0, search_step,
                                       (jnp.int32(1), jnp.int32(1), state))
      tau = tile.search_threshold(state, newton)
      if indicator:
        tol = tile.GAP_TOLERANCE * (1.0 + jnp.abs(tau))
        edge = bcast(tau - tol, (bq, bk))

        def below_body(j, z, mask, below):
          under = jnp.logical_and(mask, z < edge)
          return jnp.maximum(below, jnp.where(under, z, -jnp.inf).max(axis=1))

        below = sweep(p_end, below_body, as_row(jnp.full((bq,), -jnp.inf, jnp.float32)))
        tau = tile.gap_threshold(tau, below)
      m = jnp.where(nan_row, jnp.nan, m)
      st_smem.at[0, wg][...] = m
      st_smem.at[1, wg][...] = tau
      _write_back(plgpu, [(st_smem.at[i, wg], ref.at[bi, q_head, pl.ds(q_base, bq)])
                          for i, ref in enumerate((m_ref, tau_ref))]
                  + [(flags, flag_ref.at[bi, q_head, q_tile, wg])])

    def producer():
      kv_head = _kv_head(q_head, groups)

      def load(step, slot):  # the global step's key block: cta_lo + step mod cta_steps
        block = cta_lo + lax.rem(step, jnp.maximum(jnp.asarray(cta_steps, jnp.int32), 1))
        plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(block * bk, bk), kv_head],
                                k_smem.at[slot], k_loaded.at[slot])

      def load_range(g0, g1):  # global steps [g0, g1) through the ring
        @pl.loop(g0, g1)
        def _ring(g):
          slot = lax.rem(g, jnp.array(stages, g.dtype))

          @pl.when(g >= stages)
          def _():
            plgpu.barrier_wait(k_consumed.at[slot])

          load(g, slot)

      load_range(0, 2 * cta_steps)  # the max pass and the first sweep (always run)

      def next_sweep(carry):  # after sweep p: the consumers' verdicts
        p = carry[0]
        plgpu.barrier_wait(decided)
        verdict = lax.rem(p, jnp.int32(2))
        more = jnp.logical_and(go_smem[verdict, 0] + go_smem[verdict, 1] > 0, p < steps)

        @pl.when(more)
        def _():
          load_range((p + 1) * cta_steps, (p + 2) * cta_steps)

        return p + 1, more.astype(jnp.int32)

      p_end, _ = lax.while_loop(lambda c: c[1] > 0, next_sweep, (jnp.int32(1), jnp.int32(1)))
      if indicator:  # the gap pass
        load_range(p_end * cta_steps, (p_end + 1) * cta_steps)

    _specialise(plgpu, wg, 2, consumer, producer)

  def entry(q_ref, k_ref, *refs):
    len_ref = refs[0] if cfg.kv_lengths else None
    m_ref, tau_ref, flag_ref = refs[int(cfg.kv_lengths):]
    pl.run_scoped(
        lambda *args: kernel(q_ref, k_ref, len_ref, m_ref, tau_ref, flag_ref, args),
        (_swizzled(plgpu, (2, bq, h), dtype), _swizzled(plgpu, (stages, bk, h), dtype)),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2)),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        (plgpu.SMEM((2, 2, bq), jnp.float32), plgpu.SMEM((2, nkp), jnp.int32),
         plgpu.SMEM((2, 2), jnp.int32)),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  nq = tp // (2 * bq)
  out_type = [jax.ShapeDtypeStruct((b, n, tp), jnp.float32),
              jax.ShapeDtypeStruct((b, n, tp), jnp.float32),
              jax.ShapeDtypeStruct((b, n, nq, 2, nkp), jnp.int32)]
  lens = (kv_lengths,) if cfg.kv_lengths else ()
  return _launch(plgpu, entry, out_type, (n, nq, b), ("heads", "q_seq", "batch"), 3,
                 interpret)(q, k, *lens)


def _weighted(cfg: _TCfg, q, k, v, m, tau, idx, cnt, interpret, save_w: bool = False,
              kv_lengths=None):
  """The attention pass over the live key blocks ``idx[.., :cnt]`` of each CTA (a subset of
  the blocks its rows see): returns [B, Tp, N, H] (``save_w``: and the rows' weight sums
  W, [B, N, Tp] float32)."""
  plgpu = _plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  b, tp, n, h = q.shape
  kh = k.shape[2]
  groups = n // kh
  bq, bk = _BQ, cfg.block_k
  stages = cfg.num_stages
  dtype = q.dtype
  rule = cfg.rule
  hp = cfg.hp_dict
  score_map, weight = _primal(rule.score_map), _primal(rule.weight)
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = wgmma_layout.reduce(1)

  def bcast(row, shape):
    return lax.broadcast_in_dim(row, shape, [0])

  def kernel(q_ref, k_ref, v_ref, len_ref, m_ref, tau_ref, idx_ref, cnt_ref, out_ref, w_ref,
             scoped):
    bi, q_head, q_tile, wg = _cta()
    end = _end(cfg, len_ref, bi)
    (qo_smem2, k_smem, v_smem, st_smem), loaded, consumed = scoped
    k_loaded, v_loaded, q_loaded, m_loaded, tau_loaded = loaded
    k_consumed, v_consumed = consumed
    count = cnt_ref[bi, q_head, q_tile]

    def consumer():
      qo_smem = qo_smem2.at[wg]
      q_base = q_tile * (2 * bq) + wg * bq
      q_rows = (bi, pl.ds(q_base, bq), q_head)
      _fetch(plgpu, [(q_ref.at[q_rows], qo_smem, q_loaded.at[wg])]
             + [(ref.at[bi, q_head, pl.ds(q_base, bq)], st_smem.at[i, wg], bar.at[wg])
                for i, (ref, bar) in enumerate(((m_ref, m_loaded), (tau_ref, tau_loaded)))])
      m = _load_row(plgpu, st_smem.at[0, wg], row_layout)
      tau = _load_row(plgpu, st_smem.at[1, wg], row_layout)
      m_w = tile.weight_stabiliser(m)

      def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=wgmma_layout)

      def step(i, carry):
        acc, l_i = carry
        j = idx_ref[bi, q_head, q_tile, i]
        slot = lax.rem(i, jnp.array(stages, i.dtype))
        qk = _scores(plgpu, qo_smem, k_smem.at[slot], k_loaded.at[slot], k_consumed.at[slot],
                     (bq, bk))
        mask, length = _mask_and_length(cfg, iota(0) + q_base, iota(1) + j * bk, end)
        x = jnp.where(mask, qk * cfg.scale, 0.0)
        z = jnp.where(mask, score_map(x, length, **hp), bcast(m, (bq, bk)))
        w = weight(z, bcast(tau, (bq, bk)), bcast(m_w, (bq, bk)), **hp)
        w = jnp.where(mask, w, 0.0)
        l_i = l_i + w.sum(axis=1)
        w16 = w.astype(dtype)
        plgpu.barrier_wait(v_loaded.at[slot])

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, w16, v_smem.at[slot])

        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, l_i

      acc = plgpu.layout_cast(jnp.full((bq, h), 0.0, jnp.float32), wgmma_layout)
      l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
      acc, l_i = lax.fori_loop(0, count, step, (acc, l_i))
      inv = jnp.where(l_i > 0.0, 1.0 / jnp.where(l_i > 0.0, l_i, 1.0), 0.0)
      inv = jnp.where(m != m, jnp.nan, inv)  # a NaN logit: the row is NaN
      qo_smem[...] = (acc * bcast(inv, acc.shape)).astype(dtype)
      copies = [(qo_smem, out_ref.at[q_rows])]
      if w_ref is not None:  # W for the backward, in tau's slot (tau is in registers)
        st_smem.at[1, wg][...] = l_i
        copies.append((st_smem.at[1, wg], w_ref.at[bi, q_head, pl.ds(q_base, bq)]))
      _write_back(plgpu, copies)

    def producer():
      kv_head = _kv_head(q_head, groups)

      def load(i, slot):
        j = idx_ref[bi, q_head, q_tile, i]
        sl = (bi, pl.ds(j * bk, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_loaded.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_loaded.at[slot])

      def released(slot):
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])

      _stream(0, count, stages, load, released)

    _specialise(plgpu, wg, 2, consumer, producer)

  def entry(q_ref, k_ref, v_ref, *refs):
    len_ref = refs[0] if cfg.kv_lengths else None
    m_ref, tau_ref, idx_ref, cnt_ref, out_ref, *w_ref = refs[int(cfg.kv_lengths):]
    pl.run_scoped(
        lambda *args: kernel(q_ref, k_ref, v_ref, len_ref, m_ref, tau_ref, idx_ref, cnt_ref,
                             out_ref, w_ref[0] if w_ref else None, args),
        (_swizzled(plgpu, (2, bq, h), dtype), _swizzled(plgpu, (stages, bk, h), dtype),
         _swizzled(plgpu, (stages, bk, h), dtype), plgpu.SMEM((2, 2, bq), jnp.float32)),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        collective_axes="wg",
    )

  out_type: Any = jax.ShapeDtypeStruct(q.shape, dtype)
  if save_w:
    out_type = [out_type, jax.ShapeDtypeStruct((b, n, tp), jnp.float32)]
  lens = (kv_lengths,) if cfg.kv_lengths else ()
  return _launch(plgpu, entry, out_type, (n, tp // (2 * bq), b), ("heads", "q_seq", "batch"),
                 3, interpret)(q, k, v, *lens, m, tau, idx, cnt)


def _pad(cfg: _TCfg, q, k, v):
  tp, sp = _round_up(cfg.t, 2 * _BQ), _round_up(cfg.s, cfg.block_k)
  qp = jnp.pad(q, ((0, 0), (0, tp - cfg.t), (0, 0), (0, 0)))
  kp = jnp.pad(k, ((0, 0), (0, sp - cfg.s), (0, 0), (0, 0)))
  vp = jnp.pad(v, ((0, 0), (0, sp - cfg.s), (0, 0), (0, 0)))
  return qp, kp, vp


def _blocks(cfg: _TCfg, q, k, interpret, kv_lengths=None):
  """(m, tau, idx, cnt, flags) of padded inputs: the search kernel, then the block lists
  (the flags per consumer warpgroup are the backward's)."""
  m, tau, flags = _search(cfg, q, k, interpret, kv_lengths)
  idx, cnt = engine.live_block_tables(jnp.max(flags, axis=3))
  return m, tau, idx, cnt, flags


# Where a derivative the custom VJP does not give is refused, and the way out.
_WHERE = "mosaic_gpu_attention (class T)"
_ADVICE = ("Use kernels_pallas.attention (the Triton / Mosaic-TPU engine) or "
           "jaxsoft.attention.dot_product_attention(implementation='xla'), which takes any "
           "derivative.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _attention(cfg: _TCfg, q, k, v, kv_lengths, interpret):
  qp, kp, vp = _pad(cfg, q, k, v)
  m, tau, idx, cnt, _ = _blocks(cfg, qp, kp, interpret, kv_lengths)
  return _weighted(cfg, qp, kp, vp, m, tau, idx, cnt, interpret,
                   kv_lengths=kv_lengths)[:, :cfg.t]


def _forward_saving(cfg, interpret, q, k, v, kv_lengths):
  """The forward and what the backward needs:
  ``(out, (q, k, v, kv_lengths, out, m, tau, W, flags))``."""
  qp, kp, vp = _pad(cfg, q, k, v)
  m, tau, idx, cnt, flags = _blocks(cfg, qp, kp, interpret, kv_lengths)
  out, w_sum = _weighted(cfg, qp, kp, vp, m, tau, idx, cnt, interpret, save_w=True,
                         kv_lengths=kv_lengths)
  out = out[:, :cfg.t]
  return out, (q, k, v, kv_lengths, out, m, tau, w_sum, flags)


def _attention_fwd(cfg, q, k, v, kv_lengths, interpret):
  return first_order_only(functools.partial(_forward_saving, cfg, interpret), _WHERE,
                          _ADVICE)(q, k, v, kv_lengths)


def _backward(cfg, interpret, res, g):
  q, k, v, kv_lengths, out, m, tau, w_sum, flags = res
  return threshold_backward(cfg, q, k, v, out, m, tau, w_sum, flags, g, interpret,
                            kv_lengths)


def _attention_bwd(cfg, interpret, res, g):
  dq, dk, dv = first_order_only(functools.partial(_backward, cfg, interpret), _WHERE,
                                _ADVICE)(res, g)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _cfg(spec, hp, scale, causal, t, s, block_k, num_stages, window=None,
         kv_lengths=False) -> _TCfg:
  name = getattr(spec, "name", spec)
  if name not in SUPPORTED or getattr(spec, "threshold", None) is None:
    raise UnsupportedError(
        f"mosaic_gpu_attention: `normalizer` {name!r} (class T) is not one of the class-T "
        f"rules the Mosaic-GPU threshold kernels lower: {', '.join(SUPPORTED)}")
  return _TCfg(spec=spec, hp=tuple(sorted(hp.items())), scale=float(scale),
               causal=bool(causal), t=int(t), s=int(s), block_k=int(block_k),
               num_stages=int(num_stages), window=window, kv_lengths=bool(kv_lengths))


def threshold_blocks(query, key, *, normalizer="sparsemax", normalizer_params=None,
                     scale=None, is_causal=False, block_k=128, interpret=None,
                     key_value_seq_lengths=None, local_window_size=None):
  r"""The threshold search kernel and the block lists it yields (class T, Mosaic GPU).

  Per query row ``i`` (``V_i`` its visible keys, ``z_ij = score_map(scale q_i·k_j)``):
  the row max ``m_i = max_{j in V_i} z_ij`` and the threshold ``tau_i`` solving
  ``sum_{j in V_i} mass(z_ij, tau_i) = target(|V_i|)``; per CTA of 128 query rows, the key
  blocks of ``block_k`` keys holding some visible ``z_ij >= lo_i`` (``lo_i <= tau_i``, the
  search bracket's lower end: every other block has zero weights), compacted.

  Args:
    query: ``[B, T, N, H]`` float16 or bfloat16, H in {64, 128, 256}.
    key: ``[B, S, K, H]`` of the query's dtype, ``N % K == 0``.
    normalizer: ``"sparsemax"``, ``"entmax15"`` or ``"top_k_softmax"``.
    normalizer_params: hyperparameters as Python numbers (top-k's ``k``).
    scale: the logits' scale (None: ``1 / sqrt(H)``).
    is_causal: top-left aligned causal mask.
    block_k: keys per block, a multiple of 64.
    interpret: None for the GPU, else ``InterpretGPUParams`` (``mosaic_gpu.gpu_interpret_params``).
    key_value_seq_lengths: optional int32 ``[B]``: batch entry b's rows see keys ``j < L_b``.
    local_window_size: optional ``(left, right)``: row i sees keys ``i - left .. i + right``.

  Returns:
    ``(m, tau, idx, cnt)``: ``m`` and ``tau`` ``[B, N, Tp]`` float32 (Tp = T rounded up
    to 128; ``m`` NaN on a row with a NaN logit), ``idx`` ``[B, N, Tp / 128, nkp]`` int32
    the live key blocks in increasing order (padded with the last), ``cnt``
    ``[B, N, Tp / 128]`` their number.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from kernels_pallas.mosaic_gpu_threshold import threshold_blocks
    >>> q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    >>> f = lambda q: threshold_blocks(q, q, is_causal=True)[3]
    >>> exp = jax.export.export(jax.jit(f), platforms=["cuda"])(q)  # lowers on a CPU
    >>> exp.out_avals[0].shape
    (1, 1, 1)

  References:
    N. Gonçalves, M. Treviso & A. F. T. Martins, 2025, "AdaSplash: Adaptive Sparse Flash
    Attention", arXiv:2502.12082.

    C. Michelot, 1986, "A finite algorithm for finding the projection of a point onto the
    canonical simplex of R^n" (sparsemax's Newton step).
  """
  spec = _spec.resolve(normalizer)
  h = query.shape[-1]
  scale = 1.0 / h ** 0.5 if scale is None else scale
  lengths = (None if key_value_seq_lengths is None
             else jnp.asarray(key_value_seq_lengths).astype(jnp.int32))
  window = None if local_window_size is None else tuple(map(int, local_window_size))
  cfg = _cfg(spec, dict(normalizer_params or {}), scale, is_causal, query.shape[1],
             key.shape[1], block_k, _STAGES, window, lengths is not None)
  qp, kp, _ = _pad(cfg, query, key, key)
  return _blocks(cfg, qp, kp, interpret, lengths)[:4]


def threshold_attention(query, key, value, *, spec, hp, scale: float, is_causal: bool,
                        block_k: int, num_stages: int, interpret=None,
                        rescale_threshold=None, local_window_size=None,
                        key_value_seq_lengths=None):
  r"""Class-T attention forward on Hopper: the search kernel, then the attention pass
  over the live key blocks (module docstring). ``kp.mosaic_gpu_attention`` calls it
  after validating the arguments.

  .. math::
    O_i = \frac{\sum_{j \in L_i} w(z_{ij}, \tau_i, m_i)\, v_j}{\sum_{j \in L_i}
    w(z_{ij}, \tau_i, m_i)},\quad \sum_{j \in V_i} \mathrm{mass}(z_{ij}, \tau_i)
    = \mathrm{target}(|V_i|)

  with ``L_i`` the keys of the live blocks (a superset of the support).

  Args:
    query: ``[B, T, N, H]`` float16 or bfloat16.
    key, value: ``[B, S, K, H]``.
    spec: the resolved class-T NormalizerSpec (one of :data:`SUPPORTED`).
    hp: its hyperparameters as Python numbers.
    scale: the logits' scale.
    is_causal: top-left aligned causal mask.
    block_k: keys per block.
    num_stages: the attention pass's ring slots.
    interpret: None for the GPU, else ``InterpretGPUParams``.
    rescale_threshold: not supported for class T (UnsupportedError unless None).
    local_window_size: None or ``(left, right)`` (validated by the caller): query i sees
      keys ``i - left .. i + right`` (``right = 0`` with ``is_causal``).
    key_value_seq_lengths: None or int32 ``[B]``: batch entry b's keys ``j >= L_b`` are
      seen by no query. |V_i| (top-k's ``min(k, |V_i|)``, the bracket) counts the visible
      keys only; key blocks outside a CTA's visible interval are never loaded; a row that
      sees no key gets a zero output and zero gradients.

  Returns:
    ``[B, T, N, H]`` of the query's dtype. ``jax.grad`` / ``jax.vjp`` run the class-T
    backward kernels (``kernels_pallas.mosaic_gpu_threshold_backward``); forward mode and
    second order raise ``UnsupportedDifferentiation``.

  Examples:
    >>> import jax, jax.numpy as jnp, kernels_pallas as kp
    >>> q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.float16)
    >>> f = lambda q: kp.mosaic_gpu_attention(q, q, q, normalizer="sparsemax")
    >>> mlir = jax.export.export(jax.jit(f), platforms=["cuda"])(q).mlir_module()
    >>> mlir.count("stablehlo.custom_call @mosaic_gpu")  # the search, the attention pass
    2
    >>> g = jax.grad(lambda q: f(q).astype(jnp.float32).sum())
    >>> jax.export.export(jax.jit(g), platforms=["cuda"])(q).mlir_module().count(
    ...     "stablehlo.custom_call @mosaic_gpu")  # and the dQ and dK/dV kernels
    4

  References:
    N. Gonçalves, M. Treviso & A. F. T. Martins, 2025, "AdaSplash: Adaptive Sparse Flash
    Attention", arXiv:2502.12082.

    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
    arXiv:2407.08608.
  """
  if rescale_threshold is not None:
    raise UnsupportedError(f"mosaic_gpu_attention: `rescale_threshold` is not supported for "
                           f"class T ({spec.name!r}); it must be None")
  b, t, n, h = query.shape
  window = None if local_window_size is None else (int(local_window_size[0]),
                                                   int(local_window_size[1]))
  lengths = (None if key_value_seq_lengths is None
             else jnp.asarray(key_value_seq_lengths).astype(jnp.int32))
  cfg = _cfg(spec, dict(hp), scale, is_causal, t, key.shape[1], block_k, num_stages, window,
             lengths is not None)
  refuse_unsupported_ad((query, key, value), _WHERE, _ADVICE)
  return _attention(cfg, query, key, value, lengths, interpret)


# kp.mosaic_gpu_attention routes class T here (mosaic_gpu.CLASS_KERNELS: no import cycle)
CLASS_KERNELS["T"] = threshold_attention
