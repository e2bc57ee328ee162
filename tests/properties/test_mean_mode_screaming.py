"""E16: "mean-mode screaming" (catalogue 001#25, notebooks/15_mean_mode_screaming).

The paper's softmax claim: "structural suppression of attention-logit gradients through the
null space of the Softmax Jacobian once values homogenize". For one attention row
o = sum_j p_j v_j, p = softmax(s), g = dL/do:  dL/ds = J (V g), J = diag(p) - p p^T, J 1 = 0.
With v_j = mu + eps e_j the mean part is in J's null space, so dL/ds = eps J E g exactly
(linear in the spread, zero for identical values), while dL/dv_j = p_j g does not depend on eps.
Checked through js.attention.dot_product_attention, the logits entering as its bias.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js

S, H = 24, 8
EPS = np.array([0.0, 1e-12, 1e-8, 1e-4, 1e-2, 1.0])


def test_logit_gradient_is_linear_in_the_value_spread_and_zero_for_identical_values():
  rng = np.random.default_rng(0)
  s, mu, e, g = (rng.normal(size=shape) for shape in [(S,), (H,), (S, H), (H,)])
  mu = 5.0 * mu  # a dominant mean mode
  values = mu[None, None] + EPS[:, None, None] * e[None]
  with jax.enable_x64(True):

    def loss(bias, v):
      out = js.attention.dot_product_attention(
          jnp.zeros((1, 1, 1, H)), jnp.zeros((1, S, 1, H)), v[None, :, None, :],
          bias=bias[None, None, None, :])
      return jnp.sum(out[0, 0, 0] * g)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, 0)))
    gs, gv = (np.asarray(a) for a in grads(jnp.asarray(s), jnp.asarray(values)))
    assert gs.dtype == np.float64
  # numpy float64 reference from the formula, the mean mode dropped analytically
  p = np.exp(s - s.max())
  p /= p.sum()
  jac = np.diag(p) - np.outer(p, p)
  np.testing.assert_allclose(jac @ np.ones(S), 0.0, atol=1e-16)  # 24 terms of size p_j/24 each
  ref = EPS[:, None] * (jac @ (e @ g))[None]
  # The mean mode cancels only up to the row sum: |1 - sum p| ~ S * 2^-53 per entry, times
  # |mu . g| (~ 5 * sqrt(H) * 3 ~ 40): an absolute floor ~ 24 * 1.1e-16 * 40 ~ 1e-13.
  floor = S * 2.0 ** -53 * abs(mu @ g) * 4
  np.testing.assert_allclose(gs, ref, rtol=1e-9, atol=floor)
  assert np.max(np.abs(gs[0])) <= floor, "identical values: no logit gradient"
  # linear: |dL/ds| / eps is the same number from eps = 1e-4 to 1 (rtol: floor / (1e-4 * |JEg|))
  ratio = np.linalg.norm(gs[3:], axis=-1) / EPS[3:]
  np.testing.assert_allclose(ratio, np.linalg.norm(jac @ (e @ g)), rtol=1e-7)
  # the values' gradient p_j g is the same at every spread (1e-13: a few roundoffs of p_j g)
  np.testing.assert_allclose(gv, np.broadcast_to(np.outer(p, g), gv.shape), rtol=0, atol=1e-13)
  # and so the logit/value gradient ratio falls with the spread, by the factor 1e4 over 1e-4..1
  assert np.linalg.norm(gs[3]) < 1e-3 * np.linalg.norm(gs[5])


def test_logit_gradient_bound_half_sigma_max_of_the_centred_values():
  """||dL/ds_i|| <= 1/2 sigma_max(V - 1 m^T) ||g_i|| for every query row (||J||_2 <= 1/2 and
  J 1 = 0), on random rows whose values have a large common mean; a broken softmax VJP (one
  that does not annihilate the mean mode) breaks it by about sigma_max(V) / sigma_max(V_c) > 100."""
  rng = np.random.default_rng(1)
  T = 16
  q, k = rng.normal(size=(T, H)), rng.normal(size=(S, H))
  v = 30.0 * rng.normal(size=(1, H)) + 0.03 * rng.normal(size=(S, H))
  g = rng.normal(size=(T, H))
  with jax.enable_x64(True):

    def loss(bias):
      out = js.attention.dot_product_attention(q[None, :, None], k[None, :, None],
                                               v[None, :, None], bias=bias[None, None])
      return jnp.sum(out[0, :, 0] * g)

    gs = np.asarray(jax.jit(jax.grad(loss))(jnp.zeros((T, S))))
  centred = v - v.mean(axis=0, keepdims=True)
  bound = 0.5 * np.linalg.norm(centred, ord=2) * np.linalg.norm(g, axis=-1)
  assert np.all(np.linalg.norm(gs, axis=-1) <= bound * (1 + 1e-12))
  # and it is not vacuous: the uncentred bound would be over 100 times larger
  assert np.linalg.norm(v, ord=2) > 100 * np.linalg.norm(centred, ord=2)
