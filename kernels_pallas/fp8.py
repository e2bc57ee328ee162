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
  r"""The orthogonal ``m x m`` randomized Hadamard matrix of fp8 attention's rotation.

  .. math::
    R = \operatorname{diag}(\sigma)\, H_m / \sqrt{m}, \qquad
    H_1 = [1], \quad H_{2n} = \begin{bmatrix} H_n & H_n \\ H_n & -H_n \end{bmatrix}

  with ``sigma`` a fixed random +-1 vector drawn from ``seed``; ``R R^T = I``.

  Args:
    m: the size, a power of two.
    seed: the seed of the signs (the default is the kernels').
    dtype: the result's dtype.

  Returns:
    ``[m, m]`` in ``dtype``.

  Examples:
    >>> from kernels_pallas import fp8
    >>> r = fp8.hadamard_matrix(4)
    >>> r
    Array([[-0.5, -0.5, -0.5, -0.5],
           [-0.5,  0.5, -0.5,  0.5],
           [ 0.5,  0.5, -0.5, -0.5],
           [ 0.5, -0.5, -0.5,  0.5]], dtype=float32)
    >>> bool(jnp.allclose(r @ r.T, jnp.eye(4)))
    True

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision" (the
    randomized Hadamard transform, "incoherent processing").
  """
  return jnp.asarray(_hadamard_np(m, seed), dtype)


def hadamard_rotation(x, seed: int = SEED):
  """The last axis of ``x`` rotated by :func:`hadamard_matrix`: outliers spread, dots kept.

  ``x [..., h]`` is zero-padded to ``m = next_pow2(h)`` and multiplied by R in float32:
  ``x @ R``. R is orthogonal, so the same rotation of q and k keeps every ``q . k``, while
  a channel with large entries is spread over all ``m`` (what block quantisation wants).

  Args:
    x: ``[..., h]``, any float dtype.
    seed: the seed of R's signs.

  Returns:
    ``[..., m]`` float32.

  Examples:
    >>> from kernels_pallas import fp8
    >>> q = jax.random.normal(jax.random.key(0), (2, 3))
    >>> k = jax.random.normal(jax.random.key(1), (2, 3))
    >>> qr, kr = fp8.hadamard_rotation(q), fp8.hadamard_rotation(k)
    >>> qr.shape, bool(jnp.allclose(qr @ kr.T, q @ k.T, atol=1e-5))
    ((2, 4), True)

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision".
  """
  h = x.shape[-1]
  m = 1 << max(0, (h - 1).bit_length())
  x = x.astype(jnp.float32)
  if m != h:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, m - h)])
  return jnp.matmul(x, hadamard_matrix(m, seed), precision=jax.lax.Precision.HIGHEST)


def quantize_blocks(x, block: int) -> tuple[jax.Array, jax.Array, int]:
  r"""Block quantisation to float8_e4m3fn with one float32 scale per (batch, head, block).

  .. math::
    s = \max_{i \in \text{block}, h} |x_{ih}| / 448, \qquad
    x_8 = \operatorname{e4m3}(\operatorname{clip}(x / s, -448, 448)), \qquad x \approx x_8 s

  (an all-zero block gets s = 1).

  Args:
    x: ``[B, T, N, H]``.
    block: rows per block (a positive int); T is zero-padded to ``nb = ceil(T / block)``
      blocks.

  Returns:
    ``(x8, scale, T)``: ``x8`` float8_e4m3fn ``[B, nb, block, N, H]``, ``scale`` float32
    ``[B, nb, 1, N, 1]`` and the unpadded length T.

  Examples:
    >>> from kernels_pallas import fp8
    >>> x = jnp.array([0.3, 1.0, -2.7, 0.01]).reshape(1, 4, 1, 1)   # two blocks of 2
    >>> x8, scale, t = fp8.quantize_blocks(x, 2)
    >>> x8.dtype, x8.astype(jnp.float32).ravel(), scale.ravel()
    (dtype(float8_e4m3fn), Array([ 128.   ,  448.   , -448.   ,    1.625], dtype=float32),
     Array([0.0022, 0.006 ], dtype=float32))

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision" (its
    block quantisation).

    P. Micikevicius, D. Stosic, N. Burgess et al., 2022, "FP8 Formats for Deep Learning"
    (the e4m3 format, largest finite value 448).
  """
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
  """The values :func:`quantize_blocks` stands for: ``x8 * scale``, unblocked and unpadded.

  Args:
    x8: ``[B, nb, block, N, H]`` float8_e4m3fn.
    scale: ``[B, nb, 1, N, 1]`` float32.
    t: the unpadded length T.

  Returns:
    ``[B, T, N, H]`` float32: x up to the e4m3 rounding (3 mantissa bits, a relative
    error of at most 2^-4; values below 2^-6 times the block's scale are subnormal in
    e4m3 and keep fewer bits).

  Examples:
    >>> from kernels_pallas import fp8
    >>> x = jnp.array([0.3, 1.0, -2.7, 0.01]).reshape(1, 4, 1, 1)
    >>> fp8.dequantize_blocks(*fp8.quantize_blocks(x, 2)).ravel()
    Array([ 0.2857,  1.    , -2.7   ,  0.0098], dtype=float32)

  References:
    P. Micikevicius, D. Stosic, N. Burgess et al., 2022, "FP8 Formats for Deep Learning"
    (the e4m3 format, largest finite value 448).
  """
  b, nb, block, n, h = x8.shape
  return (x8.astype(jnp.float32) * scale).reshape(b, nb * block, n, h)[:, :t]


def straight_through(x, x8, scale):
  """The dequantised ``x8 * scale`` in the forward pass, the identity's gradient in ``x``.

  ``x + stop_gradient(dequantize_blocks(x8, scale) - x)``: the forward sees the fp8
  values, ``jax.grad`` passes through the quantiser unchanged.

  Args:
    x: ``[B, T, N, H]``, the values ``x8, scale`` quantise.
    x8, scale: :func:`quantize_blocks`'s output for ``x``.

  Returns:
    float32 ``x.shape``.

  Examples:
    >>> from kernels_pallas import fp8
    >>> x = jnp.array([0.3, 1.0, -2.7, 0.01]).reshape(1, 4, 1, 1)
    >>> x8, scale, _ = fp8.quantize_blocks(x, 2)
    >>> jax.grad(lambda x: jnp.sum(fp8.straight_through(x, x8, scale)))(x).ravel()
    Array([1., 1., 1., 1.], dtype=float32)

  References:
    Y. Bengio, N. Léonard & A. Courville, 2013, "Estimating or Propagating Gradients
    Through Stochastic Neurons for Conditional Computation" (the straight-through
    estimator).
  """
  xf = x.astype(jnp.float32)
  y = dequantize_blocks(x8, scale, x.shape[1])
  return xf + jax.lax.stop_gradient(y - xf)


def fake_quant_blocks(x, block: int):
  """x rounded through e4m3 block quantisation, with a straight-through gradient.

  ``dequantize_blocks(*quantize_blocks(x, block))`` in the forward pass (the fp8 values
  the kernels multiply), the identity's gradient in the backward pass
  (:func:`straight_through`).

  Args:
    x: ``[B, T, N, H]``.
    block: rows per block (:func:`quantize_blocks`).

  Returns:
    float32 ``x.shape``.

  Examples:
    >>> from kernels_pallas import fp8
    >>> x = jnp.array([0.3, 1.0, -2.7, 0.01]).reshape(1, 4, 1, 1)
    >>> fp8.fake_quant_blocks(x, 2).ravel()
    Array([ 0.2857,  1.    , -2.7   ,  0.0098], dtype=float32)
    >>> jax.grad(lambda x: jnp.sum(fp8.fake_quant_blocks(x, 2)))(x).ravel()
    Array([1., 1., 1., 1.], dtype=float32)

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision".

    Y. Bengio, N. Léonard & A. Courville, 2013, "Estimating or Propagating Gradients
    Through Stochastic Neurons for Conditional Computation".
  """
  x8, scale, _ = quantize_blocks(jax.lax.stop_gradient(x), block)
  return straight_through(x, x8, scale)


def kernel_operands(x8, scale, rows: int):
  """The native fp8 kernel's operands: float8 rows and one scale per row.

  From :func:`quantize_blocks`'s output: ``x8`` unblocked to ``[B, rows, N, H]`` float8
  (zero rows appended) and each row's block scale ``[B, N, rows]`` float32 (1 on the
  appended rows), so that a score tile is ``dot(q8, k8) * sq_i * sk_j``.

  Args:
    x8, scale: :func:`quantize_blocks`'s output.
    rows: the kernel's padded length, at least the quantised ``nb * block``.

  Returns:
    ``(x8 [B, rows, N, H] float8_e4m3fn, scale [B, N, rows] float32)``.

  Examples:
    >>> from kernels_pallas import fp8
    >>> x = jnp.array([0.3, 1.0, -2.7, 0.01]).reshape(1, 4, 1, 1)
    >>> x8, scale, _ = fp8.quantize_blocks(x, 2)
    >>> x8k, sk = fp8.kernel_operands(x8, scale, 8)
    >>> x8k.shape, sk
    ((1, 8, 1, 1), Array([[[0.0022, 0.0022, 0.006 , 0.006 , 1.    , 1.    , 1.    ,
                             1.    ]]], dtype=float32))

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision" (fp8
    operands with per-block scales applied to the float32 scores).
  """
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
