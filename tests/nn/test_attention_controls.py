"""A49 js.nn.AttentionControl: every control (and its hybrid with real heads) against a numpy
float64 oracle written from its parameters; causality under a perturbed future token,
gradients, random_qk's embeddings are fixed (never parameters), bf16, bad arguments."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsoft as js

D, N, L, B, T = 8, 2, 6, 2, 5
X = np.random.default_rng(7).standard_normal((B, T, D)).astype(np.float32)
CONTROLS = tuple(js.nn.ATTENTION_CONTROLS)


@functools.cache  # (one build per configuration; no test mutates a layer)
def _layer(control, real_heads=1, dtype=jnp.float32, **kwargs):
  def build():
    return js.nn.AttentionControl(D, N, control=control, max_len=L, real_heads=real_heads,
                                  dtype=dtype, rngs=nnx.Rngs(0), **kwargs)
  graphdef, _ = nnx.split(nnx.eval_shape(build))  # (initialised under jit: eager is slow)
  layer = nnx.merge(graphdef, jax.jit(lambda: nnx.state(build()))())
  if layer.scores is not None:  # a map away from its zero start, so it is really tested
    layer.scores[...] = jax.random.normal(jax.random.key(1), layer.scores.shape)
  return layer


def _np(a):
  return np.asarray(a[...] if isinstance(a, nnx.Variable) else a, np.float64)


def _causal_softmax(z):
  """Row softmax of ``z [..., T, S]`` over j <= i, float64."""
  t = z.shape[-1]
  z = np.where(np.tril(np.ones((t, t), bool)), z, -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def o_layer(layer, x):
  """The layer written out in numpy float64 from its parameters (use_bias=False)."""
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, r = layer.head_dim, layer.real_heads
  v = (x @ _np(layer.value.kernel)).reshape(b, t, N, h)
  heads = []
  if r:
    q = (x @ _np(layer.query.kernel)).reshape(b, t, r, h)
    k = (x @ _np(layer.key.kernel)).reshape(b, t, r, h)
    w = _causal_softmax(np.einsum("binh,bjnh->bnij", q, k) / np.sqrt(h))
    heads.append(np.einsum("bnij,bjnh->binh", w, v[:, :, :r]))
  c = N - r
  vc = v[:, :, r:]
  if layer.control == "none":
    heads.append(vc)
  else:
    if layer.control == "uniform":
      s = np.zeros((c, t, t))
    elif layer.control == "fixed":
      s = _np(layer.scores)[:, :t, :t]
    else:
      p = (_np(layer.positions) if layer.control == "static_qk" else np.asarray(
          jax.random.normal(jax.random.key(layer.seed), (L, D)), np.float64))[:t]
      qe = (p @ _np(layer.position_query.kernel)).reshape(t, c, h)
      ke = (p @ _np(layer.position_key.kernel)).reshape(t, c, h)
      s = np.einsum("inh,jnh->nij", qe, ke) / np.sqrt(h)
    heads.append(np.einsum("nij,bjnh->binh", _causal_softmax(s), vc))
  o = np.concatenate(heads, axis=2).reshape(b, t, N * h)
  return o @ _np(layer.out.kernel)


call = nnx.jit(lambda layer, x: layer(x))


# float32: projections of width 8 and softmaxes over <= 5 keys (~50 roundings of 2^-24 on
# O(1) values): 2e-5.
TOL = {"rtol": 2e-5, "atol": 2e-5}


@pytest.mark.parametrize("control, real_heads", [
    ("fixed", 1),
    *(pytest.param(c, r, marks=pytest.mark.slow) for c in CONTROLS for r in (0, 1)
      if (c, r) != ("fixed", 1))])
def test_matches_the_float64_oracle_and_the_future_does_not_leak(control, real_heads):
  layer = _layer(control, real_heads)
  y = call(layer, X)
  assert y.shape == (B, T, D) and y.dtype == jnp.float32
  np.testing.assert_allclose(y, o_layer(layer, X), **TOL)
  changed = X.copy()
  changed[:, 3] += 5.0
  y2 = np.asarray(call(layer, changed))
  np.testing.assert_array_equal(np.asarray(y)[:, :3], y2[:, :3])
  assert np.abs(y2[:, 3] - np.asarray(y)[:, 3]).max() > 1e-3


def test_random_qk_embeddings_are_fixed_and_not_parameters():
  def params(control):
    layer = nnx.eval_shape(lambda: js.nn.AttentionControl(D, N, control=control, max_len=L,
                                                          seed=5, rngs=nnx.Rngs(0)))
    return layer, {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(layer))}
  random, names = params("random_qk")
  assert random.positions is None and not any("positions" in n for n in names)
  static, names = params("static_qk")
  assert "positions" in names and static.positions.shape == (L, D)  # learned: a parameter
  drawn = jax.eval_shape(lambda: random.position_embeddings(4))
  assert drawn.shape == (4, D) and random.seed == 5  # drawn from jax.random.key(seed)


def test_gradients_reach_the_map_and_skip_its_future_entries():
  layer = _layer("fixed", real_heads=1)
  graphdef, params = nnx.split(layer)
  weights = np.random.default_rng(3).standard_normal((B, T, D))
  grads = jax.jit(jax.grad(lambda p: jnp.sum(weights * nnx.merge(graphdef, p)(X))))(params)
  ds = np.asarray(grads["scores"][...])
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
  i, j = np.tril_indices(T)
  learns = i > 0  # (row 0 sees one key: its weight is 1 whatever the score, no gradient)
  assert np.all(ds[:, i[learns], j[learns]] != 0)              # every visible entry learns
  future = np.triu(np.ones((L, L), bool), 1)
  future[T:, :] = future[:, T:] = True                         # and positions past T
  assert np.all(ds[:, future] == 0)
  for name in ("query", "key", "value", "out"):
    assert np.abs(np.asarray(grads[name]["kernel"][...])).max() > 0, name


@pytest.mark.slow
def test_bf16_compute_stays_close_to_the_oracle():
  layer = _layer("static_qk", real_heads=1, dtype=jnp.bfloat16)
  y = call(layer, X)
  assert y.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(y, np.float32)))
  want = o_layer(layer, X)
  # bf16 projections (2^-9 relative per rounding, ~6 roundings along a path of O(1)
  # values and sums of 8 terms): within 5 % of the output scale.
  scale = np.abs(want).max()
  np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=0.05 * scale)


@pytest.mark.parametrize("kwargs, match", [
    (dict(control="mean"), r"`control` must be one of"),
    (dict(control="none", real_heads=3), r"`real_heads` must be an int in \[0, 2\]"),
    (dict(control="fixed"), r"control 'fixed' needs `max_len`"),
    (dict(control="none", causal=1), r"`causal` must be a bool"),
    (dict(control="static_qk", max_len=0), r"`max_len` must be a positive int"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    js.nn.AttentionControl(D, N, rngs=nnx.Rngs(0), **kwargs)


def test_longer_than_max_len_raises():
  layer = nnx.eval_shape(lambda: js.nn.AttentionControl(D, N, control="fixed", max_len=L,
                                                       rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"7 positions but control 'fixed' covers `max_len` = 6"):
    layer.mix(None, None, jnp.zeros((1, 7, N, D // N)))
