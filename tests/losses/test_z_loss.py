"""L05 spherical_z_loss and z_loss (log²Z) against float64 numpy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import LOW_PRECISION, check_raises, normal, numeric_grad, value_and_vjp

# jitted, so that each test compiles a few programs instead of dispatching op by op
szl = jax.jit(js.losses.spherical_z_loss, static_argnames=("axis", "ignore_index"))
zl = jax.jit(js.losses.z_loss, static_argnames=("axis",))


def _szl_reference(x, labels, a, b, mask=None):
  """float64 numpy spherical Z-loss of each row (integer labels), over the visible classes."""
  x = np.asarray(x, np.float64)
  mask = np.ones(x.shape, bool) if mask is None else np.broadcast_to(mask, x.shape)
  out = np.zeros(x.shape[0])
  for r in range(x.shape[0]):
    o = x[r, mask[r]]
    z = (o - o.mean()) / o.std()
    z_y = z[np.flatnonzero(mask[r]).tolist().index(int(labels[r]))]
    out[r] = np.logaddexp(0.0, a * (b - z_y)) / a
  return out


@pytest.mark.parametrize("a,b", [(1.0, 0.0), (3.0, 1.5)])
def test_spherical_matches_float64_reference_and_gradient(a, b):
  x, labels = normal(0, (4, 7), 2.0), jnp.array([0, 3, 6, 2])
  mask = np.ones((4, 7), bool)
  mask[1, 5] = mask[2, 0] = False
  ct = normal(1, (4,))
  out, (dx,), _ = value_and_vjp(lambda v: szl(v, labels, a=a, b=b, where=mask), x, seed=None)
  ref = _szl_reference(x, labels, a, b, mask)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
  ref_dx = numeric_grad(lambda v: _szl_reference(v, labels, a, b, mask).sum(), x)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(dx)[~mask] == 0.0)
  # a random cotangent weights the rows
  (dx_ct,) = jax.vjp(lambda v: szl(v, labels, a=a, b=b, where=mask), x)[1](ct)
  np.testing.assert_allclose(dx_ct, np.asarray(ct)[:, None] * ref_dx, rtol=1e-4, atol=1e-5)


def test_spherical_invariances_and_gradient_orthogonality():
  x, labels = normal(2, (5, 6), 1.5), jnp.array([0, 1, 2, 3, 5])
  base = szl(x, labels, a=2.0, b=0.5)
  chex.assert_trees_all_close(szl(3.7 * x - 11.0, labels, a=2.0, b=0.5), base, rtol=1e-5)
  perm = jnp.array([0, 1, 2, 3, 5, 4])         # swaps two classes: relabel the targets too
  chex.assert_trees_all_close(szl(x[:, perm], perm.argsort()[labels], a=2.0, b=0.5), base,
                              rtol=1e-6)
  dx = jax.grad(lambda v: szl(v, labels, a=2.0, b=0.5).sum())(x)
  np.testing.assert_allclose(dx.sum(-1), 0.0, atol=1e-6)          # shift direction
  np.testing.assert_allclose((dx * x).sum(-1), 0.0, atol=1e-5)    # scale direction
  # bounded: |z_y| <= sqrt(K - 1), and a -> inf gives the hinge max(0, b - z_y)
  z = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
  z_y = z[jnp.arange(5), labels]
  chex.assert_trees_all_close(szl(x, labels, a=1e4, b=0.5), jnp.maximum(0.0, 0.5 - z_y),
                              atol=1e-4)


def test_spherical_probability_targets_equal_the_mixture_of_labels():
  x = normal(3, (3, 5))
  y = jax.nn.softmax(normal(4, (3, 5)))
  per_label = jnp.stack([szl(x, jnp.full((3,), j), a=2.0, b=1.0) for j in range(5)], -1)
  chex.assert_trees_all_close(szl(x, y, a=2.0, b=1.0), (y * per_label).sum(-1), rtol=1e-5)


def test_spherical_edge_cases():
  labels = jnp.array([0, 1, 2, -100])
  x = jnp.array([[1.0, 1.0, 1.0],              # std 0: z = 0
                 [3e38, -3e38, 1e30],           # extreme but finite
                 [0.0, -jnp.inf, 2.0],          # -inf is a masked class ...
                 [1.0, 2.0, 3.0]])              # ... ignored example
  out, (dx,), _ = value_and_vjp(lambda v: szl(v, labels, a=2.0, b=1.0, ignore_index=-100), x)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(dx))
  np.testing.assert_allclose(out[0], np.logaddexp(0, 2.0) / 2.0, rtol=1e-6)
  np.testing.assert_allclose(out[1], _szl_reference(np.array([[1.0, -1.0, 1e-8]]), [1], 2.0, 1.0),
                             rtol=1e-5)
  np.testing.assert_allclose(out[2], np.logaddexp(0, 2.0 * (1.0 - 1.0)) / 2.0, rtol=1e-6)
  assert out[3] == 0.0 and np.all(dx[3] == 0.0)
  assert szl(x[2:3], jnp.array([1]))[0] == jnp.inf   # the label's class is masked
  example_mask = jnp.array([True, False, True, True])
  assert szl(x, jnp.array([0, 1, 2, 0]), where=example_mask)[1] == 0.0


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision(dtype):
  x, labels = normal(5, (4, 9), 3.0), jnp.array([0, 4, 8, 1])
  out = szl(x.astype(dtype), labels, a=2.0)
  assert out.dtype == dtype
  chex.assert_trees_all_close(out.astype(jnp.float32),
                              szl(x.astype(dtype).astype(jnp.float32), labels, a=2.0), rtol=1e-2)
  lz = zl(x.astype(dtype))
  assert lz.dtype == dtype
  chex.assert_trees_all_close(lz.astype(jnp.float32), zl(x.astype(dtype).astype(jnp.float32)),
                              rtol=1e-2)


def test_z_loss_matches_float64_reference():
  x = normal(6, (5, 8), 3.0)
  mask = np.ones((1, 8), bool)
  mask[0, 3] = False
  out, (dx,), ct = value_and_vjp(lambda v: zl(v, where=mask), x)
  x64 = np.where(mask, np.asarray(x, np.float64), -np.inf)
  m = x64.max(-1, keepdims=True)
  lse = m[:, 0] + np.log(np.exp(x64 - m).sum(-1))
  np.testing.assert_allclose(out, lse**2, rtol=1e-5)
  ref_dx = (np.asarray(ct)[:, None] * 2 * lse[:, None] * np.exp(x64 - lse[:, None]))
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-6)
  # the regulariser that linear_cross_entropy adds
  h, w = normal(8, (5, 4)), normal(9, (4, 8))
  labels = jnp.array([0, 1, 2, 3, 4])
  chex.assert_trees_all_close(
      js.losses.linear_cross_entropy(h, w, labels, z_loss=1e-2, vocab_chunk_size=3),
      optax.losses.softmax_cross_entropy_with_integer_labels(h @ w, labels) + 1e-2 * zl(h @ w),
      rtol=1e-5)
  # logits far past exp's range (log²Z itself stays below float32's max), and empty rows
  out, (dx,), _ = value_and_vjp(zl, jnp.array([[1e18, 0.0], [-jnp.inf, -jnp.inf]]))
  np.testing.assert_allclose(out[0], 1e36, rtol=1e-6)
  assert out[1] == 0.0 and np.all(np.isfinite(dx)) and dx[0, 1] == 0.0


def test_bad_input_names_the_argument():
  x, labels = normal(10, (3, 4)), jnp.array([0, 1, 2])
  check_raises(
      ("`a`", lambda: js.losses.spherical_z_loss(x, labels, a=0.0)),
      ("`labels`", lambda: js.losses.spherical_z_loss(x, labels[:2])),
      ("`labels`", lambda: js.losses.spherical_z_loss(x, jnp.ones((3, 5)))),
      ("`ignore_index`", lambda: js.losses.spherical_z_loss(x, jnp.ones((3, 4)) / 4, ignore_index=-1)),
      ("`axis`", lambda: js.losses.z_loss(x, axis=3)),
      ("`where`", lambda: js.losses.z_loss(x, where=jnp.ones((2, 4), bool))),
      ("`logits`", lambda: js.losses.z_loss(jnp.zeros((3, 4), jnp.complex64))),
  )
