"""N30 calibration maps (temperature scaling, Dirichlet calibration, power softening) and the
ODIR regulariser of Dirichlet calibration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers._softmax import softmax

__all__ = ["temperature_scale", "power_soften", "dirichlet_calibration", "dirichlet_logits",
           "odir_penalty"]


def temperature_scale(logits: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                      temperature: ArrayLike = 1.0) -> jax.Array:
  r"""Temperature scaling, the one-parameter calibration map (feature N30).

  From C. Guo, G. Pleiss, Y. Sun, K. Q. Weinberger, "On Calibration of Modern Neural
  Networks" (ICML 2017): :math:`\mathrm{softmax}(z / T)`, T fit on held-out data (see
  ``jaxsoft.losses.fit_temperature``). It is :func:`jaxsoft.normalizers.softmax` with its
  temperature, named for calibration code; the special case ``W = I/T``, ``b = 0`` of
  :func:`dirichlet_calibration` and equal to :func:`power_soften` of ``softmax(z)``.

  Args:
    logits: ``z``.
    axis: the class axis.
    where: optional boolean mask; masked classes get exactly 0.
    temperature: T > 0, a scalar or an array broadcast to the rows; differentiable.

  Returns:
    Calibrated probabilities of ``logits``'s shape and dtype.

  Examples:
    >>> js.normalizers.temperature_scale(jnp.array([2.0, 1.0, 0.0]), temperature=2.0)
    Array([0.5065, 0.3072, 0.1863], dtype=float32)

  References:
    C. Guo, G. Pleiss, Y. Sun & K. Q. Weinberger, 2017, "On Calibration of Modern Neural
    Networks".
  """
  return softmax(logits, axis, where, temperature=temperature)


def power_soften(probs: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                 temperature: ArrayLike = 1.0) -> jax.Array:
  r"""Probability-domain softening ``p^{1/T} / sum_j p_j^{1/T}`` (feature N30).

  The power-normalisation operator of the softening-operator analysis (the paper
  "Probability-domain softening operators", authors not recorded): for ``p = softmax(z)``
  it equals ``softmax(z / T)`` exactly, since ``p_i^{1/T} = e^{z_i/T} / Z^{1/T}``. It
  preserves the ranking, is the identity at T = 1, tends to one-hot at the argmax as
  T -> 0 and to uniform (over the non-zero entries) as T -> inf. Computed as
  ``softmax(log p / T)``; zero probabilities stay 0.

  Args:
    probs: probabilities ``p >= 0`` (need not be normalised).
    axis: the class axis.
    where: optional boolean mask; masked classes get exactly 0.
    temperature: T > 0, a scalar or an array broadcast to the rows; differentiable.

  Returns:
    Softened probabilities of ``probs``'s shape and dtype; a row with no positive visible
    entry is all zeros.

  Examples:
    >>> p = js.normalizers.softmax(jnp.array([2.0, 1.0, 0.0]))
    >>> js.normalizers.power_soften(p, temperature=2.0)
    Array([0.5065, 0.3072, 0.1863], dtype=float32)
    >>> js.normalizers.softmax(jnp.array([2.0, 1.0, 0.0]), temperature=2.0)
    Array([0.5065, 0.3072, 0.1863], dtype=float32)

  References:
    "Probability-domain softening operators" (authors and year not recorded in
    docs/feature_ids.md).

    C. Guo, G. Pleiss, Y. Sun & K. Q. Weinberger, 2017, "On Calibration of Modern Neural
    Networks".
  """
  p = jnp.asarray(probs)
  if jnp.issubdtype(p.dtype, jnp.floating):
    pos = p > 0
    logp = jnp.where(pos, jnp.log(jnp.where(pos, p, 1.0)), -jnp.inf).astype(p.dtype)
  else:
    logp = jnp.log(p.astype(c.output_dtype(p.dtype)))
  return softmax(logp, axis, where, temperature=temperature)


def dirichlet_calibration(log_probs: ArrayLike, weights: ArrayLike,
                          bias: ArrayLike | None = None) -> jax.Array:
  r"""Dirichlet calibration ``softmax(W log p + b)`` over the last axis (feature N30).

  From M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song, P. Flach, "Beyond
  temperature scaling: Obtaining well-calibrated multiclass probabilities with Dirichlet
  calibration" (NeurIPS 2019):

  .. math::
    \mu(p) = \mathrm{softmax}(W \ln p + b), \qquad W \in \mathbb{R}^{K \times K},\
    b \in \mathbb{R}^K,

  fit by log-loss with the ODIR penalty (:func:`odir_penalty`). ``W = I``, ``b = 0`` is
  the identity map; ``W = I/T``, ``b = 0`` is temperature scaling of the original logits
  exactly (``ln softmax(z) = z - LSE(z)`` and softmax is shift invariant); a diagonal W is
  vector scaling, a full one matrix scaling.

  Args:
    log_probs: ``ln p`` of shape ``[..., K]`` (e.g. ``jax.nn.log_softmax(z)``; passing
      logs avoids ``ln 0``).
    weights: ``W`` of shape ``[K, K]``.
    bias: ``b`` of shape ``[K]``, or None for 0.

  Returns:
    ``[..., K]`` calibrated probabilities (float32 for low-precision inputs are cast back).

  Examples:
    >>> log_p = jax.nn.log_softmax(jnp.array([2.0, 1.0, 0.0]))
    >>> js.normalizers.dirichlet_calibration(log_p, jnp.eye(3) / 2.0)  # = softmax(z / 2)
    Array([0.5065, 0.3072, 0.1863], dtype=float32)
    >>> js.normalizers.dirichlet_calibration(log_p, jnp.eye(3), jnp.array([0.0, 0.0, 1.0]))
    Array([0.5761, 0.2119, 0.2119], dtype=float32)

  References:
    M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song & P. Flach, 2019,
    "Beyond temperature scaling: Obtaining well-calibrated multiclass probabilities with
    Dirichlet calibration".
  """
  lp = jnp.asarray(log_probs)
  out = jax.nn.softmax(dirichlet_logits(lp, weights, bias, "dirichlet_calibration"), axis=-1)
  return out.astype(c.output_dtype(lp.dtype))


def dirichlet_logits(log_probs: ArrayLike, weights: ArrayLike, bias: ArrayLike | None = None,
                     fn: str = "dirichlet_logits") -> jax.Array:
  r"""The calibrated logits of Dirichlet calibration, ``W ln p + b``.

  .. math::
    z = W \ln p + b,

  whose softmax is :func:`dirichlet_calibration` (and which
  ``jaxsoft.losses.dirichlet_calibrate`` takes its cross-entropy of), in the compute dtype
  (float32 for low-precision inputs), the shapes checked.

  Args:
    log_probs: ``ln p`` of shape ``[..., K]``.
    weights: ``W`` of shape ``[K, K]``.
    bias: ``b`` of shape ``[K]``, or None for 0.
    fn: the caller's name, for the error messages.

  Returns:
    ``[..., K]`` logits.

  Examples:
    >>> log_p = jnp.log(jnp.array([0.5, 0.25, 0.25]))
    >>> js.normalizers.dirichlet_logits(log_p, -jnp.eye(3) / jnp.log(2.0), jnp.ones(3))
    Array([2., 3., 3.], dtype=float32)

  References:
    That of :func:`dirichlet_calibration`.
  """
  lp = jnp.asarray(log_probs)
  w = jnp.asarray(weights)
  k = lp.shape[-1] if lp.ndim else 0
  if lp.ndim == 0 or w.shape != (k, k):
    raise ValueError(f"{fn}: `weights` must have shape [K, K] = {(k, k)} for inputs of shape "
                     f"{lp.shape}, got {w.shape}")
  cdt = c.compute_dtype(jnp.result_type(lp.dtype, w.dtype))
  z = lp.astype(cdt) @ w.astype(cdt).T
  if bias is not None:
    b = jnp.asarray(bias)
    if b.shape != (k,):
      raise ValueError(f"{fn}: `bias` must have shape [K] = {(k,)}, got {b.shape}")
    z = z + b.astype(cdt).reshape((1,) * (z.ndim - 1) + (k,))
  return z


def odir_penalty(weights: ArrayLike, bias: ArrayLike | None = None, *,
                 lambda_od: float = 1.0, lambda_b: float = 1.0) -> jax.Array:
  r"""ODIR ("off-diagonal and intercept") regulariser of Dirichlet calibration (Kull et al. 2019).

  .. math::
    \frac{\lambda_{od}}{K (K - 1)} \sum_{i \ne j} W_{ij}^2 + \frac{\lambda_b}{K} \sum_j b_j^2

  A diagonal W (vector and temperature scaling) pays nothing for W.

  Args:
    weights: ``W`` of shape ``[K, K]``.
    bias: ``b`` of shape ``[K]``, or None (no intercept term).
    lambda_od: the weight of the off-diagonal term.
    lambda_b: the weight of the intercept term.

  Returns:
    The penalty, a scalar.

  Examples:
    >>> w = jnp.array([[1.0, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    >>> js.normalizers.odir_penalty(w)  # 0.5^2 / (3 * 2)
    Array(0.0417, dtype=float32)
    >>> js.normalizers.odir_penalty(jnp.eye(3) * 2.0, jnp.array([0.0, 0.0, 3.0]), lambda_b=0.1)
    Array(0.3, dtype=float32)

  References:
    M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song & P. Flach, 2019,
    "Beyond temperature scaling: Obtaining well-calibrated multiclass probabilities with
    Dirichlet calibration".
  """
  w = jnp.asarray(weights)
  if w.ndim != 2 or w.shape[0] != w.shape[1]:
    raise ValueError(f"odir_penalty: `weights` must be square [K, K], got {w.shape}")
  k = w.shape[0]
  off = w * (1.0 - jnp.eye(k, dtype=w.dtype))
  pen = lambda_od * jnp.sum(off * off) / max(k * (k - 1), 1)
  if bias is not None:
    b = jnp.asarray(bias)
    pen = pen + lambda_b * jnp.sum(b * b) / k
  return pen
