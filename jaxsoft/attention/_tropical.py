"""A16 tropical attention: max-plus scores and max-plus aggregation as one attention function,
through the masks (built on the two N39 helpers of :mod:`jaxsoft.normalizers`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import boolean_mask
from jaxsoft.attention import masks as _masks
from jaxsoft.attention._checks import check_rank
from jaxsoft.attention.call import gqa_dims
from jaxsoft.normalizers import tropical_hilbert_scores, tropical_max_plus
from jaxsoft.normalizers.common import compute_dtype, output_dtype

__all__ = ["tropical_attention"]

_SCORES = ("hilbert", "max_plus")


def _lengths(lengths, b: int, name: str, fn: str):
  if lengths is None:
    return None
  a = jnp.asarray(lengths)
  if a.shape != (b,) or not jnp.issubdtype(a.dtype, jnp.integer):
    raise ValueError(f"{fn}: `{name}` must be an integer array of shape [B] = [{b}], got "
                     f"{a.dtype} {a.shape}")
  return a[:, None, None, None]


def tropical_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                       mask: ArrayLike | None = None, *, score: str = "hilbert",
                       eps: float = 0.0, is_causal: bool = False,
                       query_seq_lengths: ArrayLike | None = None,
                       key_value_seq_lengths: ArrayLike | None = None) -> jax.Array:
  r"""Tropical attention: max-plus scores and max-plus aggregation (feature A16).

  From Hashemi, Pasque, Teska & Yoshida, "Tropical Attention: Neural Algorithmic Reasoning
  for Combinatorial Algorithms" (2025): attention carried out in the max-plus semiring,
  where the softmax-weighted sum becomes a max and the product a sum. For each head, with
  :math:`V_i` the keys query i sees,

  .. math::
    S_{ij} = -d_H(q_i, k_j) = -\Big(\max_r (q_{i,r} - k_{j,r})
                                     - \min_r (q_{i,r} - k_{j,r})\Big)
    \quad\text{(``score="hilbert"``)}, \qquad
    S_{ij} = \max_r (q_{i,r} + k_{j,r}) \quad\text{(``score="max_plus"``)},

  .. math::
    o_{i,r} = \max_{j \in V_i} (S_{ij} + v_{j,r}), \qquad
    o^{\epsilon}_{i,r} = \epsilon \log \sum_{j \in V_i} e^{(S_{ij} + v_{j,r})/\epsilon}
    \ \ (\epsilon > 0).

  The Hilbert score is the tropical projective metric (non-negative, symmetric,
  ``d_H(q, q + c 1) = 0``), the paper's main rule; the max-plus inner product is its code's
  variant without the metric. There is no normalisation, so no dilution with length:
  keys whose :math:`S_{ij} + v_j` is dominated leave the hard output unchanged however
  many are appended; ``o`` is translation equivariant in the values (``v + c`` gives
  ``o + c``), monotone and 1-Lipschitz in the sup norm, piecewise linear. The smooth
  version (the code's temperature is 1/eps) satisfies ``o <= o^eps <= o + eps log n``.
  The paper's layer wraps this core in a valuation map ``x -> log1p(relu(W x)) - lambda``
  and per-head max-plus linear maps before it and ``expm1`` after it; those are
  projections of the layer, not of the attention function.

  Dense reference: the ``[B, N, T, S, Hv]`` sums are formed (each output channel has its
  own maximiser), so memory grows with ``T S Hv``.

  Args:
    query: ``[B, T, N, H]``.
    key: ``[B, S, K, H]`` (N % K == 0: query head n reads key/value head ``n // (N / K)``).
    value: ``[B, S, K, Hv]``.
    mask: optional boolean mask broadcastable to ``[B, N, T, S]``; False keys are left out.
    score: ``"hilbert"`` (default) or ``"max_plus"``.
    eps: smoothing eps >= 0 (a Python number); 0 is the hard max-plus product.
    is_causal: query i sees keys j <= i.
    query_seq_lengths: optional ``[B]`` integer lengths; queries past them output 0.
    key_value_seq_lengths: optional ``[B]`` integer lengths; keys past them are left out.

  Returns:
    ``[B, T, N, Hv]`` in the promoted floating dtype of the inputs (bf16/fp16 computed in
    float32; float64 stays float64); a query with no visible key gives 0 with zero
    gradient.

  Examples:
    One query, three keys on one head: Hilbert distances 0, 1 and 4 (the first key is the
    query shifted by 2, distance 0), so ``o = max(0 + v_0, -1 + v_1, -4 + v_2)``:

    >>> q = jnp.array([0.0, 1.0]).reshape(1, 1, 1, 2)                      # [B, T, N, H]
    >>> k = jnp.array([[2.0, 3.0], [0.0, 0.0], [0.0, -3.0]]).reshape(1, 3, 1, 2)
    >>> v = jnp.array([1.0, 3.0, 10.0]).reshape(1, 3, 1, 1)
    >>> js.attention.tropical_attention(q, k, v)[0, 0, 0]
    Array([6.], dtype=float32)
    >>> js.attention.tropical_attention(q, k, v, jnp.array([True, True, False]))[0, 0, 0]
    Array([2.], dtype=float32)

  References:
    K. Hashemi, T. Pasque, C. Teska & R. Yoshida, 2025, "Tropical Attention: Neural
    Algorithmic Reasoning for Combinatorial Algorithms" (arXiv 2505.17190).
  """
  fn = "tropical_attention"
  q = check_rank(query, "query", 4, "[B, T, N, H]", fn)
  k = check_rank(key, "key", 4, "[B, S, K, H]", fn)
  v = check_rank(value, "value", 4, "[B, S, K, Hv]", fn)
  for name, a in (("query", q), ("key", k), ("value", v)):
    if not (jnp.issubdtype(a.dtype, jnp.floating) or jnp.issubdtype(a.dtype, jnp.integer)):
      raise ValueError(f"{fn}: `{name}` must have a real dtype, got {a.dtype}")
  b, t, n, h, s, kh = gqa_dims(q, k, v, fn)
  if score not in _SCORES:
    raise ValueError(f"{fn}: `score` must be one of {_SCORES}, got {score!r}")
  try:
    eps_f = float(eps)
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise ValueError(f"{fn}: `eps` must be a Python number, got {eps!r}") from None
  if not eps_f >= 0.0:
    raise ValueError(f"{fn}: `eps` must be >= 0, got {eps!r}")
  out = output_dtype(jnp.result_type(q.dtype, k.dtype, v.dtype))
  cdt = compute_dtype(out)
  g = n // kh
  # [B, K, G, T, H] queries against [B, K, 1, S, H] keys and values: no copy per group
  qg = jnp.transpose(q.astype(cdt).reshape(b, t, kh, g, h), (0, 2, 3, 1, 4))
  kg = jnp.transpose(k.astype(cdt), (0, 2, 1, 3))[:, :, None]
  vg = jnp.transpose(v.astype(cdt), (0, 2, 1, 3))[:, :, None]
  if score == "hilbert":
    scores = tropical_hilbert_scores(qg, kg)
  else:
    scores = jnp.max(qg[..., :, None, :] + kg[..., None, :, :], axis=-1)
  visible = jnp.ones((1, 1, 1, 1), bool)
  if mask is not None:
    visible = visible & boolean_mask(mask, (b, n, t, s), "mask", fn, "[B, N, T, S] =")
  rows = jnp.arange(t, dtype=jnp.int32)[None, None, :, None]  # rank 4, as the lengths
  cols = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]   # (no implicit rank promotion)
  pos = _masks.positions_visible(
      rows, cols, is_causal=bool(is_causal),
      q_len=_lengths(query_seq_lengths, b, "query_seq_lengths", fn),
      kv_len=_lengths(key_value_seq_lengths, b, "key_value_seq_lengths", fn))
  if pos is not None:
    visible = visible & pos.reshape((1,) * (4 - pos.ndim) + pos.shape)
  visible = jnp.broadcast_to(visible, (b, n, t, s)).reshape(b, kh, g, t, s)
  o = tropical_max_plus(scores, vg, visible, eps=eps_f)            # [B, K, G, T, Hv]
  o = jnp.transpose(o.reshape(b, n, t, v.shape[3]), (0, 2, 1, 3))
  return o.astype(out)
