"""A14 lucid_attention (jaxsoft/attention/_lucid.py).

Oracles: numpy float64 with the explicit inverse of tril(exp(K K^T / s)); for gradients,
JAX autodiff of that dense formula (jnp.linalg.inv) in float64.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention
from jaxsoft.attention._lucid import lucid_attention, lucid_preconditioned_values
from tests.helpers import check_raises, make_qkv

B, T, N, K, H = 2, 12, 4, 2, 8


def _np_lucid(q, k, v, normalize=True, eps=1e-6):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  if normalize:
    k = k / np.sqrt(np.mean(k * k, -1, keepdims=True) + eps)
  G = q.shape[2] // k.shape[2]
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  causal = np.tril(np.ones((T, T), bool))
  for b, n in np.ndindex(B, q.shape[2]):
    kk, vv = k[b, :, n // G], v[b, :, n // G]
    pre = np.where(causal, np.exp(kk @ kk.T / np.sqrt(H)), 0.0)
    y = np.linalg.inv(pre) @ vv
    z = np.where(causal, q[b, :, n] @ kk.T / np.sqrt(H), -np.inf)
    a = np.exp(z - z.max(-1, keepdims=True))
    out[b, :, n] = (a / a.sum(-1, keepdims=True)) @ y
  return out


def _jnp_lucid(q, k, v):
  """The dense formula with the explicit inverse (float64 autodiff oracle)."""
  k = k / jnp.sqrt(jnp.mean(k * k, -1, keepdims=True) + 1e-6)
  kr = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
  vr = jnp.repeat(v, q.shape[2] // k.shape[2], axis=2)
  causal = jnp.tril(jnp.ones((T, T), bool))
  pre = jnp.where(causal, jnp.exp(jnp.einsum("bink,bjnk->bnij", kr, kr) / np.sqrt(H)), 0.0)
  y = jnp.linalg.inv(pre) @ jnp.transpose(vr, (0, 2, 1, 3))
  z = jnp.where(causal, jnp.einsum("bink,bjnk->bnij", q, kr) / np.sqrt(H), -jnp.inf)
  return jnp.transpose(jax.nn.softmax(z, -1) @ y, (0, 2, 1, 3))


def test_matches_explicit_inverse_float64_reference():
  q, k, v = make_qkv(0, B=B, T=T, N=N, K=K, H=H)
  out = jax.jit(lucid_attention)(q, k, v)
  np.testing.assert_allclose(np.asarray(out, np.float64), _np_lucid(q, k, v), rtol=2e-4, atol=2e-4)
  # well-separated keys (a small kernel scale): exp(K K^T / s) is nearly diagonal, and LUCID
  # is softmax attention with the values divided by that diagonal, e^{|k|^2 / s} = e^{H / s}
  s = 0.25
  q, k, v = make_qkv(5, B=B, T=T, N=N, K=K, H=H)  # keys whose draw meets the bound below
  sep = jax.jit(functools.partial(lucid_attention, key_scale=s))(q, k, v)
  kh = k / jnp.sqrt(jnp.mean(k * k, -1, keepdims=True) + 1e-6)
  gram = np.einsum("btkh,bskh->bkts", kh, kh) - 1e9 * np.eye(T)
  assert np.exp((gram.max() - H) / s) < 1e-3  # the largest off-diagonal term, relative
  plain = dot_product_attention(q, kh, v, is_causal=True)
  chex.assert_trees_all_close(sep * np.exp(H / s), plain, atol=1e-3, rtol=1e-3)
  out = jax.jit(lucid_attention)(q, k, v)
  assert not np.allclose(np.asarray(out), np.asarray(plain), atol=1e-2)


@pytest.mark.parametrize("impl", ["xla", "xla_chunked"])
def test_adjoint_gradient_matches_autodiff_of_dense_formula_float64(impl):
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in make_qkv(1, B=B, T=T, N=N, K=K, H=H))
    ct = jax.random.normal(jax.random.key(2), (B, T, N, H), jnp.float64)

    def grads(f):
      return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct), argnums=(0, 1, 2)))(q, k, v)

    got = grads(functools.partial(lucid_attention, implementation=impl))
    want = grads(_jnp_lucid)
    chex.assert_trees_all_close(got, want, atol=1e-9, rtol=1e-8)
    out = jax.jit(functools.partial(lucid_attention, implementation=impl))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), _np_lucid(q, k, v), atol=1e-10, rtol=1e-9)


def test_solve_equals_inverse_and_gradient_by_finite_differences():
  with jax.enable_x64(True):
    _, k, v = (a.astype(jnp.float64) for a in make_qkv(3, B=1, T=6, N=2, K=2, H=4))
    y = lucid_preconditioned_values(k, v, key_scale=2.0)
    kk, vv = np.asarray(k[0, :, 1]), np.asarray(v[0, :, 1])
    pre = np.tril(np.exp(kk @ kk.T / 2.0))
    np.testing.assert_allclose(np.asarray(y[0, :, 1]), np.linalg.solve(pre, vv), rtol=1e-10)
    # jit: check_grads evaluates the function many times; one program instead of op by op
    jax.test_util.check_grads(
        jax.jit(lambda k, v: lucid_preconditioned_values(k, v, key_scale=2.0)), (k, v), order=1,
        modes=("rev",))


def test_causal_and_bf16():
  q, k, v = make_qkv(4, B=B, T=T, N=N, K=K, H=H)
  f = jax.jit(lucid_attention)
  out = f(q, k, v)
  t = 7  # perturb every input after position t: outputs up to t are unchanged
  bump = lambda a: a.at[:, t + 1:].add(1.5)
  out2 = f(bump(q), bump(k), bump(v))
  np.testing.assert_array_equal(np.asarray(out[:, :t + 1]), np.asarray(out2[:, :t + 1]))
  assert not np.allclose(np.asarray(out[:, t + 1:]), np.asarray(out2[:, t + 1:]))
  lo = f(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
  assert lo.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(lo, np.float32)))
  want = f(*(a.astype(jnp.bfloat16).astype(jnp.float32) for a in (q, k, v)))
  chex.assert_trees_all_close(lo.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)


def test_errors_name_the_argument():
  q, k, v = make_qkv(0, B=1, T=4, N=2, K=1, H=4)
  check_raises(
      ("`query`", lambda: lucid_attention(q[0], k, v)),
      ("same length", lambda: lucid_attention(q[:, :3], k, v)),
      ("`value`", lambda: lucid_attention(q, k, v[:, :3])),
      ("`key_scale`", lambda: lucid_attention(q, k, v, key_scale=0.0)),
      ("`eps`", lambda: lucid_attention(q, k, v, eps=0.0)),
  )
