"""LinearMixer(kind="mhla") and LinearMixer(kind="rala") (jaxsoft/nn/_linear.py).

Oracles: each layer written out in plain jnp from its parameters (projections, causal
depthwise convolution, SiLU, elu + 1 features, the T x T weights of MHLA built from the block
matrix C by repetition, RALA's key weights and sums, per-head RMSNorm, the output gate, the
output projection), with no jaxsoft call; "one-token decoding = the full forward" for MHLA;
MHLA's parallel and chunked forms against each other (values and gradients).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft import linear as js_linear
from jaxsoft import nn as js_nn
from tests.helpers import check_raises
from tests.nn.test_linear_modules import (
  B,
  D,
  H,
  N,
  _decode,
  _finish_by_hand,
  _forward,
  _jit_init,
  _qkv_by_hand,
  _value,
  _x,
)

BLOCK, MAX_LEN, T7 = 3, 16.0, 7  # M_max = 6 blocks; T = 7 uses 3 of them, the last one partial


def _mhla(causal=True, implementation=None, random_mixing=True):
  layer = _jit_init(lambda: js_nn.LinearMixer(
      "mhla", D, N, H, conv_size=3, max_len=MAX_LEN, block_size=BLOCK, causal=causal,
      implementation=implementation, rngs=nnx.Rngs(0)))
  if random_mixing:  # away from the all-ones start, so that C matters
    layer.mixing[...] = jax.random.uniform(jax.random.key(7), layer.mixing.shape, jnp.float32,
                                           0.2, 2.0)
  return layer


def _rala():
  return _jit_init(lambda: js_nn.LinearMixer("rala", D, N, H, conv_size=3, rngs=nnx.Rngs(0)))


def _phi(x):
  return jnp.where(x > 0, x + 1.0, jnp.exp(x))  # elu + 1


def _mhla_by_hand(layer, x):
  """MHLA's layer from its parameters: o_t = sum_s c_{b(t) b(s)} phi(q_t).phi(k_s) v_s / (the
  same without v_s), over s <= t when causal, C expanded to tokens by repeating its entries."""
  t = x.shape[1]
  q, k, v = _qkv_by_hand(layer, x)
  fq, fk = _phi(q), _phi(k)
  m = -(-t // BLOCK)
  C = _value(layer.mixing)[:, :m, :m]
  coef = jnp.repeat(jnp.repeat(C, BLOCK, axis=1), BLOCK, axis=2)[:, :t, :t]   # [N, T, T]
  w = jnp.einsum("btnk,bsnk->bnts", fq, fk) * coef[None]
  if layer.causal:
    w = w * np.tril(np.ones((t, t)))[None, None]
  o = jnp.einsum("bnts,bsnv->btnv", w, v) / jnp.moveaxis(jnp.sum(w, -1), 1, 2)[..., None]
  return _finish_by_hand(layer, o, x)


def _rala_by_hand(layer, x):
  """RALA's layer from its parameters: alpha_j = T softmax_j(mean_t(q_t).k_j / sqrt(H)),
  y_i = phi(q_i).sum_j alpha_j phi(k_j) v_j / phi(q_i).sum_j alpha_j phi(k_j), RMSNorm,
  times the linear gate x W_g, output projection."""
  b, t, _ = x.shape
  q, k, v = _qkv_by_hand(layer, x)
  s = jnp.einsum("bnk,btnk->btn", jnp.mean(q, axis=1), k) / np.sqrt(H)
  alpha = t * jnp.exp(s) / jnp.sum(jnp.exp(s), axis=1, keepdims=True)
  fq, fk = _phi(q), alpha[..., None] * _phi(k)
  o = (jnp.einsum("btnk,bsnk,bsnv->btnv", fq, fk, v)
       / jnp.einsum("btnk,bsnk->btn", fq, fk)[..., None])
  o = (o / jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + 1e-6)
       * _value(layer.o_norm)[None, None, None, :])
  o = o.reshape(b, t, N * H) * (x @ _value(layer.gate.kernel))
  return o @ _value(layer.o.kernel)


def _value_and_grads(fn, params, x, ct):
  """(fn(params, x), d<fn, ct>/d(params, x)), one jit."""
  def loss(p, x):
    out = fn(p, x)
    return jnp.sum(out * ct), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, grads


def _assert_grads_close(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5)


def test_mhla_layer_matches_the_written_out_layer_and_its_two_forms_agree_with_gradients():
  x = _x(seed=3, t=T7)
  ct = jax.random.normal(jax.random.key(2), x.shape)
  graphdef, params = nnx.split(_mhla())
  want = jax.jit(lambda p, x: _mhla_by_hand(nnx.merge(graphdef, p), x))(params, x)
  results = {}
  for impl in ("parallel", "chunked"):
    impl_graphdef, impl_params = nnx.split(_mhla(implementation=impl))
    results[impl] = _value_and_grads(lambda p, x, g=impl_graphdef: nnx.merge(g, p)(x),
                                     impl_params, x, ct)
    np.testing.assert_allclose(results[impl][0], want, rtol=2e-4, atol=2e-5)
  _assert_grads_close(results["chunked"][1], results["parallel"][1])
  for _, grads in results.values():
    g_mixing = grads[0]["mixing"][...]
    # the blocks the input reaches get gradient, the causal upper triangle and the blocks
    # past T none
    assert float(jnp.min(jnp.abs(g_mixing[:, 1, :2]))) > 0
    np.testing.assert_array_equal(g_mixing[:, 0, 1:], 0.0)
    np.testing.assert_array_equal(g_mixing[:, 3:], 0.0)


@pytest.mark.slow
def test_mhla_at_initialisation_is_the_linear_attention_layer():
  x = _x(seed=4, t=T7)
  start = _mhla(random_mixing=False)
  np.testing.assert_array_equal(start.mixing[...][0], np.tril(np.ones((6, 6))))
  linear = _jit_init(lambda: js_nn.LinearMixer("linear", D, N, H, conv_size=3, rngs=nnx.Rngs(0)))
  for a, b in ((start.conv, linear.conv), *((getattr(start, name).kernel,
                                             getattr(linear, name).kernel)
                                            for name in ("qkv", "gate", "o"))):
    np.testing.assert_array_equal(_value(a), _value(b))  # the same random streams
  np.testing.assert_allclose(_forward(start, x), _forward(linear, x), rtol=2e-4, atol=2e-5)


def test_bidirectional_mhla_matches_the_written_out_layer_and_sees_the_future():
  layer = _mhla(causal=False)
  assert float(jnp.min(layer.mixing[...])) > 0
  graphdef, params = nnx.split(layer)
  x = _x(seed=5, t=T7)
  reference = jax.jit(lambda p, x: _mhla_by_hand(nnx.merge(graphdef, p), x))
  got = _forward(layer, x)
  np.testing.assert_allclose(got, reference(params, x), rtol=2e-4, atol=2e-5)
  later = _forward(layer, x.at[:, -1].add(1.0))
  assert float(jnp.max(jnp.abs(later[:, 0] - got[:, 0]))) > 1e-4


def test_mhla_one_token_decoding_equals_the_full_forward():
  layer = _mhla()
  x = _x(seed=6, t=T7)
  full = _forward(layer, x)
  np.testing.assert_allclose(_decode(layer, x), full, rtol=2e-4, atol=2e-5)
  state = layer.init_state(B)["state"]  # the M_max block summaries with z as a last column
  assert state.shape == (B, N, 6, H, H + 1)
  huge = x * 1e4
  assert bool(jnp.all(jnp.isfinite(_forward(layer, huge))))
  assert bool(jnp.all(jnp.isfinite(_decode(layer, huge))))


@pytest.mark.slow
def test_mhla_step_with_per_sequence_positions_equals_mhla():
  """The function itself, with sequences at different positions in one batch."""
  ks = jax.random.split(jax.random.key(8), 4)
  q, k, v = (jax.random.normal(key, (2, T7, N, H)) for key in ks[:3])
  C = jax.random.uniform(ks[3], (6, 6), jnp.float32, 0.2, 2.0)
  full = js_linear.mhla(q, k, v, C[:3, :3], block_size=BLOCK)

  @jax.jit
  def decode(q, k, v):  # sequence 1 starts two tokens after sequence 0
    state, out0, out1 = None, [], []
    for t in range(T7 + 2):
      t0, t1 = min(t, T7 - 1), max(t - 2, 0)
      if t == 2:
        state = state.at[1].set(0.0)
      o, state = js_linear.mhla_step(*(jnp.stack([a[0, t0], a[1, t1]]) for a in (q, k, v)), C,
                                     state, position=jnp.array([t0, t1]), block_size=BLOCK)
      if t < T7:
        out0.append(o[0])
      if t >= 2:
        out1.append(o[1])
    return jnp.stack(out0), jnp.stack(out1)

  out0, out1 = decode(q, k, v)
  np.testing.assert_allclose(out0, full[0], rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(out1, full[1], rtol=2e-5, atol=2e-6)
  # a traced position outside [0, M b) gives NaN, not a silently wrong value
  outside = jax.jit(lambda p: js_linear.mhla_step(q[:, 0], k[:, 0], v[:, 0], C, position=p,
                                                  block_size=BLOCK)[0])(jnp.array([-1, 18]))
  assert bool(jnp.all(jnp.isnan(outside)))


def test_rala_layer_matches_the_written_out_layer_forward_and_backward():
  layer = _rala()
  assert not layer.causal
  graphdef, params = nnx.split(layer)
  x = _x(seed=9, t=T7)
  ct = jax.random.normal(jax.random.key(2), x.shape)
  got, grads = _value_and_grads(lambda p, x: nnx.merge(graphdef, p)(x), params, x, ct)
  want, want_grads = _value_and_grads(lambda p, x: _rala_by_hand(nnx.merge(graphdef, p), x),
                                      params, x, ct)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
  _assert_grads_close(grads, want_grads)
  assert float(jnp.min(jnp.abs(grads[0]["gate"]["kernel"][...]))) > 0
  # bidirectional: the last token moves the first output
  later = _forward(layer, x.at[:, -1].add(1.0))
  assert float(jnp.max(jnp.abs(later[:, 0] - got[:, 0]))) > 1e-4


def test_bad_input_raises_value_error_naming_the_argument_or_the_kind():
  rngs = nnx.Rngs(0)
  mhla = _mhla()
  rala = _rala()
  bidirectional = _mhla(causal=False)
  mixer = js_nn.LinearMixer
  one = jnp.zeros((1, N, H))
  C = jnp.ones((2, 2))
  check_raises(
      ("'rala' is bidirectional", lambda: mixer("rala", D, N, causal=True, rngs=rngs)),
      ("kind 'rala' with causal=False", lambda: rala.init_state(B)),
      ("kind 'rala' with causal=False", lambda: rala.step(jnp.zeros((B, D)), {
          "conv": None, "state": None, "position": 0})),
      ("kind 'mhla' with causal=False", lambda: bidirectional.init_state(B)),
      ("`causal`", lambda: mixer("gla", D, N, causal=False, rngs=rngs)),
      ("`causal`", lambda: mixer("mhla", D, N, causal="yes", rngs=rngs)),
      ("`implementation`", lambda: mixer("mhla", D, N, implementation="recurrent", rngs=rngs)),
      ("`implementation`", lambda: mixer("rala", D, N, implementation="chunked", rngs=rngs)),
      ("`block_size`", lambda: mixer("mhla", D, N, block_size=0, rngs=rngs)),
      ("`feature_map`", lambda: mixer("rala", D, N, feature_map="favor", rngs=rngs)),
      ("`x` has T = 19", lambda: mhla(jnp.zeros((B, 19, D)))),
      ("`x`", lambda: rala(jnp.zeros((B, T7, D + 1)))),
      ("`position`", lambda: js_linear.mhla_step(one, one, one, C, position=4, block_size=2)),
      ("`position`", lambda: js_linear.mhla_step(one, one, one, C, position=0.5, block_size=2)),
      ("`mixing`", lambda: js_linear.mhla_step(one, one, one, jnp.ones((2, 3)), position=0,
                                               block_size=2)),
      ("`state`", lambda: js_linear.mhla_step(one, one, one, C, jnp.zeros((1, N, 2, H, H)),
                                              position=0, block_size=2)),
      ("`block_size`", lambda: js_linear.mhla_step(one, one, one, C, position=0, block_size=0)),
  )


@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 3, 5, 18])
def test_mhla_decoding_and_both_forms_agree_at_other_lengths(t):
  layer = _mhla()
  x = _x(seed=t, t=t)
  full = _forward(layer, x)
  np.testing.assert_allclose(_decode(layer, x), full, rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(_forward(_mhla(implementation="parallel"), x), full, rtol=2e-4,
                             atol=2e-5)
