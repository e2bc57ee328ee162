"""dice_semimetric_loss (feature L17) against a float64 reference: properties, gradients,
masks, dtypes and bad input."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.helpers import check_raises
from tests.losses.references import grads64, jitted_losses

L = jitted_losses({
    "dice_semimetric_loss": ("axis",),
})


def _np_dml(x, y, axis=-1):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return np.abs(x - y).sum(axis) / (np.abs(x).sum(axis) + np.abs(y).sum(axis))


def test_dice_semimetric_reference_properties_and_gradient():
  rng = np.random.default_rng(0)
  x = rng.random((3, 2, 5))
  y = rng.random((3, 2, 5))
  got = L.dice_semimetric_loss(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32),
                               axis=(1, 2))
  np.testing.assert_allclose(got, _np_dml(x, y, (1, 2)), rtol=1e-5)
  np.testing.assert_allclose(got, L.dice_semimetric_loss(y, x, axis=(1, 2)), rtol=1e-6)
  hard = (rng.random((3, 2, 5)) < 0.5).astype(np.float64)
  sdl = 1 - 2 * (x * hard).sum((1, 2)) / (x.sum((1, 2)) + hard.sum((1, 2)))
  np.testing.assert_allclose(L.dice_semimetric_loss(x, hard, axis=(1, 2)), sdl, rtol=1e-5)
  half = jnp.full((4,), 0.5)
  assert float(L.dice_semimetric_loss(half, half)) == 0.0  # soft Dice would give 0.5
  assert np.all((np.asarray(got) >= 0) & (np.asarray(got) <= 1))
  grads64(lambda a, b: L.dice_semimetric_loss(a, b, axis=(1, 2)), x, y)
  g = jax.grad(lambda a: L.dice_semimetric_loss(a, a * 1.0).sum())(jnp.asarray(x))
  assert np.all(np.isfinite(g))


def test_dice_semimetric_masks_dtypes_and_errors():
  x = jnp.array([[0.2, 0.9, 0.4], [0.0, 0.0, 0.0]])
  y = jnp.array([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
  keep = jnp.array([True, True, False])
  np.testing.assert_allclose(L.dice_semimetric_loss(x, y, where=keep)[0],
                             _np_dml(x[0, :2], y[0, :2]), rtol=1e-6)
  assert float(L.dice_semimetric_loss(x, y)[1]) == 0.0  # empty pair
  out = L.dice_semimetric_loss(x.astype(jnp.bfloat16), y.astype(jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  with np.errstate(invalid="ignore"):
    want = np.nan_to_num(_np_dml(x, y))  # the empty pair: 0 / 0 -> 0
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=1e-2)
  check_raises(("targets", lambda: js.losses.dice_semimetric_loss(x, y[:, :2])),
               ("axis", lambda: js.losses.dice_semimetric_loss(x, y, axis=3)),
               ("axis", lambda: js.losses.dice_semimetric_loss(x, y, axis=(1, -1))))
