"""N18 ASEntmax: alpha-entmax of the scores scaled by a length-adaptive factor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import _entmax, _sparsemax
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, ThresholdRule, register

__all__ = ["asentmax", "asentmax_scale"]

# beta and gamma are learned (beta per query from a projection); the defaults are this
# library's choice, delta = 1 as in the paper's description.
_ALPHA = Param("alpha", 1.5, low=1.0, low_open=True, sample=1.25, row_broadcast=True)
_DELTA = Param("delta", 1.0, low=0.0, sample=0.5, row_broadcast=True)
_BETA = Param("beta", 0.5, low=0.0, sample=1.0, row_broadcast=True)
_GAMMA = Param("gamma", 1.0, low=0.0, low_open=True, sample=0.5, row_broadcast=True)


def asentmax_scale(length, delta=1.0, beta=0.5, gamma=1.0):
  r"""The length-adaptive scale of ASEntmax: ``theta = delta + beta (log n)^gamma``.

  .. math::
    \theta(n) = \delta + \beta\,(\log n)^\gamma

  with ``(log n)^gamma = 0`` for n <= 1 (and a gradient free of NaN there, where
  ``log(log n)`` is ``-inf``). :func:`asentmax` multiplies its scores by it.

  Args:
    length: n, the number of visible entries of each row (an array).
    delta: the offset delta.
    beta: the slope beta.
    gamma: the power gamma.

  Returns:
    ``theta`` of ``length``'s shape.

  Examples:
    >>> js.normalizers.asentmax_scale(jnp.array([1.0, 64.0, 4096.0]))  # 1 + log(n) / 2
    Array([1.    , 3.0794, 5.1589], dtype=float32)

  References:
    P. Vasylenko, M. Treviso, A. F. T. Martins et al., 2025, "Long-Context Generalization
    with Sparse Attention".
  """
  log_n = jnp.log(jnp.maximum(length, 1.0))
  pos = log_n > 0
  powered = jnp.where(pos, jnp.power(jnp.where(pos, log_n, 1.0), gamma), 0.0)
  return delta + beta * powered


def _asentmax_score_map(x, length, alpha=1.5, delta=1.0, beta=0.5, gamma=1.0, **_):
  return (alpha - 1.0) * asentmax_scale(length, delta, beta, gamma) * x


@c.dense_rules
def asentmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
             alpha: ArrayLike = 1.5, delta: ArrayLike = 1.0, beta: ArrayLike = 0.5,
             gamma: ArrayLike = 1.0) -> jax.Array:
  r"""ASEntmax, length-adaptive scaled alpha-entmax (feature N18, kernel class T; Vasylenko et al. 2025).

  From "Long-Context Generalization with Sparse Attention" (P. Vasylenko, M. Treviso &
  A. F. T. Martins et al., 2025, arXiv 2506.16640):

  .. math::
    w = \alpha\text{-entmax}(\theta\, x), \qquad \theta = \delta + \beta\,(\log n)^{\gamma}

  with n the number of visible entries of the row (causal and padding aware) and
  alpha-entmax as :func:`entmax`. In the paper ``beta = softplus(w^T q)`` is computed per
  query and gamma is learned per head: pass them as arrays broadcast to the rows. The
  scale grows with the length, so entmax keeps exact zeros on the noise and a bounded
  support as n grows where softmax's weight on a fixed-margin needle fades to 0.
  ``beta = 0, delta = 1`` is alpha-entmax; sparse, shift invariant, sums to 1.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are not counted in n.
    alpha: entmax's ``alpha > 1`` (default 1.5); a scalar or an array broadcast to the
      rows; differentiable.
    delta: ``delta >= 0`` (default 1); a scalar or an array broadcast to the rows.
    beta: ``beta >= 0`` (default 0.5, this library's choice); a scalar or an array
      broadcast to the rows (per query); differentiable.
    gamma: ``gamma > 0`` (default 1); a scalar or an array broadcast to the rows.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1; a row with no visible entry is all
    zeros with zero gradient.

  Threshold rule (class T): entmax's, on the scores ``(alpha - 1) theta(n) x``.

  Examples:
    >>> x = jnp.zeros(64).at[0].set(1.0)  # a needle among 63 zeros
    >>> both = jax.jit(lambda x: (js.normalizers.entmax15(x), js.normalizers.asentmax(x)))
    >>> p_entmax, p_asentmax = both(x)
    >>> p_entmax[0], p_asentmax[0]  # n = 64: theta = 3.08
    (Array(0.3609, dtype=float32), Array(1., dtype=float32))

  References:
    P. Vasylenko, M. Treviso, A. F. T. Martins et al., 2025, "Long-Context Generalization
    with Sparse Attention".

    B. Peters, V. Niculae & A. F. T. Martins, 2019, "Sparse Sequence-to-Sequence Models".
  """
  _entmax._check_alpha(alpha)
  xs, mask, ax, top, hp = c.prepare_params(x, axis, where, "asentmax", (_DELTA, delta),
                                           (_BETA, beta), (_GAMMA, gamma), with_max=True)
  theta = asentmax_scale(c.visible_count(mask, ax, xs.dtype), **hp)
  # theta (x - max x): entmax is shift invariant per row, and the scaled scores keep
  # their differences exact however far x sits from 0 (theta x + theta c would round
  # theta c's ulp into every gap)
  w = _entmax.entmax(theta * (xs - top), axis=ax, where=mask, alpha=alpha)
  return c.finish(w, mask, jnp.asarray(x).dtype)


ASENTMAX_RULE = ThresholdRule(
    score_map=_asentmax_score_map, mass=_entmax._alpha_mass, target=_sparsemax._unit_target,
    bracket=_entmax._alpha_bracket, weight=_entmax._alpha_mass, iterations=30,
    newton_power=_entmax._alpha_newton_power)

SPEC = register(NormalizerSpec(
    name="asentmax",
    fn=asentmax,
    kernel_class="T",
    catalogue_id="N18",
    can_be_sparse=True,
    length_dependent=True,
    params=(_ALPHA, _DELTA, _BETA, _GAMMA),
    threshold=ASENTMAX_RULE,
    description="alpha-entmax((delta + beta (log n)^gamma) x)",
))
