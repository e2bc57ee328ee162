"""N10 sdm against a float64 numpy reference written from the paper's formula."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
SDM = jax.jit(N.sdm)


def _reference(x, mask, q=0.0, d=1.0):
  """float64: (2 + q)^(d x_i) / sum_j (2 + q)^(d x_j), computed with numpy's power."""
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  shift = np.max(np.where(mask, x, -np.inf), -1, keepdims=True)
  shift = np.where(np.isfinite(shift), shift, 0.0)
  a = np.where(mask, np.power(2.0 + q, d * (x - shift)), 0.0)
  s = a.sum(-1, keepdims=True)
  return np.divide(a, s, out=np.zeros_like(a), where=s > 0)


def test_matches_reference():
  x, mask = helpers.random_rows(0, scale=2.0)
  for hp in ({}, {"q": 3.0}, {"d": 0.3}, {"q": 7.0, "d": 0.8}):
    chex.assert_trees_all_close(SDM(x, where=mask, **hp),
                                _reference(x, mask, **hp).astype(np.float32), atol=1e-6)
  q = np.arange(x.shape[0], dtype=np.float64)[:, None]
  d = np.linspace(0.0, 1.0, x.shape[0])[:, None]
  chex.assert_trees_all_close(
      SDM(x, where=mask, q=jnp.asarray(q, jnp.float32), d=jnp.asarray(d, jnp.float32)),
      _reference(x, mask, q, d).astype(np.float32), atol=1e-6)


def test_closed_forms_and_monotone_sharpening():
  x, mask = helpers.random_rows(1, scale=2.0)
  chex.assert_trees_all_close(SDM(x, where=mask, q=np.e - 2.0), N.softmax(x, where=mask),
                              atol=1e-6)
  visible = np.asarray(mask)
  n = visible.sum(-1, keepdims=True)
  w0 = np.asarray(SDM(x, where=mask, d=0.0))
  np.testing.assert_allclose(w0, np.where(visible, 1.0 / np.maximum(n, 1), 0.0), rtol=1e-6)

  def top(**hp):
    return float(SDM(jnp.array([2.0, 1.0, 0.0, -1.0]), **hp)[0])
  assert top(q=0.0) < top(q=1.0) < top(q=5.0)
  assert top(q=2.0, d=0.2) < top(q=2.0, d=0.6) < top(q=2.0, d=1.0)
  # the log version: log sdm = d x log(2 + q) - logsumexp, i.e. change of base
  w = SDM(x[1], q=3.0, d=0.5)
  chex.assert_trees_all_close(jnp.log(w), jax.nn.log_softmax(0.5 * jnp.log(5.0) * x[1]),
                              atol=1e-5)


def test_gradients_float64_masks_low_precision_tile_rule():
  x, mask = helpers.random_rows(2)
  with jax.enable_x64(True):
    rows = x.shape[0]
    args = (jnp.asarray(x, jnp.float64), jnp.full((rows, 1), 3.0, jnp.float64),
            jnp.full((rows, 1), 0.5, jnp.float64))
    check_grads(lambda x, q, d: SDM(x, where=mask, q=q, d=d), args, order=1,
                modes=("fwd", "rev"))
  xf, _ = helpers.random_rows(3, masked=False)
  helpers.check_low_precision(SDM, xf, q=3.0, d=0.5)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(SDM)
