"""Feature A39, the softmax-to-TTT conversion aids of SD3.5-T^5: key instance normalisation
(:func:`jaxsoft.linear.key_instance_norm`) and the locality module
(:func:`jaxsoft.linear.locality_enhance`).

Oracles: numpy float64 loops written from the formulas (per-instance mean and population
variance over the valid tokens of a run of equal segment ids; the depthwise "same"
convolution as explicit neighbour sums, 1-D and on a 2-D grid). Properties from the paper:
normalised keys have zero mean and unit variance per instance and channel, and are
invariant to a key shift shared by the instance's tokens, as softmax attention is and
TTT / linear attention is not until its keys are normalised."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests import helpers
from tests.helpers import check_raises

B, T, N, K = 2, 9, 2, 3


def _runs_np(seg, mask):
  """Per batch row, the lists of token indices of each instance (valid tokens of a run)."""
  out = []
  for b in range(seg.shape[0]):
    runs, start = [], 0
    for t in range(1, seg.shape[1] + 1):
      if t == seg.shape[1] or seg[b, t] != seg[b, t - 1]:
        runs.append([s for s in range(start, t) if mask[b, s]])
        start = t
    out.append(runs)
  return out


def _key_norm_np(k, eps, seg=None, mask=None):
  k = np.asarray(k, np.float64)
  seg = np.zeros(k.shape[:2], int) if seg is None else np.asarray(seg)
  mask = np.ones(k.shape[:2], bool) if mask is None else np.asarray(mask)
  out = np.zeros(k.shape)
  for b, runs in enumerate(_runs_np(seg, mask)):
    for idx in runs:
      if idx:
        x = k[b, idx]
        out[b, idx] = (x - x.mean(0)) / np.sqrt(x.var(0) + eps)
  return out


def _inputs():
  k = 2.0 * helpers.standard_normal(0, (B, T, N, K)) + 3.0
  seg = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0, 0]])
  mask = jnp.asarray([[True] * 8 + [False], [True, False] + [True] * 7])
  return k, seg, mask


def test_key_instance_norm_matches_float64_and_is_shift_invariant():
  """Segments and a mask against the float64 loop; a shift shared by an instance's tokens
  (a different one per segment) changes nothing; zero mean and unit variance per instance
  and channel (ε small)."""
  k, seg, mask = _inputs()
  shift = helpers.standard_normal(1, (B, 1, N, K)) * 5.0
  per_segment = jnp.where((seg == 1)[:, :, None, None], 2.0 * shift, -shift)
  both, shifted, tight = jax.jit(lambda k: (
      linear.key_instance_norm(k, segment_ids=seg, mask=mask),
      linear.key_instance_norm(k + per_segment, segment_ids=seg, mask=mask),
      linear.key_instance_norm(k, eps=1e-12)))(k)
  want = _key_norm_np(k, 1e-5, seg, mask)
  # float32 mean / variance of <= 9 values ~ 3 ± 6: ~1e-6 relative to a unit output
  np.testing.assert_allclose(both, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(both)[~np.asarray(mask)] == 0.0)
  # the shifts (|c| <~ 20) cost float32 cancellation: 20 * 2^-24 / std(~2)
  np.testing.assert_allclose(shifted, want, rtol=1e-4, atol=1e-4)
  tight = np.asarray(tight, np.float64)
  np.testing.assert_allclose(tight.mean(1), 0.0, atol=1e-6)
  np.testing.assert_allclose(tight.var(1), 1.0, rtol=1e-5)


@pytest.mark.slow
def test_key_instance_norm_matches_float64_and_its_properties():
  """Against the float64 loop (no mask; mask; segments and mask); per instance and channel
  zero mean and unit variance (ε small); a shift shared by an instance's tokens (a different
  one per segment) and a positive per-channel scale change nothing; the gradient along a
  shared shift is zero; bf16 computes in float32."""
  k, seg, mask = _inputs()
  shift = helpers.standard_normal(1, (B, 1, N, K)) * 5.0
  per_segment = jnp.where((seg == 1)[:, :, None, None], 2.0 * shift, -shift)
  scale = jnp.exp(helpers.standard_normal(2, (1, 1, N, K)))
  w = jax.random.normal(jax.random.key(3), k.shape)

  @jax.jit
  def run(k):
    f = lambda k: linear.key_instance_norm(k, segment_ids=seg, mask=mask)
    return (linear.key_instance_norm(k), linear.key_instance_norm(k, mask=mask, eps=0.5), f(k),
            f(k + per_segment), f(k * scale), linear.key_instance_norm(k, eps=1e-12),
            jax.grad(lambda c: jnp.sum(f(k + c) * w))(jnp.zeros((1, 1, N, K))),
            linear.key_instance_norm(k.astype(jnp.bfloat16)),
            linear.key_instance_norm(k * scale, eps=1e-12))

  plain, masked, both, shifted, scaled, tight, grad_c, bf16, scaled_tight = run(k)
  # float32 mean / variance of <= 9 values ~ 3 ± 6: ~1e-6 relative to a unit output
  np.testing.assert_allclose(plain, _key_norm_np(k, 1e-5), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(masked, _key_norm_np(k, 0.5, mask=mask), rtol=1e-5, atol=1e-5)
  want = _key_norm_np(k, 1e-5, seg, mask)
  np.testing.assert_allclose(both, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(both)[~np.asarray(mask)] == 0.0)
  # the shifts (|c| <~ 20) cost float32 cancellation: 20 * 2^-24 / std(~2)
  np.testing.assert_allclose(shifted, want, rtol=1e-4, atol=1e-4)
  # a scale multiplies the variance, so only ε's share changes (ε / (s² var): 8e-4 for this
  # draw's smallest-scale channel): the scaled input against the float64 loop on it (a
  # one-token segment's float32 rounding, ~1e-7, over sqrt(ε): up to ~3e-5), and the
  # invariance itself with ε = 1e-12 on whole instances
  np.testing.assert_allclose(scaled, _key_norm_np(np.asarray(k * scale, np.float64), 1e-5, seg,
                                                  mask), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(scaled_tight, tight, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(grad_c))) < 1e-4   # sums of ~18 terms of size ~1
  tight = np.asarray(tight, np.float64)
  np.testing.assert_allclose(tight.mean(1), 0.0, atol=1e-6)
  np.testing.assert_allclose(tight.var(1), 1.0, rtol=1e-5)
  assert bf16.dtype == jnp.bfloat16
  # bf16 keys (2^-9 relative of ~10 against std ~2: ~1e-2 of a unit) and output rounding
  np.testing.assert_allclose(np.asarray(bf16, np.float32), _key_norm_np(
      np.asarray(k.astype(jnp.bfloat16), np.float64), 1e-5), rtol=2e-2, atol=2e-2)


def test_key_shift_invariance_softmax_has_linear_lacks_and_the_norm_restores():
  """``softmax_j(q·(k_j + c)) = softmax_j(q·k_j)``; (bidirectional, unnormalised) linear
  attention ``o_i = Σ_j (q_i·k_j) v_j`` -- one full-batch TTT step from W = 0 -- changes
  under the shift, and does not on normalised keys."""
  q, v = helpers.standard_normal(4, (2, 1, T, N, K))
  k = _inputs()[0][:1]
  c = 3.0 * jnp.ones((1, 1, N, K))

  @jax.jit
  def run(q, k, v):
    scores = lambda k: jnp.einsum("bink,bjnk->bnij", q, k)
    lin = lambda k: jnp.einsum("bnij,bjnv->binv", scores(k), v)
    kin = linear.key_instance_norm
    return (jax.nn.softmax(scores(k)), jax.nn.softmax(scores(k + c)), lin(k), lin(k + c),
            lin(kin(k)), lin(kin(k + c)))

  s, s_c, o, o_c, o_n, o_nc = run(q, k, v)
  np.testing.assert_allclose(s_c, s, rtol=1e-4, atol=1e-6)   # float32 logits ~ 30 shifted
  assert float(jnp.max(jnp.abs(o_c - o))) > 1.0
  np.testing.assert_allclose(o_nc, o_n, rtol=1e-4, atol=1e-4)   # sums of 9 terms ~ 3


@pytest.mark.slow
def test_key_shift_invariance_softmax_has_ttt_lacks_and_the_norm_restores():
  """``softmax_j(q·(k_j + c)) = softmax_j(q·k_j)``; TTT-Linear (one mini-batch from W = 0:
  unnormalised linear attention) changes under the shift, and does not on normalised keys."""
  q, v = helpers.standard_normal(4, (2, 1, T, N, K))
  k, _, _ = _inputs()
  k = k[:1]
  c = 3.0 * jnp.ones((1, 1, N, K))
  eta = jnp.full((1, T, N), 0.5)

  @jax.jit
  def run(q, k, v):
    ttt = lambda k: linear.ttt_linear(q, k, v, eta, mini_batch_size=T)
    soft = lambda k: jax.nn.softmax(jnp.einsum("bink,bjnk->bnij", q, k), axis=-1)
    kin = linear.key_instance_norm
    return soft(k), soft(k + c), ttt(k), ttt(k + c), ttt(kin(k)), ttt(kin(k + c))

  s, s_c, o, o_c, o_n, o_nc = run(q, k, v)
  np.testing.assert_allclose(s_c, s, rtol=1e-4, atol=1e-6)   # float32 logits ~ 30 shifted
  assert float(jnp.max(jnp.abs(o_c - o))) > 1.0
  np.testing.assert_allclose(o_nc, o_n, rtol=1e-4, atol=1e-4)


def _conv_np(x, kernel, bias, grid):
  """``x_t + b + Σ_δ w_δ x_{t+δ}`` by explicit neighbour sums in float64."""
  x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
  b_, t_ = x.shape[:2]
  H, W = grid if grid is not None else (t_, 1)
  kh, kw = kernel.shape[:2] if grid is not None else (kernel.shape[0], 1)
  kern = kernel if grid is not None else kernel[:, None]
  xs = x.reshape(b_, H, W, *x.shape[2:])
  out = xs.copy() + (0.0 if bias is None else np.asarray(bias, np.float64))
  for i in range(H):
    for j in range(W):
      for di in range(kh):
        for dj in range(kw):
          ii, jj = i + di - kh // 2, j + dj - kw // 2
          if 0 <= ii < H and 0 <= jj < W:
            out[:, i, j] += kern[di, dj] * xs[:, ii, jj]
  return out.reshape(x.shape)


def test_locality_enhance_matches_float64_neighbour_sums_1d_and_on_a_grid():
  ks = jax.random.split(jax.random.key(6), 4)
  x = jax.random.normal(ks[0], (B, 12, N, K))
  k3, k33 = jax.random.normal(ks[1], (3, N, K)), jax.random.normal(ks[2], (3, 3, N, K))
  bias = jax.random.normal(ks[3], (N, K))
  y3, y33 = jax.jit(lambda x: (linear.locality_enhance(x, k3, bias),
                               linear.locality_enhance(x, k33, bias, grid=(3, 4))))(x)
  # float32 sums of <= 11 products of size ~1 (HIGHEST precision)
  np.testing.assert_allclose(y3, _conv_np(x, k3, bias, None), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y33, _conv_np(x, k33, bias, (3, 4)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_locality_enhance_matches_float64_neighbour_sums():
  """1-D (kernel 3 and 5, with a bias) and a 3 x 4 grid (3 x 3, the paper's), against the
  float64 sums; the kernel's gradient against the float64 correlation of x with the
  cotangent; a zero kernel and bias is the identity; bf16 computes in float32."""
  ks = jax.random.split(jax.random.key(5), 6)
  x = jax.random.normal(ks[0], (B, 12, N, K))
  k3, k5 = jax.random.normal(ks[1], (3, N, K)), jax.random.normal(ks[2], (5, N, K))
  k33 = jax.random.normal(ks[3], (3, 3, N, K))
  bias = jax.random.normal(ks[4], (N, K))
  w = jax.random.normal(ks[5], x.shape)

  @jax.jit
  def run(x):
    return (linear.locality_enhance(x, k3, bias), linear.locality_enhance(x, k5),
            linear.locality_enhance(x, k33, bias, grid=(3, 4)),
            jax.grad(lambda kern: jnp.sum(linear.locality_enhance(x, kern) * w))(k3),
            linear.locality_enhance(x, jnp.zeros_like(k3), jnp.zeros_like(bias)),
            linear.locality_enhance(x.astype(jnp.bfloat16), k3))

  y3, y5, y33, grad, ident, y16 = run(x)
  # float32 sums of <= 11 products of size ~1 (HIGHEST precision)
  np.testing.assert_allclose(y3, _conv_np(x, k3, bias, None), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y5, _conv_np(x, k5, None, None), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y33, _conv_np(x, k33, bias, (3, 4)), rtol=1e-5, atol=1e-5)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = np.zeros((3, N, K))
  for d in range(3):   # d y_t / d w_d = x_{t + d - 1}
    for t in range(12):
      if 0 <= t + d - 1 < 12:
        want[d] += np.sum(w64[:, t] * x64[:, t + d - 1], axis=0)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ident, x)
  assert y16.dtype == jnp.bfloat16
  # bf16 input rounding (2^-9 relative) through 4 terms of size ~2, plus output rounding
  np.testing.assert_allclose(np.asarray(y16, np.float32), _conv_np(
      np.asarray(x.astype(jnp.bfloat16), np.float64), k3, None, None), rtol=3e-2, atol=3e-2)


def test_errors():
  k = jnp.ones((B, T, N, K))
  check_raises(
      (r"`k` must have shape \[B, T, \.\.\.\]", lambda: linear.key_instance_norm(jnp.ones(3))),
      (r"`eps` must be a positive float", lambda: linear.key_instance_norm(k, eps=0)),
      (r"`mask` must be a boolean array \[B, T\]",
       lambda: linear.key_instance_norm(k, mask=jnp.ones((B, T)))),
      (r"`segment_ids` must have shape \[B, T\]",
       lambda: linear.key_instance_norm(k, segment_ids=jnp.zeros((B, T + 1), int))),
      (r"`k` must be a real", lambda: linear.key_instance_norm(k.astype(jnp.complex64))),
      (r"`kernel` must have shape \[k, \*C\]",
       lambda: linear.locality_enhance(k, jnp.ones((3, N, K + 1)))),
      (r"must have odd sizes", lambda: linear.locality_enhance(k, jnp.ones((2, N, K)))),
      (r"`grid` = \(2, 4\) must have H \* W = T = 9",
       lambda: linear.locality_enhance(k, jnp.ones((3, 3, N, K)), grid=(2, 4))),
      (r"`grid` must be None or a pair", lambda: linear.locality_enhance(
          k, jnp.ones((3, 3, N, K)), grid=(3, 0))),
      (r"`bias` must have shape \[\*C\]",
       lambda: linear.locality_enhance(k, jnp.ones((3, N, K)), jnp.ones((K,)))),
      (r"`x` must have shape \[B, T, \*C\]",
       lambda: linear.locality_enhance(jnp.ones(3), jnp.ones((3,)))),
  )


@pytest.mark.slow
def test_float64_stays_float64():
  k, seg, mask = _inputs()
  with jax.enable_x64(True):
    k64 = jnp.asarray(np.asarray(k, np.float64))
    kern = jnp.asarray(np.linspace(-1, 1, 3 * N * K).reshape(3, N, K))
    y, z = jax.jit(lambda k: (linear.key_instance_norm(k, segment_ids=seg, mask=mask),
                              linear.locality_enhance(k, kern)))(k64)
    assert y.dtype == jnp.float64 and z.dtype == jnp.float64
    np.testing.assert_allclose(y, _key_norm_np(k, 1e-5, seg, mask), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(z, _conv_np(k, kern, None, None), rtol=1e-12, atol=1e-12)
