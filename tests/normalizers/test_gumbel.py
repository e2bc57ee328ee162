"""N13 Gumbel-softmax: the soft sample, the straight-through hard sample, Gumbel-max."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

KEY = jax.random.key(42)
X = helpers.rows(0, (4, 6))


def _soft_oracle(key, x, tau):
  """softmax((x + g) / tau) with g drawn by the documented convention (jax.random.gumbel)."""
  g = jax.random.gumbel(key, x.shape, jnp.float32)
  return jax.nn.softmax((x + g) / tau)


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_soft_sample_matches_oracle_values_and_gradient(tau):
  ct = helpers.random_cotangent(X.shape)
  out, vjp = jax.vjp(lambda x, t: N.gumbel_softmax(KEY, x, tau=t), X, tau)
  want, vjp_want = jax.vjp(lambda x, t: _soft_oracle(KEY, x, t), X, tau)
  chex.assert_trees_all_close(out, want, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(vjp(ct), vjp_want(ct), atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(out) > 0)  # interior of the simplex
  chex.assert_trees_all_close(out.sum(-1), jnp.ones(4), atol=1e-6)


def test_deterministic_given_key_and_different_across_keys():
  a = N.gumbel_softmax(KEY, X)
  chex.assert_trees_all_equal(a, N.gumbel_softmax(KEY, X))
  assert not np.allclose(a, N.gumbel_softmax(jax.random.key(1), X))


def test_hard_is_one_hot_with_straight_through_gradient():
  ct = helpers.random_cotangent(X.shape)
  hard, vjp_h = jax.vjp(lambda x: N.gumbel_softmax(KEY, x, tau=0.5, hard=True), X)
  soft, vjp_s = jax.vjp(lambda x: N.gumbel_softmax(KEY, x, tau=0.5), X)
  # Exactly one-hot at the argmax of the soft sample.
  want = jax.nn.one_hot(jnp.argmax(soft, -1), 6)
  chex.assert_trees_all_equal(hard, want)
  assert set(np.unique(np.asarray(hard))) <= {0.0, 1.0}
  chex.assert_trees_all_close(vjp_h(ct), vjp_s(ct), atol=1e-7)
  # The gradient of the soft sample, computed independently.
  chex.assert_trees_all_close(vjp_h(ct), jax.vjp(lambda x: _soft_oracle(KEY, x, 0.5), X)[1](ct),
                              atol=1e-5)


def test_masked_entries_never_win():
  x = X.at[:, 2].set(50.0)  # would always win if visible
  where = jnp.ones(X.shape, bool).at[:, 2].set(False)
  keys = jax.random.split(KEY, 50)
  hard = jax.vmap(lambda k: N.gumbel_softmax(k, x, hard=True, where=where))(keys)
  assert np.all(np.asarray(hard[..., 2]) == 0)
  chex.assert_trees_all_close(hard.sum(-1), jnp.ones((50, 4)))
  soft = N.gumbel_softmax(KEY, x, where=where)
  assert np.all(np.asarray(soft[:, 2]) == 0)
  # -inf scores are masked too.
  soft = N.gumbel_softmax(KEY, X.at[:, 3].set(-jnp.inf), hard=True)
  assert np.all(np.asarray(soft[:, 3]) == 0)


@pytest.mark.parametrize("masked", [False, True])
def test_gumbel_max_frequencies_match_softmax_chi_square(masked):
  # Many rows of the same logits: each row is an independent draw with one key.
  logits = jnp.asarray([1.0, 0.0, -1.0, 0.5, -0.5], jnp.float32)
  where = jnp.asarray([True, True, not masked, True, True])
  draws = 20000
  x = jnp.broadcast_to(logits, (draws, 5))
  hard = N.gumbel_softmax(jax.random.key(7), x, tau=0.7, hard=True, where=where)
  counts = np.asarray(hard.sum(0), np.float64)
  assert counts.sum() == draws
  p = np.asarray(jax.nn.softmax(logits, where=where), np.float64)
  vis = np.asarray(where)
  assert np.all(counts[~vis] == 0)
  stat = np.sum((counts[vis] - draws * p[vis]) ** 2 / (draws * p[vis]))
  # A fixed key makes this deterministic; the 0.999 quantile keeps a correct sampler far
  # from the bound while a wrong one (e.g. softmax(x / tau) frequencies) lands far above.
  assert stat < scipy.stats.chi2.ppf(0.999, vis.sum() - 1), (counts, draws * p)
  wrong = np.asarray(jax.nn.softmax(logits / 0.7, where=where), np.float64)
  stat_wrong = np.sum((counts[vis] - draws * wrong[vis]) ** 2 / (draws * wrong[vis]))
  assert stat_wrong > scipy.stats.chi2.ppf(0.999, vis.sum() - 1)


def test_temperature_limits():
  cold = N.gumbel_softmax(KEY, X, tau=1e-3)
  chex.assert_trees_all_close(cold.max(-1), jnp.ones(4), atol=1e-3)
  hot = N.gumbel_softmax(KEY, X, tau=1e4)
  chex.assert_trees_all_close(hot, jnp.full(X.shape, 1 / 6), atol=1e-3)


def test_shift_invariant_with_the_same_key():
  chex.assert_trees_all_close(N.gumbel_softmax(KEY, X + 3.0), N.gumbel_softmax(KEY, X),
                              atol=1e-6)


@pytest.mark.parametrize("hard", [False, True])
def test_fully_masked_row(hard):
  where = jnp.ones(X.shape, bool).at[0].set(False)
  out = N.gumbel_softmax(KEY, X, hard=hard, where=where)
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.isfinite(np.asarray(out)))
  g = jax.grad(lambda x: jnp.sum(N.gumbel_softmax(KEY, x, hard=hard, where=where) ** 2))(X)
  assert np.all(np.asarray(g[0]) == 0) and np.all(np.isfinite(np.asarray(g)))
  out = N.gumbel_softmax(KEY, X.at[1].set(-jnp.inf), hard=hard)
  assert np.all(np.asarray(out[1]) == 0)


def test_low_precision_and_jit_vmap():
  for dt in (jnp.bfloat16, jnp.float16):
    out = N.gumbel_softmax(KEY, X.astype(dt))
    assert out.dtype == dt
    chex.assert_trees_all_close(out.astype(jnp.float32),
                                N.gumbel_softmax(KEY, X.astype(dt).astype(jnp.float32)),
                                atol=1e-2)
    hard = N.gumbel_softmax(KEY, X.astype(dt), hard=True)
    assert hard.dtype == dt and np.all(np.asarray(hard.sum(-1), np.float32) == 1)
  f = jax.jit(lambda k, x: N.gumbel_softmax(k, x, tau=0.5, hard=True))
  chex.assert_trees_all_equal(f(KEY, X), N.gumbel_softmax(KEY, X, tau=0.5, hard=True))
  keys = jax.random.split(KEY, 4)
  v = jax.vmap(lambda k, r: N.gumbel_softmax(k, r))(keys, X)
  for i in range(4):
    chex.assert_trees_all_close(v[i], N.gumbel_softmax(keys[i], X[i]), atol=1e-7)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5)))
    check_grads(jax.jit(lambda x, t: N.gumbel_softmax(KEY, x, tau=t)), (x, jnp.float64(0.8)),
                order=2)


def test_specs():
  soft, hard = N.get("gumbel_softmax"), N.get("gumbel_softmax_hard")
  assert soft.kernel_class == hard.kernel_class == "X"
  assert soft.needs_key and hard.needs_key and soft.tile is None
  chex.assert_trees_all_equal(hard.fn(KEY, X), N.gumbel_softmax(KEY, X, hard=True))


def test_bad_input():
  with pytest.raises(ValueError, match="`tau`"):
    N.gumbel_softmax(KEY, X, tau=-1.0)
  with pytest.raises(ValueError, match="`tau`"):
    N.gumbel_softmax(KEY, X, tau=0.0)
  with pytest.raises(ValueError, match="`axis`"):
    N.gumbel_softmax(KEY, X, axis=3)
