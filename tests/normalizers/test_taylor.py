"""N24 Taylor softmax against the closed-form polynomial."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

X = helpers.rows(0, (4, 8), 2.0)


def _poly(x, order):
  """sum_{k<=order} x^k / k!, term by term (not Horner)."""
  return sum(x ** k / math.factorial(k) for k in range(order + 1))


def _direct(x, order):
  p = _poly(x, order)
  return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("order", [2, 4, 6])
def test_matches_closed_form(order):
  helpers.vjp_close(lambda x: N.taylor_softmax(x, order=order), lambda x: _direct(x, order), X,
                    vjp_rtol=1e-4)


def test_order_2_formula_and_positivity():
  x = jnp.asarray([-1.0, 0.0, 1.0, -10.0])
  p = 1 + x + x ** 2 / 2
  chex.assert_trees_all_close(N.taylor_softmax(x), p / p.sum(), rtol=1e-6)
  xs = jnp.linspace(-20, 20, 2001)
  for order in (2, 4, 8):
    assert np.all(np.asarray(N.taylor_exp(xs, order)) > 0)
  chex.assert_trees_all_close(N.taylor_exp(jnp.float32(-1.0), 2), 0.5)


def test_high_order_tends_to_softmax():
  x = X / 2
  chex.assert_trees_all_close(N.taylor_softmax(x, order=16), jax.nn.softmax(x), atol=1e-5)


def test_not_shift_invariant_and_no_overflow():
  assert not np.allclose(N.taylor_softmax(X + 1.0), N.taylor_softmax(X))
  x = jnp.asarray([[1000.0, -1000.0, 0.0], [1e15, 1e15, 1.0]])
  out = N.taylor_softmax(x)
  assert np.all(np.isfinite(np.asarray(out)))
  chex.assert_trees_all_close(out[0], _direct(np.asarray(x[0], np.float64), 2).astype(np.float32),
                              atol=1e-6)
  chex.assert_trees_all_close(out[1], jnp.asarray([0.5, 0.5, 0.0]), atol=1e-6)


def test_mask_fully_masked_low_precision():
  # jitted (order static): one program per call shape instead of op by op
  taylor = jax.jit(N.taylor_softmax, static_argnames="order")
  helpers.check_mask_is_delete(taylor, X, 1)
  helpers.check_mask_is_delete(taylor, X, 6, order=4)
  helpers.check_fully_masked(taylor)
  helpers.check_low_precision(taylor, X)


@pytest.mark.parametrize("hp", [{}, {"order": 4}])
def test_tile_rule_matches_function(hp):
  helpers.check_tile_rule(N.get("taylor_softmax"), hp)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)))
    check_grads(jax.jit(lambda x: N.taylor_softmax(x, order=4)), (x,), order=2)


@pytest.mark.slow  # order-2 checks compile ~10 programs each: one stays in the default run
def test_check_grads_float64_order_two_default_order():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)))
    check_grads(jax.jit(N.taylor_softmax), (x,), order=2)


def test_jit_vmap():
  chex.assert_trees_all_close(jax.jit(N.taylor_softmax, static_argnames="order")(X, order=4),
                              N.taylor_softmax(X, order=4), atol=1e-7)
  chex.assert_trees_all_close(jax.vmap(N.taylor_softmax)(X), N.taylor_softmax(X), atol=1e-7)


def test_spec():
  spec = N.get("taylor_softmax")
  assert spec.kernel_class == "S" and spec.sums_to_one and not spec.shift_invariant
  assert spec.param("order").default == 2 and spec.param("order").sample % 2 == 0


@pytest.mark.parametrize("order", [1, 3, 5, 0, -2, 2.0, True])
def test_bad_order(order):
  with pytest.raises(ValueError, match="`order`"):
    N.taylor_softmax(X, order=order)


def test_bad_axis():
  with pytest.raises(ValueError, match="`axis`"):
    N.taylor_softmax(X, axis=-3)
