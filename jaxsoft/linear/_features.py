r"""Feature maps for :func:`jaxsoft.linear.linear_attention` beyond elementwise ones.

* :func:`taylor_features`: ``φ(x) = [x^{⊗i} / \sqrt{i!}]_{i=0..m}`` so that
  ``φ(q) · φ(k) = Σ_{i<=m} (q·k)^i / i!``, the order-m Taylor polynomial of ``exp(q·k)``.
* :func:`favor_feature_map`: Performer's FAVOR+ positive orthogonal random features, an
  unbiased estimate ``E[φ(q) · φ(k)] = exp(scale · q·k)``; it needs a PRNG key, so it is a
  factory of feature maps rather than an entry of ``FEATURE_MAPS``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = ["taylor_features", "favor_feature_map", "check_order"]


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


def _check_positive_int(value, name: str, fn_name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"{fn_name}: `{name}` must be a positive int, got {value!r}")
  return int(value)


def _orthogonal_gaussian(key: jax.Array, m: int, d: int) -> jax.Array:
  """``[m, d]``: blocks of ``d`` orthonormal rows (QR of a Gaussian matrix, with the signs
  of ``R``'s diagonal fixed so that the block is Haar-distributed), each row
  rescaled to the norm of an independent ``N(0, I_d)`` vector, so that every row is
  marginally ``N(0, I_d)`` and rows in one block are exactly orthogonal."""
  n_blocks = -(-m // d)
  k_blocks, k_norms = jax.random.split(key)
  gauss = jax.random.normal(k_blocks, (n_blocks, d, d), jnp.float32)
  Q, R = jnp.linalg.qr(gauss)                                  # columns orthonormal
  # signs of R's diagonal moved into Q: Q is then Haar-distributed (uniform directions)
  Q = Q * jnp.sign(jnp.diagonal(R, axis1=-2, axis2=-1))[..., None, :]
  rows = jnp.swapaxes(Q, -1, -2).reshape(n_blocks * d, d)[:m]
  norms = jnp.linalg.norm(jax.random.normal(k_norms, (m, d), jnp.float32), axis=-1)
  return rows * norms[:, None]


def favor_feature_map(key: jax.Array, head_dim: int, num_features: int = 256, *,
                      scale: float | None = None,
                      orthogonal: bool = True) -> Callable[[jax.Array], jax.Array]:
  r"""FAVOR+ positive random features for the softmax kernel (Performer).

  .. math::
    φ(x) = \frac{1}{\sqrt{m}} \exp\big(W x' - \tfrac{1}{2}\|x'\|^2\big), \qquad
    x' = \sqrt{\text{scale}}\, x, \qquad
    \mathbb{E}_W[φ(q) \cdot φ(k)] = \exp(\text{scale} \cdot q \cdot k)

  for rows ``w_r ~ N(0, I)`` (Choromanski, Likhosherstov, Dohan, Song, Gane, Sarlos,
  Hawkins, Davis, Mohiuddin, Kaiser, Belanger, Colwell & Weller 2021, "Rethinking Attention
  with Performers", ICLR 2021). With ``orthogonal=True`` the rows are drawn in blocks of
  ``head_dim`` exactly orthogonal rows with chi-distributed norms (the paper's orthogonal
  random features: still unbiased, lower variance). Passed as ``feature_map=`` to
  :func:`jaxsoft.linear.linear_attention`, the normalised result estimates causal softmax
  attention with scores ``scale · q·k`` (the ratio of two unbiased estimates: consistent,
  not unbiased, as ``num_features`` grows). The features are positive, so the
  denominator is too; ``exp`` is not stabilised, so keep ``scale · |q| |w|`` well below 80.
  The matrix ``W`` is drawn once here: call again with a new key to redraw it.

  Args:
    key: a JAX PRNG key (``jax.random.key(0)``).
    head_dim: ``K``, the last axis of the ``q`` and ``k`` the map will see.
    num_features: ``m``, the number of random features (the state has ``m`` rows).
    scale: the softmax temperature inside ``exp``; default ``head_dim ** -0.5``.
    orthogonal: orthogonal blocks (True) or i.i.d. Gaussian rows.

  Returns:
    A function ``[..., K] -> [..., m]`` (float32).

  Example:
    >>> phi = favor_feature_map(jax.random.key(0), 2, 4)
    >>> phi(jnp.ones((3, 2))).shape, bool(jnp.all(phi(jnp.ones((3, 2))) > 0))
    ((3, 4), True)
  """
  fn_name = "favor_feature_map"
  if not (isinstance(key, jax.Array) and (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                                          or (key.dtype == jnp.uint32 and key.shape == (2,)))):
    raise ValueError(f"{fn_name}: `key` must be a JAX PRNG key (jax.random.key(seed)), got "
                     f"{type(key).__name__} {getattr(key, 'dtype', '')}")
  d = _check_positive_int(head_dim, "head_dim", fn_name)
  m = _check_positive_int(num_features, "num_features", fn_name)
  if scale is None:
    scale = d ** -0.5
  if (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
      or not (math.isfinite(float(scale)) and float(scale) > 0)):
    raise ValueError(f"{fn_name}: `scale` must be a positive finite number, got {scale!r}")
  W = (_orthogonal_gaussian(key, m, d) if orthogonal
       else jax.random.normal(key, (m, d), jnp.float32))
  root = math.sqrt(float(scale))

  def phi(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape[-1] != d:
      raise ValueError(f"{fn_name} features: `x` must have head_dim = {d} as its last axis, "
                       f"got shape {x.shape}")
    x = x.astype(jnp.float32) * root
    proj = jnp.einsum("...d,md->...m", x, W)
    return jnp.exp(proj - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)) / math.sqrt(m)

  return phi
