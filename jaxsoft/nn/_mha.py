"""``MultiHeadAttention``: a Flax NNX attention layer with every jaxsoft variant as an option.

The layer is ``flax.nnx.MultiHeadAttention``'s projections around
:func:`jaxsoft.attention.dot_product_attention`, plus the learned parameters of the
variants (features A03, A07-A10; see docs/feature_ids.md), each held as an ``nnx.Param``
in an unconstrained form and mapped into its valid range by construction, never clipped
(so no optimizer step can leave the range):

* ``sink=True``: a per-head sink logit (softmax_sink, A03), free;
* ``learned=("s",)`` with ssmax: SSMax ``s = softplus(z)`` per head (A09);
* ``learned=("alpha",)`` with entmax: ``alpha = 1 + softplus(z)`` (+ 1e-3) per head (A10);
* ``learned=("temperature",)`` with softmax: ``T = softplus(z)`` (+ 1e-3) per head;
* any other name: from the normalizer's declared Param range (softplus above a lower
  bound, sigmoid between two bounds; open bounds kept open by a small margin);
* ``gated=True``: gate ``W_theta [D, N, H]`` and bias, ``Y ⊙ sigmoid(X W + b)`` (A07);
* ``forget_gate=True``: projection ``[D, N]`` and bias, ``log f = log sigmoid(x w + b)`` (A08).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.module import first_from
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init
from flax.typing import Dtype, Initializer, PrecisionLike
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.attention import (
  forget_gate_decay,
  gated_attention_output,
  softplus_from_range,
  softplus_to_range,
)
from jaxsoft.nn import _kv_cache, _learned_normalizers
from jaxsoft.nn._attention_fn import attend, flatten_logit_array
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["MultiHeadAttention", "param_transform"]

_Map = Callable[[ArrayLike], jax.Array]

# Open bounds are kept open in floating point by this margin (softplus and sigmoid
# saturate to exactly their limits for large |z|), relative to the bound's scale.
_OPEN_MARGIN = 1e-3


def param_transform(param: _spec.Param) -> tuple[_Map, _Map]:
  """``(to_range, from_range)`` for a normalizer hyperparameter, from its declared range.

  * no bounds: the identity (e.g. a sink logit);
  * a lower bound ``l`` only: ``l + softplus(z)`` (``1 + softplus(z)`` for entmax alpha,
    ``softplus(z)`` for SSMax s and temperatures), plus a margin of ``1e-3·max(1, |l|)``
    when the bound is open;
  * an upper bound ``u`` only: ``u - softplus(-z)`` (margin likewise);
  * both: ``l + (u - l)·sigmoid(z)``, shrunk by the margins of the open ends.

  ``from_range`` inverts ``to_range`` (for initialising at the spec default).

  Args:
    param: the hyperparameter's declaration (``NormalizerSpec.param(name)``), with its
      bounds and whether they are open.

  Returns:
    ``(to_range, from_range)``: the map from a free value ``z`` (any real) into the valid
    range, and its inverse.

  Examples:
    >>> alpha = js.normalizers.get("entmax").param("alpha")      # alpha > 1 (open)
    >>> to_range, from_range = js.nn.param_transform(alpha)
    >>> to_range(jnp.array([-20.0, 0.0, 20.0]))                  # 1.001 + softplus(z)
    Array([ 1.001 ,  1.6941, 21.001 ], dtype=float32)
    >>> to_range(from_range(1.5))
    Array(1.5, dtype=float32)

  References:
    B. Peters, V. Niculae & A. F. T. Martins, 2019, "Sparse Sequence-to-Sequence Models"
    (alpha-entmax, whose alpha the example keeps above 1).

    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers"
    (a learned per-head alpha through ``1 + softplus``-like maps).
  """
  low, high = param.low, param.high
  lo_m = _OPEN_MARGIN * max(1.0, abs(low)) if (low is not None and param.low_open) else 0.0
  hi_m = _OPEN_MARGIN * max(1.0, abs(high)) if (high is not None and param.high_open) else 0.0
  if low is None:
    if high is None:
      return jnp.asarray, (lambda y: jnp.asarray(y, jnp.float32))
    upper = high
    return (lambda z: -softplus_to_range(-jnp.asarray(z), -upper, hi_m),
            lambda y: -softplus_from_range(-jnp.asarray(y), -upper, hi_m))
  if high is None:
    lower = low
    return (lambda z: softplus_to_range(z, lower, lo_m),
            lambda y: softplus_from_range(y, lower, lo_m))
  a, b = low + lo_m, high - hi_m
  if not a < b:
    raise ValueError(f"parameter `{param.name}`: empty range [{low}, {high}]")

  def to_range(z: ArrayLike) -> jax.Array:
    z = jnp.asarray(z)
    return a + (b - a) * jax.nn.sigmoid(z.astype(jnp.promote_types(z.dtype, jnp.float32)))

  def from_range(y: ArrayLike) -> jax.Array:
    u = (jnp.asarray(y, jnp.float32) - a) / (b - a)
    return jnp.log(u) - jnp.log1p(-u)

  return to_range, from_range


def _init_value(param: _spec.Param, normalizer_name: str):
  if param.default is not None:
    return float(param.default)
  if param.sample is not None:
    return float(param.sample)
  raise ValueError(
      f"MultiHeadAttention: `learned` parameter {param.name!r} of {normalizer_name!r} has no "
      "default to initialise from")


class MultiHeadAttention(nnx.Module):
  r"""Multi-head attention with any jaxsoft normalizer and the variants' learned parameters.

  .. math::
    \mathrm{MHA}(X_q, X_k, X_v) = \big[\, g_n \odot f_n\big(Q_n K_{n'}^\top/\sqrt{d}
      + D\big) V_{n'} \big]_{n=1}^{N} W_O

  with ``Q = X_q W_Q``, ``K = X_k W_K``, ``V = X_v W_V`` (``num_kv_heads`` K/V heads shared
  by groups of query heads: GQA), ``f_n`` the normalizer with head ``n``'s hyperparameters,
  ``D`` the optional FoX forget-gate decay (A08) and ``g_n`` the optional output gate (A07).

  Args:
    num_heads: number of query heads N.
    in_features: input feature size D (of ``inputs_q``; also ``inputs_k``/``inputs_v``).
    qkv_features: total q/k/v size (default ``in_features``), divisible by ``num_heads``.
    out_features: output size (default ``in_features``).
    num_kv_heads: number of key/value heads K (default N); N % K == 0.
    normalizer: a registered name (or NormalizerSpec / callable when nothing is learned).
    normalizer_params: fixed hyperparameters of the normalizer.
    learned: names of normalizer hyperparameters to learn per head (e.g. ``("alpha",)``
      for entmax, ``("s",)`` for ssmax, ``("temperature",)`` for softmax); each starts at
      the normalizer's default and stays in its valid range (see the module docstring);
      and/or learned-normalizer modules (``MultiMax``, ``QASSMax``, ``SSA``, ``ASEntmax``,
      ``PolarSink``, ``TempNet``, ``MoEGate`` of ``jaxsoft.nn``) of the layer's
      normalizer, whose ``attention_hyperparams(q, n_visible)`` (and
      ``attention_queries``) the layer calls with its queries and visible-key counts.
    gated: add the A07 output gate ``Y ⊙ sigmoid(X_q W_theta + b)`` (elementwise per head).
    forget_gate: add the A08 FoX forget gate ``log f_t = log sigmoid(x_t w + b)`` per head
      (self-attention; the call is then causal).
    forget_bias_init: initial forget-gate bias (``f = sigmoid(b)`` at zero input).
    forget_prune_threshold: with ``forget_gate``, a static float ``t < 0`` that turns on
      ACP block pruning in the ``"xla_chunked"`` path: key blocks whose decay is below
      ``t`` for every pair are skipped, and (softmax) each skipped weight is at most
      ``e^{t + 2U}`` for logits bounded by ``|l| <= U``. Choose ``t = log(eps) - 2U``
      (:func:`jaxsoft.attention.acp_prune_threshold` computes it from a batch).
    sink: learn a per-head sink logit (``softmax``/``softmax_1`` become ``softmax_sink``).
    implementation: passed to ``dot_product_attention``. When it is "pallas",
      "pallas_triton", "pallas_mosaic_tpu" (or a sequence whose first entry is one of
      them), a one-token decode step runs the split-K decoding kernel
      ``kernels_pallas.decode_attention`` if it computes the step exactly (softmax,
      softmax_sink or sigmoid, GQA, the cache's window; no dropout, sown weights,
      learned normalizer modules or forget gate): see
      ``jaxsoft.nn._kv_cache.pallas_decode``; gradients through it are the dense path's.
    dropout_rate, broadcast_dropout, deterministic: dropout on the attention weights, as
      in ``flax.nnx.MultiHeadAttention`` (computed through the dense weights).
    decode: call in cached decoding mode by default (see :meth:`init_cache`).
    use_bias, kernel_init, bias_init, precision: of the q/k/v/out projections.
    dtype: computation dtype (default: inferred); param_dtype: parameter dtype.
    rngs: ``nnx.Rngs`` for initialisation (and dropout).

  Examples:
    >>> layer = js.nn.MultiHeadAttention(2, 8, normalizer="entmax", learned=("alpha",),
    ...                                  gated=True, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 3, 8)), is_causal=True).shape           # [B, T, out_features]
    (1, 3, 8)
    >>> layer.normalizer_values()["alpha"]                         # starts at entmax's 1.5
    Array([1.5, 1.5], dtype=float32)

  References:
    A. Vaswani, N. Shazeer, N. Parmar, J. Uszkoreit, L. Jones, A. N. Gomez, Ł. Kaiser &
    I. Polosukhin, 2017, "Attention Is All You Need".

    G. Xiao, Y. Tian, B. Chen, S. Han & M. Lewis, 2024, "Efficient Streaming Language
    Models with Attention Sinks" (``sink``).

    Z. Qiu et al., 2025, "Gated Attention for Large Language Models: Non-linearity,
    Sparsity, and Attention-Sink-Free" (``gated``).

    Z. Lin, E. Nikishin, X. O. He & A. Courville, 2025, "Forgetting Transformer: Softmax
    Attention with a Forget Gate" (``forget_gate``).

    K. M. Nakanishi, 2025, "Scalable-Softmax Is Superior for Attention" (learned SSMax
    ``s``).

    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers"
    (learned entmax ``alpha``).
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      *,
      num_kv_heads: int | None = None,
      normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
      normalizer_params: Mapping[str, Any] | None = None,
      learned: Sequence[str] = (),
      gated: bool = False,
      forget_gate: bool = False,
      forget_bias_init: float = 0.0,
      forget_prune_threshold: float | None = None,
      sink: bool = False,
      implementation: str | Sequence[str] | None = None,
      dropout_rate: float = 0.0,
      broadcast_dropout: bool = True,
      deterministic: bool | None = None,
      decode: bool = False,
      use_bias: bool = True,
      kernel_init: Initializer = default_kernel_init,
      bias_init: Initializer = initializers.zeros_init(),
      precision: PrecisionLike = None,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      rngs: nnx.Rngs,
  ) -> None:
    name = "MultiHeadAttention"
    qkv_features = in_features if qkv_features is None else qkv_features
    out_features = in_features if out_features is None else out_features
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for arg, val in (("num_heads", num_heads), ("in_features", in_features),
                     ("qkv_features", qkv_features), ("out_features", out_features),
                     ("num_kv_heads", num_kv_heads)):
      positive_int(val, arg, name)
    if qkv_features % num_heads:
      raise ValueError(
          f"{name}: `qkv_features` ({qkv_features}) must be divisible by `num_heads` "
          f"({num_heads})")
    if num_heads % num_kv_heads:
      raise ValueError(
          f"{name}: `num_heads` ({num_heads}) must be divisible by `num_kv_heads` "
          f"({num_kv_heads})")
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"{name}: `dropout_rate` must be in [0, 1), got {dropout_rate}")
    if isinstance(learned, str):
      learned = (learned,)
    learned = tuple(learned)
    modules = tuple(m for m in learned if not isinstance(m, str))
    learned = tuple(m for m in learned if isinstance(m, str))
    normalizer_params = dict(normalizer_params or {})

    if sink:
      if normalizer in ("softmax", "softmax_1"):
        normalizer = "softmax_sink"
      spec = _spec.resolve(normalizer)
      if not (isinstance(spec, _spec.NormalizerSpec)
              and any(p.name == "sink_logit" for p in spec.params)):
        raise ValueError(
            f"{name}: `sink` needs normalizer 'softmax', 'softmax_1' or one with a "
            f"`sink_logit` hyperparameter, got {normalizer!r}")
      if "sink_logit" not in learned:
        learned = learned + ("sink_logit",)
    spec = _spec.resolve(normalizer)
    if isinstance(spec, _spec.NormalizerSpec):
      spec.validate(normalizer_params)
    elif learned:
      raise ValueError(
          f"{name}: `learned` needs a registered normalizer (a name or NormalizerSpec) to "
          f"know the parameters' ranges, got {normalizer!r}")
    _learned_normalizers.check_attention_modules(modules, spec, num_heads, name,
                                                 applies_values=True)
    if forget_prune_threshold is not None:
      if not forget_gate:
        raise ValueError(f"{name}: `forget_prune_threshold` needs `forget_gate=True`")
      if not isinstance(forget_prune_threshold, (int, float)) or not forget_prune_threshold < 0:
        raise ValueError(
            f"{name}: `forget_prune_threshold` must be a float < 0, got "
            f"{forget_prune_threshold!r}")

    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.in_features = in_features
    self.qkv_features = qkv_features
    self.out_features = out_features
    self.head_dim = qkv_features // num_heads
    self.normalizer = normalizer
    self.normalizer_params = normalizer_params
    self.learned = learned
    self.gated = gated
    self.forget_gate = forget_gate
    self.forget_prune_threshold = forget_prune_threshold
    self.implementation = implementation
    self.dropout_rate = dropout_rate
    self.broadcast_dropout = broadcast_dropout
    self.deterministic = deterministic
    self.decode = decode
    self.precision = precision
    self.dtype = dtype
    self.param_dtype = param_dtype

    # Learned normalizer hyperparameters, stored free, one per head.
    free = {}
    for pname in learned:
      assert isinstance(spec, _spec.NormalizerSpec)  # `learned` without a spec was refused above
      if pname in normalizer_params:
        raise ValueError(
            f"{name}: `learned` parameter {pname!r} is also fixed in `normalizer_params`")
      try:
        p = spec.param(pname)
      except KeyError:
        raise ValueError(
            f"{name}: `learned` names {pname!r}, which normalizer {spec.name!r} does not take "
            f"(it takes {[q.name for q in spec.params]})") from None
      _, from_range = param_transform(p)
      z0 = from_range(_init_value(p, spec.name))
      free[pname] = nnx.Param(jnp.full((num_heads,), z0, param_dtype))
    self.normalizer_free = nnx.Dict(free)
    self.learned_modules = nnx.List(modules)

    def linear(in_f, out_f, axis=-1):
      return nnx.LinearGeneral(
          in_f, out_f, axis=axis, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
          kernel_init=kernel_init, bias_init=bias_init, precision=precision, rngs=rngs)

    self.query = linear(in_features, (num_heads, self.head_dim))
    self.key = linear(in_features, (num_kv_heads, self.head_dim))
    self.value = linear(in_features, (num_kv_heads, self.head_dim))
    self.out = linear((num_heads, self.head_dim), out_features, axis=(-2, -1))

    if gated:
      self.gate_kernel = nnx.Param(
          kernel_init(rngs.params(), (in_features, num_heads, self.head_dim), param_dtype))
      self.gate_bias = nnx.Param(jnp.zeros((num_heads, self.head_dim), param_dtype))
    if forget_gate:
      self.forget_kernel = nnx.Param(
          kernel_init(rngs.params(), (in_features, num_heads), param_dtype))
      self.forget_bias = nnx.Param(jnp.full((num_heads,), forget_bias_init, param_dtype))
    self.rngs = rngs.dropout.fork() if dropout_rate > 0 else None

  def init_cache(self, batch: int | Sequence[int], max_length: int, *,
                 local_window_size: int | tuple[int, int] | None = None,
                 dtype: Dtype | None = None, quantization: str | None = None) -> None:
    """Creates (or resets) the key/value cache for autoregressive decoding.

    Afterwards ``layer(x, decode=True)`` (or every call, with ``decode=True`` in the
    constructor) takes ``x [batch..., L, in_features]``, ``L >= 1`` new tokens (a prompt
    prefill, then one token per step): they attend causally to the cached tokens and to
    each other, and their keys and values are stored. The outputs equal the rows of the
    full causal forward ``layer(x_all, is_causal=True)`` for every normalizer, with
    length-dependent normalizers given the same n = number of visible keys.

    The cache holds ``num_kv_heads`` (not ``num_heads``) heads, in ``nnx.Cache``
    variables (``cached_key``, ``cached_value`` ``[B, C, num_kv_heads, head_dim]``,
    ``cached_positions [C]``, ``cache_index``; with ``forget_gate`` also the cumulative
    log forget gates), so ``nnx.jit`` carries it.

    Args:
      batch: the batch size, or the batch shape of the decode inputs.
      max_length: the most positions to decode. Going past it raises ValueError when
        the position is concrete (eager calls); under ``jit`` it cannot raise, and the
        output of such a call is NaN.
      local_window_size: int ``w`` or ``(left, right)`` (as ``dot_product_attention``;
        with causal decoding only ``left`` and a negative ``right`` matter): a sliding-
        window cache, a ring buffer of ``max(left, 1)`` slots; every decode call uses
        this window.
      dtype: dtype of the stored keys/values (default ``dtype``, else ``param_dtype``;
        with ``quantization``: of the dequantised keys/values a step attends with).
      quantization: None (float keys and values) or ``"polykv"``: PolyKV's asymmetric
        cache (``cached_key_codes`` int8 q8_0 keys with float16 scales per 32 channels,
        ``cached_value_codes`` Hadamard-rotated 3-bit Lloyd-Max values bit-packed 8 per
        3 bytes, ``cached_value_rho``); a step attends with the dequantised cache, and a
        one-token step with a Pallas ``implementation`` decodes through
        ``kernels_pallas.polykv.polykv_decode_attention`` (see
        ``jaxsoft.nn._quantized_cache``).
    """
    _kv_cache.init_cache(self, batch, max_length, local_window_size=local_window_size,
                         dtype=dtype, quantization=quantization)

  def normalizer_values(self) -> dict[str, jax.Array]:
    """The learned hyperparameters in their valid range, ``{name: [num_heads]}`` (float32)."""
    spec = _spec.resolve(self.normalizer)
    out = {}
    for pname, z in self.normalizer_free.items():
      assert isinstance(spec, _spec.NormalizerSpec)  # learned parameters need a spec
      to_range, _ = param_transform(spec.param(pname))
      out[pname] = to_range(jnp.asarray(z[...], jnp.float32))
    return out

  def log_forget_gates(self, inputs: ArrayLike) -> jax.Array:
    """``log f = log sigmoid(x w + b)``, ``[batch..., T, N]`` in float32 (float64 for
    float64 inputs and parameters; forget_gate only)."""
    if not self.forget_gate:
      raise ValueError("MultiHeadAttention.log_forget_gates: the layer has no `forget_gate`")
    x, w = jnp.asarray(inputs), self.forget_kernel[...]
    cdt = compute_dtype(jnp.result_type(x.dtype, w.dtype))
    logits = x.astype(cdt) @ w.astype(cdt)
    bias = self.forget_bias[...].astype(cdt)
    logits = logits + bias.reshape((1,) * (logits.ndim - 1) + bias.shape)  # [N], explicit
    return jax.nn.log_sigmoid(logits)

  def __call__(self, inputs_q: ArrayLike, inputs_k: ArrayLike | None = None,
               inputs_v: ArrayLike | None = None, *, mask: ArrayLike | None = None,
               is_causal: bool = False,
               segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
               deterministic: bool | None = None, rngs: nnx.Rngs | nnx.RngStream | None = None,
               sow_weights: bool = False, decode: bool | None = None,
               **attention_kwargs: Any) -> jax.Array:
    """Applies attention; inputs ``[batch..., length, in_features]``.

    ``inputs_k`` defaults to ``inputs_q`` and ``inputs_v`` to ``inputs_k``. ``mask`` is
    broadcast to ``[batch..., num_heads, T, S]`` (True = attend); ``is_causal``: query i
    sees keys j <= i; ``segment_ids`` as in ``dot_product_attention`` (``[batch, T]``
    for a packed self-attention batch). ``deterministic`` (or the constructor's) turns
    dropout off; ``rngs`` overrides the dropout stream; ``sow_weights`` sows the weights
    into ``nnx.Intermediate`` under ``'attention_weights'``. Other keywords go to
    ``dot_product_attention`` (``local_window_size``, ``query_seq_lengths``, ...).
    ``decode`` (or the constructor's): cached causal self-attention of new tokens (see
    :meth:`init_cache`); it takes no ``inputs_k``/``inputs_v``, ``mask``,
    ``segment_ids`` or sequence lengths.
    """
    name = "MultiHeadAttention"
    decode = self.decode if decode is None else decode
    window = None
    if decode:
      attention_kwargs, window = _kv_cache.check_decode_call(
          self, inputs_k, inputs_v, mask, segment_ids, attention_kwargs)
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError(f"{name}: `inputs_k` cannot be None when `inputs_v` is given")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    xq, xk, xv = (jnp.asarray(a) for a in (inputs_q, inputs_k, inputs_v))
    for arg, a in (("inputs_q", xq), ("inputs_k", xk), ("inputs_v", xv)):
      if a.ndim < 2 or a.shape[-1] != self.in_features:
        raise ValueError(
            f"{name}: `{arg}` must have shape [batch..., length, {self.in_features}], got "
            f"{a.shape}")
    batch = tuple(xq.shape[:-2])
    if tuple(xk.shape[:-2]) != batch or tuple(xv.shape[:-2]) != batch:
      raise ValueError(f"{name}: `inputs_q`, `inputs_k`, `inputs_v` batch shapes differ: "
                       f"{xq.shape}, {xk.shape}, {xv.shape}")
    if xk.shape[-2] != xv.shape[-2]:
      raise ValueError(f"{name}: `inputs_k` and `inputs_v` lengths differ: {xk.shape[-2]} "
                       f"and {xv.shape[-2]}")
    bsz = math.prod(batch)
    xq = xq.reshape((bsz,) + xq.shape[-2:])
    xk = xk.reshape((bsz,) + xk.shape[-2:])
    xv = xv.reshape((bsz,) + xv.shape[-2:])

    q = self.query(xq)
    k = self.key(xk)
    v = self.value(xv)
    step = _kv_cache.update_cache(self, batch, xq, k, v, window) if decode else None
    if step is not None:
      k, v, is_causal = step.key, step.value, False

    params = dict(self.normalizer_params)
    for pname, val in self.normalizer_values().items():
      params[pname] = val.reshape(self.num_heads, 1, 1)

    kw = dict(attention_kwargs)
    if segment_ids is not None:
      kw["segment_ids"] = segment_ids
    if self.forget_gate and step is not None:
      kw["decay_bias"] = step.decay_bias
    elif self.forget_gate:
      if xk.shape[-2] != xq.shape[-2]:
        raise ValueError(
            f"{name}: `forget_gate` needs self-attention (keys as long as queries), got "
            f"T={xq.shape[-2]}, S={xk.shape[-2]}")
      is_causal = True  # the decay c_i - c_j is a forgetting bias only for j <= i
      kw["decay_bias"] = forget_gate_decay(self.log_forget_gates(xq))
      if self.forget_prune_threshold is not None:
        kw["decay_prune_threshold"] = float(self.forget_prune_threshold)

    if self.dropout_rate > 0.0:
      deterministic = first_from(
          deterministic, self.deterministic,
          error_msg=f"{name}: no `deterministic` given to __call__ or the constructor")
      if not deterministic:
        stream = self.rngs if rngs is None else (
            rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs)
        if stream is None:
          raise ValueError(f"{name}: `rngs` is needed for dropout")
        dropout_rng = stream()
      else:
        dropout_rng = None
    else:
      deterministic, dropout_rng = True, None

    m = flatten_logit_array(mask, batch, "mask", name)
    if m is not None:
      m = m.astype(bool)
    if step is not None:
      m = step.mask
    if len(self.learned_modules):
      n_visible = _learned_normalizers.visible_key_counts(
          q.shape[1], k.shape[1], m, is_causal=is_causal, batch=q.shape[0],
          **{a: kw[a] for a in ("local_window_size", "query_seq_lengths",
                                "key_value_seq_lengths", "segment_ids") if a in kw})
      q, params = _learned_normalizers.apply_attention_modules(self.learned_modules, q, params, n_visible)
      # SSA's value temperature scales each value by its own tau_v(v_j) (the cache holds
      # the raw values)
      v = _learned_normalizers.apply_attention_values(self.learned_modules, v)
    y = None
    if (step is not None and dropout_rng is None and not sow_weights
        and not len(self.learned_modules) and not self.forget_gate):
      # a one-token step with implementation="pallas"...: the split-K decoding kernel
      # when it computes the call exactly (else None and the dense path below)
      y = _kv_cache.pallas_decode(self, step, window, q, params, kw)
    if y is None:
      y = attend(
          q, k, v, None, m, normalizer=self.normalizer, normalizer_params=params or None,
          implementation=self.implementation, dropout_rng=dropout_rng,
          dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout,
          deterministic=deterministic, module=self if sow_weights else None,
          precision=self.precision, batch_shape=batch, is_causal=is_causal, **kw)
    if self.gated:
      y = gated_attention_output(y, xq, self.gate_kernel[...], self.gate_bias[...])
    out = self.out(y)
    if step is not None and step.overflow is not None:
      out = jnp.where(step.overflow, jnp.nan, out)  # past max_length under jit: no raise
    return out.reshape(batch + out.shape[1:])
