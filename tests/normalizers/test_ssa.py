"""N07 ssa_softmax against a float64 numpy reference of the selective temperature."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking
from tests.normalizers.reference import softmax64

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
SSA_SOFTMAX = jax.jit(N.ssa_softmax)


def _reference(x, mask, alpha=0.0, token_temperature=0.0):
  """float64: softmax(tau x), tau = tau_tok + 1 + sigmoid(alpha) log n, n visible."""
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  n = np.maximum(mask.sum(-1, keepdims=True), 1)
  tau = token_temperature + 1.0 + np.log(n) / (1.0 + np.exp(-alpha))
  return softmax64(tau * x, mask)


def test_matches_reference():
  x, mask = helpers.random_rows(0, scale=2.0)
  tok = np.linspace(-0.5, 0.5, x.shape[0])[:, None]
  for hp in ({}, {"alpha": -2.0}, {"alpha": 1.0, "token_temperature": 0.5},
             {"token_temperature": tok}):
    jhp = {k: jnp.asarray(v, jnp.float32) for k, v in hp.items()}
    chex.assert_trees_all_close(SSA_SOFTMAX(x, where=mask, **jhp),
                                _reference(x, mask, **hp).astype(np.float32), atol=1e-6)


def test_reductions_and_entropy():
  x, mask = helpers.random_rows(1, scale=2.0)
  chex.assert_trees_all_close(SSA_SOFTMAX(x, where=mask, alpha=-60.0),
                              N.softmax(x, where=mask), atol=1e-6)  # tau = 1
  # causal rows: row i sees i + 1 keys, so its temperature is 1 + sigmoid(a) log(i + 1)
  t = 6
  scores = jnp.asarray(np.random.default_rng(2).standard_normal((t, t)), jnp.float32)
  causal = jnp.tril(jnp.ones((t, t), bool))
  got = np.asarray(SSA_SOFTMAX(scores, where=causal, alpha=0.5), np.float64)
  s = 1.0 / (1.0 + np.exp(-0.5))
  for i in range(t):
    z = (1.0 + s * np.log(i + 1)) * np.asarray(scores[i, :i + 1], np.float64)
    np.testing.assert_allclose(got[i, :i + 1], np.exp(z) / np.exp(z).sum(), rtol=1e-5)
  # a larger temperature lowers the entropy
  row = jnp.asarray(np.random.default_rng(3).standard_normal(16), jnp.float32)

  def entropy(w):
    return float(-jnp.sum(w * jnp.log(w)))
  ents = [entropy(SSA_SOFTMAX(row, token_temperature=t)) for t in (-0.5, 0.0, 1.0, 3.0)]
  assert all(a > b for a, b in zip(ents, ents[1:], strict=False))
  # the needle keeps a non-vanishing weight as the row grows
  needle = [float(SSA_SOFTMAX(jnp.zeros(n).at[0].set(2.0), alpha=2.0)[0])
            for n in (64, 4096)]
  assert min(needle) > 0.5


def test_gradients_float64_masks_low_precision_tile_rule():
  x, mask = helpers.random_rows(2)
  rows = x.shape[0]
  with jax.enable_x64(True):
    check_grads(lambda x, a, t: SSA_SOFTMAX(x, where=mask, alpha=a, token_temperature=t),
                (jnp.asarray(x, jnp.float64), jnp.full((rows, 1), -1.0, jnp.float64),
                 jnp.full((rows, 1), 0.3, jnp.float64)), order=1, modes=("fwd", "rev"))
  xf, _ = helpers.random_rows(3, masked=False)
  helpers.check_low_precision(SSA_SOFTMAX, xf, alpha=1.0)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(SSA_SOFTMAX)
