"""continual_cross_entropy (feature L17): the mask and stop-gradient modes against float64
references, with gradients, masks, bf16 and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.references import jitted_losses, np_ce, np_softmax

L = jitted_losses({
    "continual_cross_entropy": ("mode", "axis", "ignore_index"),
})


def test_continual_cross_entropy_against_reference_and_gradients():
  z = np.asarray(rows(0, (4, 6), 2.0), np.float64)
  y = np.array([1, 2, 4, 5])
  cur = np.array([False, True, True, False, True, True])
  zc = np.where(cur, z, -np.inf)
  p_mask = np_softmax(zc)
  onehot = np.eye(6)[y]
  got, g = jax.value_and_grad(lambda a: L.continual_cross_entropy(a, y, cur).sum())(
      jnp.asarray(z, jnp.float32))
  np.testing.assert_allclose(got, np_ce(zc, y).sum(), rtol=1e-5)
  np.testing.assert_allclose(g, np.where(cur, p_mask - onehot, 0.0), atol=1e-6)
  got, g = jax.value_and_grad(
      lambda a: L.continual_cross_entropy(a, y, cur, mode="stop_gradient").sum())(
          jnp.asarray(z, jnp.float32))
  np.testing.assert_allclose(got, np_ce(z, y).sum(), rtol=1e-5)
  np.testing.assert_allclose(g, np.where(cur, np_softmax(z) - onehot, 0.0), atol=1e-6)
  assert np.all(np.asarray(g)[:, ~cur] == 0.0), "old logits get exactly zero gradient"


def test_continual_cross_entropy_edges():
  z = rows(1, (3, 4))
  y = jnp.array([0, 1, 3])
  full = optax.softmax_cross_entropy_with_integer_labels(z, y)
  for mode in ("mask", "stop_gradient"):
    np.testing.assert_allclose(L.continual_cross_entropy(z, y, jnp.ones(4, bool), mode=mode),
                               full, rtol=1e-6)
    out = L.continual_cross_entropy(z, y, jnp.array([True, True, True, False]), mode=mode,
                                    where=jnp.array([True, False, True]))
    assert out[1] == 0.0
  # a label on a masked class: +inf (mask) or an ordinary loss (stop-gradient)
  cur = jnp.array([True, True, True, False])
  assert np.isinf(L.continual_cross_entropy(z, y, cur)[2])
  assert np.isfinite(L.continual_cross_entropy(z, y, cur, mode="stop_gradient")[2])
  big = jnp.array([[1e4, -1e4, -jnp.inf, 0.0]], jnp.bfloat16)
  for mode in ("mask", "stop_gradient"):
    val, g = jax.value_and_grad(lambda a, mode=mode: L.continual_cross_entropy(
        a, jnp.array([1]), cur, mode=mode).sum())(big)
    assert val.dtype == jnp.bfloat16 and np.isfinite(float(val))
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  check_raises(
      ("mode", lambda: js.losses.continual_cross_entropy(z, y, cur, mode="freeze")),
      ("current_classes", lambda: js.losses.continual_cross_entropy(z, y, jnp.ones(4))),
      ("current_classes", lambda: js.losses.continual_cross_entropy(z, y, jnp.ones(5, bool))))
