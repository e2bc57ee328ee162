"""Mosaic TPU driver of the attention engine (forward, dQ and dK/dV passes).

Layout: heads before sequence ([B, N, T, H]), so every block's last two dimensions are
(rows, head_dim) as Mosaic requires; the key axis of the grid is "arbitrary" and the
running state lives in VMEM scratch. Block skipping is splash-style: per query block the
first and last key block holding a visible entry (``engine.block_table``) are scalar-
prefetched into SMEM; steps outside that range do no compute, and their index_map
clamps to the range so that no new K/V tile is fetched either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import engine as E

__all__ = ["forward", "backward_dq", "backward_dkv"]


def _div(x, g: int):
  # lax.div, not //: floor division lowers through sign, which Mosaic resolves per chip.
  return jax.lax.div(x, jnp.asarray(g, x.dtype))


def _interpret(cfg):
  # True: the generic Pallas interpreter; a pltpu.InterpretParams: TPU interpret mode.
  return cfg.interpret if cfg.interpret is not None else False


def _clamp(i, lo, hi):
  return jnp.minimum(jnp.maximum(i, lo), jnp.maximum(hi, lo))


def _heads_first(x):
  return jnp.swapaxes(x, 1, 2)


def _row_spec(bq, index):
  return pl.BlockSpec((None, None, bq, 1), index)


def forward(cfg: E.Config, q, k, v, dyn, sink, aux: E.Aux):
  bl = cfg.blocks.resolved()
  bq, bk = bl.block_q, bl.block_k
  b, n, hp, g = q.shape[0], cfg.num_heads, cfg.head_dim_pad, cfg.groups
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  qh, kh, vh = _heads_first(q), _heads_first(k), _heads_first(v)

  def kv_index(bi, ni, qi, ki, lo, hi):
    r = bi * nq + qi
    return bi, _div(ni, g), _clamp(ki, lo[r], hi[r]), 0

  q_index = lambda bi, ni, qi, ki, lo, hi: (bi, ni, qi, 0)
  row_index = lambda bi, ni, qi, ki, lo, hi: (bi, ni, qi, 0)
  in_specs = [
      pl.BlockSpec((None, None, bq, hp), q_index),
      pl.BlockSpec((None, None, bk, hp), kv_index),
      pl.BlockSpec((None, None, bk, hp), kv_index),
  ]
  args = [qh, kh, vh]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, bq, 1), lambda bi, ni, qi, ki, lo, hi: (bi, qi, 0)),
        pl.BlockSpec((None, 1, bk),
                     lambda bi, ni, qi, ki, lo, hi: (bi, 0, kv_index(bi, ni, qi, ki, lo, hi)[2])),
    ]
    args += [aux.q_seg, aux.k_seg]
  in_specs.append(pl.BlockSpec((None, bq, 1), lambda bi, ni, qi, ki, lo, hi: (bi, qi, 0)))
  args.append(aux.length)
  extra = list(dyn) + ([sink] if sink is not None else [])
  in_specs += [_row_spec(bq, row_index) for _ in extra]
  args += extra
  out_shape = [
      jax.ShapeDtypeStruct((b, n, cfg.t_pad, hp), q.dtype),
      jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype),
      jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype),
  ]
  out_specs = [pl.BlockSpec((None, None, bq, hp), q_index),
               _row_spec(bq, row_index), _row_spec(bq, row_index)]
  scratch = [pltpu.VMEM((bq, 1), cfg.acc_dtype), pltpu.VMEM((bq, 1), cfg.acc_dtype),
             pltpu.VMEM((bq, hp), cfg.acc_dtype)]
  n_dyn = len(dyn)
  has_sink = sink is not None

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, *refs):
    refs = list(refs)
    qs_ref = ks_ref = None
    if cfg.has_segments:
      qs_ref, ks_ref = refs.pop(0), refs.pop(0)
    len_ref = refs.pop(0)
    dyn_refs = [refs.pop(0) for _ in range(n_dyn)]
    sink_ref = refs.pop(0) if has_sink else None
    o_ref, m_ref, d_ref, m_sc, l_sc, acc_sc = refs
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    r = bi * nq + qi

    @pl.when(ki == 0)
    def _init():
      m0, l0, a0 = E.init_state(cfg, bq, hp)
      m_sc[...] = m0
      l_sc[...] = l0
      acc_sc[...] = a0

    @pl.when(jnp.logical_and(ki >= lo_ref[r], ki <= hi_ref[r]))
    def _compute():
      s = E.tile_logits(cfg, q_ref[...], k_ref[...])
      mask = E.tile_mask(cfg, qi * bq, ki * bk, bq, bk,
                         qs_ref[...] if qs_ref is not None else None,
                         ks_ref[...] if ks_ref is not None else None)
      dyn_v = tuple(rf[...] for rf in dyn_refs)
      m, lsum, acc = E.forward_tile(cfg, s, mask, (m_sc[...], l_sc[...], acc_sc[...]), v_ref[...],
                                 len_ref[...], dyn_v)
      m_sc[...] = m
      l_sc[...] = lsum
      acc_sc[...] = acc

    @pl.when(ki == nk - 1)
    def _finish():
      dyn_v = tuple(rf[...] for rf in dyn_refs)
      o, m, d = E.finalize(cfg, (m_sc[...], l_sc[...], acc_sc[...]), len_ref[...], dyn_v,
                           sink_ref[...] if sink_ref is not None else None)
      o_ref[...] = o.astype(o_ref.dtype)
      m_ref[...] = m
      d_ref[...] = d

  o, m, d = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, n, nq, nk), in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=_interpret(cfg),
      debug=cfg.debug,
      name=f"jaxsoft_attention_fwd_{cfg.spec.name}",
  )(aux.fwd_lo.reshape(-1), aux.fwd_hi.reshape(-1), *args)
  return _heads_first(o), m, d


def backward_dq(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  bl = cfg.blocks.resolved()
  bq, bk = bl.block_q_dq, bl.block_k_dq
  b, n, hp, g = q.shape[0], cfg.num_heads, cfg.head_dim_pad, cfg.groups
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  qh, kh, vh, doh = _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(do)

  def kv_index(bi, ni, qi, ki, lo, hi):
    r = bi * nq + qi
    return bi, _div(ni, g), _clamp(ki, lo[r], hi[r]), 0

  q_index = lambda bi, ni, qi, ki, lo, hi: (bi, ni, qi, 0)
  in_specs = [
      pl.BlockSpec((None, None, bq, hp), q_index),
      pl.BlockSpec((None, None, bk, hp), kv_index),
      pl.BlockSpec((None, None, bk, hp), kv_index),
      pl.BlockSpec((None, None, bq, hp), q_index),
      _row_spec(bq, q_index), _row_spec(bq, q_index), _row_spec(bq, q_index),
  ]
  args = [qh, kh, vh, doh, m, d, delta]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, bq, 1), lambda bi, ni, qi, ki, lo, hi: (bi, qi, 0)),
        pl.BlockSpec((None, 1, bk),
                     lambda bi, ni, qi, ki, lo, hi: (bi, 0, kv_index(bi, ni, qi, ki, lo, hi)[2])),
    ]
    args += [aux.q_seg, aux.k_seg]
  in_specs.append(pl.BlockSpec((None, bq, 1), lambda bi, ni, qi, ki, lo, hi: (bi, qi, 0)))
  args.append(aux.length)
  in_specs += [_row_spec(bq, q_index) for _ in dyn]
  args += list(dyn)
  n_dyn = len(dyn)
  out_shape = [jax.ShapeDtypeStruct((b, n, cfg.t_pad, hp), cfg.acc_dtype)]
  out_shape += [jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype) for _ in dyn]
  out_specs = [pl.BlockSpec((None, None, bq, hp), q_index)]
  out_specs += [_row_spec(bq, q_index) for _ in dyn]
  scratch = [pltpu.VMEM((bq, hp), cfg.acc_dtype)] + [pltpu.VMEM((bq, 1), cfg.acc_dtype)
                                                   for _ in dyn]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    refs = list(refs)
    qs_ref = ks_ref = None
    if cfg.has_segments:
      qs_ref, ks_ref = refs.pop(0), refs.pop(0)
    len_ref = refs.pop(0)
    dyn_refs = [refs.pop(0) for _ in range(n_dyn)]
    dq_ref = refs.pop(0)
    ddyn_refs = [refs.pop(0) for _ in range(n_dyn)]
    dq_sc = refs.pop(0)
    ddyn_sc = refs
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    r = bi * nq + qi

    @pl.when(ki == 0)
    def _init():
      dq_sc[...] = jnp.zeros_like(dq_sc)
      for sc in ddyn_sc:
        sc[...] = jnp.zeros_like(sc)

    @pl.when(jnp.logical_and(ki >= lo_ref[r], ki <= hi_ref[r]))
    def _compute():
      kt = k_ref[...]
      s = E.tile_logits(cfg, q_ref[...], kt)
      mask = E.tile_mask(cfg, qi * bq, ki * bk, bq, bk,
                         qs_ref[...] if qs_ref is not None else None,
                         ks_ref[...] if ks_ref is not None else None)
      dp = jax.lax.dot_general(do_ref[...], v_ref[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=cfg.acc_dtype)
      dyn_v = tuple(rf[...] for rf in dyn_refs)
      _, ds, ddyn = E.backward_tile(cfg, s, mask, m_ref[...], d_ref[...], delta_ref[...], dp,
                                    len_ref[...], dyn_v)
      ds = E.soft_cap_grad(cfg, s, ds) * cfg.scale
      dq_sc[...] += jax.lax.dot_general(ds.astype(kt.dtype), kt, (((1,), (0,)), ((), ())),
                                        preferred_element_type=cfg.acc_dtype)
      for sc, x in zip(ddyn_sc, ddyn, strict=True):
        sc[...] += x

    @pl.when(ki == nk - 1)
    def _finish():
      dq_ref[...] = dq_sc[...]
      for rf, sc in zip(ddyn_refs, ddyn_sc, strict=True):
        rf[...] = sc[...]

  outs = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, n, nq, nk), in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=_interpret(cfg),
      debug=cfg.debug,
      name=f"jaxsoft_attention_dq_{cfg.spec.name}",
  )(aux.dq_lo.reshape(-1), aux.dq_hi.reshape(-1), *args)
  return _heads_first(outs[0]), tuple(outs[1:])


def backward_dkv(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  bl = cfg.blocks.resolved()
  bq, bk = bl.block_q_dkv, bl.block_k_dkv
  b, kvh, hp, g = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.groups
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  qh, kh, vh, doh = _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(do)

  def q_index(bi, hi_, ki, gi, qi, lo, hi):
    r = bi * nk + ki
    return bi, hi_ * g + gi, _clamp(qi, lo[r], hi[r]), 0

  kv_index = lambda bi, hi_, ki, gi, qi, lo, hi: (bi, hi_, ki, 0)
  in_specs = [
      pl.BlockSpec((None, None, bq, hp), q_index),
      pl.BlockSpec((None, None, bk, hp), kv_index),
      pl.BlockSpec((None, None, bk, hp), kv_index),
      pl.BlockSpec((None, None, bq, hp), q_index),
      _row_spec(bq, q_index), _row_spec(bq, q_index), _row_spec(bq, q_index),
  ]
  args = [qh, kh, vh, doh, m, d, delta]
  if cfg.has_segments:
    in_specs += [
        pl.BlockSpec((None, bq, 1),
                     lambda bi, hi_, ki, gi, qi, lo, hi: (bi, q_index(bi, hi_, ki, gi, qi, lo,
                                                                      hi)[2], 0)),
        pl.BlockSpec((None, 1, bk), lambda bi, hi_, ki, gi, qi, lo, hi: (bi, 0, ki)),
    ]
    args += [aux.q_seg, aux.k_seg]
  in_specs.append(pl.BlockSpec(
      (None, bq, 1),
      lambda bi, hi_, ki, gi, qi, lo, hi: (bi, q_index(bi, hi_, ki, gi, qi, lo, hi)[2], 0)))
  args.append(aux.length)
  in_specs += [_row_spec(bq, q_index) for _ in dyn]
  args += list(dyn)
  n_dyn = len(dyn)
  out_shape = [jax.ShapeDtypeStruct((b, kvh, cfg.s_pad, hp), cfg.acc_dtype)] * 2
  out_specs = [pl.BlockSpec((None, None, bk, hp), kv_index)] * 2
  scratch = [pltpu.VMEM((bk, hp), cfg.acc_dtype), pltpu.VMEM((bk, hp), cfg.acc_dtype)]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    refs = list(refs)
    qs_ref = ks_ref = None
    if cfg.has_segments:
      qs_ref, ks_ref = refs.pop(0), refs.pop(0)
    len_ref = refs.pop(0)
    dyn_refs = [refs.pop(0) for _ in range(n_dyn)]
    dk_ref, dv_ref, dk_sc, dv_sc = refs
    bi, ki, gi, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    r = bi * nk + ki

    @pl.when(jnp.logical_and(gi == 0, qi == 0))
    def _init():
      dk_sc[...] = jnp.zeros_like(dk_sc)
      dv_sc[...] = jnp.zeros_like(dv_sc)

    @pl.when(jnp.logical_and(qi >= lo_ref[r], qi <= hi_ref[r]))
    def _compute():
      qt, kt, vt, dot_ = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
      s = E.tile_logits(cfg, qt, kt)
      mask = E.tile_mask(cfg, qi * bq, ki * bk, bq, bk,
                         qs_ref[...] if qs_ref is not None else None,
                         ks_ref[...] if ks_ref is not None else None)
      dp = jax.lax.dot_general(dot_, vt, (((1,), (1,)), ((), ())),
                               preferred_element_type=cfg.acc_dtype)
      dyn_v = tuple(rf[...] for rf in dyn_refs)
      w, ds, _ = E.backward_tile(cfg, s, mask, m_ref[...], d_ref[...], delta_ref[...], dp,
                                 len_ref[...], dyn_v)
      ds = E.soft_cap_grad(cfg, s, ds) * cfg.scale
      dv_sc[...] += jax.lax.dot_general(w.T.astype(dot_.dtype), dot_, (((1,), (0,)), ((), ())),
                                        preferred_element_type=cfg.acc_dtype)
      dk_sc[...] += jax.lax.dot_general(ds.T.astype(qt.dtype), qt, (((1,), (0,)), ((), ())),
                                        preferred_element_type=cfg.acc_dtype)

    @pl.when(jnp.logical_and(gi == g - 1, qi == nq - 1))
    def _finish():
      dk_ref[...] = dk_sc[...]
      dv_ref[...] = dv_sc[...]

  dk, dv = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(b, kvh, nk, g, nq), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
      interpret=_interpret(cfg),
      debug=cfg.debug,
      name=f"jaxsoft_attention_dkv_{cfg.spec.name}",
  )(aux.dkv_lo.reshape(-1), aux.dkv_hi.reshape(-1), *args)
  return _heads_first(dk), _heads_first(dv)

