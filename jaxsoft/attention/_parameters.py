"""Learned attention parameters: safe parameterisations and per-head broadcasting.

A learned parameter is kept in its valid range by construction, never clipped after an
update: :func:`softplus_to_range` maps a free parameter above a bound (the entmax
``alpha = 1 + softplus(z)`` of A10, the SSMax ``s = softplus(z)`` of A09) and
:func:`softplus_from_range` inverts it for initialising; :func:`per_head` turns a scalar
or a per-head vector into a normalizer parameter for the logits ``[B, N, T, S]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.normalizers import common as c

__all__ = ["softplus_to_range", "softplus_from_range", "per_head"]


def softplus_to_range(free: ArrayLike, low: float = 0.0, margin: float = 0.0) -> jax.Array:
  r"""``low + margin + softplus(free)``: an unconstrained parameter mapped above ``low``.

  .. math:: \theta = \ell + \epsilon + \log(1 + e^{z})

  ``alpha = softplus_to_range(z, 1.0)`` is the learned entmax alpha of A10 (> 1),
  ``softplus_to_range(z)`` the SSMax ``s`` of A09 and a positive temperature. ``margin``
  keeps an *open* bound open in floating point: softplus underflows to exactly 0 for
  ``z`` below about -100 (float32), so without it ``alpha`` could reach 1 exactly.
  Computed in float32 (or float64) whatever the dtype of ``free``.
  """
  free = jnp.asarray(free)
  z = free.astype(c.compute_dtype(free.dtype))
  return low + margin + jax.nn.softplus(z)


def softplus_from_range(value: ArrayLike, low: float = 0.0, margin: float = 0.0) -> jax.Array:
  r"""The inverse of :func:`softplus_to_range`: the free parameter giving ``value``.

  .. math:: z = y + \log(1 - e^{-y}),\quad y = \theta - \ell - \epsilon > 0

  Raises ValueError naming ``value`` when a concrete value is not above
  ``low + margin``.
  """
  v = jnp.asarray(value, dtype=jnp.float32)
  y = v - low - margin
  known = concrete(y)  # None for a tracer: checked only when concrete
  if known is not None and np.any(known <= 0):
    raise ValueError(
        f"softplus_from_range: `value` must be > low + margin = {low + margin}, got {value}")
  # log(expm1(y)) written to stay finite for large y (expm1 overflows past ~88 in f32).
  return y + jnp.log(-jnp.expm1(-y))


def per_head(value: ArrayLike, num_heads: int, name: str, fn_name: str) -> jax.Array:
  """A scalar or a per-head vector ``[N]`` -> a normalizer parameter for logits ``[B,N,T,S]``.

  Scalars pass through; a vector of length ``num_heads`` becomes ``[N, 1, 1]`` (one value
  per head, broadcast right-aligned against the logits with size 1 along the keys).
  """
  v = jnp.asarray(value)
  if v.ndim == 0:
    return v
  if v.shape != (num_heads,):
    raise ValueError(
        f"{fn_name}: `{name}` must be a scalar or have shape [num_heads] = ({num_heads},), "
        f"got {v.shape}")
  return v.reshape(num_heads, 1, 1)
