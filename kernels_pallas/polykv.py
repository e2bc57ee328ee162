r"""K11: PolyKV asymmetric KV-cache quantisation and split-K decoding through it.

Keys and values are quantised differently because the softmax treats their errors
differently: a key error ``dk`` moves the logit by ``q . dk`` and multiplies the weight by
``e^{q . dk}`` (an exponential, relative error on every weight of the row), while a value
error enters the output linearly. So keys keep 8 bits and values get 3:

* **keys**, GGML's ``q8_0``: along the head dim, blocks of 32 channels of one token and
  head, each with the scale ``d = max |x| / 127`` and codes ``round(x / d)`` in int8
  (``x ~ d * code``; round half away from zero, as ``roundf``; ``d`` stored at float16
  precision, as GGML's ``ggml_half``, in a float32 array);
* **values**: rotated along the head dim by the randomized Hadamard matrix
  ``R = diag(sigma) H_m / sqrt(m)`` (``m`` the head dim rounded up to a power of two,
  :func:`kernels_pallas.fp8.hadamard_matrix`, the same seeded signs), ``y = v R``, which
  makes each coordinate of ``y`` close to Gaussian; then each coordinate of ``y / rho``
  (``rho = ||y|| / sqrt(m)``, the token's RMS) is mapped to the nearest of the 8
  Lloyd-Max centroids of N(0, 1) (:data:`LLOYD_MAX_3BIT`), a 3-bit code.

Decoding (:func:`polykv_decode_attention`) never dequantises the cache: a key tile is
``codes * (d expanded over its 32 channels)`` in float32 inside the kernel, and because R
is orthogonal the values' rotation is undone once on the output,

.. math::
  o = \sum_j p_j \hat v_j = \Big(\sum_j p_j\, \rho_j\, c[\mathrm{code}_j]\Big) R^\top ,

so the kernel accumulates ``p_j rho_j c[code_j]`` in the rotated basis and XLA applies
``R^T`` to the ``[B, N, m]`` result. The split-K structure, the online-softmax partials and
their merge are those of :mod:`kernels_pallas.decode` (Flash-Decoding).

[R] reconstructed where the source leaves it open: the per-token normalisation ``rho``
that maps the rotated coordinates to N(0, 1) (the centroids are N(0, 1)-optimal, the paper
names no scale); the random signs of the Hadamard matrix (the source says "Fast
Walsh-Hadamard", the rotation is randomized here as in FlashAttention-3 and QuaRot); the
storage of one 3-bit code per int8 (the codes are not bit-packed: memory is 8 bits per
value code, information 3). Keys with a head dim that is not a multiple of 32 are padded
with zeros to whole blocks (GGML requires whole blocks).

References:
  PolyKV (catalogue 001#89): int8 q8_0 keys, Hadamard-rotated 3-bit Lloyd-Max values,
  "stable 2.91x compression ratio" (= 32 / (8 + 3) bits over an fp16 K and V).

  G. Gerganov et al., ggml / llama.cpp, ``block_q8_0`` (the q8_0 format).

  S. P. Lloyd, 1982, "Least squares quantization in PCM"; J. Max, 1960, "Quantizing for
  minimum distortion" (the codebook).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kernels_pallas import decode as _decode
from kernels_pallas import fp8
from kernels_pallas.backends import BACKENDS

__all__ = ["LLOYD_MAX_3BIT", "LLOYD_MAX_3BIT_THRESHOLDS", "LLOYD_MAX_3BIT_MSE",
           "Q8_BLOCK", "PolyKVCache", "lloyd_max_gaussian", "quantize_keys_q8_0",
           "dequantize_keys_q8_0", "quantize_values", "dequantize_values", "polykv_quantize",
           "polykv_dequantize", "polykv_reference", "polykv_decode_attention"]

_NAME = "polykv_decode_attention"
Q8_BLOCK = 32
SEED = fp8.SEED
# The 3-bit Lloyd-Max quantiser of N(0, 1), from lloyd_max_gaussian(3) (Lloyd's iteration
# to its fixed point; tests/kernels_pallas/test_polykv.py recomputes it): centroids,
# the decision thresholds (midpoints) and the mean squared error per coordinate.
LLOYD_MAX_3BIT = (-2.1519457, -1.3439093, -0.7560053, -0.2450942,
                  0.2450942, 0.7560053, 1.3439093, 2.1519457)
LLOYD_MAX_3BIT_THRESHOLDS = (-1.7479275, -1.0499573, -0.5005497, 0.0,
                             0.5005497, 1.0499573, 1.7479275)
LLOYD_MAX_3BIT_MSE = 0.0345478
_SCALE_COLS = 16  # key-scale columns as the kernels read them (a 16-wide matmul operand)


def _err(msg: str) -> ValueError:
  return ValueError(f"{_NAME}: {msg}")


def lloyd_max_gaussian(bits: int, iterations: int = 500):
  r"""The ``2^bits``-level Lloyd-Max quantiser of the standard normal, by Lloyd's iteration.

  Alternates the two optimality conditions of a minimum-MSE scalar quantiser: thresholds at
  the midpoints of neighbouring centroids, and centroids at the conditional means of their
  cells,

  .. math::
    t_i = \tfrac{c_i + c_{i+1}}{2}, \qquad
    c_i = E[X \mid t_{i-1} < X \le t_i] = \frac{\phi(t_{i-1}) - \phi(t_i)}
    {\Phi(t_i) - \Phi(t_{i-1})},

  in float64 numpy from equally spaced centroids on [-2, 2]; the MSE is
  ``1 - sum_i P_i c_i^2`` (the conditional means make the error orthogonal to the code).

  Args:
    bits: the code width, 1 to 8.
    iterations: Lloyd iterations (500 reach the fixed point to float64 rounding for 3 bits).

  Returns:
    ``(centroids [2^bits], thresholds [2^bits - 1], mse)`` as float64 numpy arrays and a
    float.

  Examples:
    >>> from kernels_pallas import polykv
    >>> c, t, mse = polykv.lloyd_max_gaussian(3)
    >>> np.round(c[4:], 4), round(mse, 5)
    (array([0.2451, 0.756 , 1.3439, 2.1519]), 0.03455)
    >>> c1, _, mse1 = polykv.lloyd_max_gaussian(1)   # sign quantiser: +-sqrt(2/pi)
    >>> round(float(c1[1]), 4), round(mse1, 4)
    (0.7979, 0.3634)

  References:
    S. P. Lloyd, 1982, "Least squares quantization in PCM".

    J. Max, 1960, "Quantizing for minimum distortion".
  """
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
    raise ValueError(f"lloyd_max_gaussian: `bits` must be an int in [1, 8], got {bits!r}")
  n = 1 << int(bits)
  erf = np.vectorize(math.erf)

  def pdf(t):
    return np.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)

  def cdf(t):
    return 0.5 * (1.0 + erf(t / math.sqrt(2.0)))

  def cells(c):
    t = (c[1:] + c[:-1]) / 2
    return t, np.concatenate([[-np.inf], t]), np.concatenate([t, [np.inf]])

  c = np.linspace(-2.0, 2.0, n)
  for _ in range(int(iterations)):
    _, lo, hi = cells(c)
    c = (pdf(lo) - pdf(hi)) / (cdf(hi) - cdf(lo))
  t, lo, hi = cells(c)
  mse = float(1.0 - np.sum((cdf(hi) - cdf(lo)) * c * c))
  return c, t, mse


# ------------------------------------------------------------------------------ quantisers


def quantize_keys_q8_0(k):
  r"""GGML ``q8_0`` quantisation of keys: int8 codes, one scale per 32 channels of a token.

  .. math::
    d_{b} = \max_{h \in \text{block } b} |k_h| / 127, \qquad
    \mathrm{code}_h = \operatorname{sign}(k_h) \lfloor |k_h| / d_b + 1/2 \rfloor, \qquad
    k_h \approx d_b\, \mathrm{code}_h

  with ``d`` rounded to float16 precision (GGML's stored scale; the codes use the float32
  ``d``, as ``quantize_row_q8_0``). An all-zero block has ``d = 0`` and codes 0. The
  error is at most ``d / 2`` per channel, plus ``127 |d - d_16|`` from the scale's rounding.

  Args:
    k: ``[..., H]`` float keys; H is zero-padded to ``H32 = 32 ceil(H / 32)``.

  Returns:
    ``(codes [..., H32] int8, scales [..., H32 / 32] float32)``.

  Examples:
    >>> from kernels_pallas import polykv
    >>> k = np.concatenate([np.linspace(-1, 1, 32), np.linspace(0, 0.5, 32)]).astype("f4")
    >>> codes, d = polykv.quantize_keys_q8_0(k)
    >>> codes.dtype, codes.shape, np.round(np.asarray(d) * 127, 3)  # d = max |x| / 127
    (dtype('int8'), (64,), array([1. , 0.5], dtype=float32))
    >>> err = np.abs(polykv.dequantize_keys_q8_0(codes, d, 64) - k)
    >>> bool(np.all(err <= np.repeat(d, 32) * 0.51))
    True

  References:
    G. Gerganov et al., ggml / llama.cpp, ``block_q8_0`` and ``quantize_row_q8_0``.
  """
  k = jnp.asarray(k)
  if k.ndim < 1 or not jnp.issubdtype(k.dtype, jnp.floating):
    raise ValueError(f"quantize_keys_q8_0: `k` must be a float array [..., H], got "
                     f"{k.dtype}{list(k.shape)}")
  return _q8_0(k)


@jax.jit
def _q8_0(k):
  h = k.shape[-1]
  nb = -(-h // Q8_BLOCK)
  x = jnp.pad(k.astype(jnp.float32), [(0, 0)] * (k.ndim - 1) + [(0, nb * Q8_BLOCK - h)])
  xb = x.reshape(*x.shape[:-1], nb, Q8_BLOCK)
  d = jnp.max(jnp.abs(xb), axis=-1) / 127.0
  inv = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
  y = xb * inv[..., None]
  codes = jnp.clip(jnp.sign(y) * jnp.floor(jnp.abs(y) + 0.5), -127, 127).astype(jnp.int8)
  d16 = d.astype(jnp.float16).astype(jnp.float32)
  return codes.reshape(x.shape), d16


def dequantize_keys_q8_0(codes, scales, head_dim: int):
  """The keys :func:`quantize_keys_q8_0` stands for: ``codes * d``, unpadded to ``head_dim``.

  Args:
    codes: ``[..., H32]`` int8.
    scales: ``[..., H32 / 32]`` float32.
    head_dim: H, the unpadded head dim.

  Returns:
    ``[..., H]`` float32.

  Examples:
    >>> from kernels_pallas import polykv
    >>> k = np.concatenate([np.linspace(-1, 1, 32), np.linspace(0, 0.5, 32)]).astype("f4")
    >>> k_hat = np.asarray(polykv.dequantize_keys_q8_0(*polykv.quantize_keys_q8_0(k), 64))
    >>> k_hat[:3], k[:3]
    (array([-0.9999, -0.937 , -0.874 ], dtype=float32), array([-1.    , -0.9355, -0.871 ], dtype=float32))

  References:
    G. Gerganov et al., ggml / llama.cpp, ``dequantize_row_q8_0``.
  """
  return _dequant_keys(codes, scales, int(head_dim))


@functools.partial(jax.jit, static_argnums=2)
def _dequant_keys(codes, scales, head_dim: int):
  x = codes.astype(jnp.float32).reshape(*codes.shape[:-1], -1, Q8_BLOCK)
  return (x * scales[..., None]).reshape(codes.shape)[..., :head_dim]


def _rotation(m: int, seed: int):
  return fp8.hadamard_matrix(m, seed)


def quantize_values(v, seed: int = SEED):
  r"""Values rotated by a randomized Hadamard matrix, then 3-bit Lloyd-Max codes per coordinate.

  .. math::
    y = v R, \quad \rho = \|y\|_2 / \sqrt{m}, \quad
    \mathrm{code}_i = \#\{t \in T : y_i / \rho > t\} \in \{0, \dots, 7\}

  (``R`` = :func:`kernels_pallas.fp8.hadamard_matrix` of ``m = next_pow2(Hv)``, v
  zero-padded to m; ``T`` = :data:`LLOYD_MAX_3BIT_THRESHOLDS`: the nearest of the
  centroids :data:`LLOYD_MAX_3BIT`). [R] ``rho``, the per-token RMS that maps ``y`` to
  unit variance, is this module's reading of "N(0, 1)-optimal centroids". The expected
  squared error per coordinate is ``LLOYD_MAX_3BIT_MSE * rho^2`` (0.0345) when ``y / rho``
  is standard normal, which the rotation makes nearly so.

  Args:
    v: ``[..., Hv]`` float values.
    seed: the seed of R's signs.

  Returns:
    ``(codes [..., m] int8 in [0, 8), rho [...] float32)``.

  Examples:
    >>> from kernels_pallas import polykv
    >>> v = np.random.default_rng(0).standard_normal((1024, 128)).astype(np.float32)
    >>> codes, rho = polykv.quantize_values(v)
    >>> codes.shape, int(codes.min()), int(codes.max())
    ((1024, 128), 0, 7)
    >>> err = np.asarray(polykv.dequantize_values(codes, rho, 128)) - v
    >>> round(float(np.mean(err ** 2 / np.asarray(rho)[:, None] ** 2)), 3)  # Lloyd-Max: 0.0345
    0.034

  References:
    S. P. Lloyd, 1982, "Least squares quantization in PCM"; J. Max, 1960, "Quantizing for
    minimum distortion".

    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision" (the
    randomized Hadamard rotation before quantisation).
  """
  v = jnp.asarray(v)
  if v.ndim < 1 or v.shape[-1] < 1 or not jnp.issubdtype(v.dtype, jnp.floating):
    raise ValueError(f"quantize_values: `v` must be a float array [..., Hv], got "
                     f"{v.dtype}{list(v.shape)}")
  return _quantize_values(v, int(seed))


@functools.partial(jax.jit, static_argnums=1)
def _quantize_values(v, seed: int):
  y = fp8.hadamard_rotation(v, seed)
  m = y.shape[-1]
  rho = jnp.sqrt(jnp.sum(y * y, axis=-1) / m)
  u = y / jnp.where(rho > 0, rho, 1.0)[..., None]
  t = jnp.asarray(LLOYD_MAX_3BIT_THRESHOLDS, jnp.float32).reshape((1,) * u.ndim + (-1,))
  codes = jnp.sum((u[..., None] > t).astype(jnp.int32), axis=-1).astype(jnp.int8)
  return codes, rho


def dequantize_values(codes, rho, value_dim: int, seed: int = SEED):
  """The values :func:`quantize_values` stands for: ``(rho c[codes]) R^T``, unpadded.

  Args:
    codes: ``[..., m]`` int codes in ``[0, 8)``.
    rho: ``[...]`` float32, the per-token RMS.
    value_dim: Hv, the unpadded value head dim.
    seed: the seed of R's signs (the quantiser's).

  Returns:
    ``[..., Hv]`` float32.

  Examples:
    >>> from kernels_pallas import polykv
    >>> v = np.random.default_rng(0).standard_normal((1024, 128)).astype(np.float32)
    >>> v_hat = np.asarray(polykv.dequantize_values(*polykv.quantize_values(v), 128))
    >>> v_hat[0, :4], v[0, :4]                      # 3 bits per coordinate: coarse
    (array([ 0.0238, -0.1785,  0.4427,  0.1403], dtype=float32), array([ 0.1257, -0.1321,  0.6404,  0.1049], dtype=float32))

  References:
    S. P. Lloyd, 1982, "Least squares quantization in PCM".
  """
  return _dequant_values(codes, rho, int(value_dim), int(seed))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dequant_values(codes, rho, value_dim: int, seed: int):
  m = codes.shape[-1]
  y = jnp.take(jnp.asarray(LLOYD_MAX_3BIT, jnp.float32), codes.astype(jnp.int32)) * rho[..., None]
  v = jnp.matmul(y, _rotation(m, seed).T, precision=jax.lax.Precision.HIGHEST)
  return v[..., :value_dim]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k_codes", "k_scales", "v_codes", "v_rho"],
                   meta_fields=["head_dim", "value_dim", "seed"])
@dataclasses.dataclass(frozen=True)
class PolyKVCache:
  """A PolyKV-quantised KV cache (a pytree; the dims and the seed are static).

  Attributes:
    k_codes: ``[B, S, K, H32]`` int8, q8_0 key codes (H zero-padded to whole 32-blocks).
    k_scales: ``[B, S, K, H32 / 32]`` float32, their scales.
    v_codes: ``[B, S, K, m]`` int8, 3-bit Lloyd-Max codes of the rotated values.
    v_rho: ``[B, S, K]`` float32, each token's RMS in the rotated basis.
    head_dim: H, the keys' head dim.
    value_dim: Hv, the values' head dim (``m = next_pow2(Hv)``).
    seed: the seed of the Hadamard signs.
  """

  k_codes: jax.Array
  k_scales: jax.Array
  v_codes: jax.Array
  v_rho: jax.Array
  head_dim: int
  value_dim: int
  seed: int = SEED


def polykv_quantize(k, v, seed: int = SEED) -> PolyKVCache:
  """A KV cache quantised the PolyKV way: q8_0 keys, rotated 3-bit Lloyd-Max values.

  Args:
    k: ``[B, S, K, H]`` keys.
    v: ``[B, S, K, Hv]`` values.
    seed: the seed of the Hadamard signs.

  Returns:
    A :class:`PolyKVCache`.

  Examples:
    >>> from kernels_pallas import polykv
    >>> k, v = np.random.default_rng(0).standard_normal((2, 1, 48, 2, 64)).astype(np.float32)
    >>> cache = polykv.polykv_quantize(k, v)
    >>> cache.k_codes.shape, cache.k_scales.shape, cache.v_codes.shape, cache.v_rho.shape
    ((1, 48, 2, 64), (1, 48, 2, 2), (1, 48, 2, 64), (1, 48, 2))

  References:
    PolyKV (catalogue 001#89); G. Gerganov et al., ggml ``block_q8_0``.
  """
  k, v = jnp.asarray(k), jnp.asarray(v)
  if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
    raise ValueError(f"polykv_quantize: `k` [B, S, K, H] and `v` [B, S, K, Hv] must agree in "
                     f"B, S, K, got {k.shape} and {v.shape}")
  kc, ks = quantize_keys_q8_0(k)
  vc, rho = quantize_values(v, seed)
  return PolyKVCache(kc, ks, vc, rho, head_dim=k.shape[-1], value_dim=v.shape[-1],
                     seed=int(seed))


def polykv_dequantize(cache: PolyKVCache):
  """``(k_hat [B, S, K, H], v_hat [B, S, K, Hv])`` float32: what the cache stands for.

  Examples:
    >>> from kernels_pallas import polykv
    >>> k, v = np.random.default_rng(0).standard_normal((2, 1, 48, 2, 64)).astype(np.float32)
    >>> k_hat, v_hat = polykv.polykv_dequantize(polykv.polykv_quantize(k, v))
    >>> float(np.max(np.abs(k_hat - k))) < 0.02, float(np.mean((v_hat - v) ** 2)) < 0.06
    (True, True)

  References:
    PolyKV (catalogue 001#89).
  """
  return (dequantize_keys_q8_0(cache.k_codes, cache.k_scales, cache.head_dim),
          dequantize_values(cache.v_codes, cache.v_rho, cache.value_dim, cache.seed))


def polykv_reference(q, cache: PolyKVCache, lengths, scale: float | None = None):
  r"""Decode attention through a PolyKV cache in plain ``jnp`` (the kernel's reference).

  Softmax attention of one query token per row over the first ``lengths[b]`` keys of the
  dequantised cache (:func:`polykv_dequantize`), float32, GQA (query head n reads KV head
  ``n // (N / K)``):

  .. math::
    o_{bn} = \sum_{j < \mathrm{len}_b} \operatorname{softmax}_j(s\, q_{bn} \cdot \hat k_{bj})
    \, \hat v_{bj}

  Args:
    q: ``[B, N, H]``.
    cache: a :class:`PolyKVCache`.
    lengths: ``[B]`` int; a row of length 0 gives zeros.
    scale: the logit scale (default ``1 / sqrt(H)``).

  Returns:
    ``[B, N, Hv]`` in q's dtype.

  Examples:
    >>> from kernels_pallas import polykv
    >>> k, v = np.random.default_rng(0).standard_normal((2, 1, 48, 2, 64)).astype(np.float32)
    >>> q = np.random.default_rng(1).standard_normal((1, 4, 64)).astype(np.float32)
    >>> o = polykv.polykv_reference(q, polykv.polykv_quantize(k, v), np.array([10]))
    >>> s = q[0, :2] @ k[0, :10, 0].T / 8.0          # exact, head 0's first 10 keys
    >>> exact = np.exp(s) / np.exp(s).sum(-1, keepdims=True) @ v[0, :10, 0]
    >>> o.shape, float(np.mean(np.abs(o[0, :2] - exact))) < 0.1   # 3-bit values
    ((1, 4, 64), True)

  References:
    PolyKV (catalogue 001#89).
  """
  q = jnp.asarray(q)
  h = q.shape[-1]
  return _reference(q, cache, jnp.asarray(lengths),
                    1.0 / math.sqrt(h) if scale is None else float(scale))


@functools.partial(jax.jit, static_argnums=3)
def _reference(q, cache: PolyKVCache, lengths, scale: float):
  b, n, h = q.shape
  k, v = polykv_dequantize(cache)
  kh = k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, kh, n // kh, h)
  s = jnp.einsum("bkgh,bskh->bkgs", qg, k, precision=jax.lax.Precision.HIGHEST) * scale
  visible = jnp.arange(k.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
  s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
  w = jax.nn.softmax(s, axis=-1, where=visible[:, None, None, :])
  w = jnp.where(visible[:, None, None, :], w, 0.0)
  o = jnp.einsum("bkgs,bskh->bkgh", w, jnp.where(visible[:, :, None, None], v, 0.0),
                 precision=jax.lax.Precision.HIGHEST)
  return o.reshape(b, n, -1).astype(q.dtype)


# --------------------------------------------------------------------------- kernel tiles


@dataclasses.dataclass(frozen=True)
class _Cfg:
  backend: str
  scale: float
  block_k: int
  num_blocks: int
  num_splits: int
  blocks_per_split: int
  interpret: Any


def _expand(nbp: int, hp: int):
  """``[nbp, hp]`` 0/1: row b is 1 on the channels of q8_0 block b (no integer division)."""
  i = jax.lax.broadcasted_iota(jnp.int32, (nbp, hp), 0)
  h = jax.lax.broadcasted_iota(jnp.int32, (nbp, hp), 1)
  off = h - i * Q8_BLOCK
  return jnp.where((off >= 0) & (off < Q8_BLOCK), 1.0, 0.0).astype(jnp.float32)


def _centroids(codes):
  """``c[codes]`` by a chain of selects (no gather in a kernel)."""
  out = jnp.full(codes.shape, LLOYD_MAX_3BIT[0], jnp.float32)
  for i in range(1, 8):
    out = jnp.where(codes == i, LLOYD_MAX_3BIT[i], out)
  return out


def _tile(cfg: _Cfg, q, kc, ks, vc, rho, start, n, state):
  """One key block: logits from the int8 keys and their block scales (expanded by a 0/1
  matmul), values ``rho_j c[code_j]`` in the rotated basis, rows past the length zeroed,
  folded into the online-softmax state of :mod:`kernels_pallas.decode`."""
  bk = kc.shape[0]
  # float32 dots at full precision (IEEE on Triton, not TF32): the kernel computes what
  # polykv_reference does, so the quantisation is the only error
  with jax.default_matmul_precision("highest"):
    scales = jax.lax.dot_general(ks, _expand(ks.shape[1], kc.shape[1]),
                                 (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    k = kc.astype(jnp.float32) * scales
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * cfg.scale
    valid = start + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1) < n
    rows = start + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < n
    vt = jnp.where(rows, _centroids(vc) * rho, 0.0)
    return _decode._tile("online", s, valid, vt, state, None)


def _triton_partials(cfg: _Cfg, q4, kc, ks, vc, rho, lo, hi, lens):
  """Grid (batch, KV head, split); loop over the split's key blocks ``[lo, hi)``
  (``decode._triton_split_call``)."""
  gp = q4.shape[2]
  s_pad, mp, bk = kc.shape[1], vc.shape[-1], cfg.block_k

  def kernel(lo_ref, hi_ref, len_ref, q_ref, kc_ref, ks_ref, vc_ref, rho_ref, *out_refs):
    q, n = q_ref[...], len_ref[...]

    def body(j, state):
      sl = pl.ds(j * bk, bk)
      return _tile(cfg, q, kc_ref[sl, :], ks_ref[sl, :], vc_ref[sl, :], rho_ref[sl, :],
                   j * bk, n, state)

    _decode._fold_split(lo_ref, hi_ref, body, _decode._init(gp, mp), out_refs)

  caches = (kc, ks, vc, rho)
  specs = [pl.BlockSpec((None, s_pad, None, a.shape[-1]), lambda bi, h, si: (bi, 0, h, 0))
           for a in caches]
  return _decode._triton_split_call(kernel, specs, caches, q4=q4, lo=lo, hi=hi, lens=lens,
                                   num_splits=cfg.num_splits, width=mp,
                                   interpret=bool(cfg.interpret), name="jaxsoft_polykv_decode")


def _mosaic_partials(cfg: _Cfg, q4, kc, ks, vc, rho, lo, hi, lens):
  """Grid (batch, KV head, split, block of the split) with the state in VMEM scratch, as
  :func:`kernels_pallas.decode._mosaic_partials`; the four cache arrays are read
  heads-first (``[B, K, S, .]``: a transposed copy of each, whose last dim is the whole
  array's, so any width is a legal block)."""

  b, kh, gp, hp = q4.shape
  mp, p, bk = vc.shape[-1], cfg.num_splits, cfg.block_k
  bps, nk = cfg.blocks_per_split, cfg.num_blocks

  def block(bi, si, t, lo_ref, hi_ref):
    r = bi * p + si
    a, z = lo_ref[r], hi_ref[r]
    return jnp.minimum(jnp.minimum(jnp.maximum(si * bps + t, a), jnp.maximum(z - 1, a)), nk - 1)

  def spec(width):
    return pl.BlockSpec((None, None, bk, width), lambda bi, hh, si, t, lo_ref, hi_ref, _: (
        bi, hh, block(bi, si, t, lo_ref, hi_ref), 0))

  def kernel(lo_ref, hi_ref, len_ref, q_ref, kc_ref, ks_ref, vc_ref, rho_ref, m_ref, l_ref,
             acc_ref, m_sc, l_sc, acc_sc):
    bi, si, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    r, kb = bi * p + si, si * bps + t

    @pl.when(t == 0)
    def _start():
      m_sc[...], l_sc[...], acc_sc[...] = _decode._init(gp, mp)

    @pl.when(jnp.logical_and(kb >= lo_ref[r], kb < hi_ref[r]))
    def _compute():
      m_sc[...], l_sc[...], acc_sc[...] = _tile(
          cfg, q_ref[...], kc_ref[...], ks_ref[...], vc_ref[...], rho_ref[...], kb * bk,
          len_ref[bi], (m_sc[...], l_sc[...], acc_sc[...]))

    @pl.when(t == bps - 1)
    def _finish():
      m_ref[...] = m_sc[...]
      l_ref[...] = l_sc[...]
      acc_ref[...] = acc_sc[...]

  heads_first = [jnp.swapaxes(x, 1, 2) for x in (kc, ks, vc, rho)]
  call = _decode._mosaic_split_call(
      kernel, cfg, grid=(b, kh, p, bps), gp=gp, h=hp, hv=mp,
      in_specs=[spec(hp), spec(ks.shape[-1]), spec(mp), spec(1)], num_scalar_prefetch=3,
      name="jaxsoft_polykv_decode")
  return call(lo.reshape(-1), hi.reshape(-1), lens, q4, *heads_first)


# ----------------------------------------------------------------------------------- API


def _check_cache(q, cache, lengths):
  if not isinstance(cache, PolyKVCache):
    raise _err(f"`cache` must be a PolyKVCache (from polykv_quantize), got {type(cache)}")
  q = jnp.asarray(q)
  if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
    raise _err(f"`q` must be a float array [B, N, H], got {q.dtype}{list(q.shape)}")
  b, n, h = q.shape
  kc, ks, vc, rho = cache.k_codes, cache.k_scales, cache.v_codes, cache.v_rho
  if kc.ndim != 4 or kc.shape[0] != b or h != cache.head_dim:
    raise _err(f"the cache's keys must be [B, S, K, H32] with B = {b} and head_dim H = {h} "
               f"(q's), got k_codes {kc.shape} and head_dim {cache.head_dim}")
  bsk = kc.shape[:3]
  if (ks.shape != (*bsk, kc.shape[3] // Q8_BLOCK) or vc.shape[:3] != bsk
      or rho.shape != bsk or kc.dtype != jnp.int8 or vc.dtype != jnp.int8):
    raise _err(f"inconsistent PolyKVCache: k_codes {kc.dtype}{list(kc.shape)}, k_scales "
               f"{list(ks.shape)}, v_codes {vc.dtype}{list(vc.shape)}, v_rho {list(rho.shape)}")
  kh = bsk[2]
  if kh < 1 or n % kh:
    raise _err(f"the number of query heads N = {n} must be a multiple of the cache's K = {kh}")
  if bsk[1] < 1:
    raise _err(f"the cache must hold at least one key, got k_codes {kc.shape}")
  try:
    lens = _decode._check_lengths(lengths, b, bsk[1])
  except ValueError as e:
    raise _err(str(e).split(": ", 1)[1]) from None
  return q, lens


def polykv_decode_attention(q, cache: PolyKVCache, lengths, *, scale=None,
                            num_splits: int | None = None, backend: str = "triton",
                            interpret: Any = False, block_k: int | None = None) -> jax.Array:
  r"""Split-K softmax decoding of one new token per row through a PolyKV cache (K11).

  For batch row b and query head n (KV head ``n // G``, ``G = N / K``), with
  ``\hat k_j = d_{j, \lfloor h / 32 \rfloor} \mathrm{code}_{jh}`` (q8_0) and the values in
  the rotated basis ``\hat y_j = \rho_j c[\mathrm{code}_j]``:

  .. math::
    x_j = s\, q_{bn} \cdot \hat k_{bj}, \qquad
    o_{bn} = \Big(\sum_{j < \mathrm{len}_b} \operatorname{softmax}(x)_j\, \hat y_{bj}\Big)
    R^\top,

  equal to :func:`polykv_reference` (attention on the dequantised cache) up to float32
  rounding. One program per (batch, KV head, key split) reads the int8 key codes, their
  scales (expanded over the 32 channels of a block inside the kernel), the int8 value
  codes and rho, and returns online-softmax partials ``(m, l, acc)`` merged in XLA as in
  :func:`kernels_pallas.decode_attention`; ``R^T`` is applied once to the merged
  ``[B, N, m]`` output. Forward only (a quantised cache has no gradient).

  Error against exact attention on the unquantised cache (tested in float64): with
  ``eps = s * max_j sum_h |q_h| |k_jh - \hat k_jh|`` the logit error, the weights move by
  ``||p_hat - p||_1 <= e^{2 eps} - 1``, so
  ``|o_hat - o| <= (e^{2 eps} - 1) max_j |v_j|_inf + max_j ||v_j - \hat v_j||_2``.

  Args:
    q: ``[B, N, H]``, the new token's queries (float; computed in float32).
    cache: a :class:`PolyKVCache` of ``S_max`` keys (:func:`polykv_quantize`); ``N % K
      == 0``.
    lengths: ``[B]`` int, the valid cached keys per row (concrete values in ``[0,
      S_max]``, traced ones clipped); a row of length 0 returns zeros.
    scale: the logit scale (a number; default ``1 / sqrt(H)``).
    num_splits: key chunks processed in parallel (default: about 128 programs per call).
    backend: "triton" (GPU) or "mosaic_tpu".
    interpret: run in the Pallas interpreter (CPU).
    block_k: keys per block (Triton: a power of two >= 16, default 128; Mosaic: a multiple
      of 128, default 512, or the whole cache when it is shorter).

  Returns:
    ``[B, N, Hv]`` in q's dtype.

  Examples:
    >>> import functools
    >>> from kernels_pallas import polykv
    >>> k, v = np.random.default_rng(0).standard_normal((2, 1, 48, 2, 64)).astype(np.float32)
    >>> q = np.random.default_rng(1).standard_normal((1, 4, 64)).astype(np.float32)
    >>> cache = polykv.polykv_quantize(k, v)
    >>> lengths = np.array([37])
    >>> decode = jax.jit(functools.partial(polykv.polykv_decode_attention, block_k=16,
    ...                                    interpret=True))
    >>> o = decode(q, cache, lengths)
    >>> o.shape, bool(jnp.allclose(o, polykv.polykv_reference(q, cache, lengths), atol=1e-5))
    ((1, 4, 64), True)

  References:
    PolyKV (catalogue 001#89): int8 keys, Hadamard-rotated 3-bit Lloyd-Max values.

    T. Dao, D. Haziza, F. Massa & G. Sizov, 2023, "Flash-Decoding for long-context
    inference" (the split-K partials and their merge).

    G. Gerganov et al., ggml / llama.cpp, ``block_q8_0``.
  """
  if backend not in BACKENDS:
    raise _err(f"`backend` must be one of {BACKENDS}, got {backend!r}")
  q, lens = _check_cache(q, cache, lengths)
  b, n, h = q.shape
  try:
    scale, _ = _decode._check_numbers(scale, None, h)
  except ValueError as e:
    raise _err(str(e).split(": ", 1)[1]) from None
  kc, ks, vc, rho = cache.k_codes, cache.k_scales, cache.v_codes, cache.v_rho
  s_len, kh, h32, m = kc.shape[1], kc.shape[2], kc.shape[3], vc.shape[3]
  g = n // kh
  nbp = _SCALE_COLS * _decode._cdiv(h32 // Q8_BLOCK, _SCALE_COLS)
  if backend == "triton":
    gp, hp, mp = (_decode._next_pow2(max(x, 16)) for x in (g, h32, m))
  else:
    gp, hp, mp = _decode._cdiv(g, 8) * 8, h32, m
  try:
    bk = _decode._check_block(backend, block_k, s_len, hp)
    p_req = None if num_splits is None else _decode._check_int(num_splits, "num_splits")
  except ValueError as e:
    raise _err(str(e).split(": ", 1)[1]) from None
  nk = _decode._cdiv(s_len, bk)
  p = min(max(1, _decode._cdiv(128, b * kh)) if p_req is None else p_req, nk)
  bps = _decode._cdiv(nk, p)
  cfg = _Cfg(backend=backend, scale=scale, block_k=bk, num_blocks=nk,
             num_splits=_decode._cdiv(nk, bps), blocks_per_split=bps, interpret=interpret)
  p = cfg.num_splits
  ds = nk * bk - s_len if backend == "triton" else 0
  kc = jnp.pad(kc, ((0, 0), (0, ds), (0, 0), (0, hp - h32)))
  ks = jnp.pad(ks, ((0, 0), (0, ds), (0, 0), (0, nbp - ks.shape[3])))
  vc = jnp.pad(vc, ((0, 0), (0, ds), (0, 0), (0, mp - m)))
  rho = jnp.pad(rho, ((0, 0), (0, ds), (0, 0)))[..., None]
  q4 = jnp.pad(q.astype(jnp.float32).reshape(b, kh, g, h),
               ((0, 0), (0, 0), (0, gp - g), (0, hp - h)))
  starts = jnp.arange(p, dtype=jnp.int32) * bps
  lo = jnp.broadcast_to(starts, (b, p))
  hi = jnp.maximum(jnp.minimum((starts + bps)[None, :], (lens[:, None] + bk - 1) // bk), lo)
  fn = _triton_partials if backend == "triton" else _mosaic_partials
  mx, l, acc = fn(cfg, q4, kc, ks, vc, rho, lo, hi, lens)
  out = _decode._merge(mx[:, :, :, :g], l[:, :, :, :g], acc[:, :, :, :g], None)
  out = jnp.where((lens > 0)[:, None, None, None], out, 0.0)[..., :m]
  out = jnp.matmul(out, _rotation(m, cache.seed).T, precision=jax.lax.Precision.HIGHEST)
  return out[..., :cache.value_dim].reshape(b, n, cache.value_dim).astype(q.dtype)
