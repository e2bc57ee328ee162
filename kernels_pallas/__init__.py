"""Pallas kernels for jaxsoft (imported lazily by ``implementation="pallas*"``).

``attention`` is one blockwise attention engine for every normalizer of kernel class E, S
or P (DESIGN.md §3), with a Triton (GPU) and a Mosaic TPU driver, forward and backward.
"""

from kernels_pallas._api import BlockSizes, attention
from kernels_pallas.engine import UnsupportedError, default_block_sizes
from kernels_pallas.sharding import sharded_attention

__all__ = ["attention", "BlockSizes", "UnsupportedError", "default_block_sizes",
           "sharded_attention"]
