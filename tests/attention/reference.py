"""Dense references shared by the tests of the attention variants, written for clarity.

The jnp ones (masked softmax, logits, sparsemax by optax's simplex projection) serve the
variants built on ``dot_product_attention`` (Hopfield, gating, FoX, SSMax, entmax); the
float64 numpy ones (visibility, the masked softmax map) serve the dense map variants
(Multiscreen, UniAttn, InfSA). Layouts as the library: ``[B, T, N, H]``, maps
``[B, N, T, S]``.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from tests.helpers import BWD, FWD, normal, value_and_grads

IMPLS = ("xla", "xla_chunked")


def vjp_all(f, args, ct_key=99):
  """(output, input cotangents) of f at args for a random output cotangent (jitted)."""

  def run(*args):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(normal(ct_key, out.shape))

  return jax.jit(run)(*args)


def assert_fn_close(f, ref, args, fwd=FWD, bwd=BWD):
  """f and ref agree on the output and on every input cotangent, all finite."""
  out, grads = vjp_all(f, args)
  out_r, grads_r = vjp_all(ref, args)
  chex.assert_trees_all_close(out, out_r, **fwd)
  chex.assert_trees_all_close(grads, grads_r, **bwd)
  chex.assert_tree_all_finite((out, grads))


def assert_same_jit(fn_a, fn_b, args, fwd_tol=1e-5, bwd_tol=1e-4):
  """``tests.helpers.assert_same`` (the same cotangent, tolerances and checks) with each
  side's output and gradients computed by one jitted program: op-by-op eager dispatch of an
  attention call and its VJP costs several times the compilation of the whole."""
  out_a, g_a = jax.jit(lambda *a: value_and_grads(fn_a, a))(*args)
  out_b, g_b = jax.jit(lambda *a: value_and_grads(fn_b, a))(*args)
  chex.assert_trees_all_close(out_a, out_b, atol=fwd_tol, rtol=fwd_tol)
  chex.assert_trees_all_close(g_a, g_b, atol=bwd_tol, rtol=bwd_tol)
  for g in jax.tree.leaves(g_a):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  return out_a, g_a


def masked_softmax(logits, visible):
  z = jnp.where(visible, logits, -jnp.inf)
  return jnp.where(visible, jax.nn.softmax(z, axis=-1), 0.0)


def apply_weights(w, v):
  """Weights [B, N, T, S] applied to values [B, S, N, Hv] -> [B, T, N, Hv]."""
  return jnp.einsum("bnts,bsnh->btnh", w, v)


def scaled_logits(q, k, scale=None):
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  return scale * jnp.einsum("btnh,bsnh->bnts", q, k)


def causal_mask(t, s):
  return jnp.tril(jnp.ones((t, s), bool))


def simplex(x):
  """Sparsemax of the rows of x by optax's Euclidean projection onto the simplex."""
  rows = jax.vmap(optax.projections.projection_simplex)(x.reshape(-1, x.shape[-1]))
  return rows.reshape(x.shape)


def fox_inputs(t=7, n=2, h=4, seed=0):
  """q, k, v [2, t, n, h] and log forget gates [2, t, n]."""
  q, k, v = (normal(seed + i, (2, t, n, h)) for i in range(3))
  log_f = jax.nn.log_sigmoid(normal(seed + 3, (2, t, n), 2.0) + 1.0)
  return q, k, v, log_f


# ------------------------------------------------------------- float64 numpy references


def f64(*a):
  return [np.asarray(x, np.float64) for x in a]


def np_visible(mask, is_causal, B, N, T, S):
  """bool [B, N, T, S]: the mask (None: all) and, with ``is_causal``, j <= i."""
  vis = np.ones((B, N, T, S), bool) if mask is None else np.broadcast_to(
      np.asarray(mask), (B, N, T, S)).copy()
  if is_causal:
    vis &= np.tril(np.ones((T, S), bool))
  return vis


def np_softmax_map(q, k, vis):
  """The softmax attention map [B, N, T, S] over ``vis`` (GQA; rows with no key are 0)."""
  q, k = f64(q, k)
  G = q.shape[2] // k.shape[2]
  kk = np.repeat(k, G, axis=2)
  z = np.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(q.shape[-1])
  z = np.where(vis, z, -np.inf)
  m = np.max(z, -1, keepdims=True)
  e = np.where(vis, np.exp(z - np.where(np.isfinite(m), m, 0.0)), 0.0)
  d = e.sum(-1, keepdims=True)
  return np.where(d > 0, e / np.where(d > 0, d, 1.0), 0.0)


def np_apply(a, v):
  """[B, N, T, S] x [B, S, K, Hv] -> [B, T, N, Hv] in float64 (GQA)."""
  G = a.shape[1] // v.shape[2]
  return np.einsum("bnts,bsnh->btnh", a, np.repeat(np.asarray(v, np.float64), G, axis=2))


def rand_mask(seed, B, T, S):
  """A random bool mask [B, 1, T, S] with key 0 always visible."""
  m = np.random.default_rng(seed).random((B, 1, T, S)) < 0.7
  m[..., 0] = True
  return jnp.asarray(m)


def assert_masked_row_is_zero(fn, q, k, v, row):
  """``fn(q, k, v)`` is exactly 0 at query ``row`` (which sees no key), nonzero elsewhere,
  and a cotangent on that row alone gives exactly zero gradients."""

  @jax.jit  # the output and the gradients in one program
  def run(q, k, v):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(jnp.zeros_like(out).at[:, row].set(1.0))  # only the masked row's output

  out, grads = run(q, k, v)
  assert float(jnp.max(jnp.abs(out[:, row]))) == 0.0 and float(jnp.max(jnp.abs(out))) > 0
  for g in grads:
    assert np.all(np.asarray(g) == 0.0)
