"""UniAttn (feature A22): one attention map computed once and reused by a superblock.

:func:`uniattn_shared_map` is the dense map of the superblock's first block;
:func:`uniattn` applies it to every block's values plus a linear compensation. A
reconstruction from its paper; dense (O(T·S) memory per head).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_rank
from jaxsoft.attention._dense import dense_weights
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["uniattn_shared_map", "uniattn"]

_HI = lax.Precision.HIGHEST
_MAP_ARGUMENTS = frozenset({
    "scale", "is_causal", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
    "segment_ids", "logits_soft_cap", "normalizer", "normalizer_params", "decay_bias"})


def attention_map(fn: str, query, key, bias, mask, kwargs: Mapping[str, Any]) -> jax.Array:
  """The dense weights [B, N, T, S] that ``dot_product_attention`` would apply (float32,
  float64 for float64 inputs): same validation, masks, GQA and normalizers; exact zeros
  off the visible set. Shared with :func:`infsa_attention`."""
  q = check_rank(query, "query", 4, "[B, T, N, H]", fn)
  k = check_rank(key, "key", 4, "[B, S, K, H]", fn)
  dummy_v = jnp.zeros(k.shape[:3] + (1,), jnp.float32)
  _, weights, _ = dense_weights(fn, q, k, dummy_v, bias, mask, kwargs, _MAP_ARGUMENTS)
  return weights


def uniattn_shared_map(query: ArrayLike, key: ArrayLike, bias: ArrayLike | None = None,
                       mask: ArrayLike | None = None, **kwargs: Any) -> jax.Array:
  r"""UniAttn's shared attention map: the dense weights a superblock computes once (A22) [R].

  .. math:: A = f\big(s\, Q K^\top + \mathrm{bias}\big) \text{ over the visible keys}

  the dense weights :func:`dot_product_attention` would apply (softmax by default: rows
  with a visible key sum to 1), for the first block of a superblock; :func:`uniattn`
  applies it to the values of every block.

  Args:
    query: [B, T, N, H]; key: [B, S, K, H] (GQA when N % K == 0).
    bias, mask: as :func:`dot_product_attention`.
    **kwargs: ``scale``, ``is_causal``, the sequence lengths, ``local_window_size``,
      ``segment_ids``, ``logits_soft_cap``, ``normalizer``, ``normalizer_params``,
      ``decay_bias``, as :func:`dot_product_attention`.

  Returns:
    [B, N, T, S] in float32 (float64 for float64 inputs); exact zeros off the visible set.

  Examples:
    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> a = js.attention.uniattn_shared_map(q, jnp.cos(q), is_causal=True)
    >>> a.shape
    (1, 2, 4, 4)
    >>> a[0, 0]   # head 0: causal rows summing to 1
    Array([[1.    , 0.    , 0.    , 0.    ],
           [0.4914, 0.5086, 0.    , 0.    ],
           [0.3467, 0.333 , 0.3204, 0.    ],
           [0.2343, 0.2446, 0.2561, 0.265 ]], dtype=float32)

  References:
    Y. Xiong et al., 2025, "UniAttn: Reducing Inference Costs via Softmax Unification for
    Post-Training LLMs" (arXiv 2502.00439).
  """
  return attention_map("uniattn_shared_map", query, key, bias, mask, kwargs)


def uniattn(attn_map: ArrayLike, values: ArrayLike, x: ArrayLike | None = None,
            w_c: ArrayLike | None = None) -> jax.Array:
  r"""UniAttn: one shared attention map applied to several blocks' values (A22) [R].

  Consecutive transformer blocks form a superblock; the softmax map A of its first block
  (:func:`uniattn_shared_map`) is reused by every block l, and a linear projection
  compensates the error of the reuse:

  .. math:: o_l = A\, V_l + X_l W_{c,l}

  so the later blocks need neither keys (no K cache) nor a softmax. With the same queries
  and keys in every block and :math:`W_c = 0` it is exact. [R] The compensation is
  written as one matrix per block from that block's input X_l to its attention output;
  the paper's exact placement is not established.

  Args:
    attn_map: A [B, N, T, S] (e.g. from :func:`uniattn_shared_map`); differentiable.
    values: [L, B, S, K, Hv] (L blocks) or [B, S, K, Hv] (one block); N % K == 0 (GQA:
      query head n reads value head n // (N / K)).
    x: optional block inputs [L, B, T, C] (or [B, T, C] for 4-D ``values``).
    w_c: optional compensation [L, C, N, Hv] (or [C, N, Hv]); given with ``x``.

  Returns:
    [L, B, T, N, Hv] (or [B, T, N, Hv]) in the values' dtype (computed in float32 at least: bf16 and fp16 widen, float64 stays).

  Examples:
    Two blocks sharing the first block's map: exact attention for a block with the same
    queries and keys; the compensation adds :math:`X_l W_{c,l}`.

    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k = jnp.cos(q)
    >>> a = js.attention.uniattn_shared_map(q, k, is_causal=True)
    >>> values = jnp.stack([q, 2.0 * q])                    # [L, B, S, K, Hv]
    >>> out = js.attention.uniattn(a, values)
    >>> out.shape
    (2, 1, 4, 2, 8)
    >>> bool(jnp.allclose(out[1], js.attention.dot_product_attention(
    ...     q, k, 2.0 * q, is_causal=True), atol=1e-6))
    True
    >>> x = jnp.ones((2, 1, 4, 3))             # [L, B, T, C]
    >>> w_c = jnp.full((2, 3, 2, 8), 0.1)      # [L, C, N, Hv]
    >>> bool(jnp.allclose(js.attention.uniattn(a, values, x, w_c) - out, 0.3))
    True

  References:
    Y. Xiong et al., 2025, "UniAttn: Reducing Inference Costs via Softmax Unification for
    Post-Training LLMs" (arXiv 2502.00439).
  """
  fn = "uniattn"
  a = check_rank(attn_map, "attn_map", 4, "[B, N, T, S]", fn)
  v = jnp.asarray(values)
  if v.ndim not in (4, 5):
    raise ValueError(f"{fn}: `values` must have shape [L, B, S, K, Hv] or [B, S, K, Hv], "
                     f"got {v.shape}")
  single = v.ndim == 4
  if single:
    v = v[None]
  L, B, S, K, Hv = v.shape
  if a.shape[0] != B or a.shape[3] != S:
    raise ValueError(f"{fn}: `attn_map` must have shape [B, N, T, S] = [{B}, N, T, {S}] to "
                     f"match `values`, got {a.shape}")
  N, T = a.shape[1], a.shape[2]
  if K == 0 or N % K:
    raise ValueError(f"{fn}: `values` heads K={K} must divide the map's heads N={N}")
  if (x is None) != (w_c is None):
    raise ValueError(f"{fn}: `x` and `w_c` must be given together (got only "
                     f"`{'x' if w_c is None else 'w_c'}`)")
  out_dtype = v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else jnp.float32
  cdt = compute_dtype(jnp.promote_types(a.dtype, v.dtype))
  ag = a.astype(cdt).reshape(B, K, N // K, T, S)
  out = jnp.einsum("bkgts,lbskh->lbtkgh", ag, v.astype(cdt), precision=_HI)
  out = out.reshape(L, B, T, N, Hv)
  if x is not None:
    xa, wa = jnp.asarray(x), jnp.asarray(w_c)
    x_shape, w_shape = xa.shape, wa.shape
    if single:
      xa, wa = xa[None], wa[None]
    if xa.ndim != 4 or xa.shape[:3] != (L, B, T):
      lay = "[B, T, C]" if single else "[L, B, T, C]"
      raise ValueError(f"{fn}: `x` must have shape {lay} with L={L}, B={B}, T={T}, got "
                       f"{x_shape}")
    C = xa.shape[3]
    if wa.shape != (L, C, N, Hv):
      lay = f"[C, N, Hv] = [{C}, {N}, {Hv}]" if single else f"[L, C, N, Hv] = [{L}, {C}, {N}, {Hv}]"
      raise ValueError(f"{fn}: `w_c` must have shape {lay}, got {w_shape}")
    out = out + jnp.einsum("lbtc,lcnh->lbtnh", xa.astype(cdt), wa.astype(cdt), precision=_HI)
  out = out.astype(out_dtype)
  return out[0] if single else out
