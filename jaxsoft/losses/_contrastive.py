"""L09 contrastive softmax losses on a score matrix: InfoNCE (symmetric, AM/AAM margins),
Soft-InfoNCE, DEXML's decoupled softmax, SoftCLIP and the top-K multi-positive loss.

Every loss takes ``scores [B, M]``: the similarity of query i to candidate j (e.g.
``q @ k.T``, or cosines), divided by ``temperature`` inside (a float or a traced, learned
array; it must be > 0). One value per query comes back, in ``scores``' dtype (bf16/fp16
computed in float32).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive, concrete, positive_int
from jaxsoft.losses import _common as lc
from jaxsoft.losses._classification import softmax_cross_entropy_with_integer_labels
from jaxsoft.losses._margin import angular_margin_target
from jaxsoft.normalizers import common as nc

__all__ = [
    "decoupled_softmax_loss",
    "info_nce",
    "soft_clip_loss",
    "soft_info_nce",
    "soft_info_nce_weights",
    "top_k_multi_positive_loss",
]


def info_nce(scores: ArrayLike, *, temperature: ArrayLike = 1.0, labels: ArrayLike | None = None,
             symmetric: bool = False, margin: float = 0.0, angular_margin: float = 0.0,
             where: ArrayLike | None = None) -> jax.Array:
  r"""InfoNCE / NT-Xent (feature L09), optionally symmetric (CLIP) and with AM/AAM margins.

  From A. van den Oord, Y. Li & O. Vinyals, "Representation Learning with Contrastive
  Predictive Coding" (2018); symmetric as in A. Radford et al., "Learning Transferable
  Visual Models From Natural Language Supervision" (CLIP, 2021); the margins as in
  T. Lepage & R. Dehak, "Experimenting with Additive Margins for Contrastive
  Self-Supervised Speaker Verification" (Interspeech 2023). For query i with positive
  :math:`p_i` (``labels[i]``, default i):

  .. math::
    \ell_i = -\log \frac{e^{\psi(s_{i p_i}) / \tau}}{e^{\psi(s_{i p_i}) / \tau}
      + \sum_{j \ne p_i} e^{s_{ij} / \tau}},

  with :math:`\psi(s) = s - m` (AM, ``margin``) or :math:`\psi(s) = \cos(\arccos s + m)`
  (AAM, ``angular_margin``; the scores must then be cosines; computed as
  :func:`arcface_loss` does); no margin gives :math:`\psi(s) = s`. ``symmetric=True``
  (square scores, positives on the diagonal) averages the row and the column losses,
  :math:`\tfrac12(\ell_i^{q \to k} + \ell_i^{k \to q})`. The gradient in the scores is
  :math:`(\mathrm{softmax}_j(\cdot) - [j = p_i]) / \tau`; in a learned ``temperature`` it
  is the usual one (pass a traced array, e.g. ``jnp.exp(log_tau)``).

  ``where``: ``[B]`` marks examples (a False query has loss 0; with square scores its
  candidate is also left out of every other row's and column's denominator, i.e. a padded
  pair), or broadcastable to ``[B, M]`` (a False pair is left out).

  Args:
    scores: ``[B, M]`` similarities (``M >= B`` with the default labels).
    temperature: :math:`\tau > 0`, a float or a traced scalar.
    labels: optional ``[B]`` int positions of the positives (not with ``symmetric``).
    symmetric: average with the column-wise (candidate -> query) loss; needs M == B.
    margin: AM (additive cosine) margin m >= 0.
    angular_margin: AAM (additive angular) margin in [0, π).
    where: optional example or pair mask.

  Returns:
    ``[B]`` losses in ``scores``' dtype.

  Examples:
    >>> s = jnp.array([[0.9, 0.1, -0.2], [0.3, 0.8, 0.0], [0.0, 0.5, 0.7]])
    >>> print(js.losses.info_nce(s, temperature=0.1, symmetric=True))
    [0.0015 0.0283 0.0644]

  References:
    A. van den Oord, Y. Li & O. Vinyals, 2018, "Representation Learning with Contrastive
    Predictive Coding".

    A. Radford et al., 2021, "Learning Transferable Visual Models From Natural Language
    Supervision" (ICML).

    T. Lepage & R. Dehak, 2023, "Experimenting with Additive Margins for Contrastive
    Self-Supervised Speaker Verification" (Interspeech).
  """
  fn = "info_nce"
  x, dtype = _scores(scores, fn)
  tau = check_positive(temperature, "temperature", fn)
  b, n = x.shape
  if margin and angular_margin:
    raise ValueError(f"{fn}: give `margin` (AM) or `angular_margin` (AAM), not both")
  m_am = lc.nonnegative_float(margin, "margin", fn)
  m_aam = lc.nonnegative_float(angular_margin, "angular_margin", fn, upper=math.pi)
  if symmetric:
    if labels is not None:
      raise ValueError(f"{fn}: `labels` must be None with `symmetric=True` (positives on the "
                       "diagonal)")
    if b != n:
      raise ValueError(f"{fn}: `scores` must be square with `symmetric=True`, got {x.shape}")
  labels = _positive_labels(labels, b, n, fn)
  keep, pair = _masks(where, x.shape, fn)
  if m_am or m_aam:
    c = jnp.take_along_axis(x, jnp.asarray(labels)[:, None], axis=1)[:, 0]
    psi = c - m_am if m_am else angular_margin_target(jnp.clip(c, -1.0, 1.0), m_aam)
    x = x + jax.nn.one_hot(labels, n, dtype=x.dtype) * (psi - c)[:, None]
  logits = x / tau
  loss = softmax_cross_entropy_with_integer_labels(logits, labels, where=pair)
  if symmetric:
    loss = 0.5 * (loss + softmax_cross_entropy_with_integer_labels(logits.T, labels,
                                                                   where=pair.T))
  return lc.finish(loss, keep, dtype)


def soft_info_nce(scores: ArrayLike, negative_weights: ArrayLike, *,
                  temperature: ArrayLike = 1.0, labels: ArrayLike | None = None,
                  where: ArrayLike | None = None) -> jax.Array:
  r"""Soft-InfoNCE: InfoNCE with a weight on each negative (feature L09).

  From H. Li, X. Zhou, L. A. Tuan & C. Miao, "Rethinking Negative Pairs in Code Search"
  (EMNLP 2023):

  .. math::
    \ell_i = -\log \frac{e^{s_{i p_i}/\tau}}{e^{s_{i p_i}/\tau}
      + \sum_{j \ne p_i} w_{ij}\, e^{s_{ij}/\tau}},

  computed as a softmax CE of :math:`s/\tau + \log w` (the positive's weight is 1 whatever
  ``negative_weights`` holds there; a zero weight removes that negative, e.g. a known false
  negative). :math:`w \equiv 1` is :func:`info_nce`. The gradient in :math:`s_{ij}` is
  :math:`w_{ij} e^{s_{ij}/\tau} / (\tau Z_i)`. :func:`soft_info_nce_weights` computes the
  paper's weights from similarity estimates (BM25, a trained model, ...).

  Args:
    scores: ``[B, M]`` similarities.
    negative_weights: ``[B, M]`` weights >= 0 (differentiable where > 0).
    temperature: :math:`\tau > 0`.
    labels: optional ``[B]`` positions of the positives (default i).
    where: optional example (``[B]``) or pair mask, as :func:`info_nce`.

  Returns:
    ``[B]`` losses in ``scores``' dtype.

  Examples:
    >>> s = jnp.array([[0.9, 0.1, -0.2], [0.3, 0.8, 0.0]])
    >>> w = jnp.array([[1.0, 0.5, 1.5], [0.0, 1.0, 1.0]])
    >>> print(js.losses.soft_info_nce(s, w))
    [0.5446 0.3711]

  References:
    H. Li, X. Zhou, L. A. Tuan & C. Miao, 2023, "Rethinking Negative Pairs in Code Search"
    (EMNLP).
  """
  fn = "soft_info_nce"
  x, dtype = _scores(scores, fn)
  tau = check_positive(temperature, "temperature", fn)
  b, n = x.shape
  w = jnp.asarray(negative_weights)
  if w.shape != x.shape:
    raise ValueError(f"{fn}: `negative_weights` of shape {w.shape} must have `scores`' shape "
                     f"{x.shape}")
  labels = _positive_labels(labels, b, n, fn)
  keep, pair = _masks(where, x.shape, fn)
  is_pos = jax.nn.one_hot(labels, n, dtype=bool)
  w = jnp.where(is_pos, 1.0, w.astype(x.dtype))
  _check_nonnegative(w, "negative_weights", fn)
  live = w > 0
  log_w = jnp.where(live, jnp.log(jnp.where(live, w, 1.0)), 0.0)
  loss = softmax_cross_entropy_with_integer_labels(x / tau + log_w, labels, where=pair & live)
  return lc.finish(loss, keep, dtype)


def soft_info_nce_weights(similarity: ArrayLike, *, temperature: float = 1.0, alpha: float = 1.0,
                          beta: float = 1.0, floor: float = 0.1,
                          labels: ArrayLike | None = None) -> jax.Array:
  r"""The negative weights of Soft-InfoNCE from similarity estimates (feature L09).

  As the authors' code (Alex-HaochenLi/Soft-InfoNCE, ``--softinfonce``): over the N
  negatives of each row,

  .. math::
    q_{ij} = \mathrm{softmax}_{j \ne p_i}(\mathrm{sim}_{ij} / t), \qquad
    w_{ij} = \max\Bigl(\text{floor},\ \frac{\beta - \alpha q_{ij}}{\beta - \alpha / N}\Bigr),

  so a uniform q gives :math:`w \equiv 1` (plain InfoNCE), more similar (likely false)
  negatives get smaller weights and, before the floor, :math:`\mathrm{mean}_j w_{ij} = 1`.
  The positive's entry is 1. No gradient flows (the weights are estimates).

  Args:
    similarity: ``[B, M]`` similarity estimates.
    temperature: t > 0 of the softmax over negatives.
    alpha, beta: the paper's coefficients (``weight_kl``, ``weight_unif``; 1 in the code),
      with :math:`\beta \ne \alpha / N`.
    floor: the lower clip (0.1 in the code).
    labels: optional ``[B]`` positions of the positives (default i).

  Returns:
    ``[B, M]`` float32 weights for :func:`soft_info_nce`.

  Examples:
    >>> sim = jnp.array([[1.0, 0.9, 0.0, 0.0]])  # candidate 1 is a likely false negative
    >>> print(js.losses.soft_info_nce_weights(sim, temperature=0.1))
    [[1.     0.1    1.4998 1.4998]]

  References:
    H. Li, X. Zhou, L. A. Tuan & C. Miao, 2023, "Rethinking Negative Pairs in Code Search"
    (EMNLP).
  """
  fn = "soft_info_nce_weights"
  x, _ = _scores(similarity, fn, name="similarity")
  t = check_positive(temperature, "temperature", fn)
  b, n = x.shape
  if n < 2:
    raise ValueError(f"{fn}: `similarity` needs at least one negative per row, got {x.shape}")
  labels = _positive_labels(labels, b, n, fn)
  is_pos = jax.nn.one_hot(labels, n, dtype=bool)
  x = jax.lax.stop_gradient(x)
  q = _masked_softmax(x / t, ~is_pos, fn)
  w = jnp.maximum(floor, (beta - alpha * q) / (beta - alpha / (n - 1)))
  return jnp.where(is_pos, 1.0, w)


def decoupled_softmax_loss(scores: ArrayLike, positives: ArrayLike, *,
                           temperature: ArrayLike = 1.0,
                           where: ArrayLike | None = None) -> jax.Array:
  r"""DEXML's decoupled softmax loss for multiple positives (feature L09).

  From N. Gupta, D. Khatri, A. S. Rawat, S. Bhojanapalli, P. Jain & I. S. Dhillon,
  "Dual-Encoders for Extreme Multi-label Classification" (ICLR 2024). For query i with
  positive set :math:`P_i` and negatives :math:`N_i` (the other visible candidates):

  .. math::
    \ell_i = \frac{1}{|P_i|}\sum_{p \in P_i} -\log
      \frac{e^{s_{ip}/\tau}}{e^{s_{ip}/\tau} + \sum_{n \in N_i} e^{s_{in}/\tau}},

  each positive competing with the negatives only (the other positives are *decoupled*
  from its denominator), so a positive's term has zero gradient in the other positives.
  One positive per row is :func:`info_nce`. A row with no visible positive has loss 0;
  a positive with no negative contributes 0.

  Args:
    scores: ``[B, M]`` similarities.
    positives: ``[B, M]`` boolean (or 0/1) positive labels.
    temperature: :math:`\tau > 0`.
    where: optional example (``[B]``) or candidate (``[B, M]``) mask; a masked candidate
      is neither a positive nor a negative.

  Returns:
    ``[B]`` losses in ``scores``' dtype.

  Examples:
    >>> s = jnp.array([[2.0, 1.5, -1.0, 0.0]])
    >>> print(js.losses.decoupled_softmax_loss(s, jnp.array([[True, True, False, False]])))
    [0.2181]

  References:
    N. Gupta, D. Khatri, A. S. Rawat, S. Bhojanapalli, P. Jain & I. S. Dhillon, 2024,
    "Dual-Encoders for Extreme Multi-label Classification" (ICLR).
  """
  fn = "decoupled_softmax_loss"
  x, mask, keep, pos, dtype = _multi_positive_inputs(scores, positives, temperature, where, fn)
  lse_neg = _sub_logsumexp(x, mask & ~pos, fn)
  has_neg = jnp.any(mask & ~pos, axis=-1, keepdims=True)
  lse_neg = jnp.where(has_neg, lse_neg[:, None], -jnp.inf)
  per_pos = jnp.logaddexp(x, lse_neg) - x          # -log p of each positive vs the negatives
  per_pos = jnp.where(has_neg, per_pos, 0.0)
  n_pos = jnp.sum(pos, axis=-1)
  loss = nc.safe_divide(jnp.sum(jnp.where(pos, per_pos, 0.0), axis=-1), n_pos)
  return lc.finish(loss, keep & (n_pos > 0), dtype)


def top_k_multi_positive_loss(scores: ArrayLike, positives: ArrayLike, *, k: int | None = None,
                              temperature: ArrayLike = 1.0,
                              where: ArrayLike | None = None) -> jax.Array:
  r"""Top-K multi-positive contrastive loss (feature L09).

  The "Top-K multi-positive contrastive objective" of J. Hu, T. Bai, F. Wu, W. Li, Z. Peng
  & Y. Zhang, "ExpAlign: Expectation-Guided Vision-Language Alignment for Open-Vocabulary
  Grounding" (2026, arXiv 2601.22666; its exact selection rule is not in the abstract: this
  is our reading of it) and,
  with every positive, of MIL-NCE (A. Miech et al., "End-to-End Learning of Visual
  Representations from Uncurated Instructional Videos", CVPR 2020):

  .. math::
    \ell_i = -\log \frac{\sum_{p \in \mathrm{Top}_K(P_i)} e^{s_{ip}/\tau}}
      {\sum_{j} e^{s_{ij}/\tau}},

  where :math:`\mathrm{Top}_K(P_i)` are the K highest-scoring positives of row i (all of
  them when ``k`` is None or exceeds their number; ties by lower index; the selection
  carries no gradient). One positive per row, or K = 1 with one positive, is
  :func:`info_nce`. A row with no visible positive has loss 0.

  Args:
    scores: ``[B, M]`` similarities.
    positives: ``[B, M]`` boolean (or 0/1) positive labels.
    k: None or an int >= 1.
    temperature: :math:`\tau > 0`.
    where: optional example or candidate mask, as :func:`decoupled_softmax_loss`.

  Returns:
    ``[B]`` losses in ``scores``' dtype.

  Examples:
    >>> s = jnp.array([[2.0, 1.5, -1.0, 0.0]])
    >>> pos = jnp.array([[True, True, True, False]])
    >>> print(js.losses.top_k_multi_positive_loss(s, pos, k=2))
    [0.1091]

  References:
    J. Hu, T. Bai, F. Wu, W. Li, Z. Peng & Y. Zhang, 2026, "ExpAlign: Expectation-Guided
    Vision-Language Alignment for Open-Vocabulary Grounding" (arXiv 2601.22666).

    A. Miech et al., 2020, "End-to-End Learning of Visual Representations from Uncurated
    Instructional Videos" (CVPR; MIL-NCE).
  """
  fn = "top_k_multi_positive_loss"
  x, mask, keep, pos, dtype = _multi_positive_inputs(scores, positives, temperature, where, fn)
  if k is not None:
    k = positive_int(k, "k", fn)
    if k < x.shape[-1]:
      ranked = jnp.where(pos, jax.lax.stop_gradient(x), -jnp.inf)
      _, idx = jax.lax.top_k(ranked, k)
      chosen = jnp.zeros(x.shape, bool).at[jnp.arange(x.shape[0])[:, None], idx].set(True)
      pos = pos & chosen
  lse_all, visible = lc.masked_logsumexp(x, mask, axis=-1)
  lse_pos = _sub_logsumexp(x, pos, fn)
  return lc.finish(lse_all - lse_pos, keep & visible & jnp.any(pos, axis=-1), dtype)


def soft_clip_loss(scores: ArrayLike, query_similarity: ArrayLike,
                   candidate_similarity: ArrayLike | None = None, *,
                   temperature: ArrayLike = 1.0, target_temperature: float = 1.0,
                   smoothing: float = 0.2, negative_weight: float = 0.0,
                   where: ArrayLike | None = None) -> jax.Array:
  r"""SoftCLIP: symmetric CLIP loss against soft targets from intra-modal similarity (L09).

  From Y. Gao, J. Liu, Z. Xu, T. Wu, E. Zhang et al., "SoftCLIP:
  Softer Cross-modal Alignment Makes CLIP Stronger" (AAAI 2024). The abstract fixes the
  idea (a softened target from fine-grained intra-modal self-similarity, plus aligning the
  negatives); the exact weights are not published there, so this is a reconstruction.
  With :math:`p^{q\to c}_i = \mathrm{softmax}_j(s_{ij}/\tau)` and
  :math:`p^{c\to q}_i = \mathrm{softmax}_j(s_{ji}/\tau)`, the targets are

  .. math::
    y_i = (1 - \epsilon)\, e_i + \epsilon\,\mathrm{softmax}_j(S_{ij} / \tau'),

  with S = ``query_similarity`` for the rows and ``candidate_similarity`` (default: the
  same) for the columns, and

  .. math::
    \ell_i = \tfrac12 \sum_{\mathrm{dir}} \Bigl[\mathrm{CE}(y_i, p_i)
      + \lambda\,\mathrm{KL}\bigl(\bar y_i \,\|\, \bar p_i\bigr)\Bigr],

  where :math:`\bar\cdot` is the distribution restricted to the negatives
  :math:`j \ne i` and renormalised (``negative_weight`` :math:`\lambda`). The targets carry
  no gradient. :math:`\epsilon = \lambda = 0` is the symmetric :func:`info_nce`.

  Args:
    scores: ``[B, B]`` cross-modal similarities, pairs on the diagonal.
    query_similarity: ``[B, B]`` intra-modal similarity of the queries (e.g. images).
    candidate_similarity: ``[B, B]`` intra-modal similarity of the candidates (texts);
      defaults to ``query_similarity``.
    temperature: :math:`\tau > 0` of the cross-modal softmax.
    target_temperature: :math:`\tau' > 0` of the target softmax.
    smoothing: :math:`\epsilon \in [0, 1]`.
    negative_weight: :math:`\lambda \ge 0`.
    where: optional ``[B]`` example mask (a False pair is neither a query nor a candidate).

  Returns:
    ``[B]`` losses in ``scores``' dtype.

  Examples:
    >>> s = jnp.array([[0.9, 0.1], [0.3, 0.8]])
    >>> sim = jnp.array([[1.0, 0.9], [0.9, 1.0]])  # the two queries look alike
    >>> print(js.losses.soft_clip_loss(s, sim, temperature=0.1))
    [0.6664 0.5738]
    >>> print(js.losses.soft_clip_loss(s, sim, temperature=0.1, smoothing=0.0))  # = symmetric info_nce
    [0.0014 0.0038]

  References:
    Y. Gao, J. Liu, Z. Xu, T. Wu, E. Zhang et al., 2024, "SoftCLIP: Softer Cross-modal Alignment
    Makes CLIP Stronger" (AAAI).

    A. Radford et al., 2021, "Learning Transferable Visual Models From Natural Language
    Supervision" (ICML).
  """
  fn = "soft_clip_loss"
  x, dtype = _scores(scores, fn)
  tau = check_positive(temperature, "temperature", fn)
  t_tau = check_positive(target_temperature, "target_temperature", fn)
  b, n = x.shape
  if b != n:
    raise ValueError(f"{fn}: `scores` must be square (pairs on the diagonal), got {x.shape}")
  eps = _unit_interval(smoothing, "smoothing", fn)
  lam = lc.nonnegative_float(negative_weight, "negative_weight", fn)
  sims = []
  for name, s in (("query_similarity", query_similarity),
                  ("candidate_similarity",
                   query_similarity if candidate_similarity is None else candidate_similarity)):
    s = jnp.asarray(s)
    if s.shape != x.shape:
      raise ValueError(f"{fn}: `{name}` of shape {s.shape} must have `scores`' shape {x.shape}")
    sims.append(jax.lax.stop_gradient(s.astype(x.dtype)))
  if where is not None and jnp.ndim(where) != 1:
    raise ValueError(f"{fn}: `where` must be a [B] example mask, got shape {jnp.shape(where)}")
  keep, pair = _masks(where, x.shape, fn)
  eye = jnp.eye(b, dtype=bool)
  neg = pair & ~eye
  total = jnp.zeros((b,), x.dtype)
  for logits, sim in ((x / tau, sims[0]), (x.T / tau, sims[1])):
    target = (1.0 - eps) * eye + eps * _masked_softmax(sim / t_tau, pair, fn)
    log_p = _masked_log_softmax(logits, pair, fn)
    total = total - jnp.sum(jnp.where(pair, target * log_p, 0.0), axis=-1)
    if lam:
      y_bar = target * neg
      y_bar = nc.safe_divide(y_bar, jnp.sum(y_bar, axis=-1, keepdims=True))
      live = y_bar > 0
      log_ratio = jnp.log(jnp.where(live, y_bar, 1.0)) - _masked_log_softmax(logits, neg, fn)
      total = total + lam * jnp.sum(jnp.where(live, y_bar * log_ratio, 0.0), axis=-1)
  return lc.finish(0.5 * total, keep, dtype)


def _sub_logsumexp(x, mask, fn):
  """LSE over a subset of a row's visible entries; the others are refilled (as
  ``lc.prepare`` does) so that no branch overflows and no gradient is NaN."""
  xs, m, _ = lc.prepare(x, -1, mask, fn)
  return lc.masked_logsumexp(xs, m, axis=-1)[0]


def _masked_log_softmax(z, mask, fn):
  """log softmax over the True entries of each row (finite everywhere, 0-safe gradients);
  the caller ignores the masked entries."""
  zs, m, _ = lc.prepare(z, -1, mask, fn)
  lse, _ = lc.masked_logsumexp(zs, m, axis=-1)
  return zs - lse[:, None]


def _masked_softmax(z, mask, fn):
  return jnp.where(mask, jnp.exp(_masked_log_softmax(z, mask, fn)), 0.0)


# ------------------------------------------------------------------------------ helpers


def _scores(scores, fn, name="scores"):
  x = lc.float_input(scores, name, fn)
  if x.ndim != 2:
    raise ValueError(f"{fn}: `{name}` must be [B, M] (queries x candidates), got shape {x.shape}")
  return x.astype(nc.compute_dtype(x.dtype)), x.dtype


def _positive_labels(labels, b, n, fn):
  if labels is None:
    if n < b:
      raise ValueError(f"{fn}: `scores` of shape {(b, n)} needs M >= B for the default "
                       "positives on the diagonal; pass `labels`")
    return jnp.arange(b)
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.shape != (b,):
    raise ValueError(f"{fn}: `labels` must be [B] = ({b},) integers, got {labels.shape} "
                     f"{labels.dtype}")
  return labels


def _masks(where, shape, fn):
  """(example keep [B], pair mask [B, M]) from an example or a pair mask."""
  b, n = shape
  if where is None:
    return jnp.ones((b,), bool), jnp.ones(shape, bool)
  where = jnp.asarray(where).astype(bool)
  if where.ndim == 1:
    if where.shape != (b,):
      raise ValueError(f"{fn}: `where` of shape {where.shape} must be [B] = ({b},) or "
                       f"broadcast to {shape}")
    pair = jnp.broadcast_to(where[:, None], shape)
    if b == n:  # in-batch candidates: a padded pair is not a negative of anyone
      pair = pair & where[None, :]
    return where, pair
  try:
    pair = jnp.broadcast_to(where, shape)
  except ValueError:
    raise ValueError(f"{fn}: `where` of shape {where.shape} must be [B] or broadcast to "
                     f"{shape}") from None
  return jnp.ones((b,), bool), pair


def _multi_positive_inputs(scores, positives, temperature, where, fn):
  x, dtype = _scores(scores, fn)
  tau = check_positive(temperature, "temperature", fn)
  pos = jnp.asarray(positives)
  if pos.shape != x.shape:
    raise ValueError(f"{fn}: `positives` of shape {pos.shape} must have `scores`' shape "
                     f"{x.shape}")
  keep, pair = _masks(where, x.shape, fn)
  x, mask, _ = lc.prepare(x / tau, -1, pair, fn)
  return x, mask, keep, mask & pos.astype(bool), dtype


def _check_nonnegative(w, name, fn):
  values = concrete(w)  # None when traced: the caller vouches for it
  if values is not None and np.any(values < 0):
    raise ValueError(f"{fn}: `{name}` must be >= 0")


def _unit_interval(value, name, fn):
  v = float(value)
  if not 0.0 <= v <= 1.0:
    raise ValueError(f"{fn}: `{name}` must be in [0, 1], got {value!r}")
  return v
