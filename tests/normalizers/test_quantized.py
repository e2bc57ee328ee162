"""K05 (two-pass and unified-max softmax) and K09 (quantised softmax, LUT exp, binarisation)
against float64 numpy softmax and closed forms."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.normalizers as N
from tests import helpers

F32_MAX = float(np.finfo(np.float32).max)


def _softmax64(x, mask=None):
  """float64 numpy softmax over the last axis (masked entries 0)."""
  x = np.asarray(x, np.float64)
  mask = np.isfinite(x) if mask is None else np.asarray(mask) & (x > -np.inf)
  m = np.max(np.where(mask, x, -np.inf), -1, keepdims=True)
  e = np.where(mask, np.exp(np.where(mask, x, m) - m), 0.0)
  return e / e.sum(-1, keepdims=True)


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
  want = _softmax64(x)
  assert np.all(np.isfinite(y))
  assert _ulps(y, want).max() <= 8, _ulps(y, want).max()
  np.testing.assert_allclose(y, want, rtol=0, atol=1e-6)
  assert y[13, 0] == y[13, 1] == 0.5 and y[13, 2] == 0
  assert float(jnp.exp(jnp.float32(1e4))) == math.inf  # where the naive exp overflows


def _masked_rows():
  """Scores with a -inf entry, hidden columns and one fully masked row (row 0)."""
  x, mask = helpers.random_rows(11, (5, 9))
  return x.at[2, 1].set(-jnp.inf), mask


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
  x, mask = _masked_rows()
  _check_against_softmax(N.two_pass_softmax, x, mask)


@pytest.mark.slow
def test_two_pass_low_precision_other_axis_and_odd_rows():
  x, _ = _masked_rows()
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
  np.testing.assert_allclose(y, _softmax64(x), rtol=1e-14, atol=1e-300)
  np.testing.assert_array_equal(big, [0.5, 0.5, 0.0])


# --------------------------------------------------------------------------- K05 unified max


def test_unified_max_equals_softmax_for_any_phi_and_guard_fires():
  rng = np.random.default_rng(2)
  x = rng.standard_normal((5, 12)) * np.array([[2], [2], [2], [2], [0.05]])
  x = (x + np.array([[0], [5], [1e3], [-1e3], [87]])).astype(np.float32)
  want = _softmax64(x)
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
  x, mask = _masked_rows()
  _check_against_softmax(lambda x, where: N.unified_max_softmax(x + 500.0, 0.0, where=where),
                         x, mask)
  helpers.check_raises(
      ("safe_range", lambda: N.unified_max_softmax(x, 0.0, safe_range=(0.0, 200.0))),
      ("safe_range", lambda: N.unified_max_softmax(x, 0.0, safe_range=(3.0, 1.0))),
      ("phi", lambda: N.unified_max_softmax(x, math.inf)),
      ("axis", lambda: N.unified_max_softmax(x, 0.0, axis=2)))


# ------------------------------------------------------------------------------- K09 quantisers


@pytest.fixture(scope="module")
def attention_rows():
  """Near-uniform attention rows (n = 512): most p fall below half an 8-bit step."""
  x = helpers.rows(5, (64, 512), 0.7)
  return x, np.asarray(N.softmax(x), np.float64)


@pytest.mark.parametrize("method", helpers.sampled(["uniform", "tan", "log2"],
                                                    default=("uniform", "tan")))
def test_error_shrinks_as_bits_grow(attention_rows, method):
  x, p = attention_rows
  if method == "log2":  # levels 2^-k: more bits only reach further down; 1/2..1 stays coarse
    errs = [float(np.mean(np.abs(np.asarray(N.quantized_softmax(x, b, method=method)) - p)))
            for b in (2, 4, 8)]
    assert errs[0] > 3 * errs[1] and errs[1] >= errs[2], errs
    sulq = [float(np.mean(np.abs(np.asarray(N.log2_quantize(p, b, shift=1e-3)) - p)))
            for b in (2, 4, 8)]
    assert sulq[0] > sulq[1] > sulq[2], sulq
    return
  errs = [float(np.mean(np.abs(np.asarray(N.quantized_softmax(x, b, method=method)) - p)))
          for b in (4, 8, 16)]
  assert errs[0] > errs[1] > 10 * errs[2] and errs[2] < errs[0] / 100, errs


def test_bias_correction_reduces_the_mean_bias(attention_rows):
  x, p = attention_rows
  calib = helpers.rows(6, (64, 512), 0.7)  # beta calibrated on another batch
  beta = N.softmax_quantization_bias(calib, bits=8)
  q = np.asarray(N.quantized_softmax(x, 8), np.float64)
  qc = np.asarray(N.quantized_softmax(x, 8, bias_correction=True, bias=beta), np.float64)
  before, after = abs(q.sum(-1).mean() - 1), abs(qc.sum(-1).mean() - 1)
  assert before > 0.1 and after < before / 20, (before, after)
  # on a toy attention output: the mean signed error shrinks
  v = np.asarray(helpers.rows(7, (512, 4), 1.0), np.float64) + 1.0
  bias_o = lambda w: abs(np.mean(w @ v - p @ v))
  assert bias_o(qc) < bias_o(q) / 10, (bias_o(q), bias_o(qc))
  # per-row beta on the batch itself brings every row sum to 1; argmax unchanged
  beta_rows = N.softmax_quantization_bias(x, bits=8, per_row=True)
  q_rows = N.quantized_softmax(x, 8, bias_correction=True, bias=beta_rows)
  np.testing.assert_allclose(np.asarray(q_rows).sum(-1), 1.0, atol=1e-4)
  assert np.array_equal(np.argmax(qc, -1), np.argmax(q, -1))
  # stochastic rounding is unbiased without correction
  qs = np.asarray(N.quantized_softmax(x, 8, key=jax.random.key(0)), np.float64)
  assert abs(qs.sum(-1).mean() - 1) < before / 20


@pytest.mark.slow
def test_quantizers_exact_on_their_levels_and_in_range():
  levels = jnp.arange(16, dtype=jnp.float32) / 15
  np.testing.assert_array_equal(N.uniform_quantize(levels, 4), levels)
  assert float(N.softmax_quantization_bias(jnp.log(jnp.array([[1.0, 2.0, 12.0]])), 4)) == \
      pytest.approx(0.0, abs=1e-7)  # p = (1, 2, 12)/15 are 4-bit levels: beta = 0
  pw = jnp.exp2(-jnp.arange(7.0))
  np.testing.assert_array_equal(N.log2_quantize(pw, 3), pw)
  p = jnp.linspace(0.0, 1.0, 101)
  for q in (N.log2_quantize(p, 3, shift=0.01), N.tan_quantize(p, 3), N.log2_quantize(p, 2)):
    q = np.asarray(q)
    assert q.min() >= 0 and q.max() <= 1 and np.all(np.diff(q) >= 0)
  for q in (N.log2_quantize(p, 3, shift=0.01), N.tan_quantize(p, 3)):  # 0 and 1 are levels
    assert float(q[0]) == 0.0 and float(q[-1]) == 1.0
    assert len(np.unique(np.asarray(q))) <= 8
  # tan: finer near 0 and 1 than in the middle
  lv = np.unique(np.asarray(N.tan_quantize(p, 4, theta=1.3)))
  assert np.diff(lv)[0] < np.diff(lv)[len(lv) // 2] / 2
  # straight-through gradient
  g = jax.grad(lambda p: jnp.sum(N.uniform_quantize(p, 4) * jnp.arange(3.0)))(p[:3])
  np.testing.assert_array_equal(g, jnp.arange(3.0))


@pytest.mark.parametrize("method", helpers.sampled(["uniform", "log2", "tan"], ("uniform",)))
def test_quantized_masks_and_extremes(method):
  x = helpers.rows(8, (3, 10), 2.0).at[0, 1].set(-jnp.inf).at[1, 2].set(1e30)
  where = jnp.ones((3, 10), bool).at[2].set(False)
  f = lambda x: N.quantized_softmax(x, 4, where=where, method=method, bias_correction=True)
  q, g = jax.jit(lambda x: (f(x), jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(10.0)))(x)))(x)
  assert np.all(np.isfinite(np.asarray(q))) and np.all(np.isfinite(np.asarray(g)))
  assert float(q[0, 1]) == 0 and not np.any(np.asarray(q[2])) and not np.any(np.asarray(g[2]))


def test_bad_arguments_raise():
  x = jnp.zeros((2, 3))
  helpers.check_raises(
      ("bits", lambda: N.quantized_softmax(x, 0)),
      ("bits", lambda: N.uniform_quantize(x, 2.5)),
      ("method", lambda: N.quantized_softmax(x, 4, method="int")),
      ("key", lambda: N.quantized_softmax(x, 4, method="tan", key=jax.random.key(0))),
      ("bias", lambda: N.quantized_softmax(x, 4, bias=0.01)),
      ("shift", lambda: N.log2_quantize(x, 4, shift=-1.0)),
      ("theta", lambda: N.tan_quantize(x, 4, theta=2.0)),
      ("scale", lambda: N.uniform_quantize(x, 4, scale=0.0)))


# --------------------------------------------------------------------------------- K09 LUT exp


@pytest.mark.parametrize("table_size,x_min,frac_bits", [
    (64, -12.0, None), pytest.param(256, -16.0, 12, marks=pytest.mark.slow)])
def test_lut_exp_error_within_its_bound(table_size, x_min, frac_bits):
  d = jnp.linspace(-20.0, 0.0, 4001)
  got = np.asarray(N.lut_exp(d, table_size, x_min=x_min, frac_bits=frac_bits), np.float64)
  want = np.exp(np.asarray(d, np.float64))
  step = -x_min / (table_size - 1)
  fixed = 0.0 if frac_bits is None else 2.0 ** (-frac_bits - 1)
  inside = np.asarray(d) >= x_min - step / 2
  bound = np.where(inside, want * math.expm1(step / 2) + fixed, math.exp(x_min - step / 2))
  err = np.abs(got - want)
  assert np.all(err <= bound * (1 + 1e-5) + 1e-7), float(np.max(err - bound))
  assert err.max() > 0.2 * bound.max()  # the bound is not loose by orders of magnitude
  assert np.all(np.diff(got) >= 0)  # monotone
  np.testing.assert_allclose(jax.grad(lambda t: N.lut_exp(t, table_size))(-1.0),
                             N.lut_exp(-1.0, table_size))
  assert np.isnan(float(N.lut_exp(jnp.nan, table_size)))  # no silent value for a NaN


def test_lut_softmax_bound_masks_and_errors():
  x = helpers.rows(9, (4, 40), 3.0)
  table_size, x_min = 32, -8.0
  xm, mask = _masked_rows()
  weights = jnp.arange(9.0)

  @jax.jit
  def run(x, xm):
    f = lambda x, where=None: N.lut_softmax(x, where=where, table_size=table_size, x_min=x_min)
    ym, dx = jax.value_and_grad(lambda x: jnp.sum(f(x, mask) * weights))(xm)
    return f(x), f(xm, mask), dx, f(x.at[0, 0].set(1e30).at[1].set(-jnp.inf))

  y, ym, dx, big = (np.asarray(a, np.float64) for a in run(x, xm))
  p = _softmax64(x)
  step = -x_min / (table_size - 1)
  rho, eps = math.expm1(step / 2), 39 * math.exp(x_min - step / 2)
  d = np.asarray(x) - np.asarray(x).max(-1, keepdims=True)
  inside = d >= x_min - step / 2
  ratio = y[inside] / p[inside]
  assert ratio.min() >= (1 - rho) / (1 + rho) - 1e-6
  assert ratio.max() <= (1 + rho) / ((1 - rho) * (1 - eps)) + 1e-6
  assert np.all(y[~inside] == 0) and np.any(~inside)
  np.testing.assert_allclose(y.sum(-1), 1.0, atol=1e-6)
  hidden = ~np.asarray(mask) | ~np.isfinite(np.asarray(xm))
  assert np.all(ym[hidden] == 0) and np.all(dx[hidden] == 0) and np.all(np.isfinite(dx))
  assert np.all(np.isfinite(big)) and big[0, 0] == 1.0
  helpers.check_raises(("table_size", lambda: N.lut_exp(x, 1)),
                       ("x_min", lambda: N.lut_softmax(x, x_min=0.0)),
                       ("frac_bits", lambda: N.lut_exp(x, frac_bits=0)))


# ---------------------------------------------------------------------- K09 binarisation [R]


def test_binarize_two_values_least_squares_and_adaptive_beats_fixed():
  x = helpers.rows(10, (16, 24), 2.5)  # long-tailed softmax rows
  where = jnp.ones(x.shape, bool).at[0].set(False).at[1, :3].set(False)

  @jax.jit
  def run(p):
    g = jax.grad(lambda p: jnp.sum(N.softmax_aware_binarize(p, where=where) ** 2))(p)
    return (N.softmax_aware_binarize(p), N.softmax_aware_binarize(p, threshold=1 / 24),
            N.softmax_aware_binarize(p, where=where), g)

  p = N.softmax(x)
  pn = np.asarray(p, np.float64)
  b, bf, bm, g = (np.asarray(a, np.float64) for a in run(p))
  for row in (*b, *bf):
    assert len(np.unique(row)) == 2 and row.min() == 0
  # for its kept set, alpha is the least-squares scale: the mean of the kept entries
  kept = bf > 0
  np.testing.assert_allclose(bf.max(-1), [pn[i][kept[i]].mean() for i in range(16)], rtol=1e-6)
  # adaptive = the best top-k over every k (brute force)
  srt = -np.sort(-pn, -1)
  brute = np.min([np.sum(srt ** 2, -1) - np.cumsum(srt, -1)[:, k - 1] ** 2 / k
                  for k in range(1, 25)], axis=0)
  np.testing.assert_allclose(np.sum((pn - b) ** 2, -1), brute, rtol=1e-4, atol=1e-9)
  err_a, err_f = np.sum((pn - b) ** 2), np.sum((pn - bf) ** 2)
  assert err_a < 0.9 * err_f, (err_a, err_f)
  # masks: exact zeros, fully masked row zeros, no NaN gradient
  assert not np.any(bm[0]) and not np.any(bm[1, :3]) and np.any(bm[1])
  assert np.all(np.isfinite(g))
