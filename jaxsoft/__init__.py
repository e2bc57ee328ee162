"""jaxsoft: softmax-like normalizers, attention variants and softmax-based losses in JAX.

``jaxsoft.nn`` (Flax NNX modules) is imported on first access, so the functional core
needs no flax import.
"""

from jaxsoft import attention, checks, linear, losses, normalizers, optim, pooling, testing

__version__ = "0.1.0"

__all__ = ["attention", "checks", "linear", "losses", "nn", "normalizers", "optim", "pooling", "testing", "__version__"]


def __getattr__(name):
  if name == "nn":
    import jaxsoft.nn  # noqa: PLC0415  (flax is imported on first use of jaxsoft.nn)
    return jaxsoft.nn
  raise AttributeError(f"module 'jaxsoft' has no attribute {name!r}")
