"""N30 calibration maps: the identities between them (Kull et al.'s special cases, power
softening = temperature scaling), checked in float64, and the ODIR penalty."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.normalizers import _calibration as K
from tests import helpers

Z = np.random.default_rng(0).normal(size=(5, 6)) * 2.0


def _softmax64(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_special_cases_of_dirichlet_calibration():
  with jax.enable_x64(True):
    lp = jax.nn.log_softmax(jnp.asarray(Z))
    eye = jnp.eye(6)
    np.testing.assert_allclose(K.dirichlet_calibration(lp, eye), _softmax64(Z), rtol=1e-12)
    for t in (0.5, 3.0):
      want = _softmax64(Z / t)
      np.testing.assert_allclose(K.dirichlet_calibration(lp, eye / t, jnp.zeros(6)), want,
                                 rtol=1e-12)
      np.testing.assert_allclose(K.temperature_scale(jnp.asarray(Z), temperature=t), want,
                                 rtol=1e-12)
      np.testing.assert_allclose(K.power_soften(jnp.asarray(_softmax64(Z)), temperature=t), want,
                                 rtol=1e-12)
    # a general W, b against the formula
    rng = np.random.default_rng(1)
    w, b = rng.normal(size=(6, 6)), rng.normal(size=6)
    want = _softmax64(np.asarray(lp) @ w.T + b)
    np.testing.assert_allclose(K.dirichlet_calibration(lp, w, b), want, rtol=1e-12)


def test_power_soften_limits_ranks_zeros_and_entropy():
  p = jnp.asarray([[0.5, 0.3, 0.2, 0.0]])
  np.testing.assert_allclose(K.power_soften(p, temperature=1.0), p, rtol=1e-6)
  hot = K.power_soften(p, temperature=0.01)
  np.testing.assert_allclose(hot, [[1.0, 0.0, 0.0, 0.0]], atol=1e-6)
  flat = K.power_soften(p, temperature=1e4)
  np.testing.assert_allclose(flat, [[1 / 3, 1 / 3, 1 / 3, 0.0]], atol=1e-4)
  assert np.asarray(flat)[0, 3] == 0
  ents = []
  for t in (0.5, 1.0, 2.0, 4.0):
    q = np.asarray(K.power_soften(p, temperature=t), np.float64)[0, :3]
    assert np.all(np.diff(q) < 0)  # ranking preserved
    ents.append(-(q * np.log(q)).sum())
  assert np.all(np.diff(ents) > 0)
  g = jax.grad(lambda t: K.power_soften(p, temperature=t)[0, 0])(2.0)
  assert np.isfinite(g)


def test_odir_penalty_and_bad_shapes():
  w = jnp.asarray([[2.0, 1.0], [-3.0, 5.0]])
  b = jnp.asarray([1.0, 2.0])
  np.testing.assert_allclose(K.odir_penalty(w, b, lambda_od=0.5, lambda_b=2.0),
                             0.5 * (1 + 9) / 2 + 2.0 * 5 / 2, rtol=1e-6)
  assert float(K.odir_penalty(jnp.diag(jnp.arange(3.0)))) == 0.0
  lp = jnp.zeros((2, 3))
  helpers.check_raises(("weights", lambda: K.dirichlet_calibration(lp, jnp.eye(2))),
                       ("bias", lambda: K.dirichlet_calibration(lp, jnp.eye(3), jnp.zeros(2))),
                       ("temperature", lambda: K.power_soften(lp, temperature=0.0)),
                       ("weights", lambda: K.odir_penalty(jnp.ones((2, 3)))))
