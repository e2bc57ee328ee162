r"""The softmax-to-TTT conversion aids of SD3.5-T^5: key instance normalisation and locality.

Feature A39 (LeapLab, Tsinghua, 2025/2026, "Transformer to Test-Time Training": converting
a pretrained softmax-attention model into a TTT layer that inherits its Q/K/V weights).
Softmax attention is invariant to adding one vector ``c`` to every key,
``softmax_j(q·(k_j + c)) = softmax_j(q·k_j)``, and it is local (a query's neighbours weigh
most); a linear / TTT layer is neither. The paper's two aids restore both:

* :func:`key_instance_norm`: each key channel standardised over the tokens of its instance,
  ``k̂_j = (k_j - mean_t k_t) / sqrt(var_t k_t + ε)``: zero mean and (nearly) unit variance
  per instance and channel, and invariant to a shared key shift ``k_j + c`` (and to a
  positive per-channel rescaling, up to ``ε``), so the linear layer downstream is too.
* :func:`locality_enhance`: ``x + DWConv(x)``, a depthwise convolution (3 x 3 over the
  image's token grid in the paper's code) added to the queries and the keys.

Both read the whole sequence (the statistics of every token; neighbours on both sides): they
are for bidirectional (diffusion / vision) layers, not for causal decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.linear import _checks
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["key_instance_norm", "locality_enhance"]


def _runs(segment_ids, mask, shape, fn_name: str) -> tuple[jax.Array | None, jax.Array]:
  """``(same [B, T, T] or None, valid [B, T])``: which tokens share an instance (a run of
  equal ``segment_ids``, among the valid tokens) and which tokens count."""
  seg = _checks.check_segment_ids(segment_ids, shape, fn_name)
  if mask is None:
    valid = jnp.ones(shape, bool)
  else:
    valid = jnp.asarray(mask)
    if valid.dtype != jnp.bool_ or valid.shape != tuple(shape):
      raise ValueError(f"{fn_name}: `mask` must be a boolean array [B, T] = {list(shape)}, got "
                       f"{valid.dtype}{list(valid.shape)}")
  if seg is None:
    return None, valid
  change = jnp.concatenate([jnp.zeros((shape[0], 1), jnp.int32),
                            (seg[:, 1:] != seg[:, :-1]).astype(jnp.int32)], axis=1)
  run = jnp.cumsum(change, axis=1)                         # the run's index, [B, T]
  same = (run[:, :, None] == run[:, None, :]) & valid[:, None, :]
  return same, valid


def key_instance_norm(k: ArrayLike, *, eps: float = 1e-5, mask: ArrayLike | None = None,
                      segment_ids: ArrayLike | None = None) -> jax.Array:
  r"""Key instance normalisation: every key channel standardised over its instance's tokens.

  Feature A39.

  .. math::
    \hat k_{t} = \frac{k_t - μ}{\sqrt{σ^2 + ε}}, \qquad
    μ = \frac1{|I|}\sum_{s \in I} k_s, \quad σ^2 = \frac1{|I|}\sum_{s \in I} (k_s - μ)^2,

  per batch row and channel (``[N, K]``), over the tokens ``I`` of the instance: the valid
  (``mask``) tokens of the row, or of its run of equal ``segment_ids`` (packed sequences).
  Motivation: softmax attention ignores a key shift shared by all tokens,
  ``softmax_j(q·(k_j + c)) = softmax_j(q·k_j)``, linear attention does not; the normalised
  keys are shift-invariant, so any layer on them is. The released code of the paper uses
  ``ε = 1`` (PyTorch's ``instance_norm``); the default here is PyTorch's ``1e-5``.
  Non-causal: every output reads its whole instance.

  Args:
    k: keys ``[B, T, ...]`` (``[B, T, N, K]`` in :mod:`jaxsoft.linear`'s layout); every
      trailing index is a channel of its own.
    eps: ``ε > 0`` added to the variance.
    mask: ``[B, T]`` bool, the tokens that count (padding False: excluded from the
      statistics, output 0 there); None: all.
    segment_ids: ``[B, T]`` integers; a change between neighbours starts a new instance.

  Returns:
    ``k̂`` in ``k``'s shape and dtype (computed in float32 for bf16 / fp16).

  Examples:
    >>> k = jnp.array([1.0, 2.0, 3.0]).reshape(1, 3, 1, 1)
    >>> key_instance_norm(k, eps=1e-12)[0, :, 0, 0]  # mean 2, variance 2/3
    Array([-1.2247,  0.    ,  1.2247], dtype=float32)

    Shifting every key by the same vector changes nothing:

    >>> k = jax.random.normal(jax.random.key(0), (1, 5, 2, 4))
    >>> c = jnp.arange(8.0).reshape(1, 1, 2, 4)
    >>> bool(jnp.allclose(key_instance_norm(k + c), key_instance_norm(k), atol=1e-5))
    True

  References:
    LeapLab (Tsinghua University), 2025, "SD3.5-T^5: Transformer to Test-Time Training"
    (key instance normalization; github.com/LeapLabTHU/Transformer-to-TTT).
  """
  fn_name = "key_instance_norm"
  k = _checks.check_floating(k, "k", fn_name)
  eps = _checks.check_eps(eps, fn_name)
  if k.ndim < 2:
    raise ValueError(f"{fn_name}: `k` must have shape [B, T, ...], got {k.shape}")
  same, valid = _runs(segment_ids, mask, k.shape[:2], fn_name)
  x = k.astype(compute_dtype(k.dtype)).reshape(*k.shape[:2], -1)        # [B, T, C]
  w = valid.astype(x.dtype)[:, :, None]                                  # [B, T, 1]
  if same is None:
    count = jnp.maximum(jnp.sum(w, axis=1, keepdims=True), 1.0)          # [B, 1, 1]
    mean = jnp.sum(w * x, axis=1, keepdims=True) / count
    var = jnp.sum(w * jnp.square(x - mean), axis=1, keepdims=True) / count
  else:
    m = same.astype(x.dtype)                                             # [B, T, T]
    count = jnp.maximum(jnp.sum(m, axis=2, keepdims=True), 1.0)          # [B, T, 1]
    mean = jnp.einsum("bts,bsc->btc", m, x) / count
    # each token's own instance variance: Σ_s m_ts (x_s - μ_t)², μ_t shared by the run
    var = (jnp.einsum("bts,bsc->btc", m, jnp.square(x)) / count - jnp.square(mean))
    var = jnp.maximum(var, 0.0)
  out = jnp.where(valid[:, :, None], (x - mean) * jax.lax.rsqrt(var + eps), 0.0)
  return out.reshape(k.shape).astype(k.dtype)


def locality_enhance(x: ArrayLike, kernel: ArrayLike, bias: ArrayLike | None = None, *,
                     grid: tuple[int, int] | None = None) -> jax.Array:
  r"""The locality module of SD3.5-T^5: ``x + DWConv(x)``, a depthwise "same" convolution.

  Feature A39 [R]: the paper names "a lightweight locality enhancement module"; its released
  code adds a 3 x 3 depthwise convolution over the image's token grid (zero padding, with a
  bias) to the queries and to the keys (after key instance normalisation) of the TTT
  layer. Here, for ``x [B, T, *C]``:

  .. math::
    y_t = x_t + b + \sum_{δ} w_{δ} \odot x_{t + δ}

  with ``δ`` over the kernel's window centred on ``t``: ``t ± r`` along the sequence
  (``grid=None``, kernel ``[k, *C]``), or ``(i ± r_h, j ± r_w)`` on the row-major
  ``H x W`` grid of the tokens (``grid=(H, W)``, ``T = H W``, kernel ``[k_h, k_w, *C]``);
  tokens outside the sequence or the grid are zero. Each channel has its own filter.
  Non-causal (it reads neighbours on both sides).

  Args:
    x: ``[B, T, *C]`` (e.g. queries or keys ``[B, T, N, K]``).
    kernel: the depthwise filters, ``[k, *C]`` or ``[k_h, k_w, *C]`` with ``grid``; odd sizes.
    bias: ``[*C]`` or None.
    grid: ``(H, W)`` with ``H W = T``, or None (a 1-D sequence).

  Returns:
    ``y`` in ``x``'s shape and dtype (computed in float32 for bf16 / fp16).

  Examples:
    >>> x = jnp.arange(1.0, 5.0).reshape(1, 4, 1)
    >>> locality_enhance(x, jnp.array([[1.0], [0.0], [10.0]]))[0, :, 0]  # x_t + x_{t-1} + 10 x_{t+1}
    Array([21., 33., 45.,  7.], dtype=float32)

    On a 2 x 2 grid, a 3 x 3 box filter adds the sum of all four tokens:

    >>> x = jnp.arange(1.0, 5.0).reshape(1, 4, 1)
    >>> locality_enhance(x, jnp.ones((3, 3, 1)), grid=(2, 2))[0, :, 0]
    Array([11., 12., 13., 14.], dtype=float32)

  References:
    LeapLab (Tsinghua University), 2025, "SD3.5-T^5: Transformer to Test-Time Training"
    (the locality enhancement module; github.com/LeapLabTHU/Transformer-to-TTT).
  """
  fn_name = "locality_enhance"
  x = _checks.check_floating(x, "x", fn_name)
  kernel = _checks.check_floating(kernel, "kernel", fn_name)
  if x.ndim < 2:
    raise ValueError(f"{fn_name}: `x` must have shape [B, T, *C], got {x.shape}")
  B, T, channels = x.shape[0], x.shape[1], x.shape[2:]
  spatial = 1 if grid is None else 2
  if grid is None:
    dims: tuple[int, ...] = (T,)
  else:
    if (not isinstance(grid, (tuple, list)) or len(grid) != 2 or not all(
        isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in grid)):
      raise ValueError(f"{fn_name}: `grid` must be None or a pair of positive ints (H, W), "
                       f"got {grid!r}")
    dims = (int(grid[0]), int(grid[1]))
    if dims[0] * dims[1] != T:
      raise ValueError(f"{fn_name}: `grid` = {dims} must have H * W = T = {T} tokens")
  layout = "[k, *C]" if grid is None else "[k_h, k_w, *C]"
  if kernel.shape[spatial:] != channels or kernel.ndim != spatial + len(channels):
    raise ValueError(f"{fn_name}: `kernel` must have shape {layout} with C = {list(channels)}, "
                     f"got {kernel.shape}")
  if any(n % 2 == 0 for n in kernel.shape[:spatial]):
    raise ValueError(f"{fn_name}: the kernel's window {kernel.shape[:spatial]} must have odd "
                     "sizes (centred on the token)")
  dtype = compute_dtype(jnp.result_type(x.dtype, kernel.dtype))
  c = int(np.prod(channels, dtype=np.int64))
  lhs = x.astype(dtype).reshape(B, *dims, c)
  rhs = kernel.astype(dtype).reshape(*kernel.shape[:spatial], 1, c)
  spec = ("NHC", "HIO", "NHC") if grid is None else ("NHWC", "HWIO", "NHWC")
  y = jax.lax.conv_general_dilated(
      lhs, rhs, window_strides=(1,) * spatial,
      padding=[(n // 2, n // 2) for n in kernel.shape[:spatial]],
      dimension_numbers=spec, feature_group_count=c,
      precision=jax.lax.Precision.HIGHEST)
  y = lhs + y
  if bias is not None:
    bias = _checks.check_floating(bias, "bias", fn_name)
    if bias.shape != channels:
      raise ValueError(f"{fn_name}: `bias` must have shape [*C] = {list(channels)}, got "
                       f"{bias.shape}")
    y = y + bias.astype(dtype).reshape((1,) * (spatial + 1) + (c,))
  return y.reshape(x.shape).astype(x.dtype)
