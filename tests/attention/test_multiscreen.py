"""A19 multiscreen_attention (jaxsoft/attention/_multiscreen.py).

Oracles: numpy float64 written from the formula (cosine similarities and the screening
rule), the invariance to keys below the threshold (which softmax fails), and float64 finite
differences.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention import dot_product_attention, multiscreen_attention
from tests.attention.reference import (
    assert_masked_row_is_zero,
    f64,
    np_apply,
    np_visible,
    rand_mask,
)
from tests.helpers import check_raises, make_qkv, normal

B, T, N, K, H, HV = 2, 5, 4, 2, 3, 2


def _np_multiscreen(q, k, v, theta, power, vis):
  q, k, v = f64(q, k, v)
  G = q.shape[2] // k.shape[2]
  qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
  kn = np.repeat(k / np.linalg.norm(k, axis=-1, keepdims=True), G, axis=2)
  s = np.einsum("btnh,bsnh->bnts", qn, kn)
  th = np.broadcast_to(np.asarray(theta, np.float64), (N,))[None, :, None, None]
  pw = np.broadcast_to(np.asarray(power, np.float64), (N,))[None, :, None, None]
  w = np.clip((s - th) / (1 - th), 0, 1) ** pw
  w = np.where(vis, w, 0.0)
  return np_apply(w, v), w


def test_multiscreen_matches_numpy_causal_masked_gqa_and_bf16():
  q, k, v = make_qkv(0, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  mask = rand_mask(1, B, T, T)
  theta = jnp.array([0.0, 0.2, -0.3, 0.5])
  power = jnp.array([1.0, 2.0, 0.5, 1.5])
  for causal in (False, True):
    fn = jax.jit(functools.partial(multiscreen_attention, is_causal=causal, theta=theta,
                                   power=power))
    out = fn(q, k, v, None, mask)
    want, w = _np_multiscreen(q, k, v, theta, power, np_visible(mask, causal, B, N, T, T))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-5, rtol=1e-5)
    assert np.all((w >= 0) & (w <= 1)) and np.any(w == 0) and np.any(w > 0)
  lo = jax.jit(multiscreen_attention)(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
  assert lo.dtype == jnp.bfloat16
  want, _ = _np_multiscreen(*(a.astype(jnp.bfloat16) for a in (q, k, v)), 0.0, 1.0,
                            np_visible(None, False, B, N, T, T))
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


def test_fully_masked_row_is_zero_with_zero_gradient():
  q, k, v = make_qkv(8, B=1, T=4, N=2, K=1, H=3, Hv=2)
  mask = jnp.ones((1, 1, 4, 4), bool).at[:, :, 2].set(False)  # query 2 sees no key
  assert_masked_row_is_zero(
      lambda q, k, v: multiscreen_attention(q, k, v, None, mask, theta=-0.5), q, k, v, 2)


def test_errors_name_the_argument():
  q, k, v = make_qkv(0, B=1, T=4, N=2, K=1, H=2)
  check_raises(
      ("`theta`", lambda: multiscreen_attention(q, k, v, theta=1.0)),
      ("`theta`", lambda: multiscreen_attention(q, k, v, theta=jnp.zeros(3))),
      ("`power`", lambda: multiscreen_attention(q, k, v, power=0.0)),
      ("`scale`", lambda: multiscreen_attention(q, k, v, scale=2.0)),
      ("`query`", lambda: multiscreen_attention(q[0], k, v)),
      ("`eps`", lambda: multiscreen_attention(q, k, v, eps=0.0)),
  )
