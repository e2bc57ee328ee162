"""Tensor (triple-wise) attention (feature A24): each query attends to pairs of keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_rank
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["tensor_attention"]

_HI = lax.Precision.HIGHEST


def tensor_attention(query: ArrayLike, key1: ArrayLike, key2: ArrayLike, value1: ArrayLike,
                     value2: ArrayLike, *, scale: float | None = None,
                     is_causal: bool = False) -> jax.Array:
  r"""Tensor (triple-wise) attention: each query attends to pairs of keys (feature A24).

  .. math::
    \ell_{i,(j,k)} = s \sum_h q_{ih}\, k^{(1)}_{jh}\, k^{(2)}_{kh}, \qquad
    o_i = \sum_{j,k} \frac{e^{\ell_{i,(j,k)}}}{\sum_{j',k'} e^{\ell_{i,(j',k')}}}
          \big(v^{(1)}_j \odot v^{(2)}_k\big)

  i.e. :math:`D^{-1} \exp(Q (K_1 \oslash K_2)^\top)(V_1 \oslash V_2)` with the row-wise
  Kronecker product :math:`\oslash`. With ``key2`` and ``value2`` all ones it is standard
  softmax attention on (query, key1, value1). With ``is_causal`` query i sees the pairs
  with j <= i and k <= i. Dense: O(T·S^2·H) time and O(T·S^2) memory per head (the paper's
  point is that faster algorithms exist only for small entries).

  Args:
    query: [B, T, N, H]; key1, key2: [B, S, N, H]; value1, value2: [B, S, N, Hv].
    scale: s; None = 1/sqrt(H) (so that key2 = 1 reduces to dot_product_attention's
      default).
    is_causal: restrict the pairs to j, k <= i.

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside). Differentiable in all five arrays.

  Examples:
    With ``key2`` and ``value2`` all ones it is standard softmax attention:

    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k, v = jnp.cos(q), q
    >>> ones = jnp.ones_like(k)
    >>> out = js.attention.tensor_attention(q, k, ones, v, ones, is_causal=True)
    >>> out.shape
    (1, 4, 2, 8)
    >>> bool(jnp.allclose(out, js.attention.dot_product_attention(q, k, v, is_causal=True),
    ...                   atol=1e-5))
    True

  References:
    J. Alman & Z. Song, 2024, "How to Capture Higher-order Correlations? Generalizing
    Matrix Softmax Attention to Kronecker Computation" (ICLR 2024, arXiv 2310.04064).
  """
  fn = "tensor_attention"
  q = check_rank(query, "query", 4, "[B, T, N, H]", fn)
  ks = [check_rank(a, n, 4, "[B, S, N, H]", fn) for a, n in ((key1, "key1"), (key2, "key2"))]
  vs = [check_rank(a, n, 4, "[B, S, N, Hv]", fn) for a, n in ((value1, "value1"),
                                                                 (value2, "value2"))]
  B, T, N, H = q.shape
  for a, n in zip(ks, ("key1", "key2"), strict=True):
    if a.shape[0] != B or a.shape[2:] != (N, H) or a.shape[1] != ks[0].shape[1]:
      raise ValueError(f"{fn}: `{n}` must have shape [B, S, N, H] = [{B}, S, {N}, {H}], got {a.shape}")
  S = ks[0].shape[1]
  for a, n in zip(vs, ("value1", "value2"), strict=True):
    if a.shape[:3] != (B, S, N) or a.shape[3] != vs[0].shape[3]:
      raise ValueError(
          f"{fn}: `{n}` must have shape [B, S, N, Hv] = [{B}, {S}, {N}, Hv] (one Hv for both), "
          f"got {a.shape}")
  out_dtype = q.dtype
  cdt = compute_dtype(q.dtype)
  s = 1.0 / float(H) ** 0.5 if scale is None else scale
  q, k1, k2, v1, v2 = (a.astype(cdt) for a in (q, *ks, *vs))
  logits = s * jnp.einsum("binh,bjnh,bknh->bnijk", q, k1, k2, precision=_HI)
  if is_causal:
    i = jnp.arange(T)[:, None, None]
    vis = (jnp.arange(S)[None, :, None] <= i) & (jnp.arange(S)[None, None, :] <= i)
    logits = jnp.where(vis, logits, -jnp.inf)
  w = jax.nn.softmax(logits.reshape(B, N, T, S * S), axis=-1).reshape(B, N, T, S, S)
  # sum_{j,k} w_ijk (v1_j ⊙ v2_k) without forming the S^2 x Hv Kronecker values
  out = jnp.einsum("bnijk,bjnh,bknh->binh", w, v1, v2, precision=_HI)
  return out.astype(out_dtype)
