"""N40 nested_sigmoid (the [R] staircase) against a float64 numpy reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
NESTED_SIGMOID = jax.jit(N.nested_sigmoid, static_argnames=("levels",))


def _reference(x, mask, kappa=1.0, start=-1.0, step=1.0, levels=3):
  x = np.asarray(x, np.float64)
  thresholds = start + step * np.arange(levels)
  f = np.mean([1.0 / (1.0 + np.exp(-kappa * (x - t))) for t in thresholds], axis=0)
  return np.where(mask, f, 0.0)


def test_matches_reference():
  x, mask = helpers.random_rows(0, scale=2.0)
  for hp in ({}, {"kappa": 4.0, "start": 0.0, "step": 2.0}, {"start": 0.5, "levels": 1},
             {"levels": 5, "step": 0.5}):
    chex.assert_trees_all_close(NESTED_SIGMOID(x, where=mask, **hp),
                                _reference(x, mask, **hp).astype(np.float32), atol=1e-6)


def test_staircase_monotone_bounded_nested_levels():
  z = jnp.linspace(-6.0, 6.0, 1201)
  f = np.asarray(NESTED_SIGMOID(z, kappa=20.0, start=-2.0, step=2.5))
  assert np.all(np.diff(f) >= 0) and f.min() >= 0 and f.max() <= 1
  # between the steps the level is k/K: nested regions read off one output
  levels = NESTED_SIGMOID(jnp.array([-4.0, -0.75, 1.75, 5.0]), kappa=20.0, start=-2.0,
                          step=2.5)
  np.testing.assert_allclose(levels, [0.0, 1 / 3, 2 / 3, 1.0], atol=1e-6)
  with pytest.raises(ValueError, match="levels"):
    N.nested_sigmoid(z, levels=0)
  with pytest.raises(ValueError, match="step"):
    N.nested_sigmoid(z, step=-1.0)
  with pytest.raises(ValueError, match="kappa"):
    N.nested_sigmoid(z, kappa=0.0)


def test_gradients_float64_masks_low_precision_tile_rule():
  x, mask = helpers.random_rows(1)
  with jax.enable_x64(True):
    rows = (x.shape[0], 1)
    check_grads(lambda x, k, a, d: NESTED_SIGMOID(x, where=mask, kappa=k, start=a, step=d),
                (jnp.asarray(x, jnp.float64), jnp.full(rows, 2.0, jnp.float64),
                 jnp.full(rows, -0.5, jnp.float64), jnp.full(rows, 0.7, jnp.float64)),
                order=1, modes=("fwd", "rev"))
  xf, _ = helpers.random_rows(2, masked=False)
  helpers.check_low_precision(NESTED_SIGMOID, xf, kappa=4.0)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(NESTED_SIGMOID)
