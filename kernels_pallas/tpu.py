"""Mosaic TPU driver of the attention engine (forward, dQ and dK/dV passes).

Layout: heads before sequence ([B, N, T, H]), so every block's last two dimensions are
(rows, head_dim) as Mosaic requires; the key axis of the grid is "arbitrary" and the
running state lives in VMEM scratch. Block skipping is splash-style: per query block the
visible key blocks ``[lo, hi)`` (``MaskStructure.block_table``) are scalar-prefetched
into SMEM; steps outside that range do no compute, and their index_map clamps to the
range so that no new K/V tile is fetched either. With a block table (``cfg.key_table``)
the step axis walks a compacted block list instead (the class-T weighted pass's scheme).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import engine as E

__all__ = ["forward", "backward_dq", "backward_dkv", "threshold_search", "threshold_forward",
           "threshold_backward_dq", "threshold_backward_dkv"]


def _clamp(i, lo, hi):
  """i clamped to the visible blocks [lo, hi) (to lo when there are none)."""
  return jnp.minimum(jnp.maximum(i, lo), jnp.maximum(hi - 1, lo))


def _heads_first(x):
  return jnp.swapaxes(x, 1, 2)


def _read(ref):
  return None if ref is None else ref[...]


def _q_major(cfg: E.Config, bq: int, bk: int):
  """Specs of the passes over query blocks (forward, dQ): grid (batch, head, query block,
  key block); a key block outside the visible ones is clamped into them. With a block
  table the last grid axis steps through the table instead (:func:`_q_major_live`)."""
  if cfg.key_table:
    return _q_major_live(cfg, (None, None, cfg.t_pad // bq, E.num_k_flags(cfg)))
  g, nq = cfg.groups, cfg.t_pad // bq

  def index(bi, ni, qi, ki, lo, hi):
    r = bi * nq + qi
    return bi, ni, E.div(ni, g), qi, _clamp(ki, lo[r], hi[r])

  return E.block_specs(cfg, index, bq, bk, heads_first=True)


def _q_step(cfg: E.Config, a_ref, b_ref, bi, ni, qi, ki, nq: int):
  """(the key block of grid step ``ki``, whether it is computed) of a pass over query
  blocks: ``ki`` itself inside the visible range [lo, hi) (``a_ref``, ``b_ref``), or with
  a block table the ``ki``-th listed block (``a_ref`` the lists, ``b_ref`` the counts)."""
  if cfg.key_table:
    width = E.num_k_flags(cfg)
    r = (bi * cfg.num_heads + ni) * nq + qi
    return _live(ki, lambda: b_ref[r], lambda j: a_ref[r * width + j])
  r = bi * nq + qi
  return ki, jnp.logical_and(ki >= a_ref[r], ki < b_ref[r])


def _q_grid(cfg: E.Config, aux: E.Aux, b: int, n: int, nq: int, nk: int, lo, hi):
  """(grid, scalar-prefetched bounds) of a pass over query blocks: the structure's ranges
  over every key block, or the block table's lists over their width."""
  if cfg.key_table:
    return (b, n, nq, aux.fwd_idx.shape[-1]), (aux.fwd_idx, aux.fwd_cnt)
  return (b, n, nq, nk), (lo, hi)


def _call(cfg: E.Config, kernel, name: str, grid, sp, bounds, operands, aux, dyn, out_specs,
          out_shape, scratch):
  """pallas_call of one pass: the block bounds [lo, hi) scalar-prefetched, the pass's own
  ``(spec, array)`` operands, then :func:`engine.pass_inputs`."""
  extra_specs, extra = E.pass_inputs(cfg, sp, aux, dyn)
  # typed so that mypy keeps the literals through the repetition and the concatenation
  parallel: tuple[Literal["parallel", "arbitrary"], ...] = ("parallel",) * 3
  arbitrary: tuple[Literal["parallel", "arbitrary"], ...] = ("arbitrary",)
  semantics = parallel + arbitrary * (len(grid) - 3)
  out_shape = E.varying_like(out_shape, [o[1] for o in operands] + list(extra))
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


def _backward_operands(sp, q, k, v, do, *rows):
  """The operands of a backward pass: q, k, v, dO, then its per-row arrays [B, N, T_pad, 1]."""
  return [(sp["q"], _heads_first(q)), (sp["kv"], _heads_first(k)), (sp["v"], _heads_first(v)),
          (sp["o"], _heads_first(do))] + [(sp["row"], x) for x in rows]


def _tile(cfg: E.Config, ins: E.InputRefs, q, k, qb, kb, bq: int, bk: int,
          log2: bool = False) -> E.Tile:
  """The grid step's tile (:func:`engine.masked_logits`): query block ``qb`` (``q`` [bq,
  H]) against key block ``kb`` (``k`` [bk, H]), the other inputs read from ``ins``;
  ``log2`` and the fp8 scales for the forward's K06 flags."""
  fp8_scales = None if ins.q_scale is None else (ins.q_scale[...], ins.k_scale[...])
  dense = (E.dense_tile(cfg.bias_full, ins.bias, bq, bk),
           E.dense_tile(cfg.mask_full, ins.mask, bq, bk))
  return E.masked_logits(cfg, q, k, qb, kb, bq, bk, (_read(ins.q_seg), _read(ins.k_seg)),
                         (_read(ins.cq), _read(ins.ck)), dense, _read(ins.sel), log2=log2,
                         fp8_scales=fp8_scales)


def _values(refs):
  return tuple(rf[...] for rf in refs)


def _zero_at(cond, *refs):
  """Zeroes ``refs`` at the grid steps where ``cond`` holds (a pass's first step)."""
  @pl.when(cond)
  def _zero():
    for rf in refs:
      rf[...] = jnp.zeros_like(rf)


def _store_at(cond, outs, scratch):
  """Copies the accumulators ``scratch`` into ``outs`` where ``cond`` holds (the last
  step)."""
  @pl.when(cond)
  def _store():
    for rf, sc in zip(outs, scratch, strict=True):
      rf[...] = sc[...]


def _add_dq(cfg: E.Config, t: E.Tile, ds, k, ds_ref, dq_sc, row_sc, rows=()):
  """Adds a tile's dQ share (``k`` its keys) and per-row cotangents ``rows`` (then d cq,
  with a decay) into the scratch ``dq_sc`` and ``row_sc``; with a dense bias writes its dS
  tile into ``ds_ref``."""
  if ds_ref is not None:
    ds_ref[...] = ds
  dq, dcq = E.dq_tile(cfg, t, ds, k)
  dq_sc[...] += dq
  for sc, y in zip(row_sc, (*rows, dcq) if cfg.decay else rows, strict=True):
    sc[...] += y


def _add_dkv(cfg: E.Config, t: E.Tile, ds, q, dk_sc, dck_ref, w=None, do=None, dv_sc=None):
  """Adds a tile's dK share (``q`` its queries) into ``dk_sc``, its dV share (weights
  ``w``, ``do`` the output cotangent) into ``dv_sc`` (when not None) and, with a decay,
  subtracts its d ck share from the block ``dck_ref``."""
  dk, dck = E.dk_tile(cfg, t, ds, q, transpose=True)
  if dck_ref is not None:
    dck_ref[...] -= dck
  if dv_sc is not None:
    dv_sc[...] += E.dot(cfg, w.T.astype(do.dtype), do, (1, 0))
  dk_sc[...] += dk


def _dkv_init(gi, i, scratch, dck_ref):
  """The first steps of a dK/dV-style pass (grid step ``i`` of query head ``gi`` of the
  group): the accumulators ``scratch`` zeroed at the group's first, and with a decay the
  head's own d ck block (revisited over its consecutive steps) at each head's first."""
  _zero_at(jnp.logical_and(gi == 0, i == 0), *scratch)
  if dck_ref is not None:
    _zero_at(i == 0, dck_ref)


def _clear_off(ds_ref, off):
  """Zeroes the dS tile (``ds_ref``; None without a dense bias) of the steps where ``off``
  holds: every step writes its own tile, the ones the pass computes none for too."""
  if ds_ref is not None:
    _zero_at(off, ds_ref)


def forward(cfg: E.Config, q, k, v, dyn, aux: E.Aux):
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hv = q.shape[0], cfg.num_heads, cfg.hv_pad
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  sp = _q_major(cfg, bq, bk)
  grid, bounds = _q_grid(cfg, aux, b, n, nq, nk, aux.fwd_lo, aux.fwd_hi)
  row_shape = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)
  out_shape = [jax.ShapeDtypeStruct((b, n, cfg.t_pad, hv), v.dtype), row_shape, row_shape]
  scratch = [pltpu.VMEM((bq, 1), cfg.acc_dtype), pltpu.VMEM((bq, 1), cfg.acc_dtype),
             pltpu.VMEM((bq, hv), cfg.acc_dtype)]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, *refs):
    ins, (o_ref, m_ref, d_ref, m_sc, l_sc, acc_sc) = E.split_inputs(cfg, refs, len(dyn))
    bi, ni, qi, ki = (pl.program_id(a) for a in range(4))
    kb, active = _q_step(cfg, lo_ref, hi_ref, bi, ni, qi, ki, nq)

    @pl.when(ki == 0)
    def _init():
      m_sc[...], l_sc[...], acc_sc[...] = E.init_state(cfg, bq, hv)

    @pl.when(active)
    def _compute():
      # K06 exp2: the forward's logits in log2 units (the backward passes' stay natural)
      # K06 fp8: q and k float8, the dot times their scales
      t = _tile(cfg, ins, q_ref[...], k_ref[...], qi, kb, bq, bk, log2=cfg.exp2)
      state = E.forward_tile(cfg, t.x, t.mask, (m_sc[...], l_sc[...], acc_sc[...]),
                             v_ref[...], ins.length[...], _values(ins.dyn))
      m_sc[...], l_sc[...], acc_sc[...] = state

    @pl.when(ki == grid[3] - 1)
    def _finish():
      o, m, d = E.finalize(cfg, (m_sc[...], l_sc[...], acc_sc[...]), ins.length[...],
                           _values(ins.dyn))
      o_ref[...] = o.astype(o_ref.dtype)
      m_ref[...] = m
      d_ref[...] = d

  o, m, d = _call(
      cfg, kernel, "fwd", grid, sp, bounds,
      [(sp["q"], _heads_first(q)), (sp["kv"], _heads_first(k)), (sp["v"], _heads_first(v))],
      aux, dyn, [sp["o"], sp["row"], sp["row"]], out_shape, scratch)
  return _heads_first(o), m, d


def backward_dq(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  """dQ and the hyperparameters' cotangents; with a dense bias also dS [B, N, T_pad,
  S_pad], the cotangent of the biased logits (zero outside the visible key blocks); with
  a decay d cq [B, N, T_pad, W] (W = cfg.terms). Returns (dq, ddyn, dS or None, dcq or
  None)."""
  bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
  assert bq is not None and bk is not None  # Config.blocks is resolved
  b, n, hp, n_dyn = q.shape[0], cfg.num_heads, cfg.head_dim_pad, len(dyn)
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  has_bias = cfg.bias_full is not None
  n_rows = n_dyn + int(cfg.decay)  # the hyperparameters' cotangents, then dcq
  sp = _q_major(cfg, bq, bk)
  grid, bounds = _q_grid(cfg, aux, b, n, nq, nk, aux.dq_lo, aux.dq_hi)
  out_shape, out_specs = E.dq_outputs(cfg, sp, (b, n, cfg.t_pad, hp), n_dyn)
  if has_bias:  # every grid step writes its own dS tile (not clamped like the inputs; with
    # a block table into slot ki, the ki-th listed block's, scattered afterwards)
    out_shape.append(jax.ShapeDtypeStruct((b, n, cfg.t_pad, grid[3] * bk), cfg.acc_dtype))
    out_specs.append(pl.BlockSpec((None, None, bq, bk),
                                  lambda bi, ni, qi, ki, lo, hi: (bi, ni, qi, ki)))
  scratch = [pltpu.VMEM((bq, w), cfg.acc_dtype) for w in [hp] + E.row_widths(cfg, n_dyn)]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    ins, rest = E.split_inputs(cfg, refs, n_dyn)
    dq_ref, ddyn_refs = rest[0], rest[1:1 + n_rows]
    ds_ref = rest[1 + n_rows] if has_bias else None
    dq_sc, *ddyn_sc = rest[1 + n_rows + int(has_bias):]
    bi, ni, qi, ki = (pl.program_id(a) for a in range(4))
    kb, visible = _q_step(cfg, lo_ref, hi_ref, bi, ni, qi, ki, nq)
    _zero_at(ki == 0, dq_sc, *ddyn_sc)

    @pl.when(visible)
    def _compute():
      kt = k_ref[...]
      t = _tile(cfg, ins, q_ref[...], kt, qi, kb, bq, bk)
      dp = E.dot(cfg, do_ref[...], v_ref[...], (1, 1))
      _, ds, ddyn = E.backward_tile(cfg, t.x, t.mask, m_ref[...], d_ref[...], delta_ref[...],
                                    dp, ins.length[...], _values(ins.dyn))
      _add_dq(cfg, t, ds, kt, ds_ref, dq_sc, ddyn_sc, ddyn)

    _clear_off(ds_ref, jnp.logical_not(visible))
    _store_at(ki == grid[3] - 1, (dq_ref, *ddyn_refs), (dq_sc, *ddyn_sc))

  outs = _call(cfg, kernel, "dq", grid, sp, bounds,
               _backward_operands(sp, q, k, v, do, m, d, delta), aux, dyn, out_specs,
               out_shape, scratch)
  ds = outs[1 + n_rows] if has_bias else None
  if ds is not None and cfg.key_table:
    ds = _scatter_live(cfg, ds, aux.fwd_idx)
  return (_heads_first(outs[0]), tuple(outs[1:1 + n_dyn]), ds,
          outs[1 + n_dyn] if cfg.decay else None)


def backward_dkv(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  """dK, dV (and with a decay d ck) over the visible query blocks of each key block, or
  with a block table its listed ones."""
  if cfg.key_table:
    bounds, table = (aux.dkv_idx, aux.dkv_cnt), True
  else:
    bounds, table = (aux.dkv_lo, aux.dkv_hi), False

  def grads(t, dp, rows, length, dyn_v):
    mt, dt, delt = rows
    return E.backward_tile(cfg, t.x, t.mask, mt, dt, delt, dp, length, dyn_v)[:2]

  return _dkv_pass(cfg, "dkv", (cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv), q, k, v, do,
                   (m, d, delta), dyn, aux, bounds, table, grads)


def _dkv_pass(cfg: E.Config, name: str, blocks, q, k, v, do, rows, dyn, aux: E.Aux, bounds,
              table: bool, grads):
  """A dK/dV pass: grid (batch, KV head, key block, query head of the group, step), the
  step over the query blocks ``[lo, hi)`` of the key block (``bounds`` = (lo [B, nk], hi)),
  or with ``table`` over its compacted list (``bounds`` = (idx [B, N, nk, width], cnt
  [B, N, nk, 1])). ``grads(tile, dP, rows, length, dyn)`` gives the tile's ``(weights,
  dS)`` from ``rows``, the values of the per-row arrays [B, N, T_pad, 1] (residuals) the
  pass reads. Returns (dk, dv, dck or None)."""
  bq, bk = blocks
  b, kvh, hp, hv, g = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.hv_pad, cfg.groups
  nq, nk, n = cfg.t_pad // bq, cfg.s_pad // bk, cfg.num_heads
  # grid step i: query block i in the visible range, or (table) the i-th query block
  # listed for this (head, key block)
  width = bounds[0].shape[-1] if table else nq

  def step(bi, h, ki, gi, i, a, c):
    """(the query block of step i, whether it is computed)."""
    if table:
      r = (bi * n + h * g + gi) * nk + ki
      return _live(i, lambda: c[r], lambda j: a[r * width + j])
    r = bi * nk + ki
    return _clamp(i, a[r], c[r]), jnp.logical_and(i >= a[r], i < c[r])

  def index(bi, h, ki, gi, i, a, c):
    return bi, h * g + gi, h, step(bi, h, ki, gi, i, a, c)[0], ki

  sp = E.block_specs(cfg, index, bq, bk, heads_first=True)
  out_shape = [jax.ShapeDtypeStruct((b, kvh, cfg.s_pad, hp), cfg.acc_dtype),
               jax.ShapeDtypeStruct((b, kvh, cfg.s_pad, hv), cfg.acc_dtype)]
  scratch = [pltpu.VMEM((bk, hp), cfg.acc_dtype), pltpu.VMEM((bk, hv), cfg.acc_dtype)]
  out_specs = [sp["kv"], sp["v"]]
  if cfg.decay:  # d ck [B, N, W, S_pad]: one block per (query head, key block), revisited
    out_shape.append(E.term_shapes(cfg, b)[1])
    out_specs.append(sp["ck"])  # over the consecutive query-block steps

  def kernel(a_ref, c_ref, q_ref, k_ref, v_ref, do_ref, *refs):
    row_refs = refs[:len(rows)]
    ins, (dk_ref, dv_ref, *rest) = E.split_inputs(cfg, refs[len(rows):], len(dyn))
    dck_ref = rest[0] if cfg.decay else None
    dk_sc, dv_sc = rest[-2:]
    bi, h, ki, gi, i = (pl.program_id(a) for a in range(5))
    qb, active = step(bi, h, ki, gi, i, a_ref, c_ref)
    _dkv_init(gi, i, (dk_sc, dv_sc), dck_ref)

    @pl.when(active)
    def _compute():
      qt, dot_ = q_ref[...], do_ref[...]
      t = _tile(cfg, ins, qt, k_ref[...], qb, ki, bq, bk)
      dp = E.dot(cfg, dot_, v_ref[...], (1, 1))
      w, ds = grads(t, dp, _values(row_refs), ins.length[...], _values(ins.dyn))
      _add_dkv(cfg, t, ds, qt, dk_sc, dck_ref, w, dot_, dv_sc)

    _store_at(jnp.logical_and(gi == g - 1, i == width - 1), (dk_ref, dv_ref), (dk_sc, dv_sc))

  outs = _call(cfg, kernel, name, (b, kvh, nk, g, width), sp, bounds,
               _backward_operands(sp, q, k, v, do, *rows), aux, dyn, out_specs, out_shape,
               scratch)
  return _heads_first(outs[0]), _heads_first(outs[1]), (outs[2] if cfg.decay else None)


# ---------------------------------------------------------------------- class T (AdaSplash)
# engine's class-T section on the grid: the search is one pallas_call with grid (batch,
# head, query block, sweep, key block), sweep 0 the max pass and sweeps 1..P the tau
# search, its state in VMEM scratch. The weighted and backward passes iterate the
# compacted live-block lists (scalar-prefetched): step i of a query block visits its i-th
# live key block, steps past the count do nothing and their index map repeats the last
# live block, so skipped blocks are neither computed nor fetched.


def _live(i, cnt_at, idx_at):
  """(the block of step i, whether step i is live) from a live list and its count."""
  c = cnt_at()
  return idx_at(jnp.minimum(i, jnp.maximum(c - 1, 0))), i < c


def threshold_search(cfg: E.Config, q, k, dyn, aux: E.Aux):
  """Returns (m [B, N, T_pad, 1] (finite), tau [B, N, T_pad, 1], flags [B, N, nq, 1, nk],
  tau_search [B, N, T_pad, 1]) as the Triton driver's ``threshold_search``."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, g, n_dyn = q.shape[0], cfg.num_heads, cfg.groups, len(dyn)
  nq, nk, width = cfg.t_pad // bq, cfg.s_pad // bk, E.num_k_flags(cfg)
  n_cand, passes, _ = E.threshold_schedule(cfg, early_exit=False)  # multisection
  indicator = E.t_indicator(cfg)  # one more sweep: the largest score below tau

  def index(bi, ni, qi, p, ki, lo, hi):
    r = bi * nq + qi
    return bi, ni, E.div(ni, g), qi, _clamp(ki, lo[r], hi[r])

  sp = E.block_specs(cfg, index, bq, bk, heads_first=True)
  row_shape = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)
  flag_spec = pl.BlockSpec((None, None, None, 1, width),
                           lambda bi, ni, qi, p, ki, lo, hi: (bi, ni, qi, 0, 0))
  out_shape = [row_shape, row_shape, jax.ShapeDtypeStruct((b, n, nq, 1, width), jnp.int32),
               row_shape]
  row = pltpu.VMEM((bq, 1), cfg.acc_dtype)
  scratch = [row] * 4 + [pltpu.VMEM((1, width), jnp.int32)] + [row] * n_cand
  last = passes + int(indicator)

  def kernel(lo_ref, hi_ref, q_ref, k_ref, *refs):
    ins, rest = E.split_inputs(cfg, refs, n_dyn)
    m_out, tau_out, flag_out, res_out, m_sc, lo_sc, hi_sc, tg_sc, flag_sc, *tot_sc = rest
    bi, qi, p, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    r = bi * nq + qi
    length, dyn_v = ins.length[...], _values(ins.dyn)

    @pl.when(jnp.logical_and(p == 0, ki == 0))
    def _init():
      m_sc[...] = jnp.full((bq, 1), -jnp.inf, cfg.acc_dtype)

    @pl.when(jnp.logical_and(jnp.logical_and(p > 0, p <= passes), ki == 0))
    def _sweep_init():
      for sc in tot_sc:
        sc[...] = jnp.zeros_like(sc)
      flag_sc[...] = jnp.zeros_like(flag_sc)

    @pl.when(jnp.logical_and(p > passes, ki == 0))
    def _below_init():  # the indicator rules' extra sweep reuses the first total
      tot_sc[0][...] = jnp.full((bq, 1), -jnp.inf, cfg.acc_dtype)

    @pl.when(jnp.logical_and(ki >= lo_ref[r], ki < hi_ref[r]))
    def _compute():
      _, _, s, mask = _tile(cfg, ins, q_ref[...], k_ref[...], qi, ki, bq, bk)

      @pl.when(p == 0)
      def _max():
        m_sc[...] = E.t_max_tile(cfg, s, mask, m_sc[...], length, dyn_v)

      @pl.when(p > passes)
      def _below():
        tot_sc[0][...] = E.t_below_tile(cfg, s, mask, m_sc[...], lo_sc[...], tot_sc[0][...],
                                        length, dyn_v)

      @pl.when(jnp.logical_and(p > 0, p <= passes))
      def _mass():
        lo = lo_sc[...]
        taus = E.t_candidates(lo, hi_sc[...], None, n_cand)
        z, tots = E.t_sums_tile(cfg, s, mask, m_sc[...], taus, [sc[...] for sc in tot_sc],
                                length, dyn_v, newton=False)
        for sc, x in zip(tot_sc, tots, strict=True):
          sc[...] = x
        flag_sc[...] = E.t_flag_update(flag_sc[...], ki, E.t_live(z, mask, lo))

    @pl.when(jnp.logical_and(p == 0, ki == nk - 1))
    def _bracket():
      m, (lo, hi, _), target = E.t_start(cfg, m_sc[...], length, dyn_v)
      m_sc[...], lo_sc[...], hi_sc[...], tg_sc[...] = m, lo, hi, target

    @pl.when(jnp.logical_and(jnp.logical_and(p > 0, p <= passes), ki == nk - 1))
    def _narrow():
      lo, hi = lo_sc[...], hi_sc[...]
      state = (lo, hi, jnp.full_like(lo, -jnp.inf))
      lo, hi, _ = E.t_update(cfg, state, E.t_candidates(lo, hi, None, n_cand),
                                [sc[...] for sc in tot_sc], tg_sc[...], dyn_v,
                                newton=False)
      lo_sc[...], hi_sc[...] = lo, hi

    @pl.when(jnp.logical_and(p == last, ki == nk - 1))
    def _finish():
      m_out[...] = m_sc[...]
      res_out[...] = lo_sc[...]
      if indicator:
        tau_out[...] = E.t_gap_tau(lo_sc[...], tot_sc[0][...])
      else:
        tau_out[...] = lo_sc[...]
      flag_out[...] = flag_sc[...]

  return _call(cfg, kernel, "tsearch", (b, n, nq, last + 1, nk), sp,
               (aux.fwd_lo, aux.fwd_hi), [(sp["q"], _heads_first(q)), (sp["kv"], _heads_first(k))],
               aux, dyn, [sp["row"], sp["row"], flag_spec, sp["row"]], out_shape, scratch)


def _q_major_live(cfg: E.Config, idx_shape):
  """Specs of the passes over query blocks that visit the live key blocks: grid (batch,
  head, query block, [phase,] step); ``idx``/``cnt`` flattened from [B, N, nq, width]."""
  g, n, nq, width = cfg.groups, cfg.num_heads, idx_shape[2], idx_shape[3]

  def index(bi, ni, qi, *rest):
    i, idx, cnt = rest[-3:]
    r = (bi * n + ni) * nq + qi
    kb, _ = _live(i, lambda: cnt[r], lambda j: idx[r * width + j])
    return bi, ni, E.div(ni, g), qi, kb

  return E.block_specs(cfg, index, cfg.blocks.block_q, cfg.blocks.block_k, heads_first=True)


def threshold_forward(cfg: E.Config, q, k, v, m, tau, idx, cnt, dyn, aux: E.Aux):
  """The weighted pass over the live key blocks: returns (o, W [B, N, T_pad, 1])."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hv, n_dyn = q.shape[0], cfg.num_heads, cfg.hv_pad, len(dyn)
  nq, width = idx.shape[2], idx.shape[3]
  sp = _q_major_live(cfg, idx.shape)
  out_shape = [jax.ShapeDtypeStruct((b, n, cfg.t_pad, hv), q.dtype),
               jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)]
  scratch = [pltpu.VMEM((bq, 1), cfg.acc_dtype), pltpu.VMEM((bq, hv), cfg.acc_dtype)]

  def kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, m_ref, tau_ref, *refs):
    ins, (o_ref, d_ref, l_sc, acc_sc) = E.split_inputs(cfg, refs, n_dyn)
    bi, ni, qi, i = (pl.program_id(a) for a in range(4))
    r = (bi * n + ni) * nq + qi
    kb, live = _live(i, lambda: cnt_ref[r], lambda j: idx_ref[r * width + j])
    _zero_at(i == 0, l_sc, acc_sc)

    @pl.when(live)
    def _compute():
      t = _tile(cfg, ins, q_ref[...], k_ref[...], qi, kb, bq, bk)
      w = E.t_weight_tile(cfg, t.x, t.mask, tau_ref[...], m_ref[...], ins.length[...],
                          _values(ins.dyn))
      vt = v_ref[...]
      l_sc[...] += jnp.sum(w, axis=-1, keepdims=True)
      acc_sc[...] += E.dot(cfg, w.astype(vt.dtype), vt, (1, 0))

    @pl.when(i == width - 1)
    def _finish():
      lsum = l_sc[...]
      o_ref[...] = (acc_sc[...] * E.tile.safe_inverse(lsum)).astype(o_ref.dtype)
      d_ref[...] = lsum

  o, d = _call(cfg, kernel, "tfwd", (b, n, nq, width), sp, (idx, cnt),
               [(sp["q"], _heads_first(q)), (sp["kv"], _heads_first(k)),
                (sp["v"], _heads_first(v)), (sp["row"], m), (sp["row"], tau)],
               aux, dyn, [sp["o"], sp["row"]], out_shape, scratch)
  return _heads_first(o), d


def threshold_backward_dq(cfg: E.Config, q, k, v, do, m, tau, d, delta, idx, cnt, dyn,
                          aux: E.Aux):
  """dQ over the live key blocks, in two phases of the grid: phase 0 sums ``coef``'s
  parts, phase 1 the cotangents. Returns (dq, coef, ddyn, dS or None, dcq or None).

  With a dense bias, phase 1's step i writes the i-th live tile's logit cotangent into
  slot i of a compacted [B, N, T_pad, width * bk] array (zeros past the count; phase 0
  parks on slot 0, so every slot is written back once), scattered to dS [B, N, T_pad,
  S_pad] in XLA afterwards."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hp, n_dyn = q.shape[0], cfg.num_heads, cfg.head_dim_pad, len(dyn)
  nq, width = idx.shape[2], idx.shape[3]
  has_bias = cfg.bias_full is not None
  n_rows = n_dyn + int(cfg.decay)  # the hyperparameters' cotangents, then dcq
  sp = _q_major_live(cfg, idx.shape)
  out_shape, out_specs = E.dq_outputs(cfg, sp, (b, n, cfg.t_pad, hp), 1 + n_dyn)  # coef first
  if has_bias:
    out_shape.append(jax.ShapeDtypeStruct((b, n, cfg.t_pad, width * bk), cfg.acc_dtype))
    out_specs.append(pl.BlockSpec((None, None, bq, bk),
                                  lambda bi, ni, qi, ph, i, idx, cnt: (bi, ni, qi, i * ph)))
  rsc = pltpu.VMEM((bq, 1), cfg.acc_dtype)
  scratch = [pltpu.VMEM((bq, hp), cfg.acc_dtype), rsc, rsc, rsc]
  scratch += [pltpu.VMEM((bq, w), cfg.acc_dtype) for w in E.row_widths(cfg, n_dyn)]

  def kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, m_ref, tau_ref, d_ref, delta_ref,
             *refs):
    ins, rest = E.split_inputs(cfg, refs, n_dyn)
    dq_ref, coef_ref, ddyn_refs = rest[0], rest[1], rest[2:2 + n_rows]
    ds_ref = rest[2 + n_rows] if has_bias else None
    dq_sc, g_sc, mt_sc, coef_sc, *ddyn_sc = rest[2 + n_rows + int(has_bias):]
    bi, ni, qi, ph, i = (pl.program_id(a) for a in range(5))
    r = (bi * n + ni) * nq + qi
    kb, live = _live(i, lambda: cnt_ref[r], lambda j: idx_ref[r * width + j])
    length, dyn_v = ins.length[...], _values(ins.dyn)
    _zero_at(jnp.logical_and(ph == 0, i == 0), dq_sc, g_sc, mt_sc, *ddyn_sc)

    @pl.when(live)
    def _compute():
      kt = k_ref[...]
      t = _tile(cfg, ins, q_ref[...], kt, qi, kb, bq, bk)
      dp = E.dot(cfg, do_ref[...], v_ref[...], (1, 1))

      @pl.when(ph == 0)
      def _coef_parts():
        gt, mt = E.t_coef_tile(cfg, t.x, t.mask, tau_ref[...], m_ref[...], delta_ref[...], dp,
                               length, dyn_v)
        g_sc[...] += gt
        mt_sc[...] += mt

      @pl.when(ph == 1)
      def _grads():
        _, ds, dd = E.t_backward_tile(cfg, t.x, t.mask, tau_ref[...], m_ref[...], d_ref[...],
                                      delta_ref[...], coef_sc[...], dp, length, dyn_v)
        _add_dq(cfg, t, ds, kt, ds_ref, dq_sc, ddyn_sc, dd)

    _clear_off(ds_ref, jnp.logical_and(ph == 1, jnp.logical_not(live)))

    @pl.when(jnp.logical_and(ph == 0, i == width - 1))
    def _coef():
      coef_sc[...] = E.t_coef(g_sc[...], mt_sc[...], d_ref[...])

    _store_at(jnp.logical_and(ph == 1, i == width - 1), (dq_ref, coef_ref, *ddyn_refs),
              (dq_sc, coef_sc, *ddyn_sc))

  outs = _call(cfg, kernel, "tdq", (b, n, nq, 2, width), sp, (idx, cnt),
               _backward_operands(sp, q, k, v, do, m, tau, d, delta), aux, dyn,
               out_specs, out_shape, scratch)
  ds = _scatter_live(cfg, outs[-1], idx) if has_bias else None
  return (_heads_first(outs[0]), outs[1], tuple(outs[2:2 + n_dyn]), ds,
          outs[2 + n_dyn] if cfg.decay else None)


def _scatter_live(cfg: E.Config, compact, idx):
  """dS [B, N, T_pad, S_pad] from its live tiles in slots ([B, N, T_pad, width * bk]; slot i
  of query block r holds key block ``idx[..., r, i]``; the slots past the count are zero,
  so adding them to the repeated last live block changes nothing)."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, nq, width = idx.shape
  nk = cfg.s_pad // bk
  tiles = compact.reshape(b, n, nq, bq, width, bk).transpose(0, 1, 2, 4, 3, 5)
  bi, ni, qi = jnp.meshgrid(jnp.arange(b), jnp.arange(n), jnp.arange(nq), indexing="ij")
  full = jnp.zeros((b, n, nq, nk, bq, bk), compact.dtype)
  full = full.at[bi[..., None], ni[..., None], qi[..., None], idx].add(tiles)
  return full.transpose(0, 1, 2, 4, 3, 5).reshape(b, n, cfg.t_pad, cfg.s_pad)


def threshold_backward_dkv(cfg: E.Config, q, k, v, do, m, tau, d, delta, coef, idx_t, cnt_t,
                           dyn, aux: E.Aux):
  """dK, dV over, per key block and query head, the query blocks for which it is live."""

  def grads(t, dp, rows, length, dyn_v):
    mt, taut, dt, delt, ct = rows
    return E.t_backward_tile(cfg, t.x, t.mask, taut, mt, dt, delt, ct, dp, length, dyn_v)[:2]

  return _dkv_pass(cfg, "tdkv", (cfg.blocks.block_q, cfg.blocks.block_k), q, k, v, do,
                   (m, tau, d, delta, coef), dyn, aux, (idx_t, cnt_t), True, grads)
