"""sdm_nearest_distance, sdm_similarity and sdm_distance_quantile (the SDM estimator's q and d,
feature N10) on synthetic data against float64 NumPy references written from the
definitions: masks, the cap, no gradient, bf16 and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises

N = js.normalizers


def _data(seed=0):
  rng = np.random.default_rng(seed)
  train = rng.normal(size=(30, 3)).astype(np.float32)
  y_tr = (train[:, 0] > 0).astype(np.int32)
  pred_tr = np.where(rng.random(30) < 0.8, y_tr, 1 - y_tr).astype(np.int32)
  test = rng.normal(size=(8, 3)).astype(np.float32)
  pred = (test[:, 0] > 0).astype(np.int32)
  return train, y_tr, pred_tr, test, pred


def _np_q(test, pred, train, y_tr, pred_tr, keep, cap=None):
  out = []
  for x, p in zip(np.float64(test), pred, strict=True):
    dist = np.linalg.norm(np.float64(train) - x, axis=-1)
    order = [j for j in np.argsort(dist, kind="stable") if keep[j]]
    q = 0
    for j in order[:cap]:
      if pred_tr[j] != p or pred_tr[j] != y_tr[j]:
        break
      q += 1
    out.append(q)
  return np.array(out, float)


def _np_d(t, cal_d, cal_y, n_cls, keep):
  out = []
  for ti in t:
    vals = [1 - np.mean(cal_d[(cal_y == y) & keep] <= ti) for y in range(n_cls)
            if np.any((cal_y == y) & keep)]
    out.append(min(vals))
  return np.array(out)


@jax.jit
def _estimate(test, pred, train, y_tr, pred_tr, keep, cal, cal_y, cal_keep):
  q = N.sdm_similarity(test, pred, train, y_tr, pred_tr, where=keep)
  q3 = N.sdm_similarity(test, pred, train, y_tr, pred_tr, max_q=3, where=keep)
  dist = N.sdm_nearest_distance(test, train, where=keep)
  cal_d = N.sdm_nearest_distance(cal, train, where=keep)
  d = N.sdm_distance_quantile(dist, cal_d, cal_y, 2, where=cal_keep)
  dq = N.sdm_distance_quantile(jnp.linspace(0.0, 3.0, 31), cal_d, cal_y, 2)
  w = N.sdm(jnp.ones((test.shape[0], 2)) * jnp.arange(2.0)[None], q=q[:, None], d=d[:, None])
  return q, q3, dist, cal_d, d, dq, w


def test_q_and_d_against_references_with_masks():
  train, y_tr, pred_tr, test, pred = _data()
  cal = np.random.default_rng(1).normal(size=(20, 3)).astype(np.float32)
  cal_y = (cal[:, 0] > 0).astype(np.int32)
  keep = np.ones(30, bool)
  keep[::7] = False
  cal_keep = np.ones(20, bool)
  cal_keep[:3] = False
  q, q3, dist, cal_d, d, dq, w = _estimate(test, pred, train, y_tr, pred_tr, keep, cal, cal_y,
                                            cal_keep)
  want_q = _np_q(test, pred, train, y_tr, pred_tr, keep)
  np.testing.assert_array_equal(q, want_q)
  assert want_q.max() >= 2  # the runs are not all trivially 0 on this data
  np.testing.assert_array_equal(q3, np.minimum(want_q, 3))
  near = np.array([np.linalg.norm(np.float64(train[keep]) - x, axis=-1).min()
                   for x in np.float64(test)])
  np.testing.assert_allclose(dist, near, rtol=1e-5, atol=1e-5)  # float32 |x|^2 - 2x.t: ~1e-6
  want_d = _np_d(np.asarray(dist, np.float64), np.asarray(cal_d, np.float64), cal_y, 2, cal_keep)
  np.testing.assert_allclose(d, want_d, rtol=0, atol=1e-7)
  assert want_d.min() > 0 and len(np.unique(want_d)) >= 4  # informative quantiles here
  # d is non-increasing in the distance; ready for sdm as per-row q and d
  dq = np.asarray(dq)
  assert np.all(np.diff(dq) <= 0) and dq[0] == 1.0 and dq[-1] == 0.0
  np.testing.assert_allclose(np.sum(w, -1), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_no_gradient_bf16_empty_and_errors():
  train, y_tr, pred_tr, test, pred = _data(2)

  @jax.jit
  def grads(test, train):
    def f(a, b):
      q = N.sdm_similarity(a, pred, b, y_tr, pred_tr)
      d = N.sdm_nearest_distance(a, b)
      return jnp.sum(q) + jnp.sum(N.sdm_distance_quantile(d, d, pred, 2))
    return jax.grad(f, argnums=(0, 1))(test, train)

  for g in grads(test, train):
    np.testing.assert_array_equal(g, 0.0)
  low = N.sdm_nearest_distance(jnp.asarray(test, jnp.bfloat16), jnp.asarray(train, jnp.bfloat16))
  assert low.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(low)))
  # no visible training row: +inf distance, q 0; no calibration row: d 0
  none = np.zeros(30, bool)
  assert np.all(np.isinf(np.asarray(N.sdm_nearest_distance(test, train, where=none))))
  assert float(jnp.max(N.sdm_similarity(test, pred, train, y_tr, pred_tr, where=none))) == 0.0
  assert float(N.sdm_distance_quantile(jnp.ones(1), jnp.ones(3), jnp.zeros(3, int), 2,
                                       where=jnp.zeros(3, bool))[0]) == 0.0
  check_raises(
      ("test_embeddings", lambda: N.sdm_nearest_distance(test[0], train)),
      ("feature size", lambda: N.sdm_nearest_distance(test, train[:, :2])),
      ("test_predictions", lambda: N.sdm_similarity(test, pred[:3], train, y_tr, pred_tr)),
      ("train_labels", lambda: N.sdm_similarity(test, pred, train, np.float32(y_tr), pred_tr)),
      ("max_q", lambda: N.sdm_similarity(test, pred, train, y_tr, pred_tr, max_q=0)),
      ("where", lambda: N.sdm_similarity(test, pred, train, y_tr, pred_tr, where=np.ones(3))),
      ("calibration_labels", lambda: N.sdm_distance_quantile(jnp.ones(2), jnp.ones(3),
                                                             jnp.array([0, 1, 2]), 2)),
      ("num_classes", lambda: N.sdm_distance_quantile(jnp.ones(2), jnp.ones(3),
                                                      jnp.zeros(3, int), 0)),
      ("distances", lambda: N.sdm_distance_quantile(jnp.ones((2, 2)), jnp.ones(3),
                                                    jnp.zeros(3, int), 2)))
