"""The distance score of ``score="distance"`` (public inside jaxsoft: the dense and chunked
paths and the Pallas engine all compute it with :func:`safe_distance`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = ["safe_distance"]


def safe_distance(d2: ArrayLike) -> jax.Array:
  """``sqrt(max(d2, 0))`` with gradient 0 (not infinity) where ``d2 <= 0``.

  ``d2`` is a squared distance computed as ``|q|^2 + |k|^2 - 2 q·k`` (slightly negative
  after rounding when q = k). The derivative ``1 / (2 d)`` is replaced by 0 at ``d = 0``:
  the distance's gradient ``(q - k) / d`` becomes 0 there, a subgradient of the norm.

  Examples:
    >>> from jaxsoft.attention.scores import safe_distance
    >>> safe_distance(jnp.array([4.0, 0.0, -1e-7]))
    Array([2., 0., 0.], dtype=float32)
    >>> jax.grad(lambda d2: safe_distance(d2).sum())(jnp.array([4.0, 0.0]))
    Array([0.25, 0.  ], dtype=float32)
  """
  d2 = jnp.asarray(d2)
  pos = d2 > 0
  return jnp.where(pos, jnp.sqrt(jnp.where(pos, d2, 1.0)), 0.0)
