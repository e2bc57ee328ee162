"""Softmax-based losses (features L01–L04), optax-compatible: one value per example.

The feature ids and the papers behind each loss are listed in docs/feature_ids.md.

Conventions shared by every loss: the result has ``logits``' shape without the class
``axis`` and ``logits``' dtype (bf16/fp16 are computed in float32); ``where`` is either a
class mask broadcastable to ``logits`` (masked classes, like ``-inf`` logits, enter no
sum or max) or, with one dimension fewer, an example mask (optax's convention); masked
or ignored examples and rows with no visible class get loss 0 with zero gradient; a
label naming no visible class gets ``+inf`` (never NaN).

Each family lives in its own private module; this package re-exports exactly the
public names.
"""

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
from jaxsoft.losses._contrastive import (
    decoupled_softmax_loss,
    info_nce,
    soft_clip_loss,
    soft_info_nce,
    soft_info_nce_weights,
    top_k_multi_positive_loss,
)
from jaxsoft.losses._fenchel_young import fenchel_young_loss
from jaxsoft.losses._heads import gol_loss, l2_svm_loss, ovr_bce_loss
from jaxsoft.losses._linear_ce import linear_cross_entropy
from jaxsoft.losses._margin import (
    adacos_scale,
    arcface_loss,
    cosface_loss,
    normalized_softmax_loss,
)
from jaxsoft.losses._orthogonal import orthogonal_gradient
from jaxsoft.losses._partial_fc import partial_fc_loss
from jaxsoft.losses._stablemax import softmax_collapse_fraction, stablemax_cross_entropy
from jaxsoft.losses._z_loss import spherical_z_loss, z_loss

__all__ = [
    "adacos_scale",
    "arcface_loss",
    "cosface_loss",
    "decoupled_softmax_loss",
    "dirichlet_calibrate",
    "ece",
    "energy_score",
    "fenchel_young_loss",
    "fit_dirichlet_calibration",
    "fit_temperature",
    "gol_loss",
    "info_nce",
    "l2_svm_loss",
    "linear_cross_entropy",
    "msp",
    "normalized_softmax_loss",
    "odin",
    "orthogonal_gradient",
    "ovr_bce_loss",
    "partial_fc_loss",
    "soft_clip_loss",
    "soft_info_nce",
    "soft_info_nce_weights",
    "softmax_collapse_fraction",
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
    "spherical_z_loss",
    "stablemax_cross_entropy",
    "top_k_cross_entropy",
    "top_k_multi_positive_loss",
    "z_loss",
]
