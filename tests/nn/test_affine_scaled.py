"""A15 input-dependent affine-scaled attention (js.nn.AffineScaled): alpha(q) and the tied or
free bias against a float64 NumPy reference of the formula, with masks, gradients, bf16,
errors, and the module inside MultiHeadAttention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsoft as js
from tests import helpers

B, N, T, H = 2, 3, 5, 4
D = N * H


def _module(free_bias):
  aff = js.nn.AffineScaled(N, H, alpha_init=np.array([0.5, 1.0, 2.0]), free_bias=free_bias)
  aff.alpha_kernel[...] = helpers.normal(11, (N, H), 0.5)
  if free_bias:
    aff.bias_kernel[...] = helpers.normal(12, (N, H), 0.5)
    aff.bias_bias[...] = jnp.array([0.2, -0.3, 0.1])
  return aff


def _softplus(z):
  return np.logaddexp(0.0, z)


def _reference(aff, scores, q, mask, a_kernel=None):
  """float64: alpha = softplus(a . q + c); beta = (1 - alpha) / n (tied) or
  (e . q + f) / n (free), n the visible keys; w = alpha softmax(x) + beta on visible keys."""
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  x, qd = f64(scores), f64(q)
  mask = np.broadcast_to(mask, x.shape)
  n = mask.sum(-1, keepdims=True)
  a = f64(aff.alpha_kernel[...]) if a_kernel is None else a_kernel
  alpha = _softplus(np.einsum("bnth,nh->bnt", qd, a)
                    + f64(aff.alpha_bias[...])[:, None])[..., None]
  if aff.free_bias:
    mass = (np.einsum("bnth,nh->bnt", qd, f64(aff.bias_kernel[...]))
            + f64(aff.bias_bias[...])[:, None])[..., None]
    beta = mass / np.maximum(n, 1)
  else:
    beta = (1.0 - alpha) / np.maximum(n, 1)
  z = np.where(mask, x, -np.inf)
  e = np.where(mask, np.exp(z - np.where(n > 0, z.max(-1, keepdims=True), 0.0)), 0.0)
  p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  return np.where(mask, alpha * p + beta, 0.0), alpha


def test_formula_masks_gradients_and_bf16():
  scores = helpers.normal(0, (B, N, T, T), 1.5)
  q = helpers.normal(1, (B, N, T, H))
  mask = np.tril(np.ones((T, T), bool)) & np.ones((B, 1, 1, T), bool)
  mask[1, ..., 3:] = False          # batch 1: two padded keys
  mask[1, :, 0] = False             # and a query that sees no key
  tied, free = _module(False), _module(True)
  gd_t, st_t = nnx.split(tied)
  gd_f, st_f = nnx.split(free)

  @jax.jit
  def run(st_t, st_f, scores, q):
    t, f = nnx.merge(gd_t, st_t), nnx.merge(gd_f, st_f)
    loss = lambda s, st: jnp.sum(nnx.merge(gd_f, st)(s, q, mask) ** 2)  # noqa: E731
    return (t(scores, q, mask), f(scores, q, mask), f.alpha(q),
            jax.grad(loss, argnums=(0, 1))(scores, st_f),
            f(scores.astype(jnp.bfloat16), q, mask))

  out_t, out_f, alpha, (g_s, g_st), out_bf16 = run(st_t, st_f, scores, q)
  want_t, want_alpha = _reference(tied, scores, q, mask)
  want_f, _ = _reference(free, scores, q, mask)
  # float32: a softmax of 5 entries ~3 and an affine map (a few 2^-24 roundings of ~2)
  for got, want in ((out_t, want_t), (out_f, want_f)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(alpha, want_alpha, rtol=1e-6)
  # the data reach both sides of alpha = 1; tied rows sum to 1, free rows to alpha + b
  assert want_alpha.min() < 0.7 and want_alpha.max() > 1.3
  vis = np.asarray(mask).any(-1)
  np.testing.assert_allclose(np.asarray(out_t).sum(-1)[np.broadcast_to(vis, (B, N, T))], 1.0,
                             rtol=1e-5)
  assert np.all(np.asarray(out_f)[1, :, 0] == 0) and np.all(np.asarray(out_t)[1, :, 0] == 0)
  # gradients against central differences of the float64 reference along a random
  # direction (h = 1e-5: truncation ~h^2 * 1e2, float64 rounding ~1e-16 / h)
  rng = np.random.default_rng(3)
  g_a = np.asarray(g_st["alpha_kernel"][...])
  for arg, g in (("scores", g_s), ("alpha_kernel", g_a)):
    d = rng.normal(size=np.shape(g))

    def ref_loss(t, arg=arg, d=d):
      s = np.asarray(scores, np.float64) + (t * d if arg == "scores" else 0.0)
      a = np.asarray(free.alpha_kernel[...], np.float64) + (t * d if arg != "scores" else 0.0)
      return np.sum(_reference(free, s, q, mask, a)[0] ** 2)

    fd = (ref_loss(1e-5) - ref_loss(-1e-5)) / 2e-5
    np.testing.assert_allclose(np.sum(np.asarray(g) * d), fd, rtol=1e-3, atol=1e-5)
  # bf16 scores: bf16 weights computed in float32 from the rounded scores (8-bit output:
  # 2^-9 relative of weights up to ~2)
  assert out_bf16.dtype == jnp.bfloat16
  rb = np.asarray(scores.astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(out_bf16, np.float32),
                             _reference(free, rb, q, mask)[0], atol=1e-2)


@pytest.mark.slow  # three layers compiled (~5 s)
def test_in_multi_head_attention():
  x = helpers.normal(20, (B, T, D))
  kvlen = jnp.array([T, T - 2])
  kw = dict(is_causal=True, key_value_seq_lengths=kvlen)
  free = js.nn.AffineScaled(N, H, free_bias=True)
  layer = js.nn.MultiHeadAttention(N, D, normalizer="affine_softmax", learned=(free,),
                                   rngs=nnx.Rngs(70))
  ref = js.nn.MultiHeadAttention(N, D, rngs=nnx.Rngs(70))  # softmax, the same projections
  trained = _module(True)
  layer2 = js.nn.MultiHeadAttention(N, D, normalizer="affine_softmax", learned=(trained,),
                                    rngs=nnx.Rngs(70))

  @nnx.jit  # one compilation instead of one per eager operation
  def run(layer, ref, layer2, x):
    # the layer's output by hand: scores q.k / sqrt(H) under its causal and padding mask,
    # the module's weights (n from the mask), the output projection
    qh, kh, vh = layer2.query(x), layer2.key(x), layer2.value(x)     # [B, T, N, H]
    scores = jnp.einsum("btnh,bsnh->bnts", qh, kh) / np.sqrt(H)
    mask = (jnp.tril(jnp.ones((T, T), bool))[None, None]
            & (jnp.arange(T)[None, :] < kvlen[:, None])[:, None, None, :])
    w = layer2.learned_modules[0](scores, jnp.swapaxes(qh, 1, 2), mask)
    by_hand = layer2.out(jnp.einsum("bnts,bsnh->btnh", w, vh))
    return layer(x, **kw), ref(x, **kw), layer2(x, **kw), by_hand

  at_init, softmax_out, out2, by_hand = run(layer, ref, layer2, x)
  # at init (alpha = 1, no bias mass) the module is softmax
  np.testing.assert_allclose(at_init, softmax_out, rtol=1e-5, atol=1e-6)
  # trained: the layer passes its visible counts (padding included) to the free bias
  np.testing.assert_allclose(out2, by_hand, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(out2 - softmax_out).max()) > 1e-3


def test_errors_name_the_module_and_argument():
  free = js.nn.AffineScaled(N, H, free_bias=True)
  q = helpers.normal(21, (B, N, T, H))
  helpers.check_raises(
      (r"AffineScaled: `alpha_init` must be > 0", lambda: js.nn.AffineScaled(N, H,
                                                                             alpha_init=0.0)),
      (r"AffineScaled: `free_bias` must be a bool", lambda: js.nn.AffineScaled(N, H,
                                                                               free_bias=1)),
      (r"AffineScaled: `alpha_init` must be a float or an array of shape \[num_heads\]",
       lambda: js.nn.AffineScaled(N, H, alpha_init=np.ones(N + 1))),
      (r"AffineScaled: `n_visible` is needed", lambda: free.attention_hyperparams(q, None)),
      (r"AffineScaled: `bias_mass` needs `free_bias=True`",
       lambda: js.nn.AffineScaled(N, H).bias_mass(q)),
      (r"AffineScaled: `q` must have shape \[B, 3, T, 4\]", lambda: free.alpha(q[..., :2])),
      (r"belongs to normalizer 'affine_softmax'",
       lambda: js.nn.MultiHeadAttention(N, D, learned=(free,), rngs=nnx.Rngs(0))),
  )
