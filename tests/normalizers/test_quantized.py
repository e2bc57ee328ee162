"""K09: the quantised softmax, its quantisers and bias correction, the LUT exp and softmax-aware
binarisation against float64 numpy softmax and closed forms."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers.reference import masked_rows, softmax64

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
  q, g = jax.jit(lambda x: (f(x), jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(10.0)[None]))(x)))(x)
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
  xm, mask = masked_rows()
  weights = jnp.arange(9.0)

  @jax.jit
  def run(x, xm):
    f = lambda x, where=None: N.lut_softmax(x, where=where, table_size=table_size, x_min=x_min)
    ym, dx = jax.value_and_grad(lambda x: jnp.sum(f(x, mask) * weights[None]))(xm)
    return f(x), f(xm, mask), dx, f(x.at[0, 0].set(1e30).at[1].set(-jnp.inf))

  y, ym, dx, big = (np.asarray(a, np.float64) for a in run(x, xm))
  p = softmax64(x)
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


def test_binarize_needs_no_implicit_rank_promotion():
  """The adaptive threshold's candidate counts ``k`` get every axis of the scores explicitly:
  they were ``[n]`` against ``[..., rows, 1]`` (implicit rank promotion, a ValueError under
  jax.numpy_rank_promotion("raise")). Traced only (eval_shape): nothing is compiled."""
  p = jax.ShapeDtypeStruct((3, 16, 24), jnp.float32)
  for axis in (-1, 1):
    with jax.numpy_rank_promotion("raise"):
      out = jax.eval_shape(lambda q, a=axis: N.softmax_aware_binarize(q, axis=a), p)
    assert out.shape == p.shape
