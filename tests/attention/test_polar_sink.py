"""A20 Polar attention, the checked ATMA form: ``polar_sink_attention`` (the extreme-value
null sink, the null value, the sink-corrected participation ratio and the tanh magnitude)
and ``polar_memory`` (the gated-delta memory channel) against float64 NumPy references
written from the reference code's formulas, and the properties it states: ||c|| <= 1,
mu in [0, 1), n_eff = n for uniform and 1 for one-hot weights, the null weight rising as
the scores drop below nu, nu on the extreme-value scale sqrt(log n), the delta write
M k = v at gamma = beta = 1, a bounded state under gamma <= gamma_max < 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from jaxsoft.attention import polar_memory, polar_sink_attention
from tests.helpers import check_raises, make_qkv


def _softplus(x):
  return np.log1p(np.exp(-abs(x))) + max(x, 0.0)


def reference(q, k, v, *, alpha, null_bias, gamma, gain, v_null, is_causal=False,
              q_lengths=None, eps=1e-6):
  """float64 NumPy of ATMA's two attention channels (kreasof-ai/atma)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  per = [np.broadcast_to(np.asarray(a, np.float64), (N,)) for a in (alpha, null_bias, gamma,
                                                                     gain)]
  vn = np.broadcast_to(np.asarray(v_null, np.float64), (N, v.shape[-1]))
  c = np.zeros((B, T, N, v.shape[-1]))
  mu, neff, wnull = (np.zeros((B, T, N)) for _ in range(3))
  for bb in range(B):
    for n in range(N):
      kh = n // (N // K)
      a, b, g, beta = (p[n] for p in per)
      for i in range(T):
        vis = np.ones(S, bool)
        if is_causal:
          vis &= np.arange(S) <= i
        if q_lengths is not None and i >= q_lengths[bb]:
          vis[:] = False
        if not vis.any():
          continue
        cnt = vis.sum()
        t = 1.0 + _softplus(a) * np.log(cnt)
        nu = b + _softplus(g) * np.sqrt(np.log(cnt + 1.0))
        z = np.append(q[bb, i, n] @ k[bb, vis, kh].T / np.sqrt(H), nu) * t
        e = np.exp(z - z.max())
        full = e / e.sum()
        w, wn = full[:-1], full[-1]
        s = w @ v[bb, vis, kh] + wn * vn[n]
        c[bb, i, n] = s / max(np.linalg.norm(s), eps)
        what = w / w.sum()
        neff[bb, i, n] = 1.0 / np.sum(what ** 2)
        wnull[bb, i, n] = wn
        mu[bb, i, n] = np.tanh(_softplus(beta) * np.log1p(neff[bb, i, n] * (1.0 - wn)))
  return c, mu, neff, wnull


SINK = jax.jit(polar_sink_attention, static_argnames=("is_causal", "return_parts", "scale"))


def test_matches_reference_causal_lengths_gqa_null_value():
  q, k, v = make_qkv(0, 2, 6, N=4, K=2, H=3, Hv=5)
  lengths = np.array([6, 4])
  hp = dict(alpha=np.array([-1.0, 0.0, 0.5, 1.0]), null_bias=np.array([0.5, 1.5, -1.0, 0.0]),
            gamma=0.3, gain=np.array([0.0, 1.0, -0.5, 2.0]))
  v_null = np.linspace(-1.0, 1.0, 20).reshape(4, 5).astype(np.float32)
  c, mu, neff, wnull = SINK(q, k, v, is_causal=True, query_seq_lengths=lengths,
                            alpha=hp["alpha"], null_bias=hp["null_bias"], gamma=hp["gamma"],
                            magnitude_gain=hp["gain"], null_value=v_null, return_parts=True)
  ref = reference(q, k, v, **hp, v_null=v_null, is_causal=True, q_lengths=lengths)
  # float32 softmax over <= 7 entries and a 5-vector norm: a few ulp; tol 1e-5
  for got, want in zip((c, mu, neff, wnull), ref, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
  norms = np.linalg.norm(np.asarray(c), axis=-1)
  assert np.all(norms <= 1.0 + 1e-6)
  np.testing.assert_allclose(norms[0], 1.0, rtol=1e-5)  # every row of batch 0 sees keys
  assert np.all(np.asarray(mu) >= 0.0) and np.all(np.asarray(mu) < 1.0)
  assert np.all(np.asarray(c)[1, 4:] == 0.0) and np.all(np.asarray(mu)[1, 4:] == 0.0)
  assert np.all(np.asarray(wnull)[1, 4:] == 0.0)  # no key: no sink either


# By default test_matches_reference_causal_lengths_gqa_null_value covers this: tests/conftest.py
# runs tests/attention under numpy_rank_promotion("raise") (it failed there on the old code); this
# explicit check holds without the guard.
@pytest.mark.slow
def test_per_head_gain_and_null_value_need_no_implicit_rank_promotion():
  """Issue 37: the per-head gain [N, 1] met the rows [B, N, T], and the null value [N, Hv]
  the outputs [B, T, N, Hv], by implicit rank promotion: a ValueError under
  jax.numpy_rank_promotion("raise")."""
  q, k, v = make_qkv(1, 2, 6, N=4, K=2, H=3, Hv=5)
  hp = dict(alpha=0.5, null_bias=1.0, gamma=0.3, gain=np.array([0.0, 1.0, -0.5, 2.0]))
  v_null = np.linspace(-1.0, 1.0, 20).reshape(4, 5).astype(np.float32)
  with jax.numpy_rank_promotion("raise"):
    got = SINK(q, k, v, is_causal=True, alpha=hp["alpha"], null_bias=hp["null_bias"],
               gamma=hp["gamma"], magnitude_gain=hp["gain"], null_value=v_null)
  want = reference(q, k, v, **hp, v_null=v_null, is_causal=True)
  for g, w in zip(got, want[:2], strict=True):  # (c, mu)
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


def test_participation_ratio_and_the_null_weight():
  S = 8
  # one head, query 0 all-equal scores (uniform: n_eff = n), query 1 one match (one-hot)
  k = np.zeros((1, S, 1, 2), np.float32)
  k[0, :, 0, 1] = 1.0
  k[0, 3, 0] = [1.0, 0.0]
  q = np.array([[0.0, 0.0], [60.0, 0.0]], np.float32).reshape(1, 2, 1, 2)
  v = np.ones((1, S, 1, 2), np.float32)
  # queries 2..5: every score shifted below nu by a growing margin (bias), nu = b = 0 here
  shifts = np.array([0.0, 0.0, 0.0, -1.0, -2.0, -4.0], np.float32)
  q6 = np.concatenate([q, np.zeros((1, 4, 1, 2), np.float32)], axis=1)
  bias = np.broadcast_to(shifts[None, None, :, None], (1, 1, 6, S))
  _, _, neff, wnull = SINK(q6, k, v, bias, scale=1.0, alpha=-30.0, gamma=-30.0,
                           return_parts=True)
  neff, wnull = np.asarray(neff)[0, :, 0], np.asarray(wnull)[0, :, 0]
  np.testing.assert_allclose(neff[0], S, rtol=1e-6)
  np.testing.assert_allclose(neff[1], 1.0, rtol=1e-6)
  assert np.all(np.diff(wnull[2:]) > 0)  # the null weight rises as the scores drop
  # t ~ 1 and nu ~ 0 (softplus(-30) ~ 1e-13): w_N = 1 / (1 + n e^shift)
  np.testing.assert_allclose(wnull[2:], 1.0 / (1.0 + S * np.exp(shifts[2:])), rtol=1e-5)


@pytest.mark.slow
def test_null_logit_on_the_extreme_value_scale():
  """With softplus(gamma) = sqrt(2), b = 0 and t = 1, the sink's logit (read back from the
  null weight of an all-zero row, nu = log(n w_N / (1 - w_N))) is sqrt(2 log(n + 1)), on
  the scale of the expected max of n unrelated N(0, 1) scores: above it, by a ratio that
  falls towards 1 as n grows (sqrt(2 log n) is the max's leading term)."""
  S = 256
  lengths = np.array([16, 256])
  gamma = float(np.log(np.expm1(np.sqrt(2.0))))  # softplus(gamma) = sqrt(2)
  q = np.zeros((2, 1, 1, 2), np.float32)
  k = np.zeros((2, S, 1, 2), np.float32)
  v = np.ones((2, S, 1, 2), np.float32)
  _, _, _, wnull = SINK(q, k, v, key_value_seq_lengths=lengths, alpha=-30.0, gamma=gamma,
                        return_parts=True)
  w = np.asarray(wnull, np.float64)[:, 0, 0]
  nu = np.log(lengths * w / (1.0 - w))
  np.testing.assert_allclose(nu, np.sqrt(2.0 * np.log(lengths + 1.0)), rtol=1e-4)
  rng = np.random.default_rng(0)
  # Monte Carlo E max: +- 0.02 (sd <= 0.6 / sqrt 2000); the ratios are 1.35 and 1.18
  emax = np.array([rng.standard_normal((2000, n)).max(axis=1).mean() for n in lengths])
  ratio = nu / emax
  assert np.all(ratio > 1.0) and ratio[1] < ratio[0] < 1.5


@pytest.mark.slow
def test_gradients_against_float64_differences():
  q, k, v = make_qkv(1, 1, 3, N=2, K=1, H=2, Hv=2)
  r = np.random.default_rng(1).standard_normal((1, 3, 2, 2))
  r2 = np.random.default_rng(2).standard_normal((1, 3, 2))
  v_null = np.array([0.3, -0.2])

  def loss64(a, b, g, beta):
    c, mu, _, _ = reference(q, k, v, alpha=a, null_bias=b, gamma=g, gain=beta,
                            v_null=v_null, is_causal=True)
    return float(np.sum(r * c) + np.sum(r2 * mu))

  x0 = (0.2, 0.4, -0.3, 0.7)
  with jax.enable_x64(True):
    def loss(a, b, g, beta):
      c, mu = polar_sink_attention(jnp.asarray(q, jnp.float64), jnp.asarray(k, jnp.float64),
                                   jnp.asarray(v, jnp.float64), is_causal=True, alpha=a,
                                   null_bias=b, gamma=g, magnitude_gain=beta,
                                   null_value=jnp.asarray(v_null))
      return jnp.sum(r * c) + jnp.sum(r2 * mu)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.float64(x) for x in x0))
  h = 1e-6
  for i, g in enumerate(grads):
    up, dn = list(x0), list(x0)
    up[i] += h
    dn[i] -= h
    fd = (loss64(*up) - loss64(*dn)) / (2 * h)
    # central differences in float64: truncation ~h^2, rounding ~1e-16 / h = 1e-10
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


@pytest.mark.slow
def test_bf16_computes_in_float32():
  q, k, v = make_qkv(2, 1, 4, N=2, K=2, H=4, dtype=jnp.bfloat16)
  c, mu = SINK(q, k, v, is_causal=True)
  assert c.dtype == jnp.bfloat16 and mu.dtype == jnp.float32
  c32, mu32 = SINK(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
  # the same float32 computation, then one bf16 rounding of c: relative 2^-8
  np.testing.assert_allclose(np.asarray(c, np.float32), c32, rtol=2 ** -8, atol=2 ** -9)
  np.testing.assert_allclose(mu, mu32, rtol=1e-6)


def test_bad_input():
  q, k, v = make_qkv(2, 1, 4, N=2, K=2, H=4)
  check_raises(
      ("null_value", lambda: polar_sink_attention(q, k, v, null_value=jnp.ones(3))),
      ("normalizer", lambda: polar_sink_attention(q, k, v, normalizer="softmax")),
      ("eps", lambda: polar_sink_attention(q, k, v, eps=0.0)),
      ("gamma", lambda: polar_sink_attention(q, k, v, gamma=float("nan"))),
      ("magnitude_gain", lambda: polar_sink_attention(q, k, v, magnitude_gain=jnp.ones(3))),
  )


# ------------------------------------------------------------------ the memory channel


def _unit(x):
  return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def memory_reference(q, k, v, rho, beta, gate, bias=3.9, eps=1e-6):
  """float64: M_t = gamma M (I - beta k k^T) + beta v k^T, r = M q, RMS norm, gate."""
  q, k = _unit(np.asarray(q, np.float64)), _unit(np.asarray(k, np.float64))
  v = np.asarray(v, np.float64)
  B, T, N, K = q.shape
  out = np.zeros(v.shape)
  for bb in range(B):
    for n in range(N):
      M = np.zeros((v.shape[-1], K))
      for t in range(T):
        gam = 1.0 / (1.0 + np.exp(-(rho[bb, t, n] + bias)))
        kt = k[bb, t, n]
        M = gam * M @ (np.eye(K) - beta[bb, t, n] * np.outer(kt, kt)) \
            + beta[bb, t, n] * np.outer(v[bb, t, n], kt)
        r = M @ q[bb, t, n]
        o = r / np.sqrt(np.mean(r * r) + eps)
        out[bb, t, n] = o / (1.0 + np.exp(-gate[bb, t, n]))
  return out


MEMORY = jax.jit(polar_memory, static_argnames=("output_final_state", "implementation"))


def test_memory_matches_reference_and_is_the_gated_delta_rule():
  rng = np.random.default_rng(3)
  B, T, N, K = 1, 10, 2, 4
  q, k, v = (rng.standard_normal((B, T, N, K)).astype(np.float32) for _ in range(3))
  rho = rng.standard_normal((B, T, N)).astype(np.float32) - 4.0
  beta = rng.random((B, T, N)).astype(np.float32)
  gate = rng.standard_normal((B, T, N, K)).astype(np.float32)
  out = MEMORY(q, k, v, rho, beta, gate)
  # float32 recurrence of 10 steps, then an RMS normalisation: tol 1e-4 (relative error
  # grows where r is small and the normalisation divides by it)
  np.testing.assert_allclose(out, memory_reference(q, k, v, rho, beta, gate),
                             rtol=1e-4, atol=1e-4)
  # built on jaxsoft.linear.gated_delta_rule: its readout, RMS-normalised
  @jax.jit
  def both(q, k, v, rho, beta):
    r = linear.gated_delta_rule(q, k, v, jax.nn.log_sigmoid(rho + 3.9), beta, scale=1.0,
                                qk_l2norm=True)
    rn = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + 1e-6)
    return polar_memory(q, k, v, rho, beta, gate_logit=jnp.zeros_like(v)), 0.5 * rn

  got, want = both(q, k, v, rho, beta)  # a zero gate logit halves the readout
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_memory_delta_write_and_bounded_state():
  rng = np.random.default_rng(4)
  B, T, N, K = 1, 10, 2, 4  # the shapes of the test above: no new compilation
  q, k, v = (rng.standard_normal((B, T, N, K)).astype(np.float32) for _ in range(3))
  # gamma = beta = 1 (sigmoid(100) = 1 in float32): the write stores v_T along k_T
  _, S = MEMORY(q, k, v, np.full((B, T, N), 100.0, np.float32), np.ones((B, T, N), np.float32),
                output_final_state=True)
  for n in range(N):
    kT = _unit(k[0, -1, n].astype(np.float64))
    np.testing.assert_allclose(np.asarray(S)[0, n].T @ kT, v[0, -1, n], rtol=1e-4, atol=1e-4)
  # gamma <= 0.9: ||M|| <= max ||v|| / (1 - 0.9), even for large values
  rho = np.full((B, T, N), np.log(0.9 / 0.1) - 3.9, np.float32)  # sigmoid(rho + 3.9) = 0.9
  big = 100.0 * v
  _, S = MEMORY(q, k, big, rho, np.ones((B, T, N), np.float32), output_final_state=True)
  for n in range(N):
    bound = np.linalg.norm(big[0, :, n], axis=-1).max() / (1.0 - 0.9)
    assert np.linalg.norm(np.asarray(S)[0, n], 2) <= bound * (1 + 1e-5)


@pytest.mark.slow
def test_memory_bf16():
  q = jnp.ones((1, 3, 1, 2), jnp.bfloat16)
  out = MEMORY(q, q, q, jnp.zeros((1, 3, 1)), jnp.ones((1, 3, 1)))
  assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))


def test_memory_bad_input():
  q = jnp.ones((1, 3, 1, 2), jnp.bfloat16)
  rho, beta = jnp.zeros((1, 3, 1)), jnp.ones((1, 3, 1))
  check_raises(
      ("gate_logit", lambda: polar_memory(q, q, q, rho, beta, jnp.ones((2, 2)))),
      ("gate_logit", lambda: polar_memory(q, q, q, rho, beta, jnp.ones((5, 1, 3, 1, 2)))),
      ("eps", lambda: polar_memory(q, q, q, rho, beta, eps=-1.0)),
      ("retention_bias", lambda: polar_memory(q, q, q, rho, beta, retention_bias=float("inf"))),
  )


@pytest.mark.slow
def test_memory_chunked_and_recurrent_agree():
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((1, 70, 2, 4)).astype(np.float32) for _ in range(3))
  rho = rng.standard_normal((1, 70, 2)).astype(np.float32)
  beta = rng.random((1, 70, 2)).astype(np.float32)
  a = MEMORY(q, k, v, rho, beta, implementation="recurrent")
  b = MEMORY(q, k, v, rho, beta, implementation="chunked")
  np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
