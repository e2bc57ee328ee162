"""N18 asentmax against a float64 numpy reference: alpha-entmax by bisection of the scaled row."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
ASENTMAX = jax.jit(N.asentmax, static_argnames=("alpha",))


def _entmax_row(z, alpha):
  """float64 alpha-entmax of one row by 200 bisection steps on tau."""
  if alpha == 1.0:
    e = np.exp(z - z.max())
    return e / e.sum()
  y = (alpha - 1.0) * z
  q = 1.0 / (alpha - 1.0)
  lo, hi = y.max() - 1.0, y.max()
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if np.sum(np.maximum(y - mid, 0.0) ** q) >= 1.0:
      lo = mid
    else:
      hi = mid
  p = np.maximum(y - lo, 0.0) ** q
  return p / p.sum()


def _reference(x, mask, alpha=1.5, delta=1.0, beta=0.5, gamma=1.0):
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  for r in range(x.shape[0]):
    vis = np.asarray(mask)[r]
    n = vis.sum()
    if n:
      theta = delta + beta * np.log(n) ** gamma
      out[r, vis] = _entmax_row(theta * x[r, vis], alpha)
  return out


def test_matches_reference():
  x, mask = helpers.random_rows(0, scale=1.5)
  for hp in ({}, {"alpha": 1.25, "beta": 1.0, "gamma": 0.5}, {"alpha": 2.0, "delta": 0.5}):
    chex.assert_trees_all_close(ASENTMAX(x, where=mask, **hp),
                                _reference(x, mask, **hp).astype(np.float32), atol=2e-6)


def test_closed_forms_and_needle():
  x, mask = helpers.random_rows(1, scale=1.5)
  chex.assert_trees_all_close(ASENTMAX(x, where=mask, beta=0.0), N.entmax15(x, where=mask),
                              atol=1e-6)  # theta = 1
  chex.assert_trees_all_close(ASENTMAX(x, where=mask, alpha=2.0, beta=0.0),
                              N.sparsemax(x, where=mask), atol=1e-6)
  # a needle of margin 1 among n - 1 zeros: entmax15's weight fades with n, asentmax's support
  # stays {needle}
  for n in (64, 4096):
    row = jnp.zeros(n).at[0].set(1.0)
    w = np.asarray(ASENTMAX(row, beta=1.0))
    assert w[0] == 1.0 and (w[1:] == 0).all()
  dense = [np.asarray(N.entmax15(jnp.zeros(n).at[0].set(1.0))) for n in (64, 4096)]
  assert dense[1][0] < dense[0][0] < 0.5 and (dense[1] > 0).all()  # fading, dense support


def test_gradients_float64_masks_low_precision_threshold_rule():
  x, mask = helpers.random_rows(2, scale=1.0)
  rows = x.shape[0]
  with jax.enable_x64(True):
    # (the gradient in alpha is entmax's own closed form, tested in test_entmax.py)
    check_grads(lambda x, b, g: ASENTMAX(x, where=mask, beta=b, gamma=g),
                (jnp.asarray(x, jnp.float64), jnp.full((rows, 1), 1.0, jnp.float64),
                 jnp.full((rows, 1), 0.7, jnp.float64)), order=1, modes=("fwd", "rev"))
  xf, _ = helpers.random_rows(3, masked=False)
  helpers.check_low_precision(ASENTMAX, xf, beta=1.0)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(ASENTMAX)
