"""RoPE mean pooling as a low-pass filter, LUCID's conditioning, MultiMax's sparse
multimodality (catalogue row E21).

* Prism (2025-26; a training-free spectral-aware block selection; authors and title
  not recorded in this project's sources): "mean pooling acts as a low-pass filter that
  induces destructive interference in high-frequency dimensions". For a vector rotated by
  RoPE over B positions, the block mean of rotary pair f is the vector times the Dirichlet
  kernel D_B(theta_f) = sin(B theta_f / 2) / (B sin(theta_f / 2)) (up to a phase); Prism's
  energy calibration is |D_B|^2.
* S. S. Duvvuri, N. Patel, N. Gupta & I. S. Dhillon, 2026, "LUCID: Attention with
  Preconditioned Representations": the preconditioner tril(exp(K K^T / s)) of RMS-normed
  keys grows worse conditioned with the sequence length; its solve cancels a duplicated key.
* Y. Zhou, M. Fritz & M. Keuper, 2024, "MultiMax: Sparse and Multi-Modal Attention
  Learning" (ICML): for x = (2, 1.9, -3) MultiMax can suppress the small entry while the two
  large ones stay comparable (multi-modal and sparse); softmax at any temperature cannot.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from jaxsoft.attention._block_sparse import _Layout, _prism_attenuation, prism_bands
from jaxsoft.attention._lucid import lucid_preconditioned_values

# ---------------------------------------------------------------- RoPE mean-pool low-pass


def _rope_half_split(x, pos, base=10000.0):
  """Half-split RoPE in numpy float64: pair f = dims (f, f + H/2) rotated by pos theta_f,
  theta_f = base^(-2f/H) (the convention of ``prism_bands``)."""
  half = x.shape[-1] // 2
  theta = base ** (-2.0 * np.arange(half) / x.shape[-1])
  ang = pos[:, None] * theta
  a, b = x[..., :half], x[..., half:]
  return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)],
                        -1), theta


def test_mean_pooling_of_rope_keys_is_the_dirichlet_kernel_and_prism_calibrates_by_it():
  H, B, blocks = 16, 8, 4
  S = B * blocks
  u = np.random.default_rng(0).normal(size=H)
  keys, theta = _rope_half_split(np.broadcast_to(u, (S, H)), np.arange(S, dtype=np.float64))
  dirichlet = np.sin(B * theta / 2) / (B * np.sin(theta / 2))  # theta_0 = 1 rad ... 1e-3
  with jax.enable_x64(True):
    k = jnp.asarray(keys).reshape(1, S, 1, H)
    call = types.SimpleNamespace(q=k, k=k, v=k, scale=1.0, is_causal=False,
                                 key_value_seq_lengths=None)
    lay = _Layout(call, B)

    @jax.jit
    def pooled_and_attenuation():
      kbar = lay.block_means()[1]  # [B, N, blocks, H]
      return kbar[0, 0], jnp.stack([_prism_attenuation(lay, jnp.array([f, f + H // 2]), kbar,
                                                       False).ravel()[0]
                                    for f in range(H // 2)])

    kbar, atten = (np.asarray(a) for a in pooled_and_attenuation())
  half = H // 2
  pair_norm = lambda x: np.hypot(x[..., :half], x[..., half:])  # noqa: E731
  # |mean of the rotated pair| / |pair| = |D_B(theta_f)| in every block (the phase moves
  # with the block; the magnitude does not). float64: a mean of 8 rotated values, ~1e-15.
  np.testing.assert_allclose(pair_norm(kbar) / pair_norm(u), np.broadcast_to(
      np.abs(dirichlet), (blocks, half)), rtol=0, atol=1e-13)
  # low-pass: the slowest pair passes (D_B -> 1 as theta -> 0), the fastest ones are damped
  assert np.abs(dirichlet[-1]) > 0.999 and np.abs(dirichlet[0]) < 0.2
  assert np.all(np.diff(np.abs(dirichlet)[:3]) > 0)  # monotone over the first lobe
  # Prism's per-band calibration (pooled / unpooled key energy) of a one-pair band is
  # |D_B(theta_f)|^2 (clipped below at 1e-6) ...
  np.testing.assert_allclose(atten, np.maximum(dirichlet ** 2, 1e-6), rtol=1e-12, atol=0)
  # ... and its high band (the first pairs) is the most attenuated one
  hi, lo = prism_bands(H, 2)
  assert hi == [0, 1, half, half + 1] and sorted(lo + hi) == list(range(H))
  assert atten[:2].max() < atten[2:].min()


# ---------------------------------------------------------------- LUCID conditioning


def _rms(k, eps=1e-6):
  return k / np.sqrt(np.mean(k * k, -1, keepdims=True) + eps)


def test_lucid_preconditioner_conditioning_grows_with_length_and_duplicates_cancel():
  H, lengths = 8, (8, 32, 128)
  rng = np.random.default_rng(1)
  conds = []
  with jax.enable_x64(True):
    inverse = jax.jit(lambda k: lucid_preconditioned_values(k, jnp.eye(k.shape[1])[None, :,
                                                                                   None]))
    for n in lengths:
      k = _rms(rng.normal(size=(n, H)))
      P = np.tril(np.exp(k @ k.T / np.sqrt(H)))  # the numpy float64 preconditioner
      P_inv = np.asarray(inverse(jnp.asarray(k)[None, :, None]))[0, :, 0]  # Y for V = I
      # jaxsoft's solve inverts P: P Y = I to the solve's rounding (unit-lower
      # substitution: backward error ~n eps |P||Y|; |P||Y| <= ~100 here -> 1e-11)
      np.testing.assert_allclose(P @ P_inv, np.eye(n), rtol=0, atol=1e-11)
      conds.append(np.linalg.norm(P, 1) * np.linalg.norm(P_inv, 1))
      np.testing.assert_allclose(conds[-1], np.linalg.cond(P, 1), rtol=1e-9)
  # the conditioning worsens with the length (measured ~1.7, 4, 14 in the 2-norm)
  assert conds[0] < conds[1] < conds[2] and conds[2] > 4 * conds[0], conds
  # Duplicates: if key i+1 repeats key i, rows i and i+1 of P agree left of the diagonal,
  # so Y_{i+1} = (v_{i+1} - v_i) / P_ii exactly: a repeated (key, value) token gets value 0.
  n, i = 12, 6
  k = _rms(rng.normal(size=(n, H)))
  k[i + 1] = k[i]
  v = rng.normal(size=(n, 3))
  v2 = v.copy()
  v2[i + 1] = v2[i]
  with jax.enable_x64(True):
    f = jax.jit(lambda k, v: lucid_preconditioned_values(k[None, :, None], v[None, :, None]))
    y, y2 = (np.asarray(f(jnp.asarray(k), jnp.asarray(vv)))[0, :, 0] for vv in (v, v2))
  p_ii = np.exp(k[i] @ k[i] / np.sqrt(H))
  np.testing.assert_allclose(y[i + 1], (v[i + 1] - v[i]) / p_ii, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(y2[i + 1], 0.0, rtol=0, atol=1e-14)
  assert np.all(np.abs(y2[i]) > 1e-3)  # the first copy keeps its value


# ---------------------------------------------------------------- MultiMax multimodality


def test_multimax_is_sparse_and_multimodal_where_no_softmax_temperature_is():
  x = np.array([2.0, 1.9, -3.0])
  eps, ratio = 1e-6, 1.2  # "suppressed": p3 <= eps p1; "comparable": p1 <= ratio p2
  temps = np.geomspace(1e-2, 1e2, 801)
  with jax.enable_x64(True):
    # a quadratic piece below 0 (t3 = -1, b3 = 0): sigma(-3) = -3 - 9 = -12; the scores
    # above 0 are left as they are, and sigma is increasing (t3 <= 0), so order is kept
    @jax.jit
    def weights(x, t):
      return (js.normalizers.multimax(x, t3=-1.0, b3=0.0), js.normalizers.multimax(x),
              js.normalizers.softmax(jnp.broadcast_to(x, t.shape[:1] + x.shape), temperature=t))

    mm, plain, soft = (np.asarray(a) for a in weights(x, temps[:, None]))
  # MultiMax = softmax(2, 1.9, -12): p1 / p2 = e^0.1 and p3 / p1 = e^-14 = 8.3e-7 (float64
  # reference; the exps round at ~1e-16 relative)
  ref = np.exp([2.0, 1.9, -12.0] - np.float64(2.0))
  np.testing.assert_allclose(mm, ref / ref.sum(), rtol=1e-14)
  assert mm[2] <= eps * mm[0] and mm[0] <= ratio * mm[1]
  # softmax(x / T): p3 / p1 = e^(-5/T) <= 1e-6 needs T <= 5 / ln(1e6) = 0.362, and then
  # p1 / p2 = e^(0.1/T) >= 1.318: no temperature gives both (low T: unimodal; high T: dense)
  sparse = soft[:, 2] <= eps * soft[:, 0]
  multimodal = soft[:, 0] <= ratio * soft[:, 1]
  assert sparse.any() and multimodal.any() and not np.any(sparse & multimodal)
  # the control within MultiMax: t = 0 (the default) is softmax, and is not sparse here
  assert plain[2] > eps * plain[0]
