"""The learned-parameter modules reduce to their baselines at their documented init or
special values, apply their normalizer with the learned values (against float64 numpy
references of the formulas), and plug into MultiHeadAttention(learned=...)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.test_util import check_grads

import jaxsoft as js
from jaxsoft.nn import _learned_normalizers as L
from tests import helpers

B, N, T, H = 2, 3, 5, 4


def test_multimax_zero_init_is_softmax_and_params_are_per_head():
  scores = helpers.normal(0, (B, N, T, T), 2.0)
  where = jnp.tril(jnp.ones((T, T), bool))
  # jitted calls: one compilation per call form instead of one per eager operation
  softmax = jax.jit(lambda s: jax.nn.softmax(s, where=where))
  mm = L.MultiMax(N, init_std=0.0, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(nnx.jit(lambda m, s: m(s, where))(mm, scores), softmax(scores),
                             rtol=1e-6, atol=1e-7)
  mm = L.MultiMax(N, init_std=0.5, rngs=nnx.Rngs(1))
  hp = mm.hyperparameters()
  assert set(hp) == {"t1", "t2", "t3", "t4", "b1", "b2", "b3", "b4"}
  got = nnx.jit(lambda m, s: m(s))(mm, scores)
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
  causal = jnp.tril(jnp.ones((T, T), bool))[None, None]  # [1, 1, T, T]
  n = jnp.arange(1, T + 1)  # the keys query i sees
  qt = qa(q, n)
  w = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", qt, k) / np.sqrt(H), where=causal)
  # SSMax with s = 1: softmax((log n_i) x_ij) with n_i = i + 1 visible keys
  plain = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  want = jax.nn.softmax(jnp.log(n)[:, None][None, None] * plain, where=causal) * causal
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


# --------------------------------------------------------------- SSA, ASEntmax, Polar, MoEGate


def _np_softmax(z, mask):
  z = np.where(mask, z, -np.inf)
  e = np.where(mask, np.exp(z - z.max(-1, keepdims=True)), 0.0)
  return e / e.sum(-1, keepdims=True)


def _causal_case(seed):
  """Scores [B, N, T, T], queries [B, N, T, H] and the causal mask (row i sees i + 1 keys)."""
  scores = helpers.normal(seed, (B, N, T, T), 1.5)
  q = helpers.normal(seed + 1, (B, N, T, H))
  causal = np.tril(np.ones((T, T), bool))
  return scores, q, causal, np.arange(1, T + 1, dtype=np.float64)[:, None]


def _softplus(v):
  return np.logaddexp(0.0, v)


def test_ssa_reduces_to_its_baselines_and_matches_the_formula():
  scores, q, causal, n = _causal_case(10)
  ssa = L.SSA(N, H)
  np.testing.assert_allclose(ssa(scores, q, causal),
                             js.normalizers.ssa_softmax(scores, where=causal), rtol=1e-6,
                             atol=1e-7)  # at init: the normalizer's defaults
  ssa.alpha[...] = jnp.full((N,), -200.0)  # sigmoid(alpha) = 0, token term 0: softmax
  np.testing.assert_allclose(ssa(scores, q, causal), jax.nn.softmax(scores, where=causal),
                             rtol=1e-6, atol=1e-7)
  ssa = L.SSA(N, H, alpha_init=np.array([-1.0, 0.0, 2.0]))
  ssa.token_kernel[...] = helpers.normal(12, (N, H))
  ssa.token_bias[...] = jnp.array([0.1, -0.2, 0.3])
  # float64: tau = tanh(w_h . q + c_h) + 1 + sigmoid(alpha_h) log n
  qd, w = np.asarray(q, np.float64), np.asarray(ssa.token_kernel[...], np.float64)
  tok = np.tanh(np.einsum("bnth,nh->bnt", qd, w) + np.array([0.1, -0.2, 0.3])[:, None])
  sig = 1.0 / (1.0 + np.exp(-np.array([-1.0, 0.0, 2.0])))[:, None, None]
  tau = tok[..., None] + 1.0 + sig * np.log(n)
  want = _np_softmax(tau * np.asarray(scores, np.float64), causal)
  np.testing.assert_allclose(ssa(scores, q, causal), want * causal, rtol=1e-5, atol=1e-6)
  helpers.check_raises(("alpha_init", lambda: L.SSA(N, H, alpha_init=np.zeros(N + 1))),
                       ("head_dim", lambda: L.SSA(N, 0)),
                       ("q", lambda: ssa(scores, q[..., :2], causal)))
  ssa.alpha.set_value(jnp.zeros((N + 1,)))
  helpers.check_raises(("alpha", lambda: ssa(scores, q, causal)))


def test_asentmax_reduces_to_entmax_and_matches_the_formula():
  scores, q, causal, n = _causal_case(20)
  # jitted calls: one compilation per call form instead of one per eager operation
  call = nnx.jit(lambda m, s: m(s, q, causal))
  ase = L.ASEntmax(N, H)
  baselines = jax.jit(lambda s: (js.normalizers.asentmax(s, where=causal),
                                 js.normalizers.entmax15(s, where=causal)))(scores)
  np.testing.assert_allclose(call(ase, scores), baselines[0], rtol=1e-5,
                             atol=1e-6)  # at init: the normalizer's defaults
  ase.beta_bias[...] = jnp.full((N,), -1e3)  # beta = softplus(-1e3) = 0 and delta = 1
  np.testing.assert_allclose(call(ase, scores), baselines[1], rtol=1e-5, atol=1e-6)
  ase = L.ASEntmax(N, H, alpha=2.0, delta=0.5, beta_init=0.3, gamma_init=[0.5, 1.0, 2.0])
  ase.beta_kernel[...] = helpers.normal(21, (N, H), 0.5)
  # float64 scale theta = delta + softplus(w_h . q + c_h) (log n)^gamma_h; alpha = 2 is
  # sparsemax (optax's simplex projection, an independent oracle) of theta x
  qd, w = np.asarray(q, np.float64), np.asarray(ase.beta_kernel[...], np.float64)
  beta = _softplus(np.einsum("bnth,nh->bnt", qd, w) + np.log(np.expm1(0.3)))[..., None]
  gamma = np.array([0.5, 1.0, 2.0])[:, None, None]
  theta = 0.5 + beta * np.log(n) ** gamma
  z = np.where(causal, theta * np.asarray(scores, np.float64), -1e9)
  rows = jnp.asarray(z.reshape(-1, T), jnp.float32)
  want = np.asarray(jax.jit(jax.vmap(optax.projections.projection_simplex))(rows))
  np.testing.assert_allclose(call(ase, scores), want.reshape(z.shape) * causal, rtol=1e-4,
                             atol=1e-5)
  helpers.check_raises(("alpha", lambda: L.ASEntmax(N, H, alpha=1.0)),
                       ("delta", lambda: L.ASEntmax(N, H, delta=-0.1)),
                       ("beta_init", lambda: L.ASEntmax(N, H, beta_init=0.0)),
                       ("gamma_init", lambda: L.ASEntmax(N, H, gamma_init=[1.0, 0.0, 1.0])),
                       ("gamma_init", lambda: L.ASEntmax(N, H, gamma_init=[1.0, 1.0])))


def test_polar_sink_reduces_to_softmax_and_matches_the_formula():
  scores, _, causal, n = _causal_case(30)
  pol = L.PolarSink(N)
  np.testing.assert_allclose(pol(scores, causal),
                             js.normalizers.polar_softmax(scores, where=causal), rtol=1e-6,
                             atol=1e-7)  # at init: the normalizer's defaults
  pol.alpha[...] = jnp.full((N,), -1e4)  # t = 1
  pol.null_bias[...] = jnp.full((N,), -1e4)  # the null entry takes nothing
  np.testing.assert_allclose(pol(scores, causal), jax.nn.softmax(scores, where=causal),
                             rtol=1e-6, atol=1e-7)
  a, b, g = np.array([-1.0, 0.0, 1.0]), np.array([1.5, 0.0, -1.0]), np.array([1.0, -2.0, 0.5])
  pol = L.PolarSink(N, alpha_init=a, null_bias_init=b, gamma_init=g)
  # float64: softmax(t [x, nu]) without the null, per head
  t = 1.0 + _softplus(a)[:, None, None] * np.log(n)
  nu = b[:, None, None] + _softplus(g)[:, None, None] * np.sqrt(np.log(n + 1))
  x = np.where(causal, t * np.asarray(scores, np.float64), -np.inf)
  m = np.maximum(x.max(-1, keepdims=True), t * nu)
  e = np.exp(x - m)
  want = e / (e.sum(-1, keepdims=True) + np.exp(t * nu - m))
  np.testing.assert_allclose(pol(scores, causal), want, rtol=1e-5, atol=1e-6)
  helpers.check_raises(("null_bias_init", lambda: L.PolarSink(N, null_bias_init=[0.0])),
                       ("gamma_init", lambda: L.PolarSink(N, gamma_init=float("nan"))),
                       ("scores", lambda: pol(scores[:, :2], causal)))


def test_moe_gate_matches_the_formula_and_the_plain_gate_is_its_baseline():
  h = helpers.normal(40, (6, 5), 2.0)
  gate = L.MoEGate(5, 4, tau_init=0.6, rngs=nnx.Rngs(41))
  np.testing.assert_allclose(gate.temperature(), 0.6, rtol=1e-6)
  w = np.asarray(gate.router.kernel[...], np.float64)
  logits = np.asarray(h, np.float64) @ w  # b = 0 at init
  ones = np.ones(logits.shape, bool)
  np.testing.assert_allclose(gate(h), _np_softmax(1.0 / (1.0 + np.exp(-logits)) / 0.6, ones),
                             rtol=1e-5, atol=1e-7)
  plain = L.MoEGate(5, 4, tau_init=0.6, activation=False, rngs=nnx.Rngs(41))
  np.testing.assert_allclose(plain(h), _np_softmax(logits / 0.6, ones), rtol=1e-5, atol=1e-7)
  assert (gate.normalizer, plain.normalizer) == ("moe_gate", "softmax")
  # masked experts get exactly 0
  where = jnp.array([True, False, True, True])
  assert np.all(np.asarray(gate(h, where))[:, 1] == 0)
  helpers.check_raises(("tau_init", lambda: L.MoEGate(5, 4, tau_init=0.0, rngs=nnx.Rngs(0))),
                       ("num_experts", lambda: L.MoEGate(5, 0, rngs=nnx.Rngs(0))),
                       ("activation", lambda: L.MoEGate(5, 4, activation="yes",
                                                        rngs=nnx.Rngs(0))),
                       ("inputs", lambda: gate(h[:, :3])))


def test_module_gradients_float64_bf16_and_extreme_scores():
  scores, q, causal, _ = _causal_case(50)
  mods = {"ssa": L.SSA(N, H, alpha_init=0.5), "ase": L.ASEntmax(N, H),
          "polar": L.PolarSink(N, null_bias_init=0.5, gamma_init=1.0)}
  mods["ssa"].token_kernel[...] = helpers.normal(51, (N, H), 0.3)
  mods["ase"].beta_kernel[...] = helpers.normal(52, (N, H), 0.3)
  calls = {"ssa": lambda m, s: m(s, q, causal), "ase": lambda m, s: m(s, q, causal),
           "polar": lambda m, s: m(s, causal)}
  with jax.enable_x64(True):
    for name in ("ssa",):  # smooth: check_grads on the scores and the parameters
      gdef, state = nnx.split(mods[name])
      state = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), state)

      @jax.jit
      def f(s, st, gdef=gdef, call=calls[name]):
        return call(nnx.merge(gdef, st), s)
      check_grads(f, (jnp.asarray(scores, jnp.float64), state), order=1, modes=("rev",),
                  atol=1e-4, rtol=1e-4)
  # entmax is piecewise smooth: gradients finite, zero on masked entries
  for name, mod in mods.items():
    @nnx.jit  # one compilation per module instead of one per eager operation
    def run(m, scores, c=calls[name]):
      g = jax.grad(lambda s: jnp.sum(jnp.sin(c(m, s))))(scores)
      low = scores.astype(jnp.bfloat16)
      return g, c(m, low), c(m, low.astype(jnp.float32)), c(m, scores * 1e4)

    g, out, out32, big = run(mod, scores)
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[..., ~causal] == 0)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), out32, atol=1e-2)
    assert np.all(np.isfinite(np.asarray(big)))
    np.testing.assert_array_less(np.asarray(big).sum(-1), 1.0 + 1e-5)
  gate = L.MoEGate(3, 4, rngs=nnx.Rngs(0))
  gw = np.asarray(gate(jnp.full((2, 3), 1e30)))
  assert np.all(np.isfinite(gw)) and np.allclose(gw.sum(-1), 1.0)


def test_attention_hyperparams_shapes_and_visible_counts():
  q = helpers.normal(60, (B, N, T, H))
  n = jnp.arange(1.0, T + 1)[:, None]
  # the shapes alone: traced, not computed (no compilation)
  hyper = lambda m: nnx.eval_shape(lambda m: m.attention_hyperparams(q, n), m)
  got = {k: v.shape for k, v in hyper(L.SSA(N, H)).items()}
  assert got == {"alpha": (N, 1, 1), "token_temperature": (B, N, T, 1)}
  got = hyper(L.TempNet(N * H, hidden=4, rngs=nnx.Rngs(0)))
  assert got["temperature"].shape == (B, 1, T, 1)
  got = hyper(L.TempNet(H, hidden=4, rngs=nnx.Rngs(0)))
  assert got["temperature"].shape == (B, N, T, 1)
  qa = L.QASSMax(N, H, hidden=4, rngs=nnx.Rngs(0))
  # per-head counts: head h scales with its own log n (at init q~ = q log n)
  per_head = np.arange(1.0, N + 1)[None, :, None, None] * np.ones((1, 1, T, 1))
  np.testing.assert_allclose(
      nnx.jit(lambda m, c: m.attention_queries(q, c))(qa, jnp.asarray(per_head, jnp.float32)),
      np.asarray(q) * np.log(per_head), rtol=1e-6)
  helpers.check_raises(("n_visible", lambda: qa.attention_queries(q, jnp.ones((T + 1, 1)))),
                       ("q", lambda: L.PolarSink(N).attention_hyperparams(q[:, :2], n)))
  # the visible counts MultiHeadAttention gives the modules, against a brute-force count
  t, s = 6, 7
  qlen, kvlen = jnp.array([6, 4]), jnp.array([7, 5])
  seg = (jnp.array([[0, 0, 1, 1, 1, 2]] * 2), jnp.array([[0, 0, 0, 1, 1, 2, 2]] * 2))
  mask = np.random.default_rng(61).random((2, 1, t, s)) < 0.8
  got = jax.jit(lambda mask, qlen, kvlen, seg: L.visible_key_counts(  # one compilation
      t, s, mask, is_causal=True, local_window_size=(2, 0), query_seq_lengths=qlen,
      key_value_seq_lengths=kvlen, segment_ids=seg, batch=2))(jnp.asarray(mask), qlen, kvlen, seg)
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  vis = mask & (j <= i) & (j >= i - 2)
  vis = vis & (i < np.asarray(qlen)[:, None, None, None]) & (j < np.asarray(kvlen)[:, None, None, None])
  vis = vis & (np.asarray(seg[0])[:, None, :, None] == np.asarray(seg[1])[:, None, None, :])
  np.testing.assert_array_equal(np.broadcast_to(got, (2, 1, t, 1)), vis.sum(-1, keepdims=True))
  got = L.visible_key_counts(t, s, None, is_causal=True)
  np.testing.assert_array_equal(np.broadcast_to(got, (1, 1, t, 1))[0, 0, :, 0], np.arange(1, t + 1))


# --------------------------------------------------------------- in MultiHeadAttention

D = N * H


def _layer(normalizer, learned=(), params=None):
  return js.nn.MultiHeadAttention(N, D, normalizer=normalizer, learned=learned,
                                  normalizer_params=params, rngs=nnx.Rngs(70))


BASELINES = [  # (module at its baseline init, the layer's normalizer, the baseline layer)
    ("MultiMax", lambda: L.MultiMax(N, init_std=0.0, rngs=nnx.Rngs(0)), "multimax",
     ("softmax", None)),
    ("QASSMax", lambda: L.QASSMax(N, H, hidden=4, rngs=nnx.Rngs(0)), "softmax",
     ("ssmax", {"s": 1.0})),
    ("SSA", lambda: L.SSA(N, H), "ssa_softmax", ("ssa_softmax", None)),
    ("ASEntmax", lambda: L.ASEntmax(N, H), "asentmax", ("asentmax", None)),
    ("PolarSink", lambda: L.PolarSink(N), "polar_softmax", ("polar_softmax", None)),
    ("TempNet", lambda: L.TempNet(D, hidden=4, tau_init=0.5, rngs=nnx.Rngs(0)), "softmax",
     ("softmax", {"temperature": 0.5})),
    ("MoEGate", lambda: L.MoEGate(D, 4, tau_init=0.7, rngs=nnx.Rngs(0)), "moe_gate",
     ("moe_gate", {"tau": 0.7})),
]


@pytest.mark.parametrize("make,normalizer,baseline", [b[1:] for b in BASELINES],
                         ids=[b[0] for b in BASELINES])
def test_mha_with_module_at_init_equals_the_baseline_and_trains_it(make, normalizer, baseline):
  x = helpers.normal(71, (B, T, D))
  kvlen = jnp.array([T, T - 2])  # padding: the visible counts differ from the row position
  module = make()
  layer = _layer(normalizer, (module,))
  ref = _layer(baseline[0], (), baseline[1])
  kw = dict(is_causal=True, key_value_seq_lengths=kvlen)
  forward = nnx.jit(lambda m: m(x, **kw))  # one compilation per layer, not one per operation
  np.testing.assert_allclose(forward(layer), forward(ref), rtol=1e-5, atol=1e-6)
  # the module's parameters are the layer's: a gradient reaches every one of them
  def loss(m):
    return jnp.sum(jnp.sin(m(x, **kw)))
  grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param)))(layer)
  leaves = jax.tree.leaves(nnx.state(grads, nnx.Param)["learned_modules"])
  assert leaves and all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
  assert any(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_mha_trained_module_changes_the_output_and_mismatches_raise():
  x = helpers.normal(80, (B, T, D))
  ssa = L.SSA(N, H)
  layer = _layer("ssa_softmax", (ssa,))
  before = layer(x, is_causal=True)
  ssa.token_kernel[...] = helpers.normal(81, (N, H))
  after = layer(x, is_causal=True)
  assert float(jnp.abs(after - before).max()) > 1e-4
  # per-query hyperparameters [B, N, T, 1] also reach the blockwise path
  chunked = js.nn.MultiHeadAttention(N, D, normalizer="ssa_softmax", learned=(ssa,),
                                     implementation="xla_chunked", rngs=nnx.Rngs(70))
  np.testing.assert_allclose(chunked(x, is_causal=True), after, rtol=1e-5, atol=1e-6)
  mm = L.MultiMax(N, rngs=nnx.Rngs(0))
  helpers.check_raises(
      ("multimax", lambda: _layer("softmax", (mm,))),
      ("num_heads", lambda: _layer("multimax", (L.MultiMax(N + 1, rngs=nnx.Rngs(0)),))),
      ("learned", lambda: _layer("softmax", (L.DirichletCalibration(3),))),
      ("registered", lambda: _layer(jax.nn.softmax, (mm,))))
  clash = _layer("moe_gate", (L.MoEGate(D, 2, rngs=nnx.Rngs(0)),), {"tau": 0.5})
  helpers.check_raises(("tau", lambda: clash(x)))
