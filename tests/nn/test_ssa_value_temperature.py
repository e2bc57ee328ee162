"""N07 SSA's value temperature (js.nn.SSA(value_temperature=True)): the whole SSA attention
``o_i = sum_j w_ij tau_v(v_j) v_j`` against a float64 NumPy reference of the formula, with
grouped key/value heads, masks, gradients, bf16 and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsoft as js
from jaxsoft.nn._learned_normalizers import apply_attention_values
from tests import helpers

B, N, K, T, H = 2, 4, 2, 5, 3


def _case(seed):
  scores = helpers.normal(seed, (B, N, T, T), 1.5)
  q = helpers.normal(seed + 1, (B, N, T, H))
  v = helpers.normal(seed + 2, (B, K, T, H))
  return scores, q, v


def _module():
  ssa = js.nn.SSA(N, H, alpha_init=np.array([-1.0, 0.0, 1.0, 2.0]), value_temperature=True,
                  num_kv_heads=K)
  ssa.token_kernel[...] = helpers.normal(12, (N, H))
  ssa.token_bias[...] = jnp.array([0.1, -0.2, 0.3, 0.0])
  ssa.value_kernel[...] = helpers.normal(13, (K, H), 0.5)
  ssa.value_bias[...] = jnp.array([0.5, -0.5])
  return ssa


def _reference(ssa, scores, q, v, mask, u=None):
  """float64: tau = tanh(w . q + c) + 1 + sigmoid(alpha) log n (n the visible keys),
  w = softmax(tau x) over the visible keys, tau_v = 1 + tanh(u_k . v_j + d_k),
  o = w @ (tau_v v) with query head n reading key/value head n // (N / K)."""
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  x, qd, vd = f64(scores), f64(q), f64(v)
  mask = np.broadcast_to(mask, x.shape)
  n = mask.sum(-1, keepdims=True)
  tok = np.tanh(np.einsum("bnth,nh->bnt", qd, f64(ssa.token_kernel[...]))
                + f64(ssa.token_bias[...])[:, None])[..., None]
  sig = 1.0 / (1.0 + np.exp(-f64(ssa.alpha[...])))[:, None, None]
  z = np.where(mask, (tok + 1.0 + sig * np.log(np.maximum(n, 1))) * x, -np.inf)
  e = np.where(mask, np.exp(z - np.where(n > 0, z.max(-1, keepdims=True), 0.0)), 0.0)
  w = np.where(n > 0, e / np.maximum(e.sum(-1, keepdims=True), 1e-300), 0.0)
  u = f64(ssa.value_kernel[...]) if u is None else u
  tau_v = 1.0 + np.tanh(np.einsum("bksh,kh->bks", vd, u)
                        + f64(ssa.value_bias[...])[:, None])
  vt = np.repeat(tau_v[..., None] * vd, N // K, axis=1)
  return np.einsum("bnts,bnsh->bnth", w, vt), tau_v


def test_attend_matches_the_float64_formula_with_masks_and_gradients():
  scores, q, v = _case(0)
  ssa = _module()
  causal = np.tril(np.ones((T, T), bool))
  pad = np.ones((B, 1, 1, T), bool)
  pad[1, ..., 3:] = False          # batch 1: the last two keys are padding
  pad_causal = causal & pad
  pad_causal[1, :, 0] = False      # and its first query sees no key: output 0
  graphdef, state = nnx.split(ssa)

  @jax.jit
  def run(state, scores, q, v):
    mod = nnx.merge(graphdef, state)
    loss = lambda s, vv, st: jnp.sum(  # noqa: E731
        nnx.merge(graphdef, st).attend(s, q, vv, causal) ** 2)
    return (mod.attend(scores, q, v, causal), mod.attend(scores, q, v, pad_causal),
            mod.value_temperatures(v), jax.grad(loss, argnums=(0, 1, 2))(scores, v, state),
            mod.attend(scores.astype(jnp.bfloat16), q, v.astype(jnp.bfloat16), causal))

  out, out_pad, tau_v, grads, out_bf16 = run(state, scores, q, v)
  want, want_tau = _reference(ssa, scores, q, v, causal)
  # float32: softmax of rows of 5 scores ~3 and a 5-term average (a few 2^-24 roundings)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  # 1 + tanh near tanh = -1 loses float32's absolute rounding at 1 (2^-23 ~ 1.2e-7)
  np.testing.assert_allclose(tau_v[..., 0], want_tau, rtol=1e-6, atol=3e-7)
  assert want_tau.min() < 0.7 and want_tau.max() > 1.3  # tokens silenced and amplified
  want_pad, _ = _reference(ssa, scores, q, v, pad_causal)
  np.testing.assert_allclose(out_pad, want_pad, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(out_pad)[1, :, 0] == 0)
  # gradients: d loss / d scores, d v and d u (the value kernel) by central differences of
  # the float64 reference along one random direction each (h = 1e-5: error ~h^2 * 1e2)
  rng = np.random.default_rng(3)
  g_scores, g_v, g_state = grads
  g_u = np.asarray(g_state["value_kernel"][...])
  assert np.abs(g_u).max() > 1e-3
  for arg, g in (("scores", g_scores), ("v", g_v), ("u", g_u)):
    d = rng.normal(size=np.shape(g))
    h = 1e-5

    def ref_loss(t, arg=arg, d=d):
      s, vv = np.asarray(scores, np.float64), np.asarray(v, np.float64)
      u = np.asarray(ssa.value_kernel[...], np.float64)
      s, vv, u = (a + t * d if name == arg else a
                  for a, name in ((s, "scores"), (vv, "v"), (u, "u")))
      return np.sum(_reference(ssa, s, q, vv, causal, u)[0] ** 2)

    fd = (ref_loss(h) - ref_loss(-h)) / (2 * h)
    np.testing.assert_allclose(np.sum(np.asarray(g) * d), fd, rtol=2e-3, atol=1e-4)
  # bf16 in, bf16 out, computed in float32: the rounded inputs' reference, output rounded
  # to 8 bits (values up to ~3: atol 2^-8 * 3 ~ 0.012 plus the rounding of the inputs)
  assert out_bf16.dtype == jnp.bfloat16
  rb = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
  want_bf16, _ = _reference(ssa, rb(scores), q, rb(v), causal)
  np.testing.assert_allclose(np.asarray(out_bf16, np.float32), want_bf16, atol=2e-2, rtol=1e-2)


@pytest.mark.slow  # ~1.5 s; the formula test covers the default run
def test_baselines_layer_guard_and_errors():
  scores, q, v = _case(10)
  causal = np.tril(np.ones((T, T), bool))
  plain = js.nn.SSA(N, H, num_kv_heads=K)
  init = js.nn.SSA(N, H, value_temperature=True, num_kv_heads=K)
  mod = _module()
  vl = jnp.swapaxes(v, 1, 2)  # the layer's layout [B, S, K, H]

  @jax.jit  # one compilation instead of one per eager operation
  def run(scores, q, v, vl):
    return (plain(scores, q, causal), plain.attend(scores, q, v, causal),
            init.attend(scores, q, v, causal), plain.value_temperatures(v),
            apply_attention_values([mod], vl), mod.attention_values(v))

  w, out_plain, out_init, ones, applied, direct = run(scores, q, v, vl)
  # without value temperature (or at its init, tau_v = 1): weights @ values, per group
  want = np.einsum("bnts,bnsh->bnth", np.asarray(w, np.float64),
                   np.repeat(np.asarray(v, np.float64), N // K, 1))
  for out in (out_plain, out_init):
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(ones, 1.0)
  # the layer's helper: the identity unless a module changes the values, else its values
  assert apply_attention_values([plain], vl) is vl
  np.testing.assert_array_equal(applied, jnp.swapaxes(direct, 1, 2))
  helpers.check_raises(
      (r"SSA: `num_heads` \(4\) must be a multiple of `num_kv_heads` \(3\)",
       lambda: js.nn.SSA(N, H, num_kv_heads=3)),
      (r"SSA: `value_temperature` must be a bool", lambda: js.nn.SSA(N, H, value_temperature=1)),
      (r"SSA: `v` must have shape \[B, 2, S, 3\]", lambda: mod.attend(scores, q, v[:, :1])),
      (r"SSA: `v` must have a floating dtype", lambda: mod.attention_values(v.astype(int))),
      (r"SSA: `scores` must have shape \[B, 4, T, S\]",
       lambda: mod.attend(scores[..., :3], q, v)),
  )


def test_multi_head_attention_applies_the_value_temperature():
  """Inside MultiHeadAttention (grouped key/value heads, causal): the layer's output equals
  the module's whole SSA attention on the layer's own projections, by hand; the value
  temperature changes the output."""
  D = N * H
  x = helpers.normal(31, (B, T, D))
  layer = js.nn.MultiHeadAttention(N, D, num_kv_heads=K, normalizer="ssa_softmax",
                                   learned=(_module(),), rngs=nnx.Rngs(5))
  plain = js.nn.SSA(N, H, num_kv_heads=K)
  plain.token_kernel[...] = layer.learned_modules[0].token_kernel[...]
  plain.token_bias[...] = layer.learned_modules[0].token_bias[...]
  plain.alpha[...] = layer.learned_modules[0].alpha[...]
  no_vt = js.nn.MultiHeadAttention(N, D, num_kv_heads=K, normalizer="ssa_softmax",
                                   learned=(plain,), rngs=nnx.Rngs(5))

  @nnx.jit  # one compilation instead of one per eager operation
  def run(layer, no_vt, x):
    qh, kh, vh = layer.query(x), layer.key(x), layer.value(x)  # [B, T, N or K, H]
    qn, kn, vn = (jnp.swapaxes(a, 1, 2) for a in (qh, kh, vh))
    scores = jnp.einsum("bnth,bnsh->bnts", qn, jnp.repeat(kn, N // K, 1)) / np.sqrt(H)
    o = layer.learned_modules[0].attend(scores, qn, vn, jnp.tril(jnp.ones((T, T), bool)))
    by_hand = layer.out(jnp.swapaxes(o, 1, 2))
    return layer(x, is_causal=True), no_vt(x, is_causal=True), by_hand

  out, without, by_hand = run(layer, no_vt, x)
  np.testing.assert_allclose(out, by_hand, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(out - without).max()) > 1e-3
