"""A48 merge_kv / alternating_matching (jaxsoft/attention/_merge.py).

Oracle: attention over the unmerged keys with exact duplicates (dot_product_attention),
and numpy means and counts.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention import dot_product_attention
from jaxsoft.attention._merge import alternating_matching, merge_kv
from tests.helpers import BWD, FWD, check_raises, normal, value_and_vjp

attend = jax.jit(dot_product_attention)


def _duplicated(seed=0, B=2, C=5, K=2, N=4, H=8, T=6):
  """Distinct keys/values per cluster, expanded to S positions by a random assignment."""
  rng = np.random.default_rng(seed)
  assign = np.stack([rng.permutation(np.r_[np.arange(C), rng.integers(0, C, 7)])
                     for _ in range(B)]).astype(np.int32)  # every cluster used, S = C + 7
  kc, vc = normal(seed, (B, C, K, H)), normal(seed + 1, (B, C, K, H))
  idx = jnp.asarray(assign)[:, :, None, None]
  k = jnp.take_along_axis(kc, idx, axis=1)
  v = jnp.take_along_axis(vc, idx, axis=1)
  return normal(seed + 2, (B, T, N, H)), k, v, jnp.asarray(assign), C


def test_merged_equals_unmerged_duplicates_values_and_grads():
  q, k, v, assign, C = _duplicated()

  def merged(q, k, v):
    mk, mv, bias = merge_kv(k, v, assign, C)
    return dot_product_attention(q, mk, mv, bias)

  def full(q, k, v):
    return dot_product_attention(q, k, v)

  out, grads, _ = value_and_vjp(merged, q, k, v)
  want, grads_want, _ = value_and_vjp(full, q, k, v)
  chex.assert_trees_all_close(out, want, **FWD)
  # at exact duplicates each copy's gradient is 1/n of the merged key's: equal to the
  # unmerged attention's gradient of that copy
  chex.assert_trees_all_close(grads, grads_want, **BWD)


def test_without_bias_the_duplicates_are_undercounted():
  q, k, v, assign, C = _duplicated(seed=3)
  mk, mv, bias = merge_kv(k, v, assign, C)
  wrong = attend(q, mk, mv)
  want = attend(q, k, v)
  assert float(jnp.max(jnp.abs(wrong - want))) > 1e-2


def test_means_counts_and_empty_cluster():
  rng = np.random.default_rng(1)
  k = rng.standard_normal((2, 6, 1, 3)).astype(np.float32)
  v = rng.standard_normal((2, 6, 1, 2)).astype(np.float32)
  assign = np.array([[0, 0, 1, 3, 3, 3], [1, 1, 1, 1, 0, 3]], np.int32)  # cluster 2 empty
  mk, mv, bias = merge_kv(k, v, assign, 4)
  assert mk.shape == (2, 4, 1, 3) and mv.shape == (2, 4, 1, 2) and bias.shape == (2, 1, 1, 4)
  for b in range(2):
    for c in range(4):
      members = assign[b] == c
      if members.any():
        np.testing.assert_allclose(mk[b, c], k[b, members].mean(0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(mv[b, c], v[b, members].mean(0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(bias[b, 0, 0, c], np.log(members.sum()), rtol=1e-6)
      else:
        assert np.all(np.asarray(mk[b, c]) == 0) and bias[b, 0, 0, c] == -np.inf
  # the empty cluster is masked: attention equals attention without it
  q = rng.standard_normal((2, 3, 2, 3)).astype(np.float32)
  out = attend(q, mk, mv, bias)
  keep = np.array([0, 1, 3])
  ref = attend(q, mk[:, keep], mv[:, keep], bias[..., keep])
  chex.assert_trees_all_close(out, ref, **FWD)
  assert np.all(np.isfinite(np.asarray(out)))


def test_bf16_and_jit():
  q, k, v, assign, C = _duplicated(seed=5)
  f = jax.jit(lambda q, k, v, a: dot_product_attention(q, *merge_kv(k, v, a, C)))
  out = f(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), assign)
  assert out.dtype == jnp.bfloat16
  want = attend(q, k, v)
  chex.assert_trees_all_close(out.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)


def test_alternating_matching_merges_duplicate_pairs_within_chunks():
  rng = np.random.default_rng(2)
  B, S, K, H = 1, 8, 2, 4
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  k[0, 2] = k[0, 1]  # a = position 2 duplicates b = position 1 (chunk 0)
  k[0, 6] = k[0, 7]  # a = 6 duplicates b = 7 (chunk 1)
  k[0, 4] = k[0, 3]  # crosses the chunk boundary: must not be merged
  match = jax.jit(alternating_matching, static_argnames=("chunk_size", "num_merges"))
  assign = np.asarray(match(k, chunk_size=4, num_merges=1))
  assert assign.shape == (B, S)
  assert assign[0, 2] == assign[0, 1] and assign[0, 6] == assign[0, 7]
  assert assign[0, 4] != assign[0, 3]
  assert len(np.unique(assign)) == S - 2 and assign.max() == S - 3
  # merging them and attending equals attending over all keys (the duplicates are exact)
  v = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v[0, 2], v[0, 6] = v[0, 1], v[0, 7]
  q = rng.standard_normal((B, 3, 4, H)).astype(np.float32)
  out = attend(q, *merge_kv(k, v, assign, S - 2))
  chex.assert_trees_all_close(out, attend(q, k, v), **FWD)


def test_errors_name_the_argument():
  k = jnp.zeros((1, 4, 1, 2))
  check_raises(
      ("`key`", lambda: merge_kv(k[0], k, jnp.zeros(4, jnp.int32))),
      ("`value`", lambda: merge_kv(k, k[:, :3], jnp.zeros(4, jnp.int32))),
      ("`assignment`", lambda: merge_kv(k, k, jnp.zeros(4))),
      ("`assignment`", lambda: merge_kv(k, k, jnp.zeros(3, jnp.int32))),
      ("`assignment` values", lambda: merge_kv(k, k, jnp.array([0, 1, 2, 5]), 3)),
      ("`num_clusters`", lambda: merge_kv(k, k, jnp.zeros(4, jnp.int32), 0)),
      ("`num_clusters`", lambda: jax.jit(lambda a: merge_kv(k, k, a))(jnp.zeros(4, jnp.int32))),
      ("`chunk_size`", lambda: alternating_matching(k, chunk_size=3, num_merges=1)),
      ("`num_merges`", lambda: alternating_matching(k, chunk_size=2, num_merges=2)),
  )


def test_traced_assignment_equals_eager():
  _, k, v, _, _ = _duplicated(seed=7)
  a = jnp.asarray(np.arange(k.shape[1]) % 3, jnp.int32)[None].repeat(k.shape[0], 0)
  got = jax.jit(lambda a: merge_kv(k, v, a, 3))(a)
  chex.assert_trees_all_close(got, merge_kv(k, v, a), **FWD)
