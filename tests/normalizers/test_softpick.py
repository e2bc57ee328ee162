"""N20 softpick against the naive formula, at +-1000, and the mask trap."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

X = helpers.rows(0, (5, 8), 2.0)


def _naive(x):
  """The paper's formula as written, in float64: ReLU(e^x - 1) / sum |e^x - 1|."""
  e = jnp.exp(jnp.asarray(x, jnp.float64)) - 1.0
  return jax.nn.relu(e) / jnp.sum(jnp.abs(e), -1, keepdims=True)


def test_matches_naive_formula_values_and_gradient():
  with jax.enable_x64(True):
    x64 = jnp.asarray(X, jnp.float64)
    ct = helpers.random_cotangent(X.shape, dtype=jnp.float64)
    want, vjp_want = jax.vjp(jax.jit(_naive), x64)  # jitted: one program, not op by op
    want_dx = vjp_want(ct)[0]
  out, vjp = jax.vjp(jax.jit(N.softpick), X)
  chex.assert_trees_all_close(out, np.asarray(want, np.float32), atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(vjp(ct.astype(jnp.float32))[0], np.asarray(want_dx, np.float32),
                              atol=1e-5, rtol=1e-4)


def test_finite_and_exact_at_plus_minus_1000():
  x = jnp.asarray([[1000.0, 999.0, -1000.0, 0.0], [-1000.0, -999.0, -5.0, -1.0],
                   [1000.0, -1000.0, 1000.0, -1000.0]])
  out = N.softpick(x)
  assert np.all(np.isfinite(np.asarray(out)))
  a = 1.0 / (1.0 + np.exp(-1.0))
  # The -1000 and 0 entries add |e^x - 1| <= 1 to a denominator of e^1000 scale: 0.
  chex.assert_trees_all_close(out[0], jnp.asarray([a, 1 - a, 0.0, 0.0]), atol=1e-6)
  assert np.all(np.asarray(out[1]) == 0)  # all negative: attend to nothing
  chex.assert_trees_all_close(out[2], jnp.asarray([0.5, 0.0, 0.5, 0.0]), atol=1e-6)
  g = jax.grad(lambda x: jnp.sum(N.softpick(x) * helpers.random_cotangent(x.shape)))(x)
  assert np.all(np.isfinite(np.asarray(g)))


def test_zero_row_is_zero_without_eps():
  out = N.softpick(jnp.zeros((2, 4)))
  assert np.all(np.asarray(out) == 0)
  g = jax.grad(lambda x: jnp.sum(N.softpick(x)))(jnp.zeros((2, 4)))
  assert np.all(np.isfinite(np.asarray(g)))
  # Exact (no eps): a tiny positive entry among zeros takes all the mass.
  chex.assert_trees_all_close(N.softpick(jnp.asarray([1e-3, 0.0, 0.0])),
                              jnp.asarray([1.0, 0.0, 0.0]), atol=1e-6)


def test_sparsity_and_row_sum():
  out = np.asarray(N.softpick(X))
  assert np.all(out[np.asarray(X) <= 0] == 0) and np.all(out >= 0)
  sums = out.sum(-1)
  assert np.all(sums <= 1 + 1e-6)
  x_pos = jnp.abs(X) + 0.1
  chex.assert_trees_all_close(N.softpick(x_pos).sum(-1), jnp.ones(5), atol=1e-6)
  chex.assert_trees_all_close(N.softpick(x_pos), (jnp.exp(x_pos) - 1) /
                              jnp.sum(jnp.exp(x_pos) - 1, -1, keepdims=True), atol=1e-6)
  has_neg = np.any(np.asarray(X) < 0, -1)
  assert np.all(sums[has_neg] < 1)


def test_negative_entries_get_gradient_through_the_denominator():
  x = jnp.asarray([2.0, -1.0, 0.5])
  g = jax.grad(lambda x: N.softpick(x)[0])(x)
  assert g[1] != 0


def test_mask_trap_masked_entries_add_nothing_to_denominator():
  # A naive port adds |e^{-inf} - 1| = 1 per masked entry; deleting the column must agree.
  softpick = jax.jit(N.softpick)  # one program per call shape instead of op by op
  helpers.check_mask_is_delete(softpick, X, 2)
  x = jnp.asarray([2.0, 1.0, -jnp.inf, -jnp.inf])
  e = np.expm1(np.asarray([2.0, 1.0]))
  want = e / e.sum()
  chex.assert_trees_all_close(N.softpick(x)[:2], want.astype(np.float32), atol=1e-6)
  helpers.check_fully_masked(softpick)


def test_not_shift_invariant():
  assert not np.allclose(N.softpick(X + 1.0), N.softpick(X))


def test_tile_rule_matches_function():
  helpers.check_tile_rule(N.get("softpick"))


def test_tile_rule_blocks_of_very_negative_scores():
  # A first key block whose scores are all below -88: e^{-m} would overflow with the
  # plain running max; the declared floor m >= 0 keeps the online merge exact.
  spec = N.get("softpick")
  assert spec.tile.m_floor == 0.0
  x = jnp.asarray([[-500.0, -400.0, -300.0, 5.0, 2.0, -1.0],
                   [-900.0, -800.0, -700.0, -600.0, -3.0, -1.0],
                   [1000.0, -1000.0, 999.0, -5.0, 0.5, 3.0]])
  mask = jnp.ones(x.shape, bool)
  want = N.softpick(x)
  for splits in [(), (3,), (1, 2, 4)]:
    got = helpers.tile_eval(spec, x, mask, {}, splits)
    assert np.all(np.isfinite(np.asarray(got)))
    chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-5)
  helpers.check_tile_rule(spec, scale=300.0, atol=1e-5)


def test_check_grads_float64_away_from_kink():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5)))
    x = x + 0.2 * jnp.sign(x)
    check_grads(jax.jit(N.softpick), (x,), order=2)


def test_low_precision_and_jit_vmap():
  helpers.check_low_precision(N.softpick, X)
  out = N.softpick(jnp.asarray([100.0, 99.0, -100.0], jnp.float16))
  assert out.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(out, np.float32)))
  chex.assert_trees_all_close(jax.jit(N.softpick)(X), N.softpick(X), atol=1e-7)
  chex.assert_trees_all_close(jax.vmap(N.softpick)(X), N.softpick(X), atol=1e-7)


def test_spec_and_bad_input():
  spec = N.get("softpick")
  assert spec.kernel_class == "E" and spec.at_most_one and not spec.sums_to_one
  assert spec.can_be_sparse and not spec.shift_invariant
  with pytest.raises(ValueError, match="`axis`"):
    N.softpick(X, axis=2)
