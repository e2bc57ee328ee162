"""A12 / K04 block_sparse_attention(method="blasst", implementation="pallas*"): BLASST's
decision pass, then the Pallas engine over each query row's kept key blocks (per-row
lists under the block table), in interpret mode.

Oracle: the xla_chunked skip loop of the same call (its own decisions and FlashAttention
loops, forward and custom backward) for the output, the q, k, v cotangents and the kept
blocks; the kept sets must skip something and differ between heads and rows of a block.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from jaxsoft.attention import UnsupportedDifferentiation, block_sparse_attention
from kernels_pallas import _api
from tests.kernels_pallas.test_block_sparse_pallas import BS, KV_LEN, B, N, T, _inputs
from tests.kernels_pallas.test_engine import value_and_cotangents
from tests.kernels_pallas.test_lowering import export_fwd_bwd


@pytest.fixture(autouse=True)
def interpret_env(monkeypatch):
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")


def _blasst(implementation, *, is_causal, block_size=BS, kv_len=KV_LEN, tau=1.0, **kw):
  return functools.partial(block_sparse_attention, method="blasst", block_size=block_size,
                           skip_threshold=tau, is_causal=is_causal,
                           key_value_seq_lengths=kv_len, implementation=implementation, **kw)


def _check(is_causal, implementation="pallas", seed=0, t=T, block_size=BS, kv_len=KV_LEN,
           dtype=jnp.float32, tol=(1e-5, 1e-4), grads=True):
  q, k, v, ct = _inputs(seed, t, dtype)
  kw = dict(is_causal=is_causal, block_size=block_size, kv_len=kv_len)

  @jax.jit
  def both(q, k, v, ct):  # one program: the Pallas path, its VJP and the skip loop's
    f = _blasst(implementation, return_stats=True, **kw)
    if grads:
      out, vjp, stats = jax.vjp(f, q, k, v, has_aux=True)
      ref_grads = value_and_cotangents(_blasst("xla_chunked", **kw), (q, k, v), ct)[1]
      out_grads = vjp(ct)
    else:
      (out, stats), out_grads, ref_grads = f(q, k, v), (), ()
    ref, ref_stats = _blasst("xla_chunked", return_stats=True, **kw)(q, k, v)
    return out, out_grads, stats, ref, ref_grads, ref_stats

  out, grads, stats, ref, ref_grads, ref_stats = both(q, k, v, ct)
  kept = np.asarray(stats["kept_tokens"])  # [B, N, T, nk]
  np.testing.assert_array_equal(kept, np.asarray(ref_stats["kept_tokens"]))  # same pass
  np.testing.assert_array_equal(np.asarray(stats["kept"]), np.asarray(ref_stats["kept"]))
  own = np.arange(t) // block_size
  visible = own + 1 if is_causal else np.full(t, -(-t // block_size))
  assert 0 < kept.sum() < B * N * visible.sum()  # something is skipped ...
  assert any(not np.array_equal(kept[:, 0], kept[:, h]) for h in range(1, N))  # per head
  rows = kept[..., :t - t % block_size, :].reshape(B, N, -1, block_size, kept.shape[-1])
  assert np.any(rows != rows[:, :, :, :1])  # ... and per row within a query block
  # float32: two blockwise softmax loops in different orders (the engine's tiles, the
  # skip loop's gathered chunks): the skip-loop tests' tolerances, relative to the scale
  sc = max(1.0, float(jnp.max(jnp.abs(ref))))
  chex.assert_trees_all_close(out, ref, atol=tol[0] * sc, rtol=tol[0])
  for g, r in zip(grads, ref_grads, strict=True):
    gs = max(1.0, float(jnp.max(jnp.abs(r))))
    chex.assert_trees_all_close(g, r, atol=tol[1] * gs, rtol=tol[1])
    assert bool(jnp.all(jnp.isfinite(g)))


def test_pallas_blasst_forward_equals_the_skip_loop():
  # the default run's share: the forward kernel only (each engine pass compiled in
  # interpret mode costs seconds); the backward passes with row lists are the selecting
  # methods' (tests/kernels_pallas/test_block_sparse_pallas.py), and below under slow
  _check(True, grads=False)


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [True, False])
def test_pallas_blasst_equals_the_skip_loop(is_causal):
  _check(is_causal)


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [True, False])
def test_pallas_blasst_sweep(is_causal):
  # a sequence not a multiple of the block, 32-wide blocks; both drivers (Mosaic: no key
  # lengths, so 32-row key blocks are legal)
  _check(is_causal, seed=3, t=120, block_size=32, kv_len=jnp.array([120, 77]))
  _check(is_causal, "pallas_mosaic_tpu", seed=4, t=96, block_size=32, kv_len=None)


@pytest.mark.slow
def test_pallas_blasst_bf16():
  _check(True, dtype=jnp.bfloat16, tol=(2e-2, 5e-2))


def test_pallas_blasst_refuses_forward_mode_by_name():
  q, k, v, _ = (x[:1, :32, :2] for x in _inputs(5))
  f = _blasst("pallas", is_causal=True, kv_len=None)
  with pytest.raises(UnsupportedDifferentiation, match=r"method='blasst'.*return_stats"):
    jax.jvp(lambda q: f(q, k, v), (q,), (jnp.ones_like(q),))


@pytest.mark.slow  # the engine's own lowering is default-tested with MoBA's tables
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_pallas_blasst_lowers_for_cuda_and_tpu(backend, monkeypatch):
  # pick_backend (which the dispatch calls) answers as that platform would: no interpreter
  monkeypatch.setattr(kernels_pallas, "pick_backend", lambda b: (b, False))
  t = 256
  q = jax.ShapeDtypeStruct((B, t, N, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, t, 2, 64), jnp.bfloat16)
  impl = {"triton": "pallas_triton", "mosaic_tpu": "pallas_mosaic_tpu"}[backend]
  kv_len = jnp.array([256, 200]) if backend == "triton" else None  # Mosaic: 32-row blocks
  text = export_fwd_bwd(_blasst(impl, is_causal=True, block_size=32, kv_len=kv_len),
                        backend, q, k)
  call = "__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call"
  assert call in text and text.count("jaxsoft_attention_") >= 3  # forward, dK/dV, dQ
