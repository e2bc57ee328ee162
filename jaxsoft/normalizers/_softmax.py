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


def softmax(x: ArrayLike, axis: int | tuple[int, ...] = -1, where: ArrayLike | None = None, *,
            temperature: ArrayLike = 1.0) -> jax.Array:
  r"""Softmax with temperature (feature N01, kernel class E; see docs/feature_ids.md).

  .. math::
    \mathrm{softmax}(x)_i = \frac{e^{x_i / T}}{\sum_{j \in V} e^{x_j / T}}

  over the visible entries V of the row (``where`` True and ``x > -inf``). Computed as
  ``exp(x/T - m)`` with ``m`` the row max, in float32 for low-precision inputs. The
  derivative is written in terms of the output ``y`` (a ``custom_jvp``, as in
  ``jax.nn.softmax``),

  .. math::
    dy = y \odot (dz - \langle y, dz \rangle), \quad
    dz = \frac{dx}{T} - \frac{dT}{T} (\log y - \langle y, \log y \rangle),

  so reverse mode keeps only ``y`` and one flag per row between the forward and the
  backward pass (``jax.nn.softmax`` keeps ``y``).

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
  _TEMPERATURE.validate(temperature, "softmax")  # (a concrete value: inside, it is traced)
  return _softmax_saving_output(x, where, (temperature,), (axis,))


def _softmax_body(x, axis=-1, where=None, *, temperature=1.0):
  """The weights of :func:`softmax` (its forward pass; the shared rules wrap it below)."""
  xs, mask, axis, m, hp = c.prepare_params(x, axis, where, "softmax",
                                           (_TEMPERATURE, temperature), with_max=True)
  t = hp["temperature"]
  # T > 0, so the row max of x / T is m / T: no second pass for the stabiliser.
  e = jnp.where(mask, jnp.exp((xs - m) / t), 0.0)
  d = jnp.sum(e, axis=axis, keepdims=True)  # >= 1 unless nothing is visible (then e = 0)
  w = e / jnp.where(d > 0, d, 1.0)  # exact zeros where masked, as finish() would give
  return w.astype(c.output_dtype(jnp.asarray(x).dtype))


_softmax_body.__name__ = "softmax"  # the name the shared rules give in their errors
_softmax_rows = c.dense_rules(_softmax_body)


def _softmax_tangent(y, odd, dx, params, dparams, static):
  r"""``dy = y (dx/T - <y, dx/T>) - (dT/T) y (log y - <y, log y>)``, from ``y`` alone.

  ``log y = x/T - LSE`` up to a per-row constant, which the centring removes, so the
  temperature's term needs no ``x`` either. Rows the shared rules fill in (a visible NaN
  or ``+inf``) get a zero tangent, as the fill is a constant.
  """
  (axis,), (temperature,), (dt,) = static, params, dparams
  cd = c.compute_dtype(y.dtype)
  t = c.row_value(temperature, y.ndim, cd)
  zero = jnp.zeros((), cd)

  def centred(p, v):  # p (v - <p, v>)
    return p * (v - jnp.sum(p * v, axis=axis, keepdims=True))

  parts = []
  if not c.is_zero_tangent(dx):
    # The selects on both sides keep the odd rows at 0 in both modes, also through the
    # transpose (y is NaN on a NaN row). XLA:CPU runs this about twice as fast as zeroing
    # y on those rows first.
    parts.append(centred(y.astype(cd), jnp.where(odd, zero, dx.astype(cd) / t)))
  if not c.is_zero_tangent(dt):
    p = jnp.where(odd, zero, y.astype(cd))  # finite: the coefficient of dT
    pos = p > 0
    log_p = jnp.where(pos, jnp.log(jnp.where(pos, p, jnp.ones((), cd))), zero)
    parts.append(-(c.row_value(dt, y.ndim, cd) / t) * centred(p, log_p))
  return jnp.where(odd, zero, sum(parts[1:], parts[0])).astype(y.dtype)


# Reverse mode keeps y and one flag per row (jax.nn.softmax keeps y).
_softmax_saving_output = c.saving_output(
    lambda x, where, params, static: _softmax_rows(x, static[0], where, temperature=params[0]),
    _softmax_tangent, "softmax")
# softmax applies the shared rules through _softmax_rows: the registry's mark
setattr(softmax, "_jaxsoft_dense_rules", True)  # noqa: B010

SPEC = register(NormalizerSpec(
    name="softmax",
    fn=softmax,
    kernel_class="E",
    catalogue_id="N01",
    params=(_TEMPERATURE,),
    tile=TileRule.softmax(temperature_score_map),
    residuals="output",
    description="exp(x/T) / sum exp(x/T)",
))
