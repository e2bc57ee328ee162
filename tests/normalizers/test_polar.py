"""N12 polar_softmax against a float64 numpy reference of ATMA's formula."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests import reference_f64 as ref64
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
POLAR_SOFTMAX = jax.jit(N.polar_softmax)


def _softplus(v):
  return np.log1p(np.exp(v))


def _reference(x, mask, alpha=0.0, null_bias=0.0, gamma=0.0):
  """float64: softmax(t [x, nu]) without the null entry, with the row's own n."""
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  out = np.zeros_like(x)
  for r in range(x.shape[0]):
    vis = mask[r]
    n = vis.sum()
    if n == 0:
      continue
    t = 1.0 + _softplus(np.broadcast_to(alpha, (x.shape[0], 1))[r, 0]) * np.log(n)
    nu = (np.broadcast_to(null_bias, (x.shape[0], 1))[r, 0]
          + _softplus(np.broadcast_to(gamma, (x.shape[0], 1))[r, 0]) * np.sqrt(np.log(n + 1)))
    logits = t * np.append(x[r, vis], nu)
    e = np.exp(logits - logits.max())
    out[r, vis] = (e / e.sum())[:-1]
  return out


def test_matches_reference():
  x, mask = helpers.random_rows(0, scale=2.0)
  for hp in ({}, {"alpha": -1.0, "null_bias": 1.5, "gamma": 1.0}):
    chex.assert_trees_all_close(POLAR_SOFTMAX(x, where=mask, **hp),
                                _reference(x, mask, **hp).astype(np.float32), atol=1e-6)
  alpha = np.linspace(-2.0, 2.0, x.shape[0])[:, None]
  chex.assert_trees_all_close(
      POLAR_SOFTMAX(x, where=mask, alpha=jnp.asarray(alpha, jnp.float32)),
      _reference(x, mask, alpha).astype(np.float32), atol=1e-6)


def test_null_absorbs_mass_and_grows_with_length():
  # the null weight rises as every score falls below nu
  sums = [float(POLAR_SOFTMAX(jnp.full(8, s)).sum()) for s in (3.0, 1.0, 0.0, -2.0)]
  assert all(a > b for a, b in zip(sums, sums[1:], strict=False)) and sums[-1] < 0.01
  # equals softmax_sink with the sink t*nu on scores t*x
  x = jnp.array([1.0, -0.5, 0.3, 2.0, 0.0])
  t = 1.0 + np.log(2.0) * np.log(5.0)
  nu = np.log(2.0) * np.sqrt(np.log(6.0))
  chex.assert_trees_all_close(POLAR_SOFTMAX(x), N.softmax_sink(t * x, sink_logit=t * nu),
                              atol=1e-6)
  # zero scores: the null logit grows like sqrt(log n), so the null share grows with n
  null = [1.0 - float(POLAR_SOFTMAX(jnp.zeros(n)).sum()) for n in (4, 4096)]
  assert null[0] < null[1]


def test_gradients_float64_and_extreme_logits():
  x, mask = helpers.random_rows(1)
  rows = x.shape[0]
  with jax.enable_x64(True):
    args = (jnp.asarray(x, jnp.float64), jnp.full((rows, 1), -1.0, jnp.float64),
            jnp.full((rows, 1), 1.5, jnp.float64), jnp.full((rows, 1), 1.0, jnp.float64))
    check_grads(lambda x, a, b, g: POLAR_SOFTMAX(x, where=mask, alpha=a, null_bias=b, gamma=g),
                args, order=1, modes=("fwd", "rev"))
  big = jnp.array([[-500.0, -600.0, -700.0], [800.0, 700.0, -800.0]])
  w = POLAR_SOFTMAX(big, null_bias=0.0)
  assert np.all(np.isfinite(np.asarray(w))) and float(w[0].sum()) == 0.0
  chex.assert_trees_all_close(w[1], jnp.array([1.0, 0.0, 0.0]), atol=1e-6)


def test_masks_low_precision_tile_rule():
  """Masked rows == the reference of the rows with those entries deleted (n counts only
  the visible entries), bf16/fp16 == the reference up to one rounding, and the chunked
  attention path == dense float64 attention (tests.reference_f64)."""
  ref64.check_masks_low_precision_tile_rule(
      POLAR_SOFTMAX, "polar_softmax", _reference,
      {"alpha": -1.0, "null_bias": 1.5, "gamma": 1.0})


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(POLAR_SOFTMAX)
