"""K12: the single-pass softmax kernel (kernels_pallas/single_pass.py) in interpret mode
against the jnp reference (:func:`jaxsoft.normalizers.single_pass_softmax`) and the
float64 fixed-point recurrence of tests/normalizers/test_single_pass.py, its gradient
against softmax's, and export-lowering of both drivers for their real targets.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from kernels_pallas import single_pass
from tests.normalizers.test_single_pass import _bound, _reference, _softmax64

TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
# 5 x 3 rows (not a multiple of the row block), 37 entries (padded), a random mask with
# one fully masked row
X = np.random.default_rng(0).standard_normal((5, 3, 37)).astype(np.float32) * 3.0
MASK = np.random.default_rng(1).uniform(size=X.shape) > 0.25
MASK[2, 1] = False
G = np.random.default_rng(2).standard_normal(X.shape).astype(np.float32)


def _run(backend, fmt):
  @jax.jit
  def run(x, m, g):  # one program: kernel, its VJP and the jnp reference
    w, vjp = jax.vjp(lambda x: single_pass.single_pass_softmax(
        x, m, fixed_point=fmt, backend=backend, interpret=True), x)
    return w, vjp(g)[0], js.normalizers.single_pass_softmax(x, where=m, fixed_point=fmt)
  return (np.asarray(a, np.float64) for a in run(X, MASK, G))


@pytest.mark.parametrize("backend,fmt", [
    ("triton", (16, 6)),
    pytest.param("triton", (32, 10), marks=pytest.mark.slow),
    pytest.param("triton", None, marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", (16, 6), marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", (32, 10), marks=pytest.mark.slow)])
def test_kernel_matches_reference_recurrence_and_softmax_gradient(backend, fmt):
  w, dx, ref = _run(backend, fmt)
  # the kernel runs the reference's own update function in the same order: equal in
  # interpret mode up to a float32 rounding flipping one truncation (one grid step)
  step = 2.0 ** -(fmt[0] - fmt[1]) if fmt else 0.0
  np.testing.assert_allclose(w, ref, atol=step + 1e-7, rtol=0)
  want = _softmax64(X, MASK)
  if fmt is None:
    np.testing.assert_allclose(w, want, atol=2e-6)  # float32 softmax, |x| <= 12
  else:
    np.testing.assert_allclose(w, _reference(X, fmt, MASK), atol=4 * step + 84 * 2.0 ** -24)
    assert np.all(np.abs(w - want) <= _bound(MASK.sum(-1, keepdims=True), fmt))
  assert not np.any(w[2, 1]) and not np.any(w[~MASK])
  # the gradient is softmax's (straight-through), in float64: w (g - sum w g)
  dwant = want * (G - np.sum(want * G, axis=-1, keepdims=True))
  np.testing.assert_allclose(dx, dwant, atol=1e-5)  # float32 softmax and products


def _abstract_gpu():
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_export_lowering(backend):
  xs = jax.ShapeDtypeStruct((4, 300, 1000), jnp.bfloat16)  # 1200 rows of 1000 entries
  f = jax.jit(lambda x: jax.vjp(lambda x: single_pass.single_pass_softmax(
      x, backend=backend), x)[0])
  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    text = jax.export.export(f, platforms=[platform], disabled_checks=[TRITON_CALL])(
        xs).mlir_module()
  assert ("__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call") in text
  assert "jaxsoft_single_pass_softmax" in text


def test_bad_input():
  x = jnp.ones((2, 8))
  for kw, match in ((dict(backend="cuda"), "backend"), (dict(fixed_point=(4, 4)), "fixed_point"),
                    (dict(block_rows=0), "block_rows"),
                    (dict(block_rows=64, backend="mosaic_tpu"), "block_rows"),
                    (dict(where=jnp.ones((3,), bool)), "where")):
    with pytest.raises(ValueError, match=match):
      single_pass.single_pass_softmax(x, **{"interpret": True, **kw})
  with pytest.raises(ValueError, match="float"):
    single_pass.single_pass_softmax(jnp.ones((2, 8), jnp.int32), interpret=True)
