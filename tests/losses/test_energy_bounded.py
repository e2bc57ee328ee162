"""L16 energy-bounded OOD training loss against a float64 NumPy reference of its formula
(Liu et al. 2020, Sec. 4): values, closed-form gradients, masks, bf16, x64 and errors."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import logsumexp

import jaxsoft as js
from tests.helpers import check_raises, normal
from tests.losses.references import np_softmax

E = js.losses


def _lse(z):
  return logsumexp(np.asarray(z, np.float64), axis=-1)


def _ref(z, y, zo, m_in, m_out, lam, t, keep=None, keep_out=None):
  """The loss and its gradients in float64, from the formula: CE + lam (mean relu(E_in -
  m_in)^2 + mean relu(m_out - E_out)^2), E = -T LSE(z / T), means over kept examples."""
  z, zo = np.asarray(z, np.float64), np.asarray(zo, np.float64)
  keep = np.ones(z.shape[:-1], bool) if keep is None else np.asarray(keep)
  keep_out = np.ones(zo.shape[:-1], bool) if keep_out is None else np.asarray(keep_out)
  n, n_out = max(keep.sum(), 1), max(keep_out.sum(), 1)
  y = np.asarray(y)
  ce = _lse(z) - np.take_along_axis(z, y[..., None], -1)[..., 0]
  e_in, e_out = -t * _lse(z / t), -t * _lse(zo / t)
  h_in, h_out = np.maximum(e_in - m_in, 0.0), np.maximum(m_out - e_out, 0.0)
  loss = (np.sum(ce * keep) / n
          + lam * (np.sum(h_in ** 2 * keep) / n + np.sum(h_out ** 2 * keep_out) / n_out))
  onehot = np.eye(z.shape[-1])[y]
  # dCE/dz = softmax(z) - onehot; dE/dz = -softmax(z / T)
  g = ((np_softmax(z) - onehot) - lam * 2 * h_in[..., None] * np_softmax(z / t)) * keep[..., None] / n
  g_out = lam * 2 * h_out[..., None] * np_softmax(zo / t) * keep_out[..., None] / n_out
  return loss, g, g_out


def _inputs():
  # with the margins of HP some examples of each batch are inside their hinge and some not
  # (E_in from -27 to -15 against m_in = -21; E_out from -19 to -12 against m_out = -13.5)
  z = normal(0, (6, 5), 8.0) + 10.0
  zo = normal(1, (4, 5), 6.0) + 6.0
  y = jax.random.randint(jax.random.key(2), (6,), 0, 5)
  return z, y, zo


HP = dict(margin_in=-21.0, margin_out=-13.5, energy_weight=0.3)


def test_values_and_gradients_against_float64():
  z, y, zo = _inputs()
  keep = jnp.array([True, True, False, True, True, True])
  keep_out = jnp.array([True, False, True, True])

  def loss(z, zo, t, keep, keep_out):
    return E.energy_bounded_loss(z, y, zo, temperature=t, where=keep, outlier_where=keep_out,
                                 **HP)

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  for t in (1.0, 2.0):
    ref, g, g_out = _ref(z, y, zo, -21.0, -13.5, 0.3, t, keep, keep_out)
    e_in, e_out = -t * _lse(np.asarray(z) / t), -t * _lse(np.asarray(zo) / t)
    # the data exercise both sides of both hinges among the kept examples
    active = np.asarray(keep) & (e_in > -21.0)
    assert 0 < active.sum() < np.sum(keep)
    active = np.asarray(keep_out) & (e_out < -13.5)
    assert 0 < active.sum() < np.sum(keep_out)
    val, (gz, gzo) = f(z, zo, t, keep, keep_out)
    # float32: LSEs of values ~25 (a few 2^-24 relative roundings), squared hinges up to
    # ~100 summed over 6 rows: 1e-5 relative
    np.testing.assert_allclose(val, ref, rtol=1e-5)
    np.testing.assert_allclose(gz, g, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gzo, g_out, rtol=1e-4, atol=1e-5)
  # float64 in, float64 out, to a few float64 roundings
  with jax.enable_x64(True):
    z64, zo64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (z, zo))
    val, (gz, gzo) = jax.jit(jax.value_and_grad(
        lambda a, b: E.energy_bounded_loss(a, y, b, **HP), argnums=(0, 1)))(z64, zo64)
    assert val.dtype == gz.dtype == jnp.float64
  ref, g, g_out = _ref(z, y, zo, -21.0, -13.5, 0.3, 1.0)
  np.testing.assert_allclose(val, ref, rtol=1e-12)
  np.testing.assert_allclose(gz, g, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(gzo, g_out, rtol=1e-10, atol=1e-14)


def test_masks_zero_weight_defaults_and_bf16():
  z, y, zo = _inputs()
  classes = jnp.ones((1, 5), bool).at[0, 4].set(False)
  y4 = jnp.minimum(y, 3)

  @jax.jit
  def f(z, zo):
    loss = lambda **kw: E.energy_bounded_loss(z, y4, zo, **HP, **kw)  # noqa: E731
    hidden = jnp.zeros(6, bool)
    return dict(
        classes=loss(where=classes, outlier_where=classes),
        neg_inf=E.energy_bounded_loss(z.at[:, 4].set(-jnp.inf), y4, zo.at[:, 4].set(-jnp.inf),
                                      **HP),
        masked_label=loss(where=jnp.ones((6, 5), bool).at[0, y4[0]].set(False)),
        no_weight=E.energy_bounded_loss(z, y, zo, energy_weight=0.0),
        ce=E.softmax_cross_entropy_with_integer_labels(z, y).mean(),
        defaults=E.energy_bounded_loss(z, y, zo),
        bf16=E.energy_bounded_loss(z.astype(jnp.bfloat16), y, zo.astype(jnp.bfloat16), **HP),
        hidden_in=loss(where=hidden),
        hidden_grad=jax.grad(lambda a, b: E.energy_bounded_loss(
            a, y4, b, where=hidden, outlier_where=jnp.zeros(4, bool)), argnums=(0, 1))(z, zo))

  got = f(z, zo)
  # a class mask deletes the class, as a -inf logit does
  ref, _, _ = _ref(np.asarray(z)[:, :4], y4, np.asarray(zo)[:, :4], -21.0, -13.5, 0.3, 1.0)
  np.testing.assert_allclose(got["classes"], ref, rtol=1e-5)
  np.testing.assert_allclose(got["neg_inf"], ref, rtol=1e-5)
  assert got["masked_label"] == np.inf
  # lambda = 0 is the mean cross-entropy; the paper's margins (-25, -7) with logits ~10-25:
  # both hinges active, so the defaults differ from the plain CE
  np.testing.assert_allclose(got["no_weight"], got["ce"], rtol=1e-6)
  ref, _, _ = _ref(z, y, zo, -25.0, -7.0, 0.1, 1.0)
  np.testing.assert_allclose(got["defaults"], ref, rtol=1e-5)
  assert ref > float(got["ce"]) + 1.0
  # bf16 in, bf16 out, computed in float32: the bf16-rounded inputs' reference, the
  # output rounded to 8 bits (2^-9 relative: rtol 4e-3)
  assert got["bf16"].dtype == jnp.bfloat16
  zb, zob = (np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)) for a in (z, zo))
  ref, _, _ = _ref(zb, y, zob, -21.0, -13.5, 0.3, 1.0)
  np.testing.assert_allclose(np.float32(got["bf16"]), ref, rtol=4e-3)
  # a fully masked in-batch leaves only the outlier term; both masked: 0, zero gradient
  ref_out = _ref(z, y4, zo, -21.0, -13.5, 0.3, 1.0, np.zeros(6, bool))[0]
  np.testing.assert_allclose(got["hidden_in"], ref_out, rtol=1e-5)
  assert float(got["hidden_in"]) > 0
  for g in got["hidden_grad"]:
    np.testing.assert_array_equal(g, 0.0)


def test_bad_arguments_name_the_function():
  z, y, zo = _inputs()
  f = E.energy_bounded_loss
  check_raises(
      (r"energy_bounded_loss: `temperature` must be a finite number > 0",
       lambda: f(z, y, zo, temperature=0.0)),
      (r"energy_bounded_loss: `energy_weight`", lambda: f(z, y, zo, energy_weight=-0.1)),
      (r"energy_bounded_loss: `margin_in` must be finite",
       lambda: f(z, y, zo, margin_in=float("nan"))),
      (r"energy_bounded_loss: `margin_out` must be a Python number",
       lambda: f(z, y, zo, margin_out="a")),
      (r"energy_bounded_loss: `outlier_logits` must have a real dtype",
       lambda: f(z, y, zo.astype(jnp.complex64))),
      (r"energy_bounded_loss: `outlier_logits` must have a class axis",
       lambda: f(z, y, jnp.float32(1.0))),
      (r"energy_bounded_loss: `labels`", lambda: f(z, y[:4], zo)),
  )
