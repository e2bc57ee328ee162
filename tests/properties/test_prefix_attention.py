"""Prefix independence of relative attention (catalogue E11; A. Petrov, P. H. S. Torr &
A. Bibi 2024, "When Do Prompting and Prefix-Tuning Work? A Theory of Capabilities and
Limitations"), the claims notebooks/21_prefix_attention.py shows, as tests:

* softmax: prepending prefix tokens scales every content weight of row i by the same
  ``1 - α_i`` (α_i the prefix mass), so the relative attention over the content cannot change,
  and the output moves to ``(1 - α_i) t_i + Σ_s w_is W_V s``: towards the convex hull of the
  prefix values;
* softmax_1 and a sink are softmax over [a zero-value prefix, content]: they only shrink the
  output, ``t = (1 - α) t_softmax``, and a real prefix on top of softmax_1 obeys the theorem;
* sigmoid with a fixed bias: a prefix leaves every content weight unchanged and adds
  ``σ(q·k_s + b) W_V s``; with the length bias ``-log n`` (n counting the prefix) and under
  sparsemax a prefix does move the relative attention; a rank-1 update of W_Q (LoRA) moves it
  under softmax.

References are numpy float64 written from the formulas; the library runs in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js

T, S, M, H = 5, 7, 3, 4          # queries, content keys, prefix tokens, head dimension


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((T, H)) * 1.5
  k = rng.standard_normal((S, H)) * 1.5
  v = rng.standard_normal((S, H))
  kp = rng.standard_normal((M, H)) * 2.0
  vp = rng.standard_normal((M, H)) * 3.0
  return q, k, v, kp, vp


def _attend(q, k, v, params=None, bias=None, *, normalizer):
  """(weights [T, S'], output [T, H]) of one head in float32 (one-hot values give the weights);
  call it inside a jitted function (one program per test)."""
  n = k.shape[0]
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  values = jnp.concatenate([jnp.eye(n), f32(v)], -1)[None, :, None]
  out = js.attention.dot_product_attention(
      f32(q)[None, :, None], f32(k)[None, :, None], values, None if bias is None else f32(bias),
      normalizer=normalizer, normalizer_params=params, scale=1.0)[0, :, 0]
  return out[:, :n], out[:, n:]


def _f64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _relative(w):
  return w / w.sum(-1, keepdims=True)


# float32 logits ~10 and outputs ~5: weights agree with float64 to ~1e-6, outputs to ~1e-5
ATOL_W, ATOL_O = 2e-6, 2e-5


def test_softmax_prefix_scales_content_weights_and_shifts_output_into_the_prefix_hull():
  q, k, v, kp, vp = _inputs()
  kk, vv = np.concatenate([kp, k]), np.concatenate([vp, v])
  one_k, one_v = np.concatenate([kp[:1], k]), np.concatenate([vp[:1], v])
  (w, o), (w1, o1) = _f64(jax.jit(lambda: (_attend(q, kk, vv, normalizer="softmax"),
                                           _attend(q, one_k, one_v, normalizer="softmax")))())
  A = _softmax(q @ k.T)                                  # no prefix (float64 reference)
  t = A @ v
  full = _softmax(q @ kk.T)
  alpha = full[:, :M].sum(-1)
  beta = full[:, :M] / alpha[:, None]                    # softmax over the prefix logits
  np.testing.assert_allclose(w[:, M:], (1 - alpha)[:, None] * A, atol=ATOL_W)
  np.testing.assert_allclose(_relative(w[:, M:]), A, atol=10 * ATOL_W)  # /(1 - α) >= /0.1
  np.testing.assert_allclose(o, (1 - alpha)[:, None] * t + alpha[:, None] * (beta @ vp),
                             atol=ATOL_O)
  assert np.all(beta >= 0) and alpha.min() > 0.01 and alpha.max() < 0.9   # the prefix matters
  # one prefix: the shift t' - (1 - α) t is parallel to its value
  shift = o1 - (1 - w1[:, :1]) * t
  cross = shift[:, :, None] * vp[0][None, None, :] - shift[:, None, :] * vp[0][None, :, None]
  np.testing.assert_allclose(cross, 0.0, atol=3 * ATOL_O * np.abs(vp).max())


def test_softmax_1_and_a_sink_are_a_zero_value_prefix():
  q, k, v, kp, vp = _inputs(1)
  t_soft = _softmax(q @ k.T) @ v
  one_k, one_v = np.concatenate([kp[:1], k]), np.concatenate([vp[:1], v])
  (w1, o1), (w_sink, o_sink), (wp, op) = _f64(jax.jit(lambda: (
      _attend(q, k, v, normalizer="softmax_1"),
      _attend(q, k, v, {"sink_logit": 1.5}, normalizer="softmax_sink"),
      _attend(q, one_k, one_v, normalizer="softmax_1")))())
  for (w, o), b in (((w1, o1), 0.0), ((w_sink, o_sink), 1.5)):
    full = _softmax(np.concatenate([np.full((T, 1), b), q @ k.T], -1))   # [sink, content]
    np.testing.assert_allclose(w, full[:, 1:], atol=ATOL_W)
    np.testing.assert_allclose(o, (1 - full[:, :1]) * t_soft, atol=ATOL_O)  # shrink only
    np.testing.assert_allclose(_relative(w), _softmax(q @ k.T), atol=10 * ATOL_W)
  # a real prefix on softmax_1: one factor per row on the content, shift along W_V s
  c = wp[:, 1:].sum(-1) / w1.sum(-1)
  np.testing.assert_allclose(wp[:, 1:], c[:, None] * w1, atol=ATOL_W)
  np.testing.assert_allclose(op, c[:, None] * o1 + wp[:, :1] * vp[0], atol=ATOL_O)


def test_sigmoid_prefix_adds_its_value_and_moves_relative_attention_only_through_the_bias():
  q, k, v, kp, vp = _inputs(2)
  sig = lambda x: 1 / (1 + np.exp(-x))
  kk, vv = np.concatenate([kp, k]), np.concatenate([vp, v])
  (w0, o0), (w, o), (wd0, _), (wd, _) = _f64(jax.jit(lambda: (
      _attend(q, k, v, {"bias": -2.0}, normalizer="sigmoid"),
      _attend(q, kk, vv, {"bias": -2.0}, normalizer="sigmoid"),
      _attend(q, k, v, normalizer="sigmoid"),
      _attend(q, kk, vv, normalizer="sigmoid")))())
  np.testing.assert_allclose(w0, sig(q @ k.T - 2.0), atol=ATOL_W)
  np.testing.assert_allclose(w[:, M:], w0, atol=ATOL_W)  # the content weights do not move
  np.testing.assert_allclose(o, o0 + sig(q @ kp.T - 2.0) @ vp, atol=ATOL_O)  # no attenuation
  # the default bias -log n counts the prefix: every content weight changes, by row-varying
  # factors, so the relative attention moves
  np.testing.assert_allclose(wd[:, M:], sig(q @ k.T - np.log(S + M)), atol=ATOL_W)
  assert np.max(np.abs(_relative(wd[:, M:]) - _relative(wd0))) > 1e-2


def _sparsemax(x):
  z = np.sort(x, -1)[:, ::-1]
  cum = np.cumsum(z, -1) - 1
  ks = np.arange(1, x.shape[-1] + 1)
  support = z - cum / ks > 0
  kmax = support.sum(-1)
  tau = cum[np.arange(x.shape[0]), kmax - 1] / kmax
  return np.maximum(x - tau[:, None], 0)


def test_sparsemax_prefix_and_a_query_update_move_relative_attention():
  q, k, v, _, vp = _inputs(3)
  q = 0.25 * q                                           # logits ~1: several keys in support
  A = q @ k.T
  # one prefix token with a zero key and a bias: its logit is the row's largest minus 0.3,
  # so it enters the support of every row
  kk, vv = np.concatenate([np.zeros((1, H)), k]), np.concatenate([vp[:1], v])
  bias = np.concatenate([A.max(-1, keepdims=True) - 0.3, np.zeros((T, S))], -1)
  rng = np.random.default_rng(4)
  q_lora = q + 0.5 * np.outer(q @ rng.standard_normal(H), rng.standard_normal(H)) / H
  (w0, _), (w, _), (ws, _), (wl, _) = _f64(jax.jit(lambda: (
      _attend(q, k, v, normalizer="sparsemax"),
      _attend(q, kk, vv, bias=bias[None, None], normalizer="sparsemax"),
      _attend(q, k, v, normalizer="softmax"),
      _attend(q_lora, k, v, normalizer="softmax")))())
  np.testing.assert_allclose(w0, _sparsemax(A), atol=ATOL_W)
  np.testing.assert_allclose(w, _sparsemax(np.concatenate([bias[:, :1], A], -1)), atol=ATOL_W)
  rows = (w[:, 1:] > 0).sum(-1) >= 2                     # two content keys left to compare
  assert rows.sum() >= 2 and np.all(w[:, 0] > 0)
  assert np.max(np.abs(_relative(w[rows, 1:]) - _relative(w0[rows]))) > 1e-2
  # LoRA on W_Q (a rank-1 change of the queries) moves softmax's relative attention
  np.testing.assert_allclose(wl, _softmax(q_lora @ k.T), atol=ATOL_W)
  assert np.max(np.abs(wl - ws)) > 1e-2
