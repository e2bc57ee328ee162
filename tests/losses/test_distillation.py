"""L11 distillation losses against float64 numpy references and their defining properties."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.helpers import check_raises, numeric_grad, rows
from tests.losses.jitted import Jitted

L = Jitted(js.losses)  # every call under jax.jit (see tests/losses/jitted.py)
E = js.losses          # eager: checks that need concrete values


def _log_softmax(z):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _kl(log_p, log_q):
  return (np.exp(log_p) * (log_p - log_q)).sum(-1)


def _z(z, eps=1e-7):
  z = np.asarray(z, np.float64)
  return (z - z.mean(-1, keepdims=True)) / (z.std(-1, ddof=1, keepdims=True) + eps)


def _lskd_ref(s, t, tau):
  return tau ** 2 * _kl(_log_softmax(_z(t) / tau), _log_softmax(_z(s) / tau))


def test_logit_standardized_kd_reference_gradient_and_invariance():
  s, t = rows(0, (3, 5)), rows(1, (3, 5), scale=3.0)
  f = jax.jit(lambda a, b: L.logit_standardized_kd_loss(a, b, temperature=2.0))
  np.testing.assert_allclose(f(s, t), _lskd_ref(s, t, 2.0), rtol=1e-5, atol=1e-7)
  ct = np.asarray(rows(2, (3,)), np.float64)
  _, vjp = jax.vjp(f, s, t)
  ds, dt = vjp(jnp.asarray(ct, jnp.float32))
  np.testing.assert_allclose(ds, numeric_grad(lambda a: _lskd_ref(a, t, 2.0) @ ct, s),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dt, numeric_grad(lambda a: _lskd_ref(s, a, 2.0) @ ct, t),
                             rtol=1e-4, atol=1e-5)
  # positive-affine student of the teacher: zero loss (vanilla KD would not be zero)
  affine = f(3.0 * t + 1.5, t)
  np.testing.assert_allclose(affine, 0.0, atol=1e-5)
  vanilla = _kl(_log_softmax(np.asarray(t) / 2.0), _log_softmax((3.0 * np.asarray(t) + 1.5) / 2))
  assert np.all(vanilla > 1e-2)
  np.testing.assert_allclose(f(s * 0.2 - 4.0, t * 5.0 + 1.0), f(s, t), rtol=1e-4, atol=1e-6)


def test_logit_standardized_kd_masks_and_edges():
  s, t = rows(0, (3, 5)), rows(1, (3, 5))
  cls = jnp.array([True, True, False, True, True])
  got = L.logit_standardized_kd_loss(s, t, where=cls[None])
  np.testing.assert_allclose(got, _lskd_ref(np.asarray(s)[:, cls], np.asarray(t)[:, cls], 1.0),
                             rtol=1e-5, atol=1e-7)
  ex = jnp.array([True, False, True])
  out, g = jax.value_and_grad(lambda a: L.logit_standardized_kd_loss(a, t, where=ex).sum())(s)
  assert np.all(np.asarray(g)[1] == 0.0)
  # a constant row is finite; huge logits give no NaN; bf16 in, bf16 out
  edge_s = jnp.concatenate([jnp.ones((1, 5)), 1e4 * s])
  edge_t = jnp.concatenate([t[:1], 1e4 * t])
  val, g = jax.jit(jax.value_and_grad(
      lambda a: E.logit_standardized_kd_loss(a, edge_t, eps=0.0).sum()))(edge_s)
  assert np.isfinite(val) and np.isfinite(g).all()
  lo = L.logit_standardized_kd_loss(s.astype(jnp.bfloat16), t.astype(jnp.bfloat16))
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float32), _lskd_ref(
      np.asarray(s.astype(jnp.bfloat16), np.float64),
      np.asarray(t.astype(jnp.bfloat16), np.float64), 1.0), rtol=2e-2, atol=2e-3)


def test_squared_error_logit_loss_reference_and_unbiasedness():
  s = rows(0, (4, 6))
  y = jnp.array([0, 5, 2, 2])
  lt = jnp.log(jnp.array([0.3, 0.1, 0.25, 0.05]))
  f = jax.jit(lambda a: L.squared_error_logit_loss(a, y, lt))
  want = lambda a: (_log_softmax(a)[np.arange(4), np.asarray(y)] - np.asarray(lt, np.float64)) ** 2
  np.testing.assert_allclose(f(s), want(np.asarray(s, np.float64)), rtol=1e-5)
  # gradient 2 (log q_a − log π*_a)(e_a − q), and −2 (log q_a − log π*_a) in the teacher term
  gs, gt = jax.grad(lambda a, b: L.squared_error_logit_loss(a, y, b).sum(), argnums=(0, 1))(s, lt)
  ls = _log_softmax(s)
  r = ls[np.arange(4), np.asarray(y)] - np.asarray(lt, np.float64)
  np.testing.assert_allclose(gs, 2 * r[:, None] * (np.eye(6)[np.asarray(y)] - np.exp(ls)),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(gt, -2 * r, rtol=1e-4, atol=1e-6)
  # population view: E_{a~π*} is minimised at the teacher (zero gradient there), while the
  # naive weighted CE E[-π*(a) log q(a)] is not (its minimiser is ∝ π*²)
  pi = jax.nn.softmax(rows(1, (6,)))
  labels = jnp.arange(6)
  expected = lambda z: jnp.sum(pi * L.squared_error_logit_loss(
      jnp.broadcast_to(z, (6, 6)), labels, jnp.log(pi)))
  np.testing.assert_allclose(jax.grad(expected)(jnp.log(pi)), 0.0, atol=1e-6)
  naive = lambda z: jnp.sum(pi * pi * -jax.nn.log_softmax(z))
  assert np.abs(jax.grad(naive)(jnp.log(pi))).max() > 1e-2
  np.testing.assert_allclose(jax.grad(naive)(2.0 * jnp.log(pi)), 0.0, atol=1e-6)
  out = L.squared_error_logit_loss(s, jnp.array([0, 9, 1, 1]), lt, ignore_index=1)
  assert np.isinf(out[1]) and out[2] == 0.0 and out[3] == 0.0
  assert np.isfinite(L.squared_error_logit_loss(1e4 * s, y, lt)).all()
  lo = L.squared_error_logit_loss(s.astype(jnp.bfloat16), y, lt)
  assert lo.dtype == jnp.bfloat16


def test_averaged_teacher_kd_reference_and_properties():
  s = rows(0, (3, 5))
  teachers = rows(1, (4, 3, 5), scale=2.0)

  def ref(a, tz, tau=1.5):
    pbar = np.exp(_log_softmax(np.asarray(tz, np.float64) / tau)).mean(0)
    return tau ** 2 * (pbar * (np.log(pbar) - _log_softmax(a / tau))).sum(-1)

  f = jax.jit(lambda a, b: L.averaged_teacher_kd_loss(a, b, temperature=1.5))
  np.testing.assert_allclose(f(s, teachers), ref(np.asarray(s, np.float64), teachers), rtol=1e-5)
  ct = np.asarray(rows(2, (3,)), np.float64)
  _, vjp = jax.vjp(f, s, teachers)
  ds, dt = vjp(jnp.asarray(ct, jnp.float32))
  np.testing.assert_allclose(ds, numeric_grad(lambda a: ref(a, teachers) @ ct, s), rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(dt, numeric_grad(lambda a: ref(np.asarray(s, np.float64), a) @ ct,
                                               teachers), rtol=1e-4, atol=1e-5)
  # zero exactly at the mean of softmaxes, not at the softmax of the mean logits
  pbar = jax.nn.softmax(teachers, -1).mean(0)
  np.testing.assert_allclose(L.averaged_teacher_kd_loss(jnp.log(pbar), teachers), 0.0, atol=1e-6)
  assert np.all(L.averaged_teacher_kd_loss(teachers.mean(0), teachers) > 1e-4)
  ex = L.averaged_teacher_kd_loss(s, teachers, where=jnp.array([True, False, True]))
  assert ex[1] == 0.0 and ex[0] > 0
  cls = jnp.array([True, False, True, True, True])
  got = L.averaged_teacher_kd_loss(s, teachers, temperature=1.5, where=cls[None])
  np.testing.assert_allclose(got, ref(np.asarray(s, np.float64)[:, cls],
                                      np.asarray(teachers)[..., cls]), rtol=1e-5)
  assert np.isfinite(jax.grad(lambda a: L.averaged_teacher_kd_loss(
      a, 1e4 * teachers).sum())(1e4 * s)).all()
  assert L.averaged_teacher_kd_loss(s.astype(jnp.bfloat16), teachers).dtype == jnp.bfloat16


def test_bad_inputs_name_the_argument():
  s = rows(0, (3, 5))
  check_raises(
      ("`temperature`", lambda: E.logit_standardized_kd_loss(s, s, temperature=0.0)),
      ("`teacher_logits`", lambda: E.logit_standardized_kd_loss(s, s[:2])),
      ("`eps`", lambda: E.logit_standardized_kd_loss(s, s, eps=-1.0)),
      ("`teacher_log_probs`", lambda: E.squared_error_logit_loss(s, jnp.zeros(3, jnp.int32),
                                                                 jnp.zeros(2))),
      ("`labels`", lambda: E.squared_error_logit_loss(s, jnp.zeros(3), jnp.zeros(3))),
      ("`teacher_logits`", lambda: E.averaged_teacher_kd_loss(s, s)),
      ("`temperature`", lambda: E.averaged_teacher_kd_loss(s, s[None], temperature=-1.0)),
  )
