"""Mask *structure*: which keys a query row sees, without a T x S mask.

Attention masks in jaxsoft come in two kinds:

* structure: ``is_causal``, ``local_window_size``, ``query_seq_lengths`` /
  ``key_value_seq_lengths`` and ``segment_ids``. These are described by O(B·(T+S))
  numbers, so the chunked path and the kernels can compute, per query row, the exact
  number of visible keys and the range of keys it may see, and per block pair whether
  it can be skipped — all without materialising a T x S mask.
  The Pallas kernels use the same structure: :meth:`MaskStructure.block_table` for block
  skipping, :meth:`MaskStructure.kernel_segment_ids` for the ids they compare, and
  :func:`positions_visible` inside the kernel.
* a dense boolean ``mask`` (and ``-inf`` entries of ``bias``): arbitrary, applied tile by
  tile, never used for skipping.

Semantics (as jax.nn.dot_product_attention): query i (0-based) sees key j iff

* ``is_causal``: j <= i (top-left aligned, also when T != S);
* ``local_window_size=(left, right)``: i - left <= j <= i + right;
* lengths: i < query_seq_lengths[b] and j < key_value_seq_lengths[b];
* segments: q_segment_ids[b, i] == kv_segment_ids[b, j].
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MaskStructure",
    "normalize_window",
    "normalize_segment_ids",
    "positions_visible",
    "table_ranges",
    "pad_axis",
]

# Segment ids of query rows / key columns that see nothing (past a sequence length, or
# padding to the block size) in :meth:`MaskStructure.kernel_segment_ids`: the two never
# match each other or a user id.
Q_PAD_SEGMENT = np.iinfo(np.int32).min
K_PAD_SEGMENT = np.iinfo(np.int32).min + 1


def normalize_window(local_window_size):
  """``int | (left, right) | None`` -> ``(left, right) | None``; ValueError naming it.

  The sides are Python (or NumPy) ints, static (they shape the block loops, so they are
  never traced). One side may be negative (``(-2, 3)``: keys i + 2 .. i + 3), but
  ``left + right < 0`` is a ValueError: the window would be empty for every query.
  """
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
    local_window_size = (local_window_size, local_window_size)
  try:
    left, right = local_window_size
  except (TypeError, ValueError):
    raise ValueError(
        "`local_window_size` must be an int or a pair of ints (left, right), got "
        f"{local_window_size!r}") from None
  for side in (left, right):
    if not isinstance(side, (int, np.integer)) or isinstance(side, bool):
      raise ValueError(
          "`local_window_size` must be an int or a pair of ints (left, right), got "
          f"{local_window_size!r}")
  if left + right < 0:
    raise ValueError(
        "`local_window_size` (left, right) must have left + right >= 0: query i sees keys "
        f"[i - left, i + right], empty for every query with {local_window_size!r}")
  return (int(left), int(right))


def normalize_segment_ids(segment_ids, B: int, T: int, S: int):
  """``ids [B,T]`` (when T == S) or ``(q_ids [B,T], kv_ids [B,S])`` -> a pair or None."""
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(
          "`segment_ids` must be one array [B, T] (self-attention) or a pair "
          f"(q_segment_ids [B, T], kv_segment_ids [B, S]); got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = (jnp.asarray(s) for s in segment_ids)
  else:
    q_ids = kv_ids = jnp.asarray(segment_ids)
    if T != S:
      raise ValueError(
          "`segment_ids` as one array needs T == S; for cross-attention pass a pair "
          f"(q_segment_ids [B, T], kv_segment_ids [B, S]); got T={T}, S={S}")
  for ids, name, L in ((q_ids, "q", T), (kv_ids, "kv", S)):
    if ids.ndim == 1:  # unbatched inputs (TNH) get a batch dimension
      ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] != L or ids.shape[0] not in (1, B):
      raise ValueError(
          f"`segment_ids`: {name} segment ids must have shape [B, {L}] = [{B}, {L}], got "
          f"{tuple(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"`segment_ids` must be integer arrays, got dtype {ids.dtype}")
    if name == "q":
      q_ids = jnp.broadcast_to(ids, (B, L)).astype(jnp.int32)
    else:
      kv_ids = jnp.broadcast_to(ids, (B, L)).astype(jnp.int32)
  return q_ids, kv_ids


def positions_visible(rows, cols, *, is_causal=False, window=None, q_len=None, kv_len=None,
                      q_seg=None, kv_seg=None):
  """Whether query ``rows`` see key ``cols``, elementwise; None when every pair is visible.

  ``rows`` and ``cols`` are int32 positions of broadcast-compatible shapes (inside a Pallas
  kernel: ``lax.broadcasted_iota`` over the tile plus its offsets); ``q_len`` / ``kv_len``
  bound them (an int or an array broadcasting against them, None for no bound);
  ``q_seg`` / ``kv_seg`` are the ids of those rows and columns (equal ids attend).
  """
  conds = []
  if q_len is not None:
    conds.append(rows < q_len)
  if kv_len is not None:
    conds.append(cols < kv_len)
  if is_causal:
    conds.append(cols <= rows)
  if window is not None:
    left, right = window
    conds += [cols >= rows - left, cols <= rows + right]
  if q_seg is not None:
    conds.append(q_seg == kv_seg)
  return functools.reduce(jnp.logical_and, conds) if conds else None


def table_ranges(table, axis: int):
  """First visible block and one past the last along ``axis`` of a bool block table.

  Returns int32 ``(lo, hi)`` with ``axis`` reduced; a line without a visible block gives
  ``lo == hi == 0`` (a loop over ``[lo, hi)`` runs zero times).
  """
  n = table.shape[axis]
  any_ = jnp.any(table, axis=axis)
  lo = jnp.argmax(table, axis=axis).astype(jnp.int32)
  hi = (n - jnp.argmax(jnp.flip(table, axis=axis), axis=axis)).astype(jnp.int32)
  return jnp.where(any_, lo, 0), jnp.where(any_, hi, 0)


def pad_axis(a, axis: int, size: int, *, value=0, mode: str = "constant"):
  """``a`` padded at the end of ``axis`` to ``size`` (a tile multiple), for blockwise loops.

  The new entries are ``value`` (``mode="constant"``: ``-inf`` for a bias, False for a
  mask, 0 for data) or copies of the last entry (``mode="edge"``: segment ids and decay
  cumsums, so a padded column carries its row's id and decay). ``a`` comes back unchanged
  when it is None, already ``size`` long, or of length 1 along ``axis`` (it broadcasts).

  Examples:
    >>> from jaxsoft.attention.masks import pad_axis
    >>> pad_axis(jnp.array([[1, 2, 3]]), 1, 5, value=-1)
    Array([[ 1,  2,  3, -1, -1]], dtype=int32)
    >>> pad_axis(jnp.array([[7, 8]]), 1, 4, mode="edge")
    Array([[7, 8, 8, 8]], dtype=int32)
  """
  if a is None or a.shape[axis] == size or a.shape[axis] == 1:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, size - a.shape[axis])
  if mode == "edge":
    return jnp.pad(a, widths, mode="edge")
  return jnp.pad(a, widths, constant_values=value)


def _bounded_search(sorted_vals, lo, hi, x):
  """Smallest p in [lo, hi] with ``sorted_vals[b, p] >= x`` (ascending on [lo, hi)).

  Vectorised binary search with a fixed iteration count: ``sorted_vals`` [B, S];
  ``lo``, ``hi``, ``x`` [B, T].
  """
  S = sorted_vals.shape[-1]
  iters = max(1, math.ceil(math.log2(S + 1)) + 1)

  def body(_, state):
    lo, hi = state
    active = lo < hi
    mid = (lo + hi) // 2
    val = jnp.take_along_axis(sorted_vals, jnp.clip(mid, 0, S - 1), axis=-1)
    go_right = active & (val < x)
    go_left = active & ~(val < x)
    return jnp.where(go_right, mid + 1, lo), jnp.where(go_left, mid, hi)

  lo, _ = jax.lax.fori_loop(0, iters, body, (lo, hi))
  return lo


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class MaskStructure:
  """The structured part of an attention mask (see the module docstring).

  Array fields are pytree children (so the structure can be passed through jit,
  vmap and custom_vjp); ``T``, ``S``, ``is_causal`` and ``window`` are static.

  Attributes:
    T, S: query and key lengths.
    is_causal: query i sees keys j <= i.
    window: ``(left, right)``: i - left <= j <= i + right; None = unbounded.
    q_lengths, kv_lengths: int32 [B] or None.
    q_segment_ids, kv_segment_ids: int32 [B, T] and [B, S], or None.

  Examples:
    Causal attention over a window of the previous key and the query's own:

    >>> from jaxsoft.attention import MaskStructure
    >>> mask = MaskStructure(T=4, S=4, is_causal=True, window=(1, 0))
    >>> mask.dense().astype(int)[0, 0]   # visible (query, key) pairs, [T, S]
    Array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]], dtype=int32)
    >>> mask.is_trivial, mask.is_per_batch
    (False, False)
  """

  T: int
  S: int
  is_causal: bool = False
  window: tuple[int, int] | None = None
  q_lengths: jax.Array | None = None
  kv_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None

  def tree_flatten(self):
    children = (self.q_lengths, self.kv_lengths, self.q_segment_ids, self.kv_segment_ids)
    return children, (self.T, self.S, self.is_causal, self.window)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*aux, *children)

  @property
  def has_segments(self) -> bool:
    return self.q_segment_ids is not None

  @property
  def is_per_batch(self) -> bool:
    """True when lengths or segment ids make the visibility differ across the batch."""
    return not (self.q_lengths is None and self.kv_lengths is None and not self.has_segments)

  @property
  def is_trivial(self) -> bool:
    """True when every query sees every key."""
    return not (self.is_causal or self.window is not None or self.is_per_batch)

  def kernel_segment_ids(self, t_pad: int | None = None, s_pad: int | None = None):
    """The per-batch part as segment ids alone: ``(q_ids [B, t_pad], kv_ids [B, s_pad])``.

    Rows past ``q_lengths`` (or past T, up to ``t_pad``) get ``Q_PAD_SEGMENT`` and keys
    past ``kv_lengths`` (or S) get ``K_PAD_SEGMENT``, ids that match nothing, so that the
    kernels test one equality. Without segment ids every valid position has id 0. None
    when the structure is not per batch (:attr:`is_per_batch`).
    """
    if not self.is_per_batch:
      return None
    t_pad = self.T if t_pad is None else t_pad
    s_pad = self.S if s_pad is None else s_pad

    def ids(seg, lengths, n, n_pad, sentinel):
      pos = jnp.arange(n_pad, dtype=jnp.int32)[None, :]
      if seg is None:
        seg = jnp.zeros((1, n), jnp.int32)
      seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, n_pad - n)))
      valid = pos < n if lengths is None else pos < jnp.minimum(lengths[:, None], n)
      return jnp.where(valid, seg, sentinel)

    q_ids = ids(self.q_segment_ids, self.q_lengths, self.T, t_pad, Q_PAD_SEGMENT)
    kv_ids = ids(self.kv_segment_ids, self.kv_lengths, self.S, s_pad, K_PAD_SEGMENT)
    b, = jnp.broadcast_shapes(q_ids.shape[:1], kv_ids.shape[:1])  # a symbolic batch too
    return jnp.broadcast_to(q_ids, (b, t_pad)), jnp.broadcast_to(kv_ids, (b, s_pad))

  # ---------------------------------------------------------------- tiles / dense mask

  def tile_visible(self, q_pos, k_pos, q_seg=None, kv_seg=None):
    """Visibility of a tile from positions: bool broadcastable to [B, 1, bq, bk].

    Args:
      q_pos: int32 [bq] query positions (positions >= T are padding and see nothing).
      k_pos: int32 [bk] key positions (positions >= S are padding and are never seen).
      q_seg, kv_seg: the segment ids of these positions, [B, bq] and [B, bk] (only when
        the structure has segments).
    """
    i = q_pos[:, None]
    j = k_pos[None, :]
    vis = positions_visible(i, j, is_causal=self.is_causal, window=self.window, q_len=self.T,
                            kv_len=self.S)[None, None]  # [1, 1, bq, bk]
    if self.q_lengths is not None:  # (explicit ranks: no implicit rank promotion)
      vis = vis & (i[None, None] < self.q_lengths[:, None, None, None])
    if self.kv_lengths is not None:
      vis = vis & (j[None, None] < self.kv_lengths[:, None, None, None])
    if self.has_segments:
      vis = vis & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    return vis

  def dense(self):
    """The full structure mask, bool broadcastable to [B, 1, T, S] (dense path only)."""
    return self.tile_visible(
        jnp.arange(self.T, dtype=jnp.int32), jnp.arange(self.S, dtype=jnp.int32),
        self.q_segment_ids, self.kv_segment_ids)

  def tile_is_full(self, q_start, bq: int, k_start, bk: int):
    """True when every (i, j) of the tile is visible by structure (no masking needed).

    Conservative: with segment ids it is always False.
    """
    q_end = q_start + bq  # exclusive
    k_end = k_start + bk
    full = (q_end <= self.T) & (k_end <= self.S)
    if self.has_segments:
      return jnp.zeros((), bool)
    if self.is_causal:
      full = full & (k_end - 1 <= q_start)
    if self.window is not None:
      left, right = self.window
      # every i in [q_start, q_end), j in [k_start, k_end): i - left <= j, j <= i + right
      full = full & (q_end - 1 - left <= k_start) & (k_end - 1 <= q_start + right)
    if self.q_lengths is not None:
      full = full & (q_end <= jnp.min(self.q_lengths))
    if self.kv_lengths is not None:
      full = full & (k_end <= jnp.min(self.kv_lengths))
    return full

  # ---------------------------------------------------------------- per-row closed forms

  def _interval(self):
    """Per query row the key interval [lo, hi) allowed by causal/window/lengths.

    Returns int32 arrays broadcastable to [B, T] (leading dim 1 without lengths).
    """
    i = jnp.arange(self.T, dtype=jnp.int32)[None, :]
    lo = jnp.zeros_like(i)
    hi = jnp.full_like(i, self.S)
    if self.is_causal:
      hi = jnp.minimum(hi, i + 1)
    if self.window is not None:
      left, right = self.window
      lo = jnp.maximum(lo, i - left)
      hi = jnp.minimum(hi, i + right + 1)
    if self.kv_lengths is not None:
      hi = jnp.minimum(hi, self.kv_lengths.astype(jnp.int32)[:, None])
    if self.q_lengths is not None:
      # rows past the query length see nothing: an empty interval
      hi = jnp.where(i < self.q_lengths.astype(jnp.int32)[:, None], hi, 0)
    hi = jnp.maximum(hi, lo)  # empty intervals as lo == hi
    return lo, hi

  def row_ranges(self):
    """Per query row the tight key range ``[first, last + 1)`` of its visible keys.

    Returns ``(lo, hi, count)`` int32 broadcastable to [B, T]: every visible key of row
    i lies in [lo, hi), and ``count`` is the exact number of visible keys (closed form:
    interval lengths; with segment ids a binary search among the key positions of the
    row's segment, O((T + S) log S)). Rows without a visible key have lo == hi.
    """
    lo, hi = self._interval()
    q_seg, kv_seg = self.q_segment_ids, self.kv_segment_ids
    if q_seg is None or kv_seg is None:
      return lo, hi, hi - lo
    B = q_seg.shape[0]
    lo = jnp.broadcast_to(lo, (B, self.T))
    hi = jnp.broadcast_to(hi, (B, self.T))
    # key positions sorted by (segment id, position): the keys of one segment form a run
    order = jnp.argsort(kv_seg, axis=-1, stable=True).astype(jnp.int32)
    sorted_seg = jnp.take_along_axis(kv_seg, order, axis=-1)
    run_lo = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left"))(sorted_seg, q_seg)
    run_hi = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="right"))(sorted_seg, q_seg)
    run_lo, run_hi = run_lo.astype(jnp.int32), run_hi.astype(jnp.int32)
    c_lo = _bounded_search(order, run_lo, run_hi, lo)
    c_hi = _bounded_search(order, run_lo, run_hi, hi)
    count = c_hi - c_lo
    S = self.S
    first = jnp.take_along_axis(order, jnp.clip(c_lo, 0, S - 1), axis=-1)
    last = jnp.take_along_axis(order, jnp.clip(c_hi - 1, 0, S - 1), axis=-1)
    nonempty = count > 0
    new_lo = jnp.where(nonempty, first, 0)
    new_hi = jnp.where(nonempty, last + 1, 0)
    return new_lo, new_hi, count

  def visible_counts(self, ranges=None, dtype=jnp.float32):
    """n: the number of visible keys of each query row, broadcastable to [B, T].

    ``ranges``: the result of :meth:`row_ranges` when the caller already has it;
    ``dtype``: the compute dtype of the caller (float64 inputs take float64 counts, so
    that length terms such as ``log n`` are as precise as the rest of the row).
    """
    return (self.row_ranges() if ranges is None else ranges)[2].astype(dtype)

  def block_table(self, block_q: int, block_k: int, num_q_blocks: int | None = None,
                  num_k_blocks: int | None = None, ranges=None):
    """Which (query block, key block) tiles can hold a visible entry: bool [B or 1, nq, nk].

    A tile is marked when one of its rows has its visible keys' range (:meth:`row_ranges`)
    meeting the tile's columns: exact (no tile with a visible entry is unmarked), and tight
    when each row's visible keys are contiguous (no segment ids, or sorted ones). Blocks
    past T or S (padding up to ``num_q_blocks`` / ``num_k_blocks``) are unmarked. Memory
    O(B·(T + nq·nk)), never T x S. ``ranges``: the result of :meth:`row_ranges` when the
    caller already has it (one search serves every table and the counts).
    """
    for name, size in (("block_q", block_q), ("block_k", block_k)):
      if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {size!r}")
    nq = -(-self.T // block_q) if num_q_blocks is None else num_q_blocks
    nk = -(-self.S // block_k) if num_k_blocks is None else num_k_blocks
    if nq * block_q < self.T or nk * block_k < self.S:
      raise ValueError(
          f"`num_q_blocks`={nq} x `block_q`={block_q} and `num_k_blocks`={nk} x "
          f"`block_k`={block_k} must cover T={self.T} and S={self.S}")
    lo, hi, count = self.row_ranges() if ranges is None else ranges
    rows = [jnp.broadcast_to(a, (a.shape[0], self.T))
            for a in (lo, hi, (count > 0).astype(jnp.int32))]
    # Per row +1 at its first key block, -1 past its last; a running sum over the key
    # blocks of each query block counts the rows reaching each tile. One batch entry at a
    # time (vmap), an array of one entry ([1, T]) shared by the batch: the scatter then
    # keeps a batch sharded on an Explicit mesh (a batch-indexed scatter into a replicated
    # zeros is a sharding type error there, and so is a mapped axis sharded in one argument
    # and not in another). ``== 1`` is False for a symbolic batch (jax.export).
    shared = [a.shape[0] == 1 for a in rows]
    in_axes = [0] * 3 if all(shared) else [None if s else 0 for s in shared]
    rows = [a[0] if axis is None else a for a, axis in zip(rows, in_axes, strict=True)]
    qb = jnp.arange(self.T, dtype=jnp.int32) // block_q

    def row_diff(lo, hi, mark):
      diff = jnp.zeros((nq, nk + 1), jnp.int32)
      diff = diff.at[qb, jnp.where(mark > 0, lo // block_k, 0)].add(mark)
      return diff.at[qb, jnp.where(mark > 0, (hi - 1) // block_k + 1, 0)].add(-mark)

    diff = jax.vmap(row_diff, in_axes=tuple(in_axes))(*rows)
    return jnp.cumsum(diff, axis=-1)[..., :nk] > 0

  def block_key_ranges(self, block_q: int, num_q_blocks: int, block_k: int, ranges=None):
    """Per query block the range of key blocks ``[kb_lo, kb_hi)`` that can be visible.

    Reduced over the batch (the chunked loop is shared by the batch); an all-invisible
    query block gets an empty range. Returns two int32 arrays [num_q_blocks].
    """
    table = self.block_table(block_q, block_k, num_q_blocks, ranges=ranges)
    return table_ranges(jnp.any(table, axis=0), axis=-1)
