"""N28 idw_softmax against Shepard's inverse-distance weights in float64 numpy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
IDW_SOFTMAX = jax.jit(N.idw_softmax)


def _reference(d, mask, power=1.0, eps=1e-12):
  """float64: (d^2 + eps)^(-p/2) / sum over the visible entries."""
  d = np.asarray(d, np.float64)
  a = np.where(mask, (d * d + eps) ** (-0.5 * power), 0.0)
  s = a.sum(-1, keepdims=True)
  return np.divide(a, s, out=np.zeros_like(a), where=s > 0)


def test_matches_reference():
  d, mask = helpers.random_rows(0, scale=2.0)
  for hp in ({}, {"power": 2.0}, {"power": 0.5, "eps": 1e-4}):
    chex.assert_trees_all_close(IDW_SOFTMAX(d, where=mask, **hp),
                                _reference(d, mask, **hp).astype(np.float32), atol=2e-6,
                                rtol=1e-5)


def test_shepard_interpolation_and_invariances():
  rng = np.random.default_rng(1)
  q = rng.standard_normal(4)
  keys = rng.standard_normal((6, 4))
  dist = lambda q, k: jnp.asarray(np.linalg.norm(q - k, axis=-1), jnp.float32)  # noqa: E731
  w = IDW_SOFTMAX(dist(q, keys))
  chex.assert_trees_all_close(N.softmax(-jnp.log(dist(q, keys))), w, atol=1e-6)  # the paper's
  chex.assert_trees_all_close(IDW_SOFTMAX(dist(3.0 * q, 3.0 * keys)), w, atol=1e-6)  # scale
  rot, _ = np.linalg.qr(rng.standard_normal((4, 4)))
  chex.assert_trees_all_close(IDW_SOFTMAX(dist(rot @ q + 1.0, keys @ rot.T + 1.0)), w,
                              atol=1e-5)  # rotation and translation
  near = IDW_SOFTMAX(dist(keys[2] + 1e-4, keys))  # q -> k_2: all weight on key 2
  assert float(near[2]) > 0.999
  chex.assert_trees_all_close(IDW_SOFTMAX(dist(q, keys), power=2.0),
                              N.softmax(-jnp.log(dist(q, keys)), temperature=0.5), atol=1e-6)


def test_gradients_float64_masks_low_precision_tile_rule():
  d, mask = helpers.random_rows(2)
  with jax.enable_x64(True):
    check_grads(lambda d, p: IDW_SOFTMAX(d, where=mask, power=p, eps=1e-4),
                (jnp.asarray(d, jnp.float64), jnp.full((d.shape[0], 1), 2.0, jnp.float64)),
                order=1, modes=("fwd", "rev"))
  df, _ = helpers.random_rows(3, masked=False)
  helpers.check_low_precision(IDW_SOFTMAX, df, power=2.0)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(IDW_SOFTMAX)


def test_posinf_distance_takes_the_formula_limit():
  """An infinitely distant key has weight d^-p -> 0 (the others share the row as if it
  were absent: numpy float64 from the formula); a row of only +inf distances gives 1/k each
  (the limit as they grow together); a NaN row stays NaN."""
  inf = np.inf
  x = np.array([[inf, 1.0, 2.0, 4.0], [inf, inf, -inf, inf], [1.0, inf, inf, 0.5]],
               np.float32)
  got = np.asarray(N.idw_softmax(jnp.asarray(x), power=2.0), np.float64)
  d = np.where(np.isfinite(x), x, 1.0).astype(np.float64)
  e = np.where(np.isfinite(x), (d * d + 1e-12) ** -1.0, 0.0)
  want = e / e.sum(-1, keepdims=True)
  want[1] = [1 / 3, 1 / 3, 0.0, 1 / 3]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  g = np.asarray(jax.jit(jax.grad(lambda v: N.idw_softmax(v)[0, 1]))(jnp.asarray(x)))
  assert np.all(np.isfinite(g)) and g[0, 0] == 0
  nan_row = N.idw_softmax(jnp.array([inf, np.nan, 1.0]))
  assert np.all(np.isnan(np.asarray(nan_row)))
