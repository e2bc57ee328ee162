"""``pmrl_contrastive_regularizer``'s sign rule has a tie that rounding decided.

The leading direction's sign is fixed by :math:`\\sum_m z^m\\cdot v \\ge 0`, i.e. a
non-negative entry sum of the Gram matrix's top eigenvector u. Two unit modalities with a
negative cosine c have the Gram matrix [[1, c], [c, 1]], whose top eigenvector is
(1, -1)/sqrt(2) exactly: the sum is 0 and its computed value, +-1e-17, flipped v and the
loss between inputs a float64 ulp apart (in test_float64_walk's case 0.016 against 2.6e-6,
and a gradient 2e4 off its finite differences). The tie now goes to a non-negative first entry.
The reference: the loss in float64 NumPy from the definition, with that rule.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js


def _np_reg(e, tau):
  """InfoNCE among the unit leading directions v_i = (z_i^1 - z_i^2)/|.| (two unit
  modalities with a negative cosine: u = (1, -1)/sqrt 2, the first modality's side)."""
  z = e / np.linalg.norm(e, axis=-1, keepdims=True)
  v = z[:, 0] - z[:, 1]
  v /= np.linalg.norm(v, axis=-1, keepdims=True)
  logits = v @ v.T / tau
  return np.log(np.exp(logits).sum(-1)) - 1.0 / tau


def test_two_modalities_with_a_negative_cosine_keep_one_sign():
  rng = np.random.default_rng(21)
  e = rng.normal(size=(3, 2, 4))
  e[:, 1] -= 2.0 * e[:, 0]  # every instance's two modalities: a negative cosine
  z = e / np.linalg.norm(e, axis=-1, keepdims=True)
  assert np.all(np.sum(z[:, 0] * z[:, 1], -1) < 0)
  want = _np_reg(e, 0.1)
  with jax.enable_x64(True):
    f = jax.jit(lambda x: js.losses.pmrl_contrastive_regularizer(x, temperature=0.1))
    for k in range(8):  # 17 tiny moves along each of 8 coordinates
      for t in 1e-6 * np.arange(-8, 9):
        x = e.copy()
        x.flat[k] += t
        np.testing.assert_allclose(np.asarray(f(jnp.asarray(x))), _np_reg(x, 0.1),
                                   rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(e))), want, rtol=1e-9, atol=1e-12)
