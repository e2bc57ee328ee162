"""ACP block pruning of Forgetting attention's decay in the Pallas kernels
(``decay_prune_threshold``): a (query block, key block) tile whose decay bound
``max_i cq_i - min_j ck_j`` is below the threshold is skipped in every pass.

Oracle: the dense xla path with the skipped tiles hidden by a mask computes exactly what
the pruned kernel computes (forward and every cotangent, cq and ck included); against the
unpruned output the error stays within xla_chunked's documented bound. With a dense bias
the bias's gradient is zero on the skipped tiles, as the oracle's. Classes E, S and P skip
the pruned tiles through a block table; classes T and R hide them inside every pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from jaxsoft import attention
from kernels_pallas import _api
from tests.kernels_pallas.test_engine import TRITON_SMALL, assert_matches, inputs

N, KH, H = 2, 1, 16
THRESHOLD = -4.0
BLOCKS = {"triton": TRITON_SMALL, "mosaic_tpu": dict(block_q=16, block_k=128)}
SHAPES = {"triton": (2, 64), "mosaic_tpu": (1, 256)}  # (B, T): Mosaic's keys in 128s


def _fox_decay(B, T, seed=71):
  """cq = ck = cumulative log forget gates, strong enough that distant tiles fall below
  the threshold (about -0.35 per step)."""
  gates = jax.nn.log_sigmoid(1.0 + 0.5 * jax.random.normal(jax.random.key(seed), (B, T, N)))
  c = jnp.cumsum(gates, axis=1)
  return c, c


def _kept_mask(cq, ck, backend):
  """The element mask [B, N, T, T] of the tiles the kernel keeps (its block shape)."""
  T = cq.shape[1]
  bq, bk = BLOCKS[backend]["block_q"], BLOCKS[backend]["block_k"]
  t_pad, s_pad = -(-T // bq) * bq, -(-T // bk) * bk
  bl = kp.BlockSizes(bq, bk).resolved()
  keep = _api._decay_keep_table((cq, ck), THRESHOLD, bl, t_pad, s_pad)  # [B, N, nq, nk]
  rows = jnp.repeat(jnp.repeat(keep, bq, axis=2), bk, axis=3)
  return rows[:, :, :T, :T]


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic_tpu",
                                                             marks=pytest.mark.slow)])
def test_pruned_kernel_is_dense_attention_over_the_kept_tiles(backend):
  B, T = SHAPES[backend]
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=72)
  cq, ck = _fox_decay(B, T)
  kept = _kept_mask(cq, ck, backend)
  causal = np.tril(np.ones((T, T), bool))[None, None]  # [1, 1, T, T] against [B, N, T, T]
  skipped = float(1.0 - jnp.sum(kept & causal) / (B * N * causal.sum()))
  assert 0.2 < skipped < 0.9, skipped  # the threshold prunes, and not everything

  def pruned(q, k, v, cq, ck):
    return kp.attention(q, k, v, is_causal=True, decay_bias=(cq, ck), backend=backend,
                        interpret=True, block_sizes=BLOCKS[backend],
                        decay_prune_threshold=THRESHOLD)

  def oracle(q, k, v, cq, ck):
    return attention.dot_product_attention(q, k, v, mask=kept, is_causal=True,
                                           decay_bias=(cq, ck), implementation="xla")

  out, grads = assert_matches(pruned, oracle, (q, k, v, cq, ck), ct)
  assert bool(jnp.any(grads[3] != 0)) and bool(jnp.any(grads[4] != 0))
  # against the unpruned result: within 2 max|v| sum_skipped w_ij, each skipped weight at
  # most e^{l_ij - l_ii} (the diagonal's decay is 0: D_i >= e^{l_ii}), the decay of
  # l_ij below the threshold
  full, logits = jax.jit(lambda q, k, v, cq, ck: (  # one compilation, not one per op
      attention.dot_product_attention(q, k, v, is_causal=True, decay_bias=(cq, ck),
                                      implementation="xla"),
      attention.dense_logits(q, k, scale=1 / np.sqrt(H), decay_bias=(cq, ck))))(
          q, k, v, cq, ck)
  diag = jnp.diagonal(logits, axis1=-2, axis2=-1)[..., None]
  terms = jnp.where(causal & ~kept, jnp.exp(logits - diag), 0.0)
  bound = 2 * float(jnp.max(jnp.abs(v))) * jnp.sum(terms, axis=-1)  # [B, N, T]
  err = jnp.max(jnp.abs(out - full), axis=-1)  # [B, T, N]
  assert bool(jnp.all(err <= jnp.swapaxes(bound, 1, 2) + 1e-6))
  assert float(jnp.max(err)) > 0  # something was skipped



def test_pruning_with_a_dense_mask():
  """A dense mask [B, 1, T, S] (read per kept tile): the pruned kernel is the dense path
  over the kept tiles and the mask, forward and every cotangent."""
  B, T = SHAPES["triton"]
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=76)
  cq, ck = _fox_decay(B, T)
  mask = jax.random.bernoulli(jax.random.key(77), 0.8, (B, 1, T, T))
  kept = _kept_mask(cq, ck, "triton")
  assert_matches(
      lambda q, k, v, cq, ck: kp.attention(
          q, k, v, mask=mask, is_causal=True, decay_bias=(cq, ck), interpret=True,
          block_sizes=BLOCKS["triton"], decay_prune_threshold=THRESHOLD),
      lambda q, k, v, cq, ck: attention.dot_product_attention(
          q, k, v, mask=kept & mask, is_causal=True, decay_bias=(cq, ck),
          implementation="xla"),
      (q, k, v, cq, ck), ct)


def test_pruning_keeps_rows_without_a_visible_key_zero():
  """A batch row of key length 0 under pruning: zero output, zero and finite gradients; the
  other row is the dense path over the kept tiles."""
  B, T = SHAPES["triton"]
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=78)
  cq, ck = _fox_decay(B, T)
  lengths = jnp.array([T, 0], jnp.int32)
  kept = _kept_mask(cq, ck, "triton")
  out, grads = assert_matches(
      lambda q, k, v: kp.attention(
          q, k, v, is_causal=True, decay_bias=(cq, ck), key_value_seq_lengths=lengths,
          interpret=True, block_sizes=BLOCKS["triton"], decay_prune_threshold=THRESHOLD),
      lambda q, k, v: attention.dot_product_attention(
          q, k, v, mask=kept, is_causal=True, decay_bias=(cq, ck),
          key_value_seq_lengths=lengths, implementation="xla"),
      (q, k, v), ct)
  assert bool(jnp.all(out[1] == 0)) and all(bool(jnp.all(g[1] == 0)) for g in grads)


@pytest.mark.parametrize("backend,bias_shape", [
    ("triton", (64, 64)), ("mosaic_tpu", (1, 2, 256, 256)),
    pytest.param("triton", (2, 2, 64, 64), marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", (256, 256), marks=pytest.mark.slow)])
def test_pruning_with_a_dense_bias(backend, bias_shape):
  """A dense bias, broadcast or per head: the pruned kernel is the dense path over the kept
  tiles, forward and every cotangent; the bias's gradient is the dQ passes' dS, zero on the
  skipped tiles (Triton clears every block before writing the listed ones, Mosaic writes
  its listed tiles into slots scattered afterwards)."""
  B, T = SHAPES[backend]
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=73)
  cq, ck = _fox_decay(B, T)
  bias = 0.3 * jax.random.normal(jax.random.key(74), bias_shape)
  kept = _kept_mask(cq, ck, backend)
  _, grads = assert_matches(
      lambda q, k, v, bias: kp.attention(
          q, k, v, bias=bias, is_causal=True, decay_bias=(cq, ck), backend=backend,
          interpret=True, block_sizes=BLOCKS[backend], decay_prune_threshold=THRESHOLD),
      lambda q, k, v, bias: attention.dot_product_attention(
          q, k, v, bias=bias, mask=kept, is_causal=True, decay_bias=(cq, ck),
          implementation="xla"),
      (q, k, v, bias), ct)
  dbias = grads[3] if len(bias_shape) == 2 else grads[3][0, 0]  # [T, T] of batch 0, head 0
  skipped = ~kept[0, 0] & np.tril(np.ones((T, T), bool))
  assert bool(jnp.any(skipped)) and bool(jnp.any(dbias != 0))
  if len(bias_shape) == 4:  # per (batch, head): exactly zero on its skipped tiles
    assert bool(jnp.all(jnp.where(skipped, dbias, 0.0) == 0))


@pytest.mark.parametrize("backend,normalizer", [
    ("triton", "sparsemax"), ("mosaic_tpu", "standardized_softmax"),
    pytest.param("triton", "entmax15", marks=pytest.mark.slow),
    pytest.param("triton", "softmax", marks=pytest.mark.slow),  # class E: the block table
    pytest.param("triton", "top_p_softmax", marks=pytest.mark.slow),
    pytest.param("triton", "nap", marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", "top_k_softmax", marks=pytest.mark.slow)])
def test_classes_t_and_r_prune_inside_the_tiles(monkeypatch, backend, normalizer):
  """Classes T and R (one tile shape for every pass; the search's live blocks, the
  statistics passes' ranges) hide a pruned tile inside each pass (``engine.prune_mask``):
  the threshold search, the statistics and every backward pass see the dense path over the
  kept tiles, forward and every cotangent (cq and ck included); through the dispatcher
  too."""
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")
  B, T = SHAPES[backend]
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=79)
  q = 4.0 * q  # scores spread wide: the pruned keys would be in the threshold's support
  cq, ck = _fox_decay(B, T)
  kept = _kept_mask(cq, ck, backend)
  params = {"k": 24} if normalizer == "top_k_softmax" else None
  kw = dict(normalizer=normalizer, normalizer_params=params, is_causal=True)
  unpruned, oracle = jax.jit(lambda q, k, v, cq, ck: (  # one compilation, not one per op
      attention.dot_product_attention(q, k, v, decay_bias=(cq, ck), implementation="xla",
                                      **kw),
      attention.dot_product_attention(q, k, v, mask=kept, decay_bias=(cq, ck),
                                      implementation="xla", **kw)))(q, k, v, cq, ck)
  assert float(jnp.max(jnp.abs(unpruned - oracle))) > 1e-3  # pruning changes the answer
  out, grads = assert_matches(
      lambda q, k, v, cq, ck: kp.attention(
          q, k, v, decay_bias=(cq, ck), backend=backend, interpret=True,
          block_sizes=BLOCKS[backend], decay_prune_threshold=THRESHOLD, **kw),
      lambda q, k, v, cq, ck: attention.dot_product_attention(
          q, k, v, mask=kept, decay_bias=(cq, ck), implementation="xla", **kw),
      (q, k, v, cq, ck), ct)
  assert bool(jnp.any(grads[3] != 0))
  if backend == "triton":  # the dispatcher reaches the pruned kernel (its default tiles)
    got = jax.jit(lambda q, k, v, cq, ck: attention.dot_product_attention(
        q, k, v, decay_bias=(cq, ck), decay_prune_threshold=THRESHOLD,
        implementation="pallas", **kw))(q, k, v, cq, ck)
    assert bool(jnp.all(jnp.isfinite(got))) and float(jnp.max(jnp.abs(got - unpruned))) > 0


@pytest.mark.parametrize("normalizer", ["sparsemax", "standardized_softmax"])
def test_classes_t_and_r_pruning_keeps_rows_without_a_visible_key_zero(normalizer):
  """Classes T and R under in-tile pruning with a batch row of key length 0: zero output,
  zero and finite gradients; the other row is the dense path over the kept tiles."""
  B, T = SHAPES["triton"]
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=80)
  cq, ck = _fox_decay(B, T)
  lengths = jnp.array([T, 0], jnp.int32)
  kept = _kept_mask(cq, ck, "triton")
  kw = dict(normalizer=normalizer, is_causal=True, decay_bias=(cq, ck),
            key_value_seq_lengths=lengths)
  out, grads = assert_matches(
      lambda q, k, v: kp.attention(q, k, v, interpret=True, block_sizes=BLOCKS["triton"],
                                   decay_prune_threshold=THRESHOLD, **kw),
      lambda q, k, v: attention.dot_product_attention(q, k, v, mask=kept,
                                                      implementation="xla", **kw),
      (q, k, v), ct)
  assert bool(jnp.all(out[1] == 0)) and all(bool(jnp.all(g[1] == 0)) for g in grads)


@pytest.mark.parametrize("bias,normalizer", [
    (False, "softmax"), (True, "softmax"), (False, "sparsemax"),
    (False, "standardized_softmax")],
    ids=["decay", "decay_bias", "class_t", "class_r"])
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_pruned_decay_lowers_for_both_targets(backend, bias, normalizer):
  """The block-table kernels with the decay's row and column operands (and a dense bias,
  whose dS the block-table dQ passes write), and the class-T and class-R passes that hide
  the pruned tiles themselves, export for cuda and tpu."""
  from tests.kernels_pallas.test_lowering import export_fwd_bwd
  q = jax.ShapeDtypeStruct((2, 512, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 512, 2, 64), jnp.bfloat16)
  cq = jnp.cumsum(jnp.full((2, 512, 4), -0.1), axis=1)
  dense = 0.1 * jnp.ones((4, 512, 512), jnp.float32) if bias else None
  text = export_fwd_bwd(
      lambda q, k, v: kp.attention(q, k, v, dense, is_causal=True, decay_bias=(cq, cq),
                                   decay_prune_threshold=-4.0, backend=backend,
                                   normalizer=normalizer),
      backend, q, k)
  assert text.count("jaxsoft_attention_") >= 3
