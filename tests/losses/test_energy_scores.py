"""L19 spilled and marginalized energy against float64 numpy references of their formulas."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.jitted import Jitted

L = Jitted(js.losses)  # every call under jax.jit (see tests/losses/jitted.py)
E = js.losses          # eager: checks that need concrete values


def _lse(z):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  return (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _spilled_ref(z, y, beta):
  """LSE(beta z[t + 1]) - beta z[t, y[t]] for t < T - 1, in float64."""
  z = np.asarray(z, np.float64)
  zy = np.take_along_axis(z, np.asarray(y)[..., None], -1)[..., 0]
  return _lse(beta * z[..., 1:, :]) - beta * zy[..., :-1]


def _inputs(b=2, t=5, v=7):
  z = rows(0, (b, t, v), scale=2.0)
  y = jax.random.randint(jax.random.key(1), (b, t), 0, v)
  return z, y


def test_values_and_gradients_against_float64():
  z, y = _inputs()
  got = jax.jit(lambda z, y: (L.spilled_energy(z, y), L.spilled_energy(z, y, beta=0.5),
                              L.marginalized_energy(z, beta=0.5)))(z, y)
  # float32: one LSE (~4 roundings of 2^-24 relative on values ~5) and a subtraction
  for a, b in zip(got, (_spilled_ref(z, y, 1.0), _spilled_ref(z, y, 0.5),
                        -_lse(0.5 * np.asarray(z, np.float64))), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # float64 in, float64 out; gradients against the closed forms: d/dz[t+1] = beta
  # softmax(beta z[t+1]) and d/dz[t, y_t] = -beta, each times transition t's cotangent
  with jax.enable_x64(True):
    z64 = jnp.asarray(np.asarray(z, np.float64))
    ct = np.asarray(rows(2, (2, 4)), np.float64)

    @jax.jit
    def f(z64):
      g = jax.grad(lambda a: jnp.sum(E.spilled_energy(a, y, beta=0.5) * ct))(z64)
      gm = jax.grad(lambda a: jnp.sum(E.marginalized_energy(a, beta=2.0)))(z64)
      return E.spilled_energy(z64, y), g, gm

    val, g, gm = f(z64)
    assert val.dtype == g.dtype == jnp.float64
  want = np.zeros(z.shape)
  want[:, 1:] += 0.5 * _softmax(0.5 * np.asarray(z64)[:, 1:]) * ct[..., None]
  for b in range(2):
    for t in range(4):
      want[b, t, int(y[b, t])] -= 0.5 * ct[b, t]
  # float64: a few roundings of 2^-52 on values ~10
  np.testing.assert_allclose(val, _spilled_ref(z, y, 1.0), rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(gm, -2.0 * _softmax(2.0 * np.asarray(z64)), rtol=1e-12, atol=1e-14)


def test_consistency_identity_and_beta_limit():
  """A chain that is consistent by construction has no spill: with z[t+1] shifted so that
  LSE(z[t+1]) = z[t, y_t] (step by step), every Delta_t is 0."""
  z, y = _inputs()
  zc = np.asarray(z, np.float64).copy()
  yn = np.asarray(y)
  for t in range(4):
    zy = np.take_along_axis(zc[:, t], yn[:, t, None], -1)[:, 0]
    zc[:, t + 1] += (zy - _lse(zc[:, t + 1]))[:, None]
  got = jax.jit(lambda a, z, y: (L.spilled_energy(a, y), L.marginalized_energy(z),
                                 L.energy_score(z), L.marginalized_energy(z, beta=100.0)))(
      jnp.asarray(zc, jnp.float32), z, y)
  np.testing.assert_allclose(got[0], 0.0, atol=2e-5)  # |z| ~ 10: a few float32 roundings
  np.testing.assert_allclose(got[1], -got[2], rtol=1e-6)   # E' = -energy_score at beta = 1
  # beta -> large: -E'/beta -> max_v z, with a gap in [0, log V / beta]
  gap = np.asarray(got[3] / -100.0 - z.max(-1))
  assert np.all(gap >= -1e-5) and np.all(gap <= np.log(7) / 100 + 1e-5)


def test_masks_step_and_vocabulary():
  z, y = _inputs()
  step = jnp.array([[True, True, True, False, True], [False, True, True, True, True]])
  vocab = jnp.ones(7, bool).at[6].set(False)[None, None]
  y5 = jnp.minimum(y, 5)

  @jax.jit
  def f(z, y, y5):
    g = jax.grad(lambda a: E.spilled_energy(a, y, where=step).sum())(z)
    return dict(step=E.spilled_energy(z, y, where=step), g=g,
                vocab=E.spilled_energy(z, y5, where=vocab),
                me_vocab=E.marginalized_energy(z, where=vocab),
                masked_token=E.spilled_energy(z, y5.at[0, 0].set(6), where=vocab),
                me_step=E.marginalized_energy(z, where=step),
                neg_inf=E.spilled_energy(z.at[..., 6].set(-jnp.inf), y5))

  got = f(z, y, y5)
  keep = np.asarray(step[:, 1:] & step[:, :-1])
  np.testing.assert_allclose(got["step"], np.where(keep, _spilled_ref(z, y, 1.0), 0.0),
                             rtol=1e-5, atol=1e-5)
  g = np.asarray(got["g"])
  assert np.all(g[0, 3] == 0) and np.all(g[1, 0] == 0)  # steps in no kept transition
  # a vocabulary mask deletes those entries (so do -inf logits); a masked chosen token: +inf
  ref6 = _spilled_ref(z[..., :6], y5, 1.0)
  np.testing.assert_allclose(got["vocab"], ref6, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["neg_inf"], ref6, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["me_vocab"], -_lse(np.asarray(z, np.float64)[..., :6]),
                             rtol=1e-5, atol=1e-5)
  out = np.asarray(got["masked_token"])
  assert out[0, 0] == np.inf and np.isfinite(out[0, 1:]).all() and np.isfinite(out[1]).all()
  me = np.asarray(got["me_step"])
  assert me[0, 3] == 0 and me[1, 0] == 0


def test_vmap_bf16_extremes_and_one_step():
  z, y = _inputs()

  @jax.jit
  def f(z, y):
    return (jax.vmap(E.spilled_energy)(z, y), E.spilled_energy(z, y),
            E.spilled_energy(z.astype(jnp.bfloat16), y), E.spilled_energy(1e4 * z, y),
            E.spilled_energy(z[:, :1], y[:, :1]))

  vm, plain, lo, huge, one = f(z, y)
  np.testing.assert_allclose(vm, plain, rtol=1e-6)
  assert lo.dtype == jnp.bfloat16 and one.shape == (2, 0)
  # bf16: the rounded input's float64 reference; the output rounded to 8 bits (2^-9
  # relative of values up to ~10: atol 0.05)
  zb = np.asarray(z.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  np.testing.assert_allclose(np.asarray(lo, np.float32), _spilled_ref(zb, y, 1.0), rtol=1e-2,
                             atol=5e-2)
  # logits ~1e4: finite, float32 spacing ~1e-3 on the values
  np.testing.assert_allclose(huge, _spilled_ref(1e4 * np.asarray(z, np.float64), y, 1.0),
                             rtol=1e-5, atol=2e-2)


def test_bad_inputs_name_the_argument():
  z, y = _inputs()
  check_raises(
      ("`beta`", lambda: E.spilled_energy(z, y, beta=0.0)),
      ("`beta`", lambda: E.marginalized_energy(z, beta=-1.0)),
      ("`tokens`", lambda: E.spilled_energy(z, y[:, :3])),
      ("`tokens`", lambda: E.spilled_energy(z, y.astype(jnp.float32))),
      ("`logits`", lambda: E.spilled_energy(z[0, 0], y[0, 0])),
      ("`logits`", lambda: E.spilled_energy(z[:, :0], y[:, :0])),
      ("`logits`", lambda: E.marginalized_energy(z.astype(jnp.complex64))),
  )


def test_fully_masked_rows_give_zero_with_zero_gradient():
  """A step with no visible token and a masked transition score 0, never NaN or inf."""
  z = jnp.asarray(np.random.default_rng(3).normal(size=(1, 3, 4)), jnp.float32)
  tokens = jnp.zeros((1, 3), jnp.int32)
  vocab_none = jnp.zeros((1, 3, 4), bool)
  steps_none = jnp.zeros((1, 3), bool)

  @jax.jit
  def run(z):
    e, ge = jax.value_and_grad(lambda z: L.marginalized_energy(z, where=vocab_none).sum())(z)
    s, gs = jax.value_and_grad(
        lambda z: L.spilled_energy(z, tokens, where=steps_none).sum())(z)
    return (L.marginalized_energy(z, where=vocab_none),
            L.spilled_energy(z, tokens, where=steps_none), ge, gs, e, s)

  for a in run(z):
    np.testing.assert_array_equal(np.asarray(a), 0.0)
