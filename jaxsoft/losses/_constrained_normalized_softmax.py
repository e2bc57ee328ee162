"""L06 the open-set latent-space constraints under the normalised softmax loss: a pull of
each embedding towards its class centre on the hypersphere and a separation penalty on the
class centres, added to the normalised (cosine) softmax cross-entropy.

References:
  R. S. Pereira, A. Joly, P. Valduriez & F. Porto, 2021, "Hyperspherical embedding for novel
  class classification" (arXiv:2102.03243).

  A. Zhai & H.-Y. Wu, 2019, "Classification is a Strong Baseline for Deep Metric Learning"
  (BMVC).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive, finite_float
from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import EMBEDDING_BATCH, cosine_logits, margin_cross_entropy
from jaxsoft.normalizers import common as nc

__all__ = ["class_separation_penalty", "constrained_normalized_softmax_loss"]

def class_separation_penalty(class_weights: ArrayLike, *, max_cosine: float = 0.0) -> jax.Array:
  r"""Open-set separation constraint on the class centres on the hypersphere (feature L06).

  With :math:`\hat w_j` the L2-normalised columns of ``class_weights`` (C >= 2 classes) and
  :math:`\mu` = ``max_cosine``:

  .. math::
    P(W) = \frac{1}{C(C-1)} \sum_{j \ne k} \max\bigl(0,\ \hat w_j \cdot \hat w_k - \mu\bigr)^2,

  zero exactly when no two centres are closer than the angle :math:`\arccos\mu` (with
  :math:`\mu = 0`, pairwise orthogonal or obtuse, reachable when C <= d; with
  :math:`\mu = -1/(C-1)`, only the regular simplex, reachable when C <= d + 1). It keeps
  room on the sphere between the training classes for classes not seen in training.
  Invariant to the scale of each centre.

  [R]: Pereira et al. add constraints on the latent representations under the normalised
  softmax loss, but their form is not in any source available here; this hinge on the
  centres' pairwise cosines is a reconstruction.

  Args:
    class_weights: ``[d, C]`` class centres (floating).
    max_cosine: :math:`\mu \in [-1, 1)`.

  Returns:
    A scalar in float32 (float64 under x64 for float64 centres; bf16 centres give float32).

  Examples:
    >>> w = jnp.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    >>> print(round(float(js.losses.class_separation_penalty(w)), 4))
    0.3333

  References:
    Pereira, Joly, Valduriez & Porto, 2021, "Hyperspherical embedding for novel class
    classification" (arXiv:2102.03243): the latent-space constraints this reconstructs.
  """
  fn = "class_separation_penalty"
  mu = _max_cosine(max_cosine, fn)
  w = _centres(class_weights, fn)
  if w.shape[1] < 2:
    raise ValueError(f"{fn}: `class_weights` needs at least 2 classes ([d, C]), got {w.shape}")
  return _penalty(w, mu)


def constrained_normalized_softmax_loss(
    embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
    temperature: float = 0.05, compactness: float = 0.1, separation: float = 0.1,
    max_cosine: float = 0.0, where: ArrayLike | None = None,
    ignore_index: int | None = None) -> jax.Array:
  r"""Normalised softmax loss with open-set latent-space constraints (feature L06).

  The normalised softmax cross-entropy of Zhai & Wu (:func:`normalized_softmax_loss`), as
  Pereira et al. use it for novel-class (open-set) classification, plus two constraints on
  the latent space: each embedding is pulled towards its class centre on the hypersphere
  (compactness) and the class centres are kept apart (:func:`class_separation_penalty`):

  .. math::
    \ell(x; y) = -\log \frac{e^{\cos\theta_y / T}}{\sum_j e^{\cos\theta_j / T}}
      + \lambda_c\,(1 - \cos\theta_y) + \lambda_s\,P(W),

  with :math:`\cos\theta_j = \hat x \cdot \hat w_j` (:func:`cosine_logits`);
  :math:`1 - \cos\theta_y = \tfrac12\lVert\hat x - \hat w_y\rVert^2`. The batch term
  :math:`P(W)` is added to each kept example, so the mean over the kept examples is the
  mean cross-entropy plus :math:`\lambda_c` times the mean gap plus :math:`\lambda_s P(W)`.
  With :math:`\lambda_c = \lambda_s = 0` it is :func:`normalized_softmax_loss` exactly.
  Novel classes are then recognised by nearest centre (or nearest support embedding) in
  cosine, as in metric learning, without pairwise training.

  [R]: the paper's constraint terms are not in any source available here; the compactness
  and separation terms and their defaults are a reconstruction (the temperature 0.05 is Zhai
  & Wu's).

  Args:
    embeddings: ``[..., d]`` features.
    class_weights: ``[d, C]`` class centres, C >= 2.
    labels: integer classes, ``embeddings``' shape without its last axis.
    temperature: T > 0 (may be traced).
    compactness: :math:`\lambda_c \ge 0`.
    separation: :math:`\lambda_s \ge 0`.
    max_cosine: :math:`\mu \in [-1, 1)` of :func:`class_separation_penalty`.
    where: optional example mask (False: loss 0, no gradient).
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Examples:
    >>> x = jnp.array([[1.0, 0.2], [0.1, -1.0]])
    >>> w = jnp.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    >>> print(js.losses.constrained_normalized_softmax_loss(
    ...     x, w, jnp.array([0, 1]), temperature=0.125, compactness=1.0, separation=1.0))
    [ 0.6202 11.0877]

  References:
    Pereira, Joly, Valduriez & Porto, 2021, "Hyperspherical embedding for novel class
    classification" (arXiv:2102.03243): the open-set use and its constraints.

    Zhai & Wu, 2019, "Classification is a Strong Baseline for Deep Metric Learning" (BMVC):
    the normalised softmax loss and its temperature.
  """
  fn = "constrained_normalized_softmax_loss"
  temperature = check_positive(temperature, "temperature", fn)
  lam_c = lc.nonnegative_float(compactness, "compactness", fn)
  lam_s = lc.nonnegative_float(separation, "separation", fn)
  mu = _max_cosine(max_cosine, fn)
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  out_dtype = nc.output_dtype(jnp.result_type(embeddings))
  w = _centres(class_weights, fn)
  if w.shape[1] < 2:
    raise ValueError(f"{fn}: `class_weights` needs at least 2 classes ([d, C]), got {w.shape}")
  cos = cosine_logits(embeddings, w, fn)
  labels = lc.check_labels(labels, cos.shape[:-1], fn, what=EMBEDDING_BATCH)
  ce, visible, label_visible = margin_cross_entropy(cos, labels, 1.0 / temperature, None, where,
                                                    fn)
  c_y = jnp.take_along_axis(cos, labels[..., None].clip(0, cos.shape[-1] - 1), axis=-1)[..., 0]
  loss = ce + lam_c * (1.0 - c_y)
  if lam_s:
    loss = loss + lam_s * _penalty(w, mu).astype(loss.dtype)
  return lc.integer_finish(loss, labels, visible, label_visible, ignore_index, out_dtype)


def _max_cosine(value, fn):
  mu = finite_float(value, "max_cosine", fn)
  if not -1.0 <= mu < 1.0:
    raise ValueError(f"{fn}: `max_cosine` must be in [-1, 1), got {value!r}")
  return mu


def _centres(class_weights, fn):
  w = lc.float_input(class_weights, "class_weights", fn)
  if w.ndim != 2:
    raise ValueError(f"{fn}: `class_weights` must be [d, C], got shape {w.shape}")
  return w


def _penalty(w, mu):
  """P(W) in the compute dtype, through :func:`cosine_logits` of the centres with themselves."""
  n = w.shape[1]
  gram = cosine_logits(w.T, w, "class_separation_penalty")
  off = ~jnp.eye(n, dtype=bool)
  hinge = jnp.where(off, jnp.maximum(gram - mu, 0.0), 0.0)
  return jnp.sum(jnp.square(hinge)) / (n * (n - 1))
