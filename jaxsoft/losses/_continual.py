"""Continual-learning softmax cross-entropy: the old tasks' classes masked out of the
softmax or frozen behind a stop-gradient (feature L17)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import boolean_mask
from jaxsoft.losses import _common as lc
from jaxsoft.losses._classification import softmax_cross_entropy_with_integer_labels
from jaxsoft.normalizers import common as nc

__all__ = ["continual_cross_entropy"]

_CL_MODES = ("mask", "stop_gradient")


def continual_cross_entropy(logits: ArrayLike, labels: ArrayLike, current_classes: ArrayLike, *,
                            mode: str = "mask", axis: lc.Axis = -1, where: ArrayLike | None = None,
                            ignore_index: int | None = None) -> jax.Array:
  r"""Softmax CE with the classes outside the current task masked or frozen (feature L17).

  From "Revisiting Softmax Masking: Stop Gradient for Enhancing Stability in Replay-based
  Continual Learning" (2023). With :math:`m_c = 1` for the classes of the current task
  (``current_classes``):

  * ``mode="mask"``: :math:`p_c = e^{z_c} m_c / \sum_j e^{z_j} m_j`, i.e. the old classes
    leave the softmax (as ``-inf`` logits; this is :func:`softmax_cross_entropy_with_integer_labels`
    with ``where=current_classes``). A label on an old class gets ``+inf``.
  * ``mode="stop_gradient"`` [R]: the old logits stay in the normaliser but carry no
    gradient, :math:`p_c = e^{z_c} / (\sum_{j \in \mathrm{cur}} e^{z_j} +
    \sum_{j \in \mathrm{old}} e^{\mathrm{sg}(z_j)})`; the value is plain softmax CE and the
    gradient with respect to every old logit is exactly 0 (a replayed example of an old
    class trains only through the current logits of its denominator).

  An all-True ``current_classes`` gives plain softmax CE in both modes.

  Args:
    logits: ``[..., K, ...]`` logits.
    labels: integer classes of ``logits``' shape without ``axis``.
    current_classes: boolean mask of the current task's classes, broadcastable to ``logits``
      (e.g. ``[K]`` for a class-last batch).
    mode: ``"mask"`` or ``"stop_gradient"``.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class or example mask, as the other losses.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> z, cur = jnp.array([[2.0, 1.0, 0.0]]), jnp.array([False, True, True])
    >>> print(js.losses.continual_cross_entropy(z, jnp.array([1]), cur))
    [0.3133]
    >>> print(js.losses.continual_cross_entropy(z, jnp.array([1]), cur, mode="stop_gradient"))
    [1.4076]

  References:
    "Revisiting Softmax Masking: Stop Gradient for Enhancing Stability in Replay-based Continual
    Learning", 2023 (its authors are not recorded here).
  """
  fn = "continual_cross_entropy"
  if mode not in _CL_MODES:
    raise ValueError(f"{fn}: `mode` must be one of {_CL_MODES}, got {mode!r}")
  z = lc.check_logits(logits, fn)
  cur = boolean_mask(current_classes, z.shape, "current_classes", fn, "`logits`")
  z, where, axis, (cur,) = lc.class_rows(z, axis, where, fn, current_classes=cur)
  if mode == "mask":
    ex = lc.example_where(where, z.ndim, nc.canonical_axis(axis, z.ndim, fn))
    mask = cur if ex is None else jnp.logical_and(cur, ex)
    return softmax_cross_entropy_with_integer_labels(z, labels, axis, mask,
                                                     ignore_index=ignore_index)
  frozen = jnp.where(cur, z, jax.lax.stop_gradient(z))
  return softmax_cross_entropy_with_integer_labels(frozen, labels, axis, where,
                                                   ignore_index=ignore_index)
