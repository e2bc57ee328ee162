r"""Feature maps of the linear-attention family: the named ones, and the two that are more
than an elementwise function.

* ``FEATURE_MAPS``: the maps a variant's ``feature_map=`` accepts by name (``"elu1"``,
  ``"relu"``, ``"identity"``, ``"taylor"``); :func:`resolve` turns a name or a callable
  into the map and :func:`apply` checks ``q, k, v`` and maps ``q`` and ``k``, for every
  variant that takes a ``feature_map`` (linear attention, MALA, MHLA, RALA, interdomain).
* :func:`taylor_features`: ``φ(x) = [x^{⊗i} / \sqrt{i!}]_{i=0..m}`` so that
  ``φ(q) · φ(k) = Σ_{i<=m} (q·k)^i / i!``, the order-m Taylor polynomial of ``exp(q·k)``.
* :func:`favor_feature_map`: Performer's FAVOR+ positive orthogonal random features, an
  unbiased estimate ``E[φ(q) · φ(k)] = exp(scale · q·k)``; it needs a PRNG key, so it is a
  factory of feature maps rather than an entry of ``FEATURE_MAPS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.linear import _checks
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["taylor_features", "favor_feature_map", "FEATURE_MAPS", "resolve", "apply"]


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
    ``[..., 1 + K + ... + K^m]``, float32 (float64 for float64 ``x``).

  Examples:
    >>> q, k = jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0])
    >>> taylor_features(q) @ taylor_features(k), 1 + (q @ k) + (q @ k) ** 2 / 2
    (Array(0.625, dtype=float32), Array(0.625, dtype=float32))

  References:
    G. Mongaras & E. C. Larson, 2025, "On the Expressiveness of Softmax Attention: A
    Recurrent Neural Network Perspective".

    T. C. Nauen, S. Palacio & A. Dengel, 2024, "TaylorShift: Shifting the Complexity of
    Self-Attention from Squared to Linear (and Back) using Taylor-Softmax".
  """
  order = _checks.check_int(order, "order", "taylor_features")
  x = jnp.asarray(x)
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  power = jnp.ones_like(x[..., :1])  # from x: keeps a batch sharding (Explicit mesh)
  parts = [power]
  for i in range(1, order + 1):
    power = (power[..., :, None] * x[..., None, :]).reshape(x.shape[:-1] + (-1,))
    parts.append(power / math.sqrt(math.factorial(i)))
  return jnp.concatenate(parts, axis=-1)


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
    A function ``[..., K] -> [..., m]`` (float32; float64 for float64 ``x``).

  Examples:
    >>> phi = favor_feature_map(jax.random.key(0), 2, 4)
    >>> phi(jnp.ones((3, 2))).shape, bool(jnp.all(phi(jnp.ones((3, 2))) > 0))
    ((3, 4), True)

  References:
    K. Choromanski, V. Likhosherstov, D. Dohan, X. Song, A. Gane, T. Sarlos, P. Hawkins,
    J. Davis, A. Mohiuddin, L. Kaiser, D. Belanger, L. Colwell & A. Weller, 2021, "Rethinking
    Attention with Performers".
  """
  fn_name = "favor_feature_map"
  if not (isinstance(key, jax.Array) and (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                                          or (key.dtype == jnp.uint32 and key.shape == (2,)))):
    raise ValueError(f"{fn_name}: `key` must be a JAX PRNG key (jax.random.key(seed)), got "
                     f"{type(key).__name__} {getattr(key, 'dtype', '')}")
  d = positive_int(head_dim, "head_dim", fn_name)
  m = positive_int(num_features, "num_features", fn_name)
  scale = _checks.check_positive_number(d ** -0.5 if scale is None else scale, "scale", fn_name)
  W = (_orthogonal_gaussian(key, m, d) if orthogonal
       else jax.random.normal(key, (m, d), jnp.float32))
  root = math.sqrt(scale)

  def phi(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape[-1] != d:
      raise ValueError(f"{fn_name} features: `x` must have head_dim = {d} as its last axis, "
                       f"got shape {x.shape}")
    x = x.astype(compute_dtype(x.dtype)) * root
    proj = jnp.einsum("...d,md->...m", x, W)
    return jnp.exp(proj - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)) / math.sqrt(m)

  return phi


def _elu1(x: jax.Array) -> jax.Array:
  return jax.nn.elu(x) + 1.0


FEATURE_MAPS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "elu1": _elu1,            # Katharopoulos et al. 2020: elu(x) + 1 > 0
    "relu": jax.nn.relu,
    "identity": lambda x: x,
    # order-2 Taylor features of exp(q·k) (feature A40); scale q first, see taylor_linear_attention
    "taylor": taylor_features,
}


def resolve(feature_map: Any, fn_name: str) -> Callable[[jax.Array], jax.Array]:
  """A callable ``feature_map`` as it is, or the map ``FEATURE_MAPS`` names."""
  if callable(feature_map):
    return feature_map
  if isinstance(feature_map, str) and feature_map in FEATURE_MAPS:
    return FEATURE_MAPS[feature_map]
  raise ValueError(
      f"{fn_name}: `feature_map` must be one of {sorted(FEATURE_MAPS)} or a callable, got "
      f"{feature_map!r}")


def apply(phi: Callable[[jax.Array], jax.Array], q, k, v, fn_name: str, *,
          step: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
  """Checks ``q, k [B, T, N, K]``, ``v [B, T, N, V]`` (``[B, N, ...]`` for a decoding
  ``step``) and maps ``q`` and ``k`` in the compute dtype (:func:`_checks.compute_dtype_of`
  ``q, k, v``: float32, float64 for float64 inputs).

  Returns ``(φ(q), φ(k) [..., K'], v, dtype)``, ``dtype`` the inputs' result type; raises
  ValueError naming ``feature_map`` when ``φ`` changes the leading axes or maps ``q`` and
  ``k`` to different shapes.
  """
  check = _checks.check_qkv_step if step else _checks.check_qkv
  q, k, v = check(q, k, v, fn_name)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  cdt = _checks.compute_dtype_of(q, k, v)
  fq, fk = phi(q.astype(cdt)), phi(k.astype(cdt))
  if fq.shape[:-1] != q.shape[:-1] or fk.shape != fq.shape:
    lead = "B, N" if step else "B, T, N"
    raise ValueError(
        f"{fn_name}: `feature_map` must map q and k [{lead}, K] to equal shapes [{lead}, K'],"
        f" got {fq.shape} and {fk.shape}")
  return fq, fk, v, dtype
