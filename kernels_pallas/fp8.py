"""K06: FP8 (e4m3) block quantisation of q and k with a randomized Hadamard rotation
(FlashAttention-3's "incoherent processing", Shah et al. 2024).

q and k are multiplied along the head dim by the same orthogonal matrix
``R = H_m diag(signs) / sqrt(m)`` (``H_m`` the Sylvester Hadamard matrix, ``m`` the head
dim rounded up to a power of two, q and k zero-padded to it, ``signs`` a fixed seeded
random +-1 vector), which leaves ``q . k`` unchanged and spreads outlier channels over all
``m`` dims; then q is quantised per (batch, head, query block) and k per (batch, kv-head,
key block) to ``float8_e4m3fn`` with float32 scales ``amax / 448``.

The forward kernel's score tiles are a native fp8 dot, ``dot(q8, k8)`` with float32
accumulation, times the query row's and the key's scales (``kernel_operands``; the
Triton driver by default, the Mosaic one with ``fp8_dot=True``), or the dot of the
dequantised values ``x8 * scale`` (``fake_quant_blocks``), which equals it up to float32
rounding: either way the scores carry exactly the fp8 quantisation error. v and the
P . V product stay in the input dtype. The backward passes run on the dequantised q and
k with a straight-through gradient (FlashAttention-3's fp8 path is forward-only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["E4M3_MAX", "hadamard_matrix", "hadamard_rotation", "quantize_blocks",
           "dequantize_blocks", "fake_quant_blocks", "straight_through", "kernel_operands"]

E4M3_MAX = 448.0
SEED = 0x5EED


@functools.cache
def _hadamard_np(m: int, seed: int) -> np.ndarray:
  if m < 1 or m & (m - 1):
    raise ValueError(f"the Hadamard size must be a power of two, got {m}")
  h = np.ones((1, 1))
  while h.shape[0] < m:
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=m)
  return (signs[:, None] * h) / np.sqrt(m)  # diag(signs) @ H / sqrt(m): orthogonal


def hadamard_matrix(m: int, seed: int = SEED, dtype=jnp.float32):
  """The orthogonal ``m x m`` randomized Hadamard matrix ``diag(signs) H_m / sqrt(m)``."""
  return jnp.asarray(_hadamard_np(m, seed), dtype)


def hadamard_rotation(x, seed: int = SEED):
  """``x [..., h]`` zero-padded to ``m = next_pow2(h)`` and rotated: ``x @ R`` in float32,
  returned ``[..., m]`` float32. The same R for q and k keeps every ``q . k``."""
  h = x.shape[-1]
  m = 1 << max(0, (h - 1).bit_length())
  x = x.astype(jnp.float32)
  if m != h:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, m - h)])
  return jnp.matmul(x, hadamard_matrix(m, seed), precision=jax.lax.Precision.HIGHEST)


def quantize_blocks(x, block: int):
  """``x [B, T, N, H]`` -> ``(x8, scale, T)``: ``x8`` float8_e4m3fn ``[B, nb, block, N, H]``
  (T zero-padded to ``nb = ceil(T / block)`` blocks), ``scale`` float32
  ``[B, nb, 1, N, 1]`` = the block's amax / 448 per (batch, head, block of ``block`` rows)
  (an all-zero block gets scale 1), so that ``x ~ x8 * scale``."""
  if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block <= 0:
    raise ValueError(f"`block` must be a positive int, got {block!r}")
  if jnp.ndim(x) != 4:
    raise ValueError(f"`x` must be [B, T, N, H], got shape {jnp.shape(x)}")
  b, t, n, h = x.shape
  nb = -(-t // block)
  xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * block - t), (0, 0), (0, 0)))
  xb = xf.reshape(b, nb, block, n, h)
  amax = jnp.max(jnp.abs(xb), axis=(2, 4), keepdims=True)  # [B, nb, 1, N, 1]
  scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
  x8 = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  return x8, scale, t


def dequantize_blocks(x8, scale, t: int):
  """Inverse of :func:`quantize_blocks`: float32 ``[B, T, N, H]``."""
  b, nb, block, n, h = x8.shape
  return (x8.astype(jnp.float32) * scale).reshape(b, nb * block, n, h)[:, :t]


def straight_through(x, x8, scale):
  """The dequantised ``x8 * scale`` (float32 ``x.shape``) with the gradient of the
  identity in ``x``: the forward sees the fp8 values, ``jax.grad`` passes through."""
  xf = x.astype(jnp.float32)
  y = dequantize_blocks(x8, scale, x.shape[1])
  return xf + jax.lax.stop_gradient(y - xf)


def fake_quant_blocks(x, block: int):
  """``dequantize_blocks(*quantize_blocks(x, block))`` with a straight-through gradient
  (identity): the forward sees the fp8 values, ``jax.grad`` passes through unchanged."""
  x8, scale, _ = quantize_blocks(jax.lax.stop_gradient(x), block)
  return straight_through(x, x8, scale)


def kernel_operands(x8, scale, rows: int):
  """The native fp8 kernel's operands from :func:`quantize_blocks`'s output: ``x8`` as
  ``[B, rows, N, H]`` float8 (zero rows appended) and the scale of each row ``[B, N,
  rows]`` float32 (1 on the appended rows); ``rows`` >= the quantised length."""
  b, nb, block, n, h = x8.shape
  if rows < nb * block:
    raise ValueError(f"`rows` must be at least the quantised length {nb * block}, got {rows}")
  x8 = jnp.pad(x8.reshape(b, nb * block, n, h), ((0, 0), (0, rows - nb * block), (0, 0),
                                                 (0, 0)))
  per_row = jnp.broadcast_to(scale, (b, nb, block, n, 1)).reshape(b, nb * block, n)
  per_row = jnp.pad(per_row, ((0, 0), (0, rows - nb * block), (0, 0)), constant_values=1.0)
  return x8, jnp.transpose(per_row, (0, 2, 1))

# Measured forward error of ``kp.attention(..., fp8="e4m3")`` (Triton driver, interpret
# mode, float32 inputs; bf16 row: the same kernel on bf16 inputs, no fp8) against the dense
# float32 softmax reference: B=1, T=256, N=2, H=64, causal, blocks 64x64, q, k, v standard
# normal ("normal") or with channels 3 and 17 of q and k scaled by 20 ("outlier").
# (case, run) -> (max abs error, mean abs error) of the output.
ERRORS = {
    ("normal", "bf16"): (0.0090, 0.00048),
    ("normal", "fp8"): (0.083, 0.0048),
    ("normal", "fp8+hadamard"): (0.100, 0.0049),
    ("outlier", "bf16"): (0.54, 0.0058),
    ("outlier", "fp8"): (4.37, 0.068),
    ("outlier", "fp8+hadamard"): (1.22, 0.0135),
}
