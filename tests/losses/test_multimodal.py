"""pmrl_loss (feature L17) against a float64 reference: rotation invariance, its minimum,
gradients, masks, dtypes and bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.references import grads64, jitted_losses

L = jitted_losses({
    "pmrl_loss": (),
})


def _np_pmrl(z, tau):
  z = np.asarray(z, np.float64)
  zh = z / np.linalg.norm(z, axis=-1, keepdims=True)
  s = np.linalg.svd(zh, compute_uv=False) / tau
  m = s.max(-1, keepdims=True)
  return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0] - s[..., 0]


def test_pmrl_against_reference_and_properties():
  z = np.asarray(rows(15, (3, 4, 6)), np.float64)
  got = L.pmrl_loss(jnp.asarray(z, jnp.float32), temperature=0.5)
  np.testing.assert_allclose(got, _np_pmrl(z, 0.5), rtol=1e-5)
  q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(6, 6)))
  np.testing.assert_allclose(L.pmrl_loss(z @ q, temperature=0.5), got, rtol=1e-4)
  same = np.tile(np.random.default_rng(1).normal(size=(1, 6)), (4, 1)) * np.arange(1, 5)[:, None]
  v, g = jax.value_and_grad(lambda a: L.pmrl_loss(a, temperature=0.5))(jnp.asarray(same))
  np.testing.assert_allclose(v, math.log1p(3 * math.exp(-2 / 0.5)), rtol=1e-5)
  assert np.all(np.isfinite(g)), "repeated (zero) singular values give a finite gradient"
  grads64(lambda a: L.pmrl_loss(a, temperature=0.5), z)


def test_pmrl_masks_dtypes_and_errors():
  z = rows(16, (2, 4, 5))
  keep = jnp.array([[True, True, False, True], [True, True, True, True]])
  got = L.pmrl_loss(z, where=keep)
  np.testing.assert_allclose(got[0], L.pmrl_loss(z[0, jnp.array([0, 1, 3])]), rtol=1e-5)
  np.testing.assert_allclose(got[1], L.pmrl_loss(z[1]), rtol=1e-6)
  assert float(L.pmrl_loss(z, where=jnp.zeros(4, bool))[0]) == 0.0
  bf = L.pmrl_loss(z.astype(jnp.bfloat16))
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf, np.float32), L.pmrl_loss(z), rtol=2e-2)
  assert np.all(np.isfinite(L.pmrl_loss(z * 1e30, temperature=1e-3)))
  check_raises(("embeddings", lambda: js.losses.pmrl_loss(jnp.ones(3))),
               ("temperature", lambda: js.losses.pmrl_loss(z, temperature=0.0)),
               ("where", lambda: js.losses.pmrl_loss(z, where=jnp.ones(3, bool))))
