"""E18, routing geometry (catalogue 000#89; K. R. Balasubramanian, 2026, "All Routes Lead to
Collapse", arXiv 2606.22325), the claims notebooks/17_routing_geometry.py shows, as tests:

* the reframing identity q·k = -1/2||q - k||^2 + 1/2||q||^2 + 1/2||k||^2 holds exactly (to
  float rounding), and the library's distance logits (score="neg_sq_distance", A50) are
  -(s/2)||q - k||^2 within their stated float32 bound;
* with equal key norms, dot-product softmax attention equals distance softmax attention;
  with unequal norms it equals distance attention plus the key bonus (s/2)||k||^2 as a bias;
* averaged over random queries, the dot-product attention mass on a key grows with its norm
  scale c (Jensen), while under distance attention it shrinks; not for every query (those
  with a negative cosine to the key lose mass under dot products too).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from jaxsoft.attention.scores import neg_sq_distance_terms


def test_identity_is_exact_and_the_distance_logits_are_within_their_bound():
  rng = np.random.default_rng(0)
  D = 16
  q, k = rng.standard_normal((32, D)), rng.standard_normal((48, D))
  d2 = np.sum((q[:, None] - k[None]) ** 2, -1)
  qk = q @ k.T
  rhs = -0.5 * d2 + 0.5 * np.sum(q ** 2, -1)[:, None] + 0.5 * np.sum(k ** 2, -1)[None]
  # float64 terms of size <= ~60: rounding ~1e-14, 1e-12 is a 100x margin; a wrong sign or
  # factor in any term would be off by O(1)
  np.testing.assert_allclose(qk, rhs, rtol=0, atol=1e-12)
  s = 1.0 / np.sqrt(D)
  exact = -0.5 * s * d2
  norms = np.sum(q ** 2, -1)[:, None] + np.sum(k ** 2, -1)[None]

  @jax.jit
  def logits(q, k):
    cq, ck = neg_sq_distance_terms(q, k, s)
    return js.attention.dense_logits(q, k, scale=s, decay_bias=(cq, ck))[0, 0]

  got = np.asarray(logits(jnp.asarray(q, jnp.float32)[None, :, None],
                          jnp.asarray(k, jnp.float32)[None, :, None]), np.float64)
  bound = (D + 4) * 2.0 ** -24 * s * norms  # the bound of neg_sq_distance_terms' docstring
  assert np.all(np.abs(got - exact) <= bound)
  with jax.enable_x64(True):  # float64 inputs: float64 logits, rounding ~1e-15
    got64 = logits(jnp.asarray(q)[None, :, None], jnp.asarray(k)[None, :, None])
    assert got64.dtype == jnp.float64
    np.testing.assert_allclose(got64, exact, rtol=0, atol=1e-12)


@jax.jit
def _weights(q, k, bias):
  """Weights [T, S] of one row block under dot, distance and distance + bias (one-hot
  values make the outputs the weights)."""
  v = jnp.eye(k.shape[0])[:, None, :]
  w = lambda *a, **kw: js.attention.dot_product_attention(*a, **kw)[:, 0]
  return (w(q, k, v), w(q, k, v, score="neg_sq_distance"),
          w(q, k, v, bias, score="neg_sq_distance"))


def test_equal_key_norms_make_dot_and_distance_softmax_equal():
  rng = np.random.default_rng(1)
  D, S = 8, 24
  q = jnp.asarray(rng.standard_normal((6, 1, D)), jnp.float32)
  k = rng.standard_normal((S, 1, D))
  bonus = 0.5 / np.sqrt(D) * np.sum(k[:, 0] ** 2, -1)  # (s/2)||k_j||^2 per key
  w_dot, w_dist, w_bonus = _weights(q, jnp.asarray(k, jnp.float32), jnp.asarray(bonus)[None])
  # unequal norms: dot = distance + key bonus (float32 logits ~10: errors ~1e-6), and the
  # two scores differ by far more
  np.testing.assert_allclose(w_bonus, w_dot, rtol=0, atol=1e-5)
  assert float(jnp.max(jnp.abs(w_dot - w_dist))) > 0.05
  k_eq = 2.5 * k / np.linalg.norm(k, axis=-1, keepdims=True)
  w_dot, w_dist, _ = _weights(q, jnp.asarray(k_eq, jnp.float32), jnp.zeros((1, S)))
  np.testing.assert_allclose(w_dist, w_dot, rtol=0, atol=1e-6)


def test_mean_mass_on_a_key_grows_with_its_norm_under_dot_and_shrinks_under_distance():
  """n = 16 keys in d = 16, key 0 scaled by c in {1/2, 1, 2, 4}, 2048 random queries (seeded).
  The dot-product means (0.046, 0.057, 0.108, 0.227) step by 0.011 or more on the same
  queries, where the paired differences have Monte Carlo errors near 0.001 (std < 0.05 /
  sqrt(2048)): the 0.005 threshold sits between; the distance means fall by 2.5x or more
  per doubling of c (0.17, 0.066, 1.3e-3, 7e-11)."""
  rng = np.random.default_rng(2)
  n, d, Q = 16, 16, 2048
  C = np.array([0.5, 1.0, 2.0, 4.0], np.float32)
  base = rng.standard_normal((n, d)).astype(np.float32)
  qs = rng.standard_normal((Q, d)).astype(np.float32)
  k = np.repeat(base[None], len(C), 0)
  k[:, 0] *= C[:, None]
  q = np.broadcast_to(qs, (len(C), Q, d))[:, :, None]
  v = np.broadcast_to(np.eye(n, dtype=np.float32), (len(C), n, n))[:, :, None]

  @jax.jit
  def mass(q, k, v):
    f = lambda score: js.attention.dot_product_attention(q, k, v, score=score)[:, :, 0, 0]
    return f("dot"), f("neg_sq_distance")

  w_dot, w_dist = (np.asarray(w) for w in mass(q, k[:, :, None], v))  # [len(C), Q]
  m_dot, m_dist = w_dot.mean(1), w_dist.mean(1)
  assert np.all(np.diff(m_dot) > 0.005), m_dot
  assert np.all(m_dist[1:] < 0.5 * m_dist[:-1]), m_dist  # here each doubling of c: / 2.5 or more
  assert m_dot[-1] > 2 / n > 1e-3 / n > m_dist[-1]  # c = 4: a sink under dot, none under distance
  # the average, not every query: from c = 1 to 4 about half of the queries lose dot-product
  # mass on key 0, all of them pointing away from it
  falls = w_dot[3] < w_dot[1]
  cos = qs @ base[0] / np.linalg.norm(qs, axis=-1) / np.linalg.norm(base[0])
  assert 0.2 < falls.mean() < 0.8 and np.all(cos[falls] < 0)
