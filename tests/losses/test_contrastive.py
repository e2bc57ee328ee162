"""L09 contrastive losses against optax and float64 numpy references (values and gradients)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, normal, numeric_grad

L = js.losses
ce_int = optax.losses.softmax_cross_entropy_with_integer_labels


def _lse(z, axis=-1):
  m = np.max(z, axis=axis, keepdims=True)
  return np.squeeze(m, axis) + np.log(np.sum(np.exp(z - m), axis=axis))


def _check(f, ref, s, ct_seed=3, rtol=1e-4, atol=1e-5):
  """f (jax) == ref (float64 numpy) on s, and the VJP of a random cotangent == numeric."""
  ct = np.asarray(normal(ct_seed, (s.shape[0],)), np.float64)
  out, vjp = jax.vjp(f, s)
  (ds,) = vjp(jnp.asarray(ct, out.dtype))
  np.testing.assert_allclose(out, ref(np.asarray(s, np.float64)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ds, numeric_grad(lambda a: ref(a) @ ct, s), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------- InfoNCE


def test_info_nce_matches_optax_rows_and_columns():
  s = normal(0, (4, 6))
  labels = jnp.array([5, 0, 2, 2])
  got = jax.jit(lambda a: (L.info_nce(a, temperature=0.5),
                           L.info_nce(a, temperature=0.5, labels=labels),
                           L.info_nce(a[:, :4], temperature=0.5, symmetric=True)))(s)
  chex.assert_trees_all_close(got[0], ce_int(s / 0.5, jnp.arange(4)), rtol=1e-6)
  chex.assert_trees_all_close(got[1], ce_int(s / 0.5, labels), rtol=1e-6)
  sq = s[:, :4] / 0.5
  chex.assert_trees_all_close(got[2], 0.5 * (ce_int(sq, jnp.arange(4)) + ce_int(sq.T, jnp.arange(4))),
                              rtol=1e-6)


def _info_nce_ref(s, tau, am=0.0, aam=0.0, symmetric=False):
  s = np.array(s, np.float64)
  b = s.shape[0]
  d = np.diag(s[:, :b]).copy()
  if am:
    d = d - am
  if aam:
    d = np.cos(np.arccos(d) + aam)
  s[np.arange(b), np.arange(b)] = d
  z = s / tau
  rows = _lse(z) - np.diag(z)
  if not symmetric:
    return rows
  return 0.5 * (rows + _lse(z, 0) - np.diag(z))


@pytest.mark.parametrize("kw", [dict(), dict(margin=0.2), dict(angular_margin=0.3, symmetric=True)],
                         ids=["plain", "am", "aam_symmetric"])
def test_info_nce_matches_float64_reference(kw):
  s = jnp.tanh(normal(1, (5, 5)))                 # cosines for the angular margin
  f = jax.jit(lambda a: L.info_nce(a, temperature=0.2, **kw))
  _check(f, lambda a: _info_nce_ref(a, 0.2, kw.get("margin", 0.0), kw.get("angular_margin", 0.0),
                                    kw.get("symmetric", False)), s)


def test_info_nce_learned_temperature_gradient():
  s = normal(2, (4, 4))
  f = jax.jit(jax.value_and_grad(
      lambda log_tau: L.info_nce(s, temperature=jnp.exp(log_tau), symmetric=True).sum()))
  val, g = f(jnp.log(0.3))
  ref = lambda lt: _info_nce_ref(s, np.exp(lt), symmetric=True).sum()
  np.testing.assert_allclose(val, ref(np.log(0.3)), rtol=1e-5)
  np.testing.assert_allclose(g, numeric_grad(lambda a: ref(a[0]), np.array([np.log(0.3)]))[0],
                             rtol=1e-4)


def test_info_nce_masks_equal_deleting_the_pair():
  s = normal(3, (5, 5))
  where = jnp.array([True, False, True, True, True])
  keep = np.array([0, 2, 3, 4])
  @jax.jit
  def run(s):
    got, ds = jax.vjp(lambda a: L.info_nce(a, symmetric=True, where=where), s)
    want, dw = jax.vjp(lambda a: L.info_nce(a, symmetric=True), s[keep][:, keep])
    return got, ds(jnp.ones((5,)))[0], want, dw(jnp.ones((4,)))[0]

  got, ds, want, dw = run(s)
  np.testing.assert_allclose(got[keep], want, rtol=1e-6)
  np.testing.assert_allclose(ds[keep][:, keep], dw, rtol=1e-5, atol=1e-7)
  assert got[1] == 0.0 and np.all(ds[1] == 0.0) and np.all(ds[:, 1] == 0.0)
  pair = jnp.ones((5, 5), bool).at[0, 3].set(False)
  got = jax.jit(lambda a: L.info_nce(a, where=pair))(s)
  np.testing.assert_allclose(got[0], ce_int(s[0, jnp.array([0, 1, 2, 4])], 0), rtol=1e-6)


# ----------------------------------------------------------------------------- Soft-InfoNCE


def test_soft_info_nce_matches_reference_and_special_cases():
  s = normal(4, (4, 6))
  w = jax.random.uniform(jax.random.key(5), (4, 6), minval=0.1, maxval=2.0)

  def ref(a):
    e = np.exp(a) * np.asarray(w, np.float64)
    pos = np.exp(np.diag(a[:, :4]))
    e[np.arange(4), np.arange(4)] = pos
    return np.log(e.sum(-1)) - np.diag(a[:, :4])

  _check(jax.jit(lambda a: L.soft_info_nce(a, w)), ref, s)
  ones = L.soft_info_nce(s, jnp.ones_like(s), temperature=0.5)
  np.testing.assert_allclose(ones, L.info_nce(s, temperature=0.5), rtol=1e-6)
  drop = L.soft_info_nce(s, jnp.ones_like(s).at[:, 5].set(0.0))
  np.testing.assert_allclose(drop, L.info_nce(s[:, :5]), rtol=1e-6)
  # monotone increasing in each weight
  assert np.all(L.soft_info_nce(s, w * 1.5) > L.soft_info_nce(s, w))


def test_soft_info_nce_weights():
  sim = normal(6, (3, 5))
  w = L.soft_info_nce_weights(sim, floor=-np.inf)
  off = ~np.eye(3, 5, dtype=bool)
  np.testing.assert_allclose(np.asarray(w)[~off], 1.0)
  np.testing.assert_allclose(np.asarray(w)[off].reshape(3, 4).mean(-1), 1.0, rtol=1e-6)
  q = np.exp(np.asarray(sim, np.float64))
  q = np.where(off, q, 0.0)
  q /= q.sum(-1, keepdims=True)
  want = np.maximum(0.1, (1 - q) / (1 - 1 / 4))
  np.testing.assert_allclose(np.asarray(L.soft_info_nce_weights(sim))[off], want[off], rtol=1e-5)
  np.testing.assert_allclose(L.soft_info_nce_weights(jnp.zeros((3, 5))), 1.0, rtol=1e-6)


# ------------------------------------------------------------------- multi-positive losses


POS = np.array([[1, 1, 0, 0, 1, 0],
                [0, 1, 0, 0, 0, 0],
                [1, 1, 1, 1, 0, 0],
                [0, 0, 0, 0, 0, 0]], bool)


def _decoupled_ref(a):
  out = np.zeros(a.shape[0])
  for r in range(a.shape[0]):
    p, n = a[r, POS[r]], a[r, ~POS[r]]
    if len(p):
      out[r] = np.mean([np.logaddexp(v, _lse(n)) - v for v in p])
  return out


def _top_k_ref(a, k):
  out = np.zeros(a.shape[0])
  for r in range(a.shape[0]):
    p = np.sort(a[r, POS[r]])[::-1][:k]
    if len(p):
      out[r] = _lse(a[r]) - _lse(p)
  return out


def test_decoupled_softmax_matches_reference():
  s = normal(7, (4, 6), 2.0)
  _check(jax.jit(lambda a: L.decoupled_softmax_loss(a, POS)), _decoupled_ref, s)
  assert L.decoupled_softmax_loss(s, POS)[3] == 0.0
  # one positive per row is InfoNCE; a positive's term ignores the other positives
  one = jnp.eye(4, 6, dtype=bool)
  np.testing.assert_allclose(L.decoupled_softmax_loss(s, one), L.info_nce(s), rtol=1e-6)
  np.testing.assert_allclose(L.decoupled_softmax_loss(s + 3.0, POS),
                             L.decoupled_softmax_loss(s, POS), rtol=1e-5)


@pytest.mark.parametrize("k", [None, 2])
def test_top_k_multi_positive_matches_reference(k):
  s = normal(8, (4, 6), 2.0)
  _check(jax.jit(lambda a: L.top_k_multi_positive_loss(a, POS, k=k)),
         lambda a: _top_k_ref(a, 6 if k is None else k), s)


def test_top_k_multi_positive_single_positive_is_info_nce():
  s = normal(9, (4, 6))
  one = jnp.eye(4, 6, dtype=bool)
  np.testing.assert_allclose(L.top_k_multi_positive_loss(s, one, k=1, temperature=0.3),
                             L.info_nce(s, temperature=0.3), rtol=1e-6)


# -------------------------------------------------------------------------------- SoftCLIP


def _soft_clip_ref(a, sim_q, sim_c, eps, lam, tau=0.5, t_tau=0.7):
  b = a.shape[0]
  eye = np.eye(b)
  total = np.zeros(b)
  for z, sim in ((a / tau, sim_q), (a.T / tau, sim_c)):
    q = np.exp(sim / t_tau - _lse(sim / t_tau)[:, None])
    y = (1 - eps) * eye + eps * q
    log_p = z - _lse(z)[:, None]
    total += -(y * log_p).sum(-1)
    if lam:
      for i in range(b):
        neg = np.arange(b) != i
        yb = y[i, neg] / y[i, neg].sum()
        lpb = z[i, neg] - _lse(z[i, neg])
        total[i] += lam * np.sum(yb * (np.log(yb) - lpb))
  return 0.5 * total


def test_soft_clip_matches_reference_and_reduces_to_symmetric_info_nce():
  s, sq, sc = normal(10, (4, 4)), normal(11, (4, 4)), normal(12, (4, 4))
  f = jax.jit(lambda a: L.soft_clip_loss(a, sq, sc, temperature=0.5, target_temperature=0.7,
                                         smoothing=0.3, negative_weight=0.5))
  _check(f, lambda a: _soft_clip_ref(a, np.asarray(sq, np.float64), np.asarray(sc, np.float64),
                                     0.3, 0.5), s)
  np.testing.assert_allclose(
      L.soft_clip_loss(s, sq, smoothing=0.0, temperature=0.5),
      L.info_nce(s, temperature=0.5, symmetric=True), rtol=1e-6)


# ---------------------------------------------------------------------- numerics and errors


def test_bfloat16_and_extreme_scores():
  s = normal(13, (4, 6), 3.0)
  sb = s.astype(jnp.bfloat16)
  s32 = sb.astype(jnp.float32)

  def all_losses(a):
    return (L.info_nce(a), L.soft_info_nce(a, jnp.ones(a.shape)),
            L.decoupled_softmax_loss(a, POS), L.top_k_multi_positive_loss(a, POS, k=2),
            L.soft_clip_loss(a[:, :4], a[:, :4].astype(jnp.float32), smoothing=0.2,
                             negative_weight=0.1))

  run = jax.jit(all_losses)
  for lo, hi in zip(run(sb), run(s32), strict=True):
    assert lo.dtype == jnp.bfloat16
    np.testing.assert_allclose(lo.astype(np.float32), hi, rtol=1e-2, atol=1e-2)
  huge = s * 1e30
  grads = jax.jit(jax.grad(lambda a: sum(x.sum() for x in all_losses(a))))(huge)
  assert all(np.all(np.isfinite(x)) for x in run(huge)) and np.all(np.isfinite(grads))


def test_bad_input_names_the_argument():
  s = normal(14, (4, 6))
  check_raises(
      ("`scores`", lambda: L.info_nce(s[0])),
      ("`scores`", lambda: L.info_nce(s.T)),
      ("`scores`", lambda: L.info_nce(s, symmetric=True)),
      ("`labels`", lambda: L.info_nce(s[:, :4], labels=jnp.arange(4), symmetric=True)),
      ("`labels`", lambda: L.info_nce(s, labels=jnp.arange(3))),
      ("`temperature`", lambda: L.info_nce(s, temperature=0.0)),
      ("`margin`", lambda: L.info_nce(s, margin=-1.0)),
      ("`angular_margin`", lambda: L.info_nce(s, angular_margin=4.0)),
      ("`where`", lambda: L.info_nce(s, where=jnp.ones((3,), bool))),
      ("`negative_weights`", lambda: L.soft_info_nce(s, jnp.ones((4, 5)))),
      ("`negative_weights`", lambda: L.soft_info_nce(s, -jnp.ones((4, 6)))),
      ("`positives`", lambda: L.decoupled_softmax_loss(s, POS[:, :5])),
      ("`k`", lambda: L.top_k_multi_positive_loss(s, POS, k=0)),
      ("`smoothing`", lambda: L.soft_clip_loss(s[:, :4], s[:, :4], smoothing=1.5)),
      ("`query_similarity`", lambda: L.soft_clip_loss(s[:, :4], s)),
  )
