"""L15 non-softmax output heads: one-vs-rest sigmoid BCE, GOL (Gumbel BCE), L2-SVM squared hinge.

Each is a sum over the visible classes of a per-class binary loss, so, unlike softmax CE,
the loss of a class depends on its own logit only (a diagonal Jacobian) and the class
probabilities need not sum to 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.losses import _common as lc

__all__ = ["gol_loss", "l2_svm_loss", "ovr_bce_loss"]

def ovr_bce_loss(logits: ArrayLike, labels: ArrayLike, *, axis: lc.Axis = -1,
                 where: ArrayLike | None = None, ignore_index: int | None = None) -> jax.Array:
  r"""One-vs-rest sigmoid binary cross-entropy summed over classes (feature L15).

  .. math::
    \ell(z; y) = -\sum_{c \in V} \bigl[y_c \log\sigma(z_c) + (1 - y_c)\log(1 - \sigma(z_c))\bigr]
      = \sum_{c \in V} \bigl[\mathrm{softplus}(z_c) - y_c z_c\bigr],

  the multi-binary criterion that replaces softmax CE to remove the competition between
  classes, as in J. Pan & K. Huang, "PCOV-KWS: Multi-task Learning for Personalized
  Customizable Open Vocabulary Keyword Spotting" (2026, arXiv 2603.18023). It equals the sum over classes of
  ``optax.sigmoid_binary_cross_entropy``; its gradient is :math:`\sigma(z) - y`.

  Args:
    logits: ``[..., K, ...]`` float logits (bf16/fp16 computed in float32).
    labels: integer classes (``logits``' shape without ``axis``; one-hot targets) or
      targets in [0, 1] of ``logits``' shape (multi-label or soft).
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class mask (broadcastable to ``logits``) or example mask (one
      dimension fewer); a masked class adds nothing.
    ignore_index: with integer labels, a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> print(js.losses.ovr_bce_loss(jnp.array([[2.0, -1.0, 0.0]]), jnp.array([0])))
    [1.1333]

  References:
    J. Pan & K. Huang, 2026, "PCOV-KWS: Multi-task Learning for Personalized Customizable Open
    Vocabulary Keyword Spotting" (arXiv 2603.18023).
  """
  fn = "ovr_bce_loss"
  return _per_class_sum(fn, logits, labels, axis, where, ignore_index,
                        lambda z, y: jax.nn.softplus(z) - y * z)


def gol_loss(logits: ArrayLike, labels: ArrayLike, *, axis: lc.Axis = -1,
             where: ArrayLike | None = None, ignore_index: int | None = None) -> jax.Array:
  r"""Gumbel Optimized Loss: binary CE with the Gumbel CDF as activation (feature L15).

  From K. P. Alexandridis, J. Deng, A. Nguyen & S. Luo, "Long-tailed Instance Segmentation
  using Gumbel Optimized Loss" (ECCV 2022). With :math:`\eta(z) = \exp(-e^{-z})` (the
  Gumbel CDF, :math:`\eta(0) = e^{-1}`, skewed towards small probabilities, which suits
  rare classes):

  .. math::
    \ell(z; y) = \sum_{c \in V} \bigl[y_c\, e^{-z_c}
      - (1 - y_c)\log\bigl(1 - \exp(-e^{-z_c})\bigr)\bigr].

  :math:`\log(1 - \exp(-t))` is computed as ``log(-expm1(-t))``, and as
  :math:`-z - t/2` once :math:`z > 15` (where t = e^{-z} would underflow), so the loss is
  finite for every finite logit. Below z = -80 the logit is taken as -80 in value
  (:math:`e^{80} \approx 5.5\cdot10^{34}`; the exact loss would overflow float32) while the
  gradient is still the one at -80, so a missed positive keeps its push.

  Args:
    logits, labels, axis, where, ignore_index: as in :func:`ovr_bce_loss`.

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> print(js.losses.gol_loss(jnp.array([[2.0, -1.0, 0.0]]), jnp.array([0])))
    [0.6623]

  References:
    K. P. Alexandridis, J. Deng, A. Nguyen & S. Luo, 2022, "Long-tailed Instance Segmentation
    using Gumbel Optimized Loss" (ECCV).
  """
  fn = "gol_loss"

  def per_class(z, y):
    z = z + jax.lax.stop_gradient(jnp.maximum(z, -80.0) - z)  # value clipped, gradient kept
    t = jnp.exp(-z)
    big = z > 15.0
    z_small = jnp.where(big, 15.0, z)
    neg_direct = -jnp.log(-jnp.expm1(-jnp.exp(-z_small)))
    neg = jnp.where(big, z + 0.5 * t, neg_direct)  # -log(1 - eta) = z + t/2 + O(t^2)
    return y * t + (1.0 - y) * neg

  return _per_class_sum(fn, logits, labels, axis, where, ignore_index, per_class)


def l2_svm_loss(logits: ArrayLike, labels: ArrayLike, *, axis: lc.Axis = -1,
                where: ArrayLike | None = None, ignore_index: int | None = None) -> jax.Array:
  r"""L2-SVM one-vs-rest squared hinge loss (feature L15).

  From A. F. Agarap, "An Architecture Combining Convolutional Neural Network (CNN) and
  Support Vector Machine (SVM) for Image Classification" (2017), after Y. Tang, "Deep
  Learning using Linear Support Vector Machines" (2013):

  .. math::
    \ell(z; y) = \sum_{c \in V} \max(0,\, 1 - t_c z_c)^2, \qquad t_c = 2 y_c - 1 \in \{-1, 1\},

  the per-example data term of :math:`\tfrac12\|w\|^2 + C\sum_i \ell_i` (add the weight
  penalty with your optimiser). Zero, with zero gradient, once every class is beyond the
  margin; the gradient is continuous at the hinge. A logit beyond about 1.8e19 on the
  wrong side overflows the square (float32). Equals the sum over classes of
  ``optax.hinge_loss(z, t) ** 2``. Predict with ``argmax`` of the logits.

  Args:
    logits, labels, axis, where, ignore_index: as in :func:`ovr_bce_loss`.

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> print(js.losses.l2_svm_loss(jnp.array([[2.0, -1.0, 0.0]]), jnp.array([0])))
    [1.]

  References:
    A. F. Agarap, 2017, "An Architecture Combining Convolutional Neural Network (CNN) and
    Support Vector Machine (SVM) for Image Classification".

    Y. Tang, 2013, "Deep Learning using Linear Support Vector Machines".
  """
  fn = "l2_svm_loss"
  return _per_class_sum(fn, logits, labels, axis, where, ignore_index,
                        lambda z, y: jnp.square(jnp.maximum(0.0, 1.0 - (2.0 * y - 1.0) * z)))


def _per_class_sum(fn, logits, labels, axis, where, ignore_index, per_class):
  """sum over visible classes of ``per_class(z, y)``, integer or probability targets."""
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  logits, where, axis, (labels,) = lc.class_rows(logits, axis, where, fn, labels=labels)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  x = jnp.where(mask, x, 0.0)   # a -inf (masked) logit enters no branch of per_class
  labels, y = lc.integer_or_probability_labels(labels, x, mask, axis, ignore_index, fn)
  keep = jnp.any(mask, axis=axis)
  if y is None:
    y = lc.one_hot(labels, x.shape[axis], axis)
    keep = lc.drop_ignored(keep, labels, ignore_index)
  loss = jnp.sum(jnp.where(mask, per_class(x, y), 0.0), axis=axis)
  return lc.finish(loss, keep, dtype)
