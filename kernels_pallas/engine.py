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
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.normalizers import _spec
from jaxsoft.normalizers import _tile as tile

__all__ = [
    "BlockSizes",
    "Config",
    "UnsupportedError",
    "attention_core",
    "default_block_sizes",
    "supports",
]

# Segment id given to padded query rows / key columns (from padding to the block size or
# from query/key-value sequence lengths); the two never match each other or a user id.
Q_PAD_SEGMENT = np.iinfo(np.int32).min
K_PAD_SEGMENT = np.iinfo(np.int32).min + 1


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
  has_sink: bool
  scale: float
  soft_cap: float | None
  causal: bool
  window: tuple[int, int] | None
  has_segments: bool
  t: int
  s: int
  t_pad: int
  s_pad: int
  head_dim: int
  head_dim_pad: int
  num_heads: int
  num_kv_heads: int
  blocks: BlockSizes
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
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=cfg.acc_dtype)
  s = s * cfg.scale
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
  """Visibility of a [bq, bk] tile from the structure (None when every entry is visible).

  ``q_start``/``k_start`` are the tile's first global row/column; ``q_seg`` [bq, 1] and
  ``k_seg`` [1, bk] the segment ids (padding carries ids that never match).
  """
  if not cfg.needs_mask:
    return None
  rows = q_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  cols = k_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  mask = None

  def conj(a, b):
    return b if a is None else jnp.logical_and(a, b)

  if cfg.s_pad != cfg.s:
    mask = conj(mask, cols < cfg.s)
  if cfg.t_pad != cfg.t:
    mask = conj(mask, rows < cfg.t)
  if cfg.causal:
    mask = conj(mask, cols <= rows)
  if cfg.window is not None:
    left, right = cfg.window
    mask = conj(mask, jnp.logical_and(cols >= rows - left, cols <= rows + right))
  if cfg.has_segments:
    mask = conj(mask, q_seg == k_seg)
  return mask


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
  pv = jax.lax.dot_general(num.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=cfg.acc_dtype)
  return m, lsum, tile.rescale(acc, alpha) + pv


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
# XLA-side preparation: padding, visible counts, block tables, per-row parameters.


def supports(spec) -> bool:
  return isinstance(spec, _spec.NormalizerSpec) and spec.kernel_class in ("E", "S", "P")


def visible_counts(t, s, causal, window, q_seg, k_seg, chunk: int = 256):
  """n_i: the number of visible keys of each query row, float32 [B, T] (no T x S buffer).

  Closed form without segments; with segments a count over query chunks (O(chunk * S)
  memory).
  """
  rows = jnp.arange(t, dtype=jnp.int32)
  if q_seg is None:
    lo = jnp.zeros_like(rows)
    hi = jnp.full_like(rows, s - 1)
    if causal:
      hi = jnp.minimum(hi, rows)
    if window is not None:
      lo = jnp.maximum(lo, rows - window[0])
      hi = jnp.minimum(hi, rows + window[1])
    return jnp.maximum(hi - lo + 1, 0).astype(jnp.float32)[None, :]
  b = q_seg.shape[0]
  tc = _round_up(t, chunk) if t > chunk else t
  chunk = min(chunk, tc)
  qs = jnp.pad(q_seg, ((0, 0), (0, tc - t)), constant_values=Q_PAD_SEGMENT)
  cols = jnp.arange(s, dtype=jnp.int32)

  def count(args):
    qs_c, r0 = args
    r = r0 + jnp.arange(chunk, dtype=jnp.int32)
    vis = qs_c[:, :, None] == k_seg[:, None, :]
    if causal:
      vis &= (cols[None, :] <= r[:, None])[None]
    if window is not None:
      vis &= ((cols[None, :] >= r[:, None] - window[0])
              & (cols[None, :] <= r[:, None] + window[1]))[None]
    return jnp.sum(vis, axis=-1).astype(jnp.float32)

  nchunks = tc // chunk
  qs_chunks = qs.reshape(b, nchunks, chunk).transpose(1, 0, 2)
  starts = jnp.arange(nchunks, dtype=jnp.int32) * chunk
  out = jax.lax.map(count, (qs_chunks, starts))  # [nchunks, B, chunk]
  return out.transpose(1, 0, 2).reshape(b, tc)[:, :t]


def block_table(cfg: Config, bq: int, bk: int, q_seg, k_seg):
  """Which (query block, key block) tiles hold a visible entry: bool [B or 1, nq, nk].

  From the structure only: causal, window, padding, and segment-id ranges (a tile whose
  query and key segment ranges do not overlap has no equal pair; exact for any layout,
  tight for sorted ids).
  """
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  r_lo = np.arange(nq) * bq
  r_hi = np.minimum(r_lo + bq, cfg.t) - 1
  c_lo = np.arange(nk) * bk
  c_hi = np.minimum(c_lo + bk, cfg.s) - 1
  vis = (r_lo <= r_hi)[:, None] & (c_lo <= c_hi)[None, :]
  if cfg.causal:
    vis &= c_lo[None, :] <= r_hi[:, None]
  if cfg.window is not None:
    left, right = cfg.window
    vis &= (c_lo[None, :] <= r_hi[:, None] + right) & (c_hi[None, :] >= r_lo[:, None] - left)
  vis = jnp.asarray(vis)[None]
  if q_seg is not None:
    big = np.iinfo(np.int32).max
    qv = q_seg != Q_PAD_SEGMENT
    kv = k_seg != K_PAD_SEGMENT
    qb = q_seg.reshape(q_seg.shape[0], nq, bq)
    kb = k_seg.reshape(k_seg.shape[0], nk, bk)
    qvb, kvb = qv.reshape(qb.shape), kv.reshape(kb.shape)
    q_min = jnp.min(jnp.where(qvb, qb, big), axis=-1)
    q_max = jnp.max(jnp.where(qvb, qb, -big), axis=-1)
    k_min = jnp.min(jnp.where(kvb, kb, big), axis=-1)
    k_max = jnp.max(jnp.where(kvb, kb, -big), axis=-1)
    overlap = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])
    vis = vis & overlap
  return vis


def block_ranges(vis, axis: int):
  """First and last visible block along ``axis`` of a [B, nq, nk] table (int32, [B, n]).

  An empty row gives lo = 0, hi = -1 (the loop runs zero times).
  """
  n = vis.shape[axis]
  any_ = jnp.any(vis, axis=axis)
  lo = jnp.argmax(vis, axis=axis).astype(jnp.int32)
  hi = (n - 1 - jnp.argmax(jnp.flip(vis, axis=axis), axis=axis)).astype(jnp.int32)
  return jnp.where(any_, lo, 0), jnp.where(any_, hi, -1)


@dataclasses.dataclass(frozen=True)
class Aux:
  """Non-differentiable per-call arrays the kernels read (a pytree)."""

  q_seg: Any  # [B, T_pad, 1] int32 or None
  k_seg: Any  # [B, 1, S_pad] int32 or None
  length: Any  # [B, T_pad, 1] float32
  fwd_lo: Any  # [B, nq] int32 (also the dQ pass, whose blocks may differ)
  fwd_hi: Any
  dq_lo: Any
  dq_hi: Any
  dkv_lo: Any  # [B, nk] int32
  dkv_hi: Any


jax.tree_util.register_dataclass(
    Aux, data_fields=[f.name for f in dataclasses.fields(Aux)], meta_fields=[])


def _driver(cfg: Config):
  if cfg.backend == "triton":
    from kernels_pallas import triton as drv
  elif cfg.backend == "mosaic_tpu":
    from kernels_pallas import tpu as drv
  else:
    raise ValueError(f"`backend` must be 'triton' or 'mosaic_tpu', got {cfg.backend!r}")
  return drv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_core(cfg: Config, q, k, v, dyn, aux: Aux):
  """The kernel on padded inputs: q [B, T_pad, N, Hp], k/v [B, S_pad, K, Hp].

  ``dyn`` are the per-row hyperparameters [B, N, T_pad, 1] float32. Returns
  o [B, T_pad, N, Hp] in q's dtype.
  """
  o, _, _ = _driver(cfg).forward(cfg, q, k, v, dyn, aux)
  return o


def _core_fwd(cfg, q, k, v, dyn, aux):
  o, m, d = _driver(cfg).forward(cfg, q, k, v, dyn, aux)
  return o, (q, k, v, dyn, aux, o, m, d)


def _core_bwd(cfg, res, do):
  q, k, v, dyn, aux, o, m, d = res
  delta = jnp.einsum("btnh,btnh->bnt", o.astype(cfg.acc_dtype),
                     do.astype(cfg.acc_dtype))[..., None]
  drv = _driver(cfg)
  dq, ddyn = drv.backward_dq(cfg, q, k, v, do, m, d, delta, dyn, aux)
  dk, dv = drv.backward_dkv(cfg, q, k, v, do, m, d, delta, dyn, aux)
  # the offset's hyperparameters (a learned sink logit) enter only D: dL/dD = -Delta / D
  static, arrays = _hp(cfg, dyn)
  d_off = tile.offset_vjp(cfg.tile, m, d, delta, aux.length[:, None, :, :], static, arrays)
  if d_off is not None:
    ddyn = tuple(a + d_off[name] for a, name in zip(ddyn, cfg.dyn_hp, strict=True))
  aux_ct = jax.tree_util.tree_map(lambda x: None, aux)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), tuple(ddyn), aux_ct)


attention_core.defvjp(_core_fwd, _core_bwd)


def row_broadcast(value, b: int, n: int, t: int, name: str, dtype=jnp.float32):
  """A per-row hyperparameter -> [B, N, T] (broadcast like a row of scores [B, N, T, S]).

  Scalars, or arrays broadcastable numpy-style to [B, N, T, 1] (e.g. per head [N, 1, 1]).
  """
  x = jnp.asarray(value, dtype)
  if x.ndim > 4:
    raise ValueError(f"`{name}` of shape {x.shape} has more than 4 dimensions")
  full = (1,) * (4 - x.ndim) + tuple(x.shape)
  if full[-1] != 1:
    raise ValueError(
        f"`{name}` must have size 1 along the key axis (one value per query row), got "
        f"shape {x.shape}")
  try:
    return jnp.broadcast_to(x.reshape(full), (b, n, t, 1))[..., 0]
  except ValueError:
    raise ValueError(
        f"`{name}` of shape {x.shape} does not broadcast to the rows [B, N, T, 1] = "
        f"{(b, n, t, 1)}") from None


def is_static_scalar(v) -> bool:
  return v is None or isinstance(v, (bool, int, float, np.integer, np.floating))

