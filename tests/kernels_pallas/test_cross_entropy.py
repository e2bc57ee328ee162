"""K08: the Pallas linear cross-entropy kernels (interpret mode on CPU) against the chunked XLA
path, optax on the materialised logits and a float64 numpy reference; cross-lowering for cuda
(Triton) and tpu (Mosaic)."""

from __future__ import annotations

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental.pallas import tpu as pltpu

import jaxsoft as js
from kernels_pallas import _api
from kernels_pallas import cross_entropy as kce
from tests.helpers import normal
from tests.kernels_pallas.test_lowering import TRITON_CALL, _abstract_gpu
from tests.losses.test_linear_ce import _all_shapes, _inputs, _reference, _value_and_grads

lce = js.losses.linear_cross_entropy
N, D, V = 37, 8, 53   # blocks of 16 (Triton) / 8 x 128 (Mosaic) divide neither axis
# (implementation, token block, vocabulary block); Mosaic's vocabulary block is 128 lanes,
# so its case uses V = 200 (two vocabulary blocks, the second one partly padding).
CASES = [("pallas_triton", 16, 16, V), ("pallas_mosaic_tpu", 8, 128, 200)]
IDS = ["triton", "mosaic"]


@pytest.fixture(autouse=True)
def interpret_env(monkeypatch):
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")


def _kernel(impl, bt, bv, y, **kw):
  return lambda a, b: lce(a, b, y, implementation=impl, token_chunk_size=bt, vocab_chunk_size=bv,
                          **kw)


@pytest.mark.parametrize("impl,bt,bv,v", CASES, ids=IDS)
def test_equals_optax_and_the_xla_path(impl, bt, bv, v):
  h, w, y = _inputs(0, v=v)
  ct = normal(9, (N,))
  ours = _value_and_grads(_kernel(impl, bt, bv, y), h, w, ct)
  optax_ref = _value_and_grads(
      lambda a, b: optax.losses.softmax_cross_entropy_with_integer_labels(a @ b, y), h, w, ct)
  xla = _value_and_grads(lambda a, b: lce(a, b, y, token_chunk_size=8, vocab_chunk_size=16),
                         h, w, ct)
  chex.assert_trees_all_close(ours, optax_ref, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(ours, xla, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,bt,bv,v", CASES, ids=IDS)
def test_smoothing_z_loss_softcap_match_float64_reference(impl, bt, bv, v):
  h, w, y = _inputs(1, v=v, scale=3.0)
  ct = normal(10, (N,))
  kw = dict(label_smoothing=0.1, z_loss=1e-2, softcap=2.5)
  out, (dh, dw) = _value_and_grads(_kernel(impl, bt, bv, y, **kw), h, w, ct)
  loss, rdh, rdw = _reference(h, w, y, ct, eps=0.1, lam=1e-2, cap=2.5)
  np.testing.assert_allclose(out, loss, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dh, rdh, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, rdw, rtol=1e-4, atol=1e-5)
  xla = _value_and_grads(lambda a, b: lce(a, b, y, token_chunk_size=8, vocab_chunk_size=16,
                                          **kw), h, w, ct)
  chex.assert_trees_all_close((out, (dh, dw)), xla, rtol=1e-5, atol=1e-5)


def test_where_ignore_index_and_labels_out_of_range():
  h, w, y = _inputs(3)
  y = y.at[4].set(-100).at[5].set(V).at[6].set(-1)
  where = jnp.ones((N,), bool).at[0].set(False).at[6].set(False)
  ct = normal(11, (N,))
  out, (dh, dw) = _value_and_grads(
      _kernel("pallas_triton", 16, 16, y, where=where, ignore_index=-100), h, w, ct)
  np.testing.assert_array_equal(out[np.array([0, 4, 6])], 0.0)
  assert out[5] == jnp.inf
  np.testing.assert_array_equal(dh[np.array([0, 4, 5, 6])], 0.0)
  kept = np.setdiff1d(np.arange(N), [0, 4, 5, 6])
  loss, rdh, rdw = _reference(h[kept], w, y[kept], ct[kept])
  np.testing.assert_allclose(out[kept], loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dh[kept], rdh, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, rdw, rtol=1e-4, atol=1e-5)


def test_bfloat16_and_batch_shape():
  h, w, y = _inputs(5, n=36)
  hb, wb = h.astype(jnp.bfloat16).reshape(4, 9, D), w.astype(jnp.bfloat16)
  yb = y.reshape(4, 9)
  ct = normal(12, (4, 9))
  f = lambda impl, bt, bv: lambda a, b: lce(a, b, yb, z_loss=1e-3, implementation=impl,
                                            token_chunk_size=bt, vocab_chunk_size=bv)
  out, (dh, dw) = _value_and_grads(f("pallas_triton", 16, 16), hb, wb, ct)
  assert out.shape == (4, 9) and out.dtype == dh.dtype == dw.dtype == jnp.bfloat16
  loss, rdh, rdw = _reference(hb.astype(jnp.float32).reshape(36, D), wb.astype(jnp.float32), y,
                              ct.astype(jnp.bfloat16).astype(jnp.float32).reshape(36), lam=1e-3)
  np.testing.assert_allclose(out.astype(np.float32).reshape(36), loss, rtol=1e-2)
  np.testing.assert_allclose(dh.astype(np.float32).reshape(36, D), rdh, rtol=1e-2, atol=1e-4)
  np.testing.assert_allclose(dw.astype(np.float32), rdw, rtol=1e-2, atol=1e-4)
  xla = _value_and_grads(f("xla", 8, 16), hb, wb, ct)   # the same float32 math: same roundings
  chex.assert_trees_all_close((out, (dh, dw)), xla, rtol=1e-2, atol=1e-3)


def test_extreme_logits_are_finite():
  h, w, y = _inputs(6, scale=3e3)         # logits of order 1e4: e^z overflows float32
  ct = jnp.ones((N,))
  out, (dh, dw) = _value_and_grads(_kernel("pallas_triton", 16, 16, y), h, w, ct)
  loss, rdh, _ = _reference(h, w, y, ct)
  assert all(np.all(np.isfinite(a)) for a in (out, dh, dw))
  np.testing.assert_allclose(out, loss, rtol=1e-4, atol=0.5)
  np.testing.assert_allclose(dh, rdh, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_float64_check_grads():
  with jax.enable_x64(True):
    h, w, y = _inputs(7, n=10, v=20)
    h, w = h.astype(jnp.float64), w.astype(jnp.float64)
    f = _kernel("pallas_triton", 16, 16, y, label_smoothing=0.2, z_loss=1e-2, softcap=3.0)
    assert f(h, w).dtype == jnp.float64
    jax.test_util.check_grads(f, (h, w), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_mosaic_tpu_interpret_detect_races_uninitialized_nan():
  # Uninitialized memory reads NaN: a scratch or output the kernels forget to write shows.
  h, w, y = _inputs(8, n=12, v=130)
  ct = normal(13, (12,))
  params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
  keep = jnp.ones((12,), bool)

  def f(a, b):
    return kce.linear_cross_entropy_tokens(
        a, b, y, keep, label_smoothing=0.1, z_loss=1e-3, softcap=None,
        compute_dtype=jnp.float32, backend="mosaic_tpu", interpret=params, token_chunk_size=8,
        vocab_chunk_size=128)

  out, (dh, dw) = _value_and_grads(f, h, w, ct)
  loss, rdh, rdw = _reference(h, w, y, ct, eps=0.1, lam=1e-3)
  np.testing.assert_allclose(out, loss, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dh, rdh, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, rdw, rtol=1e-4, atol=1e-5)
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  assert ipc.races is not None and not ipc.races.races_found


@pytest.mark.slow
def test_vmap_and_checkpoint():
  h, w, y = _inputs(9, n=12, v=20)
  hb, yb = h.reshape(3, 4, D), y.reshape(3, 4)
  f = lambda a, b, c, impl: lce(a, b, c, z_loss=1e-3, implementation=impl, token_chunk_size=16,
                                vocab_chunk_size=16)
  grad = lambda g: jax.value_and_grad(g, argnums=(0, 1))(hb, w)
  plain = grad(lambda a, b: f(a, b, yb, "xla").sum())
  mapped = grad(lambda a, b: jax.vmap(lambda x, c: f(x, b, c, "pallas_triton"))(a, yb).sum())
  remat = grad(lambda a, b: jax.checkpoint(lambda x, z: f(x, z, yb, "pallas_triton"))(a, b).sum())
  chex.assert_trees_all_close(mapped, plain, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(remat, plain, rtol=1e-5, atol=1e-6)


def test_no_tokens_by_vocab_array():
  h, w, y = _inputs(7)
  grad = jax.value_and_grad(
      lambda a, b: _kernel("pallas_triton", 16, 16, y, label_smoothing=0.1, z_loss=1e-3,
                           softcap=5.0)(a, b).sum(), argnums=(0, 1))
  shapes = _all_shapes(jax.make_jaxpr(grad)(h, w).jaxpr, set())
  assert (16, 16) in shapes          # the kernels' tiles were inspected
  # the largest arrays: w padded to [16, 64] and h to [48, 16] (and their gradients)
  assert max(int(np.prod(s)) for s in shapes) == 16 * 64 < N * V


def test_bad_arguments(monkeypatch):
  h, w, y = _inputs(0)
  with pytest.raises(ValueError, match="implementation"):
    lce(h, w, y, implementation="cuda")
  with pytest.raises(ValueError, match="token_chunk_size"):
    lce(h, w, y, implementation="pallas_triton", token_chunk_size=24)
  with pytest.raises(ValueError, match="vocab_chunk_size"):
    lce(h, w, y, implementation="pallas_mosaic_tpu", token_chunk_size=8, vocab_chunk_size=64)
  with pytest.raises(ValueError, match="token_chunk_size"):
    lce(h, w, y, implementation="pallas_mosaic_tpu", token_chunk_size=12)
  monkeypatch.delenv(_api.INTERPRET_ENV)
  with pytest.raises(NotImplementedError, match=_api.INTERPRET_ENV):
    lce(h, w, y, implementation="pallas")


def _export(backend, n=300, d=72, v=1000, dtype=jnp.bfloat16, **kw):
  h, w = jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype)
  y, keep = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), bool)

  def fwd_bwd(h, w, y, keep):
    f = lambda a, b: kce.linear_cross_entropy_tokens(
        a, b, y, keep, label_smoothing=0.1, z_loss=1e-4, softcap=30.0,
        compute_dtype=jnp.float32, backend=backend, **kw)
    out, vjp = jax.vjp(f, h, w)
    return out, vjp(out)

  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    exp = jax.export.export(jax.jit(fwd_bwd), platforms=["cuda" if backend == "triton" else "tpu"],
                            disabled_checks=[TRITON_CALL])(h, w, y, keep)
  return exp.mlir_module()


@pytest.mark.parametrize("kw", [dict(), dict(token_chunk_size=16, vocab_chunk_size=32,
                                             dtype=jnp.float32), dict(d=1024)],
                         ids=["default", "f32_small", "d1024"])
def test_triton_lowers_for_cuda(kw):
  text = _export("triton", **kw)
  assert "__gpu$xla.gpu.triton" in text
  for name in ("fwd", "dh", "dw"):
    assert f"jaxsoft_linear_ce_{name}" in text


@pytest.mark.parametrize("kw", [dict(), dict(token_chunk_size=8, vocab_chunk_size=128, d=64),
                                dict(d=4096)], ids=["default", "small_d64", "d4096"])
def test_mosaic_lowers_for_tpu(kw):
  text = _export("mosaic_tpu", **kw)
  assert text.count("tpu_custom_call") >= 3


def test_triton_blocks_fit_the_shared_memory_model():
  # The model reproduces the one H200 measurement: bf16, d = 1024, blocks 32 x 64 asked for
  # 327680 bytes (the forward kernel; no upcast when the compute dtype is bf16 too).
  assert kce.triton_shared_memory_bytes(32, 64, 1024, 2, 2) == 327680
  assert kce.triton_shared_memory_bytes(32, 64, 1024, 2, 4) > kce.TRITON_SHARED_MEMORY_BUDGET
  for d_pad in (16, 64, 256, 512, 1024):
    for itemsize in (2, 4):
      bt, bv = kce.default_block_sizes("triton", d_pad, itemsize, 4)
      assert min(bt, bv) >= 16 and not bt & (bt - 1) and not bv & (bv - 1)
      assert kce.triton_shared_memory_bytes(bt, bv, d_pad, itemsize, 4) <= \
          kce.TRITON_SHARED_MEMORY_BUDGET, (d_pad, itemsize, bt, bv)
  assert kce.default_block_sizes("triton", 64, 2, 4) == (64, 128)  # small d: large tiles
  for bad in (dict(bt=0), dict(d_pad=-1), dict(itemsize=2.0)):
    args = dict(bt=32, bv=64, d_pad=1024, itemsize=2) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
      kce.triton_shared_memory_bytes(**args)


@pytest.mark.parametrize("kw", [dict(d=2048), dict(d=1024, token_chunk_size=32,
                                                   vocab_chunk_size=64)],
                         ids=["d2048", "d1024_blocks_32x64"])
def test_triton_refuses_blocks_over_the_shared_memory(kw):
  with pytest.raises(ValueError, match="shared memory.*implementation='xla'"):
    _export("triton", **kw)
