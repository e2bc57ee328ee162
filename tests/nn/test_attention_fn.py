"""Tests of jaxsoft.nn.attention_fn inside flax.nnx.MultiHeadAttention, and attention_weights.

The oracle for softmax is Flax itself (the module's default attention_fn, same parameters,
same dropout draws); other normalizers are checked against references written here from
the module's own projections (jax.nn, optax's simplex projection).
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsoft as js
from jaxsoft.nn import attention_fn, attention_weights
from tests.helpers import BWD, FWD, normal

D, N = 8, 4


def _pair(fn=None, num_kv_heads=None, dropout_rate=0.0, broadcast_dropout=True, seed=0):
  """Two nnx.MultiHeadAttention with identical parameters: Flax's default and ``fn``."""
  def make(**kw):
    return nnx.MultiHeadAttention(
        N, D, num_kv_heads=num_kv_heads, decode=False, dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout, rngs=nnx.Rngs(seed, dropout=seed + 1), **kw)
  ref = make()
  mine = make(attention_fn=fn if fn is not None else attention_fn())
  return ref, mine


def _out_and_param_grads(module, x, ct, **call_kw):
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def loss(params):
    m = nnx.merge(graphdef, params, rest)
    out = m(x, **call_kw)
    return jnp.sum(out * ct), out

  # jitted: one compilation instead of one per eager operation
  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return out, jax.tree.leaves(grads)


def _jit_call(module, x, **call_kw):
  """``module(x, **call_kw)`` in one compilation (state changes such as sown weights are
  not kept)."""
  graphdef, state = nnx.split(module)
  return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, **call_kw))(state, x)


def _key_padding_mask(b, t, s):
  """Padding on keys only: every query row keeps at least one key (jax.nn's conventions)."""
  lengths = jnp.array([s, max(1, s - 2)])[:b]
  valid = jnp.arange(s)[None, :] < lengths[:, None]
  return nnx.make_attention_mask(jnp.ones((b, t)), valid)


@pytest.mark.parametrize("case", ["plain", "causal_mask", "is_causal", "padding", "gqa"])
def test_softmax_equals_flax_default(case):
  x = normal(0, (2, 5, D))
  ct = normal(1, (2, 5, D))
  kw = {}
  if case == "causal_mask":
    kw["mask"] = nnx.make_causal_mask(x[..., 0])
  elif case == "is_causal":
    kw["is_causal"] = True
  elif case == "padding":
    kw["mask"] = _key_padding_mask(2, 5, 5)
  ref, mine = _pair(num_kv_heads=2 if case == "gqa" else None)
  out_r, g_r = _out_and_param_grads(ref, x, ct, **kw)
  out_m, g_m = _out_and_param_grads(mine, x, ct, **kw)
  chex.assert_trees_all_close(out_m, out_r, **FWD)
  chex.assert_trees_all_close(g_m, g_r, **BWD)


def test_sown_weights_equal_flax():
  x = normal(2, (2, 5, D))
  mask = nnx.make_causal_mask(x[..., 0])
  ref, mine = _pair()
  out_r = ref(x, mask=mask, sow_weights=True)
  out_m = mine(x, mask=mask, sow_weights=True)
  w_r = nnx.pop(ref, nnx.Intermediate)["attention_weights"]
  w_m = nnx.pop(mine, nnx.Intermediate)["attention_weights"]
  chex.assert_trees_all_close(out_m, out_r, **FWD)
  chex.assert_trees_all_close(jax.tree.leaves(w_m), jax.tree.leaves(w_r), **FWD)
  assert jax.tree.leaves(w_m)[0].shape == (2, N, 5, 5)


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_equals_flax_with_the_same_draws(broadcast):
  x = normal(3, (2, 5, D))
  ref, mine = _pair(dropout_rate=0.4, broadcast_dropout=broadcast)
  out_r = ref(x, deterministic=False)
  out_m = mine(x, deterministic=False)
  chex.assert_trees_all_close(out_m, out_r, **FWD)
  # and the dropout is real: a deterministic call differs
  assert float(jnp.max(jnp.abs(mine(x, deterministic=True) - out_m))) > 1e-3


@pytest.mark.parametrize("shape", [(5, D), (2, 3, 5, D)])
def test_batch_dims_equal_flax(shape):
  x = normal(4, shape)
  ref, mine = _pair()
  chex.assert_trees_all_close(_jit_call(mine, x), _jit_call(ref, x), **FWD)
  mask = nnx.make_causal_mask(x[..., 0])
  chex.assert_trees_all_close(_jit_call(mine, x, mask=mask, sow_weights=True),
                              _jit_call(ref, x, mask=mask, sow_weights=True), **FWD)


def _projections(module, x):
  return module.query(x), module.key(x), module.value(x)


def _reference_layer(module, x, weights_fn):
  q, k, v = _projections(module, x)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
  w = weights_fn(logits)
  return module.out(jnp.einsum("bnts,bsnh->btnh", w, v))


def test_temperature_normalizer_param():
  x = normal(5, (2, 5, D))
  _, mine = _pair(attention_fn("softmax", temperature=2.0))
  want = _reference_layer(mine, x, lambda z: jax.nn.softmax(z / 2.0, axis=-1))
  chex.assert_trees_all_close(mine(x), want, **FWD)


def test_sparsemax_normalizer():
  x = normal(6, (2, 5, D), 3.0)
  _, mine = _pair(attention_fn("sparsemax"))

  def simplex(z):
    rows = jax.vmap(optax.projections.projection_simplex)(z.reshape(-1, z.shape[-1]))
    return rows.reshape(z.shape)

  want = _reference_layer(mine, x, simplex)
  chex.assert_trees_all_close(mine(x), want, atol=2e-5, rtol=1e-4)


def test_per_head_sink_normalizer_param():
  x = normal(7, (2, 5, D))
  sink = jnp.array([-1.0, 0.0, 0.5, 2.0]).reshape(N, 1, 1)
  _, mine = _pair(attention_fn("softmax_sink", sink_logit=sink))

  def with_sink(z):
    zz = jnp.concatenate([z, jnp.broadcast_to(sink, z.shape[:-1] + (1,))], axis=-1)
    return jax.nn.softmax(zz, axis=-1)[..., :-1]

  graphdef, state = nnx.split(mine)

  @jax.jit  # one compilation instead of one per eager operation
  def run(state, x):
    m = nnx.merge(graphdef, state)
    return m(x), _reference_layer(m, x, with_sink)

  chex.assert_trees_all_close(*run(state, x), **FWD)


def test_extra_keywords_reach_dot_product_attention():
  q, k, v = (normal(10 + i, (2, 6, 2, 4)) for i in range(3))
  fn = attention_fn()
  out = fn(q, k, v, local_window_size=(1, 0), deterministic=True)
  want = jax.nn.dot_product_attention(q, k, v, local_window_size=(1, 0))
  chex.assert_trees_all_close(out, want, **FWD)


def test_attention_weights_match_jax_nn():
  b, t, s = 2, 6, 6
  q, k, v = (normal(20 + i, (b, t, 2, 4)) for i in range(3))
  bias = normal(23, (1, 2, t, s), 0.5)
  kv_len = jnp.array([6, 4])
  w = attention_weights(q, k, bias, is_causal=True, local_window_size=(2, 0),
                        key_value_seq_lengths=kv_len)
  want = jax.nn.dot_product_attention(q, k, v, bias, is_causal=True, local_window_size=(2, 0),
                                      key_value_seq_lengths=kv_len)
  chex.assert_trees_all_close(jnp.einsum("bnts,bsnh->btnh", w, v), want, **FWD)
  visible_sum = jnp.sum(w, axis=-1)
  chex.assert_trees_all_close(visible_sum, jnp.ones_like(visible_sum), atol=1e-6)


def test_attention_weights_segments_and_fully_masked_rows():
  q, k = normal(30, (1, 4, 1, 4)), normal(31, (1, 4, 1, 4))
  seg = jnp.array([[0, 0, 1, 1]])
  weights = lambda q: attention_weights(q, k, segment_ids=seg, query_seq_lengths=jnp.array([3]))
  # the weights and their gradient in one compilation (not one per eager operation)
  w, g = jax.jit(lambda q: (weights(q), jax.grad(lambda q: jnp.sum(weights(q) ** 2))(q)))(q)
  same = np.asarray(seg[0][:, None] == seg[0][None, :])
  assert np.all(np.asarray(w[0, 0])[~same] == 0)
  np.testing.assert_array_equal(np.asarray(w[0, 0, 3]), 0.0)  # a padded query row: zeros
  chex.assert_tree_all_finite(g)


def test_bad_options_raise_errors_naming_them():
  with pytest.raises(KeyError, match="nope"):
    attention_fn("nope")
  with pytest.raises(ValueError, match="temperature"):
    attention_fn("softmax", temperature=-1.0)
  with pytest.raises(ValueError, match="foo"):
    attention_fn("softmax", foo=1.0)
  q = jnp.ones((1, 3, 2, 4))
  with pytest.raises(ValueError, match="dropout_rng"):
    attention_fn()(q, q, q, dropout_rate=0.5, deterministic=False)
  with pytest.raises(ValueError, match="mask"):
    attention_fn()(q, q, q, mask=jnp.ones((3, 1, 2, 3, 3), bool))


def test_jaxsoft_nn_is_exported():
  assert js.nn.attention_fn is attention_fn


def test_linen_sown_weights_equal_flax():
  """Linen's MultiHeadDotProductAttention(sow_weights=True) keeps the weights in 'intermediates'."""
  from flax import linen

  x = normal(5, (2, 5, D))
  mask = nnx.make_causal_mask(x[..., 0])
  kw = dict(num_heads=N, qkv_features=D, deterministic=True)
  ref = linen.MultiHeadDotProductAttention(**kw)
  mine = linen.MultiHeadDotProductAttention(**kw, attention_fn=js.nn.attention_fn())
  params = ref.init(jax.random.key(0), x, mask=mask)
  out_r, st_r = ref.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  out_m, st_m = mine.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  w_r = st_r["intermediates"]["attention_weights"]
  w_m = st_m["intermediates"]["attention_weights"]
  chex.assert_trees_all_close(out_m, out_r, **FWD)
  chex.assert_trees_all_close(w_m, w_r, **FWD)
  assert w_m[0].shape == (2, N, 5, 5)
