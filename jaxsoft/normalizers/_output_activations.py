"""N42 sinusoid and step output activations for soft (disagreement) labels: pointwise maps
into [0, 1] (class P), each weight a function of its own score only.

From P. Hosseini, M. Hosseini, S. Al-Azzawi, M. Liwicki, I. Castro & M. Purver,
"Lon-eå at SemEval-2023 Task 11: A Comparison of Activation Functions for Soft and Hard
Label Prediction" (SemEval 2023), which compares a sigmoid output (N21's
:func:`~jaxsoft.normalizers.sigmoid` with ``bias=0``), a step added after training and a
new sinusoidal activation for predicting the fraction of annotators choosing a label.
The paper's formulas are not in its abstract: both maps here are reconstructions [R].
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["sinusoid", "step"]

_LEVELS = Param("levels", None, low=1, sample=4, static=True)
_THETA = Param("theta", 1.0, low=0.0, high=1.0, sample=0.5, row_broadcast=True)
_THRESHOLD = Param("threshold", 0.0, sample=0.5, row_broadcast=True)


def _sinusoid_values(z, levels=None, theta=1.0):
  """The clipped sine map, then (``levels`` = a) the sinusoidal staircase."""
  u = 0.5 + 0.5 * jnp.sin(jnp.clip(z, -0.5 * math.pi, 0.5 * math.pi))
  if levels is None:
    return u
  w = 2.0 * math.pi * levels
  # The staircase maps [0, 1] onto [0, 1] (monotone for θ <= 1); near u = 0 and 1 the rounding
  # of sin(w u) can leave y a few ulps outside (-6e-15 measured in float32): clip it back.
  return jnp.clip(u - theta * jnp.sin(w * u) / w, 0.0, 1.0)


def _step_values(z, straight_through=False):
  """H(z) with H(0) = 1/2; with ``straight_through`` the gradient of sigmoid(z)."""
  hard = jnp.where(z > 0, 1.0, jnp.where(z < 0, 0.0, 0.5)).astype(z.dtype)
  if not straight_through:
    return hard
  s = jax.nn.sigmoid(z)
  return hard + (s - jax.lax.stop_gradient(s))  # exactly `hard` in value


def _check_levels(levels, fn: str):
  if levels is None:
    return None
  if isinstance(levels, (bool, np.bool_)) or not isinstance(levels, (int, np.integer)):
    raise ValueError(f"{fn}: `levels` must be None or a static int >= 1 (the number of "
                     f"annotators), got {levels!r}")
  _LEVELS.validate(levels, fn)
  return int(levels)


@c.dense_rules(inf_limit=1.0)
def sinusoid(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
             levels: int | None = None, theta: ArrayLike = 1.0) -> jax.Array:
  r"""Sinusoidal output activation into [0, 1] for soft labels (feature N42, kernel class P).

  For soft-label (annotator disagreement) prediction, after P. Hosseini et al. 2023
  (SemEval), whose sinusoidal activation is a reconstruction here [R]. The base map is
  the sine clipped to its rising half-period, a sigmoid-like squashing that reaches 0
  and 1 exactly,

  .. math::
    u(x) = \tfrac12\bigl(1 + \sin(\operatorname{clip}(x, -\tfrac\pi2, \tfrac\pi2))\bigr),

  C¹ and non-decreasing (:math:`u' = \tfrac12\cos x` inside, 0 outside). With
  ``levels`` = a (the number of annotators, so soft labels are multiples of 1/a) it is
  followed by the sinusoidal staircase

  .. math::
    y = u - \theta\,\frac{\sin(2\pi a u)}{2\pi a},

  whose derivative :math:`u'\,(1 - \theta\cos(2\pi a u))` vanishes (θ = 1) at every
  level k/a: outputs settle on the annotator fractions, which stay fixed points
  (:math:`y = u` there), and θ ∈ [0, 1] keeps the map monotone (θ = 0: no staircase).
  [R] The paper names an "SSF" with parameters a (annotators) and θ; this is the
  staircase that reading suggests, not its verified formula.

  Args:
    x: scores (logits of the output layer).
    axis: the axis the rows run along (for ``where`` and validation; the map is
      pointwise).
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    levels: None (the clipped sine alone) or a static int a >= 1.
    theta: staircase depth θ in [0, 1] (only with ``levels``); a scalar or an array
      broadcast to the rows (size 1 along ``axis``); differentiable.

  Returns:
    Values in [0, 1] of ``x``'s shape and dtype (f32 compute for bf16/fp16); ``+inf``
    gives 1 and ``-inf`` is masked (0).

  Examples:
    >>> x = jnp.array([-2.0, -0.5, 0.0, 0.5, 2.0])
    >>> js.normalizers.sinusoid(x)
    Array([0.    , 0.2603, 0.5   , 0.7397, 1.    ], dtype=float32)
    >>> js.normalizers.sinusoid(x, levels=4)  # pulled towards 0, 1/4, 1/2, 3/4, 1
    Array([0.    , 0.2501, 0.5   , 0.7499, 1.    ], dtype=float32)

  References:
    P. Hosseini, M. Hosseini, S. Al-Azzawi, M. Liwicki, I. Castro & M. Purver, 2023,
    "Lon-eå at SemEval-2023 Task 11: A Comparison of Activation Functions for Soft and
    Hard Label Prediction" (SemEval).
  """
  fn = "sinusoid"
  levels = _check_levels(levels, fn)
  _THETA.validate(theta, fn)
  xs, mask, ax = c.prepare(x, axis, where, fn)
  th = c.row_param(theta, xs.shape, ax, "theta", fn, xs.dtype)
  return c.finish(_sinusoid_values(xs, levels, th), mask, jnp.asarray(x).dtype)


@c.dense_rules(inf_limit=1.0)
def step(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
         threshold: ArrayLike = 0.0, straight_through: bool = False) -> jax.Array:
  r"""Step output activation :math:`H(x - t)` (feature N42, kernel class P).

  The step P. Hosseini et al. 2023 (SemEval) add after training to turn soft-label
  outputs into hard labels [R]:

  .. math::
    y = H(x - t) = \begin{cases} 1 & x > t \\ \tfrac12 & x = t \\ 0 & x < t \end{cases}

  (on logits, t = 0 rounds ``sigmoid(x)`` at 1/2). Its gradient is 0 almost everywhere,
  which is what ``straight_through=False`` gives (registered as ``"step"``); with
  ``straight_through=True`` (registered as ``"step_straight_through"``) the value is the
  same hard step but the gradient is the sigmoid's, :math:`\sigma(x - t)(1 - \sigma(x -
  t))`, the straight-through estimator of Bengio, Léonard & Courville 2013, so the step
  can be kept while training.

  Args:
    x: scores (logits of the output layer).
    axis, where: as in :func:`sinusoid`.
    threshold: t; a scalar or an array broadcast to the rows; differentiable through the
      straight-through surrogate only.
    straight_through: a static bool: the sigmoid's gradient instead of 0.

  Returns:
    Values in {0, 1/2, 1} of ``x``'s shape and dtype; ``+inf`` gives 1, ``-inf`` is masked
    (0).

  Examples:
    >>> x = jnp.array([-1.0, 0.0, 0.3, 2.0])
    >>> js.normalizers.step(x)
    Array([0. , 0.5, 1. , 1. ], dtype=float32)
    >>> jax.grad(lambda v: js.normalizers.step(v, straight_through=True).sum())(x)
    Array([0.1966, 0.25  , 0.2445, 0.105 ], dtype=float32)

  References:
    P. Hosseini, M. Hosseini, S. Al-Azzawi, M. Liwicki, I. Castro & M. Purver, 2023,
    "Lon-eå at SemEval-2023 Task 11: A Comparison of Activation Functions for Soft and
    Hard Label Prediction" (SemEval).

    Y. Bengio, N. Léonard & A. Courville, 2013, "Estimating or Propagating Gradients
    Through Stochastic Neurons for Conditional Computation".
  """
  fn = "step"
  _THRESHOLD.validate(threshold, fn)
  if not isinstance(straight_through, (bool, np.bool_)):
    raise ValueError(f"{fn}: `straight_through` must be a static bool, got {straight_through!r}")
  xs, mask, ax = c.prepare(x, axis, where, fn)
  t = c.row_param(threshold, xs.shape, ax, "threshold", fn, xs.dtype)
  return c.finish(_step_values(xs - t, bool(straight_through)), mask, jnp.asarray(x).dtype)


def _sinusoid_numerator(z, m, levels=None, theta=1.0, **_):
  return _sinusoid_values(z, levels, theta)


def _threshold_score_map(x, length, threshold=0.0, **_):
  return x - threshold


def _step_numerator(z, m, **_):
  return _step_values(z, False)


def _step_st_numerator(z, m, **_):
  return _step_values(z, True)


_OUTPUT: dict = dict(kernel_class="P", catalogue_id="N42", sums_to_one=False, at_most_one=False,
                     nonnegative=True, shift_invariant=False, can_be_sparse=True)

SPEC_SINUSOID = register(NormalizerSpec(
    name="sinusoid", fn=sinusoid, params=(_LEVELS, _THETA), smooth=True,
    tile=TileRule(score_map=identity_score_map, numerator=_sinusoid_numerator),
    description="(1 + sin(clip(x, -pi/2, pi/2))) / 2, optional sinusoidal staircase", **_OUTPUT))

SPEC_STEP = register(NormalizerSpec(
    name="step", fn=step, params=(_THRESHOLD,), smooth=False,
    tile=TileRule(score_map=_threshold_score_map, numerator=_step_numerator),
    description="H(x - t), zero gradient", **_OUTPUT))

SPEC_STEP_ST = register(NormalizerSpec(
    name="step_straight_through", fn=functools.partial(step, straight_through=True),
    params=(_THRESHOLD,), smooth=False,
    tile=TileRule(score_map=_threshold_score_map, numerator=_step_st_numerator),
    description="H(x - t), sigmoid's gradient (straight-through)", **_OUTPUT))
