r"""Feature maps for :func:`jaxsoft.linear.linear_attention` beyond elementwise ones.

* :func:`taylor_features`: ``φ(x) = [x^{⊗i} / \sqrt{i!}]_{i=0..m}`` so that
  ``φ(q) · φ(k) = Σ_{i<=m} (q·k)^i / i!``, the order-m Taylor polynomial of ``exp(q·k)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = ["taylor_features", "check_order"]


def check_order(order, fn_name: str) -> int:
  """The Taylor order: an int ``>= 0``."""
  if isinstance(order, bool) or not isinstance(order, (int, np.integer)) or order < 0:
    raise ValueError(f"{fn_name}: `order` must be an int >= 0, got {order!r}")
  return int(order)


def taylor_features(x: ArrayLike, order: int = 2) -> jax.Array:
  r"""Tensor-power features whose dot product is the Taylor polynomial of ``exp`` (feature A40).

  .. math::
    φ_m(x) = \Big[1, x, \tfrac{x \otimes x}{\sqrt{2!}}, \dots,
             \tfrac{x^{\otimes m}}{\sqrt{m!}}\Big], \qquad
    φ_m(q) \cdot φ_m(k) = \sum_{i=0}^{m} \frac{(q \cdot k)^i}{i!}

  since ``<q^{⊗i}, k^{⊗i}> = (q·k)^i`` (Mongaras & Larson 2025, "On the Expressiveness of
  Softmax Attention: A Recurrent Neural Network Perspective"; order 2 is TaylorShift's,
  Nauen, Palacio & Dengel 2024, "TaylorShift: Shifting the Complexity of Self-Attention
  from Squared to Linear (and Back) using Taylor-Softmax"). The tensor powers are kept
  whole (not reduced to their ``C(K+i-1, i)`` distinct entries), so the width is
  ``1 + K + K^2 + ... + K^m``: order 2 with K = 64 gives 4161 features.

  Args:
    x: ``[..., K]``.
    order: ``m >= 0``.

  Returns:
    ``[..., 1 + K + ... + K^m]``, float32 (or x's wider float dtype).

  Example:
    >>> jnp.set_printoptions(precision=4)
    >>> q, k = jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0])
    >>> taylor_features(q) @ taylor_features(k), 1 + (q @ k) + (q @ k) ** 2 / 2
    (Array(0.625, dtype=float32), Array(0.625, dtype=float32))
  """
  order = check_order(order, "taylor_features")
  x = jnp.asarray(x)
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  power = jnp.ones(x.shape[:-1] + (1,), x.dtype)
  parts = [power]
  for i in range(1, order + 1):
    power = (power[..., :, None] * x[..., None, :]).reshape(x.shape[:-1] + (-1,))
    parts.append(power / math.sqrt(math.factorial(i)))
  return jnp.concatenate(parts, axis=-1)
