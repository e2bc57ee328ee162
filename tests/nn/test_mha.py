"""Tests of jaxsoft.nn.MultiHeadAttention: equals Flax's layer, every variant option runs
under jit and grad, learned parameters stay in range, and each option computes its formula
(checked against references written here from the layer's own projections)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft.nn import MultiHeadAttention, param_transform
from jaxsoft.normalizers import get
from tests.helpers import BWD, FWD, normal

D, N, T = 8, 4, 5


def _copy_projections(src, dst):
  for name in ("query", "key", "value", "out"):
    for p in ("kernel", "bias"):
      getattr(getattr(dst, name), p).value = getattr(getattr(src, name), p).value


def _reference(module, x, weights_fn):
  """out(sum_j w_ij v_j) with w = weights_fn(logits [B, N, T, S], causal visibility)."""
  q, k, v = module.query(x), module.key(x), module.value(x)
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
  visible = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))
  w = jnp.where(visible, weights_fn(jnp.where(visible, logits, -jnp.inf)), 0.0)
  return jnp.einsum("bnts,bsnh->btnh", w, v)


def _softmax(z):
  return jax.nn.softmax(z, axis=-1)


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_plain_layer_equals_flax(num_kv_heads):
  x = normal(0, (2, T, D))
  ct = normal(1, (2, T, D))
  ref = nnx.MultiHeadAttention(N, D, num_kv_heads=num_kv_heads, decode=False, rngs=nnx.Rngs(0))
  mine = MultiHeadAttention(N, D, num_kv_heads=num_kv_heads, rngs=nnx.Rngs(1))
  _copy_projections(ref, mine)

  @nnx.jit  # one compilation per layer instead of one per eager operation
  def run(m, x):
    out, vjp = jax.vjp(lambda x: m(x, is_causal=True), x)
    return out, vjp(ct)

  (out_m, dx_m), (out_r, dx_r) = run(mine, x), run(ref, x)
  chex.assert_trees_all_close(out_m, out_r, **FWD)
  chex.assert_trees_all_close(dx_m, dx_r, **BWD)


OPTIONS = {
    "temperature": dict(learned=("temperature",)),
    "sink": dict(sink=True),
    "ssmax_s": dict(normalizer="ssmax", learned=("s",)),
    "entmax_alpha": dict(normalizer="entmax", learned=("alpha",)),
    "sparsemax": dict(normalizer="sparsemax"),
    "gated": dict(gated=True),
    "forget_gate": dict(forget_gate=True),
    "forget_gate_acp": dict(forget_gate=True, forget_prune_threshold=-12.0,
                            implementation="xla_chunked"),
    "gqa_chunked": dict(num_kv_heads=2, implementation="xla_chunked"),
    "dropout": dict(dropout_rate=0.3),
}
# The parameters each option adds, which must receive a gradient.
OWN_PARAMS = {
    "temperature": ["temperature"], "sink": ["sink_logit"], "ssmax_s": ["s"],
    "entmax_alpha": ["alpha"], "gated": ["gate_kernel", "gate_bias"],
    "forget_gate": ["forget_kernel", "forget_bias"],
    "forget_gate_acp": ["forget_kernel", "forget_bias"],
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_option_runs_jitted_and_differentiable(option):
  m = MultiHeadAttention(N, D, rngs=nnx.Rngs(0, dropout=1), **OPTIONS[option])
  x = normal(2, (2, T, D), 2.0)
  ct = normal(3, (2, T, D))

  @nnx.jit
  def step(m, x):
    def loss(m):
      return jnp.sum(m(x, is_causal=True, deterministic=False) * ct)
    return nnx.value_and_grad(loss)(m)

  value, grads = step(m, x)
  chex.assert_tree_all_finite((value, jax.tree.leaves(grads)))
  flat = dict(nnx.to_flat_state(grads))
  for name in OWN_PARAMS.get(option, []):
    keys = [k for k in flat if name in k]
    assert keys, (name, list(flat))
    for key in keys:
      g = np.asarray(flat[key].value)
      if g.shape == (N,):  # a per-head parameter: every head gets a gradient
        assert np.all(np.abs(g) > 0), (key, g)
      else:
        assert np.any(np.abs(g) > 0), (key, g)


LEARNED = [("softmax", "temperature"), ("ssmax", "s"), ("entmax", "alpha"),
           ("softmax_sink", "sink_logit")]


@pytest.mark.parametrize("normalizer,name", LEARNED)
def test_learned_params_start_at_default_and_stay_in_range(normalizer, name):
  m = MultiHeadAttention(N, D, normalizer=normalizer, learned=(name,), rngs=nnx.Rngs(0))
  p = get(normalizer).param(name)
  chex.assert_trees_all_close(m.normalizer_values()[name], jnp.full((N,), p.default), rtol=1e-5)
  x = normal(4, (1, T, D))
  forward = nnx.jit(lambda m, x: m(x, is_causal=True))  # compiled once, not op by op
  for big in (-1e4, -60.0, 60.0, 1e4):  # the result of a huge optimizer step
    m.normalizer_free[name].value = jnp.full((N,), big)
    val = np.asarray(m.normalizer_values()[name])
    assert np.all(np.isfinite(val))
    if p.low is not None:
      assert np.all(val > p.low) if p.low_open else np.all(val >= p.low)
    if p.high is not None:
      assert np.all(val < p.high) if p.high_open else np.all(val <= p.high)
    chex.assert_tree_all_finite(forward(m, x))


def test_param_transforms_follow_the_declared_ranges():
  alpha = get("entmax").param("alpha")
  to_range, from_range = param_transform(alpha)
  z = jnp.array([-3.0, 0.0, 2.0])
  if alpha.high is None:  # alpha = 1 + softplus(z) (plus the open-bound margin)
    chex.assert_trees_all_close(to_range(z), 1.0 + 1e-3 + jax.nn.softplus(z), rtol=1e-6)
  chex.assert_trees_all_close(from_range(to_range(z)), z, atol=1e-4)
  s_to, _ = param_transform(get("ssmax").param("s"))
  chex.assert_trees_all_close(s_to(z), jax.nn.softplus(z), rtol=1e-6)  # s = softplus(z)
  sink_to, _ = param_transform(get("softmax_sink").param("sink_logit"))
  chex.assert_trees_all_close(sink_to(z), z)  # sinks: free


def test_sink_matches_reference():
  m = MultiHeadAttention(N, D, sink=True, rngs=nnx.Rngs(0))
  sink = jnp.array([-2.0, 0.0, 0.7, 3.0])
  m.normalizer_free["sink_logit"].value = sink
  x = normal(5, (2, T, D))

  def with_sink(z):
    extra = jnp.broadcast_to(sink[:, None, None], z.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([z, extra], axis=-1), axis=-1)[..., :-1]

  chex.assert_trees_all_close(m(x, is_causal=True), m.out(_reference(m, x, with_sink)), **FWD)


def test_learned_temperature_matches_reference():
  m = MultiHeadAttention(N, D, learned=("temperature",), rngs=nnx.Rngs(0))
  to_range, from_range = param_transform(get("softmax").param("temperature"))
  temps = jnp.array([0.5, 1.0, 2.0, 4.0])
  m.normalizer_free["temperature"].value = from_range(temps)
  x = normal(6, (2, T, D))
  want = m.out(_reference(m, x, lambda z: _softmax(z / temps[None, :, None, None])))
  chex.assert_trees_all_close(m(x, is_causal=True), want, **FWD)


def test_gate_scales_head_outputs():
  x = normal(7, (2, T, D))
  plain = MultiHeadAttention(N, D, rngs=nnx.Rngs(0))
  gated = MultiHeadAttention(N, D, gated=True, rngs=nnx.Rngs(1))
  _copy_projections(plain, gated)
  y = _reference(plain, x, _softmax)
  # gate = sigmoid(x W + b): per head and feature, from the layer input
  w, b = normal(8, (D, N, D // N)), normal(9, (N, D // N))
  gated.gate_kernel.value, gated.gate_bias.value = w, b
  gate = jax.nn.sigmoid(jnp.einsum("btd,dnh->btnh", x, w) + b[None, None])
  chex.assert_trees_all_close(gated(x, is_causal=True), plain.out(y * gate), **FWD)


def test_forget_gate_matches_explicit_decay():
  m = MultiHeadAttention(N, D, forget_gate=True, rngs=nnx.Rngs(0))
  m.forget_bias.value = jnp.array([-1.0, 0.0, 1.0, 3.0])
  x = normal(10, (2, T, D))
  log_f = jax.nn.log_sigmoid(x @ m.forget_kernel.value + m.forget_bias.value[None, None])  # [B, T, N]
  terms = np.zeros((T, T, T), np.float32)  # D_ij = sum_{l=j+1}^{i} log f_l
  for i in range(T):
    for j in range(i + 1):
      terms[i, j, j + 1:i + 1] = 1.0
  decay = jnp.einsum("btn,ijt->bnij", log_f, terms)
  want = m.out(_reference(m, x, lambda z: _softmax(z + decay)))
  chex.assert_trees_all_close(m(x), want, **FWD)  # forget gates make the call causal


def test_forget_gate_open_is_plain_causal():
  x = normal(11, (2, T, D))
  plain = MultiHeadAttention(N, D, rngs=nnx.Rngs(0))
  fox = MultiHeadAttention(N, D, forget_gate=True, forget_bias_init=40.0, rngs=nnx.Rngs(1))
  _copy_projections(plain, fox)
  fox.forget_kernel.value = jnp.zeros_like(fox.forget_kernel.value)
  chex.assert_trees_all_close(fox(x), plain(x, is_causal=True), **FWD)


def test_sow_weights_and_batch_dims():
  m = MultiHeadAttention(N, D, normalizer="sparsemax", rngs=nnx.Rngs(0))
  x = normal(12, (2, 3, T, D), 3.0)
  out = m(x, is_causal=True, sow_weights=True)
  assert out.shape == (2, 3, T, D)
  (w,) = jax.tree.leaves(nnx.pop(m, nnx.Intermediate))
  assert w.shape == (2, 3, N, T, T)
  chex.assert_trees_all_close(jnp.sum(w, -1), jnp.ones((2, 3, N, T)), atol=1e-5)
  assert np.all(np.asarray(jnp.triu(w, 1)) == 0)  # causal
  chex.assert_trees_all_close(out, m(x, is_causal=True), **FWD)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(learned=("alpha",)), "learned"),
    (dict(normalizer="sparsemax", sink=True), "sink"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(qkv_features=6), "qkv_features"),
    (dict(forget_prune_threshold=-10.0), "forget_prune_threshold"),
    (dict(forget_gate=True, forget_prune_threshold=0.5), "forget_prune_threshold"),
    (dict(normalizer_params={"temperature": 2.0}, learned=("temperature",)), "learned"),
    (dict(normalizer_params={"temperature": -2.0}), "temperature"),
    (dict(dropout_rate=1.0), "dropout_rate"),
])
def test_bad_options_raise_errors_naming_them(kwargs, arg):
  with pytest.raises(ValueError, match=arg):
    MultiHeadAttention(N, D, rngs=nnx.Rngs(0), **kwargs)


def test_bad_calls_raise_errors_naming_them():
  m = MultiHeadAttention(N, D, forget_gate=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="inputs_q"):
    m(jnp.ones((2, T, D + 1)))
  with pytest.raises(ValueError, match="forget_gate"):
    m(jnp.ones((2, T, D)), jnp.ones((2, T + 1, D)))
  with pytest.raises(KeyError, match="nope"):
    MultiHeadAttention(N, D, normalizer="nope", rngs=nnx.Rngs(0))
