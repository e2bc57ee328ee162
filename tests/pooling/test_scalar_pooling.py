"""N35 scalar pooling (soft_pool, ada_pool, log_mean_exp, linear_softmax_pool, gem,
power_mean_pool) against numpy float64 oracles written from the formulas, plus limits,
masking, gradients, dtypes and bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxsoft import pooling

RNG = np.random.default_rng(0)
X = (2.0 * RNG.standard_normal((4, 7))).astype(np.float32)
MASK = RNG.random((4, 7)) < 0.7
MASK[0] = True
MASK[1, :] = False
MASK[1, 3] = True  # a pool with one visible entry
Y = RNG.random((4, 7)).astype(np.float32)  # probabilities for linear_softmax_pool

_SCALAR = ("soft_pool", "ada_pool", "log_mean_exp", "linear_softmax_pool", "gem",
           "power_mean_pool")


class _Jitted:
  """The pooling functions jitted (one compile per test instead of one per eager op);
  hyperparameters are traced, so new values do not recompile."""

  def __init__(self):
    for name in _SCALAR:
      setattr(self, name, jax.jit(getattr(pooling, name), static_argnames=("axis", "keepdims")))


P = _Jitted()


# ------------------------------------------------------------------ float64 oracles (1-D)


def _softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def o_soft_pool(x, temperature=1.0):
  return float(np.sum(_softmax(x / temperature) * x))


def o_ada_pool(x, beta=0.5):
  mean = x.mean()
  den = mean ** 2 + x ** 2
  dsc = np.where(den > 0, 2 * mean * x / np.where(den > 0, den, 1), 1.0)
  b = min(max(beta, 0.0), 1.0)
  return float(b * np.sum(_softmax(dsc) * x) + (1 - b) * np.sum(_softmax(x) * x))


def o_log_mean_exp(x, tau=1.0):
  m = x.max()
  return float(m + tau * np.log(np.mean(np.exp((x - m) / tau))))


def o_linear_softmax(y):
  s = y.sum()
  return float((y ** 2).sum() / s) if s != 0 else 0.0


def o_gem(x, p=3.0, eps=1e-6):
  return float(np.mean(np.maximum(x, eps) ** p) ** (1.0 / p))


def o_power_mean(x, p=2.0, eps=1e-6, w=None):
  w = np.ones_like(x) if w is None else w
  a = w / w.sum()
  m = x.min()
  return float(np.sum(a * (x - m + eps) ** p) ** (1.0 / p) + m - eps)


def oracle_rows(o, x, mask, **hp):
  """``o`` applied to each row's visible entries (0 for a row with none), float64."""
  x = np.asarray(x, np.float64)
  out = []
  for row, m in zip(x, np.asarray(mask), strict=True):
    out.append(o(row[m], **hp) if m.any() else 0.0)
  return np.array(out)


# name -> (function, oracle, hyperparameters, input)
CASES = {
    "soft_pool": (P.soft_pool, o_soft_pool, {"temperature": 0.7}, X),
    "ada_pool": (P.ada_pool, o_ada_pool, {"beta": 0.3}, X),
    "log_mean_exp": (P.log_mean_exp, o_log_mean_exp, {"tau": 0.8}, X),
    "linear_softmax_pool": (P.linear_softmax_pool, o_linear_softmax, {}, Y),
    "gem": (P.gem, o_gem, {"p": 2.5}, np.abs(X) + 0.1),
    "power_mean_pool": (P.power_mean_pool, o_power_mean, {"p": 3.0}, X),
}
NAMES = list(CASES)


def subset(*default):
  """All NAMES as params: ``default`` always runs, the others only with ``-m slow``."""
  return [pytest.param(n, marks=() if n in default else pytest.mark.slow) for n in NAMES]


@pytest.mark.parametrize("name", NAMES)
def test_matches_float64_oracle_with_and_without_mask(name):
  fn, o, hp, x = CASES[name]
  for mask in (np.ones_like(MASK), MASK):
    out = fn(jnp.asarray(x), where=jnp.asarray(mask), **hp)
    assert out.shape == (4,) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, oracle_rows(o, x, mask, **hp), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", subset("soft_pool", "gem"))
def test_axis_and_keepdims(name):
  fn, o, hp, x = CASES[name]
  out = fn(jnp.asarray(x), axis=0, keepdims=True, **hp)
  assert out.shape == (1, 7)
  np.testing.assert_allclose(out[0], oracle_rows(o, x.T, np.ones((7, 4), bool), **hp),
                             rtol=2e-5, atol=2e-5)
  x3 = np.stack([x, x[::-1]], axis=1)  # [4, 2, 7]; pool the middle axis
  out3 = fn(jnp.asarray(x3), axis=1, **hp)
  assert out3.shape == (4, 7)


@pytest.mark.parametrize("name", NAMES)
def test_masking_a_column_is_deleting_it_value_and_gradient(name):
  fn, _, hp, x = CASES[name]
  keep = np.ones(7, bool)
  keep[[2, 5]] = False
  xj = jnp.asarray(x)
  vg_masked = jax.jit(jax.value_and_grad(
      lambda v: jnp.sum(fn(v, where=jnp.asarray(keep), **hp) * jnp.arange(1.0, 5.0))))
  vg_deleted = jax.jit(jax.value_and_grad(
      lambda v: jnp.sum(fn(v[:, keep], **hp) * jnp.arange(1.0, 5.0))))
  val, g = vg_masked(xj)
  val_d, g_d = vg_deleted(xj)
  chex.assert_trees_all_close(val, val_d, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(g[:, ~keep], 0.0)
  chex.assert_trees_all_close(g[:, keep], g_d[:, keep], rtol=1e-5, atol=1e-6)
  # A masked entry may hold anything, NaN and inf included.
  val_bad, g_bad = vg_masked(xj.at[:, 2].set(jnp.nan).at[:, 5].set(jnp.inf))
  chex.assert_trees_all_close(val_bad, val, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(g_bad, g, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_pool_is_zero_with_zero_gradient(name):
  fn, _, hp, x = CASES[name]
  where = jnp.asarray(MASK).at[2].set(False)
  f = jax.jit(jax.value_and_grad(lambda v, m: jnp.sum(fn(v, where=m, **hp) * jnp.arange(1.0, 5.0))))
  _, g = f(jnp.asarray(x), where)
  assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(g[2], 0.0)
  assert fn(jnp.asarray(x), where=where, **hp)[2] == 0.0
  val, g = f(jnp.asarray(x), jnp.zeros((4, 7), bool))
  assert val == 0.0
  np.testing.assert_array_equal(g, 0.0)


HPARAM = {"soft_pool": "temperature", "ada_pool": "beta", "log_mean_exp": "tau", "gem": "p",
          "power_mean_pool": "p"}


@pytest.mark.parametrize("name", NAMES)
def test_gradient_matches_finite_differences_in_float64(name):
  """d/dx and d/d(hyperparameter) in one check (one compiled program pair per function)."""
  fn, _, hp, x = CASES[name]
  key = HPARAM.get(name)
  with jax.enable_x64(True):
    x64 = jnp.asarray(x[:2, :5], jnp.float64)
    where = jnp.asarray(MASK[:2, :5]).at[0, 0].set(True)
    if key is None:
      check_grads(lambda v: fn(v, where=where, **hp), (x64,), order=1, modes=("rev",),
                  atol=1e-6, rtol=1e-6)
    else:
      check_grads(lambda v, h: fn(v, where=where, **{**hp, key: h}), (x64, jnp.float64(hp[key])),
                  order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
    assert fn(x64, **hp).dtype == jnp.float64


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("gem", "soft_pool") else
                                               pytest.mark.slow) for n in HPARAM])
def test_hyperparameter_per_pool(name):
  fn, o, hp, x = CASES[name]
  key = HPARAM[name]
  per_row = np.array([[hp[key]], [0.9 * hp[key]], [0.5 * hp[key]]])
  out = fn(jnp.asarray(x[:3]), **{**hp, key: jnp.asarray(per_row, jnp.float32)})
  want = [o(x[i].astype(np.float64), **{**hp, key: per_row[i, 0]}) for i in range(3)]
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", subset("log_mean_exp", "power_mean_pool", "ada_pool"))
def test_bf16_in_bf16_out_close_to_float32(name):
  fn, _, hp, x = CASES[name]
  xb = jnp.asarray(x, jnp.bfloat16)
  out = fn(xb, where=jnp.asarray(MASK), **hp)
  assert out.dtype == jnp.bfloat16
  want = fn(xb.astype(jnp.float32), where=jnp.asarray(MASK), **hp)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", subset("soft_pool", "linear_softmax_pool"))
def test_jit_vmap_and_int_input(name):
  fn, _, hp, x = CASES[name]
  xj, mj = jnp.asarray(x), jnp.asarray(MASK)
  jitted = fn(xj, where=mj, **hp)  # fn is jitted
  vmapped = jax.jit(jax.vmap(lambda v, m: fn(v, where=m, **hp)))(xj, mj)
  chex.assert_trees_all_close(vmapped, jitted, rtol=1e-6, atol=1e-6)
  xi = jnp.asarray([[3, 1, 2], [0, 1, 1]], jnp.int32)
  out = fn(xi, **hp)
  assert out.dtype == jnp.float32
  chex.assert_trees_all_close(out, fn(xi.astype(jnp.float32), **hp))


@pytest.mark.parametrize("name", subset("gem", "power_mean_pool", "ada_pool"))
def test_empty_pooled_axis_returns_zeros(name):
  fn, _, hp, _ = CASES[name]
  out = fn(jnp.zeros((3, 0)), **hp)
  assert out.shape == (3,) and out.dtype == jnp.float32
  np.testing.assert_array_equal(out, 0.0)
  assert fn(jnp.zeros((3, 0)), keepdims=True, **hp).shape == (3, 1)
  assert fn(jnp.zeros((0, 4)), **hp).shape == (0,)


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_raises(name):
  fn, _, hp, x = CASES[name]
  fn = getattr(pooling, name)
  with pytest.raises(ValueError, match="axis"):
    fn(jnp.asarray(x), axis=2, **hp)
  with pytest.raises(ValueError, match="where"):
    fn(jnp.asarray(x), where=jnp.ones((3, 7), bool), **hp)
  with pytest.raises(ValueError, match="keepdims"):
    fn(jnp.asarray(x), keepdims="yes", **hp)


@pytest.mark.parametrize("fn,key,bad", [
    (pooling.soft_pool, "temperature", 0.0), (pooling.soft_pool, "temperature", -1.0),
    (pooling.log_mean_exp, "tau", 0.0), (pooling.log_mean_exp, "tau", float("nan")),
    (pooling.gem, "p", 0.0), (pooling.gem, "p", -2.0), (pooling.gem, "eps", 0.0),
    (pooling.power_mean_pool, "p", -1.0), (pooling.power_mean_pool, "eps", 0.0),
    (pooling.power_mean_pool, "weights", np.array([1.0, -1.0, 1.0])),
    (pooling.ada_pool, "beta", float("nan")),
    (pooling.gem, "p", np.array([[1.0], [0.0], [2.0]])),
])
def test_bad_hyperparameter_raises_naming_it(fn, key, bad):
  with pytest.raises(ValueError, match=f"`{key}`"):
    fn(jnp.ones((3, 3)), **{key: bad})


def test_row_param_with_size_along_the_axis_raises():
  with pytest.raises(ValueError, match="`p`"):
    pooling.gem(jnp.ones((3, 4)), p=jnp.ones((3, 4)))


# ------------------------------------------------------------------ limits and special values


def test_soft_pool_properties():
  x = X
  out = P.soft_pool(x)
  assert np.all(out >= x.mean(-1) - 1e-6) and np.all(out <= x.max(-1) + 1e-6)
  np.testing.assert_allclose(P.soft_pool(np.full((2, 5), -2.5, np.float32)), -2.5, rtol=1e-6)
  chex.assert_trees_all_close(P.soft_pool(x + 3.0), out + 3.0, atol=1e-5)
  np.testing.assert_allclose(P.soft_pool(x, temperature=1e-3), x.max(-1), atol=1e-4)
  np.testing.assert_allclose(P.soft_pool(x, temperature=1e5), x.mean(-1), atol=1e-4)
  # d out / d x_i = w_i (1 + (x_i - out) / T)
  t = 0.7
  g = jax.grad(lambda v: P.soft_pool(v, temperature=t))(x[0])
  w = _softmax(x[0] / t)
  o = P.soft_pool(x[0], temperature=t)
  chex.assert_trees_all_close(g, w * (1 + (x[0] - o) / t), atol=1e-6)


def test_ada_pool_limits_and_clamp():
  x = X
  chex.assert_trees_all_close(P.ada_pool(x, beta=0.0), P.soft_pool(x), atol=1e-6)
  edscw = oracle_rows(o_ada_pool, X, np.ones_like(MASK), beta=1.0)
  np.testing.assert_allclose(P.ada_pool(x, beta=1.0), edscw, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(P.ada_pool(x, beta=3.0), P.ada_pool(x, beta=1.0))
  chex.assert_trees_all_close(P.ada_pool(x, beta=-1.0), P.ada_pool(x, beta=0.0))
  out = P.ada_pool(x, beta=0.4)
  assert np.all(out >= x.min(-1) - 1e-6) and np.all(out <= x.max(-1) + 1e-6)
  # DSC's 0/0 point (mean 0 and an entry 0) is finite, with finite gradients.
  z = np.zeros(3, np.float32)
  assert P.ada_pool(z) == 0.0
  assert np.all(np.isfinite(jax.grad(lambda v: P.ada_pool(v, beta=0.5))(z)))
  # linear in beta inside [0, 1]
  g = jax.grad(lambda b: P.ada_pool(x[0], beta=b))(0.5)
  np.testing.assert_allclose(g, P.ada_pool(x[0], beta=1.0) - P.ada_pool(x[0], beta=0.0),
                             rtol=1e-5)


def test_log_mean_exp_limits_bounds_and_gradient():
  x = X
  n = x.shape[-1]
  out = P.log_mean_exp(x, tau=0.5)
  assert np.all(out >= x.mean(-1) - 1e-6) and np.all(out <= x.max(-1) + 1e-6)
  assert np.all(out >= x.max(-1) - 0.5 * np.log(n) - 1e-5)
  np.testing.assert_allclose(P.log_mean_exp(x, tau=1e-3), x.max(-1), atol=1e-2)
  # The stable form keeps the mean at a large temperature (the naive one loses it).
  np.testing.assert_allclose(P.log_mean_exp(x, tau=1e6), x.mean(-1), atol=2e-5)
  np.testing.assert_allclose(P.log_mean_exp(1e4 + x, tau=1.0), 1e4 + P.log_mean_exp(x),
                             rtol=1e-6)
  g = jax.grad(lambda v: P.log_mean_exp(v, tau=0.5))(x[0])
  chex.assert_trees_all_close(g, _softmax(x[0] / 0.5), atol=1e-6)


def test_linear_softmax_bounds_and_gradient_sign_rule():
  y = Y
  out = P.linear_softmax_pool(y)
  assert np.all(out >= y.mean(-1) - 1e-6) and np.all(out <= y.max(-1) + 1e-6)
  np.testing.assert_allclose(P.linear_softmax_pool(np.full((2, 4), 0.3, np.float32)), 0.3, rtol=1e-6)
  g = jax.grad(P.linear_softmax_pool)(y[0])
  chex.assert_trees_all_close(g, (2 * y[0] - out[0]) / y[0].sum(), atol=1e-6)
  np.testing.assert_array_equal(g > 0, y[0] > out[0] / 2)
  zeros = np.zeros(4, np.float32)
  assert P.linear_softmax_pool(zeros) == 0.0
  assert np.all(np.isfinite(jax.grad(P.linear_softmax_pool)(zeros)))


def test_gem_limits_and_properties():
  x = X  # negatives are clamped at eps
  clamped = np.maximum(x, 1e-6)
  np.testing.assert_allclose(P.gem(x, p=1.0), clamped.mean(-1), rtol=1e-5, atol=1e-6)
  pos = np.abs(x) + 0.1
  np.testing.assert_allclose(P.gem(pos, p=200.0), pos.max(-1), rtol=2e-2)
  geo = np.exp(np.log(pos).mean(-1))
  np.testing.assert_allclose(P.gem(pos, p=1e-4), geo, rtol=1e-3)
  ps = [0.5, 1.0, 2.0, 3.0, 8.0]
  vals = np.stack([P.gem(pos, p=p) for p in ps])
  assert np.all(np.diff(vals, axis=0) >= -1e-6)  # non-decreasing in p
  chex.assert_trees_all_close(P.gem(2.5 * pos), 2.5 * P.gem(pos), rtol=1e-5)
  g = jax.grad(lambda v: P.gem(v))(x[0])
  np.testing.assert_array_equal(g[x[0] < 1e-6], 0.0)
  # no overflow at a large p on large inputs
  big = np.array([1e3, 2e3, 5e2], np.float32)
  np.testing.assert_allclose(P.gem(big, p=100.0), 2e3 * (1 / 3) ** 0.01, rtol=1e-5)


def test_power_mean_limits_and_properties():
  x = X
  np.testing.assert_allclose(P.power_mean_pool(x, p=1.0), x.mean(-1), atol=2e-6)
  np.testing.assert_allclose(P.power_mean_pool(x, p=300.0), x.max(-1), atol=0.05)
  chex.assert_trees_all_close(P.power_mean_pool(x + 5.0), P.power_mean_pool(x) + 5.0,
                              atol=1e-5)
  out = P.power_mean_pool(x)
  assert np.all(out >= x.mean(-1) - 1e-6) and np.all(out <= x.max(-1) + 1e-6)
  # weights: normalised over the visible entries; p = 1 is the weighted mean
  w = RNG.random((4, 7)).astype(np.float32)
  np.testing.assert_allclose(P.power_mean_pool(x, p=1.0, weights=w),
                             (w * x).sum(-1) / w.sum(-1), atol=2e-6)
  want = oracle_rows(lambda r, **_: 0.0, X, MASK)  # shape only
  for i in range(4):
    m = MASK[i]
    want[i] = o_power_mean(X[i][m].astype(np.float64), 2.0, 1e-6, np.asarray(w[i])[m]) if m.any() else 0
  np.testing.assert_allclose(P.power_mean_pool(x, where=MASK, weights=w), want,
                             rtol=2e-5, atol=2e-5)
  # large p with weights approaches the max over the entries of positive weight
  w0 = np.ones(7, np.float32)
  w0[np.argmax(x[0])] = 0.0
  second = np.sort(x[0])[-2]
  np.testing.assert_allclose(P.power_mean_pool(x[0], p=500.0, weights=w0), second, atol=0.05)
  assert P.power_mean_pool(x[0], weights=np.zeros(7, np.float32)) == 0.0
  with jax.enable_x64(True):
    x64 = jnp.asarray(X[:2, :5], jnp.float64)
    w64 = jnp.asarray(RNG.random((2, 5)) + 0.1)
    check_grads(lambda v, ww: P.power_mean_pool(v, p=2.5, weights=ww), (x64, w64), order=1,
                modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape,axis", [((3, 5, 9), -1), ((3, 5, 9), 0), ((2, 1, 33), 2)])
def test_oracle_matrix(name, shape, axis):
  fn, o, hp, _ = CASES[name]
  rng = np.random.default_rng(hash((name, shape, axis)) % 2**32)
  x = rng.random(shape) if name == "linear_softmax_pool" else 3.0 * rng.standard_normal(shape)
  if name == "gem":
    x = np.abs(x) + 0.05
  x = x.astype(np.float32)
  mask = rng.random(shape) < 0.6
  out = fn(jnp.asarray(x), axis=axis, where=jnp.asarray(mask), **hp)
  xm, mm = np.moveaxis(x, axis, -1), np.moveaxis(mask, axis, -1)
  want = oracle_rows(o, xm.reshape(-1, xm.shape[-1]), mm.reshape(-1, mm.shape[-1]), **hp)
  np.testing.assert_allclose(out.reshape(-1), want, rtol=5e-5, atol=5e-5)
