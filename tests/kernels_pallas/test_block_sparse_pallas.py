"""A12 block_sparse_attention(implementation="pallas*"): the Pallas engine's block tables.

MoBA, BFLA and Prism choose their key blocks before the key loop; the Pallas path runs
the same selection and then softmax attention in the engine over the kept blocks only
(``attention_from_call(block_table=..., row_blocks=...)``), in interpret mode here.

Oracles: the xla_chunked ``block_sparse_attention`` (independent blockwise XLA loops) for
the output and the q, k, v cotangents; for the engine's table entry a dense float32
softmax whose mask is the table expanded per query row; NaN in key/value blocks that no
table lists (a pass that read them would spread the NaN); cross-lowering with
``jax.export`` for CUDA (Triton) and TPU (Mosaic).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from jaxsoft.attention import block_sparse_attention
from jaxsoft.attention.call import AttentionCall
from kernels_pallas import _api
from tests.kernels_pallas.test_engine import value_and_cotangents
from tests.kernels_pallas.test_lowering import export_fwd_bwd

B, T, N, K, H, BS = 2, 64, 4, 2, 16, 16
NB = T // BS
KV_LEN = jnp.array([T, 41])  # batch 1: a partial key block and an empty one
SETTINGS = {
    "moba": dict(top_k_blocks=2),
    "bfla": dict(mass_threshold=0.7, top_k_blocks=3),
    "prism": dict(top_k_blocks=2, high_frequency_pairs=1),
}


@pytest.fixture(autouse=True)
def interpret_env(monkeypatch):
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")


def _inputs(seed=0, t=T, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = 2.0 * jax.random.normal(ks[0], (B, t, N, H), dtype)  # peaked: selective gates
  k = jax.random.normal(ks[1], (B, t, K, H), dtype)
  v = jax.random.normal(ks[2], (B, t, K, H), dtype)
  ct = jax.random.normal(ks[3], (B, t, N, H), dtype)
  return q, k, v, ct


def _sparse(method, implementation, *, is_causal, block_size=BS, kv_len=KV_LEN, **kw):
  return functools.partial(block_sparse_attention, method=method, block_size=block_size,
                           is_causal=is_causal, key_value_seq_lengths=kv_len,
                           implementation=implementation, **{**SETTINGS[method], **kw})


def _check_against_xla(method, is_causal, implementation="pallas", seed=0, t=T,
                       block_size=BS, kv_len=KV_LEN, dtype=jnp.float32, tol=(1e-5, 1e-4)):
  """The Pallas path's output and q, k, v cotangents (and its stats) against xla_chunked's;
  the kept sets must skip something and differ between heads."""
  q, k, v, ct = _inputs(seed, t, dtype)
  kw = dict(is_causal=is_causal, block_size=block_size, kv_len=kv_len)

  @jax.jit
  def pallas(q, k, v):
    out, vjp, stats = jax.vjp(_sparse(method, implementation, return_stats=True, **kw),
                              q, k, v, has_aux=True)
    return out, vjp(ct), stats

  out, grads, stats = pallas(q, k, v)
  ref, ref_grads = jax.jit(lambda *a: value_and_cotangents(
      _sparse(method, "xla_chunked", **kw), a, ct))(q, k, v)
  kept = np.asarray(stats["kept_tokens"])  # [B, N, T, nk]: what each token attends to
  own = np.arange(t) // block_size
  visible = own + 1 if is_causal else np.full(t, -(-t // block_size))
  assert 0 < kept.sum() < B * N * visible.sum()  # something is skipped ...
  assert any(not np.array_equal(kept[:, 0], kept[:, h]) for h in range(1, N))  # ... per head
  sc = max(1.0, float(jnp.max(jnp.abs(ref))))
  chex.assert_trees_all_close(out, ref, atol=tol[0] * sc, rtol=tol[0])
  for g, r in zip(grads, ref_grads, strict=True):
    gs = max(1.0, float(jnp.max(jnp.abs(r))))
    chex.assert_trees_all_close(g, r, atol=tol[1] * gs, rtol=tol[1])
    assert bool(jnp.all(jnp.isfinite(g)))


# MoBA selects per query token (causal or not: each token's own list, their union as the
# block's table row); BFLA and Prism per query block without is_causal, per token with it.
@pytest.mark.parametrize("method,is_causal", [
    ("moba", True), pytest.param("moba", False, marks=pytest.mark.slow),
    pytest.param("bfla", False, marks=pytest.mark.slow),
    pytest.param("prism", True, marks=pytest.mark.slow),
    pytest.param("bfla", True, marks=pytest.mark.slow),
    pytest.param("prism", False, marks=pytest.mark.slow)])
def test_pallas_equals_xla_chunked(method, is_causal):
  _check_against_xla(method, is_causal)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["moba", "bfla", "prism"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_pallas_equals_xla_chunked_sweep(method, is_causal):
  # longer, 32-wide blocks, a sequence that is not a multiple of the block, both drivers
  # (Mosaic: no key lengths, so 32-row key blocks are legal)
  _check_against_xla(method, is_causal, seed=3, t=120, block_size=32,
                     kv_len=jnp.array([120, 77]))
  _check_against_xla(method, is_causal, "pallas_mosaic_tpu", seed=4, t=96, block_size=32,
                     kv_len=None)


@pytest.mark.slow
def test_pallas_bf16():
  _check_against_xla("moba", True, dtype=jnp.bfloat16, tol=(2e-2, 5e-2))


def _row_lists(table, seed, per_row=2):
  """Per query row up to ``per_row`` of its block's table entries (-1 = none)."""
  rng = np.random.default_rng(seed)
  b, n, nq, _ = table.shape
  sel = np.full((b, n, nq * BS, per_row), -1, np.int32)
  for i in np.ndindex(b, n, nq * BS):
    opts = np.flatnonzero(table[i[0], i[1], i[2] // BS])
    pick = rng.permutation(opts)[:rng.integers(0, per_row + 1)]
    sel[i + (slice(0, len(pick)),)] = pick
  return sel


def _dense_table_reference(q, k, v, row_keep, is_causal):
  """Softmax over the keys of the blocks each row kept ([B, N, T, nk] bool), dense."""
  qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
  kf, vf = (jnp.repeat(x, N // K, axis=2) for x in (kf, vf))
  z = jnp.einsum("btnh,bsnh->bnts", qf, kf) / np.sqrt(H)
  vis = jnp.asarray(np.repeat(row_keep, BS, axis=-1))
  if is_causal:
    vis = vis & jnp.tril(jnp.ones((T, T), bool))[None, None]
  z = jnp.where(vis, z, -jnp.inf)
  m = jnp.max(z, axis=-1, keepdims=True)
  e = jnp.where(vis, jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  w = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
  return jnp.einsum("bnts,bsnh->btnh", w, vf)


@pytest.mark.parametrize("backend,rows", [
    ("triton", True), pytest.param("triton", False, marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", True, marks=pytest.mark.slow)])
def test_unlisted_blocks_are_never_read(backend, rows):
  # A random table per (batch, head, query block) that never lists key block 2, and
  # per-row lists inside it; NaN keys and values in block 2: any pass reading it would
  # spread the NaN, and its dK, dV must be exactly 0.
  rng = np.random.default_rng(7)
  table = rng.random((B, N, NB, NB)) < 0.6
  table[..., 2] = False
  assert any(not np.array_equal(table[:, 0], table[:, h]) for h in range(1, N))
  sel = _row_lists(table, 8) if rows else None
  keep = (np.any(sel[..., None] == np.arange(NB), axis=-2) if rows
          else np.repeat(table, BS, axis=2))
  q, k, v, ct = _inputs(1)
  poison = (slice(None), slice(2 * BS, 3 * BS))
  k_nan, v_nan = k.at[poison].set(jnp.nan), v.at[poison].set(jnp.nan)

  def kernel(q, k, v):
    call = AttentionCall.create(q, k, v, is_causal=True)
    return _api.attention_from_call(
        call, backend=backend, interpret=True, block_sizes=dict(block_q=BS, block_k=BS),
        block_table=jnp.asarray(table), row_blocks=None if sel is None else jnp.asarray(sel))

  out, (dq, dk, dv) = jax.jit(lambda *a: value_and_cotangents(kernel, a, ct))(q, k_nan, v_nan)
  ref, ref_grads = jax.jit(lambda *a: value_and_cotangents(  # one compilation, not per op
      lambda q, k, v: _dense_table_reference(q, k, v, keep, True), a, ct))(q, k, v)
  chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
  for g, r in zip((dq, dk, dv), ref_grads, strict=True):
    chex.assert_trees_all_close(g, r, atol=1e-4, rtol=1e-4)
  assert bool(jnp.all(dk[poison] == 0)) and bool(jnp.all(dv[poison] == 0))


@pytest.mark.slow
def test_block_sparse_never_reads_an_unkept_value_block():
  # Non-causal MoBA keeping 2 of 4 blocks per token; every query leans along e0 and the
  # keys of block 1 lean against it, so no token selects block 1 (checked on the stats).
  # Its values are NaN (the selection reads q and k only): the output and cotangents
  # equal the clean xla_chunked ones, and its dV is exactly 0.
  q, k, v, ct = _inputs(2)
  e0 = jnp.zeros((1, 1, 1, H)).at[..., 0].set(1.0)
  q = q + 12.0 * e0  # q_0 = 12 + 2 N(0, 1) > 0 for every token
  k = k.at[:, BS:2 * BS].add(-3.0 * e0)
  kw = dict(is_causal=False)
  _, stats = jax.jit(_sparse("moba", "pallas", return_stats=True, **kw))(q, k, v)
  assert not np.any(np.asarray(stats["kept"])[..., 1]) and np.all(np.asarray(stats["kept"])[..., 0])
  v_nan = v.at[:, BS:2 * BS].set(jnp.nan)
  out, grads = jax.jit(lambda *a: value_and_cotangents(_sparse("moba", "pallas", **kw), a,
                                                       ct))(q, k, v_nan)
  ref, ref_grads = jax.jit(lambda *a: value_and_cotangents(  # one compilation, not per op
      _sparse("moba", "xla_chunked", **kw), a, ct))(q, k, v)
  chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(grads, ref_grads, atol=1e-4, rtol=1e-4)
  assert bool(jnp.all(grads[2][:, BS:2 * BS] == 0))


def _export(backend, block_size, monkeypatch, kv_len=None, t=256):
  """Exports forward + backward of causal MoBA through the Pallas path for the backend's
  platform (``pick_backend``, which the block-sparse dispatch calls, answers as that
  platform would: no interpreter)."""
  monkeypatch.setattr(kernels_pallas, "pick_backend", lambda b: (b, False))
  q = jax.ShapeDtypeStruct((B, t, N, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, t, K, 64), jnp.bfloat16)
  impl = {"triton": "pallas_triton", "mosaic_tpu": "pallas_mosaic_tpu"}[backend]
  f = _sparse("moba", impl, is_causal=True, block_size=block_size, kv_len=kv_len)
  return export_fwd_bwd(f, backend, q, k)


def test_lowers_for_cuda_and_tpu(monkeypatch):
  text = _export("triton", 32, monkeypatch, kv_len=jnp.array([256, 200]))
  assert "__gpu$xla.gpu.triton" in text and text.count("jaxsoft_attention_") >= 3
  text = _export("mosaic_tpu", 128, monkeypatch, kv_len=jnp.array([256, 200]))
  assert "tpu_custom_call" in text


def test_block_size_the_backend_cannot_use_is_named(monkeypatch):
  q, k, v, _ = _inputs()
  check = [("triton", 24, None), ("mosaic_tpu", 12, None),
           ("mosaic_tpu", 16, KV_LEN)]  # key lengths: 128-lane key blocks on Mosaic
  for backend, bs, kv_len in check:
    impl = {"triton": "pallas_triton", "mosaic_tpu": "pallas_mosaic_tpu"}[backend]
    with pytest.raises(ValueError, match="`block_size`"):
      _sparse("moba", impl, is_causal=True, block_size=bs, kv_len=kv_len)(q, k, v)


def test_block_table_arguments_are_checked():
  q, k, v, _ = _inputs()
  table = np.ones((B, N, NB, NB), bool)  # numpy: nothing to compile

  def run(normalizer="softmax", bias=None, blocks=None, **kw):
    blocks = dict(block_q=BS, block_k=BS) if blocks is None else blocks

    def f(q, k, v):
      call = AttentionCall.create(q, k, v, bias=bias, is_causal=True, normalizer=normalizer)
      return _api.attention_from_call(call, backend="triton", interpret=True,
                                      block_sizes=blocks, **kw)

    return jax.eval_shape(f, q, k, v)  # the checks run while tracing

  with pytest.raises(ValueError, match="`block_table`"):
    run(block_table=table[:, :, :, :2])
  with pytest.raises(ValueError, match="`row_blocks`"):
    run(row_blocks=np.zeros((B, N, T, 1), np.int32))
  with pytest.raises(ValueError, match="`row_blocks`"):
    run(block_table=table, row_blocks=np.zeros((B, N, T - 1, 1), np.int32))
  with pytest.raises(ValueError, match="`block_sizes`"):
    run(block_table=table, blocks=dict(block_q=BS, block_k=BS, block_q_dq=2 * BS))
  with pytest.raises(NotImplementedError, match="class E, S or P"):
    run("sparsemax", block_table=table)
  with pytest.raises(NotImplementedError, match="bias"):
    run(bias=np.zeros((T, T), np.float32), block_table=table)


def test_rows_with_no_visible_key_give_zeros_and_zero_gradients():
  """Batch 1 has no key (length 0): its rows are all zeros with zero, finite cotangents on
  the Pallas path, as on xla_chunked; batch 0 still matches xla_chunked."""
  q, k, v, ct = _inputs(3)
  kv_len = jnp.array([T, 0])

  def run(implementation):
    f = _sparse("moba", implementation, is_causal=False, kv_len=kv_len)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)

  out, (dq, dk, dv) = jax.jit(lambda: run("pallas"))()
  ref, ref_grads = jax.jit(lambda: run("xla_chunked"))()
  for x in (out, dq, dk, dv):
    assert bool(jnp.all(jnp.isfinite(x)))
  assert bool(jnp.all(out[1] == 0.0)) and bool(jnp.all(dq[1] == 0.0))
  assert bool(jnp.all(dk[1] == 0.0)) and bool(jnp.all(dv[1] == 0.0))
  chex.assert_trees_all_close((out, dq, dk, dv), (ref, *ref_grads), atol=1e-5, rtol=1e-4)
