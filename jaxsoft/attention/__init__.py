"""Attention: one entry point for every normalizer and implementation.

``dot_product_attention`` is a drop-in superset of ``jax.nn.dot_product_attention``
(DESIGN.md §2); ``MaskStructure`` describes causal / window / length / segment masks
without a T x S array (shared with the Pallas kernels).
"""

# ruff: noqa: F401
from jaxsoft.attention._api import IMPLEMENTATIONS, dot_product_attention
from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention._masks import MaskStructure

__all__ = ["dot_product_attention", "IMPLEMENTATIONS", "MaskStructure", "dense_logits"]
