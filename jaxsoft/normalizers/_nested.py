"""N40 nested-class staircase: the mean of shifted sigmoids of one score (a reconstruction)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["nested_sigmoid"]

_KAPPA = Param("kappa", 1.0, low=0.0, low_open=True, sample=4.0, row_broadcast=True)
_START = Param("start", -1.0, sample=0.0, row_broadcast=True)
_STEP = Param("step", 1.0, low=0.0, low_open=True, sample=2.0, row_broadcast=True)
_LEVELS = Param("levels", 3, low=1, sample=2, static=True)


def _check_levels(levels) -> int:
  if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) or levels < 1:
    raise ValueError(f"nested_sigmoid: `levels` must be a positive int, got {levels!r}")
  return int(levels)


def staircase(z, kappa, start, step, levels: int):
  """``(1/K) sum_{k<K} sigma(kappa (z - start - k step))`` elementwise."""
  return sum(jax.nn.sigmoid(kappa * (z - start - k * step)) for k in range(levels)) / levels


def _staircase_numerator(z, m, kappa=1.0, start=-1.0, step=1.0, levels=3, **_):
  return staircase(z, kappa, start, step, int(levels))


@c.dense_rules(inf_limit=1.0)
def nested_sigmoid(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                   kappa: ArrayLike = 1.0, start: ArrayLike = -1.0, step: ArrayLike = 1.0,
                   levels: int = 3) -> jax.Array:
  r"""Multi-level (nested-class) sigmoid staircase (feature N40, kernel class P; [R]).

  After "Hierarchical multi-class segmentation of glioma images using networks with
  multi-level activation function" (X. Hu, H. Li, ..., B. Menze, BrainLes 2018). The
  paper's exact activation is not known to this library: this is the reconstruction of
  its catalogue note (marked [R], unverified), a staircase of K shifted sigmoids of one
  score, here with evenly spaced thresholds (so that every parameter is a scalar or a
  per-row array, as the attention slot passes them),

  .. math::
    f(x) = \frac{1}{K} \sum_{k=0}^{K-1} \sigma\big(\kappa (x - t_k)\big), \qquad
    t_k = t_0 + k\,\Delta

  so that thresholds of a single output encode nested regions (whole tumour, tumour core,
  enhancing tumour: ``f > k/K`` roughly means "inside region k"), nested by construction
  since f is increasing. The note's form is the sum ``K f`` (levels 0..K); the mean keeps
  the weight in (0, 1). What holds either way, and is tested: f is increasing, bounded,
  has K steps at the thresholds (sharper as kappa grows), and is pointwise (class P, no
  competition between entries).

  Args:
    x: scores.
    axis: the row axis (used for the mask and validation only).
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    kappa: step sharpness ``kappa > 0`` (default 1); a scalar or an array broadcast to the
      rows; differentiable.
    start: the first threshold ``t_0`` (default -1); a scalar or an array broadcast to the
      rows; differentiable.
    step: the spacing ``Delta > 0`` of the thresholds (default 1); a scalar or an array
      broadcast to the rows; differentiable.
    levels: K, the number of steps (default 3, the note's three nested regions); a
      static int.

  Returns:
    Weights in (0, 1) of ``x``'s shape and dtype; a fully masked row is all zeros.

  Examples:
    >>> js.normalizers.nested_sigmoid(jnp.array([-0.5, 0.5, 3.0]), kappa=10.0)  # 1/3 steps
    Array([0.3333, 0.6667, 1.    ], dtype=float32)

  References:
    X. Hu et al., 2018, "Hierarchical multi-class segmentation of glioma images using
    networks with multi-level activation function".
  """
  k_levels = _check_levels(levels)
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "nested_sigmoid", (_KAPPA, kappa),
                                      (_START, start), (_STEP, step))
  return c.finish(staircase(xs, levels=k_levels, **hp), mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="nested_sigmoid",
    fn=nested_sigmoid,
    kernel_class="P",
    catalogue_id="N40",
    sums_to_one=False,
    at_most_one=False,
    shift_invariant=False,
    params=(_KAPPA, _START, _STEP, _LEVELS),
    tile=TileRule(score_map=identity_score_map, numerator=_staircase_numerator),
    description="mean_k sigmoid(kappa (x - t0 - k step)), a nested-class staircase [R]",
))
