"""tempnet_dro_loss (TempNet's DRO robust loss, feature N31) against a float64 NumPy
reference written from the formula: values, gradients in the logits and the temperature,
the optimal-temperature condition, limits, masks, bf16 and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.references import grads64, np_ce

dro = jax.jit(js.losses.tempnet_dro_loss, static_argnames=("rho", "axis"))


def _np_dro(z, y, tau, rho, cls=None):
  """tau log((1/m) sum_j exp((z_j - z_y) / tau)) + tau rho over the visible classes, float64."""
  z = np.asarray(z, np.float64)
  cls = np.ones(z.shape, bool) if cls is None else np.broadcast_to(cls, z.shape)
  out = []
  for zr, yr, tr, cr in zip(z, y, np.broadcast_to(tau, y.shape), cls, strict=True):
    ell = (zr[cr] - zr[yr]) / tr
    out.append(tr * np.log(np.mean(np.exp(ell))) + tr * rho)
  return np.array(out)


def _case():
  z = np.asarray(rows(0, (4, 6), 2.0), np.float64)
  y = np.array([0, 3, 5, 1])
  tau = np.array([0.3, 1.0, 2.5, 0.7])
  cls = np.ones((4, 6), bool)
  cls[1, 4:] = False
  cls[2, 0] = False
  return z, y, tau, cls


def test_against_reference_temperature_gradient_and_masks():
  z, y, tau, cls = _case()
  hid = np.ones((4, 6), bool)
  hid[0, 0] = False  # row 0's label hidden

  @jax.jit
  def run(z, tau):
    f = lambda t, w: js.losses.tempnet_dro_loss(z, y, t, rho=0.2, where=w)
    g = jax.grad(lambda t: jnp.sum(f(t, None)))(tau)
    return (f(tau, cls), g, f(tau, jnp.array([True, False, True, True])), f(tau, hid))

  got, g, ex_masked, label_hidden = run(jnp.asarray(z, jnp.float32), jnp.asarray(tau, jnp.float32))
  # float32 logits over 6 classes: a few ulps of |loss| ~ 5 -> rtol 1e-5
  np.testing.assert_allclose(got, _np_dro(z, y, tau, 0.2, cls), rtol=1e-5, atol=1e-6)
  # the tau-derivative is rho - KL(softmax(l / tau) || uniform)
  ell = (z - z[np.arange(4), y][:, None]) / tau[:, None]
  p = np.exp(ell - ell.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  kl = np.sum(p * np.log(p * 6), -1)
  np.testing.assert_allclose(g, 0.2 - kl, rtol=1e-4, atol=1e-5)  # float32 log/exp: ~1e-6 abs
  # masked example: 0; label on a masked class: +inf
  assert float(ex_masked[1]) == 0.0 and np.all(np.asarray(ex_masked)[[0, 2, 3]] != 0)
  assert np.isinf(float(label_hidden[0])) and np.all(np.isfinite(np.asarray(label_hidden)[1:]))


@pytest.mark.slow
def test_gradients_float64():
  z, y, tau, cls = _case()
  grads64(lambda a, t: dro(a, y, t, rho=0.2, where=cls), z, tau)


@pytest.mark.slow
def test_limits_monotonicity_and_constant_temperature():
  z = jnp.asarray(rows(1, (3, 5), 2.0))
  y = jnp.array([2, 0, 4])
  ell = np.asarray(z, np.float64) - np.asarray(z, np.float64)[np.arange(3), np.asarray(y)][:, None]
  taus = jnp.array([1e-3, 0.1, 0.5, 1.0, 3.0, 1e4])

  @jax.jit
  def sweep(z):
    return jax.vmap(lambda t: js.losses.tempnet_dro_loss(z, y, t, rho=0.0))(taus)

  vals = np.asarray(sweep(z), np.float64)
  # tau -> 0: max_j l_j (tau log m = 1.6e-3 below the max at tau = 1e-3); tau -> inf: the mean
  np.testing.assert_allclose(vals[0], ell.max(-1), atol=2e-3)
  np.testing.assert_allclose(vals[-1], ell.mean(-1), atol=1e-3)
  assert np.all(np.diff(vals, axis=0) <= 1e-6)  # non-increasing in tau
  # constant tau: tau CE(z / tau) - tau log m + tau rho
  ce = np_ce(np.asarray(z, np.float64) / 0.5, np.asarray(y))
  np.testing.assert_allclose(dro(z, y, 0.5, rho=0.3), 0.5 * (ce - np.log(5) + 0.3), rtol=1e-5)


@pytest.mark.slow
def test_bf16_and_errors():
  z = jnp.asarray(rows(2, (2, 4), 3.0))
  y = jnp.array([1, 2])
  out = dro(z.astype(jnp.bfloat16), y, jnp.array([0.5, 2.0]), rho=0.1)
  want = dro(z.astype(jnp.bfloat16).astype(jnp.float32), y, jnp.array([0.5, 2.0]), rho=0.1)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2)  # bf16 output: 8 bits
  f = js.losses.tempnet_dro_loss
  check_raises(
      ("temperature", lambda: f(z, y, 0.0, rho=0.1)),
      ("temperature", lambda: f(z, y, jnp.ones(3), rho=0.1)),
      ("rho", lambda: f(z, y, 1.0, rho=-1.0)),
      ("labels", lambda: f(z, jnp.ones(2), 1.0, rho=0.1)))
