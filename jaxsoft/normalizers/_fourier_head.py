"""N36 Fourier head: a PMF over ordered bins from a non-negative Fourier-series density, and its
cross-entropy loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = ["fourier_head", "fourier_head_logits", "fourier_head_cross_entropy",
           "fourier_autocorrelation"]

# The reference code's floor in its "inverse softmax" logits log(P + 1e-5).
LOGIT_FLOOR = 1e-5


def _complex_coefficients(coefficients, fn_name: str):
  a = jnp.asarray(coefficients)
  if a.ndim == 0:
    raise ValueError(f"{fn_name}: `coefficients` must have at least one dimension")
  if not jnp.iscomplexobj(a):
    if a.shape[-1] % 2 or a.shape[-1] == 0:
      raise ValueError(
          f"{fn_name}: real `coefficients` must hold 2(N+1) numbers (real parts, then "
          f"imaginary parts) along the last axis, got {a.shape[-1]}")
    h = a.shape[-1] // 2
    a = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    a = jax.lax.complex(a[..., :h], a[..., h:])
  return a


def fourier_autocorrelation(coefficients: ArrayLike) -> jax.Array:
  r"""The autocorrelation of Fourier-head coefficients, the density's Fourier series.

  .. math::
    c_k = \sum_l a_{l+k}\,\overline{a_l}, \qquad k = 0, \dots, N

  (complex; ``c_0 = sum_l |a_l|^2``): :func:`fourier_head`'s density is
  ``1/2 + Re sum_{k >= 1} (c_k / c_0) e^{i pi k z}``.

  Args:
    coefficients: complex ``[..., N+1]``, or real ``[..., 2(N+1)]`` (real parts, then
      imaginary parts).

  Returns:
    ``[..., N+1]`` complex.

  Examples:
    >>> js.normalizers.fourier_autocorrelation(jnp.array([1.0 + 0j, 0.8 + 0j]))
    Array([1.64+0.j, 0.8 +0.j], dtype=complex64)
    >>> js.normalizers.fourier_autocorrelation(jnp.array([1.0, 0.8, 0.0, 0.0]))  # real form
    Array([1.64+0.j, 0.8 +0.j], dtype=complex64)

  References:
    N. Gillman, D. Aggarwal, M. Freeman, S. Singh & C. Sun, 2025, "Fourier Head: Helping
    Large Language Models Learn Complex Probability Distributions".
  """
  a = _complex_coefficients(coefficients, "fourier_autocorrelation")
  n = a.shape[-1]
  return jnp.stack([jnp.sum(a[..., k:] * jnp.conj(a[..., :n - k]), axis=-1)
                    for k in range(n)], axis=-1)


def _bin_centres(num_bins: int, fn_name: str, dtype):
  if not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
    raise ValueError(f"{fn_name}: `num_bins` must be a positive int, got {num_bins!r}")
  edges = np.linspace(-1.0, 1.0, num_bins + 1)
  return jnp.asarray((edges[:-1] + edges[1:]) / 2, dtype)


def fourier_head(coefficients: ArrayLike, num_bins: int) -> jax.Array:
  r"""Fourier-head PMF over ``num_bins`` bins of [-1, 1] (feature N36, kernel class X).

  From N. Gillman, D. Aggarwal, M. Freeman, S. Singh, C. Sun, "Fourier Head: Helping Large
  Language Models Learn Complex Probability Distributions" (ICLR 2025), following the
  reference code (nate-gillman/fourier-head): complex coefficients ``a_0..a_N`` (a linear
  layer's output) define the density on [-1, 1]

  .. math::
    p(z) = \tfrac12 + \mathrm{Re} \sum_{k=1}^{N} \frac{c_k}{c_0} e^{i\pi k z},
    \qquad c_k = \sum_{l} a_{l+k}\,\overline{a_l},

  which equals ``|sum_l a_l e^{i pi l z}|^2 / (2 c_0)``, so it is non-negative (Fejér-Riesz)
  and integrates to 1. The PMF is p at the bin centres (midpoints of
  ``linspace(-1, 1, num_bins + 1)``), renormalised: ``P_b = p(z_b) / sum_b' p(z_b')``.
  N = 0 gives the uniform PMF.

  Args:
    coefficients: complex ``[..., N+1]``, or real ``[..., 2(N+1)]`` holding the real parts
      then the imaginary parts [R] (the reference's pairing of its linear layer's outputs
      is not recorded; any fixed pairing is equivalent up to a permutation of that layer).
    num_bins: the number of bins m >= 1.

  Returns:
    ``[..., num_bins]`` probabilities (float32, or float64 for float64 inputs) summing to 1.
    All-zero coefficients give NaN (c_0 = 0: no density is defined).

  Examples:
    >>> js.normalizers.fourier_head(jnp.array([1.0 + 0j]), 4)  # N = 0: uniform
    Array([0.25, 0.25, 0.25, 0.25], dtype=float32)
    >>> js.normalizers.fourier_head(jnp.array([1.0 + 0j, 0.8 + 0j]), 4)  # 1.64 + 1.6 cos(pi z)
    Array([0.0775, 0.4225, 0.4225, 0.0775], dtype=float32)

  References:
    N. Gillman, D. Aggarwal, M. Freeman, S. Singh & C. Sun, 2025, "Fourier Head: Helping
    Large Language Models Learn Complex Probability Distributions".
  """
  c = fourier_autocorrelation(coefficients)
  real_dtype = jnp.real(c).dtype
  z = _bin_centres(num_bins, "fourier_head", real_dtype)
  k = jnp.arange(1, c.shape[-1], dtype=real_dtype)
  c0 = jnp.real(c[..., :1])
  ck = c[..., 1:] / c0  # [..., N]
  phase = jnp.pi * k[:, None] * z[None, :]  # [N, m]
  dens = 0.5 + (jnp.real(ck) @ jnp.cos(phase) - jnp.imag(ck) @ jnp.sin(phase))
  dens = jnp.maximum(dens, 0.0)  # >= 0 exactly; only rounding can push it below
  return dens / jnp.sum(dens, axis=-1, keepdims=True)


def fourier_head_logits(coefficients: ArrayLike, num_bins: int) -> jax.Array:
  """Fourier-head logits ``log(P + 1e-5)``, P the PMF of :func:`fourier_head`.

  The reference code's logits (its "inverse softmax"), so existing softmax cross-entropy
  code can train a Fourier head.

  Args:
    coefficients: as :func:`fourier_head`.
    num_bins: the number of bins.

  Returns:
    ``[..., num_bins]`` logits.

  Examples:
    >>> js.normalizers.fourier_head_logits(jnp.array([1.0 + 0j, 0.8 + 0j]), 4)
    Array([-2.5569, -0.8616, -0.8616, -2.5569], dtype=float32)

  References:
    N. Gillman, D. Aggarwal, M. Freeman, S. Singh & C. Sun, 2025, "Fourier Head: Helping
    Large Language Models Learn Complex Probability Distributions".
  """
  return jnp.log(fourier_head(coefficients, num_bins) + LOGIT_FLOOR)


def fourier_head_cross_entropy(coefficients: ArrayLike, labels: ArrayLike, num_bins: int, *,
                               gamma: float = 0.0) -> jax.Array:
  r"""Per-example Fourier-head loss: cross-entropy on :func:`fourier_head_logits` plus
  the reference code's high-frequency regulariser (Gillman et al., ICLR 2025).

  .. math::
    \ell = -\log \mathrm{softmax}(\log(P + 10^{-5}))_y
    + \gamma \cdot 4\pi^2 \sum_{k=0}^{N} k^2 |c_k|^2,

  ``c_k`` the unnormalised autocorrelation (the code's ``gamma * 2 * mean_batch
  sum_k 2 pi^2 k^2 |c_k|^2``, per example; average it for the batch loss).

  Args:
    coefficients: as :func:`fourier_head`, ``[..., N+1]`` complex.
    labels: integer bin indices ``[...]`` in [0, num_bins).
    num_bins: the number of bins.
    gamma: regularisation weight >= 0 (the code's default 0).

  Returns:
    ``[...]`` losses.

  Examples:
    >>> a = jnp.array([[1.0 + 0j, 0.8 + 0j]] * 2)  # P = [0.0775, 0.4225, 0.4225, 0.0775]
    >>> js.normalizers.fourier_head_cross_entropy(a, jnp.array([1, 0]), 4)
    Array([0.8617, 2.5569], dtype=float32)
    >>> js.normalizers.fourier_head_cross_entropy(a, jnp.array([1, 0]), 4, gamma=0.01)
    Array([1.1143, 2.8096], dtype=float32)

  References:
    N. Gillman, D. Aggarwal, M. Freeman, S. Singh & C. Sun, 2025, "Fourier Head: Helping
    Large Language Models Learn Complex Probability Distributions".
  """
  if not float(gamma) >= 0.0:
    raise ValueError(f"fourier_head_cross_entropy: `gamma` must be >= 0, got {gamma!r}")
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"fourier_head_cross_entropy: `labels` must be integers, got {labels.dtype}")
  logits = fourier_head_logits(coefficients, num_bins)
  if labels.shape != logits.shape[:-1]:
    raise ValueError(f"fourier_head_cross_entropy: `labels` of shape {labels.shape} does not "
                     f"match the coefficients' batch shape {logits.shape[:-1]}")
  logp = jax.nn.log_softmax(logits, axis=-1)
  loss = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  if gamma:
    c = fourier_autocorrelation(coefficients)
    k = jnp.arange(c.shape[-1], dtype=loss.dtype).reshape((1,) * (c.ndim - 1) + (-1,))
    loss = loss + gamma * 4 * jnp.pi ** 2 * jnp.sum(k ** 2 * jnp.abs(c) ** 2, axis=-1)
  return loss
