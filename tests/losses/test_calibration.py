"""L16 calibration and OOD scores (msp, energy_score, odin, ece, fit_temperature) against float64
numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises, normal

L = js.losses


def _lse(z, axis=-1):
  m = np.max(z, axis=axis, keepdims=True)
  return np.squeeze(m, axis) + np.log(np.sum(np.exp(z - m), axis=axis))


def test_msp_and_energy_match_reference_and_their_identities():
  f = normal(0, (6, 5), 3.0)
  f64 = np.asarray(f, np.float64)
  t = 2.0
  run = jax.jit(lambda a: (L.msp(a, temperature=t), L.energy_score(a, temperature=t),
                           jax.grad(lambda b: L.energy_score(b, temperature=t).sum())(a),
                           L.msp(a), L.energy_score(a), L.energy_score(a + 7.0),
                           L.msp(a + 7.0), L.energy_score(a, temperature=1e-3)))
  m, e, de, m1, e1, e_shift, m_shift, e_cold = run(f)
  np.testing.assert_allclose(m, np.exp(f64.max(-1) / t - _lse(f64 / t)), rtol=1e-5)
  np.testing.assert_allclose(e, t * _lse(f64 / t), rtol=1e-5)
  np.testing.assert_allclose(de, np.exp(f64 / t - _lse(f64 / t)[:, None]), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.log(m1), f64.max(-1) - e1, rtol=1e-5, atol=1e-6)  # log MSP = max f + E
  assert np.all(f64.max(-1) <= e1 + 1e-5) and np.all(e1 <= f64.max(-1) + np.log(5) + 1e-5)
  np.testing.assert_allclose(e_shift, e1 + 7.0, rtol=1e-6)     # energy moves with a shift ...
  np.testing.assert_allclose(m_shift, m1, rtol=1e-5)            # ... MSP does not
  np.testing.assert_allclose(e_cold, f64.max(-1), rtol=1e-4)   # T -> 0: the max logit
  assert np.all((m1 >= 1 / 5 - 1e-6) & (m1 <= 1))


def test_msp_and_energy_masks_and_extremes():
  f = jnp.array([[1.0, 2.0, -jnp.inf], [3e38, -3e38, 0.0], [-jnp.inf, -jnp.inf, -jnp.inf]])
  where = jnp.array([[True, False, True], [True, True, True], [True, True, True]])
  m, e = L.msp(f, where=where), L.energy_score(f, where=where)
  np.testing.assert_allclose(m[0], 1.0, rtol=1e-6)       # one visible class
  np.testing.assert_allclose(e[0], 1.0, rtol=1e-6)
  assert m[1] == 1.0 and e[1] == np.float32(3e38)
  assert m[2] == 0.0 and e[2] == 0.0
  assert L.msp(f.astype(jnp.bfloat16), where=where).dtype == jnp.bfloat16


def test_odin_matches_reference_for_a_linear_model():
  x, w = normal(1, (6, 4)), normal(2, (4, 5), 2.0)
  t, eps = 10.0, 0.05
  model = lambda v: v @ w
  got = jax.jit(lambda a: (L.odin(model, a, temperature=t, epsilon=eps),
                           L.odin(model, a, temperature=t, epsilon=0.0)))(x)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)

  def score(v):
    z = v @ w64 / t
    return np.exp(z.max(-1) - _lse(z))

  z = x64 @ w64 / t
  p = np.exp(z - _lse(z)[:, None])
  grad = (w64[:, z.argmax(-1)].T - p @ w64.T) / t          # d log S / dx
  np.testing.assert_allclose(got[0], score(x64 + eps * np.sign(grad)), rtol=1e-5)
  np.testing.assert_allclose(got[1], score(x64), rtol=1e-5)
  assert np.all(got[0] >= got[1]) and np.all(got[0] <= 1) and np.all(got[1] >= 1 / 5)


def _ece_reference(logits, labels, bins):
  z = np.asarray(logits, np.float64)
  p = np.exp(z - _lse(z)[:, None])
  conf, pred = p.max(-1), p.argmax(-1)
  total = 0.0
  for b in range(bins):
    sel = (conf > b / bins) & (conf <= (b + 1) / bins)
    if sel.any():
      total += sel.sum() / len(z) * abs((pred[sel] == labels[sel]).mean() - conf[sel].mean())
  return total


def test_ece_matches_reference_and_fit_temperature_recovers_a_known_temperature():
  true_logits = normal(3, (600, 4), 1.5)
  labels = jax.random.categorical(jax.random.key(4), true_logits)
  overconfident = 3.0 * true_logits                 # calibrated at T = 3
  ece = jax.jit(L.ece, static_argnames="num_bins")  # one compilation per call form
  for bins in (1, 10):
    np.testing.assert_allclose(ece(overconfident, labels, num_bins=bins),
                               _ece_reference(overconfident, np.asarray(labels), bins),
                               rtol=1e-5, atol=1e-7)
  t = jax.jit(L.fit_temperature)(overconfident, labels)
  # the NLL minimiser, by a float64 grid search refined around its best point
  z, y = np.asarray(overconfident, np.float64), np.asarray(labels)
  nll = lambda tt: np.mean(_lse(z / tt) - z[np.arange(len(y)), y] / tt)
  grid = np.exp(np.linspace(np.log(0.3), np.log(30.0), 801))
  best = grid[np.argmin([nll(g) for g in grid])]
  fine = np.linspace(best * 0.99, best * 1.01, 401)
  best = fine[np.argmin([nll(g) for g in fine])]
  np.testing.assert_allclose(t, best, rtol=2e-3)
  assert 2.4 < float(t) < 3.6
  assert ece(overconfident / t, labels) < 0.5 * ece(overconfident, labels)
  # masked examples are left out
  where = jnp.arange(600) < 300
  np.testing.assert_allclose(ece(overconfident, labels, where=where),
                             _ece_reference(overconfident[:300], y[:300], 15), rtol=1e-5)


@pytest.mark.slow
def test_fit_temperature_leaves_masked_examples_out():
  true_logits = 3.0 * normal(3, (400, 4), 1.5)
  labels = jax.random.categorical(jax.random.key(4), true_logits / 3.0)
  where = jnp.arange(400) < 200
  np.testing.assert_allclose(L.fit_temperature(true_logits, labels, where=where),
                             L.fit_temperature(true_logits[:200], labels[:200]), rtol=1e-4)


def test_dirichlet_calibration_identity_and_fit_optimality():
  z = normal(6, (1500, 3), 2.0)
  # W = I / T, b = 0 is temperature scaling exactly
  # jitted: one compilation per call instead of one per eager operation
  cal, want = jax.jit(lambda z: (jax.nn.softmax(L.dirichlet_calibrate(z, jnp.eye(3) / 2.5,
                                                                      jnp.zeros(3))),
                                 jax.nn.softmax(z / 2.5)))(z)
  np.testing.assert_allclose(cal, want, rtol=1e-5, atol=1e-7)
  w_true = np.array([[1.5, 0.3, 0.0], [0.0, 0.8, 0.2], [0.1, 0.0, 1.2]])
  b_true = np.array([0.2, -0.1, 0.0])
  labels = jax.jit(lambda z: jax.random.categorical(
      jax.random.key(7), L.dirichlet_calibrate(z, jnp.asarray(w_true), jnp.asarray(b_true))))(z)
  lam, mu = 0.01, 0.01
  w, b = jax.jit(lambda z, labels: L.fit_dirichlet_calibration(
      z, labels, off_diagonal_weight=lam, bias_weight=mu))(z, labels)
  z64, y = np.asarray(z, np.float64), np.asarray(labels)
  log_p = z64 - _lse(z64)[:, None]
  off = 1 - np.eye(3)

  def objective(wb):   # float64 numpy, flattened (W, b)
    ww, bb = wb[:9].reshape(3, 3), wb[9:]
    q = log_p @ ww.T + bb
    return (np.mean(_lse(q) - q[np.arange(len(y)), y]) + lam * np.sum((ww * off) ** 2) / 6
            + mu * np.sum(bb**2) / 3)

  fitted = np.concatenate([np.asarray(w, np.float64).ravel(), np.asarray(b, np.float64)])
  grad = np.array([(objective(fitted + e) - objective(fitted - e)) / 2e-6
                   for e in 1e-6 * np.eye(12)])
  assert np.max(np.abs(grad)) < 1e-3, grad                      # a stationary point ...
  assert objective(fitted) <= objective(np.concatenate([w_true.ravel(), b_true])) + 1e-7
  np.testing.assert_allclose(w, w_true, atol=0.4)               # ... near the truth


def test_bad_input_names_the_argument():
  f, labels = normal(5, (4, 3)), jnp.array([0, 1, 2, 0])
  check_raises(
      ("`temperature`", lambda: L.msp(f, temperature=0.0)),
      ("`temperature`", lambda: L.energy_score(f, temperature=-1.0)),
      ("`num_bins`", lambda: L.ece(f, labels, num_bins=0)),
      ("`labels`", lambda: L.ece(f, labels[:3])),
      ("`model_fn`", lambda: L.odin(None, f)),
      ("`model_fn`", lambda: L.odin(lambda v: v[0], f)),
      ("`epsilon`", lambda: L.odin(lambda v: v, f, epsilon=-0.1)),
      ("`inputs`", lambda: L.odin(lambda v: v, f.astype(jnp.complex64))),  # ints promote
      ("`init`", lambda: L.fit_temperature(f, labels, init=0.0)),
      ("`num_steps`", lambda: L.fit_temperature(f, labels, num_steps=0)),
      ("`logits`", lambda: L.fit_temperature(f[0], labels[0])),
      ("`where`", lambda: L.fit_temperature(f, labels, where=jnp.ones((3,), bool))),
      ("`weights`", lambda: L.dirichlet_calibrate(f, jnp.eye(2), jnp.zeros(3))),
      ("`bias`", lambda: L.dirichlet_calibrate(f, jnp.eye(3), jnp.zeros(2))),
      ("`off_diagonal_weight`",
       lambda: L.fit_dirichlet_calibration(f, labels, off_diagonal_weight=-1.0)),
  )
