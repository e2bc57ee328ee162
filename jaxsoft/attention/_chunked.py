"""implementation="xla_chunked": blockwise attention with the normalizer's tile rule.

The logits are never materialised for the whole problem: an outer loop runs over query
blocks and an inner loop over the key blocks that block can see (the range comes from the
mask structure, so causal, sliding-window, padding and segment structure skip whole
blocks, narrowed to the key blocks where a dense ``mask`` has a True entry), carrying per query row only what the normalizer's kernel class needs:

* class E (softmax family): the running max m and sum l, merged with the rescaling
  ``l <- l·e^{m - m'} + sum_j den(z_j, m')`` of FlashAttention;
* class S: the running sum l (no stabiliser);
* class P: nothing (``D = 1``);
* class T (sparsemax, entmax, top-k): a first pass for the row max, then ``tau`` by a
  search over key blocks (``_tile.search_*``: Newton steps with a bisection companion, or
  multisection, one pass per step until every row of the query block is done), then a
  weighted pass;
* class R (standardised softmax, NAP, adaptive temperature, ...): a first pass merges the
  rule's row statistics over key blocks (``RowStatsRule``: mean and variance by Chan's
  merge, softmax's (m, l), ...), ``derive`` turns them into per-row hyperparameters, then
  an ordinary class E or P pass runs with them.

The per-tile math of classes E/S/P is ``jaxsoft.normalizers.tile`` (shared with the
Pallas engine and ``jaxsoft.testing``); this module only moves blocks. A custom_vjp
recomputes each tile in the backward pass (memory O(B·N·T·H); the only T x S-sized
arrays are the caller's own ``bias``/``mask`` and their gradient): ``_tile.tile_vjp``
gives the cotangent of a tile's logits and of the array hyperparameters (per-head
temperature, alpha, s, sink logit, ...), and one shared step carries it to dq, dk, dv,
the bias and the decay hook. Class T adds the implicit-function term of tau:
``dz_j = w'_j (dP_j - Δ)/W - (g_tau / M_tau)·mass'_j`` with
``g_tau = sum_k d_tau weight_k (dP_k - Δ)/W`` and ``M_tau = sum_k d_tau mass_k``.
Class R adds the statistics' term: a first backward sweep sums the cotangents of the
derived hyperparameters over the key blocks, ``derive``'s vjp turns them into cotangents
of the statistics, and the main sweep adds ``vjp(tangent)`` of each tile to its dx.

Internally everything is float32 (float64 for float64 inputs); q is pre-multiplied by the
scale (so ``scale`` and its gradient are handled by ordinary autodiff outside the
custom_vjp) and GQA keeps one copy of K/V: q is viewed as [B, K, G, T, H] and each key
block serves the G query heads of its group in one batched matmul. Forgetting attention's
decay ``cq_i - ck_j`` enters through :class:`_RowColumnBias`, an additive pre-cap bias
hook with its own tile and gradient.

Differentiation: first-order reverse mode only (``jax.grad``, ``jax.vjp``, ``jax.jacrev``),
exact against the dense path. Forward mode (``jax.jvp``, ``jax.jacfwd``) and second or
higher orders (``jax.hessian``, grad of grad, jvp of grad) are refused with
:class:`UnsupportedDifferentiation` (a NotImplementedError and a TypeError) naming
``implementation='xla_chunked'`` and the dense ``implementation='xla'``, which supports
them: the backward pass reads the transposed keys and values and the threshold tau as
constants, so differentiating it would silently drop Hessian terms, and its loops have
dynamic bounds (no reverse mode). The refusal is raised at the call when the derivative
retraces it, so ``implementation=None`` moves on to the dense path (a Hessian-vector
product keeps its meaning at every length, at the dense path's O(T·S) memory); under a
derivative of a ``jax.jit``-compiled function the backward pass raises it
(:func:`first_order_only`), and forward mode there gives JAX's own custom_vjp error. A
blockwise JVP (a linear, transposable tangent pass) would lift this; it is not written.

Sharding: the loop carries are typed like the query block (:func:`_typed_like`), so a
batch-sharded call runs under an Explicit mesh and inside ``jax.shard_map``.

With ``score="distance"`` (A18) the tile's pre-cap logit is the distance
``d_ij = sqrt(max(|q_i|^2 + |k_j|^2 - 2 q_i·k_j, 0))``: the squared norms are computed once
per call (``_Aux.qn``/``kn``, no gradient through them) and sliced per block, and the
backward pass chains the logit cotangent through the distance itself:
``dq_i += sum_j ds_ij (q_i - k_j) / d_ij``, ``dk_j -= sum_i ds_ij (q_i - k_j) / d_ij``
(0 where ``d_ij = 0``, as :func:`jaxsoft.attention._dense.safe_distance`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsoft.attention.differentiation import first_order_only, refuse_unsupported_ad
from jaxsoft.attention.masks import MaskStructure, pad_axis, table_ranges
from jaxsoft.attention.posinf import with_posinf_rule
from jaxsoft.attention.scores import safe_distance
from jaxsoft.normalizers import tile
from jaxsoft.normalizers.common import compute_dtype
from jaxsoft.normalizers.spec import NormalizerSpec

__all__ = ["chunked_attention", "BLOCK_Q", "BLOCK_K"]

# Default block sizes (query rows x key columns). 512 x 512 keeps a tile's float32 logits at
# 1 MiB (L2-sized on CPUs) while each matmul is large enough to run near the GEMM peak.
BLOCK_Q = 512
BLOCK_K = 512


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _slice(a, start, size: int, axis: int):
  """A block of ``a`` along ``axis``, or ``a`` itself where it broadcasts (size 1)."""
  if a is None or a.shape[axis] == 1:
    return a
  return lax.dynamic_slice_in_dim(a, start, size, axis)


def _accumulate(buf, upd, start, axis: int):
  """``buf[..., start:start + size, ...] += upd`` along ``axis`` (plain += if size 1)."""
  if buf.shape[axis] == 1:
    return buf + upd
  cur = lax.dynamic_slice_in_dim(buf, start, upd.shape[axis], axis)
  return lax.dynamic_update_slice_in_dim(buf, cur + upd, start, axis)


def _typed_like(tree, ref):
  """``tree``'s arrays ([B, K, G, bq, w], built from a shape) given the sharding and the
  varying mesh axes of ``ref`` ([B, K, G, bq, ...]: a query block), so that a loop carry
  started from them keeps its type under an Explicit mesh and inside ``jax.shard_map``
  (``jnp.zeros(shape)`` is replicated and invariant, the loop's output is not)."""
  def typed(x):
    return x + jnp.zeros_like(ref[..., :1], dtype=x.dtype)

  return jax.tree.map(typed, tree)


def _heads5(a, N: int, K: int, G: int):
  """A 4-D [b, n, t, s] array broadcastable to [B, N, T, S] -> 5-D [b, k, g, t, s]."""
  b, n, t, s = a.shape
  if n == 1:
    return a.reshape(b, 1, 1, t, s)
  return a.reshape(b, K, G, t, s)


def _reduce_to(x, shape):
  """Sums ``x`` over the axes where ``shape`` broadcasts (size 1)."""
  axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, shape, strict=True))
               if want == 1 and have != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _unblock(a):
  """[nq, B, K, G, bq, X] -> [B, K, G, nq·bq, X]."""
  nq, B, K, G, bq, X = a.shape
  return jnp.moveaxis(a, 0, 3).reshape(B, K, G, nq * bq, X)


def _pytree(cls):
  """A frozen dataclass whose fields are all pytree children."""
  return jax.tree_util.register_dataclass(
      cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[])


# ------------------------------------------------------------------------ call layout


@_pytree
@dataclasses.dataclass(frozen=True)
class _RowColumnBias:
  """An additive pre-cap logit bias ``cq[i] - ck[j]`` (Forgetting attention's decay).

  ``cq`` [B, K, G, Tp] and ``ck`` [B, K, G, Sp]; its tile is an outer difference, and its
  gradient the row and (negated) column sums of the logits' cotangent.
  """

  cq: Any
  ck: Any

  def tile(self, q_start, bq: int, k_start, bk: int):
    cq = lax.dynamic_slice_in_dim(self.cq, q_start, bq, 3)
    ck = lax.dynamic_slice_in_dim(self.ck, k_start, bk, 3)
    return cq[..., :, None] - ck[..., None, :]


@_pytree
@dataclasses.dataclass(frozen=True)
class _Inputs:
  """The differentiable inputs: q (scaled, [B, K, G, Tp, H]), k and v ([B, K, Sp, H]),
  the bias ([b, k, g, t, s] broadcastable) or None, the decay hook or None, and the float
  array hyperparameters ([b, k, g, t, 1])."""

  q: Any
  k: Any
  v: Any
  bias: Any
  decay: _RowColumnBias | None
  hp: dict


@_pytree
@dataclasses.dataclass(frozen=True)
class _Aux:
  """What the passes read but never differentiate."""

  structure: MaskStructure
  mask: Any  # bool [b, k, g, t, s] or None
  q_seg: Any  # int32 [B, Tp] or None
  kv_seg: Any  # int32 [B, Sp] or None
  counts: Any  # visible keys per row, [B|1, 1, 1, Tp, 1], at least 1
  kb_lo: Any  # per query block the first key block to visit, int32 [nq]
  kb_hi: Any  # ... and one past the last
  prune: Any  # bool [nq, nk] (FoX block pruning) or None
  hp_int: dict  # integer array hyperparameters (no gradient)
  qn: Any = None  # score="distance": |q_i|^2 [B, K, G, Tp] (no gradient), else None
  kn: Any = None  # ... and |k_j|^2 [B, K, Sp]
  full_lo: Any = None  # per query block the first key block fully inside the structure,
  full_hi: Any = None  # ... and the end of that run of full blocks (int32 [nq]), or None
  kt: Any = None  # k and v transposed once per call, [B, K, H, Sp] (the right operands of
  vt: Any = None  # q·k^T and dO·v^T; no gradient: the backward pass returns dk, dv itself)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one chunked call."""

  kind: str  # "E", "S", "P", "T" or "R"
  rule: Any  # TileRule, ThresholdRule or RowStatsRule
  dtype: Any  # the compute dtype (float32; float64 for float64 inputs)
  static_hp: tuple  # ((name, python value), ...)
  cap: float | None
  bq: int
  bk: int
  nq: int
  may_skip_mask: bool  # tiles fully inside the structure need no masking

  @property
  def tile_rule(self) -> Any:
    """The TileRule of the weighted pass (class R: its second pass); None for class T."""
    if self.kind == "R":
      return self.rule.second
    return None if self.kind == "T" else self.rule

  def row(self, q: Any) -> tuple[int, ...]:
    """The shape of a per-row statistic of one query block."""
    B, K, G = q.shape[:3]
    return (B, K, G, self.bq, 1)


@dataclasses.dataclass(frozen=True)
class _QueryBlock:
  """One query block's slices (inside the traced loop)."""

  start: Any
  q: Any  # [B, K, G, bq, H]
  n: Any  # visible keys per row
  hp: dict  # float array hyperparameters, sliced
  hp_static: dict  # Python values, integer arrays and a threshold rule's derived constants
  q_pos: Any
  q_seg: Any
  bias: Any
  mask: Any
  qn: Any = None  # score="distance": |q_i|^2 [B, K, G, bq]

  @property
  def params(self) -> dict:
    return {**self.hp_static, **self.hp}


@dataclasses.dataclass(frozen=True)
class _Tile:
  """One (query block, key block) tile: logits before and after cap and bias."""

  k_start: Any
  s: Any  # q·k or the distance (+ decay), before the soft cap
  x: Any  # the logits the normalizer sees
  vis: Any  # bool visibility, or None when every entry is visible
  k: Any
  v: Any
  dist: Any = None  # score="distance": the distances d [B, K, G, bq, bk], else None
  vt: Any = None  # the value block transposed, [B, K, H, bk]

  def dp(self, do):
    """``dO · v^T`` of the tile, [B, K, G, bq, bk]."""
    if self.vt is None:
      return jnp.einsum("bkgqh,bksh->bkgqs", do, self.v)
    return jnp.einsum("bkgqh,bkhs->bkgqs", do, self.vt)


def _query_block(plan: _Plan, inp: _Inputs, aux: _Aux, qi) -> _QueryBlock:
  start = qi * plan.bq
  q_seg = None
  if aux.q_seg is not None:
    q_seg = lax.dynamic_slice_in_dim(aux.q_seg, start, plan.bq, 1)
  return _QueryBlock(
      start=start,
      q=lax.dynamic_slice_in_dim(inp.q, start, plan.bq, 3),
      n=_slice(aux.counts, start, plan.bq, 3),
      hp={name: _slice(a, start, plan.bq, 3) for name, a in inp.hp.items()},
      hp_static={**dict(plan.static_hp), **aux.hp_int},
      q_pos=start + jnp.arange(plan.bq, dtype=jnp.int32),
      q_seg=q_seg,
      bias=_slice(inp.bias, start, plan.bq, 3),
      mask=_slice(aux.mask, start, plan.bq, 3),
      qn=None if aux.qn is None else lax.dynamic_slice_in_dim(aux.qn, start, plan.bq, 3))


def _visibility(plan: _Plan, aux: _Aux, qb: _QueryBlock, ks, x=None):
  """Visibility of the tile at key offset ``ks``: structure, dense mask, ``±inf`` logits."""
  k_pos = ks + jnp.arange(plan.bk, dtype=jnp.int32)
  kv_seg = None
  if aux.kv_seg is not None:
    kv_seg = lax.dynamic_slice_in_dim(aux.kv_seg, ks, plan.bk, 1)
  vis = aux.structure.tile_visible(qb.q_pos, k_pos, qb.q_seg, kv_seg)[:, :, None]
  if qb.mask is not None:
    vis = vis & _slice(qb.mask, ks, plan.bk, 4)
  if x is not None:
    # a NaN logit stays visible: its row is NaN, as dense; but for class P (whose numerator
    # at +inf is the entry's own limit) a +inf one is hidden like a -inf one (its row is
    # replaced by the +inf rule, ``with_posinf_rule``), so the tile stays finite
    vis = vis & ((x != -jnp.inf) if plan.kind == "P" else (jnp.abs(x) != jnp.inf))
  return vis


def _tile(plan: _Plan, inp: _Inputs, aux: _Aux, qb: _QueryBlock, kj, masked: bool) -> _Tile:
  ks = kj * plan.bk
  k_blk = lax.dynamic_slice_in_dim(inp.k, ks, plan.bk, 2)
  v_blk = lax.dynamic_slice_in_dim(inp.v, ks, plan.bk, 2)
  vt_blk = None
  if aux.kt is None:
    s = jnp.einsum("bkgqh,bksh->bkgqs", qb.q, k_blk, preferred_element_type=plan.dtype)
  else:  # a slice of the pre-transposed k: no per-tile transpose of the key block
    kt_blk = lax.dynamic_slice_in_dim(aux.kt, ks, plan.bk, 3)
    vt_blk = lax.dynamic_slice_in_dim(aux.vt, ks, plan.bk, 3)
    s = jnp.einsum("bkgqh,bkhs->bkgqs", qb.q, kt_blk, preferred_element_type=plan.dtype)
  dist = None
  if aux.kn is not None:  # score="distance"
    kn = lax.dynamic_slice_in_dim(aux.kn, ks, plan.bk, 2)[:, :, None, None, :]
    s = dist = safe_distance(qb.qn[..., None] + kn - 2.0 * s)
  if inp.decay is not None:
    s = s + inp.decay.tile(qb.start, plan.bq, ks, plan.bk)
  x = s if plan.cap is None else plan.cap * jnp.tanh(s / plan.cap)
  if qb.bias is not None:
    x = x + _slice(qb.bias, ks, plan.bk, 4)
  vis = None
  if masked:
    vis = _visibility(plan, aux, qb, ks, x if qb.bias is not None else None)
  return _Tile(k_start=ks, s=s, x=x, vis=vis, k=k_blk, v=v_blk, dist=dist, vt=vt_blk)


def _over_key_blocks(plan: _Plan, inp: _Inputs, aux: _Aux, qb: _QueryBlock, qi,
                     step: Callable, init):
  """Runs ``carry = step(tile, carry)`` over the key blocks query block ``qi`` can see.

  Tiles that lie fully inside the structure skip the masking: the key range is split into
  masked blocks before the run of full blocks ``[full_lo, full_hi)``, that run, and the
  masked blocks after it (three loops with static bodies, not a per-tile ``cond``: a
  conditional around a step that updates the whole dK/dV accumulators makes XLA copy them
  on every tile). Pruned pairs (FoX) are not visited.
  """

  def body(masked: bool):
    def run(kj, carry):
      return step(_tile(plan, inp, aux, qb, kj, masked), carry)

    if aux.prune is None:
      return run
    return lambda kj, c: lax.cond(aux.prune[qi, kj], lambda c: c, lambda c: run(kj, c), c)

  lo, hi = aux.kb_lo[qi], aux.kb_hi[qi]
  if not plan.may_skip_mask or aux.full_lo is None:
    return lax.fori_loop(lo, hi, body(True), init)
  f_lo = jnp.clip(aux.full_lo[qi], lo, hi)
  f_hi = jnp.clip(aux.full_hi[qi], f_lo, hi)
  carry = lax.fori_loop(lo, f_lo, body(True), init)
  carry = lax.fori_loop(f_lo, f_hi, body(False), carry)
  return lax.fori_loop(f_hi, hi, body(True), carry)


def _mask_key_ranges(mask, bq: int, nq: int, bk: int, nk: int):
  """Per query block the key blocks ``[lo, hi)`` that hold a visible entry of the dense
  ``mask`` (bool [b, k, g, t, s], padded with False to [.., nq·bq, nk·bk] where not 1):
  a tile of the range's complement has no True entry in any batch or head, so it adds
  nothing to any row and the loops need not visit it (int32 [nq] each; ``lo = hi = 0``
  for a query block that sees nothing). One O(mask) reduction per call; the structure's
  own range (``block_key_ranges``) knows nothing of the mask."""
  m = jnp.any(mask, axis=(0, 1, 2))  # [t, s] with t in (1, nq·bq), s in (1, nk·bk)
  if m.shape[0] != 1:
    m = jnp.any(m.reshape(nq, bq, m.shape[1]), axis=1)
  if m.shape[1] != 1:
    m = jnp.any(m.reshape(m.shape[0], nk, bk), axis=2)
  return table_ranges(jnp.broadcast_to(m, (nq, nk)), axis=-1)


def _full_block_runs(structure: MaskStructure, bq: int, nq: int, bk: int, nk: int):
  """Per query block the first run of key blocks fully inside the structure, ``[lo, hi)``
  (int32 [nq] each; ``lo = hi = nk`` where there is none). Blocks outside the run are
  masked even if full, so the run need not be the only one."""
  q_start = (jnp.arange(nq, dtype=jnp.int32) * bq)[:, None]
  k_start = (jnp.arange(nk, dtype=jnp.int32) * bk)[None, :]
  full = jnp.broadcast_to(structure.tile_is_full(q_start, bq, k_start, bk), (nq, nk))
  idx = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32)[None, :], (nq, nk))
  lo = jnp.min(jnp.where(full, idx, nk), axis=1)
  hi = jnp.min(jnp.where(~full & (idx >= lo[:, None]), idx, nk), axis=1)
  return lo.astype(jnp.int32), hi.astype(jnp.int32)


# ----------------------------------------------------------------------------- forward


def _threshold_search(plan: _Plan, inp: _Inputs, aux: _Aux, qb: _QueryBlock, qi):
  """Class T: ``(m', tau, residual)`` of one query block (no gradient): the weights'
  stabiliser, their threshold and the search's (``return_residual``'s) threshold.

  The search is ``_tile``'s: Newton steps with a bisection companion for rules with a
  ``newton_power``, multisection for the rest, one pass over the key blocks per step,
  until every row of the block is done (at most the rule's ``iterations`` steps)."""
  rule, hp, n = plan.rule, qb.params, qb.n
  row = plan.row(inp.q)

  def max_step(t: _Tile, m):
    z = rule.score_map(jnp.where(t.vis, t.x, 0.0) if t.vis is not None else t.x, n, **hp)
    return tile.running_max(z, t.vis, m)

  m = _over_key_blocks(plan, inp, aux, qb, qi, max_step,
                       _typed_like(jnp.full(row, -jnp.inf, plan.dtype), qb.q))
  m, state, target = tile.search_start(rule, m, n, hp)
  count, steps, newton = tile.search_schedule(rule, rule.iterations, early_exit=True)

  def search_step(carry):
    i, _, state = carry
    lo, hi, point = state
    taus = tile.search_candidates(lo, hi, point, count)

    def sums_step(t: _Tile, sums):
      z = tile.scores(rule, t.x, t.vis, m, n, hp)
      return tile.search_sums(rule, z, t.vis, taus, sums, hp, newton, stacked=True)

    zero = [_typed_like(jnp.zeros(row, plan.dtype), qb.q)] * (count * (1 + int(newton)))
    sums = _over_key_blocks(plan, inp, aux, qb, qi, sums_step, zero)
    state = tile.search_update(rule, state, taus, sums, target, hp, newton)
    return i + 1, jnp.all(tile.search_done(state)), state

  def more(carry):
    i, done, _ = carry
    return jnp.logical_and(i < steps, jnp.logical_not(done))

  done = jnp.all(tile.search_done(state))
  _, _, state = lax.while_loop(more, search_step, (jnp.int32(0), done, state))
  tau = residual = lax.stop_gradient(tile.search_threshold(state, newton))
  if tile.jumps_at_threshold(rule, dict(plan.static_hp)):
    # top-k / top-p: tau moves into the gap below it, so that a score equal to tau that
    # the backward pass recomputes an ulp lower is still kept
    def below_step(t: _Tile, below):
      return tile.max_below(tile.scores(rule, t.x, t.vis, m, n, hp), t.vis, tau, below)

    below = _over_key_blocks(plan, inp, aux, qb, qi, below_step,
                             _typed_like(jnp.full(row, -jnp.inf, plan.dtype), qb.q))
    tau = tile.gap_threshold(tau, below)
  # Every visible row has a non-empty support at tau; the final normalisation removes the
  # residual error of the search.
  # The weights are evaluated just above m (``_tile.weight_stabiliser``): a rule may clamp as
  # exp(min(z - m, 0)) against overflow, and at the row's argmax that clamp's derivative
  # is a tie (1/2) wherever the backward pass recomputes z a few ulps above the max pass's;
  # strictly above every recomputed z it is inactive, and the uniform factor e^{m - m'}
  # cancels in the normalisation.
  return tile.weight_stabiliser(m), lax.stop_gradient(tau), residual


def _full_visibility(t: _Tile):
  """The tile's visibility as a boolean array of the logits' shape."""
  full = jnp.ones_like(t.x, dtype=bool)  # typed like the logits (sharding, varying axes)
  return full if t.vis is None else full & t.vis


def _row_stats_sweep(plan: _Plan, inp: _Inputs, aux: _Aux, qb: _QueryBlock, qi, rule=None):
  """Class R: the row statistics of one query block, merged over its key blocks (``rule``:
  that RowStatsRule instead of the plan's)."""
  rule = plan.rule if rule is None else rule

  def step(t: _Tile, stats):
    return rule.merge(stats, rule.block(t.x, _full_visibility(t)))

  init = _typed_like(rule.init(plan.row(inp.q), plan.dtype), qb.q)
  return _over_key_blocks(plan, inp, aux, qb, qi, step, init)


def _threshold_theta(plan: _Plan, inp: _Inputs, aux: _Aux, qb: _QueryBlock, qi) -> dict:
  """Class T with ``ThresholdRule.stats``: its derived hyperparameters of one query block
  (constants: no gradient), from a statistics sweep; ``{}`` without."""
  rule = plan.rule.stats
  if rule is None:
    return {}
  stats = _row_stats_sweep(plan, inp, aux, qb, qi, rule)
  theta = rule.derive(stats, qb.n, **qb.params)
  return {name: lax.stop_gradient(jnp.broadcast_to(jnp.asarray(x, plan.dtype), stats[0].shape))
          for name, x in theta.items()}


def _with_theta(qb: _QueryBlock, theta: dict) -> _QueryBlock:
  """``qb`` with a threshold rule's derived hyperparameters among its constants."""
  return dataclasses.replace(qb, hp_static={**qb.hp_static, **theta}) if theta else qb


def _forward(plan: _Plan, inp: _Inputs, aux: _Aux):
  """Returns the residuals ``(out, m, D, extra)``, each [B, K, G, Tp, ·]; ``extra`` is
  ``(residual tau, weights' tau, theta)`` for class T (the search's tau, and the one the
  weights use: for top-k/top-p moved into the gap below it; theta: the derived
  hyperparameters of its ``stats``, a dict, empty without), the row statistics for class
  R, ``()`` otherwise."""
  rule = plan.rule
  row = plan.row(inp.q)
  Hv = inp.v.shape[-1]

  def q_block(qi):
    qb = _query_block(plan, inp, aux, qi)
    hp, n = qb.params, qb.n
    extra: tuple = ()
    if plan.kind == "T":
      theta = _threshold_theta(plan, inp, aux, qb, qi)
      qb = _with_theta(qb, theta)
      hp = qb.params
      m0, tau, residual = _threshold_search(plan, inp, aux, qb, qi)
      extra = (residual, tau, theta)

      def update(t: _Tile, m, l):  # a class-P pass with the weights at tau, and their sum
        w, _ = tile.threshold_maps(rule, t.x, t.vis, tau, m, n, hp)
        return m, l + jnp.sum(w, axis=-1, keepdims=True), w, None

      l0 = _typed_like(jnp.zeros(row, plan.dtype), qb.q)
    else:
      if plan.kind == "R":
        extra = _row_stats_sweep(plan, inp, aux, qb, qi)
        hp = {**hp, **rule.derive(extra, n, **hp)}
      trule = plan.tile_rule
      m0, l0 = _typed_like(tile.init_rows(trule, row, plan.dtype), qb.q)

      def update(t: _Tile, m, l):
        return tile.online_update(trule, t.x, t.vis, m, l, n, hp)

    def step(t: _Tile, carry):
      m, l, acc = carry
      m, l, num, alpha = update(t, m, l)
      pv = jnp.einsum("bkgqs,bksh->bkgqh", num, t.v, preferred_element_type=plan.dtype)
      return m, l, tile.rescale(acc, alpha) + pv

    acc0 = _typed_like(jnp.zeros(row[:-1] + (Hv,), plan.dtype), qb.q)
    m, l, acc = _over_key_blocks(plan, inp, aux, qb, qi, step, (m0, l0, acc0))
    if plan.kind == "T":
      d = l
      out = acc * tile.safe_inverse(d)
    else:
      m, d = tile.finalize(plan.tile_rule, m, l, n, hp)
      out = tile.normalize(plan.tile_rule, acc, d)
    return out, m, d, tuple(extra)

  blocks = lax.map(q_block, jnp.arange(plan.nq, dtype=jnp.int32))
  return jax.tree.map(_unblock, blocks)


# ---------------------------------------------------------------------------- backward


def _threshold_coefficient(plan: _Plan, inp: _Inputs, aux: _Aux, qb: _QueryBlock, qi,
                           m, tau, inv_w, do, delta):
  """Class T: dL/dtau / (dF/dtau), F = sum mass - target (one pass over key blocks).

  ``g_tau = sum_k d_tau weight_k (dP_k - Δ)/W`` and ``M_tau = sum_k d_tau mass_k``.
Class R adds the statistics' term: a first backward sweep sums the cotangents of the
derived hyperparameters over the key blocks, ``derive``'s vjp turns them into cotangents
of the statistics, and the main sweep adds ``vjp(tangent)`` of each tile to its dx.
  """
  hp, n = qb.params, qb.n

  def step(t: _Tile, c):
    g, mt = c
    _, (dw, dm) = jax.jvp(lambda tau_: tile.threshold_maps(plan.rule, t.x, t.vis, tau_, m, n, hp),
                          (tau,), (jnp.ones_like(tau),))
    dp = t.dp(do)
    g = g + jnp.sum(dw * (dp - delta), axis=-1, keepdims=True) * inv_w
    return g, mt + jnp.sum(dm, axis=-1, keepdims=True)

  zero = _typed_like(jnp.zeros(plan.row(inp.q), plan.dtype), qb.q)
  g_tau, m_tau = _over_key_blocks(plan, inp, aux, qb, qi, step, (zero, zero))
  return g_tau * tile.safe_inverse(m_tau)


def _tile_gradient(plan: _Plan, qb: _QueryBlock, m, d, delta, tau=None, coef=None):
  """``(t, dP) -> (w, dx, dhp)``: the tile's weights and the cotangents of its logits and
  of the float array hyperparameters (the normalizer's part of the backward pass)."""
  rule, n = plan.rule, qb.n
  if plan.kind != "T":
    return lambda t, dp: tile.tile_vjp(rule, t.x, t.vis, m, d, delta, dp, n, qb.hp_static,
                                       qb.hp)
  inv_w = tile.safe_inverse(d)

  def threshold_gradient(t: _Tile, dp):
    (w, mass), vjp = jax.vjp(
        lambda x, arrays: tile.threshold_maps(rule, x, t.vis, tau, m, n,
                                              {**qb.hp_static, **arrays}), t.x, qb.hp)
    cot_mass = jnp.broadcast_to(-coef, mass.shape)
    if t.vis is not None:
      cot_mass = jnp.where(t.vis, cot_mass, 0.0)
    dx, dhp = vjp(((dp - delta) * inv_w, cot_mass))
    return w * inv_w, dx, dhp

  return threshold_gradient


def _row_stats_gradients(plan: _Plan, inp: _Inputs, aux: _Aux, qb: _QueryBlock, qi, m, d,
                         delta, do, stats):
  """Class R: ``(tile_gradient, row dhp)`` for the main backward sweep.

  A first sweep sums the cotangents of the derived hyperparameters theta over the key
  blocks (tile_vjp of the second pass, plus its offset's share); ``derive``'s vjp turns
  them into cotangents of the statistics and of the hyperparameters that ``derive``
  reads; each tile of the main sweep then adds ``vjp(tangent)`` to its dx.
  """
  rule, n = plan.rule, qb.n
  trule = rule.second

  row = plan.row(inp.q)

  def derive(stats_, arrays):
    theta = rule.derive(stats_, n, **{**qb.hp_static, **arrays})
    return {k: jnp.broadcast_to(jnp.asarray(v, plan.dtype), row) for k, v in theta.items()}

  theta, derive_vjp = jax.vjp(derive, stats, qb.hp)
  arrays = {**qb.hp, **theta}

  def theta_step(t: _Tile, g):
    dp = t.dp(do)
    _, _, dhp = tile.tile_vjp(trule, t.x, t.vis, m, d, delta, dp, n, qb.hp_static, arrays)
    return {k: g[k] + dhp[k] for k in theta}

  g_theta = _over_key_blocks(plan, inp, aux, qb, qi, theta_step,
                             {k: jnp.zeros_like(v) for k, v in theta.items()})
  offset = tile.offset_vjp(trule, m, d, delta, n, qb.hp_static, arrays)
  if offset is not None:
    g_theta = {k: g_theta[k] + offset[k] for k in theta}
  g_stats, d_row = derive_vjp(g_theta)
  if offset is not None:
    d_row = {k: d_row[k] + offset[k] for k in qb.hp}

  def tile_gradient(t: _Tile, dp):
    w, dx, dhp = tile.tile_vjp(trule, t.x, t.vis, m, d, delta, dp, n, qb.hp_static, arrays)
    vis = _full_visibility(t)
    _, tangent_vjp = jax.vjp(lambda x: rule.tangent(x, vis, stats), t.x)
    return w, dx + tangent_vjp(g_stats)[0], {k: dhp[k] for k in qb.hp}

  return tile_gradient, (d_row if qb.hp else None)


def _row_gradient(plan: _Plan, inp: _Inputs, qb: _QueryBlock, m, d, delta, coef=None):
  """The hyperparameter cotangents that enter per row, not per tile (or None): class
  E/S's offset (``dL/dD = -Δ/D``) and class T's target (``+coef``)."""
  if not qb.hp:
    return None
  if plan.kind != "T":
    return tile.offset_vjp(plan.rule, m, d, delta, qb.n, qb.hp_static, qb.hp)
  row = plan.row(inp.q)

  def target(arrays):
    value = plan.rule.target(qb.n, **{**qb.hp_static, **arrays})
    return jnp.broadcast_to(jnp.asarray(value, plan.dtype), row)

  _, vjp = jax.vjp(target, qb.hp)
  return vjp(coef)[0]


def _add_bias_grad(dbias, dx, qs, ks):
  """Accumulates a tile's logit gradient into the bias gradient (broadcast dims summed)."""
  b, k, g, t, s = dbias.shape
  upd = _reduce_to(dx, (b, k, g, 1 if t == 1 else dx.shape[3], 1 if s == 1 else dx.shape[4]))
  if t != 1 and s != 1:
    zero = jnp.zeros((), jnp.int32)
    idx = (zero, zero, zero, jnp.asarray(qs, jnp.int32), jnp.asarray(ks, jnp.int32))
    cur = lax.dynamic_slice(dbias, idx, upd.shape)
    return lax.dynamic_update_slice(dbias, cur + upd, idx)
  if t != 1:
    return _accumulate(dbias, upd, qs, 3)
  if s != 1:
    return _accumulate(dbias, upd, ks, 4)
  return dbias + upd


@_pytree
@dataclasses.dataclass(frozen=True)
class _BlockGrads:
  """The gradients one query block's key loop accumulates."""

  dq: Any  # [B, K, G, bq, H]
  dcq: Any  # the decay hook's row part [B, K, G, bq], or None
  dk: Any  # whole arrays from here on
  dv: Any
  dck: Any
  dbias: Any
  dhp: dict  # per query block: [b, k, g, bq|1, 1]


def _transposed_product(a, b_t):
  """``einsum("bkgqs,bkgqh->bksh", a, b)`` from ``b_t = b^T`` ([B, K, G, H, bq], transposed
  once per query block) as ``(b^T a)^T``: the tile ``a`` stays the row-major right operand
  and only the thin [h, s] result is transposed (``a^T b`` makes XLA:CPU materialise a
  transposed copy of the whole tile first)."""
  return jnp.swapaxes(jnp.einsum("bkghq,bkgqs->bkhs", b_t, a), -1, -2)


def _backprop_tile(plan: _Plan, qb: _QueryBlock, t: _Tile, w, dx, q_t, do_t, g: _BlockGrads):
  """From a tile's weights and logit cotangent to every input's gradient (all classes);
  ``q_t``, ``do_t``: the query block and its output cotangent transposed, [B, K, G, H, bq]."""
  ks = t.k_start
  dv = _accumulate(g.dv, _transposed_product(w, do_t), ks, 2)
  dbias = g.dbias if qb.bias is None else _add_bias_grad(g.dbias, dx, qb.start, ks)
  ds = dx
  if plan.cap is not None:
    th = jnp.tanh(t.s / plan.cap)
    ds = ds * (1.0 - th * th)
  dcq, dck = g.dcq, g.dck
  if dcq is not None:  # the decay hook: d(cq_i - ck_j)
    dcq = dcq + jnp.sum(ds, axis=-1)
    dck = _accumulate(dck, -jnp.sum(ds, axis=-2), ks, 3)
  if t.dist is None:
    dq = g.dq + jnp.einsum("bkgqs,bksh->bkgqh", ds, t.k)
    dk = _accumulate(g.dk, _transposed_product(ds, q_t), ks, 2)
  else:  # d = ||q - k||: dq_i += sum_j r_ij (q_i - k_j), dk_j -= sum_i r_ij (q_i - k_j)
    r = jnp.where(t.dist > 0, ds / jnp.where(t.dist > 0, t.dist, 1.0), 0.0)
    dq = g.dq + jnp.sum(r, axis=-1, keepdims=True) * qb.q - jnp.einsum(
        "bkgqs,bksh->bkgqh", r, t.k)
    dk_blk = (jnp.sum(r, axis=(2, 3))[..., None] * t.k
              - jnp.einsum("bkgqs,bkgqh->bksh", r, qb.q))
    dk = _accumulate(g.dk, dk_blk, ks, 2)
  return dataclasses.replace(g, dq=dq, dcq=dcq, dk=dk, dv=dv, dck=dck, dbias=dbias)


def _backward(plan: _Plan, inp: _Inputs, aux: _Aux, res, dout) -> _Inputs:
  out, m_all, d_all, extra_all = res
  delta_all = jnp.sum(dout * out, axis=-1, keepdims=True)

  def q_block(carry: _BlockGrads, qi):
    qb = _query_block(plan, inp, aux, qi)

    def rows(a):
      return lax.dynamic_slice_in_dim(a, qb.start, plan.bq, 3)

    m, d, do, delta = (rows(a) for a in (m_all, d_all, dout, delta_all))
    extra = jax.tree.map(rows, extra_all)
    if plan.kind == "R":
      tile_gradient, d_row = _row_stats_gradients(plan, inp, aux, qb, qi, m, d, delta, do,
                                                  extra)
    else:
      coef = tau = None
      if plan.kind == "T":
        _, tau, theta = extra
        qb = _with_theta(qb, theta)
        coef = _threshold_coefficient(plan, inp, aux, qb, qi, m, tau, tile.safe_inverse(d), do,
                                      delta)
      tile_gradient = _tile_gradient(plan, qb, m, d, delta, tau, coef)
      d_row = _row_gradient(plan, inp, qb, m, d, delta, coef)

    q_t, do_t = jnp.swapaxes(qb.q, -1, -2), jnp.swapaxes(do, -1, -2)  # once per block

    def step(t: _Tile, g: _BlockGrads):
      dp = t.dp(do)
      w, dx, dhp = tile_gradient(t, dp)
      g = _backprop_tile(plan, qb, t, w, dx, q_t, do_t, g)
      return dataclasses.replace(g, dhp=jax.tree.map(jnp.add, g.dhp, dhp))

    g = dataclasses.replace(
        carry, dq=jnp.zeros_like(qb.q), dhp=jax.tree.map(jnp.zeros_like, qb.hp),
        dcq=None if inp.decay is None else jnp.zeros_like(qb.q[..., 0], plan.dtype))
    g = _over_key_blocks(plan, inp, aux, qb, qi, step, g)
    dhp = g.dhp
    if d_row is not None:
      dhp = jax.tree.map(jnp.add, dhp, d_row)
    full_dhp = {name: _accumulate(carry.dhp[name], x, qb.start, 3) for name, x in dhp.items()}
    carry = dataclasses.replace(g, dq=None, dcq=None, dhp=full_dhp)
    return carry, (g.dq, g.dcq)

  def zeros(a):
    return None if a is None else jnp.zeros_like(a)

  init = _BlockGrads(dq=None, dcq=None, dk=zeros(inp.k), dv=zeros(inp.v),
                     dck=None if inp.decay is None else zeros(inp.decay.ck),
                     dbias=zeros(inp.bias), dhp=jax.tree.map(jnp.zeros_like, inp.hp))
  g, (dq, dcq) = lax.scan(q_block, init, jnp.arange(plan.nq, dtype=jnp.int32))
  decay = None
  if inp.decay is not None:
    decay = _RowColumnBias(cq=_unblock(dcq[..., None])[..., 0], ck=g.dck)
  return _Inputs(q=_unblock(dq), k=g.dk, v=g.dv, bias=g.dbias, decay=decay, hp=g.dhp)


def _row_statistic(plan: _Plan, m, d, extra):
  """The residual of ``return_residual`` per row, [B, K, G, Tp, 1] (see the entry point).

  Classes E and S: ``log D`` in the logits' own scale, ``m + log D`` (the log-sum-exp for
  softmax; ``-inf`` where D = 0); P: 0 (its D is 1); T: tau (``-inf`` for a row with no
  visible key, whose weights sum to 0).
  """
  if plan.kind in ("E", "S"):
    return m + jnp.log(d)
  if plan.kind == "P":
    return jnp.zeros_like(m)
  if plan.kind == "R":  # (refused by the entry point: no residual is defined)
    return jnp.zeros_like(m)
  return jnp.where(d > 0, extra[0], -jnp.inf)


def _attend(plan: _Plan):
  """``attend(inputs, aux) -> (out [B, K, G, Tp, Hv], statistic [B, K, G, Tp, 1])`` with
  the recomputing custom VJP; the statistic's cotangent is ignored (the caller stops its
  gradient)."""

  where = "dot_product_attention(implementation='xla_chunked')"
  forward = first_order_only(functools.partial(_forward, plan), where)
  backward = first_order_only(functools.partial(_backward, plan), where)

  @jax.custom_vjp
  def attend(inp: _Inputs, aux: _Aux):
    out, m, d, extra = forward(inp, aux)
    return out, _row_statistic(plan, m, d, extra)

  def attend_fwd(inp, aux):
    res = forward(inp, aux)
    return (res[0], _row_statistic(plan, *res[1:])), (inp, aux, res)

  def attend_bwd(saved, cotangents):
    inp, aux, res = saved
    return backward(inp, aux, res, cotangents[0]), None

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


# ---------------------------------------------------------------------------- the call


def _params_5d(value, N: int, K: int, G: int, T: int, Tp: int, dtype):
  """A row-broadcast hyperparameter array -> 5-D [b, k, g, t, 1] padded along T."""
  a = jnp.asarray(value, dtype)
  a = a.reshape((1,) * (4 - a.ndim) + a.shape)
  a = _heads5(a, N, K, G)
  if a.shape[3] == T and T != 1:
    a = pad_axis(a, 3, Tp, mode="edge")
  return a


def _block_prune_table(cq5, ck5, bq: int, bk: int, threshold: float):
  """True where a (query block, key block) pair may be skipped by the decay bound."""
  B, K, G, Tp = cq5.shape
  Sp = ck5.shape[-1]
  cq_max = jnp.max(cq5.reshape(B, K, G, Tp // bq, bq), axis=-1)
  ck_min = jnp.min(ck5.reshape(B, K, G, Sp // bk, bk), axis=-1)
  bound = cq_max[..., :, None] - ck_min[..., None, :]
  return jnp.max(bound, axis=(0, 1, 2)) < threshold


def _dense_counts(plan: _Plan, inp: _Inputs, aux: _Aux):
  """Visible keys per row including the dense mask and -inf bias (a pass over key blocks).

  Only used for length-dependent normalizers with a dense ``mask`` or a ``bias``: these
  can hide keys the structure cannot describe. No matmul: only the mask/bias tiles.
  """
  shape = plan.row(inp.q)[:-1] + (plan.bk,)

  def q_block(qi):
    qb = _query_block(plan, inp, aux, qi)

    def body(kj, cnt):
      ks = kj * plan.bk
      bias = None if qb.bias is None else _slice(qb.bias, ks, plan.bk, 4)
      vis = jnp.broadcast_to(_visibility(plan, aux, qb, ks, bias), shape)
      return cnt + jnp.sum(vis, axis=-1, keepdims=True).astype(plan.dtype)

    return lax.fori_loop(aux.kb_lo[qi], aux.kb_hi[qi], body,
                         _typed_like(jnp.zeros(plan.row(inp.q), plan.dtype), qb.q))

  return _unblock(lax.map(q_block, jnp.arange(plan.nq, dtype=jnp.int32)))


def _blockwise_rule(spec) -> tuple[str, Any]:
  """(kernel class, rule) of a spec the chunked path can run; NotImplementedError else."""
  if not isinstance(spec, NormalizerSpec):
    raise NotImplementedError(
        "xla_chunked needs a registered normalizer with a tile or threshold rule, got a plain "
        "callable")
  if spec.needs_key:
    raise NotImplementedError(f"xla_chunked does not support stochastic normalizers ({spec.name})")
  rule = {"T": spec.threshold, "R": spec.row_stats}.get(spec.kernel_class, spec.tile)
  if rule is None:
    raise NotImplementedError(
        f"xla_chunked has no blockwise rule for normalizer {spec.name!r} (kernel class "
        f"{spec.kernel_class}); use implementation='xla'")
  return spec.kernel_class, rule


def chunked_attention(call, block_q: int | None = None, block_k: int | None = None):
  """Blockwise attention for a validated AttentionCall (see the module docstring).

  A row whose bias holds a visible ``+inf`` follows the normalizer's ``+inf`` rule, as the
  dense path (``jaxsoft.attention.posinf.with_posinf_rule``: the tiles hide ``+inf``
  logits as they hide ``-inf`` ones; the rows are recomputed beside the pass only when the
  bias has a ``+inf``).

  Returns ``out`` [B, T, N, Hv], or ``(out, residual [B, T, N])`` when
  ``call.return_residual`` (the row statistic of :func:`_row_statistic`, no gradient).
  Raises NotImplementedError for what the chunked path cannot compute: plain callables,
  stochastic normalizers, kernel class X and a class-R residual (the dispatcher then falls back to
  "xla"), and :class:`UnsupportedDifferentiation` for forward-mode and higher-order
  derivatives (see the module docstring: first-order reverse mode only).
  """
  # here, before the +inf rule: class R's zero-bias pass runs in a lax.cond, whose branches
  # hide the JVP tracers from the check in _chunked_attention (JAX's bare custom_vjp error)
  refuse_unsupported_ad((call.q, call.k, call.v, call.bias, call.params),
                        "dot_product_attention(implementation='xla_chunked')")
  return with_posinf_rule(call, functools.partial(_chunked_attention, block_q=block_q,
                                                  block_k=block_k))


def _chunked_attention(call, block_q: int | None = None, block_k: int | None = None):
  """:func:`chunked_attention` without the ``+inf`` rule (bias entries ``+inf`` give NaN)."""
  spec = call.spec
  kind, rule = _blockwise_rule(spec)
  if kind == "R" and call.return_residual:
    raise NotImplementedError(
        f"`return_residual`: normalizer {spec.name!r} (kernel class R) has no row statistic")
  q, k, v = call.q, call.k, call.v
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  block_q = block_q or BLOCK_Q
  block_k = block_k or BLOCK_K
  bq = T if T <= block_q else block_q
  bk = S if S <= block_k else block_k
  Tp, Sp = _round_up(T, bq), _round_up(S, bk)
  nq = Tp // bq

  cdt = compute_dtype(q.dtype)  # float32, or float64 for float64 inputs
  # differentiable inputs in the compute dtype, GQA view of q with the scale folded in
  qs = (q.astype(cdt) * call.scale).reshape(B, T, K, G, H)
  qs = pad_axis(jnp.transpose(qs, (0, 2, 3, 1, 4)), 3, Tp)
  k4 = pad_axis(jnp.transpose(k.astype(cdt), (0, 2, 1, 3)), 2, Sp)
  v4 = pad_axis(jnp.transpose(v.astype(cdt), (0, 2, 1, 3)), 2, Sp)
  bias = None
  if call.bias is not None:
    bias = _heads5(call.bias.astype(cdt), N, K, G)
    bias = pad_axis(pad_axis(bias, 3, Tp), 4, Sp)
  decay = None
  if call.decay_bias is not None:
    cq, ck = call.decay_bias
    decay = _RowColumnBias(
        cq=pad_axis(jnp.transpose(cq, (0, 2, 1)).reshape(B, K, G, T), 3, Tp, mode="edge"),
        ck=pad_axis(jnp.transpose(ck, (0, 2, 1)).reshape(B, K, G, S), 3, Sp, mode="edge"))
  static_hp, hp, hp_int = [], {}, {}
  for name, value in {**spec.defaults, **call.params}.items():
    if isinstance(value, (jax.Array, np.ndarray)) and jnp.issubdtype(value.dtype, jnp.floating):
      hp[name] = _params_5d(value, N, K, G, T, Tp, cdt)
    elif isinstance(value, (jax.Array, np.ndarray)):
      hp_int[name] = jnp.asarray(value)  # integer arrays: not differentiable
    else:
      static_hp.append((name, value))
  inp = _Inputs(q=qs, k=k4, v=v4, bias=bias, decay=decay, hp=hp)

  st = call.structure
  mask = None
  if call.mask is not None:
    mask = _heads5(call.mask, N, K, G)
    mask = pad_axis(pad_axis(mask, 3, Tp, value=False), 4, Sp, value=False)
  ranges = st.row_ranges()  # one search for the block ranges and the counts
  kb_lo, kb_hi = st.block_key_ranges(bq, nq, bk, ranges)
  if mask is not None:  # and the key blocks the dense mask can see (e.g. a causal mask of
    # global positions from context_parallel_attention: about half the tiles)
    m_lo, m_hi = _mask_key_ranges(mask, bq, nq, bk, Sp // bk)
    kb_lo = jnp.maximum(kb_lo, m_lo)
    kb_hi = jnp.maximum(jnp.minimum(kb_hi, m_hi), kb_lo)
  prune = None
  if call.decay_prune_threshold is not None and decay is not None:
    prune = _block_prune_table(decay.cq, decay.ck, bq, bk, call.decay_prune_threshold)
  counts = pad_axis(st.visible_counts(ranges, cdt), 1, Tp, value=0.0)  # [B|1, Tp]
  aux = _Aux(
      structure=st, mask=mask,
      q_seg=pad_axis(st.q_segment_ids, 1, Tp, mode="edge") if st.has_segments else None,
      kv_seg=pad_axis(st.kv_segment_ids, 1, Sp, mode="edge") if st.has_segments else None,
      counts=counts.reshape(counts.shape[0], 1, 1, Tp, 1), kb_lo=kb_lo, kb_hi=kb_hi,
      prune=prune, hp_int=hp_int,
      kt=lax.stop_gradient(jnp.swapaxes(k4, -1, -2)),
      vt=lax.stop_gradient(jnp.swapaxes(v4, -1, -2)))
  if call.score == "distance":  # squared norms once per call (the backward chains d itself)
    aux = dataclasses.replace(
        aux, qn=lax.stop_gradient(jnp.sum(qs * qs, axis=-1)),
        kn=lax.stop_gradient(jnp.sum(k4 * k4, axis=-1)))
  plan = _Plan(kind=kind, rule=rule, dtype=cdt, static_hp=tuple(static_hp),
               cap=call.logits_soft_cap, bq=bq, bk=bk, nq=nq,
               may_skip_mask=not (bias is not None or mask is not None or st.has_segments))
  if plan.may_skip_mask:
    full_lo, full_hi = _full_block_runs(st, bq, nq, bk, Sp // bk)
    aux = dataclasses.replace(aux, full_lo=full_lo, full_hi=full_hi)
  if spec.length_dependent and (bias is not None or mask is not None):
    no_grad = dataclasses.replace(inp, bias=None if bias is None else lax.stop_gradient(bias))
    aux = dataclasses.replace(aux, counts=_dense_counts(plan, no_grad, aux))
  # n >= 1 inside the tile maps: a row with n = 0 has no visible entry, and log(0)-style
  # length terms must not create NaN in masked branches
  aux = dataclasses.replace(aux, counts=jnp.maximum(aux.counts, 1.0))

  refuse_unsupported_ad(inp, "dot_product_attention(implementation='xla_chunked')")
  out, stat = _attend(plan)(inp, aux)  # [B, K, G, Tp, Hv], [B, K, G, Tp, 1]
  out = jnp.transpose(out[:, :, :, :T], (0, 3, 1, 2, 4)).reshape(B, T, N, v.shape[-1])
  if not call.return_residual:
    return out.astype(q.dtype)
  stat = lax.stop_gradient(jnp.transpose(stat[:, :, :, :T, 0], (0, 3, 1, 2)).reshape(B, T, N))
  return out.astype(q.dtype), stat.astype(q.dtype)
