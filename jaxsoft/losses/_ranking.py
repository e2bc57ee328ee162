"""L14 ranking losses for recommendation: the pairwise softmax loss (PSL) and the
top-K weighted softmax loss SL@K with its quantile threshold.

Every loss takes ``scores [..., M]`` (the model's scores of M candidate items for a user,
e.g. cosines divided by a temperature) and integer ``labels`` (the position of the
positive item of each row). ``where`` is a candidate mask broadcastable to ``scores`` or,
with one dimension fewer, an example mask. One value per example comes back, in
``scores``' dtype (bf16/fp16 computed in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["pairwise_softmax_loss", "softmax_loss_at_k", "top_k_threshold_loss"]

_ACTIVATIONS = ("tanh", "relu", "atan", "exp")


def _log_surrogate(d, activation):
  """log s(d) of the surrogate s ≈ e^d and whether s(d) > 0."""
  if activation == "exp":
    return d, jnp.ones(d.shape, bool)
  if activation == "tanh":                       # tanh(d) + 1 = 2 σ(2d), stably in log space
    return jnp.log(2.0) + jax.nn.log_sigmoid(2.0 * d), jnp.ones(d.shape, bool)
  s = jnp.maximum(d + 1.0, 0.0) if activation == "relu" else jnp.arctan(d) + 1.0
  pos = s > 0
  return jnp.where(pos, jnp.log(jnp.where(pos, s, 1.0)), 0.0), pos


def _check_inputs(scores, labels, where, fn) -> tuple[jax.Array, ...]:
  x, mask, axis = lc.prepare(scores, -1, where, fn)
  labels = lc.check_integer_labels(labels, x.shape, axis, fn)
  x_y, label_visible = lc.gather_label(x, mask, labels, axis)
  return x, mask, labels, x_y, label_visible


def pairwise_softmax_loss(scores: ArrayLike, labels: ArrayLike, *, activation: str = "tanh",
                          temperature: ArrayLike = 1.0,
                          where: ArrayLike | None = None) -> jax.Array:
  r"""PSL, the pairwise softmax loss for recommendation (feature L14) [R].

  From W. Yang et al., "PSL:
  Rethinking and Improving Softmax Loss from Pairwise Perspective for Recommendation"
  (NeurIPS 2024). With :math:`d_j = f_j - f_y` the score gaps of the candidates to the
  positive y (y included, :math:`d_y = 0`),

  .. math::
    \ell = \log \sum_j \exp\bigl(\sigma(d_j)/\tau\bigr)
         = \log \sum_j s(d_j)^{1/\tau},

  where the softmax loss's :math:`e^{d}` is replaced by a surrogate
  :math:`s = e^{\sigma}`: ``"tanh"`` :math:`\tanh(d) + 1`, ``"relu"``
  :math:`\mathrm{ReLU}(d + 1)`, ``"atan"`` :math:`\max(\arctan(d) + 1, 0)` [R: the clamp
  at 0 is ours], or ``"exp"`` :math:`e^d` (the softmax CE of :math:`f/\tau`). Each
  satisfies :math:`\mathbb 1[d \ge 0] \le s(d) \le e^d` on :math:`d \in [-1, 1]`, so PSL is
  a tighter surrogate of the DCG than the softmax loss, and :math:`\ell \ge \log
  \mathrm{rank}_y`. Candidates with :math:`s(d) = 0` drop out of the sum. The loss
  increases in every :math:`d_j`; the gradient weight of candidate j is
  :math:`\mathrm{softmax}(\sigma(d)/\tau)_j\,\sigma'(d_j)/\tau`.

  Args:
    scores: ``[..., M]`` candidate scores f (the paper uses cosines over a temperature).
    labels: integer position of each row's positive item.
    activation: "tanh" (default, as the authors' code), "relu", "atan" or "exp".
    temperature: :math:`\tau > 0` (the DRO temperature :math:`\tau^*`).
    where: optional candidate mask (broadcastable) or example mask (one dimension fewer).

  Returns:
    One loss per example, in ``scores``' dtype.

  Examples:
    >>> print(js.losses.pairwise_softmax_loss(jnp.array([[0.9, 0.1, 0.3, -0.5]]), jnp.array([0])))
    [0.649]

  References:
    W. Yang et al., 2024, "PSL: Rethinking and Improving Softmax Loss from Pairwise Perspective
    for Recommendation" (NeurIPS).
  """
  fn = "pairwise_softmax_loss"
  if activation not in _ACTIVATIONS:
    raise ValueError(f"{fn}: `activation` must be one of {_ACTIVATIONS}, got {activation!r}")
  tau = check_positive(temperature, "temperature", fn)
  dtype = lc.check_logits(scores, fn).dtype
  x, mask, labels, x_y, label_visible = _check_inputs(scores, labels, where, fn)
  log_s, pos = _log_surrogate(x - x_y[..., None], activation)
  mask = mask & pos
  lse, visible = lc.masked_logsumexp(jnp.where(mask, log_s / tau, 0.0), mask, -1)
  return lc.integer_finish(lse, labels, visible, label_visible, None, dtype)


def _kth_largest(x, mask, k):
  """The k-th largest visible score of each row (the smallest visible one if fewer)."""
  top = -jnp.sort(-jnp.where(mask, x, -jnp.inf), axis=-1)   # descending, masked last
  n = jnp.sum(mask, axis=-1)
  idx = jnp.clip(jnp.minimum(k, n) - 1, 0, x.shape[-1] - 1)
  kth = jnp.take_along_axis(top, idx[..., None], axis=-1)[..., 0]
  return jnp.where(n > 0, kth, 0.0)


def softmax_loss_at_k(scores: ArrayLike, labels: ArrayLike, *, k: int | None = None,
                      threshold: ArrayLike | None = None, temperature: ArrayLike = 1.0,
                      weight_temperature: ArrayLike = 1.0,
                      where: ArrayLike | None = None) -> jax.Array:
  r"""SL@K: the softmax loss weighted towards the top-K positions (feature L14) [R].

  From W. Yang et al., "Breaking the Top-K Barrier: Advancing Top-K Ranking Metrics
  Optimization in Recommender Systems" (KDD 2025). With :math:`\beta^K` the score of the
  K-th ranked candidate of the row,

  .. math::
    \ell = \sigma\Bigl(\frac{f_y - \beta^K}{\tau_\beta}\Bigr)\,
      \log \sum_j \exp\Bigl(\frac{f_j - f_y}{\tau}\Bigr),

  the softmax loss of the positive times a sigmoid weight that favours positives near or
  above the top-K threshold (NDCG@K / Recall@K only count those). The weight and
  :math:`\beta^K` carry no gradient [R: the practical form of the authors' loss; the
  paper's normalisation of the weights over a user's positives and its penalty term are
  left out]. :math:`\beta^K` is ``threshold`` when given (e.g. fitted with
  :func:`top_k_threshold_loss`, the paper's quantile regression) or the K-th largest
  visible score of the row (sorting). A constant weight would give the softmax loss.

  Args:
    scores: ``[..., M]`` candidate scores f.
    labels: integer position of each row's positive item.
    k: K, ``1 <= k <= M`` (when ``threshold`` is None).
    threshold: optional :math:`\beta^K`, broadcastable to ``labels``' shape.
    temperature: :math:`\tau > 0` of the softmax loss.
    weight_temperature: :math:`\tau_\beta > 0` of the sigmoid weight.
    where: optional candidate or example mask.

  Returns:
    One loss per example, in ``scores``' dtype.

  Examples:
    >>> s, y = jnp.array([[0.9, 0.1, 0.3, -0.5], [0.2, 0.8, 0.6, 0.0]]), jnp.array([0, 0])
    >>> print(js.losses.softmax_loss_at_k(s, y, k=1))  # row 1's positive is below the top 1
    [0.4043 0.5796]

  References:
    W. Yang et al., 2025, "Breaking the Top-K Barrier: Advancing Top-K Ranking Metrics
    Optimization in Recommender Systems" (KDD).
  """
  fn = "softmax_loss_at_k"
  tau = check_positive(temperature, "temperature", fn)
  tau_b = check_positive(weight_temperature, "weight_temperature", fn)
  dtype = lc.check_logits(scores, fn).dtype
  x, mask, labels, x_y, label_visible = _check_inputs(scores, labels, where, fn)
  if threshold is None:
    k = lc.int_in_range(k, "k", 1, x.shape[-1], fn, " when `threshold` is None")
    beta = _kth_largest(x, mask, k)
  else:
    beta = jnp.broadcast_to(jnp.asarray(threshold, x.dtype), labels.shape)
  weight = jax.lax.stop_gradient(jax.nn.sigmoid((x_y - beta) / tau_b))
  lse, visible = lc.masked_logsumexp(x / tau, mask, -1)
  return lc.integer_finish(weight * (lse - x_y / tau), labels, visible, label_visible, None,
                           dtype)


def top_k_threshold_loss(scores: ArrayLike, threshold: ArrayLike, k: int, *,
                         where: ArrayLike | None = None) -> jax.Array:
  r"""Quantile (pinball) loss whose minimiser is the top-K score threshold (feature L14).

  The quantile regression SL@K uses for :math:`\beta^K` (W. Yang et al., "Breaking the
  Top-K Barrier: Advancing Top-K Ranking Metrics Optimization in Recommender Systems",
  KDD 2025): over the n visible scores of a row, with :math:`t = 1 - K/n`,

  .. math::
    \ell(\beta) = \frac1n \sum_j \rho_t(f_j - \beta), \qquad
    \rho_t(u) = \max(t\,u,\ (t - 1)\,u),

  minimised by the t-quantile of the scores: about K of them lie above it. Minimise it in
  ``threshold`` alongside the model (no gradient flows into ``scores``).

  Args:
    scores: ``[..., M]`` candidate scores.
    threshold: :math:`\beta`, of the batch shape (``scores``' shape without the last axis).
    k: K, ``1 <= k <= M``.
    where: optional candidate or example mask.

  Returns:
    One value per row, in ``scores``' dtype.

  Examples:
    >>> s = jnp.array([[4.0, 3.0, 2.0, 1.0]])  # k = 1: t = 3/4, minimised between 3 and 4
    >>> print(js.losses.top_k_threshold_loss(s, jnp.array([3.5]), 1),
    ...       js.losses.top_k_threshold_loss(s, jnp.array([2.0]), 1))
    [0.375] [0.625]

  References:
    W. Yang et al., 2025, "Breaking the Top-K Barrier: Advancing Top-K Ranking Metrics
    Optimization in Recommender Systems" (KDD).
  """
  fn = "top_k_threshold_loss"
  dtype = lc.check_logits(scores, fn).dtype
  x, mask, _ = lc.prepare(scores, -1, where, fn)
  k = lc.int_in_range(k, "k", 1, x.shape[-1], fn)
  beta = jnp.asarray(threshold)
  if beta.shape != x.shape[:-1]:
    raise ValueError(f"{fn}: `threshold` of shape {beta.shape} must be {x.shape[:-1]}")
  n = nc.visible_count(mask, -1)[..., 0]
  t = 1.0 - nc.safe_divide(jnp.asarray(float(k), x.dtype), n)
  u = jax.lax.stop_gradient(x) - beta.astype(x.dtype)[..., None]
  rho = jnp.maximum(t[..., None] * u, (t[..., None] - 1.0) * u)
  loss = nc.safe_divide(jnp.sum(jnp.where(mask, rho, 0.0), axis=-1), n)
  return lc.finish(loss, n > 0, dtype)
