"""Product-key memory (feature A47): exact top-k over N = n^2 keys from two top-k's over n."""

from __future__ import annotations

from typing import cast

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Dtype
from jax.typing import ArrayLike

from jaxsoft._validation import finite_float, positive_int
from jaxsoft.nn._fast_weight_product_key_memory import fast_weight_pkm
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["ProductKeyMemory", "product_key_topk"]


def product_key_topk(query: ArrayLike, sub_keys1: ArrayLike, sub_keys2: ArrayLike,
                     top_k: int) -> tuple[jax.Array, jax.Array]:
  r"""The exact top-k of :math:`s_{(a,b)} = q^{(1)} \cdot c^{(1)}_a + q^{(2)} \cdot
  c^{(2)}_b` over all n^2 product keys, from the top-k of each half.

  The query splits into halves :math:`q = [q^{(1)}; q^{(2)}]`. Any pair in the overall
  top-k has both of its halves in their half's top-k (a pair with a worse half is beaten
  by k pairs that share its other half), so the top-k of the k x k candidate sums is
  exact: O(n·d + k^2) instead of O(n^2·d).

  Args:
    query: [..., heads, d] (d even).
    sub_keys1, sub_keys2: [heads, n, d / 2].
    top_k: k <= n.

  Returns:
    ``(scores [..., heads, k], indices [..., heads, k])``, scores descending, indices
    ``a · n + b`` in [0, n^2) (int32).

  Examples:
    >>> q = jnp.array([[1.0, 0.0, 0.0, 1.0]])                   # [heads=1, d=4]
    >>> c1 = jnp.array([[[1.0, 0.0], [0.5, 0.0], [-1.0, 0.0]]])   # half scores 1, .5, -1
    >>> c2 = jnp.array([[[0.0, 1.0], [0.0, 0.25], [0.0, -1.0]]])  # half scores 1, .25, -1
    >>> scores, idx = js.nn.product_key_topk(q, c1, c2, 2)
    >>> scores, idx                                  # (a, b) = (0, 0) and (1, 0)
    (Array([[2. , 1.5]], dtype=float32), Array([[0, 3]], dtype=int32))

  References:
    G. Lample, A. Sablayrolles, M. Ranzato, L. Denoyer & H. Jégou, 2019, "Large Memory
    Layers with Product Keys".
  """
  q = jnp.asarray(query)
  c1, c2 = jnp.asarray(sub_keys1), jnp.asarray(sub_keys2)
  h, n, half = c1.shape
  if c2.shape != c1.shape or q.shape[-2:] != (h, 2 * half):
    raise ValueError(
        f"product_key_topk: `query` [..., heads, d] = [..., {h}, {2 * half}] and sub-keys "
        f"[heads, n, d/2] must agree, got {q.shape}, {c1.shape}, {c2.shape}")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n:
    raise ValueError(f"product_key_topk: `top_k` must be an int in [1, n={n}], got {top_k!r}")
  cdt = compute_dtype(q.dtype)
  s1 = jnp.einsum("...hd,hnd->...hn", q[..., :half].astype(cdt), c1.astype(cdt))
  s2 = jnp.einsum("...hd,hnd->...hn", q[..., half:].astype(cdt), c2.astype(cdt))
  v1, i1 = jax.lax.top_k(s1, top_k)
  v2, i2 = jax.lax.top_k(s2, top_k)
  cand = (v1[..., :, None] + v2[..., None, :]).reshape(*v1.shape[:-1], top_k * top_k)
  scores, flat = jax.lax.top_k(cand, top_k)
  a = jnp.take_along_axis(i1, flat // top_k, axis=-1)
  b = jnp.take_along_axis(i2, flat % top_k, axis=-1)
  return scores, (a * n + b).astype(jnp.int32)


class ProductKeyMemory(nnx.Module):
  r"""A product-key memory layer (feature A47).

  Per head h: :math:`q_h = x W_q^{(h)}`, the exact top-k product keys
  (:func:`product_key_topk`), weights :math:`w = \mathrm{softmax}(s_{I})` over those k,
  and the output :math:`\sum_h \sum_{i \in I_h} w_i\, V_i` from one shared value table
  :math:`V \in \mathbb{R}^{n^2 \times d_v}`. Only k rows of V per head and token receive
  gradient (a sparse update).

  From G. Lample, A. Sablayrolles, M. Ranzato, L. Denoyer, H. Jégou, "Large Memory Layers
  with Product Keys" (NeurIPS 2019).

  ``fast_weights=True`` is FwPKM (fast-weight product-key memory, 2025): inputs are
  sequences ``[..., T, d_in]``, ``value_table`` is the initial state of a fast-weight table
  that is rewritten chunk by chunk (:func:`fast_weight_pkm`) toward write targets
  :math:`v_t = x_t W_v` (``w_target``): chunk c reads the table written by chunks < c.
  [R]: the reconstruction loss and the single SGD step per chunk are reconstructed (see
  :func:`fast_weight_pkm_update`).

  Args:
    in_features: d_in; key_dim: d (even; split into two halves of d/2);
    num_sub_keys: n (the memory has n^2 slots); value_dim: d_v (default d_in);
    top_k: k <= n; num_heads: heads (their outputs are summed);
    fast_weights: the FwPKM mode (needs ``chunk_size``); chunk_size: tokens per write;
    inner_learning_rate: the fast-weight step size (>= 0; default 1.0);
    param_dtype: parameter dtype; rngs: nnx.Rngs.

  Examples:
    >>> pkm = js.nn.ProductKeyMemory(8, key_dim=4, num_sub_keys=3, top_k=2, rngs=nnx.Rngs(0))
    >>> pkm.value_table.shape                        # n^2 = 9 slots of d_v = 8
    (9, 8)
    >>> x = jnp.ones((2, 8))
    >>> pkm(x).shape
    (2, 8)
    >>> weights, idx = pkm.lookup(x)                 # softmax over the k = 2 slots read
    >>> weights.sum(-1)
    Array([[1.],
           [1.]], dtype=float32)
    >>> fw = lambda x: js.nn.ProductKeyMemory(8, key_dim=4, num_sub_keys=3, top_k=2,
    ...     fast_weights=True, chunk_size=2, rngs=nnx.Rngs(0))(x)   # FwPKM: x is [..., T, d_in]
    >>> jax.eval_shape(fw, jnp.ones((3, 6, 8))).shape              # T a multiple of chunk_size
    (3, 6, 8)

  References:
    G. Lample, A. Sablayrolles, M. Ranzato, L. Denoyer & H. Jégou, 2019, "Large Memory
    Layers with Product Keys".
  """

  def __init__(self, in_features: int, *, key_dim: int, num_sub_keys: int, top_k: int,
               value_dim: int | None = None, num_heads: int = 1, fast_weights: bool = False,
               chunk_size: int | None = None, inner_learning_rate: float = 1.0,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs) -> None:
    value_dim = in_features if value_dim is None else value_dim
    for arg, val in (("in_features", in_features), ("key_dim", key_dim),
                     ("num_sub_keys", num_sub_keys), ("top_k", top_k), ("value_dim", value_dim),
                     ("num_heads", num_heads)):
      positive_int(val, arg, "ProductKeyMemory")
    if key_dim % 2:
      raise ValueError(f"ProductKeyMemory: `key_dim` must be even, got {key_dim}")
    if top_k > num_sub_keys:
      raise ValueError(
          f"ProductKeyMemory: `top_k` ({top_k}) must be <= `num_sub_keys` ({num_sub_keys})")
    self.top_k = top_k
    if not isinstance(fast_weights, bool):
      raise ValueError(f"ProductKeyMemory: `fast_weights` must be a bool, got {fast_weights!r}")
    self.fast_weights = fast_weights
    self.chunk_size = chunk_size
    self.inner_learning_rate = finite_float(inner_learning_rate, "inner_learning_rate",
                                            "ProductKeyMemory")
    if self.inner_learning_rate < 0:
      raise ValueError("ProductKeyMemory: `inner_learning_rate` must be >= 0, got "
                       f"{inner_learning_rate!r}")
    if fast_weights:
      positive_int(chunk_size, "chunk_size", "ProductKeyMemory")
    elif chunk_size is not None:
      raise ValueError("ProductKeyMemory: `chunk_size` is for `fast_weights=True` only")
    init = initializers.lecun_normal()
    self.w_query = nnx.Param(init(rngs.params(), (in_features, num_heads * key_dim), param_dtype))
    self.num_heads, self.key_dim = num_heads, key_dim
    shape = (num_heads, num_sub_keys, key_dim // 2)
    self.sub_keys1 = nnx.Param(jax.random.normal(rngs.params(), shape, param_dtype)
                               / jnp.sqrt(key_dim / 2).astype(param_dtype))
    self.sub_keys2 = nnx.Param(jax.random.normal(rngs.params(), shape, param_dtype)
                               / jnp.sqrt(key_dim / 2).astype(param_dtype))
    self.value_table = nnx.Param(jax.random.normal(
        rngs.params(), (num_sub_keys * num_sub_keys, value_dim), param_dtype)
        / jnp.sqrt(value_dim).astype(param_dtype))
    if fast_weights:
      self.w_target = nnx.Param(init(rngs.params(), (in_features, value_dim), param_dtype))

  def lookup(self, x: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """``(weights [..., heads, k], indices [..., heads, k])`` for inputs ``x [..., d_in]``."""
    x = jnp.asarray(x)
    cdt = compute_dtype(x.dtype)
    q = (x.astype(cdt) @ self.w_query[...].astype(cdt)).reshape(
        *x.shape[:-1], self.num_heads, self.key_dim)
    scores, idx = product_key_topk(q, self.sub_keys1[...], self.sub_keys2[...], self.top_k)
    return jax.nn.softmax(scores, axis=-1), idx

  def __call__(self, x: ArrayLike) -> jax.Array:
    """``x [..., d_in] -> [..., d_v]`` in x's dtype (``[..., T, d_in]`` with fast weights)."""
    x = jnp.asarray(x)
    if self.fast_weights and x.ndim < 2:
      raise ValueError(
          f"ProductKeyMemory: with `fast_weights` `x` must be [..., T, d_in], got {x.shape}")
    w, idx = self.lookup(x)
    if self.fast_weights:
      cdt = w.dtype
      tgt = x.astype(cdt) @ self.w_target[...].astype(cdt)
      lead, (T, h, k) = x.shape[:-2], w.shape[-3:]
      run = jax.vmap(lambda w_, i_, t_: fast_weight_pkm(
          self.value_table[...], w_, i_, t_, chunk_size=cast(int, self.chunk_size),
          learning_rate=self.inner_learning_rate)[0])
      out = run(w.reshape(-1, T, h, k), idx.reshape(-1, T, h, k), tgt.reshape(-1, T, tgt.shape[-1]))
      return out.reshape(*lead, T, -1).astype(x.dtype)
    vals = jnp.take(self.value_table[...].astype(w.dtype), idx, axis=0)  # [..., heads, k, d_v]
    return jnp.einsum("...hk,...hkv->...v", w, vals).astype(x.dtype)
