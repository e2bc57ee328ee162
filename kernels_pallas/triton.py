"""Triton (GPU) driver of the attention engine (forward, dQ and dK/dV passes).

jax.nn's layout is kept ([B, T, N, H]: no transpose). One program per (query block,
batch, head) runs the key loop inside the kernel (FlashAttention-2); block skipping is
the loop bounds: the first and last key block holding a visible entry of the query
block (``engine.block_table``; causal, window, segments). The dK/dV pass runs one program
per (key block, batch, KV head) and loops over the G query heads of its group and the
visible query blocks, so GQA never copies K/V and dK/dV need no reduction afterwards.
Block sizes are powers of two; the head dim is padded to one by the caller.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import engine as E

__all__ = ["forward", "backward_dq", "backward_dkv"]


def _div(x, g: int):
  # lax.div, not //: floor division lowers through sign, which Mosaic resolves per chip.
  return jax.lax.div(x, jnp.asarray(g, x.dtype))


def _params(cfg, bq):
  warps = 4 if cfg.head_dim_pad <= 64 and bq <= 64 else 8
  return plgpu.CompilerParams(num_warps=warps, num_stages=2)


def _interpret(cfg):
  return bool(cfg.interpret)


def _scalar_spec():
  # One int32 per (batch, block): the block's loop bounds.
  return pl.BlockSpec((None, None), lambda i, bi, hi: (bi, i))


def forward(cfg: E.Config, q, k, v, dyn, sink, aux: E.Aux):
  bl = cfg.blocks.resolved()
  bq, bk = bl.block_q, bl.block_k
  b, n, hp, g = q.shape[0], cfg.num_heads, cfg.head_dim_pad, cfg.groups
  nq = cfg.t_pad // bq
  in_specs = [
      _scalar_spec(), _scalar_spec(),
      pl.BlockSpec((None, bq, None, hp), lambda qi, bi, ni: (bi, qi, ni, 0)),
      pl.BlockSpec((None, cfg.s_pad, None, hp), lambda qi, bi, ni: (bi, 0, _div(ni, g), 0)),
      pl.BlockSpec((None, cfg.s_pad, None, hp), lambda qi, bi, ni: (bi, 0, _div(ni, g), 0)),
  ]
  args = [aux.fwd_lo, aux.fwd_hi, q, k, v]
  if cfg.has_segments:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda qi, bi, ni: (bi, qi, 0)),
                 pl.BlockSpec((None, 1, cfg.s_pad), lambda qi, bi, ni: (bi, 0, 0))]
    args += [aux.q_seg, aux.k_seg]
  in_specs.append(pl.BlockSpec((None, bq, 1), lambda qi, bi, ni: (bi, qi, 0)))
  args.append(aux.length)
  row = pl.BlockSpec((None, None, bq, 1), lambda qi, bi, ni: (bi, ni, qi, 0))
  extra = list(dyn) + ([sink] if sink is not None else [])
  in_specs += [row] * len(extra)
  args += extra
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype),
               jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)]
  out_specs = [pl.BlockSpec((None, bq, None, hp), lambda qi, bi, ni: (bi, qi, ni, 0)), row, row]
  n_dyn, has_sink = len(dyn), sink is not None

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, *refs):
    refs = list(refs)
    qs = ks_ref = None
    qi = pl.program_id(0)
    if cfg.has_segments:
      qs, ks_ref = refs.pop(0)[...], refs.pop(0)
    length = refs.pop(0)[...]
    dyn_v = tuple(refs.pop(0)[...] for _ in range(n_dyn))
    sink_v = refs.pop(0)[...] if has_sink else None
    o_ref, m_ref, d_ref = refs
    qt = q_ref[...]

    def body(j, state):
      sl = pl.ds(j * bk, bk)
      s = E.tile_logits(cfg, qt, k_ref[sl, :])
      mask = E.tile_mask(cfg, qi * bq, j * bk, bq, bk, qs,
                         ks_ref[:, sl] if ks_ref is not None else None)
      return E.forward_tile(cfg, s, mask, state, v_ref[sl, :], length, dyn_v)

    state = jax.lax.fori_loop(lo_ref[...], hi_ref[...] + 1, body, E.init_state(cfg, bq, hp))
    o, m, d = E.finalize(cfg, state, length, dyn_v, sink_v)
    o_ref[...] = o.astype(o_ref.dtype)
    m_ref[...] = m
    d_ref[...] = d

  return pl.pallas_call(
      kernel, grid=(nq, b, n), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_params(cfg, bq), interpret=_interpret(cfg), debug=cfg.debug,
      name=f"jaxsoft_attention_fwd_{cfg.spec.name}",
  )(*args)


def backward_dq(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  bl = cfg.blocks.resolved()
  bq, bk = bl.block_q_dq, bl.block_k_dq
  b, n, hp, g = q.shape[0], cfg.num_heads, cfg.head_dim_pad, cfg.groups
  nq = cfg.t_pad // bq
  q_spec = pl.BlockSpec((None, bq, None, hp), lambda qi, bi, ni: (bi, qi, ni, 0))
  kv_spec = pl.BlockSpec((None, cfg.s_pad, None, hp), lambda qi, bi, ni: (bi, 0, _div(ni, g), 0))
  row = pl.BlockSpec((None, None, bq, 1), lambda qi, bi, ni: (bi, ni, qi, 0))
  in_specs = [_scalar_spec(), _scalar_spec(), q_spec, kv_spec, kv_spec, q_spec, row, row, row]
  args = [aux.dq_lo, aux.dq_hi, q, k, v, do, m, d, delta]
  if cfg.has_segments:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda qi, bi, ni: (bi, qi, 0)),
                 pl.BlockSpec((None, 1, cfg.s_pad), lambda qi, bi, ni: (bi, 0, 0))]
    args += [aux.q_seg, aux.k_seg]
  in_specs.append(pl.BlockSpec((None, bq, 1), lambda qi, bi, ni: (bi, qi, 0)))
  args.append(aux.length)
  in_specs += [row] * len(dyn)
  args += list(dyn)
  n_dyn = len(dyn)
  out_shape = [jax.ShapeDtypeStruct(q.shape, cfg.acc_dtype)]
  out_shape += [jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)] * n_dyn
  out_specs = [q_spec] + [row] * n_dyn

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    refs = list(refs)
    qs = ks_ref = None
    qi = pl.program_id(0)
    if cfg.has_segments:
      qs, ks_ref = refs.pop(0)[...], refs.pop(0)
    length = refs.pop(0)[...]
    dyn_v = tuple(refs.pop(0)[...] for _ in range(n_dyn))
    dq_ref, ddyn_refs = refs[0], refs[1:]
    qt, dot_, mt, dt, delt = q_ref[...], do_ref[...], m_ref[...], d_ref[...], delta_ref[...]

    def body(j, carry):
      dq, ddyn = carry
      sl = pl.ds(j * bk, bk)
      kt = k_ref[sl, :]
      s = E.tile_logits(cfg, qt, kt)
      mask = E.tile_mask(cfg, qi * bq, j * bk, bq, bk, qs,
                         ks_ref[:, sl] if ks_ref is not None else None)
      dp = jax.lax.dot_general(dot_, v_ref[sl, :], (((1,), (1,)), ((), ())),
                               preferred_element_type=cfg.acc_dtype)
      _, ds, dd = E.backward_tile(cfg, s, mask, mt, dt, delt, dp, length, dyn_v)
      ds = E.soft_cap_grad(cfg, s, ds) * cfg.scale
      dq = dq + jax.lax.dot_general(ds.astype(kt.dtype), kt, (((1,), (0,)), ((), ())),
                                    preferred_element_type=cfg.acc_dtype)
      return dq, tuple(a + x for a, x in zip(ddyn, dd, strict=True))

    init = (jnp.zeros((bq, hp), cfg.acc_dtype),
            tuple(jnp.zeros((bq, 1), cfg.acc_dtype) for _ in range(n_dyn)))
    dq, ddyn = jax.lax.fori_loop(lo_ref[...], hi_ref[...] + 1, body, init)
    dq_ref[...] = dq
    for rf, x in zip(ddyn_refs, ddyn, strict=True):
      rf[...] = x

  outs = pl.pallas_call(
      kernel, grid=(nq, b, n), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_params(cfg, bq), interpret=_interpret(cfg), debug=cfg.debug,
      name=f"jaxsoft_attention_dq_{cfg.spec.name}",
  )(*args)
  return outs[0], tuple(outs[1:])


def backward_dkv(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  bl = cfg.blocks.resolved()
  bq, bk = bl.block_q_dkv, bl.block_k_dkv
  b, kvh, hp, g = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.groups
  nk = cfg.s_pad // bk
  q_spec = pl.BlockSpec((None, cfg.t_pad, g, hp), lambda ki, bi, hi: (bi, 0, hi, 0))
  kv_spec = pl.BlockSpec((None, bk, None, hp), lambda ki, bi, hi: (bi, ki, hi, 0))
  row = pl.BlockSpec((None, g, cfg.t_pad, 1), lambda ki, bi, hi: (bi, hi, 0, 0))
  in_specs = [_scalar_spec(), _scalar_spec(), q_spec, kv_spec, kv_spec, q_spec, row, row, row]
  args = [aux.dkv_lo, aux.dkv_hi, q, k, v, do, m, d, delta]
  if cfg.has_segments:
    in_specs += [pl.BlockSpec((None, cfg.t_pad, 1), lambda ki, bi, hi: (bi, 0, 0)),
                 pl.BlockSpec((None, 1, bk), lambda ki, bi, hi: (bi, 0, ki))]
    args += [aux.q_seg, aux.k_seg]
  in_specs.append(pl.BlockSpec((None, cfg.t_pad, 1), lambda ki, bi, hi: (bi, 0, 0)))
  args.append(aux.length)
  in_specs += [row] * len(dyn)
  args += list(dyn)
  n_dyn = len(dyn)
  out_shape = [jax.ShapeDtypeStruct(k.shape, cfg.acc_dtype)] * 2
  out_specs = [kv_spec, kv_spec]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    refs = list(refs)
    qs_ref = ks = None
    ki = pl.program_id(0)
    if cfg.has_segments:
      qs_ref, ks = refs.pop(0), refs.pop(0)[...]
    len_ref = refs.pop(0)
    dyn_refs = [refs.pop(0) for _ in range(n_dyn)]
    dk_ref, dv_ref = refs
    kt, vt = k_ref[...], v_ref[...]
    carry = (jnp.zeros((bk, hp), cfg.acc_dtype), jnp.zeros((bk, hp), cfg.acc_dtype))
    for gi in range(g):  # the query heads sharing this KV head

      def body(i, carry, gi=gi):
        dk, dv = carry
        sl = pl.ds(i * bq, bq)
        qt, dot_ = q_ref[sl, gi, :], do_ref[sl, gi, :]
        s = E.tile_logits(cfg, qt, kt)
        mask = E.tile_mask(cfg, i * bq, ki * bk, bq, bk,
                           qs_ref[sl, :] if qs_ref is not None else None, ks)
        dp = jax.lax.dot_general(dot_, vt, (((1,), (1,)), ((), ())),
                                 preferred_element_type=cfg.acc_dtype)
        dyn_v = tuple(rf[gi, sl, :] for rf in dyn_refs)
        w, ds, _ = E.backward_tile(cfg, s, mask, m_ref[gi, sl, :], d_ref[gi, sl, :],
                                   delta_ref[gi, sl, :], dp, len_ref[sl, :], dyn_v)
        ds = E.soft_cap_grad(cfg, s, ds) * cfg.scale
        dv = dv + jax.lax.dot_general(w.astype(dot_.dtype), dot_, (((0,), (0,)), ((), ())),
                                      preferred_element_type=cfg.acc_dtype)
        dk = dk + jax.lax.dot_general(ds.astype(qt.dtype), qt, (((0,), (0,)), ((), ())),
                                      preferred_element_type=cfg.acc_dtype)
        return dk, dv

      carry = jax.lax.fori_loop(lo_ref[...], hi_ref[...] + 1, body, carry)
    dk_ref[...] = carry[0]
    dv_ref[...] = carry[1]

  dk, dv = pl.pallas_call(
      kernel, grid=(nk, b, kvh), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_params(cfg, bk), interpret=_interpret(cfg), debug=cfg.debug,
      name=f"jaxsoft_attention_dkv_{cfg.spec.name}",
  )(*args)
  return dk, dv
