"""Softmax-based losses (features L01–L19), optax-compatible: one value per example.

The feature ids and the papers behind each loss are listed in docs/feature_ids.md.

Conventions shared by every loss: the result has ``logits``' shape without the class
``axis`` and ``logits``' dtype (bf16/fp16 are computed in float32); ``where`` is either a
class mask broadcastable to ``logits`` (masked classes, like ``-inf`` logits, enter no
sum or max) or, with one dimension fewer, an example mask (optax's convention); masked
or ignored examples and rows with no visible class get loss 0 with zero gradient; a
label naming no visible class gets ``+inf`` (never NaN); a NaN logit at a visible class
gives NaN, as optax's losses do (a NaN at a masked class is left out), never a finite
number, and so does a NaN embedding or score. A ``+inf`` logit at a visible class gives the
formula's value in IEEE arithmetic, never a finite number where the formula's limit is
infinite: ``+inf`` where the loss grows without bound (a cross-entropy whose ``+inf`` logit
is not the target's, ``z_loss``, an infinite hinge), the finite limit where the formula
reaches it without an indeterminate form (a squared hinge whose target logit is ``+inf``:
0), and NaN where it meets ``inf - inf`` or ``inf / inf`` (the log-sum-exp minus a ``+inf``
target logit, a probability-target cross-entropy, standardised logits: optax's losses give
NaN there too); tests/losses/test_nonfinite_walk.py lists each loss's outcome. A tuple ``axis``
(None: every axis) names axes that form one class axis, as in optax: they are moved last in
the order given and merged, an integer label is a flat index into that slice, and an
example ``where`` has the logits' rank minus the number of named axes. ``axis`` is
positional only in the optax drop-ins (``softmax_cross_entropy``,
``softmax_cross_entropy_with_integer_labels``: ``(logits, labels, axis, where)``, as optax
has them) and keyword-only everywhere else, as optax's losses with hyperparameters have it.
Integer and boolean array inputs (logits, scores, embeddings, weights) promote to float as
jax.nn's inputs do (float32; float64 for 64-bit integers under x64).

Each family lives in its own private module; this package re-exports exactly the
public names.
"""

from jaxsoft.losses._acol import acol_gar, acol_loss, acol_probabilities
from jaxsoft.losses._auc import midam_auc_loss
from jaxsoft.losses._calibration import (
    dirichlet_calibrate,
    ece,
    energy_score,
    fit_dirichlet_calibration,
    fit_temperature,
    msp,
    odin,
)
from jaxsoft.losses._classification import (
    softmax_cross_entropy,
    softmax_cross_entropy_with_integer_labels,
    top_k_cross_entropy,
)
from jaxsoft.losses._constrained_normalized_softmax import (
    class_separation_penalty,
    constrained_normalized_softmax_loss,
)
from jaxsoft.losses._continual import continual_cross_entropy
from jaxsoft.losses._contrastive import (
    decoupled_softmax_loss,
    info_nce,
    soft_clip_loss,
    soft_info_nce,
    soft_info_nce_weights,
    top_k_multi_positive_loss,
)
from jaxsoft.losses._distillation import (
    averaged_teacher_kd_loss,
    logit_standardized_kd_loss,
    squared_error_logit_loss,
)
from jaxsoft.losses._dro_temperature import tempnet_dro_loss
from jaxsoft.losses._embedding import nbc_softmax_loss, orthogonal_projection_loss
from jaxsoft.losses._energy_bounded import energy_bounded_loss
from jaxsoft.losses._energy_scores import marginalized_energy, spilled_energy
from jaxsoft.losses._expectation_alignment import expectation_alignment, geometry_consistency_loss
from jaxsoft.losses._fenchel_young import FENCHEL_YOUNG_NORMALIZERS, fenchel_young_loss
from jaxsoft.losses._heads import gol_loss, l2_svm_loss, ovr_bce_loss
from jaxsoft.losses._large_output import (
    augment_reduce_loss,
    hierarchical_softmax_log_probs,
    hierarchical_softmax_loss,
    huffman_tree,
    negative_sampling_loss,
    sampled_softmax_loss,
    unigram_proposal,
)
from jaxsoft.losses._linear_ce import linear_cross_entropy
from jaxsoft.losses._madacos import madacos_alpha_schedule, madacos_loss, madacos_scale_margin
from jaxsoft.losses._margin import (
    adacos_scale,
    arcface_loss,
    cosface_loss,
    normalized_softmax_loss,
)
from jaxsoft.losses._multimodal import pmrl_loss
from jaxsoft.losses._noisy import noisy_softmax_loss
from jaxsoft.losses._orthogonal import orthogonal_gradient
from jaxsoft.losses._output_layers import (
    discretized_logistic_mixture_loss,
    dual_softmax_loss,
    pointer_sentinel_log_probs,
    pointer_sentinel_loss,
    softmax_cpr_logits,
    vq_logits,
    vq_logits_cross_entropy,
)
from jaxsoft.losses._partial_fc import partial_fc_loss
from jaxsoft.losses._preference import adpo_loss, sdpo_loss
from jaxsoft.losses._ranking import (
    pairwise_softmax_loss,
    softmax_loss_at_k,
    top_k_threshold_loss,
)
from jaxsoft.losses._regularizers import attention_entropy_penalty
from jaxsoft.losses._segmentation import dice_semimetric_loss
from jaxsoft.losses._sigmoid_head import sigmoid_head_loss, sigmoid_head_negatives
from jaxsoft.losses._singular_vector_contrast import pmrl_contrastive_regularizer
from jaxsoft.losses._soft_top_k import soft_top_k_loss
from jaxsoft.losses._stablemax import softmax_collapse_fraction, stablemax_cross_entropy
from jaxsoft.losses._stochastic_pooling import MidamPoolState, midam_pool_init, midam_pool_update
from jaxsoft.losses._time_series import soft_msm
from jaxsoft.losses._wrapped_cauchy import wcdas_loss, wrapped_cauchy_log_density
from jaxsoft.losses._z_loss import spherical_z_loss, z_loss
from jaxsoft.normalizers import fourier_head_cross_entropy

__all__ = [
    "acol_gar",
    "acol_loss",
    "acol_probabilities",
    "adacos_scale",
    "adpo_loss",
    "arcface_loss",
    "attention_entropy_penalty",
    "augment_reduce_loss",
    "averaged_teacher_kd_loss",
    "class_separation_penalty",
    "constrained_normalized_softmax_loss",
    "continual_cross_entropy",
    "cosface_loss",
    "decoupled_softmax_loss",
    "dice_semimetric_loss",
    "dirichlet_calibrate",
    "discretized_logistic_mixture_loss",
    "dual_softmax_loss",
    "ece",
    "energy_bounded_loss",
    "energy_score",
    "expectation_alignment",
    "fenchel_young_loss",
    "FENCHEL_YOUNG_NORMALIZERS",
    "fit_dirichlet_calibration",
    "fit_temperature",
    "fourier_head_cross_entropy",
    "geometry_consistency_loss",
    "gol_loss",
    "hierarchical_softmax_log_probs",
    "hierarchical_softmax_loss",
    "huffman_tree",
    "info_nce",
    "l2_svm_loss",
    "linear_cross_entropy",
    "logit_standardized_kd_loss",
    "madacos_alpha_schedule",
    "madacos_loss",
    "madacos_scale_margin",
    "marginalized_energy",
    "midam_auc_loss",
    "midam_pool_init",
    "midam_pool_update",
    "MidamPoolState",
    "msp",
    "nbc_softmax_loss",
    "negative_sampling_loss",
    "noisy_softmax_loss",
    "normalized_softmax_loss",
    "odin",
    "orthogonal_gradient",
    "orthogonal_projection_loss",
    "ovr_bce_loss",
    "pairwise_softmax_loss",
    "partial_fc_loss",
    "pmrl_contrastive_regularizer",
    "pmrl_loss",
    "pointer_sentinel_log_probs",
    "pointer_sentinel_loss",
    "sampled_softmax_loss",
    "sdpo_loss",
    "sigmoid_head_loss",
    "sigmoid_head_negatives",
    "soft_clip_loss",
    "soft_info_nce",
    "soft_info_nce_weights",
    "soft_msm",
    "soft_top_k_loss",
    "softmax_collapse_fraction",
    "softmax_cpr_logits",
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
    "softmax_loss_at_k",
    "spherical_z_loss",
    "spilled_energy",
    "squared_error_logit_loss",
    "stablemax_cross_entropy",
    "tempnet_dro_loss",
    "top_k_cross_entropy",
    "top_k_multi_positive_loss",
    "top_k_threshold_loss",
    "unigram_proposal",
    "vq_logits",
    "vq_logits_cross_entropy",
    "wcdas_loss",
    "wrapped_cauchy_log_density",
    "z_loss",
]
