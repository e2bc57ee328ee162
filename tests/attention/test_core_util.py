"""Shared helpers of the attention-core tests (no tests here)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np


def make_qkv(seed=0, B=2, T=11, S=None, N=4, K=2, H=8, Hv=None, dtype=jnp.float32):
  S = T if S is None else S
  Hv = H if Hv is None else Hv
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, Hv), jnp.float32).astype(dtype)
  return q, k, v


def value_and_grads(fn, args, seed=7):
  """fn(*args) and the gradients of <fn(*args), ct> for a random cotangent ct."""
  out = fn(*args)
  ct = jax.random.normal(jax.random.PRNGKey(seed), out.shape, jnp.float32).astype(out.dtype)
  grads = jax.grad(lambda *a: jnp.sum((fn(*a) * ct).astype(jnp.float32)),
                   argnums=tuple(range(len(args))))(*args)
  return out, grads


def assert_same(fn_a, fn_b, args, fwd_tol=1e-5, bwd_tol=1e-4):
  """Outputs and every input cotangent of fn_a and fn_b agree."""
  out_a, g_a = value_and_grads(fn_a, args)
  out_b, g_b = value_and_grads(fn_b, args)
  chex.assert_trees_all_close(out_a, out_b, atol=fwd_tol, rtol=fwd_tol)
  chex.assert_trees_all_close(g_a, g_b, atol=bwd_tol, rtol=bwd_tol)
  for g in jax.tree.leaves(g_a):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  return out_a, g_a


def segment_mask(q_seg, kv_seg):
  """The dense mask [B, 1, T, S] of segment ids (an oracle for segment_ids)."""
  return (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]


def sampled(values, default, ids=None):
  """pytest params: the ``default`` subset runs always, the rest only with ``-m slow``."""
  import pytest  # pylint: disable=g-import-not-at-top
  ids = ids or [str(v) for v in values]
  return [pytest.param(v, id=i, marks=() if i in default else pytest.mark.slow)
          for v, i in zip(values, ids, strict=False)]
