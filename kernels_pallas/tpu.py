"""Mosaic TPU driver of the attention engine (forward, dQ and dK/dV passes).

Layout: heads before sequence ([B, N, T, H]), so every block's last two dimensions are
(rows, head_dim) as Mosaic requires; the key axis of the grid is "arbitrary" and the
running state lives in VMEM scratch. Block skipping is splash-style: per query block the
visible key blocks ``[lo, hi)`` (``MaskStructure.block_table``) are scalar-prefetched
into SMEM; steps outside that range do no compute, and their index_map clamps to the
range so that no new K/V tile is fetched either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import engine as E

__all__ = ["forward", "backward_dq", "backward_dkv"]


def _clamp(i, lo, hi):
  """i clamped to the visible blocks [lo, hi) (to lo when there are none)."""
  return jnp.minimum(jnp.maximum(i, lo), jnp.maximum(hi - 1, lo))


def _heads_first(x):
  return jnp.swapaxes(x, 1, 2)


def _read(ref):
  return None if ref is None else ref[...]


def _q_major(cfg: E.Config, bq: int, bk: int):
  """Specs of the passes over query blocks (forward, dQ): grid (batch, head, query block,
  key block); a key block outside the visible ones is clamped into them."""
  g, nq = cfg.groups, cfg.t_pad // bq

  def index(bi, ni, qi, ki, lo, hi):
    r = bi * nq + qi
    return bi, ni, E.div(ni, g), qi, _clamp(ki, lo[r], hi[r])

  return E.block_specs(cfg, index, bq, bk, heads_first=True)


def _call(cfg: E.Config, kernel, name: str, grid, sp, bounds, operands, aux, dyn, out_specs,
          out_shape, scratch):
  """pallas_call of one pass: the block bounds [lo, hi) scalar-prefetched, the pass's own
  ``(spec, array)`` operands, then :func:`engine.pass_inputs`."""
  extra_specs, extra = E.pass_inputs(cfg, sp, aux, dyn)
  semantics = ("parallel",) * 3 + ("arbitrary",) * (len(grid) - 3)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=grid, in_specs=[o[0] for o in operands] + extra_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      # True: the generic Pallas interpreter; a pltpu.InterpretParams: TPU interpret mode.
      interpret=cfg.interpret if cfg.interpret is not None else False,
      debug=cfg.debug,
      name=f"jaxsoft_attention_{name}_{cfg.spec.name}",
  )(*(x.reshape(-1) for x in bounds), *(o[1] for o in operands), *extra)


def _backward_operands(sp, q, k, v, do, m, d, delta):
  return [(sp["q"], _heads_first(q)), (sp["kv"], _heads_first(k)), (sp["kv"], _heads_first(v)),
          (sp["q"], _heads_first(do)), (sp["row"], m), (sp["row"], d), (sp["row"], delta)]


def forward(cfg: E.Config, q, k, v, dyn, aux: E.Aux):
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hp = q.shape[0], cfg.num_heads, cfg.head_dim_pad
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  sp = _q_major(cfg, bq, bk)
  row_shape = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)
  out_shape = [jax.ShapeDtypeStruct((b, n, cfg.t_pad, hp), q.dtype), row_shape, row_shape]
  scratch = [pltpu.VMEM((bq, 1), cfg.acc_dtype), pltpu.VMEM((bq, 1), cfg.acc_dtype),
             pltpu.VMEM((bq, hp), cfg.acc_dtype)]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, len(dyn))
    o_ref, m_ref, d_ref, m_sc, l_sc, acc_sc = rest
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    r = bi * nq + qi

    @pl.when(ki == 0)
    def _init():
      m_sc[...], l_sc[...], acc_sc[...] = E.init_state(cfg, bq, hp)

    @pl.when(jnp.logical_and(ki >= lo_ref[r], ki < hi_ref[r]))
    def _compute():
      s = E.tile_logits(cfg, q_ref[...], k_ref[...])
      mask = E.tile_mask(cfg, qi * bq, ki * bk, bq, bk, _read(qs_ref), _read(ks_ref))
      state = E.forward_tile(cfg, s, mask, (m_sc[...], l_sc[...], acc_sc[...]), v_ref[...],
                             len_ref[...], tuple(rf[...] for rf in dyn_refs))
      m_sc[...], l_sc[...], acc_sc[...] = state

    @pl.when(ki == nk - 1)
    def _finish():
      o, m, d = E.finalize(cfg, (m_sc[...], l_sc[...], acc_sc[...]), len_ref[...],
                           tuple(rf[...] for rf in dyn_refs))
      o_ref[...] = o.astype(o_ref.dtype)
      m_ref[...] = m
      d_ref[...] = d

  o, m, d = _call(
      cfg, kernel, "fwd", (b, n, nq, nk), sp, (aux.fwd_lo, aux.fwd_hi),
      [(sp["q"], _heads_first(q)), (sp["kv"], _heads_first(k)), (sp["kv"], _heads_first(v))],
      aux, dyn, [sp["q"], sp["row"], sp["row"]], out_shape, scratch)
  return _heads_first(o), m, d


def backward_dq(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
  b, n, hp, n_dyn = q.shape[0], cfg.num_heads, cfg.head_dim_pad, len(dyn)
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  sp = _q_major(cfg, bq, bk)
  out_shape = [jax.ShapeDtypeStruct((b, n, cfg.t_pad, hp), cfg.acc_dtype)]
  out_shape += [jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)] * n_dyn
  scratch = [pltpu.VMEM((bq, hp), cfg.acc_dtype)]
  scratch += [pltpu.VMEM((bq, 1), cfg.acc_dtype)] * n_dyn

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, n_dyn)
    dq_ref, ddyn_refs = rest[0], rest[1:1 + n_dyn]
    dq_sc, ddyn_sc = rest[1 + n_dyn], rest[2 + n_dyn:]
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    r = bi * nq + qi

    @pl.when(ki == 0)
    def _init():
      for sc in (dq_sc, *ddyn_sc):
        sc[...] = jnp.zeros_like(sc)

    @pl.when(jnp.logical_and(ki >= lo_ref[r], ki < hi_ref[r]))
    def _compute():
      kt = k_ref[...]
      s = E.tile_logits(cfg, q_ref[...], kt)
      mask = E.tile_mask(cfg, qi * bq, ki * bk, bq, bk, _read(qs_ref), _read(ks_ref))
      dp = E.dot(cfg, do_ref[...], v_ref[...], (1, 1))
      _, ds, ddyn = E.backward_tile(cfg, s, mask, m_ref[...], d_ref[...], delta_ref[...], dp,
                                    len_ref[...], tuple(rf[...] for rf in dyn_refs))
      ds = E.soft_cap_grad(cfg, s, ds) * cfg.scale
      dq_sc[...] += E.dot(cfg, ds.astype(kt.dtype), kt, (1, 0))
      for sc, x in zip(ddyn_sc, ddyn, strict=True):
        sc[...] += x

    @pl.when(ki == nk - 1)
    def _finish():
      for rf, sc in zip((dq_ref, *ddyn_refs), (dq_sc, *ddyn_sc), strict=True):
        rf[...] = sc[...]

  outs = _call(cfg, kernel, "dq", (b, n, nq, nk), sp, (aux.dq_lo, aux.dq_hi),
               _backward_operands(sp, q, k, v, do, m, d, delta), aux, dyn,
               [sp["q"]] + [sp["row"]] * n_dyn, out_shape, scratch)
  return _heads_first(outs[0]), tuple(outs[1:])


def backward_dkv(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
  b, kvh, hp, g = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.groups
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk

  def index(bi, h, ki, gi, qi, lo, hi):
    r = bi * nk + ki
    return bi, h * g + gi, h, _clamp(qi, lo[r], hi[r]), ki

  sp = E.block_specs(cfg, index, bq, bk, heads_first=True)
  out_shape = [jax.ShapeDtypeStruct((b, kvh, cfg.s_pad, hp), cfg.acc_dtype)] * 2
  scratch = [pltpu.VMEM((bk, hp), cfg.acc_dtype), pltpu.VMEM((bk, hp), cfg.acc_dtype)]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, len(dyn))
    dk_ref, dv_ref, dk_sc, dv_sc = rest
    bi, ki, gi, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    r = bi * nk + ki

    @pl.when(jnp.logical_and(gi == 0, qi == 0))
    def _init():
      dk_sc[...] = jnp.zeros_like(dk_sc)
      dv_sc[...] = jnp.zeros_like(dv_sc)

    @pl.when(jnp.logical_and(qi >= lo_ref[r], qi < hi_ref[r]))
    def _compute():
      qt, kt, vt, dot_ = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
      s = E.tile_logits(cfg, qt, kt)
      mask = E.tile_mask(cfg, qi * bq, ki * bk, bq, bk, _read(qs_ref), _read(ks_ref))
      dp = E.dot(cfg, dot_, vt, (1, 1))
      w, ds, _ = E.backward_tile(cfg, s, mask, m_ref[...], d_ref[...], delta_ref[...], dp,
                                 len_ref[...], tuple(rf[...] for rf in dyn_refs))
      ds = E.soft_cap_grad(cfg, s, ds) * cfg.scale
      dv_sc[...] += E.dot(cfg, w.T.astype(dot_.dtype), dot_, (1, 0))
      dk_sc[...] += E.dot(cfg, ds.T.astype(qt.dtype), qt, (1, 0))

    @pl.when(jnp.logical_and(gi == g - 1, qi == nq - 1))
    def _finish():
      dk_ref[...] = dk_sc[...]
      dv_ref[...] = dv_sc[...]

  dk, dv = _call(cfg, kernel, "dkv", (b, kvh, nk, g, nq), sp, (aux.dkv_lo, aux.dkv_hi),
                 _backward_operands(sp, q, k, v, do, m, d, delta), aux, dyn,
                 [sp["kv"], sp["kv"]], out_shape, scratch)
  return _heads_first(dk), _heads_first(dv)
