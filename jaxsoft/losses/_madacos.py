"""L06 CFCD's MadaCos: the scale and margin of a CosFace loss set from each batch's
statistics (the scale rising as the batch's median target cosine rises), and the loss."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import EMBEDDING_BATCH, cosine_logits, margin_cross_entropy
from jaxsoft.normalizers import common as nc

__all__ = ["madacos_loss", "madacos_scale_margin"]

_STATISTICS = ("example", "median", "mean")


def madacos_scale_margin(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                         alpha: float = 0.02, ratio: float = 9999999.0,
                         min_scale: float = 32.0, statistic: str = "example",
                         where: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
  r"""CFCD's MadaCos scale and margin of the cosine logits, from a batch (feature L06).

  From Y. Zhu, Y. Gao, Z. Huang et al., "Coarse-to-Fine: Learning Compact Discriminative
  Representation for Single-Stage Image Retrieval" (CFCD, ICCV 2023). With
  :math:`c_{\mathrm{med}}` the batch's (lower) median target cosine
  :math:`\cos\theta_{i y_i}` (:func:`cosine_logits`) and :math:`\rho` = ``alpha``:

  .. math::
    s = \max\Bigl(s_{\min},\ \frac{\log\bigl(R (1-\rho)/\rho\bigr)}{1 - c_{\mathrm{med}}}\Bigr),
    \qquad
    m = \max\Bigl(0,\ c_{\mathrm{med}} - \frac1s \log\frac{\rho\,\bar B}{1-\rho}\Bigr),
    \qquad B_i = \sum_{j \ne y_i} e^{s \cos\theta_{ij}},

  where :math:`\bar B` is :math:`B` of the median example (``statistic="example"``, CFCD's
  default), the median or the mean of :math:`B_i` over the batch. With this margin the
  median example's CosFace target probability :math:`e^{s(c-m)} / (e^{s(c-m)} + B)` is
  exactly :math:`\rho` (when :math:`m > 0`), and at :math:`\cos\theta_y = 1` the target
  logit leads the median's by :math:`\log(R(1-\rho)/\rho)`: as training raises the
  median cosine, the scale grows with it (the progressive schedule). Pass the pair to
  :func:`madacos_loss` (traced, under ``jit``) or, as Python floats, to
  :func:`cosface_loss`; CFCD uses margin 0 at evaluation. No gradient flows through them.
  :math:`\bar B` is computed in log space, so a large scale does not overflow it.

  [R]: the paper gives the rule in words; the formulas and defaults (R = 9999999,
  :math:`s_{\min}` = 32, :math:`\rho` = 0.02 in its configs) are those of the authors'
  released code (bassyess/CFCD, ``MadaCosLayerFunction``).

  Args:
    embeddings: ``[..., d]`` features.
    class_weights: ``[d, C]`` (or ``[d, C, K]``) class centres.
    labels: integer classes, ``embeddings``' shape without its last axis.
    alpha: :math:`\rho \in (0, 1)`, the median example's target probability.
    ratio: R > 0.
    min_scale: :math:`s_{\min} \ge 0`.
    statistic: ``"example"``, ``"median"`` or ``"mean"``: which :math:`\bar B`.
    where: optional example mask (False: left out of every statistic).

  Returns:
    ``(scale, margin)``, scalars in the cosines' dtype (float32; float64 under x64); a
    batch with no example gives ``(min_scale, 0)``.

  Examples:
    >>> x = jnp.array([[1.0, 0.2], [0.1, -1.0], [0.5, 0.5]])
    >>> w = jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    >>> s, m = js.losses.madacos_scale_margin(x, w, jnp.array([0, 2, 1]), alpha=0.1)
    >>> print(round(float(s), 3), round(float(m), 4))
    62.532 0.0351

  References:
    Y. Zhu, Y. Gao, Z. Huang, J. Wang, X. Sun, X. Chen & Y. Fu, 2023, "Coarse-to-Fine:
    Learning Compact Discriminative Representation for Single-Stage Image Retrieval" (ICCV).
  """
  fn = "madacos_scale_margin"
  hp = _hyperparameters(alpha, ratio, min_scale, statistic, fn)
  cos = cosine_logits(embeddings, class_weights, fn)
  labels = lc.check_labels(labels, cos.shape[:-1], fn, what=EMBEDDING_BATCH)
  keep = lc.example_keep(where, labels, None, fn)
  return _scale_margin(cos, labels, keep, *hp)


def madacos_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                 alpha: float = 0.02, ratio: float = 9999999.0, min_scale: float = 32.0,
                 statistic: str = "example", where: ArrayLike | None = None,
                 ignore_index: int | None = None) -> jax.Array:
  r"""CFCD's MadaCos loss: CosFace with the batch's adaptive scale and margin (feature L06).

  .. math::
    \ell(x; y) = -\log \frac{e^{s(\cos\theta_y - m)}}
      {e^{s(\cos\theta_y - m)} + \sum_{j \ne y} e^{s \cos\theta_j}},

  :func:`cosface_loss` with :math:`(s, m)` = :func:`madacos_scale_margin` of the same
  batch (its kept examples: ``where`` and not ``ignore_index``), held constant in the
  gradient, as CFCD's layer does. Fixed (s, m) make it :func:`cosface_loss` exactly.

  Args:
    embeddings, class_weights, labels, where, ignore_index: as in :func:`arcface_loss`.
    alpha, ratio, min_scale, statistic: as in :func:`madacos_scale_margin`.

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Examples:
    >>> x = jnp.array([[1.0, 0.2], [0.1, -1.0], [0.5, 0.5]])
    >>> w = jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    >>> print(js.losses.madacos_loss(x, w, jnp.array([0, 2, 1]), alpha=0.1))
    [ 0.     14.6416  2.3026]

  References:
    Y. Zhu, Y. Gao, Z. Huang, J. Wang, X. Sun, X. Chen & Y. Fu, 2023, "Coarse-to-Fine:
    Learning Compact Discriminative Representation for Single-Stage Image Retrieval" (ICCV).
  """
  fn = "madacos_loss"
  hp = _hyperparameters(alpha, ratio, min_scale, statistic, fn)
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  out_dtype = jnp.result_type(embeddings)
  cos = cosine_logits(embeddings, class_weights, fn)
  labels = lc.check_labels(labels, cos.shape[:-1], fn, what=EMBEDDING_BATCH)
  keep = lc.example_keep(where, labels, ignore_index, fn)
  s, m = _scale_margin(cos, labels, keep, *hp)
  loss, visible, label_visible = margin_cross_entropy(cos, labels, s, lambda c: c - m, where, fn)
  return lc.integer_finish(loss, labels, visible, label_visible, ignore_index,
                           nc.output_dtype(out_dtype))


def _hyperparameters(alpha, ratio, min_scale, statistic, fn):
  """Checked (alpha, ratio, min_scale, statistic), before any array work."""
  alpha = float(alpha)
  if not 0.0 < alpha < 1.0:
    raise ValueError(f"{fn}: `alpha` must be in (0, 1), got {alpha!r}")
  ratio = float(ratio)
  if not (math.isfinite(ratio) and ratio > 0):
    raise ValueError(f"{fn}: `ratio` must be finite and > 0, got {ratio!r}")
  min_scale = lc.nonnegative_float(min_scale, "min_scale", fn)
  if statistic not in _STATISTICS:
    raise ValueError(f"{fn}: `statistic` must be one of {_STATISTICS}, got {statistic!r}")
  return alpha, ratio, min_scale, statistic


def _scale_margin(cos, labels, keep, alpha, ratio, min_scale, statistic):
  c_all = jax.lax.stop_gradient(cos).reshape(-1, cos.shape[-1])
  y, keep = labels.reshape(-1), keep.reshape(-1)
  n_classes = c_all.shape[-1]
  c_y = jnp.take_along_axis(c_all, y[:, None].clip(0, n_classes - 1), axis=-1)[:, 0]
  n = jnp.sum(keep)
  order = jnp.argsort(jnp.where(keep, c_y, jnp.inf), stable=True)
  i_med = order[jnp.maximum((n - 1) // 2, 0)]
  c_med = c_y[i_med]
  gap = jnp.maximum(1.0 - c_med, jnp.finfo(c_all.dtype).eps)
  s = jnp.maximum(min_scale, math.log(ratio * (1.0 - alpha) / alpha) / gap)
  others = ~jax.nn.one_hot(y, n_classes, dtype=bool)
  log_b, _ = lc.masked_logsumexp(s * c_all, others, axis=-1)   # log B_i
  if statistic == "example":
    log_b_bar = log_b[i_med]
  elif statistic == "median":
    log_b_bar = jnp.sort(jnp.where(keep, log_b, jnp.inf))[jnp.maximum((n - 1) // 2, 0)]
  else:
    log_b_bar = (jax.nn.logsumexp(jnp.where(keep, log_b, -jnp.inf))
                 - jnp.log(jnp.maximum(n, 1)))
  m = jnp.maximum(0.0, c_med - (log_b_bar + math.log(alpha / (1.0 - alpha))) / s)
  empty = n == 0
  return (jnp.where(empty, min_scale, s).astype(c_all.dtype),
          jnp.where(empty, 0.0, m).astype(c_all.dtype))
