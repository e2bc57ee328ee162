"""Attention: one entry point for every normalizer and implementation.

``dot_product_attention`` is a drop-in superset of ``jax.nn.dot_product_attention``
(DESIGN.md §2); ``MaskStructure`` describes causal / window / length / segment masks
without a T x S array (shared with the Pallas kernels); the variants of CATALOGUE
A03-A10 (``_variants``) are built on the entry point.
"""

# ruff: noqa: F401, F403
from jaxsoft.attention._api import IMPLEMENTATIONS, dot_product_attention
from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention._masks import MaskStructure

__all__ = ["dot_product_attention", "IMPLEMENTATIONS", "MaskStructure", "dense_logits"]

try:  # the variants module is written alongside; only its absence is tolerated
  from jaxsoft.attention import _variants
  from jaxsoft.attention._variants import *
except ModuleNotFoundError as e:
  if e.name != "jaxsoft.attention._variants":
    raise
else:
  __all__ += list(_variants.__all__)
