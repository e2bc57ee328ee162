"""K04 kernels_pallas.blasst_attention: BLASST's skip decided inside the Pallas kernel.

Oracles: a numpy float64 loop written from the rule (each query row visits its key blocks
from its own block backwards, wrapping round without causality, and skips block j when
the block's max logit is below the running max of the kept blocks minus tau; exact softmax
over the kept pairs); for the gradients, dense attention (autodiff of the XLA path) under
the kept pairs as its mask, and the xla_chunked skip loop. The skip happening in the
kernel shows as NaN values of a key block that every row of a tile skips: a kernel that
ran the tile's P V with zero weights would give 0 * NaN = NaN there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from jaxsoft.attention import block_sparse_attention, dot_product_attention
from tests.kernels_pallas.test_lowering import export_fwd_bwd

B, T, N, K, H, BS = 2, 48, 2, 1, 16, 16


def reference(q, k, v, tau, bs, causal, kv_len=None, scale=None):
  """(out [B, T, N, Hv], kept bool [B, N, T, nk]) in float64, row by row."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b_, t_, n_, h_ = q.shape
  s_, kh = k.shape[1], k.shape[2]
  nk = -(-s_ // bs)
  scale = 1 / np.sqrt(h_) if scale is None else scale
  lens = np.full(b_, s_) if kv_len is None else np.asarray(kv_len)
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  kept = np.zeros((b_, n_, t_, nk), bool)
  pos = np.arange(s_)
  for b in range(b_):
    for n in range(n_):
      g = n // (n_ // kh)
      for i in range(t_):
        s = scale * k[b, :, g] @ q[b, i, n]
        vis = pos < lens[b]
        if causal:
          vis &= pos <= i
        diag, m = min(i // bs, nk - 1), -np.inf
        for t in range(nk):
          j = (diag - t) % nk
          blk = vis[j * bs:(j + 1) * bs]
          if not blk.any():
            continue
          mt = s[j * bs:(j + 1) * bs][blk].max()
          if mt < m - tau:
            continue
          kept[b, n, i, j], m = True, max(m, mt)
        use = vis & kept[b, n, i][pos // bs]
        if use.any():
          w = np.exp(s[use] - s[use].max())
          out[b, i, n] = (w / w.sum()) @ v[b, use, g]
  return out, kept


def _inputs(seed=0, t=T, b=B, n=N, kh=K, h=H, dtype=jnp.float32):
  # numpy draws: no compilation for the default run's share
  rng = np.random.default_rng(seed)
  q = 2.0 * rng.standard_normal((b, t, n, h))  # peaked: many skips
  k, v = rng.standard_normal((2, b, t, kh, h))
  ct = rng.standard_normal((b, t, n, h))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v, ct))


def _skipped_block_inputs(seed=0, t=T):
  """Key block 0 far below every query (so rows outside block 0 skip it: whole tiles),
  with NaN values; the other keys random."""
  q, k, v, _ = (np.array(x) for x in _inputs(seed, t))
  u = np.ones(H, np.float32) / np.sqrt(H)
  q = q + 6.0 * u
  k[:, :BS] = -3.0 * u + 0.1 * k[:, :BS]
  v[:, :BS] = np.nan
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _blasst(backend, **kw):
  return functools.partial(kernels_pallas.blasst_attention, backend=backend, interpret=True,
                           **kw)


def _check_forward(backend, q, k, v, *, tau, causal, kv_len=None, bs=BS):
  f = jax.jit(_blasst(backend, skip_threshold=tau, block_size=bs, is_causal=causal,
                      key_value_seq_lengths=kv_len, return_kept=True))
  out, kept = f(q, k, v)
  want, want_kept = reference(q, k, v, tau, bs, causal, kv_len)
  np.testing.assert_array_equal(np.asarray(kept), want_kept)
  # float32 scores and one online softmax against float64: a few ulps of the output scale
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=2e-5)
  return want_kept


def test_blasst_kernel_decides_in_the_kernel():
  # the default run's share: Triton's forward in interpret mode; the skipped tiles' V is
  # NaN, and the rows that never kept block 0 stay finite and exact
  q, k, v = _skipped_block_inputs()
  kept = _check_forward("triton", q, k, v, tau=1.0, causal=False, kv_len=jnp.array([T, 37]))
  assert kept[:, :, BS:, 0].sum() == 0 and kept[:, :, :BS, 0].all()
  inner = kept[:, :, BS:, 1:]
  assert 0 < inner.sum() < inner.size  # the random blocks: some kept, some skipped
  rows = kept[:, :, BS:, 1:].reshape(B, N, -1, BS, kept.shape[-1] - 1)
  assert np.any(rows != rows[:, :, :, :1])  # decided per row within a tile


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("causal", [True, False])
def test_blasst_kernel_forward_matrix(backend, causal):
  q, k, v, _ = _inputs(1, t=64, kh=1)
  kv_len = jnp.array([64, 41]) if backend == "triton" else None
  kept = _check_forward(backend, q, k, v, tau=0.5, causal=causal, kv_len=kv_len)
  assert 0 < kept.sum()
  for tau in (0.0, float("inf")):  # the extremes: only the running max's block / all
    _check_forward(backend, q, k, v, tau=tau, causal=causal, kv_len=kv_len)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_blasst_kernel_gradients(causal):
  # the kept-pair backward: dense attention under the kept pairs as a mask (autodiff of
  # the XLA path) and the skip loop's custom backward
  q, k, v, ct = _inputs(2, t=48, n=4, kh=2)
  kv_len = jnp.array([48, 30])
  kw = dict(skip_threshold=1.0, block_size=BS, is_causal=causal, key_value_seq_lengths=kv_len)
  f = _blasst("triton", **kw)
  out, kept = jax.jit(_blasst("triton", return_kept=True, **kw))(q, k, v)
  mask = jnp.repeat(kept, BS, axis=-1)[..., :T]  # [B, N, T, S]

  def dense(q, k, v):
    return dot_product_attention(q, k, v, mask=mask, key_value_seq_lengths=kv_len,
                                 is_causal=causal)

  def loop(q, k, v):
    return block_sparse_attention(q, k, v, method="blasst", **kw)

  grads = jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(q, k, v, ct)
  for oracle in (dense, loop):
    want = jax.jit(lambda *a, g=oracle: jax.vjp(g, *a[:3])[1](a[3]))(q, k, v, ct)
    for got, w in zip(grads, want, strict=True):
      np.testing.assert_allclose(np.asarray(got), np.asarray(w), atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_blasst_kernel_bf16():
  q, k, v, _ = _inputs(3, dtype=jnp.bfloat16)
  f = jax.jit(_blasst("triton", skip_threshold=1.0, block_size=BS, is_causal=True,
                      return_kept=True))
  out, kept = f(q, k, v)
  assert out.dtype == jnp.bfloat16
  want, want_kept = reference(q, k, v, 1.0, BS, True)  # the bf16 inputs, exactly
  np.testing.assert_array_equal(np.asarray(kept), want_kept)
  # float32 inside; one bf16 rounding of the output (2^-8 relative)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=1e-2, rtol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_blasst_kernel_lowers_for_cuda_and_tpu(backend):
  t = 256
  q = jax.ShapeDtypeStruct((B, t, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, t, 2, 64), jnp.bfloat16)
  bs = 32 if backend == "triton" else 128  # Mosaic with key lengths: the engine's 128
  f = functools.partial(kernels_pallas.blasst_attention, skip_threshold=2.0, block_size=bs,
                        is_causal=True, key_value_seq_lengths=jnp.array([256, 200]),
                        backend=backend, interpret=False)
  text = export_fwd_bwd(f, backend, q, k)
  call = "__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call"
  assert call in text and "jaxsoft_blasst_fwd" in text
  assert text.count("jaxsoft_attention_") >= 2  # the engine's dQ and dK/dV passes


def test_blasst_kernel_errors_name_the_argument():
  q, k, v, _ = _inputs(0, t=32)
  with pytest.raises(ValueError, match="skip_threshold"):
    kernels_pallas.blasst_attention(q, k, v, skip_threshold=-1.0, block_size=16,
                                    backend="triton", interpret=True)
  with pytest.raises(ValueError, match="block_size"):
    kernels_pallas.blasst_attention(q, k, v, skip_threshold=1.0, block_size=24,
                                    backend="triton", interpret=True)
  with pytest.raises(ValueError, match="backend"):
    kernels_pallas.blasst_attention(q, k, v, skip_threshold=1.0, block_size=16,
                                    backend="cuda", interpret=True)


def test_blasst_kernel_row_with_no_visible_key_is_zero():
  # key_value_seq_lengths = 0: every row of batch 0 sees no key; zeros out, finite (zero)
  # gradients, and batch 1 unaffected
  q, k, v, ct = _inputs(4, t=32)
  f = jax.jit(_blasst("triton", skip_threshold=1.0, block_size=BS,
                      key_value_seq_lengths=jnp.array([0, 32])))
  out, vjp = jax.vjp(f, q, k, v)
  out = np.asarray(out)
  assert np.all(out[0] == 0.0) and np.all(np.isfinite(out))
  want, _ = reference(q[1:], k[1:], v[1:], 1.0, BS, False)
  np.testing.assert_allclose(out[1:], want, atol=2e-6, rtol=2e-5)
  grads = [np.asarray(g) for g in vjp(ct)]
  assert all(np.all(np.isfinite(g)) for g in grads)
  assert np.all(grads[0][0] == 0.0)  # dq of the rows that see nothing
