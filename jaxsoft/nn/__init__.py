"""Flax NNX modules: MultiHeadAttention with every jaxsoft variant, and ``attention_fn``.

The only jaxsoft package that imports flax.

* :class:`MultiHeadAttention` holds the learned parameters of the attention variants
  (per-head sinks, SSMax s, entmax alpha, temperatures, output gates, forget gates) as
  ``nnx.Param`` in safe parameterisations: an unconstrained value mapped into the valid
  range (e.g. ``alpha = 1 + softplus(z)``), never clipped.
* :func:`attention_fn` plugs any normalizer into ``flax.nnx.MultiHeadAttention`` unchanged.
* :func:`attention_weights` gives the dense weights ``[B, N, T, S]`` of a call.
* learned-parameter normalizers (:class:`MultiMax`, :class:`QASSMax`, :class:`SSA`,
  :class:`ASEntmax`, :class:`PolarSink`, :class:`TempNet`, :class:`MoEGate`,
  :class:`DirichletCalibration`): modules that own a normalizer's parameters and return its
  hyperparameters or apply it; all but the last plug into ``MultiHeadAttention(learned=...)``.
* :class:`SoftMoE` (A21; :func:`soft_moe`, :func:`soft_moe_weights`) and
  :class:`ProductKeyMemory` (A47; :func:`product_key_topk`; FwPKM fast weights:
  :func:`fast_weight_pkm`, :func:`fast_weight_pkm_update`).
* :class:`UniAttnCompensation` (A22, UniAttn's W_c) and :class:`InfSA` (A25, a learned
  per-head discount).
* :class:`AttentionControl` (A49): attention controls (no token mixing, fixed or learned
  sequence-independent maps, Q/K from position embeddings) and their hybrids with real heads.
* :class:`AdaptiveAttentionPool` (A53): a set pooled by one learned query, any normalizer
  (:func:`jaxsoft.pooling.adaptive_attention_pool`).
* :class:`PoNetMixer` (A51): PoNet's pooling token mixer with its projections
  (:func:`jaxsoft.attention.ponet_mix`).
* the linear family as layers with the papers' projections, short causal convolution, gates
  and output gate, each with a one-token decoding ``step``: :class:`GatedDeltaNet`,
  :class:`DeltaNet`, :class:`GLA`, :class:`SimpleGLA`, :class:`LightningAttention`,
  :class:`LinearAttention` (any feature map; :class:`HedgehogFeatureMap` is Hedgehog's learned
  one, with its distillation loss), all :class:`LinearMixer` of a ``kind``: a row
  (:class:`LinearKind`) of ``LINEAR_MIXER_TABLE``, whose keys are ``LINEAR_MIXER_KINDS``;
  their short causal convolution :func:`causal_conv` and its decoding form
  :func:`causal_conv_step`.
"""

from jaxsoft.nn._adaptive_pool import AdaptiveAttentionPool
from jaxsoft.nn._attention_controls import ATTENTION_CONTROLS, AttentionControl
from jaxsoft.nn._attention_fn import attention_fn, attention_weights
from jaxsoft.nn._attention_residuals import block_attention_residual
from jaxsoft.nn._fast_weight_product_key_memory import fast_weight_pkm, fast_weight_pkm_update
from jaxsoft.nn._fox_pro import FoXProAttention
from jaxsoft.nn._infinite import InfSA
from jaxsoft.nn._learned_normalizers import (
    SSA,
    AffineScaled,
    ASEntmax,
    DirichletCalibration,
    LearnedNormalizer,
    MoEGate,
    MultiMax,
    PolarSink,
    QASSMax,
    TempNet,
)
from jaxsoft.nn._linear import (
    GLA,
    LINEAR_MIXER_KINDS,
    LINEAR_MIXER_TABLE,
    DeltaNet,
    GatedDeltaNet,
    HedgehogFeatureMap,
    LightningAttention,
    LinearAttention,
    LinearKind,
    LinearMixer,
    SimpleGLA,
    causal_conv,
    causal_conv_step,
)
from jaxsoft.nn._mha import MultiHeadAttention, param_transform
from jaxsoft.nn._polar_memory import PolarMemoryAttention
from jaxsoft.nn._ponet import PoNetMixer
from jaxsoft.nn._product_key_memory import ProductKeyMemory, product_key_topk
from jaxsoft.nn._soft_moe import SoftMoE, soft_moe, soft_moe_weights
from jaxsoft.nn._uniattn import UniAttnCompensation

__all__ = ["MultiHeadAttention", "attention_fn", "attention_weights", "param_transform",
           "SoftMoE", "soft_moe", "soft_moe_weights", "ProductKeyMemory", "product_key_topk",
           "fast_weight_pkm", "fast_weight_pkm_update",
           "DirichletCalibration", "MultiMax", "QASSMax", "TempNet", "SSA", "ASEntmax",
           "AffineScaled",
           "FoXProAttention",
           "PolarSink", "MoEGate", "LearnedNormalizer", "LinearMixer", "GatedDeltaNet",
           "DeltaNet", "GLA", "SimpleGLA", "LightningAttention", "LinearAttention",
           "HedgehogFeatureMap", "LinearKind", "LINEAR_MIXER_TABLE", "LINEAR_MIXER_KINDS",
           "causal_conv", "causal_conv_step", "UniAttnCompensation", "InfSA",
           "PoNetMixer", "AttentionControl", "ATTENTION_CONTROLS", "AdaptiveAttentionPool",
           "PolarMemoryAttention", "block_attention_residual"]
