"""jaxsoft: softmax-like normalizers, attention variants and softmax-based losses in JAX."""

from jaxsoft import normalizers

__version__ = "0.1.0"

__all__ = ["normalizers", "__version__"]
