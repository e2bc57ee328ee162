"""Reverse mode keeps only the output (issue 37, defect 7).

``jax.nn.softmax`` keeps its output between the forward and the backward pass; jaxsoft's
softmax kept 5.5x its input (12 arrays under jit) and log_softmax 4.25x. Their derivatives
are now written in terms of the output (a ``custom_jvp``, as jax.nn does). The residuals are
counted as the bytes of the arrays ``jax.vjp`` of the jitted function holds for the backward
pass; every registered normalizer that declares ``residuals="output"`` is held to the same
bound, and the derivative rules are checked against float64 finite differences (order 2,
forward and reverse) and against the Jacobian written from the formula.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft as js

N = js.normalizers
OUTPUT_RESIDUALS = [n for n in N.names() if N.get(n).residuals == "output"]
# the output plus per-row statistics: 1.25x leaves a quarter of the input for them (a row
# flag is 1/n of the input's elements, one byte each)
BOUND = 1.25


def residual_bytes(f, *args):
  """Bytes of the arrays the VJP of ``jit(f)`` keeps between forward and backward (traced
  with ``eval_shape``: the VJP closure's leaves are the residuals)."""
  vjp = jax.eval_shape(lambda *a: jax.vjp(jax.jit(f), *a)[1], *args)
  return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(vjp))


def _x(shape=(64, 96), dtype=jnp.float32, seed=0):
  return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def test_residual_count_matches_jax_nn_for_the_reference():
  """The counting itself: jax.nn.softmax keeps its output (1x) and exp(x) keeps e^x."""
  x = _x()
  assert x.nbytes <= residual_bytes(jax.nn.softmax, x) <= BOUND * x.nbytes
  assert residual_bytes(lambda v: jnp.exp(v) * jnp.exp(2 * v), x) >= 2 * x.nbytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fn", [N.softmax, N.log_softmax], ids=["softmax", "log_softmax"])
def test_softmax_and_log_softmax_keep_only_their_output(fn, dtype):
  x = _x(dtype=dtype)
  where = jax.random.bernoulli(jax.random.key(1), 0.8, x.shape)
  t = jnp.full((64, 1), 0.7)
  cases = {
      "plain": (lambda v: fn(v), (x,)),
      "where": (lambda v: fn(v, where=where), (x,)),
      "tuple axis": (lambda v: fn(v.reshape(8, 8, 96), axis=(0, 2)), (x,)),
      "learned temperature": (lambda v, s: fn(v, where=where, temperature=s), (x, t)),
  }
  for case, (f, args) in cases.items():
    size = sum(a.nbytes for a in args)
    got = residual_bytes(f, *args)
    assert got <= BOUND * size, f"{fn.__name__} {case}: {got / size:.2f}x the input"


def test_float64_keeps_only_the_output():
  with jax.enable_x64(True):
    x = _x(dtype=jnp.float64)
    for fn in (N.softmax, N.log_softmax):
      assert residual_bytes(fn, x) <= BOUND * x.nbytes, fn.__name__


@pytest.mark.parametrize("name", OUTPUT_RESIDUALS)
def test_declared_output_residuals_hold(name):
  """Every normalizer declaring ``residuals="output"`` (softmax first) keeps <= 1.25x."""
  spec = N.get(name)
  x = _x()
  if spec.needs_key:
    f = lambda v: spec.fn(jax.random.key(0), v)  # noqa: E731
  else:
    f = spec.fn
  assert residual_bytes(f, x) <= BOUND * x.nbytes


def test_softmax_declares_output_residuals():
  assert "softmax" in OUTPUT_RESIDUALS


# the normalizers whose derivative is a function of their output (issue 37, defect 7):
# the threshold family (the support p > 0 and g = p^{2 - alpha} on it) and the pointwise
# maps sigmoid (y (1 - y)) and relu (y > 0)
FROM_OUTPUT = ["softmax", "sparsemax", "entmax15", "entmax", "sigmoid", "relu"]


def test_normalizers_written_from_their_output_declare_it():
  assert set(FROM_OUTPUT) <= set(OUTPUT_RESIDUALS)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name, kw", [
    ("sparsemax", {}), ("entmax15", {}), ("entmax", {"alpha": 1.3}), ("sigmoid", {}),
    ("relu", {}),
    pytest.param("entmax", {"alpha": 2.0}, marks=pytest.mark.slow),
    pytest.param("sigmoid", {"bias": -1.0}, marks=pytest.mark.slow)],
    ids=["sparsemax", "entmax15", "entmax-1.3", "sigmoid", "relu", "entmax-2", "sigmoid-bias"])
def test_written_from_output_keep_only_their_output(name, kw, dtype):
  """They kept 3.5x (threshold family) to 7.5x (pointwise) their input; now the output and
  a row flag, also with a mask and along another axis."""
  fn = N.get(name).fn
  x = _x(dtype=dtype)
  where = jax.random.bernoulli(jax.random.key(1), 0.8, x.shape)
  cases = {
      "plain": lambda v: fn(v, **kw),
      "where": lambda v: fn(v, where=where, **kw),
      "axis 0": lambda v: fn(v, axis=0, **kw),
  }
  for case, f in cases.items():
    got = residual_bytes(f, x)
    assert got <= BOUND * x.nbytes, f"{name} {case}: {got / x.nbytes:.2f}x the input"


def test_learned_hyperparameters_keep_only_the_output():
  x = _x()
  p = jnp.full((64, 1), 1.3)
  for f in (lambda v, a: N.entmax(v, alpha=a), lambda v, b: N.sigmoid(v, bias=b)):
    got = residual_bytes(f, x, p)
    assert got <= BOUND * (x.nbytes + p.nbytes)


def _entmax64(x, where, alpha):
  """Float64 numpy alpha-entmax over the last axis by bisection on tau (sparsemax at
  alpha = 2), 0 where masked and on empty rows."""
  z = np.where(where, (alpha - 1.0) * x, -np.inf)
  top = np.max(z, -1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  z = z - top
  lo, hi = np.full(top.shape, -1.0), np.zeros(top.shape)
  for _ in range(200):
    tau = (lo + hi) / 2
    mass = np.sum(np.maximum(z - tau, 0.0) ** (1.0 / (alpha - 1.0)), -1, keepdims=True)
    lo, hi = np.where(mass >= 1.0, tau, lo), np.where(mass >= 1.0, hi, tau)
  p = np.maximum(z - (lo + hi) / 2, 0.0) ** (1.0 / (alpha - 1.0))
  s = p.sum(-1, keepdims=True)
  return np.where(where, p / np.where(s > 0, s, 1.0), 0.0)


@pytest.mark.parametrize("alpha, fn", [
    (2.0, lambda v, w, a: N.sparsemax(v, where=w)),
    pytest.param(1.5, lambda v, w, a: N.entmax15(v, where=w), marks=pytest.mark.slow),
    (1.3, lambda v, w, a: N.entmax(v, where=w, alpha=a)),
    pytest.param(1.7, lambda v, w, a: N.entmax(v, where=w, alpha=1.7), marks=pytest.mark.slow)],
    ids=["sparsemax", "entmax15", "entmax-traced-alpha", "entmax-static-alpha"])
def test_threshold_gradients_against_the_formula(alpha, fn):
  """J = diag(g) - g g^T / sum g with g = p^{2 - alpha} on the support (the indicator for
  sparsemax), in numpy float64 from a bisection reference; reverse and forward mode, with
  masked entries, a fully masked row and a one-entry row (both get exactly 0)."""
  x, where = _rows64(seed=7, shape=(6, 9))
  p = _entmax64(x, where, alpha)
  g = np.where(p > 0, p, 0.0) ** (2.0 - alpha) * (p > 0)
  ct = np.random.default_rng(8).normal(size=x.shape)
  gx_ref = g * ct - g * (g * ct).sum(-1, keepdims=True) / np.maximum(g.sum(-1, keepdims=True),
                                                                     1e-300)
  w = jnp.asarray(where)
  with jax.enable_x64(True):
    xj, a = jnp.asarray(x), jnp.full((6, 1), alpha, jnp.float64)
    np.testing.assert_allclose(fn(xj, w, a), p, rtol=1e-9, atol=1e-12)
    gx = jax.jit(jax.grad(lambda v: jnp.sum(fn(v, w, a) * ct)))(xj)
    _, jx = jax.jit(lambda v, d: jax.jvp(lambda u: fn(u, w, a), (v,), (d,)))(xj, jnp.asarray(ct))
  np.testing.assert_allclose(gx, gx_ref, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(jx, gx_ref, rtol=1e-9, atol=1e-12)  # J is symmetric
  assert (np.asarray(gx)[~where] == 0).all() and (np.asarray(gx)[:2] == 0).all()


@pytest.mark.slow
def test_entmax_alpha_derivative_and_hessian_against_finite_differences():
  """The alpha term of the rule and the rule differentiated again (Hessian in x, in both
  modes), against float64 central differences of the forward pass."""
  x, where = _rows64(seed=9, shape=(4, 6))
  w = jnp.asarray(where)
  with jax.enable_x64(True):
    a = jnp.asarray(np.random.default_rng(2).uniform(1.2, 1.9, (4, 1)))

    @jax.jit
    def f(v, s):
      return N.entmax(v, where=w, alpha=s)

    check_grads(f, (jnp.asarray(x), a), order=2, modes=("fwd", "rev"), eps=1e-5)


# --- the derivative rules: exact, to second order, in both modes ---------------------------


def _rows64(seed=0, shape=(3, 4, 5)):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape) * 2
  where = rng.random(shape) > 0.25
  rows = where.reshape(-1, shape[-1])
  rows[0] = False  # a fully masked row
  rows[1] = False
  rows[1, 2] = True  # a row with one visible entry
  return x, where


@pytest.mark.parametrize("fn, axis", [
    pytest.param(N.softmax, (0, 2), id="softmax-tuple"),
    pytest.param(N.log_softmax, -1, id="log_softmax-last"),
    pytest.param(N.softmax, -1, id="softmax-last", marks=pytest.mark.slow),
    pytest.param(N.log_softmax, (0, 2), id="log_softmax-tuple", marks=pytest.mark.slow)])
def test_second_order_fwd_and_rev_against_finite_differences(fn, axis):
  with jax.enable_x64(True):
    x, where = _rows64()
    w = jnp.asarray(where)
    t_shape = (3, 4, 1) if axis == -1 else (1, 4, 1)
    t = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2.0, t_shape))

    @jax.jit
    def f(v, s):  # masked log-weights are -inf: compare the visible entries
      return jnp.where(w, fn(v, axis, w, temperature=s), 0.0)

    check_grads(f, (jnp.asarray(x), t), order=2, modes=("fwd", "rev"))


def _softmax_rows64(x, where, t):
  """Float64 numpy softmax over the last axis, 0 where masked and on empty rows."""
  z = np.where(where, x / t, -np.inf)
  m = np.max(np.where(where, z, -np.inf), -1, keepdims=True)
  e = np.where(where, np.exp(z - np.where(np.isfinite(m), m, 0.0)), 0.0)
  d = e.sum(-1, keepdims=True)
  return e / np.where(d > 0, d, 1.0)


@pytest.mark.parametrize("fn", [N.softmax, N.log_softmax], ids=["softmax", "log_softmax"])
def test_gradients_against_the_formula(fn):
  """d softmax = y (dz - <y, dz>), d log_softmax = dz - <y, dz>, dz = dx/T - (x/T) dT/T,
  written in numpy float64; masked entries and empty rows get exactly 0."""
  x, where = _rows64(seed=3, shape=(6, 7))
  where[2] = False
  t = np.random.default_rng(4).uniform(0.5, 2.0, (6, 1))
  ct = np.random.default_rng(5).normal(size=x.shape)
  y = _softmax_rows64(x, where, t)
  # the cotangent of z for the loss sum(ct * out) over visible entries
  if fn is N.softmax:
    gz = y * (ct - np.sum(y * ct, -1, keepdims=True))
  else:
    c = np.where(where, ct, 0.0)
    gz = np.where(where, c - y * c.sum(-1, keepdims=True), 0.0)
  gx_ref = gz / t
  gt_ref = -np.sum(gz * np.where(where, x, 0.0), -1, keepdims=True) / t**2
  w = jnp.asarray(where)
  loss = lambda v, s: jnp.sum(jnp.where(w, fn(v, -1, w, temperature=s), 0.0) * ct)  # noqa: E731
  with jax.enable_x64(True):
    gx, gt = jax.jit(jax.grad(loss, (0, 1)))(jnp.asarray(x), jnp.asarray(t))
  np.testing.assert_allclose(gx, gx_ref, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(gt, gt_ref, rtol=1e-12, atol=1e-14)
  assert (np.asarray(gx)[~where] == 0).all() and (np.asarray(gx)[2] == 0).all()


def test_nonfinite_rows_keep_their_rule_and_a_zero_gradient():
  """+inf rows share the mass among their +inf entries, NaN rows are NaN; both have a zero,
  finite gradient (x and temperature), in reverse and in forward mode."""
  inf, nan = np.inf, np.nan
  x = jnp.array([[1.0, inf, 0.0, -1.0], [inf, 2.0, inf, -inf], [1.0, nan, 0.0, 2.0],
                 [0.5, -1.0, 2.0, 0.0]])
  w = jnp.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 1]], bool)
  ct = jnp.array([0.3, -1.2, 0.7, 2.0])
  for fn, want in [(N.softmax, [[0, 1, 0, 0], [0.5, 0, 0.5, 0]]),
                   (N.log_softmax, [[-inf, 0, -inf, -inf], [-np.log(2), -inf, -np.log(2), -inf]])]:
    out = fn(x, where=w)
    np.testing.assert_allclose(out[:2], want, rtol=1e-6)
    assert np.isnan(out[2, :3]).all() and out[2, 3] == (0 if fn is N.softmax else -inf)

    def loss(v, s, fn=fn):
      o = fn(v, where=w, temperature=s)
      return jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * jnp.broadcast_to(ct, o.shape))

    gx, gt = jax.jit(jax.grad(loss, (0, 1)))(x, jnp.ones((4, 1)))
    assert (np.asarray(gx)[:3] == 0).all() and (np.asarray(gt)[:3] == 0).all(), fn.__name__
    assert np.isfinite(np.asarray(gx)).all() and np.isfinite(np.asarray(gt)).all()
    assert np.abs(np.asarray(gx)[3]).max() > 0  # the finite row still has its gradient
    _, jdx = jax.jit(lambda v, d, fn=fn: jax.jvp(lambda u: fn(u, where=w), (v,), (d,)))(
        x, jnp.ones_like(x))
    assert (np.asarray(jdx)[:3] == 0).all(), fn.__name__


def test_bfloat16_gradient_is_the_float32_gradient_rounded():
  """bf16 computes in float32: the gradient from the bf16 output stays within bf16's
  rounding (2^-8 relative per factor of y, three of them) of the float32 gradient."""
  x = _x(shape=(8, 33), seed=2).astype(jnp.bfloat16)
  ct = jax.random.normal(jax.random.key(3), x.shape)
  for fn in (N.softmax, N.log_softmax):
    g16 = jax.jit(jax.grad(lambda v, fn=fn: jnp.sum(fn(v).astype(jnp.float32) * ct)))(x)
    g32 = jax.jit(jax.grad(lambda v, fn=fn: jnp.sum(fn(v) * ct)))(x.astype(jnp.float32))
    assert g16.dtype == jnp.bfloat16
    scale = float(jnp.max(jnp.abs(g32)))
    np.testing.assert_allclose(np.asarray(g16, np.float32), g32, rtol=3 * 2.0**-8,
                               atol=3 * 2.0**-8 * scale, err_msg=fn.__name__)


def test_pointwise_gradients_against_the_formula():
  """sigmoid: dy = y (1 - y) (dx + db); relu: dy = dx where x > 0; numpy float64, both
  modes. Masked entries and a fully masked row get 0; a +inf entry takes its limit (1,
  +inf) with a zero gradient while its row's other entries keep theirs; a row with a
  visible NaN is NaN with a zero gradient."""
  x, where = _rows64(seed=11, shape=(6, 7))
  x[3, 1], x[4, 2] = np.inf, np.nan
  where[3, 1] = where[4, 2] = True  # both visible
  vis = where & ~np.isneginf(x)
  finite = vis & np.isfinite(x)
  finite[4] = False  # the NaN row
  b = np.random.default_rng(12).normal(size=(6, 1))
  ct = np.random.default_rng(13).normal(size=x.shape)
  s = 1.0 / (1.0 + np.exp(-np.where(finite, x, 0.0) - b))
  refs = {
      "sigmoid": (lambda v, w, bb: N.sigmoid(v, where=w, bias=bb),
                  np.where(finite, s * (1 - s) * ct, 0.0),
                  np.sum(np.where(finite, s * (1 - s) * ct, 0.0), -1, keepdims=True)),
      "relu": (lambda v, w, bb: N.relu(v, where=w),
               np.where(finite & (x > 0), ct, 0.0), None),
  }
  w = jnp.asarray(where)
  with jax.enable_x64(True):
    xj, bj, cj = jnp.asarray(x), jnp.asarray(b), jnp.asarray(ct)
    dx = jnp.where(jnp.isfinite(xj), cj, 0.0)
    for name, (fn, gx_ref, gb_ref) in refs.items():

      def loss(v, bb, fn=fn):
        out = fn(v, w, bb)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) * cj)

      gx, gb = jax.jit(jax.grad(loss, (0, 1)))(xj, bj)
      _, jx = jax.jit(lambda v, d, fn=fn: jax.jvp(lambda u: fn(u, w, bj), (v,), (d,)))(xj, dx)
      np.testing.assert_allclose(gx, gx_ref, rtol=1e-12, atol=1e-15, err_msg=name)
      np.testing.assert_allclose(jx, gx_ref, rtol=1e-12, atol=1e-15, err_msg=name)
      if gb_ref is not None:
        np.testing.assert_allclose(gb, gb_ref, rtol=1e-12, atol=1e-15, err_msg=name)
