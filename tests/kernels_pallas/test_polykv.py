"""K11: PolyKV quantisation (q8_0 keys, Hadamard-rotated 3-bit Lloyd-Max values) and the
split-K decode kernel through it (kernels_pallas/polykv.py).

References written here in float64 numpy from the formats: GGML's q8_0 (``d = amax / 127``,
``roundf(x / d)``, d stored as float16), the Hadamard rotation (Sylvester matrix times
the module's signs), nearest-centroid coding and dense softmax attention. The kernel runs
in interpret mode (both drivers) against :func:`polykv_reference` and against exact
attention on the unquantised cache within the module's stated bound; both drivers are
export-lowered for their real targets.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import fp8, polykv
from tests.kernels_pallas.test_decode import _reference as _attention_np  # float64 decode

TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
U_F32 = 2.0 ** -24


# --------------------------------------------------------------------- float64 references


def _q8_0_np(x):
  """GGML quantize_row_q8_0 in float64 (d computed in float32 as GGML's float code does)."""
  x = np.asarray(x, np.float32)
  h = x.shape[-1]
  nb = -(-h // 32)
  xp = np.zeros((*x.shape[:-1], nb * 32), np.float32)
  xp[..., :h] = x
  xb = xp.reshape(*x.shape[:-1], nb, 32)
  d = np.max(np.abs(xb), axis=-1) / np.float32(127)
  inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
  y = xb * inv[..., None]
  codes = np.sign(y) * np.floor(np.abs(y) + 0.5)  # roundf: half away from zero
  return codes.reshape(xp.shape).astype(np.int8), d.astype(np.float16).astype(np.float64)


def _hadamard_np(m, seed=fp8.SEED):
  h = np.ones((1, 1))
  while h.shape[0] < m:
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=m)
  return signs[:, None] * h / np.sqrt(m)


def _dequant_np(cache):
  """(k_hat, v_hat) float64 from the cache's codes: codes * d; (rho c[code]) R^T."""
  kc = np.asarray(cache.k_codes, np.float64)
  ks = np.asarray(cache.k_scales, np.float64)
  k = (kc.reshape(*kc.shape[:-1], -1, 32) * ks[..., None]).reshape(kc.shape)[..., :cache.head_dim]
  c = np.asarray(polykv.LLOYD_MAX_3BIT, np.float64)
  y = c[np.asarray(cache.v_codes)] * np.asarray(cache.v_rho, np.float64)[..., None]
  v = y @ _hadamard_np(y.shape[-1]).T
  return k, v[..., :cache.value_dim]


# ------------------------------------------------------------------------- the codebook


def test_lloyd_max_constants_are_the_gaussian_fixed_point():
  c, t, mse = polykv.lloyd_max_gaussian(3)
  # the committed constants carry 7 decimals: 5e-8 of rounding
  np.testing.assert_allclose(polykv.LLOYD_MAX_3BIT, c, atol=1e-7)
  np.testing.assert_allclose(polykv.LLOYD_MAX_3BIT_THRESHOLDS, t, atol=1e-7)
  assert abs(polykv.LLOYD_MAX_3BIT_MSE - mse) < 1e-7
  np.testing.assert_allclose(c, -c[::-1], atol=1e-12)  # symmetric
  # known values of Max (1960), table for N = 8: 0.2451, 0.7560, 1.3440, 2.1520
  np.testing.assert_allclose(c[4:], [0.2451, 0.7560, 1.3440, 2.1520], atol=1.1e-4)


@pytest.mark.slow
def test_lloyd_max_centroids_minimise_the_mse_of_gaussian_samples():
  x = np.random.default_rng(0).standard_normal(100_000)
  c = np.asarray(polykv.LLOYD_MAX_3BIT)

  def mse(cb):
    return np.mean(np.min((x[:, None] - cb[None, :]) ** 2, axis=1))

  base = mse(c)
  # sample MSE of 1e5 draws: standard error ~ sqrt(Var / n) ~ 1.5e-4 around 0.034548
  assert abs(base - polykv.LLOYD_MAX_3BIT_MSE) < 6e-4
  # on the same draws, moving centroid i by delta costs P_i delta^2 + 2 delta P_i (c_i -
  # mean of its cell's draws); that mean is within ~0.005 of c_i (>= 2000 draws per cell),
  # far inside delta / 2 = 0.025
  for i in range(8):
    for delta in (-0.05, 0.05):
      assert mse(c + delta * (np.arange(8) == i)) > base
  assert mse(c * 1.05) > base and mse(c * 0.95) > base


def test_lloyd_max_gaussian_rejects_bad_bits():
  with pytest.raises(ValueError, match="bits"):
    polykv.lloyd_max_gaussian(0)


# ------------------------------------------------------------------------- the quantisers


def test_q8_0_keys_match_ggml_and_their_error_bound():
  x = np.random.default_rng(1).standard_normal((3, 5, 40)).astype(np.float32)
  x[0, 0, :32] = 0.0  # an all-zero block: d = 0, codes 0
  x[1, 2, 3] = 25.0   # an outlier: its block's step grows, the other block's does not
  codes, d = jax.jit(polykv.quantize_keys_q8_0)(x)
  want_codes, want_d = _q8_0_np(x)
  np.testing.assert_array_equal(np.asarray(codes), want_codes)
  np.testing.assert_array_equal(np.asarray(d, np.float64), want_d)
  assert codes.shape == (3, 5, 64) and d.shape == (3, 5, 2)
  k_hat = np.asarray(polykv.dequantize_keys_q8_0(codes, d, 40), np.float64)
  # |x - code d16| <= d / 2 + 127 |d - d16| with |d - d16| <= 2^-11 d (float16 rounding)
  d32 = np.abs(np.pad(x, ((0, 0), (0, 0), (0, 24)))).reshape(3, 5, 2, 32).max(-1) / 127
  bound = np.repeat(d32 * (0.5 + 127 * 2.0 ** -11) * (1 + 1e-6), 32, axis=-1)[..., :40]
  assert np.all(np.abs(k_hat - x) <= bound)
  assert not np.any(k_hat[0, 0, :32])


def test_value_codes_are_nearest_centroids_of_the_rotated_normalised_values():
  v = np.random.default_rng(2).standard_normal((64, 48)).astype(np.float32)
  codes, rho = jax.jit(polykv.quantize_values)(v)
  r = _hadamard_np(64)
  np.testing.assert_allclose(r @ r.T, np.eye(64), atol=1e-12)  # inverse = transpose
  y = np.pad(v.astype(np.float64), ((0, 0), (0, 16))) @ r
  want_rho = np.sqrt(np.mean(y ** 2, axis=-1))
  np.testing.assert_allclose(np.asarray(rho), want_rho, rtol=1e-5)  # float32 matmul
  u = y / want_rho[:, None]
  dist = np.abs(u[..., None] - np.asarray(polykv.LLOYD_MAX_3BIT)[None, None, :])
  nearest = np.argmin(dist, axis=-1)
  # a value within float32 rounding (1e-5) of a threshold may code either side
  srt = np.sort(dist, axis=-1)
  clear = srt[..., 1] - srt[..., 0] > 1e-5
  np.testing.assert_array_equal(np.asarray(codes)[clear], nearest[clear])
  assert clear.mean() > 0.99


@jax.jit
def _three_bit(x):
  """x through the value quantiser and back (one program per shape)."""
  codes, rho = polykv.quantize_values(x)
  return polykv.dequantize_values(codes, rho, x.shape[-1]), rho


@pytest.mark.slow
def test_rotated_3bit_distortion_is_the_lloyd_max_mse_and_outliers_are_spread():
  # Gaussian values: y / rho is ~ N(0, 1) per coordinate, MSE ~ 0.0345 rho^2. Two channels
  # 20x larger: unrotated, they would sit at ~5.4 rms, far past the outer centroid 2.15
  # (overload); the rotation spreads them over all 64 coordinates.
  rng = np.random.default_rng(3)
  v = rng.standard_normal((2048, 64)).astype(np.float32)
  v_out = v.copy()
  v_out[:, [3, 17]] *= 20.0
  mse = {}
  for name, x in (("normal", v), ("outlier", v_out)):
    v_hat, rho = _three_bit(x)
    err = np.asarray(v_hat, np.float64) - x
    mse[name] = np.mean(err ** 2, axis=-1) / np.asarray(rho, np.float64) ** 2
  # 2048 x 64 coordinates: the sample mean's standard error is ~ 2e-4; normalising by the
  # empirical rho (not the true sigma) moves the law slightly: allow 0.003
  assert abs(mse["normal"].mean() - polykv.LLOYD_MAX_3BIT_MSE) < 3e-3, mse["normal"].mean()
  assert mse["outlier"].mean() < polykv.LLOYD_MAX_3BIT_MSE + 3e-3
  # the same codebook without the rotation (nearest centroid of v / rms):
  rms = np.sqrt(np.mean(v_out.astype(np.float64) ** 2, axis=-1, keepdims=True))
  c = np.asarray(polykv.LLOYD_MAX_3BIT)
  u = v_out / rms
  plain = c[np.argmin(np.abs(u[..., None] - c), axis=-1)] * rms
  plain_mse = np.mean((plain - v_out) ** 2, axis=-1) / rms[:, 0] ** 2
  assert plain_mse.mean() > 3 * mse["outlier"].mean(), (plain_mse.mean(), mse["outlier"].mean())


@pytest.mark.slow
def test_keys_are_more_sensitive_than_values():
  # The asymmetry PolyKV rests on: the same 3-bit quantiser applied to the keys (rotated
  # with q, so q . k is kept up to the quantisation) moves the output more than applied
  # to the values, because a logit error multiplies the weights by e^{q . dk}.
  rng = np.random.default_rng(4)
  q = rng.standard_normal((8, 4, 64)) * 2.0
  k = rng.standard_normal((8, 256, 1, 64))
  v = rng.standard_normal((8, 256, 1, 64))
  n = np.full(8, 256)
  exact = _attention_np(q, k, v, n)

  def three_bit(x):
    return np.asarray(_three_bit(x.astype(np.float32))[0], np.float64)

  err_keys = np.abs(_attention_np(q, three_bit(k), v, n) - exact).mean()
  err_values = np.abs(_attention_np(q, k, three_bit(v), n) - exact).mean()
  assert err_keys > 1.5 * err_values, (err_keys, err_values)


# ---------------------------------------------------------------------------- the kernel


def _case(b=3, s=40, kh=2, n=4, h=48, hv=20, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, n, h), (b, s, kh, h), (b, s, kh, hv)))


def _poison(cache, lengths):
  """NaN scales and rho, code 7, past each row's length (never read into the result)."""
  s = cache.k_codes.shape[1]
  past = jnp.arange(s)[None, :] >= lengths[:, None]
  return polykv.PolyKVCache(
      jnp.where(past[:, :, None, None], jnp.int8(127), cache.k_codes),
      jnp.where(past[:, :, None, None], jnp.nan, cache.k_scales),
      jnp.where(past[:, :, None, None], jnp.int8(7), cache.v_codes),
      jnp.where(past[:, :, None], jnp.nan, cache.v_rho),
      head_dim=cache.head_dim, value_dim=cache.value_dim, seed=cache.seed)


def _float64_bound(q, k, v, cache, lengths):
  """The module's bound on |o_hat - o|: (e^{2 eps} - 1) max |v|_inf + max ||v - v_hat||_2,
  eps = s max_j sum_h |q_h| |k_jh - k_hat_jh| over the visible keys, per (row, head)."""
  k_hat, v_hat = _dequant_np(cache)
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, n, h = q.shape
  g = n // k.shape[2]
  bound = np.zeros((b, n))
  for bi in range(b):
    ln = int(lengths[bi])
    for ni in range(n):
      if ln == 0:
        continue
      dk = np.abs(k[bi, :ln, ni // g] - k_hat[bi, :ln, ni // g])
      eps = np.max(dk @ np.abs(q[bi, ni])) / np.sqrt(h)
      dv = np.max(np.linalg.norm(v[bi, :ln, ni // g] - v_hat[bi, :ln, ni // g], axis=-1))
      bound[bi, ni] = np.expm1(2 * eps) * np.max(np.abs(v[bi, :ln, ni // g])) + dv
  return bound


@pytest.mark.parametrize("backend,block_k", [
    ("triton", 16), pytest.param("mosaic_tpu", None, marks=pytest.mark.slow)])
def test_kernel_matches_reference_and_exact_attention_within_the_bound(backend, block_k):
  # GQA 4 query / 2 KV heads, H = 48 (keys padded to two 32-blocks), Hv = 20 (m = 32),
  # lengths 0, partial and S_max, 3 key blocks of 16 in 2 splits (Triton; Mosaic: one
  # whole-length block), NaN / garbage past the lengths.
  q, k, v = _case()
  lengths = jnp.array([0, 17, 40], jnp.int32)

  @jax.jit
  def run(q, k, v, n):  # one program: quantise, poison, kernel, jnp reference
    cache = polykv.polykv_quantize(k, v)
    out = polykv.polykv_decode_attention(q, _poison(cache, n), n, backend=backend,
                                         block_k=block_k, num_splits=2, interpret=True)
    return cache, out, polykv.polykv_reference(q, cache, n)

  cache, out, ref = run(q, k, v, lengths)
  out = np.asarray(out, np.float64)
  k_hat, v_hat = _dequant_np(cache)
  quantised = _attention_np(q, k_hat, v_hat, lengths)
  # float32 kernel vs float64 on the same dequantised cache: logits of |q|.|k| ~ 50 lose
  # ~50 * 2^-24 each, outputs are convex combinations of |v| <= 5: 1e-5 is ~20x margin
  np.testing.assert_allclose(out, quantised, atol=1e-5)
  np.testing.assert_allclose(out, np.asarray(ref), atol=1e-5)
  assert not np.any(out[0])  # length 0: zeros
  exact = _attention_np(q, k, v, lengths)
  bound = _float64_bound(q, k, v, cache, lengths)
  err = np.max(np.abs(out - exact), axis=-1)
  assert np.all(err <= bound + 1e-5), (err, bound)
  assert np.max(err[1:]) > 1e-3  # the quantisation shows: not the exact result


def test_bf16_queries_and_cache_inputs_compute_in_float32():
  """bf16 q, k, v (the serving dtype): the cache is quantised from the bf16 values, the
  kernel computes in float32 and returns q's dtype, so the output is float64 attention on
  the bf16 query and the dequantised cache, rounded once to bf16 (bf16's unit roundoff
  2^-8 relative), plus the float32 kernel's own 1e-5."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _case(b=2, s=20, kh=1, n=2, h=32, hv=16, seed=3))
  lengths = jnp.array([20, 9], jnp.int32)

  @jax.jit
  def run(q, k, v, n):
    cache = polykv.polykv_quantize(k, v)
    return cache, polykv.polykv_decode_attention(q, cache, n, block_k=16, interpret=True)

  cache, out = run(q, k, v, lengths)
  assert out.dtype == jnp.bfloat16 and cache.k_codes.dtype == jnp.int8
  k_hat, v_hat = _dequant_np(cache)
  want = _attention_np(np.asarray(q, np.float64), k_hat, v_hat, lengths)
  got = np.asarray(out, np.float64)
  np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=1e-5)
  # and the cache holds the bf16 inputs' q8_0 codes exactly (GGML's, in float64)
  codes, scales = _q8_0_np(np.asarray(k, np.float32))
  np.testing.assert_array_equal(np.asarray(cache.k_codes), codes)
  np.testing.assert_array_equal(np.asarray(cache.k_scales, np.float64), scales)


@pytest.mark.parametrize("backend,h,hv", [("triton", 128, 128), ("mosaic_tpu", 128, 128),
                                          pytest.param("mosaic_tpu", 64, 80,
                                                       marks=pytest.mark.slow),
                                          pytest.param("triton", 72, 80,
                                                       marks=pytest.mark.slow)])
def test_export_lowering(backend, h, hv):
  q = jax.ShapeDtypeStruct((2, 8, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 1000, 2, h), jnp.float32)
  v = jax.ShapeDtypeStruct((2, 1000, 2, hv), jnp.float32)
  cache = jax.eval_shape(polykv.polykv_quantize, k, v)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  f = jax.jit(lambda q, c, n: polykv.polykv_decode_attention(q, c, n, backend=backend,
                                                             num_splits=3))
  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    text = jax.export.export(f, platforms=[platform], disabled_checks=[TRITON_CALL])(
        q, cache, lengths).mlir_module()
  assert ("__gpu$xla.gpu.triton" if backend == "triton" else "tpu_custom_call") in text
  assert "jaxsoft_polykv_decode" in text


def _abstract_gpu():
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def test_bad_input():
  q, k, v = _case(b=2, s=8)
  cache = polykv.PolyKVCache(jnp.zeros((2, 8, 2, 64), jnp.int8), jnp.ones((2, 8, 2, 2)),
                             jnp.zeros((2, 8, 2, 32), jnp.int8), jnp.ones((2, 8, 2)),
                             head_dim=48, value_dim=20)
  n = jnp.array([3, 8], jnp.int32)
  cases = [
      (dict(q=q[:, :3]), "multiple"),
      (dict(q=q[..., :40]), "head_dim"),
      (dict(cache=(k, v)), "PolyKVCache"),
      (dict(lengths=jnp.array([3, 9])), "lengths"),
      (dict(backend="cuda"), "backend"),
      (dict(block_k=24), "block_k"),
      (dict(num_splits=0), "num_splits"),
  ]
  for change, match in cases:
    kw = dict(q=q, cache=cache, lengths=n, interpret=True)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
      polykv.polykv_decode_attention(kw.pop("q"), kw.pop("cache"), kw.pop("lengths"), **kw)
  with pytest.raises(ValueError, match="inconsistent"):
    polykv.polykv_decode_attention(q, polykv.PolyKVCache(
        cache.k_codes, cache.k_scales[..., :1], cache.v_codes, cache.v_rho, head_dim=48,
        value_dim=20), n, interpret=True)
  with pytest.raises(ValueError, match="agree"):
    polykv.polykv_quantize(k, v[:, :4])
