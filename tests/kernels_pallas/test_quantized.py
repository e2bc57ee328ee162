"""K09: the quantised-softmax and table-lookup-softmax kernels
(kernels_pallas/quantized.py) in interpret mode against their jnp references
(:func:`jaxsoft.normalizers.quantized_softmax`, :func:`jaxsoft.normalizers.lut_softmax`)
and a numpy float64 softmax, their straight-through / output gradients, and
export-lowering of both drivers.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from kernels_pallas import quantized as qs
from tests.kernels_pallas.test_two_pass import _softmax64

TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
ULP = 2.0 ** -24
X = np.random.default_rng(0).standard_normal((5, 3, 37)).astype(np.float32) * 3.0
MASK = np.random.default_rng(1).uniform(size=X.shape) > 0.25
MASK[2, 1] = False
G = np.random.default_rng(2).standard_normal(X.shape).astype(np.float32)


def _run(kernel, reference, backend, reference_vjp=True):
  br = 16 if backend == "triton" else 8

  @jax.jit
  def run(x, m, g):  # one program: kernel, its VJP and the jnp reference (and its VJP)
    y, vjp = jax.vjp(lambda x: kernel(x, m, backend=backend, interpret=True, block_rows=br), x)
    if not reference_vjp:
      return y, vjp(g)[0], reference(x, m), vjp(g)[0]
    ref, rvjp = jax.vjp(lambda x: reference(x, m), x)
    return y, vjp(g)[0], ref, rvjp(g)[0]
  return (np.asarray(a, np.float64) for a in run(X, MASK, G))


def _check_gradient(dx, w):
  # softmax's (straight-through) or the output's: w (g - <w, g>) in float64; |g| < 5 and
  # float32 products and a 37-term sum: within 1e-5
  np.testing.assert_allclose(dx, w * (G - np.sum(w * G, axis=-1, keepdims=True)), atol=1e-5)


@pytest.mark.parametrize("backend,bits,method,bias", [
    ("triton", 8, "uniform", None),
    pytest.param("triton", 3, "uniform", 0.01, marks=pytest.mark.slow),
    pytest.param("triton", 4, "log2", None, marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", 8, "uniform", None, marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", 6, "log2", None, marks=pytest.mark.slow)])
def test_quantized_kernel_matches_reference(backend, bits, method, bias):
  y, dx, ref, dref = _run(
      lambda x, m, **kw: qs.quantized_softmax(x, bits, m, method=method, bias=bias, **kw),
      lambda x, m: js.normalizers.quantized_softmax(
          x, bits, where=m, method=method, bias_correction=bias is not None, bias=bias),
      backend, reference_vjp=backend != "triton" or bits != 8)  # (the default case: cheaper)
  # the same float operations: the same codes; the value is the straight-through form
  # p + (Q(p) - p), which rounds with p (summed in another order): 4 ulps of the value
  np.testing.assert_allclose(y, ref, rtol=4 * ULP, atol=0)
  p = _softmax64(X, MASK)
  levels = 2 ** bits - 1
  if method == "uniform":  # the level nearest the float64 weight (one step off only at ties)
    want = np.round(p * levels) / levels + (bias or 0.0)
  else:
    k = np.round(-np.log2(np.maximum(p, 1e-300)))
    want = np.where(k >= levels, 0.0, 2.0 ** -np.minimum(k, levels))
  want = np.where(MASK, want, 0.0)
  np.testing.assert_allclose(y, want, atol=1e-6)  # no weight here lies within 1e-6 of a tie
  assert not np.any(y[~MASK]) and not np.any(y[2, 1])
  _check_gradient(dx, p)
  np.testing.assert_allclose(dx, dref, atol=1e-6)


@pytest.mark.parametrize("backend,kw", [
    pytest.param("triton", dict(table_size=64, x_min=-8.0), marks=pytest.mark.slow),
    pytest.param("triton", dict(table_size=256, x_min=-16.0, frac_bits=8),
                 marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", dict(table_size=64, x_min=-8.0), marks=pytest.mark.slow)])
def test_lut_kernel_matches_reference(backend, kw):
  y, dx, ref, dref = _run(lambda x, m, **k: qs.lut_softmax(x, m, **kw, **k),
                          lambda x, m: js.normalizers.lut_softmax(x, where=m, **kw), backend)
  # the same table entries; the row sum is added in another order: the division differs
  # by <= 37 ulps of the sum plus its own rounding
  np.testing.assert_allclose(y, ref, rtol=40 * ULP, atol=0)
  p = _softmax64(X, MASK)
  _check_gradient(dx, y)
  np.testing.assert_allclose(dx, dref, atol=1e-6)
  assert not np.any(y[~MASK]) and not np.any(y[2, 1])
  if "frac_bits" in kw:
    return
  # lut_softmax's documented bound against float64 softmax: rho = e^(Delta/2) - 1 the
  # table's relative error, eps the weight beyond the table; +1e-6 for float32 rounding
  delta = -kw["x_min"] / (kw["table_size"] - 1)
  rho = np.expm1(delta / 2)
  eps = 36 * np.exp(kw["x_min"] - delta / 2)
  inside = MASK & (y > 0)
  ratio = y[inside] / p[inside]
  assert np.all(ratio >= (1 - rho) / (1 + rho) - 1e-6)
  assert np.all(ratio <= (1 + rho) / ((1 - rho) * (1 - eps)) + 1e-6)


def _abstract_gpu():
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("backend,fn", [
    ("triton", "quantized_softmax"),
    pytest.param("mosaic_tpu", "quantized_softmax", marks=pytest.mark.slow),
    pytest.param("triton", "lut_softmax", marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", "lut_softmax", marks=pytest.mark.slow)])
def test_export_lowering(backend, fn):
  xs = jax.ShapeDtypeStruct((4, 300, 1000), jnp.bfloat16)  # 1200 rows of 1000 entries
  kernel = getattr(qs, fn)
  f = jax.jit(lambda x: jax.vjp(lambda x: kernel(x, backend=backend), x)[0])
  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    text = jax.export.export(f, platforms=[platform], disabled_checks=[TRITON_CALL])(
        xs).mlir_module()
  assert ("__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call") in text
  assert f"jaxsoft_{fn}" in text


def test_bad_input():
  x = jnp.ones((2, 8))
  for kw, match in ((dict(bits=0), "bits"), (dict(method="tan"), "method"),
                    (dict(bias=float("nan")), "bias"), (dict(backend="cuda"), "backend"),
                    (dict(block_rows=0), "block_rows")):
    with pytest.raises(ValueError, match=match):
      qs.quantized_softmax(x, **{"interpret": True, **kw})
  for kw, match in ((dict(table_size=1), "table_size"), (dict(x_min=0.0), "x_min"),
                    (dict(frac_bits=0), "frac_bits"), (dict(where=jnp.ones(3, bool)), "where")):
    with pytest.raises(ValueError, match=match):
      qs.lut_softmax(x, **{"interpret": True, **kw})


def test_reference_log2_levels_are_exact_powers_of_two():
  # the kernel writes 2^-k from the exponent bits; the jnp reference used jnp.exp2, which
  # XLA's CPU backend computes 4 ulps low at -13: the levels must be 2^-k exactly
  k = np.arange(0, 15)
  p = (2.0 ** -k * 1.01).astype(np.float32)  # nearest level 2^-k, no tie
  q = np.asarray(jax.jit(lambda p: js.normalizers.log2_quantize(p, 4))(p))
  np.testing.assert_array_equal(q, (2.0 ** -k).astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("fn,kw", [
    ("quantized_softmax", dict(bits=4)),
    ("quantized_softmax", dict(bits=5, method="log2", bias_correction=True)),  # beta from x
    ("quantized_softmax", dict(bits=3, bias_correction=True, bias=0.01)),
    ("lut_softmax", dict(table_size=32, x_min=-6.0))])
def test_jnp_functions_run_the_kernels_with_implementation_pallas(monkeypatch, fn, kw):
  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")
  f = getattr(js.normalizers, fn)
  x, mask, g = X[0].T, MASK[0].T, G[0].T  # over axis 0

  @jax.jit
  def run(x):
    outs = []
    for impl in (None, "pallas_mosaic_tpu"):
      y, vjp = jax.vjp(lambda x, impl=impl: f(x, axis=0, where=mask, implementation=impl, **kw), x)
      outs += [y, vjp(g)[0]]
    return outs
  y, dy, yk, dyk = (np.asarray(a, np.float64) for a in run(x))
  # the same codes; the LUT softmax's sum in another order (37 terms): 40 ulps
  np.testing.assert_allclose(yk, y, rtol=40 * ULP, atol=0)
  np.testing.assert_allclose(dyk, dy, atol=1e-6)  # both softmax-form gradients in float32


def test_implementation_pallas_refuses_what_the_kernel_lacks():
  with pytest.raises(ValueError, match="method"):
    js.normalizers.quantized_softmax(X, 4, method="tan", implementation="pallas_triton")
  with pytest.raises(ValueError, match="key"):
    js.normalizers.quantized_softmax(X, 4, key=jax.random.key(0), implementation="pallas_triton")
  with pytest.raises(ValueError, match="implementation"):
    js.normalizers.lut_softmax(X, implementation="triton")
