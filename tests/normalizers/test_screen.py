"""N38 multiscreen (the [R] screening map) against a float64 numpy reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
MULTISCREEN = jax.jit(N.multiscreen)


def _reference(x, mask, theta=0.0, power=1.0):
  x = np.asarray(x, np.float64)
  u = np.clip((x - theta) / (1.0 - theta), 0.0, 1.0)
  return np.where(mask, u ** power, 0.0)


def test_matches_reference():
  x, mask = helpers.random_rows(0, scale=0.7)
  for hp in ({}, {"theta": 0.5}, {"theta": -0.3, "power": 2.0}, {"power": 0.5}):
    chex.assert_trees_all_close(MULTISCREEN(x, where=mask, **hp),
                                _reference(x, mask, **hp).astype(np.float32), atol=1e-6)


def test_absolute_relevance():
  rng = np.random.default_rng(1)
  q = rng.standard_normal(8)
  q /= np.linalg.norm(q)
  keys = rng.standard_normal((12, 8))
  keys /= np.linalg.norm(keys, axis=1, keepdims=True)
  v = jnp.asarray(rng.standard_normal((12, 3)), jnp.float32)
  s = jnp.asarray(keys @ q, jnp.float32)  # cosine similarities in [-1, 1]
  theta = 0.1
  w = MULTISCREEN(s, theta=theta, power=2.0)
  assert np.all((np.asarray(w) >= 0) & (np.asarray(w) <= 1))
  assert np.all(np.asarray(w)[np.asarray(s) <= theta] == 0)  # exact zeros below theta
  # appending irrelevant keys (below theta) leaves the output unchanged; softmax's changes
  s2 = jnp.concatenate([s, jnp.full(20, -0.5)])
  v2 = jnp.concatenate([v, jnp.ones((20, 3))])
  chex.assert_trees_all_close(MULTISCREEN(s2, theta=theta, power=2.0) @ v2, w @ v, atol=1e-6)
  assert not np.allclose(N.softmax(s2) @ v2, N.softmax(s) @ v, atol=1e-3)
  # a query with no relevant key outputs 0
  assert float(jnp.abs(MULTISCREEN(jnp.full(5, -0.2), theta=theta) @ v[:5]).sum()) == 0.0


def test_gradients_float64_masks_low_precision_tile_rule():
  x, mask = helpers.random_rows(2, scale=0.5)
  # every visible score at least 0.01 from the kinks theta = 0.2 and 1 (checked)
  assert np.min(np.abs(np.asarray(x)[np.asarray(mask)] - 0.2)) > 0.01
  with jax.enable_x64(True):
    rows = x.shape[0]
    check_grads(lambda x, t, p: MULTISCREEN(x, where=mask, theta=t, power=p),
                (jnp.asarray(x, jnp.float64), jnp.full((rows, 1), 0.2, jnp.float64),
                 jnp.full((rows, 1), 2.0, jnp.float64)), order=1, modes=("fwd", "rev"),
                eps=1e-4)
  g = jax.grad(lambda x: jnp.sum(MULTISCREEN(x, power=0.5)))(jnp.array([0.0, -1.0, 0.5]))
  assert np.all(np.isfinite(np.asarray(g)))  # u^p with p < 1 at u = 0: no NaN
  xf, _ = helpers.random_rows(3, masked=False, scale=0.7)
  helpers.check_low_precision(MULTISCREEN, xf, theta=0.2, power=2.0)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(MULTISCREEN)
