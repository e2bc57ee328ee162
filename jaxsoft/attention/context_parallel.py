"""Context-parallel attention: a sequence sharded along a mesh axis (issue 34).

:func:`context_parallel_attention` takes global ``query``, ``key`` and ``value`` arrays,
splits their sequence axis over the mesh axis ``axis_name`` (and, optionally, the batch
over ``batch_axes``), runs one *strategy* on each device's shards inside
:func:`jax.shard_map`, and returns the global output, equal to the single-device
:func:`jaxsoft.attention.dot_product_attention` for every normalizer and implementation.

A strategy is a function run inside ``shard_map`` on local shards, looked up by name in
:data:`STRATEGIES`, with the signature::

    strategy(q, k, v, *, axis_name, q_positions, kv_positions, q_segment_ids,
             kv_segment_ids, kv_valid, is_causal, local_window_size, normalizer,
             normalizer_params, scale, logits_soft_cap, implementation) -> out

``q`` [B, Tl, N, H] and ``k`` / ``v`` [B, Sl, K, H] are the local shards; the positions
(int32 [B, Tl] / [B, Sl]) are the GLOBAL positions of the local rows in the original
sequence order (after any load-balancing reorder); segment ids are int32 or None;
``kv_valid`` is bool [B, Sl] (False past ``key_value_seq_lengths``) or None. Key j is
visible to query i iff ``kv_valid[j]``, equal segment ids (when given), ``kv_pos[j] <=
q_pos[i]`` (when causal) and ``q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right`` (with a
window). The result is the local output [B, Tl, N, H] in ``q.dtype``. A strategy whose
signature also has ``load_balanced`` gets it: True when the shards, concatenated in device
order, are the sequence in :func:`load_balance_order` (False: in sequence order), which
lets it restore the sequence order of gathered rows with a static reshape and flip.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxsoft.attention._api import dot_product_attention
from jaxsoft.attention._ring import ring_attention
from jaxsoft.attention.call import _check_lengths
from jaxsoft.attention.masks import normalize_segment_ids, normalize_window, positions_visible

__all__ = ["context_parallel_attention", "STRATEGIES", "load_balance_order"]


# ----------------------------------------------------------------------------- helpers


def load_balance_order(length: int, cp: int) -> np.ndarray:
  r"""The dual-chunk order of a causal sequence over ``cp`` devices (static, NumPy).

  The sequence is cut into ``2·cp`` equal chunks :math:`c_0, \dots, c_{2cp-1}`; device
  i holds :math:`(c_i, c_{2cp-1-i})`, so that every device gets the same amount of causal
  work (a chunk near the start sees few keys, its mirror near the end sees many). The
  returned index ``order`` (int32 [length]) is the global position of each row of the
  reordered sequence, ``x_balanced = x[order]``; contiguous blocks of ``length / cp``
  rows of it are the devices' shards. The inverse is ``np.argsort(order)``.

  Args:
    length: the sequence length, divisible by ``2 * cp``.
    cp: the number of devices along the context axis (>= 1).

  Returns:
    int32 NumPy array [length], a permutation of ``range(length)``.

  Raises:
    ValueError when ``length`` is not divisible by ``2 * cp``.

  References:
    Grattafiori et al. (2024), "The Llama 3 Herd of Models", arXiv:2407.21783 (its
    load-balanced context parallelism: 2·cp chunks, device i takes chunks i and
    2cp-1-i).

  Examples:
    >>> js.attention.load_balance_order(8, 2)  # chunks of 2: device 0 (0, 3), device 1 (1, 2)
    array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
  """
  if cp < 1 or length % (2 * cp):
    raise ValueError(
        f"load-balanced context parallelism needs the sequence length ({length}) divisible by "
        f"2 * cp = {2 * cp} (cp = {cp} devices along the context axis)")
  chunks = np.arange(length, dtype=np.int32).reshape(2 * cp, length // (2 * cp))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]])
                         for i in range(cp)]).astype(np.int32)


def _natural_order(x, cp: int):
  """The rows of ``x`` [B, L, ...], in :func:`load_balance_order` (the device shards
  concatenated), put back in sequence order: a static reshape and flip. Device i's shard
  holds chunks i and 2cp-1-i, so the first halves of the shards are chunks 0..cp-1 in
  order and the second halves, read backwards, chunks cp..2cp-1."""
  B, L = x.shape[:2]
  halves = x.reshape(B, cp, 2, L // (2 * cp), *x.shape[2:])
  first, second = halves[:, :, 0], jnp.flip(halves[:, :, 1], axis=1)
  return jnp.concatenate([first, second], axis=1).reshape(x.shape)


def _balanced_order(x, cp: int):
  """The inverse of :func:`_natural_order`: rows in sequence order -> the dual-chunk
  order of :func:`load_balance_order`."""
  B, L = x.shape[:2]
  chunks = x.reshape(B, 2 * cp, L // (2 * cp), *x.shape[2:])
  pairs = jnp.stack([chunks[:, :cp], jnp.flip(chunks[:, cp:], axis=1)], axis=2)
  return pairs.reshape(x.shape)


def _visibility(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_valid,
                is_causal, local_window_size):
  """bool [B, 1, T, S] (True = attend) from global positions, or None (all visible)."""
  window = normalize_window(local_window_size)
  rows, cols = q_positions[:, :, None], kv_positions[:, None, :]
  seg = None if q_segment_ids is None else (q_segment_ids[:, :, None],
                                            kv_segment_ids[:, None, :])
  vis = positions_visible(rows, cols, is_causal=is_causal, window=window,
                          q_seg=None if seg is None else seg[0],
                          kv_seg=None if seg is None else seg[1])
  if kv_valid is not None:
    vis = kv_valid[:, None, :] if vis is None else vis & kv_valid[:, None, :]
  if vis is None:
    return None
  B, T, S = q_positions.shape[0], q_positions.shape[1], kv_positions.shape[1]
  return jnp.broadcast_to(vis, (B, T, S))[:, None]


def _gather(x, axis_name):
  return None if x is None else lax.all_gather(x, axis_name, axis=1, tiled=True)


def _attend(q, k, v, mask, *, normalizer, normalizer_params, scale, logits_soft_cap,
            implementation):
  out = dot_product_attention(q, k, v, mask=mask, scale=scale, logits_soft_cap=logits_soft_cap,
                              normalizer=normalizer, normalizer_params=normalizer_params,
                              implementation=implementation)
  return out.astype(q.dtype)


# -------------------------------------------------------------------------- strategies


def _all_gather_attention(q, k, v, *, axis_name, q_positions, kv_positions, q_segment_ids,
                          kv_segment_ids, kv_valid, is_causal, local_window_size, normalizer,
                          normalizer_params, scale, logits_soft_cap, implementation,
                          load_balanced: bool = False):
  r"""The ``"all_gather"`` strategy: queries stay sharded, keys and values are gathered.

  Each device gathers K, V and their positions, segment ids and validity along
  ``axis_name`` (``lax.all_gather``, tiled: its transpose under autodiff is a
  reduce-scatter of dK, dV) and computes, for its local queries,
  :math:`o_i = \sum_{j \in V_i} f(\ell_{i\cdot})_j v_j` over ALL S keys, with the
  visibility :math:`V_i` of the module docstring written as a boolean ``mask`` [B, 1, Tl,
  S] for :func:`~jaxsoft.attention.dot_product_attention` (so every implementation and
  every normalizer class counts the same visible keys; a row with none gives zeros).
  Memory per device: the gathered K, V (O(S·K·H)) and the mask (O(Tl·S) booleans).

  With ``load_balanced`` the gathered keys are put back in sequence order (a static
  reshape and flip, :func:`_natural_order`), so that a causal query's visible keys are a
  prefix: ``implementation="xla_chunked"`` then visits, per query block, only the key
  blocks its mask can see (its loop bounds narrowed to the mask's, about half the tiles
  of a causal sequence, as on one device); in dual-chunk order they spread over every
  block.
  """
  k, v = _gather(k, axis_name), _gather(v, axis_name)
  kv_positions, kv_segment_ids, kv_valid = (
      _gather(x, axis_name) for x in (kv_positions, kv_segment_ids, kv_valid))
  if load_balanced:
    cp = lax.psum(1, axis_name)
    k, v, kv_positions, kv_segment_ids, kv_valid = (
        None if x is None else _natural_order(x, cp)
        for x in (k, v, kv_positions, kv_segment_ids, kv_valid))
  mask = _visibility(q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_valid,
                     is_causal, local_window_size)
  return _attend(q, k, v, mask, normalizer=normalizer, normalizer_params=normalizer_params,
                 scale=scale, logits_soft_cap=logits_soft_cap, implementation=implementation)


def _kv_repeats(N: int, K: int, cp: int, axis_name: str) -> int:
  """How many times ulysses repeats each key/value head so that the cp devices get whole
  groups: 1 when K % cp == 0, else cp / gcd(K, cp) (GQA with fewer key heads than
  devices), which needs N divisible by the repeated count. ValueError naming the sizes."""
  repeats = 1 if K % cp == 0 else cp // math.gcd(K, cp)
  if N % cp or N % (K * repeats):
    raise ValueError(
        f"strategy='ulysses' splits the heads over the {cp} devices of axis {axis_name!r}: "
        f"the query heads N = {N} must be divisible by {cp}, and by the key/value heads K = "
        f"{K} repeated to a multiple of {cp} ({K * repeats})")
  return repeats


def _ulysses_attention(q, k, v, *, axis_name, q_positions, kv_positions, q_segment_ids,
                       kv_segment_ids, kv_valid, is_causal, local_window_size, normalizer,
                       normalizer_params, scale, logits_soft_cap, implementation,
                       load_balanced: bool = False):
  r"""The ``"ulysses"`` strategy: all-to-all from sequence shards to head shards and back.

  ``lax.all_to_all`` turns q [B, T/cp, N, H] into [B, T, N/cp, H] (and k, v into [B, S,
  K/cp, H]); each device computes full-sequence attention for its head group (query head n
  uses key head n // (N/K) in the same group, since N/cp and K/cp heads are contiguous),
  and a second all-to-all returns [B, T/cp, N, H]. Needs N divisible by cp; when K is
  not (GQA with few key heads), each key/value head is repeated r = cp / gcd(K, cp) times
  first (r times their all-to-all traffic; their gradients sum over the copies), which
  needs N divisible by K·r.
  Per-head ``normalizer_params`` (an array with N along its third-to-last axis) are sliced
  to the device's head group.

  After the all-to-all each device holds the whole sequence, in the shards' order: with
  ``load_balanced`` (the dual-chunk order of :func:`load_balance_order`) it is put back
  in sequence order by a static reshape and flip (and the output returned to the shards'
  order), so that the rows' positions are 0..T-1 and the call takes ``is_causal``,
  ``local_window_size``, the key lengths (the count of ``kv_valid``, a prefix in sequence
  order) and the segment ids as structure, not as a dense mask: every implementation
  skips what it skips on one device (``xla_chunked``: the causal half of the tiles), and
  no T x S mask is built. (``q_positions`` and ``kv_positions`` are the shards' rows of
  that order, so they are not read here.)

  References:
    Jacobs, Tanaka, Zhang, Zhang, Song, Rajbhandari and He (2023), "DeepSpeed Ulysses:
    System Optimizations for Enabling Training of Extreme Long Sequence Transformer
    Models", arXiv:2309.14509.
  """
  del q_positions, kv_positions  # the gathered rows are the sequence (see above)
  cp = lax.psum(1, axis_name)
  N, K = q.shape[2], k.shape[2]
  repeats = _kv_repeats(N, K, cp, axis_name)
  if repeats > 1:  # key head j becomes heads j·r .. j·r + r - 1: query head n still uses j
    k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)

  def to_heads(x):
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)

  def in_order(x):
    return x if x is None or not load_balanced else _natural_order(x, cp)

  q, k, v = (in_order(to_heads(x)) for x in (q, k, v))
  q_segment_ids, kv_segment_ids, kv_valid = (
      in_order(_gather(x, axis_name)) for x in (q_segment_ids, kv_segment_ids, kv_valid))
  kv_lengths = None if kv_valid is None else jnp.sum(kv_valid, axis=1, dtype=jnp.int32)
  segment_ids = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  group = lax.axis_index(axis_name)

  def heads_of_group(x):
    if isinstance(x, (jax.Array, np.ndarray)) and jnp.ndim(x) >= 3 and x.shape[-3] == N and N > 1:
      return lax.dynamic_slice_in_dim(jnp.asarray(x), group * (N // cp), N // cp, axis=-3)
    return x

  params = None if normalizer_params is None else {
      name: heads_of_group(x) for name, x in normalizer_params.items()}
  out = dot_product_attention(
      q, k, v, scale=scale, is_causal=is_causal, local_window_size=local_window_size,
      key_value_seq_lengths=kv_lengths, segment_ids=segment_ids,
      logits_soft_cap=logits_soft_cap, normalizer=normalizer, normalizer_params=params,
      implementation=implementation).astype(q.dtype)
  if load_balanced:
    out = _balanced_order(out, cp)
  return lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)


# The strategies by name (every one runs inside shard_map on local shards, with the
# signature of the module docstring). "ring" (jaxsoft.attention._ring, Liu et al. 2023)
# passes K/V shards around the ring: kernel classes E, S, P and T, not R.
STRATEGIES: dict[str, Callable[..., jax.Array]] = {
    "all_gather": _all_gather_attention,
    "ulysses": _ulysses_attention,
    "ring": ring_attention,
}


# ------------------------------------------------------------------------ entry point


def _axes(batch_axes, mesh, axis_name):
  if batch_axes is None:
    return ()
  axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  for a in axes:
    if a not in mesh.axis_names or a == axis_name:
      raise ValueError(f"`batch_axes`: {a!r} must be an axis of the mesh "
                       f"{tuple(mesh.axis_names)} other than `axis_name` {axis_name!r}")
  return axes


def context_parallel_attention(
    query: Any, key: Any, value: Any, *, mesh: jax.sharding.Mesh, axis_name: str = "context",
    strategy: str = "all_gather", load_balance: bool | None = None,
    batch_axes: str | Sequence[str] | None = None, is_causal: bool = False,
    query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
    segment_ids: Any = None, local_window_size: int | tuple[int, int] | None = None,
    scale: Any = None, logits_soft_cap: float | None = None,
    normalizer: Any = "softmax", normalizer_params: Mapping[str, Any] | None = None,
    implementation: str | Sequence[str] | None = None) -> jax.Array:
  r"""Attention over a sequence sharded along a mesh axis (context parallelism).

  Computes, for each batch b, head n and query i, exactly what
  :func:`~jaxsoft.attention.dot_product_attention` computes on one device,

  .. math::
    \ell_{ij} = c \tanh\Big(\frac{s\, q_i \cdot k_j}{c}\Big), \qquad
    o_i = \sum_{j \in V_i} f(\ell_{i\cdot};\ \mathrm{where}=V_i)_j\, v_j,

  with f the normalizer (any kernel class: E, S, P, R, T) and V_i the keys query i sees
  (causal, window, lengths, segments), but with the T queries and S keys split into
  ``cp = mesh.shape[axis_name]`` contiguous shards, one per device along ``axis_name``
  (and the batch split over ``batch_axes``). The call runs a *strategy* from
  :data:`STRATEGIES` inside :func:`jax.shard_map` on the local shards:

  * ``"all_gather"`` (default): each device keeps its T/cp queries and all-gathers the
    keys and values (the transpose of the gather, in the backward pass, is a
    reduce-scatter of dK, dV). Memory per device O(S·K·H + (T/cp)·S).
  * ``"ulysses"`` (DeepSpeed-Ulysses): an all-to-all turns the sequence shards into head
    shards (each device gets all T queries of N/cp heads and all S keys of K/cp heads),
    attends, and a second all-to-all turns the result back. N must be divisible by cp;
    key/value heads are repeated when K is not (GQA), which needs N divisible by the
    repeated count.
  * ``"ring"`` (ring attention): the key/value shards travel around the ring of devices,
    cp - 1 hops, each device folding every shard into its rows' running state
    (:func:`jaxsoft.attention._ring.ring_attention`): memory per device O((S/cp)·K·H);
    kernel classes E, S, P and T (class R raises NotImplementedError); ``implementation``
    is not used (each hop is plain jnp on one tile).

  With ``load_balance`` (the default when ``is_causal``), the sequence is reordered
  before sharding so that device i holds chunks i and 2cp-1-i of 2·cp equal chunks
  (:func:`load_balance_order`): every device then does the same causal work. The
  reorder of q, k, v, lengths and segment ids is a static gather outside ``shard_map``
  (one collective permute or cheap reshuffle under ``jit``), the strategies see the
  GLOBAL positions of their rows, and the output is put back in the original order.
  ``"all_gather"`` and ``"ulysses"`` put the rows they gather back in sequence order (a
  static reshape and flip), so that ``implementation="xla_chunked"`` skips the key blocks
  a causal query block cannot see, as on one device (about half of the tiles).

  The inputs may be sharded or not (``shard_map`` reshards them); plain autodiff gives
  the single-device gradients with respect to query, key, value and array
  ``normalizer_params``.

  Args:
    query: [B, T, N, H] (or [T, N, H]).
    key: [B, S, K, H] (or [S, K, H]); N % K == 0 (GQA: query head n uses key head
      n // (N/K)).
    value: [B, S, K, Hv].
    mesh: the :class:`jax.sharding.Mesh` to run on.
    axis_name: the mesh axis the sequence is split over (size cp); T and S must be
      divisible by cp (by 2·cp with ``load_balance``).
    strategy: a name in :data:`STRATEGIES` (``"all_gather"``, ``"ulysses"``, ``"ring"``).
    load_balance: reorder the sequence into dual chunks (see above); None = ``is_causal``;
      nothing to do (and no divisibility by 2) when cp = 1.
      Causal self-attention with T != S is top-left aligned (as the single-device call);
      q and kv are then reordered each with their own length.
    batch_axes: optional mesh axis name(s) the batch B is split over (B divisible by
      their total size).
    is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids, local_window_size,
      scale, logits_soft_cap, normalizer, normalizer_params, implementation: as in
      :func:`~jaxsoft.attention.dot_product_attention` (``implementation`` is the one each
      device runs on its shards). Array ``normalizer_params`` must not vary along T or,
      with ``batch_axes``, along B (size 1 there); per-head arrays ([N, 1, 1]) are fine.
      ``bias``, ``mask`` and ``return_residual`` are not taken here.

  Returns:
    [B, T, N, Hv] (or [T, N, Hv]) in the dtype q, k, v promote to (float32 for integer
    inputs), equal to the single-device result (up to the order of floating-point sums).

  Raises:
    ValueError naming the argument: ``axis_name`` or ``batch_axes`` not in the mesh,
    unknown ``strategy`` (the message lists :data:`STRATEGIES`), T or S not divisible by
    cp (2·cp with ``load_balance``), N not divisible by cp (or by the repeated K) for
    ``"ulysses"``, bad
    shapes of lengths or segment ids, normalizer_params varying along T.

  References:
    Jacobs, Tanaka, Zhang, Zhang, Song, Rajbhandari and He (2023), "DeepSpeed Ulysses:
    System Optimizations for Enabling Training of Extreme Long Sequence Transformer
    Models", arXiv:2309.14509. Grattafiori et al. (2024), "The Llama 3 Herd of Models",
    arXiv:2407.21783 (all-gather context parallelism with load-balanced dual chunks).
    Liu, Zaharia and Abbeel (2023), "Ring Attention with Blockwise Transformers for
    Near-Infinite Context", arXiv:2310.01889 (the ring strategy).

  Examples:
    On a one-device mesh (any number of devices works the same way):

    >>> mesh = jax.make_mesh((1,), ("context",))
    >>> x = jnp.sin(jnp.arange(128.0)).reshape(2, 8, 2, 4)  # [B, T, N, H]
    >>> causal = jax.jit(lambda x: js.attention.context_parallel_attention(
    ...     x, x, x, mesh=mesh, is_causal=True))
    >>> out, ref = causal(x), js.attention.dot_product_attention(x, x, x, is_causal=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-6))
    ((2, 8, 2, 4), True)
    >>> ulysses = jax.jit(lambda x: js.attention.context_parallel_attention(
    ...     x, x, x, mesh=mesh, strategy="ulysses", normalizer="sparsemax"))
    >>> out = ulysses(x)
    >>> ref = js.attention.dot_product_attention(x, x, x, normalizer="sparsemax")
    >>> bool(jnp.allclose(out, ref, atol=1e-6))
    True
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"`strategy` must be one of {sorted(STRATEGIES)}, got {strategy!r}")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"`axis_name` {axis_name!r} is not an axis of the mesh "
                     f"{tuple(mesh.axis_names)}")
  baxes = _axes(batch_axes, mesh, axis_name)
  q, k, v = (jnp.asarray(x) for x in (query, key, value))
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError("`query`, `key`, `value` must be [B, T, N, H], [B, S, K, H], [B, S, K, Hv] "
                     f"(or without B), got {q.shape}, {k.shape}, {v.shape}")
  dtype = jnp.result_type(q, k, v)
  if not jnp.issubdtype(dtype, jnp.floating):
    dtype = jnp.float32
  q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  cp = int(mesh.shape[axis_name])
  # one device along the axis has nothing to balance
  balance = (bool(is_causal) if load_balance is None else bool(load_balance)) and cp > 1
  unit = 2 * cp if balance else cp
  for L, name in ((T, "query"), (S, "key")):
    if L % unit:
      raise ValueError(
          f"`{name}`'s sequence length {L} must be divisible by {unit} "
          + (f"(2 * cp, load_balance with cp = {cp} devices along {axis_name!r})" if balance
             else f"(cp, the devices along {axis_name!r})"))
  nb = int(np.prod([mesh.shape[a] for a in baxes])) if baxes else 1
  if B % nb:
    raise ValueError(f"the batch size {B} must be divisible by {nb}, the devices along "
                     f"`batch_axes` {baxes}")
  if strategy == "ulysses":
    _kv_repeats(N, K, cp, axis_name)
  normalize_window(local_window_size)  # a ValueError naming it before the trace

  segs = normalize_segment_ids(segment_ids, B, T, S)
  q_len = _check_lengths(query_seq_lengths, "query_seq_lengths", B, T)
  kv_len = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", B, S)
  q_order = load_balance_order(T, cp) if balance else np.arange(T, dtype=np.int32)
  kv_order = load_balance_order(S, cp) if balance else np.arange(S, dtype=np.int32)

  batch = baxes if baxes else None
  seq_spec = PartitionSpec(batch, axis_name)
  explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

  def seq_take(x, order):  # a static gather along the sequence axis (identity: no op)
    if np.array_equal(order, np.arange(len(order))):
      return x
    # under an Explicit mesh the gather's output layout must be named: the shards
    return x.at[:, order].get(out_sharding=NamedSharding(mesh, seq_spec) if explicit else None)

  args: dict[str, Any] = {
      "q": seq_take(q, q_order), "k": seq_take(k, kv_order), "v": seq_take(v, kv_order),
      "q_positions": jnp.broadcast_to(jnp.asarray(q_order), (B, T)),
      "kv_positions": jnp.broadcast_to(jnp.asarray(kv_order), (B, S))}
  if segs is not None:
    args["q_segment_ids"] = seq_take(segs[0], q_order)
    args["kv_segment_ids"] = seq_take(segs[1], kv_order)
  if q_len is not None:
    args["q_valid"] = args["q_positions"] < q_len[:, None]
  if kv_len is not None:
    args["kv_valid"] = args["kv_positions"] < kv_len[:, None]
  specs: dict[str, Any] = {name: seq_spec for name in args}

  # array hyperparameters (and an array scale) enter shard_map replicated, so that they
  # are differentiable; Python values stay static
  params = dict(normalizer_params or {})
  arrays = {n: jnp.asarray(x) for n, x in params.items() if isinstance(x, (jax.Array, np.ndarray))}
  for n, x in arrays.items():
    if x.ndim >= 2 and x.shape[-2] != 1:
      raise ValueError(f"`normalizer_params[{n!r}]` varies along T (shape {x.shape}): "
                       "context_parallel_attention takes hyperparameters constant along T")
    if baxes and x.ndim >= 4 and x.shape[-4] != 1:
      raise ValueError(f"`normalizer_params[{n!r}]` varies along B (shape {x.shape}) with "
                       "`batch_axes`: pass it constant along B")
  args["params"] = arrays
  specs["params"] = {n: PartitionSpec() for n in arrays}
  scale_is_array = isinstance(scale, (jax.Array, np.ndarray))
  if scale_is_array:
    args["scale"] = jnp.asarray(scale)
    specs["scale"] = PartitionSpec()
  run = STRATEGIES[strategy]

  # a strategy that takes ``load_balanced`` is told whether the rows are in dual-chunk order
  order_kw = ({"load_balanced": balance}
              if "load_balanced" in inspect.signature(run).parameters else {})

  def local(a):
    out = run(a["q"], a["k"], a["v"], axis_name=axis_name, q_positions=a["q_positions"],
              kv_positions=a["kv_positions"], q_segment_ids=a.get("q_segment_ids"),
              kv_segment_ids=a.get("kv_segment_ids"), kv_valid=a.get("kv_valid"),
              is_causal=bool(is_causal), local_window_size=local_window_size,
              normalizer=normalizer,
              normalizer_params={**params, **a["params"]} if normalizer_params else None,
              scale=a["scale"] if scale_is_array else scale, logits_soft_cap=logits_soft_cap,
              implementation=implementation, **order_kw)
    if "q_valid" in a:  # rows past query_seq_lengths are zeros (with zero gradient)
      out = jnp.where(a["q_valid"][:, :, None, None], out, jnp.zeros((), out.dtype))
    return out

  # Explicit mesh axes need the inputs laid out as in_specs says (Auto ones are resharded
  # by shard_map itself)
  if explicit:
    args = jax.tree.map(lambda x, s: jax.reshard(x, NamedSharding(mesh, s)), args, specs)
  # shard_map's default varying-axes check (check_vma) stays on for every strategy,
  # implementation and normalizer, the Pallas interpreter included
  out = jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=seq_spec)(args)
  out = seq_take(out, np.argsort(q_order).astype(np.int32))
  return out[0] if unbatched else out
