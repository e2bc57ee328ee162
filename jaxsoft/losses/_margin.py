"""L06 margin softmax losses on cosine logits: ArcFace (+ sub-centres), CosFace / AM-softmax and
the normalised (cosine) softmax."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["adacos_scale", "arcface_loss", "cosface_loss", "normalized_softmax_loss"]

EMBEDDING_BATCH = "`embeddings`' shape without its last axis"


def cosine_logits(embeddings: ArrayLike, class_weights: ArrayLike, fn_name: str = "cosine_logits"):
  r"""Cosines :math:`\hat x \cdot \hat w_j` of L2-normalised embeddings and class weights.

  ``embeddings`` ``[..., d]``; ``class_weights`` ``[d, C]``, or ``[d, C, K]`` for K
  sub-centres per class (the class's cosine is the largest of its K, as sub-center ArcFace).
  Returns float32 (float64 under x64 for float64 inputs) cosines ``[..., C]`` in
  :math:`[-1, 1]`. A zero vector has cosine 0 with everything.
  """
  x = lc.float_input(embeddings, "embeddings", fn_name)
  w = lc.float_input(class_weights, "class_weights", fn_name)
  if x.ndim < 1:
    raise ValueError(f"{fn_name}: `embeddings` must be [..., d], got a scalar")
  if w.ndim not in (2, 3) or w.shape[0] != x.shape[-1]:
    raise ValueError(
        f"{fn_name}: `class_weights` must be [d, C] or [d, C, K] (K sub-centres) with "
        f"d = {x.shape[-1]} (the last axis of `embeddings`), got shape {w.shape}")
  dtype = nc.compute_dtype(jnp.result_type(x.dtype, w.dtype))
  x_hat = _l2_normalize(x.astype(dtype), axis=-1)
  w_hat = _l2_normalize(w.astype(dtype), axis=0)
  cos = jnp.tensordot(x_hat, w_hat, axes=(-1, 0))
  if w.ndim == 3:
    cos = jnp.max(cos, axis=-1)
  return jnp.clip(cos, -1.0, 1.0)


def arcface_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                 scale: float = 64.0, margin: float = 0.5, easy_margin: bool = False,
                 where: ArrayLike | None = None, ignore_index: int | None = None) -> jax.Array:
  r"""ArcFace: additive angular margin softmax (feature L06), with optional sub-centres.

  From J. Deng, J. Guo, N. Xue & S. Zafeiriou, "ArcFace: Additive Angular Margin Loss for
  Deep Face Recognition" (CVPR 2019), and, for sub-centres, J. Deng, J. Guo, T. Liu,
  M. Gong & S. Zafeiriou, "Sub-center ArcFace: Boosting Face Recognition by Large-scale
  Noisy Web Faces" (ECCV 2020). With :math:`\cos\theta_j = \hat x\cdot\hat w_j`
  (:func:`cosine_logits`; with K sub-centres, the largest of the class's K cosines):

  .. math::
    \ell(x; y) = -\log \frac{e^{s\,\phi(\theta_y)}}
      {e^{s\,\phi(\theta_y)} + \sum_{j \ne y} e^{s \cos\theta_j}}, \qquad
    \phi(\theta) = \cos(\theta + m),

  with :math:`\cos(\theta + m) = \cos\theta\cos m - \sin\theta \sin m` computed from the
  cosine (no ``arccos``). Past :math:`\theta + m > \pi`, where :math:`\cos(\theta + m)`
  would turn back up, the target logit is :math:`\cos\theta - m\sin m` instead (the
  insightface threshold rule, kept as it is: the target logit stays decreasing in
  :math:`\theta` over :math:`[0, \pi]`, with a downward step of
  :math:`1 - \cos m - m \sin m` at the threshold); with ``easy_margin`` the
  margin applies only where :math:`\cos\theta > 0` and the logit is :math:`\cos\theta`
  elsewhere. :math:`\sin\theta` is computed as :math:`\sqrt{\max(1 - \cos^2\theta,
  10^{-12})}`, so the gradient stays finite at :math:`\theta = 0` and :math:`\pi`. The
  AAM-softmax of speaker verification is this loss. ``margin = 0`` is
  :func:`normalized_softmax_loss` with temperature ``1/scale``.

  Args:
    embeddings: ``[..., d]`` features (any scale: they are L2-normalised).
    class_weights: ``[d, C]`` class centres, or ``[d, C, K]`` with K sub-centres.
    labels: integer classes of ``embeddings``' shape without the last axis.
    scale: s > 0 (64 in the paper).
    margin: m, an angle in radians in [0, π) (0.5 in the paper).
    easy_margin: apply the margin only where :math:`\cos\theta_y > 0`.
    where: optional mask, broadcastable to the cosines ``[..., C]`` (False classes are
      left out) or of ``labels``' shape (a False example gets loss 0).
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Examples:
    >>> x = jnp.array([[1.0, 0.2], [0.1, -1.0]])
    >>> w = jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    >>> print(js.losses.arcface_loss(x, w, jnp.array([0, 2]), scale=8.0, margin=0.3))
    [0.0042 3.929 ]

  References:
    J. Deng, J. Guo, N. Xue & S. Zafeiriou, 2019, "ArcFace: Additive Angular Margin Loss for
    Deep Face Recognition" (CVPR).

    J. Deng, J. Guo, T. Liu, M. Gong & S. Zafeiriou, 2020, "Sub-center ArcFace: Boosting Face
    Recognition by Large-scale Noisy Web Faces" (ECCV).
  """
  fn = "arcface_loss"
  m = lc.nonnegative_float(margin, "margin", fn, upper=math.pi)
  return _margin_softmax(fn, embeddings, class_weights, labels, scale,
                         lambda c: angular_margin_target(c, m, easy_margin), where, ignore_index)


def angular_margin_target(c, m: float, easy_margin: bool = False):
  """ArcFace's target cosine cos(theta + m) from c = cos(theta), with the insightface
  threshold (or easy-margin) rule and a gradient that stays finite at |c| = 1."""
  sin = jnp.sqrt(jnp.maximum(1.0 - jnp.square(c), 1e-12))
  phi = c * math.cos(m) - sin * math.sin(m)
  if easy_margin:
    return jnp.where(c > 0, phi, c)
  return jnp.where(c > math.cos(math.pi - m), phi, c - m * math.sin(m))


def cosface_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                 scale: float = 64.0, margin: float = 0.35, where: ArrayLike | None = None,
                 ignore_index: int | None = None) -> jax.Array:
  r"""CosFace / AM-softmax: additive cosine margin softmax (feature L06).

  From H. Wang, Y. Wang, Z. Zhou, X. Ji, D. Gong, J. Zhou, Z. Li & W. Liu, "CosFace:
  Large Margin Cosine Loss for Deep Face Recognition" (CVPR 2018) and F. Wang, J. Cheng,
  W. Liu & H. Liu, "Additive Margin Softmax for Face Verification" (IEEE SPL 2018):

  .. math::
    \ell(x; y) = -\log \frac{e^{s(\cos\theta_y - m)}}
      {e^{s(\cos\theta_y - m)} + \sum_{j \ne y} e^{s \cos\theta_j}},

  on the cosines of :func:`cosine_logits` (sub-centres allowed). ``margin = 0`` is
  :func:`normalized_softmax_loss` with temperature ``1/scale``.

  Args:
    embeddings, class_weights, labels, where, ignore_index: as in :func:`arcface_loss`.
    scale: s > 0 (64 in CosFace, 30 in AM-softmax).
    margin: m >= 0 on the cosine (0.35 in both papers).

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Examples:
    >>> x = jnp.array([[1.0, 0.2], [0.1, -1.0]])
    >>> w = jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    >>> print(js.losses.cosface_loss(x, w, jnp.array([0, 2]), scale=8.0, margin=0.3))
    [0.0205 4.0105]

  References:
    H. Wang, Y. Wang, Z. Zhou, X. Ji, D. Gong, J. Zhou, Z. Li & W. Liu, 2018, "CosFace: Large
    Margin Cosine Loss for Deep Face Recognition" (CVPR).

    F. Wang, J. Cheng, W. Liu & H. Liu, 2018, "Additive Margin Softmax for Face Verification"
    (IEEE Signal Processing Letters).
  """
  fn = "cosface_loss"
  m = lc.nonnegative_float(margin, "margin", fn)
  return _margin_softmax(fn, embeddings, class_weights, labels, scale, lambda c: c - m, where,
                         ignore_index)


def normalized_softmax_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike,
                            *, temperature: float = 0.05, where: ArrayLike | None = None,
                            ignore_index: int | None = None) -> jax.Array:
  r"""Normalised (cosine) softmax cross-entropy (feature L06).

  From A. Zhai & H.-Y. Wu, "Classification is a Strong Baseline for Deep Metric Learning"
  (BMVC 2019), the base loss of the open-set "normalized softmax" papers:

  .. math::
    \ell(x; y) = -\log \frac{e^{\cos\theta_y / T}}{\sum_j e^{\cos\theta_j / T}},

  softmax CE on :func:`cosine_logits` divided by the temperature T (0.05 in the paper).
  The logits are bounded in :math:`[-1/T, 1/T]` and the loss is invariant to the scale of
  the embeddings and of each class weight.

  Args:
    embeddings, class_weights, labels, where, ignore_index: as in :func:`arcface_loss`.
    temperature: T > 0 (may be a traced, learned value).

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Examples:
    >>> x = jnp.array([[1.0, 0.2], [0.1, -1.0]])
    >>> w = jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    >>> print(js.losses.normalized_softmax_loss(x, w, jnp.array([0, 2]), temperature=0.125))
    [0.0019 1.7774]

  References:
    A. Zhai & H.-Y. Wu, 2019, "Classification is a Strong Baseline for Deep Metric Learning"
    (BMVC).
  """
  fn = "normalized_softmax_loss"
  temperature = check_positive(temperature, "temperature", fn)
  return _margin_softmax(fn, embeddings, class_weights, labels, 1.0 / temperature, None, where,
                         ignore_index)


def adacos_scale(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                 previous_scale: ArrayLike | None = None,
                 where: ArrayLike | None = None) -> jax.Array:
  r"""AdaCos: the scale of cosine logits, fixed or adapted per batch (feature L06).

  From X. Zhang, R. Zhao, Y. Qiao, X. Wang & H. Li, "AdaCos: Adaptively Scaling Cosine
  Logits for Effectively Learning Deep Face Representations" (CVPR 2019). With C classes,
  the fixed AdaCos scale (``previous_scale=None``) is

  .. math::
    \tilde s = \sqrt{2}\,\log(C - 1),

  and the dynamic one, from the previous step's scale :math:`s` and this batch's cosines
  (:func:`cosine_logits`), is

  .. math::
    s_{\mathrm{new}} = \frac{\log B_{\mathrm{avg}}}{\cos\bigl(\min(\pi/4,\ \theta_{\mathrm{med}})\bigr)},
    \qquad B_{\mathrm{avg}} = \frac1n \sum_i \sum_{j \ne y_i} e^{s \cos\theta_{ij}},

  with :math:`	heta_{\mathrm{med}}` the median target angle of the batch. Use it as the
  ``scale`` of :func:`cosface_loss` with ``margin=0`` (AdaCos has no margin) or as
  ``1 / temperature`` of :func:`normalized_softmax_loss`, carrying it from step to step.
  No gradient flows through it.

  Args:
    embeddings: ``[B, d]`` features.
    class_weights: ``[d, C]`` (or ``[d, C, K]``) class centres, C >= 2.
    labels: ``[B]`` integer classes.
    previous_scale: None (the fixed scale) or the scale of the previous step.
    where: optional ``[B]`` example mask (False: left out of both statistics).

  Returns:
    A scalar in the cosines' dtype: float32, or float64 for float64 features or centres
    under x64 (``previous_scale`` is taken in that dtype).

  Examples:
    >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 1001))
    >>> print(round(float(js.losses.adacos_scale(x, w, jnp.array([0, 1]))), 3))
    9.769

  References:
    X. Zhang, R. Zhao, Y. Qiao, X. Wang & H. Li, 2019, "AdaCos: Adaptively Scaling Cosine Logits
    for Effectively Learning Deep Face Representations" (CVPR).
  """
  fn = "adacos_scale"
  w = jnp.asarray(class_weights)
  n_classes = w.shape[1] if w.ndim >= 2 else 0
  if n_classes < 2:
    raise ValueError(f"{fn}: `class_weights` needs at least 2 classes ([d, C]), got {w.shape}")
  if previous_scale is None:
    return jnp.asarray(math.sqrt(2.0) * math.log(n_classes - 1),
                       nc.compute_dtype(jnp.result_type(jnp.asarray(embeddings), w)))
  cos = jax.lax.stop_gradient(cosine_logits(embeddings, w, fn))
  labels = lc.check_labels(labels, cos.shape[:1], fn, what="[B]")
  keep = lc.example_keep(where, labels, None, fn)
  s = jax.lax.stop_gradient(jnp.asarray(previous_scale, cos.dtype))
  target = jax.nn.one_hot(labels, n_classes, dtype=bool)
  b_sum = jnp.sum(jnp.where(target, 0.0, jnp.exp(s * cos)), axis=-1)
  b_avg = nc.safe_divide(jnp.sum(jnp.where(keep, b_sum, 0.0)), jnp.sum(keep))
  theta_y = jnp.arccos(jnp.take_along_axis(cos, labels[:, None], axis=-1)[:, 0])
  theta_med = jnp.nanmedian(jnp.where(keep, theta_y, jnp.nan))
  return jnp.log(b_avg) / jnp.cos(jnp.minimum(math.pi / 4, theta_med))


def _margin_softmax(fn, embeddings, class_weights, labels, scale, target, where, ignore_index):
  """Softmax CE of ``scale * cos`` with the label's cosine replaced by ``target(cos_y)``."""
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  scale = check_positive(scale, "scale", fn)
  out_dtype = nc.output_dtype(jnp.result_type(embeddings))
  cos = cosine_logits(embeddings, class_weights, fn)
  labels = lc.check_labels(labels, cos.shape[:-1], fn, what=EMBEDDING_BATCH)
  loss, visible, label_visible = margin_cross_entropy(cos, labels, scale, target, where, fn)
  return lc.integer_finish(loss, labels, visible, label_visible, ignore_index, out_dtype)


def margin_cross_entropy(cos, labels, scale, target, where, fn):
  """Per-example CE of ``scale * cos`` (class axis last) with the label's cosine mapped by
  ``target`` (None: unchanged); returns ``(loss, row visible, label visible)``."""
  axis = cos.ndim - 1
  x, mask, axis = lc.prepare(cos, axis, where, fn)
  c_y, label_visible = lc.gather_label(x, mask, labels, axis)
  logits = scale * x
  if target is not None:
    onehot = lc.one_hot(labels, x.shape[axis], axis, x.dtype)
    logits = logits + scale * onehot * jnp.expand_dims(target(c_y) - c_y, axis)
    c_y = target(c_y)
  lse, visible = lc.masked_logsumexp(logits, mask, axis)
  return lse - scale * c_y, visible, label_visible


def _l2_normalize(a, axis):
  """a / ||a|| along ``axis`` (0 for a zero vector), safe for |a| up to float max: the
  vector is first divided by its largest magnitude (in two sqrt steps, since 1/max is
  subnormal for max > 2^126 and XLA:CPU flushes subnormals). A vector holding a NaN comes
  back NaN (not as a zero vector), so a loss on it is NaN as optax's would be."""
  big = jax.lax.stop_gradient(jnp.max(jnp.abs(a), axis=axis, keepdims=True))
  root = jnp.sqrt(jnp.where(big > 0, big, 1.0))
  a = a / root / root
  sq = jnp.sum(jnp.square(a), axis=axis, keepdims=True)
  ok = sq != 0  # True for a NaN norm (`sq > 0` would zero the vector)
  return jnp.where(ok, a * jax.lax.rsqrt(jnp.where(ok, sq, 1.0)), 0.0)
