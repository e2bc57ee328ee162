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
  r"""A free parameter mapped above ``low`` by softplus: ``low + margin + softplus(free)``.

  .. math:: \theta = \ell + \epsilon + \log(1 + e^{z})

  ``alpha = softplus_to_range(z, 1.0)`` is the learned entmax alpha of A10 (> 1),
  ``softplus_to_range(z)`` the SSMax ``s`` of A09 and a positive temperature: a gradient
  step on ``z`` can never leave the range, so nothing is clipped after an update.
  ``margin`` keeps an *open* bound open in floating point: softplus underflows to exactly
  0 for ``z`` below about -100 (float32), so without it ``alpha`` could reach 1 exactly.

  Args:
    free: the unconstrained parameter z (any shape, any real dtype).
    low: the bound :math:`\ell` the result stays above.
    margin: :math:`\epsilon \ge 0` added to the bound.

  Returns:
    :math:`\theta`, of ``free``'s shape, in float32 (float64 for float64 input) whatever
    the dtype of ``free``.

  Examples:
    >>> alpha = js.attention.softplus_to_range(jnp.array([-2.0, 0.0, 3.0]), 1.0)
    >>> alpha   # entmax alphas, all above 1
    Array([1.1269, 1.6931, 4.0486], dtype=float32)

  References:
    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers"
    (EMNLP 2019; the learned per-head alpha, kept above 1).

    K. M. Nakanishi, 2025, "Scalable-Softmax Is Superior for Attention" (arXiv 2501.19399;
    the learned s).
  """
  free = jnp.asarray(free)
  z = free.astype(c.compute_dtype(free.dtype))
  return low + margin + jax.nn.softplus(z)


def softplus_from_range(value: ArrayLike, low: float = 0.0, margin: float = 0.0) -> jax.Array:
  r"""The free parameter that :func:`softplus_to_range` maps to ``value``: its inverse.

  .. math:: z = y + \log(1 - e^{-y}),\quad y = \theta - \ell - \epsilon > 0

  For initialising a learned parameter at a chosen value (an entmax alpha of 1.5, say).
  Written to stay finite for large ``y`` (``log(expm1(y))`` overflows past about 88 in
  float32).

  Args:
    value: :math:`\theta`, every entry above ``low + margin``.
    low, margin: as :func:`softplus_to_range`.

  Returns:
    z of ``value``'s shape, in float32 (float64 for float64 input) as
    :func:`softplus_to_range`. Raises ValueError naming ``value`` when a
    concrete value is not above ``low + margin`` (a traced one is not checked).

  Examples:
    >>> z = js.attention.softplus_from_range(jnp.array([1.5, 2.0]), 1.0)
    >>> z
    Array([-0.4328,  0.5413], dtype=float32)
    >>> js.attention.softplus_to_range(z, 1.0)   # the round trip
    Array([1.5, 2. ], dtype=float32)

  References:
    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers"
    (EMNLP 2019).
  """
  v = jnp.asarray(value)
  v = v.astype(c.compute_dtype(v.dtype))
  y = v - low - margin
  known = concrete(y)  # None for a tracer: checked only when concrete
  if known is not None and np.any(known <= 0):
    raise ValueError(
        f"softplus_from_range: `value` must be > low + margin = {low + margin}, got {value}")
  # log(expm1(y)) written to stay finite for large y (expm1 overflows past ~88 in f32).
  return y + jnp.log(-jnp.expm1(-y))


def per_head(value: ArrayLike, num_heads: int, name: str, fn_name: str) -> jax.Array:
  """A per-head attention parameter shaped for the logits ``[B, N, T, S]``.

  Scalars pass through; a vector of length ``num_heads`` becomes ``[N, 1, 1]`` (one value
  per head, broadcast right-aligned against the logits with size 1 along the keys): the
  form :func:`dot_product_attention`'s ``normalizer_params`` take for a per-head SSMax
  ``s`` or entmax ``alpha``.

  Args:
    value: a scalar or a vector ``[num_heads]``.
    num_heads: N, the number of query heads.
    name: the argument's name, for the error message.
    fn_name: the calling function's name, for the error message.

  Returns:
    ``value`` as an array: ``[]`` for a scalar, ``[N, 1, 1]`` for a vector. Raises
    ValueError naming ``fn_name`` and ``name`` for any other shape.

  Examples:
    >>> js.attention.per_head(jnp.array([0.5, 1.0]), 2, "s", "my_attention").shape
    (2, 1, 1)
    >>> js.attention.per_head(0.5, 2, "s", "my_attention").shape
    ()

  References:
    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers"
    (EMNLP 2019; one learned alpha per head).
  """
  v = jnp.asarray(value)
  if v.ndim == 0:
    return v
  if v.shape != (num_heads,):
    raise ValueError(
        f"{fn_name}: `{name}` must be a scalar or have shape [num_heads] = ({num_heads},), "
        f"got {v.shape}")
  return v.reshape(num_heads, 1, 1)
