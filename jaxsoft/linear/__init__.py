"""Linear attention and its gated / delta-rule relatives (features A30-A41, A45, K07).

Each variant is one function with the layouts of flash-linear-attention's ops
(``q, k [B, T, N, K]``, ``v [B, T, N, V]``, log-space decays ``g``, ``beta [B, T, N]``,
states ``[B, N, K, V]``; ``scale`` multiplies ``q``) and three exact forms chosen by
``implementation=``: ``"parallel"`` (T x T), ``"recurrent"`` (a scan over tokens) and
``"chunked"`` (a scan over chunks, no T x T buffer); each has a ``*_step`` function for
decoding one token from a state. ``segment_ids`` reset the state between packed sequences.

* A30 :func:`linear_attention`: ``φ(q)(φ(K)^T V) / φ(q)φ(K)^T 1`` (Katharopoulos et al. 2020),
  with Performer's FAVOR+ random features from :func:`favor_feature_map`.
* A31 :func:`cosformer`: ReLU features re-weighted by ``cos(π/2 · (i - j)/M)`` (Qin et al. 2022).
* A32 :func:`mala`: magnitude-aware linear attention, normalised additively (Fan et al. 2025).
* A33 :func:`lightning_attention`: a fixed decay per head (TransNormerLLM, Lightning Attention);
  TransNormerLLM's :func:`lrpe` (with :func:`lrpe_theta`), :func:`srms_norm` and the LRPE-d
  :func:`transnormer_attention`.
* A38 :func:`simple_gla` (a decay per head: RetNet, Lightning Attention) and :func:`gla`
  (a decay per key channel: Gated Linear Attention, Yang et al. 2024).
* A39 :func:`delta_rule` (DeltaNet, Schlag et al. 2021; Yang et al. 2024) and
  :func:`gated_delta_rule` (Gated DeltaNet, Yang, Kautz & Hatamizadeh 2025).
* A39 :func:`ttt_linear`: TTT-Linear, a linear fast-weight model trained by mini-batch
  gradient descent at test time (Sun et al. 2024); the softmax-to-TTT conversion aids
  :func:`key_instance_norm` and :func:`locality_enhance` (SD3.5-T^5, 2025).
* A34 :func:`softmax_linear_attention`: a softmax over heads gates the read and the write
  (Xu et al. 2026) [R].
* A35 :func:`ccq`: the query contracted by the running key covariance (Le et al. 2026) [R].
* A36 :func:`mhla`, :func:`mhla_step`: block summaries mixed by learned coefficients
  (MHLA, 2026) [R].
* A37 :func:`rala`: rank-augmented bidirectional linear attention (Fan et al. 2025) [R].
* A41 :func:`interdomain_attention`: kernel features through a diagonal-SSM basis [R].
* A45 :func:`native_hybrid_attention`: one softmax over linear-RNN slots and a sliding
  window (Du et al. 2025).
* A30 Hedgehog (Zhang et al. 2024): :func:`hedgehog_feature_map`, learned by
  :func:`hedgehog_distillation_loss` against softmax attention.
* K07: the chunked forms' backward pass recomputes each chunk (a custom VJP keeping the
  inputs and the chunk-start states; the delta rules also keep the UT inverse and the WY
  factors).
* :func:`context_parallel`: a recurrent family with its sequence split over a mesh axis
  (each shard's state map, one ``all_gather``, a fold in sequence order);
  :func:`context_parallel_mixer` and :func:`short_conv_halo` for the layers.
* A40 :func:`taylor_linear_attention`: ``exp`` replaced by its order-m Taylor polynomial, as
  linear attention on :func:`taylor_features` (Mongaras & Larson 2025; TaylorShift).

The feature ids are explained in docs/feature_ids.md.
"""

from jaxsoft.linear._ccq import ccq, ccq_step
from jaxsoft.linear._checks import IMPLEMENTATIONS
from jaxsoft.linear._cosformer import cosformer, cosformer_step
from jaxsoft.linear._delta_rule import (
    delta_rule,
    delta_rule_step,
    gated_delta_rule,
    gated_delta_rule_step,
    l2_normalize,
)
from jaxsoft.linear._features import FEATURE_MAPS, favor_feature_map, taylor_features
from jaxsoft.linear._gla import gla, gla_step, simple_gla, simple_gla_step
from jaxsoft.linear._hedgehog import (
    hedgehog_attention_weights,
    hedgehog_distillation_loss,
    hedgehog_feature_map,
    hedgehog_init,
)
from jaxsoft.linear._interdomain import interdomain_attention, interdomain_attention_step
from jaxsoft.linear._lightning import lightning_attention, lightning_attention_step, lightning_decay
from jaxsoft.linear._linear_attention import linear_attention, linear_attention_step
from jaxsoft.linear._mala import mala, mala_step
from jaxsoft.linear._mhla import mhla, mhla_step
from jaxsoft.linear._native_hybrid import native_hybrid_attention, native_hybrid_attention_step
from jaxsoft.linear._rala import rala, rala_key_weights
from jaxsoft.linear._softmax_linear import (
    head_gates,
    softmax_linear_attention,
    softmax_linear_attention_step,
)
from jaxsoft.linear._taylor import taylor_linear_attention, taylor_linear_attention_step
from jaxsoft.linear._transnormer import (
    lrpe,
    lrpe_theta,
    srms_norm,
    transnormer_attention,
    transnormer_attention_step,
)
from jaxsoft.linear._ttt import ttt_linear, ttt_linear_step
from jaxsoft.linear._ttt_conversion import key_instance_norm, locality_enhance
from jaxsoft.linear.context_parallel import (
    CONTEXT_PARALLEL_FAMILIES,
    CONTEXT_PARALLEL_UNSUPPORTED,
    context_parallel,
    context_parallel_mixer,
    short_conv_halo,
)

__all__ = [
    "linear_attention",
    "linear_attention_step",
    "simple_gla",
    "simple_gla_step",
    "gla",
    "gla_step",
    "delta_rule",
    "delta_rule_step",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "l2_normalize",
    "lightning_attention",
    "lightning_attention_step",
    "lightning_decay",
    "taylor_features",
    "favor_feature_map",
    "taylor_linear_attention",
    "taylor_linear_attention_step",
    "cosformer",
    "cosformer_step",
    "mala",
    "mala_step",
    "ttt_linear",
    "ttt_linear_step",
    "key_instance_norm",
    "locality_enhance",
    "transnormer_attention",
    "transnormer_attention_step",
    "lrpe",
    "lrpe_theta",
    "srms_norm",
    "softmax_linear_attention",
    "softmax_linear_attention_step",
    "head_gates",
    "ccq",
    "ccq_step",
    "interdomain_attention",
    "interdomain_attention_step",
    "native_hybrid_attention",
    "native_hybrid_attention_step",
    "mhla",
    "mhla_step",
    "rala",
    "rala_key_weights",
    "hedgehog_init",
    "hedgehog_feature_map",
    "hedgehog_attention_weights",
    "hedgehog_distillation_loss",
    "FEATURE_MAPS",
    "IMPLEMENTATIONS",
    "context_parallel",
    "context_parallel_mixer",
    "short_conv_halo",
    "CONTEXT_PARALLEL_FAMILIES",
    "CONTEXT_PARALLEL_UNSUPPORTED",
]
