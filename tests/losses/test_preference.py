"""L10 preference losses (S-DPO, ADPO) against optax, float64 numpy and their reductions to DPO."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.jitted import Jitted

L = Jitted(js.losses)  # every call under jax.jit (see tests/losses/jitted.py)
E = js.losses          # eager: checks that need concrete values
ce_int = jax.jit(optax.losses.softmax_cross_entropy_with_integer_labels)


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def _log_softmax(z):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _sdpo_inputs(b=3, n=4):
  return rows(0, (b,)), rows(1, (b, n)), rows(2, (b,)), rows(3, (b, n))


def test_sdpo_is_softmax_ce_over_implicit_rewards_and_dpo_with_one_negative():
  c, r, rc, rr = _sdpo_inputs()
  f = jax.jit(lambda *a: L.sdpo_loss(*a, beta=0.5))
  logits = 0.5 * jnp.concatenate([(c - rc)[:, None], r - rr], -1)
  np.testing.assert_allclose(f(c, r, rc, rr), ce_int(logits, jnp.zeros(3, jnp.int32)), rtol=1e-6)
  # float64 reference of the paper's form -log σ(-log Σ exp(r_d - r_p))
  rp = 0.5 * (np.asarray(c, np.float64) - np.asarray(rc))
  rd = 0.5 * (np.asarray(r, np.float64) - np.asarray(rr))
  s = np.log(np.exp(rd - rp[:, None]).sum(-1))
  np.testing.assert_allclose(f(c, r, rc, rr), -_log_sigmoid(-s), rtol=1e-5)
  one = L.sdpo_loss(c, r[:, :1], rc, rr[:, :1], beta=0.5)
  np.testing.assert_allclose(one, -_log_sigmoid(rp - rd[:, 0]), rtol=1e-5)
  # gradients: β (softmax weight − [positive]) on the policy, the negative on the reference;
  # each negative's weight is its softmax weight (hard negatives weigh more)
  gc, gr, grc, grr = jax.grad(lambda *a: L.sdpo_loss(*a, beta=0.5).sum(), argnums=(0, 1, 2, 3))(
      c, r, rc, rr)
  p = np.exp(_log_softmax(logits))
  np.testing.assert_allclose(gc, 0.5 * (p[:, 0] - 1.0), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(gr, 0.5 * p[:, 1:], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grc, -np.asarray(gc), rtol=1e-6)
  np.testing.assert_allclose(grr, -np.asarray(gr), rtol=1e-6)


def test_sdpo_masks_extremes_and_bf16():
  c, r, rc, rr = _sdpo_inputs()
  neg = jnp.array([[True, False, True, True]] * 3)
  np.testing.assert_allclose(L.sdpo_loss(c, r, rc, rr, where=neg),
                             L.sdpo_loss(c, r[:, [0, 2, 3]], rc, rr[:, [0, 2, 3]]), rtol=1e-6)
  ex = jnp.array([True, False, True])
  out, g = jax.value_and_grad(lambda a: L.sdpo_loss(a, r, rc, rr, where=ex).sum())(c)
  assert g[1] == 0.0 and np.isfinite(out)
  big = jax.grad(lambda a: L.sdpo_loss(1e4 * a, 1e4 * r, rc, rr).sum())(c)
  assert np.isfinite(big).all()
  lo = L.sdpo_loss(*(a.astype(jnp.bfloat16) for a in (c, r, rc, rr)))
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float32), L.sdpo_loss(
      *(a.astype(jnp.bfloat16).astype(jnp.float32) for a in (c, r, rc, rr))), rtol=1e-2)


def _adpo_ref(l, lr, q, tau):
  l, lr, q = (np.asarray(a, np.float64) for a in (l, lr, q))
  log_p = _log_softmax((l - lr) / tau)
  return np.sum(np.where(q > 0, q * (np.log(np.where(q > 0, q, 1.0)) - log_p), 0.0), -1)


def test_adpo_reference_dpo_reduction_hessian_and_shift_invariance():
  l, lr = rows(0, (3, 5)), rows(1, (3, 5))
  q = jax.nn.softmax(rows(2, (3, 5))).at[0].set(jnp.array([0.0, 1.0, 0.0, 0.0, 0.0]))
  f = jax.jit(lambda a, b: L.adpo_loss(a, b, q, temperature=0.5))
  np.testing.assert_allclose(f(l, lr), _adpo_ref(l, lr, q, 0.5), rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(f(l, lr)) >= 0)
  np.testing.assert_allclose(f(l + 3.0, lr), f(l, lr), rtol=1e-5, atol=1e-6)
  # pairwise with q = (1, 0): DPO with β = 1/τ
  pair = L.adpo_loss(l[:, :2], lr[:, :2], jnp.array([[1.0, 0.0]] * 3), temperature=0.5)
  margin = (np.asarray(l[:, 0] - l[:, 1], np.float64) - np.asarray(lr[:, 0] - lr[:, 1])) / 0.5
  np.testing.assert_allclose(pair, -_log_sigmoid(margin), rtol=1e-5, atol=1e-6)
  with jax.enable_x64(True):
    l64, lr64, q64 = (jnp.asarray(a, jnp.float64) for a in (l[1], lr[1], q[1]))
    q64 = q64 / q64.sum()                                     # the Hessian scales with Σq
    hess = jax.hessian(lambda a: L.adpo_loss(a, lr64, q64, temperature=0.5))(l64)
    p = np.exp(_log_softmax((np.asarray(l64) - np.asarray(lr64)) / 0.5))
    np.testing.assert_allclose(hess, (np.diag(p) - np.outer(p, p)) / 0.25, rtol=1e-8, atol=1e-10)
    gl, glr = jax.grad(lambda a, b: L.adpo_loss(a, b, q64, temperature=0.5), argnums=(0, 1))(
        l64, lr64)
    np.testing.assert_allclose(gl, (p - np.asarray(q64)) / 0.5, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(glr, -np.asarray(gl), rtol=1e-12)


def test_adpo_masks_extremes_and_bf16():
  l, lr = rows(0, (3, 5)), rows(1, (3, 5))
  q = jax.nn.softmax(rows(2, (3, 4)))
  cand = jnp.array([True, True, False, True, True])
  got = L.adpo_loss(l, lr, jnp.insert(q, 2, 0.3, axis=1), where=cand[None])
  np.testing.assert_allclose(got, _adpo_ref(np.asarray(l)[:, cand], np.asarray(lr)[:, cand],
                                            q, 1.0), rtol=1e-5, atol=1e-6)
  qq = jax.nn.softmax(rows(3, (3, 5)))
  out, g = jax.value_and_grad(
      lambda a: L.adpo_loss(a, lr, qq, where=jnp.array([False, True, True])).sum())(l)
  assert np.all(np.asarray(g)[0] == 0.0) and np.isfinite(out)
  assert np.isfinite(jax.grad(lambda a: L.adpo_loss(1e4 * a, lr, qq).sum())(l)).all()
  lo = L.adpo_loss(l.astype(jnp.bfloat16), lr.astype(jnp.bfloat16), qq)
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float32), _adpo_ref(
      np.asarray(l.astype(jnp.bfloat16), np.float64),
      np.asarray(lr.astype(jnp.bfloat16), np.float64), qq, 1.0), rtol=2e-2, atol=1e-2)


def test_bad_inputs_name_the_argument():
  c, r, rc, rr = _sdpo_inputs()
  check_raises(
      ("`beta`", lambda: E.sdpo_loss(c, r, rc, rr, beta=0.0)),
      ("`rejected_logps`", lambda: E.sdpo_loss(c, r[:2], rc, rr)),
      ("`ref_chosen_logps`", lambda: E.sdpo_loss(c, r, rc[:2], rr)),
      ("`ref_rejected_logps`", lambda: E.sdpo_loss(c, r, rc, rr[:, :2])),
      ("`where`", lambda: E.sdpo_loss(c, r, rc, rr, where=jnp.ones((3, 2), bool))),
      ("`temperature`", lambda: E.adpo_loss(r, rr, rr, temperature=-1.0)),
      ("`targets`", lambda: E.adpo_loss(r, rr, rr[:, :2])),
      ("`ref_logps`", lambda: E.adpo_loss(r, rr.astype(jnp.complex64), rr)),
  )
