"""Feature A33, TransNormerLLM's parts around Lightning Attention: LRPE (:func:`lrpe`,
:func:`lrpe_theta`), SRMSNorm (:func:`srms_norm`) and the LRPE-d attention
(:func:`transnormer_attention` and its step).

Oracles: numpy float64 written from the formulas (``[x cos θp, x sin θp]``; ``x /
sqrt(mean x² + ε)``; ``o_i = scale Σ_{j<=i, same segment} λ^{i-j} Σ_c q_ic k_jc
cos(θ_c (i - j)) v_j`` as a dense loop), a dense jnp formula for the gradients, and the
properties: products depend on ``i - j`` only, ``θ = 0`` is Lightning Attention, packed
segments need no position reset, SRMSNorm is scale-invariant."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests import helpers
from tests.helpers import check_raises
from tests.linear import cases

B, T, N, K, V = 2, 7, 2, 3, 2


def _lrpe_np(x, theta, pos):
  """``[x cos θp, x sin θp]`` in float64; ``pos [B, T]``."""
  x = np.asarray(x, np.float64)
  a = np.asarray(theta, np.float64)[None, None] * np.asarray(pos, np.float64)[:, :, None, None]
  return np.concatenate([x * np.cos(a), x * np.sin(a)], axis=-1)


def _attention_np(q, k, v, g, theta, *, scale, segment_ids=None):
  """The LRPE-d attention as a dense float64 loop over (i, j) pairs of one segment run."""
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  g, theta = np.asarray(g, np.float64), np.asarray(theta, np.float64)
  b_, t_ = q.shape[:2]
  seg = np.zeros((b_, t_), int) if segment_ids is None else np.asarray(segment_ids)
  run = np.concatenate([np.zeros((b_, 1), int), np.cumsum(seg[:, 1:] != seg[:, :-1], 1)], 1)
  o = np.zeros(v.shape)
  for b in range(b_):
    for i in range(t_):
      for j in range(i + 1):
        if run[b, i] != run[b, j]:
          continue
        w = np.exp(g * (i - j)) * np.sum(q[b, i] * k[b, j] * np.cos(theta * (i - j)), -1)
        o[b, i] += scale * w[:, None] * v[b, j]
  return o


def _inputs(seed=0, t=T):
  ks = jax.random.split(jax.random.key(seed), 6)
  a = cases.random_qkv(ks, B, t, N, K, V)
  a["g"] = jax.random.uniform(ks[3], (N,), minval=-1.0, maxval=-0.05)
  a["theta"] = jax.random.uniform(ks[4], (N, K), minval=0.05, maxval=1.5)
  return a


# ------------------------------------------------------------------------------------ LRPE


def test_lrpe_matches_float64_formula_and_products_depend_on_i_minus_j_only():
  """Every ``positions`` form against ``[x cos θp, x sin θp]`` in float64; the (i, j) score
  of rotated q, k is Σ_c q_ic k_jc cos(θ_c (i - j)) (float64 oracle), the same for every
  common shift of the positions; with one vector at every position it is a Toeplitz
  matrix; θ = 0 gives q · k."""
  a = _inputs()
  q, k, theta = a["q"], a["k"], a["theta"]
  pos_bt = jnp.asarray(np.random.default_rng(0).integers(0, 50, (B, T)))
  one = jnp.broadcast_to(q[:, :1], q.shape)
  rotated_product = lambda x, y, th, p=None: jnp.einsum(
      "bink,bjnk->bnij", linear.lrpe(x, th, positions=p), linear.lrpe(y, th, positions=p))

  @jax.jit
  def run(q, k, theta, pos_bt):
    forms = (linear.lrpe(q, theta), linear.lrpe(q, theta, positions=jnp.arange(T) + 5),
             linear.lrpe(q, theta, positions=pos_bt), linear.lrpe(q, theta, positions=3),
             linear.lrpe(q, theta[0]))
    scores = (rotated_product(q, k, theta), rotated_product(q, k, theta, jnp.arange(T) + 40),
              rotated_product(q, k, jnp.zeros((N, K))), rotated_product(one, one, theta))
    return forms, scores

  forms, (s0, s_shift, s_zero, s_one) = run(q, k, theta, pos_bt)
  base = np.broadcast_to(np.arange(T), (B, T))
  want = (_lrpe_np(q, theta, base), _lrpe_np(q, theta, base + 5), _lrpe_np(q, theta, pos_bt),
          _lrpe_np(q, theta, np.full((B, T), 3)),
          _lrpe_np(q, np.broadcast_to(theta[0], (N, K)), base))
  # float32 angles up to 1.5 * 56 = 84 rad: about 84 * 2^-24 ≈ 5e-6 of phase error, |x| <= 5
  for g_, w_ in zip(forms, want, strict=True):
    np.testing.assert_allclose(g_, w_, rtol=0, atol=1e-4)
  assert forms[0].shape == (B, T, N, 2 * K) and forms[0].dtype == jnp.float32
  q64, k64, th = (np.asarray(t, np.float64) for t in (q, k, theta))
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  want = np.einsum("bink,bjnk,nijk->bnij", q64, k64,
                   np.cos(th[:, None, None, :] * (i - j)[None, :, :, None]))
  # sums of 6 products of |x| <= 5 with angles <= 70 rad in float32: ~1e-5
  np.testing.assert_allclose(s0, want, rtol=0, atol=1e-4)
  np.testing.assert_allclose(s_shift, want, rtol=0, atol=1e-4)
  np.testing.assert_allclose(s_zero, np.einsum("bink,bjnk->bnij", q64, k64), rtol=0, atol=1e-5)
  s_one = np.asarray(s_one)   # one vector at every position: a function of i - j
  for d in range(-T + 1, T):
    diagonal = np.diagonal(s_one, offset=d, axis1=2, axis2=3)
    np.testing.assert_allclose(diagonal, np.broadcast_to(diagonal[..., :1], diagonal.shape),
                               atol=1e-5)


def test_lrpe_theta_schedule():
  got = np.asarray(linear.lrpe_theta(2, 3))
  want = 10000.0 ** (-2.0 * np.arange(6) / 6)   # one ladder over N K = 6 channels
  np.testing.assert_allclose(got, want.reshape(2, 3), rtol=1e-6)
  assert got.dtype == np.float32 and got[0, 0] == 1.0


# ----------------------------------------------------------------------------- SRMSNorm


def test_srms_norm_matches_float64_and_is_scale_invariant():
  x = helpers.standard_normal(3, (4, 6)) * 3.0
  y, y_scaled, y0 = jax.jit(lambda x: (linear.srms_norm(x), linear.srms_norm(7.5 * x),
                                       linear.srms_norm(x, axis=0, eps=0.5)))(x)
  x64 = np.asarray(x, np.float64)
  want = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)      # float32 rounding, |y| < 3
  np.testing.assert_allclose(y_scaled, want, rtol=1e-6, atol=1e-6)   # eps/mean(x²) ~ 1e-7
  np.testing.assert_allclose(y0, x64 / np.sqrt(np.mean(x64 ** 2, 0, keepdims=True) + 0.5),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_srms_norm_in_full_its_gradient_is_orthogonal_to_x():
  """Against ``x / sqrt(mean x² + ε)`` in float64 (any axis, bf16 computed in float32);
  ``SRMSNorm(c x) = SRMSNorm(x)``; the gradient kills the direction of x (ε -> 0):
  ``(w - y ⟨w, y⟩ / d) / rms`` in float64, ``⟨∇, x⟩ = 0``."""
  x = helpers.standard_normal(3, (4, 6)) * 3.0
  w = helpers.standard_normal(5, (6,))
  f = jax.jit(lambda x: (linear.srms_norm(x), linear.srms_norm(7.5 * x),
                         linear.srms_norm(x, axis=0, eps=0.5),
                         linear.srms_norm(x.astype(jnp.bfloat16)),
                         jax.grad(lambda r: jnp.sum(linear.srms_norm(r, eps=1e-12) * w))(x[0])))
  y, y_scaled, y0, y_bf16, grad = f(x)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)      # float32 rounding, |y| < 3
  np.testing.assert_allclose(y_scaled, want, rtol=1e-6, atol=1e-6)   # eps/mean(x²) ~ 1e-7
  np.testing.assert_allclose(y0, x64 / np.sqrt(np.mean(x64 ** 2, 0, keepdims=True) + 0.5),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.mean(want ** 2, -1), 1.0, rtol=1e-6)
  assert y_bf16.dtype == jnp.bfloat16
  # the input's bf16 rounding (2^-9 relative) carries through, plus the output's rounding
  np.testing.assert_allclose(np.asarray(y_bf16, np.float32), want, rtol=2e-2, atol=2e-2)
  rms = np.sqrt(np.mean(x64[0] ** 2))
  y_row = x64[0] / rms
  np.testing.assert_allclose(grad, (w64 - y_row * np.dot(w64, y_row) / 6) / rms, rtol=1e-5,
                             atol=1e-5)
  assert abs(float(np.dot(grad, x64[0]))) < 1e-5


# ---------------------------------------------------------------------- LRPE-d attention


def test_transnormer_attention_matches_float64_loop():
  """The chunked form with segments against the dense float64 loop; θ = 0 is
  :func:`lightning_attention`."""
  a = _inputs(t=8)
  seg = cases.segments(B, 8)
  chunked, plain, light = jax.jit(lambda a: (
      linear.transnormer_attention(a["q"], a["k"], a["v"], a["g"], a["theta"],
                                   implementation="chunked", chunk_size=3, segment_ids=seg),
      linear.transnormer_attention(a["q"], a["k"], a["v"], a["g"], jnp.zeros((N, K))),
      linear.lightning_attention(a["q"], a["k"], a["v"], a["g"])))(a)
  want = _attention_np(a["q"], a["k"], a["v"], a["g"], a["theta"], scale=K ** -0.5,
                       segment_ids=seg)
  # float32 sums of <= 8 terms of size <= ~20: 1e-5 relative; angles to 1.5 * 7 rad
  np.testing.assert_allclose(chunked, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(plain, light, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_transnormer_attention_matches_float64_loop_and_its_properties():
  """The chunked form with segments, and the parallel one at positions offset by 100,
  against the dense float64 loop; packed segments equal each segment alone from position 0
  (no position reset needed); θ = 0 is :func:`lightning_attention`; bf16 inputs compute in
  float32 and come back bf16."""
  a = _inputs(t=8)
  seg = cases.segments(B, 8)
  packed_ids = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]] * B)

  @jax.jit
  def run(a):
    call = lambda q, k, v, **kw: linear.transnormer_attention(q, k, v, a["g"], a["theta"], **kw)
    q, k, v = a["q"], a["k"], a["v"]
    bf16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    return (call(q, k, v, implementation="chunked", chunk_size=3, segment_ids=seg),
            call(q, k, v, implementation="parallel", positions=jnp.arange(8) + 100,
                 segment_ids=seg),
            call(q, k, v, segment_ids=packed_ids), call(q[:, 3:], k[:, 3:], v[:, 3:]),
            linear.transnormer_attention(q, k, v, a["g"], jnp.zeros((N, K))),
            linear.lightning_attention(q, k, v, a["g"]), call(q, k, v), call(*bf16))

  chunked, offset, packed, alone, plain, light, o32, o16 = run(a)
  want = _attention_np(a["q"], a["k"], a["v"], a["g"], a["theta"], scale=K ** -0.5,
                       segment_ids=seg)
  # float32 sums of <= 8 terms of size <= ~20: 1e-5 relative; angles to 1.5 * 107 rad add
  # ~1e-5 absolute
  np.testing.assert_allclose(chunked, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(offset, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(packed[:, 3:], alone, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(plain, light, rtol=1e-5, atol=1e-5)
  assert o16.dtype == jnp.bfloat16 and o32.dtype == jnp.float32
  # bf16 inputs (2^-9 relative each, three factors) and output rounding; |o| <~ 10
  np.testing.assert_allclose(np.asarray(o16, np.float32), o32, rtol=5e-2, atol=5e-2)


@pytest.mark.slow
def test_gradients_match_the_dense_formula():
  """The gradients of q, k, v, g and θ against those of the dense formula written in jnp."""
  a = _inputs()
  w = helpers.standard_normal(9, (B, T, N, V))

  def dense(a):
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    d = (i - j).astype(jnp.float32)                                        # [T, T]
    cos = jnp.cos(a["theta"][:, None, None, :] * d[None, :, :, None])      # [N, T, T, K]
    s = jnp.einsum("bink,bjnk,nijk->bnij", a["q"], a["k"], cos) * K ** -0.5
    decay = jnp.where(i >= j, jnp.exp(a["g"][:, None, None] * jnp.maximum(d, 0.0)[None]), 0.0)
    return jnp.einsum("bnij,bjnv->binv", s * decay[None], a["v"])

  def library(a):
    return linear.transnormer_attention(a["q"], a["k"], a["v"], a["g"], a["theta"])

  loss = lambda f, a: jnp.sum(f(a) * w)
  got, want = jax.jit(lambda a: (jax.grad(functools.partial(loss, library))(a),
                                 jax.grad(functools.partial(loss, dense))(a)))(a)
  for name in ("q", "k", "v", "g", "theta"):
    scale = float(jnp.max(jnp.abs(want[name])))
    assert scale > 0, name
    # float32 sums over <= 7 tokens: 1e-5 of the largest entry
    np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4 * scale, err_msg=name)


@pytest.mark.slow
def test_step_matches_full_call_after_a_prefix():
  """Decoding from the state of a prefix of 3 tokens, at positions 3, 4, ...; a position per
  batch row ``[B]`` shifts both rows' rotations alike (the outputs do not change)."""
  a = _inputs()
  full, S_full = jax.jit(lambda a: linear.transnormer_attention(
      a["q"], a["k"], a["v"], a["g"], a["theta"], output_final_state=True))(a)
  _, S = jax.jit(lambda a: linear.transnormer_attention(
      a["q"][:, :3], a["k"][:, :3], a["v"][:, :3], a["g"], a["theta"],
      output_final_state=True))(a)
  step = jax.jit(lambda q, k, v, S, p: linear.transnormer_attention_step(
      q, k, v, S, position=p, g=a["g"], theta=a["theta"]))
  outs = []
  for t in range(3, T):
    o, S = step(a["q"][:, t], a["k"][:, t], a["v"][:, t], S, jnp.full((B,), t))
    outs.append(o)
  np.testing.assert_allclose(jnp.stack(outs, 1), full[:, 3:], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(S, S_full, rtol=1e-5, atol=1e-5)
  assert S.shape == (B, N, 2 * K, V)


@pytest.mark.slow
def test_float64_stays_float64():
  a = _inputs()
  with jax.enable_x64(True):
    a64 = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), a)
    o64, y64 = jax.jit(lambda a: (linear.transnormer_attention(a["q"], a["k"], a["v"], a["g"],
                                                               a["theta"]),
                                  linear.srms_norm(a["q"])))(a64)
    assert o64.dtype == jnp.float64 and y64.dtype == jnp.float64
    want = _attention_np(a["q"], a["k"], a["v"], a["g"], a["theta"], scale=K ** -0.5)
    np.testing.assert_allclose(o64, want, rtol=1e-12, atol=1e-12)   # float64 throughout


def test_errors():
  x = jnp.ones((B, T, N, K))
  check_raises(
      (r"`x` must have shape \[B, T, N, K\]", lambda: linear.lrpe(jnp.ones((T, K)))),
      (r"`theta` must have shape \[N, K\]", lambda: linear.lrpe(x, jnp.ones((K + 1,)))),
      (r"`theta` must be finite", lambda: linear.lrpe(x, jnp.full((K,), jnp.nan))),
      (r"`positions` must be a scalar or have shape \[T\]",
       lambda: linear.lrpe(x, positions=jnp.arange(T + 1))),
      (r"`positions` must be an integer or floating", lambda: linear.lrpe(
          x, positions=jnp.ones((T,), bool))),
      (r"`x` must be a real", lambda: linear.srms_norm(jnp.ones(3, jnp.complex64))),
      (r"`eps` must be a positive float", lambda: linear.srms_norm(x, eps=0.0)),
      (r"`axis` must be an int", lambda: linear.srms_norm(x, axis=4)),
      (r"`num_heads` must be an int >= 1", lambda: linear.lrpe_theta(0, 2)),
      (r"`base` must be a positive finite", lambda: linear.lrpe_theta(1, 2, base=-1.0)),
      (r"`position` must be a scalar or have shape \[B\]",
       lambda: linear.transnormer_attention_step(x[:, 0], x[:, 0], x[:, 0],
                                                 position=jnp.zeros((B, 2)))),
      (r"`k` of shape", lambda: linear.transnormer_attention(x, x[..., :2], x)),
      (r"`g` must have shape \[N\]",
       lambda: linear.transnormer_attention(x, x, x, jnp.zeros((N + 1,)))),
  )


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["parallel", "recurrent", "chunked"])
def test_forms_agree_with_every_gradient(implementation):
  """Each form against the recurrent one with segments and an initial state: the value and
  the gradients of q, k, v, g, θ and the initial state."""
  a = _inputs(t=11)
  a["initial_state"] = 0.5 * helpers.standard_normal(11, (B, N, 2 * K, V))

  def call(args, **kw):
    args = dict(args)
    return linear.transnormer_attention(args.pop("q"), args.pop("k"), args.pop("v"),
                                        args.pop("g"), args.pop("theta"),
                                        output_final_state=True, **args, **kw)

  cases.assert_forms_agree(call, a, ("recurrent", implementation),
                           segment_ids=cases.segments(B, 11, seed=2), key=jax.random.key(3))
