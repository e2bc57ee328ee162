"""K06: fp8 (e4m3) block quantisation of q and k with a randomized Hadamard rotation
(``kp.attention(..., fp8="e4m3")``, kernels_pallas/fp8.py), interpret mode."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import fp8
from tests.kernels_pallas.test_lowering import export_fwd_bwd

B, T, N, H = 1, 256, 2, 64
BLOCKS = dict(block_q=64, block_k=64)


def _ref(q, k, v, causal, kv_len=None):
  s = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") / np.sqrt(q.shape[-1])
  vis = jnp.ones((q.shape[1], k.shape[1]), bool)
  if causal:
    vis = jnp.tril(vis)
  if kv_len is not None:
    vis = vis & (jnp.arange(k.shape[1]) < kv_len)[None]
  s = jnp.where(vis, s, -jnp.inf)
  p = jnp.where(vis, jax.nn.softmax(s, -1), 0.0)
  return jnp.einsum("bnts,bsnh->btnh", jnp.nan_to_num(p), v, precision="highest")


@functools.cache
def _inputs(case="normal", t=T, h=H):
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(x, (B, t, N, h)) for x in ks)
  if case == "outlier":
    q, k = (x.at[..., [3, 17]].multiply(20.0) for x in (q, k))
  return q, k, v


def test_rotation_orthogonal_preserves_dots():
  for m in (16, 64):
    r = np.asarray(fp8.hadamard_matrix(m), np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(m), atol=1e-6)
  q, k, _ = _inputs(h=48)  # padded to 64
  qr, kr = fp8.hadamard_rotation(q), fp8.hadamard_rotation(k)
  assert qr.shape[-1] == 64
  a = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest")
  b = jnp.einsum("btnh,bsnh->bnts", qr, kr, precision="highest")
  np.testing.assert_allclose(b, a, atol=2e-4 * float(jnp.abs(a).max()))
  with pytest.raises(ValueError, match="power of two"):
    fp8.hadamard_matrix(48)


def test_quantize_round_trip():
  q, _, _ = _inputs(t=100)  # 100 rows: a partial last block
  x8, scale, t = fp8.quantize_blocks(q, 64)
  assert x8.dtype == jnp.float8_e4m3fn and scale.shape == (B, 2, 1, N, 1)
  y = fp8.dequantize_blocks(x8, scale, t)
  assert y.shape == q.shape
  # e4m3: 3 mantissa bits -> relative rounding <= 2^-4 of the value (normal range)
  err = jnp.abs(y - q)
  bound = 2.0 ** -4 * jnp.abs(q) + scale.max() * 2.0 ** -9  # + the subnormal step
  assert bool(jnp.all(err <= bound + 1e-7))
  assert float(jnp.max(err)) > 0
  g = jax.grad(lambda x: jnp.sum(fp8.fake_quant_blocks(x, 64) * 3.0))(q)
  np.testing.assert_array_equal(g, 3.0 * jnp.ones_like(q))  # straight-through


def _run(q, k, v, **kw):
  return kp.attention(q, k, v, interpret=True, block_sizes=BLOCKS, **kw)


@pytest.mark.parametrize("case", ["normal", "outlier"])
def test_forward_error_bounds_and_rotation(case):
  q, k, v = _inputs(case)
  r = _ref(q, k, v, True)
  errs = {}
  for name, kw in (("fp8", dict(fp8_rotation=False)), ("fp8+hadamard", {})):
    e = jnp.abs(_run(q, k, v, is_causal=True, fp8="e4m3", **kw) - r)
    errs[name] = (float(e.max()), float(e.mean()))
    mx, mean = fp8.ERRORS[(case, name)]
    assert errs[name][0] <= 1.5 * mx and errs[name][1] <= 1.5 * mean, (name, errs)
  if case == "outlier":  # the rotation spreads the outlier channels
    assert errs["fp8+hadamard"][1] < 0.5 * errs["fp8"][1], errs


def test_masks_and_empty_rows():
  q, k, v = _inputs(t=128)
  lens = jnp.array([40])
  o = _run(q, k, v, fp8="e4m3", is_causal=True, key_value_seq_lengths=lens)
  r = _ref(q, k, v, True, kv_len=40)
  assert float(jnp.abs(o - r).max()) < 0.15
  # no visible key (key length 0): every row gives zeros
  o = _run(q, k, v, fp8="e4m3", key_value_seq_lengths=jnp.array([0]))
  np.testing.assert_array_equal(o, jnp.zeros_like(o))


def test_gradients_close_to_flag_off():
  q, k, v = _inputs(t=128)
  ct = jax.random.normal(jax.random.PRNGKey(3), q.shape)

  def grads(**kw):
    return jax.grad(lambda q, k, v: jnp.sum(_run(q, k, v, is_causal=True, **kw) * ct),
                    (0, 1, 2))(q, k, v)

  g8, g = grads(fp8="e4m3"), grads()
  for a, b in zip(g8, g, strict=True):
    assert bool(jnp.all(jnp.isfinite(a)))
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel < 0.1, rel


def test_head_dim_padded_to_power_of_two():
  q, k, v = _inputs(t=64, h=48)  # rotated in 64 dims; the scale stays 1/sqrt(48)
  o = _run(q, k, v, fp8="e4m3")
  assert o.shape == v.shape
  assert float(jnp.abs(o - _ref(q, k, v, False)).max()) < 0.1


@pytest.mark.parametrize("backend,h,normalizer", [
    ("triton", 64, "softmax"), ("triton", 16, "sigmoid"), ("mosaic_tpu", 64, "softmax")])
def test_native_fp8_dot_equals_dequantised(backend, h, normalizer):
  """The native fp8 dot (float8 operands, scales on the tile) gives the dequantised
  path's output up to float32 rounding, and the same gradients (the backward passes run
  on the dequantised q and k either way); h = 16 pads to 32 for the fp8 dot."""
  q, k, v = _inputs("outlier", t=128, h=h)
  blocks = BLOCKS if backend == "triton" else dict(block_q=64, block_k=128)
  ct = jax.random.normal(jax.random.PRNGKey(5), v.shape)

  def run(dot):
    def loss(q, k, v):
      o = kp.attention(q, k, v, backend=backend, interpret=True, block_sizes=blocks,
                       is_causal=True, normalizer=normalizer, fp8="e4m3", fp8_dot=dot)
      return jnp.sum(o * ct), o
    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

  (_, o8), g8 = run(True)
  (_, o), g = run(False)
  assert float(jnp.abs(o8 - o).max()) <= 1e-4 * float(jnp.abs(o).max()), backend
  for a, b in zip(g8, g, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * float(jnp.abs(b).max()))
  # the dequantised values really differ from the inputs: fp8 is on in both runs
  assert float(jnp.abs(o - kp.attention(q, k, v, backend=backend, interpret=True,
                                        block_sizes=blocks, is_causal=True,
                                        normalizer=normalizer)).max()) > 1e-3


def test_native_fp8_dot_bf16_and_masks():
  """bf16 inputs with lengths and a fully hidden batch row: the native path stays within
  the dequantised path's error of the float32 reference, and empty rows give zeros."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(t=128))
  q, k, v = (jnp.concatenate([x, x]) for x in (q, k, v))  # B = 2
  lens = jnp.array([40, 0])
  kw = dict(fp8="e4m3", is_causal=True, key_value_seq_lengths=lens)
  o8, o = _run(q, k, v, fp8_dot=True, **kw), _run(q, k, v, fp8_dot=False, **kw)
  assert o8.dtype == jnp.bfloat16
  r = _ref(*(x[:1].astype(jnp.float32) for x in (q, k, v)), True, kv_len=40)
  e8, e = (float(jnp.abs(x[:1].astype(jnp.float32) - r).max()) for x in (o8, o))
  assert e8 <= 1.25 * e + 1e-2, (e8, e)
  np.testing.assert_array_equal(o8[1], jnp.zeros_like(o8[1]))


def test_kernel_operands():
  q, _, _ = _inputs(t=100)
  x8, scale, _ = fp8.quantize_blocks(q, 64)
  q8, per_row = fp8.kernel_operands(x8, scale, 192)
  assert q8.shape == (B, 192, N, H) and q8.dtype == jnp.float8_e4m3fn
  assert per_row.shape == (B, N, 192)
  deq = q8.astype(jnp.float32) * jnp.transpose(per_row, (0, 2, 1))[..., None]
  np.testing.assert_array_equal(deq[:, :100], fp8.dequantize_blocks(x8, scale, 100))
  np.testing.assert_array_equal(deq[:, 128:], 0.0)
  np.testing.assert_array_equal(per_row[..., 128:], 1.0)
  with pytest.raises(ValueError, match="`rows`"):
    fp8.kernel_operands(x8, scale, 100)


def test_bad_inputs():
  q, k, v = _inputs(t=64)
  with pytest.raises(ValueError, match="fp8"):
    _run(q, k, v, fp8="e5m2")
  with pytest.raises(ValueError, match="fp8_rotation"):
    _run(q, k, v, fp8="e4m3", fp8_rotation=1)
  with pytest.raises(ValueError, match="`fp8_dot` must"):
    _run(q, k, v, fp8="e4m3", fp8_dot=1)
  with pytest.raises(ValueError, match="`fp8_dot` needs"):
    _run(q, k, v, fp8_dot=True)
  with pytest.raises(ValueError, match="class T"):
    _run(q, k, v, fp8="e4m3", fp8_dot=True, normalizer="sparsemax")
  with pytest.raises(ValueError, match="`block`"):
    fp8.quantize_blocks(q, 0)
  with pytest.raises(ValueError, match="`x`"):
    fp8.quantize_blocks(q[0], 16)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_export_lowering(backend):
  q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  fn = functools.partial(kp.attention, backend=backend, is_causal=True, fp8="e4m3",
                         block_sizes=dict(block_q=128, block_k=128))
  text = export_fwd_bwd(fn, backend, q, q)
  assert "f8E4M3FN" in text  # the quantiser's convert is in the module


def _pass_operands_fp8(text: str) -> dict[str, bool]:
  """Per kernel pass of an exported module (fwd, dq, dkv): whether a float8 array is
  among the pallas custom call's operands."""
  out = {}
  for line in text.splitlines():
    name = re.search(r"jaxsoft_attention_(fwd|dq|dkv)_", line)
    if "custom_call" in line and name:
      out[name.group(1)] = "f8E4M3FN" in line[line.rfind(" : ("):]
  return out


@pytest.mark.parametrize("backend,fp8_dot,native", [
    ("triton", None, True), ("triton", False, False), ("mosaic_tpu", None, False),
    ("mosaic_tpu", True, True)])
def test_export_native_fp8_operands(backend, fp8_dot, native):
  """The forward kernel takes float8 q and k exactly when the fp8 dot is native (Triton by
  default, Mosaic on request); the backward passes never do."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  fn = functools.partial(kp.attention, backend=backend, is_causal=True, fp8="e4m3",
                         fp8_dot=fp8_dot, block_sizes=dict(block_q=128, block_k=128))
  assert _pass_operands_fp8(export_fwd_bwd(fn, backend, q, q)) == dict(
      fwd=native, dq=False, dkv=False)
