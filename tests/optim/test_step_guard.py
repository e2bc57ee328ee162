"""The safe step radius of softmax cross-entropy and the optax step guard (catalogue E08;
P. Sao 2026, "Ghosts of Softmax", arXiv 2603.13552): :func:`jaxsoft.optim.ghost_radius`,
:func:`jaxsoft.optim.binary_ghost_radius` and :func:`jaxsoft.optim.softmax_step_guard`.

The radius is checked against numpy float64 complex arithmetic (the zeros of
``F(τ) = Σ_k exp(z_k + a_k τ)``); the guard against a linear model whose logits' JVP is
``x @ U + u_b`` exactly, so its promises can be checked without linearisation error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js


def test_ghost_radius_is_pi_over_the_tangent_spread():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((4, 7))
  where = rng.random((4, 7)) < 0.7
  where[3] = [True] + [False] * 6                      # one visible class: nothing can cancel

  @jax.jit
  def radii(a, where):
    r = js.optim.ghost_radius
    return (r(a), r(a.T, axis=0), r(a, where=where), r(a / 4.0), r(jnp.zeros(3)),
            r(a.astype(jnp.bfloat16)))

  plain, transposed, masked, hot, flat, low = radii(jnp.asarray(a, jnp.float32), where)
  ref = np.pi / (a.max(-1) - a.min(-1))
  # float32 tangents of size ~2: relative rounding ~1e-7, 1e-6 leaves a margin
  np.testing.assert_allclose(plain, ref, rtol=1e-6)
  np.testing.assert_allclose(transposed, ref, rtol=1e-6)
  am = np.ma.masked_array(a, ~where)
  np.testing.assert_allclose(masked[:3], np.pi / (am.max(-1) - am.min(-1))[:3], rtol=1e-6)
  assert masked[3] == np.inf and flat == np.inf
  assert low.dtype == jnp.float32
  # temperature T divides the logits and their tangents by T: the radius grows by T
  np.testing.assert_allclose(hot, 4 * ref, rtol=1e-6)
  with jax.enable_x64(True):
    r64 = jax.jit(js.optim.ghost_radius)(jnp.asarray(a))
    assert r64.dtype == jnp.float64
    np.testing.assert_allclose(r64, ref, rtol=1e-14)  # float64: a few ulps


def test_binary_radius_is_the_distance_to_a_zero_of_the_partition_function():
  rng = np.random.default_rng(1)
  z, a = rng.standard_normal((6, 2)) * 3, rng.standard_normal((6, 2))
  z[5, 1] = z[5, 0]                                      # a zero margin
  with jax.enable_x64(True):
    rho, bound = jax.jit(lambda z, a: (js.optim.binary_ghost_radius(z, a),
                                       js.optim.ghost_radius(a)))(jnp.asarray(z), jnp.asarray(a))
    rho, bound = np.asarray(rho), np.asarray(bound)
  delta, d = z[:, 0] - z[:, 1], a[:, 0] - a[:, 1]
  tau = (-delta + 1j * np.pi) / d                        # the nearest zero (m = 0)
  terms = np.exp(z + a * tau[:, None])
  # F(τ*) = 0 exactly: two terms of equal modulus and opposite phase; float64 cancellation
  # leaves ~1e-15 of the terms' size
  assert np.all(np.abs(terms.sum(-1)) <= 1e-12 * np.abs(terms).sum(-1))
  np.testing.assert_allclose(rho, np.abs(tau), rtol=1e-12)
  # it is at least the multiclass bound, with equality at a zero margin
  assert np.all(rho >= bound * (1 - 1e-12))
  np.testing.assert_allclose(rho[delta == 0], bound[delta == 0], rtol=1e-12)
  np.testing.assert_allclose(
      jax.jit(js.optim.binary_ghost_radius)(jnp.zeros(2), jnp.array([1.0, -2.0])), np.pi / 3,
      rtol=1e-6)
  with pytest.raises(ValueError, match="exactly 2 classes"):
    js.optim.binary_ghost_radius(jnp.zeros(3), jnp.ones(3))


def test_no_zero_of_the_partition_function_inside_the_multiclass_radius():
  """Inside |τ| < ρ_a every term's phase a_k Im τ lies in an arc of width θ = Δ_a |Im τ| < π,
  so |F| >= cos(θ/2) Σ_k |term_k| > 0: checked at random points of the disk (float64)."""
  rng = np.random.default_rng(2)
  z = rng.standard_normal((50, 5)) * 2
  a = rng.standard_normal((50, 5)) * 3
  with jax.enable_x64(True):
    rho = np.asarray(js.optim.ghost_radius(jnp.asarray(a)))
  radius = 0.999 * rho[:, None] * np.sqrt(rng.random((50, 200)))
  tau = radius * np.exp(2j * np.pi * rng.random((50, 200)))
  terms = np.exp(z[:, None] + a[:, None] * tau[..., None])          # [rows, samples, K]
  theta = (a.max(-1) - a.min(-1))[:, None] * np.abs(tau.imag)
  bound = np.cos(theta / 2) * np.abs(terms).sum(-1)
  assert np.all(theta < np.pi)
  # the bound is an inequality; 1e-12 relative absorbs float64 rounding of the sums
  assert np.all(np.abs(terms.sum(-1)) >= bound * (1 - 1e-12))
  assert np.min(np.abs(terms.sum(-1)) / np.abs(terms).sum(-1)) > 0


def _linear_problem(seed=3, n=16, d=5, k=4):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)).astype(np.float32)
  y = rng.integers(0, k, n)
  params = {"W": jnp.asarray(rng.standard_normal((d, k)) * 0.1, jnp.float32),
            "b": jnp.zeros(k, jnp.float32)}
  return jnp.asarray(x), jnp.asarray(y), params


def _logits(p, x):
  return x @ p["W"] + p["b"][None, :]


def _loss(p, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(_logits(p, x), y)


def test_guard_contract_and_guarantee_under_jit():
  x, y, params = _linear_problem()
  guard = js.optim.softmax_step_guard(_logits)
  state = guard.init(params)
  assert float(state.step_ratio) == 0.0 and float(state.scale) == 1.0

  @jax.jit
  def step(lr):
    grads = jax.grad(lambda p: _loss(p, x, y).mean())(params)
    u = jax.tree.map(lambda g: -lr * g, grads)
    new, st = guard.update(u, state, params, batch=x)
    loss = lambda d: _loss(jax.tree.map(jnp.add, params, d), x, y) - _loss(params, x, y)
    return u, new, st, loss(new), loss(u)

  # the JVP of linear logits along U is x @ U_W + U_b: the reference, in float64
  spread = lambda u: np.max(np.ptp(np.asarray(x, np.float64) @ np.asarray(u["W"], np.float64)
                                   + np.asarray(u["b"], np.float64), axis=-1))
  u, new, st, _, _ = step(1e-3)                           # a small step: untouched
  assert float(st.scale) == 1.0
  for leaf_u, leaf_new in zip(jax.tree.leaves(u), jax.tree.leaves(new), strict=True):
    np.testing.assert_array_equal(leaf_new, leaf_u)
  np.testing.assert_allclose(float(st.step_ratio), spread(u) / np.pi, rtol=1e-5)  # float32 JVP
  u, new, st, rise, raw = step(1e4)                       # a spike: shrunk onto r = 1
  r = spread(u) / np.pi
  assert r > 10
  np.testing.assert_allclose(float(st.step_ratio), r, rtol=1e-5)
  np.testing.assert_allclose(float(st.scale), 1 / r, rtol=1e-5)
  np.testing.assert_allclose(spread(new) / np.pi, 1.0, rtol=1e-5)   # the guarded step's r
  for leaf_u, leaf_new in zip(jax.tree.leaves(u), jax.tree.leaves(new), strict=True):
    np.testing.assert_allclose(leaf_new, leaf_u * float(st.scale), rtol=1e-6)  # same direction
  # linear logits: |dℓ/dτ| <= Δ_a, so no example's loss rises by more than π r_max = π
  # (float32 losses ~2: 1e-5 absorbs their rounding)
  assert np.max(rise) <= np.pi + 1e-5
  assert np.max(raw) > 10 * np.pi                         # without the guard it does


def test_guard_in_an_optax_chain_with_a_margin_and_without_a_batch():
  x, y, params = _linear_problem(seed=4)
  guard = js.optim.softmax_step_guard(_logits, max_ratio=0.5)
  opt = optax.chain(optax.sgd(1e3), guard)
  state = opt.init(params)

  @jax.jit
  def update(state):
    grads = jax.grad(lambda p: _loss(p, x, y).mean())(params)
    return opt.update(grads, state, params, batch=x)

  new, state = update(state)
  a = np.asarray(x, np.float64) @ np.asarray(new["W"], np.float64) + np.asarray(new["b"])
  np.testing.assert_allclose(np.max(np.ptp(a, -1)), 0.5 * np.pi, rtol=1e-5)
  assert float(state[1].scale) < 1
  # logits_fn(params) without a batch; a class at -inf is not in the spread
  mask = jnp.array([0.0, 0.0, -jnp.inf])
  closed = js.optim.softmax_step_guard(lambda p: p * jnp.array([1.0, -1.0, 100.0]) + mask)
  u = jnp.full(3, 2.0)
  out, st = jax.jit(closed.update)(u, closed.init(u), jnp.zeros(3))
  np.testing.assert_allclose(float(st.step_ratio), 4 / np.pi, rtol=1e-6)   # spread 2 - (-2)
  np.testing.assert_allclose(out, u * np.pi / 4, rtol=1e-6)


def test_guard_keeps_float64_and_rejects_bad_input():
  with jax.enable_x64(True):
    guard = js.optim.softmax_step_guard(lambda p: jnp.stack([p, -p]))
    u, st = jax.jit(guard.update)(jnp.array(10.0), guard.init(jnp.zeros(())), jnp.zeros(()))
    assert u.dtype == jnp.float64
    np.testing.assert_allclose(u, np.pi / 2, rtol=1e-14)
  with pytest.raises(ValueError, match="max_ratio"):
    js.optim.softmax_step_guard(_logits, max_ratio=0.0)
  with pytest.raises(TypeError, match="callable"):
    js.optim.softmax_step_guard(3.0)
  guard = js.optim.softmax_step_guard(lambda p: p)
  with pytest.raises(ValueError, match="needs `params`"):
    guard.update(jnp.ones(2), guard.init(jnp.ones(2)))
  with pytest.raises(ValueError, match="scalar"):
    guard.update(jnp.ones(()), guard.init(jnp.ones(())), jnp.ones(()))
