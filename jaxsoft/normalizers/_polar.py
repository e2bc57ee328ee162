"""N12 polar softmax: a length-tempered softmax with a virtual null logit (sums to <= 1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import _ssmax
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["polar_softmax"]

# Learned per head in ATMA; the initial values are this library's choice (not recorded).
_ALPHA = Param("alpha", 0.0, sample=-1.0, row_broadcast=True)
_NULL_BIAS = Param("null_bias", 0.0, sample=1.5, row_broadcast=True)
_GAMMA = Param("gamma", 0.0, sample=1.0, row_broadcast=True)


def _log_length(length):
  return jnp.log(jnp.maximum(length, 1.0))  # an empty row (n = 0) stays finite


def polar_temperature(length, alpha):
  """``t = 1 + softplus(alpha) log n``."""
  return 1.0 + jax.nn.softplus(alpha) * _log_length(length)


def polar_null_logit(length, null_bias, gamma):
  """``nu = b + softplus(gamma) sqrt(log(n + 1))``: grows like the max of n unrelated scores."""
  return null_bias + jax.nn.softplus(gamma) * jnp.sqrt(jnp.log1p(jnp.maximum(length, 0.0)))


def _polar_score_map(x, length, alpha=0.0, **_):
  return polar_temperature(length, alpha) * x


def _scaled_null(length, alpha=0.0, null_bias=0.0, gamma=0.0, **_):
  return polar_temperature(length, alpha) * polar_null_logit(length, null_bias, gamma)


def _polar_offset(m, length, **hp):
  return jnp.exp(_scaled_null(length, **hp) - m)


def _polar_floor(length, **hp):
  """The null logit ``t nu`` floors the stabiliser, so the offset ``e^{t nu - m} <= 1``."""
  return jax.lax.stop_gradient(_scaled_null(length, **hp))


@c.dense_rules
def polar_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                  alpha: ArrayLike = 0.0, null_bias: ArrayLike = 0.0,
                  gamma: ArrayLike = 0.0) -> jax.Array:
  r"""Polar null-sink length-tempered softmax (feature N12, kernel class E; ATMA, Kreasof AI).

  The attention weights of ATMA's polar attention (kreasof-ai/atma, the ICLR 2027
  submission "ATMA" in that repository): with n the number of visible entries of the row,

  .. math::
    t = 1 + \mathrm{softplus}(\alpha) \log n, \qquad
    \nu = b + \mathrm{softplus}(\gamma) \sqrt{\log(n + 1)}, \qquad
    w = \mathrm{softmax}\big(t \cdot [x_1, \dots, x_n, \nu]\big)_{1..n}

  A virtual null logit ``nu`` joins the row and its weight is dropped, so rows sum to
  ``1 - w_null <= 1``: when every score falls below ``nu`` the row attends to (almost)
  nothing. ``nu`` grows like ``sqrt(log n)``, the extreme-value scale of n unrelated
  scores (``E max`` of n standard normals is about ``sqrt(2 log n)``), and the temperature
  ``t`` like ``log n`` (as SSMax's). Only the weights: ATMA's direction/magnitude split of
  the output (with the null value and the sink-corrected magnitude) is
  :func:`jaxsoft.attention.polar_sink_attention`, its memory branch
  :func:`jaxsoft.attention.polar_memory`, the whole layer ``jaxsoft.nn.PolarMemoryAttention``.
  Not shift invariant (the null logit is fixed).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are not counted in n.
    alpha: temperature parameter (default 0, ``t = 1 + log(2) log n``); a scalar or an
      array broadcast to the rows (one per head); differentiable.
    null_bias: ``b``, the null logit's offset (default 0); a scalar or an array broadcast
      to the rows.
    gamma: the null logit's growth parameter (default 0); a scalar or an array broadcast
      to the rows.

  Returns:
    Weights of ``x``'s shape and dtype summing to at most 1; a row with no visible entry
    is all zeros with zero gradient.

  Tile rule: ``z = t x``, softmax's ``e^{z - m}`` with the offset ``e^{t nu - m}`` and
  the stabiliser floored at ``t nu`` (``m_floor``), as softmax with a sink logit.

  Examples:
    >>> w = js.normalizers.polar_softmax(jnp.array([2.0, 1.0, 0.0, -1.0]))
    >>> w  # n = 4: t = 1.96, nu = 0.88
    Array([0.7847, 0.1104, 0.0155, 0.0022], dtype=float32)
    >>> w.sum()  # the null logit took the rest
    Array(0.9128, dtype=float32)
    >>> js.normalizers.polar_softmax(jnp.array([-2.0, -3.0, -3.0, -4.0])).sum()  # all low
    Array(0.0046, dtype=float32)

  References:
    Kreasof AI, "ATMA" (an ICLR 2027 submission, repository kreasof-ai/atma; authors and
    year not recorded here).

    K. M. Nakanishi, 2025, "Scalable-Softmax Is Superior for Attention".
  """
  xs, mask, ax, top, hp = c.prepare_params(x, axis, where, "polar_softmax", (_ALPHA, alpha),
                                           (_NULL_BIAS, null_bias), (_GAMMA, gamma),
                                           with_max=True)
  n = c.visible_count(mask, ax, xs.dtype)
  # softmax(t [x, nu]) as e^{t ([x, nu] - p)}, p = max(max x, nu): not t x - max(t x),
  # which XLA contracts into an FMA (wrong past scaled scores of ~1e9).
  w = _ssmax.scaled_softmax(xs, mask, ax, polar_temperature(n, hp["alpha"]), top,
                            null=polar_null_logit(n, hp["null_bias"], hp["gamma"]),
                            nonnegative=True)  # t >= 1
  return c.finish(w, mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="polar_softmax",
    fn=polar_softmax,
    kernel_class="E",
    catalogue_id="N12",
    sums_to_one=False,
    shift_invariant=False,
    length_dependent=True,
    params=(_ALPHA, _NULL_BIAS, _GAMMA),
    tile=TileRule.softmax(_polar_score_map, offset=_polar_offset, m_floor=_polar_floor),
    description="softmax(t [x, nu])[:n], t = 1 + softplus(a) log n, nu ~ sqrt(log n)",
))
