"""A ``-inf`` logit in the calibration maps and fits is a class of probability zero.

``dirichlet_calibrate``, ``fit_dirichlet_calibration`` and ``fit_temperature`` follow the
losses' rule (``jaxsoft.losses``' docstring): a ``-inf`` logit is a masked class. They gave
NaN for it (``0 · -inf`` in ``W log softmax(z)``, and ``-z / T^2`` times a zero softmax
weight in the temperature's gradient). The references here are float64 numpy written from
the formulas with the class removed from its example (and scipy's minimiser for the fits);
a label naming a class of probability zero has no finite likelihood: the fits are NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import jaxsoft as js
from tests.helpers import normal

L = js.losses
INF = float("inf")


def _lse(z, axis=-1):
  m = np.max(z, axis=axis, keepdims=True)
  return np.squeeze(m, axis) + np.log(np.sum(np.exp(z - m), axis=axis))


def _masked_log_softmax(z, visible):
  """float64 log softmax over each row's visible classes, 0 at the others."""
  out = np.zeros_like(z)
  for i, row in enumerate(z):
    v = visible[i]
    out[i, v] = row[v] - _lse(row[v])
  return out


def _data(n, k, seed):
  """Held-out logits with a -inf on one non-label class of every third example."""
  rng = np.random.default_rng(seed)
  z = 2.0 * rng.standard_normal((n, k)).astype(np.float32).astype(np.float64)
  p = np.exp(z / 2.0 - _lse(z / 2.0)[:, None])  # labels drawn at T = 2
  labels = (rng.random(n)[:, None] > np.cumsum(p, axis=1)).sum(axis=1)
  gone = (labels + 1 + np.arange(n) % (k - 1)) % k  # never the label
  hit = np.arange(n) % 3 == 0
  z[hit, gone[hit]] = -np.inf
  return z, labels


def test_dirichlet_calibrate_keeps_a_neginf_class_at_probability_zero():
  z = np.array([[2.0, -INF, 0.5, -1.0], [0.3, 1.0, -INF, -INF], [1.0, 0.0, 3.0, 0.5]])
  w = np.array([[1.2, 0.3, -0.4, 0.0], [0.1, 0.8, 0.2, -0.3],
                [-0.2, 0.5, 1.1, 0.4], [0.0, -0.6, 0.3, 0.9]])  # no zero where it matters
  b = np.array([0.1, -0.2, 0.0, 0.3])
  vis = np.isfinite(z)
  want = np.where(vis, _masked_log_softmax(z, vis) @ w.T + b, -np.inf)
  c = jnp.asarray(normal(1, (3, 4)))
  f = jax.jit(lambda z, w: L.dirichlet_calibrate(z, w, jnp.asarray(b, jnp.float32)))
  got = f(jnp.asarray(z, jnp.float32), jnp.asarray(w, jnp.float32))
  np.testing.assert_array_equal(np.isneginf(got), ~vis)
  np.testing.assert_allclose(np.where(vis, got, 0), np.where(vis, want, 0), rtol=1e-5, atol=1e-6)
  # the gradient: 0 on the -inf logits, and on the visible ones that of the map restricted
  # to them (a float64 central difference of the reference in the visible logits)
  loss = lambda z, w: jnp.sum(jnp.where(jnp.isfinite(f(z, w)), jax.nn.softmax(f(z, w)) * c, 0))
  dz, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(z, jnp.float32),
                                                   jnp.asarray(w, jnp.float32))
  assert np.all(np.isfinite(dz)) and np.all(np.isfinite(dw))
  np.testing.assert_array_equal(np.asarray(dz)[~vis], 0.0)

  def ref_loss(z64):
    q = np.where(vis, _masked_log_softmax(z64, vis) @ w.T + b, -np.inf)
    p = np.exp(q - _lse(q)[:, None])
    return np.sum(p * np.asarray(c, np.float64))

  eps = 1e-6
  fd = np.zeros_like(z)
  for i, j in zip(*np.nonzero(vis), strict=True):
    e = np.zeros_like(z)
    e[i, j] = eps
    fd[i, j] = (ref_loss(z + e) - ref_loss(z - e)) / (2 * eps)
  np.testing.assert_allclose(np.where(vis, dz, 0), fd, rtol=1e-4, atol=1e-5)


def test_fit_temperature_leaves_a_neginf_class_out():
  z, labels = _data(240, 4, 3)
  vis = np.isfinite(z)
  z_vis = np.where(vis, z, 0.0)
  zy = z[np.arange(len(labels)), labels]

  def nll(log_t):  # float64 NLL over each example's visible classes
    beta = np.exp(-log_t)
    s = np.where(vis, beta * z_vis, -np.inf)
    return np.mean(_lse(s) - beta * zy)

  best = scipy.optimize.minimize_scalar(nll, bounds=(-3.0, 3.0), method="bounded",
                                        options={"xatol": 1e-10}).x
  fit = jax.jit(L.fit_temperature)
  t = fit(jnp.asarray(z, jnp.float32), jnp.asarray(labels))
  np.testing.assert_allclose(t, np.exp(best), rtol=1e-3)
  # a label on a class of probability zero: no temperature gives it a finite likelihood
  bad = labels.copy()
  bad[0] = int(np.flatnonzero(~vis[0])[0])
  assert np.isnan(fit(jnp.asarray(z, jnp.float32), jnp.asarray(bad)))


@pytest.mark.slow  # 2 s
def test_fit_dirichlet_calibration_leaves_a_neginf_class_out():
  z, labels = _data(240, 3, 4)
  vis = np.isfinite(z)
  log_p = _masked_log_softmax(z, vis)
  n, k = z.shape
  lam, mu = 0.05, 0.05
  off = 1 - np.eye(k)

  def objective(wb):  # float64: the class of probability zero enters no sum
    ww, bb = wb[:k * k].reshape(k, k), wb[k * k:]
    q = np.where(vis, log_p @ ww.T + bb, -np.inf)
    return (np.mean(_lse(q) - q[np.arange(n), labels])
            + lam * np.sum((ww * off) ** 2) / (k * (k - 1)) + mu * np.sum(bb**2) / k)

  best = scipy.optimize.minimize(objective, np.concatenate([np.eye(k).ravel(), np.zeros(k)]),
                                 method="BFGS", options={"gtol": 1e-10}).x
  fit = jax.jit(lambda z, y: L.fit_dirichlet_calibration(
      z, y, off_diagonal_weight=lam, bias_weight=mu, num_steps=60))
  w, b = fit(jnp.asarray(z, jnp.float32), jnp.asarray(labels))
  fitted = np.concatenate([np.asarray(w, np.float64).ravel(), np.asarray(b, np.float64)])
  # the objective's minimum (float32 L-BFGS: the value agrees to its rounding) near scipy's
  assert objective(fitted) <= objective(best) + 1e-5, (objective(fitted), objective(best))
  np.testing.assert_allclose(fitted, best, atol=2e-2)
  bad = labels.copy()
  bad[0] = int(np.flatnonzero(~vis[0])[0])
  w, b = fit(jnp.asarray(z, jnp.float32), jnp.asarray(bad))
  assert np.isnan(w).all() and np.isnan(b).all()
