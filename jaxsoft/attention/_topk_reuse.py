"""Reusing top-k selections (feature A11): over decode steps and across layers.

Two ways to skip the O(S) selection of :func:`topk_attention`:

* TokenSelect's Selection Cache (``init_selection_cache``, ``selection_cache_step``): a
  decode step keeps the previous step's selected keys while the new query stays close
  (cosine similarity) to the query that made the selection;
* Kascade's anchor layers (``anchor_layer_scores``, ``select_anchor_layers``): a few anchor
  layers compute fresh top-k indices, the layers after each anchor reuse them; the anchors
  are chosen by dynamic programming over a [L, L] matrix of measured kept attention mass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_int, check_rank
from jaxsoft.attention._topk import SELECTIONS, topk_attention

__all__ = ["SelectionCache", "init_selection_cache", "selection_cache_step",
           "anchor_layer_scores", "select_anchor_layers"]


class SelectionCache(NamedTuple):
  """The state of :func:`selection_cache_step` (a pytree).

  Attributes:
    query: [B, N, H] the query that made the cached selection.
    indices: [B, N, k] int32 key positions selected for that query.
    valid: [B] bool; False until a first selection is made.
  """

  query: jax.Array
  indices: jax.Array
  valid: jax.Array


def init_selection_cache(batch: int, num_heads: int, head_dim: int, top_k: int,
                         dtype: Any = None) -> SelectionCache:
  """An empty Selection Cache for :func:`selection_cache_step` (the first step selects).

  Args:
    batch, num_heads, head_dim: B, N (query heads) and H of the decode queries.
    top_k: k, the number of kept keys.
    dtype: dtype of the stored query; default float32 (use float64 with float64 queries).

  Returns:
    A :class:`SelectionCache` with ``valid`` all False.

  Examples:
    >>> c = js.attention.init_selection_cache(1, 2, 4, top_k=3)
    >>> c.indices.shape, bool(c.valid.any())
    ((1, 2, 3), False)
  """
  fn = "init_selection_cache"
  b = check_int(batch, "batch", 1, fn)
  n = check_int(num_heads, "num_heads", 1, fn)
  h = check_int(head_dim, "head_dim", 1, fn)
  k = check_int(top_k, "top_k", 1, fn)
  dt = jnp.float32 if dtype is None else dtype
  return SelectionCache(jnp.zeros((b, n, h), dt), jnp.zeros((b, n, k), jnp.int32),
                        jnp.zeros((b,), bool))


def selection_cache_step(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, cache: SelectionCache, *,
    top_k: int, threshold: float, scale: float | None = None,
    key_value_seq_lengths: ArrayLike | None = None, selection: str = "soft_vote",
) -> tuple[jax.Array, SelectionCache, jax.Array]:
  r"""One decode step of top-k attention with TokenSelect's Selection Cache (A11).

  For each batch element, with :math:`q` the step's query (all heads flattened) and
  :math:`\bar q` the cached query that made the cached selection :math:`\bar I`:

  .. math::
    I = \begin{cases} \bar I & \text{if the cache is valid and }
        \cos(q, \bar q) \ge \theta \\
        \operatorname{top\text{-}k}(q) & \text{otherwise (and } (\bar q, \bar I) \leftarrow
        (q, I)) \end{cases}, \qquad
    o_h = \operatorname{softmax}(\ell_h[I])\, V_h[I]

  where top-k is :func:`topk_attention`'s selection (``selection``; TokenSelect's soft vote
  by default) and the attention over I is exact. When no batch element reselects, the step
  runs no O(S) scoring at all (a ``lax.cond``): its cost is that of k keys.

  [R] TokenSelect (Wu et al., 2025) reuses the selection while consecutive queries are
  similar; the catalogue writes the test as cos(q_{t+1}, q_t) > theta. Reconstructed here:
  the comparison is with the query that made the cached selection (not the previous
  step's query, so a slow drift cannot keep a stale selection forever), over the
  concatenated heads, reselecting when the similarity is below theta (>= reuses). Sink
  and local-window tokens are not forced in: keys appended after a selection are seen only
  after the next reselection.

  Args:
    query: [B, 1, N, H] the step's query (one token).
    key, value: [B, S, K, H], [B, S, K, Hv] the key/value cache (GQA as
      :func:`dot_product_attention`); positions at or beyond ``key_value_seq_lengths`` are
      invisible.
    cache: a :class:`SelectionCache` from :func:`init_selection_cache` or the previous step.
    top_k: k, an int in [1, S].
    threshold: theta, the cosine similarity at or above which the selection is reused
      (theta > 1 reselects every step).
    scale: the logit scale (default 1/sqrt(H)).
    key_value_seq_lengths: optional int [B], the number of valid keys.
    selection: ``"soft_vote"`` or ``"per_head"`` (as :func:`topk_attention`).

  Returns:
    ``(out, new_cache, reselected)``: out [B, 1, N, Hv] in query's dtype, the updated
    cache, and reselected [B] bool.

  Examples:
    Two steps with the same query: the second reuses the first step's selection.

    >>> q = jnp.ones((1, 1, 1, 2)); k = jnp.eye(4, 2)[None, :, None]; v = k
    >>> c = js.attention.init_selection_cache(1, 1, 2, top_k=2)
    >>> o, c, r = js.attention.selection_cache_step(q, k, v, c, top_k=2, threshold=0.9)
    >>> o2, c, r2 = js.attention.selection_cache_step(q, k, v, c, top_k=2, threshold=0.9)
    >>> bool(r[0]), bool(r2[0]), bool(jnp.all(o == o2))
    (True, False, True)

  References:
    W. Wu et al., 2025, "TokenSelect: Dynamic Token-Level KV Cache Selection for Efficient
    Long-Context Inference and Length Extrapolation" (EMNLP 2025, arXiv 2411.02886).
  """
  fn = "selection_cache_step"
  if selection not in SELECTIONS:
    raise ValueError(f"{fn}: `selection` must be one of {SELECTIONS}, got {selection!r}")
  q = check_rank(query, "query", 4, "[B, 1, N, H]", fn)
  k = check_rank(key, "key", 4, "[B, S, K, H]", fn)
  if q.shape[1] != 1:
    raise ValueError(f"{fn}: `query` must hold one decode token, [B, 1, N, H], got {q.shape}")
  B, _, N, H = q.shape
  S = k.shape[1]
  kk = check_int(top_k, "top_k", 1, fn, S)
  if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
    raise ValueError(f"{fn}: `threshold` must be a float, got {threshold!r}")
  if not isinstance(cache, SelectionCache):
    raise ValueError(f"{fn}: `cache` must be a SelectionCache, got {type(cache).__name__}")
  want = {"query": (B, N, H), "indices": (B, N, kk), "valid": (B,)}
  for name, shape in want.items():
    got = jnp.shape(getattr(cache, name))
    if got != shape:
      raise ValueError(f"{fn}: `cache.{name}` must have shape {shape}, got {got}")

  cdt = jnp.promote_types(q.dtype, jnp.float32)
  qf = q[:, 0].astype(cdt)  # [B, N, H]
  cq = cache.query.astype(cdt)
  flat, cflat = qf.reshape(B, -1), cq.reshape(B, -1)
  num = jnp.sum(flat * cflat, axis=-1)
  den = jnp.sqrt(jnp.sum(flat * flat, axis=-1) * jnp.sum(cflat * cflat, axis=-1))
  cos = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), -1.0)
  reselect = ~cache.valid | ~(cos >= threshold)
  cached = cache.indices.astype(jnp.int32)

  def fresh(_):
    _, idx = topk_attention(query, key, value, top_k=kk, selection=selection,
                            return_indices=True, implementation="xla", scale=scale,
                            key_value_seq_lengths=key_value_seq_lengths)
    return jnp.where(reselect[:, None, None], idx[:, :, 0], cached)

  idx = lax.cond(jnp.any(reselect), fresh, lambda _: cached, None)
  out = topk_attention(query, key, value, top_k=kk, indices=idx[:, :, None], scale=scale,
                       key_value_seq_lengths=key_value_seq_lengths)
  r = reselect[:, None, None]
  new = SelectionCache(jnp.where(r, qf, cq).astype(cache.query.dtype), idx,
                       cache.valid | reselect)
  return out, new, reselect


def anchor_layer_scores(weights: ArrayLike, top_k: int) -> jax.Array:
  r"""Kascade's cross-layer score matrix: the attention mass layer l keeps with layer a's top-k.

  With :math:`P^l` the attention weights of layer l (one row per query and head) and
  :math:`I^a` the per-row top-k key set of layer a (head-aware: each head its own set):

  .. math::
    M_{al} = \operatorname{mean}_{\text{rows}} \sum_{j \in I^a} P^l_j

  so :math:`M_{ll}` is the mass a layer keeps with its own top-k, and :math:`M_{al}` the
  mass it keeps when it reuses anchor a's indices. This is the input of
  :func:`select_anchor_layers` (measured on a development set).

  Args:
    weights: [L, ..., S] attention weights of L layers on the same queries (e.g.
      [L, B, N, T, S]; rows need not be normalised).
    top_k: k, an int in [1, S].

  Returns:
    [L, L] float32 (float64 under x64 for a float64 input), rows the anchor a, columns the
    layer l.

  Examples:
    >>> w = jnp.array([[[0.7, 0.2, 0.1]], [[0.1, 0.2, 0.7]]])  # two layers, one row
    >>> js.attention.anchor_layer_scores(w, top_k=1)
    Array([[0.7, 0.1],
           [0.1, 0.7]], dtype=float32)

  References:
    Kascade, 2025, training-free sparse attention that reuses anchor layers' exact top-k
    indices (authors and full title not recorded in this project's sources).
  """
  fn = "anchor_layer_scores"
  w = jnp.asarray(weights)
  if w.ndim < 2:
    raise ValueError(f"{fn}: `weights` must have shape [L, ..., S], got {w.shape}")
  kk = check_int(top_k, "top_k", 1, fn, w.shape[-1])
  w = w.astype(jnp.promote_types(w.dtype, jnp.float32))
  L = w.shape[0]
  rows = w.reshape(L, -1, w.shape[-1])  # [L, R, S]
  _, idx = lax.top_k(rows, kk)  # [L, R, k]
  kept = jnp.take_along_axis(rows[None], idx[:, None], axis=-1)  # [a, l, R, k]
  return jnp.mean(jnp.sum(kept, axis=-1), axis=-1)


def select_anchor_layers(scores: ArrayLike, num_anchors: int) -> tuple[jax.Array, jax.Array]:
  r"""Kascade's anchor layers by dynamic programming: which layers select, which reuse (A11).

  Layer 0 is an anchor; every other layer l either is an anchor (computes fresh top-k
  indices) or reuses the indices of the nearest anchor before it, :math:`a(l) = \max\{a
  \in A: a \le l\}`. With at most ``num_anchors`` anchors the choice maximises

  .. math::
    \sum_{l=0}^{L-1} M_{a(l)\, l}

  (M from :func:`anchor_layer_scores`). The DP over segments: with
  :math:`g(a, b) = \sum_{l=a}^{b-1} M_{al}` the score of anchor a serving layers a..b-1,
  :math:`F_m(b) = \max_{a<b} F_{m-1}(a) + g(a, b)`, :math:`F_0(0) = 0`, and the answer is
  :math:`\max_{m \le M} F_m(L)`, in O(M L^2).

  Args:
    scores: [L, L] M, rows the anchor, columns the layer (entries below the diagonal are
      unused).
    num_anchors: M, the budget of anchor layers, an int in [1, L].

  Returns:
    ``(assignment, total)``: int32 [L], the layer whose indices each layer uses
    (``assignment[l] == l`` for an anchor), and the maximised total score.

  Examples:
    Layers 0-1 agree, layers 2-3 agree: with two anchors, layers 0 and 2 select.

    >>> m = jnp.array([[1., .9, .1, .1], [0, 1, .1, .1], [0, 0, 1, .9], [0, 0, 0, 1]])
    >>> a, total = js.attention.select_anchor_layers(m, num_anchors=2)
    >>> a, total
    (Array([0, 0, 2, 2], dtype=int32), Array(3.8, dtype=float32))

  References:
    Kascade, 2025, training-free sparse attention that selects its anchor layers by a
    dynamic program maximising cross-layer top-k similarity on a development set
    (authors and full title not recorded in this project's sources).
  """
  fn = "select_anchor_layers"
  m = jnp.asarray(scores)
  if m.ndim != 2 or m.shape[0] != m.shape[1]:
    raise ValueError(f"{fn}: `scores` must have shape [L, L], got {m.shape}")
  L = m.shape[0]
  M = check_int(num_anchors, "num_anchors", 1, fn, L)
  m = m.astype(jnp.promote_types(m.dtype, jnp.float32))
  # C[a, b] = sum_{l < b} M[a, l];  G[a, b] = g(a, b) = C[a, b] - C[a, a] for a < b
  C = jnp.concatenate([jnp.zeros((L, 1), m.dtype), jnp.cumsum(m, axis=1)], axis=1)
  G = C - jnp.diagonal(C)[:L, None]  # [L, L+1]
  a_ix = jnp.arange(L)[:, None]
  b_ix = jnp.arange(L + 1)[None, :]
  G = jnp.where(a_ix < b_ix, G, -jnp.inf)
  neg = jnp.full((L + 1,), -jnp.inf, m.dtype)
  F0 = neg.at[0].set(0.0)

  def step(F, _):
    cand = F[:L, None] + G  # [a, b]
    return jnp.max(cand, axis=0), (jnp.max(cand, axis=0), jnp.argmax(cand, axis=0))

  _, (Fs, args) = lax.scan(step, F0, None, length=M)  # Fs[m-1] = F_m, [M, L+1]
  best_m = jnp.argmax(Fs[:, L])  # index m-1
  total = Fs[best_m, L]

  def back(i, carry):
    b, anchors = carry
    mi = best_m - i  # F_{mi+1}
    a = args[jnp.maximum(mi, 0), b]
    active = mi >= 0
    anchors = anchors | (active & (jnp.arange(L) == a))
    return jnp.where(active, a, b), anchors

  _, anchors = lax.fori_loop(0, M, back, (jnp.asarray(L), jnp.zeros((L,), bool)))
  assignment = lax.cummax(jnp.where(anchors, jnp.arange(L), 0).astype(jnp.int32), axis=0)
  return assignment, total
