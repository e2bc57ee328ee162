"""L04 StableMax cross-entropy and the softmax-collapse diagnostic (Prieto et al., ICLR 2025)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["stablemax_cross_entropy", "softmax_collapse_fraction"]


def log_stablemax_score(x: ArrayLike) -> jax.Array:
  r""":math:`\log s(x) = \operatorname{sign}(x)\,\log(1 + |x|)`, StableMax's score in log space.

  :math:`s(x) = x + 1` for :math:`x \ge 0` and :math:`1/(1 - x)` for :math:`x < 0`
  (Prieto et al., 2025), so :math:`\log s` is :math:`\log1p(x)`, resp.
  :math:`-\log1p(-x)`: finite for every finite x, odd, and :math:`C^1` with slope
  :math:`1/(1 + |x|)` (1 at 0 from both sides).
  """
  x = jnp.asarray(x)
  nonneg = x >= 0
  # each branch sees only its own half-line, so neither side's gradient leaks a NaN/inf
  pos = jnp.log1p(jnp.where(nonneg, x, 0.0))
  neg = -jnp.log1p(-jnp.where(nonneg, 0.0, x))
  return jnp.where(nonneg, pos, neg)


def stablemax_cross_entropy(logits: ArrayLike, labels: ArrayLike, *, axis: lc.Axis = -1,
                            where: ArrayLike | None = None, ignore_index: int | None = None) -> jax.Array:
  r"""Cross-entropy of log-StableMax (feature L04; L. Prieto et al., ICLR 2025).

  From "Grokking at the Edge of Numerical Stability" (L. Prieto, M. Barsbey,
  P. A. M. Mediano & T. Birdal, ICLR 2025, arXiv 2501.04697):

  .. math::
    \ell(x; y) = \log \sum_{j \in V} s(x_j) - \log s(x_y), \qquad
    s(x) = \begin{cases} x + 1 & x \ge 0 \\ 1/(1 - x) & x < 0 \end{cases}

  over the visible classes V; probability targets give
  :math:`-\sum_j y_j \log \mathrm{StableMax}(x)_j`. Computed directly in log space,
  :math:`\log \sum_j s(x_j) = \mathrm{LSE}_j(\log s(x_j))` with
  :math:`\log s(x) = \operatorname{sign}(x) \log1p(|x|)`, never as the log of normalised
  weights, so it neither overflows nor underflows for any finite logits. Because s grows
  linearly rather than exponentially, a confident prediction does not round the loss to
  0 in float32 (no softmax collapse): the gradient keeps flowing where softmax CE's is
  exactly 0. StableMax is not shift invariant.

  Masks, ``ignore_index`` and labels that name no visible class behave as in
  :func:`softmax_cross_entropy_with_integer_labels` (loss 0, resp. ``+inf``).

  Args:
    logits: ``[..., K, ...]`` float logits (bf16/fp16 computed in float32).
    labels: integer class indices (``logits``' shape without ``axis``) or probability
      targets (``logits``' shape, a floating dtype).
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional mask, broadcastable to ``logits`` (False classes are left out) or
      with one dimension fewer (per example; a False example gets loss 0).
    ignore_index: with integer labels, a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> logits = jnp.array([[2.0, 0.5, -1.0], [0.0, 0.3, 0.1]])
    >>> print(js.losses.stablemax_cross_entropy(logits, jnp.array([0, 1])))
    [0.5108 0.9614]

  References:
    L. Prieto, M. Barsbey, P. A. M. Mediano & T. Birdal, 2025, "Grokking at the Edge of
    Numerical Stability" (ICLR).
  """
  fn = "stablemax_cross_entropy"
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  logits, where, axis, (labels,) = lc.class_rows(logits, axis, where, fn, labels=labels)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  labels, y = lc.integer_or_probability_labels(labels, x, mask, axis, ignore_index, fn)
  log_s = log_stablemax_score(x)
  lse, visible = lc.masked_logsumexp(log_s, mask, axis)
  if y is None:
    log_s_y, label_visible = lc.gather_label(log_s, mask, labels, axis)
    return lc.integer_finish(lse - log_s_y, labels, visible, label_visible, ignore_index, dtype)
  log_p = log_s - jnp.expand_dims(lse, axis)
  loss = -jnp.sum(jnp.where(mask, y * log_p, 0.0), axis=axis)
  return lc.finish(loss, visible, dtype)


def softmax_collapse_fraction(logits: ArrayLike, labels: ArrayLike, *, axis: lc.Axis = -1,
                              where: ArrayLike | None = None, ignore_index: int | None = None) -> jax.Array:
  r"""Fraction of examples in Softmax Collapse (features L04/E02; Prieto et al., ICLR 2025).

  An example is collapsed when its float32 softmax cross-entropy is exactly 0:

  .. math::
    \mathrm{fl}_{32}\bigl(\mathrm{LSE}(x) - x_y\bigr) = 0,

  i.e. :math:`1 + \sum_{j \ne y} e^{x_j - x_y}` rounds to 1, the correct-class
  probability rounds to 1, and the gradient on the correct logit is exactly 0. LSE is
  the usual max-shifted float32 logsumexp (as in ``jax.nn.logsumexp`` and optax), and
  the logits are cast to float32 whatever their dtype: the diagnostic is about float32
  training. With 3 classes and ``x = [g, 0, 0]`` this happens from ``g = 16`` on.

  Args:
    logits: ``[..., K, ...]`` float logits.
    labels: integer class indices of ``logits``' shape without ``axis``.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class or example mask; masked examples, ignored labels and rows
      with no visible class are not counted (neither as collapsed nor in the total).
    ignore_index: a label value whose examples are not counted.

  Returns:
    A float32 scalar in [0, 1] (0 when no example counts). Not differentiable (a count).

  Examples:
    >>> logits = jnp.array([[40.0, 0.0, 0.0], [2.0, 0.5, -1.0]])
    >>> print(js.losses.softmax_collapse_fraction(logits, jnp.array([0, 0])))  # first row
    0.5

  References:
    L. Prieto, M. Barsbey, P. A. M. Mediano & T. Birdal, 2025, "Grokking at the Edge of
    Numerical Stability" (ICLR).
  """
  fn = "softmax_collapse_fraction"
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  logits = lc.check_logits(logits, fn).astype(jnp.float32)
  x, mask, axis = lc.prepare(logits, axis, where, fn)
  labels = lc.check_integer_labels(labels, x.shape, axis, fn)
  loss, visible, label_visible = lc.integer_cross_entropy(x, mask, labels, axis)
  counted = lc.drop_ignored(visible & label_visible, labels, ignore_index)
  collapsed = counted & (loss == 0.0)
  total = jnp.sum(counted)
  return nc.safe_divide(jnp.sum(collapsed), total).astype(jnp.float32)
