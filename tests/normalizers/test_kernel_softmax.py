"""K05: the two-pass and the unified-max softmax against float64 numpy softmax."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers.reference import masked_rows, softmax64

F32_MAX = float(np.finfo(np.float32).max)


def _ulps(y, want):
  """|y - want| in units of float32 spacing at want (entries with want > 1e-30)."""
  want32 = np.asarray(want, np.float32)
  err = np.abs(np.asarray(y, np.float64) - want) / np.spacing(want32).astype(np.float64)
  return err[want > 1e-30]


# ------------------------------------------------------------------------------ K05 two-pass


def _magnitude_rows():
  """Rows of N(0, 3) scores shifted to |x| ~ 0, 1e2, ..., 3e38 (one magnitude per row)."""
  rng = np.random.default_rng(0)
  noise = rng.standard_normal((12, 17)) * 3.0
  shifts = np.array([0, 1e2, -1e4, 1e4, 1e6, -1e7, 3e7, 1e8, 1e9, -1e12, 1e30, 3e38])
  return (shifts[:, None] + noise).astype(np.float32)


def test_two_pass_equals_float64_softmax_within_a_few_ulps_and_never_overflows():
  extremes = np.full((4, 17), -np.inf, np.float32)  # (-inf pads: masked)
  extremes[:, :4] = [[1e4, 1e4 - 1.0, -F32_MAX, 0.0],
                     [F32_MAX, F32_MAX, -F32_MAX, 1e10],       # ties at float32's max share
                     [2.0 ** 31, 2.0 ** 31 - 128, 2.0 ** 30, -2.0 ** 31],
                     [-F32_MAX, -F32_MAX, -3e38, -1e38]]       # all hugely negative
  x = np.concatenate([_magnitude_rows(), extremes])
  y = np.asarray(jax.jit(N.two_pass_softmax)(jnp.asarray(x)), np.float64)
  want = softmax64(x)
  assert np.all(np.isfinite(y))
  assert _ulps(y, want).max() <= 8, _ulps(y, want).max()
  np.testing.assert_allclose(y, want, rtol=0, atol=1e-6)
  assert y[13, 0] == y[13, 1] == 0.5 and y[13, 2] == 0
  assert float(jnp.exp(jnp.float32(1e4))) == math.inf  # where the naive exp overflows


def _check_against_softmax(fn, x, mask):
  """``fn`` == the library softmax on values and VJP (random cotangent) with a mask, in
  one compiled program; masked entries and the fully masked row 0 get exact zeros."""
  ct = helpers.random_cotangent(x.shape)

  @jax.jit
  def both(x):
    out = []
    for f in (fn, N.softmax):
      y, vjp = jax.vjp(lambda x, f=f: f(x, where=mask), x)
      out.append((y, vjp(ct)[0]))
    return out

  (y, dx), (want, dwant) = both(x)
  chex.assert_trees_all_close(y, want, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(dx, dwant, atol=1e-6, rtol=1e-5)
  hidden = ~np.asarray(mask) | ~np.isfinite(np.asarray(x))
  assert np.all(np.asarray(y)[hidden] == 0) and np.all(np.asarray(dx)[hidden] == 0)
  assert np.all(np.isfinite(np.asarray(dx)))


def test_two_pass_masks_and_gradient():
  x, mask = masked_rows()
  _check_against_softmax(N.two_pass_softmax, x, mask)


@pytest.mark.slow
def test_two_pass_low_precision_other_axis_and_odd_rows():
  x, _ = masked_rows()
  xb = x.astype(jnp.bfloat16)
  yb = N.two_pass_softmax(xb, axis=0)  # another axis, bf16 in and out
  assert yb.dtype == jnp.bfloat16
  chex.assert_trees_all_close(yb.astype(jnp.float32),
                              N.softmax(xb.astype(jnp.float32), axis=0), atol=1e-2)
  # +inf and NaN rows follow softmax's rules
  odd = x.at[1, 2].set(jnp.inf).at[3, 3].set(jnp.nan)
  chex.assert_trees_all_close(N.two_pass_softmax(odd), N.softmax(odd), atol=1e-6)


@pytest.mark.slow
def test_two_pass_float64():
  rng = np.random.default_rng(12)
  x = rng.standard_normal((5, 9)) * 3 + np.array([[0.0], [1e3], [1e8], [1e15], [1e300]])
  with jax.enable_x64(True):
    y = np.asarray(N.two_pass_softmax(jnp.asarray(x)))
    assert y.dtype == np.float64
    big = np.asarray(N.two_pass_softmax(jnp.asarray([1.7e308, 1.7e308, -1.7e308])))
  np.testing.assert_allclose(y, softmax64(x), rtol=1e-14, atol=1e-300)
  np.testing.assert_array_equal(big, [0.5, 0.5, 0.0])


# --------------------------------------------------------------------------- K05 unified max


def test_unified_max_equals_softmax_for_any_phi_and_guard_fires():
  rng = np.random.default_rng(2)
  x = rng.standard_normal((5, 12)) * np.array([[2], [2], [2], [2], [0.05]])
  x = (x + np.array([[0], [5], [1e3], [-1e3], [87]])).astype(np.float32)
  want = softmax64(x)
  run = jax.jit(lambda x, phi: (N.unified_max_softmax(x, phi), N.unified_max_fallback(x, phi)))
  for phi in (0.0, 4.0, -30.0):
    y, fb = run(jnp.asarray(x), phi)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-6, atol=1e-7)
  fb = np.asarray(run(jnp.asarray(x), 0.0)[1])[:, 0]
  # rows 0, 1 near phi: no recompute; 1e3 above and 1e3 below phi: recompute. Row 4 at
  # max ~ 87: e^87 fits float32 but 12 such terms do not -> above b = log(max) - log(12) - 1.
  assert fb.tolist() == [False, False, True, True, True]
  with np.errstate(over="ignore"):
    assert not np.all(np.isfinite(np.exp(x[2]).astype(np.float32)))  # the guard was needed
  # per-row phi, and a safe range of one's own
  phis = jnp.asarray(x.max(-1, keepdims=True) - 1.0)
  assert not np.any(np.asarray(N.unified_max_fallback(jnp.asarray(x), phis)))
  y = N.unified_max_softmax(jnp.asarray(x), phis, safe_range=(-5.0, 5.0))
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-6, atol=1e-7)


def test_unified_max_chunks_merge_by_addition():
  x = helpers.rows(3, (2, 20), 2.0)
  phi = 1.5

  @jax.jit
  def run(x):
    e = jnp.exp(x - phi)  # FlashDecoding++: chunk sums computed apart, merged by +
    parts = sum(jnp.sum(e[:, a:b], -1, keepdims=True) for a, b in [(0, 7), (7, 13), (13, 20)])
    return N.unified_max_softmax(x, phi), e / parts

  got, want = run(x)
  chex.assert_trees_all_close(got, want, atol=1e-7, rtol=1e-6)


def test_unified_max_masks_gradient_and_bad_range():
  x, mask = masked_rows()
  _check_against_softmax(lambda x, where: N.unified_max_softmax(x + 500.0, 0.0, where=where),
                         x, mask)
  helpers.check_raises(
      ("safe_range", lambda: N.unified_max_softmax(x, 0.0, safe_range=(0.0, 200.0))),
      ("safe_range", lambda: N.unified_max_softmax(x, 0.0, safe_range=(3.0, 1.0))),
      ("phi", lambda: N.unified_max_softmax(x, math.inf)),
      ("axis", lambda: N.unified_max_softmax(x, 0.0, axis=2)))
