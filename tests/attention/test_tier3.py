"""A19 multiscreen_attention, A22 uniattn / uniattn_shared_map, A25 infsa_attention
(jaxsoft/attention/_tier3.py).

Oracles: numpy float64 written from each formula (cosine similarities and the screening
rule, a masked softmax map, the Neumann kernel by numpy.linalg.solve), exact reductions
(UniAttn with the first block's own queries and keys, InfSA at gamma = 0), closed forms
(row-stochastic kernels, the truncation bound) and float64 finite differences.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention
from jaxsoft.attention._tier3 import (
    infsa_attention,
    multiscreen_attention,
    uniattn,
    uniattn_shared_map,
)
from tests.helpers import check_raises, make_qkv, normal

B, T, N, K, H, HV = 2, 5, 4, 2, 3, 2


def _f64(*a):
  return [np.asarray(x, np.float64) for x in a]


def _np_visible(mask, causal, T, S):
  vis = np.ones((B, N, T, S), bool) if mask is None else np.broadcast_to(
      np.asarray(mask), (B, N, T, S)).copy()
  if causal:
    vis &= np.tril(np.ones((T, S), bool))
  return vis


def _np_softmax_map(q, k, vis):
  q, k = _f64(q, k)
  G = q.shape[2] // k.shape[2]
  kk = np.repeat(k, G, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(q.shape[-1])
  logits = np.where(vis, logits, -np.inf)
  m = np.max(logits, -1, keepdims=True)
  e = np.where(vis, np.exp(logits - np.where(np.isfinite(m), m, 0.0)), 0.0)
  d = e.sum(-1, keepdims=True)
  return np.where(d > 0, e / np.where(d > 0, d, 1.0), 0.0)


def _apply(a, v):  # [B, N, T, S] x [B, S, K, Hv] -> [B, T, N, Hv]
  G = a.shape[1] // v.shape[2]
  return np.einsum("bnts,bsnh->btnh", a, np.repeat(np.asarray(v, np.float64), G, axis=2))


def _rand_mask(seed, T, S):
  m = np.random.default_rng(seed).random((B, 1, T, S)) < 0.7
  m[..., 0] = True
  return jnp.asarray(m)


# ------------------------------------------------------------------------------- A19


def _np_multiscreen(q, k, v, theta, power, vis):
  q, k, v = _f64(q, k, v)
  G = q.shape[2] // k.shape[2]
  qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
  kn = np.repeat(k / np.linalg.norm(k, axis=-1, keepdims=True), G, axis=2)
  s = np.einsum("btnh,bsnh->bnts", qn, kn)
  th = np.broadcast_to(np.asarray(theta, np.float64), (N,))[None, :, None, None]
  pw = np.broadcast_to(np.asarray(power, np.float64), (N,))[None, :, None, None]
  w = np.clip((s - th) / (1 - th), 0, 1) ** pw
  w = np.where(vis, w, 0.0)
  return _apply(w, v), w


def test_multiscreen_matches_numpy_causal_masked_gqa_and_bf16():
  q, k, v = make_qkv(0, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  mask = _rand_mask(1, T, T)
  theta = jnp.array([0.0, 0.2, -0.3, 0.5])
  power = jnp.array([1.0, 2.0, 0.5, 1.5])
  for causal in (False, True):
    fn = jax.jit(functools.partial(multiscreen_attention, is_causal=causal, theta=theta,
                                   power=power))
    out = fn(q, k, v, None, mask)
    want, w = _np_multiscreen(q, k, v, theta, power, _np_visible(mask, causal, T, T))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-5, rtol=1e-5)
    assert np.all((w >= 0) & (w <= 1)) and np.any(w == 0) and np.any(w > 0)
  lo = jax.jit(multiscreen_attention)(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
  assert lo.dtype == jnp.bfloat16
  want, _ = _np_multiscreen(*(a.astype(jnp.bfloat16) for a in (q, k, v)), 0.0, 1.0,
                            _np_visible(None, False, T, T))
  np.testing.assert_allclose(np.asarray(lo, np.float64), want, atol=5e-2, rtol=5e-2)


def test_multiscreen_irrelevant_keys_no_relevant_key_and_extremes():
  # queries span dims 0-1, the appended keys dims 2-3: cosine 0 < theta, so they are screened
  q = normal(0, (B, T, N, 4)).at[..., 2:].set(0.0)
  k = normal(1, (B, T, K, 4))
  v = normal(2, (B, T, K, HV))
  extra_k = normal(3, (B, 3, K, 4)).at[..., :2].set(0.0)
  extra_v = normal(4, (B, 3, K, HV), scale=100.0)
  fn = jax.jit(functools.partial(multiscreen_attention, theta=0.3))
  base = fn(q, k, v)
  more = fn(q, jnp.concatenate([k, extra_k], 1), jnp.concatenate([v, extra_v], 1))
  np.testing.assert_allclose(np.asarray(more), np.asarray(base), atol=1e-6)
  # softmax fails this invariance
  sm = jax.jit(dot_product_attention)(q, k, v)
  sm_more = jax.jit(dot_product_attention)(q, jnp.concatenate([k, extra_k], 1),
                                           jnp.concatenate([v, extra_v], 1))
  assert float(jnp.max(jnp.abs(sm - sm_more))) > 1e-2
  # a query whose every key is below the threshold outputs exactly 0
  zero = fn(q, jnp.broadcast_to(extra_k[:, :1], (B, T, K, 4)), v)
  assert float(jnp.max(jnp.abs(zero))) == 0.0
  # huge, tiny and zero inputs: finite, and the gradient too
  vg = jax.jit(jax.value_and_grad(lambda qq, kk: jnp.sum(multiscreen_attention(qq, kk, v)),
                                  argnums=(0, 1)))
  for s in (1e30, 1e-30, 0.0):
    out, g = vg(q * s, k * s)
    assert np.all(np.isfinite(np.asarray(out)))
    assert all(np.all(np.isfinite(np.asarray(t))) for t in g)


def test_multiscreen_gradients_finite_differences():
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in make_qkv(5, B=1, T=3, N=2, K=1, H=3, Hv=2))
    fn = jax.jit(lambda q, k, v, th: multiscreen_attention(
        q, k, v, is_causal=True, theta=th, power=2.0))
    jax.test_util.check_grads(fn, (q, k, v, jnp.array([-0.2, 0.1])), order=1, modes=("rev",))


# ------------------------------------------------------------------------------- A22


def test_uniattn_with_the_blocks_own_map_is_exact_attention():
  q, k, _ = make_qkv(0, B=B, T=T, N=N, K=K, H=H)
  values = normal(1, (3, B, T, K, HV))
  mask = _rand_mask(2, T, T)
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([5, 3]))
  a = jax.jit(functools.partial(uniattn_shared_map, **kw))(q, k, None, mask)
  # rows are stochastic where a key is visible
  np.testing.assert_allclose(np.asarray(jnp.sum(a, -1)), 1.0, atol=1e-6)
  x = normal(3, (3, B, T, 6))
  w0 = jnp.zeros((3, 6, N, HV))
  out = jax.jit(uniattn)(a, values, x, w0)
  dpa = jax.jit(functools.partial(dot_product_attention, **kw))
  for layer in range(3):
    want = dpa(q, k, values[layer], None, mask)
    np.testing.assert_allclose(np.asarray(out[layer]), np.asarray(want), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(a, np.float64), _np_softmax_map(
      q, k, _np_visible(mask, True, T, T) & (np.arange(T) < np.array([5, 3])[:, None])[
          :, None, None, :]), atol=1e-6)
  single = jax.jit(uniattn)(a, values[1])
  np.testing.assert_allclose(np.asarray(single), np.asarray(out[1]), atol=1e-6)


def test_uniattn_compensation_matches_numpy_bf16_and_grads():
  a = jax.nn.softmax(normal(0, (B, N, T, 4)), -1)
  values = normal(1, (2, B, 4, K, HV))
  x = normal(2, (2, B, T, 3))
  w_c = normal(3, (2, 3, N, HV))
  out = jax.jit(uniattn)(a, values, x, w_c)
  want = np.stack([_apply(np.asarray(a, np.float64), values[i])
                   + np.einsum("btc,cnh->btnh", *_f64(x[i], w_c[i])) for i in range(2)])
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-5, rtol=1e-5)
  lo = jax.jit(uniattn)(a, values.astype(jnp.bfloat16), x.astype(jnp.bfloat16), w_c)
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float64), want, atol=6e-2, rtol=3e-2)
  with jax.enable_x64(True):
    args = [jnp.asarray(t, jnp.float64) for t in (a[:1, :, :3], values[:, :1], x[:, :1, :3],
                                                  w_c)]
    jax.test_util.check_grads(jax.jit(uniattn), args, order=1, modes=("rev",))
    q, k, _ = (t.astype(jnp.float64) for t in make_qkv(4, B=1, T=3, N=2, K=1, H=2))
    jax.test_util.check_grads(jax.jit(functools.partial(uniattn_shared_map, is_causal=True)),
                              (q, k),
                              order=1, modes=("rev",))


# ------------------------------------------------------------------------------- A25


def _np_infsa(q, k, v, gamma, vis, normalize=False):
  a = _np_softmax_map(q, k, vis)
  g = np.broadcast_to(np.asarray(gamma, np.float64), (N,))[None, :, None, None]
  kern = np.linalg.solve(np.eye(a.shape[-1]) - g * a, a)  # (I - gamma A)^-1 A
  kern = ((1 - g) if normalize else g) * kern
  return _apply(kern, v)


def test_infsa_exact_matches_numpy_and_series_converges():
  q, k, v = make_qkv(0, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  mask = _rand_mask(1, T, T)
  gamma = jnp.array([0.9, -0.5, 0.3, 0.7])
  for causal in (False, True):
    vis = _np_visible(mask, causal, T, T)
    exact = jax.jit(functools.partial(infsa_attention, gamma=gamma, is_causal=causal))(
        q, k, v, None, mask)
    np.testing.assert_allclose(np.asarray(exact, np.float64), _np_infsa(q, k, v, gamma, vis),
                               atol=1e-5, rtol=1e-5)
  want = _np_infsa(q, k, v, 0.8, _np_visible(None, True, T, T))
  bound_scale = float(jnp.max(jnp.abs(v))) / (1 - 0.8)
  errs = []
  for terms in (1, 3, 9, 80):
    got = jax.jit(functools.partial(infsa_attention, gamma=0.8, terms=terms, is_causal=True))(
        q, k, v)
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    assert err <= 0.8 ** (terms + 1) * bound_scale + 1e-5
    errs.append(err)
  assert errs[0] > errs[1] > errs[2] > errs[3] and errs[-1] < 1e-5


def test_infsa_normalized_kernel_causality_gamma_zero_and_bf16():
  q, k, v = make_qkv(3, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  lengths = jnp.array([5, 3])
  ones = jnp.ones_like(v)
  for terms in (None, 200):
    out = jax.jit(functools.partial(
        infsa_attention, gamma=0.6, terms=terms, normalize=True, is_causal=True))(
            q, k, ones, key_value_seq_lengths=lengths)
    np.testing.assert_allclose(np.asarray(out), 1.0, atol=1e-5)  # row-stochastic kernel
  np.testing.assert_allclose(
      np.asarray(jax.jit(functools.partial(infsa_attention, gamma=0.0, normalize=True,
                                           is_causal=True))(q, k, v)),
      np.asarray(jax.jit(functools.partial(dot_product_attention, is_causal=True))(q, k, v)),
      atol=1e-6)
  # causal: changing the last token changes no earlier output
  k2, v2 = k.at[:, -1].add(3.0), v.at[:, -1].add(5.0)
  for terms in (None, 4):
    f = jax.jit(functools.partial(infsa_attention, gamma=0.9, terms=terms, is_causal=True))
    np.testing.assert_allclose(np.asarray(f(q, k, v)[:, :-1]), np.asarray(f(q, k2, v2)[:, :-1]),
                               atol=1e-5, rtol=1e-5)
    assert float(jnp.max(jnp.abs(f(q, k, v)[:, -1] - f(q, k2, v2)[:, -1]))) > 1e-3
  lo = jax.jit(functools.partial(infsa_attention, gamma=0.5))(
      *(a.astype(jnp.bfloat16) for a in (q, k, v)))
  assert lo.dtype == jnp.bfloat16
  want = _np_infsa(*(a.astype(jnp.bfloat16) for a in (q, k, v)), 0.5,
                   _np_visible(None, False, T, T))
  np.testing.assert_allclose(np.asarray(lo, np.float64), want, atol=3e-2, rtol=3e-2)
  big = jax.jit(functools.partial(infsa_attention, gamma=0.99, terms=3))(q * 1e30, k * 1e30, v)
  assert np.all(np.isfinite(np.asarray(big)))


def test_infsa_gradients_finite_differences():
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in make_qkv(6, B=1, T=3, N=2, K=1, H=2, Hv=2))
    g = jnp.array([0.6, -0.4])
    for terms in (None, 3):
      fn = jax.jit(lambda q, k, v, g, terms=terms: infsa_attention(
          q, k, v, gamma=g, terms=terms, is_causal=True))
      jax.test_util.check_grads(fn, (q, k, v, g), order=1, modes=("rev",))


def test_fully_masked_rows_are_zero_with_zero_gradient():
  q, k, v = make_qkv(8, B=1, T=4, N=2, K=1, H=3, Hv=2)
  mask = jnp.ones((1, 1, 4, 4), bool).at[:, :, 2].set(False)  # query 2 sees no key
  fns = (
      lambda q, k, v: multiscreen_attention(q, k, v, None, mask, theta=-0.5),
      lambda q, k, v: uniattn(uniattn_shared_map(q, k, None, mask), v),
      lambda q, k, v: infsa_attention(q, k, v, None, mask, gamma=0.7),
      lambda q, k, v: infsa_attention(q, k, v, None, mask, gamma=0.7, terms=3),
  )
  for fn in fns:
    out, vjp = jax.vjp(jax.jit(fn), q, k, v)
    assert float(jnp.max(jnp.abs(out[:, 2]))) == 0.0 and float(jnp.max(jnp.abs(out))) > 0
    ct = jnp.zeros_like(out).at[:, 2].set(1.0)  # only the masked row's output
    for g in vjp(ct):
      assert np.all(np.asarray(g) == 0.0)


# ----------------------------------------------------------------------- nnx modules


def test_nn_modules_hold_the_learned_parameters():
  from flax import nnx

  from jaxsoft.nn import InfSA, UniAttnCompensation
  a = jax.nn.softmax(normal(0, (B, N, T, 4)), -1)
  values, x = normal(1, (2, B, 4, K, HV)), normal(2, (2, B, T, 3))
  comp = UniAttnCompensation(2, 3, N, HV)
  np.testing.assert_array_equal(np.asarray(comp(a, values, x)), np.asarray(uniattn(a, values)))
  ct = normal(3, (2, B, T, N, HV))
  grads = nnx.grad(lambda m: jnp.sum(m(a, values, x) * ct))(comp)
  np.testing.assert_allclose(np.asarray(grads.w_c[...]), np.einsum(
      "lbtc,lbtnh->lcnh", *_f64(x, ct)), atol=1e-4, rtol=1e-5)

  q, k, v = make_qkv(4, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  mod = InfSA(N, gamma_init=0.3, terms=4, is_causal=True)
  np.testing.assert_allclose(np.asarray(mod.gamma), 0.3, rtol=1e-6)
  out = mod(q, k, v)
  want = infsa_attention(q, k, v, gamma=jnp.full((N,), 0.3), terms=4, is_causal=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)
  g = nnx.grad(lambda m: jnp.sum(m(q, k, v) ** 2))(mod)
  assert np.all(np.isfinite(np.asarray(g.gamma_logit[...])))
  assert np.all(np.asarray(g.gamma_logit[...]) != 0)
  check_raises(("`gamma_init`", lambda: InfSA(N, gamma_init=1.0)),
               ("`num_heads`", lambda: InfSA(0)),
               ("`head_dim`", lambda: UniAttnCompensation(2, 3, N, 0)))


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
  q, k, v = make_qkv(0, B=1, T=4, N=2, K=1, H=2)
  amap = jnp.ones((1, 2, 4, 4)) / 4
  vals = jnp.zeros((3, 1, 4, 1, 2))
  sig = dict(normalizer="sigmoid", normalizer_params={"bias": 0.0})
  check_raises(
      ("`theta`", lambda: multiscreen_attention(q, k, v, theta=1.0)),
      ("`theta`", lambda: multiscreen_attention(q, k, v, theta=jnp.zeros(3))),
      ("`power`", lambda: multiscreen_attention(q, k, v, power=0.0)),
      ("`scale`", lambda: multiscreen_attention(q, k, v, scale=2.0)),
      ("`query`", lambda: multiscreen_attention(q[0], k, v)),
      ("`eps`", lambda: multiscreen_attention(q, k, v, eps=0.0)),
      ("`attn_map`", lambda: uniattn(amap[0], vals)),
      ("`attn_map`", lambda: uniattn(amap[..., :3], vals)),
      ("`values`", lambda: uniattn(amap, vals[0, 0])),
      ("`values`", lambda: uniattn(amap, jnp.zeros((3, 1, 4, 3, 2)))),
      ("`w_c`", lambda: uniattn(amap, vals, jnp.zeros((3, 1, 4, 5)))),
      ("`w_c`", lambda: uniattn(amap, vals, jnp.zeros((3, 1, 4, 5)), jnp.zeros((3, 4, 2, 2)))),
      ("`x`", lambda: uniattn(amap, vals, jnp.zeros((2, 1, 4, 5)), jnp.zeros((3, 5, 2, 2)))),
      ("`key`", lambda: uniattn_shared_map(q, k[0])),
      ("`implementation`", lambda: uniattn_shared_map(q, k, implementation="xla")),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=1.0)),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=-1.5)),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=float("nan"))),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=jnp.array([0.5, 1.0]))),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=True)),
      # sigmoid(0) = 1/2 on 4 keys: rho(A) = 2, checked since the rows sum to more than 1
      ("`gamma`", lambda: infsa_attention(q * 0, k, v, gamma=0.6, **sig)),
      ("`terms`", lambda: infsa_attention(q, k, v, gamma=0.5, terms=0)),
      ("`normalize`", lambda: infsa_attention(q, k, v, gamma=0.5, normalize=1)),
      ("`key`", lambda: infsa_attention(q, k[:, :3], v[:, :3], gamma=0.5)),
  )
  # with a small enough gamma it is accepted, and equals the numpy kernel
  out = infsa_attention(q * 0, k, v, gamma=0.45, **sig)
  a = np.full((4, 4), 0.5)
  want = 0.45 * np.linalg.solve(np.eye(4) - 0.45 * a, a) @ np.asarray(v[0, :, 0], np.float64)
  np.testing.assert_allclose(np.asarray(out[0, :, 1], np.float64), want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
@pytest.mark.parametrize("causal", [False, True])
def test_infsa_series_equals_solve_matrix(normalizer, causal):
  q, k, v = make_qkv(7, B=2, T=9, N=4, K=2, H=4, Hv=3)
  f = functools.partial(infsa_attention, gamma=0.7, is_causal=causal, normalizer=normalizer)
  np.testing.assert_allclose(np.asarray(f(q, k, v, terms=120)), np.asarray(f(q, k, v)),
                             atol=1e-5, rtol=1e-5)
