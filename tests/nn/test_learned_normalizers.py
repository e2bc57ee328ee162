"""The learned-parameter modules reduce to their baselines at their documented init or
special values, and apply their normalizer with the learned values."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsoft.nn import _learned as L
from tests import helpers

B, N, T, H = 2, 3, 5, 4


def test_multimax_zero_init_is_softmax_and_params_are_per_head():
  scores = helpers.normal(0, (B, N, T, T), 2.0)
  where = jnp.tril(jnp.ones((T, T), bool))
  mm = L.MultiMax(N, init_std=0.0, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(mm(scores, where), jax.nn.softmax(scores, where=where),
                             rtol=1e-6, atol=1e-7)
  mm = L.MultiMax(N, init_std=0.5, rngs=nnx.Rngs(1))
  hp = mm.hyperparameters()
  assert set(hp) == {"t1", "t2", "t3", "t4", "b1", "b2", "b3", "b4"}
  got = mm(scores)
  # the official code's modulator, per head, then softmax (numpy float64)
  x = np.asarray(scores, np.float64)
  t = [np.asarray(hp[f"t{i}"], np.float64) for i in range(1, 5)]
  b = [np.asarray(hp[f"b{i}"], np.float64) for i in range(1, 5)]
  relu = lambda a: np.maximum(a, 0.0)  # noqa: E731
  sig = (x + t[0] * relu(b[0] - x) + t[1] * relu(x - b[1]) + t[2] * relu(b[2] - x) ** 2
         + t[3] * relu(x - b[3]) ** 2)
  e = np.exp(sig - sig.max(-1, keepdims=True))
  np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
  helpers.check_raises(("scores", lambda: mm(scores[:, :2])),
                       ("init_std", lambda: L.MultiMax(N, init_std=-1.0, rngs=nnx.Rngs(0))))


def test_qassmax_at_init_is_ssmax_with_s_one():
  qa = L.QASSMax(N, H, hidden=8, rngs=nnx.Rngs(2))
  q = helpers.normal(3, (B, T, N, H))
  k = helpers.normal(4, (B, T, N, H))
  causal = jnp.tril(jnp.ones((T, T), bool))
  n = jnp.arange(1, T + 1)  # the keys query i sees
  qt = qa(q, n)
  w = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", qt, k) / np.sqrt(H), where=causal)
  # SSMax with s = 1: softmax((log n_i) x_ij) with n_i = i + 1 visible keys
  plain = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  want = jax.nn.softmax(jnp.log(n)[:, None] * plain, where=causal) * causal
  np.testing.assert_allclose(w * causal, want, rtol=1e-5, atol=1e-6)
  # training the gate moves it away from 1, within (0, 2)
  qa.gate_out.kernel[...] = jnp.full(qa.gate_out.kernel.shape, 0.3)
  g = qa.gate(q)
  assert np.all((np.asarray(g) > 0) & (np.asarray(g) < 2)) and np.abs(np.asarray(g) - 1).max() > 0.1
  helpers.check_raises(("q", lambda: qa(q[..., :2], n)), ("n", lambda: qa(q, jnp.ones(3))))


def test_tempnet_constant_at_init_is_softmax_over_tau():
  net = L.TempNet(6, hidden=8, tau_init=0.4, rngs=nnx.Rngs(5))
  feats = helpers.normal(6, (4, 6), 3.0)
  logits = helpers.normal(7, (4, 9))
  np.testing.assert_allclose(net.temperature(feats), np.full((4, 1), 0.4), rtol=1e-6)
  np.testing.assert_allclose(net(feats, logits), jax.nn.softmax(logits / 0.4), rtol=1e-5,
                             atol=1e-7)
  # after a change of the last layer the temperature depends on the input, inside the range
  net.out.kernel[...] = jnp.full(net.out.kernel.shape, 0.1)
  tau = np.asarray(net.temperature(feats))
  assert tau.std() > 1e-3 and np.all((tau > 0.05) & (tau < 2.0))
  np.testing.assert_allclose(net(feats, logits), jax.nn.softmax(logits / tau), rtol=1e-5,
                             atol=1e-7)
  helpers.check_raises(("tau_init", lambda: L.TempNet(3, tau_init=3.0, rngs=nnx.Rngs(0))),
                       ("tau_min", lambda: L.TempNet(3, tau_min=0.0, rngs=nnx.Rngs(0))))


def test_dirichlet_calibration_identity_then_temperature_scaling_then_fit():
  z = helpers.normal(8, (16, 5), 3.0)
  lp = jax.nn.log_softmax(z)
  cal = L.DirichletCalibration(5)
  np.testing.assert_allclose(cal(lp), jax.nn.softmax(z), rtol=1e-5, atol=1e-7)
  assert float(cal.penalty()) == 0.0
  cal.weights[...] = jnp.eye(5) / 2.5
  np.testing.assert_allclose(cal(lp), jax.nn.softmax(z / 2.5), rtol=1e-5, atol=1e-7)
  # fitting on over-confident logits (true probabilities softmax(z / 3)) lowers the log-loss
  labels = jax.random.categorical(jax.random.key(9), z / 3.0, shape=(64, 16))
  model = L.DirichletCalibration(5)
  opt = nnx.Optimizer(model, __import__("optax").adam(0.05), wrt=nnx.Param)

  def nll(m):
    logp = jnp.log(m(lp) + 1e-12)
    return -jnp.mean(jnp.take_along_axis(logp[None], labels[..., None], -1)) + 1e-3 * m.penalty()

  first = float(nll(model))

  @nnx.jit
  def step(m, o):
    loss, g = nnx.value_and_grad(nll)(m)
    o.update(m, g)
    return loss

  for _ in range(60):
    step(model, opt)
  assert float(nll(model)) < first - 0.1
