"""N21 sigmoid and N22 relu / relu_n / relu2 against jax.nn."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

X, MASK = helpers.rows_and_mask(0, (4, 7), 2.0, p=0.6)


def test_sigmoid_default_bias_is_minus_log_n():
  helpers.vjp_close(N.sigmoid, lambda x: jax.nn.sigmoid(x - np.log(7)), X)
  n = MASK.sum(-1, keepdims=True)
  helpers.vjp_close(lambda x: N.sigmoid(x, where=MASK),
             lambda x: jnp.where(MASK, jax.nn.sigmoid(x - jnp.log(n)), 0.0), X)


def test_sigmoid_explicit_bias_scalar_and_per_row():
  helpers.vjp_close(lambda x: N.sigmoid(x, bias=0.3), lambda x: jax.nn.sigmoid(x + 0.3), X)
  b = jnp.asarray([[0.0], [-1.0], [2.0], [0.5]])
  helpers.vjp_close(lambda x: N.sigmoid(x, bias=b), lambda x: jax.nn.sigmoid(x + b), X)
  g = jax.grad(lambda b: jnp.sum(N.sigmoid(X, bias=b)))(b)
  chex.assert_trees_all_close(g, jnp.sum(jax.nn.sigmoid(X + b) * (1 - jax.nn.sigmoid(X + b)),
                                         -1, keepdims=True), atol=1e-6)


def test_sigmoid_zero_scores_row_sum_and_diagonal_jacobian():
  for n in (1, 4, 100):
    chex.assert_trees_all_close(N.sigmoid(jnp.zeros(n)).sum(), n / (n + 1), rtol=1e-5)
  x = X[0]
  jac = jax.jit(jax.jacfwd(lambda x: N.sigmoid(x, bias=-1.0)))(x)
  s = jax.nn.sigmoid(x - 1.0)
  chex.assert_trees_all_close(jac, jnp.diag(s * (1 - s)), atol=1e-7)
  assert float(jnp.max(jac)) <= 0.25


def test_sigmoid_explicit_bias_ignores_other_keys_default_bias_counts_them():
  a = N.sigmoid(X, bias=-1.0)
  b = N.sigmoid(X.at[:, 6].set(5.0), bias=-1.0)
  chex.assert_trees_all_equal(a[:, :6], b[:, :6])
  # Masking a column == deleting it (n drops by one for the default bias).
  helpers.check_mask_is_delete(N.sigmoid, X, 6)


def test_relu_family_matches_jax_nn():
  helpers.vjp_close(N.relu, jax.nn.relu, X)
  helpers.vjp_close(N.relu2, lambda x: jax.nn.relu(x) ** 2, X)
  helpers.vjp_close(N.relu_n, lambda x: jax.nn.relu(x) / 7, X)
  n = MASK.sum(-1, keepdims=True)
  helpers.vjp_close(lambda x: N.relu_n(x, where=MASK),
             lambda x: jnp.where(MASK, jax.nn.relu(x) / n, 0.0), X)
  helpers.vjp_close(lambda x: N.relu(x, where=MASK), lambda x: jnp.where(MASK, jax.nn.relu(x), 0.0), X)


def test_relu_all_negative_row_is_zero():
  out = N.relu(-jnp.abs(X))
  assert np.all(np.asarray(out) == 0)
  assert np.all(np.asarray(jax.grad(lambda x: N.relu(x).sum())(-jnp.abs(X))) == 0)


@pytest.mark.parametrize("name", ["sigmoid", "relu", "relu_n", "relu2"])
def test_mask_fully_masked_and_low_precision(name):
  fn = jax.jit(N.get(name).fn)  # one program per call shape instead of op by op
  helpers.check_mask_is_delete(fn, X, 2)
  helpers.check_fully_masked(fn)
  helpers.check_low_precision(fn, X, atol=(3e-2, 1e-2))


@pytest.mark.parametrize("name,hp", [("sigmoid", {}), ("sigmoid", {"bias": -1.0}),
                                     ("relu", {}), ("relu_n", {}), ("relu2", {})])
def test_tile_rule_matches_function(name, hp):
  helpers.check_tile_rule(N.get(name), hp)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5)))
    x = x + 0.2 * jnp.sign(x)  # away from the ReLU kink
    check_grads(jax.jit(lambda x, b: N.sigmoid(x, bias=b)), (x, jnp.float64(0.4)), order=2)
    check_grads(jax.jit(N.relu_n), (x,), order=1)


@pytest.mark.slow  # order-2 checks compile ~10 programs each: one stays in the default run
def test_check_grads_float64_order_two_without_bias():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5)))
    x = x + 0.2 * jnp.sign(x)  # away from the ReLU kink
    check_grads(jax.jit(N.sigmoid), (x,), order=2)
    check_grads(jax.jit(N.relu2), (x,), order=2)


def test_jit_vmap():
  for fn in (N.sigmoid, N.relu, N.relu_n, N.relu2):
    chex.assert_trees_all_close(jax.jit(fn)(X), fn(X), atol=1e-7)
    chex.assert_trees_all_close(jax.vmap(fn)(X), fn(X), atol=1e-7)
  chex.assert_trees_all_close(N.sigmoid(X.T, axis=0), N.sigmoid(X).T, atol=1e-7)


def test_specs():
  for name in ("sigmoid", "relu", "relu_n", "relu2"):
    spec = N.get(name)
    assert spec.kernel_class == "P" and not spec.sums_to_one and not spec.at_most_one
    assert spec.tile.denominator is None and not spec.tile.uses_max
  assert N.get("sigmoid").length_dependent and N.get("relu_n").length_dependent
  assert not N.get("relu").length_dependent


def test_bad_input():
  with pytest.raises(ValueError, match="`bias`"):
    N.sigmoid(X, bias=float("nan"))
  with pytest.raises(ValueError, match="`bias`"):
    N.sigmoid(X, bias=jnp.zeros((4, 7)))
  for fn in (N.sigmoid, N.relu, N.relu_n, N.relu2):
    with pytest.raises(ValueError, match="`axis`"):
      fn(X, axis=4)
