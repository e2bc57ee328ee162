"""Attention controls (feature A49): token mixing with one of attention's principles removed.

H. Xue, N. S. Moosavi & N. Aletras (2025, "Deconstructing Attention") relax attention's principles one at a time:
mixing across positions, sequence-dependent weights, the dot-product + softmax form, and
queries / keys computed from the current hidden states. The controls here are the three
building blocks of such variants (reconstructions [R]: the paper's exact definitions are not
in its abstract):

* :func:`no_mixing_attention`: no token mixing, each position's output is its own value;
* :func:`fixed_map_attention`: a sequence-independent map (a fixed or learned ``T x S``
  score matrix through any normalizer, e.g. zeros -> the uniform causal average);
* :func:`embedding_qk_attention`: queries and keys from embeddings that do not depend on
  the tokens (learned position embeddings, or fixed random ones), values from the tokens.

Their hybrids with real attention (some heads or some layers real) are
:class:`jaxsoft.nn.AttentionControl` (``real_heads``) and train/'s ``--layers``.

References:
  H. Xue, N. S. Moosavi & N. Aletras, 2025, "Deconstructing Attention: Investigating Design
  Principles for Effective Language Modeling" (arXiv 2510.11602).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.attention._api import dot_product_attention
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import spec as _spec

__all__ = ["no_mixing_attention", "fixed_map_attention", "embedding_qk_attention"]

Normalizer = str | _spec.NormalizerSpec | Callable[..., Any]


def _values(value: ArrayLike, fn: str) -> jax.Array:
  """``value`` as a real array ``[..., S, K, Hv]``; ValueError naming ``fn`` otherwise."""
  v = jnp.asarray(value)
  c.check_real(v, fn)
  if v.ndim < 3:
    raise ValueError(f"{fn}: `value` must have shape [..., S, K, Hv], got {v.shape}")
  return v


def _heads(num_heads: int, kv_heads: int, what: str, fn: str) -> None:
  if num_heads % kv_heads:
    raise ValueError(f"{fn}: the {num_heads} heads of {what} must be a multiple of the "
                     f"{kv_heads} heads of `value` (GQA: head n uses value head "
                     f"n // (N / K))")


def _shared_weights_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                              bias: jax.Array | None, mask: ArrayLike | None,
                              dtype: Any, fn: str, **kwargs: Any) -> jax.Array:
  """``dot_product_attention`` of batch-free ``query [T, N, H]`` and ``key [S, K, H]``
  against ``value [..., S, K, Hv]``: the weights are the same for every batch row, so the
  batch rides along in the values' feature axis and the normalizer runs once."""
  if mask is not None and jnp.ndim(mask) > 3:
    raise ValueError(f"{fn}: `mask` must broadcast to [N, T, S] (no batch axis), got shape "
                     f"{jnp.shape(mask)}")
  lead, (s, k, hv) = value.shape[:-3], value.shape[-3:]
  folded = jnp.moveaxis(value.reshape(-1, s, k, hv), 0, -2).reshape(s, k, -1)  # [S, K, B·Hv]
  out = dot_product_attention(query, key, folded, bias, mask, **kwargs)      # [T, N, B·Hv]
  t, n = out.shape[:2]
  out = jnp.moveaxis(out.reshape(t, n, -1, hv), -2, 0).reshape(*lead, t, n, hv)
  return out.astype(dtype)


def no_mixing_attention(value: ArrayLike, *, num_heads: int | None = None) -> jax.Array:
  r"""The no-token-mixing control of attention: each position's output is its own value (A49).

  .. math::
    o_{i,n} = v_{i,\lfloor n / G \rfloor}, \qquad G = N / K

  the attention map replaced by the identity :math:`W = I` (each query sees only its own
  key, with weight 1), so no information moves between positions; with ``num_heads`` N a
  multiple of the value heads K, query head n reads value head ``n // G`` (GQA, as
  :func:`~jaxsoft.attention.dot_product_attention`). Causal and bidirectional at once. In
  the paper's words such a model collapses "to near-random behavior": a layer stack of
  these is a per-token MLP.

  Args:
    value: V ``[..., T, K, Hv]``.
    num_heads: N, the output heads (default K).

  Returns:
    ``[..., T, N, Hv]`` in ``value``'s dtype.

  Examples:
    >>> v = jnp.arange(6.0).reshape(3, 1, 2)            # [T, K, Hv]
    >>> js.attention.no_mixing_attention(v, num_heads=2)[:, :, 0]
    Array([[0., 0.],
           [2., 2.],
           [4., 4.]], dtype=float32)

  References:
    Xue, Moosavi & Aletras, 2025, "Deconstructing Attention" (arXiv 2510.11602):
    the control without mixing across positions.
  """
  fn = "no_mixing_attention"
  v = _values(value, fn)
  kv = v.shape[-2]
  if num_heads is None:
    return v
  if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
    raise ValueError(f"{fn}: `num_heads` must be a positive int, got {num_heads!r}")
  _heads(num_heads, kv, "`num_heads`", fn)
  return jnp.repeat(v, num_heads // kv, axis=-2)


def fixed_map_attention(scores: ArrayLike, value: ArrayLike, *, mask: ArrayLike | None = None,
                        is_causal: bool = True, normalizer: Normalizer = "softmax",
                        normalizer_params: Mapping[str, Any] | None = None,
                        implementation: Any = "xla") -> jax.Array:
  r"""Attention through a fixed, sequence-independent map: the A49 control of input dependence.

  .. math::
    W_{n} = f\big(S_{n};\ \mathrm{where} = M\big), \qquad
    o_{i,n} = \sum_{j \in M_i} W_{n,ij}\, v_{j,\lfloor n/G \rfloor}

  with S the ``scores`` (a constant or a learned parameter, never a function of the input),
  f any normalizer of the registry over the key axis, and M the visible keys (``mask`` and,
  with ``is_causal``, j <= i). ``scores = 0`` with softmax is the uniform causal average
  :math:`o_i = \frac{1}{i+1} \sum_{j \le i} v_j` (the "fixed causal averaging matrix" of
  the catalogue's claim (b)). The normalizer runs once for the whole batch (the map has no
  batch axis); the call is :func:`~jaxsoft.attention.dot_product_attention` with zero
  queries and keys and ``bias=scores``, so every normalizer, mask rule and implementation
  of the entry point applies (a row with no visible key gives 0).

  Args:
    scores: S ``[T, S]`` (one map for every head) or ``[N, T, S]`` (one per head; N a
      multiple of the value heads K). No batch axis: the map does not depend on the input.
    value: V ``[..., S, K, Hv]``.
    mask: optional boolean, broadcastable to ``[N, T, S]``; True = visible.
    is_causal: query i sees keys j <= i (top-left aligned when T != S).
    normalizer: a registered name, a NormalizerSpec or a callable (as
      :func:`~jaxsoft.attention.dot_product_attention`).
    normalizer_params: the normalizer's hyperparameters (a per-head array is ``[N, 1, 1]``).
    implementation: as :func:`~jaxsoft.attention.dot_product_attention`; default ``"xla"``,
      the dense map computed once for the batch (O(N·T·S) memory; ``"xla_chunked"`` for
      long sequences). The batch rides in the values' width, a layout the GPU kernels were
      not measured on: pass them explicitly.

  Returns:
    ``[..., T, N, Hv]`` in the dtype ``scores`` and ``value`` promote to (bf16 computed in
    float32).

  Examples:
    >>> v = jnp.array([1.0, 2.0, 3.0, 6.0]).reshape(4, 1, 1)       # [T, K, Hv]
    >>> js.attention.fixed_map_attention(jnp.zeros((4, 4)), v)[:, 0, 0]   # causal average
    Array([1. , 1.5, 2. , 3. ], dtype=float32)
    >>> near = -0.5 * jnp.abs(jnp.arange(4.0)[:, None] - jnp.arange(4.0)[None, :])   # a recency map
    >>> js.attention.fixed_map_attention(near, v, normalizer="sparsemax")[:, 0, 0]
    Array([1.  , 1.75, 2.75, 5.25], dtype=float32)

  References:
    Xue, Moosavi & Aletras, 2025, "Deconstructing Attention" (arXiv 2510.11602):
    the control of sequence-dependent weights.
  """
  fn = "fixed_map_attention"
  v = _values(value, fn)
  s_ = jnp.asarray(scores)
  c.check_real(s_, fn)
  if s_.ndim not in (2, 3):
    raise ValueError(f"{fn}: `scores` must have shape [T, S] or [N, T, S] (no batch axis: "
                     f"the map does not depend on the input), got {s_.shape}")
  if s_.shape[-1] != v.shape[-3]:
    raise ValueError(f"{fn}: `scores` has {s_.shape[-1]} keys but `value` has "
                     f"{v.shape[-3]} positions")
  kv = v.shape[-2]
  n = kv if s_.ndim == 2 else s_.shape[0]
  _heads(n, kv, "`scores`", fn)
  t = s_.shape[-2]
  dtype = jnp.result_type(s_, v)
  zq = jnp.zeros((t, n, 1), dtype)  # (in the output's dtype: a float32 map keeps float32)
  zk = jnp.zeros((v.shape[-3], kv, 1), dtype)
  return _shared_weights_attention(
      zq, zk, v, s_, mask, dtype, fn, scale=1.0, is_causal=is_causal, normalizer=normalizer,
      normalizer_params=normalizer_params, implementation=implementation)


def embedding_qk_attention(query_embeddings: ArrayLike, key_embeddings: ArrayLike,
                           value: ArrayLike, *, mask: ArrayLike | None = None,
                           scale: float | None = None, is_causal: bool = True,
                           normalizer: Normalizer = "softmax",
                           normalizer_params: Mapping[str, Any] | None = None,
                           implementation: Any = "xla") -> jax.Array:
  r"""Attention whose queries and keys do not come from the tokens: the A49 control of Q/K.

  .. math::
    W_n = f\big(s\, \tilde Q_n \tilde K_n^\top;\ \mathrm{where} = M\big), \qquad
    o_{i,n} = \sum_{j \in M_i} W_{n,ij}\, v_{j,\lfloor n/G \rfloor}

  with :math:`\tilde Q, \tilde K` computed from embeddings that do not depend on the input
  (learned position embeddings: "static"; fixed random ones: "random"; e.g.
  :math:`\tilde Q = P W_Q,\ \tilde K = P W_K` of positions P) while the values V come from
  the tokens, s the ``scale`` (default :math:`1/\sqrt{H}`), f any normalizer and M the
  visible keys. The map is then sequence-independent, as :func:`fixed_map_attention`'s, in
  a factored form of rank H per head; the normalizer runs once for the whole batch.

  Args:
    query_embeddings: :math:`\tilde Q` ``[T, N, H]`` (no batch axis).
    key_embeddings: :math:`\tilde K` ``[S, K, H]``, K the heads of ``value`` (N a multiple
      of K).
    value: V ``[..., S, K, Hv]``.
    scale: the logit scale (default ``1/sqrt(H)``).
    mask, is_causal, normalizer, normalizer_params, implementation: as in
      :func:`fixed_map_attention`.

  Returns:
    ``[..., T, N, Hv]`` in the dtype of the three inputs (as jnp promotes; bf16 computed in
    float32).

  Examples:
    >>> pos = jnp.stack([jnp.cos(jnp.arange(4.0)), jnp.sin(jnp.arange(4.0))], -1)
    >>> e = pos.reshape(4, 1, 2)                   # [T, N, H]: position-only embeddings
    >>> v = jnp.array([1.0, 2.0, 3.0, 6.0]).reshape(4, 1, 1)
    >>> js.attention.embedding_qk_attention(e, e, v, scale=4.0)[:, 0, 0]
    Array([1.    , 1.8628, 2.8573, 5.5763], dtype=float32)

  References:
    Xue, Moosavi & Aletras, 2025, "Deconstructing Attention" (arXiv 2510.11602):
    the control of queries and keys computed from the hidden states.
  """
  fn = "embedding_qk_attention"
  v = _values(value, fn)
  q, k = jnp.asarray(query_embeddings), jnp.asarray(key_embeddings)
  for name, a in (("query_embeddings", q), ("key_embeddings", k)):
    c.check_real(a, fn)
    if a.ndim != 3:
      raise ValueError(f"{fn}: `{name}` must have shape [T, N, H] (no batch axis: they do "
                       f"not depend on the input), got {a.shape}")
  if k.shape[:2] != v.shape[-3:-1]:
    raise ValueError(f"{fn}: `key_embeddings` must have the positions and heads of `value` "
                     f"{v.shape[-3:-1]}, got {k.shape[:2]}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"{fn}: `query_embeddings` and `key_embeddings` must have one width H, "
                     f"got {q.shape[-1]} and {k.shape[-1]}")
  _heads(q.shape[1], k.shape[1], "`query_embeddings`", fn)
  return _shared_weights_attention(
      q, k, v, None, mask, jnp.result_type(q, k, v), fn, scale=scale, is_causal=is_causal,
      normalizer=normalizer, normalizer_params=normalizer_params,
      implementation=implementation)
