"""N04 clipped_softmax against a float64 numpy reference written from the paper's formula."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
CLIPPED_SOFTMAX = jax.jit(N.clipped_softmax)


def _reference(x, mask, zeta=1.0, gamma=-0.03):
  """float64: clip((zeta - gamma) softmax(x) + gamma, 0, 1) on the visible entries."""
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  e = np.where(mask, np.exp(x - np.max(np.where(mask, x, -np.inf), -1, keepdims=True)), 0.0)
  s = e.sum(-1, keepdims=True)
  p = np.divide(e, s, out=np.zeros_like(e), where=s > 0)
  return np.where(mask, np.clip((zeta - gamma) * p + gamma, 0.0, 1.0), 0.0)


def test_matches_reference_with_scalar_and_per_row_parameters():
  x, mask = helpers.random_rows(0, scale=2.0)
  for hp in ({}, {"zeta": 1.05, "gamma": -0.1}):
    chex.assert_trees_all_close(CLIPPED_SOFTMAX(x, where=mask, **hp),
                                _reference(x, mask, **hp).astype(np.float32), atol=1e-6)
  zeta = np.linspace(1.0, 1.2, x.shape[0])[:, None]
  gamma = -np.linspace(0.0, 0.2, x.shape[0])[:, None]
  chex.assert_trees_all_close(
      CLIPPED_SOFTMAX(x, where=mask, zeta=jnp.asarray(zeta, jnp.float32),
                        gamma=jnp.asarray(gamma, jnp.float32)),
      _reference(x, mask, zeta, gamma).astype(np.float32), atol=1e-6)


def test_exact_zeros_and_ones_and_softmax_limit():
  x = jnp.array([[4.0, 1.5, -1.0, -3.0], [9.0, 0.0, 0.0, 0.0]])
  w = np.asarray(CLIPPED_SOFTMAX(x, zeta=1.05, gamma=-0.03))
  assert (w[0, 2:] == 0).all() and (w[0, :2] > 0).all()  # p < 0.03/1.08 -> exact 0
  assert w[1, 0] == 1.0  # (1.08 p - 0.03) >= 1 once p >= 0.954: exactly 1
  chex.assert_trees_all_close(CLIPPED_SOFTMAX(x, zeta=1.0, gamma=0.0),
                              jax.nn.softmax(x, axis=-1), atol=1e-7)
  # zeta = 1: each weight <= softmax's, rows sum to at most 1
  x, mask = helpers.random_rows(1, scale=3.0)
  w = np.asarray(CLIPPED_SOFTMAX(x, where=mask, gamma=-0.2))
  assert (w <= np.asarray(N.softmax(x, where=mask)) + 1e-7).all()
  assert (w.sum(-1) <= 1 + 1e-6).all()


def test_gradients_float64():
  x, mask = helpers.random_rows(2, scale=0.5)
  with jax.enable_x64(True):
    x64 = jnp.asarray(x, jnp.float64)
    rows = x.shape[0]
    zeta = jnp.full((rows, 1), 1.05, jnp.float64)
    gamma = jnp.full((rows, 1), -0.02, jnp.float64)
    # no weight sits at a clip boundary here (checked), so the map is smooth around x
    w = np.asarray(CLIPPED_SOFTMAX(x64, where=mask, zeta=zeta, gamma=gamma))
    assert not np.any(np.isclose(w[np.asarray(mask)], 0.0, atol=1e-3) & (w[np.asarray(mask)] > 0))
    check_grads(lambda x, z, g: CLIPPED_SOFTMAX(x, where=mask, zeta=z, gamma=g),
                (x64, zeta, gamma), order=1, modes=("fwd", "rev"))


def test_masks_low_precision_and_inf_limit():
  x, _ = helpers.random_rows(3, masked=False)
  helpers.check_low_precision(CLIPPED_SOFTMAX, x, zeta=1.05, gamma=-0.05)
  # two +inf logits: the clipped limit of 1/2 each
  w = CLIPPED_SOFTMAX(jnp.array([jnp.inf, 1.0, jnp.inf]), zeta=1.1, gamma=-0.1)
  np.testing.assert_allclose(w, [0.5 * 1.2 - 0.1, 0.0, 0.5], rtol=1e-6)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(CLIPPED_SOFTMAX)
