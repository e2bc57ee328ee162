r"""A PolyKV-quantised key/value cache for :class:`jaxsoft.nn.MultiHeadAttention` (K11).

``layer.init_cache(batch, max_length, quantization="polykv")`` stores the cache in the
PolyKV format of :mod:`kernels_pallas.polykv` instead of float keys and values:

* keys, GGML ``q8_0``: ``cached_key_codes`` int8 ``[B, C, K, H32]`` (``H32 = 32
  ceil(H / 32)``) and ``cached_key_scales`` float16 ``[B, C, K, H32 / 32]`` (one scale
  ``d = max |k| / 127`` per 32 channels, float16 as GGML's ``ggml_half``; the quantiser
  already rounds d to float16, so storing it as float16 loses nothing);
* values, Hadamard-rotated 3-bit Lloyd-Max codes, bit-packed: ``cached_value_codes``
  uint8 ``[B, C, K, 3 m8 / 8]`` (``m`` = the value head dim rounded up to a power of two,
  ``m8 = 8 ceil(m / 8)``; 8 codes in 3 bytes, code i of a group at bits ``3i .. 3i + 2``
  of the little-endian 24-bit word) and ``cached_value_rho`` float32 ``[B, C, K]`` (each
  token's RMS in the rotated basis).

Bytes per cached token and KV head: ``H32 + 2 H32 / 32 + 3 m8 / 8 + 4`` (H = m = 64: 64 +
4 + 24 + 4 = 96, against 256 for float16 K and V: 2.67x smaller).

A decode call quantises the new tokens' keys and values, writes them, and attends with
the *dequantised* cache (:func:`kernels_pallas.polykv.polykv_dequantize`; the new tokens
also through their quantised form, so every step sees exactly what is stored). A
one-token step of a layer whose ``implementation`` asks for Pallas decodes through
:func:`kernels_pallas.polykv.polykv_decode_attention` (int8 keys and 3-bit values read
by the kernel, no dequantised cache) when it computes the call exactly (softmax, no soft
cap, dot scores, no float64, no sliding window); otherwise the dense path runs on the
dequantised arrays. The error against the float cache is PolyKV's
(:func:`kernels_pallas.polykv.polykv_decode_attention`): with the logit error
:math:`\epsilon = s \max_j \sum_h |q_h| |k_{jh} - \hat k_{jh}|`,

.. math::
  |\hat o - o| \le (e^{2\epsilon} - 1) \max_j |v_j|_\infty
    + \max_j \|v_j - \hat v_j\|_2 .
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas import polykv

__all__ = ["QUANTIZATIONS", "pack_3bit", "unpack_3bit", "polykv_cache_bytes"]

QUANTIZATIONS = ("polykv",)


def _value_dims(head_dim: int) -> tuple[int, int]:
  """``(m, m8)``: the rotated value dim (next power of two) and it rounded up to 8."""
  m = 1 << max(0, math.ceil(math.log2(head_dim)))
  return m, 8 * -(-m // 8)


def pack_3bit(codes: jax.Array) -> jax.Array:
  r"""Packs 3-bit codes ``[..., n]`` (ints in ``[0, 8)``) into uint8 ``[..., 3 ceil(n / 8)]``.

  Groups of 8 codes (the last zero-padded) form the 24-bit word
  :math:`w = \sum_{i=0}^{7} c_i\, 2^{3i}`, stored as its 3 little-endian bytes.

  Examples:
    >>> from jaxsoft.nn import _quantized_cache as qc
    >>> codes = jnp.arange(8, dtype=jnp.int8)
    >>> packed = qc.pack_3bit(codes)
    >>> packed.dtype, packed.shape, bool(jnp.all(qc.unpack_3bit(packed, 8) == codes))
    (dtype('uint8'), (3,), True)

  References:
    PolyKV, 2025 (3-bit Lloyd-Max value codes; it names no bit layout, this one is this
    module's).
  """
  n = codes.shape[-1]
  g = -(-n // 8)
  c = jnp.pad(codes.astype(jnp.uint32), [(0, 0)] * (codes.ndim - 1) + [(0, 8 * g - n)])
  c = c.reshape(*codes.shape[:-1], g, 8)
  shifts = 3 * jnp.arange(8, dtype=jnp.uint32).reshape((1,) * (c.ndim - 1) + (8,))
  word = jnp.sum(c << shifts, axis=-1, dtype=jnp.uint32)
  b = (word[..., None] >> (8 * jnp.arange(3, dtype=jnp.uint32)).reshape((1,) * word.ndim + (3,))) & 0xFF
  return b.astype(jnp.uint8).reshape(*codes.shape[:-1], 3 * g)


def unpack_3bit(packed: jax.Array, n: int) -> jax.Array:
  """The first ``n`` codes (int8 ``[..., n]``) of :func:`pack_3bit`'s bytes ``[..., 3 g]``.

  Examples:
    >>> from jaxsoft.nn import _quantized_cache as qc
    >>> c = jnp.array([7, 0, 5, 3, 1, 6, 2, 4, 7, 7], jnp.int8)
    >>> qc.unpack_3bit(qc.pack_3bit(c), 10).tolist()
    [7, 0, 5, 3, 1, 6, 2, 4, 7, 7]

  References:
    The layout of :func:`pack_3bit`.
  """
  g = packed.shape[-1] // 3
  b = packed.astype(jnp.uint32).reshape(*packed.shape[:-1], g, 3)
  word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
  c = (word[..., None] >> (3 * jnp.arange(8, dtype=jnp.uint32)).reshape((1,) * word.ndim + (8,))) & 7
  return c.astype(jnp.int8).reshape(*packed.shape[:-1], 8 * g)[..., :n]


def polykv_cache_bytes(head_dim: int) -> int:
  """Bytes per cached token and KV head in the PolyKV cache: ``H32 + 2 H32 / 32 + 3 m8 / 8
  + 4`` (int8 key codes, float16 key scales, packed 3-bit value codes, float32 rho).

  Examples:
    >>> from jaxsoft.nn import _quantized_cache as qc
    >>> qc.polykv_cache_bytes(64)   # vs 2 * 64 * 2 = 256 for float16 K and V
    96

  References:
    PolyKV, 2025 (int8 keys, 3-bit values); G. Gerganov et al., ggml ``block_q8_0``.
  """
  h32 = 32 * -(-head_dim // 32)
  _, m8 = _value_dims(head_dim)
  return h32 + 2 * (h32 // 32) + 3 * m8 // 8 + 4


def init(module: Any, shape: tuple[int, int, int, int]) -> None:
  """The PolyKV cache variables of ``shape = (B, C, K, H)`` on ``module`` (zeros)."""
  b, c, kh, h = shape
  h32 = 32 * -(-h // 32)
  _, m8 = _value_dims(h)
  module.cached_key_codes = nnx.Cache(jnp.zeros((b, c, kh, h32), jnp.int8))
  module.cached_key_scales = nnx.Cache(jnp.zeros((b, c, kh, h32 // 32), jnp.float16))
  module.cached_value_codes = nnx.Cache(jnp.zeros((b, c, kh, 3 * m8 // 8), jnp.uint8))
  module.cached_value_rho = nnx.Cache(jnp.zeros((b, c, kh), jnp.float32))


def stored(module: Any) -> polykv.PolyKVCache:
  """The cache as a :class:`kernels_pallas.polykv.PolyKVCache` (value codes unpacked)."""
  h = module.head_dim
  m, _ = _value_dims(h)
  return polykv.PolyKVCache(
      module.cached_key_codes[...], module.cached_key_scales[...].astype(jnp.float32),
      unpack_3bit(module.cached_value_codes[...], m), module.cached_value_rho[...],
      head_dim=h, value_dim=h)


def read(module: Any) -> tuple[jax.Array, jax.Array]:
  """The dequantised cached keys and values ``[B, C, K, H]`` float32."""
  return polykv.polykv_dequantize(stored(module))


def quantize(k: jax.Array, v: jax.Array) -> tuple[Any, tuple[jax.Array, jax.Array]]:
  """New keys/values ``[B, L, K, H]`` -> (their stored form, their dequantised form)."""
  c = polykv.polykv_quantize(k, v)
  return (c.k_codes, c.k_scales.astype(jnp.float16), pack_3bit(c.v_codes), c.v_rho), \
      polykv.polykv_dequantize(c)


def write(module: Any, slots: jax.Array, stored: Any, first: int) -> None:
  """Writes the stored form's tokens ``first:`` into cache slots ``slots``."""
  names = ("cached_key_codes", "cached_key_scales", "cached_value_codes", "cached_value_rho")
  for name, x in zip(names, stored, strict=True):
    var = getattr(module, name)
    var[...] = var[...].at[:, slots].set(x[:, first:].astype(var[...].dtype))


def _np_bytes(module: Any) -> int:
  """Bytes held by the PolyKV cache variables of ``module`` (tests, docs)."""
  names = ("cached_key_codes", "cached_key_scales", "cached_value_codes", "cached_value_rho")
  return int(sum(np.asarray(getattr(module, n)[...]).nbytes for n in names))
