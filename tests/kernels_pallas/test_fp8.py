"""K06: fp8 (e4m3) block quantisation of q and k with a randomized Hadamard rotation
(``kp.attention(..., fp8="e4m3")``, kernels_pallas/fp8.py), interpret mode."""

from __future__ import annotations

import functools

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


def test_bad_inputs():
  q, k, v = _inputs(t=64)
  with pytest.raises(ValueError, match="fp8"):
    _run(q, k, v, fp8="e5m2")
  with pytest.raises(ValueError, match="fp8_rotation"):
    _run(q, k, v, fp8="e4m3", fp8_rotation=1)
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
