r"""A08: the Forgetting Transformer's Pro attention block (``FoXProAttention``), a layer.

Forgetting attention (:func:`jaxsoft.attention.forgetting_attention`) with the four parts
of the paper's "Pro" block, each switchable: a data-dependent key/value shift, QK-norm,
a per-head output RMSNorm and an output gate. The q/k/v/output projections, the forget
gate and the output gate's parameters are those of an inner
:class:`jaxsoft.nn.MultiHeadAttention` (``forget_gate=True``, ``gated=True``), and a
decode call uses its key/value cache, so the block reuses that layer's parametrisation
and decoding; the shift gates and the norms' scales are this module's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init
from flax.typing import Dtype, Initializer, PrecisionLike
from jax.typing import ArrayLike

from jaxsoft.attention import dot_product_attention, forget_gate_decay, gated_attention_output
from jaxsoft.nn import _kv_cache
from jaxsoft.nn._linear import rms_norm
from jaxsoft.nn._mha import MultiHeadAttention
from jaxsoft.normalizers import common as c

__all__ = ["FoXProAttention"]

_NAME = "FoXProAttention"


def _token_shift(u: jax.Array, x: jax.Array, kernel: jax.Array,
                 prev: jax.Array | None) -> jax.Array:
  """``u'_t = a_t u_{t-1} + (1 - a_t) u_t`` with ``a_t = sigmoid(x_t W)`` per head.

  ``u [B, T, K, H]`` (a raw projection), ``x [B, T, D]``, ``kernel [D, K]``; ``prev
  [B, K, H]`` is ``u_{-1}`` (the last raw projection before this call; zero when None)."""
  cdt = c.compute_dtype(jnp.result_type(u.dtype, x.dtype, kernel.dtype))
  alpha = jax.nn.sigmoid(jnp.tensordot(x.astype(cdt), kernel.astype(cdt), axes=1))[..., None]
  u32 = u.astype(cdt)
  first = jnp.zeros_like(u32[:, :1]) if prev is None else prev.astype(cdt)[:, None]
  before = jnp.concatenate([first, u32[:, :-1]], axis=1)
  return (alpha * before + (1.0 - alpha) * u32).astype(u.dtype)


class FoXProAttention(nnx.Module):
  r"""The Forgetting Transformer's "Pro" attention block: FoX with its four add-ons (A08).

  With ``x_t`` the (pre-normed) input of token ``t``, per head (``k``/``v`` heads for the
  shift, GQA as in :class:`MultiHeadAttention`):

  .. math::
    \tilde q_t = W_Q x_t,\quad \tilde k_t = W_K x_t,\quad \tilde v_t = W_V x_t

    \text{KV shift:}\quad k_t = \alpha^k_t \tilde k_{t-1} + (1 - \alpha^k_t)\,\tilde k_t,
    \quad v_t = \alpha^v_t \tilde v_{t-1} + (1 - \alpha^v_t)\,\tilde v_t,
    \quad \alpha^{k,v}_t = \sigma(x_t^\top w^{k,v}),\ \tilde k_{-1} = \tilde v_{-1} = 0

    \text{QK-norm:}\quad q_t \leftarrow \mathrm{RMSNorm}_{g_q}(\tilde q_t),\quad
    k_t \leftarrow \mathrm{RMSNorm}_{g_k}(k_t)

    o_i = \sum_{j \le i} \frac{e^{q_i^\top k_j/\sqrt{d} + D_{ij}}}
      {\sum_{l \le i} e^{q_i^\top k_l/\sqrt{d} + D_{il}}}\, v_j,
    \qquad D_{ij} = \sum_{l=j+1}^{i} \log\sigma(w_f^\top x_l + b_f)

    y_t = W_O\Big[\mathrm{RMSNorm}_{g_o}(o_t) \odot \sigma(W_\theta x_t + b_\theta)\Big]

  with :math:`\mathrm{RMSNorm}_g(u) = u / \sqrt{\mathrm{mean}(u^2) + \epsilon} \odot g`
  over each head's ``head_dim`` channels (a learned ``g [heads, head_dim]``, started at 1).
  The shift gate is one scalar per key/value head and token; it is applied to the raw
  projections, before the QK-norm. Every part is a flag: ``k_shift``, ``v_shift``,
  ``qk_norm``, ``output_norm``, ``output_gate``, and ``forget_gate`` itself (off: the
  paper's "Transformer (Pro)", plain causal softmax). With the five add-ons off (the forget
  gate kept) the block is ``MultiHeadAttention(forget_gate=True)`` with the same
  parameters. The block is causal: output ``t`` reads tokens ``<= t`` only.

  The paper names the four parts; their exact form (a sigmoid shift gate without a bias
  on the raw projections, zero before the first token, the norm before the gate, per-head
  norm scales) follows the authors' public implementation (zhixuan-lin/forgetting-
  transformer, ``ShiftLinear`` and ``ForgettingAttentionLayer``); the output gate keeps
  :class:`MultiHeadAttention`'s bias (zero at the start).

  Decoding: after :meth:`init_cache`, ``layer(x, decode=True)`` takes ``L >= 1`` new tokens
  and equals the rows of the full forward (to rounding: the cache keeps the cumulative
  forget gates in float32, as :class:`MultiHeadAttention`'s does); the cache is that layer's
  (the shifted, normed keys and the values, the cumulative forget gates) plus each
  sequence's last raw key and value projections for the shift.

  Args:
    num_heads: query heads N.
    in_features: input size D.
    qkv_features: total q/k/v size (default D), divisible by N.
    out_features: output size (default D).
    num_kv_heads: key/value heads K (default N); N % K == 0.
    forget_gate, k_shift, v_shift, qk_norm, output_norm, output_gate: the parts (all on by
      default).
    forget_bias_init: initial forget-gate bias.
    norm_eps: the RMSNorms' epsilon (> 0).
    implementation: passed to ``dot_product_attention``.
    decode: call in cached decoding mode by default.
    use_bias, kernel_init, bias_init, precision, dtype, param_dtype: of the projections
      (``kernel_init`` also draws the shift gates' ``[D, K]`` kernels).
    rngs: ``nnx.Rngs`` for initialisation.

  Examples:
    >>> layer = js.nn.FoXProAttention(2, 8, rngs=nnx.Rngs(0))
    >>> x = jax.ShapeDtypeStruct((1, 3, 8), jnp.bfloat16)          # [B, T, D]
    >>> jax.eval_shape(layer, x)                    # bf16 inputs compute in float32
    ShapeDtypeStruct(shape=(1, 3, 8), dtype=float32)
    >>> sorted(k for k in vars(layer) if k.endswith(("_kernel", "_scale")))  # its own parts
    ['k_norm_scale', 'k_shift_kernel', 'out_norm_scale', 'q_norm_scale', 'v_shift_kernel']

  References:
    Z. Lin, E. Nikishin, X. O. He & A. Courville, 2025, "Forgetting Transformer: Softmax
    Attention with a Forget Gate" (ICLR 2025, arXiv 2503.02130): the forget gate and the
    "Pro" block.

    Z. Qiu et al., 2025, "Gated Attention for Large Language Models: Non-linearity,
    Sparsity, and Attention-Sink-Free" (the elementwise sigmoid output gate).
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      *,
      num_kv_heads: int | None = None,
      forget_gate: bool = True,
      k_shift: bool = True,
      v_shift: bool = True,
      qk_norm: bool = True,
      output_norm: bool = True,
      output_gate: bool = True,
      forget_bias_init: float = 0.0,
      norm_eps: float = 1e-6,
      implementation: str | Sequence[str] | None = None,
      decode: bool = False,
      use_bias: bool = True,
      kernel_init: Initializer = default_kernel_init,
      bias_init: Initializer = initializers.zeros_init(),
      precision: PrecisionLike = None,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      rngs: nnx.Rngs,
  ) -> None:
    flags = dict(forget_gate=forget_gate, k_shift=k_shift, v_shift=v_shift, qk_norm=qk_norm,
                 output_norm=output_norm, output_gate=output_gate, decode=decode)
    for arg, val in flags.items():
      if not isinstance(val, bool):
        raise ValueError(f"{_NAME}: `{arg}` must be a bool, got {val!r}")
    if not (isinstance(norm_eps, (int, float)) and norm_eps > 0):
      raise ValueError(f"{_NAME}: `norm_eps` must be a float > 0, got {norm_eps!r}")
    self.attn = MultiHeadAttention(
        num_heads, in_features, qkv_features, out_features, num_kv_heads=num_kv_heads,
        gated=output_gate, forget_gate=forget_gate, forget_bias_init=forget_bias_init,
        implementation=implementation, use_bias=use_bias, kernel_init=kernel_init,
        bias_init=bias_init, precision=precision, dtype=dtype, param_dtype=param_dtype,
        rngs=rngs)
    a = self.attn
    self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
    self.in_features, self.out_features = a.in_features, a.out_features
    self.forget_gate, self.k_shift, self.v_shift = forget_gate, k_shift, v_shift
    self.qk_norm, self.output_norm, self.output_gate = qk_norm, output_norm, output_gate
    self.norm_eps, self.decode = float(norm_eps), decode
    n, kv, h = a.num_heads, a.num_kv_heads, a.head_dim
    if k_shift:
      self.k_shift_kernel = nnx.Param(kernel_init(rngs.params(), (in_features, kv), param_dtype))
    if v_shift:
      self.v_shift_kernel = nnx.Param(kernel_init(rngs.params(), (in_features, kv), param_dtype))
    if qk_norm:
      self.q_norm_scale = nnx.Param(jnp.ones((n, h), param_dtype))
      self.k_norm_scale = nnx.Param(jnp.ones((kv, h), param_dtype))
    if output_norm:
      self.out_norm_scale = nnx.Param(jnp.ones((n, h), param_dtype))

  def init_cache(self, batch: int | Sequence[int], max_length: int, *,
                 dtype: Dtype | None = None) -> None:
    """Creates (or resets) the decoding cache: :meth:`MultiHeadAttention.init_cache`'s,
    plus the last raw key/value projections ``[B, K, head_dim]`` (zero) for the shift.

    Args:
      batch: the batch size, or the batch shape of the decode inputs.
      max_length: the most positions to decode (past it: ValueError eagerly, NaN outputs
        under ``jit``).
      dtype: of the stored keys and values (default ``dtype``, else ``param_dtype``).
    """
    self.attn.init_cache(batch, max_length, dtype=dtype)
    cache: Any = self.attn  # the nnx.Cache variables _kv_cache.init_cache set on it
    store = cache.cached_key[...]
    shape = (store.shape[0], self.num_kv_heads, self.head_dim)
    self.shift_key = nnx.Cache(jnp.zeros(shape, store.dtype))
    self.shift_value = nnx.Cache(jnp.zeros(shape, store.dtype))

  def __call__(self, inputs: ArrayLike, *, decode: bool | None = None) -> jax.Array:
    """Causal self-attention of ``inputs [batch..., T, in_features]`` ->
    ``[batch..., T, out_features]``; ``decode`` (or the constructor's): cached decoding of
    ``T >= 1`` new tokens (see :meth:`init_cache`)."""
    decode = self.decode if decode is None else decode
    x = jnp.asarray(inputs)
    if x.ndim < 2 or x.shape[-1] != self.in_features:
      raise ValueError(f"{_NAME}: `inputs` must have shape [batch..., length, "
                       f"{self.in_features}], got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{_NAME}: `inputs` must be floating, got {x.dtype}")
    if decode and not _kv_cache.has_cache(self.attn):
      raise ValueError(f"{_NAME}: `decode=True` needs a cache: call "
                       "`init_cache(batch, max_length)` first")
    batch = tuple(x.shape[:-2])
    a: Any = self.attn  # with a cache: the variables _kv_cache.init_cache set on it
    if decode and batch != a.cache_batch_shape:
      raise ValueError(f"{_NAME}: `inputs` has batch shape {batch} but the cache was made "
                       f"for batch {a.cache_batch_shape}: call init_cache again")
    x = x.reshape((math.prod(batch),) + x.shape[-2:])
    q, k, v = a.query(x), a.key(x), a.value(x)
    raw_k, raw_v = k, v
    prev_k = prev_v = None
    if decode:
      prev_k, prev_v = self.shift_key[...], self.shift_value[...]
    if self.k_shift:
      k = _token_shift(k, x, self.k_shift_kernel[...], prev_k)
    if self.v_shift:
      v = _token_shift(v, x, self.v_shift_kernel[...], prev_v)
    if self.qk_norm:
      q = rms_norm(q, self.q_norm_scale[...], self.norm_eps)
      k = rms_norm(k, self.k_norm_scale[...], self.norm_eps)

    overflow = None
    if decode:
      step = _kv_cache.update_cache(a, batch, x, k, v, a.cache_window)
      self.shift_key[...] = raw_k[:, -1].astype(self.shift_key[...].dtype)
      self.shift_value[...] = raw_v[:, -1].astype(self.shift_value[...].dtype)
      y = dot_product_attention(q, step.key, step.value, mask=step.mask,
                                decay_bias=step.decay_bias, implementation=a.implementation)
      overflow = step.overflow
    else:
      decay = forget_gate_decay(a.log_forget_gates(x)) if self.forget_gate else None
      y = dot_product_attention(q, k, v, is_causal=True, decay_bias=decay,
                                implementation=a.implementation)
    if self.output_norm:
      y = rms_norm(y, self.out_norm_scale[...], self.norm_eps)
    if self.output_gate:
      y = gated_attention_output(y, x, a.gate_kernel[...], a.gate_bias[...])
    out = a.out(y)
    if overflow is not None:
      out = jnp.where(overflow, jnp.nan, out)  # past max_length under jit: no raise
    return out.reshape(batch + out.shape[1:])
