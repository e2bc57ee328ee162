"""Normalizers at extreme scores against numpy float64 written from their formulas (issue 37).

Each case is a batch of float32 rows (with a masked entry here and there) where the old code
gave zeros, NaN or a wrong weight: scaled scores past ~1e9 under ``jit`` (XLA contracted
``c x - max(c x)`` into a fused multiply-add), squares past float32's range (|x| ~ 1.8e19)
and ``e^x - 1`` cancelling near 0. Values and VJPs are compared eagerly and under ``jit``;
the float64 VJPs are the formulas' own derivatives, written out.
"""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.normalizers as N
from jaxsoft import testing

MODES = [pytest.param(False, id="eager"), pytest.param(True, id="jit")]
F32 = np.float32


def _rows(rows):
  """(x, mask) float32 / bool arrays from rows of scores with None for a masked entry (its
  score 1e20: a masked entry must not move the result)."""
  x = np.array([[F32(1e20) if v is None else F32(v) for v in r] for r in rows], F32)
  mask = np.array([[v is not None for v in r] for r in rows])
  return x, mask


def _ratio_vjp(num, dnum, den, dden, mask, g):
  """``w = num / sum(den)`` over the visible entries and its VJP, float64, with the row's
  VJP scale (the size of its terms, to which float32's rounding is relative)."""
  num, dnum = np.where(mask, num, 0.0), np.where(mask, dnum, 0.0)
  den, dden = np.where(mask, den, 0.0), np.where(mask, dden, 0.0)
  total = den.sum(-1, keepdims=True)
  w = num / total
  vjp = (g * dnum - (g * w).sum(-1, keepdims=True) * dden) / total
  return w, vjp, _row_max((np.abs(dnum) + np.abs(dden)) / total) * np.abs(g).max()


def _softmax_vjp(z, dz, mask, g, null=None):
  """``softmax([z, null])[:n]`` and its VJP in x, for ``z = z(x)`` elementwise with
  derivative ``dz``, float64 (``null``: per-row logit whose weight is dropped), with the
  row's VJP scale as :func:`_ratio_vjp`."""
  top = np.max(np.where(mask, z, -np.inf), -1, keepdims=True)
  if null is not None:
    top = np.maximum(top, null)
  e = np.where(mask, np.exp(np.where(mask, z - top, 0.0)), 0.0)
  total = e.sum(-1, keepdims=True) + (0.0 if null is None else np.exp(null - top))
  w = e / total
  vjp = dz * w * (g - (g * w).sum(-1, keepdims=True))
  return w, vjp, 2.0 * _row_max(np.abs(dz * w)) * np.abs(g).max()


def _row_max(a):
  return np.max(a, -1, keepdims=True)


def _check(fn, x, mask, reference, jit, rtol=2e-6, vjp_rtol=2e-5):
  """fn's weights and VJP (cotangent ``_cotangent``) match float64, finite everywhere.

  ``reference`` is ``(weights, vjp, scale)``: the VJP is compared to its row's scale (its
  terms, before they cancel), and values below float32's smallest normal count as 0."""
  want, want_vjp, scale = reference
  g = _cotangent(x.shape)
  f = lambda x: fn(x, where=mask)
  if jit:
    f = jax.jit(f)
  w, vjp = jax.vjp(f, jnp.asarray(x))
  (dx,) = vjp(jnp.asarray(g, jnp.float32))
  w, dx = np.asarray(w, np.float64), np.asarray(dx, np.float64)
  assert np.all(np.isfinite(w)) and np.all(np.isfinite(dx))
  np.testing.assert_allclose(w, want, rtol=rtol, atol=1e-7)
  bound = vjp_rtol * scale + 1e-36
  assert np.all(np.abs(dx - want_vjp) <= bound), (dx, want_vjp, bound)
  assert np.all(dx[~mask] == 0) and np.all(w[~mask] == 0)


def _cotangent(shape):
  return np.random.default_rng(37).standard_normal(shape)


def _count(mask):
  return mask.sum(-1, keepdims=True).astype(np.float64)


# Scaled scores past 1e9 in one-hot rows, and past 1e7 with O(1) gaps (x = 2^40 + k 2^17,
# exact in float32, at a scale ~1e-5; x = 2^23 - k at a scale ~1-2): the fused
# multiply-add made the argmax's exponent a rounding error of c x instead of 0.
BIG = 2.0 ** 40
STEP = 2.0 ** 17
SCALED_ROWS = [[0.0, 1e20, -1e20, 3.0], [BIG, BIG - STEP, BIG - 2 * STEP, None],
               [2.0 ** 23, 2.0 ** 23 - 1, None, 2.0 ** 23 - 2], [-1e30, 5e29, 0.0, 1e30]]


def _scale_cases():
  """name -> (fn(x, where), scale(n) in float64, null logit(n) or None), n the visible
  count, for the normalizers that are softmax(c x) with a per-row c."""
  # ssmax: s log n + b; a tiny scale for the 2^40 row (s = 0: the bias alone).
  s_row = np.array([[1.0], [0.0], [1.0], [0.43]], F32)
  b_row = np.array([[0.0], [1e-5], [0.0], [0.0]], F32)
  ssmax = (lambda x, where: N.ssmax(x, where=where, s=s_row, bias=b_row),
           lambda n: s_row * np.log(n) + b_row.astype(np.float64), None)
  d_row = np.array([[1.0], [F32(1e-5 / math.log(2.0))], [1.0], [0.5]], F32)
  sdm = (lambda x, where: N.sdm(x, where=where, d=d_row),
         lambda n: d_row.astype(np.float64) * np.log(2.0), None)
  # SSA: tau_tok + 1 + sigmoid(alpha) log n; tau_tok = -1 + 1e-5 gives tau ~ 1e-5.
  tok = np.array([[0.0], [F32(-1.0 + 1e-5)], [0.5], [0.0]], F32)
  alpha = np.array([[0.0], [-80.0], [0.0], [1.0]], F32)
  ssa = (lambda x, where: N.ssa_softmax(x, where=where, alpha=alpha, token_temperature=tok),
         lambda n: tok.astype(np.float64) + 1.0 + np.log(n) / (1.0 + np.exp(-alpha.astype(
             np.float64))), None)
  # polar: t = 1 + softplus(alpha) log n >= 1, null nu = b + softplus(gamma) sqrt(log(n + 1)).
  softplus = lambda v: np.log1p(np.exp(v))
  polar = (lambda x, where: N.polar_softmax(x, where=where, null_bias=0.5),
           lambda n: 1.0 + softplus(0.0) * np.log(n),
           lambda n: 0.5 + softplus(0.0) * np.sqrt(np.log(n + 1.0)))
  return {"ssmax": ssmax, "sdm": sdm, "ssa_softmax": ssa, "polar_softmax": polar}


@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("name", ["ssmax", "sdm", "ssa_softmax", "polar_softmax"])
def test_scaled_softmax_exact_at_scaled_scores_past_1e9(name, jit):
  """softmax(c x) (c per row, with polar's null logit) where c x reaches 1e7 to 1e30, under
  jit too (it gave zeros or NaN there)."""
  fn, scale, null = _scale_cases()[name]
  x, mask = _rows(SCALED_ROWS)
  c = scale(_count(mask))
  x64 = x.astype(np.float64)
  nu = None if null is None else c * null(_count(mask))
  ref = _softmax_vjp(c * x64, c, mask, _cotangent(x.shape), nu)
  _check(fn, x, mask, ref, jit)


@pytest.mark.parametrize("jit", MODES)
def test_scale_gradients_at_scaled_scores_past_1e9(jit):
  """d/ds and d/db of ssmax against float64 (traced s and b: the path that also handles a
  negative scale), and every hyperparameter gradient of the scaled softmaxes finite."""
  x, mask = _rows(SCALED_ROWS)
  g = _cotangent(x.shape)
  n = _count(mask)
  rows = lambda *v: jnp.asarray(np.array(v, F32)[:, None])
  grad = lambda f, p: (jax.jit(jax.grad(f)) if jit else jax.grad(f))(p)
  loss = lambda fn: lambda p: jnp.sum(jnp.asarray(g, jnp.float32) * fn(jnp.asarray(x), p))
  s, b = rows(1.0, 0.0, 1.0, 0.43), rows(0.0, 1e-5, 0.0, 0.0)
  ds, db = grad(loss(lambda x, p: N.ssmax(x, where=mask, s=p[0], bias=p[1])), (s, b))
  c = np.asarray(s, np.float64) * np.log(n) + np.asarray(b, np.float64)
  x64 = np.where(mask, x.astype(np.float64), 0.0)
  w = _softmax_vjp(c * x64, c, mask, g)[0]
  terms = g * w * (x64 - (w * x64).sum(-1, keepdims=True))  # dL/dc = sum of these
  bound = 2e-5 * np.abs(terms).sum(-1, keepdims=True) + 1e-30
  assert np.all(np.abs(np.asarray(db, np.float64) - terms.sum(-1, keepdims=True)) <= bound)
  assert np.all(np.abs(np.asarray(ds, np.float64) - np.log(n) * terms.sum(-1, keepdims=True))
                <= np.log(n) * bound)
  others = [(lambda x, p: N.sdm(x, where=mask, q=p[0], d=p[1]), (rows(0, 1, 2, 3),
                                                                  rows(1, 1e-5, 1, 0.5))),
            (lambda x, p: N.ssa_softmax(x, where=mask, alpha=p[0], token_temperature=p[1]),
             (rows(0, -80, 0, 1), rows(0, -1 + 1e-5, 0.5, 0))),
            (lambda x, p: N.polar_softmax(x, where=mask, alpha=p[0], null_bias=p[1],
                                          gamma=p[2]),
             (rows(0, 1, -1, 0), rows(0.5, 0, 2, 0), rows(0, 1, 0, -1)))]
  for fn, params in others:
    for d in grad(loss(fn), params):
      assert np.all(np.isfinite(np.asarray(d)))


@pytest.mark.parametrize("jit", MODES)
def test_ssmax_negative_scale_exact_at_scaled_scores_past_1e9(jit):
  """A negative scale (bias < -s log n) pivots at the row min: still exact past 1e9 (beside
  a row of positive scale)."""
  x, mask = _rows([[0.0, 1e20, -1e20, 3.0], [-BIG, STEP - BIG, 2 * STEP - BIG, None],
                   [BIG, BIG - STEP, BIG - 2 * STEP, None]])
  bias = np.array([[-2.0], [-1e-5], [1e-5]], F32)
  c = bias.astype(np.float64)
  ref = _softmax_vjp(c * x.astype(np.float64), c, mask, _cotangent(x.shape))
  _check(lambda x, where: N.ssmax(x, where=where, s=0.0, bias=bias), x, mask, ref, jit)


@pytest.mark.parametrize("jit", MODES)
def test_multimax_defaults_equal_softmax_past_square_overflow(jit):
  """All t = 0 is softmax: no 0 * inf from the squared terms past |x| ~ 1.8e19."""
  x, mask = _rows([[3e19, 0.0, 1.0], [0.0, 1e20, None], [-3e19, 1.0, 0.5], [3e38, -3e38, 0.0]])
  x64 = x.astype(np.float64)
  ref = _softmax_vjp(x64, 1.0, mask, _cotangent(x.shape))
  _check(N.multimax, x, mask, ref, jit)
  # Zero slopes on the squares beside nonzero linear ones: softmax of the linear map (rows
  # whose modulated scores fit float32).
  x, mask, x64 = x[:3], mask[:3], x64[:3]
  t2, b2 = 0.5, 1.0
  z = x64 + t2 * np.maximum(x64 - b2, 0.0)
  ref = _softmax_vjp(z, 1.0 + t2 * (x64 > b2), mask, _cotangent(x.shape))
  _check(lambda x, where: N.multimax(x, where=where, t2=t2, b2=b2), x, mask, ref, jit)


@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("power,eps", [(1.0, 1e-12), (2.0, 1e-4), (1.0, 1e30)])
def test_idw_exact_past_square_overflow(power, eps, jit):
  """(d^2 + eps)^(-p/2) / sum where d^2 overflows float32 (|d| > 1.8e19), d = 0 included."""
  x, mask = _rows([[3e19, 1e19, 2e19, None], [3.4e38, 1.7e38, 3.4e37, 1e20],
                   [-3e19, 1.0, 0.0, 0.5], [1e-3, -2e20, None, 7.0]])
  d = x.astype(np.float64)
  log_sq = np.log(d * d + eps)
  ref = _softmax_vjp(-0.5 * power * log_sq, -power * d / (d * d + eps), mask,
                     _cotangent(x.shape))
  # The weights' float32 rounding is that of scores ~ -p log d ~ -90 p: a few ulps of 90.
  _check(lambda x, where: N.idw_softmax(x, where=where, power=power, eps=eps), x, mask, ref,
         jit, rtol=2e-5, vjp_rtol=1e-4)


@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("eps", [0.01, 0.5])
def test_spherical_exact_past_square_overflow(eps, jit):
  """(x^2 + eps) / sum where x^2 overflows float32, scores up to 3.4e38."""
  x, mask = _rows([[3e19, 1e19, -2e19, None], [3e19, 0.0, 1.0, -0.5],
                   [3.4e38, -1e38, 1e-3, 2e19], [1.0, -2.0, None, 0.0]])
  x64 = x.astype(np.float64)
  ref = _ratio_vjp(x64 ** 2 + eps, 2 * x64, x64 ** 2 + eps, 2 * x64, mask,
                   _cotangent(x.shape))
  _check(lambda x, where: N.spherical_softmax(x, where=where, eps=eps), x, mask, ref, jit)


@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("order", [2, 4])
def test_taylor_exact_past_polynomial_overflow(order, jit):
  """sum_k x^k / k! normalised where x^m / m! overflows float32 (any finite score)."""
  x, mask = _rows([[3e19, 1e19, -2e19, None], [3e19, 0.0, 1.0, -0.5],
                   [3.4e38, -1e38, 1e-3, 2e19], [1e10, -3e10, None, 0.0]])
  x64 = x.astype(np.float64)
  poly = lambda v, m: sum(v ** k / math.factorial(k) for k in range(m + 1))
  p, dp = poly(x64, order), poly(x64, order - 1)
  ref = _ratio_vjp(p, dp, p, dp, mask, _cotangent(x.shape))
  _check(lambda x, where: N.taylor_softmax(x, where=where, order=order), x, mask, ref, jit)


def _softpick64(x, mask, g):
  """ReLU(e^x - 1) / sum |e^x - 1| and its VJP, float64 (e^x - 1 as expm1: exact near 0)."""
  x = np.where(mask, x, 0.0)
  e1 = np.expm1(x)
  return _ratio_vjp(np.maximum(e1, 0.0), np.exp(x) * (x > 0), np.abs(e1),
                    np.sign(x) * np.exp(x), mask, g)


@pytest.mark.parametrize("jit", MODES)
def test_softpick_exact_near_zero_float32(jit):
  """e^x - 1 at logits ~1e-4 (and 1e-8, below float32's resolution of e^x) keeps its digits."""
  x, mask = _rows([[3e-4, 1e-4, -2e-4, None], [1e-8, 3e-8, -1e-8, 0.0],
                   [5.0, 1e-6, -1e-6, -3.0], [-1e-4, -2e-4, 0.0, None]])
  ref = _softpick64(x.astype(np.float64), mask, _cotangent(x.shape))
  _check(N.softpick, x, mask, ref, jit)


@pytest.mark.parametrize("jit", MODES)
def test_softpick_exact_near_zero_float64(jit):
  """Under x64: softpick([1e-30, -1e-30]) = [0.5, 0] (was [0, 0])."""
  with jax.enable_x64(True):
    x = jnp.asarray([[1e-30, -1e-30], [1e-300, 3e-300]], jnp.float64)
    f = jax.jit(N.softpick) if jit else N.softpick
    w = f(x)
    assert w.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(w), [[0.5, 0.0], [0.25, 0.75]], rtol=1e-15)


def _exact_ratio(q, rows):
  """``q(x) / sum q(x)`` per row in exact rational arithmetic (no overflow), as float64."""
  out = []
  for row in rows:
    vals = [q(Fraction(float(v))) for v in row]
    total = sum(vals)
    out.append([float(v / total) for v in vals])
  return np.array(out)


@pytest.mark.parametrize("jit", MODES)
def test_float64_exact_at_extreme_scores(jit):
  """Under x64 the same fixes hold at float64's extremes (squares overflow from 1.3e154)."""
  rows = [[3e300, 1e300, -2e300, 5.0], [1e200, -3e160, 0.0, 2e180]]
  eps = Fraction(0.01)
  taylor = lambda m: lambda v: sum(v ** k / math.factorial(k) for k in range(m + 1))
  cases = [(lambda x: N.spherical_softmax(x, eps=0.01), _exact_ratio(lambda v: v * v + eps, rows)),
           (N.taylor_softmax, _exact_ratio(taylor(2), rows)),
           (lambda x: N.taylor_softmax(x, order=4), _exact_ratio(taylor(4), rows)),
           (lambda x: N.idw_softmax(x, power=2.0, eps=0.01),
            _exact_ratio(lambda v: 1 / (v * v + eps), rows))]
  with jax.enable_x64(True):
    x = jnp.asarray(rows, jnp.float64)
    x64, visible, g = np.asarray(rows, np.float64), np.ones(x.shape, bool), _cotangent(x.shape)
    cases += [(N.multimax, _softmax_vjp(x64, 1.0, visible, g)[0]),
              (lambda x: N.ssmax(x, s=1.0), _softmax_vjp(math.log(4) * x64, 1.0, visible, g)[0])]
    for fn, want in cases:
      w = (jax.jit(fn) if jit else fn)(x)
      assert w.dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(w), want, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("name", ["softpick", "idw_softmax", "multimax"])
def test_tile_rule_exact_at_extreme_scores(name):
  """The blockwise rules (chunked / Pallas attention paths) share the fixes: softpick near
  0, idw and multimax past the squares' overflow (online over two key blocks)."""
  rows = {"softpick": [[3e-4, 1e-4, -2e-4, 0.0], [1e-8, 3e-8, -1e-8, 2.0]],
          "idw_softmax": [[3e19, 1e19, 2e19, 4e19], [3.4e38, 1.7e38, 3.4e37, 6.8e37]],
          "multimax": [[3e19, 0.0, 1.0, -3e19], [0.0, 1e20, 2.0, 1.0]]}[name]
  x, mask = _rows(rows)
  x64, g = x.astype(np.float64), _cotangent(x.shape)
  want = {"softpick": lambda: _softpick64(x64, mask, g),
          "idw_softmax": lambda: _softmax_vjp(-0.5 * np.log(x64 ** 2 + 1e-12), 0.0, mask, g),
          "multimax": lambda: _softmax_vjp(x64, 1.0, mask, g)}[name]()[0]
  got = testing.evaluate_tile_rule_online(N.get(name), jnp.asarray(x), jnp.eye(4), [1, 3])
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=1e-7)


def _moments64(x, mask):
  """(centred x, population std, n) of the visible entries, float64 (0 where masked)."""
  n = _count(mask)
  mean = np.where(mask, x, 0.0).sum(-1, keepdims=True) / n
  c = np.where(mask, x - mean, 0.0)
  return c, np.sqrt((c * c).sum(-1, keepdims=True) / n), n


def _nap64(x, mask, g, eps):
  """(x - mean) / sqrt(var + eps) and its VJP, float64: with r = (var + eps)^-1/2,
  ``dx_j = r (g_j - mean g) - r^3 c_j (g . c) / n``."""
  c, std, n = _moments64(x, mask)
  g = np.where(mask, g, 0.0)
  r = 1.0 / np.sqrt(std * std + eps)
  gc = (g * c).sum(-1, keepdims=True)
  vjp = np.where(mask, r * (g - g.sum(-1, keepdims=True) / n) - r ** 3 * c * gc / n, 0.0)
  scale = 2.0 * r * np.abs(g).max() + r ** 3 * _row_max(np.abs(c)) * np.abs(gc) / n
  return np.where(mask, c * r, 0.0), vjp, scale


def _standardized64(x, mask, g, eps):
  """softmax(z), z = (x - mean) / (std + eps), and its VJP, float64: with gz the softmax
  cotangent of z, ``dx_j = (gz_j - mean gz) / (std + eps) - (gz . c) c_j / ((std + eps)^2 n
  std)``."""
  c, std, n = _moments64(x, mask)
  d = std + eps
  w, gz, _ = _softmax_vjp(c / d, 1.0, mask, g)
  gzc = (gz * c).sum(-1, keepdims=True)
  vjp = np.where(mask, (gz - gz.sum(-1, keepdims=True) / n) / d - gzc * c / (d * d * n * std),
                 0.0)
  scale = 2.0 * _row_max(np.abs(gz)) / d + np.abs(gzc) * _row_max(np.abs(c)) / (d * d * n * std)
  return w, vjp, scale


# Rows whose squares overflow (|x| ~ 1e20 .. 1e30) or underflow (~1e-20) float32: the old
# variance gave zeros / uniform rows (overflow) or one-hot rows and NaN gradients (eps 1e-30).
BIG_ROWS = [[1e20, -3e20, 2e20, None], [3e19, 1e19, -2e19, 0.0], [1e30, -1e30, 0.0, 5e29],
            [1.0, 2.0, None, 0.5]]
TINY_ROWS = [[1e-20, -3e-20, 2e-20, None], [2e-19, 0.0, -1e-19, 5e-20],
             [3e-21, 1e-21, 2e-21, 0.0], [1.0, 2.0, None, 0.5]]


@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("rows,eps", [(BIG_ROWS, 1e-8), (TINY_ROWS, 1e-30)],
                         ids=["big", "tiny-eps1e-30"])
def test_nap_exact_past_variance_overflow_and_underflow(rows, eps, jit):
  x, mask = _rows(rows)
  ref = _nap64(x.astype(np.float64), mask, _cotangent(x.shape), eps)
  _check(lambda x, where: N.nap(x, where=where, eps=eps), x, mask, ref, jit)


@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("rows,eps", [(BIG_ROWS, 1e-7), (TINY_ROWS, 1e-30)],
                         ids=["big", "tiny-eps1e-30"])
def test_standardized_exact_past_variance_overflow_and_underflow(rows, eps, jit):
  x, mask = _rows(rows)
  ref = _standardized64(x.astype(np.float64), mask, _cotangent(x.shape), eps)
  _check(lambda x, where: N.standardized_softmax(x, where=where, eps=eps), x, mask, ref, jit)


@pytest.mark.parametrize("jit", MODES)
def test_spherical_finite_gradient_on_tiny_rows_at_eps_1e_30(jit):
  """A row sum of ~1e-30 (the square of which underflows in the quotient's derivative)."""
  x, mask = _rows([[1e-20, -2e-20, None, 0.0], [0.0, 0.0, 0.0, 0.0], [3e-16, 1e-15, 0.0, 2e-16],
                   [1.0, 2.0, None, 0.5]])
  x64 = x.astype(np.float64)
  eps = 1e-30
  ref = _ratio_vjp(x64 ** 2 + eps, 2 * x64, x64 ** 2 + eps, 2 * x64, mask, _cotangent(x.shape))
  _check(lambda x, where: N.spherical_softmax(x, where=where, eps=eps), x, mask, ref, jit)


def _sa_normalized64(x, mask, g):
  """(x - lo) / (hi - lo) softmax(x) and its VJP, float64 (rows without ties at the min or
  max), lo = min(x_min, 0), hi = max(x_max, 0): the min and max pass their derivative to
  their argument when they are not 0."""
  xm_hi, xm_lo = np.where(mask, x, -np.inf), np.where(mask, x, np.inf)
  hi = np.maximum(xm_hi.max(-1, keepdims=True), 0.0)
  lo = np.minimum(xm_lo.min(-1, keepdims=True), 0.0)
  d_hi = (xm_hi == xm_hi.max(-1, keepdims=True)) & (hi > 0)
  d_lo = (xm_lo == xm_lo.min(-1, keepdims=True)) & (lo < 0)
  r = hi - lo
  p, _, _ = _softmax_vjp(x, 1.0, mask, np.zeros_like(x))
  f = np.where(mask, (x - lo) / r, 0.0)
  g = np.where(mask, g, 0.0)
  gp = g * p
  vjp = gp / r  # the diagonal of df
  vjp = vjp - d_lo * (gp.sum(-1, keepdims=True) / r)
  vjp = vjp - (d_hi.astype(float) - d_lo) * (gp * f).sum(-1, keepdims=True) / r
  gf = g * f
  vjp = vjp + p * (gf - (gf * p).sum(-1, keepdims=True))
  scale = 3.0 * np.abs(g).max() * (1.0 / r + 1.0)
  return f * p, np.where(mask, vjp, 0.0), scale


@pytest.mark.parametrize("jit", MODES)
def test_sa_softmax_normalized_finite_gradient_on_tiny_rows(jit):
  """A row of size ~1e-20: the quotient's derivative squares hi - lo (~1e-40: 0 in float32,
  which gave NaN)."""
  x, mask = _rows([[1e-20, -3e-20, 2e-20, None], [2e-20, 5e-21, 1e-20, 0.5e-20],
                   [-1e-20, -3e-20, None, -2e-20], [1.0, 2.0, None, -0.5]])
  ref = _sa_normalized64(x.astype(np.float64), mask, _cotangent(x.shape))
  _check(N.sa_softmax_normalized, x, mask, ref, jit)
