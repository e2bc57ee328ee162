"""L01 softmax cross-entropy (probability or integer targets) and L03 top-k sparse-softmax CE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = [
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
    "top_k_cross_entropy",
]


def softmax_cross_entropy(logits: ArrayLike, labels: ArrayLike, axis: lc.Axis = -1,
                          where: ArrayLike | None = None, *,
                          label_smoothing: ArrayLike = 0.0) -> jax.Array:
  r"""Softmax cross-entropy against probability targets (feature L01).

  .. math::
    \ell(x; y) = -\sum_{j \in V} \tilde y_j \log \mathrm{softmax}_V(x)_j,
    \qquad \tilde y = (1 - \epsilon)\, y + \epsilon / |V|,

  over the visible classes V of each row (``where`` True and ``x > -inf``), with
  :math:`\epsilon` = ``label_smoothing`` (``optax.smooth_labels``; the uniform part is
  spread over the visible classes only). Target mass on masked classes is ignored. The
  gradient in the logits is :math:`(\sum_V \tilde y)\,\mathrm{softmax}(x) - \tilde y`.

  Equals ``optax.losses.softmax_cross_entropy(logits, optax.smooth_labels(labels, eps))``
  wherever that is finite; unlike it, a ``-inf`` logit is a masked class (no NaN) and a
  row with no visible class has loss 0 and zero gradient.

  Args:
    logits: ``[..., K, ...]`` unnormalised log-probabilities (float; bf16/fp16 are
      computed in float32).
    labels: targets of ``logits``' shape (a distribution over classes per example; any
      float or int dtype). Differentiable.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional mask, either broadcastable to ``logits`` (False classes are left out)
      or with one dimension fewer (per example; a False example gets loss 0).
    label_smoothing: :math:`\epsilon \in [0, 1)`.

  Returns:
    One loss per example (``logits``' shape without ``axis``), in ``logits``' dtype.

  Examples:
    >>> logits = jnp.array([[1.2, -0.8, -0.5], [0.9, -1.2, 1.1]])
    >>> labels = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    >>> print(js.losses.softmax_cross_entropy(logits, labels))
    [0.2761 2.9518]

  References:
    C. Szegedy, V. Vanhoucke, S. Ioffe, J. Shlens & Z. Wojna, 2016, "Rethinking the Inception
    Architecture for Computer Vision" (CVPR; label smoothing).
  """
  fn = "softmax_cross_entropy"
  label_smoothing = lc.check_label_smoothing(label_smoothing, fn)
  logits, where, axis, (labels,) = lc.class_rows(logits, axis, where, fn, labels=labels)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  y = lc.check_probability_labels(
      labels, x.shape, fn,
      " (for integer class indices use softmax_cross_entropy_with_integer_labels)")
  y = jnp.where(mask, y, 0.0)
  if not _is_zero(label_smoothing):
    n = nc.visible_count(mask, axis)
    y = jnp.where(mask, (1.0 - label_smoothing) * y + nc.safe_divide(label_smoothing, n), 0.0)
  lse, visible = lc.masked_logsumexp(x, mask, axis)
  log_p = x - jnp.expand_dims(lse, axis)
  loss = -jnp.sum(jnp.where(mask, y * log_p, 0.0), axis=axis)
  return lc.finish(loss, visible, dtype)


def softmax_cross_entropy_with_integer_labels(
    logits: ArrayLike, labels: ArrayLike, axis: lc.Axis = -1, where: ArrayLike | None = None, *,
    label_smoothing: ArrayLike = 0.0, ignore_index: int | None = None) -> jax.Array:
  r"""Softmax cross-entropy against integer class labels (feature L01).

  .. math::
    \ell(x; y) = (1 - \epsilon)\,\bigl(\mathrm{LSE}_V(x) - x_y\bigr)
      + \epsilon\,\Bigl(\mathrm{LSE}_V(x) - \tfrac{1}{|V|}\sum_{j \in V} x_j\Bigr),

  the cross-entropy against the smoothed one-hot target
  :math:`(1-\epsilon)\,e_y + \epsilon/|V|` over the visible classes V (as
  ``optax.smooth_labels``), computed without materialising the target. Its gradient is
  :math:`\mathrm{softmax}_V(x) - \tilde y`.

  Edge cases: an example whose label equals ``ignore_index``, whose ``where`` is False or
  whose row has no visible class has loss 0 and zero gradient. A label that names no
  visible class (a masked class, a ``-inf`` logit, or an index outside ``[0, K)`` that is
  not ``ignore_index``) has probability 0, so its loss is ``+inf`` (never NaN; the
  gradient there is 0).

  Args:
    logits: ``[..., K, ...]`` float logits (bf16/fp16 computed in float32).
    labels: integer class indices of ``logits``' shape without ``axis``; with a tuple
      ``axis``, a flat index into the slice ``logits[axis]`` (row-major over the named axes
      in the order given, ``jnp.ravel_multi_index``), as optax.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional mask broadcastable to ``logits`` (classes) or of ``labels``' shape
      (examples).
    label_smoothing: :math:`\epsilon \in [0, 1)`.
    ignore_index: a label value whose examples get loss 0 (e.g. -100 for padding).

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> logits = jnp.array([[1.2, -0.8, -0.5], [0.9, -1.2, 1.1]])
    >>> print(js.losses.softmax_cross_entropy_with_integer_labels(logits, jnp.array([0, 1])))
    [0.2761 2.9518]
    >>> x = jnp.arange(24.0).reshape(1, 2, 3, 4)        # classes: the 3 x 4 slice
    >>> labels = jnp.ravel_multi_index((jnp.array([[1, 2]]), jnp.array([[1, 3]])), (3, 4))
    >>> print(js.losses.softmax_cross_entropy_with_integer_labels(x, labels, axis=(2, 3)))
    [[6.4587 0.4587]]

  References:
    That of :func:`softmax_cross_entropy` (label smoothing).
  """
  fn = "softmax_cross_entropy_with_integer_labels"
  label_smoothing = lc.check_label_smoothing(label_smoothing, fn)
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  labels = lc.check_integer_labels(labels, x.shape, axis, fn)
  lse, visible = lc.masked_logsumexp(x, mask, axis)
  x_y, label_visible = lc.gather_label(x, mask, labels, axis)
  loss = lse - x_y
  if not _is_zero(label_smoothing):
    n = nc.visible_count(mask, axis).squeeze(axis)
    mean_x = nc.safe_divide(jnp.sum(jnp.where(mask, x, 0.0), axis=axis), n)
    loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - mean_x)
  return lc.integer_finish(loss, labels, visible, label_visible, ignore_index, dtype)


def top_k_cross_entropy(logits: ArrayLike, labels: ArrayLike, k: int, *, axis: lc.Axis = -1,
                        where: ArrayLike | None = None, ignore_index: int | None = None) -> jax.Array:
  r"""Sparse-softmax cross-entropy over the top-k logits (feature L03).

  Sparse-softmax (S. Sun et al. 2021, "Sparse-softmax: A Simpler and Faster Alternative
  Softmax Transformation", arXiv 2112.12433) keeps the k largest logits
  :math:`\Omega_k` of a row and normalises over them only. Its loss is

  .. math::
    \ell(x; t) = \log \sum_{j \in \Omega} e^{x_j} - x_t, \qquad
    \Omega = \Omega_k \cup \{t\}.

  **Target outside the top-k.** The paper writes the loss for :math:`t \in \Omega_k`;
  when the target is not among the k largest logits we add it to the normalising set
  (:math:`\Omega_k \cup \{t\}`: this project's choice, since the paper does not cover
  that case). The loss then stays finite and positive and its gradient still raises
  :math:`x_t` and lowers the top-k logits, whereas dropping the target would give
  :math:`-\log 0`. So :math:`0 \le \ell \le` the full softmax CE, with equality when
  k is at least the number of visible classes. The gradient is
  :math:`\mathrm{softmax}_\Omega(x) - e_t`: exactly zero outside :math:`\Omega`.

  Ties at the k-th value are broken by the lower index (``jax.lax.top_k``); masked
  classes are never selected, and a row with fewer than k visible classes keeps all of
  them (plain softmax CE). Masked / ignored examples and labels naming no visible class
  are handled as in :func:`softmax_cross_entropy_with_integer_labels`.

  Args:
    logits: ``[..., K, ...]`` float logits (bf16/fp16 computed in float32).
    labels: integer class indices of ``logits``' shape without ``axis``.
    k: number of logits kept, ``1 <= k <= K``.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional mask, broadcastable to ``logits`` (False classes are left out) or
      with one dimension fewer (per example; a False example gets loss 0).
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> logits = jnp.array([[1.2, -0.8, -0.5], [0.9, -1.2, 1.1]])
    >>> print(js.losses.top_k_cross_entropy(logits, jnp.array([0, 1]), k=1))  # 0: label is top-1
    [0.     2.3955]

  References:
    S. Sun et al., 2021, "Sparse-softmax: A Simpler and Faster Alternative Softmax
    Transformation" (arXiv 2112.12433).
  """
  fn = "top_k_cross_entropy"
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  labels = lc.check_integer_labels(labels, x.shape, axis, fn)
  n_classes = x.shape[axis]
  k = lc.int_in_range(k, "k", 1, n_classes, fn, " (the size of the class axis)")
  x_y, label_visible = lc.gather_label(x, mask, labels, axis)
  support = _top_k_membership(x, mask, k, axis)
  target = lc.one_hot(labels, n_classes, axis, bool) & jnp.expand_dims(label_visible, axis)
  support = mask & (support | target)
  lse, visible = lc.masked_logsumexp(x, support, axis)
  return lc.integer_finish(lse - x_y, labels, visible, label_visible, ignore_index, dtype)


def _top_k_membership(x, mask, k: int, axis: int):
  """Boolean mask of the k largest visible entries of each row (ties: lower index)."""
  xm = jnp.moveaxis(jnp.where(mask, x, -jnp.inf), axis, -1)
  batch_shape, n = xm.shape[:-1], xm.shape[-1]
  _, idx = jax.lax.top_k(jax.lax.stop_gradient(xm), k)
  rows = idx.reshape(-1, k)
  member = jax.vmap(lambda i: jnp.zeros((n,), bool).at[i].set(True))(rows)
  member = member.reshape(batch_shape + (n,))
  return jnp.moveaxis(member, -1, axis)


def _is_zero(value) -> bool:
  """True for a concrete 0 (skips work); a traced value is never assumed to be 0."""
  try:
    return float(value) == 0.0
  except (TypeError, jax.errors.ConcretizationTypeError):
    return False

