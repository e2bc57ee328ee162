"""N37 congestion_softmax: the fixed point, its optimality condition, its implicit gradient
against finite differences and against differentiating the unrolled iteration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.normalizers import _congestion as C
from tests import helpers

f = C.congestion_softmax


def _rows(seed=0, shape=(4, 7), scale=1.5):
  x = np.asarray(helpers.rows(seed, shape, scale), np.float64)
  mask = np.ones(shape, bool)
  mask[1, [0, 3]] = False
  if shape[0] > 2:
    mask[2] = False
  return x, mask


@pytest.mark.parametrize("gamma,t", [(0.5, 1.0), (3.0, 0.7), (100.0, 1.0)])
def test_kkt_condition_of_the_concave_objective(gamma, t):
  """The maximiser of <p,q> - gamma/2 |p|^2 + T H(p) has T log p_i + gamma p_i - q_i equal on
  every visible entry (the simplex multiplier): checked without the iteration."""
  x, mask = _rows()
  with jax.enable_x64(True):
    # jitted: one program instead of op-by-op eager dispatch
    p = np.asarray(jax.jit(lambda v: f(v, where=jnp.asarray(mask), gamma=gamma,
                                       temperature=t))(jnp.asarray(x)))
  for i in range(x.shape[0]):
    vis = mask[i]
    if not vis.any():
      assert np.all(p[i] == 0)
      continue
    np.testing.assert_allclose(p[i, vis].sum(), 1.0, atol=1e-13)
    nu = t * np.log(p[i, vis]) + gamma * p[i, vis] - x[i, vis]
    np.testing.assert_allclose(nu, nu.mean(), atol=1e-10)
    assert np.all(p[i, ~vis] == 0)


def test_gamma_zero_is_softmax_and_gamma_spreads_the_load():
  x, _ = _rows(1, (3, 9))
  xj = jnp.asarray(x, jnp.float32)
  np.testing.assert_allclose(f(xj, gamma=0.0, temperature=0.5), jax.nn.softmax(xj / 0.5),
                             rtol=1e-6, atol=1e-7)
  peaks, ents = [], []
  for gamma in (0.0, 1.0, 4.0, 16.0):
    p = np.asarray(f(xj, gamma=gamma), np.float64)
    peaks.append(p.max(-1))
    ents.append(-(p * np.log(p)).sum(-1))
  assert np.all(np.diff(np.stack(peaks), axis=0) < 0)
  assert np.all(np.diff(np.stack(ents), axis=0) > 0)


def _unrolled(x, gamma, t, steps=80):
  """The damped iteration written with jax.nn.softmax, differentiated through its steps (a
  fixed-length loop, reverse mode through every iteration)."""
  eta = 4 * t / (4 * t + gamma)

  def step(_, p):
    return (1 - eta) * p + eta * jax.nn.softmax((x - gamma * p) / t)

  return jax.lax.fori_loop(0, steps, step, jax.nn.softmax(x / t))


def test_implicit_gradient_matches_finite_differences_and_unrolling():
  x = np.asarray(helpers.rows(2, (2, 6), 1.5), np.float64)
  ct = np.random.default_rng(3).normal(size=x.shape)
  gamma, t = 3.0, 0.7
  with jax.enable_x64(True):
    xj = jnp.asarray(x)

    @jax.jit
    def loss(v, g, tt):
      return jnp.sum(f(v, gamma=g, temperature=tt) * ct)

    gx, gg, gt = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xj, gamma, t)
    h = 1e-6
    fd_x = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
      e = np.zeros_like(x)
      e[idx] = h
      fd_x[idx] = (loss(xj + e, gamma, t) - loss(xj - e, gamma, t)) / (2 * h)
    np.testing.assert_allclose(gx, fd_x, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gg, (loss(xj, gamma + h, t) - loss(xj, gamma - h, t)) / (2 * h),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gt, (loss(xj, gamma, t + h) - loss(xj, gamma, t - h)) / (2 * h),
                               rtol=1e-6, atol=1e-8)
    unrolled = jax.jit(jax.grad(lambda v, g, tt: jnp.sum(_unrolled(v, g, tt) * ct),
                                argnums=(0, 1, 2)))(xj, gamma, t)
    for got, want in zip((gx, gg, gt), unrolled, strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    # forward mode (the custom JVP itself) agrees with reverse mode: <ct, J dx> = <grad, dx>
    dx = np.random.default_rng(4).normal(size=x.shape)
    _, tangent = jax.jit(lambda v, d: jax.jvp(loss, (v, gamma, t), (d, 0.0, 0.0)))(xj, dx)
    np.testing.assert_allclose(tangent, np.sum(np.asarray(gx) * dx), rtol=1e-10)


def test_masking_is_deleting_with_per_row_gamma():
  x, mask = _rows(4, (3, 8))
  xj = jnp.asarray(x, jnp.float32)
  gam = jnp.array([[0.5], [8.0], [1.0]])
  # jitted (gamma bound as a constant): one program per call instead of op by op
  got = np.asarray(jax.jit(lambda v: f(v, where=jnp.asarray(mask), gamma=gam))(xj))
  for i in range(3):
    if mask[i].any():
      want = jax.jit(lambda v, g=float(gam[i, 0]): f(v, gamma=g))(xj[i, mask[i]])
      np.testing.assert_allclose(got[i, mask[i]], want, rtol=1e-5, atol=1e-6)
    assert np.all(got[i, ~mask[i]] == 0)


def test_bfloat16_and_bad_input():
  x, mask = _rows(5)
  xb = jnp.asarray(x, jnp.bfloat16)
  got = f(xb, where=jnp.asarray(mask), gamma=2.0)
  assert got.dtype == jnp.bfloat16
  want = f(xb.astype(jnp.float32), where=jnp.asarray(mask), gamma=2.0)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=1e-2)
  helpers.check_raises(("gamma", lambda: f(xb, gamma=-1.0)),
                       ("temperature", lambda: f(xb, temperature=0.0)))


def _equilibrium_f64(q, gamma, t):
  """numpy float64 reference from the optimality condition alone: T log p_i + gamma p_i - q_i
  = -lambda on every entry with sum p = 1, by nested bisection (p_i in log space for a given
  lambda, then lambda), 120 halvings each (below float64 resolution)."""
  q = np.asarray(q, np.float64)

  def p_of(lam):
    u = (q - lam) / t
    lo, hi = np.full_like(u, -800.0), np.minimum(u, 50.0)  # the root l of l + c e^l = u
    for _ in range(120):
      mid = 0.5 * (lo + hi)
      below = mid + gamma / t * np.exp(mid) < u
      lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return np.exp(0.5 * (lo + hi))

  a = q.max(-1, keepdims=True) - gamma - 10 * t
  b = q.max(-1, keepdims=True) + t * np.log(q.shape[-1]) + 1.0
  for _ in range(120):
    m = 0.5 * (a + b)
    over = p_of(m).sum(-1, keepdims=True) > 1.0
    a, b = np.where(over, m, a), np.where(over, b, m)
  return p_of(0.5 * (a + b))


@pytest.mark.parametrize("gamma,t", [(1e4, 1.0), (3e3, 0.5), (1e6, 0.01)])
def test_large_gamma_over_temperature_reaches_the_equilibrium(gamma, t):
  """gamma / T far past 3000 (where the damped iteration hit its cap and returned a largest
  weight of 0.0735 for an equilibrium of 0.0420): float32 within 1e-6 of the float64
  equilibrium, and rows sum to 1."""
  q = np.asarray(helpers.rows(6, (3, 24), 2.0), np.float32)
  got = np.asarray(f(jnp.asarray(q), gamma=gamma, temperature=t), np.float64)
  want = _equilibrium_f64(q, gamma, t)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-6)


def test_grad_of_grad_matches_finite_differences():
  """Reverse over reverse (and jax.hessian) works: the implicit rule is differentiable again.
  float64, against central differences of the first derivative."""
  x = np.asarray(helpers.rows(7, (5,), 1.5), np.float64)
  a, b = np.sin(np.arange(5.0)), np.cos(np.arange(5.0))
  with jax.enable_x64(True):
    @jax.jit
    def g1(v, gamma):
      return jax.grad(lambda v: jnp.sum(f(v, gamma=gamma, temperature=0.7) * a))(v) @ b

    gg = jax.jit(jax.grad(g1, argnums=(0, 1)))(jnp.asarray(x), 2.0)
    h = 1e-5
    fd = [(g1(jnp.asarray(x) + h * e, 2.0) - g1(jnp.asarray(x) - h * e, 2.0)) / (2 * h)
          for e in np.eye(5)]
    np.testing.assert_allclose(gg[0], fd, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(gg[1], (g1(jnp.asarray(x), 2.0 + h) - g1(jnp.asarray(x), 2.0 - h))
                               / (2 * h), rtol=1e-6, atol=1e-9)
    hess = jax.jit(jax.hessian(lambda v: f(v, gamma=2.0, temperature=0.7) @ a))(jnp.asarray(x))
    np.testing.assert_allclose(hess @ b, fd, rtol=1e-6, atol=1e-9)
