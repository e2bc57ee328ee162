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
           "threshold_backward_dq", "threshold_backward_dkv", "launch_params", "ANCHOR_FORWARD",
           "ANCHOR_BACKWARD"]


def _q_major(cfg: E.Config, bq: int):
  """Specs of the passes over query blocks (forward, dQ): grid (query block, batch, head)."""
  g = cfg.groups
  return E.block_specs(cfg, lambda qi, bi, ni: (bi, ni, E.div(ni, g), qi, 0), bq, cfg.s_pad)


def _backward_operands(sp, q, k, v, do, *rows):
  """The operands of a backward pass: q, k, v, dO, then its per-row arrays [B, N, T_pad, 1]."""
  return [(sp["q"], q), (sp["kv"], k), (sp["v"], v), (sp["o"], do)] + [(sp["row"], x)
                                                                      for x in rows]


def _call(cfg: E.Config, kernel, name: str, grid, rows: int, sp, bounds, operands, aux, dyn,
          out_specs, out_shape, table: bool | None = None, group: bool = False):
  """pallas_call of one pass: the loop bounds [lo, hi) of each (batch, block), the pass's
  own ``(spec, array)`` operands, then :func:`engine.pass_inputs`. With ``table``
  (default: a block table, ``cfg.key_table``) ``bounds`` is ``(idx, cnt)`` of the loop
  instead: the compacted block list of each (batch, head, block) and its count, [B, N,
  blocks, width] and [B, N, blocks, 1]; a dK/dV pass (``group``) reads the lists of its G
  query heads. ``rows``: the rows of the pass's tiles (the default warp count)."""
  if cfg.key_table if table is None else table:
    width, g = bounds[0].shape[-1], (cfg.groups if group else None)
    at = (lambda i, bi, h: (bi, h, i, 0))
    lead = [(pl.BlockSpec((None, g, None, width), at), bounds[0]),
            (pl.BlockSpec((None, g, None, 1), at), bounds[1])]
  else:
    bound = pl.BlockSpec((None, None), lambda i, bi, h: (bi, i))
    lead = [(bound, x) for x in bounds]
  operands = lead + operands
  extra_specs, extra = E.pass_inputs(cfg, sp, aux, dyn)
  itemsize = max(jnp.dtype(o[1].dtype).itemsize for o in operands[len(lead):])
  warps, stages = launch_params(cfg, name, rows, itemsize)
  out_shape = E.varying_like(out_shape, [o[1] for o in operands] + list(extra))
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[*(o[0] for o in operands), *extra_specs],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=bool(cfg.interpret), debug=cfg.debug,
      name=f"jaxsoft_attention_{name}_{cfg.spec.name}",
  )(*(o[1] for o in operands), *extra)


# The measured winners of the H100 anchors (tokamax's Pallas-Triton autotuning, bf16,
# d = 128): (block_q, block_k, warps, stages) of the forward and of the backward passes.
ANCHOR_FORWARD = (128, 128, 8, 3)
ANCHOR_BACKWARD = (64, 64, 4, 2)
_FORWARD_PASSES = ("fwd", "tsearch", "tfwd")


def _smem_budget() -> int:
  """Shared memory per block of the default device, bytes: 227 KiB on sm_90 and newer
  (and without a GPU: export and the interpreter assume an H100), 163 KiB on sm_80,
  99 KiB on the other GPUs."""
  try:
    device = jax.devices()[0]
  except RuntimeError:  # pragma: no cover
    return 227 * 1024
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or cc is None:
    return 227 * 1024
  cc = float(cc)
  return (227 if cc >= 9.0 else 163 if cc == 8.0 else 99) * 1024


def launch_params(cfg: E.Config, name: str, rows: int, itemsize: int = 2) -> tuple[int, int]:
  """``(num_warps, num_stages)`` of the pass ``name`` (``rows``: its tiles' rows;
  ``itemsize``: bytes per element of its inputs).

  ``BlockSizes.num_warps`` / ``num_stages`` when set, for every pass. Otherwise a pass
  whose tile is its anchor's (:data:`ANCHOR_FORWARD` for the forward-like passes,
  :data:`ANCHOR_BACKWARD` for dQ and dK/dV) runs the anchor's warps and stages where the
  head dims are at most 128 and its pipeline fits the device's shared memory (``stages``
  buffers of a k and a v tile, ``stages * block_k * (d + dv) * itemsize``, plus the
  resident q tile); any other tile keeps 4 warps for tiles of at most 64 rows with head
  dim <= 64, else 8, and 2 stages.

  Examples:
    >>> import types
    >>> import kernels_pallas as kp
    >>> from kernels_pallas import triton
    >>> cfg = types.SimpleNamespace(blocks=kp.BlockSizes(128, 128, 64, 64, 64, 64),
    ...                             head_dim_pad=128, hv_pad=128)
    >>> triton.launch_params(cfg, "fwd", 128), triton.launch_params(cfg, "dkv", 64)
    ((8, 3), (4, 2))
  """
  bl = cfg.blocks
  forward = name in _FORWARD_PASSES
  tile: tuple[int | None, int | None] = (bl.block_q, bl.block_k)
  if name == "dq":
    tile = (bl.block_q_dq, bl.block_k_dq)
  elif name == "dkv":
    tile = (bl.block_q_dkv, bl.block_k_dkv)
  anchor = ANCHOR_FORWARD if forward else ANCHOR_BACKWARD
  warps, stages = (4 if cfg.head_dim_pad <= 64 and rows <= 64 else 8), 2
  if tile == anchor[:2] and max(cfg.head_dim_pad, cfg.hv_pad) <= 128:
    bq, bk = anchor[:2]
    smem = (anchor[3] * bk * (cfg.head_dim_pad + cfg.hv_pad) + bq * cfg.head_dim_pad) * itemsize
    if smem <= _smem_budget():
      warps, stages = anchor[2:]
  return bl.num_warps or warps, bl.num_stages or stages


def _key_loop(cfg: E.Config, a_ref, b_ref, head=None):
  """``(start, stop, block)`` of a pass's block loop: the range [lo, hi) (``a_ref``,
  ``b_ref``; ``block(j) = j``), or with a block table the first ``cnt`` entries of the
  compacted list (``block(j) = idx[j]``; ``head`` picks the query head of a dK/dV pass)."""
  if not cfg.key_table:
    return a_ref[...], b_ref[...], lambda j: j
  return _table_loop(a_ref, b_ref, head)


def _table_loop(idx_ref, cnt_ref, head=None):
  """``(start, stop, block)`` of a loop over a compacted block list (``head``: of that
  query head of a dK/dV-style pass's group)."""
  # The loop starts at ``cnt - cnt`` (0) rather than a constant: in the Pallas interpreter
  # inside ``jax.shard_map`` (default ``check_vma``) the list varies over the mesh axes, and
  # ``idx_ref[j]`` needs an index that varies over them too.
  if head is not None:  # [G, 1] read whole, the head's row picked by a select and a sum
    cnt = cnt_ref[...]
    cnt = jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, cnt.shape, 0) == head, cnt, 0))
    return cnt - cnt, cnt, lambda j: idx_ref[j - j + head, j]
  cnt = cnt_ref[...].reshape(())  # [1]: read whole (not at a constant index)
  return cnt - cnt, cnt, lambda j: idx_ref[j]


def _bounds(cfg: E.Config, aux: E.Aux, lo, hi, dkv: bool = False):
  """The leading loop operands of a pass: its [lo, hi) ranges, or the block table."""
  if not cfg.key_table:
    return lo, hi
  return (aux.dkv_idx, aux.dkv_cnt) if dkv else (aux.fwd_idx, aux.fwd_cnt)


def forward(cfg: E.Config, q, k, v, dyn, aux: E.Aux):
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, hv = q.shape[0], cfg.num_heads, cfg.hv_pad
  sp = _q_major(cfg, bq)
  row_shape = jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)
  out_shape = [jax.ShapeDtypeStruct((b, cfg.t_pad, n, hv), v.dtype), row_shape, row_shape]

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, *refs):
    ins, (o_ref, m_ref, d_ref) = E.split_inputs(cfg, refs, len(dyn))
    qi = pl.program_id(0)
    length, dyn_v, qt = ins.length[...], _values(ins.dyn), q_ref[...]
    rows = _q_rows(ins)
    start, stop, block = _key_loop(cfg, lo_ref, hi_ref)

    def body(j, state):
      kb = block(j)
      # K06 exp2: the logits in log2 units (the backward passes' too: _grad_tile);
      # K06 fp8: q and k float8, the dot times their scales
      sl, _, t = _key_block(cfg, ins, rows, qt, k_ref, qi, kb, bq, bk, log2=cfg.exp2)
      return E.forward_tile(cfg, t.x, t.mask, state, v_ref[sl, :], length, dyn_v)

    state = jax.lax.fori_loop(start, stop, body, E.init_state(cfg, bq, hv))
    o, m, d = E.finalize(cfg, state, length, dyn_v)
    o_ref[...] = o.astype(o_ref.dtype)
    m_ref[...] = m
    d_ref[...] = d

  return _call(cfg, kernel, "fwd", (cfg.t_pad // bq, b, n), bq, sp,
               _bounds(cfg, aux, aux.fwd_lo, aux.fwd_hi),
               [(sp["q"], q), (sp["kv"], k), (sp["v"], v)], aux, dyn,
               [sp["o"], sp["row"], sp["row"]], out_shape)


def _values(refs):
  return tuple(rf[...] for rf in refs)


def _read(ref, *index):
  """``ref[index]`` (all of it without an index), or None for an absent input."""
  return None if ref is None else ref[index or ...]


def _q_rows(ins: E.InputRefs):
  """The query side of a pass over query blocks, read once per program: (segment ids,
  the decay's row terms, the per-row block lists, the fp8 scales), each None when absent."""
  return _read(ins.q_seg), _read(ins.cq), _read(ins.sel), _read(ins.q_scale)


def _key_block(cfg: E.Config, ins: E.InputRefs, rows, qt, k_ref, qi, kb, bq: int, bk: int,
               log2: bool = False):
  """``(slice, keys, tile)`` of key block ``kb`` in a pass over query blocks: the tile
  (:func:`engine.masked_logits`) of the program's query block ``qi`` (``qt``, ``rows``
  from :func:`_q_rows`) with the block's columns of the whole-length key-side refs."""
  qs, cq, sel, sq = rows
  sl = pl.ds(kb * bk, bk)
  kt = k_ref[sl, :]
  dense = (E.dense_tile(cfg.bias_full, ins.bias, bq, bk, cols=sl),
           E.dense_tile(cfg.mask_full, ins.mask, bq, bk, cols=sl))
  t = E.masked_logits(cfg, qt, kt, qi, kb, bq, bk, (qs, _read(ins.k_seg, slice(None), sl)),
                      (cq, _read(ins.ck, slice(None), sl)), dense, sel, log2=log2,
                      fp8_scales=None if sq is None else (sq, ins.k_scale[:, sl]))
  return sl, kt, t


def _query_block(cfg: E.Config, ins: E.InputRefs, cols, q_ref, kt, gi: int, qb, ki, bq: int,
                 bk: int, log2: bool = False):
  """``(slice, queries, tile)`` of query block ``qb`` of query head ``gi`` in a dK/dV-style
  pass: the program's key block ``ki`` (``kt``; ``cols`` = (key segment ids, the head's
  decay column terms), read once) with the block's rows of the whole-length query-side
  refs (``log2`` as :func:`_key_block`)."""
  sl = pl.ds(qb * bq, bq)
  qt = q_ref[sl, gi, :]
  dense = (E.dense_tile(cfg.bias_full, ins.bias, bq, bk, gi, sl),
           E.dense_tile(cfg.mask_full, ins.mask, bq, bk, gi, sl))
  every = slice(None)
  t = E.masked_logits(cfg, qt, kt, qb, ki, bq, bk, (_read(ins.q_seg, sl, every), cols[0]),
                      (_read(ins.cq, gi, sl, every), cols[1]), dense,
                      _read(ins.sel, gi, sl, every), log2=log2)
  return sl, qt, t


def _head_rows(cfg: E.Config, ins: E.InputRefs, gi: int, sl):
  """``(visible counts, hyperparameters)`` of query head ``gi``'s rows ``sl``."""
  length = ins.length[gi, sl, :] if cfg.length_rows else ins.length[sl, :]
  return length, tuple(rf[gi, sl, :] for rf in ins.dyn)


def _add_dq(cfg: E.Config, t: E.Tile, ds, kt, ds_ref, sl, carry, rows=()):
  """``carry`` = (dQ, per-row cotangents) plus a tile's shares (``kt`` its keys): dQ's,
  those of ``rows`` and, with a decay, d cq's; with a dense bias writes its dS columns
  ``sl`` into ``ds_ref``."""
  if ds_ref is not None:
    ds_ref[:, sl] = ds
  dq, dcq = E.dq_tile(cfg, t, ds, kt)
  rows = (*rows, dcq) if cfg.decay else rows
  return carry[0] + dq, tuple(a + y for a, y in zip(carry[1], rows, strict=True))


def _dq_init(cfg: E.Config, bq: int, rows: int):
  """The zero carry of :func:`_add_dq`: dQ and ``rows`` per-row cotangents (then d cq)."""
  return (jnp.zeros((bq, cfg.head_dim_pad), cfg.acc_dtype),
          tuple(jnp.zeros((bq, w), cfg.acc_dtype) for w in E.row_widths(cfg, rows)))


def _store(refs, values):
  for rf, x in zip(refs, values, strict=True):
    rf[...] = x


def _clear_ds(cfg: E.Config, ds_ref, bq: int, bk: int, spans):
  """Zeroes dS on the key blocks of each ``[start, stop)`` in ``spans`` (those the key loop
  does not write; nothing without a dense bias, ``ds_ref`` None)."""
  if ds_ref is None:
    return

  def clear(j, c):
    ds_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), cfg.acc_dtype)
    return c

  for start, stop in spans:
    jax.lax.fori_loop(start, stop, clear, 0)


def _add_dkv(cfg: E.Config, t: E.Tile, ds, qt, carry, w=None, do=None):
  """``carry`` = (dK, [dV,] d ck) plus a tile's shares (``qt`` its queries): dK's, dV's
  (weights ``w``, ``do`` the output cotangent; without ``w`` the carry has no dV) and,
  with a decay, minus d ck's."""
  dk, dck = E.dk_tile(cfg, t, ds, qt, transpose=False)
  dv = () if w is None else (carry[1] + E.dot(cfg, w.astype(do.dtype), do, (0, 0)),)
  return carry[0] + dk, *dv, (carry[-1] if dck is None else carry[-1] - dck)


def _over_heads(cfg: E.Config, ins: E.InputRefs, g: int, bk: int, init, loop, body, dck_refs):
  """Runs a dK/dV-style program over the query heads ``gi`` of its group:
  ``carry = body(gi, ck, qb, carry)`` (``ck`` the head's decay column terms or None) over
  the query blocks ``qb`` of the head's loop ``loop(gi)`` (:func:`_key_loop`'s ``(start,
  stop, block)``), the accumulators ``init`` carried across the heads and each head's
  d ck [W, bk] stored into ``dck_refs`` (with a decay). Returns the accumulators."""
  acc = tuple(init)
  for gi in range(g):  # the query heads sharing this KV head
    ck = _read(ins.ck, gi)
    start, stop, block = loop(gi)

    def step(j, carry, gi=gi, ck=ck, block=block):
      return body(gi, ck, block(j), carry)

    *acc, dck = jax.lax.fori_loop(start, stop, step,
                                  (*acc, jnp.zeros((cfg.terms, bk), cfg.acc_dtype)))
    if dck_refs:
      dck_refs[0][gi] = dck
  return acc


def exp2_backward(cfg: E.Config) -> bool:
  """Whether the backward passes recompute the weights with exp2 (the forward's K06
  ``exp2`` flag): class E with ``e^{z - m}`` numerators and a linear score map
  (:func:`engine.check_flags` has checked that) and no per-row hyperparameter array (whose
  cotangent the natural-unit rule gives)."""
  return bool(cfg.exp2) and cfg.kernel_class == "E" and not cfg.dyn_hp


def _grad_tile(cfg: E.Config, t: E.Tile, m, d, delta, dp, length, dyn):
  """``(w, dS, d hyperparameters)`` of a backward tile (:func:`engine.backward_tile`).

  With :func:`exp2_backward` the tile's logits ``t`` are in log2 units (log2 e folded
  into the scale, as the forward's) and the weights are recomputed as

      w = 2^(z2 - m log2 e) / D,   dS = score_map'(w (dP - Delta))

  (``z2 = score_map(x2) = log2(e) z``: the map is linear, so its vjp is the natural-unit
  one), the same numbers as ``e^{z - m} / D`` without the multiply by log2 e per score
  (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
  Partitioning", arXiv:2307.08691; Shah et al. 2024, "FlashAttention-3",
  arXiv:2407.08608). The tile that goes on to dQ / dK (the soft cap's derivative reads
  its logits) is given back in natural units (``t`` itself without a soft cap)."""
  if not exp2_backward(cfg):
    return t, E.backward_tile(cfg, t.x, t.mask, m, d, delta, dp, length, dyn)
  rule, hp = cfg.tile, dict(cfg.static_hp)
  x2 = E.mask_where(t.mask, t.x, jnp.zeros_like(t.x))
  z2, score_vjp = jax.vjp(lambda x: rule.score_map(x, length, **hp), x2)
  m2 = m * E.LOG2E
  w = E.mask_where(t.mask, jnp.exp2(E.mask_where(t.mask, z2, m2) - m2), 0.0)
  w = w * E.tile.safe_inverse(d)
  (ds,) = score_vjp(w * (dp - delta))
  if cfg.soft_cap is not None:  # soft_cap_grad reads s / cap in natural units
    t = t._replace(s=t.s * E.LN2)
  return t, (w, ds, ())


def backward_dq(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  """The Triton form of :func:`kernels_pallas.tpu.backward_dq` (same arguments, same
  returns)."""
  bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
  assert bq is not None and bk is not None  # Config.blocks is resolved
  b, n, n_dyn = q.shape[0], cfg.num_heads, len(dyn)
  has_bias, nk = cfg.bias_full is not None, cfg.s_pad // bk
  sp = _q_major(cfg, bq)
  n_rows = n_dyn + int(cfg.decay)  # the hyperparameters' cotangents, then dcq
  exp2 = exp2_backward(cfg)
  out_shape, out_specs = E.dq_outputs(cfg, sp, q.shape, n_dyn)
  if has_bias:
    out_shape.append(jax.ShapeDtypeStruct((b, n, cfg.t_pad, cfg.s_pad), cfg.acc_dtype))
    out_specs.append(pl.BlockSpec((None, None, bq, cfg.s_pad),
                                  lambda qi, bi, ni: (bi, ni, qi, 0)))

  def kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, m_ref, d_ref, delta_ref, *refs):
    ins, (dq_ref, *outs) = E.split_inputs(cfg, refs, n_dyn)
    ddyn_refs, ds_ref = outs[:n_rows], (outs[n_rows] if has_bias else None)
    qi = pl.program_id(0)
    length, dyn_v = ins.length[...], _values(ins.dyn)
    qt, dot_, mt, dt, delt = q_ref[...], do_ref[...], m_ref[...], d_ref[...], delta_ref[...]
    rows = _q_rows(ins)
    lo, hi, block = _key_loop(cfg, lo_ref, hi_ref)

    def body(j, carry):
      sl, kt, t = _key_block(cfg, ins, rows, qt, k_ref, qi, block(j), bq, bk, log2=exp2)
      dp = E.dot(cfg, dot_, v_ref[sl, :], (1, 1))
      t, (_, ds, dd) = _grad_tile(cfg, t, mt, dt, delt, dp, length, dyn_v)
      return _add_dq(cfg, t, ds, kt, ds_ref, sl, carry, dd)

    # the key blocks the loop skips have dS = 0 (with a block table: every block, then
    # the loop writes the listed ones)
    _clear_ds(cfg, ds_ref, bq, bk, [(0, nk)] if cfg.key_table else [(0, lo), (hi, nk)])
    dq, ddyn = jax.lax.fori_loop(lo, hi, body, _dq_init(cfg, bq, n_dyn))
    _store((dq_ref, *ddyn_refs), (dq, *ddyn))

  outs = _call(cfg, kernel, "dq", (cfg.t_pad // bq, b, n), bq, sp,
               _bounds(cfg, aux, aux.dq_lo, aux.dq_hi),
               _backward_operands(sp, q, k, v, do, m, d, delta), aux, dyn, out_specs, out_shape)
  return (outs[0], tuple(outs[1:1 + n_dyn]), (outs[-1] if has_bias else None),
          outs[1 + n_dyn] if cfg.decay else None)


def backward_dkv(cfg: E.Config, q, k, v, do, m, d, delta, dyn, aux: E.Aux):
  """The Triton form of :func:`kernels_pallas.tpu.backward_dkv`."""

  def grads(t, dp, rows, length, dyn_v):
    mt, dt, delt = rows
    t, (w, ds, _) = _grad_tile(cfg, t, mt, dt, delt, dp, length, dyn_v)
    return t, w, ds

  return _dkv_pass(cfg, "dkv", (cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv), q, k, v, do,
                   (m, d, delta), dyn, aux, _bounds(cfg, aux, aux.dkv_lo, aux.dkv_hi, dkv=True),
                   cfg.key_table, grads, log2=exp2_backward(cfg))


def _dkv_pass(cfg: E.Config, name: str, blocks, q, k, v, do, rows, dyn, aux: E.Aux, bounds,
              table: bool, grads, log2: bool = False):
  """A dK/dV pass: one program per (key block, batch, KV head), which holds its G query
  heads (the q-side blocks span the whole padded length and the group's heads, so GQA
  never copies K/V) and loops over each head's query blocks ``[lo, hi)`` (``bounds`` =
  (lo [B, nk], hi)), or with ``table`` over its compacted list (``bounds`` = (idx [B, N,
  nk, width], cnt [B, N, nk, 1])). ``grads(tile, dP, rows, length, dyn)`` gives ``(tile,
  weights, dS)`` from ``rows``, the tile's values of the per-row arrays [B, N, T_pad, 1]
  (residuals) the pass reads (the tile it returns goes on to dK: :func:`_grad_tile`);
  ``log2``: the tiles' logits in log2 units (:func:`exp2_backward`). Returns (dk, dv, dck
  or None)."""
  bq, bk = blocks
  b, kvh, hp, hv, g = q.shape[0], cfg.num_kv_heads, cfg.head_dim_pad, cfg.hv_pad, cfg.groups
  sp = E.block_specs(cfg, lambda ki, bi, hi: (bi, hi, hi, 0, ki), cfg.t_pad, bk, q_heads=g)
  out_shape = [jax.ShapeDtypeStruct(k.shape, cfg.acc_dtype),
               jax.ShapeDtypeStruct(v.shape, cfg.acc_dtype)]
  out_specs = [sp["kv"], sp["v"]]
  if cfg.decay:  # d ck [B, N, W, S_pad]: minus the column sums of dS, per query head
    out_shape.append(E.term_shapes(cfg, b)[1])
    out_specs.append(sp["ck"])

  def kernel(a_ref, c_ref, q_ref, k_ref, v_ref, do_ref, *refs):
    row_refs = refs[:len(rows)]
    ins, (dk_ref, dv_ref, *dck_refs) = E.split_inputs(cfg, refs[len(rows):], len(dyn))
    ki = pl.program_id(0)
    ks = _read(ins.k_seg)
    kt, vt = k_ref[...], v_ref[...]

    def body(gi, ck, qb, carry):
      sl, qt, t = _query_block(cfg, ins, (ks, ck), q_ref, kt, gi, qb, ki, bq, bk, log2)
      dot_ = do_ref[sl, gi, :]
      dp = E.dot(cfg, dot_, vt, (1, 1))
      t, w, ds = grads(t, dp, tuple(r[gi, sl, :] for r in row_refs),
                       *_head_rows(cfg, ins, gi, sl))
      return _add_dkv(cfg, t, ds, qt, carry, w, dot_)

    def loop(gi):
      if table:
        return _table_loop(a_ref, c_ref, gi)
      return a_ref[...], c_ref[...], lambda j: j

    init = (jnp.zeros((bk, hp), cfg.acc_dtype), jnp.zeros((bk, hv), cfg.acc_dtype))
    _store((dk_ref, dv_ref), _over_heads(cfg, ins, g, bk, init, loop, body, dck_refs))

  outs = _call(cfg, kernel, name, (cfg.s_pad // bk, b, kvh), bk, sp, bounds,
               _backward_operands(sp, q, k, v, do, *rows), aux, dyn, out_specs, out_shape,
               table=table, group=True)
  return outs[0], outs[1], (outs[2] if cfg.decay else None)


# ---------------------------------------------------------------------- class T (AdaSplash)
# The four passes of engine's class-T section. The search runs over the structural key
# range [lo, hi) and records which key blocks hold a visible z >= tau; the weighted pass
# and both backward passes loop over those live blocks only (a compacted list per query
# block, ``engine.live_block_tables``; per key block for dK/dV).


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
    ins, (m_ref, tau_ref, flag_ref, res_ref) = E.split_inputs(cfg, refs, n_dyn)
    qi = pl.program_id(0)
    length, dyn_v, qt = ins.length[...], _values(ins.dyn), q_ref[...]
    rows = _q_rows(ins)
    k_lo, k_hi = lo_ref[...], hi_ref[...]

    def logits(j):
      t = _key_block(cfg, ins, rows, qt, k_ref, qi, j, bq, bk)[2]
      return t.x, t.mask

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
  out_shape = [jax.ShapeDtypeStruct((b, cfg.t_pad, n, hv), q.dtype),
               jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)]

  def kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, m_ref, tau_ref, *refs):
    ins, (o_ref, d_ref) = E.split_inputs(cfg, refs, n_dyn)
    qi = pl.program_id(0)
    length, dyn_v, qt = ins.length[...], _values(ins.dyn), q_ref[...]
    rows = _q_rows(ins)
    mt, taut = m_ref[...], tau_ref[...]
    start, stop, block = _table_loop(idx_ref, cnt_ref)

    def body(j, carry):
      lsum, acc = carry
      sl, _, t = _key_block(cfg, ins, rows, qt, k_ref, qi, block(j), bq, bk)
      w = E.t_weight_tile(cfg, t.x, t.mask, taut, mt, length, dyn_v)
      vt = v_ref[sl, :]
      return (lsum + jnp.sum(w, axis=-1, keepdims=True),
              acc + E.dot(cfg, w.astype(vt.dtype), vt, (1, 0)))

    init = (jnp.zeros((bq, 1), cfg.acc_dtype), jnp.zeros((bq, hv), cfg.acc_dtype))
    lsum, acc = jax.lax.fori_loop(start, stop, body, init)
    # A NaN logit makes the row max NaN and no block live (no z >= NaN): the row would come
    # out 0. It is NaN, as on the dense path (jax.nn's rule).
    nan_row = mt != mt
    lsum = jnp.where(nan_row, jnp.nan, lsum)
    o_ref[...] = jnp.where(nan_row, jnp.nan, acc * E.tile.safe_inverse(lsum)).astype(o_ref.dtype)
    d_ref[...] = lsum

  return _call(cfg, kernel, "tfwd", (cfg.t_pad // bq, b, n), bq, sp, (idx, cnt),
               [(sp["q"], q), (sp["kv"], k), (sp["v"], v), (sp["row"], m), (sp["row"], tau)],
               aux, dyn, [sp["o"], sp["row"]], out_shape, table=True)


def threshold_backward_dq(cfg: E.Config, q, k, v, do, m, tau, d, delta, idx, cnt, dyn,
                          aux: E.Aux):
  """dQ over the live key blocks; also the per-row ``coef`` (for dK/dV) and the
  hyperparameters' tile cotangents; with a dense bias also dS [B, N, T_pad, S_pad] (0 off
  the live blocks); with a decay d cq. Returns (dq, coef, ddyn, dS or None, dcq or None)."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  b, n, n_dyn = q.shape[0], cfg.num_heads, len(dyn)
  has_bias, nk = cfg.bias_full is not None, cfg.s_pad // bk
  n_rows = n_dyn + int(cfg.decay)  # the hyperparameters' cotangents, then dcq
  sp = _q_major(cfg, bq)
  out_shape, out_specs = E.dq_outputs(cfg, sp, q.shape, 1 + n_dyn)  # coef first
  if has_bias:
    out_shape.append(jax.ShapeDtypeStruct((b, n, cfg.t_pad, cfg.s_pad), cfg.acc_dtype))
    out_specs.append(pl.BlockSpec((None, None, bq, cfg.s_pad),
                                  lambda qi, bi, ni: (bi, ni, qi, 0)))

  def kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, m_ref, tau_ref, d_ref, delta_ref,
             *refs):
    ins, (dq_ref, coef_ref, *outs) = E.split_inputs(cfg, refs, n_dyn)
    ddyn_refs, ds_ref = outs[:n_rows], (outs[n_rows] if has_bias else None)
    qi = pl.program_id(0)
    length, dyn_v = ins.length[...], _values(ins.dyn)
    qt, dot_, mt, taut, dt, delt = (r[...] for r in (q_ref, do_ref, m_ref, tau_ref, d_ref,
                                                     delta_ref))
    rows = _q_rows(ins)
    start, stop, block = _table_loop(idx_ref, cnt_ref)

    def tile_at(j):
      sl, kt, t = _key_block(cfg, ins, rows, qt, k_ref, qi, block(j), bq, bk)
      return sl, kt, t, E.dot(cfg, dot_, v_ref[sl, :], (1, 1))

    def coef_body(j, carry):
      _, _, t, dp = tile_at(j)
      g, mm = E.t_coef_tile(cfg, t.x, t.mask, taut, mt, delt, dp, length, dyn_v)
      return carry[0] + g, carry[1] + mm

    zero = jnp.zeros((bq, 1), cfg.acc_dtype)
    g_tau, m_tau = jax.lax.fori_loop(start, stop, coef_body, (zero, zero))
    coef = E.t_coef(g_tau, m_tau, dt)

    def body(j, carry):
      sl, kt, t, dp = tile_at(j)
      _, ds, dd = E.t_backward_tile(cfg, t.x, t.mask, taut, mt, dt, delt, coef, dp, length,
                                    dyn_v)
      return _add_dq(cfg, t, ds, kt, ds_ref, sl, carry, dd)

    # dS = 0 on every block but the live ones (written by the loop)
    _clear_ds(cfg, ds_ref, bq, bk, [(0, nk)])
    dq, ddyn = jax.lax.fori_loop(start, stop, body, _dq_init(cfg, bq, n_dyn))
    _store((dq_ref, coef_ref, *ddyn_refs), (dq, coef, *ddyn))

  outs = _call(cfg, kernel, "tdq", (cfg.t_pad // bq, b, n), bq, sp, (idx, cnt),
               _backward_operands(sp, q, k, v, do, m, tau, d, delta), aux, dyn, out_specs,
               out_shape, table=True)
  return (outs[0], outs[1], tuple(outs[2:2 + n_dyn]), (outs[-1] if has_bias else None),
          outs[2 + n_dyn] if cfg.decay else None)


def threshold_backward_dkv(cfg: E.Config, q, k, v, do, m, tau, d, delta, coef, idx_t, cnt_t,
                           dyn, aux: E.Aux):
  """dK, dV over, per key block, the query blocks for which it is live (per query head:
  ``idx_t`` [B, N, nk, width], ``cnt_t`` [B, N, nk, 1])."""

  def grads(t, dp, rows, length, dyn_v):
    mt, taut, dt, delt, ct = rows
    return (t, *E.t_backward_tile(cfg, t.x, t.mask, taut, mt, dt, delt, ct, dp, length,
                                  dyn_v)[:2])

  return _dkv_pass(cfg, "tdkv", (cfg.blocks.block_q, cfg.blocks.block_k), q, k, v, do,
                   (m, tau, d, delta, coef), dyn, aux, (idx_t, cnt_t), True, grads)
