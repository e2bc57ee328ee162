"""The linear-family layers and HedgehogFeatureMap (jaxsoft/nn/_linear.py).

Oracles: a plain-jnp SimpleGLA / linear-attention layer written out token by token (no
jaxsoft), numpy float64 Hedgehog features and attention maps, and the identity
"one-token decoding = the full forward" for every kind.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxsoft import linear as js_linear
from jaxsoft import nn as js_nn
from tests import helpers
from tests.helpers import check_raises

D, N, H, T, B = 8, 2, 4, 6, 2
# Every causal-only row of the table (a new one is tested here with no edit); "mhla" and
# "rala" have a bidirectional form: tests/nn/test_linear_mixer_mhla_rala.py.
KINDS = tuple(kind for kind, row in js_nn.LINEAR_MIXER_TABLE.items() if row.direction == "causal")
DEFAULT_KINDS = ("gated_delta_rule", "gla")  # "linear": the Hedgehog test below


def _jit_init(fn):
  """An nnx module built under jit (eager initialisation is slow on CPU)."""
  graphdef, _ = nnx.split(nnx.eval_shape(fn))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.state(fn()))())


def _layer(kind, **kwargs):
  kwargs.setdefault("max_len", 16.0)
  # small enough that T = 6 crosses TTT's mini-batches and the hybrid's window
  kwargs.setdefault("mini_batch_size", 4)
  kwargs.setdefault("window", 3)
  kwargs.setdefault("num_slots", 2)
  return _jit_init(lambda: js_nn.LinearMixer(kind, D, N, H, conv_size=3, rngs=nnx.Rngs(0),
                                             **kwargs))


def _x(seed=1, t=T, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), (B, t, D)).astype(dtype)


_STEP = jax.jit(lambda g, p, x, s: nnx.merge(g, p).step(x, s), static_argnums=0)
_FORWARD = jax.jit(lambda g, p, x: nnx.merge(g, p)(x), static_argnums=0)


def _decode(layer, x):
  graphdef, params = nnx.split(layer)
  step = functools.partial(_STEP, graphdef)
  state = layer.init_state(x.shape[0])
  outs = []
  for t in range(x.shape[1]):
    y, state = step(params, x[:, t], state)
    outs.append(y)
  assert int(state["position"]) == x.shape[1]
  return jnp.stack(outs, axis=1)


def _forward(layer, x):
  graphdef, params = nnx.split(layer)
  return _FORWARD(graphdef, params, x)


@pytest.mark.parametrize("kind", [k if k in DEFAULT_KINDS else pytest.param(
    k, marks=pytest.mark.slow) for k in KINDS])
def test_one_token_decoding_equals_the_full_forward(kind):
  layer = _layer(kind)
  x = _x()
  full = _forward(layer, x)
  assert full.shape == x.shape and bool(jnp.all(jnp.isfinite(full)))
  np.testing.assert_allclose(_decode(layer, x), full, rtol=2e-4, atol=2e-5)
  huge = x * 1e4  # extreme inputs (same compiled functions): finite
  assert bool(jnp.all(jnp.isfinite(_forward(layer, huge))))
  assert bool(jnp.all(jnp.isfinite(_decode(layer, huge))))


@pytest.mark.parametrize("kind", ["simple_gla", pytest.param("delta_rule", marks=pytest.mark.slow)])
def test_parallel_recurrent_and_chunked_layers_agree(kind):
  x = _x(t=7)
  outs = [_forward(_layer(kind, implementation=impl, chunk_size=3), x)
          for impl in ("parallel", "recurrent", "chunked")]
  for o in outs[1:]:
    np.testing.assert_allclose(o, outs[0], rtol=2e-4, atol=2e-5)


def _value(v):
  return v[...]


def _qkv_by_hand(layer, x):
  """Projections, the causal depthwise convolution and SiLU, in plain jnp: q, k, v [B, T, N, H]."""
  b, t, _ = x.shape
  u = x @ _value(layer.qkv.kernel)
  w = _value(layer.conv)
  padded = jnp.pad(u, ((0, 0), (w.shape[0] - 1, 0), (0, 0)))
  u = jax.nn.silu(sum(w[None, i:i + 1] * padded[:, i:i + t] for i in range(w.shape[0])))
  return tuple(a.reshape(b, t, N, H) for a in jnp.split(u, 3, axis=-1))


def _finish_by_hand(layer, o, x):
  """Per-head RMSNorm, the SiLU output gate and the output projection, in plain jnp."""
  b, t, _ = x.shape
  o = (o / jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + 1e-6)
       * _value(layer.o_norm)[None, None, None, :])
  o = o.reshape(b, t, N * H) * jax.nn.silu(x @ _value(layer.gate.kernel))
  return o @ _value(layer.o.kernel)


def _written_out(layer, x):
  """SimpleGLA (or linear attention with elu + 1 features) in plain jnp: projections, conv,
  SiLU, the recurrence S_t = a_t S_{t-1} + k_t v_t^T token by token, RMSNorm, output gate."""
  p = _value
  b, t, _ = x.shape
  q, k, v = _qkv_by_hand(layer, x)
  if layer.kind == "simple_gla":
    alpha = jax.nn.sigmoid(x @ p(layer.gk.kernel) + p(layer.gk.bias)[None, None, :]) ** (1 / 16)
  else:
    alpha = jnp.ones((b, t, N))
    q, k = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1
  S = jnp.zeros((b, N, H, H))
  z = jnp.zeros((b, N, H))
  outs = []
  for i in range(t):
    S = alpha[:, i, :, None, None] * S + k[:, i][..., :, None] * v[:, i][..., None, :]
    z = z + k[:, i]
    o = jnp.einsum("bnkv,bnk->bnv", S, q[:, i]) * H ** -0.5
    if layer.kind == "linear":
      o = o / (jnp.einsum("bnk,bnk->bn", z, q[:, i])[..., None] * H ** -0.5)
    outs.append(o)
  o = jnp.stack(outs, axis=1)
  return _finish_by_hand(layer, o, x)


@pytest.mark.parametrize("kind", ["simple_gla", pytest.param("linear", marks=pytest.mark.slow)])
def test_layer_matches_the_written_out_recurrence_forward_and_backward(kind):
  check_against_reference(_layer(kind), _written_out, _x(seed=3))


def check_against_reference(layer, written_out, x):
  """``layer(x)`` and its gradients (in the parameters and in ``x``) against
  ``written_out(layer, x)``, the layer in plain jnp: equal, and the gradients finite."""
  graphdef, params = nnx.split(layer)
  got = _forward(layer, x)
  reference = jax.jit(lambda p, x: written_out(nnx.merge(graphdef, p), x))
  np.testing.assert_allclose(got, reference(params, x), rtol=2e-4, atol=2e-5)
  ct = jax.random.normal(jax.random.key(2), got.shape)
  grad = jax.jit(jax.grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) * ct), argnums=(0, 1)))
  ref = jax.jit(jax.grad(lambda p, x: jnp.sum(reference(p, x) * ct), argnums=(0, 1)))
  for a, b in zip(jax.tree.leaves(grad(params, x)), jax.tree.leaves(ref(params, x)), strict=True):
    assert bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5)


def _by_hand(layer, x):
  """A layer of the kinds ttt_linear, ccq, softmax_linear_attention, native_hybrid and
  interdomain from its parameters: projections, conv, SiLU, the gates written out from the
  module docstring, the js.linear function in its recurrent form, RMSNorm, output gate."""
  p = _value
  b, t, _ = x.shape
  q, k, v = _qkv_by_hand(layer, x)
  rec = dict(implementation="recurrent")
  if layer.kind in ("ccq", "softmax_linear_attention"):
    g = jax.nn.log_sigmoid(x @ p(layer.gk.kernel) + p(layer.gk.bias)[None, None, :]) / 16
  if layer.kind == "ttt_linear":
    eta = jax.nn.sigmoid(x @ p(layer.eta.kernel))
    o = js_linear.ttt_linear(q, k, v, eta, mini_batch_size=layer.mini_batch_size, **rec)
  elif layer.kind == "ccq":
    o = js_linear.ccq(q, k, v, g, strength=layer.strength, **rec)
  elif layer.kind == "softmax_linear_attention":
    gates = x @ p(layer.head_gate.kernel)
    o = js_linear.softmax_linear_attention(q, k, v, gates[..., :N], gates[..., N:], g=g, **rec)
  elif layer.kind == "native_hybrid":
    a = jax.nn.log_sigmoid(x @ p(layer.slots.kernel) + p(layer.slots.bias)[None, None]) / 16
    o = js_linear.native_hybrid_attention(q, k, v, a.reshape(b, t, N, -1), window=layer.window,
                                          **rec)
  else:
    basis = (x @ p(layer.basis.kernel)).reshape(b, t, 2, N, -1)
    o = js_linear.interdomain_attention(q, k, v, basis[:, :, 0], basis[:, :, 1],
                                        -jnp.exp(p(layer.basis_log_rate)), **rec)
  return _finish_by_hand(layer, o, x)


@pytest.mark.parametrize("kind", ["softmax_linear_attention", *(
    pytest.param(k, marks=pytest.mark.slow) for k in ("ttt_linear", "ccq", "native_hybrid",
                                                       "interdomain"))])
def test_new_kinds_match_their_gates_written_out(kind):
  layer = _layer(kind)
  x = _x(seed=5)
  graphdef, params = nnx.split(layer)
  reference = jax.jit(lambda p, x: _by_hand(nnx.merge(graphdef, p), x))
  np.testing.assert_allclose(_forward(layer, x), reference(params, x), rtol=2e-4, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gated_delta_rule", "ttt_linear", "ccq", "softmax_linear_attention",
                                  "native_hybrid", "interdomain"])
def test_gradients_are_finite_and_reach_every_parameter(kind):
  layer = _layer(kind)
  graphdef, params = nnx.split(layer)
  grads = jax.jit(jax.grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)))(params, _x())
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert bool(jnp.all(jnp.isfinite(g))), path
    assert float(jnp.max(jnp.abs(g))) > 0, path


@pytest.mark.parametrize("kind", ["gated_delta_rule", pytest.param("gla", marks=pytest.mark.slow)])
def test_bf16_layer_is_finite_and_close_to_float32(kind):
  x = _x()
  a32 = _forward(_layer(kind), x)
  a16 = _forward(_layer(kind, dtype=jnp.bfloat16), x.astype(jnp.bfloat16))
  assert a16.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(a16)))
  err = float(jnp.max(jnp.abs(a16.astype(jnp.float32) - a32)))
  assert err < 0.05 * float(jnp.max(jnp.abs(a32))) + 0.02, err


def test_named_classes_are_their_kinds():
  for cls, kind in ((js_nn.GatedDeltaNet, "gated_delta_rule"), (js_nn.DeltaNet, "delta_rule"),
                    (js_nn.GLA, "gla"), (js_nn.SimpleGLA, "simple_gla"),
                    (js_nn.LightningAttention, "lightning_attention"),
                    (js_nn.LinearAttention, "linear")):
    layer = nnx.eval_shape(lambda cls=cls: cls(D, N, rngs=nnx.Rngs(0)))
    assert layer.kind == kind and layer.head_dim == D // N


def test_bad_input_raises_value_error_naming_the_argument():
  rngs = nnx.Rngs(0)
  layer = _layer("simple_gla")
  state = layer.init_state(B)
  check_raises(
      ("`kind`", lambda: js_nn.LinearMixer("mamba", D, N, rngs=rngs)),
      ("`d_model`", lambda: js_nn.GLA(0, N, rngs=rngs)),
      ("`num_heads`", lambda: js_nn.GLA(D, 3, rngs=rngs)),
      ("`conv_size`", lambda: js_nn.GLA(D, N, conv_size=0, rngs=rngs)),
      ("`feature_map`", lambda: js_nn.LinearAttention(D, N, feature_map="nope", rngs=rngs)),
      ("`implementation`", lambda: js_nn.GLA(D, N, implementation="fast", rngs=rngs)),
      ("`implementation`", lambda: js_nn.LinearMixer("ttt_linear", D, N, implementation="parallel",
                                                     rngs=rngs)),
      ("`mini_batch_size`", lambda: js_nn.GLA(D, N, mini_batch_size=0, rngs=rngs)),
      ("`strength`", lambda: js_nn.GLA(D, N, strength=-1.0, rngs=rngs)),
      ("`num_slots`", lambda: js_nn.GLA(D, N, num_slots=0, rngs=rngs)),
      ("`window`", lambda: js_nn.GLA(D, N, window=0, rngs=rngs)),
      ("`dtype`", lambda: js_nn.GLA(D, N, dtype=jnp.int32, rngs=rngs)),
      ("`x`", lambda: layer(jnp.zeros((B, T, D + 1)))),
      ("`x`", lambda: layer(jnp.zeros((B, T, D), jnp.int32))),
      ("`x`", lambda: layer.step(jnp.zeros((B, 1, D)), state)),
      ("`state`", lambda: layer.step(jnp.zeros((B, D)), {"conv": state["conv"]})),
      ("`batch`", lambda: layer.init_state(0)),
      ("`noise`", lambda: js_nn.HedgehogFeatureMap(N, H, noise=-1.0)),
      ("`head_dim`", lambda: js_nn.HedgehogFeatureMap(N, 0)),
  )


# ------------------------------------------------------------------------------- Hedgehog


def _np_hedgehog(W, b, x):
  z = np.einsum("...nk,nkf->...nf", x, W) + b
  sm = lambda a: np.exp(a - a.max(-1, keepdims=True)) / np.exp(a - a.max(-1, keepdims=True)).sum(  # noqa: E731
      -1, keepdims=True)
  return np.concatenate([sm(z), sm(-z)], axis=-1)


def _np_attention_kl(W, b, q, k):
  """Mean over (b, n, i) of KL(softmax attention row || Hedgehog linear-attention row)."""
  t, kd = q.shape[1], q.shape[-1]
  causal = np.tril(np.ones((t, t), bool))
  s = np.einsum("btnk,bsnk->bnts", q, k) * kd ** -0.5
  s = np.where(causal, s, -np.inf)
  teacher = np.exp(s - s.max(-1, keepdims=True))
  teacher /= teacher.sum(-1, keepdims=True)
  fs = np.einsum("btnf,bsnf->bnts", _np_hedgehog(W, b, q), _np_hedgehog(W, b, k))
  fs = np.where(causal, fs, 0.0)
  student = fs / fs.sum(-1, keepdims=True)
  with np.errstate(divide="ignore", invalid="ignore"):
    terms = np.where(causal, teacher * (np.log(teacher) - np.log(student)), 0.0)
  return float(terms.sum(-1).mean())


def test_hedgehog_module_features_match_numpy():
  fmap = _jit_init(lambda: js_nn.HedgehogFeatureMap(N, H, 3, noise=0.3, rngs=nnx.Rngs(0)))
  x = np.asarray(helpers.standard_normal(0, (B, T, N, H)), np.float64)
  W, b = np.asarray(fmap.W[...], np.float64), np.asarray(fmap.b[...], np.float64)
  assert W.shape == (N, H, 3) and float(np.abs(W - np.eye(H, 3)).max()) > 0  # noised
  call = nnx.jit(lambda m, x: m(x))
  np.testing.assert_allclose(call(fmap, jnp.asarray(x, jnp.float32)), _np_hedgehog(W, b, x),
                             rtol=1e-5, atol=1e-6)
  low = call(fmap, jnp.asarray(x, jnp.bfloat16))
  assert low.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(low)))
  assert bool(jnp.all(jnp.isfinite(call(fmap, jnp.asarray(x * 1e4, jnp.float32)))))


def test_a_few_distillation_steps_lower_the_attention_map_kl():
  q = helpers.standard_normal(4, (2, 8, N, H)) * 2.0
  k = helpers.standard_normal(5, (2, 8, N, H)) * 2.0
  fmap = js_nn.HedgehogFeatureMap(N, H, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(fmap)
  opt = optax.adam(0.05)
  opt_state = opt.init(params)

  @jax.jit
  def update(params, opt_state):
    loss, grads = jax.value_and_grad(
        lambda p: nnx.merge(graphdef, p).distillation_loss(q, k))(params)
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  def kl(params):
    m = nnx.merge(graphdef, params)
    return _np_attention_kl(np.asarray(m.W[...], np.float64), np.asarray(m.b[...], np.float64),
                            np.asarray(q, np.float64), np.asarray(k, np.float64))

  before = kl(params)
  losses = []
  for _ in range(20):
    params, opt_state, loss = update(params, opt_state)
    losses.append(float(loss))
  after = kl(params)
  assert np.all(np.isfinite(losses))
  assert after < 0.8 * before, (before, after)


def test_linear_attention_owns_a_hedgehog_feature_map_and_decodes():
  def build():
    rngs = nnx.Rngs(0)
    return js_nn.LinearAttention(D, N, H, conv_size=3,
                                 feature_map=js_nn.HedgehogFeatureMap(N, H, rngs=rngs), rngs=rngs)
  layer = _jit_init(build)
  x = _x()
  np.testing.assert_allclose(_decode(layer, x), _forward(layer, x), rtol=2e-4, atol=2e-5)
  assert bool(jnp.all(jnp.isfinite(_forward(layer, x * 1e4))))
  graphdef, params = nnx.split(layer)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)))(params)
  gW = grads["feature_map"]["W"][...]
  assert bool(jnp.all(jnp.isfinite(gW))) and float(jnp.max(jnp.abs(gW))) > 0


@pytest.mark.parametrize("width", [3, 4])
def test_causal_conv_matches_a_numpy_loop_and_its_step_form(width):
  rng = np.random.default_rng(0)
  u, w = rng.standard_normal((2, 7, 3)), rng.standard_normal((width, 3))
  expected = np.zeros_like(u)
  for t in range(7):
    for i in range(width):
      if t - width + 1 + i >= 0:
        expected[:, t] += w[i] * u[:, t - width + 1 + i]
  got = js_nn.causal_conv(jnp.asarray(u, jnp.float32), jnp.asarray(w, jnp.float32))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  window = jnp.zeros((2, width - 1, 3), jnp.float32)
  for t in range(7):
    y, window = js_nn.causal_conv_step(jnp.asarray(u[:, t], jnp.float32),
                                       jnp.asarray(w, jnp.float32), window)
    np.testing.assert_allclose(y, expected[:, t], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- the table


def test_the_kinds_are_the_tables_rows_each_with_a_forward_and_a_step():
  table = js_nn.LINEAR_MIXER_TABLE
  assert js_nn.LINEAR_MIXER_KINDS == tuple(table)
  for kind, row in table.items():
    assert isinstance(row, js_nn.LinearKind) and row.title and callable(row.forward), kind
    assert row.direction in ("causal", "bidirectional", "either"), kind
    # decoding exactly when the kind has a causal form; a bidirectional kind says why
    assert (row.step is not None) == (row.direction != "bidirectional"), kind
    assert bool(row.why_bidirectional) == (row.direction == "bidirectional"), kind
    assert set(row.implementations) <= set(js_linear.IMPLEMENTATIONS), kind
    assert set(row.feature_maps) <= {*js_linear.FEATURE_MAPS, "favor"}, kind
  with pytest.raises(TypeError):  # read-only: a kind is a row of the table's source
    table["new"] = table["gla"]  # type: ignore[index]


def test_each_kind_owns_the_parameters_of_its_parts_and_nothing_else():
  shared = {"qkv", "o", "gate", "o_norm", "conv"}
  for kind, row in js_nn.LINEAR_MIXER_TABLE.items():
    layer = nnx.eval_shape(lambda kind=kind: js_nn.LinearMixer(kind, D, N, rngs=nnx.Rngs(0)))
    owned = {path[0] for path, _ in nnx.to_flat_state(nnx.state(layer))}
    built = {name for part in row.parts for name in part.build(layer, nnx.Rngs(0))}
    assert owned == shared | built, kind
