r"""ATMA's Polar attention with its gated-delta memory (feature A20) as a Flax NNX layer.

The channels are ``jaxsoft.attention``'s :func:`~jaxsoft.attention.polar_sink_attention`
(direction and magnitude over the extreme-value null sink) and
:func:`~jaxsoft.attention.polar_memory` (the gated-delta memory); this module holds their
projections and combines them as ATMA's reference code does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.attention import polar_memory, polar_sink_attention

__all__ = ["PolarMemoryAttention"]


class PolarMemoryAttention(nnx.Module):
  r"""ATMA's Polar attention layer: direction, bounded magnitude and gated-delta memory (feature A20).

  For inputs ``x [B, T, D]`` with N heads of size H (kreasof-ai/atma's combination):

  .. math::
    (c_t, \mu_t) = \mathrm{polar\_sink\_attention}(W_q x, W_k x, W_v x), \qquad
    m_t = \mathrm{polar\_memory}(W_{mq} x, W_{mk} x, W_{mv} x,\;
      W_\gamma x_t + b_\gamma,\; \mathrm{sigmoid}(W_\beta x_t + b_\beta),\; W_g x_t + b_g)

  .. math::
    y_t = W_o\big(c_t \odot \mathrm{sigmoid}(W_{\mathrm{gate}} c_t + b_{\mathrm{gate}})\big)
      + W_\mu \mu_t + W_{\mathrm{mem}} m_t

  with ``c`` and ``m`` the heads' vectors concatenated ``[N H]``, ``mu`` the heads'
  magnitudes ``[N]``, per-head learned ``alpha``, ``null_bias``, ``gamma``,
  ``magnitude_gain`` and ``null_value`` (the null sink) and a zero-initialised
  ``W_mem``, so that at initialisation the layer is the attention channels alone. The
  memory's retention is ``sigmoid(W_gamma x + b_gamma + 3.9)`` (about 0.98 at init).
  Reconstructed [R]: the memory's own query/key/value projections, the write strength
  ``beta`` as a sigmoid of a projection, ``W_gate`` acting on all heads' directions
  together, and the initial values of the per-head parameters (0, this library's
  choice; ATMA learns them). Causal by default (``is_causal=True``); the memory is
  causal in any case.

  Args:
    d_model: D, the width of ``x`` and of the output.
    num_heads: N.
    head_dim: H (queries, keys and values).
    rngs: the ``nnx.Rngs`` of the projections.
    use_memory: include the memory channel (ATMA's full model; False gives Polar
      attention alone).
    retention_bias: the memory's retention bias (default 3.9).
    param_dtype: the parameters' dtype.
    **attention_kwargs: further fixed arguments of ``polar_sink_attention`` (``scale``,
      ``local_window_size``, ``eps``, ...); ``is_causal`` defaults to True.

  Examples:
    >>> layer = js.nn.PolarMemoryAttention(8, 2, 4, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(1), (1, 5, 8))
    >>> y = layer(x)
    >>> y.shape
    (1, 5, 8)
    >>> bool(jnp.all(layer.w_mem.kernel[...] == 0))   # the memory starts switched off
    True

  References:
    ATMA / Polar attention (reference code kreasof-ai/atma; authors and year not
    established in this project's sources).

    S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving Mamba2 with
    Delta Rule".
  """

  def __init__(self, d_model: int, num_heads: int, head_dim: int, *, rngs: nnx.Rngs,
               use_memory: bool = True, retention_bias: float = 3.9,
               param_dtype: Any = jnp.float32, **attention_kwargs: Any) -> None:
    owner = "PolarMemoryAttention"
    d = positive_int(d_model, "d_model", owner)
    n = positive_int(num_heads, "num_heads", owner)
    h = positive_int(head_dim, "head_dim", owner)
    if not isinstance(use_memory, bool):
      raise ValueError(f"{owner}: `use_memory` must be a bool, got {use_memory!r}")
    for name in ("alpha", "null_bias", "gamma", "magnitude_gain", "null_value",
                 "normalizer", "normalizer_params", "return_parts"):
      if name in attention_kwargs:
        raise ValueError(f"{owner}: `{name}` is set by the layer (a learned parameter or "
                         "fixed), not an attention argument")
    self.num_heads, self.head_dim = n, h
    self.use_memory = use_memory
    self.retention_bias = float(retention_bias)
    self.attention_kwargs = {"is_causal": True, **attention_kwargs}

    def linear(i, o, *, bias=False, zero=False):
      if zero:
        return nnx.Linear(i, o, use_bias=bias, param_dtype=param_dtype, rngs=rngs,
                          kernel_init=nnx.initializers.zeros_init())
      return nnx.Linear(i, o, use_bias=bias, param_dtype=param_dtype, rngs=rngs)

    self.wq, self.wk, self.wv = linear(d, n * h), linear(d, n * h), linear(d, n * h)
    self.alpha = nnx.Param(jnp.zeros((n,), param_dtype))
    self.null_bias = nnx.Param(jnp.zeros((n,), param_dtype))
    self.gamma = nnx.Param(jnp.zeros((n,), param_dtype))
    self.magnitude_gain = nnx.Param(jnp.zeros((n,), param_dtype))
    self.null_value = nnx.Param(jnp.zeros((n, h), param_dtype))
    self.w_gate = linear(n * h, n * h, bias=True)
    self.w_o = linear(n * h, d)
    self.w_mu = linear(n, d)
    if use_memory:
      self.w_mq, self.w_mk, self.w_mv = linear(d, n * h), linear(d, n * h), linear(d, n * h)
      self.w_retention = linear(d, n, bias=True)
      self.w_write = linear(d, n, bias=True)
      self.w_mem_gate = linear(d, n * h, bias=True)
      self.w_mem = linear(n * h, d, zero=True)

  def channels(self, x: ArrayLike, **kwargs: Any) -> tuple[jax.Array, jax.Array,
                                                             jax.Array | None]:
    """``(c [B, T, N, H], mu [B, T, N], memory [B, T, N, H] or None)`` of ``x [B, T, D]``."""
    x = jnp.asarray(x)
    if x.ndim != 3:
      raise ValueError(f"PolarMemoryAttention: `x` must be [B, T, D], got shape {x.shape}")
    B, T, _ = x.shape
    n, h = self.num_heads, self.head_dim

    def heads(layer):
      return layer(x).reshape(B, T, n, h)

    c, mu = polar_sink_attention(
        heads(self.wq), heads(self.wk), heads(self.wv), alpha=self.alpha[...],
        null_bias=self.null_bias[...], gamma=self.gamma[...],
        magnitude_gain=self.magnitude_gain[...], null_value=self.null_value[...],
        **{**self.attention_kwargs, **kwargs})
    mem = None
    if self.use_memory:
      mem = polar_memory(heads(self.w_mq), heads(self.w_mk), heads(self.w_mv),
                         self.w_retention(x), jax.nn.sigmoid(self.w_write(x)),
                         heads(self.w_mem_gate), retention_bias=self.retention_bias)
    return c, mu, mem

  def __call__(self, x: ArrayLike, **kwargs: Any) -> jax.Array:
    """``x [B, T, D] -> y [B, T, D]``; ``kwargs`` go to ``polar_sink_attention``."""
    c, mu, mem = self.channels(x, **kwargs)
    B, T = c.shape[:2]
    cf = c.reshape(B, T, -1)
    y = self.w_o(cf * jax.nn.sigmoid(self.w_gate(cf))) + self.w_mu(mu.astype(cf.dtype))
    if mem is not None:
      y = y + self.w_mem(mem.reshape(B, T, -1))
    return y
