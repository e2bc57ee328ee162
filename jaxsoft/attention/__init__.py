"""Attention: one entry point for every normalizer and implementation, and its variants.

``dot_product_attention`` is a drop-in superset of ``jax.nn.dot_product_attention`` (the
same arguments in the same positions, plus ``normalizer``, ``normalizer_params`` and more
``implementation`` choices); ``MaskStructure`` describes causal / window / length /
segment masks without a T x S array (shared with the Pallas kernels); ``dense_logits``
are the logits every path computes. The variants, one module per concept (feature ids in
docs/feature_ids.md):

* built on the entry point: Hopfield retrieval (A03, ``_hopfield``), gated attention
  output (A07, ``_gated``), Forgetting attention with ACP pruning (A08, ``_forgetting``),
  SSMax / entmax / sparsemax attention with per-head parameters (A09, A10,
  ``_shortcuts``) and the parameterisations of learned parameters (``_parameters``);
* other selections of keys: top-k attention (A11, ``_topk``), block-sparse attention
  (A12, ``_block_sparse``), KV merging (A48, ``_merge``);
* other maps: Multi-Token Attention (A13, ``_multi_token``), LUCID (A14, ``_lucid``),
  Multiscreen screening attention (A19, ``_multiscreen``), Polar attention (A20,
  ``_polar``), UniAttn (A22, ``_uniattn``), tensor attention (A24, ``_tensor``),
  Infinite Self-Attention (A25, ``_infinite``), SOFT (A26, ``_soft``) and the
  softmax-free non-local block (A27, ``_nonlocal``).

Inverse-distance attention (A18) is ``dot_product_attention(score="distance",
normalizer="idw_softmax")``.
"""

from jaxsoft.attention._api import IMPLEMENTATIONS, dot_product_attention
from jaxsoft.attention._blasst_calibration import blasst_calibrate, blasst_skip_threshold
from jaxsoft.attention._block_sparse import BLOCK_SPARSE_METHODS, block_sparse_attention
from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention._forgetting import (
    acp_prune_threshold,
    forget_gate_decay,
    forgetting_attention,
)
from jaxsoft.attention._gated import gated_attention_output
from jaxsoft.attention._hopfield import hopfield_energy, hopfield_retrieval
from jaxsoft.attention._infinite import infsa_attention, linear_infsa_attention
from jaxsoft.attention._lucid import lucid_attention, lucid_preconditioned_values
from jaxsoft.attention._merge import alternating_matching, merge_kv
from jaxsoft.attention._multi_token import mta_identity_kernel, multi_token_attention
from jaxsoft.attention._multiscreen import multiscreen_attention
from jaxsoft.attention._nonlocal import nonlocal_block
from jaxsoft.attention._parameters import per_head, softplus_from_range, softplus_to_range
from jaxsoft.attention._polar import polar_attention, polar_memory, polar_sink_attention
from jaxsoft.attention._pooling_mixer import ponet_mix
from jaxsoft.attention._shortcuts import entmax_attention, sparsemax_attention, ssmax_attention
from jaxsoft.attention._soft import gaussian_kernel, newton_schulz_pinv, soft_attention
from jaxsoft.attention._sparse_state_expansion import sparse_state_expansion, sse_gates
from jaxsoft.attention._tensor import tensor_attention
from jaxsoft.attention._topk import topk_attention
from jaxsoft.attention._uniattn import uniattn, uniattn_shared_map
from jaxsoft.attention.differentiation import UnsupportedDifferentiation
from jaxsoft.attention.masks import MaskStructure

__all__ = ["dot_product_attention", "IMPLEMENTATIONS", "MaskStructure", "dense_logits",
           "UnsupportedDifferentiation",
           "hopfield_retrieval", "hopfield_energy", "gated_attention_output",
           "forget_gate_decay", "forgetting_attention", "acp_prune_threshold",
           "ssmax_attention", "entmax_attention", "sparsemax_attention",
           "per_head", "softplus_to_range", "softplus_from_range",
           "merge_kv", "alternating_matching", "topk_attention",
           "block_sparse_attention", "BLOCK_SPARSE_METHODS", "blasst_calibrate",
           "blasst_skip_threshold", "sparse_state_expansion", "sse_gates",
           "lucid_attention", "lucid_preconditioned_values",
           "multi_token_attention", "mta_identity_kernel",
           "tensor_attention", "soft_attention", "gaussian_kernel", "newton_schulz_pinv",
           "nonlocal_block",
           "multiscreen_attention", "uniattn", "uniattn_shared_map", "infsa_attention",
           "linear_infsa_attention", "polar_attention",
           "polar_sink_attention", "polar_memory",
           "ponet_mix"]

# monotonic attention (A52, ``_monotonic``): expected / hard monotonic, chunkwise (MoChA),
# local-window and segmental attention around a monotonic position
from jaxsoft.attention._monotonic import (  # noqa: E402
    chunkwise_attention,
    hard_monotonic_attention,
    local_window_attention,
    monotonic_attention,
    monotonic_attention_probs,
    segmental_attention,
)

__all__ += ["monotonic_attention_probs", "monotonic_attention", "hard_monotonic_attention",
            "chunkwise_attention", "local_window_attention", "segmental_attention"]

# attention controls (A49, ``_controls``): no token mixing, fixed sequence-independent maps,
# queries and keys from embeddings that do not depend on the tokens
from jaxsoft.attention._controls import (  # noqa: E402
    embedding_qk_attention,
    fixed_map_attention,
    no_mixing_attention,
)

__all__ += ["no_mixing_attention", "fixed_map_attention", "embedding_qk_attention"]

# tropical attention (A16, ``_tropical``): max-plus scores and max-plus aggregation
from jaxsoft.attention._tropical import tropical_attention  # noqa: E402

__all__ += ["tropical_attention"]

# reusing top-k selections (A11, ``_topk_reuse``): TokenSelect's Selection Cache, Kascade's anchor layers
from jaxsoft.attention._topk_reuse import (  # noqa: E402, E501
    anchor_layer_scores,
    init_selection_cache,
    select_anchor_layers,
    selection_cache_step,
)

__all__ += ["init_selection_cache", "selection_cache_step", "anchor_layer_scores", "select_anchor_layers"]

# context parallelism (issue 34, ``context_parallel``): the sequence sharded along a mesh axis
from jaxsoft.attention.context_parallel import (  # noqa: E402
    context_parallel_attention,
    load_balance_order,
)

__all__ += ["context_parallel_attention", "load_balance_order"]

# token-level hybrids of softmax attention and Gated DeltaNet (A46, ``_token_hybrid``): NAtS-L, Oryx
from jaxsoft.attention._token_hybrid import (  # noqa: E402
    nats_attention,
    oryx_attention,
    straight_through_route,
)

__all__ += ["nats_attention", "oryx_attention", "straight_through_route"]
