"""N21 sigmoid and N22 ReLU maps: pointwise, unnormalised "normalizers" (class P).

Each weight depends on its own score (and at most on n, the row's visible count), so a
blockwise kernel carries nothing across key blocks and rows need not sum to 1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import (
    NormalizerSpec,
    Param,
    TileRule,
    identity_score_map,
    register,
    sigmoid_numerator,
)

__all__ = ["sigmoid", "relu", "relu_n", "relu2"]

_BIAS = Param("bias", None, sample=-1.0, row_broadcast=True)


def _log_length(length):
  # log(max(n, 1)): an empty row (n = 0) stays finite; its entries are masked anyway.
  return jnp.log(jnp.maximum(length, 1.0))


def sigmoid(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
            bias: ArrayLike | None = None) -> jax.Array:
  r"""Sigmoid attention weights (feature N21, kernel class P; J. Ramapuram et al. 2024).

  From "Theory, Analysis, and Best Practices for Sigmoid Self-Attention" (J. Ramapuram
  et al. 2024, ICLR 2025, arXiv 2409.04431):

  .. math::
    w_i = \sigma(x_i + b), \qquad b = -\log n \text{ by default}

  with n the number of visible entries of the row (causal and padding aware), the
  paper's recommended bias: with zero scores the row sums to ``n / (n + 1)``. No row
  normalisation: weights lie in (0, 1), adding a key leaves the others unchanged when
  ``bias`` is given, and the Jacobian is diagonal, ``sigma (1 - sigma) <= 1/4``, written
  from the output (a ``custom_jvp``, as ``jax.nn.sigmoid``'s): reverse mode keeps only the
  output.

  Args:
    x: scores.
    bias: b; ``None`` means ``-log n``. A scalar or an array broadcast to the rows (size 1
      along ``axis``); differentiable.
    axis: the axis the bias's n counts over (the key axis).
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are not counted in n.

  Returns:
    Weights of ``x``'s shape and dtype (f32 compute); a fully masked row is all zeros
    with zero gradient.

  Examples:
    >>> js.normalizers.sigmoid(jnp.zeros(4))  # bias -log 4: each 1/5, the row sums to 4/5
    Array([0.2, 0.2, 0.2, 0.2], dtype=float32)
    >>> w = js.normalizers.sigmoid(jnp.array([2.0, 1.0, 0.0, -1.0]))
    >>> w
    Array([0.6488, 0.4046, 0.2   , 0.0842], dtype=float32)
    >>> w.sum()  # no row normalisation
    Array(1.3376, dtype=float32)

  References:
    J. Ramapuram et al., 2024, "Theory, Analysis, and Best Practices for Sigmoid
    Self-Attention".
  """
  _BIAS.validate(bias, "sigmoid")
  return _sigmoid_saving_output(x, where, () if bias is None else (bias,), (axis,))


@c.dense_rules(inf_limit=1.0)
def _sigmoid_rows(x, axis=-1, where=None, *, bias=None):
  """:func:`sigmoid`'s forward pass, under the shared rules."""
  xs, mask, ax = c.prepare(x, axis, where, "sigmoid")
  if bias is None:
    b = -_log_length(c.visible_count(mask, ax, xs.dtype))
  else:
    b = c.row_param(bias, xs.shape, ax, "bias", "sigmoid", xs.dtype)
  return c.finish(jax.nn.sigmoid(xs + b), mask, jnp.asarray(x).dtype)


_sigmoid_rows.__name__ = "sigmoid"  # the name the shared rules give in their errors


def _sigmoid_tangent(y, _, dx, params, dparams, static):
  """``dy = y (1 - y) (dx + db)``: 0 at masked entries (y = 0), at ``+inf`` entries (y = 1)
  and on the rows the NaN rule fills (y is NaN at their visible entries)."""
  cd = c.compute_dtype(y.dtype)
  zero = jnp.zeros((), cd)
  nan = jnp.isnan(y)
  yc = jnp.where(nan, zero, y.astype(cd))
  slope = yc * (1.0 - yc)
  dz = [jnp.where(nan, zero, dx.astype(cd))] if not c.is_zero_tangent(dx) else []
  if params and not c.is_zero_tangent(dparams[0]):
    dz.append(c.row_value(dparams[0], y.ndim, cd))
  return (slope * sum(dz[1:], dz[0])).astype(y.dtype)


# Reverse mode keeps the output alone (as jax.nn.sigmoid).
_sigmoid_saving_output = c.saving_output(
    lambda x, where, params, static: _sigmoid_rows(x, static[0], where,
                                                   bias=params[0] if params else None),
    _sigmoid_tangent, "sigmoid", odd=None)
# sigmoid applies the shared rules through _sigmoid_rows: the registry's mark
setattr(sigmoid, "_jaxsoft_dense_rules", True)  # noqa: B010


def relu(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""ReLU weights ``max(0, x_i)`` (feature N22, kernel class P; see docs/feature_ids.md).

  As a classification output, A. F. Agarap 2018, "Deep Learning using Rectified Linear
  Units (ReLU)" (arXiv 1803.08375); as attention, K. Shen et al. 2023, "A Study on ReLU and
  Softmax in Transformer" (arXiv 2302.06461).

  No normalisation: rows do not sum to 1, and a row whose scores are all <= 0 is all
  zeros ("attend to nothing"; for classification its argmax is ill-defined: ties broken
  by ``jnp.argmax``, the first index). Gradient 1 for x > 0, 0 for x <= 0 (written from
  the output, ``y > 0``: reverse mode keeps only the output).

  Args:
    x: scores.
    axis: the normalized (key) axis; used for validation and the mask.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype.

  Examples:
    >>> js.normalizers.relu(jnp.array([2.0, 1.0, 0.0, -1.0]))
    Array([2., 1., 0., 0.], dtype=float32)

  References:
    A. F. Agarap, 2018, "Deep Learning using Rectified Linear Units (ReLU)".

    K. Shen et al., 2023, "A Study on ReLU and Softmax in Transformer".
  """
  return _relu_saving_output(x, where, (), (axis,))


@c.dense_rules(inf_limit=float("inf"))
def _relu_rows(x, axis=-1, where=None):
  """:func:`relu`'s forward pass, under the shared rules."""
  xs, mask, _ = c.prepare(x, axis, where, "relu")
  return c.finish(jax.nn.relu(xs), mask, jnp.asarray(x).dtype)


_relu_rows.__name__ = "relu"  # the name the shared rules give in their errors


def _relu_tangent(y, _, dx, params, dparams, static):
  """``dy = dx`` where ``0 < y < inf``, else 0 (masked, non-positive and ``+inf`` entries,
  whose value is the rule's constant, and the rows the NaN rule fills, NaN in y)."""
  on = (y > 0) & (y < jnp.inf)
  return jnp.where(on, dx.astype(y.dtype), jnp.zeros((), y.dtype))


# Reverse mode keeps the output alone.
_relu_saving_output = c.saving_output(
    lambda x, where, params, static: _relu_rows(x, static[0], where),
    _relu_tangent, "relu", odd=None)
# relu applies the shared rules through _relu_rows: the registry's mark
setattr(relu, "_jaxsoft_dense_rules", True)  # noqa: B010


@c.dense_rules(inf_limit=float("inf"))
def relu_n(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""Length-normalised ReLU ``max(0, x_i) / n`` (feature N22, class P).

  n is the number of visible entries of the row, so for i.i.d. scores the output of
  ReLU attention stays O(1) as the length grows: the ``ReLU(QK^T/sqrt d) / L`` of
  M. Wortsman et al. 2023, "Replacing softmax with ReLU in Vision Transformers" (arXiv
  2309.08586). Arguments and returns as :func:`relu`; a fully masked row is zeros.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0, -1.0])
    >>> js.normalizers.relu_n(x)  # n = 4
    Array([0.5 , 0.25, 0.  , 0.  ], dtype=float32)
    >>> js.normalizers.relu_n(x, where=jnp.array([True, True, False, False]))  # n = 2
    Array([1. , 0.5, 0. , 0. ], dtype=float32)

  References:
    M. Wortsman, J. Lee, J. Gilmer & S. Kornblith, 2023, "Replacing softmax with ReLU in
    Vision Transformers".
  """
  xs, mask, ax = c.prepare(x, axis, where, "relu_n")
  n = jnp.maximum(c.visible_count(mask, ax, xs.dtype), 1.0)
  return c.finish(jax.nn.relu(xs) / n, mask, jnp.asarray(x).dtype)


@c.dense_rules(inf_limit=float("inf"))
def relu2(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""Squared ReLU ``max(0, x_i)^2`` (feature N22, kernel class P).

  C^1 (gradient ``2 max(0, x)``), unnormalised. Arguments and returns as :func:`relu`.
  The squared ReLU is the activation of D. R. So et al. 2021, "Primer: Searching for
  Efficient Transformers for Language Modeling" (arXiv 2109.08668), used here as
  attention weights.

  Examples:
    >>> js.normalizers.relu2(jnp.array([2.0, 1.0, 0.0, -1.0]))
    Array([4., 1., 0., 0.], dtype=float32)

  References:
    D. R. So et al., 2021, "Primer: Searching for Efficient Transformers for Language
    Modeling".
  """
  xs, mask, _ = c.prepare(x, axis, where, "relu2")
  return c.finish(jnp.square(jax.nn.relu(xs)), mask, jnp.asarray(x).dtype)


def _sigmoid_score_map(x, length, bias=None, **_):
  return x + (-_log_length(length) if bias is None else bias)


def _per_length_score_map(x, length, **_):
  # relu(x) / n = relu(x / n) for n > 0, so the division moves into the score map.
  return x / jnp.maximum(length, 1.0)


def _relu_numerator(z, m, **_):
  return jax.nn.relu(z)


def _relu2_numerator(z, m, **_):
  return jnp.square(jax.nn.relu(z))


_POINTWISE: dict[str, Any] = dict(kernel_class="P", catalogue_id="N22", sums_to_one=False,
                                  at_most_one=False, nonnegative=True, shift_invariant=False)

SPEC_SIGMOID = register(NormalizerSpec(
    name="sigmoid", fn=sigmoid, params=(_BIAS,), can_be_sparse=False, length_dependent=True,
    residuals="output",
    tile=TileRule(score_map=_sigmoid_score_map, numerator=sigmoid_numerator),
    description="sigmoid(x + b), b = -log n", **{**_POINTWISE, "catalogue_id": "N21"}))

SPEC_RELU = register(NormalizerSpec(
    name="relu", fn=relu, can_be_sparse=True, smooth=False, residuals="output",
    tile=TileRule(score_map=identity_score_map, numerator=_relu_numerator),
    description="max(0, x)", **_POINTWISE))

SPEC_RELU_N = register(NormalizerSpec(
    name="relu_n", fn=relu_n, can_be_sparse=True, smooth=False, length_dependent=True,
    tile=TileRule(score_map=_per_length_score_map, numerator=_relu_numerator),
    description="max(0, x) / n", **_POINTWISE))

SPEC_RELU2 = register(NormalizerSpec(
    name="relu2", fn=relu2, can_be_sparse=True, smooth=True,
    tile=TileRule(score_map=identity_score_map, numerator=_relu2_numerator),
    description="max(0, x)^2", **_POINTWISE))
