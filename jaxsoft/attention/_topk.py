"""Top-k attention (feature A11): each query attends to its k highest-scoring keys.

Two selection rules (per head; TokenSelect's soft vote across heads) and two ways to find
the selected keys: ``"xla"`` (``lax.top_k`` over the dense logits, O(T·S) memory) and
``"xla_chunked"`` (a loop over key blocks carrying each row's running top-k; never a
T x S array). Both end in the same exact attention over the k gathered keys, whose
gradient flows through the gathered logits (the selection itself is piecewise constant).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_int
from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention.call import AttentionCall
from jaxsoft.attention.masks import MaskStructure, positions_visible

__all__ = ["topk_attention", "SELECTIONS"]

SELECTIONS = ("per_head", "soft_vote")
BLOCK_K = 512


def _gqa_take(x, idx, K: int, G: int):
  """``x`` [B, S, K, H] gathered at ``idx`` [B, N, T, k] -> [B, N, T, k, H] (head n reads
  key/value head n // G, as jax.nn's GQA). One gather in place: no transposed copy of the
  [B, S, K, H] cache (a decode step over a long cache reads only the k rows it keeps)."""
  B = x.shape[0]
  N = idx.shape[1]
  b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
  h = (jnp.arange(N, dtype=jnp.int32) // G)[None, :, None, None]
  return x[b, idx, h]


def _take_pairs(a, idx):
  """A [b, n, t, s]-broadcastable array at key positions ``idx`` [B, N, T, k] (the
  leading dimensions broadcast; nothing of size T x S is built)."""
  if a.shape[3] == 1:
    return a
  return jnp.take_along_axis(a, idx, axis=3)


def _visible_at(st: MaskStructure, idx, mask):
  """Whether query i sees key ``idx[b, n, i, r]`` by structure and ``mask``: [B, N, T, k]."""
  rows = jnp.arange(st.T, dtype=jnp.int32)[None, None, :, None]
  q_len = None if st.q_lengths is None else st.q_lengths[:, None, None, None]
  kv_len = st.S if st.kv_lengths is None else jnp.minimum(st.kv_lengths[:, None, None, None], st.S)
  vis = positions_visible(rows, idx, is_causal=st.is_causal, window=st.window, q_len=q_len,
                          kv_len=kv_len)
  if st.q_segment_ids is not None and st.kv_segment_ids is not None:
    B = idx.shape[0]
    q_seg = st.q_segment_ids[:, None, :, None]
    kv_seg = jnp.take_along_axis(st.kv_segment_ids[:, None, None, :],
                                 idx.reshape(B, 1, 1, -1), axis=3).reshape(idx.shape)
    vis = vis & (q_seg == kv_seg)
  if mask is not None:
    vis = vis & _take_pairs(mask, idx)
  return vis


def _attend_selected(call, idx):
  """Exact softmax attention of each query over its selected keys ``idx`` [B, N, T, k]."""
  q, k, v = call.q, call.k, call.v
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  idx = jnp.clip(lax.stop_gradient(idx), 0, k.shape[1] - 1).astype(jnp.int32)
  cdt = jnp.promote_types(q.dtype, jnp.float32)
  ks = _gqa_take(k.astype(cdt), idx, K, G)  # [B, N, T, k, H]
  vs = _gqa_take(v.astype(cdt), idx, K, G)
  qn = jnp.transpose(q.astype(cdt), (0, 2, 1, 3))  # [B, N, T, H]
  logits = call.scale * jnp.einsum("bnth,bntrh->bntr", qn, ks)
  if call.bias is not None:
    logits = logits + _take_pairs(call.bias.astype(cdt), idx)
  vis = _visible_at(call.structure, idx, call.mask) & (logits > -jnp.inf)
  # duplicate indices (a row with fewer visible keys than k) count once
  first = jnp.ones(idx.shape, bool)
  if idx.shape[-1] > 1:
    order = jnp.argsort(idx, axis=-1)
    sorted_idx = jnp.take_along_axis(idx, order, axis=-1)
    dup_sorted = jnp.concatenate(
        [jnp.zeros(idx.shape[:-1] + (1,), bool), sorted_idx[..., 1:] == sorted_idx[..., :-1]], -1)
    dup = jnp.zeros(idx.shape, bool).at[
        tuple(jnp.indices(idx.shape)[:-1]) + (order,)].set(dup_sorted)
    first = ~dup
  vis = vis & first
  z = jnp.where(vis, logits, -jnp.inf)
  m = lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(vis, jnp.exp(jnp.where(vis, logits, m) - m), 0.0)
  den = jnp.sum(e, axis=-1, keepdims=True)
  w = e / jnp.where(den > 0, den, 1.0)
  out = jnp.einsum("bntr,bntrh->btnh", w, vs)
  return out.astype(q.dtype)


def _dense_selection(call, top_k: int, selection: str):
  st = call.structure
  logits = dense_logits(call.q, call.k, scale=call.scale, bias=call.bias)
  vis = jnp.broadcast_to(st.dense(), logits.shape) & (logits > -jnp.inf)
  if call.mask is not None:
    vis = vis & call.mask
  if selection == "per_head":
    score = jnp.where(vis, logits, -jnp.inf)
  else:
    z = jnp.where(vis, logits, -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(jnp.where(vis, logits, m) - m), 0.0)
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(e.dtype).tiny)
    vote = jnp.sum(p, axis=1, keepdims=True)  # [B, 1, T, S]
    score = jnp.where(jnp.any(vis, axis=1, keepdims=True), vote, -jnp.inf)
  _, idx = lax.top_k(lax.stop_gradient(score), top_k)
  return jnp.broadcast_to(idx, logits.shape[:3] + (top_k,))


def _chunked_selection(call, top_k: int, selection: str, block_k: int):
  """The top-k indices by a loop over key blocks: memory O(T·(k + block_k)) per head."""
  q, k = call.q, call.k
  B, T, N, _ = q.shape
  S = k.shape[1]
  bk = min(block_k, S)
  nk = -(-S // bk)
  Sp = nk * bk
  cdt = jnp.promote_types(q.dtype, jnp.float32)
  st = call.structure
  qs = lax.stop_gradient(q.astype(cdt))
  kp = jnp.pad(lax.stop_gradient(k.astype(cdt)), ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
  bias = None if call.bias is None else lax.stop_gradient(call.bias.astype(cdt))
  mask = call.mask
  if bias is not None and bias.shape[3] != 1:
    bias = jnp.pad(bias, ((0, 0),) * 3 + ((0, Sp - S),))
  if mask is not None and mask.shape[3] != 1:
    mask = jnp.pad(mask, ((0, 0),) * 3 + ((0, Sp - S),))

  def block(j):
    ks = j * bk
    kb = lax.dynamic_slice_in_dim(kp, ks, bk, 1)
    pos = ks + jnp.arange(bk, dtype=jnp.int32)
    logits = dense_logits(qs, kb, scale=call.scale)  # [B, N, T, bk]
    if bias is not None:
      b = bias if bias.shape[3] == 1 else lax.dynamic_slice_in_dim(bias, ks, bk, 3)
      logits = logits + b
    idx = jnp.broadcast_to(pos, (B, N, T, bk))
    vis = _visible_at(st, idx, None) & (logits > -jnp.inf)
    if mask is not None:
      vis = vis & (mask if mask.shape[3] == 1 else lax.dynamic_slice_in_dim(mask, ks, bk, 3))
    return logits, vis, pos

  lse = jnp.zeros((B, N, T), cdt)  # the per-head log-sum-exp (soft vote only)
  if selection == "soft_vote":
    def lse_step(j, carry):
      m, l = carry
      logits, vis, _ = block(j)
      bm = jnp.max(jnp.where(vis, logits, -jnp.inf), axis=-1)
      m_new = jnp.maximum(m, bm)
      m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      l = l * jnp.where(jnp.isfinite(m), jnp.exp(m - m_use), 0.0) + jnp.sum(
          jnp.where(vis, jnp.exp(jnp.where(vis, logits, m_use[..., None]) - m_use[..., None]),
                    0.0), axis=-1)
      return m_new, l

    m, l = lax.fori_loop(0, nk, lse_step, (jnp.full((B, N, T), -jnp.inf, cdt),
                                           jnp.zeros((B, N, T), cdt)))
    lse = jnp.where(l > 0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(l > 0, l, 1.0)),
                    jnp.inf)
  heads = N if selection == "per_head" else 1

  def topk_step(j, carry):
    vals, idx = carry
    logits, vis, pos = block(j)
    if selection == "per_head":
      score = jnp.where(vis, logits, -jnp.inf)
    else:
      p = jnp.where(vis, jnp.exp(jnp.where(vis, logits, 0.0) - lse[..., None]), 0.0)
      score = jnp.where(jnp.any(vis, axis=1, keepdims=True),
                        jnp.sum(p, axis=1, keepdims=True), -jnp.inf)
    cand = jnp.concatenate([vals, score], axis=-1)
    cand_idx = jnp.concatenate([idx, jnp.broadcast_to(pos, score.shape)], axis=-1)
    vals, where = lax.top_k(cand, top_k)
    return vals, jnp.take_along_axis(cand_idx, where, axis=-1)

  init = (jnp.full((B, heads, T, top_k), -jnp.inf, cdt),
          jnp.zeros((B, heads, T, top_k), jnp.int32))
  _, idx = lax.fori_loop(0, nk, topk_step, init)
  return jnp.broadcast_to(idx, (B, N, T, top_k))


def topk_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
    mask: ArrayLike | None = None, *, top_k: int, scale: float | None = None,
    is_causal: bool = False, query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    selection: str = "per_head", indices: ArrayLike | None = None,
    return_indices: bool = False, implementation: str | None = None,
    block_k: int = BLOCK_K) -> Any:
  r"""Top-k attention: softmax over each query's k highest-scoring visible keys (A11).

  With :math:`\ell_{ij} = s\, q_i \cdot k_j + \mathrm{bias}_{ij}` over the visible keys
  :math:`V_i` (the mask arguments of :func:`dot_product_attention`):

  .. math::
    I_i = \operatorname{top\text{-}k}_{j \in V_i}\ \sigma_{ij}, \qquad
    o_i = \sum_{j \in I_i} \frac{e^{\ell_{ij}}}{\sum_{j' \in I_i} e^{\ell_{ij'}}}\, v_j

  exactly (no approximation once I is chosen), where the selection score sigma is

  * ``selection="per_head"``: the head's own logit, :math:`\sigma = \ell` (each query and
    head keeps its own k keys; the exact per-head top-k of Kascade, 2025, a training-free
    sparse attention that reuses anchor layers' top-k indices; authors and full title not
    recorded here);
  * ``selection="soft_vote"``: TokenSelect's per-head soft vote, shared by the heads of a
    query: :math:`\sigma_{ij} = \sum_h \mathrm{softmax}_j(\ell^h_{i\cdot})_j` (each head's
    normalised distribution counts equally), from TokenSelect ("Dynamic Token-Level KV Cache
    Selection", W. Wu et al., EMNLP 2025, arXiv 2411.02886). [R] The vote formula is the catalogue's reconstruction
    of "per-head soft voting"; the Selection Cache and sink/local windows are not included
    (pass a ``local_window_size`` to restrict the candidates instead).

  A row with fewer than k visible keys attends to all of them (k >= S is exact softmax
  attention); a row with none returns zeros. Kascade's cross-layer reuse: take
  ``return_indices=True`` in an anchor layer and pass ``indices=`` in the next layers.

  The kept softmax mass bounds the error: with :math:`m_I` the full-softmax mass of I,
  :math:`\|o_i - o^{\mathrm{dense}}_i\| \le 2 (1 - m_I) \max_j \|v_j\|`.

  Args:
    query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
      key_value_seq_lengths, local_window_size, segment_ids: as
      :func:`dot_product_attention` ([B, T, N, H], [B, S, K, H], [B, S, K, Hv]; GQA).
    top_k: k, an int in [1, S].
    selection: ``"per_head"`` or ``"soft_vote"``.
    indices: optional int [B, N, T, k] key positions to use instead of selecting
      (e.g. from an earlier layer); their visibility is still applied.
    return_indices: also return the selected positions [B, N, T, k] (int32; for a row
      with fewer visible keys than k, the extra entries are arbitrary and unused).
    implementation: ``"xla"`` (dense selection), ``"xla_chunked"`` (selection by a loop
      over key blocks of ``block_k``; no T x S array, also in the gradient) or None
      (chunked when T·S >= 1024·1024).
    block_k: key block of the chunked selection.

  Returns:
    [B, T, N, Hv] in query's dtype (computed in float32 for bf16/fp16), and the indices
    when ``return_indices``. Differentiable in query, key, value and bias.

  Examples:
    One query, four keys with scores 1, 0.5, -1, 2 and one-hot values: the two best keys
    share the softmax of their own scores, the others get exactly 0.

    >>> q, k, v = js.testing.weight_probe(jnp.array([1.0, 0.5, -1.0, 2.0]))  # output = weights
    >>> js.attention.topk_attention(q, k, v, top_k=2, scale=1.0)[0, 0, 0]
    Array([0.2689, 0.    , 0.    , 0.7311], dtype=float32)

  References:
    W. Wu et al., 2025, "TokenSelect: Dynamic Token-Level KV Cache Selection" (EMNLP 2025,
    arXiv 2411.02886; the per-head soft vote).

    Kascade, 2025, training-free sparse attention reusing anchor layers' top-k indices
    (authors and full title not recorded in this project's sources).
  """
  fn = "topk_attention"
  if selection not in SELECTIONS:
    raise ValueError(f"{fn}: `selection` must be one of {SELECTIONS}, got {selection!r}")
  if implementation not in (None, "xla", "xla_chunked"):
    raise ValueError(
        f"{fn}: `implementation` must be None, 'xla' or 'xla_chunked', got {implementation!r}")
  check_int(block_k, "block_k", 1, fn)
  if jnp.ndim(query) != 4:
    raise ValueError(f"{fn}: `query` must have shape [B, T, N, H], got {jnp.shape(query)}")
  call = AttentionCall.create(
      query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids)
  B, T, N, _ = call.q.shape
  S = call.k.shape[1]
  if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= S:
    raise ValueError(f"{fn}: `top_k` must be an int in [1, S={S}], got {top_k!r}")
  if indices is not None:
    idx = jnp.asarray(indices)
    if idx.shape != (B, N, T, top_k) or not jnp.issubdtype(idx.dtype, jnp.integer):
      raise ValueError(
          f"{fn}: `indices` must be an int array [B, N, T, top_k] = {[B, N, T, top_k]}, got "
          f"{idx.shape} {idx.dtype}")
  else:
    chunked = implementation == "xla_chunked" or (implementation is None and T * S >= 1 << 20)
    if chunked:
      idx = _chunked_selection(call, int(top_k), selection, int(block_k))
    else:
      idx = _dense_selection(call, int(top_k), selection)
  out = _attend_selected(call, idx)
  if return_indices:
    return out, lax.stop_gradient(idx).astype(jnp.int32)
  return out
