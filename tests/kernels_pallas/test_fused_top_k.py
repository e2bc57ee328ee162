"""K01: the fused softmax + top-k kernel (kernels_pallas/fused_top_k.py) in interpret mode:
values against float64 numpy softmax, indices against ``lax.top_k(jax.nn.softmax(x))``
(ties: lower index first), the gradient against the float64 softmax Jacobian restricted
to the selected entries, and export-lowering of both drivers for their real targets.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import fused_top_k as st

TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
K = 6
# 2 x 5 rows (not a multiple of the row block) of 300 logits (not a multiple of the
# column block: the last block is padded)
X = np.random.default_rng(0).standard_normal((2, 5, 300)).astype(np.float32) * 3.0
X[0, 0, 150:300] = X[0, 0, 0:150]  # every logit twice, in different column blocks: ties
X[0, 1] *= 1e4  # |x| up to ~4e4: exp without the running max overflows
X[0, 2, 7] = 120.0  # one dominant logit: e^(x - 120) < 2^-149, the rest are 0 in float32
MASK = np.random.default_rng(1).uniform(size=X.shape) > 0.25
MASK[0, 0] = True  # every duplicate visible
MASK[0, 2, 7] = True
MASK[1, 0] = False  # a fully hidden row: values 0, indices 0..k-1
MASK[1, 1] = False
MASK[1, 1, [250, 40, 99]] = True  # fewer visible entries than k: zero slots by lowest index
G = np.random.default_rng(2).standard_normal((2, 5, K)).astype(np.float32)


def _softmax64(x, mask):
  z = np.where(mask, np.asarray(x, np.float64), -np.inf)
  m = np.max(z, axis=-1, keepdims=True)
  e = np.where(mask, np.exp(z - np.where(np.isfinite(m), m, 0.0)), 0.0)
  den = e.sum(-1, keepdims=True)
  return np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)


def _run(backend, dtype, **blocks):
  @jax.jit
  def run(x, m, g):  # one program: the kernel, its VJP and lax.top_k(softmax)
    (v, i), vjp = jax.vjp(lambda x: st.softmax_top_k(
        x, K, m, backend=backend, interpret=True, **blocks), x, has_aux=False)
    dx = vjp((g.astype(v.dtype), np.zeros(i.shape, jax.dtypes.float0)))[0]
    rv, ri = jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32), where=m), K)
    return v, i, dx, rv, ri
  return run(jnp.asarray(X, dtype), MASK, G)


@pytest.mark.parametrize("backend,dtype,blocks", [
    ("triton", jnp.float32, dict(block_cols=64)),
    pytest.param("triton", jnp.float32, {}, marks=pytest.mark.slow),
    pytest.param("triton", jnp.bfloat16, dict(block_cols=32, block_rows=4),
                 marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", jnp.float32, dict(block_cols=128), marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", jnp.bfloat16, {}, marks=pytest.mark.slow)])
def test_kernel_matches_top_k_of_softmax_and_its_gradient(backend, dtype, blocks):
  v, i, dx, rv, ri = _run(backend, dtype, **blocks)
  assert v.dtype == dtype and i.dtype == jnp.int32 and v.shape == i.shape == (2, 5, K)
  x64 = np.asarray(jnp.asarray(X, dtype), np.float64)  # the inputs as the kernel saw them
  p = _softmax64(x64, MASK)
  # indices: lax.top_k's, ties (the duplicated row, the zero probabilities of the
  # underflowing, the short and the hidden rows) broken by lower index
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(i[1, 0]), np.arange(K))
  assert set(np.asarray(i[1, 1, :3]).tolist()) == {40, 99, 250}
  np.testing.assert_array_equal(np.asarray(i[1, 1, 3:]), [0, 1, 2])
  assert np.all(i[0, 0, 0::2] < 150) and np.all(i[0, 0, 1::2] == i[0, 0, 0::2] + 150)
  # values: the float64 probabilities of those indices; float32 softmax over n = 300:
  # the sum's relative error is at most ~n 2^-24 = 1.8e-5, exp and the division a few ulp;
  # bf16 rounds the output: a relative 2^-8
  want = np.take_along_axis(p, np.asarray(i), axis=-1)
  rtol = 2e-5 if dtype == jnp.float32 else 2.0 ** -8
  # a probability below the format's smallest subnormal is 0 there (float32 2^-149,
  # bf16 2^-133)
  tiny = 2.0 ** -149 if dtype == jnp.float32 else 2.0 ** -133
  np.testing.assert_allclose(np.asarray(v, np.float64), want, rtol=rtol, atol=tiny)
  assert np.all(np.asarray(v[0, 2, 1:]) == 0) and np.asarray(i[0, 2, 0]) == 7
  np.testing.assert_allclose(np.asarray(v, np.float64), np.asarray(rv, np.float64),
                             rtol=rtol, atol=0)
  # gradient: dL/dx_j = sum_i g_i p_i (delta_ij - p_j) over the selected i, in float64
  gp = G * want
  dwant = -p * gp.sum(-1, keepdims=True)
  np.put_along_axis(dwant, np.asarray(i), np.take_along_axis(dwant, np.asarray(i), -1) + gp, -1)
  # float32 products of terms bounded by |g| p <= 3.5: a few 1e-7; bf16 rounds dx (2^-8)
  atol = 1e-6 if dtype == jnp.float32 else 2.0 ** -8 * np.abs(dwant).max()
  np.testing.assert_allclose(np.asarray(dx, np.float64), dwant, atol=atol, rtol=1e-5)
  assert not np.any(np.asarray(dx)[~MASK])


def _abstract_gpu():
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  # an Auto axis, as tests/kernels_pallas/test_lowering.py explains (JAX 0.12)
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_export_lowering(backend):
  xs = jax.ShapeDtypeStruct((3, 100, 1500), jnp.bfloat16)  # 300 rows of 1500 logits
  f = jax.jit(lambda x: jax.vjp(lambda x: st.softmax_top_k(x, 64, backend=backend)[0], x)[0])
  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    text = jax.export.export(f, platforms=[platform], disabled_checks=[TRITON_CALL])(
        xs).mlir_module()
  assert ("__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call") in text
  assert "jaxsoft_softmax_top_k" in text


def test_bad_input():
  x = jnp.ones((2, 8))
  for kw, match in ((dict(backend="cuda"), "backend"), (dict(k=0), "`k`"), (dict(k=9), "`k`"),
                    (dict(k=2.0), "`k`"), (dict(block_rows=0), "block_rows"),
                    (dict(block_cols=48), "power of two"),
                    (dict(block_cols=64, backend="mosaic_tpu"), "multiple"),
                    (dict(where=jnp.ones((3,), bool)), "where")):
    with pytest.raises(ValueError, match=match):
      st.softmax_top_k(x, **{"k": 2, "interpret": True, **kw})
  with pytest.raises(ValueError, match="float"):
    st.softmax_top_k(jnp.ones((2, 8), jnp.int32), 2, interpret=True)


@pytest.mark.slow
def test_float64_stays_float64():
  with jax.enable_x64(True):
    x = np.random.default_rng(3).standard_normal((3, 200)) * 3.0
    v, i = jax.jit(lambda x: st.softmax_top_k(x, 4, interpret=True, block_cols=64))(x)
    assert v.dtype == jnp.float64
    p = _softmax64(x, np.ones(x.shape, bool))
    order = np.argsort(-p, axis=-1, kind="stable")[:, :4]  # distinct values: no ties
    np.testing.assert_array_equal(np.asarray(i), order)
    # float64 sums of 200 terms: a relative n 2^-53 ~ 2e-14
    np.testing.assert_allclose(np.asarray(v), np.take_along_axis(p, order, -1), rtol=1e-13)
