"""N04 clipped softmax: a stretched, clipped softmax that can give exact zeros (and ones)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import row_blocks as blocks
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["clipped_softmax"]

# gamma = -0.03, zeta = 1: the setting the note on the OutEffHop paper's baseline recalls
# (the exact defaults of Bondarenko et al. are not recorded here).
_ZETA = Param("zeta", 1.0, low=1.0, sample=1.05, row_broadcast=True)
_GAMMA = Param("gamma", -0.03, high=0.0, sample=-0.1, row_broadcast=True)


def _stretch(p, zeta, gamma):
  return jnp.clip((zeta - gamma) * p + gamma, 0.0, 1.0)


def _inf_limit(posinf, axis, hparams, visible=None):
  """The limit as the k visible ``+inf`` logits grow together: softmax gives them 1/k."""
  dt = jnp.result_type(float)  # float64 under x64 (the caller casts to the output dtype)
  zeta = c.row_param(hparams.get("zeta", 1.0), posinf.shape, axis, "zeta", "clipped_softmax", dt)
  gamma = c.row_param(hparams.get("gamma", -0.03), posinf.shape, axis, "gamma",
                      "clipped_softmax", dt)
  k = jnp.sum(posinf, axis=axis, keepdims=True)
  return _stretch(posinf / jnp.maximum(k, 1), zeta, gamma)


@c.dense_rules(inf_limit=_inf_limit)
def clipped_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                    zeta: ArrayLike = 1.0, gamma: ArrayLike = -0.03) -> jax.Array:
  r"""Clipped softmax (feature N04, kernel class R; Bondarenko, Nagel & Blankevoort 2023).

  From "Quantizable Transformers: Removing Outliers by Helping Attention Heads Do
  Nothing" (Y. Bondarenko, M. Nagel & T. Blankevoort, NeurIPS 2023, arXiv 2306.12929):

  .. math::
    w_i = \mathrm{clip}\big((\zeta - \gamma)\,\mathrm{softmax}(x)_i + \gamma,\ 0,\ 1\big)

  over the visible entries of the row, with ``gamma <= 0 <= 1 <= zeta``. With
  ``gamma < 0`` a probability below ``-gamma / (zeta - gamma)`` becomes an exact 0, so a
  head can attend to (almost) nothing without pushing its logits to -inf; ``zeta > 1``
  lets a weight reach exactly 1. ``zeta = 1, gamma = 0`` is softmax. Shift invariant (as
  softmax); rows need not sum to 1 (with ``zeta = 1`` they sum to at most 1). The gradient
  is softmax's, scaled by ``zeta - gamma`` on entries strictly inside (0, 1), and 0 on
  clipped ones.

  Kernel class R: the clip acts on the *normalised* weight, so a blockwise pass needs the
  row's softmax statistics (m, l) first; there is no one-pass tile rule: blockwise
  attention (``xla_chunked``, ``pallas``) runs a statistics pass over the key blocks, then
  a pointwise pass. ``+inf`` logits: the limit, the clipped ``1/k``
  on each of the k visible ``+inf`` entries (0 elsewhere).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    zeta: stretch ``zeta >= 1`` (default 1); a scalar or an array broadcast to the rows.
    gamma: offset ``gamma <= 0`` (default -0.03); a scalar or an array broadcast to the
      rows.

  Returns:
    Weights in [0, 1] of ``x``'s shape and dtype; a row with no visible entry is all zeros
    with zero gradient.

  Examples:
    >>> x = jnp.array([3.0, 0.0, -1.0, -2.0])
    >>> js.normalizers.softmax(x)
    Array([0.9304, 0.0463, 0.017 , 0.0063], dtype=float32)
    >>> js.normalizers.clipped_softmax(x, gamma=-0.03)  # small weights become exact zeros
    Array([0.9283, 0.0177, 0.    , 0.    ], dtype=float32)

  References:
    Y. Bondarenko, M. Nagel & T. Blankevoort, 2023, "Quantizable Transformers: Removing
    Outliers by Helping Attention Heads Do Nothing".
  """
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "clipped_softmax", (_ZETA, zeta),
                                      (_GAMMA, gamma))
  p = c.exp_normalize(xs, mask, ax)
  return c.finish(_stretch(p, hp["zeta"], hp["gamma"]), mask, jnp.asarray(x).dtype)


def _derive(stats, length, **_):
  return blocks.softmax_derived(*stats)


def _numerator(z, m, zeta=1.0, gamma=-0.03, row_max=0.0, row_sum=1.0, **_):
  return _stretch(blocks.softmax_of(z, row_max, row_sum), zeta, gamma)


# blockwise: softmax's (m, l) first, then the pointwise clip (a class-P pass)
ROW_RULE = blocks.row_stats_rule(
    (blocks.SOFTMAX,), _derive,
    TileRule(score_map=identity_score_map, numerator=_numerator, kernel_class="P"))

SPEC = register(NormalizerSpec(
    name="clipped_softmax",
    fn=clipped_softmax,
    kernel_class="R",
    catalogue_id="N04",
    sums_to_one=False,
    at_most_one=False,
    can_be_sparse=True,
    smooth=False,
    params=(_ZETA, _GAMMA),
    row_stats=ROW_RULE,
    description="clip((zeta - gamma) softmax(x) + gamma, 0, 1)",
))
