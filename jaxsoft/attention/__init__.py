"""Attention: one entry point for every normalizer and implementation.

``dot_product_attention`` is a drop-in superset of ``jax.nn.dot_product_attention`` (the
same arguments in the same positions, plus ``normalizer``, ``normalizer_params`` and more
``implementation`` choices); ``MaskStructure`` describes causal / window / length /
segment masks without a T x S array (shared with the Pallas kernels); the variants of
features A03-A10 (``_variants``; ids in docs/feature_ids.md) are built on the entry point;
KV merging (A48, ``_merge``), top-k attention (A11, ``_topk``), block-sparse attention
(A12, ``_block_sparse``), LUCID (A14, ``_lucid``), Multi-Token
Attention (A13, ``_mta``), tensor attention, SOFT and the softmax-free non-local block
(A24, A26, A27, ``_structured``); Multiscreen screening attention, UniAttn and
Infinite Self-Attention (A19, A22, A25, ``_tier3``); Polar attention (A20, ``_polar``).
Inverse-distance attention (A18) is ``dot_product_attention(score="distance",
normalizer="idw_softmax")``.
"""

# ruff: noqa: F401, F403
from jaxsoft.attention import _variants
from jaxsoft.attention._api import IMPLEMENTATIONS, dot_product_attention
from jaxsoft.attention._block_sparse import BLOCK_SPARSE_METHODS, block_sparse_attention
from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention._lucid import lucid_attention, lucid_preconditioned_values
from jaxsoft.attention._merge import alternating_matching, merge_kv
from jaxsoft.attention._mta import mta_identity_kernel, multi_token_attention
from jaxsoft.attention._polar import polar_attention
from jaxsoft.attention._structured import (
    gaussian_kernel,
    newton_schulz_pinv,
    nonlocal_block,
    soft_attention,
    tensor_attention,
)
from jaxsoft.attention._tier3 import (
    infsa_attention,
    multiscreen_attention,
    uniattn,
    uniattn_shared_map,
)
from jaxsoft.attention._topk import topk_attention
from jaxsoft.attention._variants import *
from jaxsoft.attention.masks import MaskStructure

__all__ = ["dot_product_attention", "IMPLEMENTATIONS", "MaskStructure", "dense_logits",
           *_variants.__all__,
           "merge_kv", "alternating_matching", "topk_attention",
           "block_sparse_attention", "BLOCK_SPARSE_METHODS",
           "lucid_attention", "lucid_preconditioned_values",
           "multi_token_attention", "mta_identity_kernel",
           "tensor_attention", "soft_attention", "gaussian_kernel", "newton_schulz_pinv",
           "nonlocal_block",
           "multiscreen_attention", "uniattn", "uniattn_shared_map", "infsa_attention",
           "polar_attention"]
