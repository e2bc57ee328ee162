"""N38 Multiscreen screening: each key weighed against an absolute threshold, no competition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["multiscreen"]

_THETA = Param("theta", 0.0, low=-1.0, high=1.0, high_open=True, sample=0.5, row_broadcast=True)
_POWER = Param("power", 1.0, low=0.0, low_open=True, sample=2.0, row_broadcast=True)


def screen(z, theta, power):
  """``clip((z - theta) / (1 - theta), 0, 1) ** power`` with a gradient free of NaN."""
  u = jnp.clip((z - theta) / (1.0 - theta), 0.0, 1.0)
  pos = u > 0
  return jnp.where(pos, jnp.power(jnp.where(pos, u, 1.0), power), 0.0)


def _screen_numerator(z, m, theta=0.0, power=1.0, **_):
  return screen(z, theta, power)


@c.dense_rules(inf_limit=1.0)
def multiscreen(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                theta: ArrayLike = 0.0, power: ArrayLike = 1.0) -> jax.Array:
  r"""Multiscreen screening weights (feature N38, kernel class P; K. M. Nakanishi 2026; [R]).

  From "Screening Is Enough" (K. M. Nakanishi, 2026, arXiv 2604.01178): each key's
  bounded similarity to the query is compared with an explicit threshold; keys below it
  are discarded and the rest aggregated, with no global competition or redistribution of
  unit mass. The abstract does not give the exact map; this is the catalogue note's
  reconstruction (marked [R]):

  .. math::
    w_i = \mathrm{clip}\Big(\frac{s_i - \theta}{1 - \theta},\ 0,\ 1\Big)^{p}

  with ``s`` the bounded similarity (the paper's is in [-1, 1]: pass cosine similarities
  of unit-norm q and k with ``scale=1``; scores above 1 count as 1). What holds either
  way, and is tested: weights in [0, 1], exact zeros below the threshold, a query with no
  key above it outputs 0, and appending keys below the threshold leaves the output
  unchanged (softmax fails this). Pointwise (class P): nothing is carried across key
  blocks.

  Args:
    x: bounded similarities (scores).
    axis: the row axis (used for the mask and validation only).
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    theta: threshold in [-1, 1) (default 0); a scalar or an array broadcast to the rows;
      differentiable.
    power: sharpness ``p > 0`` (default 1); a scalar or an array broadcast to the rows.

  Returns:
    Weights in [0, 1] of ``x``'s shape and dtype; a fully masked row is all zeros.

  Examples:
    >>> js.normalizers.multiscreen(jnp.array([0.9, 0.6, 0.4, -0.3]), theta=0.5)
    Array([0.8, 0.2, 0. , 0. ], dtype=float32)

  References:
    K. M. Nakanishi, 2026, "Screening Is Enough".
  """
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "multiscreen", (_THETA, theta),
                                      (_POWER, power))
  return c.finish(screen(xs, hp["theta"], hp["power"]), mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="multiscreen",
    fn=multiscreen,
    kernel_class="P",
    catalogue_id="N38",
    sums_to_one=False,
    at_most_one=False,
    shift_invariant=False,
    can_be_sparse=True,
    smooth=False,
    params=(_THETA, _POWER),
    tile=TileRule(score_map=identity_score_map, numerator=_screen_numerator),
    description="clip((s - theta)/(1 - theta), 0, 1)^p, no competition [R]",
))
