"""N23 softplus-l1 (LSSA) with a log-length scale, and the LSSAR power re-weighting.

B. Gao & M. W. Spratling 2025, "Softplus Attention with Re-weighting Boosts Length
Extrapolation in Large Language Models" (arXiv 2501.13428). The paper's exact scale law and
re-weighting were not available when this was written: both forms here are this project's
reconstruction from the paper's abstract (marked [R] in the docstrings and registry
descriptions), with their constants exposed as parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["softplus_l1", "lssar", "length_scale"]

_BASE = Param("base", 512.0, low=1.0, low_open=True, sample=64.0)
_SCALE = Param("scale", 1.0, low=0.0, low_open=True, sample=2.0, row_broadcast=True)
_P = Param("p", 2.0, low=1.0, sample=3.0, row_broadcast=True)

# Below this, softplus(z) = e^z (1 - e^z/2 + ...) and log softplus(z) = z - e^z/2 to ~1e-13.
_SMALL = -15.0


def length_scale(n: ArrayLike, base: float | None = 512.0, scale: ArrayLike = 1.0) -> jax.Array:
  r"""The [R] scale law ``lambda(n) = scale * log(n) / log(base) = scale * log_base(n)``.

  [R]: a reconstruction. The paper describes a scale that grows like log N from an
  entropy-invariance argument, on the order of ``log_512 N``; its exact constants are
  unknown, so here ``lambda(base) = scale``. ``base=None`` turns the length scale off
  (``lambda = scale``). ``n`` is clamped to >= 1 (empty rows).

  Examples:
    >>> js.normalizers.length_scale(jnp.array([8.0, 512.0, 4096.0]))  # log_512 n
    Array([0.3333, 1.    , 1.3333], dtype=float32)

  References:
    B. Gao & M. W. Spratling, 2025, "Softplus Attention with Re-weighting Boosts Length
    Extrapolation in Large Language Models".
  """
  if base is None:
    return jnp.multiply(scale, jnp.ones_like(n))
  n = jnp.asarray(n)
  return jnp.multiply(scale, jnp.log(jnp.maximum(n, 1.0))) / jnp.log(jnp.asarray(base, n.dtype))


def _log_softplus(z):
  """log(softplus(z)) without underflow to log(0) for very negative z."""
  # where, not maximum/minimum, so the gradient at z = _SMALL is not split between branches.
  big = jnp.log(jax.nn.softplus(jnp.where(z >= _SMALL, z, _SMALL)))
  zs = jnp.where(z < _SMALL, z, _SMALL)
  small = zs + jnp.log1p(-0.5 * jnp.exp(zs))
  return jnp.where(z >= _SMALL, big, small)


def _powered_softplus(x, axis, where, p, base, scale, fn_name):
  """``softplus(z)^p / sum softplus(z)^p`` with ``z = lambda(n) x``, as a softmax of
  ``p log softplus(z)``: exact, and rows whose softplus values all underflow float32
  (z below about -87) still get the right (softmax-like) weights instead of 0/0."""
  _BASE.validate(base, fn_name)
  xs, mask, ax, hp = c.prepare_params(x, axis, where, fn_name, (_P, p), (_SCALE, scale))
  lam = length_scale(c.visible_count(mask, ax, xs.dtype), base, hp["scale"])
  w = c.exp_normalize(hp["p"] * _log_softplus(lam * xs), mask, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)


@c.dense_rules
def softplus_l1(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                base: float | None = 512.0, scale: ArrayLike = 1.0) -> jax.Array:
  r"""Softplus-l1 attention weights, LSSA (feature N23, kernel class S; Gao & Spratling 2025).

  .. math::
    w_i = \frac{\mathrm{softplus}(\lambda(n) x_i)}{\sum_{j \in V} \mathrm{softplus}(\lambda(n) x_j)},
    \qquad \lambda(n) = \mathrm{scale} \cdot \log_{\mathrm{base}} n

  with n the visible count of the row. The paper keeps softmax's l1 normalisation and
  replaces exp by softplus (no overflow: softplus is ~linear) with a "dynamic length
  scale" from invariance entropy. That scale law is a **reconstruction** [R] (it grows
  like log N, on the order of ``log_512 N``: see :func:`length_scale`); its constants are
  the parameters ``base`` and
  ``scale``. ``base=None`` gives ``lambda = scale`` (no length dependence). Note that
  ``log_512 n < 1`` for rows shorter than 512, which flattens them.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are not counted in n.
    base: the length at which lambda = scale (> 1), or None to disable the length scale.
    scale: the constant factor (> 0), a scalar or an array broadcast to the rows.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1 (computed as a softmax of
    ``log softplus``, f32); a fully masked row is all zeros with zero gradient.

  Tile rule: ``z = lambda(n) x``, numerator = denominator = ``softplus(z)`` (no max:
  class S; the tile form underflows to 0/0 only if every z < -87).

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0, -1.0])
    >>> js.normalizers.softplus_l1(x, base=None)  # lambda = 1: softplus, l1-normalised
    Array([0.4783, 0.2953, 0.1559, 0.0704], dtype=float32)
    >>> js.normalizers.softplus_l1(x)  # n = 4: lambda = log_512 4 = 2/9 flattens the row
    Array([0.31  , 0.2673, 0.2286, 0.194 ], dtype=float32)

  References:
    B. Gao & M. W. Spratling, 2025, "Softplus Attention with Re-weighting Boosts Length
    Extrapolation in Large Language Models".
  """
  return _powered_softplus(x, axis, where, 1.0, base, scale, "softplus_l1")


@c.dense_rules
def lssar(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
          p: ArrayLike = 2.0, base: float | None = 512.0, scale: ArrayLike = 1.0) -> jax.Array:
  r"""LSSAR: softplus-l1 weights sharpened by a power (feature N23, class S; Gao & Spratling 2025).

  .. math::
    w'_i = \frac{A_i^p}{\sum_{j \in V} A_j^p},\quad A = \mathrm{softplus\_l1}(x)
    \;\Rightarrow\; w'_i = \frac{\mathrm{softplus}(\lambda(n) x_i)^p}
                               {\sum_{j \in V} \mathrm{softplus}(\lambda(n) x_j)^p}

  The paper's "training-free re-weighting that amplifies significant attention weights
  while diminishing weaker ones" is a power function; its exact form is unknown and this
  plain renormalised power (no threshold at 1/N) is this project's reconstruction [R].
  ``p = 1`` is the identity (softplus_l1); ``p > 1`` raises the max weight and lowers the
  entropy.

  Args:
    x: scores.
    p: power p >= 1, a scalar or an array broadcast to the rows; differentiable.
    axis, where, base, scale: as :func:`softplus_l1`.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1; a fully masked row is all zeros.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0, -1.0])
    >>> js.normalizers.lssar(x, p=2.0, base=None)  # sharper than softplus_l1(x, base=None)
    Array([0.6626, 0.2526, 0.0704, 0.0144], dtype=float32)

  References:
    B. Gao & M. W. Spratling, 2025, "Softplus Attention with Re-weighting Boosts Length
    Extrapolation in Large Language Models".
  """
  return _powered_softplus(x, axis, where, p, base, scale, "lssar")


def _lssa_score_map(x, length, base=512.0, scale=1.0, **_):
  return length_scale(length, base, scale) * x


def _softplus_tile(z, m, **_):
  return jax.nn.softplus(z)


def _softplus_pow_tile(z, m, p=2.0, **_):
  return jax.nn.softplus(z) ** p


_COMMON: dict[str, Any] = dict(
    kernel_class="S", catalogue_id="N23", sums_to_one=True, nonnegative=True,
    shift_invariant=False, can_be_sparse=False, length_dependent=True, smooth=True)

SPEC = register(NormalizerSpec(
    name="softplus_l1", fn=softplus_l1, params=(_BASE, _SCALE),
    tile=TileRule(score_map=_lssa_score_map, numerator=_softplus_tile,
                  denominator=_softplus_tile),
    description="softplus(lambda(n) x) / sum softplus(lambda(n) x), lambda = log_512 n [R]",
    **_COMMON))

SPEC_LSSAR = register(NormalizerSpec(
    name="lssar", fn=lssar, params=(_P, _BASE, _SCALE),
    tile=TileRule(score_map=_lssa_score_map, numerator=_softplus_pow_tile,
                  denominator=_softplus_pow_tile),
    description="LSSA weights to the power p, renormalised [R]",
    **_COMMON))
