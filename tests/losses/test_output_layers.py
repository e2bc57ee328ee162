"""L13 large-output layers, part 2 (VQ-logits, dual softmax, discretised logistic mixture,
pointer sentinel mixture, softmax-CPR) against float64 numpy references and identities."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, numeric_grad, rows
from tests.losses.jitted import Jitted

L = Jitted(js.losses)  # every call under jax.jit (see tests/losses/jitted.py)
E = js.losses          # eager: checks that need concrete values
ce_int = jax.jit(optax.losses.softmax_cross_entropy_with_integer_labels)


def _log_softmax(z):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _assert_vjp_matches(f, ref, args, ct, rtol, atol):
  """``f``'s VJP at ``args`` against finite differences of ``ref(*args) @ ct``, argument by
  argument; returns the VJP's gradients."""
  ct = np.asarray(ct, np.float64)
  _, vjp = jax.vjp(f, *args)
  grads = vjp(jnp.asarray(ct, jnp.float32))
  for i, arg in enumerate(args):
    def partial(a, i=i):
      full = list(args)
      full[i] = a
      return ref(*full) @ ct
    np.testing.assert_allclose(grads[i], numeric_grad(partial, arg), rtol=rtol, atol=atol)
  return grads


# ----------------------------------------------------------------------------- VQ-logits


def test_vq_logits_equal_a_gathered_dense_layer_and_cluster_softmax():
  h, c = rows(0, (4, 3)), rows(1, (3, 3))
  assignment = jnp.array([0, 0, 1, 2, 2, 2, 1])
  bias = rows(2, (7,))
  y = jnp.array([0, 3, 6, 1])
  logits = L.vq_logits(h, c, assignment, bias=bias)
  dense = np.asarray(h, np.float64) @ np.asarray(c, np.float64)[:, np.asarray(assignment)]
  np.testing.assert_allclose(logits, dense + np.asarray(bias), rtol=1e-5, atol=1e-6)
  f = jax.jit(lambda a, b: L.vq_logits_cross_entropy(a, b, assignment, y))
  want = -_log_softmax(dense)[np.arange(4), np.asarray(y)]
  np.testing.assert_allclose(f(h, c), want, rtol=1e-5)
  # gradient in the codebook against central differences of the float64 reference
  ct = np.asarray(rows(3, (4,)), np.float64)
  _, vjp = jax.vjp(f, h, c)
  ref = lambda cc: -_log_softmax(np.asarray(h, np.float64) @ cc[:, np.asarray(assignment)])[
      np.arange(4), np.asarray(y)] @ ct
  np.testing.assert_allclose(vjp(jnp.asarray(ct, jnp.float32))[1], numeric_grad(ref, c),
                             rtol=1e-4, atol=1e-5)
  # classes sharing a code are equiprobable (no bias); identity codebook = plain layer
  p = np.exp(_log_softmax(np.asarray(L.vq_logits(h, c, assignment))))
  np.testing.assert_allclose(p[:, 0], p[:, 1], rtol=1e-6)
  w = rows(4, (3, 5))
  np.testing.assert_allclose(L.vq_logits_cross_entropy(h, w, jnp.arange(5), y % 5),
                             ce_int(h @ w, y % 5), rtol=1e-5)
  # unused codes drop out; masks
  got = L.vq_logits_cross_entropy(h, c, jnp.array([0, 0, 2, 2]), y % 4,
                                  where=jnp.array([True, True, False, True]))
  assert got[2] == 0.0
  np.testing.assert_allclose(np.asarray(got)[[0, 1, 3]], ce_int(L.vq_logits(h, c, jnp.array([0, 0, 2, 2])),
                                                    y % 4)[jnp.array([0, 1, 3])], rtol=1e-5)


# --------------------------------------------------------------------------- dual softmax


def test_dual_softmax_factorises_and_sums_to_one():
  kc, kf = 4, 5
  zc = rows(0, (kc,))
  zf_given_c = rows(1, (kc, kf))                     # fine logits for each coarse value
  ys = jnp.arange(kc * kf)
  coarse = jnp.broadcast_to(zc, (kc * kf, kc))
  fine = zf_given_c[ys // kf]
  loss = jax.jit(L.dual_softmax_loss)(coarse, fine, ys)
  want = -(_log_softmax(zc)[np.asarray(ys) // kf]
           + _log_softmax(zf_given_c)[np.asarray(ys) // kf, np.asarray(ys) % kf])
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(np.exp(-np.asarray(loss, np.float64)).sum(), 1.0, rtol=1e-5)
  g = jax.grad(lambda a, b: L.dual_softmax_loss(a, b, ys).sum(), argnums=(0, 1))(coarse, fine)
  p_c = np.exp(_log_softmax(np.asarray(coarse)))
  np.testing.assert_allclose(g[0], p_c - np.eye(kc)[np.asarray(ys) // kf], atol=1e-6)
  out = L.dual_softmax_loss(coarse[:3], fine[:3], jnp.array([0, 99, 1]),
                            where=jnp.array([True, True, False]))
  assert np.isinf(out[1]) and out[2] == 0.0 and np.isfinite(out[0])
  lo = L.dual_softmax_loss(coarse.astype(jnp.bfloat16), fine.astype(jnp.bfloat16), ys)
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float32), loss, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------- discretised logistic mixture


def _dlm_ref(lw, mu, ls, k, bins=256):
  lw, mu, ls = (np.asarray(a, np.float64) for a in (lw, mu, ls))
  s = np.exp(np.maximum(ls, -7.0))
  x = (2.0 * np.asarray(k, np.float64) / (bins - 1) - 1.0)[..., None]
  hi = np.where(np.asarray(k)[..., None] == bins - 1, 1.0, _sigmoid((x + 1 / (bins - 1) - mu) / s))
  lo = np.where(np.asarray(k)[..., None] == 0, 0.0, _sigmoid((x - 1 / (bins - 1) - mu) / s))
  pi = np.exp(_log_softmax(lw))
  return -np.log((pi * (hi - lo)).sum(-1))


def test_discretized_logistic_mixture_matches_reference_and_sums_to_one():
  lw = rows(0, (3, 4))
  mu = jax.random.uniform(jax.random.key(1), (3, 4), minval=-1.0, maxval=1.0)
  ls = rows(2, (3, 4)) * 0.5 - 2.5
  k = jnp.array([0, 128, 255])
  f = jax.jit(lambda a, m, s: L.discretized_logistic_mixture_loss(a, m, s, k))
  np.testing.assert_allclose(f(lw, mu, ls), _dlm_ref(lw, mu, ls, k), rtol=1e-5)
  allk = jax.jit(jax.vmap(lambda kk: L.discretized_logistic_mixture_loss(
      lw, mu, ls, jnp.full((3,), kk))))(jnp.arange(256))
  np.testing.assert_allclose(np.exp(-np.asarray(allk, np.float64)).sum(0), 1.0, rtol=1e-5)
  _assert_vjp_matches(f, lambda *a: _dlm_ref(*a, k), (lw, mu, ls), rows(3, (3,)), 1e-3, 1e-4)
  # a few bins: sums to 1 too; masks and an out-of-range bin
  four = jax.vmap(lambda kk: L.discretized_logistic_mixture_loss(lw, mu, ls, jnp.full((3,), kk),
                                                                 num_bins=4))(jnp.arange(4))
  np.testing.assert_allclose(np.exp(-np.asarray(four, np.float64)).sum(0), 1.0, rtol=1e-6)
  out = L.discretized_logistic_mixture_loss(lw, mu, ls, jnp.array([3, 256, -1]),
                                            where=jnp.array([False, True, True]))
  assert out[0] == 0.0 and np.isinf(out[1]) and np.isinf(out[2])


def test_discretized_logistic_mixture_extremes_and_bf16():
  lw = rows(0, (4, 3)) * 1e3
  mu = jnp.array([[5.0, -5.0, 0.0]] * 4)
  ls = jnp.array([[-20.0, 4.0, -7.0]] * 4)
  k = jnp.array([0, 1, 128, 255])
  out, g = jax.value_and_grad(
      lambda a, m, s: L.discretized_logistic_mixture_loss(a, m, s, k).sum(), argnums=(0, 1, 2))(
          lw, mu, ls)
  assert np.isfinite(out) and all(np.all(np.isfinite(x)) for x in g)
  lw2, mu2, ls2 = rows(1, (4, 3)), 0.5 * rows(2, (4, 3)), rows(3, (4, 3)) - 3
  lo = L.discretized_logistic_mixture_loss(*(a.astype(jnp.bfloat16) for a in (lw2, mu2, ls2)), k)
  assert lo.dtype == jnp.bfloat16
  ref = _dlm_ref(*(np.asarray(a.astype(jnp.bfloat16), np.float64) for a in (lw2, mu2, ls2)), k)
  np.testing.assert_allclose(np.asarray(lo, np.float32), ref, rtol=2e-2)


# --------------------------------------------------------------- pointer sentinel mixture


def _pointer_ref(u, z, s, ids, ctx):
  u, z, s = (np.asarray(a, np.float64) for a in (u, z, s))
  b, v = u.shape
  zs = np.concatenate([np.where(ctx, z, -np.inf), s[:, None]], -1)
  a = np.exp(_log_softmax(zs))
  p = a[:, -1:] * np.exp(_log_softmax(u))
  for i in range(b):
    for t in range(z.shape[1]):
      p[i, ids[i, t]] += a[i, t]
  return np.log(p)


def test_pointer_sentinel_matches_reference_and_sums_to_one():
  u, z, s = rows(0, (3, 6)), rows(1, (3, 4)), rows(2, (3,))
  ids = jnp.array([[1, 1, 2, 5], [0, 3, 3, 3], [4, 4, 4, 4]])
  ctx = jnp.array([[True, True, True, True], [True, False, True, True], [True] * 4])
  lp = jax.jit(lambda *a: L.pointer_sentinel_log_probs(*a, ids, context_where=ctx))(u, z, s)
  want = _pointer_ref(u, z, s, np.asarray(ids), np.asarray(ctx))
  np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.exp(np.asarray(lp, np.float64)).sum(-1), 1.0, rtol=1e-5)
  y = jnp.array([5, 2, 4])                                    # absent, absent, present
  f = jax.jit(lambda *a: L.pointer_sentinel_loss(*a, ids, y, context_where=ctx))
  np.testing.assert_allclose(f(u, z, s), -want[np.arange(3), np.asarray(y)], rtol=1e-5)
  grads = _assert_vjp_matches(
      f, lambda *a: -_pointer_ref(*a, np.asarray(ids), np.asarray(ctx))[np.arange(3),
                                                                        np.asarray(y)],
      (u, z, s), rows(5, (3,)), 1e-4, 1e-5)
  assert all(np.any(np.asarray(g) != 0) for g in grads)     # both branches get gradient
  out = L.pointer_sentinel_loss(1e4 * u, 1e4 * z, 1e4 * s, ids, jnp.array([5, 9, 4]),
                                where=jnp.array([True, True, False]))
  assert np.isfinite(out[0]) and np.isinf(out[1]) and out[2] == 0.0


# ----------------------------------------------------------------------------- softmax-CPR


def test_softmax_cpr_logits_match_reference():
  h, w, bias = rows(0, (3, 4)), rows(1, (4, 8)), rows(2, (8,))
  hc, hr, zp = rows(3, (3, 4)), rows(4, (3, 4)), rows(5, (3, 5))
  ids = jnp.array([[1, 1, 2, 7, 0], [3, 3, 3, 3, 3], [6, 5, 4, 3, 2]])
  ctx = jnp.array([[True] * 5, [True] * 5, [True, True, False, True, True]])
  f = jax.jit(lambda h, w: L.softmax_cpr_logits(h, w, bias=bias, context_ids=ids,
                                                context_where=ctx, context_h=hc, reranker_h=hr,
                                                k=3, pointer_scores=zp))
  hn, wn = np.asarray(h, np.float64), np.asarray(w, np.float64)
  base = hn @ wn + np.asarray(bias)
  want = base.copy()
  for i in range(3):
    words = {int(t) for t, m in zip(np.asarray(ids[i]), np.asarray(ctx[i]), strict=True) if m}
    for v in words:
      want[i, v] += np.asarray(hc, np.float64)[i] @ wn[:, v]
    for v in np.argsort(-base[i])[:3]:
      want[i, v] += np.asarray(hr, np.float64)[i] @ wn[:, v]
    for t in range(5):
      if ctx[i, t]:
        want[i, int(ids[i, t])] += float(zp[i, t])
  np.testing.assert_allclose(f(h, w), want, rtol=1e-5, atol=1e-5)
  # no partitions / zero projections: the plain layer
  zero = jnp.zeros_like(h)
  np.testing.assert_allclose(
      L.softmax_cpr_logits(h, w, context_ids=ids, context_h=zero, reranker_h=zero, k=2),
      h @ w, rtol=1e-6)
  g = jax.grad(lambda a: jax.nn.log_softmax(L.softmax_cpr_logits(
      h, w, context_ids=ids, context_h=a, reranker_h=hr, k=3))[:, 1].sum())(hc)
  assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0)


@pytest.mark.slow
def test_softmax_cpr_breaks_the_softmax_bottleneck():
  # log-probabilities of a d-dim layer over many contexts have rank <= d + 1; the
  # context partition (sparse, context-dependent) lifts it
  d, v, b = 2, 12, 20
  h, w = rows(0, (b, d)), rows(1, (d, v))
  ids = jax.random.randint(jax.random.key(2), (b, 3), 0, v)
  plain = np.asarray(jax.nn.log_softmax(h @ w), np.float64)
  cpr = np.asarray(jax.nn.log_softmax(L.softmax_cpr_logits(h, w, context_ids=ids,
                                                           context_h=rows(3, (b, d)))),
                   np.float64)
  assert np.linalg.matrix_rank(plain, tol=1e-4) <= d + 1
  assert np.linalg.matrix_rank(cpr, tol=1e-4) > d + 1


@pytest.mark.parametrize("name", ["vq", "pointer", "cpr"])
def test_bf16_and_extreme_inputs(name):
  h, w, c = rows(0, (3, 4)), rows(1, (4, 6)), rows(2, (4, 3))
  y = jnp.array([0, 5, 2])
  ids = jnp.array([[1, 2], [5, 5], [0, 3]])
  fns = {
      "vq": lambda a: L.vq_logits_cross_entropy(a, c, jnp.array([0, 0, 1, 2, 2, 1]), y),
      "pointer": lambda a: L.pointer_sentinel_loss(a @ w.astype(a.dtype), a[:, :2], a[:, 2], ids, y),
      "cpr": lambda a: -jnp.take_along_axis(jax.nn.log_softmax(L.softmax_cpr_logits(
          a, w, context_ids=ids, context_h=a, reranker_h=a, k=2,
          pointer_scores=a[:, :2]).astype(jnp.float32)), y[:, None], -1)[:, 0],
  }
  f = fns[name]
  lo = f(h.astype(jnp.bfloat16))
  assert lo.dtype == (jnp.float32 if name == "cpr" else jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(lo, np.float32), f(h.astype(jnp.bfloat16).astype(
      jnp.float32)), rtol=2e-2, atol=2e-2)
  val, g = jax.value_and_grad(lambda a: f(a).sum())(1e3 * h)
  assert np.isfinite(val) and np.isfinite(g).all()


def test_bad_inputs_name_the_argument():
  h, w = rows(0, (3, 4)), rows(1, (4, 6))
  y = jnp.array([0, 1, 2])
  lw = rows(2, (3, 2))
  check_raises(
      ("`assignment`", lambda: E.vq_logits(h, w, jnp.array([0, 9]))),
      ("`codebook`", lambda: E.vq_logits(h, w[:2], jnp.array([0, 1]))),
      ("`bias`", lambda: E.vq_logits(h, w, jnp.array([0, 1]), bias=jnp.ones(3))),
      ("`labels`", lambda: E.dual_softmax_loss(lw, lw, jnp.zeros(2, jnp.int32))),
      ("`fine_logits`", lambda: E.dual_softmax_loss(lw, lw[:2], y)),
      ("`means`", lambda: E.discretized_logistic_mixture_loss(lw, lw[:, :1], lw, y)),
      ("`num_bins`", lambda: E.discretized_logistic_mixture_loss(lw, lw, lw, y, num_bins=1)),
      ("`context_ids`", lambda: E.pointer_sentinel_log_probs(h, lw, y.astype(float), y[:, None])),
      ("`context_ids`", lambda: E.pointer_sentinel_log_probs(h, lw, y.astype(float),
                                                             jnp.full((3, 2), 7))),
      ("`sentinel_score`", lambda: E.pointer_sentinel_log_probs(h, lw, lw, jnp.zeros((3, 2),
                                                                                     jnp.int32))),
      ("`k`", lambda: E.softmax_cpr_logits(h, w, reranker_h=h, k=0)),
      ("`context_ids`", lambda: E.softmax_cpr_logits(h, w, context_h=h)),
      ("`context_h`", lambda: E.softmax_cpr_logits(h, w, context_ids=jnp.zeros((3, 2), jnp.int32),
                                                   context_h=h[:, :2])),
  )


@pytest.mark.slow
def test_dual_softmax_full_16_bit():
  zc = rows(0, (256,))
  zf = rows(1, (256, 256))
  ys = jnp.arange(65536)
  loss = jax.jit(lambda: L.dual_softmax_loss(jnp.broadcast_to(zc, (65536, 256)), zf[ys // 256],
                                             ys))()
  np.testing.assert_allclose(np.exp(-np.asarray(loss, np.float64)).sum(), 1.0, rtol=1e-4)
