"""N28 inverse-distance weighting: ``softmax(-p log d)``, Shepard's weights ``d^{-p}``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["idw_softmax"]

_POWER = Param("power", 1.0, low=0.0, low_open=True, sample=2.0, row_broadcast=True)
_EPS = Param("eps", 1e-12, low=0.0, low_open=True, sample=1e-4)


def _idw_score_map(x, length, power=1.0, eps=1e-12, **_):
  """``-p log sqrt(d^2 + eps)``, smooth in d and finite at d = 0."""
  return -0.5 * power * jnp.log(x * x + eps)


@c.dense_rules
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
  unchanged up to eps. A ``-inf`` entry is masked (as everywhere in the library); a
  ``+inf`` follows the library's shared rule (it takes the row's mass), so mask
  infinitely distant keys with ``where`` instead.

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
  return c.score_map_softmax(x, axis, where, "idw_softmax", _idw_score_map, (_POWER, power),
                             (_EPS, eps))


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
