"""Tests of cached decoding in jaxsoft.nn.MultiHeadAttention (``init_cache`` + ``decode=True``).

The oracle is the layer's full causal forward (itself checked against references in
test_mha.py): a prefill followed by one-token steps must give its rows, for every
normalizer the layer takes (a sample by default, all of them with ``-m slow``), with
sliding windows, GQA, learned per-head parameters, the forget and output gates, under
jit and grad, and in bfloat16. An independent float64 NumPy reference checks that a
sliding-window SSMax decode uses n = the number of visible keys of each row.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft import normalizers
from jaxsoft.nn import MultiHeadAttention, QASSMax
from jaxsoft.normalizers import get
from tests.helpers import BWD, FWD, check_raises, normal, random_cotangent, sampled

D, N, T, B = 8, 4, 5, 2
CHUNKS = (2, 1, 1, 1)  # a two-token prefill, then one token per step

# Hyperparameters where the defaults do not fit a five-key row (top-k needs k <= S).
HP = {"top_k_softmax": {"k": 2}}
STOCHASTIC = [n for n in normalizers.names() if get(n).needs_key]
DETERMINISTIC = [n for n in normalizers.names() if not get(n).needs_key]
# classes E (softmax_sink), E + length (ssmax), P + length (sigmoid: bias -log n),
# S + length (softplus_l1), T (entmax15), R (standardized_softmax)
DEFAULT = ("softmax_sink", "ssmax", "sigmoid", "softplus_l1", "entmax15", "standardized_softmax")


def _x(seed=0, shape=(B, T, D), scale=1.5, dtype=jnp.float32):
  return normal(seed, shape, scale, dtype)


# Jitted layer calls: one compilation per call form instead of one per eager operation (the
# eager path, with its max_length check, is exercised by the tests that call the layer below).
_step = nnx.jit(lambda m, xt: m(xt, decode=True))


def _forward(layer, x, **call_kw):
  """``layer(x, **call_kw)`` jitted."""
  return nnx.jit(lambda m, x: m(x, **call_kw))(layer, x)


def _decode(layer, x, chunks=CHUNKS, max_length=None, step=_step, **cache_kw):
  """init_cache, then the chunks of ``x [batch..., T, D]`` in order (by default jitted
  steps); outputs concatenated."""
  layer.init_cache(x.shape[:-2], max_length or x.shape[-2], **cache_kw)
  outs, t = [], 0
  for c in chunks:
    outs.append(step(layer, x[..., t:t + c, :]))
    t += c
  assert t == x.shape[-2]
  return jnp.concatenate(outs, axis=-2)


def _check_decode_equals_forward(layer, x, chunks=CHUNKS, tol=FWD, window=None, **call_kw):
  full = _forward(layer, x, is_causal=True, local_window_size=window, **call_kw)
  steps = _decode(layer, x, chunks, local_window_size=window)
  chex.assert_trees_all_close(steps, full, **tol)
  assert bool(jnp.isfinite(steps).all())
  return steps


def test_registry_split_is_complete():
  assert sorted(STOCHASTIC + DETERMINISTIC) == sorted(normalizers.names())
  assert set(DEFAULT) <= set(DETERMINISTIC)
  assert {get(n).kernel_class for n in DEFAULT} >= {"E", "S", "P", "T"}
  assert all(get(n).length_dependent for n in ("ssmax", "sigmoid", "softplus_l1"))


@pytest.mark.parametrize("name", sampled(DETERMINISTIC, DEFAULT))
def test_decode_equals_causal_forward_for_each_normalizer(name):
  layer = MultiHeadAttention(N, D, normalizer=name, normalizer_params=HP.get(name),
                             rngs=nnx.Rngs(0))
  _check_decode_equals_forward(layer, _x(1), tol=dict(rtol=1e-5, atol=2e-5))
  assert int(layer.cache_index[...]) == T


@pytest.mark.parametrize("name", STOCHASTIC)
def test_stochastic_normalizers_are_refused_by_the_layer(name):
  # The layer takes no PRNG key for a normalizer, so the decode matrix above covers
  # every normalizer the layer can hold; this fails (and asks for a decode test) if a
  # stochastic normalizer becomes usable in the layer.
  with pytest.raises(ValueError, match="key"):
    MultiHeadAttention(N, D, normalizer=name, normalizer_params={"key": jax.random.key(0)},
                       rngs=nnx.Rngs(0))


def test_sliding_window_ssmax_matches_float64_reference():
  """Ring-buffer decode of SSMax with window w against NumPy: n_i = min(i + 1, w + 1)."""
  w, s, length = 2, 0.7, T
  layer = MultiHeadAttention(N, D, normalizer="ssmax", normalizer_params={"s": s},
                             rngs=nnx.Rngs(3))
  x = _x(2)
  steps = _decode(layer, x, local_window_size=w)
  assert layer.cached_key.shape == (B, w, N, D // N)  # O(w) memory, not O(length)

  p = {name: np.asarray(getattr(layer, name).kernel[...], np.float64)
       for name in ("query", "key", "value", "out")}
  bias = {name: np.asarray(getattr(layer, name).bias[...], np.float64)
          for name in ("query", "key", "value", "out")}
  xs = np.asarray(x, np.float64)
  q, k, v = (np.einsum("btd,dnh->btnh", xs, p[n]) + bias[n] for n in ("query", "key", "value"))
  y = np.zeros_like(q)
  for b in range(B):
    for i in range(length):
      js = np.arange(max(0, i - w), i + 1)
      n_i = len(js)
      for h in range(N):
        logits = q[b, i, h] @ k[b, js, h].T / np.sqrt(D // N)
        z = s * np.log(n_i) * logits
        e = np.exp(z - z.max())
        y[b, i, h] = (e / e.sum()) @ v[b, js, h]
  ref = np.einsum("btnh,nhd->btd", y, p["out"]) + bias["out"]
  np.testing.assert_allclose(np.asarray(steps, np.float64), ref, rtol=1e-4, atol=1e-5)


# (window, num_kv_heads, chunks)
WINDOWS = {"w2_gqa": (2, 2, CHUNKS), "w1_prefill_longer_than_ring": (1, 4, (5, 1, 1)),
           "left3_right-1": ((3, -1), 4, (3, 2, 1, 1)), "w0": (0, 2, (2, 1, 1, 1, 1, 1))}


@pytest.mark.parametrize("case", sampled(list(WINDOWS), ("w2_gqa",)))
def test_sliding_window_decode_equals_windowed_forward(case):
  window, kv_heads, chunks = WINDOWS[case]
  layer = MultiHeadAttention(N, D, num_kv_heads=kv_heads, normalizer="sigmoid",
                             rngs=nnx.Rngs(4))
  x = _x(3, (B, sum(chunks), D))
  _check_decode_equals_forward(layer, x, chunks, window=window)
  left = window if isinstance(window, int) else window[0]
  assert layer.cached_key.shape == (B, max(left, 1), kv_heads, D // N)


@pytest.mark.parametrize("kv_heads", sampled([2, 1], ("2",)))
def test_gqa_cache_stores_kv_heads(kv_heads):
  layer = MultiHeadAttention(N, D, num_kv_heads=kv_heads, normalizer="ssmax", rngs=nnx.Rngs(5))
  _check_decode_equals_forward(layer, _x(4))
  assert layer.cached_key.shape == layer.cached_value.shape == (B, T, kv_heads, D // N)
  # the stored keys are the layer's key projection of the inputs
  chex.assert_trees_all_close(layer.cached_key[...], layer.key(_x(4)), **FWD)


OPTIONS = {
    "ssmax_s": dict(normalizer="ssmax", learned=("s",)),
    "entmax_alpha": dict(normalizer="entmax", learned=("alpha",)),
    "sink_gated": dict(sink=True, gated=True),
    "forget_gate": dict(forget_gate=True, forget_bias_init=1.0),
    "temperature_gqa": dict(learned=("temperature",), num_kv_heads=2),
    "chunked_path": dict(normalizer="sparsemax", implementation="xla_chunked"),
}


@pytest.mark.parametrize("option", sampled(list(OPTIONS), ("ssmax_s", "forget_gate")))
def test_learned_parameters_and_gates_decode_like_forward(option):
  layer = MultiHeadAttention(N, D, rngs=nnx.Rngs(6), **OPTIONS[option])
  for z in layer.normalizer_free.values():  # distinct per-head values
    z[...] = z[...] + jnp.linspace(-0.8, 0.8, N)
  _check_decode_equals_forward(layer, _x(5))


def test_decode_gradients_equal_forward_gradients():
  """Parameter gradients through a prefill and decode steps equal the forward's."""
  layer = MultiHeadAttention(N, D, normalizer="ssmax", learned=("s",), forget_gate=True,
                             rngs=nnx.Rngs(7))
  x = _x(6)
  ct = random_cotangent((B, T, D))

  @nnx.jit
  @nnx.grad
  def forward_loss(m):
    return jnp.sum(ct * m(x, is_causal=True))

  @nnx.jit
  @nnx.grad
  def decode_loss(m):
    outs, t = [], 0
    for c in CHUNKS:
      outs.append(m(x[:, t:t + c], decode=True))
      t += c
    return jnp.sum(ct * jnp.concatenate(outs, axis=1))

  g_full = forward_loss(layer)
  layer.init_cache(B, T)
  g_dec = decode_loss(layer)
  assert int(layer.cache_index[...]) == T  # the cache update left grad with the layer
  chex.assert_trees_all_close(g_dec, g_full, **BWD)
  assert float(jnp.abs(g_dec["normalizer_free"]["s"][...]).max()) > 0


def test_jitted_decode_step_and_overflow_under_jit():
  layer = MultiHeadAttention(N, D, normalizer="sigmoid", num_kv_heads=2, rngs=nnx.Rngs(8))
  x = _x(7)
  full = layer(x, is_causal=True)
  step = nnx.jit(lambda m, xt: m(xt, decode=True))
  layer.init_cache(B, T + 1)  # a cache longer than the sequence
  steps = jnp.concatenate([step(layer, x[:, t:t + 1]) for t in range(T)], axis=1)
  chex.assert_trees_all_close(steps, full, **FWD)
  assert int(layer.cache_index[...]) == T
  assert bool(jnp.isfinite(step(layer, x[:, :1])).all())  # position T < max_length
  # past max_length: eagerly a ValueError; under jit the index is traced, so the output
  # is NaN rather than a silently wrong value
  assert bool(jnp.isnan(step(layer, x[:, :1])).all())


def test_batch_dims_and_reset():
  layer = MultiHeadAttention(N, D, normalizer="softplus_l1", rngs=nnx.Rngs(9))
  x = _x(8, (1, B, T, D))
  full = _forward(layer, x, is_causal=True)
  steps = _decode(layer, x)
  chex.assert_trees_all_close(steps, full, **FWD)
  assert layer.cached_key.shape == (B, T, N, D // N)
  check_raises(("max_length", lambda: layer(x[..., :1, :], decode=True)))
  # a reset empties the cache, and decoding again repeats the outputs
  layer.init_cache((1, B), T)
  assert int(layer.cache_index[...]) == 0 and bool((layer.cached_positions[...] == -1).all())
  chex.assert_trees_all_close(_decode(layer, x), full, **FWD)


@pytest.mark.parametrize("name", ["ssmax", "entmax15"])
def test_bf16_decode(name):
  layer = MultiHeadAttention(N, D, normalizer=name, dtype=jnp.bfloat16, rngs=nnx.Rngs(10))
  x = _x(9, dtype=jnp.bfloat16)
  steps = _check_decode_equals_forward(layer, x, tol=dict(rtol=2e-2, atol=2e-2))
  assert steps.dtype == jnp.bfloat16 and layer.cached_key.dtype == jnp.bfloat16
  ref = _forward(MultiHeadAttention(N, D, normalizer=name, rngs=nnx.Rngs(10)),
                 x.astype(jnp.float32), is_causal=True)
  chex.assert_trees_all_close(steps.astype(jnp.float32), ref, rtol=5e-2, atol=5e-2)


def test_extreme_inputs_stay_finite():
  for name in ("softmax", "ssmax", "sigmoid"):
    layer = MultiHeadAttention(N, D, normalizer=name, rngs=nnx.Rngs(11))
    x = _x(10, scale=1e4)
    # eager: three normalizers share most of their eagerly compiled operations
    steps = _decode(layer, x, step=lambda m, xt: m(xt, decode=True))
    assert bool(jnp.isfinite(steps).all()), name
    chex.assert_trees_all_close(steps, layer(x, is_causal=True), rtol=1e-4, atol=1e-2)


def test_bad_decode_calls_raise_errors_naming_them():
  layer = MultiHeadAttention(N, D, rngs=nnx.Rngs(12))
  x = _x(11)
  check_raises(("init_cache", lambda: layer(x, decode=True)))
  layer.init_cache(B, 4)
  check_raises(
      ("max_length", lambda: layer(x, decode=True)),  # 5 tokens into 4 positions
      ("inputs_q.*batch", lambda: layer(x[:1, :1], decode=True)),
      ("inputs_k", lambda: layer(x[:, :1], x[:, :1], decode=True)),
      ("mask", lambda: layer(x[:, :1], mask=jnp.ones((1, 1), bool), decode=True)),
      ("segment_ids", lambda: layer(x[:, :1], segment_ids=jnp.zeros((B, 1), int), decode=True)),
      ("key_value_seq_lengths",
       lambda: layer(x[:, :1], key_value_seq_lengths=jnp.ones(B, int), decode=True)),
  )
  assert int(layer.cache_index[...]) == 0  # refused calls leave the cache alone
  layer(x[:, :4], decode=True)
  check_raises(("max_length", lambda: layer(x[:, 4:], decode=True)))
  check_raises(
      ("max_length", lambda: layer.init_cache(B, 0)),
      ("batch", lambda: layer.init_cache((B, 0), 4)),
      ("batch", lambda: layer.init_cache("2", 4)),
      ("local_window_size", lambda: layer.init_cache(B, 4, local_window_size=(-1, 3))),
  )
  layer.init_cache(B, 4, local_window_size=1)
  check_raises(("local_window_size", lambda: layer(x[:, :1], decode=True, local_window_size=2)))
  # a narrower window than the cache's is fine (and equals the windowed forward)
  layer.init_cache(B, T, local_window_size=2)
  steps = jnp.concatenate(
      [layer(x[:, t:t + 1], decode=True, local_window_size=1) for t in range(T)], axis=1)
  chex.assert_trees_all_close(steps, layer(x, is_causal=True, local_window_size=1), **FWD)


def test_decode_flag_from_the_constructor():
  layer = MultiHeadAttention(N, D, decode=True, rngs=nnx.Rngs(13))
  x = _x(12)
  layer.init_cache(B, T)
  steps = jnp.concatenate([layer(x[:, :2])] + [layer(x[:, t:t + 1]) for t in range(2, T)], axis=1)
  chex.assert_trees_all_close(steps, layer(x, is_causal=True, decode=False), **FWD)


def test_learned_normalizer_module_gets_decode_visible_counts():
  """QASSMax scales each query by log n: decoding with a window must give it the forward's
  n (min(i + 1, w + 1)), which the layer derives from the cache's visibility mask."""
  layer = MultiHeadAttention(N, D, learned=(QASSMax(N, D // N, hidden=4, rngs=nnx.Rngs(1)),),
                             rngs=nnx.Rngs(14))
  _check_decode_equals_forward(layer, _x(13), window=2)
