"""L12 Noisy Softmax: annealed, downward noise on the target logit during training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.losses import _common as lc
from jaxsoft.losses._classification import softmax_cross_entropy_with_integer_labels
from jaxsoft.normalizers import common as nc

__all__ = ["noisy_softmax_loss"]


def _norm(a, axis):
  """Euclidean norm with a gradient free of NaN at 0."""
  sq = jnp.sum(jnp.square(a), axis=axis)
  ok = sq > 0
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, sq, 1.0)), 0.0)


def noisy_softmax_loss(key: jax.Array, embeddings: ArrayLike, class_weights: ArrayLike,
                       labels: ArrayLike, *, alpha: ArrayLike = 0.1, annealed: bool = True,
                       where: ArrayLike | None = None,
                       ignore_index: int | None = None) -> jax.Array:
  r"""Noisy Softmax: the target logit lowered by annealed Gaussian noise (feature L12).

  From B. Chen, W. Deng & J. Du, "Noisy Softmax: Improving the Generalization Ability of
  DCNN via Postponing the Early Softmax Saturation" (CVPR 2017). With logits
  :math:`f_j = w_j \cdot x = \|w_j\|\|x\|\cos\theta_j` (no bias), only the label's logit
  is perturbed, always downward:

  .. math::
    \tilde f_y = f_y - \alpha\,\|w_y\|\|x\|\,(1 - \cos\theta_y)\,|\xi|, \qquad
    \xi \sim \mathcal N(0, 1),
    \qquad \ell = -\log\frac{e^{\tilde f_y}}{e^{\tilde f_y} + \sum_{j \ne y} e^{f_j}}.

  The factor :math:`1 - \cos\theta_y` anneals the noise as the example becomes well
  classified (it vanishes at :math:`\theta_y = 0`) [R: the paper's Eq. 5 is recalled, not
  verified; ``annealed=False`` drops the factor, :math:`\tilde f_y = f_y -
  \alpha\|w_y\|\|x\||\xi|`]. Since the noise only lowers the target logit, the loss is
  never below the clean softmax CE, and the gradient it sends to a saturated example
  (:math:`p_y \approx 1`) is larger: saturation is postponed. ``alpha = 0`` is the
  softmax CE of :math:`x W`; at test time use the plain logits. The gradient flows
  through :math:`\tilde f_y` (the draw :math:`\xi` is fixed by ``key``: the same key gives
  the same loss).

  Args:
    key: a ``jax.random`` key; one :math:`\xi` is drawn per example.
    embeddings: ``[..., d]`` features x.
    class_weights: ``[d, C]`` class weights w.
    labels: integer classes of ``embeddings``' shape without the last axis.
    alpha: noise scale :math:`\alpha \ge 0`.
    annealed: keep the :math:`1 - \cos\theta_y` factor.
    where: optional mask, broadcastable to the logits ``[..., C]`` (classes) or of
      ``labels``' shape (examples).
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Examples:
    >>> x, w, y = jnp.array([[1.0, 0.5], [0.2, -1.0]]), jnp.eye(2), jnp.array([0, 1])
    >>> noisy = js.losses.noisy_softmax_loss(jax.random.key(0), x, w, y, alpha=0.5)
    >>> clean = js.losses.softmax_cross_entropy_with_integer_labels(x @ w, y)
    >>> print(bool(jnp.all(noisy >= clean)))  # the noise only lowers the target logit
    True

  References:
    B. Chen, W. Deng & J. Du, 2017, "Noisy Softmax: Improving the Generalization Ability of DCNN
    via Postponing the Early Softmax Saturation" (CVPR).
  """
  fn = "noisy_softmax_loss"
  x = lc.float_input(embeddings, "embeddings", fn)
  w = lc.float_input(class_weights, "class_weights", fn)
  if x.ndim < 1 or w.ndim != 2 or w.shape[0] != x.shape[-1]:
    raise ValueError(f"{fn}: `class_weights` must be [d, C] with d = the last axis of "
                     f"`embeddings` {x.shape}, got shape {w.shape}")
  try:
    a_val = float(jnp.asarray(alpha))
    if not a_val >= 0:
      raise ValueError(f"{fn}: `alpha` must be >= 0, got {alpha!r}")
  except (TypeError, jax.errors.ConcretizationTypeError):
    pass  # traced: the caller vouches for it
  if key is None:
    raise ValueError(f"{fn}: `key` (a jax.random key) is required to draw the noise")
  dtype = x.dtype
  ct = nc.compute_dtype(jnp.result_type(x.dtype, w.dtype))
  x, w = x.astype(ct), w.astype(ct)
  labels = jnp.asarray(lc.check_integer_labels(labels, x.shape[:-1] + (w.shape[1],), x.ndim - 1,
                                               fn))
  logits = x @ w
  c = w.shape[1]
  y = jnp.where((labels >= 0) & (labels < c), labels, 0)
  f_y = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
  scale = _norm(x, -1) * _norm(jnp.take(w.T, y, axis=0), -1)       # ||w_y|| ||x||
  amplitude = scale - f_y if annealed else scale                   # ||w_y|| ||x|| (1 - cos θ_y)
  xi = jnp.abs(jax.random.normal(key, labels.shape, ct))
  noise = alpha * jnp.maximum(amplitude, 0.0) * xi
  noisy = logits - jax.nn.one_hot(y, c, dtype=ct) * noise[..., None]
  loss = softmax_cross_entropy_with_integer_labels(noisy, labels, where=where,
                                                   ignore_index=ignore_index)
  return loss.astype(dtype)
