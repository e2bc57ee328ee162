"""N10 SDM estimator, the partition step: class-conditional empirical-CDF thresholds on a
calibration set that accept a prediction only where its class keeps the target accuracy
(selective classification)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete, positive_int
from jaxsoft.normalizers._sdm_estimator import _ints, _real, _row_mask

__all__ = ["sdm_selective_thresholds", "sdm_selective_accept"]


def _scores(a, name, fn):
  return _real(a, name, fn, 1, "1-D")


def _classes(a, n, n_cls, name, fn):
  a = _ints(a, n, name, fn)
  known = concrete(a)
  if known is not None and known.size and (known.min() < 0 or known.max() >= n_cls):
    raise ValueError(f"{fn}: `{name}` must be in [0, {n_cls})")
  return a


def sdm_selective_thresholds(scores: ArrayLike, predictions: ArrayLike, labels: ArrayLike,
                             num_classes: int, *, alpha: float,
                             where: ArrayLike | None = None) -> jax.Array:
  r"""The SDM estimator's partition: per-class score thresholds for a target accuracy (N10).

  From A. Schmaltz's SDM estimator, which partitions a held-out calibration set by
  class-conditional empirical CDFs so that the predictions it keeps reach a conditional
  accuracy :math:`\alpha` (its high-reliability region); [R] the rule below is our exact,
  finite-sample form of that step. For each predicted class y let
  :math:`J_y = \{j : \hat y_j = y\}` be the calibration points predicted y, with scores
  :math:`s_j` (e.g. the :func:`sdm` probability of the prediction, or the Similarity q) and
  the upper sets of the class-conditional empirical CDF :math:`\hat F_y`,

  .. math::
    U_y(t) = \{j \in J_y : s_j \ge t\}, \qquad
    \mathrm{acc}_y(t) = \frac{\#\{j \in U_y(t) : \hat y_j = y_j\}}{\# U_y(t)},

  i.e. the points above the :math:`\hat F_y(t^-)` quantile. The threshold is the lowest
  observed class-y score from which every higher cut keeps the accuracy,

  .. math::
    \psi_y = \min\{t \in s(J_y) : \mathrm{acc}_y(t') \ge \alpha\ \ \forall\, t' \in s(J_y),
    t' \ge t\},

  :math:`+\infty` when there is none (every class-y prediction is rejected). The rule
  :func:`sdm_selective_accept` keeps x when :math:`s(x) \ge \psi_{\hat y(x)}`. On the
  calibration set each class's kept predictions then have accuracy :math:`\ge \alpha`
  (selective risk :math:`\le 1 - \alpha`), as does every stricter cut, and no lower
  threshold of that form does; on new exchangeable data the guarantee holds up to the
  sampling error of :math:`\# U_y(\psi_y)` points. Ties count together (a cut at t keeps
  every score equal to t); accuracies compare as ``correct >= alpha * count`` in the
  scores' float dtype.

  Args:
    scores: ``[c]`` calibration scores (higher = more trusted).
    predictions: ``int [c]`` the predicted classes :math:`\hat y_j` in ``[0, num_classes)``.
    labels: ``int [c]`` the true labels :math:`y_j` in ``[0, num_classes)``.
    num_classes: C >= 1.
    alpha: the target class-conditional accuracy, in [0, 1].
    where: optional ``[c]`` calibration-row mask.

  Returns:
    ``[C]`` thresholds :math:`\psi_y` (float32; float64 for float64 scores), ``+inf`` for a
    class with no valid cut (or no calibration prediction); no gradient.

  Examples:
    Class 0's top three predictions are right, its fourth wrong; class 1's best is wrong:

    >>> s = jnp.array([0.9, 0.8, 0.7, 0.6, 0.95, 0.5])
    >>> pred = jnp.array([0, 0, 0, 0, 1, 1])
    >>> y = jnp.array([0, 0, 0, 1, 0, 1])
    >>> js.normalizers.sdm_selective_thresholds(s, pred, y, 2, alpha=0.9)
    Array([0.7, inf], dtype=float32)

  References:
    A. Schmaltz, 2025, "Similarity-Distance-Magnitude Activations" (the SDM estimator; the
    activation is also the base of A. Schmaltz, 2025, "Similarity-Distance-Magnitude Universal
    Verification").
  """
  fn = "sdm_selective_thresholds"
  s = _scores(scores, "scores", fn)
  n = s.shape[0]
  n_cls = positive_int(num_classes, "num_classes", fn)
  pred = _classes(predictions, n, n_cls, "predictions", fn)
  y = _classes(labels, n, n_cls, "labels", fn)
  a = float(alpha)
  if not 0.0 <= a <= 1.0:
    raise ValueError(f"{fn}: `alpha` must be in [0, 1], got {alpha!r}")
  keep = _row_mask(where, n, "where", fn) & ~jnp.isnan(s)
  if n == 0:
    return jnp.full((n_cls,), np.inf, s.dtype)
  order = jnp.argsort(-jnp.where(keep, s, -np.inf), stable=True)   # descending scores
  ss, ps, ys, ks = s[order], pred[order], y[order], keep[order]
  # the last sorted index of each tie group: a cut at s_(i) keeps every score equal to it
  new_group = jnp.concatenate([ss[1:] != ss[:-1], jnp.ones((1,), bool)])
  group_end = jax.lax.cummin(jnp.where(new_group, jnp.arange(n), n), axis=0, reverse=True)
  member = (ps[None, :] == jnp.arange(n_cls)[:, None]) & ks[None, :]          # [C, c]
  count = jnp.cumsum(member, axis=1)[:, group_end].astype(s.dtype)
  right = jnp.cumsum(member & (ps == ys)[None, :], axis=1)[:, group_end].astype(s.dtype)
  ok = right >= jnp.asarray(a, s.dtype) * count
  bad = member & ~ok                       # a candidate cut of class y that misses alpha
  any_bad = jnp.cumsum(bad, axis=1)[:, group_end] > 0   # some cut t' >= s_(i) misses it
  valid = member & ~any_bad
  lowest = jnp.min(jnp.where(valid, ss[None, :], np.inf), axis=1)
  return jax.lax.stop_gradient(lowest)


def sdm_selective_accept(scores: ArrayLike, predictions: ArrayLike,
                         thresholds: ArrayLike) -> jax.Array:
  r"""The SDM estimator's selective-classification rule, a score cut per class (N10).

  Keep x iff :math:`s(x) \ge \psi_{\hat y(x)}`. With :math:`\psi` from
  :func:`sdm_selective_thresholds`, the kept predictions of each class reach the calibration
  accuracy :math:`\alpha`; the others are rejected (abstain).
  A NaN score is rejected.

  Args:
    scores: ``[n]`` scores of the points to classify (as on the calibration set).
    predictions: ``int [n]`` their predicted classes.
    thresholds: ``[C]`` per-class thresholds.

  Returns:
    ``bool [n]``, True where the prediction is kept.

  Examples:
    >>> psi = jnp.array([0.7, jnp.inf])
    >>> js.normalizers.sdm_selective_accept(jnp.array([0.75, 0.6, 0.99]),
    ...                                     jnp.array([0, 0, 1]), psi)
    Array([ True, False, False], dtype=bool)

  References:
    A. Schmaltz, 2025, "Similarity-Distance-Magnitude Activations" (the SDM estimator).
  """
  fn = "sdm_selective_accept"
  s = _scores(scores, "scores", fn)
  psi = _scores(thresholds, "thresholds", fn)
  pred = _classes(predictions, s.shape[0], psi.shape[0], "predictions", fn)
  return s >= psi.astype(s.dtype)[pred]
