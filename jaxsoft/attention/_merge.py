"""KV merging with the log-count bias (feature A48; Chelsea).

Pure functions; the clustering that produces an assignment is the caller's (or
:func:`alternating_matching`'s) business.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.attention._checks import check_int
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["merge_kv", "alternating_matching"]


def merge_kv(key: ArrayLike, value: ArrayLike, assignment: ArrayLike,
             num_clusters: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""KV merging: keys and values averaged by cluster, with the log-count bias (A48).

  For each batch b, key/value head h and cluster c with members
  :math:`M_c = \{j : a_{bj} = c\}` and :math:`n_c = |M_c|`:

  .. math::
    \bar k_c = \frac{1}{n_c}\sum_{j \in M_c} k_j, \qquad
    \bar v_c = \frac{1}{n_c}\sum_{j \in M_c} v_j, \qquad
    \beta_c = \log n_c

  Attention over the merged pairs with the bias :math:`\beta_c` added to the logits
  ("proportional attention") gives a cluster of n identical keys the softmax mass of its n
  copies: :math:`n e^{q\cdot \bar k} = \sum_{j\in M_c} e^{q\cdot k_j}` when the members are
  equal, so for exact duplicates it reproduces attention over the unmerged keys exactly
  (values and gradients); for near-duplicates it is first-order accurate in the spread.
  An empty cluster gets a zero key and value and a bias of ``-inf``, which
  :func:`jaxsoft.attention.dot_product_attention` treats as masked (weight exactly 0).

  Chelsea is an online KV-cache clustering method with "Chunked Soft Matching" (2025; its
  authors and full title are not recorded in this project's sources); the log-count bias is ToMe's proportional attention (D. Bolya,
  C.-Y. Fu, X. Dai, P. Zhang, C. Feichtenhofer, J. Hoffman, "Token Merging: Your ViT But
  Faster", ICLR 2023). [R] Whether Chelsea itself adds the bias is not established; the
  bias is what keeps softmax mass faithful.

  Args:
    key: [B, S, K, H].
    value: [B, S, K, Hv].
    assignment: int [B, S] (or [S], shared by the batch): the cluster of each key
      position, in ``[0, num_clusters)``; the same clusters for every key/value head.
    num_clusters: C, a static int >= 1; None = ``max(assignment) + 1`` (only when the
      assignment is concrete, i.e. not under jit). A concrete assignment outside
      ``[0, C)`` is a ValueError; a traced one cannot be checked, and an out-of-range
      position then joins no cluster (it is dropped).

  Returns:
    ``(merged_key [B, C, K, H], merged_value [B, C, K, Hv], bias [B, 1, 1, C])``: keys and
    values in their input dtypes, the bias in float32 (float64 for float64 keys),
    broadcastable to the logits [B, N, T, C] (pass it as ``bias=``).

  Examples:
    Two equal keys merged into one cluster: attention with the bias is unchanged.

    >>> k = jnp.array([1.0, 1.0, -1.0]).reshape(1, 3, 1, 1)  # keys 0 and 1 are equal
    >>> v = jnp.array([2.0, 2.0, 0.0]).reshape(1, 3, 1, 1)
    >>> q = jnp.ones((1, 1, 1, 1))
    >>> mk, mv, bias = js.attention.merge_kv(k, v, jnp.array([0, 0, 1]))
    >>> bool(jnp.allclose(js.attention.dot_product_attention(q, mk, mv, bias, scale=1.0),
    ...                   js.attention.dot_product_attention(q, k, v, scale=1.0)))
    True

  References:
    D. Bolya, C.-Y. Fu, X. Dai, P. Zhang, C. Feichtenhofer & J. Hoffman, 2023, "Token
    Merging: Your ViT But Faster" (ICLR 2023; the proportional-attention bias).

    Chelsea, 2025, online KV-cache clustering with chunked soft matching (authors and
    full title not recorded in this project's sources).
  """
  fn = "merge_kv"
  k, v = jnp.asarray(key), jnp.asarray(value)
  if k.ndim != 4:
    raise ValueError(f"{fn}: `key` must have shape [B, S, K, H], got {k.shape}")
  B, S, K, _ = k.shape
  if v.ndim != 4 or v.shape[:3] != (B, S, K):
    raise ValueError(f"{fn}: `value` must have shape [B, S, K, Hv] = [{B}, {S}, {K}, Hv], got {v.shape}")
  a = jnp.asarray(assignment)
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise ValueError(f"{fn}: `assignment` must be an integer array, got dtype {a.dtype}")
  if a.ndim == 1:
    a = a[None]
  if a.ndim != 2 or a.shape[1] != S or a.shape[0] not in (1, B):
    raise ValueError(f"{fn}: `assignment` must have shape [B, S] = [{B}, {S}] or [S], got {a.shape}")
  a = jnp.broadcast_to(a, (B, S)).astype(jnp.int32)
  values = concrete(a)
  if num_clusters is None:
    if values is None:
      raise ValueError(f"{fn}: `num_clusters` must be given when `assignment` is traced (jit)")
    num_clusters = int(values.max()) + 1 if values.size else 1
  C = check_int(num_clusters, "num_clusters", 1, fn)
  if values is not None and values.size and (values.min() < 0 or values.max() >= C):
    raise ValueError(
        f"{fn}: `assignment` values must lie in [0, num_clusters) = [0, {C}), got "
        f"[{values.min()}, {values.max()}]")
  cdt = compute_dtype(k.dtype)
  # one-hot [B, S, C]: the merge as two matmuls (no scatter; differentiable in k and v)
  onehot = jax.nn.one_hot(a, C, dtype=cdt)
  count = jnp.sum(onehot, axis=1)  # [B, C]
  inv = jnp.where(count > 0, 1.0 / jnp.where(count > 0, count, 1.0), 0.0)
  mk = jnp.einsum("bsc,bskh->bckh", onehot, k.astype(cdt)) * inv[:, :, None, None]
  mv = jnp.einsum("bsc,bskh->bckh", onehot, v.astype(cdt)) * inv[:, :, None, None]
  bias = jnp.where(count > 0, jnp.log(jnp.where(count > 0, count, 1.0)), -jnp.inf)
  return mk.astype(k.dtype), mv.astype(v.dtype), bias[:, None, None, :]


def alternating_matching(key: ArrayLike, *, chunk_size: int, num_merges: int) -> jax.Array:
  r"""Chunked alternating soft matching: which keys :func:`merge_kv` merges [R] (A48).

  Within each chunk of ``chunk_size`` positions, the even positions (set A) are matched to
  their most similar odd position (set B) by the cosine similarity of the keys (averaged
  over key/value heads), and the ``num_merges`` most similar (a, b) pairs of the chunk are
  merged (ToMe's bipartite soft matching): a merged a joins b's cluster. Clusters never
  cross a chunk boundary. [R] The abstract names the chunking and the alternating
  partition; the matching rule here is ToMe's.

  Args:
    key: [B, S, K, H]; S must be a multiple of ``chunk_size``.
    chunk_size: an even int >= 2.
    num_merges: merges per chunk, 0 <= num_merges <= chunk_size // 2.

  Returns:
    int32 [B, S] cluster ids in ``[0, S - (S / chunk_size) · num_merges)``, numbered in
    order of first position; pass it to :func:`merge_kv` with that ``num_clusters``.

  Examples:
    Two chunks of 4 keys, one merge each: keys 0 and 1 are equal, so key 0 joins key 1's
    cluster; in the second chunk keys 5 and 6 (equal) merge.

    >>> x = jnp.array([1.0, 1.0, 0.0, 1.0, 1.0, -1.0, -1.0, -1.0]).reshape(1, 8, 1, 1)
    >>> key = jnp.concatenate([x, jnp.ones_like(x)], axis=-1)   # [B, S, K, H] = [1, 8, 1, 2]
    >>> ids = js.attention.alternating_matching(key, chunk_size=4, num_merges=1)
    >>> ids
    Array([[0, 0, 1, 2, 3, 4, 4, 5]], dtype=int32)
    >>> merged_key, _, bias = js.attention.merge_kv(key, key, ids, num_clusters=6)
    >>> merged_key.shape
    (1, 6, 1, 2)

  References:
    D. Bolya, C.-Y. Fu, X. Dai, P. Zhang, C. Feichtenhofer & J. Hoffman, 2023, "Token
    Merging: Your ViT But Faster" (ICLR 2023; bipartite soft matching).

    Chelsea, 2025, online KV-cache clustering with chunked soft matching (authors and
    full title not recorded in this project's sources).
  """
  fn = "alternating_matching"
  k = jnp.asarray(key)
  if k.ndim != 4:
    raise ValueError(f"{fn}: `key` must have shape [B, S, K, H], got {k.shape}")
  B, S = k.shape[:2]
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or (
      chunk_size < 2 or chunk_size % 2 or S % chunk_size):
    raise ValueError(
        f"{fn}: `chunk_size` must be an even int >= 2 dividing S={S}, got {chunk_size!r}")
  half = chunk_size // 2
  check_int(num_merges, "num_merges", 0, fn, half)
  nc = S // chunk_size
  kc = k.astype(compute_dtype(k.dtype))
  kc = kc / jnp.maximum(jnp.linalg.norm(kc, axis=-1, keepdims=True), 1e-12)
  kc = kc.reshape(B, nc, half, 2, *k.shape[2:])
  ka, kb = kc[:, :, :, 0], kc[:, :, :, 1]  # [B, nc, half, K, H]
  sim = jnp.einsum("bcikh,bcjkh->bcij", ka, kb) / k.shape[2]
  best = jnp.argmax(sim, axis=-1)  # [B, nc, half]: the b of each a
  score = jnp.max(sim, axis=-1)
  order = jnp.argsort(-score, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)
  merged = rank < num_merges  # [B, nc, half]
  pos = jnp.arange(S, dtype=jnp.int32).reshape(nc, half, 2)
  a_pos, b_pos = pos[..., 0], pos[..., 1]  # [nc, half]
  target = jnp.where(merged, jnp.take_along_axis(
      jnp.broadcast_to(b_pos, (B, nc, half)), best, axis=-1), a_pos)
  root = jnp.stack([target, jnp.broadcast_to(b_pos, (B, nc, half))], axis=-1).reshape(B, S)
  # renumber the roots 0..C-1 in order of position
  is_root = jnp.zeros((B, S), jnp.int32).at[jnp.arange(B)[:, None], root].set(1)
  ids = jnp.cumsum(is_root, axis=-1) - 1
  return jnp.take_along_axis(ids, root, axis=-1).astype(jnp.int32)
