"""Block Attention Residuals (A46): a layer's input as softmax attention over the completed
blocks' representations and the current block's partial sum, instead of their plain sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive

__all__ = ["block_attention_residual"]


def block_attention_residual(sources: ArrayLike, query: ArrayLike, *,
                             eps: float = 1e-6) -> jax.Array:
  r"""Block Attention Residuals: depth-wise softmax attention over block summaries (A46).

  A PreNorm stack adds every layer's output to one residual stream with weight 1. Block
  AttnRes groups the layers into blocks, keeps plain residual sums within a block, and builds
  the input of a layer from the N completed blocks' representations :math:`v_0, \dots,
  v_{N-1}` and the current block's partial sum :math:`v_N` (``sources``) by one learned
  pseudo-query :math:`w \in \mathbb{R}^d` per layer (``query``), per token:

  .. math::
    h = \sum_{i=0}^{N} \alpha_i v_i, \qquad
    \alpha = \mathrm{softmax}_i\big(w \cdot \hat v_i\big), \qquad
    \hat v_i = \frac{v_i}{\sqrt{\mathrm{mean}(v_i^2) + \epsilon}}

  (keys RMS-normalised, values not; an RMSNorm gain is absorbed into w). ``query`` = 0 gives
  the mean of the sources; the result is a convex combination of them, invariant to their
  order. Full AttnRes is the case of one layer per block.

  Args:
    sources: ``[S, ..., d]``: the S = N + 1 block representations along axis 0 (completed
      blocks, then the partial sum), each ``[..., d]`` (e.g. ``[B, T, d]``).
    query: ``[d]`` the layer's pseudo-query w.
    eps: the RMS normaliser's :math:`\epsilon > 0`.

  Returns:
    ``[..., d]`` in ``sources``' dtype (the softmax in float32).

  Examples:
    >>> v = jnp.array([[[1.0, 1.0]], [[3.0, -1.0]]])        # S = 2 sources, one token, d = 2
    >>> js.nn.block_attention_residual(v, jnp.zeros(2))     # w = 0: their mean
    Array([[2., 0.]], dtype=float32)

  References:
    Kimi Team (G. Chen et al.), 2026, "Attention Residuals" (Moonshot AI; arXiv, March
    2026).
  """
  fn = "block_attention_residual"
  v = jnp.asarray(sources)
  w = jnp.asarray(query)
  if v.ndim < 2 or not jnp.issubdtype(v.dtype, jnp.floating):
    raise ValueError(f"{fn}: `sources` must be a floating [S, ..., d] array, got {v.shape} "
                     f"{v.dtype}")
  if v.shape[0] == 0:
    raise ValueError(f"{fn}: `sources` must hold at least one block (S >= 1)")
  if w.shape != v.shape[-1:]:
    raise ValueError(f"{fn}: `query` must be [d] = {v.shape[-1:]}, got {w.shape}")
  e = check_positive(eps, "eps", fn)
  ct = jnp.promote_types(v.dtype, jnp.float32)
  vc = v.astype(ct)
  keys = vc * jax.lax.rsqrt(jnp.mean(vc * vc, axis=-1, keepdims=True) + e)
  logits = jnp.einsum("s...d,d->s...", keys, w.astype(ct))
  alpha = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("s...,s...d->...d", alpha, vc).astype(v.dtype)
