"""``kernels_pallas.attention``: the public entry point of the Pallas attention engine."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxsoft.normalizers import _spec
from kernels_pallas import engine as E

__all__ = ["attention", "BlockSizes"]

BlockSizes = E.BlockSizes
BACKENDS = ("triton", "mosaic_tpu")


def _window(local_window_size):
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)):
    w = (int(local_window_size), int(local_window_size))
  else:
    try:
      w = tuple(int(x) for x in local_window_size)
    except TypeError:
      raise ValueError(
          f"`local_window_size` must be an int or a (left, right) pair, got "
          f"{local_window_size!r}") from None
    if len(w) != 2:
      raise ValueError(f"`local_window_size` must be a (left, right) pair, got {w}")
  if min(w) < 0:
    raise ValueError(f"`local_window_size` must be non-negative, got {w}")
  return w


def _segments(segment_ids, b, t, s, query_seq_lengths, key_value_seq_lengths):
  """(q_seg [B, T], k_seg [B, S]) int32 with padding folded in, or (None, None)."""
  if segment_ids is None and query_seq_lengths is None and key_value_seq_lengths is None:
    return None, None
  if segment_ids is None:
    q_seg = jnp.zeros((b, t), jnp.int32)
    k_seg = jnp.zeros((b, s), jnp.int32)
  else:
    if isinstance(segment_ids, (tuple, list)):
      if len(segment_ids) != 2:
        raise ValueError("`segment_ids` must be an array [B, T] or a pair ([B, T], [B, S])")
      q_seg, k_seg = (jnp.asarray(x) for x in segment_ids)
    else:
      q_seg = k_seg = jnp.asarray(segment_ids)
    if q_seg.shape != (b, t) or k_seg.shape != (b, s):
      raise ValueError(
          f"`segment_ids` must have shapes [B, T] = {(b, t)} and [B, S] = {(b, s)}, got "
          f"{q_seg.shape} and {k_seg.shape}")
    if not (jnp.issubdtype(q_seg.dtype, jnp.integer) and jnp.issubdtype(k_seg.dtype,
                                                                         jnp.integer)):
      raise ValueError("`segment_ids` must be integer arrays")
    q_seg, k_seg = q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)
  if query_seq_lengths is not None:
    ql = jnp.asarray(query_seq_lengths).reshape(-1)
    if ql.shape != (b,):
      raise ValueError(f"`query_seq_lengths` must have shape [B] = {(b,)}, got {ql.shape}")
    q_seg = jnp.where(jnp.arange(t)[None, :] < ql[:, None], q_seg, E.Q_PAD_SEGMENT)
  if key_value_seq_lengths is not None:
    kl = jnp.asarray(key_value_seq_lengths).reshape(-1)
    if kl.shape != (b,):
      raise ValueError(
          f"`key_value_seq_lengths` must have shape [B] = {(b,)}, got {kl.shape}")
    k_seg = jnp.where(jnp.arange(s)[None, :] < kl[:, None], k_seg, E.K_PAD_SEGMENT)
  return q_seg, k_seg


def _per_head(sinks):
  """A 1-D ``sinks`` is one logit per head ([N] -> [N, 1, 1])."""
  sinks = jnp.asarray(sinks)
  return sinks.reshape(-1, 1, 1) if sinks.ndim == 1 else sinks


def _check_blocks(bl: E.BlockSizes, backend: str, has_segments: bool):
  for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
    x = getattr(bl, name)
    if not isinstance(x, (int, np.integer)) or x <= 0:
      raise ValueError(f"`block_sizes.{name}` must be a positive int, got {x!r}")
    if backend == "triton" and (x < 16 or x & (x - 1)):
      raise ValueError(f"`block_sizes.{name}` must be a power of two >= 16 for Triton, got {x}")
    if backend == "mosaic_tpu":
      lanes = name.startswith("block_k") and has_segments
      if x % (128 if lanes else 8):
        raise ValueError(
            f"`block_sizes.{name}` must be a multiple of {128 if lanes else 8} for Mosaic TPU, "
            f"got {x}")


def attention(q, k, v, *, normalizer="softmax", normalizer_params: Mapping[str, Any] | None = None,
              scale=None, is_causal: bool = False, local_window_size=None, segment_ids=None,
              logits_soft_cap=None, sinks=None, backend: str = "triton", interpret=False,
              block_sizes: E.BlockSizes | Mapping[str, int] | None = None,
              query_seq_lengths=None, key_value_seq_lengths=None, debug: bool = False):
  r"""Blockwise ("flash") attention for any normalizer of kernel class E, S or P.

  .. math::
    O_i = \sum_{j \in V_i} f(s_{ij})\, v_j,\qquad s_{ij} = \mathrm{cap}\cdot\tanh\!\Big(
    \frac{\mathrm{scale}\; q_i \cdot k_j}{\mathrm{cap}}\Big)

  with ``f`` the normalizer applied over the row's visible keys ``V_i`` (causal, window,
  segments, sequence lengths), exactly as ``normalizer(logits, where=mask) @ v`` but without
  any T x S buffer. The kernel body is generated from the normalizer's tile rule
  (``kernels_pallas.engine``); forward and backward are Pallas kernels (FlashAttention-2
  backward: a dK/dV pass and a dQ pass from per-row statistics).

  Args:
    q: queries ``[B, T, N, H]``.
    k, v: keys and values ``[B, S, K, H]``, ``N % K == 0`` (GQA/MQA; K/V are not copied).
    normalizer: a registered name or a NormalizerSpec of class E, S or P.
    normalizer_params: hyperparameters of the normalizer: Python scalars (compiled in) or
      arrays broadcast to the rows of the scores ``[B, N, T, 1]`` (e.g. per head
      ``[N, 1, 1]``), which are differentiable.
    scale: logit scale, default ``1/sqrt(H)``.
    is_causal: query i sees keys j <= i.
    local_window_size: ``w`` or ``(left, right)``: query i sees keys in [i - left, i + right].
    segment_ids: ``[B, T]`` (self-attention) or a pair (``[B, T]``, ``[B, S]``); only equal
      ids attend.
    logits_soft_cap: ``cap`` of the tanh soft cap (Gemma 2), or None.
    sinks: learned sink logits (class E only): ``[N]`` per head, or any shape broadcast to
      the rows like ``normalizer_params`` (``[N, 1, 1]`` = ``[N]``): add ``e^{sink}`` to the
      denominator (softmax over ``[s, sink]`` without the sink's column); differentiable.
    backend: ``"triton"`` (GPU) or ``"mosaic_tpu"``.
    interpret: run in the Pallas interpreter (CPU); a ``pltpu.InterpretParams`` selects TPU
      interpret mode for the Mosaic driver.
    block_sizes: a :class:`BlockSizes` (or a dict of its fields); default per backend
      (``engine.default_block_sizes``).
    query_seq_lengths, key_value_seq_lengths: ``[B]`` valid lengths (padding masks).

  Returns:
    ``[B, T, N, H]`` in q's dtype. A query row with no visible key gives zeros.

  Raises:
    NotImplementedError (``engine.UnsupportedError``): a normalizer of class T/R/X, a plain
      callable, or a stochastic normalizer; the dispatcher falls back to XLA.
    ValueError: bad shapes or arguments (the message names the argument).
  """
  if backend not in BACKENDS:
    raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
  spec = _spec.resolve(normalizer)
  if not isinstance(spec, _spec.NormalizerSpec):
    raise E.UnsupportedError("the Pallas engine needs a registered NormalizerSpec, not a callable")
  if spec.kernel_class not in ("E", "S", "P") or spec.tile is None:
    raise E.UnsupportedError(
        f"normalizer {spec.name!r} is of kernel class {spec.kernel_class}; the Pallas engine "
        "runs classes E, S and P")
  if spec.needs_key:
    raise E.UnsupportedError(f"normalizer {spec.name!r} is stochastic")
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"`q`, `k`, `v` must be [B, T, N, H], [B, S, K, H], [B, S, K, H]; got shapes {q.shape}, "
        f"{k.shape}, {v.shape}")
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  if k.shape != v.shape:
    if k.shape[:3] == v.shape[:3]:
      raise E.UnsupportedError("a value head dim different from the key head dim")
    raise ValueError(f"`k` {k.shape} and `v` {v.shape} must have the same shape")
  if k.shape[0] != b or k.shape[3] != h:
    raise ValueError(f"`k` {k.shape} does not match `q` {q.shape} in batch or head dim")
  if n % kh:
    raise ValueError(f"the number of query heads N={n} must be a multiple of K={kh} (`k`)")
  if not (jnp.issubdtype(q.dtype, jnp.floating) and q.dtype == k.dtype == v.dtype):
    raise ValueError(f"`q`, `k`, `v` must share a floating dtype, got {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  params = dict(normalizer_params or {})
  spec.validate(params)
  static_hp, dyn_names, dyn_vals = [], [], []
  for name_, val in sorted(params.items()):
    if E.is_static_scalar(val):
      if val is not None:
        static_hp.append((name_, val))
    else:
      dyn_names.append(name_)
      dyn_vals.append(val)
  if sinks is not None and spec.kernel_class != "E":
    raise ValueError(f"`sinks` needs a class-E normalizer, got {spec.name!r} "
                     f"(class {spec.kernel_class})")
  if scale is None:
    scale = 1.0 / math.sqrt(h)
  try:
    scale = float(scale)
  except TypeError:
    raise E.UnsupportedError("a traced `scale`") from None
  if logits_soft_cap is not None:
    logits_soft_cap = float(logits_soft_cap)
    if logits_soft_cap <= 0:
      raise ValueError(f"`logits_soft_cap` must be > 0, got {logits_soft_cap}")
  window = _window(local_window_size)
  q_seg, k_seg = _segments(segment_ids, b, t, s, query_seq_lengths, key_value_seq_lengths)
  has_segments = q_seg is not None

  if block_sizes is None:
    bl = E.default_block_sizes(backend, t, s, h)
  elif isinstance(block_sizes, E.BlockSizes):
    bl = block_sizes.resolved()
  else:
    bl = E.BlockSizes(**dict(block_sizes)).resolved()
  _check_blocks(bl, backend, has_segments)
  t_pad = -(-t // math.lcm(bl.block_q, bl.block_q_dkv, bl.block_q_dq)) * math.lcm(
      bl.block_q, bl.block_q_dkv, bl.block_q_dq)
  s_pad = -(-s // math.lcm(bl.block_k, bl.block_k_dkv, bl.block_k_dq)) * math.lcm(
      bl.block_k, bl.block_k_dkv, bl.block_k_dq)
  if backend == "triton":
    h_pad = max(16, 1 << (h - 1).bit_length())
  else:
    h_pad = h if (h % 128 == 0 or h == 64) else -(-h // 128) * 128

  cfg = E.Config(
      spec=spec, static_hp=tuple(static_hp), dyn_hp=tuple(dyn_names),
      has_sink=sinks is not None, scale=scale, soft_cap=logits_soft_cap, causal=bool(is_causal),
      window=window, has_segments=has_segments, t=t, s=s, t_pad=t_pad, s_pad=s_pad,
      head_dim=h, head_dim_pad=h_pad, num_heads=n, num_kv_heads=kh, blocks=bl,
      backend=backend, interpret=interpret, debug=debug,
      acc="float64" if q.dtype == jnp.float64 else "float32")

  # Per-row parameters [B, N, T_pad, 1]; autodiff of the broadcast sums their cotangents back.
  def rows(x, name_):
    r = E.row_broadcast(x, b, n, t, name_, cfg.acc_dtype)
    return jnp.pad(r, ((0, 0), (0, 0), (0, t_pad - t)), mode="edge")[..., None]

  dyn = tuple(rows(x, nm) for x, nm in zip(dyn_vals, dyn_names, strict=True))
  sink = rows(_per_head(sinks), "sinks") if sinks is not None else None

  length = E.visible_counts(t, s, cfg.causal, window, q_seg, k_seg)
  length = jnp.broadcast_to(length, (b, t))
  length = jnp.pad(length, ((0, 0), (0, t_pad - t)))[..., None].astype(cfg.acc_dtype)
  q_seg_p = k_seg_p = None
  if has_segments:
    q_seg_p = jnp.pad(q_seg, ((0, 0), (0, t_pad - t)), constant_values=E.Q_PAD_SEGMENT)
    k_seg_p = jnp.pad(k_seg, ((0, 0), (0, s_pad - s)), constant_values=E.K_PAD_SEGMENT)
  vis_f = E.block_table(cfg, bl.block_q, bl.block_k, q_seg_p, k_seg_p)
  vis_q = E.block_table(cfg, bl.block_q_dq, bl.block_k_dq, q_seg_p, k_seg_p)
  vis_k = E.block_table(cfg, bl.block_q_dkv, bl.block_k_dkv, q_seg_p, k_seg_p)

  def full_b(x):
    return jnp.broadcast_to(x, (b,) + x.shape[1:])

  f_lo, f_hi = E.block_ranges(full_b(vis_f), axis=2)
  q_lo, q_hi = E.block_ranges(full_b(vis_q), axis=2)
  k_lo, k_hi = E.block_ranges(full_b(vis_k), axis=1)
  aux = E.Aux(
      q_seg=None if q_seg_p is None else q_seg_p[..., None],
      k_seg=None if k_seg_p is None else k_seg_p[:, None, :],
      length=length, fwd_lo=f_lo, fwd_hi=f_hi, dq_lo=q_lo, dq_hi=q_hi, dkv_lo=k_lo, dkv_hi=k_hi)

  pad_q = ((0, 0), (0, t_pad - t), (0, 0), (0, h_pad - h))
  pad_k = ((0, 0), (0, s_pad - s), (0, 0), (0, h_pad - h))
  o = E.attention_core(cfg, jnp.pad(q, pad_q), jnp.pad(k, pad_k), jnp.pad(v, pad_k), dyn, sink,
                       aux)
  return o[:, :t, :, :h]



