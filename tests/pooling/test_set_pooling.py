"""A23 attention_pool (SimPool), N35 ggem and entropic-OT pooling of token sets, against
numpy float64 oracles written from the formulas, plus limits, masking, gradients, dtypes
and bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxsoft import pooling

RNG = np.random.default_rng(1)
B, N, D = 2, 6, 4
X = RNG.standard_normal((B, N, D)).astype(np.float32)
TOK = np.ones((B, N), bool)
TOK[0, [1, 4]] = False
PROTOS = RNG.standard_normal((3, D)).astype(np.float32)

attention_pool = jax.jit(pooling.attention_pool, static_argnames=("axis", "keepdims"))
ot_pool = jax.jit(pooling.entropic_ot_pool, static_argnames=("axis", "keepdims", "num_iters"))
ot_weights = jax.jit(pooling.entropic_ot_weights, static_argnames=("axis", "num_iters"))


# ------------------------------------------------------------------ float64 oracles


def o_attention_pool(x, query=None, keys=None, gamma=2.0, eps=1e-6):
  """One pool: x [n, d] (visible tokens only)."""
  x = np.asarray(x, np.float64)
  k = x if keys is None else np.asarray(keys, np.float64)
  q = k.mean(0) if query is None else np.asarray(query, np.float64)
  s = k @ q / np.sqrt(k.shape[-1])
  a = np.exp(s - s.max())
  a /= a.sum()
  if gamma is None:
    return a @ x
  m = x.min(0)
  return (a @ (x - m + eps) ** gamma) ** (1 / gamma) + m - eps


def o_sinkhorn_weights(x, protos, mu, eps, iters=2000):
  """One pool, converged Sinkhorn in the kernel (probability) domain, float64."""
  x, w = np.asarray(x, np.float64), np.asarray(protos, np.float64)
  n, m = len(x), len(w)
  cost = ((x[:, None, :] - w[None]) ** 2).sum(-1)
  cols = [np.full(m, mu / m)] + ([np.array([1 - mu])] if mu < 1 else [])
  b = np.concatenate(cols)
  c = np.concatenate([cost, np.zeros((n, 1))], 1)[:, :len(b)]
  kern = np.exp(-c / eps)
  a = np.full(n, 1.0 / n)
  u, v = np.ones(n), np.ones(len(b))
  for _ in range(iters):
    v = b / (kern.T @ u)
    u = a / (kern @ v)
  pi = u[:, None] * kern * v[None]
  p = pi[:, :m].sum(1)
  return p / p.sum()


# ------------------------------------------------------------------ attention_pool (A23)


def test_attention_pool_matches_oracle_with_token_mask():
  for gamma in (2.0, None, 0.5):
    out = attention_pool(X, where=TOK, gamma=gamma)
    assert out.shape == (B, D) and out.dtype == jnp.float32
    want = [o_attention_pool(X[b][TOK[b]], gamma=gamma) for b in range(B)]
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  keys = RNG.standard_normal((B, N, 3)).astype(np.float32)
  query = RNG.standard_normal((B, 3)).astype(np.float32)
  out = attention_pool(X, where=TOK, keys=keys, query=query)
  want = [o_attention_pool(X[b][TOK[b]], query=query[b], keys=keys[b][TOK[b]]) for b in range(B)]
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_attention_pool_limits_and_invariances():
  # A zero query gives uniform attention: the power mean; with gamma = 1 the mean (GAP).
  zero_q = np.zeros((B, D), np.float32)
  np.testing.assert_allclose(attention_pool(X, query=zero_q, gamma=None), X.mean(1), atol=1e-6)
  np.testing.assert_allclose(attention_pool(X, query=zero_q, gamma=1.0), X.mean(1), atol=2e-6)
  xt = np.moveaxis(X, 1, -1).astype(np.float64)
  pm = (np.mean((xt - xt.min(-1, keepdims=True) + 1e-6) ** 2, -1)) ** 0.5 + xt.min(-1) - 1e-6
  np.testing.assert_allclose(attention_pool(X, query=zero_q), pm, atol=1e-5)
  out = attention_pool(X)
  assert np.all(out >= X.min(1) - 1e-6) and np.all(out <= X.max(1) + 1e-6)
  perm = RNG.permutation(N)
  np.testing.assert_allclose(attention_pool(X[:, perm]), out, rtol=1e-5, atol=1e-6)
  # The weights come from jaxsoft's softmax: they sum to 1 (gamma=1 pools a constant exactly).
  np.testing.assert_allclose(attention_pool(np.full((B, N, D), 2.5, np.float32)), 2.5, rtol=1e-6)


def test_attention_pool_masking_is_deleting_and_fully_masked_is_zero():
  keep = np.ones(N, bool)
  keep[[0, 3]] = False
  where = np.stack([keep, np.zeros(N, bool)])  # pool 1 has no visible token

  def loss_m(v):
    out = attention_pool(v, where=where)
    return jnp.sum(out[0] ** 2) + jnp.sum(out[1]), out[1]

  f_m = jax.jit(jax.value_and_grad(loss_m, has_aux=True))
  f_d = jax.jit(jax.value_and_grad(lambda v: jnp.sum(attention_pool(v[:1, keep]) ** 2)))
  ((vm, empty), gm), (vd, gd) = f_m(X), f_d(X)
  chex.assert_trees_all_close(vm, vd, rtol=1e-5)
  np.testing.assert_array_equal(empty, 0.0)
  np.testing.assert_array_equal(gm[0, ~keep], 0.0)
  np.testing.assert_array_equal(gm[1], 0.0)
  chex.assert_trees_all_close(gm[0, keep], gd[0, keep], rtol=1e-4, atol=1e-6)
  (vb, _), gb = f_m(np.where(where[..., None], X, np.nan))  # masked tokens may hold anything
  chex.assert_trees_all_close((vb, gb), (vm, gm), rtol=1e-6)


def test_attention_pool_gradient_float64_axis_keepdims_bf16_vmap():
  with jax.enable_x64(True):
    x64 = jnp.asarray(X[:, :4, :3], jnp.float64)
    check_grads(jax.jit(lambda v: attention_pool(v, where=TOK[:, :4])), (x64,), order=1,
                modes=("rev",),
                atol=1e-6, rtol=1e-6)
  xt = np.moveaxis(X, 1, 0)  # [N, B, D], tokens first
  out = attention_pool(xt, axis=0, where=TOK.T, keepdims=True)
  assert out.shape == (1, B, D)
  np.testing.assert_allclose(out[0], attention_pool(X, where=TOK), rtol=1e-5, atol=1e-6)
  xb = jnp.asarray(X, jnp.bfloat16)
  ob = attention_pool(xb, where=TOK)
  assert ob.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(ob, np.float32), attention_pool(xb.astype(jnp.float32),
                             where=TOK), rtol=2e-2, atol=2e-2)
  vm = jax.jit(jax.vmap(lambda v, m: pooling.attention_pool(v, where=m)))(X, TOK)
  np.testing.assert_allclose(vm, attention_pool(X, where=TOK), rtol=1e-6, atol=1e-6)
  assert attention_pool(np.zeros((2, 0, 3), np.float32)).shape == (2, 3)
  np.testing.assert_array_equal(attention_pool(np.zeros((2, 0, 3), np.float32)), 0.0)


def test_attention_pool_bad_input():
  x = jnp.asarray(X)
  with pytest.raises(ValueError, match="axis"):
    pooling.attention_pool(x, axis=-1)
  with pytest.raises(ValueError, match="where"):
    pooling.attention_pool(x, where=np.ones((B, N, D), bool))
  with pytest.raises(ValueError, match="`gamma`"):
    pooling.attention_pool(x, gamma=0.0)
  with pytest.raises(ValueError, match="`query`"):
    pooling.attention_pool(x, query=np.zeros((B, D + 1)))
  with pytest.raises(ValueError, match="`keys`"):
    pooling.attention_pool(x, keys=np.zeros((B, N + 1, D)))
  with pytest.raises(ValueError, match="rank"):
    pooling.attention_pool(jnp.ones(3))


# ------------------------------------------------------------------ ggem


def test_ggem_groups():
  pos = np.abs(X) + 0.1
  ggem = jax.jit(pooling.ggem, static_argnames=("axis", "keepdims"))
  gem = jax.jit(pooling.gem, static_argnames=("axis", "keepdims"))
  chex.assert_trees_all_close(ggem(pos, p=np.array([2.5])), gem(pos, axis=-2, p=2.5), rtol=1e-6)
  ps = np.array([1.0, 2.0, 3.0, 5.0])
  out = ggem(pos, p=ps)  # G = C: per-channel GeM
  want = np.stack([(np.mean(pos[..., c].astype(np.float64) ** ps[c], -1)) ** (1 / ps[c])
                   for c in range(D)], -1)
  np.testing.assert_allclose(out, want, rtol=2e-5)
  two = ggem(pos, p=np.array([1.0, 4.0]))
  chex.assert_trees_all_close(two, np.concatenate([gem(pos[..., :2], axis=-2, p=1.0),
                                                    gem(pos[..., 2:], axis=-2, p=4.0)], -1),
                              rtol=1e-6)
  g = jax.jit(jax.grad(lambda p: jnp.sum(pooling.ggem(pos, p=p))))(jnp.array([1.5, 3.0]))
  assert g.shape == (2,) and np.all(np.isfinite(g))
  with pytest.raises(ValueError, match="groups"):
    pooling.ggem(pos, p=np.ones(3))
  with pytest.raises(ValueError, match="`p`"):
    pooling.ggem(pos, p=np.array([1.0, 0.0]))
  with pytest.raises(ValueError, match="axis"):
    pooling.ggem(pos, axis=-1, p=np.ones(2))


# ------------------------------------------------------------------ entropic-OT pooling


def test_entropic_ot_matches_converged_sinkhorn_oracle():
  for mu, eps in ((0.5, 1.0), (0.3, 2.0)):
    w = ot_weights(X, where=TOK, prototypes=PROTOS, mu=mu, epsilon=eps, num_iters=300)
    assert w.shape == (B, N)
    for b in range(B):
      want = o_sinkhorn_weights(X[b][TOK[b]], PROTOS, mu, eps)
      np.testing.assert_allclose(w[b][TOK[b]], want, rtol=1e-4, atol=1e-5)
      np.testing.assert_array_equal(w[b][~TOK[b]], 0.0)
    out = ot_pool(X, where=TOK, prototypes=PROTOS, mu=mu, epsilon=eps, num_iters=300)
    np.testing.assert_allclose(out, np.einsum("bn,bnd->bd", w, X), rtol=1e-5, atol=1e-6)


def test_entropic_ot_limits():
  # mu = 1: every token sends all its mass to the prototypes: the mean (GAP).
  out = ot_pool(X, where=TOK, prototypes=PROTOS, mu=1.0, num_iters=5)
  want = np.stack([X[b][TOK[b]].mean(0) for b in range(B)])
  np.testing.assert_allclose(out, want, atol=1e-6)
  # small epsilon with one prototype: uniform weights on the k = mu * n nearest tokens.
  x = np.array([[[0.0], [3.0], [0.5], [4.0], [-0.8], [2.0]]], np.float32)
  w = ot_weights(x, prototypes=np.zeros((1, 1), np.float32), mu=0.5, epsilon=0.01,
                 num_iters=200)
  np.testing.assert_allclose(w[0], [1 / 3, 0, 1 / 3, 0, 1 / 3, 0], atol=5e-3)
  assert np.all(w[0, [1, 3, 5]] < 1e-6)
  w = ot_weights(X, where=TOK, prototypes=PROTOS, mu=0.4, epsilon=0.5, num_iters=20)
  assert np.all(w >= 0)
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  perm = RNG.permutation(N)
  w_p = ot_weights(X[:, perm], where=TOK[:, perm], prototypes=PROTOS, mu=0.4, epsilon=0.5,
                   num_iters=20)
  np.testing.assert_allclose(w_p, w[:, perm], rtol=1e-5, atol=1e-7)


def test_entropic_ot_masking_gradient_and_dtypes():
  keep = TOK[0]
  where = np.stack([keep, np.zeros(N, bool)])  # pool 1 has no visible token
  kw = dict(mu=0.5, epsilon=0.5, num_iters=10)

  def loss_m(v, p):
    out = pooling.entropic_ot_pool(v, where=where, prototypes=p, **kw)
    return jnp.sum(out[0] ** 2) + jnp.sum(out[1]), out[1]

  f_m = jax.jit(jax.value_and_grad(loss_m, argnums=(0, 1), has_aux=True))
  f_d = jax.jit(jax.value_and_grad(
      lambda v, p: jnp.sum(pooling.entropic_ot_pool(v[:1, keep], prototypes=p, **kw) ** 2),
      argnums=(0, 1)))
  ((vm, empty), (gm, gpm)), (vd, (gd, gpd)) = f_m(X, PROTOS), f_d(X, PROTOS)
  chex.assert_trees_all_close(vm, vd, rtol=1e-5)
  np.testing.assert_array_equal(empty, 0.0)
  np.testing.assert_array_equal(gm[0, ~keep], 0.0)
  np.testing.assert_array_equal(gm[1], 0.0)
  chex.assert_trees_all_close(gm[0, keep], gd[0, keep], rtol=1e-4, atol=1e-6)
  chex.assert_trees_all_close(gpm, gpd, rtol=1e-4, atol=1e-6)
  (vb, _), gb = f_m(np.where(where[..., None], X, np.inf), PROTOS)
  chex.assert_trees_all_close((vb, gb[0]), (vm, gm), rtol=1e-6)
  with jax.enable_x64(True):
    x64 = jnp.asarray(X[:, :4, :2], jnp.float64)
    p64 = jnp.asarray(PROTOS[:2, :2], jnp.float64)
    check_grads(jax.jit(lambda v, p: pooling.entropic_ot_pool(v, prototypes=p, mu=0.6,
                                                              epsilon=0.7, num_iters=4)),
                (x64, p64), order=1,
                modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_entropic_ot_bf16_axis_keepdims_vmap():
  kw = dict(prototypes=PROTOS, mu=0.5, epsilon=0.5, num_iters=10)
  xb = jnp.asarray(X, jnp.bfloat16)
  ob = ot_pool(xb, **kw)
  assert ob.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(ob, np.float32), ot_pool(xb.astype(jnp.float32), **kw),
                             rtol=2e-2, atol=2e-2)
  out = ot_pool(np.moveaxis(X, 1, 0), axis=0, keepdims=True, **kw)
  assert out.shape == (1, B, D)
  np.testing.assert_allclose(out[0], ot_pool(X, **kw), rtol=1e-5, atol=1e-6)
  vm = jax.jit(jax.vmap(lambda v: pooling.entropic_ot_pool(v, **kw)))(X)
  np.testing.assert_allclose(vm, ot_pool(X, **kw), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw,match", [
    (dict(mu=0.0), "`mu`"), (dict(mu=1.5), "`mu`"), (dict(epsilon=0.0), "`epsilon`"),
    (dict(num_iters=-1), "`num_iters`"), (dict(num_iters=2.5), "`num_iters`"),
    (dict(prototypes=np.zeros((2, D + 1))), "`prototypes`"), (dict(axis=-1), "axis"),
    (dict(where=np.ones((B, N, D), bool)), "where"),
])
def test_entropic_ot_bad_input(kw, match):
  args = {"prototypes": PROTOS, **kw}
  with pytest.raises(ValueError, match=match):
    pooling.entropic_ot_pool(jnp.asarray(X), **args)
