"""One blockwise attention engine for every normalizer of kernel class E, S or P.

The per-tile math is the normalizer's :class:`~jaxsoft.normalizers.TileRule` run through
``jaxsoft.normalizers.tile``, the one module that the chunked XLA path and the reference
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
output and two float32 statistics per query row; no T x S buffer exists anywhere but a
dense bias's gradient (dS, written per tile by the dQ pass, then summed over the bias's
broadcast axes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxsoft.attention import masks
from jaxsoft.attention.scores import safe_distance
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers import tile
from jaxsoft.normalizers.spec import exp_numerator, temperature_score_map
from jaxsoft.normalizers.spec import sigmoid_numerator as _sigmoid_numerator

__all__ = [
    "Aux",
    "BlockSizes",
    "Config",
    "UnsupportedError",
    "default_block_sizes",
]


class UnsupportedError(NotImplementedError):
  """A call the Pallas engine cannot compute exactly; a dispatcher falls back to XLA.

  The engine runs a normalizer blockwise only from a blockwise rule (kernel class E, S or
  P with a tile rule, T with a threshold rule, R with a row-statistics rule); a plain
  callable, a class-X or a stochastic normalizer raises this, as do the few combinations a
  kernel does not implement. A subclass of ``NotImplementedError``, which
  ``jaxsoft.attention.dot_product_attention`` catches to try its next implementation.

  Examples:
    >>> import kernels_pallas as kp
    >>> q = jnp.ones((1, 16, 1, 16))
    >>> try:
    ...   kp.attention(q, q, q, normalizer="congestion_softmax", interpret=True)
    ... except kp.UnsupportedError as e:
    ...   print(type(e).__name__, "-", str(e)[:61])
    UnsupportedError - normalizer 'congestion_softmax' is of kernel class X without

  References:
    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness" (the blockwise computation a rule
    must allow).
  """


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the attention kernels' passes, query rows x key columns.

  ``block_q`` x ``block_k`` tiles the forward pass; the dK/dV and dQ passes take their own
  (``block_q_dkv`` ...), None meaning the forward's (:meth:`resolved`). For Triton also
  the warps per program and the software-pipelining depth of every pass (None: 4 warps
  for tiles of at most 64 rows with head dim <= 64, else 8; 2 stages). Triton needs
  powers of two; Mosaic TPU multiples of 8 rows and of 128 key columns where the keys lie
  along the lanes.

  Attributes:
    block_q, block_k: the forward pass's tile.
    block_q_dkv, block_k_dkv: the dK/dV pass's (None: the forward's).
    block_q_dq, block_k_dq: the dQ pass's (None: the forward's).
    num_warps, num_stages: Triton's warps per program and pipelining depth (None: default).

  Examples:
    >>> from kernels_pallas import BlockSizes
    >>> BlockSizes(64, 32, block_q_dq=16).resolved()  # doctest: +NORMALIZE_WHITESPACE
    BlockSizes(block_q=64, block_k=32, block_q_dkv=64, block_k_dkv=32, block_q_dq=16,
               block_k_dq=32, num_warps=None, num_stages=None)

  References:
    T. Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning" (the forward, dK/dV and dQ passes and their tiles).
  """

  block_q: int
  block_k: int
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None

  def resolved(self) -> BlockSizes:
    return BlockSizes(
        self.block_q, self.block_k,
        self.block_q_dkv or self.block_q, self.block_k_dkv or self.block_k,
        self.block_q_dq or self.block_q, self.block_k_dq or self.block_k,
        self.num_warps, self.num_stages)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def default_block_sizes(backend: str, t: int, s: int, head_dim: int) -> BlockSizes:
  """The attention kernels' default tile sizes for a backend and problem size.

  Mosaic TPU: 512 x 512 tiles where the lengths allow (128-wide tiles leave most of a
  v5e's MXU idle), always multiples of 128 (the lane width). Triton: 128 x 64 forward
  (64 x 64 for the backward passes), smaller for head dim > 128 to stay in registers and
  for short sequences (at least 16); powers of two, as Triton requires.

  Args:
    backend: ``"triton"`` or ``"mosaic_tpu"``.
    t, s: the query and key lengths.
    head_dim: the query/key head dimension.

  Returns:
    A :class:`BlockSizes` with every pass's tile set.

  Examples:
    >>> from kernels_pallas import default_block_sizes
    >>> bl = default_block_sizes("mosaic_tpu", 4096, 4096, 128)
    >>> bl.block_q, bl.block_k
    (512, 512)
    >>> bl = default_block_sizes("triton", 100, 300, 64)
    >>> (bl.block_q, bl.block_k), (bl.block_q_dq, bl.block_k_dq)
    ((128, 64), (64, 64))

  References:
    T. Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning" (the tile shapes of its Triton and CUDA kernels).
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
  value_dim_pad: int | None = None  # the padded value head dim (None: head_dim_pad)
  # A dense bias / boolean mask: which axes of [B, N, T, S] it holds in full (the others
  # are broadcast: size 1, every block's index map pins them to block 0); None: absent.
  bias_full: tuple[bool, bool, bool, bool] | None = None
  mask_full: tuple[bool, bool, bool, bool] | None = None
  length_rows: bool = False  # the visible counts are per head: Aux.length [B, N, T_pad, 1]
  decay: bool = False  # Forgetting attention's cq_i - ck_j added before the soft cap
  # A18 score="distance": the logit is |q_i - k_j| (``score_tile``); it rides on the decay's
  # row and column operands (then |q_i|^2 and -|k_j|^2, ``decay`` True, scale -2)
  distance: bool = False
  # score="distance" together with FoX's decay: the row and column operands hold two terms
  # each (:attr:`terms`), the squared norms first, then the decay's cq_i and ck_j
  distance_decay: bool = False
  # ACP block pruning of the decay inside the tiles (classes T and R, whose passes share one
  # tile shape and follow the structure's ranges or the search's live blocks): a tile whose
  # bound max_i cq_i - min_j ck_j is below this threshold is hidden (:func:`prune_mask`).
  # Classes E, S and P prune with a block table instead (``key_table``), so never both.
  prune_threshold: float | None = None
  # Block tables (``attention_from_call(block_table=...)``): the key loops of the forward
  # and dQ passes follow a compacted list of key blocks per (batch, head, query block),
  # Aux.fwd_idx / fwd_cnt, and the dK/dV pass its transpose, Aux.dkv_idx / dkv_cnt,
  # instead of the structure's [lo, hi) ranges.
  key_table: bool = False
  # Per query row, the key blocks it may see (Aux.sel [B, N, T_pad, row_select] int32,
  # -1 = none): a tile hides the rows that did not select its key block. 0: no such list.
  row_select: int = 0
  # K06 speed flags of the forward pass (class E with e^{z - m} numerators only; checked by
  # :func:`check_flags`): ``exp2`` computes the tile numerators as exp2 in the log2
  # domain (log2 e folded into the kernel's scale), ``rescale_threshold`` tau >= 0 moves
  # the running max (and rescales) only when a block's max exceeds it by more than tau.
  exp2: bool = False
  rescale_threshold: float | None = None
  # K06 fp8: the forward's q and k operands are float8_e4m3fn (Aux.q8, Aux.k8) and its
  # scores a native fp8 dot times the per-row and per-key scales (Aux.q_scale [B, N,
  # T_pad, 1], Aux.k_scale [B, K, 1, S_pad]); the backward passes run with this False on
  # the dequantised q and k (``core``).
  fp8_dot: bool = False
  # K06 (Triton): the sigmoid numerator as 0.5 + 0.5 tanh(z / 2) with the GPU's
  # tanh.approx.f32 (FlashSigmoid's one MUFU instruction per score instead of an exp and an
  # IEEE division), in every pass; ``approx_sigmoid_numerator``.
  approx_sigmoid: bool = False

  @property
  def hv_pad(self) -> int:
    return self.head_dim_pad if self.value_dim_pad is None else self.value_dim_pad

  @property
  def acc_dtype(self):
    return jnp.dtype(self.acc)

  @property
  def groups(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def spec_tile(self) -> _spec.TileRule | None:
    """The spec's own tile rule for the E/S/P passes (class R: its row-statistics rule's
    second pass)."""
    return self.spec.row_stats.second if self.spec.kernel_class == "R" else self.spec.tile

  @property
  def tile(self) -> _spec.TileRule:
    """The tile rule the E/S/P passes run: :attr:`spec_tile`, with the K06
    ``approx_sigmoid`` numerator when that flag is on."""
    rule = self.spec_tile
    if self.approx_sigmoid and rule is not None:
      rule = dataclasses.replace(rule, numerator=approx_sigmoid_numerator(bool(self.interpret)))
    # only the E/S/P/R passes ask, and a spec of those classes carries a rule (Spec and
    # RowStatsRule validate it)
    assert rule is not None, f"{self.spec.name!r} (class {self.kernel_class}) has no tile rule"
    return rule

  @property
  def terms(self) -> int:
    """Columns of the row operand (Aux.cq [B, N, T_pad, W]) and rows of the column operand
    (Aux.ck [B, N, W, S_pad]): 2 with :attr:`distance_decay`, else 1."""
    return 2 if self.distance_decay else 1

  @property
  def kernel_class(self) -> str:
    return self.spec.kernel_class

  @property
  def needs_mask(self) -> bool:
    return (self.causal or self.window is not None or self.has_segments
            or self.t_pad != self.t or self.s_pad != self.s)


# --------------------------------------------------------------------------------------
# Per-tile math (pure jnp; runs inside the Pallas kernels of both drivers).


def tile_logits(cfg: Config, q, k, cq=None, ck=None, log2: bool = False, fp8_scales=None):
  """s = cap * tanh((scale * q k^T + cq - ck) / cap) in float32; q [bq, H], k [bk, H].

  ``cq`` [bq, 1] and ``ck`` [1, bk] are Forgetting attention's decay terms (None without):
  the tile of the outer difference ``cq_i - ck_j``, never a T x S array. ``log2`` (the
  forward pass with ``cfg.exp2``) returns ``log2(e) s``: log2 e is folded into the scale,
  the decay terms and the cap (``c cap tanh(x / cap) = (c cap) tanh(c x / (c cap))``).
  ``fp8_scales`` (``cfg.fp8_dot``): ``(sq [bq, 1], sk [1, bk])``, q and k float8 and
  ``q k^T`` the fp8 dot (float32 accumulation) times ``sq_i sk_j``. With
  ``cfg.distance`` see :func:`score_tile` (then ``cq`` [bq, W] and ``ck`` [W, bk],
  W = ``cfg.terms``).
  """
  return score_tile(cfg, q, k, cq, ck, log2, fp8_scales)[0]


def score_tile(cfg: Config, q, k, cq=None, ck=None, log2: bool = False, fp8_scales=None):
  """``(s, d)``: the logits of :func:`tile_logits` and, with ``cfg.distance``, the tile's
  distances before the soft cap (None otherwise), which :func:`logits_grad` chains through.

  With ``cfg.distance`` (A18, ``score="distance"``) the row and column terms are
  ``cq_i = |q_i|^2`` and ``ck_j = -|k_j|^2`` and the scale is -2, so that
  ``scale q k^T + cq - ck`` is the squared distance ``|q_i - k_j|^2`` and the pre-cap logit
  its square root ``d_ij`` (``safe_distance``: 0, with gradient 0, where rounding makes the
  square negative). With ``cfg.distance_decay`` the operands hold two terms (:func:`term`),
  the norms and then the decay, added to ``d_ij`` before the soft cap.
  """
  c = LOG2E if log2 else 1.0
  s = dot(cfg, q, k, (1, 1))
  dist = None
  if cfg.distance:  # the norms are term 0; a decay (cfg.distance_decay) term 1
    dist = safe_distance(s * cfg.scale + term(cq, 0, 1) - term(ck, 0, 0))
    s = dist * c if log2 else dist
    cq, ck = (term(cq, 1, 1), term(ck, 1, 0)) if cfg.distance_decay else (None, None)
  elif fp8_scales is not None:
    sq, sk = fp8_scales
    s = (s * (sq * (cfg.scale * c))) * sk
  else:
    s = s * (cfg.scale * c)
  if cq is not None:
    s = s + ((cq * c) - (ck * c) if log2 else cq - ck)
  if cfg.soft_cap is not None:
    cap = cfg.soft_cap * c
    s = cap * jnp.tanh(s * (1.0 / cap))  # a multiply per score, not a divide
  return s, dist


def term_shapes(cfg: Config, b: int):
  """The cotangents of the row and column operands (``Config.decay``): ``(d cq [B, N,
  T_pad, W], d ck [B, N, W, S_pad])`` in the compute dtype (W = ``Config.terms``)."""
  w, n = cfg.terms, cfg.num_heads
  return (jax.ShapeDtypeStruct((b, n, cfg.t_pad, w), cfg.acc_dtype),
          jax.ShapeDtypeStruct((b, n, w, cfg.s_pad), cfg.acc_dtype))


def term(x, i: int, axis: int):
  """Term ``i`` of a row operand tile ``x`` [bq, W] (``axis`` 1) or a column operand tile
  [W, bk] (``axis`` 0), keeping the axis (size 1); ``x`` itself when W = 1. A masked sum,
  not a slice: Triton lowers no value slicing."""
  if x.shape[axis] == 1:
    return x
  pick = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis) == i
  return jnp.sum(jnp.where(pick, x, 0.0), axis=axis, keepdims=True)


def term_grads(cfg: Config, s, ds, dz, axis: int):
  """The cotangent of the row (``axis`` -1: [bq, W]) or column (``axis`` 0: [W, bk]; the
  column operand enters with a minus sign, which the caller applies) operand of a tile:
  the sums of ``dz`` (:func:`logits_grad` of the logits' cotangent ``ds``) along
  ``axis``; with :attr:`Config.distance_decay` the decay's term, after the distance's,
  sums ``ds`` chained through the soft cap only (the decay is added after the square
  root)."""
  g = jnp.sum(dz, axis=axis, keepdims=True)
  if not cfg.distance_decay:
    return g
  h = jnp.sum(soft_cap_grad(cfg, s, ds), axis=axis, keepdims=True)
  shape = (s.shape[0], 2) if axis in (-1, 1) else (2, s.shape[1])
  first = jax.lax.broadcasted_iota(jnp.int32, shape, 1 if axis in (-1, 1) else 0) == 0
  return jnp.where(first, g, h)


def soft_cap_grad(cfg: Config, s, ds):
  """Chains ds through the soft cap: d(cap tanh(x/cap))/dx = 1 - (s/cap)^2."""
  if cfg.soft_cap is None:
    return ds
  t = s * (1.0 / cfg.soft_cap)
  return ds * (1.0 - t * t)


def logits_grad(cfg: Config, s, dist, ds):
  """The cotangent of the tile's ``scale q k^T + cq - ck`` from the logits' ``ds``: through
  the soft cap (:func:`soft_cap_grad`) and, with ``cfg.distance``, through ``d = sqrt(d2)``
  (``ds / (2 d)``, 0 where d = 0 as ``safe_distance``); ``dist`` from :func:`score_tile`."""
  ds = soft_cap_grad(cfg, s, ds)
  if dist is None:
    return ds
  pos = dist > 0
  return jnp.where(pos, ds / (2.0 * jnp.where(pos, dist, 1.0)), 0.0)


def tile_mask(cfg: Config, q_start, k_start, bq: int, bk: int, q_seg=None, k_seg=None):
  """Visibility of a [bq, bk] tile (None when every entry is visible).

  The structure's :func:`~jaxsoft.attention.masks.positions_visible` at the tile's
  positions: ``q_start``/``k_start`` are its first global row/column, ``q_seg`` [bq, 1]
  and ``k_seg`` [1, bk] the kernel segment ids (lengths and padding folded in).
  """
  if not cfg.needs_mask:
    return None
  rows = q_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  cols = k_start + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  return masks.positions_visible(
      rows, cols, is_causal=cfg.causal, window=cfg.window,
      q_len=cfg.t if cfg.t_pad != cfg.t else None, kv_len=cfg.s if cfg.s_pad != cfg.s else None,
      q_seg=q_seg if cfg.has_segments else None, kv_seg=k_seg)


def prune_mask(cfg: Config, mask, decay, q_start, k_start, bq: int, bk: int):
  """``mask`` with the whole tile hidden when ACP prunes it (``cfg.prune_threshold``):
  ``max_i cq_i - min_j ck_j`` over the tile's real rows and keys (padding excluded, as
  ``_api._decay_keep_table``) below the threshold. ``decay`` is the tile's ``(cq [bq, W],
  ck [W, bk])`` (the decay's term is the last); ``mask`` the visibility or None."""
  if cfg.prune_threshold is None or decay[0] is None:
    return mask
  cq, ck = term(decay[0], cfg.terms - 1, 1), term(decay[1], cfg.terms - 1, 0)
  rows = q_start + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0) < cfg.t
  cols = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1) < cfg.s
  top = jnp.max(jnp.where(rows, cq, -jnp.inf), axis=0, keepdims=True)  # [1, 1]
  low = jnp.min(jnp.where(cols, ck, jnp.inf), axis=1, keepdims=True)  # [1, 1]
  keep = jnp.broadcast_to(top - low >= cfg.prune_threshold, (bq, bk))
  return keep if mask is None else jnp.logical_and(mask, keep)


def dense_logits(cfg: Config, s, mask, bias=None, keep=None, log2: bool = False):
  """``(x, visible)`` of a tile with a dense bias and mask: ``x = s + bias`` (added after
  the soft cap, as the dense path does) and ``visible = mask & keep & (|x| != inf)``
  (``x != -inf`` for class P).

  ``s`` [bq, bk] the (capped) logits, ``mask`` the structure's visibility (or None),
  ``bias`` the float bias tile and ``keep`` the mask tile (nonzero = attend), each
  [bq, bk] or None. A ``-inf`` bias entry hides its key exactly like a False mask entry; so
  does a ``+inf`` one except for class P, its row being replaced by
  ``jaxsoft.attention.posinf.with_posinf_rule``.
  ``log2``: ``s`` is in log2 units (:func:`tile_logits`), so is the bias added to it.
  """
  x = s
  if keep is not None:
    k = keep != 0
    mask = k if mask is None else jnp.logical_and(mask, k)
  if bias is not None:
    x = s + (bias.astype(s.dtype) * LOG2E if log2 else bias.astype(s.dtype))
    # A NaN logit stays visible (its row NaN, as dense); but for class P (whose numerator
    # at +inf is the entry's own limit) a +inf one is hidden too: its row is replaced by
    # the +inf rule (jaxsoft.attention.posinf), so the tile stays finite.
    if cfg.spec.kernel_class == "P":
      finite = x != -jnp.inf
    else:
      finite = jnp.abs(x) != jnp.inf
    mask = finite if mask is None else jnp.logical_and(mask, finite)
  return x, mask


def dense_tile(full, ref, bq: int, bk: int, head=None, rows=None, cols=None):
  """The [bq, bk] tile of a bias or mask block ``ref`` (None when ``ref`` is None).

  ``full`` says which of [B, N, T, S] the array holds in full; a block has a heads axis
  only when it holds several heads (``head`` indexes it), and a broadcast T or S axis has
  one row or column, broadcast here. ``rows``/``cols`` slice a block that spans more than
  the tile (Triton's whole-length blocks), None when the block is the tile.
  """
  if ref is None:
    return None
  idx = []
  if head is not None and full[1]:
    idx.append(head)
  idx.append(rows if rows is not None and full[2] else slice(None))
  idx.append(cols if cols is not None and full[3] else slice(None))
  return jnp.broadcast_to(ref[tuple(idx)], (bq, bk))


class Tile(NamedTuple):
  """One tile's logits as every pass computes them (:func:`masked_logits`)."""

  s: Any  # [bq, bk] the (capped) logits of :func:`score_tile`
  dist: Any  # the distances before the soft cap (``cfg.distance``), else None
  x: Any  # s with the dense bias added (:func:`dense_logits`)
  mask: Any  # the tile's visibility [bq, bk], or None when every entry is visible


def masked_logits(cfg: Config, q, k, qb, kb, bq: int, bk: int, segs=(None, None),
                  decay=(None, None), dense=(None, None), sel=None, log2: bool = False,
                  fp8_scales=None) -> Tile:
  """The tile of query block ``qb`` and key block ``kb`` (block units; ``bq`` x ``bk``).

  Its logits (:func:`score_tile`), its visibility (:func:`tile_mask` with the segment ids
  ``segs`` = (q_seg [bq, 1], k_seg [1, bk])), the decay's pruning (:func:`prune_mask`,
  ``decay`` = (cq [bq, W], ck [W, bk])), the dense bias and mask tiles ``dense``
  (:func:`dense_logits`) and the per-row block selections ``sel`` (:func:`select_mask`);
  each input None when absent. ``log2`` and ``fp8_scales`` as :func:`score_tile` (the
  forward pass's K06 flags).
  """
  q_start, k_start = qb * bq, kb * bk
  s, dist = score_tile(cfg, q, k, decay[0], decay[1], log2, fp8_scales)
  mask = tile_mask(cfg, q_start, k_start, bq, bk, *segs)
  mask = prune_mask(cfg, mask, decay, q_start, k_start, bq, bk)
  x, mask = dense_logits(cfg, s, mask, dense[0], dense[1], log2)
  return Tile(s, dist, x, select_mask(mask, sel, kb, bk))


def dq_tile(cfg: Config, tile: Tile, ds, k):
  """A tile's share of dQ [bq, H] (``k`` [bk, H] its keys) and of d cq [bq, W] (None
  without a decay) from the logits' cotangent ``ds`` (before the soft cap is undone)."""
  dz = logits_grad(cfg, tile.s, tile.dist, ds)
  dcq = term_grads(cfg, tile.s, ds, dz, -1) if cfg.decay else None  # sum_j dS_ij
  return dot(cfg, (dz * cfg.scale).astype(k.dtype), k, (1, 0)), dcq


def dk_tile(cfg: Config, tile: Tile, ds, q, transpose: bool):
  """A tile's share of dK [bk, H] (``q`` [bq, H] its queries) and of d ck [W, bk], to be
  subtracted (None without a decay), from the logits' cotangent ``ds``. ``transpose``:
  the dot of ``dz.T`` with q (the Mosaic driver's form), else over dz's rows (Triton's)."""
  dz = logits_grad(cfg, tile.s, tile.dist, ds)
  dck = term_grads(cfg, tile.s, ds, dz, 0) if cfg.decay else None
  if transpose:
    dz = dz * cfg.scale
    return dot(cfg, dz.T.astype(q.dtype), q, (1, 0)), dck
  return dot(cfg, (dz * cfg.scale).astype(q.dtype), q, (0, 0)), dck


def _hp(cfg: Config, dyn: tuple) -> tuple[dict[str, Any], dict[str, Any]]:
  """(static hyperparameters, the per-row arrays ``dyn`` by name)."""
  return dict(cfg.static_hp), dict(zip(cfg.dyn_hp, dyn, strict=True))


def init_state(cfg: Config, bq: int, hd: int):
  m, lsum = tile.init_rows(cfg.tile, (bq, 1), cfg.acc_dtype)
  return m, lsum, jnp.zeros((bq, hd), cfg.acc_dtype)


def forward_tile(cfg: Config, s, mask, state, v, length, dyn):
  """One key block of the online pass (``tile.online_update``): returns the new (m, l, acc).

  ``s`` [bq, bk] float32 logits (log2 units with ``cfg.exp2``), ``v`` [bk, H], ``length``
  [bq, 1] and each of ``dyn`` [bq, 1] (per-row hyperparameters). With the K06 flags the
  block goes through :func:`_online_exp` instead.
  """
  m, lsum, acc = state
  static, arrays = _hp(cfg, dyn)
  if cfg.exp2 or cfg.rescale_threshold is not None:
    m_new, lsum, num, alpha = _online_exp(cfg, s, mask, m, lsum, length, {**static, **arrays})
    pv = dot(cfg, num.astype(v.dtype), v, (1, 0))
    if cfg.rescale_threshold is None:
      return m_new, lsum, acc * alpha + pv
    # lazy: the accumulator is rescaled only when some row moved its stabiliser (a
    # factor of exactly 1 is skipped, so the result is the same as multiplying; alpha <= 1)
    acc = jax.lax.cond(jnp.min(alpha) < 1.0, lambda a: a * alpha, lambda a: a, acc)
    return m_new, lsum, acc + pv
  m, lsum, num, alpha = tile.online_update(cfg.tile, s, mask, m, lsum, length,
                                           {**static, **arrays})
  return m, lsum, tile.rescale(acc, alpha) + dot(cfg, num.astype(v.dtype), v, (1, 0))


def _online_exp(cfg: Config, x, mask, m, lsum, length, hp):
  """``tile.online_update`` of a class-E rule with ``numerator = denominator = e^{z - m}``
  under the K06 flags: returns ``(m', l', numerators, alpha)``.

  ``exp2`` (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
  Partitioning", arXiv:2307.08691; Shah et al. 2024, "FlashAttention-3", arXiv:2407.08608):
  ``x`` is already ``log2(e) x`` (:func:`tile_logits`), the score map is linear
  (:func:`check_flags`), so ``z2 = log2(e) z`` and ``m`` are carried in log2 units
  and ``e^{z - m} = 2^{z2 - m2}`` (the floor is scaled too; :func:`finalize` converts m
  back). ``rescale_threshold`` tau (FlashAttention-4's conditional rescaling, Tri Dao et
  al. 2025): the stabiliser ``m_used`` moves to the new running max only where that
  exceeds ``m_used + tau``; elsewhere the block adds ``e^{z - m_used} <= e^tau`` with
  alpha = 1. Both (m, l, acc) stay relative to the same m, so ``acc / (l + offset(m))``
  is the same function (tau = 0: the eager update).
  """
  rule = cfg.tile
  c = LOG2E if cfg.exp2 else 1.0
  z = rule.score_map(mask_where(mask, x, jnp.zeros_like(x)), length, **hp)
  floor = rule.floor_value(length, hp)
  if floor is not None and cfg.exp2:
    floor = floor * LOG2E
  m_new = tile.running_max(z, mask, m, floor)
  if cfg.rescale_threshold is not None:
    m_new = jnp.where(m_new > m + cfg.rescale_threshold * c, m_new, m)
  m_use = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
  exp = jnp.exp2 if cfg.exp2 else jnp.exp
  alpha = exp(m - m_use)  # 0 while nothing was visible (m = -inf), 1 where m stayed
  num = exp(mask_where(mask, z, m_use) - m_use)
  num = mask_where(mask, num, 0.0)
  return m_new, lsum * alpha + jnp.sum(num, axis=-1, keepdims=True), num, alpha


def mask_where(mask, a, b):
  """``a`` where visible (everywhere when ``mask`` is None), else ``b``."""
  return a if mask is None else jnp.where(mask, a, b)


@functools.lru_cache(maxsize=2)  # one per interpret flag: Config.tile asks on every use
def approx_sigmoid_numerator(interpret: bool):
  """The sigmoid tile numerator ``w = 0.5 + 0.5 tanh(z / 2)`` with the GPU's
  ``tanh.approx.f32`` (``plgpu.approx_tanh``; PTX documents a maximum relative error of
  2^-10.987 for it, so ``|dw| <= 2^-11.987 |tanh| < 2.5e-4``), as FlashSigmoid (Ramapuram
  et al. 2024, "Theory, analysis, and best practices for sigmoid self-attention"). Its
  derivative is ``w (1 - w)`` of the same w. In the interpreter (no PTX) ``jnp.tanh``
  stands in: the algebra is exact there, the error is measured on a GPU
  (``bench/gpu.py --sections sigmoid``)."""
  tanh: Callable[[jax.Array], jax.Array]
  if interpret:
    tanh = jnp.tanh
  else:
    from jax.experimental.pallas import triton as plgpu
    tanh = plgpu.approx_tanh

  @jax.custom_jvp
  def sig(z):
    return 0.5 + 0.5 * tanh(0.5 * z)

  @sig.defjvp
  def _sig_jvp(primals, tangents):
    w = sig(primals[0])
    return w, w * (1.0 - w) * tangents[0]

  return lambda z, m, **_: sig(z)


def varying_like(out_shape, inputs):
  """``out_shape`` (ShapeDtypeStructs) given the manual axis type of the ``inputs`` that
  vary over the most mesh axes: inside ``jax.shard_map`` (default ``check_vma``) a
  pallas_call must say how its outputs vary, which a bare shape does not."""
  avals = [jax.typeof(x) for x in inputs if x is not None]
  mats = [a.mat for a in avals if getattr(a, "mat", None) is not None]
  if not mats:
    return out_shape
  mat = max(mats, key=lambda m: len(m.varying))
  if not mat.varying:
    return out_shape
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape)


LOG2E = 1.0 / math.log(2.0)  # log2(e): e^x = 2^{x log2(e)}
LN2 = math.log(2.0)


def exp2_exact(cfg: Config) -> bool:
  """Whether the tile rule is exact in the log2 domain: class E with ``e^{z - m}`` as
  numerator and denominator and a score map linear in the logits (identity or the
  temperature's ``x / T``), so ``z2 = log2(e) z``; any offset (a sink) and floor."""
  rule = cfg.tile
  return (cfg.kernel_class in ("E", "R") and rule.uses_max
          and rule.numerator is exp_numerator and rule.denominator is exp_numerator
          and rule.score_map in (_spec.identity_score_map, temperature_score_map))


def check_flags(cfg: Config) -> None:
  """ValueError naming ``exp2`` / ``rescale_threshold`` when the call's tile rule cannot
  run them exactly. ``rescale_threshold`` needs class E (or R's class-E second pass) with
  ``e^{z - m}`` numerator and denominator, any score map, offset, floor, soft cap, bias
  or decay; ``exp2`` also a linear score map (:func:`exp2_exact`: softmax with any
  temperature, softmax_1, softmax_n, softmax_sink); ``approx_sigmoid`` the sigmoid
  normalizer on the Triton backend."""
  if not isinstance(cfg.approx_sigmoid, bool):
    raise ValueError(f"`approx_sigmoid` must be a bool, got {cfg.approx_sigmoid!r}")
  if cfg.approx_sigmoid:
    base = cfg.spec_tile
    if base is None or base.numerator is not _sigmoid_numerator:
      raise ValueError(f"`approx_sigmoid` needs the sigmoid normalizer, not {cfg.spec.name!r}")
    if cfg.backend != "triton":
      raise ValueError("`approx_sigmoid` needs the Triton backend (tanh.approx.f32 is a PTX "
                       f"instruction), not {cfg.backend!r}")
  tau = cfg.rescale_threshold
  if tau is not None:
    rule = cfg.tile if cfg.kernel_class in ("E", "S", "P", "R") else None
    if (rule is None or not rule.uses_max or rule.numerator is not exp_numerator
        or rule.denominator is not exp_numerator):
      raise ValueError(
          f"`rescale_threshold` needs a class-E normalizer with e^(z - m) numerators "
          f"(softmax and its sink/temperature/length-scaled variants), not "
          f"{cfg.spec.name!r}")
    if not (isinstance(tau, (int, float)) and not isinstance(tau, bool)
            and 0.0 <= tau <= MAX_RESCALE_THRESHOLD):
      raise ValueError(f"`rescale_threshold` must be None or a number in [0, "
                       f"{MAX_RESCALE_THRESHOLD}], got {tau!r}")
  if not isinstance(cfg.exp2, bool):
    raise ValueError(f"`exp2` must be a bool, got {cfg.exp2!r}")
  if cfg.exp2 and (cfg.kernel_class not in ("E", "S", "P", "R") or not exp2_exact(cfg)):
    raise ValueError(
        f"`exp2` needs a class-E normalizer with e^(z - m) numerators and a linear score "
        f"map (softmax, softmax_1, softmax_n, softmax_sink), not {cfg.spec.name!r}")


# A lazily rescaled block adds terms up to e^tau: 64 keeps a row's sums of up to 2^40
# such terms far below float32's 3.4e38.
MAX_RESCALE_THRESHOLD = 64.0


def finalize(cfg: Config, state, length, dyn):
  """Returns (o [bq, H] float32, m [bq, 1], D [bq, 1]); a row with D = 0 gives zeros.

  With ``cfg.exp2`` the carried m is in log2 units; m and D leave in natural ones (the
  backward passes, the offset and the residuals read them so)."""
  m, lsum, acc = state
  static, arrays = _hp(cfg, dyn)
  if cfg.exp2:
    m = m * LN2
  m, d = tile.finalize(cfg.tile, m, lsum, length, {**static, **arrays})
  return tile.normalize(cfg.tile, acc, d), m, d


def backward_tile(cfg: Config, s, mask, m, d, delta, dp, length, dyn):
  """Recomputes the tile's weights and returns (w, ds, dhp) (``tile.tile_vjp``).

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
  length: Any  # [B, T_pad, 1] (per head: [B, N, T_pad, 1]): the visible count n of each row
  # The visible key blocks [lo, hi) of each query block, [B, nq] int32, per pass (the
  # forward and dQ passes may use different blocks), and the visible query blocks of
  # each key block [B, nk] for the dK/dV pass (MaskStructure.block_table).
  fwd_lo: Any
  fwd_hi: Any
  dq_lo: Any
  dq_hi: Any
  dkv_lo: Any
  dkv_hi: Any
  # The dense mask ([B|1, N|1, T_pad|1, S_pad|1] int32, nonzero = attend) or None; the
  # dense bias travels beside it (a differentiable input: ``core`` puts it here for the
  # drivers).
  mask: Any = None
  bias: Any = None
  # Forgetting attention's decay (differentiable, put here by ``core`` like the bias):
  # cq [B, N, T_pad, W] and ck [B, N, W, S_pad] (W = Config.terms), or None.
  cq: Any = None
  ck: Any = None
  # Block tables (Config.key_table): the key blocks of each query block, [B, N, nq, width]
  # int32 compacted (``live_block_tables``) with their count [B, N, nq, 1], and the query
  # blocks of each key block [B, N, nk, width_q] / [B, N, nk, 1] for the dK/dV pass.
  fwd_idx: Any = None
  fwd_cnt: Any = None
  dkv_idx: Any = None
  dkv_cnt: Any = None
  # Per-row key-block lists [B, N, T_pad, Config.row_select] int32 (-1 = none) or None.
  sel: Any = None
  # K06 fp8 (Config.fp8_dot): the forward's float8 q [B, T_pad, N, Hp] and k [B, S_pad, K,
  # Hp], and their scales per query row [B, N, T_pad, 1] and per key [B, K, 1, S_pad].
  q8: Any = None
  k8: Any = None
  q_scale: Any = None
  k_scale: Any = None


def row_lengths(cfg: Config, aux: Aux):
  """The visible counts as rows of the scores: [B, N or 1, T_pad, 1]."""
  return aux.length if cfg.length_rows else aux.length[:, None, :, :]


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
  squeezed), key-side blocks ``k_rows`` rows. Keys: ``q`` (q, dQ: [B, T, N, H], or
  [B, N, T, H] when ``heads_first``), ``o`` (O, dO: value head dim), ``kv`` (K, dK),
  ``v`` (V, dV), ``bias``/``mask`` (the dense bias and mask, None without), ``cq``/``ck``
  (the decay's row and column terms [B, N, T, W] / [B, N, W, S], ``Config.terms``, and
  their cotangents), ``row`` (per-row statistics and hyperparameters [B, N, T, 1]),
  ``q_ids`` (query segment ids and visible counts [B, T, 1]) and ``k_ids`` (key segment
  ids [B, 1, S]).
  """
  hp, hv = cfg.head_dim_pad, cfg.hv_pad

  def spec(shape, pick):
    return pl.BlockSpec(shape, lambda *grid: pick(*index(*grid)))

  def dense(full):
    # a broadcast axis has one block (index 0); a broadcast T/S axis one row/column
    if full is None:
      return None
    fb, fn, ft, fs = full
    shape = (None, q_heads if fn else None, q_rows if ft else 1, k_rows if fs else 1)
    return spec(shape, lambda b, qh, kh, qb, kb: (b if fb else 0, qh if fn else 0,
                                                 qb if ft else 0, kb if fs else 0))

  if heads_first:
    q = spec((None, q_heads, q_rows, hp), lambda b, qh, kh, qb, kb: (b, qh, qb, 0))
    o = spec((None, q_heads, q_rows, hv), lambda b, qh, kh, qb, kb: (b, qh, qb, 0))
    kv = spec((None, None, k_rows, hp), lambda b, qh, kh, qb, kb: (b, kh, kb, 0))
    vv = spec((None, None, k_rows, hv), lambda b, qh, kh, qb, kb: (b, kh, kb, 0))
  else:
    q = spec((None, q_rows, q_heads, hp), lambda b, qh, kh, qb, kb: (b, qb, qh, 0))
    o = spec((None, q_rows, q_heads, hv), lambda b, qh, kh, qb, kb: (b, qb, qh, 0))
    kv = spec((None, k_rows, None, hp), lambda b, qh, kh, qb, kb: (b, kb, kh, 0))
    vv = spec((None, k_rows, None, hv), lambda b, qh, kh, qb, kb: (b, kb, kh, 0))
  return dict(
      q=q, kv=kv, o=o, v=vv, bias=dense(cfg.bias_full), mask=dense(cfg.mask_full),
      cq=spec((None, q_heads, q_rows, cfg.terms), lambda b, qh, kh, qb, kb: (b, qh, qb, 0)),
      ck=spec((None, q_heads, cfg.terms, k_rows), lambda b, qh, kh, qb, kb: (b, qh, 0, kb)),
      k_scale=spec((None, None, 1, k_rows), lambda b, qh, kh, qb, kb: (b, kh, 0, kb)),
      sel=spec((None, q_heads, q_rows, max(1, cfg.row_select)),
               lambda b, qh, kh, qb, kb: (b, qh, qb, 0)),
      row=spec((None, q_heads, q_rows, 1), lambda b, qh, kh, qb, kb: (b, qh, qb, 0)),
      q_ids=spec((None, q_rows, 1), lambda b, qh, kh, qb, kb: (b, qb, 0)),
      k_ids=spec((None, 1, k_rows), lambda b, qh, kh, qb, kb: (b, 0, kb)))


def pass_inputs(cfg: Config, specs: dict[str, Any], aux: Aux, dyn) -> tuple[list, list]:
  """(in_specs, args) every pass appends: segment ids, visible counts, hyperparameters."""
  in_specs, args = [], []
  if cfg.has_segments:
    in_specs += [specs["q_ids"], specs["k_ids"]]
    args += [aux.q_seg, aux.k_seg]
  in_specs += [specs["row"] if cfg.length_rows else specs["q_ids"]] + [specs["row"]] * len(dyn)
  args += [aux.length, *dyn]
  for name in ("bias", "mask"):
    if getattr(aux, name) is not None:
      in_specs.append(specs[name])
      args.append(getattr(aux, name))
  if cfg.decay:
    in_specs += [specs["cq"], specs["ck"]]
    args += [aux.cq, aux.ck]
  if cfg.row_select:
    in_specs.append(specs["sel"])
    args.append(aux.sel)
  if cfg.fp8_dot:
    in_specs += [specs["row"], specs["k_scale"]]
    args += [aux.q_scale, aux.k_scale]
  return in_specs, args


class InputRefs(NamedTuple):
  """The refs of the inputs :func:`pass_inputs` appends to a pass (None where the call has
  no such input)."""

  q_seg: Any  # query segment ids [rows, 1]
  k_seg: Any  # key segment ids [1, cols]
  length: Any  # the visible counts
  dyn: tuple  # the per-row hyperparameters
  bias: Any  # the dense bias and mask blocks
  mask: Any
  cq: Any  # the decay's (or the distance's) row and column operands
  ck: Any
  sel: Any  # the per-row key-block lists (``cfg.row_select``)
  q_scale: Any  # the fp8 scales (``cfg.fp8_dot``)
  k_scale: Any


def split_inputs(cfg: Config, refs, n_dyn: int) -> tuple[InputRefs, list]:
  """A kernel's refs after its own inputs, as laid out by :func:`pass_inputs`: ``(the
  inputs' refs, the rest)`` (the rest: the pass's outputs, then its scratch)."""
  refs = iter(refs)

  def take(present):
    return next(refs) if present else None

  segs = cfg.has_segments
  q_seg, k_seg, length = take(segs), take(segs), next(refs)
  dyn = tuple(next(refs) for _ in range(n_dyn))
  bias, mask = take(cfg.bias_full is not None), take(cfg.mask_full is not None)
  cq, ck = take(cfg.decay), take(cfg.decay)
  sel = take(bool(cfg.row_select))
  q_scale, k_scale = take(cfg.fp8_dot), take(cfg.fp8_dot)
  return InputRefs(q_seg, k_seg, length, dyn, bias, mask, cq, ck, sel, q_scale,
                   k_scale), list(refs)


def dq_outputs(cfg: Config, specs: dict[str, Any], dq_shape, rows: int):
  """``(out_shape, out_specs)`` of a dQ pass: dQ [``dq_shape``], ``rows`` per-row
  cotangents [B, N, T_pad, 1], then with a decay d cq (:func:`term_shapes`)."""
  b, n = dq_shape[0], cfg.num_heads
  out_shape = [jax.ShapeDtypeStruct(dq_shape, cfg.acc_dtype)]
  out_shape += [jax.ShapeDtypeStruct((b, n, cfg.t_pad, 1), cfg.acc_dtype)] * rows
  out_shape += [term_shapes(cfg, b)[0]] * int(cfg.decay)
  return out_shape, [specs["q"]] + [specs["row"]] * rows + [specs["cq"]] * int(cfg.decay)


def row_widths(cfg: Config, rows: int) -> list[int]:
  """The widths of a dQ pass's ``rows`` per-row cotangents and, with a decay, of d cq."""
  return [1] * rows + [cfg.terms] * int(cfg.decay)


def select_mask(mask, sel, kb, bk: int):
  """The tile's visibility with the rows that did not select key block ``kb`` hidden.

  ``sel`` [bq, width] int32 lists each row's key blocks (-1 = none; None: every row sees
  the block), ``mask`` the tile's visibility [bq, bk] (None: all visible)."""
  if sel is None:
    return mask
  hit = jnp.max(jnp.where(sel == kb, 1.0, 0.0), axis=-1, keepdims=True)  # [bq, 1]
  hit = jnp.broadcast_to(hit, (sel.shape[0], bk)) > 0.0
  return hit if mask is None else jnp.logical_and(mask, hit)


# --------------------------------------------------------------------------------------
# Class T (threshold rules: sparsemax, entmax15, entmax with any alpha, top_k_softmax).
#
# AdaSplash-style (N. Gonçalves, M. Treviso & A. F. T. Martins, 2025, "AdaSplash: Adaptive
# Sparse Flash Attention", ICML 2025, arXiv:2502.12082): per query row, with
# ``z = score_map(s)`` over the visible keys V and the rule's ThresholdRule,
#
#   pass 0        m = max_{j in V} z_j                     (one sweep over the key blocks)
#   passes 1..P   tau solves  F(tau) = sum_{j in V} mass(z_j, tau) - target(n) = 0
#                 on the rule's bracket [lo, hi] (F(lo) >= 0 >= F(hi)) by ``_tile``'s
#                 search: each sweep sums the mass (and, for a rule with
#                 ``newton_power``, its slope) at a few candidate taus, merging the
#                 per-block partial sums, and closes the bracket on the root. Triton
#                 takes Newton steps with a bisection companion and stops when every row
#                 of the query block is done (3-7 sweeps for sparsemax and entmax15,
#                 against 15 for a fixed multisection); the Mosaic TPU grid fixes the
#                 sweep count in advance, so it runs multisection (2 bits per sweep).
#   weighted pass O = sum_j weight(z_j, tau, m) v_j / W,  W = sum_j weight(z_j, tau, m)
#                 (class P with f = the rule's weight; tau = the middle of the settled
#                 bracket, or its lower end, so the support is never empty, and dividing
#                 by W removes the residual error
#                 of the finite search), visiting only the key blocks that hold a
#                 visible z >= tau: every other block's weights are exactly 0.
#
# Backward, restricted to those same blocks (the support), by the implicit function
# theorem on F (the same rule as the xla_chunked path):
#
#   dz_j = weight'_j (dP_j - Delta) / W  -  coef * mass'_j,
#   coef = [sum_k d_tau weight_k (dP_k - Delta) / W] / [sum_k d_tau mass_k]
#
# (derivatives through ``score_map`` and the array hyperparameters by jax.vjp of
# ``tile.threshold_maps``, e.g. entmax's per-head alpha), plus ``coef`` times the
# target's derivative for the hyperparameters the target depends on.

def threshold_iterations(cfg: Config) -> int:
  """The rule's bisection count (doubled for float64, whose resolution is 2^29 finer)."""
  it = int(cfg.spec.threshold.iterations)
  return 2 * it if cfg.acc == "float64" else it


def threshold_schedule(cfg: Config, early_exit: bool):
  """``(candidates per sweep, most sweeps, newton)`` (``tile.search_schedule``)."""
  return tile.search_schedule(cfg.spec.threshold, threshold_iterations(cfg), early_exit)


def num_k_flags(cfg: Config) -> int:
  """Width of the live-key-block flag rows: the number of key blocks (a power of two for
  Triton, whose block shapes must be)."""
  nk = cfg.s_pad // cfg.blocks.block_k
  return _next_pow2(nk) if cfg.backend == "triton" else nk


def t_max_tile(cfg: Config, s, mask, m, length, dyn):
  """Pass 0: the running max of the visible z = score_map(s)."""
  static, arrays = _hp(cfg, dyn)
  rule = cfg.spec.threshold
  z = rule.score_map(s if mask is None else jnp.where(mask, s, 0.0), length,
                     **{**static, **arrays})
  return tile.running_max(z, mask, m)


def t_start(cfg: Config, m, length, dyn):
  """After pass 0: ``(m, state, target)`` per row (``tile.search_start``; m finite)."""
  static, arrays = _hp(cfg, dyn)
  return tile.search_start(cfg.spec.threshold, m, length, {**static, **arrays})


def t_indicator(cfg: Config) -> bool:
  """Whether the rule's weight jumps at tau (``tile.jumps_at_threshold``, probed with the
  static hyperparameters and the defaults of the others): its tau then moves into the gap
  below it after one more sweep (:func:`t_below_tile`, :func:`t_gap_tau`)."""
  hp = {**cfg.spec.defaults, **dict(cfg.static_hp)}
  return tile.jumps_at_threshold(cfg.spec.threshold,
                                 {name: x for name, x in hp.items() if x is not None})


def t_below_tile(cfg: Config, s, mask, m, tau, below, length, dyn):
  """The extra sweep of indicator rules: the running max of the visible z clearly below
  tau (``tile.max_below``)."""
  static, arrays = _hp(cfg, dyn)
  z = tile.scores(cfg.spec.threshold, s, mask, m, length, {**static, **arrays})
  return tile.max_below(z, mask, tau, below)


def t_gap_tau(tau, below):
  """Midway between tau and the largest score below it (``tile.gap_threshold``)."""
  return tile.gap_threshold(tau, below)


def t_candidates(lo, hi, newton, count: int):
  """The candidate taus of one sweep (``tile.search_candidates``; ``newton`` None:
  multisection)."""
  if newton is None:
    newton = jnp.full_like(lo, -jnp.inf)
  return tile.search_candidates(lo, hi, newton, count)


def t_sums_tile(cfg: Config, s, mask, m, taus, sums, length, dyn, newton: bool):
  """One key block of a search sweep (``tile.search_sums``): returns (z, sums)."""
  static, arrays = _hp(cfg, dyn)
  hp = {**static, **arrays}
  rule = cfg.spec.threshold
  z = tile.scores(rule, s, mask, m, length, hp)
  return z, tile.search_sums(rule, z, mask, taus, sums, hp, newton)


def t_update(cfg: Config, state, taus, sums, target, dyn, newton: bool):
  """The search state after a sweep (``tile.search_update``)."""
  static, arrays = _hp(cfg, dyn)
  return tile.search_update(cfg.spec.threshold, state, taus, sums, target,
                            {**static, **arrays}, newton)


def t_threshold(state, newton: bool):
  """The threshold a search ends with (``tile.search_threshold``)."""
  return tile.search_threshold(state, newton)


def t_all_done(state):
  """1 when every row of the block is done (int32 scalar; ``tile.search_done``)."""
  return jnp.min(tile.search_done(state).astype(jnp.int32))


def t_live(z, mask, lo):
  """1 when some visible z of the tile is >= its row's lo (int32 scalar): a block where
  every visible z < lo <= tau has exactly zero weights (and zero gradient)."""
  hit = z >= lo
  if mask is not None:
    hit = jnp.logical_and(hit, mask)
  return jnp.max(hit.astype(jnp.int32))


def t_flag_update(flags, j, live):
  """``flags`` [1, width] int32 with column j set to ``live`` (no dynamic store)."""
  col = jax.lax.broadcasted_iota(jnp.int32, flags.shape, 1)
  return jnp.where(col == j, live, flags)


def t_weight_m(m):
  """The stabiliser the weights are evaluated at (``tile.weight_stabiliser``)."""
  return tile.weight_stabiliser(m)


def t_weight_tile(cfg: Config, s, mask, tau, m, length, dyn):
  """The weighted pass's tile: ``weight(z, tau, m)``, 0 where masked."""
  static, arrays = _hp(cfg, dyn)
  w, _ = tile.threshold_maps(cfg.spec.threshold, s, mask, tau, m, length, {**static, **arrays})
  return w


def t_coef_tile(cfg: Config, s, mask, tau, m, delta, dp, length, dyn):
  """Per row ``(sum_k d_tau weight_k (dP_k - Delta), sum_k d_tau mass_k)`` of a tile."""
  static, arrays = _hp(cfg, dyn)
  hp = {**static, **arrays}
  rule = cfg.spec.threshold
  _, (dw, dm) = jax.jvp(lambda t: tile.threshold_maps(rule, s, mask, t, m, length, hp),
                        (tau,), (jnp.ones_like(tau),))
  return (jnp.sum(dw * (dp - delta), axis=-1, keepdims=True),
          jnp.sum(dm, axis=-1, keepdims=True))


def t_coef(g_tau, m_tau, d):
  """``coef = g_tau / (W M_tau)`` (0 for an empty row)."""
  return g_tau * _row_inverse(d) * _row_inverse(m_tau)


def _row_inverse(d):
  """``1 / d`` where ``d != 0``, else 0 (``tile.safe_inverse``), comparing ``d`` with
  ``d - d`` rather than a constant 0 (the same test for every d: 0 for a finite d, NaN
  for ±inf and NaN, where both comparisons are True). A row read from a ref varies over
  the mesh axes in the Pallas interpreter inside ``jax.shard_map`` (default
  ``check_vma``), which refuses a comparison with a constant there."""
  nz = d != d - d
  return jnp.where(nz, jnp.reciprocal(jnp.where(nz, d, jnp.ones_like(d))), jnp.zeros_like(d))


def t_backward_tile(cfg: Config, s, mask, tau, m, d, delta, coef, dp, length, dyn):
  """``(w, ds, dhp)``: the tile's normalised weights (for dV), the cotangent of its logits
  (before the soft cap is undone) and of the dynamic hyperparameters (each [bq, 1])."""
  static, arrays = _hp(cfg, dyn)
  rule = cfg.spec.threshold
  inv = tile.safe_inverse(d)
  (w, mass), vjp = jax.vjp(
      lambda x, a: tile.threshold_maps(rule, x, mask, tau, m, length, {**static, **a}),
      s, arrays)
  cot_mass = jnp.broadcast_to(-coef, mass.shape)
  if mask is not None:
    cot_mass = jnp.where(mask, cot_mass, 0.0)
  ds, dhp = vjp(((dp - delta) * inv, cot_mass))
  return w * inv, ds, tuple(dhp[name] for name in cfg.dyn_hp)


def t_target_vjp(cfg: Config, coef, length, dyn):
  """The target's share of the hyperparameter cotangents (``+coef · d target``), or None."""
  static, arrays = _hp(cfg, dyn)
  if not arrays:
    return None
  rule = cfg.spec.threshold

  def target(a):
    return jnp.broadcast_to(jnp.asarray(rule.target(length, **{**static, **a}), coef.dtype),
                            coef.shape)

  _, vjp = jax.vjp(target, arrays)
  (d,) = vjp(coef)
  return tuple(d[name] for name in cfg.dyn_hp)


def live_block_tables(flags):
  """Compacted block lists from live flags ``[..., width]``: ``(idx [..., width], cnt [...])``.

  ``idx`` lists the live blocks in increasing order, padded with the last live one (so a
  clamped index map fetches nothing new); ``cnt`` is their number.
  """
  live = flags != 0
  cnt = jnp.sum(live, axis=-1, dtype=jnp.int32)
  # live blocks first, in order (a stable sort of a 0/1 key over a few dozen blocks)
  order = jnp.argsort(jnp.logical_not(live), axis=-1, stable=True).astype(jnp.int32)
  last = jnp.take_along_axis(order, jnp.maximum(cnt - 1, 0)[..., None], axis=-1)
  pos = jax.lax.broadcasted_iota(jnp.int32, order.shape, order.ndim - 1)
  return jnp.where(pos < cnt[..., None], order, last), cnt
