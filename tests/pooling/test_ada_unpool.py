"""N35 adaUnPool (``pooling.ada_unpool``) against a numpy float64 oracle of adaPool's
weights: the adjoint of adaPool with its weights fixed, mass conservation, masks, shapes,
gradients, low precision and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import pooling

RNG = np.random.default_rng(3)
X = (2.0 * RNG.standard_normal((4, 6))).astype(np.float32)
Y = RNG.standard_normal(4).astype(np.float32)
Z = RNG.standard_normal((4, 6)).astype(np.float32)
MASK = RNG.random((4, 6)) < 0.7
MASK[0] = True
MASK[1] = False  # an empty pool
MASK[2, :] = False
MASK[2, 4] = True  # one visible entry

UNPOOL = jax.jit(pooling.ada_unpool, static_argnames=("axis",))
POOL = jax.jit(pooling.ada_pool, static_argnames=("axis", "keepdims"))


def _softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def o_omega(x, beta):
  """adaPool's weights of one pool (float64): beta softmax(DSC) + (1 - beta) softmax(x)."""
  x = np.asarray(x, np.float64)
  mean = x.mean()
  den = mean * mean + x * x
  dsc = np.where(den > 0, 2.0 * mean * x / np.where(den > 0, den, 1.0), 1.0)
  b = min(max(beta, 0.0), 1.0)
  return b * _softmax(dsc) + (1.0 - b) * _softmax(x)


def o_unpool(y, x, mask, beta):
  out = np.zeros(x.shape, np.float64)
  for r in range(x.shape[0]):
    if mask[r].any():
      out[r, mask[r]] = float(y[r]) * o_omega(x[r, mask[r]], beta)
  return out


def test_matches_float64_oracle_conserves_mass_and_is_adaPools_adjoint():
  beta = 0.3
  up = UNPOOL(jnp.asarray(Y), jnp.asarray(X), where=jnp.asarray(MASK), beta=beta)
  assert up.shape == X.shape and up.dtype == jnp.float32
  want = o_unpool(Y, X, MASK, beta)
  # float32 softmax weights of 6 entries times |y| <= 3: a few ulp of 1, tol 1e-5
  np.testing.assert_allclose(up, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(up)[~MASK] == 0.0)  # exact zeros off the mask
  # mass: each visible pool sums to y, the empty pool to 0
  np.testing.assert_allclose(np.asarray(up).sum(1), np.where(MASK.any(1), Y, 0.0),
                             rtol=1e-5, atol=1e-6)
  # adjoint of z -> sum_i omega_i(x) z_i, checked against the oracle's weights
  lin = np.array([Y[r] * (o_omega(X[r, MASK[r]], beta) @ Z[r, MASK[r]].astype(np.float64))
                  if MASK[r].any() else 0.0 for r in range(4)])
  np.testing.assert_allclose(np.sum(np.asarray(up, np.float64) * Z, 1), lin,
                             rtol=1e-5, atol=1e-5)
  # and at z = x the linear map is adaPool itself
  ones = UNPOOL(jnp.ones(4), jnp.asarray(X), where=jnp.asarray(MASK), beta=beta)
  pooled = POOL(jnp.asarray(X), where=jnp.asarray(MASK), beta=beta)
  np.testing.assert_allclose(jnp.sum(ones * jnp.where(MASK, X, 0.0), 1), pooled,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_axis_keepdims_shaped_y_and_beta_limits():
  x = jnp.asarray(X.T)  # pools along axis 0
  y_keep = jnp.asarray(Y)[None, :]
  a = UNPOOL(y_keep, x, axis=0, beta=1.0)
  b = UNPOOL(jnp.asarray(Y), x, axis=0, beta=1.0)
  np.testing.assert_array_equal(a, b)
  want = o_unpool(Y, X, np.ones_like(MASK), 1.0).T  # beta = 1: eDSCW weights only
  np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
  # a beta beyond [0, 1] is clamped
  np.testing.assert_array_equal(UNPOOL(jnp.asarray(Y), x, axis=0, beta=-2.0),
                                UNPOOL(jnp.asarray(Y), x, axis=0, beta=0.0))


def test_gradients_in_y_x_and_beta():
  """One jitted gradient of ``sum(r * unpool)`` against float64 central differences of
  the numpy oracle."""
  m = MASK[[0, 3]]
  r = Z[[0, 3]].astype(np.float64)
  x0, y0, b0 = X[[0, 3]].astype(np.float64), Y[[0, 3]].astype(np.float64), 0.4

  def o_loss(y, x, b):
    return float(np.sum(r * o_unpool(y, x, m, b)))

  with jax.enable_x64(True):
    grads = jax.jit(jax.grad(lambda y, x, b: jnp.sum(r * pooling.ada_unpool(
        y, x, where=m, beta=b)), argnums=(0, 1, 2)))(y0, x0, jnp.float64(b0))
  h = 1e-6
  fd_y = np.array([(o_loss(y0 + h * e, x0, b0) - o_loss(y0 - h * e, x0, b0)) / (2 * h)
                   for e in np.eye(2)])
  fd_x = np.zeros_like(x0)
  for idx in np.ndindex(*x0.shape):
    e = np.zeros_like(x0)
    e[idx] = h
    fd_x[idx] = (o_loss(y0, x0 + e, b0) - o_loss(y0, x0 - e, b0)) / (2 * h)
  fd_b = (o_loss(y0, x0, b0 + h) - o_loss(y0, x0, b0 - h)) / (2 * h)
  # central differences at h = 1e-6 in float64: truncation ~h^2, rounding ~1e-16/h = 1e-10
  np.testing.assert_allclose(grads[0], fd_y, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grads[1], fd_x, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grads[2], fd_b, rtol=1e-6, atol=1e-7)
  assert np.all(np.asarray(grads[1])[~m] == 0.0)  # masked entries get no gradient


@pytest.mark.slow
def test_low_precision_computes_in_float32():
  up = UNPOOL(jnp.asarray(Y, jnp.bfloat16), jnp.asarray(X, jnp.bfloat16))
  assert up.dtype == jnp.bfloat16
  ref = o_unpool(np.asarray(jnp.asarray(Y, jnp.bfloat16), np.float64),
                 np.asarray(jnp.asarray(X, jnp.bfloat16), np.float64),
                 np.ones_like(MASK), 0.5)
  # one bf16 rounding of the result: relative 2^-8, plus 1e-3 absolute near zero
  np.testing.assert_allclose(np.asarray(up, np.float64), ref, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("args, match", [
    ((jnp.ones(3), jnp.ones((4, 6))), "pooled value"),
    ((jnp.ones((4, 2)), jnp.ones((4, 6))), "pooled value"),
    ((jnp.ones(()), jnp.ones(())), "rank >= 1"),
])
def test_bad_shapes(args, match):
  with pytest.raises(ValueError, match=match):
    pooling.ada_unpool(*args)


def test_bad_beta():
  with pytest.raises(ValueError, match="beta"):
    pooling.ada_unpool(jnp.ones(4), jnp.ones((4, 6)), beta=float("nan"))
