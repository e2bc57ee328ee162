"""The +inf limit of nap, standardized softmax and clipped softmax stays float64 under x64 (issue 37).

A row whose k visible entries are +inf takes the limit z-scores sqrt((n-k)/k) on them and
-sqrt(k/(n-k)) on the other visible entries; they were computed in float32 (and tau read
as float32), so a float64 row was off its float64 limit by ~1e-7 (found by the exhaustive
randomized float64 promise in test_promises.py, which runs under -m slow). Clipped
softmax read zeta and gamma of its limit as float32 (0.47499999 for 0.475).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js


def test_standardized_softmax_and_nap_inf_limits_are_float64():
  x = np.array([[np.inf, 1.0, -2.0, 0.5, 3.0, np.inf, 0.0]])
  n, k = 7, 2
  z = np.where(np.isinf(x), np.sqrt((n - k) / k), -np.sqrt(k / (n - k)))
  tau = 0.3
  e = np.exp(z / tau)
  with jax.enable_x64(True):
    got = js.normalizers.standardized_softmax(jnp.asarray(x), tau=tau)
    got_nap = js.normalizers.nap(jnp.asarray(x))
  assert got.dtype == got_nap.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(got), e / e.sum(), rtol=1e-13)
  np.testing.assert_allclose(np.asarray(got_nap), z, rtol=1e-13)


def test_clipped_softmax_inf_limit_is_float64():
  x = np.array([[1.0, np.inf, np.inf, 0.0]])
  zeta, gamma = 1.05, -0.1
  want = np.where(np.isinf(x), (zeta - gamma) * 0.5 + gamma, 0.0)  # clip(1/k stretched)
  with jax.enable_x64(True):
    got = js.normalizers.clipped_softmax(jnp.asarray(x), zeta=zeta, gamma=gamma)
  assert got.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-14)
