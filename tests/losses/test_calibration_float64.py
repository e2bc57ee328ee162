"""Under x64 the calibration tools keep float64 (issue 37, guard "float64 stays float64").

``ece``, ``odin``, ``fit_temperature``, ``dirichlet_calibrate`` and
``fit_dirichlet_calibration`` cast their logits to float32 whatever the input: a float64
ECE was off a numpy float64 computation by float32 rounding, and a confidence that sits on
a bin edge in float64 could change bins. Integer inputs to ``odin`` promote as jax.nn's do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _ece_numpy(logits, labels, num_bins):
  z = logits - logits.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  conf, pred = p.max(-1), p.argmax(-1)
  bins = np.clip(np.ceil(conf * num_bins).astype(int) - 1, 0, num_bins - 1)
  total = 0.0
  for b in range(num_bins):
    sel = bins == b
    total += abs(np.sum(pred[sel] == labels[sel]) - np.sum(conf[sel]))
  return total / len(labels)


def test_ece_is_float64_and_matches_numpy(x64):
  r = np.random.default_rng(0)
  logits = r.normal(size=(64, 5)) * 3.0
  labels = r.integers(0, 5, 64)
  got = js.losses.ece(jnp.asarray(logits), jnp.asarray(labels), num_bins=10)
  assert got.dtype == jnp.float64
  np.testing.assert_allclose(float(got), _ece_numpy(logits, labels, 10), rtol=1e-12)


def test_calibration_maps_and_fits_stay_float64(x64):
  r = np.random.default_rng(1)
  z = jnp.asarray(r.normal(size=(40, 3)) * 2.0)
  labels = jnp.asarray(r.integers(0, 3, 40))
  t = js.losses.fit_temperature(z, labels, num_steps=5)
  w, b = js.losses.fit_dirichlet_calibration(z, labels, num_steps=2)
  cal = js.losses.dirichlet_calibrate(z, jnp.eye(3) / 2.0, jnp.zeros(3))
  assert t.dtype == w.dtype == b.dtype == cal.dtype == jnp.float64
  # W = I/T is temperature scaling exactly: float64 agreement, not float32's
  np.testing.assert_allclose(np.asarray(jax.nn.softmax(cal)), np.asarray(jax.nn.softmax(z / 2.0)),
                             rtol=1e-13, atol=1e-15)


def test_odin_is_float64_and_promotes_integer_inputs(x64):
  w = jnp.array([[2.0, -1.0, 0.0], [0.0, 1.0, -1.0]])
  x = jnp.array([[1, 0], [0, 2]])
  got = js.losses.odin(lambda v: v @ w, x, temperature=2.0, epsilon=0.0)
  assert got.dtype == jnp.float64
  z = np.asarray(x, np.float64) @ np.asarray(w) / 2.0
  p = np.exp(z - z.max(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(got), (p / p.sum(-1, keepdims=True)).max(-1), rtol=1e-13)


def test_dirichlet_maps_need_no_implicit_rank_promotion():
  """``W ln p + b`` added a [K] bias to [..., K] rows: a ValueError under
  ``jax_numpy_rank_promotion="raise"``."""
  z = jnp.array([[[2.0, 0.0, -1.0]], [[0.5, 0.1, 0.0]]])  # [2, 1, K]
  with jax.numpy_rank_promotion("raise"):
    cal = js.losses.dirichlet_calibrate(z, jnp.eye(3) / 2.0, jnp.array([0.1, 0.0, -0.1]))
    w, b = js.losses.fit_dirichlet_calibration(z[:, 0], jnp.array([0, 1]), num_steps=1)
  want = np.asarray(jax.nn.log_softmax(z, axis=-1)) @ (np.eye(3) / 2.0) + np.array([0.1, 0.0, -0.1])
  np.testing.assert_allclose(np.asarray(cal), want, rtol=1e-6)
  assert w.shape == (3, 3) and b.shape == (3,)
