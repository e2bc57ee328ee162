"""Pallas kernels for jaxsoft (what ``implementation="pallas*"`` runs).

``attention`` is one blockwise attention engine for every normalizer of kernel class E
(running max and row sum carried across key blocks), S (row sum only), P (nothing
carried), T (a threshold solved in a first pass, AdaSplash-style) or R (row statistics
merged in a first pass), with a Triton (GPU) and a Mosaic TPU driver, forward and backward. The classes
are explained in kernels_pallas/README.md ("How the kernel is generated") and
docs/feature_ids.md. ``attention_from_call`` is the adapter
``jaxsoft.attention.dot_product_attention`` calls.
"""

from kernels_pallas import (
    mosaic_gpu_row_stats,  # noqa: F401 (class R for mosaic_gpu_attention)
    mosaic_gpu_threshold,  # noqa: F401 (class T for mosaic_gpu_attention)
)
from kernels_pallas._api import BlockSizes, attention, attention_from_call, resolve_block_sizes
from kernels_pallas.autotune import (
    autotune_block_sizes,
    candidate_block_sizes,
    clear_autotune_cache,
)
from kernels_pallas.backends import BACKENDS, INTERPRET_ENV, pick_backend
from kernels_pallas.blasst import blasst_attention
from kernels_pallas.decode import decode_attention
from kernels_pallas.engine import UnsupportedError, default_block_sizes
from kernels_pallas.fused_top_k import softmax_top_k
from kernels_pallas.mosaic_gpu import mosaic_gpu_attention
from kernels_pallas.polykv import polykv_decode_attention, polykv_quantize
from kernels_pallas.quantized import lut_softmax, quantized_softmax
from kernels_pallas.sharding import sharded_attention
from kernels_pallas.single_pass import single_pass_softmax
from kernels_pallas.two_pass import exp2_poly, two_pass_softmax

__all__ = ["attention", "attention_from_call", "BlockSizes", "UnsupportedError",
           "default_block_sizes", "sharded_attention", "decode_attention",
           "autotune_block_sizes", "candidate_block_sizes", "clear_autotune_cache",
           "resolve_block_sizes", "pick_backend", "BACKENDS", "INTERPRET_ENV",
           "polykv_decode_attention", "polykv_quantize", "single_pass_softmax"]
__all__ += ["softmax_top_k"]
__all__ += ["two_pass_softmax", "exp2_poly", "quantized_softmax", "lut_softmax"]
__all__ += ["blasst_attention"]
__all__ += ["mosaic_gpu_attention"]  # unverified on hardware: not in the dispatch
