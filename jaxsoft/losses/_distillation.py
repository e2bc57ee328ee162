"""L11 knowledge distillation: logit-standardised KD, the squared-error logit loss and KD from
an averaged teacher ensemble.

Masks follow the other losses: ``where`` broadcastable to the logits masks classes (left
out of every mean, std, sum and normaliser) or, with one dimension fewer, examples (loss
0, zero gradient). One value per example comes back, in the student logits' dtype
(bf16/fp16 computed in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = [
    "averaged_teacher_kd_loss",
    "logit_standardized_kd_loss",
    "squared_error_logit_loss",
]


def _same_shape(a, b, name_a, name_b, fn):
  if a.shape != b.shape:
    raise ValueError(f"{fn}: `{name_b}` of shape {b.shape} must have `{name_a}`' shape {a.shape}")


def _log_softmax(x, mask, axis):
  """Masked log-softmax (0 at masked entries) and the row's visible flag."""
  lse, visible = lc.masked_logsumexp(x, mask, axis)
  return jnp.where(mask, x - jnp.expand_dims(lse, axis), 0.0), visible


def _kl(log_p, log_q, mask, axis):
  """Σ_visible p (log p − log q); terms with p = 0 are 0."""
  p = jnp.where(mask, jnp.exp(log_p), 0.0)
  return jnp.sum(jnp.where(mask, p * (log_p - log_q), 0.0), axis=axis)


def _standardize(x, mask, axis, eps):
  """(x − mean)/(std + eps) over the visible classes; std with n − 1 (as torch's ``std``)."""
  n = nc.visible_count(mask, axis)
  mean = nc.safe_divide(jnp.sum(jnp.where(mask, x, 0.0), axis=axis, keepdims=True), n)
  dev = jnp.where(mask, x - mean, 0.0)
  var = nc.safe_divide(jnp.sum(dev * dev, axis=axis, keepdims=True), jnp.maximum(n - 1.0, 0.0))
  # sqrt with a gradient free of NaN at var = 0 (a constant row)
  pos = var > 0
  std = jnp.where(pos, jnp.sqrt(jnp.where(pos, var, 1.0)), 0.0)
  return nc.safe_divide(dev, std + eps)


def logit_standardized_kd_loss(student_logits: ArrayLike, teacher_logits: ArrayLike, *,
                               temperature: ArrayLike = 1.0, eps: float = 1e-7, axis: lc.Axis = -1,
                               where: ArrayLike | None = None) -> jax.Array:
  r"""Knowledge distillation on z-scored logits (feature L11).

  From S. Sun, W. Ren, J. Li, R. Wang & X. Cao, "Logit Standardization in Knowledge
  Distillation" (CVPR 2024). With :math:`Z(z) = (z - \bar z)/(\mathrm{std}(z) + \epsilon)`
  over the visible classes (the unbiased std, n − 1, as the authors' code),

  .. math::
    \ell = \tau^2\, \mathrm{KL}\bigl(\mathrm{softmax}(Z(z^T)/\tau)\,\big\|\,
      \mathrm{softmax}(Z(z^S)/\tau)\bigr),

  i.e. vanilla KD with a per-sample temperature :math:`\tau\,\mathrm{std}(z)`. It is
  invariant to :math:`z \to a z + b` (a > 0) of either logit vector (up to ε), so a student
  whose logits are a positive-affine map of the teacher's has loss 0. No gradient flows
  into the teacher unless it is traced through (apply ``jax.lax.stop_gradient`` to freeze
  it). A constant row has Z = 0 (also with ε = 0).

  Args:
    student_logits: ``[..., K, ...]`` student logits.
    teacher_logits: teacher logits of the same shape.
    temperature: base temperature :math:`\tau > 0`.
    eps: :math:`\epsilon \ge 0` added to the std.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class mask (broadcastable) or example mask (one dimension fewer).

  Returns:
    One loss per example, in ``student_logits``' dtype.

  Examples:
    >>> s, t = jnp.array([[2.0, 0.5, -1.0]]), jnp.array([[1.0, 3.0, -2.0]])
    >>> print(js.losses.logit_standardized_kd_loss(s, t))  # = for 10 * s - 3, or 2 * t + 1
    [0.3492]

  References:
    S. Sun, W. Ren, J. Li, R. Wang & X. Cao, 2024, "Logit Standardization in Knowledge
    Distillation" (CVPR).

    G. Hinton, O. Vinyals & J. Dean, 2015, "Distilling the Knowledge in a Neural Network".
  """
  fn = "logit_standardized_kd_loss"
  tau = check_positive(temperature, "temperature", fn)
  if not (isinstance(eps, (int, float)) and eps >= 0):
    raise ValueError(f"{fn}: `eps` must be a float >= 0, got {eps!r}")
  student_logits, where, axis, (teacher_logits,) = lc.class_rows(
      student_logits, axis, where, fn, "student_logits", teacher_logits=teacher_logits)
  xs, mask, axis, dtype = lc.prepare_logits(student_logits, axis, where, fn)
  xt, mask_t, _ = lc.prepare(teacher_logits, axis, where, fn)
  _same_shape(xs, xt, "student_logits", "teacher_logits", fn)
  mask = mask & mask_t
  log_p, visible = _log_softmax(_standardize(xt, mask, axis, eps) / tau, mask, axis)
  log_q, _ = _log_softmax(_standardize(xs, mask, axis, eps) / tau, mask, axis)
  return lc.finish(tau * tau * _kl(log_p, log_q, mask, axis), visible, dtype)


def squared_error_logit_loss(student_logits: ArrayLike, labels: ArrayLike,
                             teacher_log_probs: ArrayLike, *, axis: lc.Axis = -1,
                             where: ArrayLike | None = None,
                             ignore_index: int | None = None) -> jax.Array:
  r"""Squared-error logit loss for distillation from the teacher's label probability (L11) [R].

  From Q. Zhao & B. Zhu, "Towards the Fundamental Limits of Knowledge Transfer over Finite
  Domains" (2023): when each sampled label :math:`a \sim \pi^*(\cdot \mid s)` comes with the
  teacher's probability :math:`\pi^*(a \mid s)`, the naive weighted cross-entropy
  :math:`-\pi^*(a)\log q(a)` is biased (its population minimiser is
  :math:`q \propto \pi^{*2}`), while a squared error on the log-probabilities is not.
  Reconstructed form [R: the paper's exact estimator is not known here]:

  .. math::
    \ell = \bigl(\log\mathrm{softmax}(z^S)_a - \log \pi^*(a \mid s)\bigr)^2,

  whose expectation over :math:`a \sim \pi^*` is 0 exactly at :math:`q = \pi^*` (the
  student's log-softmax absorbs the centring constant c(s) of the logit form
  :math:`(z^S_a - \log\pi^*(a) - c(s))^2`).

  Args:
    student_logits: ``[..., K, ...]`` student logits.
    labels: integer sampled labels a (the logits' shape without ``axis``).
    teacher_log_probs: :math:`\log\pi^*(a \mid s)` of each label, of ``labels``' shape.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class or example mask.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``student_logits``' dtype.

  Examples:
    >>> z, a = jnp.zeros((1, 2)), jnp.array([0])  # the student's log p(a) = -log 2
    >>> print(js.losses.squared_error_logit_loss(z, a, jnp.array([-1.0])))  # (1 - log 2)^2
    [0.0942]

  References:
    Q. Zhao & B. Zhu, 2023, "Towards the Fundamental Limits of Knowledge Transfer over Finite
    Domains".
  """
  fn = "squared_error_logit_loss"
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  student_logits, where, axis, _ = lc.class_rows(student_logits, axis, where, fn, "student_logits")
  x, mask, axis, dtype = lc.prepare_logits(student_logits, axis, where, fn)
  labels = jnp.asarray(lc.check_integer_labels(labels, x.shape, axis, fn))
  lt = lc.float_input(teacher_log_probs, "teacher_log_probs", fn)
  if lt.shape != labels.shape:
    raise ValueError(f"{fn}: `teacher_log_probs` must be a float array of `labels`' shape "
                     f"{labels.shape}, got {lt.shape} {lt.dtype}")
  ce, visible, label_visible = lc.integer_cross_entropy(x, mask, labels, axis)
  finite = jnp.isfinite(lt)
  lt = jnp.where(finite, lt.astype(x.dtype), 0.0)
  loss = jnp.where(finite, jnp.square(-ce - lt), jnp.inf)
  return lc.integer_finish(loss, labels, visible, label_visible, ignore_index, dtype)


def averaged_teacher_kd_loss(student_logits: ArrayLike, teacher_logits: ArrayLike, *,
                             temperature: ArrayLike = 1.0, axis: lc.Axis = -1,
                             where: ArrayLike | None = None) -> jax.Array:
  r"""Distillation from the average of an ensemble's softmax outputs (feature L11).

  From Z. Shen & M. Savvides, "MEAL V2: Boosting Vanilla ResNet-50 to 80%+ Top-1 Accuracy
  on ImageNet without Tricks" (2020): the student matches the mean of the teachers'
  probabilities (a mean of softmaxes, not the softmax of the mean logits),

  .. math::
    \bar p = \frac{1}{T}\sum_{t=1}^{T} \mathrm{softmax}(z^{(t)}/\tau), \qquad
    \ell = \tau^2\,\mathrm{KL}\bigl(\bar p \,\big\|\, \mathrm{softmax}(z^S/\tau)\bigr),

  with no one-hot labels (the paper's discriminator term is not part of this loss). The
  gradient in the student logits is :math:`\tau(\mathrm{softmax}(z^S/\tau) - \bar p)`;
  the loss is 0 exactly when the student's softmax equals :math:`\bar p`.

  Args:
    student_logits: ``[..., K, ...]`` student logits.
    teacher_logits: ``[T, ...]`` the T teachers' logits stacked on a new leading axis.
    temperature: :math:`\tau > 0`.
    axis: the class axis of ``student_logits``, or a tuple of its axes that form one class
      axis (None: all).
    where: optional class or example mask (for the student's shape).

  Returns:
    One loss per example, in ``student_logits``' dtype.

  Examples:
    >>> teachers = jnp.array([[[2.0, 0.0]], [[0.0, 2.0]]])  # [T, B, K]: their mean softmax is uniform
    >>> print(js.losses.averaged_teacher_kd_loss(jnp.array([[1.0, 0.0]]), teachers))  # KL(uniform || p)
    [0.1201]

  References:
    Z. Shen & M. Savvides, 2020, "MEAL V2: Boosting Vanilla ResNet-50 to 80%+ Top-1 Accuracy on
    ImageNet without Tricks".

    G. Hinton, O. Vinyals & J. Dean, 2015, "Distilling the Knowledge in a Neural Network".
  """
  fn = "averaged_teacher_kd_loss"
  tau = check_positive(temperature, "temperature", fn)
  zt = lc.float_input(teacher_logits, "teacher_logits", fn)
  student_shape = jnp.shape(student_logits)
  if zt.ndim != len(student_shape) + 1 or zt.shape[1:] != student_shape or zt.shape[0] == 0:
    raise ValueError(f"{fn}: `teacher_logits` of shape {zt.shape} must be [T] + the student's "
                     f"shape {student_shape} (T >= 1 teachers stacked on axis 0)")
  if not isinstance(axis, int):  # each teacher's class axes merged as the student's
    zt = jax.vmap(lambda t: lc.class_rows(t, axis, None, fn, "teacher_logits")[0])(zt)
  student_logits, where, axis, _ = lc.class_rows(student_logits, axis, where, fn, "student_logits")
  xs, mask, axis, dtype = lc.prepare_logits(student_logits, axis, where, fn)
  xt, mask_t, _ = lc.prepare(zt, axis + 1, None if where is None else
                             jnp.expand_dims(lc.example_where(where, xs.ndim, axis), 0), fn)
  mask = mask & jnp.all(mask_t, axis=0)
  log_pt, _ = _log_softmax(xt / tau, mask[None], axis + 1)
  n_t = zt.shape[0]
  log_pbar = jax.nn.logsumexp(jnp.where(mask[None], log_pt, 0.0), axis=0) - jnp.log(float(n_t))
  log_q, visible = _log_softmax(xs / tau, mask, axis)
  return lc.finish(tau * tau * _kl(log_pbar, log_q, mask, axis), visible, dtype)
