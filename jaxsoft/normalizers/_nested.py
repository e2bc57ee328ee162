"""N40 nested-class staircase: the mean of shifted sigmoids of one score (a reconstruction)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import _common as c
from jaxsoft.normalizers._spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["nested_sigmoid"]

_KAPPA = Param("kappa", 1.0, low=0.0, low_open=True, sample=4.0, row_broadcast=True)
_THRESHOLDS = Param("thresholds", (-1.0, 0.0, 1.0), sample=(0.0, 2.0, 4.0))


def _check_thresholds(thresholds) -> tuple[float, ...]:
  try:
    t = np.asarray(thresholds, np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"nested_sigmoid: `thresholds` must be a sequence of numbers, got "
                     f"{thresholds!r}") from None
  if t.ndim != 1 or t.size == 0 or not np.all(np.isfinite(t)) or np.any(np.diff(t) <= 0):
    raise ValueError("nested_sigmoid: `thresholds` must be a non-empty, strictly increasing "
                     f"sequence of finite numbers, got {thresholds!r}")
  return tuple(float(v) for v in t)


def staircase(z, kappa, thresholds: Sequence[float]):
  """``(1/K) sum_k sigma(kappa (z - t_k))`` elementwise."""
  return sum(jax.nn.sigmoid(kappa * (z - t)) for t in thresholds) / len(thresholds)


def _staircase_numerator(z, m, kappa=1.0, thresholds=(-1.0, 0.0, 1.0), **_):
  return staircase(z, kappa, thresholds)


@c.dense_rules(inf_limit=1.0)
def nested_sigmoid(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                   kappa: ArrayLike = 1.0,
                   thresholds: Sequence[float] = (-1.0, 0.0, 1.0)) -> jax.Array:
  r"""Multi-level (nested-class) sigmoid staircase (feature N40, kernel class P; [R]).

  After "Hierarchical multi-class segmentation of glioma images using networks with
  multi-level activation function" (X. Hu, H. Li, ..., B. Menze, BrainLes 2018). The
  paper's exact activation is not known to this library: this is the reconstruction of
  its catalogue note (marked [R], unverified), a staircase of K shifted sigmoids of one
  score,

  .. math::
    f(x) = \frac{1}{K} \sum_{k=1}^{K} \sigma\big(\kappa (x - t_k)\big), \qquad
    t_1 < \dots < t_K

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
    thresholds: the K step positions, strictly increasing (default ``(-1, 0, 1)``); a
      static sequence of numbers.

  Returns:
    Weights in (0, 1) of ``x``'s shape and dtype; a fully masked row is all zeros.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxsoft as js
    >>> jnp.set_printoptions(precision=4)
    >>> js.normalizers.nested_sigmoid(jnp.array([-0.5, 0.5, 3.0]), kappa=10.0)  # 1/3 steps
    Array([0.3333, 0.6667, 1.    ], dtype=float32)
  """
  _KAPPA.validate(kappa, "nested_sigmoid")
  ts = _check_thresholds(thresholds)
  xs, mask, ax = c.prepare(x, axis, where, "nested_sigmoid")
  k = c.row_param(kappa, xs.shape, ax, "kappa", "nested_sigmoid", xs.dtype)
  return c.finish(staircase(xs, k, ts), mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="nested_sigmoid",
    fn=nested_sigmoid,
    kernel_class="P",
    catalogue_id="N40",
    sums_to_one=False,
    at_most_one=False,
    shift_invariant=False,
    params=(_KAPPA, _THRESHOLDS),
    tile=TileRule(score_map=identity_score_map, numerator=_staircase_numerator),
    description="mean_k sigmoid(kappa (x - t_k)), a nested-class staircase [R]",
))
