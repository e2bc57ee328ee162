"""K05 / K06: the two-pass (mantissa, exponent) softmax kernel (kernels_pallas/two_pass.py)
in interpret mode against a numpy float64 softmax and the jnp reference
(:func:`jaxsoft.normalizers.two_pass_softmax`), its output-based gradient, the polynomial
``exp2`` against float64 ``2^x``, and export-lowering of both drivers for their targets.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from kernels_pallas import two_pass

TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
ULP = 2.0 ** -24  # float32 unit roundoff
# 5 x 3 rows (not a multiple of the row block) of 37 entries (padded), a random mask with a
# fully masked row, and rows far from 0 that a max-free softmax must survive: offsets +1e4
# (e^x overflows) and -3000 (e^x underflows)
X = np.random.default_rng(0).standard_normal((5, 3, 37)).astype(np.float32) * 3.0
X[1, 0] += 1e4
X[1, 1] -= 3000.0
X[3, 2, :4] = 3e6  # below 2^22: still the accurate reduction
MASK = np.random.default_rng(1).uniform(size=X.shape) > 0.25
MASK[2, 1] = False
G = np.random.default_rng(2).standard_normal(X.shape).astype(np.float32)


def _softmax64(x, mask):
  z = np.where(mask, np.asarray(x, np.float64), -np.inf)
  m = np.max(z, axis=-1, keepdims=True)
  e = np.where(mask, np.exp(z - np.where(np.isfinite(m), m, 0.0)), 0.0)
  den = e.sum(-1, keepdims=True)
  return np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)


def _run(backend, exp, with_reference, x=X, mask=MASK, g=G):
  br = 16 if backend == "triton" else 8  # Triton: one program of 16 rows (the cheap test)

  @jax.jit
  def run(x, m, g):  # one program: kernel, its VJP and the jnp reference
    y, vjp = jax.vjp(lambda x: two_pass.two_pass_softmax(
        x, m, exp=exp, backend=backend, interpret=True, block_rows=br), x)
    ref = js.normalizers.two_pass_softmax(x, where=m) if with_reference else y
    return y, vjp(g)[0], ref
  return (np.asarray(a, np.float64) for a in run(x, mask, g))


@pytest.mark.parametrize("backend,exp,with_reference", [
    ("triton", "native", False),  # the default run: the float64 softmax only (cheap)
    pytest.param("triton", "native", True, marks=pytest.mark.slow),
    pytest.param("triton", "poly", True, marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", "native", True, marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", "poly", True, marks=pytest.mark.slow)])
def test_kernel_matches_float64_softmax_reference_and_gradient(backend, exp, with_reference):
  y, dx, ref = _run(backend, exp, with_reference)
  want = _softmax64(X, MASK)
  # y_i = (m_i / M) 2^(k_i - K): the reduction r = x - k ln 2 is exact up to its last two
  # roundings (about 2 ulps of r <= ln2/2), exp and the poly add <= 2 ulps, the lane-wise
  # sum of <= 37 terms 37 ulps relative, the division and 2^d one more: < 48 ulps of y
  np.testing.assert_allclose(y, want, rtol=48 * ULP, atol=1e-30)
  np.testing.assert_allclose(y, ref, rtol=48 * ULP, atol=1e-30)  # the reference: ~4 ulps
  assert not np.any(y[2, 1]) and not np.any(y[~MASK])
  # the gradient from the output: y (g - <y, g>), in float64 from the float64 softmax;
  # |g| < 5, so the float32 products and row sum of 37 terms are within 1e-5
  dwant = want * (G - np.sum(want * G, axis=-1, keepdims=True))
  np.testing.assert_allclose(dx, dwant, atol=1e-5)


def test_exp2_poly_relative_error_bound():
  f = jax.jit(two_pass.exp2_poly)
  # [-1/2, 1/2] on a 2^-20 grid (the polynomial's whole domain) and a
  # dense grid over the normal range, against float64 2^x
  grids = [np.arange(-2 ** 19, 2 ** 19 + 1, dtype=np.float64) / 2 ** 20,
           np.linspace(-125.0, 127.99, 400_003)]
  worst = 0.0
  for g in grids:
    g32 = g.astype(np.float32)
    got = np.asarray(f(g32), np.float64)
    worst = max(worst, float(np.max(np.abs(got / np.exp2(g32.astype(np.float64)) - 1.0))))
  assert worst <= two_pass.EXP2_POLY_MAX_REL_ERR  # documented: 1.2e-7 (measured 8.3e-8)
  assert worst > 0.25 * two_pass.EXP2_POLY_MAX_REL_ERR  # the bound is not loose
  special = np.asarray(f(np.array([128.0, -127.0, np.nan, -np.inf, np.inf, 0.0], np.float32)))
  assert special[0] == np.inf and special[1] == 0 and np.isnan(special[2])
  assert special[3] == 0 and special[4] == np.inf and special[5] == 1.0


def test_round_half_even_and_pow2_are_exact():
  z = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 2.4999998, 3.0, 2.0 ** 23 + 2, 1e30, -7.5],
               np.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(two_pass.round_half_even)(z)), np.round(z))
  d = np.arange(-130, 130, dtype=np.float32)
  with np.errstate(over="ignore"):  # 2^128, 2^129 are inf in float32
    want = np.where(d < -126, 0.0, np.exp2(d.astype(np.float64))).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(two_pass.pow2_int)(d)), want)


@pytest.mark.slow
def test_bf16_rows_and_block_rows():
  x = jnp.asarray(X[0].astype(np.float32)).astype(jnp.bfloat16)
  for backend, br in (("triton", 2), ("mosaic_tpu", 16)):
    y = jax.jit(lambda x, backend=backend, br=br: two_pass.two_pass_softmax(
        x, backend=backend, interpret=True, block_rows=br))(x)
    assert y.dtype == jnp.bfloat16
    want = _softmax64(np.asarray(x.astype(jnp.float32)), np.ones(x.shape, bool))
    # computed in float32, rounded once to bf16 on output: 2^-9 relative
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), want, rtol=2.0 ** -8,
                               atol=1e-30)


def _abstract_gpu():
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("backend,exp", [("triton", "poly"),
                                         pytest.param("mosaic_tpu", "poly", marks=pytest.mark.slow),
                                         pytest.param("triton", "native", marks=pytest.mark.slow),
                                         pytest.param("mosaic_tpu", "native",
                                                      marks=pytest.mark.slow)])
def test_export_lowering(backend, exp):
  xs = jax.ShapeDtypeStruct((4, 300, 1000), jnp.bfloat16)  # 1200 rows of 1000 entries
  f = jax.jit(lambda x: jax.vjp(lambda x: two_pass.two_pass_softmax(
      x, exp=exp, backend=backend), x)[0])
  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    text = jax.export.export(f, platforms=[platform], disabled_checks=[TRITON_CALL])(
        xs).mlir_module()
  assert ("__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call") in text
  assert "jaxsoft_two_pass_softmax" in text


def test_bad_input():
  x = jnp.ones((2, 8))
  for kw, match in ((dict(backend="cuda"), "backend"), (dict(exp="fast"), "exp"),
                    (dict(block_rows=0), "block_rows"),
                    (dict(block_rows=4, backend="mosaic_tpu"), "block_rows"),
                    (dict(where=jnp.ones((3,), bool)), "where")):
    with pytest.raises(ValueError, match=match):
      two_pass.two_pass_softmax(x, **{"interpret": True, **kw})
  with pytest.raises(ValueError, match="float"):
    two_pass.two_pass_softmax(jnp.ones((2, 8), jnp.int32), interpret=True)


@pytest.mark.slow
def test_jnp_function_runs_the_kernel_with_implementation_pallas(monkeypatch):
  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")  # CPU: the interpreter
  x, mask = X[1].T, MASK[1].T  # softmax over axis 0, the rows with offsets +1e4 / -3000
  y = jax.jit(lambda x, m: js.normalizers.two_pass_softmax(
      x, axis=0, where=m, implementation="pallas"))(x, mask)
  want = _softmax64(x.T, mask.T).T
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=48 * ULP, atol=1e-30)


def test_implementation_errors(monkeypatch):
  x = X[1]
  with pytest.raises(ValueError, match="implementation"):
    js.normalizers.two_pass_softmax(x, implementation="cuda")
  monkeypatch.delenv("JAXSOFT_PALLAS_INTERPRET", raising=False)
  if jax.default_backend() == "cpu":  # no driver and no interpreter asked for
    with pytest.raises(NotImplementedError, match="JAXSOFT_PALLAS_INTERPRET"):
      js.normalizers.two_pass_softmax(x, implementation="pallas")


@pytest.mark.slow
def test_nan_propagates_to_its_row_and_nothing_visible_is_zero():
  from kernels_pallas import quantized

  x = np.array([[1.0, np.nan, 2.0, 0.0], [1.0, 2.0, -np.inf, 0.5], [-np.inf] * 4], np.float32)
  want = _softmax64(x[1:2], np.isfinite(x[1:2]))[0]
  for fn in (lambda x: two_pass.two_pass_softmax(x, interpret=True),
             lambda x: quantized.quantized_softmax(x, 16, interpret=True),
             lambda x: quantized.lut_softmax(x, table_size=4096, interpret=True)):
    y = np.asarray(jax.jit(fn)(x), np.float64)
    assert np.all(np.isnan(y[0])) and not np.any(y[2])
    np.testing.assert_allclose(y[1], want, atol=1e-3)  # (16-bit levels, a 4096-entry table)
