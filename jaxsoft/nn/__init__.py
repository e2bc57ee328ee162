"""Flax NNX modules: MultiHeadAttention with every jaxsoft variant, and ``attention_fn``.

The only jaxsoft package that imports flax.

* :class:`MultiHeadAttention` holds the learned parameters of the attention variants
  (per-head sinks, SSMax s, entmax alpha, temperatures, output gates, forget gates) as
  ``nnx.Param`` in safe parameterisations: an unconstrained value mapped into the valid
  range (e.g. ``alpha = 1 + softplus(z)``), never clipped.
* :func:`attention_fn` plugs any normalizer into ``flax.nnx.MultiHeadAttention`` unchanged.
* :func:`attention_weights` gives the dense weights ``[B, N, T, S]`` of a call.
"""

from jaxsoft.nn._attention_fn import attention_fn, attention_weights
from jaxsoft.nn._mha import MultiHeadAttention, param_transform

__all__ = ["MultiHeadAttention", "attention_fn", "attention_weights", "param_transform"]
