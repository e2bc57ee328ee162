"""Competition among the keys: what softmax's unit mass implies, and what escapes it
(catalogue row E21).

* LeapLabTHU, 2025/2026, "SD3.5-T^5" (Transformer -> test-time-training linearisation):
  softmax attention is invariant to adding one vector c to every key (q . (k_j + c) shifts
  a query's logits by the constant q . c), which is what licenses their key instance
  normalisation; with a scalar standard deviation that normalisation is a per-query
  temperature. Sigmoid attention (no normalisation over keys) is the control that fails.
* K. M. Nakanishi, 2026, "Screening Is Enough": Multiscreen weights keys against an
  absolute threshold with "no global competition or redistribution of unit mass": a key's
  weight does not depend on the other keys. Softmax attention is the control that fails.
* P. Velickovic, C. Perivolaropoulos, F. Barbero & R. Pascanu, 2024, "softmax is not
  enough (for sharp out-of-distribution)": a max-retrieval circuit trained on n <= 16
  items must disperse at larger n (every weight <= e^D / (n - 1 + e^D) for logit spread
  D), and adaptive temperature (beta >= 1) partly recovers the sharpness.

References are numpy float64 (written from the formulas) or exact identities.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsoft as js
from jaxsoft.attention import dot_product_attention, multiscreen_attention

# ---------------------------------------------------------------- key shift invariance


def test_softmax_attention_is_invariant_to_a_shared_key_shift_and_sigmoid_is_not():
  rng = np.random.default_rng(0)
  B, T, S, N, H = 2, 5, 7, 2, 4  # H = 4: the default scale 1/sqrt(H) = 1/2 is exact
  with jax.enable_x64(True):
    # Exact case: integer q, k and c, so every logit (q . k_j + q . c) / 2 is a float64
    # exactly and max-subtraction (a running max in the chunked loop) sees the very same
    # differences shifted or not: the outputs are bit-identical.
    q = rng.integers(-3, 4, (B, T, N, H)).astype(np.float64)
    k = rng.integers(-3, 4, (B, S, N, H)).astype(np.float64)
    v = rng.normal(size=(B, S, N, H))
    c = rng.integers(-5, 6, (B, 1, N, H)).astype(np.float64)
    att = jax.jit(dot_product_attention)
    np.testing.assert_array_equal(np.asarray(att(q, k + c, v)), np.asarray(att(q, k, v)))
    # Random float keys and shift: equal up to the rounding of the logits (|logit| ~ 10:
    # a few ulps, ~1e-14, times the output's sensitivity ~1: 1e-12 is a 100x margin).
    kf, cf = rng.normal(size=k.shape), 3.0 * rng.normal(size=c.shape)
    qf = rng.normal(size=q.shape)
    np.testing.assert_allclose(att(qf, kf + cf, v), att(qf, kf, v), rtol=0, atol=1e-12)
    # Key instance normalisation with one (scalar) mean vector and std per head:
    # (k - mu) / sigma gives the logits q . k / sigma + const(q): attention at scale
    # 1 / (sigma sqrt(H)), the per-query-constant part dropping out as above.
    mu = kf.mean(axis=1, keepdims=True)
    sigma = kf.std(axis=(1, 3), keepdims=True)  # [B, 1, N, 1]
    kn = (kf - mu) / sigma
    # the temperature differs per (batch, head): it is applied to the query (q / sigma)
    np.testing.assert_allclose(att(qf, kn, v), att(qf / sigma, kf, v), rtol=0, atol=1e-12)
    # Control: sigmoid attention weights each logit on its own, so the shift changes it.
    sig = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, normalizer="sigmoid"))
    assert np.max(np.abs(np.asarray(sig(q, k + c, v) - sig(q, k, v)))) > 0.1


# ---------------------------------------------------------------- no competition


def test_multiscreen_weights_have_no_competition_and_softmax_weights_do():
  # One query, S keys on the unit circle at known cosines; one-hot values read the weights
  # out exactly (each output entry is one weight times 1 plus exact zeros).
  theta = 0.25
  ang = np.array([0.2, 0.9, 1.2, 2.5, 0.5])  # cos: 0.98, 0.62, 0.36, -0.80, 0.88
  S = ang.size

  def weights(angles, fn):
    q = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    k = jnp.stack([jnp.cos(angles), jnp.sin(angles)], -1).reshape(1, S, 1, 2)
    return fn(q, k, jnp.eye(S).reshape(1, S, 1, S))[0, 0, 0]

  screen = jax.jit(lambda a: weights(a, lambda q, k, v: multiscreen_attention(
      q, k, v, theta=theta)))
  soft = jax.jit(lambda a: weights(a, lambda q, k, v: dot_product_attention(q, k, v, scale=4.0)))
  # key 4 becomes a perfect match (cosine 1)
  moved = ang.copy()
  moved[4] = 0.0
  w0, w1 = np.asarray(screen(ang)), np.asarray(screen(moved))
  others = [0, 1, 2, 3]
  # No competition: the untouched keys keep exactly their weights (each weight is a
  # function of its own cosine only) ...
  np.testing.assert_array_equal(w1[others], w0[others])
  # ... which are the reconstruction's clip((cos - theta) / (1 - theta), 0, 1) (float32:
  # cos and the division round to ~1e-7 relative; 1e-6 absolute).
  ref = np.clip((np.cos(ang.astype(np.float64)) - theta) / (1 - theta), 0, 1)
  np.testing.assert_allclose(w0, ref, rtol=0, atol=1e-6)
  # ... and no unit mass: the total weight follows the keys (2.46 -> 2.62 here).
  assert abs(w1.sum() - w0.sum()) > 0.1
  # Control: softmax redistributes a unit mass, so the same move changes every other weight.
  s0, s1 = np.asarray(soft(ang)), np.asarray(soft(moved))
  assert np.all(np.abs(s1[others] / s0[others] - 1) > 0.1)  # each loses ~17%
  np.testing.assert_allclose([s0.sum(), s1.sum()], 1.0, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- trained dispersion

_D = 4  # key width of the max-retrieval circuit


def _logits(params, x):
  """One head: key k_j = W [x_j, 1], a learned query q; logits q . k_j (q and the key
  weights are learned, so this is a general affine score a x_j + b)."""
  keys = x[..., None] * params["w"][0][None, None] + params["w"][1][None, None]  # [batch, n, D]
  return keys @ params["q"]


def _train_max_retrieval(steps=150, n=16, batch=128):
  def loss(params, x):
    p = js.normalizers.softmax(_logits(params, x))
    return jnp.mean((jnp.sum(p * x, -1) - jnp.max(x, -1)) ** 2)

  opt = optax.adam(0.1)
  params = {"w": 0.1 * jax.random.normal(jax.random.key(1), (2, _D), jnp.float64),
            "q": 0.1 * jax.random.normal(jax.random.key(2), (_D,), jnp.float64)}

  @jax.jit
  def train(params):
    def step(carry, key):
      params, state = carry
      x = jax.random.uniform(key, (batch, n), jnp.float64)
      g = jax.grad(loss)(params, x)
      updates, state = opt.update(g, state)
      return (optax.apply_updates(params, updates), state), None
    keys = jax.random.split(jax.random.key(3), steps)
    return jax.lax.scan(step, (params, opt.init(params)), keys)[0][0]

  return train(params)


def test_trained_max_retrieval_disperses_with_n_and_adaptive_temperature_sharpens():
  sizes = (16, 128, 1024)
  rows = 64
  with jax.enable_x64(True):
    params = _train_max_retrieval()
    # one program for every test size: rows of n items are the first n of 1024, masked
    rng = np.random.default_rng(4)
    x = rng.uniform(size=(len(sizes) * rows, sizes[-1]))
    n = np.repeat(sizes, rows)
    visible = np.arange(sizes[-1]) < n[:, None]
    x = np.where(visible, x, 0.0)

    @jax.jit
    def evaluate(x, visible):
      z = _logits(params, x)
      return (z, js.normalizers.softmax(z, where=visible),
              js.normalizers.adaptive_temperature_softmax(z, where=visible))

    z, p, pa = (np.asarray(a) for a in evaluate(x, visible))
  # the theorem's bound, row by row, from the row's logit spread D (temperature 1):
  # max_k p_k <= e^D / (n - 1 + e^D); an exact inequality, 1e-12 covers the rounding.
  spread = np.where(visible, z, -np.inf).max(-1) - np.where(visible, z, np.inf).min(-1)
  bound = np.exp(spread) / (n - 1 + np.exp(spread))
  assert np.all(p.max(-1) <= bound * (1 + 1e-12))
  # beta >= 1 only sharpens: the largest weight never drops (1e-12: rounding)
  assert np.all(pa.max(-1) >= p.max(-1) - 1e-12)
  # in distribution the circuit retrieves the max (mean error ~0.014 of a unit range)
  retrieved = np.sum(p * x, -1)
  assert np.mean(np.abs(retrieved - x.max(-1))[:rows]) < 0.05
  per_size = lambda a: a.reshape(len(sizes), rows).mean(-1)  # noqa: E731
  max_w, ada_w = per_size(p.max(-1)), per_size(pa.max(-1))
  entropy = per_size(-np.sum(np.where(visible, p * np.log(np.where(visible, p, 1.0)), 0.0), -1))
  # sharp in distribution (measured 0.67-0.70 over five training seeds), dispersed out of
  # it: the max weight falls (to 0.023-0.026 at n = 1024) and the entropy grows
  assert max_w[0] > 0.4, max_w
  assert max_w[0] > max_w[1] > max_w[2] and max_w[2] < 0.2 * max_w[0], max_w
  assert entropy[0] < entropy[1] < entropy[2], entropy
  # adaptive temperature partly recovers: 2.3-2.4 times the max weight at n = 1024
  assert ada_w[2] > 1.5 * max_w[2], (ada_w, max_w)
