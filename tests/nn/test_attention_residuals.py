"""Block Attention Residuals (A46) against a NumPy float64 loop written from the formula: the
depth-wise softmax over RMS-normalised block summaries, its mean limit, order invariance and
gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises


def _reference(v, w, eps=1e-6):
  v = np.asarray(v, np.float64)
  out = np.zeros(v.shape[1:])
  for idx in np.ndindex(*v.shape[1:-1]):
    vs = v[(slice(None),) + idx]                                   # [S, d]
    keys = vs / np.sqrt(np.mean(vs ** 2, axis=-1, keepdims=True) + eps)
    logits = keys @ np.asarray(w, np.float64)
    a = np.exp(logits - logits.max())
    out[idx] = (a / a.sum()) @ vs
  return out


def test_matches_reference_mean_limit_order_and_gradient():
  rng = np.random.default_rng(0)
  v = jnp.asarray(rng.normal(size=(4, 2, 3, 8)) * rng.uniform(0.5, 3.0, (4, 1, 1, 1)),
                  jnp.float32)
  w = jnp.asarray(rng.normal(size=8), jnp.float32)
  perm = jnp.array([2, 0, 3, 1])

  @jax.jit
  def run(v, w):
    f = js.nn.block_attention_residual
    grad_w = jax.grad(lambda w: jnp.sum(f(v, w) ** 2))(w)
    return f(v, w), f(v, jnp.zeros_like(w)), f(v[perm], w), grad_w

  out, mean, permuted, grad_w = run(v, w)
  # float32 against float64 over S = 4 sources, d = 8: a few ulps of O(3) values
  np.testing.assert_allclose(out, _reference(v, w), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(mean, jnp.mean(v, axis=0), atol=1e-6)
  np.testing.assert_allclose(permuted, out, atol=1e-6)
  # the gradient in w against central differences of the float64 reference
  h = 1e-6
  fd = [(np.sum(_reference(v, np.asarray(w, np.float64) + h * e) ** 2)
         - np.sum(_reference(v, np.asarray(w, np.float64) - h * e) ** 2)) / (2 * h)
        for e in np.eye(8)]
  np.testing.assert_allclose(grad_w, fd, rtol=2e-4, atol=2e-4)
  # a convex combination: inside the sources' per-coordinate range
  assert np.all(out <= v.max(0) + 1e-5) and np.all(out >= v.min(0) - 1e-5)


@pytest.mark.slow
def test_bf16_and_bad_input():
  v = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 4)), jnp.float32)
  w = jnp.ones(4)
  lo = js.nn.block_attention_residual(v.astype(jnp.bfloat16), w)
  assert lo.dtype == jnp.bfloat16
  # bf16 inputs and output rounding: 2^-8 relative on O(1) values
  np.testing.assert_allclose(np.asarray(lo, np.float32), js.nn.block_attention_residual(v, w),
                             atol=3e-2)
  check_raises(
      (r"block_attention_residual: `query` must be \[d\]",
       lambda: js.nn.block_attention_residual(v, jnp.ones(3))),
      (r"block_attention_residual: `sources` must be a floating",
       lambda: js.nn.block_attention_residual(jnp.ones(4), w)),
  )
