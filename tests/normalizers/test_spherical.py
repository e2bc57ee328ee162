"""N29 spherical_softmax against a float64 numpy reference (the spherical family's form)."""

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
SPHERICAL_SOFTMAX = jax.jit(N.spherical_softmax)


def _reference(x, mask, eps=0.01):
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  q = np.where(mask, x * x + eps, 0.0)
  s = q.sum(-1, keepdims=True)
  return np.divide(q, s, out=np.zeros_like(q), where=s > 0)


def _reference_vjp(x, mask, ct, eps=0.01):
  """Closed form: w = q/S with q = x^2 + eps, dq = 2x: dx_i = 2 x_i (ct_i - <ct, w>) / S."""
  x, ct = np.asarray(x, np.float64), np.asarray(ct, np.float64)
  q = np.where(mask, x * x + eps, 0.0)
  s = q.sum(-1, keepdims=True)
  w = np.divide(q, s, out=np.zeros_like(q), where=s > 0)
  g = 2 * x * (ct - (ct * w).sum(-1, keepdims=True))
  return np.where(mask, np.divide(g, s, out=np.zeros_like(g), where=s > 0), 0.0)


def test_matches_reference_values_and_vjp():
  x, mask = helpers.random_rows(0, scale=2.0)
  ct = helpers.random_cotangent(x.shape)
  for eps in (0.01, 0.5):
    out, vjp = jax.vjp(lambda x, e=eps: SPHERICAL_SOFTMAX(x, where=mask, eps=e), x)
    chex.assert_trees_all_close(out, _reference(x, mask, eps).astype(np.float32), atol=1e-6)
    chex.assert_trees_all_close(vjp(ct)[0], _reference_vjp(x, mask, ct, eps).astype(np.float32),
                                atol=1e-5, rtol=1e-4)


def test_even_not_shift_invariant_polynomial_tail():
  x = jnp.array([[3.0, -1.0, 0.5, 0.0]])
  chex.assert_trees_all_close(SPHERICAL_SOFTMAX(x), SPHERICAL_SOFTMAX(-x), atol=0)
  assert not np.allclose(SPHERICAL_SOFTMAX(x + 1.0), SPHERICAL_SOFTMAX(x))
  w = SPHERICAL_SOFTMAX(jnp.array([100.0, 0.0, 1.0]), eps=0.0 + 1e-9)
  np.testing.assert_allclose(w[2] / w[0], 1e-4, rtol=1e-5)  # (1/100)^2, not e^-99
  chex.assert_trees_all_close(SPHERICAL_SOFTMAX(jnp.zeros(5)), jnp.full(5, 0.2))


def test_gradients_float64_including_eps():
  x, mask = helpers.random_rows(1)
  with jax.enable_x64(True):
    args = (jnp.asarray(x, jnp.float64), jnp.full((x.shape[0], 1), 0.3, jnp.float64))
    check_grads(lambda x, e: SPHERICAL_SOFTMAX(x, where=mask, eps=e), args, order=1,
                modes=("fwd", "rev"))


def test_masks_low_precision_tile_rule():
  """Masked rows == the reference of the rows with those entries deleted, bf16/fp16 == the
  reference up to one rounding, and the chunked attention path == dense float64 attention
  (tests.reference_f64)."""
  ref64.check_masks_low_precision_tile_rule(SPHERICAL_SOFTMAX, "spherical_softmax", _reference,
                                            {"eps": 0.3})


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(SPHERICAL_SOFTMAX)
