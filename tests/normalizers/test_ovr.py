"""N33 ovr_sigmoid and gumbel_cdf against float64 numpy closed forms."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
OVR_SIGMOID = jax.jit(N.ovr_sigmoid)
GUMBEL_CDF = jax.jit(N.gumbel_cdf)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _gumbel(x):
  return np.exp(-np.exp(-np.asarray(x, np.float64)))


def test_match_closed_forms_and_their_derivatives():
  x, mask = helpers.random_rows(0, scale=2.0)
  m = np.asarray(mask)
  ct = helpers.random_cotangent(x.shape)
  for fn, ref, dref in [(OVR_SIGMOID, _sigmoid, lambda x: _sigmoid(x) * (1 - _sigmoid(x))),
                        (GUMBEL_CDF, _gumbel, lambda x: np.exp(-x) * _gumbel(x))]:
    out, vjp = jax.vjp(lambda x, f=fn: f(x, where=mask), x)
    chex.assert_trees_all_close(out, np.where(m, ref(x), 0).astype(np.float32), atol=1e-6)
    want = np.where(m, dref(np.asarray(x, np.float64)) * np.asarray(ct), 0)
    chex.assert_trees_all_close(vjp(ct)[0], want.astype(np.float32), atol=1e-6, rtol=1e-5)


def test_no_competition_and_gumbel_shape():
  x = jnp.array([3.0, 2.0, -1.0])
  assert float(OVR_SIGMOID(x).sum()) > 1.0  # several classes above 1/2
  # adding a class leaves the others unchanged (diagonal Jacobian)
  chex.assert_trees_all_close(GUMBEL_CDF(jnp.append(x, 5.0))[:3], GUMBEL_CDF(x))
  np.testing.assert_allclose(GUMBEL_CDF(jnp.zeros(1)), np.exp(-1.0), rtol=1e-7)
  z = jnp.linspace(-30.0, 30.0, 601)
  g = np.asarray(GUMBEL_CDF(z))
  assert np.all(np.diff(g) >= 0) and np.all((g >= 0) & (g <= 1))
  # asymmetric: eta(x) + eta(-x) != 1, unlike the sigmoid
  assert abs(float(jnp.sum(GUMBEL_CDF(jnp.array([1.0, -1.0])))) - 1) > 0.1
  # the one-vs-rest loss is optax's sigmoid BCE of the same logits
  labels = jnp.array([1.0, 0.0, 1.0])
  bce = -(labels * jnp.log(OVR_SIGMOID(x)) + (1 - labels) * jnp.log1p(-OVR_SIGMOID(x)))
  chex.assert_trees_all_close(bce, optax.sigmoid_binary_cross_entropy(x, labels), atol=1e-6)


def test_gumbel_extreme_logits_finite_gradient():
  x = jnp.array([-1e4, -100.0, -80.0, -5.0, 0.0, 50.0, 1e4])
  g = jax.grad(lambda x: jnp.sum(GUMBEL_CDF(x)))(x)
  assert np.all(np.isfinite(np.asarray(g)))
  assert float(g[0]) == 0.0 and float(GUMBEL_CDF(x)[0]) == 0.0


def test_gradients_float64_masks_low_precision_tile_rules():
  x, mask = helpers.random_rows(1)
  with jax.enable_x64(True):
    for fn in (OVR_SIGMOID, GUMBEL_CDF):
      check_grads(lambda x, f=fn: f(x, where=mask), (jnp.asarray(x, jnp.float64),), order=1,
                  modes=("fwd", "rev"))
  xf, _ = helpers.random_rows(2, masked=False)
  for fn in (OVR_SIGMOID, GUMBEL_CDF):
    helpers.check_low_precision(fn, xf)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(OVR_SIGMOID, GUMBEL_CDF)
