"""implementation="xla_chunked" against jax.nn.dot_product_attention (softmax) and the dense
path: every mask kind, GQA, cross-attention, vmap, odd lengths, segments, fully masked rows,
bf16, decay bias and block pruning, float64 gradients and the O(T·H) memory claim."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.normalizers as nz
from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from tests import helpers
from tests.attention.reference import assert_same_jit as assert_same
from tests.attention.test_dense import MASK_CASES, B, H, K, N, T
from tests.helpers import make_qkv, sampled, segment_mask

chunked = functools.partial(dpa, implementation="xla_chunked")


@pytest.fixture
def blocks(monkeypatch):
  """Small blocks so that a short sequence spans several blocks (with padding)."""

  def set_blocks(bq, bk):
    monkeypatch.setattr(_chunked, "BLOCK_Q", bq)
    monkeypatch.setattr(_chunked, "BLOCK_K", bk)

  set_blocks(4, 4)
  return set_blocks


@pytest.mark.parametrize(
    "case", sampled(sorted(MASK_CASES),
                    {"bias_broadcast", "causal_padding_mask", "causal_window_bias"}))
def test_softmax_matches_jax_nn(case, blocks):
  kw = dict(MASK_CASES[case])
  q, k, v = make_qkv(0, B, T, N=N, K=K, H=H)
  bias = kw.pop("bias", None)
  args = (q, k, v) if bias is None else (q, k, v, bias)
  assert_same(functools.partial(chunked, **kw),
              functools.partial(jax.nn.dot_product_attention, **kw), args)


@pytest.mark.parametrize(
    "shape", sampled([(2, 9, 13, 4, 4), (2, 9, 13, 6, 2), (1, 5, 8, 3, 1)], {"gqa_cross"},
                     ids=["mha_cross", "gqa_cross", "mqa"]))
def test_heads_and_cross_attention(shape, blocks):
  blocks(4, 8)
  b, t, s, n, kh = shape
  q, k, v = make_qkv(1, b, t, S=s, N=n, K=kh, H=H)
  bias = 0.5 * helpers.standard_normal(2, (b, n, t, s))
  kw = {"is_causal": True, "local_window_size": (5, 1)}
  assert_same(functools.partial(chunked, **kw),
              functools.partial(jax.nn.dot_product_attention, **kw), (q, k, v, bias))


def test_vmap_and_jit(blocks):
  q, k, v = make_qkv(2, 3, 10, N=2, K=1, H=H)
  ours = jax.jit(jax.vmap(lambda q, k, v: chunked(q, k, v, is_causal=True)))
  ref = jax.vmap(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
  assert_same(ours, ref, (q, k, v))


@pytest.mark.parametrize(
    "length_block", sampled([(1, None), (7, 4), (384, 128), (1000, None)], {"7"},
                            ids=["1", "7", "384", "1000"]))
def test_lengths_not_multiples_of_the_block(length_block, blocks):
  length, block = length_block
  blocks(block or 512, block or 512)
  q, k, v = make_qkv(3, 1, length, N=2, K=1, H=16)
  kvl = jnp.array([max(1, length - 3)], jnp.int32)
  kw = {"is_causal": True, "key_value_seq_lengths": kvl}
  assert_same(functools.partial(chunked, **kw),
              functools.partial(jax.nn.dot_product_attention, **kw), (q, k, v))


def test_segment_ids_match_explicit_mask(blocks):
  q, k, v = make_qkv(4, B, T, N=N, K=K, H=H)
  # packed sequences, and ids that are not contiguous runs
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [5, 7, 5, 7, 7, 1, 7, 7, 1, 1, 5]])
  kw = {"is_causal": True}
  assert_same(functools.partial(chunked, segment_ids=seg, **kw),
              functools.partial(jax.nn.dot_product_attention, mask=segment_mask(seg, seg),
                                **kw), (q, k, v))


@pytest.mark.slow
def test_cross_attention_segment_pair(blocks):
  q, k, v = make_qkv(5, B, 6, S=9, N=N, K=K, H=H)
  q_seg = jnp.array([[0, 0, 1, 1, 2, 2], [3, 3, 3, 4, 4, 4]])
  kv_seg = jnp.array([[0, 1, 1, 2, 2, 2, 0, 1, 2], [4, 4, 3, 3, 3, 4, 4, 3, 3]])
  assert_same(functools.partial(chunked, segment_ids=(q_seg, kv_seg)),
              functools.partial(jax.nn.dot_product_attention, mask=segment_mask(q_seg, kv_seg)),
              (q, k, v))


def test_fully_masked_rows_are_zero_with_finite_grads(blocks):
  q, k, v = make_qkv(6, B, T, N=N, K=K, H=H)
  mask = jnp.ones((1, 1, T, T), bool).at[..., 5, :].set(False)
  qsl = jnp.array([9, 11], jnp.int32)
  kw = {"mask": mask, "query_seq_lengths": qsl, "local_window_size": (3, 3)}
  out, grads = assert_same(functools.partial(chunked, **kw),
                           functools.partial(dpa, implementation="xla", **kw), (q, k, v))
  np.testing.assert_array_equal(np.asarray(out[:, 5]), 0.0)
  np.testing.assert_array_equal(np.asarray(out[0, 9:]), 0.0)
  np.testing.assert_array_equal(np.asarray(grads[0][:, 5]), 0.0)
  # a window that leaves rows without keys (right window -2: row i sees j >= i + 2 only)
  kw = {"local_window_size": (-2, 3)}
  out, _ = assert_same(functools.partial(chunked, **kw),
                       functools.partial(dpa, implementation="xla", **kw), (q, k, v))
  np.testing.assert_array_equal(np.asarray(out[:, T - 2:]), 0.0)


def test_bf16_inputs(blocks):
  q, k, v = make_qkv(7, B, T, N=N, K=K, H=H, dtype=jnp.bfloat16)
  # jitted: one program each instead of op-by-op dispatch
  out = jax.jit(functools.partial(chunked, is_causal=True))(q, k, v)
  assert out.dtype == jnp.bfloat16
  f32 = [t.astype(jnp.float32) for t in (q, k, v)]
  ref = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True))(*f32)
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2, rtol=2e-2)
  g = jax.jit(jax.grad(lambda q: jnp.sum(chunked(q, k, v, is_causal=True).astype(
      jnp.float32))))(q)
  g_ref = jax.jit(jax.grad(lambda q: jnp.sum(jax.nn.dot_product_attention(
      q, f32[1], f32[2], is_causal=True))))(f32[0])
  assert g.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(g, np.float32), g_ref, atol=5e-2, rtol=5e-2)


def _fox(seed, b, t, n):
  log_f = jax.nn.log_sigmoid(2.0 + jax.random.normal(jax.random.PRNGKey(seed), (b, t, n)))
  c = jnp.cumsum(log_f, axis=1)
  return c


def test_decay_bias_soft_cap_and_bias_match_dense(blocks):
  q, k, v = make_qkv(8, B, T, N=N, K=K, H=H)
  bias = 0.3 * helpers.standard_normal(9, (B, N, T, T))
  c = _fox(10, B, T, N)
  ck = c + 0.1 * jax.random.normal(jax.random.PRNGKey(11), c.shape)

  def f(impl, q, k, v, bias, cq, ck):
    return dpa(q, k, v, bias, is_causal=True, logits_soft_cap=1.5, decay_bias=(cq, ck),
               implementation=impl)

  assert_same(functools.partial(f, "xla_chunked"), functools.partial(f, "xla"),
              (q, k, v, bias, c, ck))


def test_decay_pruning_bound(blocks):
  blocks(8, 8)
  t = 64
  q, k, v = make_qkv(12, 1, t, N=2, K=2, H=H)
  c = _fox(13, 1, t, 2) * 2.0
  thr = -6.0

  def f(threshold):  # jitted, with q, k, v and the decay as (concrete) constants
    return jax.jit(lambda: chunked(q, k, v, is_causal=True, decay_bias=(c, c),
                                   decay_prune_threshold=threshold))()

  exact = f(None)
  # a very negative threshold prunes nothing
  chex.assert_trees_all_close(f(-1e30), exact, atol=1e-6)
  pruned_out = f(thr)
  # which (i, j) the threshold prunes, from the block table
  cq5 = jnp.transpose(c, (0, 2, 1))[:, :, None]
  table = np.asarray(_chunked._block_prune_table(cq5, cq5, 8, 8, thr))
  assert table.sum() > 0, "the test must prune some blocks"
  pruned = np.kron(table, np.ones((8, 8), bool))
  # dense weights and logits (without and with the decay term)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
  decay = jnp.transpose(c, (0, 2, 1))
  full = logits + decay[..., :, None] - decay[..., None, :]
  causal = np.tril(np.ones((t, t), bool))
  w = jax.nn.softmax(full, axis=-1, where=causal)
  pruned_mass = jnp.sum(jnp.where(pruned & causal, w, 0.0), axis=-1)  # [B, N, T]
  # the documented bound on each pruned weight: w_ij <= e^{thr + l_ij - l_ii}
  diag = jnp.diagonal(logits, axis1=-2, axis2=-1)[..., :, None]
  bound_w = jnp.exp(thr + logits - diag)
  assert bool(jnp.all(jnp.where(pruned & causal, w <= bound_w * (1 + 1e-5), True)))
  # and the output error: |O - O'| <= 2 max|v| · (pruned mass) <= 2 max|v| sum bound_w
  err = jnp.max(jnp.abs(pruned_out - exact), axis=-1)  # [B, T, N]
  vmax = float(jnp.max(jnp.abs(v)))
  allowed = 2 * vmax * jnp.transpose(pruned_mass, (0, 2, 1)) + 1e-5
  assert bool(jnp.all(err <= allowed))
  doc_bound = 2 * vmax * jnp.sum(jnp.where(pruned & causal, bound_w, 0.0), axis=-1)
  assert bool(jnp.all(err <= jnp.transpose(doc_bound, (0, 2, 1)) + 1e-5))
  assert float(jnp.max(err)) > 0  # pruning really changed something


def test_check_grads_float64(blocks):
  with jax.enable_x64(True):
    q, k, v = make_qkv(14, 1, 6, N=2, K=1, H=4, dtype=jnp.float64)
    bias = 0.5 * jax.random.normal(jax.random.PRNGKey(15), (1, 2, 6, 6), jnp.float64)
    # jit: check_grads evaluates f many times; one compiled program instead of op by op
    f = jax.jit(lambda q, k, v, b: chunked(q, k, v, b, is_causal=True, logits_soft_cap=3.0))
    assert f(q, k, v, bias).dtype == jnp.float64
    jax.test_util.check_grads(f, (q, k, v, bias), order=1, modes=("rev",))


def _max_intermediate(jaxpr) -> int:
  """Largest number of elements of any value in a jaxpr, sub-jaxprs included."""
  best = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      if hasattr(var.aval, "shape"):
        best = max(best, int(np.prod(var.aval.shape)))
    for value in eqn.params.values():
      for x in value if isinstance(value, (tuple, list)) else (value,):
        sub = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)
        if hasattr(sub, "eqns"):
          best = max(best, _max_intermediate(sub))
  return best


def test_memory_is_linear_in_length(blocks):
  blocks(64, 64)
  t = 1024
  q, k, v = make_qkv(16, 1, t, N=1, K=1, H=8)
  grad = jax.grad(lambda q, k, v: jnp.sum(chunked(q, k, v, is_causal=True)), argnums=(0, 1, 2))
  biggest = _max_intermediate(jax.make_jaxpr(grad)(q, k, v).jaxpr)
  assert biggest <= 64 * 64 * 4, biggest  # a few tiles, never T x S
  dense = jax.grad(lambda q: jnp.sum(dpa(q, k, v, is_causal=True, implementation="xla")))
  assert _max_intermediate(jax.make_jaxpr(dense)(q).jaxpr) >= t * t  # the oracle is dense


@pytest.mark.parametrize("name", sorted(n for n, s in nz.REGISTRY.items() if s.row_stats is not None))
def test_class_r_memory_is_linear_in_length(name, blocks):
  """Class R (a statistics pass, then an E or P pass; two backward sweeps): no T x S value
  in the forward or the backward program."""
  blocks(64, 64)
  t = 512
  q, k, v = make_qkv(17, 1, t, N=1, K=1, H=8)
  grad = jax.grad(lambda q, k, v: jnp.sum(chunked(q, k, v, is_causal=True, normalizer=name)),
                  argnums=(0, 1, 2))
  biggest = _max_intermediate(jax.make_jaxpr(grad)(q, k, v).jaxpr)
  assert biggest <= 64 * 64 * 4, biggest
