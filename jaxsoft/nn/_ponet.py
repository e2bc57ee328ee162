"""PoNet's pooling token mixer (feature A51) as a Flax NNX layer.

The computation is ``jaxsoft.attention``'s :func:`~jaxsoft.attention.ponet_mix`; this module
holds the projections of its inputs and its output projection.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft._validation import head_layout, positive_int
from jaxsoft.attention import ponet_mix

__all__ = ["PoNetMixer"]


class PoNetMixer(nnx.Module):
  r"""PoNet's multi-granularity pooling token mixer, a drop-in for self-attention (A51).

  .. math::
    Q, K, O, S, L = x W_Q, x W_K, x W_O, x W_S, x W_L, \qquad
    y = \mathrm{ponet\_mix}(Q, K, O, S, L)\, W_{out}

  each projection ``d -> N·H`` with a bias, split into N heads of H; the global path's values
  are its keys, as in the authors' code (C.-H. Tan et al. 2022). :func:`~jaxsoft.attention.ponet_mix`
  gives the math: the global token (the mean query attending to the sequence), the max over
  the token's segment and over a local window, fused as ``(g + s) ⊙ O + l``. The paper's
  layer then adds the residual and a LayerNorm (a BERT block); that is the caller's, as for
  any attention layer. Linear in T (O(T^2) in the global path with ``causal=True``, a
  reconstruction: the paper's model is an encoder).

  Args:
    d_model: the width ``d`` of ``x``.
    num_heads: N.
    head_dim: H (default ``d_model // num_heads``).
    window: the local max-pooling window (odd unless ``causal``; 3 in the authors' code).
    segment_size: fixed segments of this many tokens, used when the call gives no
      ``segment_ids`` (None: the call must give them).
    causal: the causal reconstruction of :func:`~jaxsoft.attention.ponet_mix`.
    use_bias: biases on the projections (the authors' code has them).
    dtype: the computation dtype of the projections.
    param_dtype: the dtype of the parameters.
    rngs: the parameters' random streams.

  Returns:
    Called on ``x [..., T, d]`` (with ``mask`` and ``segment_ids`` broadcastable to
    ``[..., T]``, as in :func:`~jaxsoft.attention.ponet_mix`): ``[..., T, d]``, whose
    masked tokens hold the output projection's bias.

  Examples:
    >>> layer = js.nn.PoNetMixer(8, num_heads=2, segment_size=4, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 8))
    >>> y = layer(x, mask=jnp.arange(6) < 5)
    >>> y.shape
    (2, 6, 8)
    >>> x2 = x.at[:, 5].set(1e3)                         # padding never leaks
    >>> bool(jnp.allclose(layer(x2, mask=jnp.arange(6) < 5)[:, :5], y[:, :5]))
    True

  References:
    C.-H. Tan, Q. Chen, W. Wang, Q. Zhang, S. Zheng & Z.-H. Ling, 2022, "PoNet: Pooling
    Network for Efficient Token Mixing in Long Sequences" (ICLR 2022).
  """

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, *,
               window: int = 3, segment_size: int | None = None, causal: bool = False,
               use_bias: bool = True, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
    name = type(self).__name__
    d, n, h = head_layout(d_model, num_heads, head_dim, name)
    w = positive_int(window, "window", name)
    if not isinstance(causal, bool):
      raise ValueError(f"{name}: `causal` must be a bool, got {causal!r}")
    if not causal and w % 2 == 0:
      raise ValueError(f"{name}: `window` must be odd unless `causal`, got {w}")
    self.segment_size: int | None = (
        None if segment_size is None else positive_int(segment_size, "segment_size", name))
    self.num_heads: int = n
    self.head_dim: int = h
    self.window: int = w
    self.causal: bool = causal
    linear = functools.partial(nnx.Linear, use_bias=use_bias, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
    self.query: nnx.Linear = linear(d, n * h)
    self.key: nnx.Linear = linear(d, n * h)
    self.gate: nnx.Linear = linear(d, n * h)
    self.segment: nnx.Linear = linear(d, n * h)
    self.local: nnx.Linear = linear(d, n * h)
    self.out: nnx.Linear = linear(n * h, d)

  def __call__(self, x: ArrayLike, *, mask: ArrayLike | None = None,
               segment_ids: ArrayLike | None = None) -> jax.Array:
    """``x [..., T, d]`` -> ``[..., T, d]``; ``segment_ids`` overrides ``segment_size``."""
    x = jnp.asarray(x)
    if segment_ids is None and self.segment_size is None:
      raise ValueError(f"{type(self).__name__}: give `segment_ids` (the layer has no "
                       "`segment_size`)")

    def heads(layer: nnx.Linear) -> jax.Array:
      y = layer(x)
      return y.reshape(*y.shape[:-1], self.num_heads, self.head_dim)

    mixed = ponet_mix(
        heads(self.query), heads(self.key), heads(self.gate), heads(self.segment),
        heads(self.local), segment_ids=segment_ids,
        segment_size=self.segment_size if segment_ids is None else None, window=self.window,
        mask=mask, causal=self.causal)
    return self.out(mixed.reshape(*mixed.shape[:-2], -1))
