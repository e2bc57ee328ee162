"""N27 affine_softmax against a float64 numpy reference written from the paper's formula."""

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
AFFINE_SOFTMAX = jax.jit(N.affine_softmax)


def _reference(x, mask, alpha=1.0, beta=None):
  """float64: alpha softmax(x) + beta, beta = (1 - alpha) / n when None; masked 0."""
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  e = np.where(mask, np.exp(x - np.max(np.where(mask, x, -np.inf), -1, keepdims=True)), 0.0)
  s = e.sum(-1, keepdims=True)
  p = np.divide(e, s, out=np.zeros_like(e), where=s > 0)
  n = mask.sum(-1, keepdims=True)
  b = (1.0 - alpha) / np.maximum(n, 1) if beta is None else beta
  return np.where(mask, alpha * p + b, 0.0)


def test_matches_reference_tied_free_and_per_row():
  x, mask = helpers.random_rows(0, scale=2.0)
  for hp in ({}, {"alpha": 0.3}, {"alpha": 0.7, "beta": 0.05}, {"alpha": 1.5, "beta": -0.02}):
    chex.assert_trees_all_close(AFFINE_SOFTMAX(x, where=mask, **hp),
                                _reference(x, mask, **hp).astype(np.float32), atol=1e-6)
  alpha = np.linspace(0.0, 2.0, x.shape[0])[:, None]
  chex.assert_trees_all_close(
      AFFINE_SOFTMAX(x, where=mask, alpha=jnp.asarray(alpha, jnp.float32)),
      _reference(x, mask, alpha).astype(np.float32), atol=1e-6)


def test_closed_forms():
  x, mask = helpers.random_rows(1, scale=2.0)
  visible = np.asarray(mask).any(-1)
  chex.assert_trees_all_close(AFFINE_SOFTMAX(x, where=mask), N.softmax(x, where=mask),
                              atol=1e-7)  # the defaults are softmax
  w0 = np.asarray(AFFINE_SOFTMAX(x, where=mask, alpha=0.0))  # alpha = 0: uniform
  n = np.asarray(mask).sum(-1, keepdims=True)
  np.testing.assert_allclose(w0[visible], np.where(mask, 1.0 / np.maximum(n, 1), 0)[visible],
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(AFFINE_SOFTMAX(x, where=mask, alpha=0.4)).sum(-1)
                             [visible], 1.0, rtol=1e-6)  # tied bias keeps the sum
  ws = np.asarray(AFFINE_SOFTMAX(x, where=mask, alpha=0.6, beta=0.1)).sum(-1)  # alpha + n b
  np.testing.assert_allclose(ws[visible], 0.6 + 0.1 * n[visible, 0], rtol=1e-6)
  chex.assert_trees_all_close(AFFINE_SOFTMAX(x + 7.0, where=mask, alpha=0.6, beta=0.1),
                              AFFINE_SOFTMAX(x, where=mask, alpha=0.6, beta=0.1), atol=1e-6)


def test_gradients_float64():
  x, mask = helpers.random_rows(2)
  with jax.enable_x64(True):
    rows = x.shape[0]
    args = (jnp.asarray(x, jnp.float64), jnp.full((rows, 1), 0.7, jnp.float64),
            jnp.full((rows, 1), 0.05, jnp.float64))
    check_grads(lambda x, a, b: AFFINE_SOFTMAX(x, where=mask, alpha=a, beta=b), args,
                order=1, modes=("fwd", "rev"))
    check_grads(lambda x, a: AFFINE_SOFTMAX(x, where=mask, alpha=a), args[:2], order=1,
                modes=("rev",))


def test_masks_low_precision_and_tile_rule_against_float64():
  """Masked rows == the reference of the rows with those entries deleted (the tied bias
  counts only the visible n), bf16/fp16 == the reference up to one rounding, and the
  chunked attention path == dense float64 attention (tests.reference_f64)."""
  ref64.check_masks_low_precision_tile_rule(AFFINE_SOFTMAX, "affine_softmax", _reference,
                                            {"alpha": 0.5})


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(AFFINE_SOFTMAX)


def test_posinf_takes_the_formula_limit():
  """As the k visible +inf logits grow together softmax tends to 1/k on them, 0 elsewhere,
  so the weights tend to alpha/k + beta and beta (numpy float64 from the formula), not
  all the mass to the +inf entries; the gradient there is finite."""
  inf = np.inf
  x = np.array([[inf, 1.0, 0.0, -1.0], [inf, 2.0, inf, -inf], [inf, 3.0, 1.0, 2.0]],
               np.float32)
  where = np.array([[True] * 4, [True] * 4, [True, False, True, True]])
  for alpha, beta in ((0.5, None), (0.3, 0.1), (1.7, None)):
    vis = where & (x != -inf)
    n = vis.sum(-1, keepdims=True)
    pos = vis & (x == inf)
    b = (1.0 - alpha) / n if beta is None else beta
    want = np.where(vis, alpha * pos / pos.sum(-1, keepdims=True) + b, 0.0)
    got = N.affine_softmax(jnp.asarray(x), where=jnp.asarray(where), alpha=alpha, beta=beta)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-7)
  g = jax.grad(lambda a: jnp.sum(N.affine_softmax(jnp.asarray(x), alpha=a)[0]))(0.5)
  np.testing.assert_allclose(g, 1.0 - 4 * 0.25, atol=1e-6)  # d/dalpha sum = 1 - n/n = 0


def test_posinf_limit_stays_float64_under_x64():
  """Under x64 a float64 row's +inf limit is computed in float64 (alpha/k + beta exact to
  1e-15), not in float32 (0.8500000238 for 0.85)."""
  with jax.enable_x64(True):
    x = jnp.array([np.inf, 1.0, 0.0, -1.0], jnp.float64)
    got = N.affine_softmax(x, alpha=0.8)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), [0.85, 0.05, 0.05, 0.05], rtol=1e-15)
