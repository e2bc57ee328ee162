"""A53 adaptive attention pooling (AdaPool, Brothers 2025) and its quantiser analysis: numpy
float64 oracles written from the formulas, padding (a fully padded set), gradients, bf16,
the error bound against the measured error, the NNX layer, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from jaxsoft import nn as jsnn
from jaxsoft import pooling

RNG = np.random.default_rng(53)
B, N, D, DK, DV = 3, 6, 4, 5, 2
X = RNG.standard_normal((B, N, D)).astype(np.float32)
K = RNG.standard_normal((B, N, DK)).astype(np.float32)
V = RNG.standard_normal((B, N, DV)).astype(np.float32)
Q = RNG.standard_normal((DK,)).astype(np.float32)
TOK = np.ones((B, N), bool)
TOK[0, [1, 4]] = False
TOK[2] = False                                   # set 2 fully padded
SIG = np.zeros((B, N), bool)
SIG[:, :3] = True

pool = jax.jit(pooling.adaptive_attention_pool,
               static_argnames=("axis", "keepdims", "normalizer", "scale"))


optimal = jax.jit(lambda x, sig, w: pooling.signal_optimal_pool(x, sig, where=w))
loss2 = jax.jit(lambda z1, z2, x, sig, w: (pooling.signal_loss(z1, x, sig, where=w),
                                          pooling.signal_loss(z2, x, sig, where=w)))


def o_softmax_pool(k, v, q, scale=None):
  """One set of visible tokens, float64."""
  k, v, q = (np.asarray(a, np.float64) for a in (k, v, q))
  s = k @ q * (1 / np.sqrt(k.shape[-1]) if scale is None else scale)
  a = np.exp(s - s.max())
  return (a / a.sum()) @ v


def o_sparsemax(z):
  z = np.asarray(z, np.float64)
  zs = np.sort(z)[::-1]
  cs = np.cumsum(zs)
  r = np.arange(1, z.size + 1)
  kk = r[1 + r * zs > cs].max()
  return np.maximum(z - (cs[kk - 1] - 1) / kk, 0.0)


def test_softmax_pool_matches_float64_oracle_with_padding_and_projections():
  out = np.asarray(pool(X, -2, TOK, query=Q, keys=K, values=V))
  for b in range(B):
    if not TOK[b].any():
      want = np.zeros(DV)                        # documented: a fully padded set gives 0
    else:
      want = o_softmax_pool(K[b][TOK[b]], V[b][TOK[b]], Q)
    # float32 softmax of O(1) scores and a 6-term weighted sum: error ~ 10 * 2^-24 * |v|
    np.testing.assert_allclose(out[b], want, rtol=1e-5, atol=1e-6)


def test_token_axis_keepdims_and_per_set_query():
  qb = RNG.standard_normal((B, D)).astype(np.float32)
  xt = np.moveaxis(X, 1, 0)                                   # [N, B, D], tokens first
  out = np.asarray(pool(xt, 0, TOK.T, query=qb, keepdims=True, scale=0.7))
  assert out.shape == (1, B, D)
  for b in range(2):
    want = o_softmax_pool(X[b][TOK[b]], X[b][TOK[b]], qb[b], scale=0.7)
    np.testing.assert_allclose(out[0, b], want, rtol=1e-5, atol=1e-6)  # as above


def test_any_normalizer_in_the_slot_sparsemax_and_entmax():
  out = np.asarray(pool(X, -2, TOK, query=Q, keys=K, normalizer="sparsemax"))
  for b in range(2):
    s = K[b][TOK[b]].astype(np.float64) @ Q / np.sqrt(DK)
    np.testing.assert_allclose(out[b], o_sparsemax(s) @ X[b][TOK[b]], rtol=1e-5, atol=1e-6)
  # entmax alpha = 2 is sparsemax: its hyperparameter reaches the normalizer
  ent = jax.jit(lambda x, k: pooling.adaptive_attention_pool(
      x, where=TOK, query=Q, keys=k, normalizer="entmax", normalizer_params={"alpha": 2.0}))(X, K)
  np.testing.assert_allclose(np.asarray(ent), out, atol=1e-5)   # bisection vs sort: ~1e-6


def test_zero_query_is_avgpool_and_signal_loss_identity():
  avg = np.asarray(pool(X, -2, TOK, query=np.zeros(D, np.float32)))
  for b in range(2):
    np.testing.assert_allclose(avg[b], X[b][TOK[b]].mean(0), rtol=1e-6, atol=1e-6)
  cen = np.asarray(optimal(X, SIG, TOK))
  for b in range(2):
    np.testing.assert_allclose(cen[b], X[b][SIG[b] & TOK[b]].astype(np.float64).mean(0),
                               rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(cen[2], 0.0)                   # no visible signal: 0
  # L(z) = L(C*) + |z - C*|^2 (float64 arithmetic on float32 inputs: rtol 1e-5)
  lz, lc = (np.asarray(a) for a in loss2(avg, cen, X, SIG, TOK))
  for b in range(2):
    xs = X[b][SIG[b] & TOK[b]].astype(np.float64)
    np.testing.assert_allclose(lz[b], np.mean(np.sum((xs - avg[b]) ** 2, -1)), rtol=1e-5)
    np.testing.assert_allclose(lz[b], lc[b] + np.sum((avg[b] - cen[b]) ** 2), rtol=1e-5)
  assert lz[2] == 0.0


def test_gradients_float64_and_padded_set_has_zero_finite_gradient():
  with jax.enable_x64(True):
    x, k, v, q = (jnp.asarray(a, jnp.float64) for a in (X, K, V, Q))
    f = jax.jit(lambda x, k, v, q: pooling.adaptive_attention_pool(
        x, where=TOK, query=q, keys=k, values=v))
    # central differences in float64: agreement to ~1e-4 relative at eps 1e-6
    check_grads(f, (x, k, v, q), order=1, modes=("rev",), eps=1e-6, atol=1e-4, rtol=1e-4)
    g = jax.jit(jax.grad(lambda x, k, v: jnp.sum(f(x, k, v, q) ** 2), argnums=(0, 1, 2)))(
        x, k, v)
    for gi in g:
      assert np.all(np.isfinite(np.asarray(gi)))
      np.testing.assert_array_equal(np.asarray(gi)[2], 0.0)    # the fully padded set
      np.testing.assert_array_equal(np.asarray(gi)[0, [1, 4]], 0.0)  # padded tokens
    assert f(x, k, v, q).dtype == jnp.float64                   # float64 stays float64


def test_bf16_computes_in_float32():
  xb = jnp.asarray(X, jnp.bfloat16)
  out = pool(xb, -2, TOK, query=jnp.asarray(Q[:D], jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  ref = pool(jnp.asarray(xb, jnp.float32), -2, TOK, query=jnp.asarray(Q[:D], jnp.bfloat16)
             .astype(jnp.float32))
  # one rounding of the float32 result to bf16: 2^-8 relative
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.astype(jnp.bfloat16)))


bound_fn = jax.jit(lambda s, x, sig, where: pooling.adaptive_pool_error_bound(s, x, sig, where=where))


def test_error_bound_holds_and_vanishes_with_margin():
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((64, 8, 3))
  sig = rng.random((64, 8)) < 0.4
  sig[:, 0] = True
  scores = rng.standard_normal((64, 8)) * 2.0
  vis = np.ones((64, 8), bool)
  # the same shapes in every call: one compiled program
  x32 = xs.astype(np.float32)
  bound = np.asarray(bound_fn(scores.astype(np.float32), x32, sig, vis))
  for i in range(64):
    a = np.exp(scores[i] - scores[i].max())
    a /= a.sum()
    err = np.linalg.norm(a @ xs[i] - xs[i][sig[i]].mean(0))
    assert err <= bound[i] * (1 + 1e-5) + 1e-6, (i, err, bound[i])   # float32 rounding
  # equal signal scores, distractors 30 below: bound ~ (m/k) e^-30 |x_j - C*| < 1e-11
  s2 = np.where(sig, 5.0, -25.0).astype(np.float32)
  assert np.all(np.asarray(bound_fn(s2, x32, sig, vis)) < 1e-11)
  # no visible distractor and equal signal scores: exactly 0
  np.testing.assert_array_equal(np.asarray(bound_fn(s2, x32, sig, sig)), 0.0)
  nosig = np.asarray(bound_fn(s2, x32, np.zeros((64, 8), bool), vis))
  assert np.isinf(nosig).all()


def test_oracle_query():
  ms, mn = RNG.standard_normal(D), RNG.standard_normal(D)
  q = np.asarray(pooling.snr_oracle_query(ms, mn, beta=3.0))
  want = 3.0 * (ms - mn) / np.linalg.norm(ms - mn)
  np.testing.assert_allclose(q, want, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(pooling.snr_oracle_query(ms, ms)), 0.0)


@nnx.jit
def _layer_check(layer):
  z = layer(X, where=TOK)
  grads = nnx.grad(lambda m: jnp.sum(m(X, where=TOK)[:, 0]))(layer)
  return z, layer.value_proj(X), grads.query[...]


def test_layer_starts_as_avgpool_trains_and_projects():
  layer = jsnn.AdaptiveAttentionPool(D, key_features=DK, out_features=DV, use_key_proj=True,
                                     use_value_proj=True, rngs=nnx.Rngs(0))
  z, vals, gq = (np.asarray(a) for a in _layer_check(layer))
  assert z.shape == (B, DV)
  # query 0 at init: uniform weights, the mean of the projected values (float32: 1e-5)
  np.testing.assert_allclose(z[0], vals[0][TOK[0]].mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(z[2], 0.0)
  assert np.abs(gq).sum() > 0                                        # the query learns


@pytest.mark.parametrize("call, match", [
    (lambda: pooling.adaptive_attention_pool(X, query=np.zeros(3)), "`query`"),
    (lambda: pooling.adaptive_attention_pool(X, query=np.zeros((2, D))), "`query`"),
    (lambda: pooling.adaptive_attention_pool(X, query=Q, keys=K[:, :2]), "`keys`"),
    (lambda: pooling.adaptive_attention_pool(X, query=Q[:D], values=V[:1]), "`values`"),
    (lambda: pooling.adaptive_attention_pool(X, query=Q[:D], scale=-1.0), "`scale`"),
    (lambda: pooling.adaptive_attention_pool(X, -1, query=Q[:D]), "`axis`"),
    (lambda: pooling.adaptive_attention_pool(X, query=Q[:D], where=np.ones(5, bool)),
     "`where`"),
    (lambda: pooling.signal_optimal_pool(X, np.ones(5, bool)), "`signal`"),
    (lambda: pooling.signal_loss(np.zeros(D), X, SIG), "`z`"),
    (lambda: pooling.adaptive_pool_error_bound(np.zeros(N), X, SIG), "`scores`"),
    (lambda: pooling.snr_oracle_query(np.ones(D), np.zeros(D), beta=0.0), "`beta`"),
    (lambda: pooling.snr_oracle_query(np.ones(D), np.zeros(3)), "`mu_signal`"),
    (lambda: jsnn.AdaptiveAttentionPool(D, key_features=3, rngs=nnx.Rngs(0)),
     "`key_features`"),
    (lambda: jsnn.AdaptiveAttentionPool(0, rngs=nnx.Rngs(0)), "in_features"),
])
def test_bad_input_names_the_argument(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_unknown_normalizer_is_refused():
  with pytest.raises((KeyError, ValueError), match="nope"):
    pooling.adaptive_attention_pool(X, query=Q[:D], normalizer="nope")
