"""UniAttn's learned compensation (feature A22) as a Flax NNX module.

The computation is ``jaxsoft.attention``'s :func:`~jaxsoft.attention.uniattn`; this module
holds its parameter :math:`W_c`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.attention import uniattn

__all__ = ["UniAttnCompensation"]


class UniAttnCompensation(nnx.Module):
  r"""UniAttn's linear compensation for the L blocks of a superblock (feature A22) [R].

  The blocks of a superblock share the attention map A of the first one; a learned linear
  map from each block's input :math:`X_l` corrects the error of the reuse:

  .. math:: o_l = A\, V_l + X_l W_{c,l}

  computed by :func:`jaxsoft.attention.uniattn`. :math:`W_c` ``[L, C, N, Hv]`` starts at
  zero, so before post-training the superblock is plain map sharing (exact when the
  blocks' queries and keys agree).

  Args:
    num_layers: L, the blocks of the superblock.
    in_features: C, the blocks' input width.
    num_heads: N.
    head_dim: Hv, the value head size.
    param_dtype: the dtype of :math:`W_c`.

  Examples:
    >>> comp = js.nn.UniAttnCompensation(2, 3, 2, 4)   # L=2, C=3, N=2, Hv=4
    >>> comp.w_c.shape
    (2, 3, 2, 4)
    >>> a = jax.nn.softmax(jnp.zeros((1, 2, 5, 5)), -1)    # A [B, N, T, S]
    >>> v = jnp.ones((2, 1, 5, 2, 4))                      # V [L, B, S, K, Hv]
    >>> x = jnp.ones((2, 1, 5, 3))                         # X [L, B, T, C]
    >>> out = comp(a, v, x)
    >>> out.shape                                          # [L, B, T, N, Hv]
    (2, 1, 5, 2, 4)
    >>> bool(jnp.allclose(out, js.attention.uniattn(a, v)))   # W_c = 0 at init
    True

  References:
    Y. Xiong et al., 2025, "UniAttn: Reducing Inference Costs via Softmax Unification for
    Post-Training LLMs" (arXiv 2502.00439).
  """

  def __init__(self, num_layers: int, in_features: int, num_heads: int, head_dim: int, *,
               param_dtype: Any = jnp.float32) -> None:
    shape = tuple(positive_int(v, n, "UniAttnCompensation") for v, n in (
        (num_layers, "num_layers"), (in_features, "in_features"), (num_heads, "num_heads"),
        (head_dim, "head_dim")))
    self.w_c = nnx.Param(jnp.zeros(shape, param_dtype))

  def __call__(self, attn_map: ArrayLike, values: ArrayLike, x: ArrayLike) -> jax.Array:
    """attn_map [B, N, T, S], values [L, B, S, K, Hv], x [L, B, T, C] -> [L, B, T, N, Hv]."""
    return uniattn(attn_map, values, x, self.w_c[...])
