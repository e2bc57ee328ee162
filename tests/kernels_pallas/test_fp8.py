"""K06: fp8 (e4m3) block quantisation of q and k with a randomized Hadamard rotation
(``kp.attention(..., fp8="e4m3")``, kernels_pallas/fp8.py), interpret mode.

The kernel is compared with an independent float64 numpy reference of the quantised
computation (rotation, block scales, e4m3 rounding and attention written here from the
format and the module's documented formulas), within bounds derived from the float32
arithmetic; the quantiser itself with the e4m3 rounding, whose error the format bounds.
"""

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

# --- an independent float64 reference of the quantised computation ------------------------
# e4m3 (float8_e4m3fn): 3 mantissa bits, so the step between neighbours in [2^e, 2^{e+1})
# is 2^{e-3} (a relative step of 2^-3), and round-to-nearest moves a value by at most half
# a step, a relative 2^-4; the normal range starts at 2^-6, below it the (subnormal) step
# is a fixed 2^-9; the largest finite value is 448 (Micikevicius et al. 2022).
E4M3_MANTISSA_BITS = 3
E4M3_MIN_EXP = -6
E4M3_MAX = 448.0
U_E4M3 = 2.0 ** -(E4M3_MANTISSA_BITS + 1)  # relative rounding bound, 2^-4
SUB_E4M3 = 2.0 ** (E4M3_MIN_EXP - E4M3_MANTISSA_BITS - 1)  # half the subnormal step, 2^-10
U_F32 = 2.0 ** -24  # float32's unit roundoff


def _round_e4m3(y):
  """y (float64, |y| <= 448) rounded to the nearest e4m3 value, ties to even."""
  y = np.asarray(y, np.float64)
  with np.errstate(divide="ignore"):
    e = np.floor(np.log2(np.abs(y)))
  e = np.maximum(np.where(np.isfinite(e), e, E4M3_MIN_EXP), E4M3_MIN_EXP)
  step = 2.0 ** (e - E4M3_MANTISSA_BITS)
  return np.round(y / step) * step  # exact (step is a power of two); np.round: half to even


def _rotation64(h):
  """diag(signs) H_m / sqrt(m), m = the next power of two >= h, Sylvester's H_m and the
  documented seeded signs, in float64."""
  m = 1 << max(0, (h - 1).bit_length())
  had = np.ones((1, 1))
  while had.shape[0] < m:
    had = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), had)
  signs = np.random.default_rng(fp8.SEED).choice([-1.0, 1.0], size=m)
  return signs[:, None] * had / np.sqrt(m)


def _quantise64(x, block):
  """Block quantisation of x [B, T, N, H] as documented (float32 scale amax / 448 per
  (batch, block, head), float32 quotient, e4m3 rounding): the dequantised values in float64
  and each entry's scale."""
  b, t, n, h = x.shape
  nb = -(-t // block)
  xb = np.zeros((b, nb * block, n, h), np.float32)
  xb[:, :t] = x
  xb = xb.reshape(b, nb, block, n, h)
  amax = np.abs(xb).max(axis=(2, 4), keepdims=True)
  scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
  y = np.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(np.float64)
  deq = _round_e4m3(y) * scale.astype(np.float64)
  full = np.broadcast_to(scale, xb.shape).astype(np.float64)
  return deq.reshape(b, -1, n, h)[:, :t], full.reshape(b, -1, n, h)[:, :t]


def _fp8_inputs64(q, k, rotate=True, block_q=64, block_k=64):
  """q, k rotated (float32, as the kernel sees them) and dequantised, in float64."""
  q, k = (np.asarray(x, np.float32) for x in (q, k))
  if rotate:
    r = _rotation64(q.shape[-1])
    pad = [(0, 0)] * 3 + [(0, r.shape[0] - q.shape[-1])]
    q, k = ((np.pad(x.astype(np.float64), pad) @ r).astype(np.float32) for x in (q, k))
  return (q.astype(np.float64), k.astype(np.float64), _quantise64(q, block_q)[0],
          _quantise64(k, block_k)[0])


def _visible64(t, s, causal, kv_len=None):
  vis = np.ones((t, s), bool)
  if causal:
    vis = np.tril(vis)
  if kv_len is not None:
    vis = vis & (np.arange(s) < kv_len)[None]
  return vis


def _weights64(q, k, vis, h):
  """softmax(q k^T / sqrt(h)) [B, N, T, S] over ``vis`` (rows with no key: 0)."""
  s = np.where(vis, np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h), -np.inf)
  m = s.max(-1, keepdims=True)
  e = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
  d = e.sum(-1, keepdims=True)
  return np.where(d > 0, e / np.where(d > 0, d, 1.0), 0.0)


def _f32_bound(qd, kd, v, vis, h):
  """A bound of the float32 kernel's distance from the float64 attention of qd, kd, per
  query row [B, T, N, 1]: a dot of m terms is within m u sum |q||k| of its value (the
  classic bound), so each score moves by at most delta_t = m u max_j sum |q||k| / sqrt(h)
  (+ a few u for the scale); moving every score of a row by at most delta changes each
  weight by a factor within e^{+-2 delta}, so the output by at most max|v| (e^{2 delta} - 1);
  the exp, division and the S-term P V sum add (S + 8) u max|v|."""
  m = qd.shape[-1]
  dots = np.einsum("btnh,bsnh->bnts", np.abs(qd), np.abs(kd)) / np.sqrt(h)
  delta = (m + 4) * U_F32 * np.where(vis, dots, 0.0).max(-1)  # [B, N, T]
  vmax = np.abs(np.asarray(v, np.float64)).max(axis=(1, 3))[:, :, None]  # [B, N, 1]
  bound = vmax * (np.expm1(2.0 * delta) + (vis.shape[-1] + 8) * U_F32)
  return bound.transpose(0, 2, 1)[..., None]


def _assert_is_quantised_attention(o, q, k, v, vis, rotate=True, h=None):
  """o == the float64 attention of the rotated, e4m3-quantised q and k, up to float32."""
  h = q.shape[-1] if h is None else h
  _, _, qd, kd = _fp8_inputs64(q, k, rotate)
  ref = np.einsum("bnts,bsnh->btnh", _weights64(qd, kd, vis, h), np.asarray(v, np.float64))
  err = np.abs(np.asarray(o, np.float64) - ref)
  bound = _f32_bound(qd, kd, v, vis, h)
  assert np.all(err <= bound), (float(err.max()), float((err / bound).max()))
  return ref


def _exact64(q, k, v, vis):
  """The attention of the unquantised q, k in float64."""
  q, k = (np.asarray(x, np.float64) for x in (q, k))
  return np.einsum("bnts,bsnh->btnh", _weights64(q, k, vis, q.shape[-1]),
                   np.asarray(v, np.float64))


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
    np.testing.assert_allclose(r, _rotation64(m), atol=1e-7)  # the documented R
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
  # the values are the documented block quantisation with e4m3 rounding (numpy float64);
  # the scale amax / 448 (XLA may divide through the reciprocal: two roundings) and the
  # product x8 * scale are float32, within 4 u relative
  want, scales = _quantise64(np.asarray(q), 64)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=4 * U_F32, atol=0)
  # the format's bound: half a step, 2^-4 relative (normal) or 2^-10 scale (subnormal)
  err = np.abs(np.asarray(y, np.float64) - np.asarray(q, np.float64))
  assert np.all(err <= (U_E4M3 + 2 * U_F32) * np.abs(np.asarray(q)) + SUB_E4M3 * scales)
  assert float(np.max(err)) > 0
  g = jax.grad(lambda x: jnp.sum(fp8.fake_quant_blocks(x, 64) * 3.0))(q)
  np.testing.assert_array_equal(g, 3.0 * jnp.ones_like(q))  # straight-through


def test_round_e4m3_reference_is_the_format():
  """The numpy rounding above against the format's own table (ml_dtypes' e4m3 values):
  every representable value maps to itself and midpoints round to the even neighbour."""
  grid = np.unique(np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float64))
  grid = grid[np.isfinite(grid)]
  np.testing.assert_array_equal(_round_e4m3(grid), grid)
  pos = grid[grid >= 0]
  mids = 0.5 * (pos[1:] + pos[:-1])
  got = _round_e4m3(mids)
  want = np.asarray(jnp.asarray(mids, jnp.float32).astype(jnp.float8_e4m3fn), np.float64)
  np.testing.assert_array_equal(got, want)
  assert pos.max() == E4M3_MAX and np.min(np.diff(pos)) == 2 * SUB_E4M3


def _run(q, k, v, **kw):
  """The interpret-mode kernel, jitted (one compilation, not one per eager op of the
  quantisation and rotation); array keywords are passed as arguments."""
  arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
  static = {n: x for n, x in kw.items() if n not in arrays}
  return jax.jit(lambda q, k, v, arrays: kp.attention(
      q, k, v, interpret=True, block_sizes=BLOCKS, **static, **arrays))(q, k, v, arrays)


@pytest.mark.parametrize("case", ["normal", "outlier"])
def test_forward_is_the_quantised_attention_and_rotation(case):
  """With and without the rotation, the output is the float64 attention of the quantised
  q and k (float32's error only); the rotation lowers the fp8 error on outlier channels."""
  q, k, v = _inputs(case)
  vis = _visible64(T, T, True)
  errs = {}
  for rotate in (False, True):
    o = _run(q, k, v, is_causal=True, fp8="e4m3", fp8_rotation=rotate)
    _assert_is_quantised_attention(o, q, k, v, vis, rotate)
    errs[rotate] = float(np.mean(np.abs(np.asarray(o, np.float64) - _exact64(q, k, v, vis))))
    assert errs[rotate] > 0  # fp8 is on
  if case == "outlier":  # the rotation spreads the outlier channels
    assert errs[True] < 0.5 * errs[False], errs


def test_masks_and_empty_rows():
  q, k, v = _inputs(t=128)
  o = _run(q, k, v, fp8="e4m3", is_causal=True, key_value_seq_lengths=jnp.array([40]))
  _assert_is_quantised_attention(o, q, k, v, _visible64(128, 128, True, kv_len=40))
  # no visible key (key length 0): every row gives zeros
  o = _run(q, k, v, fp8="e4m3", key_value_seq_lengths=jnp.array([0]))
  np.testing.assert_array_equal(o, jnp.zeros_like(o))


def _grads64(q, k, v, ct, vis):
  """Gradients of <o, ct> by the straight-through rule in float64: softmax attention's
  closed-form backward at the dequantised (rotated) q and k, then R^T back to q and k's
  own dims (the rotation is linear, the quantiser passes the gradient unchanged)."""
  h = q.shape[-1]
  _, _, qd, kd = _fp8_inputs64(q, k, True)
  p = _weights64(qd, kd, vis, h)
  ct, v = np.asarray(ct, np.float64), np.asarray(v, np.float64)
  dv = np.einsum("bnts,btnh->bsnh", p, ct)
  dp = np.einsum("btnh,bsnh->bnts", ct, v)
  ds = p * (dp - np.sum(dp * p, -1, keepdims=True)) / np.sqrt(h)
  r = _rotation64(h)
  dq = np.einsum("bnts,bsnh->btnh", ds, kd) @ r.T
  dk = np.einsum("bnts,btnh->bsnh", ds, qd) @ r.T
  return dq[..., :h], dk[..., :h], dv


def test_gradients_are_the_straight_through_gradients():
  q, k, v = _inputs(t=128)
  ct = jax.random.normal(jax.random.PRNGKey(3), q.shape)
  g8 = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      _run(q, k, v, is_causal=True, fp8="e4m3") * ct), (0, 1, 2)))(q, k, v)
  want = _grads64(q, k, v, ct, _visible64(128, 128, True))
  for a, b in zip(g8, want, strict=True):
    # float32 backward: sums of up to S = 128 terms and a 64-term rotation, each within
    # (terms) u of the sum of magnitudes: 1e-4 of the largest entry covers (128 + 64) u
    # times the magnitudes' spread
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0,
                               atol=1e-4 * float(np.abs(b).max()))


def test_head_dim_padded_to_power_of_two():
  q, k, v = _inputs(t=64, h=48)  # rotated in 64 dims; the scale stays 1/sqrt(48)
  o = _run(q, k, v, fp8="e4m3")
  assert o.shape == v.shape
  _assert_is_quantised_attention(o, q, k, v, _visible64(64, 64, False), h=48)


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
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

  (_, o8), g8 = run(True)
  (_, o), g = run(False)
  assert float(jnp.abs(o8 - o).max()) <= 1e-4 * float(jnp.abs(o).max()), backend
  for a, b in zip(g8, g, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * float(jnp.abs(b).max()))
  # the dequantised values really differ from the inputs: fp8 is on in both runs
  assert float(jnp.abs(o - jax.jit(lambda q, k, v: kp.attention(
      q, k, v, backend=backend, interpret=True, block_sizes=blocks, is_causal=True,
      normalizer=normalizer))(q, k, v)).max()) > 1e-3


def test_native_fp8_dot_bf16_and_masks():
  """bf16 inputs with lengths and a fully hidden batch row: the native path stays within
  the dequantised path's error of the float32 reference, and empty rows give zeros."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(t=128))
  q, k, v = (jnp.concatenate([x, x]) for x in (q, k, v))  # B = 2
  lens = jnp.array([40, 0])
  kw = dict(fp8="e4m3", is_causal=True, key_value_seq_lengths=lens)
  o8, o = _run(q, k, v, fp8_dot=True, **kw), _run(q, k, v, fp8_dot=False, **kw)
  assert o8.dtype == jnp.bfloat16
  r = _exact64(*(x[:1].astype(jnp.float32) for x in (q, k, v)), _visible64(128, 128, True, 40))
  e8, e = (float(np.abs(np.asarray(x[:1].astype(jnp.float32), np.float64) - r).max())
           for x in (o8, o))
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
