"""N25 sa_softmax and sa_softmax_normalized against float64 numpy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests.normalizers import masking

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
SA_SOFTMAX = jax.jit(N.sa_softmax)
SA_SOFTMAX_NORMALIZED = jax.jit(N.sa_softmax_normalized)


def _softmax(x, mask):
  e = np.where(mask, np.exp(x - np.max(np.where(mask, x, -np.inf), -1, keepdims=True)), 0.0)
  s = e.sum(-1, keepdims=True)
  return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def _reference(x, mask, normalized=False):
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  p = _softmax(x, mask)
  if not normalized:
    return np.where(mask, x * p, 0.0)
  lo = np.minimum(np.min(np.where(mask, x, np.inf), -1, keepdims=True), 0.0)
  hi = np.maximum(np.max(np.where(mask, x, -np.inf), -1, keepdims=True), 0.0)
  f = np.divide(x - lo, hi - lo, out=np.zeros_like(x), where=(hi - lo) > 0)
  return np.where(mask, f * p, 0.0)


def _reference_vjp(x, mask, ct):
  """d(x_i p_i)/dx_j = delta_ij p_i + x_i p_i (delta_ij - p_j)."""
  x, ct = np.asarray(x, np.float64), np.asarray(ct, np.float64)
  p = _softmax(x, mask)
  u = ct * x * p
  return np.where(mask, ct * p + u - p * u.sum(-1, keepdims=True), 0.0)


def test_matches_reference_and_jacobian():
  x, mask = helpers.random_rows(0, scale=2.0)
  ct = helpers.random_cotangent(x.shape)
  out, vjp = jax.vjp(lambda x: SA_SOFTMAX(x, where=mask), x)
  chex.assert_trees_all_close(out, _reference(x, mask).astype(np.float32), atol=1e-6)
  chex.assert_trees_all_close(vjp(ct)[0], _reference_vjp(x, mask, ct).astype(np.float32),
                              atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(SA_SOFTMAX_NORMALIZED(x, where=mask),
                              _reference(x, mask, True).astype(np.float32), atol=1e-6)


def test_properties():
  x, mask = helpers.random_rows(1, scale=2.0)
  assert float(SA_SOFTMAX(jnp.zeros(4)).sum()) == 0.0  # SA(0) = 0
  assert float(SA_SOFTMAX(jnp.array([1.0, -2.0]))[1]) < 0  # can be negative
  w = np.asarray(SA_SOFTMAX_NORMALIZED(x, where=mask))
  assert (w >= 0).all() and (w <= np.asarray(N.softmax(x, where=mask)) + 1e-7).all()
  assert (w.sum(-1) <= 1 + 1e-6).all()
  # saturation: softmax's gradient vanishes, SA's diagonal tends to 1 ("enhanced gradient")
  sat = jnp.array([12.0, 0.0, -1.0])
  g_sa = jax.grad(lambda v: SA_SOFTMAX(v)[0])(sat)
  g_sm = jax.grad(lambda v: N.softmax(v)[0])(sat)
  assert float(g_sm[0]) < 1e-4 and abs(float(g_sa[0]) - 1.0) < 1e-3
  assert not np.allclose(SA_SOFTMAX(x + 1.0, where=mask), SA_SOFTMAX(x, where=mask))


def test_gradients_float64():
  x, mask = helpers.random_rows(2)
  with jax.enable_x64(True):
    x64 = jnp.asarray(x, jnp.float64)
    for fn in (SA_SOFTMAX, SA_SOFTMAX_NORMALIZED):
      check_grads(lambda x, f=fn: f(x, where=mask), (x64,), order=1, modes=("fwd", "rev"))


def test_masks_low_precision_tile_rule_inf():
  xf, _ = helpers.random_rows(3, masked=False)
  for fn in (SA_SOFTMAX, SA_SOFTMAX_NORMALIZED):
    helpers.check_low_precision(fn, xf)
  w = np.asarray(SA_SOFTMAX(jnp.array([jnp.inf, 1.0, -1.0])))
  assert w[0] == np.inf and (w[1:] == 0).all()
  np.testing.assert_array_equal(SA_SOFTMAX_NORMALIZED(jnp.array([jnp.inf, 1.0])), [1.0, 0.0])


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(SA_SOFTMAX, SA_SOFTMAX_NORMALIZED)
