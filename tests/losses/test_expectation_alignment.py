"""ExpAlign's Expectation Alignment Head and geometry-consistency loss against numpy float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises, normal

L = js.losses


def _expectation_ref(s, tau, mask=None):
  s = np.asarray(s, np.float64)
  mask = np.ones(s.shape, bool) if mask is None else np.broadcast_to(mask, s.shape)
  out = np.zeros(s.shape[:-1])
  for idx in np.ndindex(*s.shape[:-1]):
    row, m = s[idx][mask[idx]], None
    if row.size:
      a = np.exp(row / tau - np.max(row / tau))
      a /= a.sum()
      out[idx] = np.sum(a * row)
    del m
  return out


def _geometry_ref(s, g, tau, mask=None):
  s, g = np.asarray(s, np.float64), np.asarray(g, np.float64)
  mask = np.ones(s.shape, bool) if mask is None else np.broadcast_to(mask, s.shape)
  out = np.zeros(s.shape[:-1])
  for idx in np.ndindex(*s.shape[:-1]):
    z, q = s[idx][mask[idx]] / tau, g[idx][mask[idx]]
    if z.size and q.sum() > 0:
      lse = np.log(np.sum(np.exp(z - z.max()))) + z.max()
      out[idx] = lse - np.sum(q / q.sum() * z)
  return out


# float32 against float64 over <= 7 entries of magnitude <= ~10: a few ulps of the result
TOL = dict(rtol=2e-5, atol=2e-5)


def test_expectation_alignment_matches_float64_reference_and_bounds():
  s = normal(0, (3, 4, 7), 2.0)
  perm = np.random.default_rng(0).permutation(7)
  taus = (0.3, 1.0, 4.0)
  results = jax.jit(lambda s: [(L.expectation_alignment(s, temperature=t),
                                L.expectation_alignment(s[..., perm], temperature=t))
                               for t in taus])(s)  # one compilation for the three
  for tau, (out, permuted) in zip(taus, results, strict=True):
    np.testing.assert_allclose(out, _expectation_ref(s, tau), **TOL)
    assert np.all(out >= s.min(-1) - 1e-6) and np.all(out <= s.max(-1) + 1e-6)
    # permutation invariance over tokens
    np.testing.assert_allclose(permuted, out, rtol=1e-6, atol=1e-6)


def test_expectation_alignment_limits_mean_and_max():
  # rows of distinct values 0.4 apart: at tau = 1e-3 the runner-up weighs e^-400
  s = jnp.asarray(np.stack([np.random.default_rng(i).permutation(6) for i in range(5)])
                  * 0.4 - 1.0, jnp.float32)
  hot, cold = jax.jit(lambda s: (L.expectation_alignment(s, temperature=1e4),
                                 L.expectation_alignment(s, temperature=1e-3)))(s)
  np.testing.assert_allclose(hot, s.mean(-1), atol=2e-4)  # deviation ~ var(s)/tau = 4.7e-5
  np.testing.assert_allclose(cold, s.max(-1), atol=1e-5)


@pytest.mark.slow
def test_expectation_alignment_mask_axis_and_gradient():
  s = normal(2, (2, 3, 5), 2.0)
  mask = jax.random.bernoulli(jax.random.key(3), 0.6, s.shape).at[0, 0].set(False)

  @jax.jit
  def run(s, mask):
    f = lambda x: L.expectation_alignment(x, temperature=0.7, where=mask)
    out, vjp = jax.vjp(f, s)
    a = jnp.where(mask, jax.nn.softmax(jnp.where(mask, s / 0.7, -jnp.inf), axis=-1), 0.0)
    return (out, vjp(jnp.ones_like(out))[0], a * (1 + (s - out[..., None]) / 0.7),
            L.expectation_alignment(jnp.moveaxis(s, -1, 0), axis=0),
            L.expectation_alignment(s), L.expectation_alignment(s, axis=(1, 2)))

  out, g, g_ref, moved, plain, merged = run(s, mask)
  np.testing.assert_allclose(out, _expectation_ref(s, 0.7, np.asarray(mask)), **TOL)
  assert out[0, 0] == 0
  # the token axis elsewhere, and two axes pooled as one
  np.testing.assert_allclose(moved, plain, rtol=1e-6)
  np.testing.assert_allclose(merged, _expectation_ref(s.reshape(2, 15), 1.0), **TOL)
  # the gradient a (1 + (s - S)/tau), and a fully masked row's is zero
  np.testing.assert_allclose(g, g_ref, atol=1e-5)
  np.testing.assert_array_equal(g[0, 0], 0.0)


def test_geometry_consistency_loss_matches_reference_gradient_and_optimum():
  s = normal(4, (4, 6), 2.0)
  g = jax.random.uniform(jax.random.key(5), (4, 6)).at[1].set(0.0)  # row 1: no geometry mass
  mask = jnp.ones((4, 6), bool).at[2, :3].set(False)
  q0 = jnp.array([0.5, 0.3, 0.2])
  onehot = jax.nn.one_hot(jnp.array([0, 3, 5, 1]), 6)

  @jax.jit
  def run(s, g, mask):
    grad = jax.grad(lambda x: jnp.sum(L.geometry_consistency_loss(x, g, temperature=0.5)))(s)
    q = g / jnp.maximum(g.sum(-1, keepdims=True), 1e-30)
    ref = jnp.where(g.sum(-1, keepdims=True) > 0, (jax.nn.softmax(s / 0.5, -1) - q) / 0.5, 0.0)
    return (L.geometry_consistency_loss(s, g, temperature=0.5, where=mask), grad, ref,
            L.geometry_consistency_loss(jnp.log(q0) * 2.0, q0 * 7.0, temperature=2.0),
            L.geometry_consistency_loss(s, onehot), L.softmax_cross_entropy(s, onehot))

  out, grad, grad_ref, at_opt, hot, ce = run(s, g, mask)
  np.testing.assert_allclose(out, _geometry_ref(s, g, 0.5, np.asarray(mask)), **TOL)
  assert out[1] == 0
  np.testing.assert_allclose(grad, grad_ref, atol=1e-5)
  # at softmax(s / tau) = q the loss is the entropy H(q) (its minimum)
  np.testing.assert_allclose(at_opt, -jnp.sum(q0 * jnp.log(q0)), rtol=1e-6)
  # one-hot geometry is softmax cross-entropy
  np.testing.assert_allclose(hot, ce, rtol=1e-6)


@pytest.mark.slow
def test_bf16_and_float64_dtypes():
  s = normal(6, (3, 8), 2.0)
  g = jax.random.uniform(jax.random.key(7), (3, 8))
  fns = (lambda s, g: L.expectation_alignment(s), L.geometry_consistency_loss)
  hi = jax.jit(lambda s, g: [f(s, g) for f in fns])(s, g)
  lo = jax.jit(lambda s, g: [f(s, g) for f in fns])(s.astype(jnp.bfloat16),
                                                    g.astype(jnp.bfloat16))
  for h, low in zip(hi, lo, strict=True):
    assert low.dtype == jnp.bfloat16
    # the bf16 inputs are rounded (2^-8 relative on |s| <= ~6): ~0.05 absolute
    np.testing.assert_allclose(np.asarray(low, np.float32), h, atol=0.08, rtol=0.02)
  with jax.enable_x64(True):
    s64 = np.asarray(s, np.float64)
    out = L.expectation_alignment(jnp.asarray(s64), temperature=0.5)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, _expectation_ref(s64, 0.5), rtol=1e-12)


def test_bad_inputs_name_the_argument():
  s = jnp.ones((2, 3))
  check_raises(
      (r"expectation_alignment: .*temperature", lambda: L.expectation_alignment(s,
                                                                                temperature=0.0)),
      (r"expectation_alignment: `similarity` must have an axis",
       lambda: L.expectation_alignment(jnp.float32(1.0))),
      (r"geometry_consistency_loss: `geometry` of shape",
       lambda: L.geometry_consistency_loss(s, jnp.ones((2, 4)))),
      (r"geometry_consistency_loss: `geometry` must be >= 0",
       lambda: L.geometry_consistency_loss(s, -jnp.ones((2, 3)))),
  )
