"""Triton (GPU) driver of the attention engine (forward, dQ and dK/dV passes).

jax.nn's layout is kept ([B, T, N, H]: no transpose). One program per (query block,
batch, head) runs the key loop inside the kernel (FlashAttention-2); block skipping is
the loop bounds: the visible key blocks ``[lo, hi)`` of the query block
(``MaskStructure.block_table``; causal, window, segments, lengths). The dK/dV pass runs
one program per (key block, batch, KV head) and loops over the G query heads of its group
and the visible query blocks, so GQA never copies K/V and dK/dV need no reduction
afterwards. With a block table (``cfg.key_table``) the loops walk a compacted block list
per (batch, head, block) instead of a range. Block sizes are powers of two; the head dim is
padded to one by the caller.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import engine as E

__all__ = ["forward", "backward_dq", "backward_dkv", "threshold_search", "threshold_forward",
           "threshold_backward_dq", "threshold_backward_dkv"]


def _q_major(cfg: E.Config, bq: int):
  """Specs of the passes over query blocks (forward, dQ): grid (query block, batch, head)."""
  g = cfg.groups
  return E.block_specs(cfg, lambda qi, bi, ni: (bi, ni, E.div(ni, g), qi, 0), bq, cfg.s_pad)


def _backward_operands(sp, q, k, v, do, m, d, delta):
  return [(sp["q"], q), (sp["kv"], k), (sp["v"], v), (sp["o"], do), (sp["row"], m),
          (sp["row"], d), (sp["row"], delta)]


def _call(cfg: E.Config, kernel, name: str, grid, rows: int, sp, bounds, operands, aux, dyn,
          out_specs, out_shape):
  """pallas_call of one pass: the loop bounds [lo, hi) of each (batch, block), the pass's
  own ``(spec, array)`` operands, then :func:`engine.pass_inputs`. With a block table
  (``cfg.key_table``) ``bounds`` is ``(idx, cnt)`` of the loop instead: the compacted
  block list of each (batch, head, block) and its count, [B, N, blocks, width] and
  [B, N, blocks, 1]; a dK/dV pass (``q_heads``) reads the lists of its G query heads."""
  if cfg.key_table:
    width, dkv = bounds[0].shape[-1], name == "dkv"
    g = cfg.groups if dkv else None
    at = (lambda i, bi, h: (bi, h, i, 0))
    lead = [(pl.BlockSpec((None, g, None, width), at), bounds[0]),
            (pl.BlockSpec((None, g, None, 1), at), bounds[1])]
  else:
    bound = pl.BlockSpec((None, None), lambda i, bi, h: (bi, i))
    lead = [(bound, x) for x in bounds]
  return _call_with(cfg, kernel, name, grid, rows, sp, lead + operands, aux, dyn, out_specs,
                    out_shape)


def _key_loop(cfg: E.Config, a_ref, b_ref, head=None):
  """``(start, stop, block)`` of a pass's block loop: the range [lo, hi) (``a_ref``,
  ``b_ref``; ``block(j) = j``), or with a block table the first ``cnt`` entries of the
  compacted list (``block(j) = idx[j]``; ``head`` picks the query head of a dK/dV pass)."""
  if not cfg.key_table:
    return a_ref[...], b_ref[...], lambda j: j
  if head is None:
    return 0, b_ref[0], lambda j: a_ref[j]
  return 0, b_ref[head, 0], lambda j: a_ref[head, j]


def _bounds(cfg: E.Config, aux: E.Aux, lo, hi, dkv: bool = False):
  """The leading loop operands of a pass: its [lo, hi) ranges, or the block table."""
  if not cfg.key_table:
    return lo, hi
  return (aux.dkv_idx, aux.dkv_cnt) if dkv else (aux.fwd_idx, aux.fwd_cnt)


def _call_with(cfg: E.Config, kernel, name: str, grid, rows: int, sp, operands, aux, dyn,
               out_specs, out_shape):
  """pallas_call of one pass: its own ``(spec, array)`` operands, then
  :func:`engine.pass_inputs`."""
  extra_specs, extra = E.pass_inputs(cfg, sp, aux, dyn)
  warps = cfg.blocks.num_warps or (4 if cfg.head_dim_pad <= 64 and rows <= 64 else 8)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[*(o[0] for o in operands), *extra_specs],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=warps,
                                           num_stages=cfg.blocks.num_stages or 2),
      interpret=bool(cfg.interpret), debug=cfg.debug,
      name=f"jaxsoft_attention_{name}_{cfg.spec.name}",
  )(*(o[1] for o in operands), *extra)


def forward(cfg: E.Config, q, k, v, dyn, aux: E.Aux):
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hv = q.shape[0], cfg.num_heads, cfg.hv_pad
  sp = _q_major(cfg, bq)
  row_shape = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)
  out_shape = [jax.ShapeDtypeStruct((b, cfg.t_pad, n, hv), v.dtype), row_shape, row_shape]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, len(dyn))
    bias_ref, mask_ref, rest = E.split_dense(cfg, rest)
    cq_ref, ck_ref, rest = E.split_decay(cfg, rest)
    sel_ref, rest = E.split_select(cfg, rest)
    sq_ref, sk_ref, (o_ref, m_ref, d_ref) = E.split_fp8(cfg, rest)
    qi = pl.program_id(0)
    qs = None if qs_ref is None else qs_ref[...]
    length, dyn_v, qt = len_ref[...], tuple(r[...] for r in dyn_refs), q_ref[...]
    cq = None if cq_ref is None else cq_ref[...]
    sel = None if sel_ref is None else sel_ref[...]
    sq = None if sq_ref is None else sq_ref[...]
    start, stop, block = _key_loop(cfg, lo_ref, hi_ref)

    def body(j, state):
      kb = block(j)
      sl = pl.ds(kb * bk, bk)
      # K06 exp2: the forward's logits in log2 units (the backward passes' stay natural);
      # K06 fp8: q and k float8, the dot times their scales
      s = E.tile_logits(cfg, qt, k_ref[sl, :], cq, None if ck_ref is None else ck_ref[:, sl],
                        log2=cfg.exp2, fp8_scales=None if sq is None else (sq, sk_ref[:, sl]))
      mask = E.tile_mask(cfg, qi * bq, kb * bk, bq, bk, qs,
                         None if ks_ref is None else ks_ref[:, sl])
      mask = E.prune_mask(cfg, mask, (cq, None if ck_ref is None else ck_ref[:, sl]),
                          qi * bq, kb * bk, bq, bk)
      x, mask = E.dense_logits(cfg, s, mask, *_dense_tiles(cfg, bias_ref, mask_ref, bq, bk,
                                                            cols=sl), log2=cfg.exp2)
      mask = E.select_mask(mask, sel, kb, bk)
      return E.forward_tile(cfg, x, mask, state, v_ref[sl, :], length, dyn_v)

    state = jax.lax.fori_loop(start, stop, body, E.init_state(cfg, bq, hv))
    o, m, d = E.finalize(cfg, state, length, dyn_v)
    o_ref[...] = o.astype(o_ref.dtype)
    m_ref[...] = m
    d_ref[...] = d

  return _call(cfg, kernel, "fwd", (cfg.t_pad // bq, b, n), bq, sp,
               _bounds(cfg, aux, aux.fwd_lo, aux.fwd_hi),
               [(sp["q"], q), (sp["kv"], k), (sp["v"], v)], aux, dyn,
               [sp["o"], sp["row"], sp["row"]], out_shape)


def _dense_tiles(cfg: E.Config, bias_ref, mask_ref, bq: int, bk: int, head=None, rows=None,
                 cols=None):
  """The bias and mask tiles (each None when absent) of a whole-length block."""
  return (E.dense_tile(cfg.bias_full, bias_ref, bq, bk, head, rows, cols),
          E.dense_tile(cfg.mask_full, mask_ref, bq, bk, head, rows, cols))


def _decay_q(cq_ref, ck_ref, sl):
  """(cq [bq, 1], ck [1, bk]) of a pass over query blocks at key slice ``sl`` (whole-length
  key blocks), or (None, None) without a decay."""
  return (None, None) if cq_ref is None else (cq_ref[...], ck_ref[:, sl])


def _decay_k(cq_ref, ck_ref, gi: int, sl):
  """(cq [bq, 1], ck [1, bk]) of a dK/dV-style pass (query head ``gi`` of the group, query
  slice ``sl``), or (None, None) without a decay."""
  return (None, None) if cq_ref is None else (cq_ref[gi, sl, :], ck_ref[gi])


def backward_dq(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  """dQ and the hyperparameters' cotangents; with a dense bias also dS [B, N, T_pad,
  S_pad], the cotangent of the biased logits (zero outside the visible key blocks); with
  a decay d cq [B, N, T_pad, W] (W = cfg.terms). Returns (dq, ddyn, dS or None, dcq or
  None)."""
  bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
  b, n, hp, n_dyn = q.shape[0], cfg.num_heads, cfg.head_dim_pad, len(dyn)
  has_bias, nk = cfg.bias_full is not None, cfg.s_pad // bk
  sp = _q_major(cfg, bq)
  n_rows = n_dyn + int(cfg.decay)  # the hyperparameters' cotangents, then dcq
  out_shape = [jax.ShapeDtypeStruct(q.shape, cfg.acc_dtype)]
  out_shape += [jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)] * n_dyn
  out_shape += [E.term_shapes(cfg, b)[0]] * int(cfg.decay)
  out_specs = [sp["q"]] + [sp["row"]] * n_dyn + [sp["cq"]] * int(cfg.decay)
  if has_bias:
    out_shape.append(jax.ShapeDtypeStruct((b, n, cfg.t_pad, cfg.s_pad), cfg.acc_dtype))
    out_specs.append(pl.BlockSpec((None, None, bq, cfg.s_pad),
                                  lambda qi, bi, ni: (bi, ni, qi, 0)))

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, n_dyn)
    bias_ref, mask_ref, rest = E.split_dense(cfg, rest)
    cq_ref, ck_ref, rest = E.split_decay(cfg, rest)
    sel_ref, (dq_ref, *outs) = E.split_select(cfg, rest)
    ddyn_refs, ds_ref = outs[:n_rows], (outs[n_rows] if has_bias else None)
    qi = pl.program_id(0)
    qs = None if qs_ref is None else qs_ref[...]
    length, dyn_v = len_ref[...], tuple(r[...] for r in dyn_refs)
    qt, dot_, mt, dt, delt = q_ref[...], do_ref[...], m_ref[...], d_ref[...], delta_ref[...]
    cq = None if cq_ref is None else cq_ref[...]
    sel = None if sel_ref is None else sel_ref[...]
    lo, hi, block = _key_loop(cfg, lo_ref, hi_ref)

    def body(j, carry):
      dq, ddyn = carry
      kb = block(j)
      sl = pl.ds(kb * bk, bk)
      kt = k_ref[sl, :]
      s, dist = E.score_tile(cfg, qt, kt, cq, None if ck_ref is None else ck_ref[:, sl])
      mask = E.tile_mask(cfg, qi * bq, kb * bk, bq, bk, qs,
                         None if ks_ref is None else ks_ref[:, sl])
      mask = E.prune_mask(cfg, mask, (cq, None if ck_ref is None else ck_ref[:, sl]),
                          qi * bq, kb * bk, bq, bk)
      x, mask = E.dense_logits(cfg, s, mask, *_dense_tiles(cfg, bias_ref, mask_ref, bq, bk,
                                                            cols=sl))
      mask = E.select_mask(mask, sel, kb, bk)
      dp = E.dot(cfg, dot_, v_ref[sl, :], (1, 1))
      _, ds, dd = E.backward_tile(cfg, x, mask, mt, dt, delt, dp, length, dyn_v)
      if ds_ref is not None:
        ds_ref[:, sl] = ds
      dz = E.logits_grad(cfg, s, dist, ds)
      if cfg.decay:  # d cq_i = sum_j dS_ij (before the scale)
        dd = (*dd, E.term_grads(cfg, s, ds, dz, -1))
      dq = dq + E.dot(cfg, (dz * cfg.scale).astype(kt.dtype), kt, (1, 0))
      return dq, tuple(a + y for a, y in zip(ddyn, dd, strict=True))

    if ds_ref is not None:  # the key blocks the loop skips have dS = 0
      def clear(j, c):
        ds_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), cfg.acc_dtype)
        return c

      if cfg.key_table:  # every block, then the loop writes the listed ones
        jax.lax.fori_loop(0, nk, clear, 0)
      else:
        jax.lax.fori_loop(0, lo, clear, 0)
        jax.lax.fori_loop(hi, nk, clear, 0)
    init = (jnp.zeros((bq, hp), cfg.acc_dtype),
            tuple(jnp.zeros((bq, w), cfg.acc_dtype)
                  for w in [1] * n_dyn + [cfg.terms] * int(cfg.decay)))
    dq, ddyn = jax.lax.fori_loop(lo, hi, body, init)
    dq_ref[...] = dq
    for rf, x in zip(ddyn_refs, ddyn, strict=True):
      rf[...] = x

  outs = _call(cfg, kernel, "dq", (cfg.t_pad // bq, b, n), bq, sp,
               _bounds(cfg, aux, aux.dq_lo, aux.dq_hi),
               _backward_operands(sp, q, k, v, do, m, d, delta), aux, dyn, out_specs, out_shape)
  return (outs[0], tuple(outs[1:1 + n_dyn]), (outs[-1] if has_bias else None),
          outs[1 + n_dyn] if cfg.decay else None)


def backward_dkv(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
  b, kvh, hp, hv, g = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.hv_pad, cfg.groups
  # One program per KV head holds its G query heads: the q-side blocks span the whole
  # padded length and the group's heads.
  sp = E.block_specs(cfg, lambda ki, bi, hi: (bi, hi, hi, 0, ki), cfg.t_pad, bk, q_heads=g)
  out_shape = [jax.ShapeDtypeStruct(k.shape, cfg.acc_dtype),
               jax.ShapeDtypeStruct(v.shape, cfg.acc_dtype)]
  out_specs = [sp["kv"], sp["v"]]
  if cfg.decay:  # d ck [B, N, W, S_pad]: minus the column sums of dS, per query head
    out_shape.append(E.term_shapes(cfg, b)[1])
    out_specs.append(sp["ck"])

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, len(dyn))
    bias_ref, mask_ref, rest = E.split_dense(cfg, rest)
    cq_ref, ck_ref, rest = E.split_decay(cfg, rest)
    sel_ref, (dk_ref, dv_ref, *dck_refs) = E.split_select(cfg, rest)
    ki = pl.program_id(0)
    ks = None if ks_ref is None else ks_ref[...]
    kt, vt = k_ref[...], v_ref[...]
    dk_dv = (jnp.zeros((bk, hp), cfg.acc_dtype), jnp.zeros((bk, hv), cfg.acc_dtype))
    for gi in range(g):  # the query heads sharing this KV head
      ck = None if ck_ref is None else ck_ref[gi]
      start, stop, block = _key_loop(cfg, lo_ref, hi_ref, head=gi if cfg.key_table else None)

      def body(j, carry, gi=gi, ck=ck, block=block):
        dk, dv, dck = carry
        i = block(j)
        sl = pl.ds(i * bq, bq)
        qt, dot_ = q_ref[sl, gi, :], do_ref[sl, gi, :]
        s, dist = E.score_tile(cfg, qt, kt, None if cq_ref is None else cq_ref[gi, sl, :], ck)
        mask = E.tile_mask(cfg, i * bq, ki * bk, bq, bk,
                           None if qs_ref is None else qs_ref[sl, :], ks)
        mask = E.prune_mask(cfg, mask, (None if cq_ref is None else cq_ref[gi, sl, :], ck),
                            i * bq, ki * bk, bq, bk)
        x, mask = E.dense_logits(cfg, s, mask, *_dense_tiles(cfg, bias_ref, mask_ref, bq, bk,
                                                              head=gi, rows=sl))
        if sel_ref is not None:
          mask = E.select_mask(mask, sel_ref[gi, sl, :], ki, bk)
        dp = E.dot(cfg, dot_, vt, (1, 1))
        dyn_v = tuple(rf[gi, sl, :] for rf in dyn_refs)
        length = len_ref[gi, sl, :] if cfg.length_rows else len_ref[sl, :]
        w, ds, _ = E.backward_tile(cfg, x, mask, m_ref[gi, sl, :], d_ref[gi, sl, :],
                                   delta_ref[gi, sl, :], dp, length, dyn_v)
        dz = E.logits_grad(cfg, s, dist, ds)
        dv = dv + E.dot(cfg, w.astype(dot_.dtype), dot_, (0, 0))
        dk = dk + E.dot(cfg, (dz * cfg.scale).astype(qt.dtype), qt, (0, 0))
        return dk, dv, dck - E.term_grads(cfg, s, ds, dz, 0)

      *dk_dv, dck = jax.lax.fori_loop(start, stop, body,
                                      (*dk_dv, jnp.zeros((cfg.terms, bk), cfg.acc_dtype)))
      if dck_refs:
        dck_refs[0][gi] = dck
    dk_ref[...] = dk_dv[0]
    dv_ref[...] = dk_dv[1]

  outs = _call(cfg, kernel, "dkv", (cfg.s_pad // bk, b, kvh), bk, sp,
               _bounds(cfg, aux, aux.dkv_lo, aux.dkv_hi, dkv=True),
               _backward_operands(sp, q, k, v, do, m, d, delta), aux, dyn, out_specs, out_shape)
  return outs[0], outs[1], (outs[2] if cfg.decay else None)


# ---------------------------------------------------------------------- class T (AdaSplash)
# The four passes of engine's class-T section. The search runs over the structural key
# range [lo, hi) and records which key blocks hold a visible z >= tau; the weighted pass
# and both backward passes loop over those live blocks only (a compacted list per query
# block, ``engine.live_block_tables``; per key block for dK/dV).


def _tables(width: int):
  """Specs of the live-block list [B, N, nq, width] and its count [B, N, nq, 1] of the
  passes over query blocks (grid (query block, batch, head))."""
  return (pl.BlockSpec((None, None, None, width), lambda qi, bi, ni: (bi, ni, qi, 0)),
          pl.BlockSpec((None, None, None, 1), lambda qi, bi, ni: (bi, ni, qi, 0)))


def threshold_search(cfg: E.Config, q, k, dyn, aux: E.Aux):
  """Returns (m [B, N, T_pad, 1], tau [B, N, T_pad, 1], flags [B, N, nq, 1, width],
  tau_search [B, N, T_pad, 1]): the row max of z (finite), the weights' threshold, which
  key blocks hold a visible z >= tau, and the search's threshold (``return_residual``'s;
  tau itself except for indicator rules, whose tau moves into the gap below it)."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, nq, width = q.shape[0], cfg.num_heads, cfg.t_pad // bq, E.num_k_flags(cfg)
  count, steps, newton = E.threshold_schedule(cfg, early_exit=True)
  n_dyn, indicator = len(dyn), E.t_indicator(cfg)
  sp = _q_major(cfg, bq)
  row_shape = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)
  flag_spec = pl.BlockSpec((None, None, None, 1, width), lambda qi, bi, ni: (bi, ni, qi, 0, 0))
  out_shape = [row_shape, row_shape, jax.ShapeDtypeStruct((b, n, nq, 1, width), jnp.int32),
               row_shape]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, n_dyn)
    bias_ref, mask_ref, rest = E.split_dense(cfg, rest)
    cq_ref, ck_ref, (m_ref, tau_ref, flag_ref, res_ref) = E.split_decay(cfg, rest)
    qi = pl.program_id(0)
    qs = None if qs_ref is None else qs_ref[...]
    length, dyn_v, qt = len_ref[...], tuple(r[...] for r in dyn_refs), q_ref[...]
    k_lo, k_hi = lo_ref[...], hi_ref[...]

    def logits(j):
      sl = pl.ds(j * bk, bk)
      s = E.tile_logits(cfg, qt, k_ref[sl, :], *_decay_q(cq_ref, ck_ref, sl))
      mask = E.tile_mask(cfg, qi * bq, j * bk, bq, bk, qs,
                         None if ks_ref is None else ks_ref[:, sl])
      mask = E.prune_mask(cfg, mask, _decay_q(cq_ref, ck_ref, sl), qi * bq, j * bk, bq, bk)
      return E.dense_logits(cfg, s, mask, *_dense_tiles(cfg, bias_ref, mask_ref, bq, bk,
                                                         cols=sl))

    def max_body(j, m):
      s, mask = logits(j)
      return E.t_max_tile(cfg, s, mask, m, length, dyn_v)

    m = jax.lax.fori_loop(k_lo, k_hi, max_body, jnp.full((bq, 1), -jnp.inf, cfg.acc_dtype))
    m, state, target = E.t_start(cfg, m, length, dyn_v)
    no_flags = jnp.zeros((1, width), jnp.int32)

    def sweep(carry):
      i, _, state, _ = carry
      lo = state[0]
      taus = E.t_candidates(lo, state[1], state[2], count)

      def body(j, c):
        sums, flags = c
        s, mask = logits(j)
        z, sums = E.t_sums_tile(cfg, s, mask, m, taus, sums, length, dyn_v, newton)
        return sums, E.t_flag_update(flags, j, E.t_live(z, mask, lo))

      zero = [jnp.zeros((bq, 1), cfg.acc_dtype)] * (count * (1 + int(newton)))
      sums, flags = jax.lax.fori_loop(k_lo, k_hi, body, (zero, no_flags))
      state = E.t_update(cfg, state, taus, sums, target, dyn_v, newton)
      return i + 1, E.t_all_done(state), state, flags

    def more(carry):  # at least one sweep: it records the live blocks
      i, done, _, _ = carry
      return jnp.logical_and(i < steps, jnp.logical_or(i == 0, done == 0))

    _, _, state, flags = jax.lax.while_loop(
        more, sweep, (jnp.int32(0), jnp.int32(0), state, no_flags))
    tau = E.t_threshold(state, newton)
    res_ref[...] = tau
    if indicator:
      def below_body(j, below):
        s, mask = logits(j)
        return E.t_below_tile(cfg, s, mask, m, tau, below, length, dyn_v)

      below = jax.lax.fori_loop(k_lo, k_hi, below_body,
                                jnp.full((bq, 1), -jnp.inf, cfg.acc_dtype))
      tau = E.t_gap_tau(tau, below)
    m_ref[...] = m
    tau_ref[...] = tau
    flag_ref[...] = flags

  return _call(cfg, kernel, "tsearch", (nq, b, n), bq, sp, (aux.fwd_lo, aux.fwd_hi),
               [(sp["q"], q), (sp["kv"], k)], aux, dyn,
               [sp["row"], sp["row"], flag_spec, sp["row"]],
               out_shape)


def threshold_forward(cfg: E.Config, q, k, v, m, tau, idx, cnt, dyn, aux: E.Aux):
  """The weighted pass over the live key blocks: returns (o, W [B, N, T_pad, 1])."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hv, n_dyn = q.shape[0], cfg.num_heads, cfg.hv_pad, len(dyn)
  sp = _q_major(cfg, bq)
  idx_spec, cnt_spec = _tables(idx.shape[-1])
  out_shape = [jax.ShapeDtypeStruct((b, cfg.t_pad, n, hv), q.dtype),
               jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)]

  def kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, m_ref, tau_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, n_dyn)
    bias_ref, mask_ref, rest = E.split_dense(cfg, rest)
    cq_ref, ck_ref, (o_ref, d_ref) = E.split_decay(cfg, rest)
    qi = pl.program_id(0)
    qs = None if qs_ref is None else qs_ref[...]
    length, dyn_v, qt = len_ref[...], tuple(r[...] for r in dyn_refs), q_ref[...]
    mt, taut = m_ref[...], tau_ref[...]

    def body(j, carry):
      lsum, acc = carry
      kb = idx_ref[j]
      sl = pl.ds(kb * bk, bk)
      s = E.tile_logits(cfg, qt, k_ref[sl, :], *_decay_q(cq_ref, ck_ref, sl))
      mask = E.tile_mask(cfg, qi * bq, kb * bk, bq, bk, qs,
                         None if ks_ref is None else ks_ref[:, sl])
      mask = E.prune_mask(cfg, mask, _decay_q(cq_ref, ck_ref, sl), qi * bq, kb * bk, bq, bk)
      x, mask = E.dense_logits(cfg, s, mask, *_dense_tiles(cfg, bias_ref, mask_ref, bq, bk,
                                                            cols=sl))
      w = E.t_weight_tile(cfg, x, mask, taut, mt, length, dyn_v)
      vt = v_ref[sl, :]
      return (lsum + jnp.sum(w, axis=-1, keepdims=True),
              acc + E.dot(cfg, w.astype(vt.dtype), vt, (1, 0)))

    init = (jnp.zeros((bq, 1), cfg.acc_dtype), jnp.zeros((bq, hv), cfg.acc_dtype))
    lsum, acc = jax.lax.fori_loop(0, cnt_ref[0], body, init)
    o_ref[...] = (acc * E.tile.safe_inverse(lsum)).astype(o_ref.dtype)
    d_ref[...] = lsum

  return _call_with(cfg, kernel, "tfwd", (cfg.t_pad // bq, b, n), bq, sp,
                    [(idx_spec, idx), (cnt_spec, cnt), (sp["q"], q), (sp["kv"], k),
                     (sp["v"], v), (sp["row"], m), (sp["row"], tau)],
                    aux, dyn, [sp["o"], sp["row"]], out_shape)


def threshold_backward_dq(cfg: E.Config, q, k, v, do, m, tau, d, delta, idx, cnt, dyn,
                          aux: E.Aux):
  """dQ over the live key blocks; also the per-row ``coef`` (for dK/dV) and the
  hyperparameters' tile cotangents; with a dense bias also dS [B, N, T_pad, S_pad] (0 off
  the live blocks); with a decay d cq. Returns (dq, coef, ddyn, dS or None, dcq or None)."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hp, n_dyn = q.shape[0], cfg.num_heads, cfg.head_dim_pad, len(dyn)
  has_bias, nk = cfg.bias_full is not None, cfg.s_pad // bk
  n_rows = n_dyn + int(cfg.decay)  # the hyperparameters' cotangents, then dcq
  sp = _q_major(cfg, bq)
  idx_spec, cnt_spec = _tables(idx.shape[-1])
  row = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)
  out_shape = [jax.ShapeDtypeStruct(q.shape, cfg.acc_dtype), row] + [row] * n_dyn
  out_shape += [E.term_shapes(cfg, b)[0]] * int(cfg.decay)
  out_specs = [sp["q"]] + [sp["row"]] * (1 + n_dyn) + [sp["cq"]] * int(cfg.decay)
  if has_bias:
    out_shape.append(jax.ShapeDtypeStruct((b, n, cfg.t_pad, cfg.s_pad), cfg.acc_dtype))
    out_specs.append(pl.BlockSpec((None, None, bq, cfg.s_pad),
                                  lambda qi, bi, ni: (bi, ni, qi, 0)))

  def kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, m_ref, tau_ref, d_ref, delta_ref,
             *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, n_dyn)
    bias_ref, mask_ref, rest = E.split_dense(cfg, rest)
    cq_ref, ck_ref, (dq_ref, coef_ref, *outs) = E.split_decay(cfg, rest)
    ddyn_refs, ds_ref = outs[:n_rows], (outs[n_rows] if has_bias else None)
    qi = pl.program_id(0)
    qs = None if qs_ref is None else qs_ref[...]
    length, dyn_v = len_ref[...], tuple(r[...] for r in dyn_refs)
    qt, dot_, mt, taut, dt, delt = (r[...] for r in (q_ref, do_ref, m_ref, tau_ref, d_ref,
                                                     delta_ref))
    count = cnt_ref[0]

    def tile_at(j):
      kb = idx_ref[j]
      sl = pl.ds(kb * bk, bk)
      kt, vt = k_ref[sl, :], v_ref[sl, :]
      s, dist = E.score_tile(cfg, qt, kt, *_decay_q(cq_ref, ck_ref, sl))
      mask = E.tile_mask(cfg, qi * bq, kb * bk, bq, bk, qs,
                         None if ks_ref is None else ks_ref[:, sl])
      mask = E.prune_mask(cfg, mask, _decay_q(cq_ref, ck_ref, sl), qi * bq, kb * bk, bq, bk)
      x, mask = E.dense_logits(cfg, s, mask, *_dense_tiles(cfg, bias_ref, mask_ref, bq, bk,
                                                            cols=sl))
      return kt, (s, dist), x, mask, E.dot(cfg, dot_, vt, (1, 1)), sl

    def coef_body(j, carry):
      _, _, x, mask, dp, _ = tile_at(j)
      g, mm = E.t_coef_tile(cfg, x, mask, taut, mt, delt, dp, length, dyn_v)
      return carry[0] + g, carry[1] + mm

    zero = jnp.zeros((bq, 1), cfg.acc_dtype)
    g_tau, m_tau = jax.lax.fori_loop(0, count, coef_body, (zero, zero))
    coef = E.t_coef(g_tau, m_tau, dt)

    def body(j, carry):
      dq, ddyn = carry
      kt, s_dist, x, mask, dp, sl = tile_at(j)
      _, ds, dd = E.t_backward_tile(cfg, x, mask, taut, mt, dt, delt, coef, dp, length, dyn_v)
      if ds_ref is not None:
        ds_ref[:, sl] = ds
      dz = E.logits_grad(cfg, *s_dist, ds)
      if cfg.decay:  # d cq_i = sum_j dS_ij (before the scale)
        dd = (*dd, E.term_grads(cfg, s_dist[0], ds, dz, -1))
      dq = dq + E.dot(cfg, (dz * cfg.scale).astype(kt.dtype), kt, (1, 0))
      return dq, tuple(a + y for a, y in zip(ddyn, dd, strict=True))

    if ds_ref is not None:  # dS = 0 on every block but the live ones (written below)
      def clear(j, c):
        ds_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), cfg.acc_dtype)
        return c

      jax.lax.fori_loop(0, nk, clear, 0)
    init = (jnp.zeros((bq, hp), cfg.acc_dtype),
            tuple(jnp.zeros((bq, w), cfg.acc_dtype)
                  for w in [1] * n_dyn + [cfg.terms] * int(cfg.decay)))
    dq, ddyn = jax.lax.fori_loop(0, count, body, init)
    dq_ref[...] = dq
    coef_ref[...] = coef
    for rf, x in zip(ddyn_refs, ddyn, strict=True):
      rf[...] = x

  outs = _call_with(cfg, kernel, "tdq", (cfg.t_pad // bq, b, n), bq, sp,
                    [(idx_spec, idx), (cnt_spec, cnt)]
                    + _threshold_operands(sp, q, k, v, do, m, tau, d, delta),
                    aux, dyn, out_specs, out_shape)
  return (outs[0], outs[1], tuple(outs[2:2 + n_dyn]), (outs[-1] if has_bias else None),
          outs[2 + n_dyn] if cfg.decay else None)


def _threshold_operands(sp, q, k, v, do, m, tau, d, delta):
  return [(sp["q"], q), (sp["kv"], k), (sp["v"], v), (sp["o"], do), (sp["row"], m),
          (sp["row"], tau), (sp["row"], d), (sp["row"], delta)]


def threshold_backward_dkv(cfg: E.Config, q, k, v, do, m, tau, d, delta, coef, idx_t, cnt_t,
                           dyn, aux: E.Aux):
  """dK, dV over, per key block, the query blocks for which it is live (per query head:
  ``idx_t`` [B, N, nk, width], ``cnt_t`` [B, N, nk, 1])."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, kvh, hp, hv, g = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.hv_pad, cfg.groups
  sp = E.block_specs(cfg, lambda ki, bi, hi: (bi, hi, hi, 0, ki), cfg.t_pad, bk, q_heads=g)
  width = idx_t.shape[-1]
  idx_spec = pl.BlockSpec((None, g, None, width), lambda ki, bi, hi: (bi, hi, ki, 0))
  cnt_spec = pl.BlockSpec((None, g, None, 1), lambda ki, bi, hi: (bi, hi, ki, 0))
  out_shape = [jax.ShapeDtypeStruct(k.shape, cfg.acc_dtype),
               jax.ShapeDtypeStruct(v.shape, cfg.acc_dtype)]
  out_specs = [sp["kv"], sp["v"]]
  if cfg.decay:  # d ck [B, N, W, S_pad]: minus the column sums of dS, per query head
    out_shape.append(E.term_shapes(cfg, b)[1])
    out_specs.append(sp["ck"])

  def kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, m_ref, tau_ref, d_ref, delta_ref,
             coef_ref, *refs):
    qs_ref, ks_ref, len_ref, dyn_refs, rest = E.split_refs(cfg, refs, len(dyn))
    bias_ref, mask_ref, rest = E.split_dense(cfg, rest)
    cq_ref, ck_ref, (dk_ref, dv_ref, *dck_refs) = E.split_decay(cfg, rest)
    ki = pl.program_id(0)
    ks = None if ks_ref is None else ks_ref[...]
    kt, vt = k_ref[...], v_ref[...]
    dk_dv = (jnp.zeros((bk, hp), cfg.acc_dtype), jnp.zeros((bk, hv), cfg.acc_dtype))
    for gi in range(g):  # the query heads sharing this KV head

      def body(j, carry, gi=gi):
        dk, dv, dck = carry
        qb = idx_ref[gi, j]
        sl = pl.ds(qb * bq, bq)
        qt, dot_ = q_ref[sl, gi, :], do_ref[sl, gi, :]
        s, dist = E.score_tile(cfg, qt, kt, *_decay_k(cq_ref, ck_ref, gi, sl))
        mask = E.tile_mask(cfg, qb * bq, ki * bk, bq, bk,
                           None if qs_ref is None else qs_ref[sl, :], ks)
        mask = E.prune_mask(cfg, mask, _decay_k(cq_ref, ck_ref, gi, sl), qb * bq, ki * bk, bq, bk)
        x, mask = E.dense_logits(cfg, s, mask, *_dense_tiles(cfg, bias_ref, mask_ref, bq, bk,
                                                              head=gi, rows=sl))
        dp = E.dot(cfg, dot_, vt, (1, 1))
        rows = tuple(r[gi, sl, :] for r in (m_ref, tau_ref, d_ref, delta_ref, coef_ref))
        mt, taut, dt, delt, coef = rows
        dyn_v = tuple(rf[gi, sl, :] for rf in dyn_refs)
        length = len_ref[gi, sl, :] if cfg.length_rows else len_ref[sl, :]
        w, ds, _ = E.t_backward_tile(cfg, x, mask, taut, mt, dt, delt, coef, dp, length, dyn_v)
        dz = E.logits_grad(cfg, s, dist, ds)
        dv = dv + E.dot(cfg, w.astype(dot_.dtype), dot_, (0, 0))
        dk = dk + E.dot(cfg, (dz * cfg.scale).astype(qt.dtype), qt, (0, 0))
        return dk, dv, dck - E.term_grads(cfg, s, ds, dz, 0)

      *dk_dv, dck = jax.lax.fori_loop(0, cnt_ref[gi, 0], body,
                                      (*dk_dv, jnp.zeros((cfg.terms, bk), cfg.acc_dtype)))
      if dck_refs:
        dck_refs[0][gi] = dck
    dk_ref[...] = dk_dv[0]
    dv_ref[...] = dk_dv[1]

  ops = [(idx_spec, idx_t), (cnt_spec, cnt_t)]
  ops += _threshold_operands(sp, q, k, v, do, m, tau, d, delta) + [(sp["row"], coef)]
  outs = _call_with(cfg, kernel, "tdkv", (cfg.s_pad // bk, b, kvh), bk, sp, ops, aux, dyn,
                    out_specs, out_shape)
  return outs[0], outs[1], (outs[2] if cfg.decay else None)
