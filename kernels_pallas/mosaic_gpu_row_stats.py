"""Class R (row-statistics normalizers) on the Mosaic-GPU (Hopper, sm_90a) engine.

UNVERIFIED ON HARDWARE, like ``kernels_pallas.mosaic_gpu``: lowered for CUDA by
``jax.export`` (sm_90a, 227 KiB of shared memory assumed) and run in Pallas's GPU
interpreter on a CPU, never on an H100/H200. ``kp.mosaic_gpu_attention`` routes a class-R
normalizer here.

A class-R normalizer (standardised softmax, NAP, adaptive temperature, affine, clipped,
SA-normalised, epsilon and eta truncation) needs a statistic of its whole row before any
weight; its spec carries a :class:`~jaxsoft.normalizers.RowStatsRule`. As on the Triton /
Mosaic-TPU engine (``kernels_pallas.row_stats``), attention is a composition, with no
``T x S`` buffer anywhere. For a query row i with scaled logits ``x_ij = scale q_i·k_j``
over its visible keys ``V_i``::

    stats_i = merge over the key blocks B of block(x_iB, visible)     (statistics kernel)
    theta_i = derive(stats_i, |V_i|, **hp)                            (XLA, per row)
    O_i     = the E/P tile rule ``second`` with hyperparameters hp + theta_i
                                                                      (the forward kernel)

1. **Statistics kernel.** A CTA owns ``2 x 64`` query rows of one (batch, head): a TMA
   producer warpgroup streams the key tiles the rows see (the forward's block list,
   ``mosaic_gpu._key_block_range``) through a ring, two consumer warpgroups compute
   ``Q K^T`` with ``wgmma`` and fold ``rule.block`` of each tile into their rows'
   statistics with ``rule.merge`` (every block masked: the padded keys, the causal
   diagonal, the window, the key lengths and the segment ids, whose band tables narrow
   the streamed blocks as in ``mosaic_gpu``). The rule's functions are written for
   ``[rows, 1]`` statistics (``keepdims`` sums over the key axis); the kernel holds them
   as ``[64]`` vectors in the wgmma row layout, so they are traced once and evaluated
   with every ``[rows, 1]`` value kept as its ``[rows]`` vector (:func:`_rowwise`).
2. ``derive`` in XLA on the ``[B, N, Tp]`` statistics and the rows' visible counts
   (with segment ids, the counts ``mosaic_gpu._segment_counts`` sums in XLA).
3. The forward kernel of ``kernels_pallas.mosaic_gpu`` running ``second`` (class E: the
   running max and row sum; class P: nothing carried), with the derived values as per-row
   operands (``_Cfg.row_hp``: each a ``[B, N, Tp]`` float32 array whose ``[64]`` slice a
   consumer warpgroup brings into shared memory next to its query tile and broadcasts to
   each ``[64, block_k]`` tile of logits).

Both kernels run the same key blocks with the same ``block_k``, so the forward recomputes
exactly the statistics pass's tiles (the rules that compare logits with a row's extremes,
``row_blocks.RECOMPUTE_TOLERANCE``, allow a few ulps in any case).

Backward (as ``kernels_pallas.row_stats`` on the other engines; the weights depend on x
directly, at fixed theta, and through the statistics). With ``dP_ij = dO_i·v_j`` and
``Δ_i = dO_i·O_i``:

4. **dQ sweep of the second pass** (``mosaic_gpu._bwd_dq`` with the derived rows as
   operands): ``dQ`` at fixed theta, and in the same sweep the cotangents of theta,
   ``dθ_i = sum_j (∂num_ij/∂θ dP_ij - ∂den_ij/∂θ Δ_i) / D_i`` (class P: ``∂num_ij/∂θ
   dP_ij``), the partial derivatives through the score map too
   (``mosaic_gpu._bwd_tile_fn``).
5. ``g = vjp(derive)(dθ)`` in XLA: the statistics' cotangents (0 on a row that sees no key
   and on the padded rows).
6. **The statistics' dQ sweep** (:func:`stats_dq`, the statistics kernel's CTA with a
   third matmul): ``dQ_i += scale sum_j ds_ij k_j`` with the tile cotangent
   ``ds = vjp(rule.tangent)(g)`` at the final statistics.
7. **dK/dV sweep of the second pass** (``mosaic_gpu._bwd_dkv``): the statistics and ``g``
   stream with each query block next to theta, and ``ds`` is added to each tile's ``dx``
   before ``dK += dx^T Q``.

``rule.tangent`` is a per-row sum over the key axis of elementwise terms, so its
derivative at one logit is the same function traced on a single element: the kernels
evaluate that trace on whole tiles (:func:`_elementwise`), with the statistics broadcast
along the rows (dQ) or the columns (dK/dV, keys as rows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft.attention.differentiation import first_order_only
from jaxsoft.normalizers import spec as _spec
from kernels_pallas import mosaic_gpu as mga
from kernels_pallas.engine import UnsupportedError
from kernels_pallas.mosaic_gpu import (
    _INLINE,
    SEG_BAND,
    _band,
    _Cfg,
    _clip_to_band,
    _cta,
    _fetch,
    _forward,
    _key_block_range,
    _kv_head,
    _launch,
    _load_row,
    _merge_bands,
    _or_nones,
    _plgpu,
    _round_up,
    _scores,
    _seg_same,
    _segment_operands,
    _SegOps,
    _slot,
    _specialise,
    _stream,
    _swizzled,
    _transposed,
    _visible,
    _visible_count,
    _within,
    _write_back,
)

__all__ = ["row_stats_attention", "row_stats"]


# --- the rules' [rows, 1] statistics as [rows] vectors -----------------------------------


def _as_rows(shape) -> tuple[int, ...]:
  """The shape a value of the traced shape ``shape`` has in the kernel: ``[r, 1]`` is held
  as ``[r]`` (the wgmma row layout has no trailing unit axis)."""
  shape = tuple(shape)
  return shape[:1] if len(shape) == 2 and shape[1] == 1 else shape


_SHAPE_OPS = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy",
              "copy_p")


def _eval_rowwise(jaxpr, consts, args, tile=None):
  """Evaluates ``jaxpr`` (traced on ``[r, c]`` tiles and ``[r, 1]`` statistics) on values
  of the shapes :func:`_as_rows` gives: a ``keepdims`` reshape or broadcast to ``[r, 1]``
  is the identity, a broadcast of ``[r, 1]`` to ``[r, c]`` one of ``[r]`` along the rows, a
  reduction over the unit axis the identity; custom derivatives and nested jits are
  inlined (``mosaic_gpu._INLINE``), ``is_finite(x)`` is ``|x| < inf`` and
  ``stop_gradient`` the identity (neither has a Mosaic-GPU lowering rule).

  ``tile``: for a function traced on one element (every value of size 1,
  :func:`_elementwise`), the shape of the tiles it is evaluated on: every reduction,
  reshape and broadcast is then the identity (a scalar operand of an elementwise op is
  broadcast to the tile)."""
  from jax import lax
  from jax.extend import core as jex_core

  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    field = _INLINE.get(name)
    inner = eqn.params.get(field) if field else None
    out_shape = _as_rows(eqn.outvars[0].aval.shape) if eqn.outvars else ()
    x: Any = invals[0] if invals else None
    if inner is not None:
      if hasattr(inner, "jaxpr"):
        outs = _eval_rowwise(inner.jaxpr, inner.consts, invals, tile)
      else:
        outs = _eval_rowwise(inner, (), invals, tile)
    elif tile is not None and (name.startswith("reduce_") or name in _SHAPE_OPS):
      outs = [x]  # (one element: the same element)
    elif name == "broadcast_in_dim":
      if jnp.shape(x) == out_shape:
        outs = [x]
      elif jnp.ndim(x) == 0:
        outs = [lax.broadcast_in_dim(x, out_shape, ())]
      else:  # [r] (a [r, 1] or [r] value) along the rows of [r, c]
        outs = [lax.broadcast_in_dim(x, out_shape, (0,))]
    elif (name in ("reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p")
          and jnp.shape(x) == out_shape):
      outs = [x]
    elif name.startswith("reduce_") and jnp.shape(x) == out_shape:  # over the unit axis
      outs = [x]
    elif name == "is_finite":
      outs = [jnp.abs(x) < jnp.inf]
    elif name == "stop_gradient":
      outs = [x]
    elif name == "add_any":
      outs = [lax.add(*invals)]
    else:
      if tile is not None and any(jnp.ndim(a) for a in invals):
        invals = [a if jnp.ndim(a) else lax.broadcast_in_dim(a, tile, ()) for a in invals]
      elif tile is None and len(out_shape) == 2:  # an elementwise op of [r, c] with [r, 1] (jaxprs broadcast
        # unit axes implicitly): the [r] vector broadcast along the rows
        invals = [lax.broadcast_in_dim(a, out_shape, (0,)) if jnp.ndim(a) == 1 else a
                  for a in invals]
      outs = eqn.primitive.bind(*invals, **eqn.params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def _elementwise(fn, n_args: int, masked: bool):
  """``fn(x, mask, *rows)`` (each argument one element, or for the mask absent when not
  ``masked``) traced on ``[1, 1]`` values and evaluated on whole tiles: a function of
  ``rule.tangent``'s kind (per-row sums over the key axis of elementwise terms) is then
  its per-element term (a row of one key sums nothing), in either tile orientation."""
  one = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  if masked:
    closed = jax.make_jaxpr(fn)(one, jax.ShapeDtypeStruct((1, 1), jnp.bool_),
                                *[one] * n_args)
  else:
    closed = jax.make_jaxpr(lambda x, *rows: fn(x, jnp.ones((1, 1), bool), *rows))(
        one, *[one] * n_args)
  consts = [jnp.reshape(c, ()) if jnp.size(c) == 1 else c for c in closed.consts]

  def call(x, mask, *rows):
    tile = jnp.shape(x)
    args = [x] + ([mask] if masked else []) + list(rows)
    out = _eval_rowwise(closed.jaxpr, consts, args, tile)[0]
    return out if jnp.ndim(out) else jax.lax.broadcast_in_dim(out, tile, ())
  return call


def _rowwise(fn, *avals):
  """``fn`` traced on ``avals`` (``[r, c]`` tiles, ``[r, 1]`` statistics), evaluated on
  the kernel's values (:func:`_eval_rowwise`): returns a function of those values giving
  ``fn``'s flat outputs."""
  closed = jax.make_jaxpr(fn)(*avals)

  def call(*args):
    return tuple(_eval_rowwise(closed.jaxpr, closed.consts, list(args)))
  return call


# --- the statistics kernel -------------------------------------------------------------------


def _rule(cfg: _Cfg) -> _spec.RowStatsRule:
  return cfg.spec.row_stats


def _init_values(rule: _spec.RowStatsRule) -> tuple[float, ...]:
  """The statistics of an empty row, as Python numbers (one per statistic)."""
  with jax.ensure_compile_time_eval():
    return tuple(float(jnp.reshape(a, (-1,))[0]) for a in rule.init((1, 1), jnp.float32))


def _key_ranks(plgpu, ks_scoped, slot, layout):
  """A step's key segment ranks (``[bk]`` in ``layout``) from the ring's slot, read and
  fenced before the slot is released (None without segments); every step waits its
  barrier, so that the barrier's phases are waited in order."""
  if not ks_scoped:
    return None
  ks_smem, ks_loaded = ks_scoped
  plgpu.barrier_wait(ks_loaded.at[slot])
  ranks = _load_row(plgpu, ks_smem.at[slot], layout)
  plgpu.commit_smem()  # the reads ordered before the slot's next TMA write
  return ranks


def _seg_mask(mask, seg_row, key_ranks, shape):
  """``mask`` and the segment test of a ``[bq, bk]`` tile (rows: ``seg_row``, keys:
  ``key_ranks``), or ``mask`` without segments."""
  if key_ranks is None:
    return mask
  from jax import lax
  return _seg_same(mask, lax.broadcast_in_dim(seg_row, shape, [0]),
                   lax.broadcast_in_dim(key_ranks, shape, [1]))


def _seg_scratch(plgpu, cfg: _Cfg, stages: int, bk: int):
  """The key ranks' ring (``[stages, bk]`` float32, a barrier per slot) with segments."""
  if not cfg.segments:
    return ()
  return (plgpu.SMEM((stages, bk), jnp.float32), plgpu.Barrier(num_barriers=stages))


def row_stats(cfg: _Cfg, q, k, interpret, kv_lengths=None,
              seg: _SegOps | None = None) -> tuple:
  """The statistics kernel on padded inputs q [B, Tp, N, H], k [B, Sp, K, H] (Tp a
  multiple of ``2 cfg.block_q``, Sp of ``cfg.block_k``): the rule's statistics of every
  query row, each [B, N, Tp] float32 (module docstring, step 1). ``seg``: the segment
  operands when ``cfg.segments`` (the rows' ranks fetched with the query tile, the keys'
  streamed with the key tiles, the bands' ranges intersected with the mask's)."""
  plgpu = _plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  b, tp, n, h = q.shape
  sp, kh = k.shape[1], k.shape[2]
  groups = n // kh
  bq, bk = cfg.block_q, cfg.block_k
  stages = min(cfg.num_stages, sp // bk)
  dtype = q.dtype
  rule = _rule(cfg)
  init = _init_values(rule)
  size = len(init)
  layout = plgpu.Layout.WGMMA
  row_layout = layout.reduce(1)
  tile_aval = jax.ShapeDtypeStruct((bq, bk), jnp.float32)
  mask_aval = jax.ShapeDtypeStruct((bq, bk), jnp.bool_)
  row_aval = jax.ShapeDtypeStruct((bq, 1), jnp.float32)
  block = _rowwise(lambda x, mask: tuple(rule.block(x, mask)), tile_aval, mask_aval)
  merge = _rowwise(lambda *ab: tuple(rule.merge(tuple(ab[:size]), tuple(ab[size:]))),
                   *[row_aval] * (2 * size))
  col_layout = layout.reduce(0)
  n_bands = tp // SEG_BAND

  def kernel(q_ref, k_ref, len_ref, seg_refs, st_refs, scoped):
    (q_smem2, k_smem, st_smem), (q_loaded, k_loaded), consumed, seg_scoped, ks_scoped = scoped
    qseg_ref, kseg_ref, bands_ref = _or_nones(seg_refs, 3)
    bi, q_head, q_tile, wg = _cta()

    def band_of(band):
      return None if bands_ref is None else _band(bands_ref, bi, band, n_bands)

    end: Any = cfg.s if len_ref is None else jnp.clip(len_ref[bi], 0, cfg.s)
    cta_seg = None if bands_ref is None else \
        _merge_bands([band_of(2 * q_tile), band_of(2 * q_tile + 1)])
    cta_lo, _, _, cta_hi = _clip_to_band(
        _key_block_range(cfg, q_tile * (2 * bq), 2 * bq, bk, end), cta_seg, bk)
    slot_of = functools.partial(_slot, lo=cta_lo, stages=stages)

    def consumer():
      q_smem = q_smem2.at[wg]
      q_base = q_tile * (2 * bq) + wg * bq
      _fetch(plgpu, [(q_ref.at[bi, pl.ds(q_base, bq), q_head], q_smem, q_loaded.at[wg])]
             + ([(qseg_ref.at[bi, q_head, pl.ds(q_base, bq)], seg_scoped[0].at[wg],
                  seg_scoped[1].at[wg])] if qseg_ref is not None else []))
      seg_row = None if qseg_ref is None else _load_row(plgpu, seg_scoped[0].at[wg], row_layout)
      lo, _, _, hi = _within(_clip_to_band(_key_block_range(cfg, q_base, bq, bk, end),
                                           band_of(2 * q_tile + wg), bk), cta_lo, cta_hi)

      def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=layout)

      def step(kv_step, stats):
        slot = slot_of(kv_step)
        key_ranks = _key_ranks(plgpu, ks_scoped, slot, col_layout)
        qk = _scores(plgpu, q_smem, k_smem.at[slot], k_loaded.at[slot], consumed.at[slot],
                     (bq, bk))
        mask = _seg_mask(_visible(cfg, iota(0) + q_base, iota(1) + kv_step * bk, end),
                         seg_row, key_ranks, (bq, bk))
        x = jnp.where(mask, qk * cfg.scale, 0.0)
        return merge(*stats, *block(x, mask))

      def flush(kv_step, _):
        # a block the producer loaded for the other warpgroup only: waited on, released
        slot = slot_of(kv_step)
        plgpu.barrier_wait(k_loaded.at[slot])
        if ks_scoped:
          plgpu.barrier_wait(ks_scoped[1].at[slot])
        plgpu.barrier_arrive(consumed.at[slot])

      stats = tuple(plgpu.layout_cast(jnp.full((bq,), v, jnp.float32), row_layout)
                    for v in init)
      if cfg.left is not None or cfg.segments:  # (the rows of warpgroup 1 start later)
        lax.fori_loop(cta_lo, lo, flush, None)
      stats = lax.fori_loop(lo, hi, step, stats)
      if cfg.right is not None or cfg.segments:  # (the rows of warpgroup 0 stop earlier)
        lax.fori_loop(hi, cta_hi, flush, None)
      for i, val in enumerate(stats):
        st_smem.at[i, wg][...] = val
      _write_back(plgpu, [(st_smem.at[i, wg], st_ref.at[bi, q_head, pl.ds(q_base, bq)])
                          for i, st_ref in enumerate(st_refs)])

    def producer():
      kv_head = _kv_head(q_head, groups)

      def load(step, slot):
        plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(step * bk, bk), kv_head], k_smem.at[slot],
                                k_loaded.at[slot])
        if ks_scoped:
          plgpu.copy_gmem_to_smem(kseg_ref.at[bi, pl.ds(step * bk, bk)], ks_scoped[0].at[slot],
                                  ks_scoped[1].at[slot])

      _stream(cta_lo, cta_hi, stages, load, lambda slot: plgpu.barrier_wait(consumed.at[slot]))

    _specialise(plgpu, wg, 2, consumer, producer)

  n_seg = 3 * int(cfg.segments)

  def entry(q_ref, k_ref, *refs):
    len_ref = refs[0] if cfg.kv_lengths else None
    refs = refs[int(cfg.kv_lengths):]
    seg_refs, st_refs = refs[:n_seg], refs[n_seg:]
    pl.run_scoped(
        lambda *args: kernel(q_ref, k_ref, len_ref, seg_refs, st_refs, args),
        (_swizzled(plgpu, (2, bq, h), dtype), _swizzled(plgpu, (stages, bk, h), dtype),
         plgpu.SMEM((size, 2, bq), jnp.float32)),
        (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages)),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ((plgpu.SMEM((2, bq), jnp.float32), plgpu.Barrier(num_barriers=2))
         if cfg.segments else ()),
        _seg_scratch(plgpu, cfg, stages, bk),
        collective_axes="wg",
    )

  if (seg is None) == cfg.segments:
    raise ValueError("row_stats: the segment operands go with `cfg.segments`")
  out = [jax.ShapeDtypeStruct((b, n, tp), jnp.float32) for _ in range(size)]
  lens = (kv_lengths,) if cfg.kv_lengths else ()
  segs = () if seg is None else (seg.q_row, seg.k_ids, seg.key_bands)
  return tuple(_launch(plgpu, entry, out, (n, tp // (2 * bq), b),
                       ("heads", "q_seq", "batch"), 3, interpret)(q, k, *lens, *segs))


def _tangent_fn(cfg: _Cfg, masked: bool):
  """``ds(x, mask, *stats, *g)``: one tile's logit cotangent from the statistics'
  cotangents ``g`` at the row's final statistics, ``vjp(rule.tangent)(g)`` (as
  ``kernels_pallas.row_stats.tangent_tile``), evaluated elementwise (:func:`_elementwise`)
  so that the statistics may be broadcast along either tile axis; 0 off the mask."""
  rule = _rule(cfg)
  size = len(_init_values(rule))

  def fn(x, mask, *rows):
    stats, g = tuple(rows[:size]), tuple(rows[size:])
    _, vjp = jax.vjp(lambda x_: tuple(rule.tangent(x_, mask, stats)), x)
    return vjp(g)[0]

  call = _elementwise(fn, 2 * size, masked)

  def ds(x, mask, rows):
    if mask is not None:
      x = jnp.where(mask, x, 0.0)
    out = call(x, mask, *rows)
    return out if mask is None else jnp.where(mask, out, 0.0)
  return ds


def stats_dq(cfg: _Cfg, q, k, stats, g, interpret, kv_lengths=None,
             seg: _SegOps | None = None):
  """The statistics' own dQ on padded inputs (q [B, Tp, N, H], k [B, Sp, K, H], Sp a
  multiple of 64): ``dQ_i = scale sum_j ds_ij k_j`` with ``ds`` the tile cotangent of
  :func:`_tangent_fn` from the statistics and their cotangents ``g`` (each [B, N, Tp]).
  The statistics kernel's CTA (two consumer warpgroups of 64 rows, key tiles through a
  TMA ring), with a third matmul ``ds K`` on the tensor cores; [B, Tp, N, H] of q's dtype.
  ``seg``: the segment operands (keys padded as k) when ``cfg.segments``."""
  plgpu = _plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  b, tp, n, h = q.shape
  sp, kh = k.shape[1], k.shape[2]
  groups = n // kh
  bq = bk = 64
  stages = min(2, sp // bk)
  dtype = q.dtype
  size = len(stats)
  layout = plgpu.Layout.WGMMA
  row_layout = layout.reduce(1)
  ds_of = _tangent_fn(cfg, masked=True)
  col_layout = layout.reduce(0)
  n_bands = tp // SEG_BAND
  n_rows = 2 * size + int(cfg.segments)  # (the rows' segment ranks last)

  def kernel(q_ref, k_ref, len_ref, row_refs, seg_refs, dq_ref, scoped):
    (q_smem2, k_smem, row_smem), (q_loaded, row_loaded, k_loaded), consumed, ks_scoped = scoped
    kseg_ref, bands_ref = _or_nones(seg_refs, 2)
    bi, q_head, q_tile, wg = _cta()

    def band_of(band):
      return None if bands_ref is None else _band(bands_ref, bi, band, n_bands)

    end: Any = cfg.s if len_ref is None else jnp.clip(len_ref[bi], 0, cfg.s)
    cta_seg = None if bands_ref is None else \
        _merge_bands([band_of(2 * q_tile), band_of(2 * q_tile + 1)])
    cta_lo, _, _, cta_hi = _clip_to_band(
        _key_block_range(cfg, q_tile * (2 * bq), 2 * bq, bk, end), cta_seg, bk)
    slot_of = functools.partial(_slot, lo=cta_lo, stages=stages)

    def consumer():
      q_smem = q_smem2.at[wg]
      q_base = q_tile * (2 * bq) + wg * bq
      sl = (bi, pl.ds(q_base, bq), q_head)
      _fetch(plgpu, [(q_ref.at[sl], q_smem, q_loaded.at[wg])]
             + [(r.at[bi, q_head, pl.ds(q_base, bq)], row_smem.at[i, wg],
                 row_loaded.at[2 * i + wg]) for i, r in enumerate(row_refs)])
      rows = [_load_row(plgpu, row_smem.at[i, wg], row_layout) for i in range(n_rows)]
      seg_row = rows[2 * size] if cfg.segments else None
      rows = rows[:2 * size]
      lo, _, _, hi = _within(_clip_to_band(_key_block_range(cfg, q_base, bq, bk, end),
                                           band_of(2 * q_tile + wg), bk), cta_lo, cta_hi)

      def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=layout)

      def step(kv_step, dq_acc):
        slot = slot_of(kv_step)
        key_ranks = _key_ranks(plgpu, ks_scoped, slot, col_layout)
        plgpu.barrier_wait(k_loaded.at[slot])

        def compute_s(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, _transposed(plgpu, k_smem.at[slot]))
          return acc_ref[...]

        s = pl.run_scoped(compute_s, plgpu.ACC((bq, bk), jnp.float32))
        mask = _seg_mask(_visible(cfg, iota(0) + q_base, iota(1) + kv_step * bk, end),
                         seg_row, key_ranks, (bq, bk))
        ds = ds_of(s * cfg.scale, mask,
                   [lax.broadcast_in_dim(r, (bq, bk), [0]) for r in rows])

        def compute_dq(acc_ref):
          plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

        dq_acc = pl.run_state(compute_dq)(plgpu.ACC.init(dq_acc))
        plgpu.barrier_arrive(consumed.at[slot])
        return dq_acc

      def flush(kv_step, _):
        slot = slot_of(kv_step)
        plgpu.barrier_wait(k_loaded.at[slot])
        if ks_scoped:
          plgpu.barrier_wait(ks_scoped[1].at[slot])
        plgpu.barrier_arrive(consumed.at[slot])

      dq_acc = plgpu.layout_cast(jnp.full((bq, h), 0.0, jnp.float32), layout)
      if cfg.left is not None or cfg.segments:  # (the rows of warpgroup 1 start later)
        lax.fori_loop(cta_lo, lo, flush, None)
      dq_acc = lax.fori_loop(lo, hi, step, dq_acc)
      if cfg.right is not None or cfg.segments:  # (the rows of warpgroup 0 stop earlier)
        lax.fori_loop(hi, cta_hi, flush, None)
      q_smem[...] = (dq_acc * cfg.scale).astype(dtype)
      _write_back(plgpu, [(q_smem, dq_ref.at[sl])])

    def producer():
      kv_head = _kv_head(q_head, groups)

      def load(step, slot):
        plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(step * bk, bk), kv_head], k_smem.at[slot],
                                k_loaded.at[slot])
        if ks_scoped:
          plgpu.copy_gmem_to_smem(kseg_ref.at[bi, pl.ds(step * bk, bk)], ks_scoped[0].at[slot],
                                  ks_scoped[1].at[slot])

      _stream(cta_lo, cta_hi, stages, load, lambda slot: plgpu.barrier_wait(consumed.at[slot]))

    _specialise(plgpu, wg, 2, consumer, producer)

  n_seg = 2 * int(cfg.segments)

  def entry(q_ref, k_ref, *refs):
    len_ref = refs[0] if cfg.kv_lengths else None
    refs = refs[int(cfg.kv_lengths):]
    row_refs, refs = refs[:n_rows], refs[n_rows:]
    seg_refs, dq_ref = refs[:n_seg], refs[n_seg]
    pl.run_scoped(
        lambda *args: kernel(q_ref, k_ref, len_ref, row_refs, seg_refs, dq_ref, args),
        (_swizzled(plgpu, (2, bq, h), dtype), _swizzled(plgpu, (stages, bk, h), dtype),
         plgpu.SMEM((n_rows, 2, bq), jnp.float32)),
        (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2 * n_rows),
         plgpu.Barrier(num_barriers=stages)),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        _seg_scratch(plgpu, cfg, stages, bk),
        collective_axes="wg",
    )

  if (seg is None) == cfg.segments:
    raise ValueError("stats_dq: the segment operands go with `cfg.segments`")
  lens = (kv_lengths,) if cfg.kv_lengths else ()
  segs = () if seg is None else (seg.q_row, seg.k_ids, seg.key_bands)
  return _launch(plgpu, entry, jax.ShapeDtypeStruct(q.shape, dtype), (n, tp // (2 * bq), b),
                 ("heads", "q_seq", "batch"), 3, interpret)(q, k, *lens, *stats, *g, *segs)


# --- the composition ---------------------------------------------------------------------------


def _row_lengths(cfg: _Cfg, b: int, n: int, tp: int, kv_lengths, seg: _SegOps | None = None):
  """Every query row's visible key count, [B, N, Tp] float32 (what ``derive`` takes; with
  segments the operands' counts)."""
  if seg is not None:
    return seg.count
  i = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, n, tp))
  end: Any = cfg.s
  if kv_lengths is not None:
    end = jnp.clip(kv_lengths, 0, cfg.s).astype(jnp.int32)[:, None, None]
  return jnp.broadcast_to(jnp.asarray(_visible_count(cfg, i, end), jnp.float32), (b, n, tp))


def derived_rows(cfg: _Cfg, stats, lengths) -> tuple[tuple[str, ...], tuple]:
  """``(names, rows)``: ``derive``'s per-row hyperparameters of the statistics (sorted by
  name, each [B, N, Tp] float32); ValueError when one shadows a declared hyperparameter."""
  theta = _rule(cfg).derive(tuple(stats), lengths, **cfg.hp_dict)
  names = tuple(sorted(theta))
  clash = set(names) & set(cfg.hp_dict)
  if clash:
    raise ValueError(f"mosaic_gpu_attention: normalizer {cfg.spec.name!r}: derived "
                     f"hyperparameters {sorted(clash)} shadow declared ones")
  shape = lengths.shape
  return names, tuple(jnp.broadcast_to(jnp.asarray(theta[nm], jnp.float32), shape)
                      for nm in names)


def _padded(cfg: _Cfg, q, k, v):
  tp, sp = _round_up(cfg.t, 2 * cfg.block_q), _round_up(cfg.s, cfg.block_k)
  pad = lambda x, m: jnp.pad(x, ((0, 0), (0, m - x.shape[1]), (0, 0), (0, 0)))
  return pad(q, tp), pad(k, sp), pad(v, sp)


def _prepare(cfg: _Cfg, q, k, v, kv_lengths, segment_ids, interpret):
  """The statistics kernel and ``derive``: ``(second pass's cfg, padded q, k, v, stats,
  lengths, derived rows, segment operands)``."""
  qp, kp, vp = _padded(cfg, q, k, v)
  b, tp, n, _ = qp.shape
  seg = _segment_operands(cfg, segment_ids, n, tp, kp.shape[1], kv_lengths, query_bands=False)
  stats = row_stats(cfg, qp, kp, interpret, kv_lengths, seg)
  lengths = _row_lengths(cfg, b, n, tp, kv_lengths, seg)
  names, rows = derived_rows(cfg, stats, lengths)
  return dataclasses.replace(cfg, row_hp=names), qp, kp, vp, stats, lengths, rows, seg


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _attention(cfg: _Cfg, q, k, v, kv_lengths, segment_ids, interpret):
  second, qp, kp, vp, _, _, rows, seg = _prepare(cfg, q, k, v, kv_lengths, segment_ids,
                                                 interpret)
  return _forward(second, qp, kp, vp, interpret, kv_lengths=kv_lengths, rows=rows,
                  seg=seg)[:, :cfg.t]


def _attention_fwd(cfg, q, k, v, kv_lengths, segment_ids, interpret):
  return first_order_only(functools.partial(_forward_saving, cfg, interpret),
                          mga.DIFFERENTIATION_WHERE, mga.DIFFERENTIATION_ADVICE)(
                              q, k, v, kv_lengths, segment_ids)


def _forward_saving(cfg, interpret, q, k, v, kv_lengths, segment_ids):
  second, qp, kp, vp, stats, _, rows, seg = _prepare(cfg, q, k, v, kv_lengths, segment_ids,
                                                     interpret)
  out, saved = _forward(second, qp, kp, vp, interpret, save_stats=True, kv_lengths=kv_lengths,
                        rows=rows, seg=seg)
  out = out[:, :cfg.t]
  return out, (q, k, v, kv_lengths, segment_ids, out, stats, rows, saved)


def _tangent(cfg: _Cfg):
  """``extra(x, mask, rows)`` for ``mosaic_gpu._bwd_dkv``: :func:`_tangent_fn` of a masked
  or an unmasked (``mask`` None) tile."""
  fns = {True: _tangent_fn(cfg, True), False: _tangent_fn(cfg, False)}
  return lambda x, mask, rows: fns[mask is not None](x, mask, rows)


def _attention_bwd(cfg, interpret, res, g):
  return first_order_only(functools.partial(_backward, cfg, interpret),
                          mga.DIFFERENTIATION_WHERE, mga.DIFFERENTIATION_ADVICE)(res, g)


def _backward(cfg, interpret, res, g):
  """Class R's backward (module docstring): the second pass's dQ sweep, which also sums
  the derived hyperparameters' cotangents dθ; ``vjp(derive)`` in XLA turns them into the
  statistics' cotangents; the statistics' dQ sweep (:func:`stats_dq`); the dK/dV sweep of
  the second pass with the statistics' tile cotangent added to each ``dx``."""
  q, k, v, kv_lengths, segment_ids, out, stats, rows, saved = res
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  dtype = q.dtype
  tp = stats[0].shape[-1]
  wgs = mga._bwd_wgs(h)
  sp = _round_up(s, wgs * mga.BWD_BLOCK)
  seg = _segment_operands(cfg, segment_ids, n, tp, sp, kv_lengths)
  lengths = _row_lengths(cfg, b, n, tp, kv_lengths, seg)
  names, theta_of = _theta_fn(cfg, lengths)
  second = dataclasses.replace(cfg, row_hp=names)
  g = g.astype(dtype)
  pad_t = ((0, 0), (0, tp - t), (0, 0), (0, 0))
  pad_s = ((0, 0), (0, sp - s), (0, 0), (0, 0))
  qp, dop = jnp.pad(q, pad_t), jnp.pad(g, pad_t)
  kp, vp = jnp.pad(k, pad_s), jnp.pad(v, pad_s)
  base = tuple(saved)
  if second.kind != "P":  # Δ_i = dO_i · O_i (float32), 0 on the padded rows
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), g.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    base = base + (jnp.pad(delta, ((0, 0), (0, 0), (0, tp - t))),)
  _check_smem(second, h, dtype, len(base) + len(rows), 2 * len(stats))
  dq2, dtheta = mga._bwd_dq(second, qp, kp, vp, dop, base + rows, interpret, kv_lengths,
                            theta_grad=True, seg=seg)
  # the statistics' cotangents, 0 on rows that see no key and on the padded rows
  _, pull = jax.vjp(theta_of, tuple(stats))
  (gs,) = pull(tuple(dtheta))
  live = (lengths > 0) & (jnp.arange(tp) < t)[None, None, :]
  gs = tuple(jnp.where(live, x, 0.0) for x in gs)
  dq1 = stats_dq(cfg, qp, kp, tuple(stats), gs, interpret, kv_lengths, seg)
  dk, dv = mga._bwd_dkv(second, qp, kp, vp, dop, base + rows + tuple(stats) + gs, interpret,
                        kv_lengths, extra_fn=_tangent(cfg), seg=seg)
  dq = (dq2.astype(jnp.float32) + dq1.astype(jnp.float32))[:, :t].astype(dtype)
  groups = n // kh

  def head_sum(x):  # [B, Sp, N, H] -> [B, S, K, H]: each key head's query heads summed
    x = x[:, :s].reshape(b, s, kh, groups, h)
    return x.astype(jnp.float32).sum(axis=3).astype(dtype) if groups > 1 else x[:, :, :, 0]

  return dq, head_sum(dk), head_sum(dv), None, mga._no_cotangent(segment_ids)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _theta_fn(cfg: _Cfg, lengths):
  """``(names, theta_of)``: the derived hyperparameters' names and ``stats -> rows``."""
  with jax.ensure_compile_time_eval():
    names = tuple(sorted(jax.eval_shape(
        lambda l: _rule(cfg).derive(tuple(jnp.zeros_like(l) for _ in
                                          _init_values(_rule(cfg))), l, **cfg.hp_dict),
        lengths)))
  return names, lambda stats: derived_rows(cfg, stats, lengths)[1]


def _check_smem(second: _Cfg, h: int, dtype, n_rows: int, n_tangent: int) -> None:
  """ValueError when a backward kernel's shared memory (the tiles and the float32 rows it
  streams, ``mosaic_gpu.bwd_smem_bytes``'s count) leaves less than ``SMEM_SLACK`` free."""
  item = jnp.dtype(dtype).itemsize
  w, blk, stages = mga._bwd_wgs(h), mga.BWD_BLOCK, mga.BWD_STAGES
  tiles = item * h * (2 * w * blk + 2 * stages * blk)
  need = max(tiles + 4 * (n_rows + len(second.row_hp)) * w * blk,
             tiles + 4 * (n_rows + n_tangent) * stages * blk)
  if need + mga.SMEM_SLACK > mga.SMEM_LIMIT:
    raise ValueError(f"mosaic_gpu_attention: the class-R backward at head dim {h} needs "
                     f"{need} bytes of shared memory, over Hopper's {mga.SMEM_LIMIT}")


def _check(spec) -> None:
  rule = getattr(spec, "row_stats", None)
  if rule is None or rule.second is None or rule.second.kernel_class not in ("E", "P"):
    raise UnsupportedError(
        f"mosaic_gpu_attention: `normalizer` {spec.name!r} (class R) has no row-statistics "
        "rule with an E or P second pass; it runs in kernels_pallas.attention only")


def row_stats_attention(cfg: _Cfg, query, key, value, kv_lengths, segment_ids, interpret):
  r"""Class-R attention on Hopper: the statistics kernel, ``derive`` in XLA, then the
  forward kernel of ``kernels_pallas.mosaic_gpu`` running the rule's second pass with the
  derived per-row hyperparameters, and a backward of three kernels (module docstring).
  ``kp.mosaic_gpu_attention`` calls it after validating the arguments.

  .. math::
    \theta_i = \mathrm{derive}\Big(\mathop{\mathrm{merge}}_{B}\ \mathrm{block}(x_{iB}),
    |V_i|\Big),\qquad
    O_i = \frac{\sum_{j \in V_i} \mathrm{num}(z_{ij}, m_i; \theta_i)\, v_j}{D_i}

  with ``z_ij = score_map(x_ij, |V_i|; theta_i)`` and ``D_i`` (class E) the second
  rule's row sum (1 for class P).

  Args:
    cfg: the forward's configuration (``mosaic_gpu._Cfg``) of a class-R spec.
    query: ``[B, T, N, H]`` float16 or bfloat16.
    key, value: ``[B, S, K, H]``.
    kv_lengths: optional int32 ``[B]`` key lengths (``cfg.kv_lengths``).
    segment_ids: optional int32 ``(q_ids [B, T], kv_ids [B, S])`` (``cfg.segments``).
    interpret: None for the GPU, else ``InterpretGPUParams``.

  Returns:
    ``[B, T, N, H]`` of the query's dtype; differentiable (module docstring, steps 4-7).

  Examples:
    >>> import jax, jax.numpy as jnp, kernels_pallas as kp
    >>> q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.float16)
    >>> f = lambda q: kp.mosaic_gpu_attention(q, q, q, normalizer="standardized_softmax")
    >>> mlir = jax.export.export(jax.jit(f), platforms=["cuda"])(q).mlir_module()
    >>> mlir.count("stablehlo.custom_call @mosaic_gpu")  # the statistics, the attention pass
    2

  References:
    T. F. Chan, G. H. Golub & R. J. LeVeque, 1979, "Updating formulae and a pairwise
    algorithm for computing sample variances" (the merged moments).

    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
    arXiv:2407.08608.
  """
  _check(cfg.spec)
  return _attention(cfg, query, key, value, kv_lengths, segment_ids, interpret)


# kp.mosaic_gpu_attention routes class R here (mosaic_gpu.CLASS_KERNELS: no import cycle)
mga.CLASS_KERNELS["R"] = row_stats_attention
