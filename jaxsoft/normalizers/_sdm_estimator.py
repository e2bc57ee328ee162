"""N10 SDM estimator: the Similarity q and Distance quantile d of the SDM activation
estimated from training and calibration data (dense matching and class-wise empirical CDFs).

References:
  A. Schmaltz, 2025, "Similarity-Distance-Magnitude Activations" (the SDM estimator; the
  activation is also the base of A. Schmaltz, 2025, "Similarity-Distance-Magnitude Universal
  Verification").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete, positive_int
from jaxsoft.normalizers import common as c

__all__ = ["sdm_distance_quantile", "sdm_nearest_distance", "sdm_similarity"]


def _real(a, name, fn, ndim: int, shape: str):
  """``a`` as a real array of rank ``ndim`` in the compute dtype; ValueError naming ``name``."""
  a = jnp.asarray(a)
  if a.ndim != ndim or not (jnp.issubdtype(a.dtype, jnp.floating)
                            or jnp.issubdtype(a.dtype, jnp.integer)):
    raise ValueError(f"{fn}: `{name}` must be a real {shape} array, got {a.shape} {a.dtype}")
  return a.astype(c.compute_dtype(c.output_dtype(a.dtype)))


def _embeddings(a, name, fn):
  return _real(a, name, fn, 2, "[n, e]")


def _ints(a, n, name, fn):
  a = jnp.asarray(a)
  if not jnp.issubdtype(a.dtype, jnp.integer) or a.shape != (n,):
    raise ValueError(f"{fn}: `{name}` must be an int array of shape ({n},), got "
                     f"{a.shape} {a.dtype}")
  return a


def _row_mask(where, n, name, fn):
  if where is None:
    return jnp.ones((n,), bool)
  w = jnp.asarray(where)
  if w.shape != (n,):
    raise ValueError(f"{fn}: `{name}` must be a boolean array of shape ({n},), got {w.shape}")
  return w.astype(bool)


def _sq_distances(x, t, keep):
  """Squared L2 distances ``[n, m]`` between the rows of ``x [n, e]`` and ``t [m, e]``,
  ``+inf`` in the columns of the training rows that ``keep [m]`` leaves out."""
  dt = jnp.result_type(x.dtype, t.dtype)
  x, t = x.astype(dt), t.astype(dt)
  d2 = (jnp.sum(x * x, -1)[:, None] + jnp.sum(t * t, -1)[None, :]
        - 2.0 * jnp.einsum("ne,me->nm", x, t, precision=jax.lax.Precision.HIGHEST))
  return jnp.where(keep[None, :], jnp.maximum(d2, 0.0), jnp.inf)


def _pair(test_embeddings, train_embeddings, fn):
  x = _embeddings(test_embeddings, "test_embeddings", fn)
  t = _embeddings(train_embeddings, "train_embeddings", fn)
  if x.shape[1] != t.shape[1]:
    raise ValueError(f"{fn}: `test_embeddings` {x.shape} and `train_embeddings` {t.shape} "
                     "must have the same feature size")
  return x, t


def sdm_nearest_distance(test_embeddings: ArrayLike, train_embeddings: ArrayLike, *,
                         where: ArrayLike | None = None) -> jax.Array:
  r"""SDM's raw distance: the L2 distance to the nearest training exemplar (feature N10).

  From A. Schmaltz, "Similarity-Distance-Magnitude Activations" (2025):
  :math:`d_{\mathrm{nearest}}(x) = \min_{r \in \mathcal{D}_{tr}} \lVert h(x) - h(r)\rVert_2`
  over the exemplar vectors h (the representation the SDM layer matches in). Its
  quantile under the calibration set, :func:`sdm_distance_quantile`, is the activation's d.

  Args:
    test_embeddings: ``[n, e]`` exemplar vectors of the points to score.
    train_embeddings: ``[m, e]`` exemplar vectors of the training set.
    where: optional ``[m]`` mask of the training rows to match against.

  Returns:
    ``[n]`` distances (float32; float64 for float64 inputs), ``+inf`` with no visible
    training row; no gradient (a nearest-neighbour statistic).

  Examples:
    >>> train = jnp.array([[0.0, 0.0], [3.0, 4.0]])
    >>> js.normalizers.sdm_nearest_distance(jnp.array([[0.0, 1.0], [3.0, 3.0]]), train)
    Array([1., 1.], dtype=float32)

  References:
    A. Schmaltz, 2025, "Similarity-Distance-Magnitude Activations": the nearest-exemplar
    distance of the SDM estimator.
  """
  fn = "sdm_nearest_distance"
  x, t = _pair(test_embeddings, train_embeddings, fn)
  keep = _row_mask(where, t.shape[0], "where", fn)
  d2 = _sq_distances(x, t, keep)
  near = jnp.min(d2, axis=-1, initial=jnp.inf)
  return jax.lax.stop_gradient(jnp.sqrt(near))


def sdm_similarity(test_embeddings: ArrayLike, test_predictions: ArrayLike,
                   train_embeddings: ArrayLike, train_labels: ArrayLike,
                   train_predictions: ArrayLike, *, max_q: int | None = None,
                   where: ArrayLike | None = None) -> jax.Array:
  r"""SDM's Similarity q: the run of correct, agreeing nearest training matches (N10).

  From A. Schmaltz, "Similarity-Distance-Magnitude Activations" (2025). With the
  training exemplars :math:`r_1, r_2, \dots` ranked by L2 distance to h(x) (nearest first;
  ties by their index), :math:`\hat y` the prediction for x, :math:`\hat y_r` and
  :math:`y_r` a training point's prediction and label,

  .. math::
    q(x) = \sum_{k \ge 1} \prod_{k'=1}^{k}
      \mathbf{1}[\hat y_{r_{k'}} = \hat y]\; \mathbf{1}[\hat y_{r_{k'}} = y_{r_{k'}}],

  the number of consecutive nearest matches that were predicted correctly and agree with
  x's prediction; the first mismatch ends the run. It enters
  :func:`jaxsoft.normalizers.sdm` as the base :math:`2 + q`. [R] ``max_q`` caps the run
  (and bounds the work to the ``max_q`` nearest rows), as the reference code's cap does.

  Args:
    test_embeddings: ``[n, e]`` exemplar vectors of the points to score.
    test_predictions: ``int [n]`` their predicted classes :math:`\hat y`.
    train_embeddings: ``[m, e]`` exemplar vectors of the training set.
    train_labels: ``int [m]`` the training labels y.
    train_predictions: ``int [m]`` the model's predictions on the training set.
    max_q: optional cap (an int >= 1) on q.
    where: optional ``[m]`` training-row mask (False rows are left out of the ranking).

  Returns:
    ``[n]`` counts q >= 0 as floats (float32; float64 for float64 embeddings), ready for
    ``sdm(..., q=q[:, None])``; no gradient.

  Examples:
    >>> train = jnp.array([[0.0], [1.0], [2.0], [3.0]])
    >>> labels, preds = jnp.array([0, 0, 1, 0]), jnp.array([0, 0, 0, 0])
    >>> x = jnp.array([[0.1], [2.9]])
    >>> js.normalizers.sdm_similarity(x, jnp.array([0, 0]), train, labels, preds)
    Array([2., 1.], dtype=float32)

  References:
    A. Schmaltz, 2025, "Similarity-Distance-Magnitude Activations": the Similarity q of
    the SDM estimator.
  """
  fn = "sdm_similarity"
  x, t = _pair(test_embeddings, train_embeddings, fn)
  n, m = x.shape[0], t.shape[0]
  yhat = _ints(test_predictions, n, "test_predictions", fn)
  y_tr = _ints(train_labels, m, "train_labels", fn)
  yhat_tr = _ints(train_predictions, m, "train_predictions", fn)
  keep = _row_mask(where, m, "where", fn)
  if max_q is not None:
    max_q = positive_int(max_q, "max_q", fn)
  if m == 0 or n == 0:
    return jnp.zeros((n,), x.dtype)
  k = m if max_q is None else min(max_q, m)
  d2 = _sq_distances(x, t, keep)
  _, idx = jax.lax.top_k(-d2, k)  # nearest first; equal distances: the lower index first
  ok = (keep[idx] & (yhat_tr[idx] == yhat[:, None]) & (yhat_tr[idx] == y_tr[idx]))
  q = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
  return jax.lax.stop_gradient(q.astype(x.dtype))


def sdm_distance_quantile(distances: ArrayLike, calibration_distances: ArrayLike,
                          calibration_labels: ArrayLike, num_classes: int, *,
                          where: ArrayLike | None = None) -> jax.Array:
  r"""SDM's Distance d: the most conservative class-wise CDF quantile of a distance (N10).

  From A. Schmaltz, "Similarity-Distance-Magnitude Activations" (2025): the
  class-conditional empirical CDFs of the nearest-training distances
  (:func:`sdm_nearest_distance`) over a held-out calibration set partition the distances,
  and a point's Distance is its quantile under the least favourable class,

  .. math::
    d(x) = \min_{y:\ N_y > 0}\ \Big(1 - \hat F_y\big(d_{\mathrm{nearest}}(x)\big)\Big),
    \qquad \hat F_y(t) = \frac{1}{N_y}\,\#\{j : y_j = y,\ D_j \le t\},

  with :math:`D_j, y_j` the calibration points' distances and true labels and
  :math:`N_y` the count of class y (classes absent from the calibration set are skipped).
  d lies in [0, 1]: 1 closer than every calibration point of every class, 0 at or past the
  farthest one of some class; non-increasing in the distance. It scales the exponent of
  :func:`jaxsoft.normalizers.sdm`. [R] The CDF counts ties (``D_j <= t``) and conditions
  on the true label.

  Args:
    distances: ``[n]`` nearest-training distances of the points to score.
    calibration_distances: ``[c]`` nearest-training distances of the calibration points.
    calibration_labels: ``int [c]`` their true labels in ``[0, num_classes)``.
    num_classes: C >= 1.
    where: optional ``[c]`` calibration-row mask.

  Returns:
    ``[n]`` quantiles d in [0, 1] (float32; float64 for float64 distances); 0 where no
    calibration row is visible; no gradient.

  Examples:
    >>> cal_d = jnp.array([1.0, 2.0, 3.0, 4.0, 0.5, 5.0])
    >>> cal_y = jnp.array([0, 0, 0, 0, 1, 1])
    >>> js.normalizers.sdm_distance_quantile(jnp.array([0.2, 1.5, 9.0]), cal_d, cal_y, 2)
    Array([1. , 0.5, 0. ], dtype=float32)

  References:
    A. Schmaltz, 2025, "Similarity-Distance-Magnitude Activations": the class-wise
    Distance quantile of the SDM estimator.
  """
  fn = "sdm_distance_quantile"
  t = jnp.asarray(distances)
  dc = jnp.asarray(calibration_distances)
  for name, a in (("distances", t), ("calibration_distances", dc)):
    if a.ndim != 1 or not (jnp.issubdtype(a.dtype, jnp.floating)
                           or jnp.issubdtype(a.dtype, jnp.integer)):
      raise ValueError(f"{fn}: `{name}` must be a real 1-D array, got {a.shape} {a.dtype}")
  n_cls = positive_int(num_classes, "num_classes", fn)
  y = _ints(calibration_labels, dc.shape[0], "calibration_labels", fn)
  known = concrete(y)
  if known is not None and known.size and (known.min() < 0 or known.max() >= n_cls):
    raise ValueError(f"{fn}: `calibration_labels` must be in [0, {n_cls})")
  keep = _row_mask(where, dc.shape[0], "where", fn)
  dt = c.compute_dtype(c.output_dtype(jnp.result_type(t.dtype, dc.dtype)))
  t, dc = t.astype(dt), dc.astype(dt)
  onehot = (y[:, None] == jnp.arange(n_cls)[None, :]) & keep[:, None]  # [c, C]
  n_y = jnp.sum(onehot, axis=0).astype(dt)  # [C]
  below = (dc[None, :] <= t[:, None]).astype(dt)  # [n, c]
  cdf = (below @ onehot.astype(dt)) / jnp.maximum(n_y, 1.0)[None, :]  # [n, C]
  d = jnp.min(jnp.where((n_y > 0)[None, :], 1.0 - cdf, np.inf), axis=-1, initial=np.inf)
  d = jnp.where(jnp.isfinite(d), d, 0.0)
  return jax.lax.stop_gradient(jnp.where(jnp.isnan(t), np.nan, d))
