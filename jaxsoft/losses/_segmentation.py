"""Segmentation losses: the Dice semimetric loss, for soft or hard targets (feature L17)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as nc

__all__ = ["dice_semimetric_loss"]


def _reduce_axes(axis, ndim: int, fn: str) -> tuple[int, ...]:
  axes = (axis,) if isinstance(axis, int) else tuple(axis)
  if not axes:
    raise ValueError(f"{fn}: `axis` must name at least one axis")
  out = tuple(sorted({nc.canonical_axis(a, ndim, fn) for a in axes}))
  if len(out) != len(axes):
    raise ValueError(f"{fn}: `axis` repeats an axis: {axis!r}")
  return out


def dice_semimetric_loss(predictions: ArrayLike, targets: ArrayLike, *,
                         axis: int | Sequence[int] = -1,
                         where: ArrayLike | None = None) -> jax.Array:
  r"""Dice semimetric loss (L1 form) for soft or hard targets (feature L17).

  From Z. Wang, X. Yang, T. Popordanoska, M. B. Blaschko et al., "Dice Semimetric Losses:
  Optimizing the Dice Score with Soft Labels" (MICCAI 2023). With x, y in :math:`[0, 1]^n`
  (e.g. softmax or sigmoid outputs and the targets) summed over ``axis``:

  .. math::
    \mathrm{DML}_1(x, y) = \frac{\lVert x - y\rVert_1}{\lVert x\rVert_1 + \lVert y\rVert_1}
    = 1 - \frac{\lVert x\rVert_1 + \lVert y\rVert_1 - \lVert x - y\rVert_1}
                {\lVert x\rVert_1 + \lVert y\rVert_1}.

  For hard targets :math:`y \in \{0, 1\}^n` it equals the soft Dice loss
  :math:`1 - 2\langle x, y\rangle / (\lVert x\rVert_1 + \lVert y\rVert_1)`; unlike it,
  :math:`\mathrm{DML}_1(x, x) = 0` for soft x too. Symmetric, in [0, 1] for non-negative
  inputs. Empty (all-zero or fully masked) pairs get 0. The gradient of
  :math:`|x_i - y_i|` at :math:`x_i = y_i` is taken as 0.

  Args:
    predictions: x, non-negative (typically in [0, 1]).
    targets: y, the shape of ``predictions``.
    axis: the axis or axes summed over (e.g. the class and pixel axes of one image).
    where: optional mask broadcastable to ``predictions``; False entries are left out.

  Returns:
    The loss with ``axis`` reduced, in ``predictions``' dtype (float32 for integers).

  Examples:
    >>> x = jnp.array([[0.5, 0.5], [1.0, 0.0]])
    >>> print(js.losses.dice_semimetric_loss(x, jnp.array([[0.5, 0.5], [0.0, 1.0]])))
    [0. 1.]

  References:
    Z. Wang, X. Yang, T. Popordanoska, M. B. Blaschko et al., 2023, "Dice Semimetric Losses:
    Optimizing the Dice Score with Soft Labels" (MICCAI).
  """
  fn = "dice_semimetric_loss"
  x = jnp.asarray(predictions)
  y = jnp.asarray(targets)
  if x.shape != y.shape:
    raise ValueError(f"{fn}: `targets` of shape {y.shape} must have the shape of "
                     f"`predictions` {x.shape}")
  for name, a in (("predictions", x), ("targets", y)):
    if not (jnp.issubdtype(a.dtype, jnp.floating) or jnp.issubdtype(a.dtype, jnp.integer)
            or a.dtype == jnp.bool_):
      raise ValueError(f"{fn}: `{name}` must have a real dtype, got {a.dtype}")
  if x.ndim == 0:
    raise ValueError(f"{fn}: `predictions` must have at least one axis")
  axes = _reduce_axes(axis, x.ndim, fn)
  out_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
  dtype = nc.compute_dtype(jnp.dtype(out_dtype))
  xc, yc = x.astype(dtype), y.astype(dtype)
  if where is not None:
    keep = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    xc, yc = jnp.where(keep, xc, 0.0), jnp.where(keep, yc, 0.0)
  diff = xc - yc
  l1_diff = jnp.sum(jnp.where(diff == 0, 0.0, jnp.abs(diff)), axis=axes)
  den = jnp.sum(jnp.abs(xc), axis=axes) + jnp.sum(jnp.abs(yc), axis=axes)
  return nc.safe_divide(l1_diff, den).astype(out_dtype)
