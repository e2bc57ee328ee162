"""attention_entropy_penalty (AERO, feature L17) against a float64 reference: gradients
in the weights and the thresholds, masks, bf16 and bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.references import grads64, jitted_losses

L = jitted_losses({
    "attention_entropy_penalty": ("tolerance",),
})


def _np_aero(a, theta, gamma):
  a = np.asarray(a, np.float64)
  ent = -np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1)), 0), -1).mean(-1)
  e_max = np.log(a.shape[-1])
  d = np.abs(ent - theta * e_max)
  return np.where(d > gamma * e_max, d, 0.0)


def test_attention_entropy_penalty_reference_and_gradients():
  a = np.asarray(jax.nn.softmax(rows(3, (2, 3, 4, 5), 2.0), -1), np.float64)
  theta = np.array([0.2, 0.6, 0.95])
  got = L.attention_entropy_penalty(jnp.asarray(a, jnp.float32), theta, tolerance=0.1)
  want = _np_aero(a, theta, 0.1)
  # no head within 1e-3 of the band's edge (where the finite differences would jump)
  ent = -np.sum(a * np.log(a), -1).mean(-1)
  assert np.all(np.abs(np.abs(ent - theta * np.log(5)) - 0.1 * np.log(5)) > 1e-3)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.any(want == 0) and np.any(want > 0), "both sides of the band are exercised"
  g_theta = jax.grad(lambda t: L.attention_entropy_penalty(
      jnp.asarray(a, jnp.float32), t, tolerance=0.1).sum())(jnp.asarray(theta, jnp.float32))
  sign = np.sign(ent - theta * np.log(5))
  np.testing.assert_allclose(g_theta, np.sum(np.where(want > 0, -sign * np.log(5), 0), 0),
                             rtol=1e-5)
  grads64(lambda p: L.attention_entropy_penalty(p, theta, tolerance=0.1), a)


def test_attention_entropy_penalty_edges():
  eye = jnp.eye(4)[None, None]  # one-hot rows: entropy 0
  uni = jnp.full((1, 1, 4, 4), 0.25)
  assert float(L.attention_entropy_penalty(eye, 0.0, tolerance=0.0)[0, 0]) == 0.0
  np.testing.assert_allclose(L.attention_entropy_penalty(uni, 0.0, tolerance=0.5)[0, 0],
                             math.log(4), rtol=1e-6)
  g = jax.grad(lambda p: L.attention_entropy_penalty(p, 0.5, tolerance=0.1).sum())(eye)
  assert np.all(np.isfinite(g))
  # masked keys: a causal mask leaves each row its own keys; fully masked rows drop out
  causal = jnp.tril(jnp.ones((4, 4), bool))
  w = jnp.where(causal, 1.0 / jnp.arange(1, 5)[:, None], 0.0)[None, None]
  got = L.attention_entropy_penalty(w, 0.0, tolerance=0.0, where=causal)[0, 0]
  np.testing.assert_allclose(got, np.mean(np.log(np.arange(1, 5))), rtol=1e-6)
  out = L.attention_entropy_penalty(uni.astype(jnp.bfloat16), 0.0, tolerance=0.5)
  np.testing.assert_allclose(out[0, 0], math.log(4), rtol=1e-2)
  check_raises(
      ("probs", lambda: js.losses.attention_entropy_penalty(jnp.ones((4, 4)), 0.5)),
      ("tolerance", lambda: js.losses.attention_entropy_penalty(uni, 0.5, tolerance=-0.1)),
      ("threshold", lambda: js.losses.attention_entropy_penalty(jnp.full((1, 2, 4, 4), 0.25),
                                                        jnp.ones(3))))
