"""N19 StableMax against a float64 numpy closed form."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

X = helpers.rows(0, (4, 8), 3.0)


def _reference(x):
  """float64 numpy: s(x) / sum s(x), s piecewise."""
  x = np.asarray(x, np.float64)
  s = np.where(x >= 0, x + 1.0, 1.0 / (1.0 - np.minimum(x, 0.0)))
  return s / s.sum(-1, keepdims=True)


def _reference_vjp(x, ct):
  """Closed-form VJP: w = s/S, dw_i/dx_j = (s'_i delta_ij - w_i s'_j) / S."""
  x = np.asarray(x, np.float64)
  ct = np.asarray(ct, np.float64)
  s = np.where(x >= 0, x + 1.0, 1.0 / (1.0 - np.minimum(x, 0.0)))
  ds = np.where(x >= 0, 1.0, 1.0 / (1.0 - np.minimum(x, 0.0)) ** 2)
  big_s = s.sum(-1, keepdims=True)
  w = s / big_s
  return ds * (ct - np.sum(ct * w, -1, keepdims=True)) / big_s


def test_matches_closed_form_values_and_gradient():
  ct = helpers.random_cotangent(X.shape)
  out, vjp = jax.vjp(N.stablemax, X)
  chex.assert_trees_all_close(out, _reference(X).astype(np.float32), atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(vjp(ct)[0], _reference_vjp(X, ct).astype(np.float32),
                              atol=1e-6, rtol=1e-4)


def test_map_is_c1_at_zero_and_positive():
  s = N.stablemax_map
  assert float(s(jnp.float32(0.0))) == 1.0
  for x0 in (0.0, 1e-4, -1e-4):
    chex.assert_trees_all_close(jax.grad(s)(jnp.float32(x0)), 1.0, atol=1e-3)
  # s(1) = 2 on the x + 1 branch: the 1/(1 - x) branch's pole at x = 1 must not leak.
  assert float(s(jnp.float32(1.0))) == 2.0 and float(jax.grad(s)(jnp.float32(1.0))) == 1.0
  xs = jnp.linspace(-1e4, 1e4, 101)
  assert np.all(np.asarray(s(xs)) > 0)
  assert np.all(np.diff(np.asarray(s(xs))) > 0)  # increasing


def test_not_shift_invariant_and_monotone():
  assert not np.allclose(N.stablemax(X + 1.0), N.stablemax(X))
  x = jnp.asarray([-3.0, -1.0, 0.0, 2.0, 5.0])
  assert np.all(np.diff(np.asarray(N.stablemax(x))) > 0)


def test_polynomial_tails_and_huge_logits():
  x = jnp.asarray([[1000.0, 0.0, -1000.0], [1e30, -1e30, 0.0], [-1e6, -1e6, -1e6]])
  out = N.stablemax(x)
  assert np.all(np.isfinite(np.asarray(out)))
  chex.assert_trees_all_close(out, _reference(x).astype(np.float32), atol=1e-6, rtol=1e-5)
  g = jax.grad(lambda x: jnp.sum(N.stablemax(x) * helpers.random_cotangent(x.shape)))(x)
  assert np.all(np.isfinite(np.asarray(g)))
  # The gap 1000 gives a ratio 1001 (linear), not e^1000: no collapse to an exact 1.
  assert float(out[0, 0]) < 1.0


def test_mask_and_fully_masked():
  helpers.check_mask_is_delete(N.stablemax, X, 3)
  helpers.check_fully_masked(N.stablemax)


def test_tile_rule_matches_function():
  helpers.check_tile_rule(N.get("stablemax"), scale=3.0)


def test_check_grads_float64():
  with jax.enable_x64(True):
    # Away from 0, where s'' jumps (s is C^1, not C^2).
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5)))
    x = x + 0.2 * jnp.sign(x)
    check_grads(jax.jit(N.stablemax), (x,), order=2)
    # At 0 itself (C^1): a small step, since s'' jumps there (central-difference error ~h/2).
    check_grads(jax.jit(N.stablemax), (jnp.asarray([[0.0, 1e-9, -1e-9, 0.5]]),), order=1,
                eps=1e-7)


def test_low_precision_and_jit_vmap():
  helpers.check_low_precision(N.stablemax, X)
  chex.assert_trees_all_close(jax.jit(N.stablemax)(X), N.stablemax(X), atol=1e-7)
  chex.assert_trees_all_close(jax.vmap(N.stablemax)(X), N.stablemax(X), atol=1e-7)
  chex.assert_trees_all_close(N.stablemax(X.T, axis=0), N.stablemax(X).T, atol=1e-7)


def test_spec_and_bad_input():
  spec = N.get("stablemax")
  assert spec.kernel_class == "S" and spec.sums_to_one and not spec.shift_invariant
  assert not spec.tile.uses_max
  with pytest.raises(ValueError, match="`axis`"):
    N.stablemax(X, axis=-3)
  with pytest.raises(ValueError, match="`where`"):
    N.stablemax(X, where=jnp.ones((2, 2), bool))
