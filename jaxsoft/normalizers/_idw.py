"""N28 inverse-distance weighting: ``softmax(-p log d)``, Shepard's weights ``d^{-p}``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import _ssmax
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["idw_softmax"]

_POWER = Param("power", 1.0, low=0.0, low_open=True, sample=2.0, row_broadcast=True)
_EPS = Param("eps", 1e-12, low=0.0, low_open=True, sample=1e-4)


@jax.custom_jvp
def _log_square_plus(x, eps):
  """``log(d^2 + eps)``, finite for every finite d and eps.

  ``d^2`` overflows from ``|d| = 2^64`` in float32 (``2^512`` in float64): past ``2^62``
  (or ``eps = 2^124``; float64: ``2^510``, ``2^1020``) the log is taken as
  ``log((2^-66 d)^2 + 2^-132 eps) + 132 log 2`` (float64: 514, 1028), scaled by a power
  of two, so it rounds as the unscaled sum would and cannot overflow. Both logs are taken
  and one selected (a select before a single log ran ~3x slower on XLA:CPU); below the
  threshold the plain form is unchanged.
  """
  half = jnp.finfo(jnp.result_type(x)).maxexp // 2  # 64 (float32), 512 (float64)
  down = 2.0 ** -(half + 2)
  big = (jnp.abs(x) > 2.0 ** (half - 2)) | (eps > 2.0 ** (2 * half - 4))
  scaled_x = x * down
  # Each log's argument is 1 where the other is selected: its 0 (underflow) or inf
  # would make the unselected branch's gradient 0 * inf = NaN.
  scaled = jnp.log(jnp.where(big, scaled_x * scaled_x + (eps * down) * down, 1.0))
  scaled = scaled + (2 * half + 4) * math.log(2.0)
  return jnp.where(big, scaled, jnp.log(jnp.where(big, 1.0, x * x + eps)))


@_log_square_plus.defjvp
def _log_square_plus_jvp(primals, tangents):
  """``d/dd = 2d / (d^2 + eps) = 2 / (d + eps / d)`` (no square: exact past 1.8e19, 0 at
  d = 0) and ``d/deps = 1 / (d^2 + eps) = e^{-L}``; one expression instead of the
  derivatives of both branches of the select (~1.5x faster backward on XLA:CPU)."""
  x, eps = primals
  dx, deps = tangents
  out = _log_square_plus(x, eps)
  return out, 2.0 / (x + eps / x) * dx + jnp.exp(-out) * deps


def _idw_score_map(x, length, power=1.0, eps=1e-12, **_):
  """``-p log sqrt(d^2 + eps)``, smooth in d and finite at d = 0 and at any finite d."""
  return -0.5 * power * _log_square_plus(x, eps)


@c.dense_rules
def _idw_softmax(x, axis=-1, where=None, *, power=1.0, eps=1e-12):
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "idw_softmax", (_POWER, power),
                                      (_EPS, eps))
  # softmax(-p/2 L), L = log(d^2 + eps), as e^{-p/2 (L - min L)}: not -p/2 L - max(...),
  # which XLA contracts into an FMA. xs holds visible values at masked entries, so the
  # plain row min of L is the visible one.
  log_sq = _log_square_plus(xs, hp["eps"])
  nearest = jax.lax.stop_gradient(jnp.min(log_sq, axis=ax, keepdims=True))
  w = _ssmax.exp_scaled(log_sq, mask, ax, -0.5 * hp["power"], nearest)
  return c.finish(w, mask, jnp.asarray(x).dtype)


def _far_keys(x, axis, where):
  """``(x, where)`` with the formula's limit at ``+inf`` distances: a row with a visible
  finite distance masks its ``+inf`` ones (weight ``d^-p -> 0``); a row whose visible
  distances are all ``+inf`` gets them as equal finite distances (1/k each, the limit as
  they grow together); a row with a visible NaN is left to the NaN rule. An invalid
  ``axis`` or ``where`` is left to the rules' errors (``_idw_softmax``)."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim == 0:
    return x, where
  axes = axis if isinstance(axis, tuple) else (axis,)
  if (not axes or not all(isinstance(a, int) and -x.ndim <= a < x.ndim for a in axes)
      or len({a % x.ndim for a in axes}) != len(axes)):
    return x, where
  far = x == jnp.inf
  visible = x != -jnp.inf
  if where is not None:
    try:
      visible = visible & jnp.broadcast_to(jnp.asarray(where), x.shape).astype(bool)
    except ValueError:
      return x, where
  rows = tuple(a % x.ndim for a in axes)
  near = jnp.any(visible & ~far, axis=rows, keepdims=True)
  nan_row = jnp.any(visible & jnp.isnan(x), axis=rows, keepdims=True)  # NaN everywhere
  keep = ~(far & near & ~nan_row)
  where = keep if where is None else jnp.logical_and(where, keep)
  return jnp.where(far & ~near, jnp.ones_like(x), x), where


def idw_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                power: ArrayLike = 1.0, eps: ArrayLike = 1e-12) -> jax.Array:
  r"""Inverse-distance weighting as a softmax (feature N28, kernel class E; C. McCarter 2023).

  From "Inverse distance weighting attention" (C. McCarter, 2023): with the scores
  ``-log ||q - k_j||`` softmax gives Shepard's inverse-distance weights. This takes the
  *distances* d (not scores) as its row:

  .. math::
    w_i = \frac{(d_i^2 + \epsilon)^{-p/2}}{\sum_{j \in V} (d_j^2 + \epsilon)^{-p/2}}
    = \mathrm{softmax}\big(-p \log \sqrt{d^2 + \epsilon}\big)_i
    \approx \frac{d_i^{-p}}{\sum_j d_j^{-p}}

  over the visible entries V; ``p = 1`` is the paper's, a general p is the note's
  generalisation (equal to softmax with temperature ``1/p`` on ``-log d``). Only ``|d|``
  matters; ``eps`` makes a zero distance finite (its weight tends to 1 as eps -> 0:
  interpolation). Scale invariant: ``d -> c d`` for all entries leaves the weights
  unchanged up to eps. Finite for any finite distance (``d^2`` is not formed past
  ``2^62``, where it would overflow float32). A ``-inf`` entry is masked (as everywhere
  in the library); a ``+inf`` distance takes the formula's limit, weight 0 (``d^-p -> 0``),
  unless every visible distance of its row is ``+inf`` (then 1/k each, the limit as they
  grow together).

  Args:
    x: distances ``d_j`` (only their magnitude is used).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    power: ``p > 0`` (default 1); a scalar or an array broadcast to the rows;
      differentiable.
    eps: ``eps > 0`` added to ``d^2`` (default 1e-12); a scalar or an array broadcast to
      the rows.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1; a row with no visible entry is all
    zeros with zero gradient.

  Examples:
    >>> js.normalizers.idw_softmax(jnp.array([1.0, 2.0, 4.0]))  # 1, 1/2, 1/4 over 7/4
    Array([0.5714, 0.2857, 0.1429], dtype=float32)
    >>> js.normalizers.idw_softmax(jnp.array([1.0, 2.0, 4.0]), power=2.0)
    Array([0.7619, 0.1905, 0.0476], dtype=float32)

  References:
    C. McCarter, 2023, "Inverse distance weighting attention".
  """
  x, where = _far_keys(x, axis, where)
  return _idw_softmax(x, axis, where, power=power, eps=eps)


setattr(idw_softmax, "_jaxsoft_dense_rules", True)  # noqa: B010 (_idw_softmax applies them)


SPEC = register(NormalizerSpec(
    name="idw_softmax",
    fn=idw_softmax,
    kernel_class="E",
    catalogue_id="N28",
    shift_invariant=False,
    params=(_POWER, _EPS),
    tile=TileRule.softmax(_idw_score_map),
    description="softmax(-p log d) on distances d: d^-p / sum d^-p",
))
