"""N01 softmax with temperature: the class-E exemplar every other normalizer follows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import (
    NormalizerSpec,
    Param,
    TileRule,
    register,
    temperature_score_map,
)

__all__ = ["softmax"]

_TEMPERATURE = Param("temperature", 1.0, low=0.0, low_open=True, sample=0.5, row_broadcast=True)


@c.dense_rules
def softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
            temperature: ArrayLike = 1.0) -> jax.Array:
  r"""Softmax with temperature (feature N01, kernel class E; see docs/feature_ids.md).

  .. math::
    \mathrm{softmax}(x)_i = \frac{e^{x_i / T}}{\sum_{j \in V} e^{x_j / T}}

  over the visible entries V of the row (``where`` True and ``x > -inf``). Computed as
  ``exp(x/T - m)`` with ``m`` the row max, in float32 for low-precision inputs.

  Args:
    x: scores.
    axis: the axis to normalize over, or a tuple of axes that form one row (as ``jax.nn``).
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    temperature: T > 0, a scalar or an array broadcast to the rows (size 1 along
      ``axis``); differentiable.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros (where
    ``jax.nn.softmax`` gives NaN), with zero gradient.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.softmax(x)
    Array([0.6652, 0.2447, 0.09  ], dtype=float32)
    >>> js.normalizers.softmax(x, temperature=0.5)  # sharper
    Array([0.8668, 0.1173, 0.0159], dtype=float32)
    >>> js.normalizers.softmax(x, where=jnp.array([True, True, False]))  # masked: exactly 0
    Array([0.7311, 0.2689, 0.    ], dtype=float32)
    >>> js.normalizers.softmax(x, where=jnp.zeros(3, bool))  # nothing visible: zeros, not NaN
    Array([0., 0., 0.], dtype=float32)

  References:
    J. S. Bridle, 1990, "Probabilistic Interpretation of Feedforward Classification
    Network Outputs, with Relationships to Statistical Pattern Recognition".

    G. Hinton, O. Vinyals & J. Dean, 2015, "Distilling the Knowledge in a Neural Network".
  """
  xs, mask, axis, m, hp = c.prepare_params(x, axis, where, "softmax",
                                           (_TEMPERATURE, temperature), with_max=True)
  t = hp["temperature"]
  # T > 0, so the row max of x / T is m / T: no second pass for the stabiliser.
  e = jnp.where(mask, jnp.exp((xs - m) / t), 0.0)
  d = jnp.sum(e, axis=axis, keepdims=True)  # >= 1 unless nothing is visible (then e = 0)
  w = e / jnp.where(d > 0, d, 1.0)  # exact zeros where masked, as finish() would give
  return w.astype(c.output_dtype(jnp.asarray(x).dtype))


SPEC = register(NormalizerSpec(
    name="softmax",
    fn=softmax,
    kernel_class="E",
    catalogue_id="N01",
    params=(_TEMPERATURE,),
    tile=TileRule.softmax(temperature_score_map),
    description="exp(x/T) / sum exp(x/T)",
))
