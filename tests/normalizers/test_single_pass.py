"""K12: Edge-MoE's single-pass softmax (jaxsoft/normalizers/single_pass.py).

The reference is written here in float64 numpy from the authors' HLS recurrence
(sharc-lab/Edge-MoE src/attention.cpp, ``finalize_attn``): float64 holds every value of
``ap_fixed<32, 10>`` exactly (32 significant bits < 53), so the numpy emulation is the
fixed-point arithmetic itself, with truncation toward minus infinity and saturation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft.normalizers import single_pass as sp


def _q(v, fmt):
  if fmt is None:
    return v
  w, i = fmt
  step = 2.0 ** -(w - i)
  return np.clip(np.floor(v / step) * step, -(2.0 ** (i - 1)), 2.0 ** (i - 1) - step)


def _reference(x, fmt, mask=None):
  """float64 numpy, one row at a time, entry by entry (the HLS loop)."""
  x = np.asarray(x, np.float64)
  mask = np.ones(x.shape, bool) if mask is None else np.broadcast_to(mask, x.shape)
  out = np.zeros(x.shape)
  for idx in np.ndindex(x.shape[:-1]):
    row, vis = _q(x[idx], fmt), mask[idx]
    b = -(2.0 ** (fmt[1] - 1)) if fmt else -np.inf
    s = 0.0
    for xj, v in zip(row, vis, strict=True):
      if not v:
        continue
      a = _q(b - xj, fmt)
      if a < 0:  # a new maximum: rescale the sum
        s = _q(_q(s * _q(np.exp(a), fmt), fmt) + 1.0, fmt)
        b = xj
      else:
        s = _q(s + _q(np.exp(-a), fmt), fmt)
    if s > 0:
      r = _q(1.0 / s, fmt)
      out[idx] = np.where(vis, _q(_q(np.exp(_q(row - b, fmt)), fmt) * r, fmt), 0.0)
  return out


def _softmax64(x, mask=None):
  x = np.asarray(x, np.float64)
  mask = np.ones(x.shape, bool) if mask is None else np.broadcast_to(mask, x.shape)
  z = np.where(mask, x, -np.inf)
  m = np.max(z, axis=-1, keepdims=True)
  e = np.where(mask, np.exp(z - np.where(np.isfinite(m), m, 0)), 0.0)
  den = e.sum(-1, keepdims=True)
  return np.where(den > 0, e / np.where(den > 0, den, 1), 0.0)


def _bound(n, fmt):
  """(2n + 6) delta from the module docstring, plus the float32 emulation's own rounding:
  the sum (< n) and its products round at a relative 2^-24 before each truncation, at most
  2n such roundings, each moving a weight <= 1 by <= 2^-24 relatively: 2n 2^-24 + 4 ulp."""
  delta = 2.0 ** -(fmt[0] - fmt[1])
  return (2 * n + 6) * delta + (2 * n + 4) * 2.0 ** -24


X = np.random.default_rng(0).standard_normal((4, 3, 40)) * 3.0
MASK = np.random.default_rng(1).uniform(size=(4, 1, 40)) > 0.3
MASK[0, 0] = False  # a fully masked row


@pytest.mark.parametrize("fmt", [pytest.param((32, 10), marks=pytest.mark.slow), (16, 6)])
def test_matches_the_float64_fixed_point_recurrence_and_the_bound(fmt):
  w = np.asarray(js.normalizers.single_pass_softmax(X, where=MASK, fixed_point=fmt), np.float64)
  want = _reference(X, fmt, MASK)
  n = MASK.sum(-1, keepdims=True)
  delta = 2.0 ** -(fmt[0] - fmt[1])
  # float32 rounding of a product can put it on the other side of a grid point: one step
  # per truncation of a weight's chain (~4) on top of the emulation's own rounding
  np.testing.assert_allclose(w, want, atol=4 * delta + (2 * 40 + 4) * 2.0 ** -24, rtol=0)
  err = np.abs(w - _softmax64(X, MASK))
  assert np.all(err <= _bound(n, fmt)), np.max(err / _bound(n, fmt))
  assert not np.any(w[0, 0])  # fully masked row: zeros
  assert not np.any(w[~np.broadcast_to(MASK, w.shape)])
  if fmt == (16, 6):  # 10 fraction bits: the truncation shows (the test can fail)
    assert np.max(err) > 10 * 2.0 ** -24


@pytest.mark.slow
def test_floating_point_mode_is_softmax_and_streams():
  x = jnp.asarray(X, jnp.float32)
  w = js.normalizers.single_pass_softmax(x, where=MASK, fixed_point=None)
  # float32 softmax of |x| <= 12: a few ulp of each weight
  np.testing.assert_allclose(np.asarray(w), _softmax64(X, MASK), atol=2e-6)

  # every prefix: the running state is (max, sum e^{x - max}) of the entries so far
  @jax.jit
  def states(row):
    def step(state, xj):
      b, s = sp.single_pass_update(*state, xj, None)
      return (b, s), (b, s)
    return jax.lax.scan(step, (jnp.float32(np.finfo(np.float32).min), jnp.float32(0)), row)[1]

  b, s = (np.asarray(a, np.float64) for a in states(x[1, 2]))
  row = X[1, 2]
  for t in range(1, 41):
    m = row[:t].max()
    assert b[t - 1] == np.float32(m)
    np.testing.assert_allclose(s[t - 1], np.exp(row[:t] - m).sum(), rtol=1e-5)


@pytest.mark.slow
def test_gradient_is_softmax_and_dtypes():
  x = jnp.asarray(X[1], jnp.float32)
  g = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape), jnp.float32)
  grads = jax.jit(lambda x, g: (
      jax.grad(lambda x: jnp.sum(js.normalizers.single_pass_softmax(x) * g))(x),
      jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) * g))(x)))(x, g)
  np.testing.assert_allclose(*grads, atol=1e-6)  # the same formula in float32
  wb = js.normalizers.single_pass_softmax(x.astype(jnp.bfloat16), fixed_point=(16, 6))
  assert wb.dtype == jnp.bfloat16
  # bf16 input is computed in float32 on bf16's values and rounded once at the end
  # (bf16's relative half-ulp 2^-9 on weights <= 1)
  want = _reference(np.asarray(x.astype(jnp.bfloat16), np.float64), (16, 6))
  np.testing.assert_allclose(np.asarray(wb, np.float64), want, atol=2.0 ** -9 + 4 * 2.0 ** -10)


def test_float64_input_computes_in_float64():
  """Under x64 a float64 row runs the recurrence in float64 (the module docstring): every
  value of ap_fixed<32, 10> is exact there, so the result is the float64 numpy recurrence
  itself, up to an exponential's last bit putting one truncation on the other side of a
  grid point (that moves a weight by at most 2 grid steps: its own and 1/s's); and the
  floating-point recurrence is softmax to float64 rounding, which float32 arithmetic (~1e-7)
  would miss by six orders of magnitude."""
  with jax.enable_x64(True):
    x = jnp.asarray(X, jnp.float64)
    w, w_float = jax.jit(lambda x: (js.normalizers.single_pass_softmax(x, where=MASK),
                                    js.normalizers.single_pass_softmax(x, where=MASK,
                                                                       fixed_point=None)))(x)
    assert w.dtype == w_float.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(w), _reference(X, (32, 10), MASK), atol=2 * 2.0 ** -22,
                             rtol=0)
  # 40 entries, weights <= 1: a few dozen roundings of 2^-53
  np.testing.assert_allclose(np.asarray(w_float), _softmax64(X, MASK), atol=1e-14, rtol=0)
  assert not np.any(np.asarray(w)[0, 0])  # the fully masked row


def test_rules_and_errors():
  w = js.normalizers.single_pass_softmax(jnp.array([[1.0, jnp.inf, 2.0], [1.0, jnp.nan, 0.0]]))
  np.testing.assert_array_equal(np.asarray(w[0]), [0.0, 1.0, 0.0])  # +inf takes the row
  assert np.all(np.isnan(np.asarray(w[1])))
  for bad in ((8, 8), (70, 10), (16.0, 6), "fp"):
    with pytest.raises(ValueError, match="fixed_point"):
      js.normalizers.single_pass_softmax(jnp.ones(3), fixed_point=bad)
  np.testing.assert_allclose(np.asarray(sp.fixed_point_quantize(jnp.array([0.3, -0.3, 9.0]), (8, 4))),
                             [0.25, -0.3125, 7.9375])  # floor to 1/16, saturate at 8 - 1/16
