"""The wrapped Cauchy density and wcdas_loss (feature L17) against float64 references:
gradients, masks, extreme and bf16 inputs and bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft.losses import _wrapped_cauchy
from tests.helpers import check_raises, rows
from tests.losses.references import grads64, jitted_losses, np_ce

L = jitted_losses({
    "wcdas_loss": ("ignore_index",),
    "wrapped_cauchy_log_density": (),
})


def _np_wcdas(x, w, labels, rho, scale):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  if w.ndim == 2:
    w = w[..., None]
  xh = x / np.linalg.norm(x, axis=-1, keepdims=True)
  wh = w / np.linalg.norm(w, axis=0, keepdims=True)
  theta = np.arccos(np.clip(np.einsum("bd,dck->bck", xh, wh), -1, 1))
  r = np.asarray(rho, np.float64)[:, None]
  dens = (1 - r ** 2) / (2 * np.pi * (1 + r ** 2 - 2 * r * np.cos(theta)))
  logits = scale * np.log(2 * np.pi * dens.mean(-1))
  return np_ce(logits, labels)


def test_wrapped_cauchy_density_integrates_to_one():
  t = np.linspace(0, 2 * np.pi, 4001)
  for rho in (0.0, 0.5, 0.95):
    p = np.exp(np.asarray(L.wrapped_cauchy_log_density(jnp.asarray(t), rho, 0.3), np.float64))
    assert abs(np.trapezoid(p, t) - 1) < 1e-3
  np.testing.assert_allclose(np.exp(L.wrapped_cauchy_log_density(t[:5], 0.0)), 1 / (2 * np.pi),
                             rtol=1e-6)


@pytest.mark.parametrize("kernels", [pytest.param(None, marks=pytest.mark.slow), 3])
def test_wcdas_against_reference_and_gradients(kernels):
  x = np.asarray(rows(6, (4, 3)), np.float64)
  w = np.asarray(rows(7, (3, 5) if kernels is None else (3, 5, kernels)), np.float64)
  y = np.array([0, 4, 2, 2])
  rho = np.array([0.1, 0.5, 0.7, 0.9, 0.3])
  got = L.wcdas_loss(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), y, rho, scale=2.0)
  np.testing.assert_allclose(got, _np_wcdas(x, w, y, rho, 2.0), rtol=1e-4)
  grads64(lambda a, b, r: L.wcdas_loss(a, b, y, r, scale=2.0), x, w, rho)


def test_wcdas_edges():
  x, w = rows(8, (3, 4)), rows(9, (4, 5))
  y = jnp.array([0, 1, 4])
  np.testing.assert_allclose(L.wcdas_loss(x, w, y, 0.0), np.full(3, math.log(5)), rtol=1e-6)
  out = L.wcdas_loss(x, w, y, jnp.full(5, 0.5), where=jnp.array([True, False, True]),
                     ignore_index=4)
  assert float(out[1]) == 0.0 and float(out[2]) == 0.0
  v, g = jax.value_and_grad(lambda a: L.wcdas_loss(a, w, y, 0.999, scale=30.0).sum())(x * 1e30)
  assert np.isfinite(float(v)) and np.all(np.isfinite(g))
  bf = L.wcdas_loss(x.astype(jnp.bfloat16), w, y, 0.5)
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf, np.float32), L.wcdas_loss(x, w, y, 0.5), rtol=2e-2)
  check_raises(("class_weights", lambda: js.losses.wcdas_loss(x, jnp.ones(4), y, 0.5)),
               ("concentration", lambda: js.losses.wcdas_loss(x, w, y, jnp.ones(3) * 0.5)),
               ("concentration", lambda: js.losses.wcdas_loss(x, w, y, 1.0)),
               ("concentration", lambda: js.losses.wcdas_loss(x, w, y, -0.1)),
               ("labels", lambda: js.losses.wcdas_loss(x, w, y[:2], 0.5)),
               ("scale", lambda: js.losses.wcdas_loss(x, w, y, 0.5, scale=-1.0)))


def test_private_kernel_matches_density():
  cos = jnp.array([1.0, 0.0, -1.0])
  np.testing.assert_allclose(_wrapped_cauchy._wc_log_kernel(cos, 0.5),
                             np.log(0.75 / (1.25 - np.asarray(cos))), rtol=1e-6)
