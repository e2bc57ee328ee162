"""One blockwise attention engine for every normalizer of kernel class E, S or P.

The per-tile math is the normalizer's :class:`~jaxsoft.normalizers.TileRule` run through
``jaxsoft.normalizers._tile``, the one module that the chunked XLA path and the reference
evaluators of ``jaxsoft.testing`` also call: the drivers (``triton.py`` for GPUs,
``tpu.py`` for Mosaic TPU) only move tiles and call the functions below, so a new E/S/P
normalizer runs in both kernels with no kernel change.

For one query row with logits ``s_j`` (scaled, soft-capped) over its visible keys V::

    z_j = score_map(s_j, n, **hp)                   n = |V|, the row's visible count
    m   = max_{j in V} z_j   (class E; 0 for S, P)  the stabiliser, carried online
    D   = sum_{j in V} denominator(z_j, m) + offset(m, n)   (E, S; P: 1)
    O   = sum_{j in V} numerator(z_j, m) v_j / D

Over key blocks, class E carries ``(m, l, acc)`` and rescales by ``e^{m - m'}`` when the
running max grows (FlashAttention's online softmax, valid because numerator and
denominator both scale by that factor); class S carries ``(l, acc)``; class P carries
``acc`` only (FlashSigmoid: no max or sum work at all).

Backward (FlashAttention-2: a dK/dV pass over query blocks and a dQ pass over key
blocks, recomputing the tile from the per-row statistics ``m`` and ``D``)::

    dP_ij = dO_i . v_j,   Delta_i = dO_i . O_i
    dz_ij = (numerator'(z_ij) dP_ij - denominator'(z_ij) Delta_i) / D_i   (P: numerator' dP)

taken by ``jax.vjp`` of the tile rule at fixed ``m`` (exact: the result does not depend
on ``m``), chained through ``score_map`` and the soft cap. Residuals are the inputs, the
output and two float32 statistics per query row; no T x S buffer exists anywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxsoft.attention import _masks
from jaxsoft.normalizers import _spec
from jaxsoft.normalizers import _tile as tile

__all__ = [
    "Aux",
    "BlockSizes",
    "Config",
    "UnsupportedError",
    "default_block_sizes",
]


class UnsupportedError(NotImplementedError):
  """The engine cannot compute this call exactly; a dispatcher should fall back to XLA."""


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the forward, dK/dV and dQ passes (query rows x key columns)."""

  block_q: int
  block_k: int
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None

  def resolved(self) -> BlockSizes:
    return BlockSizes(
        self.block_q, self.block_k,
        self.block_q_dkv or self.block_q, self.block_k_dkv or self.block_k,
        self.block_q_dq or self.block_q, self.block_k_dq or self.block_k)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def default_block_sizes(backend: str, t: int, s: int, head_dim: int) -> BlockSizes:
  """Block sizes that suit real chips.

  Mosaic TPU: 512 x 512 tiles where the lengths allow (128-wide tiles leave most of a
  v5e's MXU idle), always multiples of 128 (the lane width). Triton: 128 x 64 forward
  (64 x 64 for the backward passes), smaller for head dim > 128 to stay in registers;
  powers of two, as Triton requires.
  """
  if backend == "mosaic_tpu":
    bq = min(512, _round_up(t, 128))
    bk = min(512, _round_up(s, 128))
    return BlockSizes(bq, bk, bq, bk, bq, bk)
  big = head_dim > 128
  bq = min(64 if big else 128, max(16, _next_pow2(t)))
  bk = min(32 if big else 64, max(16, _next_pow2(s)))
  bb = min(32 if big else 64, max(16, _next_pow2(min(t, s))))
  bqb = min(bb, max(16, _next_pow2(t)))
  bkb = min(bb, max(16, _next_pow2(s)))
  return BlockSizes(bq, bk, bqb, bkb, bqb, bkb)


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything static about one attention call (hashable: it keys the custom_vjp)."""

  spec: Any  # NormalizerSpec (hashable by identity)
  static_hp: tuple[tuple[str, Any], ...]
  dyn_hp: tuple[str, ...]
  scale: float
  soft_cap: float | None
  causal: bool
  window: tuple[int, int] | None
  has_segments: bool
  t: int
  s: int
  t_pad: int
  s_pad: int
  head_dim_pad: int
  num_heads: int
  num_kv_heads: int
  blocks: BlockSizes  # resolved (every field set)
  backend: str
  interpret: Any
  debug: bool = False
  acc: str = "float32"  # the compute dtype: float32, or float64 for float64 inputs

  @property
  def acc_dtype(self):
    return jnp.dtype(self.acc)

  @property
  def groups(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def tile(self) -> _spec.TileRule:
    return self.spec.tile

  @property
  def kernel_class(self) -> str:
    return self.spec.kernel_class

  @property
  def needs_mask(self) -> bool:
    return (self.causal or self.window is not None or self.has_segments
            or self.t_pad != self.t or self.s_pad != self.s)


# --------------------------------------------------------------------------------------
# Per-tile math (pure jnp; runs inside the Pallas kernels of both drivers).


def tile_logits(cfg: Config, q, k):
  """s = cap * tanh(scale * q k^T / cap) in float32; q [bq, H], k [bk, H]."""
  s = dot(cfg, q, k, (1, 1)) * cfg.scale
  if cfg.soft_cap is not None:
    s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
  return s


def soft_cap_grad(cfg: Config, s, ds):
  """Chains ds through the soft cap: d(cap tanh(x/cap))/dx = 1 - (s/cap)^2."""
  if cfg.soft_cap is None:
    return ds
  t = s / cfg.soft_cap
  return ds * (1.0 - t * t)


def tile_mask(cfg: Config, q_start, k_start, bq: int, bk: int, q_seg=None, k_seg=None):
  """Visibility of a [bq, bk] tile (None when every entry is visible).

  The structure's :func:`~jaxsoft.attention._masks.positions_visible` at the tile's
  positions: ``q_start``/``k_start`` are its first global row/column, ``q_seg`` [bq, 1]
  and ``k_seg`` [1, bk] the kernel segment ids (lengths and padding folded in).
  """
  if not cfg.needs_mask:
    return None
  rows = q_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  cols = k_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  return _masks.positions_visible(
      rows, cols, is_causal=cfg.causal, window=cfg.window,
      q_len=cfg.t if cfg.t_pad != cfg.t else None, kv_len=cfg.s if cfg.s_pad != cfg.s else None,
      q_seg=q_seg if cfg.has_segments else None, kv_seg=k_seg)


def _hp(cfg: Config, dyn: tuple) -> tuple[dict[str, Any], dict[str, Any]]:
  """(static hyperparameters, the per-row arrays ``dyn`` by name)."""
  return dict(cfg.static_hp), dict(zip(cfg.dyn_hp, dyn, strict=True))


def init_state(cfg: Config, bq: int, hd: int):
  m, lsum = tile.init_rows(cfg.tile, (bq, 1), cfg.acc_dtype)
  return m, lsum, jnp.zeros((bq, hd), cfg.acc_dtype)


def forward_tile(cfg: Config, s, mask, state, v, length, dyn):
  """One key block of the online pass (``_tile.online_update``): returns the new (m, l, acc).

  ``s`` [bq, bk] float32 logits, ``v`` [bk, H], ``length`` [bq, 1] and each of ``dyn``
  [bq, 1] (per-row hyperparameters).
  """
  m, lsum, acc = state
  static, arrays = _hp(cfg, dyn)
  m, lsum, num, alpha = tile.online_update(cfg.tile, s, mask, m, lsum, length,
                                           {**static, **arrays})
  return m, lsum, tile.rescale(acc, alpha) + dot(cfg, num.astype(v.dtype), v, (1, 0))


def finalize(cfg: Config, state, length, dyn):
  """Returns (o [bq, H] float32, m [bq, 1], D [bq, 1]); a row with D = 0 gives zeros."""
  m, lsum, acc = state
  static, arrays = _hp(cfg, dyn)
  m, d = tile.finalize(cfg.tile, m, lsum, length, {**static, **arrays})
  return tile.normalize(cfg.tile, acc, d), m, d


def backward_tile(cfg: Config, s, mask, m, d, delta, dp, length, dyn):
  """Recomputes the tile's weights and returns (w, ds, dhp) (``_tile.tile_vjp``).

  ``w`` [bq, bk] the attention weights (for dV), ``ds`` [bq, bk] the cotangent of the
  logits before the soft cap is undone (the caller applies :func:`soft_cap_grad`),
  ``dhp`` the per-row cotangents of the dynamic hyperparameters (each [bq, 1]).
  """
  static, arrays = _hp(cfg, dyn)
  w, ds, dhp = tile.tile_vjp(cfg.tile, s, mask, m, d, delta, dp, length, static, arrays)
  return w, ds, tuple(dhp[name] for name in cfg.dyn_hp)


# --------------------------------------------------------------------------------------
# Plumbing shared by the drivers: one pass's block specs, its inputs, its kernel's refs.


@dataclasses.dataclass(frozen=True)
class Aux:
  """Non-differentiable per-call arrays the kernels read (a pytree)."""

  q_seg: Any  # [B, T_pad, 1] int32 or None
  k_seg: Any  # [B, 1, S_pad] int32 or None
  length: Any  # [B, T_pad, 1]: the visible count n of each row
  # The visible key blocks [lo, hi) of each query block, [B, nq] int32, per pass (the
  # forward and dQ passes may use different blocks), and the visible query blocks of
  # each key block [B, nk] for the dK/dV pass (MaskStructure.block_table).
  fwd_lo: Any
  fwd_hi: Any
  dq_lo: Any
  dq_hi: Any
  dkv_lo: Any
  dkv_hi: Any


jax.tree_util.register_dataclass(
    Aux, data_fields=[f.name for f in dataclasses.fields(Aux)], meta_fields=[])


def div(x, g: int):
  """x // g for non-negative int32 grid indices (in index maps)."""
  # lax.div, not //: floor division lowers through sign, which Mosaic resolves per chip.
  return jax.lax.div(x, jnp.asarray(g, x.dtype))


def dot(cfg: Config, a, b, contract: tuple[int, int]):
  """a . b contracting axis ``contract[0]`` of a with ``contract[1]`` of b (compute dtype)."""
  return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                             preferred_element_type=cfg.acc_dtype)


def block_specs(cfg: Config, index, q_rows: int, k_rows: int, q_heads: int | None = None,
                heads_first: bool = False) -> dict[str, Any]:
  """The BlockSpecs of one pass, all from one index map.

  ``index(*grid_indices)`` returns ``(batch, q_head, kv_head, q_block, k_block)`` in
  block units; query-side blocks have ``q_rows`` rows and ``q_heads`` heads (None: one,
  squeezed), key-side blocks ``k_rows`` rows. Keys: ``q`` (q, dO, O, dQ: [B, T, N, H], or
  [B, N, T, H] when ``heads_first``), ``kv`` (K, V, dK, dV), ``row`` (per-row statistics
  and hyperparameters [B, N, T, 1]), ``q_ids`` (query segment ids and visible counts
  [B, T, 1]) and ``k_ids`` (key segment ids [B, 1, S]).
  """
  hp = cfg.head_dim_pad

  def spec(shape, pick):
    return pl.BlockSpec(shape, lambda *grid: pick(*index(*grid)))

  if heads_first:
    q = spec((None, q_heads, q_rows, hp), lambda b, qh, kh, qb, kb: (b, qh, qb, 0))
    kv = spec((None, None, k_rows, hp), lambda b, qh, kh, qb, kb: (b, kh, kb, 0))
  else:
    q = spec((None, q_rows, q_heads, hp), lambda b, qh, kh, qb, kb: (b, qb, qh, 0))
    kv = spec((None, k_rows, None, hp), lambda b, qh, kh, qb, kb: (b, kb, kh, 0))
  return dict(
      q=q, kv=kv,
      row=spec((None, q_heads, q_rows, 1), lambda b, qh, kh, qb, kb: (b, qh, qb, 0)),
      q_ids=spec((None, q_rows, 1), lambda b, qh, kh, qb, kb: (b, qb, 0)),
      k_ids=spec((None, 1, k_rows), lambda b, qh, kh, qb, kb: (b, 0, kb)))


def pass_inputs(cfg: Config, specs: dict[str, Any], aux: Aux, dyn) -> tuple[list, list]:
  """(in_specs, args) every pass appends: segment ids, visible counts, hyperparameters."""
  in_specs, args = [], []
  if cfg.has_segments:
    in_specs += [specs["q_ids"], specs["k_ids"]]
    args += [aux.q_seg, aux.k_seg]
  in_specs += [specs["q_ids"]] + [specs["row"]] * len(dyn)
  args += [aux.length, *dyn]
  return in_specs, args


def split_refs(cfg: Config, refs, n_dyn: int):
  """A kernel's refs after its own inputs, as laid out by :func:`pass_inputs`:
  ``(q_seg, k_seg, length, dyn refs, the rest)``; the segment refs are None without ids."""
  refs = list(refs)
  q_seg = k_seg = None
  if cfg.has_segments:
    q_seg, k_seg, *refs = refs
  return q_seg, k_seg, refs[0], refs[1:1 + n_dyn], refs[1 + n_dyn:]
