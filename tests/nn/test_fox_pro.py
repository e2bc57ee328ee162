"""FoXProAttention (A08, the Forgetting Transformer's "Pro" block).

The reference is a float64 numpy oracle written from the block's formulas (token shift,
QK-norm, forgetting attention with D_ij = c_i - c_j, per-head output RMSNorm, sigmoid
output gate, projections), independent of jaxsoft; every parameter is moved off its
initial value (norm scales off 1, biases off 0) so each one's use is checked. Layers that
differ in one switch share every common parameter, so "the switch changes the output" is
about the switch alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

import jaxsoft as js

B, T, D, N, K = 2, 6, 8, 4, 2          # GQA: 2 query heads per key/value head
H = D // N
EPS = 1e-6
SWITCHES = ("forget_gate", "k_shift", "v_shift", "qk_norm", "output_norm", "output_gate")


def _flat(layer) -> dict[tuple[str, ...], jax.Array]:
  return {tuple(map(str, p)): v.get_value()
          for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}


def _set(layer, path: tuple[str, ...], value) -> None:
  obj = layer
  for name in path[:-1]:
    obj = getattr(obj, name)
  getattr(obj, path[-1]).set_value(value)


def _make(flags: dict, dtype=jnp.float32, seed: int = 0, like=None):
  """A layer with ``flags``, its parameters random (or the shared ones copied from ``like``);
  built abstractly (nnx.eval_shape), since its own random initialisation is not used."""
  layer = nnx.eval_shape(lambda: js.nn.FoXProAttention(
      N, D, num_kv_heads=K, norm_eps=EPS, param_dtype=dtype, rngs=nnx.Rngs(seed), **flags))
  rng = np.random.default_rng(seed + 100)
  src = None if like is None else _flat(like)
  for path, val in _flat(layer).items():
    if src is not None:
      new = src[path]
    elif path[-1].endswith("scale"):                 # norm scales around 1
      new = 1.0 + 0.3 * rng.standard_normal(val.shape)
    else:                                            # kernels and biases, O(1) logits
      new = 0.5 * rng.standard_normal(val.shape)
    _set(layer, path, jnp.asarray(new, dtype))
  return layer


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def oracle(p: dict, x: np.ndarray, flags: dict) -> np.ndarray:
  """The Pro block in float64 from its formulas (see FoXProAttention's docstring)."""
  on = {s: flags.get(s, True) for s in SWITCHES}
  g = {"/".join(k): np.asarray(v, np.float64) for k, v in p.items()}
  x = np.asarray(x, np.float64)

  def proj(name, heads):
    return np.einsum("btd,dnh->btnh", x, g[f"attn/{name}/kernel"]) + g[f"attn/{name}/bias"]

  def shift(u, w):                                  # u'_t = a_t u_{t-1} + (1 - a_t) u_t
    a = _sigmoid(np.einsum("btd,dk->btk", x, w))[..., None]
    prev = np.zeros_like(u)
    prev[:, 1:] = u[:, :-1]
    return a * prev + (1.0 - a) * u

  def rms(u, scale):
    return u / np.sqrt(np.mean(u * u, axis=-1, keepdims=True) + EPS) * scale

  q, k, v = proj("query", N), proj("key", K), proj("value", K)
  if on["k_shift"]:
    k = shift(k, g["k_shift_kernel"])
  if on["v_shift"]:
    v = shift(v, g["v_shift_kernel"])
  if on["qk_norm"]:
    q, k = rms(q, g["q_norm_scale"]), rms(k, g["k_norm_scale"])
  if on["forget_gate"]:
    log_f = np.log(_sigmoid(np.einsum("btd,dn->btn", x, g["attn/forget_kernel"])
                            + g["attn/forget_bias"]))
    cum = np.cumsum(log_f, axis=1)                   # c_t; D_ij = c_i - c_j
  else:
    cum = np.zeros((x.shape[0], x.shape[1], N))
  o = np.zeros_like(q)
  causal = np.tril(np.ones((T, T), bool))
  for n in range(N):
    kv = n // (N // K)
    s = np.einsum("bih,bjh->bij", q[:, :, n], k[:, :, kv]) / np.sqrt(H)
    s = s + cum[:, :, n, None] - cum[:, None, :, n]
    s = np.where(causal, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    o[:, :, n] = np.einsum("bij,bjh->bih", w, v[:, :, kv])
  if on["output_norm"]:
    o = rms(o, g["out_norm_scale"])
  if on["output_gate"]:
    o = o * _sigmoid(np.einsum("btd,dnh->btnh", x, g["attn/gate_kernel"]) + g["attn/gate_bias"])
  return np.einsum("btnh,nho->bto", o, g["attn/out/kernel"]) + g["attn/out/bias"]


def _x(seed=1, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal((B, T, D)).astype(dtype)


def _forward(layers, xs=None):
  """One jitted program applying each layer to x (or each to its own of ``xs``)."""
  splits = [nnx.split(layer) for layer in layers]
  graphs = [gdef for gdef, _ in splits]
  states = [st for _, st in splits]

  @jax.jit
  def run(states, xs):
    return [nnx.merge(gdef, st)(x) for gdef, st, x in zip(graphs, states, xs, strict=True)]
  if xs is not None:
    return run(states, [jnp.asarray(x) for x in xs])
  return lambda x: run(states, [x] * len(layers))


def test_pro_block_float64_oracle_switches_causality_and_bf16():
  """One program: the full block and each switch off against the float64 oracle; each
  switch alone moves the output; a perturbed future never moves an earlier row; bf16
  inputs compute in float32."""
  with jax.enable_x64(True):
    full = _make({}, jnp.float64)
    configs = [{}] + [{s: False} for s in SWITCHES]
    layers = [full] + [_make(flags, jnp.float64, like=full) for flags in configs[1:]]
    full32 = _make({}, jnp.float32, like=full)
    x = _x(dtype=np.float64)
    x2 = x.copy()
    x2[:, 3:] += 5.0 * np.random.default_rng(7).standard_normal((B, T - 3, D))
    x16 = jnp.asarray(x, jnp.bfloat16)
    both = np.concatenate([x, x2])                   # the full layer sees x and x2 at once
    outs = _forward(layers + [full32], [both] + [x] * (len(layers) - 1) + [x16])
    y16 = outs.pop()
    y, y2 = np.split(np.asarray(outs[0]), 2)
    outs = [y] + [np.asarray(o) for o in outs[1:]]
    assert all(o.dtype == np.float64 for o in outs)
    p = _flat(full)
    for flags, out in zip(configs, outs, strict=True):
      # float64 throughout: ~1e-16 relative per op over a few hundred ops on O(1) values
      np.testing.assert_allclose(out, oracle(p, x, flags), rtol=0, atol=1e-11,
                                 err_msg=str(flags))
      if flags:  # the switch alone moves the output by far more than rounding
        assert np.abs(out - y).max() > 1e-2, flags
    np.testing.assert_array_equal(y[:, :3], y2[:, :3])   # masked weights are exactly 0
    assert np.abs(y[:, 3:] - y2[:, 3:]).min() > 0          # the perturbed rows do move
    # bf16 inputs compute in float32 (float32 params): the oracle on the bf16 values, to
    # float32 rounding (~6e-8 relative per op over ~20 chained ops, O(1) outputs -> 2e-5)
    assert y16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y16), oracle(p, np.asarray(x16, np.float64), {}),
                               rtol=0, atol=2e-5)


@pytest.mark.slow
def test_everything_off_but_the_forget_gate_is_multi_head_attention():
  with jax.enable_x64(True):
    bare = _make(dict.fromkeys(SWITCHES[1:], False), jnp.float64)
    mha = nnx.eval_shape(lambda: js.nn.MultiHeadAttention(
        N, D, num_kv_heads=K, forget_gate=True, param_dtype=jnp.float64, rngs=nnx.Rngs(5)))
    for path, val in _flat(bare).items():
      _set(mha, path[1:], val)
    x = _x(dtype=np.float64)
    y_pro, y_mha = _forward([bare, mha], [x, x])
    # the same formulas, but MultiHeadAttention.log_forget_gates is float32 even for float64
    # input (the Pro block's gates are float64): log f rounded at ~6e-8 relative, |c_t| of a
    # few units -> ~1e-7 on the outputs; 1e-6 allows it
    np.testing.assert_allclose(np.asarray(y_pro), np.asarray(y_mha), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_gradients_match_finite_differences_in_float64():
  with jax.enable_x64(True):
    layer = _make({}, jnp.float64)
    gdef, params, rest = nnx.split(layer, nnx.Param, ...)
    flat, unravel = ravel_pytree(params)
    x = jnp.asarray(_x(dtype=np.float64))
    r = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, D)))

    def loss(theta, x):
      return jnp.sum(nnx.merge(gdef, unravel(theta), rest)(x) * r)

    f = jax.jit(loss)
    g_theta, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(flat, x)
    assert np.isfinite(g_theta).all() and np.isfinite(g_x).all()
    h = 1e-6   # central differences: O(h^2) truncation + 1e-16/h rounding, ~1e-10 here
    for idx in ((0, 0, 0), (1, 3, 5), (0, 5, 2)):
      e = jnp.zeros_like(x).at[idx].set(h)
      fd = (f(flat, x + e) - f(flat, x - e)) / (2 * h)
      np.testing.assert_allclose(g_x[idx], fd, rtol=1e-6, atol=1e-8, err_msg=str(idx))
    # one entry of each of the Pro block's own parameters and of the gates' biases
    offsets, start = {}, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      offsets[".".join(str(getattr(k, "key", k)) for k in path)] = start + leaf.size // 2
      start += leaf.size
    wanted = [name for name in offsets if any(part in name for part in (
        "shift_kernel", "norm_scale", "forget_bias", "gate_bias"))]
    assert len(wanted) == 7, sorted(offsets)
    for name in wanted:
      e = jnp.zeros_like(flat).at[offsets[name]].set(h)
      fd = (f(flat + e, x) - f(flat - e, x)) / (2 * h)
      np.testing.assert_allclose(g_theta[offsets[name]], fd, rtol=1e-6, atol=1e-8,
                                 err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{}, {"forget_gate": False},
                                   {"k_shift": False, "qk_norm": False, "output_gate": False}])
def test_decode_equals_the_full_forward(flags):
  layer = _make(flags)
  x = jnp.asarray(_x())
  (y,) = _forward([layer])(x)
  layer.init_cache(B, T)
  step = nnx.jit(lambda m, x: m(x, decode=True))
  parts = [step(layer, x[:, :3])]                    # a prefill, then one token per step
  parts += [step(layer, x[:, t:t + 1]) for t in range(3, T)]
  # float32, the same formulas in another summation order: ~6e-8 relative per op over
  # ~20 chained ops on O(1) outputs -> 2e-5
  np.testing.assert_allclose(np.asarray(jnp.concatenate(parts, 1)), np.asarray(y), atol=2e-5)
  assert np.isnan(np.asarray(step(layer, x[:, :1]))).all()   # past max_length under jit
  with pytest.raises(ValueError, match="max_length"):
    layer(x[:, :1], decode=True)                             # eagerly: an error


def test_errors_name_the_argument():
  # abstract parameters (nnx.eval_shape): every error comes before any computation
  layer = nnx.eval_shape(lambda: js.nn.FoXProAttention(2, 8, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="`inputs` must have shape"):
    layer(jnp.ones((1, 3, 7)))
  with pytest.raises(ValueError, match="`inputs` must be floating"):
    layer(jnp.ones((1, 3, 8), jnp.int32))
  with pytest.raises(ValueError, match="init_cache"):
    layer(jnp.ones((1, 1, 8)), decode=True)
  layer.init_cache(2, 4)
  with pytest.raises(ValueError, match="batch shape"):
    layer(jnp.ones((3, 1, 8)), decode=True)
  with pytest.raises(ValueError, match="`qk_norm` must be a bool"):
    js.nn.FoXProAttention(2, 8, qk_norm=1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`norm_eps` must be a float > 0"):
    js.nn.FoXProAttention(2, 8, norm_eps=0.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="divisible"):
    js.nn.FoXProAttention(3, 8, rngs=nnx.Rngs(0))
