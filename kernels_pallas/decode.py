r"""Split-K decoding attention ("flash-decoding") with an optional unified max (feature K05).

One query token per sequence attends to its key/value cache. With a single query row the
flash-attention grid (query blocks x batch x heads) has too few programs to fill a GPU or
a TPU, so the key axis is cut into ``num_splits`` chunks processed in parallel
(T. Dao, D. Haziza, F. Massa & G. Sizov 2023, "Flash-Decoding for long-context
inference", PyTorch blog): one program per (batch, KV head, split) computes the partial
statistics of its chunk over the ``G = N / K`` query heads sharing the KV head (GQA: the
cache is never copied per query head),

.. math::
  m_s = \max_{j \in C_s} x_j, \qquad l_s = \sum_{j \in C_s} e^{x_j - m_s}, \qquad
  a_s = \sum_{j \in C_s} e^{x_j - m_s} v_j,

and a small XLA step merges them with the online-softmax merge (M. Milakov &
N. Gimelshein 2018, "Online normalizer calculation for softmax"):
``M = max_s m_s``, ``o = sum_s e^{m_s - M} a_s / (sum_s e^{m_s - M} l_s + e^{sink - M})``.

Unified max (K. Hong et al. 2024, "FlashDecoding++: Faster Large Language Model Inference
on GPUs"): softmax does not depend on the constant subtracted from the row, so with a
fixed ``phi`` chosen offline every split uses ``e^{x_j - phi}`` (no running max, no
rescaling inside the loop) and the partials merge by plain addition. Overflow guard: a
split holding a visible score with ``max_j x_j - phi`` outside ``safe_range = (a, b)``
(``> b``: the exponentials may overflow; ``< a``: they may all underflow) is recomputed
with its own max, which the first pass measured exactly (so the second pass needs no
running max either; the other splits' loop bounds are empty); the result equals softmax
for any phi.
The recomputation is a second kernel call under ``lax.cond``: it costs nothing when no
split is flagged.

Forward only: decoding needs no backward pass (no ``custom_vjp`` is defined).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kernels_pallas.backends import BACKENDS

__all__ = ["decode_attention"]

_NAME = "decode_attention"
NORMALIZERS = ("softmax", "softmax_sink", "sigmoid")
_PARAMS = {"softmax": (), "softmax_sink": ("sink_logit",), "sigmoid": ("bias",)}
_F32 = np.finfo(np.float32)
# Default guard of the unified max: scores within 43.7 below the split's max stay normal
# numbers; 44.4 above phi leaves e^{44} * S * |v| far below the float32 maximum.
DEFAULT_SAFE_RANGE = (math.log(float(_F32.tiny)) / 2, math.log(float(_F32.max)) / 2)


@dataclasses.dataclass(frozen=True)
class _Cfg:
  backend: str
  mode: str            # "online" (running max), "fixed" (a given max per row), "sigmoid"
  scale: float
  cap: float | None
  block_k: int
  num_blocks: int
  num_splits: int
  blocks_per_split: int
  compute_dtype: Any
  interpret: Any


def _err(msg: str) -> ValueError:
  return ValueError(f"{_NAME}: {msg}")


def _next_pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


# ------------------------------------------------------------------------ tile math (both)


def _logits(cfg: _Cfg, q, kt, vt, start, n):
  """Logits ``[gp, bk]`` (float32, scaled, soft-capped) of one key block at key position
  ``start``, the visibility ``[1, bk]`` (position < n) and the value tile with the rows
  past the length zeroed (the cache may hold anything there, NaN included)."""
  bk = kt.shape[0]
  s = jax.lax.dot_general(q.astype(cfg.compute_dtype), kt.astype(cfg.compute_dtype),
                          (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  s = s * cfg.scale
  if cfg.cap is not None:
    s = cfg.cap * jnp.tanh(s / cfg.cap)
  valid = start + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1) < n
  rows = start + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < n
  return s, valid, jnp.where(rows, vt, jnp.zeros_like(vt))


def _pv(p, vt):
  dt = vt.dtype if vt.dtype != jnp.float32 else jnp.float32
  return jax.lax.dot_general(p.astype(dt), vt, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _tile(mode: str, s, valid, vt, state, c):
  """One key block folded into ``state = (m, l, acc)``; ``c [gp, 1]`` is the row's fixed
  max (mode "fixed") or sigmoid bias (mode "sigmoid"). Mode "fixed" carries the true max
  in ``m`` (for the guard) without rescaling by it."""
  m, l, acc = state
  tile_max = jnp.max(jnp.where(valid, s, -jnp.inf), axis=1, keepdims=True)
  if mode == "sigmoid":
    p = jnp.where(valid, 1.0 / (1.0 + jnp.exp(-(s + c))), 0.0)
    return m, l, acc + _pv(p, vt)
  if mode == "fixed":
    p = jnp.where(valid, jnp.exp(s - c), 0.0)
    return (jnp.maximum(m, tile_max), l + jnp.sum(p, axis=1, keepdims=True), acc + _pv(p, vt))
  m_new = jnp.maximum(m, tile_max)
  base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp(m - base)
  p = jnp.where(valid, jnp.exp(s - base), 0.0)
  return m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True), acc * alpha + _pv(p, vt)


def _init(gp: int, hv: int):
  return (jnp.full((gp, 1), -jnp.inf, jnp.float32), jnp.zeros((gp, 1), jnp.float32),
          jnp.zeros((gp, hv), jnp.float32))


# ---------------------------------------------------------------------------------- Triton


def _split_row_spec(gp: int):
  """The Triton split grid's block of one partial row ``[B, K, P, gp, 1]``: (m, l, or c)."""
  return pl.BlockSpec((None, None, None, gp, 1), lambda bi, h, si: (bi, h, si, 0, 0))


def _fold_split(lo_ref, hi_ref, body, init, out_refs) -> None:
  """Fold the split's key blocks ``[lo, hi)`` with ``body(j, state)`` from ``init`` and
  write the final ``(m, l, acc)`` to ``out_refs``."""
  for ref, x in zip(out_refs, jax.lax.fori_loop(lo_ref[...], hi_ref[...], body, init),
                    strict=True):
    ref[...] = x


def _triton_split_call(kernel, cache_specs, args, *, q4, lo, hi, lens, num_splits: int,
                      width: int, interpret: bool, name: str):
  """The Triton grid (batch, KV head, split) of a split-KV decode: the kernel takes
  ``lo, hi`` (the split's key blocks), the row lengths and ``q4 [B, K, gp, Hp]``, then
  ``args`` under ``cache_specs``, and writes each split's ``m, l [.., gp, 1]`` and
  ``acc [.., gp, width]`` (float32)."""
  from jax.experimental.pallas import triton as plgpu

  b, kh, gp, hp = q4.shape
  p = num_splits
  scalar = pl.BlockSpec((None, None), lambda bi, h, si: (bi, si))
  row, row_shape = _split_row_spec(gp), jax.ShapeDtypeStruct((b, kh, p, gp, 1), jnp.float32)
  return pl.pallas_call(
      kernel, grid=(b, kh, p),
      in_specs=[scalar, scalar, pl.BlockSpec((None, None), lambda bi, h, si: (bi, 0)),
                pl.BlockSpec((None, None, gp, hp), lambda bi, h, si: (bi, h, 0, 0)),
                *cache_specs],
      out_specs=[row, row, pl.BlockSpec((None, None, None, gp, width),
                                        lambda bi, h, si: (bi, h, si, 0, 0))],
      out_shape=[row_shape, row_shape,
                 jax.ShapeDtypeStruct((b, kh, p, gp, width), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name=name,
  )(lo, hi, lens[:, None], q4, *args)


def _triton_partials(cfg: _Cfg, q4, k, v, lo, hi, lens, c, pages=None):
  """Grid (batch, KV head, split); the split's key blocks ``[lo, hi)`` are the loop bounds
  of the kernel. q4 ``[B, K, gp, Hp]``, caches ``[B, S_pad, K, Hp]`` (S_pad a multiple of
  the block), ``c [B, K, P, gp, 1]``. Returns ``(m, l, acc)`` of every split. A paged
  cache: ``k``/``v`` are the page pool as ``[1, pages * block, K, Hp]`` and ``pages``
  ``[B, width]`` maps logical key block j of a row to its page (the block the loop loads;
  the positions, hence the lengths' masks, stay logical)."""
  gp, hp = q4.shape[2:]
  s_pad, hv, bk = k.shape[1], v.shape[-1], cfg.block_k
  paged = pages is not None

  def kernel(lo_ref, hi_ref, len_ref, q_ref, k_ref, v_ref, c_ref, *refs):
    pg_ref = refs[0] if paged else None
    q, n, cr = q_ref[...], len_ref[...], c_ref[...]

    def body(j, state):
      sl = pl.ds((j if pg_ref is None else pg_ref[j]) * bk, bk)
      s, valid, vt = _logits(cfg, q, k_ref[sl, :], v_ref[sl, :], j * bk, n)
      return _tile(cfg.mode, s, valid, vt, state, cr)

    _fold_split(lo_ref, hi_ref, body, _init(gp, hv), refs[-3:])

  cache_row = (lambda bi: 0) if paged else (lambda bi: bi)  # the page pool has one "row"
  specs = [pl.BlockSpec((None, s_pad, None, hp), lambda bi, h, si: (cache_row(bi), 0, h, 0)),
           pl.BlockSpec((None, s_pad, None, hv), lambda bi, h, si: (cache_row(bi), 0, h, 0)),
           _split_row_spec(gp)]
  args = [k, v, c]
  if paged:
    specs.append(pl.BlockSpec((None, pages.shape[1]), lambda bi, h, si: (bi, 0)))
    args.append(pages)
  return _triton_split_call(kernel, specs, args, q4=q4, lo=lo, hi=hi, lens=lens,
                           num_splits=cfg.num_splits, width=hv,
                           interpret=bool(cfg.interpret), name=f"jaxsoft_decode_{cfg.mode}")


# ------------------------------------------------------------------------------ Mosaic TPU


def _mosaic_partials(cfg: _Cfg, q4, k, v, lo, hi, lens, c, pages=None):
  """Grid (batch, KV head, split, block of the split), the last axis "arbitrary" with the
  state in VMEM scratch; the bounds are scalar-prefetched and a step outside ``[lo, hi)``
  computes nothing and re-reads the last fetched block (its index is clamped). A cache
  whose head dim is a multiple of 128 is read in place through the free view
  ``[B, S, K * H]``; otherwise it is transposed to ``[B, K, S, H]`` (a copy, with a
  head dim other than 64 padded to a multiple of 128 on the way: allocate such caches
  heads-first on TPU). The last key block may be partial (masked). A paged cache (the
  pool as ``[1, pages * block, K, H]``, ``pages [B, width]`` scalar-prefetched too): the
  index maps fetch logical block j of row b from page ``pages[b, j]``."""

  b, kh, gp, h = q4.shape
  hv, p, bk = v.shape[-1], cfg.num_splits, cfg.block_k
  bps, nk = cfg.blocks_per_split, cfg.num_blocks
  paged = pages is not None

  def block(bi, si, t, lo_ref, hi_ref, pg_ref):
    r = bi * p + si
    a, z = lo_ref[r], hi_ref[r]
    kb = jnp.minimum(jnp.minimum(jnp.maximum(si * bps + t, a), jnp.maximum(z - 1, a)), nk - 1)
    return kb if pg_ref is None else pg_ref[bi * nk + kb]

  def cache_spec(x):
    rows, hd = x.shape[0], x.shape[-1]

    def at(bi, si, t, refs):  # (cache row, key block) of a grid step
      return (0 if paged else bi), block(bi, si, t, refs[0], refs[1], refs[3] if paged else None)

    if hd % 128 == 0:
      view = x.reshape(rows, x.shape[1], kh * hd)
      return view, pl.BlockSpec(
          (None, bk, hd), lambda bi, hh, si, t, *refs: (*at(bi, si, t, refs), hh))

    def heads_first(bi, hh, si, t, *refs):
      row, kb = at(bi, si, t, refs)
      return row, hh, kb, 0

    return jnp.swapaxes(x, 1, 2), pl.BlockSpec((None, None, bk, hd), heads_first)

  k_in, k_spec = cache_spec(k)
  v_in, v_spec = cache_spec(v)

  def kernel(*refs):
    if paged:  # the page table is only read by the index maps
      refs = refs[:3] + refs[4:]
    (lo_ref, hi_ref, len_ref, q_ref, k_ref, v_ref, c_ref, m_ref, l_ref, acc_ref,
     m_sc, l_sc, acc_sc) = refs
    bi, si, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    r, kb = bi * p + si, si * bps + pl.program_id(3)

    @pl.when(t == 0)
    def _start():
      m_sc[...], l_sc[...], acc_sc[...] = _init(gp, hv)

    @pl.when(jnp.logical_and(kb >= lo_ref[r], kb < hi_ref[r]))
    def _compute():
      s, valid, vt = _logits(cfg, q_ref[...], k_ref[...], v_ref[...], kb * bk, len_ref[bi])
      m_sc[...], l_sc[...], acc_sc[...] = _tile(cfg.mode, s, valid, vt,
                                                (m_sc[...], l_sc[...], acc_sc[...]), c_ref[...])

    @pl.when(t == bps - 1)
    def _finish():
      m_ref[...] = m_sc[...]
      l_ref[...] = l_sc[...]
      acc_ref[...] = acc_sc[...]

  scalars = [lo.reshape(-1), hi.reshape(-1), lens] + ([pages.reshape(-1)] if paged else [])
  call = _mosaic_split_call(kernel, cfg, grid=(b, kh, p, bps), gp=gp, h=h, hv=hv,
                            in_specs=[k_spec, v_spec, _row_spec(gp)],
                            num_scalar_prefetch=len(scalars),
                            name=f"jaxsoft_decode_{cfg.mode}")
  return call(*scalars, q4, k_in, v_in, c)


def _row_spec(gp: int):
  """The block of one split's per-row numbers ``[B, K, P, G, 1]`` on the split-K grid."""
  return pl.BlockSpec((None, None, None, gp, 1), lambda bi, hh, si, t, *_: (bi, hh, si, 0, 0))


def _mosaic_split_call(kernel, cfg, *, grid, gp: int, h: int, hv: int, in_specs,
                       num_scalar_prefetch: int, name: str):
  """The Mosaic ``pallas_call`` of a split-K decode kernel on ``grid = (B, K, P, blocks per
  split)``: the query block ``[G, h]`` of (batch, KV head) first, then ``in_specs``; the
  outputs are the partials (m, l ``[B, K, P, G, 1]``, acc ``[B, K, P, G, hv]``) with their
  VMEM scratch; the last grid axis is "arbitrary" (the state lives across it). Shared by
  :func:`_mosaic_partials` and the PolyKV kernel (kernels_pallas/polykv.py)."""
  from jax.experimental.pallas import tpu as pltpu

  b, kh, p, _ = grid
  row = _row_spec(gp)
  row_shape = jax.ShapeDtypeStruct((b, kh, p, gp, 1), jnp.float32)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=num_scalar_prefetch, grid=grid,
          in_specs=[pl.BlockSpec((None, None, gp, h), lambda bi, hh, si, t, *_: (bi, hh, 0, 0)),
                    *in_specs],
          out_specs=[row, row, pl.BlockSpec((None, None, None, gp, hv),
                                            lambda bi, hh, si, t, *_: (bi, hh, si, 0, 0))],
          scratch_shapes=[pltpu.VMEM((gp, 1), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                          pltpu.VMEM((gp, hv), jnp.float32)]),
      out_shape=[row_shape, row_shape, jax.ShapeDtypeStruct((b, kh, p, gp, hv), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=cfg.interpret if cfg.interpret is not None else False,
      name=name,
  )


def _partials(cfg: _Cfg, q4, k, v, lo, hi, lens, c, pages=None):
  fn = _triton_partials if cfg.backend == "triton" else _mosaic_partials
  return fn(cfg, q4, k, v, lo, hi, lens, c, pages)


# -------------------------------------------------------------------------- merge (XLA)


def _merge(m, l, acc, sink):
  """Online-softmax merge of the split partials ``[B, K, P, G, .]`` over P; ``sink``
  (``[B, K, G, 1]`` or None) is one more entry ``e^{sink}`` of the denominator."""
  top = jnp.max(m, axis=2)
  if sink is not None:
    top = jnp.maximum(top, sink)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.exp(m - top[:, :, None])  # an empty split (m = -inf) weighs 0
  den = jnp.sum(w * l, axis=2)
  if sink is not None:
    den = den + jnp.exp(sink - top)
  num = jnp.sum(w * acc, axis=2)
  return num / jnp.where(den > 0, den, 1.0)


# ------------------------------------------------------------------------------- checks


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _per_head(x, b: int, n: int, arg: str):
  """A per-row constant: a scalar, ``[N]`` (per query head) or ``[B, N]``; float32."""
  if _is_concrete(x) and not np.all(np.isfinite(np.asarray(x, np.float32))):
    raise _err(f"`{arg}` must be finite")
  x = jnp.asarray(x, jnp.float32)
  if x.ndim > 2 or (x.ndim >= 1 and x.shape[-1] != n) or (x.ndim == 2 and x.shape[0] != b):
    raise _err(f"`{arg}` must be a scalar, [N] = [{n}] or [B, N] = [{b}, {n}], "
               f"got shape {x.shape}")
  return jnp.broadcast_to(x, (b, n))


def _check_int(x, arg: str, low: int = 1) -> int:
  if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < low:
    raise _err(f"`{arg}` must be an int >= {low}, got {x!r}")
  return int(x)


def _check_block(backend: str, block_k, s_len: int, hp: int) -> int:
  if backend == "triton":
    if block_k is None:
      block_k = 128 if hp <= 128 else 64
    bk = _check_int(block_k, "block_k")
    if bk < 16 or bk & (bk - 1):
      raise _err(f"`block_k` must be a power of two >= 16 for Triton, got {block_k!r}")
    return min(bk, max(16, _next_pow2(s_len)))
  bk = _check_int(512 if block_k is None else block_k, "block_k")
  if bk % 128:
    raise _err(f"`block_k` must be a multiple of 128 for Mosaic TPU, got {block_k!r}")
  return s_len if s_len <= bk else bk  # one whole-length block, or 128-lane blocks


def _mosaic_dim(d: int) -> int:
  return d if d == 64 or d % 128 == 0 else _cdiv(d, 128) * 128


def _check_range(safe_range, s_len: int) -> tuple[float, float]:
  if safe_range is None:
    return DEFAULT_SAFE_RANGE
  try:
    a, b = (float(x) for x in safe_range)
  except (TypeError, ValueError):
    raise _err(f"`safe_range` must be a pair of numbers (a, b), got {safe_range!r}") from None
  b_max = math.log(float(_F32.max)) - math.log(max(s_len, 1))
  if not (a < b <= b_max):
    raise _err(f"`safe_range` (a, b) needs a < b <= log(max float32) - log(S_max) = "
               f"{b_max:.3f}, got {safe_range!r}")
  return a, b


# ----------------------------------------------------------------------------------- API


def decode_attention(q, k_cache, v_cache, lengths, *, normalizer: str = "softmax",
                     normalizer_params: Mapping[str, Any] | None = None, scale=None,
                     num_splits: int | None = None, unified_max=None,
                     safe_range: tuple[float, float] | None = None,
                     logits_soft_cap: float | None = None, backend: str = "triton",
                     interpret: Any = False, block_k: int | None = None,
                     page_table=None) -> jax.Array:
  r"""Attention of one new token per sequence to its KV cache, split-K (K05).

  For batch row b and query head n (KV head ``n // G``, ``G = N / K``):

  .. math::
    x_j = c \tanh\Big(\frac{s\, q_{bn} \cdot k_{bj}}{c}\Big), \quad j < \mathrm{len}_b;
    \qquad o_{bn} = \sum_{j < \mathrm{len}_b} f(x)_j\, v_{bj}

  with f softmax, softmax_sink (``e^{x_j} / (e^{sink} + \sum e^{x})``) or sigmoid
  (``\sigma(x_j + bias)``, ``bias = -log len_b`` by default; class P: no max, no sum,
  the partial outputs merge by addition). See the module docstring for the split-K merge
  (T. Dao et al. 2023, "Flash-Decoding for long-context inference") and the unified max
  with its overflow guard (K. Hong et al. 2024, "FlashDecoding++: Faster Large Language
  Model Inference on GPUs"). Forward only (decoding needs no gradient).

  Args:
    q: ``[B, N, H]``, the new token's queries.
    k_cache: ``[B, S_max, K, H]``; ``N % K == 0`` (GQA/MQA; the cache is never copied per
      query head).
    v_cache: ``[B, S_max, K, Hv]``.
    lengths: ``[B]`` int, the number of valid cached keys (keys at positions
      ``>= lengths[b]`` are invisible, whatever they hold). A row of length 0 returns
      zeros. Concrete values must lie in ``[0, S_max]``; traced ones are clipped to it.
    normalizer: "softmax", "softmax_sink" or "sigmoid".
    normalizer_params: ``{"sink_logit": s}`` (softmax_sink, default 0) or ``{"bias": b}``
      (sigmoid, default ``-log len``); a scalar, ``[N]`` or ``[B, N]``.
    scale: the logit scale (a number; default ``1 / sqrt(H)``).
    num_splits: the number of key chunks processed in parallel (default: enough programs
      for about 128 per call, at most the number of key blocks; larger values are
      clipped to it). Need not divide the number of key blocks.
    unified_max: ``phi`` (softmax and softmax_sink): a scalar, ``[N]`` or ``[B, N]`` fixed
      max shared by all splits; None for the per-split running max.
    safe_range: ``(a, b)`` of the guard (a split whose max ``m`` has ``m - phi`` outside
      it is recomputed with ``m``); default ``(log(tiny) / 2, log(max) / 2)`` of float32,
      about ``(-43.7, 44.4)``; ``b <= log(max) - log(S_max)``.
    logits_soft_cap: ``c`` > 0, or None for no tanh cap.
    backend: "triton" (GPU) or "mosaic_tpu".
    interpret: run in the Pallas interpreter (CPU); a ``pltpu.InterpretParams`` selects
      TPU interpret mode for the Mosaic driver.
    block_k: keys per block (Triton: a power of two >= 16, default 128, 64 for H > 128;
      Mosaic: a multiple of 128, default 512). Triton pads a cache whose ``S_max`` is not
      a multiple of it, or whose head dim is not a power of two >= 16 (a copy: allocate
      the cache at such sizes to avoid it). With a ``page_table``: the page size (None
      or equal to it).
    page_table: None (a contiguous cache, as above), or a paged cache (vLLM's
      PagedAttention layout, W. Kwon et al. 2023, "Efficient Memory Management for Large
      Language Model Serving with PagedAttention"): ``k_cache`` / ``v_cache`` are page
      pools ``[num_pages, page_size, K, H]`` / ``[num_pages, page_size, K, Hv]`` shared by
      the batch, and ``page_table`` ``[B, max_pages]`` int maps the row's logical key block
      j (positions ``j * page_size ...``) to its page; ``S_max = max_pages * page_size``.
      Each key block of the kernel is one page (the page size obeys ``block_k``'s rules),
      read from the pool in place (Triton: head dims that are not a power of two >= 16
      are padded, a copy of the pool). Entries past a row's length are never read (they
      may hold anything; out-of-range ones are clipped); concrete entries that are read
      must lie in ``[0, num_pages)``.

  Returns:
    ``[B, N, Hv]`` in q's dtype (computed in float32).

  Examples:
    Two heads sharing one KV head, a cache of 32 keys of which 21 are valid, in interpret
    mode on CPU, against the dense path with one query per row:

    >>> import functools
    >>> from jaxsoft.attention import dot_product_attention
    >>> from kernels_pallas import decode_attention
    >>> kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    >>> q = jax.random.normal(kq, (1, 2, 16))              # [B, N, H]: the new token
    >>> k = jax.random.normal(kk, (1, 32, 1, 16))          # [B, S_max, K, H]
    >>> v = jax.random.normal(kv, (1, 32, 1, 16))
    >>> lengths = jnp.array([21])
    >>> decode = jax.jit(functools.partial(decode_attention, block_k=16, interpret=True))
    >>> o = decode(q, k, v, lengths)
    >>> dense = jax.jit(lambda q, k, v, n: dot_product_attention(
    ...     q[:, None], k, v, key_value_seq_lengths=n, implementation="xla")[:, 0])
    >>> o.shape, bool(jnp.allclose(o, dense(q, k, v, lengths), atol=1e-5))
    ((1, 2, 16), True)

  References:
    T. Dao, D. Haziza, F. Massa & G. Sizov, 2023, "Flash-Decoding for long-context
    inference" (PyTorch blog; the split-K partials and their merge).

    K. Hong, G. Dai, J. Xu, Q. Mao, X. Li, J. Liu, K. Chen, Y. Dong & Y. Wang, 2024,
    "FlashDecoding++: Faster Large Language Model Inference on GPUs" (the unified max).

    W. Kwon, Z. Li, S. Zhuang, Y. Sheng, L. Zheng, C. H. Yu, J. E. Gonzalez, H. Zhang &
    I. Stoica, 2023, "Efficient Memory Management for Large Language Model Serving with
    PagedAttention" (the paged cache).
  """
  q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)
  if backend not in BACKENDS:
    raise _err(f"`backend` must be one of {BACKENDS}, got {backend!r}")
  pages = None
  if page_table is None:
    b, n, h, s_len, kh, lens = _check_arrays(q, k_cache, v_cache, lengths)
  else:
    b, n, h, s_len, kh, lens, pages = _check_paged(q, k_cache, v_cache, lengths, page_table)
    block_k = _check_page(backend, k_cache.shape[1], block_k, s_len)
  params = _check_params(normalizer, normalizer_params)
  scale, cap = _check_numbers(scale, logits_soft_cap, h)
  if unified_max is not None and normalizer == "sigmoid":
    raise _err("`unified_max` applies to softmax and softmax_sink (sigmoid has no max)")
  if safe_range is not None and unified_max is None:
    raise _err("`safe_range` is the guard of `unified_max`; pass both or neither")
  guard = _check_range(safe_range, s_len) if unified_max is not None else None

  g, hv = n // kh, v_cache.shape[-1]
  mode = "sigmoid" if normalizer == "sigmoid" else ("fixed" if unified_max is not None
                                                    else "online")
  cfg, (gp, hp, hvp) = _tiling(backend, mode, q, s_len, k_cache, v_cache, block_k, num_splits,
                               scale, cap, interpret)
  if pages is not None:  # the pool as one cache row of num_pages * page_size keys
    k_cache, v_cache = (x.reshape(1, -1, *x.shape[2:]) for x in (k_cache, v_cache))
  k, v = _pad_caches(cfg, k_cache, v_cache, hp, hvp, whole=pages is not None)
  q4 = jnp.pad(q.reshape(b, kh, g, h), ((0, 0), (0, 0), (0, gp - g), (0, hp - h)))
  p, bps = cfg.num_splits, cfg.blocks_per_split

  def rows(x):  # [B, N] -> [B, K, P, gp, 1]
    x = jnp.pad(x.reshape(b, kh, g), ((0, 0), (0, 0), (0, gp - g)))
    return jnp.broadcast_to(x[:, :, None, :, None], (b, kh, p, gp, 1))

  starts = jnp.arange(p, dtype=jnp.int32) * bps
  lo = jnp.broadcast_to(starts, (b, p))
  hi = jnp.maximum(jnp.minimum((starts + bps)[None, :], (lens[:, None] + cfg.block_k - 1) // cfg.block_k),
                   lo)

  if mode == "sigmoid":
    bias = params.get("bias")
    if bias is None:
      bias = jnp.broadcast_to(-jnp.log(jnp.maximum(lens, 1).astype(jnp.float32))[:, None],
                              (b, n))
    _, _, acc = _partials(cfg, q4, k, v, lo, hi, lens, rows(_per_head(bias, b, n, "bias")),
                          pages)
    out = jnp.sum(acc, axis=2)
  else:
    sink = None
    if normalizer == "softmax_sink":
      s_arr = _per_head(params.get("sink_logit", 0.0), b, n, "sink_logit")
      sink = s_arr.reshape(b, kh, g)[..., None]
    if mode == "online":
      m, l, acc = _partials(cfg, q4, k, v, lo, hi, lens, rows(jnp.zeros((b, n), jnp.float32)),
                            pages)
    else:
      m, l, acc = _unified(cfg, q4, k, v, lo, hi, lens,
                           rows(_per_head(unified_max, b, n, "unified_max")), g, guard, pages)
    out = _merge(m[:, :, :, :g], l[:, :, :, :g], acc[:, :, :, :g], sink)
    out = jnp.where((lens > 0)[:, None, None, None], out, 0.0)
  return out[:, :, :g, :hv].reshape(b, n, hv).astype(q.dtype)


def _check_ranks(q, k_cache, v_cache):
  """q rank 3, the caches (or pools) rank 4, all floating point, and GQA's N % K == 0."""
  for arg, x, rank in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
    if x.ndim != rank:
      raise _err(f"`{arg}` must have rank {rank}, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise _err(f"`{arg}` must be floating point, got {x.dtype}")
  n, kh = q.shape[1], k_cache.shape[2]
  if kh < 1 or n % kh:
    raise _err(f"the number of query heads N = {n} must be a multiple of the cache's "
               f"K = {kh} (`k_cache` {k_cache.shape})")


def _check_arrays(q, k_cache, v_cache, lengths):
  """Shapes and dtypes; returns ``(B, N, H, S_max, K, lengths clipped to [0, S_max])``."""
  _check_ranks(q, k_cache, v_cache)
  b, n, h = q.shape
  _, s_len, kh, _ = k_cache.shape
  if k_cache.shape[0] != b or k_cache.shape[3] != h:
    raise _err(f"`k_cache` must be [B, S_max, K, H] = [{b}, S_max, K, {h}], "
               f"got {k_cache.shape}")
  if v_cache.shape[:3] != k_cache.shape[:3]:
    raise _err(f"`v_cache` must be [B, S_max, K, Hv] = [{b}, {s_len}, {kh}, Hv], "
               f"got {v_cache.shape}")
  if s_len < 1:
    raise _err(f"`k_cache` must hold at least one key, got {k_cache.shape}")
  return b, n, h, s_len, kh, _check_lengths(lengths, b, s_len)


def _check_paged(q, k_pool, v_pool, lengths, page_table):
  """A paged cache's shapes and table; returns ``(B, N, H, S_max, K, lengths clipped to
  [0, S_max], the page table int32 clipped to the pool)``."""
  _check_ranks(q, k_pool, v_pool)
  b, n, h = q.shape
  num_pages, page, kh, _ = k_pool.shape
  if k_pool.shape[3] != h or num_pages < 1 or page < 1:
    raise _err(f"a paged `k_cache` must be [num_pages, page_size, K, H] with H = {h}, got "
               f"{k_pool.shape}")
  if v_pool.shape[:3] != k_pool.shape[:3]:
    raise _err(f"a paged `v_cache` must be [num_pages, page_size, K, Hv] = [{num_pages}, "
               f"{page}, {kh}, Hv], got {v_pool.shape}")
  table = jnp.asarray(page_table)
  if table.ndim != 2 or table.shape[0] != b or table.shape[1] < 1 or not jnp.issubdtype(
      table.dtype, jnp.integer):
    raise _err(f"`page_table` must be an int array [B, max_pages] with B = {b}, got "
               f"{table.dtype}{list(table.shape)}")
  s_len = table.shape[1] * page
  lens = _check_lengths(lengths, b, s_len)
  if _is_concrete(page_table) and _is_concrete(lengths):
    used = np.arange(table.shape[1])[None, :] * page < np.asarray(lens)[:, None]
    host = np.asarray(table)
    if np.any(used & ((host < 0) | (host >= num_pages))):
      raise _err(f"`page_table` entries of the pages a row reads must lie in [0, "
                 f"num_pages = {num_pages}), got {host[used]}")
  return b, n, h, s_len, kh, lens, jnp.clip(table.astype(jnp.int32), 0, num_pages - 1)


def _check_page(backend: str, page: int, block_k, s_len: int) -> int:
  """The key block of a paged cache: its page size, which must be a legal block."""
  if block_k is not None and block_k != page:
    raise _err(f"`block_k` must be None or the page size {page} with a `page_table`, got "
               f"{block_k!r}")
  try:
    legal = _check_block(backend, page, s_len, 0) == page
  except ValueError:
    legal = False
  if not legal:
    raise _err(f"the page size {page} is not a legal key block for {backend} (Triton: a "
               f"power of two >= 16; Mosaic: a multiple of 128)")
  return page


def _check_lengths(lengths, b: int, s_len: int):
  """``lengths`` [B] int in [0, S_max] (concrete values checked, traced ones clipped)."""
  if _is_concrete(lengths):
    host = np.asarray(lengths)
    if host.shape == (b,) and np.issubdtype(host.dtype, np.integer) and (
        np.any(host < 0) or np.any(host > s_len)):
      raise _err(f"`lengths` must lie in [0, S_max = {s_len}], got {host}")
  lengths = jnp.asarray(lengths)
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise _err(f"`lengths` must be an int array of shape [B] = [{b}], got "
               f"{lengths.dtype}{list(lengths.shape)}")
  return jnp.clip(lengths.astype(jnp.int32), 0, s_len)


def _check_params(normalizer, normalizer_params) -> dict[str, Any]:
  if normalizer not in NORMALIZERS:
    raise _err(f"`normalizer` must be one of {NORMALIZERS}, got {normalizer!r}")
  params = dict(normalizer_params or {})
  extra = set(params) - set(_PARAMS[normalizer])
  if extra:
    raise _err(f"`normalizer_params` has keys {sorted(extra)} that {normalizer!r} does not "
               f"take (it takes {list(_PARAMS[normalizer])})")
  return params


def _check_numbers(scale, cap, h: int) -> tuple[float, float | None]:
  """The logit scale (default ``1 / sqrt(H)``) and soft cap as Python floats."""
  if scale is None:
    scale = 1.0 / math.sqrt(h)
  try:
    scale = float(scale)
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise _err(f"`scale` must be a concrete number, got {scale!r}") from None
  if not math.isfinite(scale):
    raise _err(f"`scale` must be finite, got {scale!r}")
  if cap is None:
    return scale, None
  try:
    ok = float(cap) > 0 and math.isfinite(float(cap))
  except (TypeError, jax.errors.ConcretizationTypeError):
    ok = False
  if not ok:
    raise _err(f"`logits_soft_cap` must be a positive number or None, got {cap!r}")
  return scale, float(cap)


def _tiling(backend, mode, q, s_len: int, k_cache, v_cache, block_k, num_splits, scale, cap,
            interpret):
  """The kernel config and the padded (query rows per tile, head dim, value head dim);
  ``s_len`` is S_max (a paged cache's max_pages * page_size)."""
  b, n, h = q.shape
  kh, hv = k_cache.shape[2], v_cache.shape[-1]
  g = n // kh
  if backend == "triton":
    gp, hp, hvp = _next_pow2(max(g, 16)), _next_pow2(max(h, 16)), _next_pow2(max(hv, 16))
  else:  # head dims 64 or multiples of 128 as they are, others padded to 128 lanes
    two_byte = min(jnp.dtype(q.dtype).itemsize, jnp.dtype(k_cache.dtype).itemsize) <= 2
    sub = 16 if two_byte else 8
    gp, hp, hvp = _cdiv(g, sub) * sub, _mosaic_dim(h), _mosaic_dim(hv)
  bk = _check_block(backend, block_k, s_len, hp)
  nk = _cdiv(s_len, bk)
  if num_splits is None:
    num_splits = max(1, _cdiv(128, b * kh))
  p = min(_check_int(num_splits, "num_splits"), nk)
  bps = _cdiv(nk, p)
  cfg = _Cfg(backend=backend, mode=mode, scale=scale, cap=cap, block_k=bk, num_blocks=nk,
             num_splits=_cdiv(nk, bps), blocks_per_split=bps,  # no split without a block
             compute_dtype=jnp.result_type(q.dtype, k_cache.dtype), interpret=interpret)
  return cfg, (gp, hp, hvp)


def _pad_caches(cfg: _Cfg, k, v, hp: int, hvp: int, whole: bool = False):
  """Triton: whole blocks along S and power-of-two head dims; Mosaic: head dims padded
  (folded into the heads-first copy of :func:`_mosaic_partials`). ``whole``: S is already
  whole blocks (a page pool)."""
  s_len, s_pad = k.shape[1], cfg.num_blocks * cfg.block_k
  ds = s_pad - s_len if cfg.backend == "triton" and not whole else 0
  if ds or hp != k.shape[-1]:
    k = jnp.pad(k, ((0, 0), (0, ds), (0, 0), (0, hp - k.shape[-1])))
  if ds or hvp != v.shape[-1]:
    v = jnp.pad(v, ((0, 0), (0, ds), (0, 0), (0, hvp - v.shape[-1])))
  return k, v


def _unified(cfg: _Cfg, q4, k, v, lo, hi, lens, phi, g: int, guard, pages=None):
  """The unified-max pass, then (only when a split is flagged) the flagged splits again
  with their own max; returns partials ``(m, l, acc)`` for :func:`_merge` (``m = phi`` for
  the unflagged splits, whose partials then merge by plain addition)."""
  a, b = guard
  top, l1, acc1 = _partials(cfg, q4, k, v, lo, hi, lens, phi, pages)
  gap = top - phi
  real = jnp.arange(phi.shape[3])[None, None, None, :, None] < g  # not a padding row
  nonempty = (hi > lo)[:, None, :, None, None]
  bad = real & nonempty & ((gap > b) | (gap < a) | ~jnp.isfinite(gap))
  split_bad = jnp.any(bad, axis=(1, 3, 4))  # [B, P]: the recomputed programs
  hi2 = jnp.where(split_bad, hi, lo)

  def recompute():
    own = jnp.where(jnp.isfinite(top), top, 0.0)
    return _partials(cfg, q4, k, v, lo, hi2, lens, own, pages)

  def skip():
    return top, jnp.zeros_like(l1), jnp.zeros_like(acc1)

  _, l2, acc2 = jax.lax.cond(jnp.any(split_bad), recompute, skip)
  redo = split_bad[:, None, :, None, None]
  m = jnp.where(redo, top, phi)
  return m, jnp.where(redo, l2, l1), jnp.where(redo, acc2, acc1)
