"""A12 block_sparse_attention (jaxsoft/attention/_block_sparse.py).

Oracles: dense attention (dot_product_attention) with the kept-block mask of each query
token, values and gradients; a numpy float64 per-token MoBA gate; causality (a token's
output and gradients never depend on a later token; decoding on prefixes equals the full
forward); numpy float64 dense weights for the skipped mass, the
BLASST per-weight bound e^-tau and the output error bound 2·(skipped mass)·max|v|; a jaxpr
walk for the shapes.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention
from jaxsoft.attention._block_sparse import block_sparse_attention
from tests import helpers
from tests.attention.test_topk import largest_intermediate
from tests.helpers import BWD, FWD, check_raises, make_qkv, value_and_vjp

B, T, N, K, H, BS = 2, 22, 4, 2, 8, 4
NB = -(-T // BS)
attend = jax.jit(dot_product_attention, static_argnames=("is_causal",))
KV_LEN = np.array([T, 17])
SETTINGS = {
    "blasst": dict(skip_threshold=1.0),
    "moba": dict(top_k_blocks=3),
    "bfla": dict(mass_threshold=0.8, top_k_blocks=4),
    "prism": dict(top_k_blocks=3, high_frequency_pairs=1),
}


def _inputs(seed=0, peak=2.0):
  q, k, v = make_qkv(seed, B=B, T=T, N=N, K=K, H=H)
  return peak * q, k, v


def _block_mask(kept_tokens, S=T):
  """kept_tokens [B, N, T, nk] -> the dense mask [B, N, T, S] (the token's key block kept)."""
  m = np.repeat(np.asarray(kept_tokens), BS, axis=3)
  return jnp.asarray(m[..., :S])


def _dense_weights(q, k, causal=True, kv_len=KV_LEN):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  z = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  vis = (j < kv_len[:, None, None, None]) & ((j <= i) if causal else True)
  z = np.where(vis, z, -np.inf)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True), vis


def _run(method, q, k, v, **kw):
  f = functools.partial(block_sparse_attention, method=method, block_size=BS, is_causal=True,
                        key_value_seq_lengths=jnp.asarray(KV_LEN), return_stats=True,
                        **{**SETTINGS[method], **kw})
  return jax.jit(f)(q, k, v)


# bfla and prism share moba's gather loop: their gradients run under -m slow
@pytest.mark.parametrize("method", ["blasst", "moba", pytest.param("bfla", marks=pytest.mark.slow),
                                    pytest.param("prism", marks=pytest.mark.slow)])
def test_equals_dense_attention_with_the_kept_block_mask(method):
  q, k, v = _inputs(1)
  _, stats = _run(method, q, k, v)
  kept = np.asarray(stats["kept_tokens"])
  assert stats["kept"].shape == (B, N, NB, NB) and kept.shape == (B, N, T, NB)
  np.testing.assert_array_equal(  # kept = the union over the query block's tokens
      stats["kept"], np.pad(kept, ((0, 0), (0, 0), (0, NB * BS - T), (0, 0))).reshape(
          B, N, NB, BS, NB).any(3))
  assert 0 < kept.sum() < (np.arange(T) // BS + 1).sum() * B * N  # something was skipped
  f = lambda q, k, v: block_sparse_attention(
      q, k, v, method=method, block_size=BS, is_causal=True,
      key_value_seq_lengths=jnp.asarray(KV_LEN), **SETTINGS[method])
  mask = _block_mask(kept)
  g = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                            key_value_seq_lengths=jnp.asarray(KV_LEN))
  out, grads, _ = value_and_vjp(f, q, k, v)
  want, want_grads, _ = value_and_vjp(g, q, k, v)
  chex.assert_trees_all_close(out, want, **FWD)
  chex.assert_trees_all_close(grads, want_grads, **BWD)


@pytest.mark.parametrize("method", ["blasst", "moba", "bfla", "prism"])
def test_skipped_mass_bounds_the_error(method):
  """Measured against dense float64 attention: ||o - o_dense|| <= 2·skipped mass·max|v|."""
  q, k, v = _inputs(2)
  out, stats = _run(method, q, k, v)
  p, vis = _dense_weights(q, k)
  kept = np.asarray(_block_mask(stats["kept_tokens"]))
  skipped = np.where(vis & ~kept, p, 0.0).sum(-1)  # [B, N, T]
  vv = np.repeat(np.asarray(v, np.float64), N // K, axis=2)
  dense = np.einsum("bnts,bsnh->btnh", p, vv)
  err = np.linalg.norm(np.asarray(out, np.float64) - dense, axis=-1).transpose(0, 2, 1)
  vmax = np.linalg.norm(vv, axis=-1).max()
  assert np.all(err <= 2 * skipped * vmax + 1e-5)
  assert skipped.max() > 0 and np.mean(skipped) < 0.5
  # and the output is dense attention over the kept blocks
  want = attend(q, k, v, mask=jnp.asarray(kept), is_causal=True,
                key_value_seq_lengths=jnp.asarray(KV_LEN))
  chex.assert_trees_all_close(out, want, **FWD)


def test_blasst_weight_bound_and_exact_limit():
  q, k, v = _inputs(3, peak=3.0)
  p, vis = _dense_weights(q, k)
  for tau in (0.5, 2.0):
    _, stats = _run("blasst", q, k, v, skip_threshold=tau)
    skipped = vis & ~np.asarray(_block_mask(stats["kept_tokens"]))
    assert skipped.any()
    # every skipped dense weight <= e^-tau, so a row's skipped mass <= n_skipped·e^-tau
    assert np.all(np.where(skipped, p, 0.0) <= np.exp(-tau) + 1e-12)
    assert np.all(np.where(skipped, p, 0.0).sum(-1) <= skipped.sum(-1) * np.exp(-tau) + 1e-12)
  out, stats = _run("blasst", q, k, v, skip_threshold=float("inf"))
  chex.assert_trees_all_close(
      out, attend(q, k, v, is_causal=True, key_value_seq_lengths=jnp.asarray(KV_LEN)), **FWD)
  kept = np.broadcast_to(np.asarray(_block_mask(stats["kept_tokens"])), p.shape)
  assert np.all(kept[np.broadcast_to(vis, p.shape)])


def test_moba_gate_matches_numpy_and_all_blocks_is_dense():
  """MoBA's gate per query token i: own block always, else the best q_i · mean(K_J) over the
  blocks wholly before it (numpy float64)."""
  q, k, v = _inputs(4)
  _, stats = _run("moba", q, k, v)
  qq = np.asarray(q, np.float64).transpose(0, 2, 1, 3)  # [B, N, T, H]
  kk = np.repeat(np.asarray(k, np.float64), N // K, axis=2).transpose(0, 2, 1, 3)
  want = np.zeros((B, N, T, NB), bool)
  for b, n, i in np.ndindex(B, N, T):
    scores = {}
    for j in range(i // BS + 1):
      keys = kk[b, n, j * BS:min((j + 1) * BS, KV_LEN[b])]
      if len(keys):
        scores[j] = np.inf if j == i // BS else qq[b, n, i] @ keys.mean(0)
    for j in sorted(scores, key=lambda j: -scores[j])[:SETTINGS["moba"]["top_k_blocks"]]:
      want[b, n, i, j] = True
  np.testing.assert_array_equal(np.asarray(stats["kept_tokens"]), want)
  out, _ = _run("moba", q, k, v, top_k_blocks=NB)
  chex.assert_trees_all_close(
      out, attend(q, k, v, is_causal=True, key_value_seq_lengths=jnp.asarray(KV_LEN)), **FWD)



def _blasst_loop_numpy(q, k, tau, causal):
  """BLASST's sequential loop in float64: row i visits its own key block, then the earlier
  ones (wrapping round to the last block when not causal), keeping block j unless its max
  score is below the running max minus tau. Returns kept [B, N, T, NB] and each decision's
  distance to the threshold (to leave out float32 ties)."""
  q, k = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), N // K, axis=2)
  z = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  vis = np.broadcast_to((j < KV_LEN[:, None, None, None]) & ((j <= i) if causal else True),
                        z.shape)
  kept = np.zeros((B, N, T, NB), bool)
  margin = np.full((B, N, T, NB), np.inf)
  for b, n, r in np.ndindex(B, N, T):
    m, diag = -np.inf, min(r // BS, NB - 1)
    for t in range(diag + 1 if causal else NB):
      blk = (diag - t) % NB
      zz = z[b, n, r, blk * BS:(blk + 1) * BS][vis[b, n, r, blk * BS:(blk + 1) * BS]]
      if zz.size == 0:
        continue
      margin[b, n, r, blk] = abs(zz.max() - (m - tau)) if np.isfinite(m) else np.inf
      if not zz.max() < m - tau:
        kept[b, n, r, blk], m = True, max(m, zz.max())
  return kept, margin


def test_blasst_decisions_match_the_sequential_loop():
  """The vectorised decisions (a cumulative max over block maxima) equal the sequential
  skip loop, causal and not (the wrapped visiting order); without is_causal the output is
  dense attention over the kept blocks (its gradients: -m slow)."""
  q, k, v = _inputs(4, peak=3.0)
  for causal in (True, False):
    out, stats = jax.jit(functools.partial(
        block_sparse_attention, method="blasst", block_size=BS, skip_threshold=1.0,
        is_causal=causal, key_value_seq_lengths=jnp.asarray(KV_LEN), return_stats=True))(q, k, v)
    kept = np.asarray(stats["kept_tokens"])
    want, margin = _blasst_loop_numpy(q, k, 1.0, causal)
    sure = margin > 1e-4
    assert sure.mean() > 0.95 and want[sure].any() and not want[sure].all()
    np.testing.assert_array_equal(kept[sure], want[sure])
    assert not kept[~np.isfinite(margin) & ~want].any()  # no visible entry: never kept
  chex.assert_trees_all_close(out, attend(q, k, v, mask=_block_mask(kept),
                                          key_value_seq_lengths=jnp.asarray(KV_LEN)), **FWD)


@pytest.mark.slow
def test_blasst_non_causal_gradients():
  q, k, v = _inputs(4, peak=3.0)
  f = functools.partial(block_sparse_attention, method="blasst", block_size=BS,
                        skip_threshold=1.0, key_value_seq_lengths=jnp.asarray(KV_LEN))
  _, stats = jax.jit(functools.partial(f, return_stats=True))(q, k, v)
  g = lambda q, k, v: dot_product_attention(q, k, v, mask=_block_mask(stats["kept_tokens"]),
                                            key_value_seq_lengths=jnp.asarray(KV_LEN))
  out, grads, _ = value_and_vjp(f, q, k, v)
  ref, ref_grads, _ = value_and_vjp(g, q, k, v)
  chex.assert_trees_all_close(out, ref, **FWD)
  chex.assert_trees_all_close(grads, ref_grads, **BWD)


def _perturb(x, t, seed, factor):
  noise = jax.random.normal(jax.random.PRNGKey(seed), x[:, t].shape, x.dtype)
  return x.at[:, t].set(factor * noise)


@pytest.mark.parametrize("method", ["blasst", "moba", "bfla", "prism"])
def test_causal_later_tokens_never_change_earlier_outputs_or_gradients(method):
  """Under is_causal, replacing token t (its q, k and v, by large values that would win any
  selection) leaves the outputs of tokens < t, and the gradients of a loss on them, unchanged;
  token t itself receives no gradient from that loss. t = 14 is inside query block 3, so a
  block-level choice (pooled queries, a shared skip) would leak into tokens 12 and 13."""
  q, k, v = _inputs(7)
  t = 3 * BS + 2
  ct = helpers.standard_normal(3, (B, T, N, H))

  @jax.jit
  def out_and_grads(q, k, v):
    def loss(q, k, v):
      out = block_sparse_attention(q, k, v, method=method, block_size=BS, is_causal=True,
                                   **SETTINGS[method])
      return jnp.sum(out[:, :t] * ct[:, :t]), out
    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)[::-1]

  base, base_g = out_and_grads(q, k, v)
  q2, k2, v2 = (_perturb(x, t, 1 + i, 300.0) for i, x in enumerate((q, k, v)))
  out, g = out_and_grads(q2, k2, v2)  # logits of token t ~ 1e5: still finite
  for x in (out, *g):
    assert np.all(np.isfinite(np.asarray(x)))
  assert not np.allclose(out[:, t], base[:, t])  # the change is seen at t
  chex.assert_trees_all_close(out[:, :t], base[:, :t], atol=1e-6, rtol=1e-6)
  chex.assert_trees_all_close([x[:, :t] for x in g], [x[:, :t] for x in base_g],
                              atol=1e-5, rtol=1e-5)
  for x in g:
    assert not np.any(np.asarray(x[:, t:]))


def _decode_check(method, prefixes):
  q, k, v = _inputs(8)
  f = functools.partial(block_sparse_attention, method=method, block_size=BS, is_causal=True,
                        **SETTINGS[method])
  full = jax.jit(f)(q, k, v)
  for n in prefixes:  # recompute on the prefix [0, n): its last row is token n - 1's output
    step = jax.jit(f)(q[:, :n], k[:, :n], v[:, :n])
    chex.assert_trees_all_close(step[:, -1], full[:, n - 1], **FWD)


@pytest.mark.parametrize("method", ["blasst", "moba", "bfla", "prism"])
def test_decoding_on_a_prefix_equals_the_full_forward(method):
  _decode_check(method, (3 * BS + 2,))  # ends inside a query block


@pytest.mark.slow
@pytest.mark.parametrize("method", ["blasst", "moba", "bfla", "prism"])
def test_decoding_every_prefix_equals_the_full_forward(method):
  """Token-by-token decoding (recomputing on each prefix; early prefixes hold fewer blocks
  than top_k_blocks, which is then all of them)."""
  _decode_check(method, range(1, T + 1))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["blasst", "moba", "bfla", "prism"])
def test_extreme_logits_stay_finite(method):
  q, k, v = _inputs(9, peak=1e4)
  f = lambda q, k, v: block_sparse_attention(q, k, v, method=method, block_size=BS,
                                             is_causal=True, **SETTINGS[method])
  out, grads, _ = value_and_vjp(f, q, k, v)
  for x in (out, *grads):
    assert np.all(np.isfinite(np.asarray(x)))


@pytest.mark.parametrize("method", ["blasst", "moba"])
def test_blockwise_loop_never_builds_t_by_s(method):
  Tq = 48
  q, k, v = make_qkv(5, B=1, T=Tq, N=2, K=1, H=4)
  kw = dict(skip_threshold=2.0) if method == "blasst" else dict(top_k_blocks=2)
  f = lambda q, k, v: block_sparse_attention(q, k, v, method=method, block_size=8,
                                             is_causal=True, **kw).sum()
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v).jaxpr
  assert largest_intermediate(jaxpr) < Tq * Tq  # one query block against the keys it visits at most


def test_bf16_and_non_causal():
  q, k, v = _inputs(6)
  lo = [a.astype(jnp.bfloat16) for a in (q, k, v)]
  for method in ("blasst", "moba"):
    out, stats = _run(method, *lo)
    assert out.dtype == jnp.bfloat16
    want = attend(*(a.astype(jnp.float32) for a in lo),
                                 mask=_block_mask(stats["kept_tokens"]), is_causal=True,
                                 key_value_seq_lengths=jnp.asarray(KV_LEN))
    chex.assert_trees_all_close(out.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
  out, stats = jax.jit(functools.partial(
      block_sparse_attention, method="moba", block_size=BS, top_k_blocks=2, return_stats=True))(
          q, k, v)
  # MoBA per token, no causal own block: the top 2 anywhere for every token
  assert np.all(np.asarray(stats["kept_tokens"]).sum(-1) == 2)
  chex.assert_trees_all_close(out, attend(q, k, v, mask=_block_mask(stats["kept_tokens"])), **FWD)


def test_errors_name_the_argument():
  q, k, v = make_qkv(0, B=1, T=8, N=2, K=1, H=4)
  f = functools.partial(block_sparse_attention, q, k, v)
  check_raises(
      ("`method`", lambda: f(method="flash")),
      ("`skip_threshold`", lambda: f(method="blasst")),
      ("`skip_threshold`", lambda: f(method="blasst", skip_threshold=-1.0)),
      ("`top_k_blocks`", lambda: f(method="moba")),
      ("`top_k_blocks`", lambda: f(method="moba", block_size=4, top_k_blocks=0)),
      ("`top_k_blocks`", lambda: f(method="bfla", block_size=4, top_k_blocks=1.5)),
      ("`block_size`", lambda: f(method="moba", block_size=0, top_k_blocks=1)),
      ("`mass_threshold`", lambda: f(method="bfla", mass_threshold=0.0)),
      ("`high_frequency_pairs`", lambda: f(method="prism", top_k_blocks=1,
                                           high_frequency_pairs=5)),
      ("`query`", lambda: block_sparse_attention(q[0], k[0], v[0], method="moba", top_k_blocks=1)),
      ("`implementation`", lambda: f(method="moba", top_k_blocks=1, implementation="xla")),
      ("`implementation`", lambda: f(method="blasst", skip_threshold=1.0,
                                     implementation="cudnn")),
  )


def test_blasst_refuses_second_order_and_forward_mode_by_name():
  """BLASST's custom VJP gives first-order reverse mode; a Hessian, grad of grad (also of a
  jitted call) and forward mode raise UnsupportedDifferentiation naming the method and the
  way out (the dense path under the kept-block mask), not JAX's bare loop error."""
  from jaxsoft.attention import UnsupportedDifferentiation
  q, k, v = (x[:1, :8, :2, :4] for x in _inputs(5))
  f = functools.partial(block_sparse_attention, method="blasst", block_size=BS,
                        skip_threshold=1.0, is_causal=True)
  loss = lambda q: jnp.sum(f(q, k, v) ** 2)
  t = jnp.ones_like(q)
  attempts = {
      "hessian": lambda: jax.hessian(loss)(q),
      "grad of grad, jitted": lambda: jax.grad(
          lambda q: jnp.vdot(jax.grad(jax.jit(loss))(q), t))(q),
      "jvp": lambda: jax.jvp(loss, (q,), (t,)),
  }
  for name, attempt in attempts.items():
    with pytest.raises(UnsupportedDifferentiation, match=r"method='blasst'.*return_stats"):
      attempt()
    del name
  assert jnp.all(jnp.isfinite(jax.grad(loss)(q)))  # first order still works


def test_every_method_needs_no_implicit_rank_promotion():
  """Causal selection masks, the BFLA sink rescue and the padded-row masks broadcast
  explicitly: every method runs under numpy_rank_promotion("raise") (moba, bfla, prism
  and blasst raised there before)."""
  q, k, v = (x[:, :12] for x in _inputs(6))
  with jax.numpy_rank_promotion("raise"):
    for method in ("blasst", "moba", "bfla", "prism"):
      out = jax.eval_shape(functools.partial(
          block_sparse_attention, method=method, block_size=BS, is_causal=True,
          key_value_seq_lengths=jnp.asarray([12, 9]), **SETTINGS[method]), q, k, v)
      assert out.shape == q.shape, method
