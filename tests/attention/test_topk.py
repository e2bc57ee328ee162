"""A11 topk_attention (jaxsoft/attention/_topk.py).

Oracles: a numpy float64 top-k softmax written from the formula (per head and TokenSelect's
soft vote), and for gradients dense attention (dot_product_attention) with the selected set
as its mask; top_k = S against dense attention; a jaxpr walk for the chunked path's shapes.
"""

import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention
from jaxsoft.attention._topk import topk_attention
from tests import helpers
from tests.helpers import BWD, FWD, check_raises, make_qkv, value_and_vjp

B, T, N, K, H = 2, 13, 4, 2, 8
attend = jax.jit(dot_product_attention)


def _np_logits(q, k, scale):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)  # GQA: head n reads kv head n // G
  return scale * np.einsum("btnh,bsnh->bnts", q, k)


def _visible(T, S, causal, kv_len):
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  vis = np.ones((len(kv_len), 1, T, S), bool)
  if causal:
    vis &= j <= i
  vis &= j < np.asarray(kv_len)[:, None, None, None]
  return vis


def _np_softmax(z, keep):
  z = np.where(keep, z, -np.inf)
  m = np.max(z, -1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(keep, np.exp(z - m), 0.0)
  d = e.sum(-1, keepdims=True)
  return np.where(d > 0, e / np.where(d > 0, d, 1), 0.0)


def reference(q, k, v, top_k, vis, selection, scale):
  """numpy float64: (output [B, T, N, Hv], selected bool [B, N, T, S])."""
  logits = _np_logits(q, k, scale)
  vis = np.broadcast_to(vis, logits.shape)
  sel = np.zeros(logits.shape, bool)
  if selection == "per_head":
    score = np.where(vis, logits, -np.inf)
    for idx in np.ndindex(*logits.shape[:3]):
      row = score[idx]
      keep = np.argsort(-row, kind="stable")[:top_k]
      sel[idx][keep[np.isfinite(row[keep])]] = True
  else:
    p = _np_softmax(logits, vis)
    vote = p.sum(1)  # [B, T, S]
    any_vis = vis.any(1)
    for b, t in np.ndindex(B, logits.shape[2]):
      row = np.where(any_vis[b, t], vote[b, t], -np.inf)
      keep = np.argsort(-row, kind="stable")[:top_k]
      keep = keep[np.isfinite(row[keep])]
      sel[b, :, t, keep] = True
    sel &= vis
  w = _np_softmax(logits, sel)
  vv = np.repeat(np.asarray(v, np.float64), q.shape[2] // v.shape[2], axis=2)
  return np.einsum("bnts,bsnh->btnh", w, vv), sel


def _fn(**kw):
  return jax.jit(functools.partial(topk_attention, **kw))


@pytest.mark.parametrize("impl", ["xla", "xla_chunked"])
@pytest.mark.parametrize("selection", ["per_head", "soft_vote"])
def test_matches_reference_and_masked_dense_gradients(impl, selection):
  q, k, v = make_qkv(1, B=B, T=T, N=N, K=K, H=H)
  kv_len = np.array([T, 9])
  top_k = 4
  f = lambda q, k, v: topk_attention(q, k, v, top_k=top_k, is_causal=True,
                                     key_value_seq_lengths=jnp.asarray(kv_len),
                                     selection=selection, implementation=impl, block_k=4)
  out, grads, _ = value_and_vjp(f, q, k, v)
  want, sel = reference(q, k, v, top_k, _visible(T, T, True, kv_len), selection, H ** -0.5)
  chex.assert_trees_all_close(np.asarray(out, np.float64), want, **FWD)
  # the gradient equals dense attention's with the selected set as its mask
  dense = lambda q, k, v: dot_product_attention(q, k, v, mask=jnp.asarray(sel))
  want_out, want_grads, _ = value_and_vjp(dense, q, k, v)
  chex.assert_trees_all_close(out, want_out, **FWD)
  chex.assert_trees_all_close(grads, want_grads, **BWD)


def test_all_keys_is_dense_attention_and_chunked_equals_dense():
  q, k, v = make_qkv(2, B=B, T=T, S=10, N=N, K=K, H=H)
  bias = helpers.standard_normal(3, (B, 1, T, 10))
  out = _fn(top_k=10)(q, k, v, bias)
  chex.assert_trees_all_close(out, attend(q, k, v, bias), **FWD)
  a = _fn(top_k=3, implementation="xla", selection="soft_vote")(q, k, v, bias)
  b = _fn(top_k=3, implementation="xla_chunked", selection="soft_vote", block_k=3)(q, k, v, bias)
  chex.assert_trees_all_close(a, b, **FWD)


def test_error_bound_by_kept_mass():
  q, k, v = make_qkv(4, B=B, T=T, N=N, K=K, H=H)
  q = 3 * q  # peaked rows
  out = np.asarray(_fn(top_k=3)(q, k, v), np.float64)
  logits = _np_logits(q, k, H ** -0.5)
  p = _np_softmax(logits, np.ones(logits.shape, bool))
  _, sel = reference(q, k, v, 3, np.ones((1, 1, T, T), bool), "per_head", H ** -0.5)
  kept = (p * sel).sum(-1)  # [B, N, T]
  dense = np.asarray(attend(q, k, v), np.float64)
  err = np.linalg.norm(out - dense, axis=-1)  # [B, T, N]
  vmax = np.linalg.norm(np.asarray(v, np.float64), axis=-1).max()
  bound = 2 * (1 - kept.transpose(0, 2, 1)) * vmax
  assert np.all(err <= bound + 1e-5)
  assert err.max() > 0  # the bound is not met trivially by an exact result


def largest_intermediate(jaxpr):
  """The most elements of any value a jaxpr (and the jaxprs nested in it) computes."""
  sizes = [int(np.prod(var.aval.shape)) for eqn in jaxpr.eqns for var in eqn.outvars
           if hasattr(var.aval, "shape")]
  for eqn in jaxpr.eqns:
    sizes += [largest_intermediate(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params)]
  return max(sizes, default=0)


def test_chunked_path_never_builds_t_by_s():
  Tq, S = 40, 56
  q, k, v = make_qkv(5, B=1, T=Tq, S=S, N=2, K=1, H=4)
  f = lambda q, k, v: topk_attention(q, k, v, top_k=4, implementation="xla_chunked", block_k=8,
                                     selection="soft_vote").sum()
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v).jaxpr
  assert largest_intermediate(jaxpr) < Tq * S  # the largest intermediate: [B, N, T, block_k] or [.., T, k, H]
  dense = jax.make_jaxpr(lambda q, k, v: topk_attention(
      q, k, v, top_k=4, implementation="xla").sum())(q, k, v).jaxpr
  assert largest_intermediate(dense) >= Tq * S


def test_indices_reuse_masks_and_empty_rows():
  q, k, v = make_qkv(6, B=B, T=T, N=N, K=K, H=H)
  f = _fn(top_k=5, is_causal=True, return_indices=True)
  out, idx = f(q, k, v)
  assert idx.shape == (B, N, T, 5) and idx.dtype == jnp.int32
  # reuse in a "next layer" with other inputs: the same keys, the new logits
  q2 = jnp.flip(q, axis=2)
  reused = _fn(top_k=5, is_causal=True)(q2, k, v, indices=idx)
  sel = np.zeros((B, N, T, T), bool)
  np.put_along_axis(sel, np.asarray(idx), True, axis=-1)
  sel &= np.tril(np.ones((T, T), bool))
  chex.assert_trees_all_close(reused, attend(q2, k, v, mask=jnp.asarray(sel)),
                              **FWD)
  # a row with no visible key: zeros and finite gradients
  f = lambda q: topk_attention(q, k, v, top_k=3, key_value_seq_lengths=jnp.array([0, T]),
                               implementation="xla_chunked", block_k=5)
  o, (g,), _ = value_and_vjp(f, q)
  assert np.all(np.asarray(o[0]) == 0) and np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(g[0]) == 0)


def test_bf16():
  q, k, v = make_qkv(7, B=B, T=T, N=N, K=K, H=H)
  lo = [a.astype(jnp.bfloat16) for a in (q, k, v)]
  out = _fn(top_k=4, is_causal=True, implementation="xla_chunked", block_k=4)(*lo)
  assert out.dtype == jnp.bfloat16
  want, _ = reference(*(a.astype(jnp.float32) for a in lo), 4,
                      _visible(T, T, True, [T, T]), "per_head", H ** -0.5)
  chex.assert_trees_all_close(np.asarray(out, np.float64), want, atol=2e-2, rtol=2e-2)


def test_errors_name_the_argument():
  q, k, v = make_qkv(0, B=1, T=4, N=2, K=1, H=4)
  check_raises(
      ("`top_k`", lambda: topk_attention(q, k, v, top_k=5)),
      ("`top_k`", lambda: topk_attention(q, k, v, top_k=0)),
      ("`selection`", lambda: topk_attention(q, k, v, top_k=2, selection="vote")),
      ("`implementation`", lambda: topk_attention(q, k, v, top_k=2, implementation="pallas")),
      ("`block_k`", lambda: topk_attention(q, k, v, top_k=2, block_k=0)),
      ("`indices`", lambda: topk_attention(q, k, v, top_k=2, indices=jnp.zeros((1, 2, 4, 3), int))),
      ("`query`", lambda: topk_attention(q[0], k[0], v[0], top_k=2)),
      ("`key`", lambda: topk_attention(q, k[..., :3], v, top_k=2)),
  )
