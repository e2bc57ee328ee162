"""Class R in the Pallas engine: a statistics pass, then the E/P engine with derived rows.

A class-R normalizer (standardised softmax, NAP, adaptive temperature, affine, clipped,
SA-normalised) needs a statistic of the whole row before any weight; its spec carries a
:class:`~jaxsoft.normalizers.RowStatsRule`. Attention runs it as a composition, so that
autodiff chains the pieces and no T x S buffer exists anywhere:

1. ``stats = row_stats_core(q, k)``: one Pallas pass over the visible key blocks of each
   query block folds ``rule.block`` of every tile into ``rule.merge`` (a handful of
   per-row numbers: mean and M2, softmax's (m, l), ...);
2. ``theta = rule.derive(stats, n, **hp)`` in XLA, per row;
3. ``o = attention_core(q, k, v, dyn + theta)``: the ordinary E/P engine running
   ``rule.second`` with theta as per-row dynamic hyperparameters (its backward returns
   theta's cotangents like those of any per-head temperature).

Backward of step 1 (a custom_vjp): given the statistics' cotangents ``g`` (autodiff
through ``derive``), every tile's logit cotangent is ``vjp(rule.tangent)(g)`` at the
final statistics; a dQ pass over key blocks and a dK pass over query blocks (as the
engine's backward passes, without V) carry it to q and k. Every pass of a class-R call
uses one tile shape, so the backward recomputes exactly the forward's tiles (the
statistics of the row extremes compare logits for equality).

A recomputed tile may round differently from the statistics pass (another kernel, or XLA
constant-folding the interpreter), so the rules compare logits with the row's extremes
within a relative 2^-16 (``row_blocks.RECOMPUTE_TOLERANCE``), and a row with one visible
key uses scale 1 (its weights do not depend on the scale, and ``x - mean`` recomputed is
not exactly 0).

A dense bias and mask enter every pass's tiles (``engine.dense_logits``): the statistics
are of the biased, visible logits, and the bias's gradient sums the statistics' dQ pass's
tile cotangents and the E/P engine's.

A class-T threshold rule with ``stats`` (top-p: softmax's (m, l) for its target) runs the
same statistics pass first (:func:`with_derived_rows`, ``constant=True``: the derived rows
carry no gradient), then the class-T kernels with those rows as hyperparameters.

Triton (GPU) and Mosaic TPU drivers, both run on CPU in interpret mode by the tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxsoft.attention.differentiation import first_order_only
from kernels_pallas import core, tpu, triton
from kernels_pallas import engine as E

__all__ = ["row_stats_attention", "row_stats_core"]


# ----------------------------------------------------------------------- per-tile math


def _rule(cfg: E.Config):
  """The row-statistics rule: class R's, or the ``stats`` of a class-T threshold rule."""
  return cfg.spec.row_stats if cfg.kernel_class == "R" else cfg.spec.threshold.stats


def _visible(s, mask):
  return jnp.ones(s.shape, bool) if mask is None else mask


def stats_init(cfg: E.Config, rows: int) -> tuple:
  """The statistics of an empty row, each [rows, 1]."""
  return tuple(_rule(cfg).init((rows, 1), cfg.acc_dtype))


def stats_tile(cfg: E.Config, s, mask, stats) -> tuple:
  """Folds one tile's statistics (of the visible logits ``s``) into ``stats``."""
  rule = _rule(cfg)
  return tuple(rule.merge(tuple(stats), rule.block(s, _visible(s, mask))))


def tangent_tile(cfg: E.Config, s, mask, stats, g):
  """The tile's logit cotangent from the statistics' cotangents ``g`` (before the soft
  cap is undone: the caller applies ``engine.soft_cap_grad``)."""
  rule, vis = _rule(cfg), _visible(s, mask)
  _, vjp = jax.vjp(lambda x: rule.tangent(x, vis, tuple(stats)), s)
  return vjp(tuple(g))[0]


def num_stats(cfg: E.Config) -> int:
  return len(stats_init(cfg, 1))


# ---------------------------------------------------------------------------- Triton


def _triton_stats(cfg: E.Config, q, k, aux: E.Aux):
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, size = q.shape[0], cfg.num_heads, num_stats(cfg)
  sp = triton._q_major(cfg, bq)
  row_shape = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)

  def kernel(lo_ref, hi_ref, q_ref, k_ref, *refs):
    ins, out_refs = E.split_inputs(cfg, refs, 0)
    qi = pl.program_id(0)
    qt, rows = q_ref[...], triton._q_rows(ins)

    def body(j, stats):
      t = triton._key_block(cfg, ins, rows, qt, k_ref, qi, j, bq, bk)[2]
      return stats_tile(cfg, t.x, t.mask, stats)

    triton._store(out_refs, jax.lax.fori_loop(lo_ref[...], hi_ref[...], body,
                                              stats_init(cfg, bq)))

  return tuple(triton._call(cfg, kernel, "rstats", (cfg.t_pad // bq, b, n), bq, sp,
                            (aux.fwd_lo, aux.fwd_hi), [(sp["q"], q), (sp["kv"], k)], aux, (),
                            [sp["row"]] * size, [row_shape] * size))


def _triton_dq(cfg: E.Config, q, k, stats, g, aux: E.Aux):
  """dQ of the statistics; with a dense bias also dS [B, N, T_pad, S_pad] (0 off the
  visible key blocks), with a decay d cq. Returns (dq, dS or None, dcq or None)."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, size = q.shape[0], cfg.num_heads, len(stats)
  has_bias, nk = cfg.bias_full is not None, cfg.s_pad // bk
  sp = triton._q_major(cfg, bq)
  out_shape, out_specs = E.dq_outputs(cfg, sp, q.shape, 0)
  if has_bias:
    out_specs.append(pl.BlockSpec((None, None, bq, cfg.s_pad), lambda qi, bi, ni: (bi, ni, qi, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, cfg.t_pad, cfg.s_pad), cfg.acc_dtype))

  def kernel(lo_ref, hi_ref, q_ref, k_ref, *refs):
    st_refs, g_refs = refs[:size], refs[size:2 * size]
    ins, (dq_ref, *outs) = E.split_inputs(cfg, refs[2 * size:], 0)
    dcq_refs, ds_ref = outs[:int(cfg.decay)], (outs[-1] if has_bias else None)
    qi = pl.program_id(0)
    qt, rows = q_ref[...], triton._q_rows(ins)
    st, gt = tuple(r[...] for r in st_refs), tuple(r[...] for r in g_refs)
    lo, hi = lo_ref[...], hi_ref[...]

    def body(j, carry):
      sl, kt, t = triton._key_block(cfg, ins, rows, qt, k_ref, qi, j, bq, bk)
      ds = tangent_tile(cfg, t.x, t.mask, st, gt)
      return triton._add_dq(cfg, t, ds, kt, ds_ref, sl, carry)

    # the key blocks the loop skips have dS = 0
    triton._clear_ds(cfg, ds_ref, bq, bk, [(0, lo), (hi, nk)])
    dq, dcq = jax.lax.fori_loop(lo, hi, body, triton._dq_init(cfg, bq, 0))
    triton._store((dq_ref, *dcq_refs), (dq, *dcq))

  ops = [(sp["q"], q), (sp["kv"], k)] + [(sp["row"], x) for x in (*stats, *g)]
  outs = triton._call(cfg, kernel, "rdq", (cfg.t_pad // bq, b, n), bq, sp,
                      (aux.fwd_lo, aux.fwd_hi), ops, aux, (), out_specs, out_shape)
  return outs[0], (outs[-1] if has_bias else None), (outs[1] if cfg.decay else None)


def _triton_dk(cfg: E.Config, q, k, stats, g, aux: E.Aux):
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, kvh, hp, grp, size = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.groups, len(stats)
  sp = E.block_specs(cfg, lambda ki, bi, hi: (bi, hi, hi, 0, ki), cfg.t_pad, bk, q_heads=grp)

  def kernel(lo_ref, hi_ref, q_ref, k_ref, *refs):
    st_refs, g_refs = refs[:size], refs[size:2 * size]
    ins, (dk_ref, *dck_refs) = E.split_inputs(cfg, refs[2 * size:], 0)
    ki = pl.program_id(0)
    ks, kt = triton._read(ins.k_seg), k_ref[...]

    def body(gi, ck, qb, carry):
      sl, qt, t = triton._query_block(cfg, ins, (ks, ck), q_ref, kt, gi, qb, ki, bq, bk)
      st = tuple(r[gi, sl, :] for r in st_refs)
      gt = tuple(r[gi, sl, :] for r in g_refs)
      return triton._add_dkv(cfg, t, tangent_tile(cfg, t.x, t.mask, st, gt), qt, carry)

    def loop(gi):
      return lo_ref[...], hi_ref[...], lambda j: j

    init = (jnp.zeros((bk, hp), cfg.acc_dtype),)
    triton._store((dk_ref,), triton._over_heads(cfg, ins, grp, bk, init, loop, body, dck_refs))

  out_specs, out_shape = [sp["kv"]], [jax.ShapeDtypeStruct(k.shape, cfg.acc_dtype)]
  if cfg.decay:  # d ck [B, N, W, S_pad]: minus the column sums, per query head
    out_specs.append(sp["ck"])
    out_shape.append(E.term_shapes(cfg, b)[1])
  ops = [(sp["q"], q), (sp["kv"], k)] + [(sp["row"], x) for x in (*stats, *g)]
  outs = triton._call(cfg, kernel, "rdk", (cfg.s_pad // bk, b, kvh), bk, sp,
                      (aux.dkv_lo, aux.dkv_hi), ops, aux, (), out_specs, out_shape)
  return outs[0], (outs[1] if cfg.decay else None)


# ------------------------------------------------------------------------ Mosaic TPU


def _tpu_stats(cfg: E.Config, q, k, aux: E.Aux):
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, size = q.shape[0], cfg.num_heads, num_stats(cfg)
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  sp = tpu._q_major(cfg, bq, bk)
  row_shape = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)
  scratch = [pltpu.VMEM((bq, 1), cfg.acc_dtype)] * size

  def kernel(lo_ref, hi_ref, q_ref, k_ref, *refs):
    ins, rest = E.split_inputs(cfg, refs, 0)
    out_refs, sc = rest[:size], rest[size:]
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    r = bi * nq + qi

    @pl.when(ki == 0)
    def _init():
      for ref, x in zip(sc, stats_init(cfg, bq), strict=True):
        ref[...] = x

    @pl.when(jnp.logical_and(ki >= lo_ref[r], ki < hi_ref[r]))
    def _compute():
      t = tpu._tile(cfg, ins, q_ref[...], k_ref[...], qi, ki, bq, bk)
      stats = stats_tile(cfg, t.x, t.mask, tpu._values(sc))
      for ref, x in zip(sc, stats, strict=True):
        ref[...] = x

    tpu._store_at(ki == nk - 1, out_refs, sc)

  return tuple(tpu._call(cfg, kernel, "rstats", (b, n, nq, nk), sp, (aux.fwd_lo, aux.fwd_hi),
                         [(sp["q"], tpu._heads_first(q)), (sp["kv"], tpu._heads_first(k))],
                         aux, (), [sp["row"]] * size, [row_shape] * size, scratch))


def _tpu_dq(cfg: E.Config, q, k, stats, g, aux: E.Aux):
  """dQ of the statistics; with a dense bias also dS [B, N, T_pad, S_pad] (0 off the
  visible key blocks), with a decay d cq. Returns (dq, dS or None, dcq or None)."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hp, size = q.shape[0], cfg.num_heads, cfg.head_dim_pad, len(stats)
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  has_bias = cfg.bias_full is not None
  sp = tpu._q_major(cfg, bq, bk)
  out_shape, out_specs = E.dq_outputs(cfg, sp, (b, n, cfg.t_pad, hp), 0)
  scratch = [pltpu.VMEM((bq, w), cfg.acc_dtype) for w in [hp] + E.row_widths(cfg, 0)]
  if has_bias:
    out_specs.append(pl.BlockSpec((None, None, bq, bk),
                                  lambda bi, ni, qi, ki, lo, hi: (bi, ni, qi, ki)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, cfg.t_pad, cfg.s_pad), cfg.acc_dtype))

  def kernel(lo_ref, hi_ref, q_ref, k_ref, *refs):
    st_refs, g_refs = refs[:size], refs[size:2 * size]
    ins, rest = E.split_inputs(cfg, refs[2 * size:], 0)
    n_out = 1 + int(cfg.decay) + int(has_bias)
    out_refs, ds_ref = rest[:1 + int(cfg.decay)], (rest[n_out - 1] if has_bias else None)
    dq_sc, *dcq_sc = rest[n_out:]
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    r = bi * nq + qi
    visible = jnp.logical_and(ki >= lo_ref[r], ki < hi_ref[r])
    tpu._zero_at(ki == 0, dq_sc, *dcq_sc)

    @pl.when(visible)
    def _compute():
      kt = k_ref[...]
      t = tpu._tile(cfg, ins, q_ref[...], kt, qi, ki, bq, bk)
      ds = tangent_tile(cfg, t.x, t.mask, tpu._values(st_refs), tpu._values(g_refs))
      tpu._add_dq(cfg, t, ds, kt, ds_ref, dq_sc, dcq_sc)

    tpu._clear_off(ds_ref, jnp.logical_not(visible))
    tpu._store_at(ki == nk - 1, out_refs, (dq_sc, *dcq_sc))

  ops = [(sp["q"], tpu._heads_first(q)), (sp["kv"], tpu._heads_first(k))]
  ops += [(sp["row"], x) for x in (*stats, *g)]
  outs = tpu._call(cfg, kernel, "rdq", (b, n, nq, nk), sp, (aux.fwd_lo, aux.fwd_hi), ops, aux,
                   (), out_specs, out_shape, scratch)
  return (tpu._heads_first(outs[0]), (outs[-1] if has_bias else None),
          outs[1] if cfg.decay else None)


def _tpu_dk(cfg: E.Config, q, k, stats, g, aux: E.Aux):
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, kvh, hp, grp, size = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.groups, len(stats)
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk

  def index(bi, h, ki, gi, qi, lo, hi):
    r = bi * nk + ki
    return bi, h * grp + gi, h, tpu._clamp(qi, lo[r], hi[r]), ki

  sp = E.block_specs(cfg, index, bq, bk, heads_first=True)

  def kernel(lo_ref, hi_ref, q_ref, k_ref, *refs):
    st_refs, g_refs = refs[:size], refs[size:2 * size]
    ins, (dk_ref, *rest) = E.split_inputs(cfg, refs[2 * size:], 0)
    dck_ref, dk_sc = (rest[0] if cfg.decay else None), rest[-1]
    bi, ki, gi, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    r = bi * nk + ki
    tpu._dkv_init(gi, qi, (dk_sc,), dck_ref)

    @pl.when(jnp.logical_and(qi >= lo_ref[r], qi < hi_ref[r]))
    def _compute():
      qt = q_ref[...]
      t = tpu._tile(cfg, ins, qt, k_ref[...], qi, ki, bq, bk)
      ds = tangent_tile(cfg, t.x, t.mask, tpu._values(st_refs), tpu._values(g_refs))
      tpu._add_dkv(cfg, t, ds, qt, dk_sc, dck_ref)

    tpu._store_at(jnp.logical_and(gi == grp - 1, qi == nq - 1), (dk_ref,), (dk_sc,))

  out_specs = [sp["kv"]]
  out_shape = [jax.ShapeDtypeStruct((b, kvh, cfg.s_pad, hp), cfg.acc_dtype)]
  if cfg.decay:
    out_specs.append(sp["ck"])
    out_shape.append(E.term_shapes(cfg, b)[1])
  ops = [(sp["q"], tpu._heads_first(q)), (sp["kv"], tpu._heads_first(k))]
  ops += [(sp["row"], x) for x in (*stats, *g)]
  outs = tpu._call(cfg, kernel, "rdk", (b, kvh, nk, grp, nq), sp, (aux.dkv_lo, aux.dkv_hi), ops,
                   aux, (), out_specs, out_shape, [pltpu.VMEM((bk, hp), cfg.acc_dtype)])
  return tpu._heads_first(outs[0]), (outs[1] if cfg.decay else None)


_PASSES = {"triton": (_triton_stats, _triton_dq, _triton_dk),
           "mosaic_tpu": (_tpu_stats, _tpu_dq, _tpu_dk)}


# --------------------------------------------------------------------- the composition


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def row_stats_core(cfg: E.Config, q, k, aux: E.Aux, bias=None, decay=None) -> tuple:
  """The row statistics of every query row, each [B, N, T_pad, 1] (padded inputs), of the
  logits (with the ``decay`` before the soft cap, the dense ``bias`` after it; either may
  be None)."""
  return _PASSES[cfg.backend][0](cfg, q, k, core._with_bias(aux, bias, decay))


def _stats_fwd(cfg, q, k, aux, bias, decay):
  return first_order_only(functools.partial(_stats_fwd_impl, cfg), core.WHERE)(
      q, k, aux, bias, decay)


def _stats_fwd_impl(cfg, q, k, aux, bias, decay):
  stats = _PASSES[cfg.backend][0](cfg, q, k, core._with_bias(aux, bias, decay))
  return stats, (q, k, aux, bias, decay, stats)


def _stats_bwd(cfg, res, g):
  return first_order_only(functools.partial(_stats_bwd_impl, cfg), core.WHERE)(res, g)


def _stats_bwd_impl(cfg, res, g):
  q, k, aux, bias, decay, stats = res
  _, dq_pass, dk_pass = _PASSES[cfg.backend]
  aux_b = core._with_bias(aux, bias, decay)
  dq, ds, dcq = dq_pass(cfg, q, k, stats, g, aux_b)
  dk, dck = dk_pass(cfg, q, k, stats, g, aux_b)
  return (dq.astype(q.dtype), dk.astype(k.dtype),
          *core.input_cotangents(aux, bias, decay, ds, dcq, dck))


row_stats_core.defvjp(_stats_fwd, _stats_bwd)


def row_stats_attention(cfg: E.Config, q, k, v, dyn, aux: E.Aux, bias=None, decay=None):
  """Class R on padded inputs: statistics, ``derive`` in XLA, then the E/P engine running
  the rule's second pass with the derived per-row hyperparameters appended to ``dyn``
  (both see the dense ``bias``, whose gradient sums both). Returns ``(o [B, T_pad, N,
  Hvp], residual)`` as :func:`core.attention_core` (the residual is the second pass's,
  which ``return_residual`` does not expose: class R defines none)."""
  second, dyn = with_derived_rows(cfg, q, k, dyn, aux, bias, decay)
  return core.attention_core(second, q, k, v, dyn, aux, bias, decay)


def with_derived_rows(cfg: E.Config, q, k, dyn, aux: E.Aux, bias=None, decay=None,
                      constant: bool = False):
  """``(cfg, dyn)`` with the rule's derived hyperparameters (statistics pass, then
  ``derive`` in XLA) appended as per-row dynamic hyperparameters [B, N, T_pad, 1];
  ``constant``: without gradient (a class-T rule's ``stats``)."""
  rule = _rule(cfg)
  stats = row_stats_core(cfg, q, k, aux, bias, decay)
  static, arrays = E._hp(cfg, dyn)
  theta = rule.derive(stats, E.row_lengths(cfg, aux), **{**static, **arrays})
  names = tuple(sorted(theta))
  clash = set(names) & (set(cfg.dyn_hp) | {nm for nm, _ in cfg.static_hp})
  if clash:
    raise ValueError(f"normalizer {cfg.spec.name!r}: derived hyperparameters {sorted(clash)} "
                     "shadow declared ones")
  rows = tuple(jnp.broadcast_to(jnp.asarray(theta[nm], cfg.acc_dtype), stats[0].shape)
               for nm in names)
  if constant:
    rows = jax.lax.stop_gradient(rows)
  return dataclasses.replace(cfg, dyn_hp=cfg.dyn_hp + names), tuple(dyn) + rows
