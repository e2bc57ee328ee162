"""L13 large-output layers, part 1 (sampled softmax, negative sampling, hierarchical softmax,
Augment and Reduce) against float64 numpy references, identities and edge cases."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxsoft as js
from tests.helpers import check_raises, numeric_grad, rows
from tests.losses.jitted import Jitted

L = Jitted(js.losses)  # every call under jax.jit (see tests/losses/jitted.py)
E = js.losses          # eager: checks that need concrete values
ce_int = jax.jit(optax.losses.softmax_cross_entropy_with_integer_labels)


def _lse(z, axis=-1):
  m = np.max(z, axis=axis, keepdims=True)
  return np.squeeze(m, axis) + np.log(np.sum(np.exp(z - m), axis=axis))


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def _inputs(b=4, d=3, v=7, seed=0):
  return rows(seed, (b, d)), rows(seed + 1, (d, v)), jnp.arange(b) % v


# ------------------------------------------------------------------------ sampled softmax


def _sampled_ref(h, w, y, sampled, q, bias=None):
  h, w, q = (np.asarray(a, np.float64) for a in (h, w, q))
  o = h @ w + (0.0 if bias is None else np.asarray(bias, np.float64))
  q = q / q.sum()
  s = len(sampled)
  out = []
  for i, yi in enumerate(np.asarray(y)):
    terms = [o[i, yi]] + [o[i, c] - np.log(s * q[c]) for c in sampled if c != yi]
    out.append(_lse(np.array(terms)) - o[i, yi])
  return np.array(out)


def test_sampled_softmax_matches_reference_and_full_ce_identity():
  h, w, y = _inputs()
  q = jnp.array([1.0, 2.0, 3.0, 1.0, 0.5, 2.0, 4.0])
  bias = rows(9, (7,))
  sampled = jnp.array([0, 6, 6, 2, 3, 1])
  f = jax.jit(lambda h, w: L.sampled_softmax_loss(None, h, w, y, 0, proposal=q, bias=bias,
                                                  sampled=sampled))
  np.testing.assert_allclose(f(h, w), _sampled_ref(h, w, y, np.asarray(sampled), q, bias),
                             rtol=1e-5)
  # every class sampled once under a uniform proposal: exactly the full softmax CE
  full = L.sampled_softmax_loss(None, h, w, y, 0, sampled=jnp.arange(7))
  np.testing.assert_allclose(full, ce_int(h @ w, y), rtol=1e-6)
  # drawn samples: the same formula on the drawn ids; many draws tend to the full CE
  key = jax.random.key(4)
  drawn = jax.random.categorical(key, jnp.log(q / q.sum()), shape=(5,))
  np.testing.assert_allclose(L.sampled_softmax_loss(key, h, w, y, 5, proposal=q),
                             _sampled_ref(h, w, y, np.asarray(drawn), q), rtol=1e-5)


@pytest.mark.slow
def test_sampled_softmax_tends_to_the_full_ce():
  h, w, y = _inputs()
  q = jnp.array([1.0, 2.0, 3.0, 1.0, 0.5, 2.0, 4.0])
  many = L.sampled_softmax_loss(jax.random.key(5), h, w, y, 20000, proposal=q)
  np.testing.assert_allclose(many, ce_int(h @ w, y), atol=0.03)


def test_sampled_softmax_gradient_and_masks():
  h, w, y = _inputs()
  sampled = jnp.array([1, 3, 3, 5])
  f = lambda h, w: L.sampled_softmax_loss(None, h, w, y, 0, sampled=sampled,
                                          where=jnp.array([True, False, True, True]))
  out, vjp = jax.vjp(f, h, w)
  dh, dw = vjp(jnp.ones(4))
  assert out[1] == 0.0 and np.all(dh[1] == 0.0)
  keep = np.array([0, 2, 3])
  ref = lambda a: _sampled_ref(a, w, y, np.asarray(sampled), np.ones(7))[keep].sum()
  np.testing.assert_allclose(dh, np.where(np.arange(4)[:, None] == 1, 0.0,
                                          numeric_grad(ref, h)), rtol=1e-4, atol=1e-5)
  # only the label's and the sampled columns receive gradient
  touched = np.zeros(7, bool)
  touched[[0, 2, 3, 1, 5]] = True
  assert np.all(np.asarray(dw)[:, ~touched] == 0.0) and np.any(np.asarray(dw)[:, touched] != 0)
  ign = L.sampled_softmax_loss(None, h, w, y, 0, sampled=sampled, ignore_index=2)
  assert ign[2] == 0.0 and ign[0] > 0
  bad = L.sampled_softmax_loss(None, h, w, jnp.array([0, 9, 1, -1]), 0, sampled=sampled)
  assert np.isinf(bad[1]) and np.isinf(bad[3]) and np.all(np.isfinite(np.asarray(bad)[[0, 2]]))


# ---------------------------------------------------------------------- negative sampling


def test_negative_sampling_matches_reference_and_draws():
  h, w, y = _inputs()
  neg = jnp.array([[1, 2], [0, 0], [5, 6], [3, 3]])
  bias = rows(8, (7,))

  def ref(h, w):
    o = np.asarray(h, np.float64) @ np.asarray(w, np.float64) + np.asarray(bias, np.float64)
    rows = np.arange(4)
    return (-_log_sigmoid(o[rows, np.asarray(y)])
            - _log_sigmoid(-o[rows[:, None], np.asarray(neg)]).sum(-1))

  f = jax.jit(lambda h, w: L.negative_sampling_loss(None, h, w, y, 0, negatives=neg, bias=bias))
  np.testing.assert_allclose(f(h, w), ref(h, w), rtol=1e-5)
  counts = jnp.array([10.0, 1.0, 0.0, 5.0, 2.0, 3.0, 8.0])
  p = L.unigram_proposal(counts)
  np.testing.assert_allclose(p, counts ** 0.75 / np.sum(np.asarray(counts) ** 0.75), rtol=1e-6)
  key = jax.random.key(2)
  drawn = jax.random.categorical(key, jnp.log(p), shape=(4, 3))
  np.testing.assert_allclose(
      L.negative_sampling_loss(key, h, w, y, 3, proposal=counts ** 0.75),
      L.negative_sampling_loss(None, h, w, y, 0, negatives=drawn), rtol=1e-6)
  assert not np.any(np.asarray(drawn) == 2)                  # zero count: never drawn
  ct = np.asarray(rows(6, (4,)), np.float64)
  _, vjp = jax.vjp(f, h, w)
  dh, dw = vjp(jnp.asarray(ct, jnp.float32))
  np.testing.assert_allclose(dh, numeric_grad(lambda a: ref(a, w) @ ct, h), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, numeric_grad(lambda a: ref(h, a) @ ct, w), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_unigram_proposal_draw_frequencies():
  p = L.unigram_proposal(jnp.array([10.0, 1.0, 0.0, 5.0, 2.0, 3.0, 8.0]))
  draws = jax.random.categorical(jax.random.key(2), jnp.log(p), shape=(40000,))
  np.testing.assert_allclose(np.bincount(np.asarray(draws), minlength=7) / 40000, p, atol=0.01)


# ------------------------------------------------------------------- hierarchical softmax


def _hs_ref(h, w, paths, codes):
  o = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  out = np.zeros((o.shape[0], paths.shape[0]))
  for v in range(paths.shape[0]):
    for j in range(paths.shape[1]):
      if paths[v, j] >= 0:
        out[:, v] += _log_sigmoid((1 - 2 * codes[v, j]) * o[:, paths[v, j]])
  return out


def test_huffman_tree_is_a_prefix_code_with_short_codes_for_frequent_classes():
  counts = np.array([40, 1, 3, 9, 2, 20, 5])
  paths, codes = E.huffman_tree(counts)
  depth = (paths >= 0).sum(1)
  assert depth[0] == depth.min() and depth[1] == depth.max()
  words = {"".join(map(str, codes[v, :depth[v]])) for v in range(7)}
  assert len(words) == 7
  assert not any(a != b and b.startswith(a) for a in words for b in words)
  assert np.all(paths[:, 0] == 5) and set(paths[paths >= 0].tolist()) == set(range(6))
  np.testing.assert_allclose(np.sum(2.0 ** -depth), 1.0)    # Kraft equality: a full tree


def test_hierarchical_softmax_sums_to_one_and_matches_reference():
  paths, codes = E.huffman_tree(np.array([40, 1, 3, 9, 2, 20, 5]))
  h, w, _ = _inputs(v=6)
  y = jnp.array([0, 6, 3, 1])
  lp = jax.jit(lambda h, w: L.hierarchical_softmax_log_probs(h, w, paths, codes))(h, w)
  want = _hs_ref(h, w, paths, codes)
  np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.exp(np.asarray(lp, np.float64)).sum(-1), 1.0, rtol=1e-6)
  f = jax.jit(lambda a, b: L.hierarchical_softmax_loss(a, b, y, paths, codes))
  np.testing.assert_allclose(f(h, w), -want[np.arange(4), np.asarray(y)], rtol=1e-5)
  ct = np.asarray(rows(7, (4,)), np.float64)
  _, vjp = jax.vjp(f, h, w)
  dh, dw = vjp(jnp.asarray(ct, jnp.float32))
  ref = lambda a, b: -_hs_ref(a, b, paths, codes)[np.arange(4), np.asarray(y)] @ ct
  np.testing.assert_allclose(dh, numeric_grad(lambda a: ref(a, w), h), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, numeric_grad(lambda b: ref(h, b), w), rtol=1e-4, atol=1e-5)
  # a hand-made tree (root 0 -> {leaf 0, node 1 -> {leaf 1, leaf 2}}), given as arrays
  hp = jnp.array([[0, -1], [0, 1], [0, 1]])
  hc = jnp.array([[0, 0], [1, 0], [1, 1]])
  lp3 = L.hierarchical_softmax_log_probs(h, w[:, :2], hp, hc)
  np.testing.assert_allclose(np.exp(lp3).sum(-1), 1.0, rtol=1e-6)
  # huge scores: no NaN, still normalised
  big = L.hierarchical_softmax_log_probs(1e4 * h, w, paths, codes)
  assert np.all(np.isfinite(big) | (np.asarray(big) == -np.inf))
  g = jax.grad(lambda a: L.hierarchical_softmax_loss(a, w, y, paths, codes).sum())(1e4 * h)
  assert np.all(np.isfinite(g))


def test_hierarchical_softmax_masks_and_edge_cases():
  paths, codes = E.huffman_tree(np.array([3, 1, 1, 2]))
  h, w, _ = _inputs(v=3)
  y = jnp.array([0, 1, 7, 3])
  f = lambda a: L.hierarchical_softmax_loss(a, w, y, paths, codes,
                                            where=jnp.array([True, False, True, True]))
  out, vjp = jax.vjp(f, h)
  (dh,) = vjp(jnp.ones(4))
  assert out[1] == 0.0 and np.all(dh[1] == 0.0)
  assert np.isinf(out[2]) and np.all(np.isfinite(dh))
  assert L.hierarchical_softmax_loss(h, w, y, paths, codes, ignore_index=7)[2] == 0.0


# --------------------------------------------------------------------- Augment and Reduce


def _ar_ref(x, y, mu):
  x = np.asarray(x, np.float64)
  s = np.array([np.exp(np.delete(x[i], yi) - x[i, yi]).sum() for i, yi in enumerate(y)])
  return mu - 1.0 + np.exp(-mu) * (1.0 + s)


def test_augment_reduce_integral_bound_and_estimator():
  # the latent-utility integral with Gumbel noise is the softmax (quadrature, K = 5)
  psi = np.array([0.3, -1.0, 2.0, 0.5, -0.2])
  eps = np.linspace(-8.0, 30.0, 200001)
  phi = np.exp(-eps - np.exp(-eps))
  for k in range(5):
    prod = np.exp(-np.exp(-eps)[:, None] * np.exp(np.delete(psi, k) - psi[k])).prod(1)
    np.testing.assert_allclose(np.trapezoid(phi * prod, eps), np.exp(psi[k] - _lse(psi)),
                               rtol=1e-6)
  x = rows(0, (3, 5))
  y = jnp.array([0, 2, 4])
  ce = np.asarray(ce_int(x, y), np.float64)
  for mu in (-1.0, 0.5, 3.0):                                 # an upper bound on the CE
    assert np.all(_ar_ref(x, np.asarray(y), mu) >= ce - 1e-12)
  # unbiased: the mean over many keys is the closed form; the optimal location gives the CE
  keys = jax.random.split(jax.random.key(1), 4000)
  est = jax.jit(jax.vmap(lambda k: L.augment_reduce_loss(k, x, y, 2, location=0.5)))(keys)
  np.testing.assert_allclose(est.mean(0), _ar_ref(x, np.asarray(y), 0.5), rtol=0.03)


@pytest.mark.slow
def test_augment_reduce_optimal_location_is_unbiased_for_the_ce():
  x = rows(0, (3, 5))
  y = jnp.array([0, 2, 4])
  keys = jax.random.split(jax.random.key(1), 4000)
  opt = jax.jit(jax.vmap(lambda k: L.augment_reduce_loss(k, x, y, 2)))(keys)
  np.testing.assert_allclose(opt.mean(0), ce_int(x, y), rtol=0.03)


def test_augment_reduce_two_classes_is_exact_with_gradient():
  x = rows(2, (4, 2))
  y = jnp.array([0, 1, 1, 0])
  mu = jnp.array([0.1, 1.0, -0.5, 2.0])
  got = L.augment_reduce_loss(jax.random.key(0), x, y, 3, location=mu)
  np.testing.assert_allclose(got, _ar_ref(x, np.asarray(y), np.asarray(mu)), rtol=1e-5)
  opt = L.augment_reduce_loss(jax.random.key(0), x, y, 3)
  np.testing.assert_allclose(opt, ce_int(x, y), rtol=1e-5)
  ct = np.asarray(rows(3, (4,)), np.float64)
  _, vjp = jax.vjp(lambda a, m: L.augment_reduce_loss(jax.random.key(0), a, y, 2, location=m),
                   x, mu)
  dx, dmu = vjp(jnp.asarray(ct, jnp.float32))
  np.testing.assert_allclose(dx, numeric_grad(lambda a: _ar_ref(a, np.asarray(y), np.asarray(
      mu, np.float64)) @ ct, x), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dmu, numeric_grad(lambda m: _ar_ref(x, np.asarray(y), m) @ ct, mu),
                             rtol=1e-4, atol=1e-5)
  ext = L.augment_reduce_loss(jax.random.key(0), 1e4 * x, y, 2)
  assert np.all(np.isfinite(ext))


# ------------------------------------------------------------- gradients, dtypes, errors


@pytest.mark.slow
def test_float64_gradients():
  paths, codes = E.huffman_tree(np.array([4, 1, 2, 3, 1]))
  with jax.enable_x64(True):
    h = jnp.asarray(rows(0, (3, 2)), jnp.float64)
    w = jnp.asarray(rows(1, (2, 5)), jnp.float64)
    y = jnp.array([0, 4, 2])
    check_grads(lambda a, b: L.sampled_softmax_loss(None, a, b, y, 0,
                                                    sampled=jnp.array([1, 3, 3, 4])),
                (h, w), order=1, modes=["rev"])
    check_grads(lambda a, b: L.negative_sampling_loss(None, a, b, y, 0,
                                                      negatives=jnp.array([[1], [2], [0]])),
                (h, w), order=1, modes=["rev"])
    check_grads(lambda a, b: L.hierarchical_softmax_loss(a, b[:, :4], y, paths, codes),
                (h, w), order=1, modes=["rev"])


@pytest.mark.parametrize("name", ["sampled", "negative", "hierarchical", "augment_reduce"])
def test_bf16_and_extreme_inputs(name):
  paths, codes = E.huffman_tree(np.array([4, 1, 2, 3, 1, 1, 1]))
  h, w, y = _inputs()
  fns = {
      "sampled": lambda a, b: L.sampled_softmax_loss(None, a, b, y, 0, sampled=jnp.arange(7)),
      "negative": lambda a, b: L.negative_sampling_loss(None, a, b, y, 0,
                                                        negatives=jnp.ones((4, 2), jnp.int32)),
      "hierarchical": lambda a, b: L.hierarchical_softmax_loss(a, b[:, :6], y, paths, codes),
      "augment_reduce": lambda a, b: L.augment_reduce_loss(
          jax.random.key(0), a @ b, y, 3, where=jnp.array([True, True, False, True])),
  }
  f = fns[name]
  lo = f(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float32),
                             f(h.astype(jnp.bfloat16).astype(jnp.float32),
                               w.astype(jnp.bfloat16).astype(jnp.float32)), rtol=1e-2)
  # huge inputs: finite losses (or +inf nowhere) and finite gradients
  val, g = jax.value_and_grad(lambda a: f(a, w).sum())(1e3 * h)
  assert np.isfinite(val) and np.isfinite(g).all()


def test_bad_inputs_name_the_argument():
  h, w, y = _inputs()
  paths, codes = E.huffman_tree(np.array([1, 1, 1]))
  check_raises(
      ("`w`", lambda: E.sampled_softmax_loss(None, h, w[:2], y, 3)),
      ("`key`", lambda: E.sampled_softmax_loss(None, h, w, y, 3)),
      ("`num_samples`", lambda: E.sampled_softmax_loss(jax.random.key(0), h, w, y, 0)),
      ("`proposal`", lambda: E.sampled_softmax_loss(jax.random.key(0), h, w, y, 2,
                                                    proposal=-jnp.ones(7))),
      ("`labels`", lambda: E.sampled_softmax_loss(None, h, w, y.astype(float), 0,
                                                  sampled=jnp.arange(2))),
      ("`where`", lambda: E.negative_sampling_loss(jax.random.key(0), h, w, y, 2,
                                                   where=jnp.ones(3, bool))),
      ("`num_negatives`", lambda: E.negative_sampling_loss(jax.random.key(0), h, w, y, -1)),
      ("`negatives`", lambda: E.negative_sampling_loss(None, h, w, y, 0,
                                                       negatives=jnp.full((4, 2), 7))),
      ("`sampled`", lambda: E.sampled_softmax_loss(None, h, w, y, 0, sampled=jnp.array([0, -1]))),
      ("`counts`", lambda: E.unigram_proposal(jnp.zeros(3))),
      ("`paths`", lambda: E.hierarchical_softmax_loss(h, w[:, :1], y, paths, codes)),
      ("`codes`", lambda: E.hierarchical_softmax_loss(h, w, y, paths, 2 * codes + 2)),
      ("`counts`", lambda: E.huffman_tree([3])),
      ("`num_samples`", lambda: E.augment_reduce_loss(jax.random.key(0), h, y, 0)),
      ("`logits`", lambda: E.augment_reduce_loss(jax.random.key(0), h[:, :1], y, 1)),
  )
