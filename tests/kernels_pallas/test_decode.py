"""Split-K decoding attention (K05): both drivers in interpret mode vs the dense path.

The reference is ``jaxsoft.attention.dot_product_attention`` with one query per row and
``key_value_seq_lengths``; lengths 0, 1, partial and S_max, GQA, split counts that do not
divide the key blocks, a partial last Mosaic block, bf16 caches, the unified max on and
off, its overflow guard (scores far above and far below phi), paged caches (a shuffled page
pool and table, against the same cache made contiguous) and export-lowering of both
drivers for their real targets.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from kernels_pallas import decode
from kernels_pallas.decode import decode_attention

TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
BLOCK = {"triton": 16, "mosaic_tpu": 128}


def _inputs(b=4, s=40, n=4, kh=2, h=16, hv=None, seed=0, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (b, n, h), jnp.float32)
  k = jax.random.normal(kk, (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, kh, hv or h), jnp.float32).astype(dtype)
  return q, k, v


def _reference(q, k, v, lengths, normalizer="softmax", scale=None, cap=None, sink=None,
               bias=None):
  """Dense float64 numpy: the normalizer over the first ``lengths[b]`` keys."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, n, h = q.shape
  g = n // k.shape[2]
  scale = 1 / np.sqrt(h) if scale is None else scale
  out = np.zeros((b, n, v.shape[-1]))
  for bi in range(b):
    ln = int(lengths[bi])
    for ni in range(n):
      x = scale * k[bi, :ln, ni // g] @ q[bi, ni]
      x = x if cap is None else cap * np.tanh(x / cap)
      if normalizer == "sigmoid":
        w = 1 / (1 + np.exp(-(x + (-np.log(max(ln, 1)) if bias is None else bias))))
      else:
        top = max(x.max(initial=-np.inf), -np.inf if sink is None else sink[ni])
        e = np.exp(x - top)
        w = e / (e.sum() + (0.0 if sink is None else np.exp(sink[ni] - top)))
      out[bi, ni] = w @ v[bi, :ln, ni // g]
  return out


def _dense_path(q, k, v, lengths, **kw):
  """jaxsoft.attention.dot_product_attention with one query per row."""
  return jax.jit(lambda q, k, v, n: js.attention.dot_product_attention(
      q[:, None], k, v, key_value_seq_lengths=n, implementation="xla", **kw)[:, 0])(
          q, k, v, lengths)


def _poison(x, lengths):
  """NaN in every cache slot at or past the row's length (never read into the result)."""
  past = jnp.arange(x.shape[1])[None, :] >= lengths[:, None]
  return jnp.where(past[:, :, None, None], jnp.nan, x).astype(x.dtype)


def _close(x, y, tol=2e-5):
  np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                             atol=tol, rtol=tol)


def _spy(monkeypatch):
  """Records ``hi - lo`` (key blocks per split) of every kernel call that runs (a debug
  callback: a recomputation under ``lax.cond`` shows up only when it is taken)."""
  calls = []
  real = decode._partials

  def spy(cfg, q4, k, v, lo, hi, lens, c, pages=None):
    jax.debug.callback(lambda x: calls.append(np.asarray(x)), hi - lo)
    return real(cfg, q4, k, v, lo, hi, lens, c, pages)

  monkeypatch.setattr(decode, "_partials", spy)
  return calls


def _jit(**kw):
  return jax.jit(lambda q, k, v, n: decode_attention(q, k, v, n, interpret=True, **kw))


def test_triton_softmax_lengths_gqa_splits_unified(monkeypatch):
  # 3 key blocks in 2 splits; GQA 4 query / 2 KV heads; lengths 0, 1, partial, S_max.
  q, k, v = _inputs(s=40, seed=1)
  lengths = jnp.array([0, 1, 23, 40], jnp.int32)
  dense = _dense_path(q, k, v, lengths, logits_soft_cap=3.0)
  k, v = _poison(k, lengths), _poison(v, lengths)
  kw = dict(backend="triton", block_k=16, num_splits=2, logits_soft_cap=3.0)
  out = _jit(**kw)(q, k, v, lengths)
  _close(out, _reference(q, k, v, lengths, cap=3.0))
  _close(out, dense)
  assert not np.any(np.asarray(out[0]))  # length 0: zeros
  calls = _spy(monkeypatch)
  _close(_jit(unified_max=1.0, **kw)(q, k, v, lengths), out)
  assert len(calls) == 1  # scores in range: nothing recomputed
  np.testing.assert_array_equal(calls[0], [[0, 0], [1, 0], [2, 0], [2, 1]])


def test_mosaic_view_path_bf16():
  # H = 128: the cache is read in place ([B, S, K * H] view); 3 blocks of 128 keys in 2
  # splits, the last block partial (S = 300); bf16 caches.
  q, k, v = _inputs(s=300, h=128, seed=2, dtype=jnp.bfloat16)
  lengths = jnp.array([0, 1, 150, 300], jnp.int32)
  k, v = _poison(k, lengths), _poison(v, lengths)
  out = _jit(backend="mosaic_tpu", block_k=128, num_splits=2)(q, k, v, lengths)
  assert out.dtype == jnp.float32
  _close(out, _reference(q, k, v, lengths), tol=1e-2)


def test_mosaic_heads_first_path_sigmoid():
  # H = 64: the cache is read heads-first; MQA (one KV head); value dim 128; sigmoid
  # (class P: the partial outputs merge by addition) with its default bias -log n.
  q, k, v = _inputs(b=2, s=260, n=2, kh=1, h=64, hv=128, seed=3)
  lengths = jnp.array([130, 260], jnp.int32)
  k, v = _poison(k, lengths), _poison(v, lengths)
  out = _jit(backend="mosaic_tpu", block_k=128, num_splits=3, normalizer="sigmoid")(
      q, k, v, lengths)
  _close(out, _reference(q, k, v, lengths, normalizer="sigmoid"))


def test_triton_sink_unified():
  q, k, v = _inputs(b=3, s=50, n=6, kh=2, h=24, hv=8, seed=4)  # G = 3, padded dims
  lengths = jnp.array([0, 7, 50], jnp.int32)
  sink = np.linspace(-2.0, 2.0, 6)
  out = _jit(normalizer="softmax_sink", unified_max=0.5, normalizer_params={"sink_logit": sink},
             backend="triton", block_k=16, num_splits=3)(q, k, v, lengths)
  _close(out, _reference(q, k, v, lengths, sink=sink))
  assert not np.any(np.asarray(out[0]))


def test_unified_guard_scores_far_above_phi(monkeypatch):
  # Keys 32..47 (the third split) score 112 against phi = 0: e^{112} overflows float32;
  # only that split is recomputed with its own max, and the result is softmax.
  q, k, v = _inputs(b=2, s=48, n=2, kh=1, h=16, seed=5)
  q = jnp.ones_like(q)
  k = k.at[:, 32:].set(7.0)
  v = v.at[:, 32:].multiply(jnp.arange(16.0)[None, :, None, None])
  lengths = jnp.array([48, 20], jnp.int32)
  calls = _spy(monkeypatch)
  out = _jit(scale=1.0, unified_max=0.0, backend="triton", block_k=16, num_splits=3)(
      q, k, v, lengths)
  _close(out, _reference(q, k, v, lengths, scale=1.0))
  assert len(calls) == 2  # the unified pass, then the recomputation
  np.testing.assert_array_equal(calls[1], [[0, 0, 1], [0, 0, 0]])


def test_unified_guard_scores_far_below_phi(monkeypatch):
  # phi = 200 above every score: e^{x - phi} underflows to 0 in every split.
  q, k, v = _inputs(b=2, s=40, seed=6)
  lengths = jnp.array([40, 9], jnp.int32)
  calls = _spy(monkeypatch)
  out = _jit(unified_max=200.0, backend="mosaic_tpu", block_k=128)(q, k, v, lengths)
  _close(out, _reference(q, k, v, lengths))
  np.testing.assert_array_equal(calls[1], [[1], [1]])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("normalizer", ["softmax", "softmax_sink", "sigmoid"])
@pytest.mark.parametrize("splits", [1, 2, 5, 64])
def test_matrix(backend, normalizer, splits):
  s = 700 if backend == "mosaic_tpu" else 100
  q, k, v = _inputs(b=3, s=s, n=8, kh=2, h=64, seed=7)
  lengths = jnp.array([1, s // 3, s], jnp.int32)
  sink = np.full(8, 0.3) if normalizer == "softmax_sink" else None
  ref = _reference(q, k, v, lengths, normalizer=normalizer, sink=sink)
  kw = dict(normalizer=normalizer, backend=backend, block_k=BLOCK[backend], num_splits=splits,
            normalizer_params=None if sink is None else {"sink_logit": 0.3})
  _close(_jit(**kw)(q, k, v, lengths), ref)
  if normalizer != "sigmoid":
    for phi in (-60.0, 0.0, 60.0):  # in range and both guard sides
      _close(_jit(unified_max=phi, **kw)(q, k, v, lengths), ref)
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    _close(_jit(unified_max=1.0, **kw)(q, kb, vb, lengths), _reference(q, kb, vb, lengths,
                                                                       sink=sink), tol=2e-2)


@pytest.mark.slow
def test_mosaic_tpu_interpret_mode_races_and_nan_memory():
  from jax.experimental.pallas import tpu as pltpu

  q, k, v = _inputs(b=2, s=300, n=4, kh=2, h=64, seed=9)
  lengths = jnp.array([0, 290], jnp.int32)
  params = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True)
  for phi in (None, 0.0, 300.0):
    out = decode_attention(q, k, v, lengths, backend="mosaic_tpu", block_k=128, num_splits=2,
                           unified_max=phi, interpret=params)
    _close(out, _reference(q, k, v, lengths))


def _paged(k, v, lengths, page: int, seed: int = 0, spare: int = 3):
  """The contiguous caches ``[B, S, K, H]`` (S a multiple of ``page``) as a shuffled page
  pool with ``spare`` unused NaN pages, and the table ``[B, S / page]``: the entries of the
  pages past a row's length are -1 (never read) and their pool pages hold NaN."""
  b, s_len = k.shape[:2]
  width = s_len // page
  order = np.random.default_rng(seed).permutation(b * width + spare)
  table = order[:b * width].reshape(b, width)
  pools = []
  for x in (k, v):
    pool = jnp.full((b * width + spare, page, *x.shape[2:]), jnp.nan, x.dtype)
    pools.append(pool.at[table.reshape(-1)].set(x.reshape(b * width, page, *x.shape[2:])))
  used = np.arange(width)[None, :] * page < np.asarray(lengths)[:, None]
  return pools[0], pools[1], jnp.asarray(np.where(used, table, -1), jnp.int32)


@pytest.mark.parametrize("backend,kw", [
    ("triton", dict(num_splits=2, unified_max=1.0, logits_soft_cap=3.0)),
    ("mosaic_tpu", dict(num_splits=2, normalizer="sigmoid")),
    pytest.param("mosaic_tpu", dict(num_splits=3, normalizer="softmax_sink", h=64,
                                    normalizer_params={"sink_logit": 0.5}),
                 marks=pytest.mark.slow),  # H = 64: the heads-first copy of the pool
    pytest.param("triton", dict(num_splits=1), marks=pytest.mark.slow)])
def test_paged_cache_equals_the_contiguous_one(backend, kw):
  """A paged cache (shuffled pages, -1 past each row's length, NaN in every page no row
  reads and in the slots past the length): the same output as the contiguous cache, and
  the float64 reference; lengths 0, 1, partial and S_max; GQA."""
  page = BLOCK[backend]
  kw = dict(kw)
  h = kw.pop("h", 16 if backend == "triton" else 128)
  q, k, v = _inputs(s=4 * page, h=h, seed=11)
  lengths = jnp.array([0, 1, 2 * page + 3, 4 * page], jnp.int32)
  k, v = _poison(k, lengths), _poison(v, lengths)
  k_pool, v_pool, table = _paged(k, v, lengths, page)
  f = jax.jit(lambda q, k, v, n, pt: decode_attention(q, k, v, n, interpret=True,
                                                      backend=backend, page_table=pt, **kw))
  out = f(q, k_pool, v_pool, lengths, table)
  _close(out, _jit(backend=backend, block_k=page, **kw)(q, k, v, lengths), tol=1e-6)
  ref = dict(normalizer=kw.get("normalizer", "softmax"), cap=kw.get("logits_soft_cap"))
  if "normalizer_params" in kw:
    ref["sink"] = np.full(4, kw["normalizer_params"]["sink_logit"])
  _close(out, _reference(q, k, v, lengths, **ref))
  assert bool(jnp.all(jnp.isfinite(out)))


def _abstract_gpu():
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("backend,h", [("triton", 128), ("mosaic_tpu", 64),
                                       ("mosaic_tpu", 72), ("mosaic_tpu", 128)])
def test_export_lowering(backend, h):
  q = jax.ShapeDtypeStruct((2, 8, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 1000, 2, h), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  f = jax.jit(lambda q, k, v, n: decode_attention(q, k, v, n, backend=backend, num_splits=3,
                                                   unified_max=2.0))
  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    text = jax.export.export(f, platforms=[platform], disabled_checks=[TRITON_CALL])(
        q, k, k, lengths).mlir_module()
  assert ("__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call") in text
  assert text.count("jaxsoft_decode_fixed") >= 2  # the unified pass and the recomputation


@pytest.mark.parametrize("backend,h", [("triton", 128), ("mosaic_tpu", 64), ("mosaic_tpu", 128)])
def test_paged_export_lowering(backend, h):
  """A paged cache exports for cuda and tpu: the page table rides in the Triton kernel's
  operands and in Mosaic's scalar prefetch (its index maps)."""
  page = 128
  q = jax.ShapeDtypeStruct((2, 8, h), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((20, page, 2, h), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  table = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  f = jax.jit(lambda q, k, v, n, pt: decode_attention(q, k, v, n, backend=backend,
                                                      num_splits=3, page_table=pt))
  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    text = jax.export.export(f, platforms=[platform], disabled_checks=[TRITON_CALL])(
        q, pool, pool, lengths, table).mlir_module()
  assert ("__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call") in text
  assert "jaxsoft_decode_online" in text


def test_paged_bad_input():
  q, k, v = _inputs(b=2, s=32)
  n = jnp.array([3, 32], jnp.int32)
  k_pool, v_pool, table = _paged(k, v, n, 16)
  bad = [
      (dict(page_table=table[0]), "page_table"),
      (dict(page_table=table.astype(jnp.float32)), "page_table"),
      (dict(page_table=table.at[1, 1].set(99)), "page_table"),  # read by row 1
      (dict(block_k=32), "block_k"),
      (dict(k_cache=k_pool[:, :, :, :8]), "k_cache"),
      (dict(v_cache=v_pool[:, :8]), "v_cache"),
      (dict(lengths=jnp.array([3, 33])), "lengths"),
      (dict(k_cache=k_pool[:, :12], v_cache=v_pool[:, :12], lengths=jnp.array([3, 20])),
       "page size"),  # 12 keys: not a Triton block
  ]
  for over, match in bad:
    args = dict(q=q, k_cache=k_pool, v_cache=v_pool, lengths=n, page_table=table)
    args.update(over)
    pos = [args.pop(a) for a in ("q", "k_cache", "v_cache", "lengths")]
    with pytest.raises(ValueError, match=match):
      decode_attention(*pos, interpret=True, **args)
  # entries past a row's length are never read: out of range there is fine
  out = decode_attention(q, k_pool, v_pool, n, page_table=table.at[0, 1].set(99),
                         interpret=True)
  _close(out, _reference(q, k, v, n))


def test_illegal_blocks_and_bad_input():
  q, k, v = _inputs(b=2, s=32)
  n = jnp.array([3, 32], jnp.int32)
  bad = [
      (dict(lengths=jnp.array([3, 33])), "lengths"),
      (dict(lengths=jnp.array([3.0, 4.0])), "lengths"),
      (dict(lengths=jnp.array([3])), "lengths"),
      (dict(q=q[0]), "`q`"),
      (dict(k_cache=k[:, :, :, :8]), "k_cache"),
      (dict(v_cache=v[:1]), "v_cache"),
      (dict(q=jnp.zeros((2, 3, 16))), "multiple"),
      (dict(normalizer="entmax"), "normalizer"),
      (dict(backend="cuda"), "backend"),
      (dict(num_splits=0), "num_splits"),
      (dict(block_k=24), "block_k"),
      (dict(block_k=64, backend="mosaic_tpu"), "block_k"),
      (dict(unified_max=jnp.inf), "unified_max"),
      (dict(unified_max=jnp.zeros(3)), "unified_max"),
      (dict(unified_max=0.0, normalizer="sigmoid"), "unified_max"),
      (dict(unified_max=0.0, safe_range=(1.0, 0.0)), "safe_range"),
      (dict(unified_max=0.0, safe_range=(-1.0, 90.0)), "safe_range"),
      (dict(safe_range=(-1.0, 1.0)), "safe_range"),
      (dict(normalizer_params={"sink_logit": 1.0}), "normalizer_params"),
      (dict(normalizer="softmax_sink", normalizer_params={"sink_logit": jnp.zeros(5)}),
       "sink_logit"),
      (dict(scale=float("nan")), "scale"),
      (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
  ]
  for over, match in bad:
    args = dict(q=q, k_cache=k, v_cache=v, lengths=n)
    args.update(over)
    pos = [args.pop(a) for a in ("q", "k_cache", "v_cache", "lengths")]
    with pytest.raises(ValueError, match=match):
      decode_attention(*pos, interpret=True, **args)
