"""Softmax-like normalizers: ``f(x, axis=-1, where=None, **hparams) -> weights``.

Every normalizer is registered with a :class:`NormalizerSpec`; ``get(name)`` returns it
and ``REGISTRY`` maps names to specs.
"""

from jaxsoft.normalizers._spec import (
    REGISTRY,
    NormalizerSpec,
    Param,
    TileRule,
    get,
    names,
    register,
    resolve,
)
from jaxsoft.normalizers._softmax import softmax

__all__ = [
    "REGISTRY",
    "NormalizerSpec",
    "Param",
    "TileRule",
    "get",
    "names",
    "register",
    "resolve",
    "softmax",
]
