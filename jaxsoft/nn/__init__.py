"""Flax NNX modules: MultiHeadAttention with every jaxsoft variant, and ``attention_fn``.

The only jaxsoft package that imports flax.

* :class:`MultiHeadAttention` holds the learned parameters of the attention variants
  (per-head sinks, SSMax s, entmax alpha, temperatures, output gates, forget gates) as
  ``nnx.Param`` in safe parameterisations: an unconstrained value mapped into the valid
  range (e.g. ``alpha = 1 + softplus(z)``), never clipped.
* :func:`attention_fn` plugs any normalizer into ``flax.nnx.MultiHeadAttention`` unchanged.
* :func:`attention_weights` gives the dense weights ``[B, N, T, S]`` of a call.
* learned-parameter normalizers (:class:`MultiMax`, :class:`QASSMax`, :class:`TempNet`,
  :class:`DirichletCalibration`): modules that own a normalizer's parameters and return its
  hyperparameters or apply it.
* :class:`SoftMoE` (A21; :func:`soft_moe`, :func:`soft_moe_weights`) and
  :class:`ProductKeyMemory` (A47; :func:`product_key_topk`).
"""

from jaxsoft.nn._attention_fn import attention_fn, attention_weights
from jaxsoft.nn._learned import DirichletCalibration, MultiMax, QASSMax, TempNet
from jaxsoft.nn._mha import MultiHeadAttention, param_transform
from jaxsoft.nn._pkm import ProductKeyMemory, product_key_topk
from jaxsoft.nn._soft_moe import SoftMoE, soft_moe, soft_moe_weights

__all__ = ["MultiHeadAttention", "attention_fn", "attention_weights", "param_transform",
           "SoftMoE", "soft_moe", "soft_moe_weights", "ProductKeyMemory", "product_key_topk",
           "DirichletCalibration", "MultiMax", "QASSMax", "TempNet"]
