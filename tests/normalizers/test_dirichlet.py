"""N14 dirichlet_resample: the Dirichlet moments (mean p, variance p(1-p)/(alpha+1)), the
expected gradient equals softmax's, masks, keys."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.normalizers import _dirichlet as D
from tests import helpers

DRAWS = 20000
P = np.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
LOGITS = jnp.asarray(np.log(P), jnp.float32)
ALPHA = jnp.array([[5.0], [2.0]])


@jax.jit
def _draws(keys, x, alpha):
  return jax.vmap(lambda k: D.dirichlet_resample(k, x, alpha=alpha))(keys)


def test_moments_are_the_dirichlet_ones():
  keys = jax.random.split(jax.random.key(0), DRAWS)
  d = np.asarray(_draws(keys, LOGITS, ALPHA), np.float64)
  np.testing.assert_allclose(d.sum(-1), 1.0, atol=1e-5)
  assert np.all(d >= 0)
  # standard error of each mean <= sqrt(0.25 / 3 / DRAWS) = 0.002: 0.012 is 6 sigma
  np.testing.assert_allclose(d.mean(0), P, atol=0.012)
  a = np.asarray(ALPHA)
  np.testing.assert_allclose(d.var(0), P * (1 - P) / (a + 1), rtol=0.12)
  # alpha -> inf: the draw is p itself
  big = np.asarray(_draws(keys[:64], LOGITS, jnp.full((2, 1), 1e7)))
  np.testing.assert_allclose(big, np.broadcast_to(P, big.shape), atol=2e-3)


def test_expected_gradient_is_the_gradient_of_the_mean():
  """The reparameterisation gradient is unbiased: E[d<p~, ct>/dx] = d<softmax(x), ct>/dx."""
  ct = jnp.array([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, -1.0, 2.0]])
  keys = jax.random.split(jax.random.key(1), DRAWS)
  grads = jax.jit(jax.vmap(jax.grad(
      lambda x, k: jnp.sum(D.dirichlet_resample(k, x, alpha=ALPHA) * ct)),
      in_axes=(None, 0)))(LOGITS, keys)
  want = jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) * ct))(LOGITS)
  se = np.asarray(grads).std(0) / np.sqrt(DRAWS)
  np.testing.assert_allclose(np.asarray(grads).mean(0), want, atol=float(6 * se.max() + 1e-3))


def test_masked_entries_are_zero_and_the_row_is_the_visible_dirichlet():
  x = jnp.asarray(helpers.rows(2, (3, 6), 1.0))
  where = jnp.array([[True] * 6, [True, False, True, True, False, True], [False] * 6])
  keys = jax.random.split(jax.random.key(2), DRAWS // 4)
  d = np.asarray(jax.jit(jax.vmap(lambda k: D.dirichlet_resample(k, x, where=where,
                                                                  alpha=4.0)))(keys))
  mask = np.asarray(where)
  assert np.all(d[:, ~mask] == 0)
  assert np.all(d[:, 2] == 0)  # nothing visible
  p = np.asarray(jax.nn.softmax(x, where=where), np.float64)
  np.testing.assert_allclose(d.mean(0)[:2], p[:2], atol=0.02)
  g = jax.jit(jax.grad(lambda v: jnp.sum(D.dirichlet_resample(keys[0], v, where=where) ** 2)))(x)
  assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[~mask] == 0)


def test_keys_same_key_same_draw_and_bad_keys_raise():
  k = jax.random.key(3)
  a = D.dirichlet_resample(k, LOGITS)
  np.testing.assert_array_equal(a, D.dirichlet_resample(k, LOGITS))
  np.testing.assert_array_equal(a, D.dirichlet_resample(jax.random.key_data(k), LOGITS))
  assert not np.array_equal(a, D.dirichlet_resample(jax.random.key(4), LOGITS))
  helpers.check_raises(
      ("key", lambda: D.dirichlet_resample(None, LOGITS)),
      ("key", lambda: D.dirichlet_resample(jnp.zeros(3), LOGITS)),
      ("key", lambda: D.dirichlet_resample(jax.random.split(k, 2), LOGITS)),
      ("alpha", lambda: D.dirichlet_resample(k, LOGITS, alpha=0.0)))
