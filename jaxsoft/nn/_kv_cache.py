r"""The key/value cache of :class:`jaxsoft.nn.MultiHeadAttention` for autoregressive decoding.

A cache holds, per batch row, the projected keys and values of the tokens seen so far
(``num_kv_heads`` heads: a GQA layer stores K, not N, heads), the absolute position of
each slot and the next position. A decode call with ``L >= 1`` tokens (a prefill of a
prompt, or one token per step) attends from the new tokens at positions
``p .. p + L - 1`` to the cached keys and the new ones at once, with

.. math::
  V_i = \{\, j : j \le i,\ i - \text{left} \le j \le i + \min(\text{right}, 0),\
    j \text{ cached or new} \,\}

(the window only with ``local_window_size``), and then stores the new keys. Each query
row sees exactly the keys the full causal forward gives it, so every normalizer, with its
length-dependent terms (SSMax ``s log n``, sigmoid's ``-log n`` bias, ...), receives the
same ``n = |V_i|`` as in the full forward, and the decoded outputs equal the forward's
rows. Keys are passed in slot order (cached slots, then new tokens): normalizers are
permutation equivariant over the visible keys, so only the float rounding of the sums
can differ.

A sliding-window cache (``local_window_size`` at :func:`init_cache`) is a ring buffer of
``max(left, 1)`` slots: slot ``pos mod C`` holds position ``pos``, the memory is O(left)
whatever the sequence length. With the FoX forget gate (Lin et al., 2025, "Forgetting
Transformer: Softmax Attention with a Forget Gate") the cache also keeps each slot's
cumulative log forget gate ``c_j`` and the running total, so the decay ``c_i - c_j``
equals the forward's.

A one-token step of a layer whose ``implementation`` asks for Pallas runs the split-K
decoding kernel :func:`kernels_pallas.decode.decode_attention` (T. Dao et al. 2023,
"Flash-Decoding for long-context inference") when it computes the call exactly (see
:func:`pallas_decode`): the kernel takes a valid length per row, and the keys such a step
sees are a prefix of the cache written with the new token (``min(p, C) + 1`` slots at
position ``p``; a ring buffer appends the slot the new token evicted, position
``p - C``, which a window of ``left >= C`` still sees).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_pallas
from jaxsoft._validation import positive_int
from jaxsoft.attention import dot_product_attention
from jaxsoft.attention.call import implementation_order
from jaxsoft.attention.masks import normalize_window
from jaxsoft.nn import _quantized_cache
from jaxsoft.normalizers import spec as _spec
from kernels_pallas import decode as decode_kernel
from kernels_pallas import polykv as _polykv

__all__ = ["DecodeStep", "init_cache", "check_decode_call", "update_cache", "has_cache",
           "pallas_decode", "KERNEL_NORMALIZERS"]

_NAME = "MultiHeadAttention"
# Keywords of dot_product_attention a decode call cannot take: the cache defines the keys'
# visibility (and its lengths), so a per-call mask or length over [T, S] has no meaning.
_REFUSED = ("query_seq_lengths", "key_value_seq_lengths", "bias", "decay_bias",
            "decay_prune_threshold", "return_residual")


@dataclasses.dataclass(frozen=True)
class DecodeStep:
  """What a decode call attends with: keys/values ``[B, C + L, K, H]`` (cached slots then
  the new tokens), the visibility ``mask [1, 1, L, C + L]``, the FoX ``decay_bias`` (or
  None), ``overflow``: None when the position was checked eagerly, else a traced bool
  that is True when the call wrote past ``max_length`` (the output is then NaN), and the
  new tokens' ``positions [L]``."""

  key: jax.Array
  value: jax.Array
  mask: jax.Array
  decay_bias: tuple[jax.Array, jax.Array] | None
  overflow: jax.Array | None
  positions: jax.Array | None = None


def has_cache(module: Any) -> bool:
  return getattr(module, "cache_index", None) is not None


def init_cache(module: Any, batch: int | Sequence[int], max_length: int, *,
               local_window_size: int | tuple[int, int] | None = None,
               dtype: Any = None, quantization: str | None = None) -> None:
  """Creates (or resets) ``module``'s cache as ``nnx.Cache`` variables; see the module doc.

  ``batch``: the batch size or the batch shape of the inputs ``[batch..., L, D]``;
  ``max_length``: the most positions the cache will hold; ``local_window_size``: int
  ``w`` (= ``(w, w)``) or ``(left, right)``: a ring buffer of ``max(left, 1)`` slots for
  a sliding window; ``dtype``: of the stored keys and values (default the module's
  ``dtype``, else its ``param_dtype``; with ``quantization``, of the dequantised keys and
  values a step attends with); ``quantization``: None (float keys and values) or
  ``"polykv"`` (:mod:`jaxsoft.nn._quantized_cache`: int8 q8_0 keys, bit-packed 3-bit
  Hadamard-rotated values).
  """
  owner = f"{_NAME}.init_cache"
  batch_shape = (batch,) if isinstance(batch, (int, np.integer)) else batch
  try:
    batch_shape = tuple(batch_shape)
  except TypeError:
    raise ValueError(
        f"{owner}: `batch` must be an int or a tuple of ints, got {batch!r}") from None
  batch_shape = tuple(positive_int(d, "batch", owner) for d in batch_shape)
  max_length = positive_int(max_length, "max_length", owner)
  try:
    window = normalize_window(local_window_size)
  except ValueError as e:
    raise ValueError(f"{owner}: {e}") from None
  if window is not None and window[0] < 0:
    raise ValueError(
        f"{owner}: `local_window_size` left side must be >= 0 for causal "
        f"decoding, got {local_window_size!r}")
  capacity = max_length if window is None else min(max_length, max(window[0], 1))
  if dtype is None:
    dtype = module.dtype if module.dtype is not None else module.param_dtype
  dtype = jnp.dtype(dtype)
  bsz = math.prod(batch_shape)
  shape = (bsz, capacity, module.num_kv_heads, module.head_dim)
  if quantization is not None and quantization not in _quantized_cache.QUANTIZATIONS:
    raise ValueError(f"{owner}: `quantization` must be None or one of "
                     f"{_quantized_cache.QUANTIZATIONS}, got {quantization!r}")
  module.cache_quantization = quantization
  module.cache_dtype = dtype
  for name in ("cached_key", "cached_value", "cached_key_codes", "cached_key_scales",
               "cached_value_codes", "cached_value_rho"):
    if hasattr(module, name):  # a reset may switch between float and quantised caches
      delattr(module, name)
  if quantization is None:
    module.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    module.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
  else:
    _quantized_cache.init(module, shape)
  module.cached_positions = nnx.Cache(jnp.full((capacity,), -1, jnp.int32))
  module.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))
  if module.forget_gate:
    module.cached_decay = nnx.Cache(jnp.zeros((bsz, capacity, module.num_heads), jnp.float32))
    module.decay_total = nnx.Cache(jnp.zeros((bsz, module.num_heads), jnp.float32))
  module.cache_batch_shape = batch_shape
  module.cache_max_length = max_length
  module.cache_window = window


def check_decode_call(module: Any, inputs_k: Any, inputs_v: Any, mask: Any, segment_ids: Any,
                      attention_kwargs: Mapping[str, Any]
                      ) -> tuple[dict[str, Any], tuple[int, int] | None]:
  """Refuses what a decode call cannot take (ValueError naming it); returns the keywords
  to pass on and the window (``local_window_size``, taken over by the cache's visibility
  mask; the cache's own window when the call gives none)."""
  if not has_cache(module):
    raise ValueError(
        f"{_NAME}: `decode=True` needs a cache: call `init_cache(batch, max_length)` first")
  for arg, val in (("inputs_k", inputs_k), ("inputs_v", inputs_v), ("mask", mask),
                   ("segment_ids", segment_ids)):
    if val is not None:
      raise ValueError(
          f"{_NAME}: `{arg}` cannot be given with `decode=True` (cached self-attention; the "
          "cache sets which keys each token sees)")
  kw = dict(attention_kwargs)
  for arg in _REFUSED:
    if kw.get(arg) is not None:
      raise ValueError(f"{_NAME}: `{arg}` cannot be given with `decode=True`")
    kw.pop(arg, None)
  if "local_window_size" in kw:
    window = normalize_window(kw.pop("local_window_size"))
    cached = module.cache_window
    if window is not None and window[0] < 0:
      raise ValueError(f"{_NAME}: `local_window_size` left side must be >= 0 when decoding")
    if cached is not None and (window is None or window[0] > cached[0]):
      raise ValueError(
          f"{_NAME}: `local_window_size` {window} needs keys further back than the "
          f"sliding-window cache keeps (left = {cached[0]}); call init_cache with it")
    return kw, window
  return kw, module.cache_window


def update_cache(module: Any, batch: tuple[int, ...], xq: jax.Array, k: jax.Array,
                 v: jax.Array, window: tuple[int, int] | None) -> DecodeStep:
  """Stores the new keys/values ``[B, L, K, H]`` (inputs ``xq [B, L, D]`` of batch shape
  ``batch``) and returns what the new tokens attend with (:class:`DecodeStep`) under
  ``window`` (or none)."""
  length = k.shape[1]
  quantized = getattr(module, "cache_quantization", None) is not None
  if quantized:  # attend with what is stored: the dequantised cache and new tokens
    stored, (k, v) = _quantized_cache.quantize(k, v)
    cached_k, cached_v = (x.astype(module.cache_dtype) for x in _quantized_cache.read(module))
  else:
    cached_k, cached_v = module.cached_key[...], module.cached_value[...]
  if tuple(batch) != module.cache_batch_shape:
    raise ValueError(
        f"{_NAME}: `inputs_q` has batch shape {tuple(batch)} but the cache was made for "
        f"batch {module.cache_batch_shape}: call init_cache(batch, max_length) again")
  capacity = cached_k.shape[1]
  max_length = module.cache_max_length
  index = module.cache_index[...]
  overflow = None
  try:
    start = int(index)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    overflow = index + length > max_length
  else:
    if start + length > max_length:
      raise ValueError(
          f"{_NAME}: decoding {length} token(s) at position {start} goes past the cache's "
          f"`max_length` = {max_length}")
  pos_q = index + jnp.arange(length, dtype=jnp.int32)
  pos_k = jnp.concatenate([module.cached_positions[...], pos_q])
  visible = (pos_k[None, :] >= 0) & (pos_k[None, :] <= pos_q[:, None])
  if window is not None:
    left, right = window
    visible = visible & (pos_k[None, :] >= pos_q[:, None] - left)
    if right < 0:
      visible = visible & (pos_k[None, :] <= pos_q[:, None] + right)
  keys = jnp.concatenate([cached_k, k.astype(cached_k.dtype)], axis=1)
  values = jnp.concatenate([cached_v, v.astype(cached_k.dtype)], axis=1)

  decay = None
  n_new = min(length, capacity)  # only the last `capacity` new tokens can be kept
  slots = pos_q[length - n_new:] % capacity
  if module.forget_gate:
    c_new = module.decay_total[...][:, None, :] + jnp.cumsum(
        module.log_forget_gates(xq), axis=1)
    decay = (c_new, jnp.concatenate([module.cached_decay[...], c_new], axis=1))
    module.cached_decay[...] = module.cached_decay[...].at[:, slots].set(c_new[:, length - n_new:])
    module.decay_total[...] = c_new[:, -1]

  if quantized:
    _quantized_cache.write(module, slots, stored, length - n_new)
  else:
    module.cached_key[...] = cached_k.at[:, slots].set(keys[:, capacity + length - n_new:])
    module.cached_value[...] = cached_v.at[:, slots].set(values[:, capacity + length - n_new:])
  module.cached_positions[...] = module.cached_positions[...].at[slots].set(
      pos_q[length - n_new:])
  module.cache_index[...] = index + length
  return DecodeStep(keys, values, visible[None, None], decay, overflow, pos_q)


# ------------------------------------------------------------------- Pallas decode step

# The normalizers of kernels_pallas.decode_attention and the hyperparameters it takes.
KERNEL_NORMALIZERS = {"softmax": (), "softmax_sink": ("sink_logit",), "sigmoid": ("bias",)}
# Pallas implementations of dot_product_attention -> the decode kernel's backend (None:
# the platform's, as kernels_pallas.pick_backend).
_PALLAS = {"pallas": None, "pallas_triton": "triton", "pallas_mosaic_tpu": "mosaic_tpu"}
_KERNEL_KWARGS = ("scale", "logits_soft_cap", "score")


def _pallas_request(implementation: Any) -> tuple[bool, str | None]:
  """``(asked, backend)``: whether ``implementation`` (a name or a sequence tried in
  order) asks for Pallas first, and which backend."""
  try:
    names = implementation_order(implementation)
  except ValueError:
    return False, None  # dot_product_attention raises the ValueError naming it
  if not names or names[0] not in _PALLAS:
    return False, None
  return True, _PALLAS[names[0]]


def _static_number(x: Any) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _prefix_view(module: Any, step: DecodeStep, window: tuple[int, int] | None):
  """``(keys, values, n)``: the cache written with the new token, as arrays whose first
  ``n`` slots (a traced int32) are exactly the keys a one-token step at position ``p``
  sees, or None when they are not a prefix.

  The cache of ``C`` slots holds position ``pos`` at slot ``pos mod C``. Before it wraps
  (``p < C``) slots ``0 .. p`` hold positions ``0 .. p``; after (a ring buffer), all
  ``C`` slots are visible and so is position ``p - C``, which the new token evicted: it
  is appended (a copy of the ring, O(C), only for sliding-window caches). With a window
  of ``left >= C`` (the cache's own) every stored position is visible: ``n = min(p, C)
  + 1``; a one-slot cache with ``left = 0``: ``n = 1``. Other windows (narrower than
  the ring, or ``right < 0``: the own token hidden) are not a prefix.
  """
  keys, values = module.cached_key[...], module.cached_value[...]
  capacity = keys.shape[1]
  if step.positions is None:
    return None
  p = step.positions[0]
  if window is not None:
    left, right = window
    if right < 0 or not (left >= capacity or (left == 0 and capacity == 1)):
      return None
  else:
    left = capacity
  if module.cache_window is None:  # never wraps below max_length (past it: NaN output)
    return keys, values, jnp.minimum(p, capacity - 1) + 1
  slot = p % capacity
  evicted_k = jax.lax.dynamic_slice_in_dim(step.key, slot, 1, axis=1)
  evicted_v = jax.lax.dynamic_slice_in_dim(step.value, slot, 1, axis=1)
  n = jnp.minimum(jnp.minimum(p, capacity), left) + 1
  return (jnp.concatenate([keys, evicted_k], axis=1),
          jnp.concatenate([values, evicted_v], axis=1), n)


def _kernel_params(spec_name: str, params: Mapping[str, Any], b: int, n: int):
  """The hyperparameters as the kernel's ``[B, N]`` float32 arrays, or None when the
  kernel does not take them (a name it lacks, a shape that is not per row, a non-finite
  concrete value: the dense path then decides)."""
  out = {}
  for name, x in params.items():
    if x is None:
      continue
    if name not in KERNEL_NORMALIZERS[spec_name]:
      return None
    try:
      x = jnp.asarray(x, jnp.float32)
      if x.ndim > 4:
        return None
      x = jnp.broadcast_to(x.reshape((1,) * (4 - x.ndim) + x.shape), (b, n, 1, 1))[:, :, 0, 0]
    except (TypeError, ValueError):
      return None
    if not isinstance(x, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(x))):
      return None
    out[name] = x
  return out


def _dense_decode(q, k, v, lengths, hp, *, normalizer, scale, cap):
  """The same step through ``dot_product_attention(implementation="xla")``: one query
  row per batch row over the first ``lengths[b]`` slots (the kernel's backward)."""
  params = {name: x[:, :, None, None] for name, x in hp.items()}
  out = dot_product_attention(
      q[:, None], k, v, key_value_seq_lengths=lengths, normalizer=normalizer,
      normalizer_params=params or None, scale=scale, logits_soft_cap=cap,
      implementation="xla")
  return out[:, 0]


def _decode_with_dense_derivative(kernel, dense):
  r"""``kernel(q, k, v, lengths, hp)`` differentiated as ``dense`` (the same function
  through XLA): the decoding kernel is forward only, so every derivative of a decode step
  is the dense step's. A custom JVP

  .. math::
    \dot o = \partial_q o_\text{dense}\,\dot q + \partial_k o_\text{dense}\,\dot k
      + \partial_v o_\text{dense}\,\dot v + \partial_\theta o_\text{dense}\,\dot\theta

  (``jax.jvp`` of ``dense``; the primal stays the kernel's), which JAX transposes for
  reverse mode, so ``jax.jvp`` / ``jax.jacfwd`` (also of a ``jax.jit``-compiled step),
  ``jax.grad`` and any higher order take the dense step's derivative; the primal inside
  the rule is this function again, so a nested derivative never differentiates the
  kernel. ``lengths`` (integers) has no tangent."""

  @jax.custom_jvp
  def f(q, k, v, lengths, hp):
    return kernel(q, k, v, lengths, hp)

  @f.defjvp
  def f_jvp(primals, tangents):
    q, k, v, lengths, hp = primals
    dq, dk, dv, _, dhp = tangents
    out = f(q, k, v, lengths, hp)
    _, dout = jax.jvp(lambda q_, k_, v_, hp_: dense(q_, k_, v_, lengths, hp_),
                      (q, k, v, hp), (dq, dk, dv, dhp))
    return out, dout.astype(out.dtype)

  return f


def pallas_decode(module: Any, step: DecodeStep, window: tuple[int, int] | None,
                  q: jax.Array, params: Mapping[str, Any],
                  kwargs: Mapping[str, Any]) -> jax.Array | None:
  r"""A one-token decode step through the split-K kernel, or None to take the dense path.

  .. math::
    o_{bn} = \sum_{j < n} f(x)_j\, v_{bj}, \qquad x_j = c \tanh(s\, q_{bn} \cdot k_{bj} / c)

  over the ``n`` keys the step sees (:func:`_prefix_view`), with
  :func:`kernels_pallas.decode.decode_attention` (T. Dao, D. Haziza, F. Massa &
  G. Sizov 2023, "Flash-Decoding for long-context inference"). Used only when the
  layer's ``implementation`` is "pallas", "pallas_triton", "pallas_mosaic_tpu" or a
  sequence whose first entry is one of them, and the kernel computes the call exactly:
  one new token; normalizer softmax (no temperature), softmax_sink or sigmoid with per
  head (or per row) hyperparameters; keywords ``scale`` and ``logits_soft_cap`` only
  (static numbers), dot scores; no float64; a visible set that is a prefix of the cache
  (:func:`_prefix_view`); a Pallas backend on the platform (or
  ``JAXSOFT_PALLAS_INTERPRET=1``). The caller checks the rest (no dropout, no sown
  weights, no learned normalizer modules, no forget gate). Otherwise None: the caller
  keeps the dense path (``dot_product_attention`` with the layer's ``implementation``).

  The kernel is forward only; a gradient through the step is the dense path's
  (:func:`_decode_with_dense_derivative`: a custom JVP through the step's XLA form, so
  forward mode, reverse mode and higher orders all work), never a differentiated kernel.

  Args:
    module: the layer (its cache was just written by :func:`update_cache`).
    step: that :class:`DecodeStep`.
    window: the step's ``(left, right)`` window or None.
    q: the new token's queries ``[B, 1, N, H]``.
    params: the normalizer's hyperparameters (per head: ``[N, 1, 1]``).
    kwargs: the other keywords for ``dot_product_attention``.

  Returns:
    ``[B, 1, N, H]`` in q's dtype, or None.
  """
  if getattr(module, "cache_quantization", None) is not None:
    return polykv_decode(module, step, window, q, params, kwargs)
  asked, backend = _pallas_request(module.implementation)
  if not asked or q.shape[1] != 1:
    return None
  spec = _spec.resolve(module.normalizer)
  if not (isinstance(spec, _spec.NormalizerSpec) and spec.name in KERNEL_NORMALIZERS
          and spec is _spec.get(spec.name)):  # the registered one, not a namesake
    return None
  if set(kwargs) - set(_KERNEL_KWARGS) or kwargs.get("score", "dot") != "dot":
    return None
  scale, cap = kwargs.get("scale"), kwargs.get("logits_soft_cap")
  if not all(x is None or _static_number(x) for x in (scale, cap)):
    return None
  if cap is not None and not (0 < cap < math.inf):
    return None  # the dense path raises the ValueError naming it
  if any(jnp.dtype(x.dtype) == jnp.float64 for x in (q, step.key)):
    return None  # the kernel computes in float32
  b, _, n, _ = q.shape
  hp = _kernel_params(spec.name, params, b, n)
  if hp is None:
    return None
  try:
    driver, interpret = kernels_pallas.pick_backend(backend)
  except NotImplementedError:
    return None
  view = _prefix_view(module, step, window)
  if view is None:
    return None
  keys, values, count = view
  lengths = jnp.broadcast_to(count.astype(jnp.int32), (b,))

  def kernel(q_, k_, v_, lengths_, hp_):  # read from its module at call time (tests spy on it)
    return decode_kernel.decode_attention(
        q_, k_, v_, lengths_, normalizer=spec.name, normalizer_params=hp_ or None,
        scale=scale, logits_soft_cap=cap, backend=driver, interpret=interpret)

  def dense(q_, k_, v_, lengths_, hp_):
    return _dense_decode(q_, k_, v_, lengths_, hp_, normalizer=spec.name, scale=scale,
                         cap=cap)

  out = _decode_with_dense_derivative(kernel, dense)(q[:, 0], keys, values, lengths, hp)
  return out[:, None]


def polykv_decode(module: Any, step: Any, window: tuple[int, int] | None, q: jax.Array,
                  params: Mapping[str, Any], kwargs: Mapping[str, Any]) -> jax.Array | None:
  r"""A one-token decode step through :func:`kernels_pallas.polykv.polykv_decode_attention`,
  or None to take the dense path (over the dequantised cache).

  .. math::
    o_{bn} = \sum_{j < n} \operatorname{softmax}_j(s\, q_{bn} \cdot \hat k_{bj})\, \hat v_{bj}

  over the ``n = p + 1`` stored keys of a step at position p (the cache just written with
  the new token), with :math:`\hat k` the q8_0 keys and :math:`\hat v` the 3-bit values the
  kernel reads without a dequantised copy. Taken when the layer's ``implementation`` asks
  for Pallas first, one new token, the registered softmax normalizer with no
  hyperparameter, keywords ``scale`` (a static number) only, no float64, a cache without a
  sliding window and a window (if any) of left >= the capacity. The kernel is forward
  only; a gradient through the step is the dense path's on the dequantised cache.

  Examples:
    A layer with the default implementation always takes the dense path over the
    dequantised cache (``implementation="pallas"`` runs the kernel for one-token steps):

    >>> layer = js.nn.MultiHeadAttention(2, 32, rngs=nnx.Rngs(0))
    >>> layer.init_cache(1, 8, quantization="polykv")
    >>> x = jnp.ones((1, 3, 32))
    >>> prefill = nnx.jit(lambda layer, x: layer(x, decode=True))
    >>> prefill(layer, x).shape           # a prefill
    (1, 3, 32)
    >>> layer.cached_key_codes[...].dtype, layer.cached_value_codes[...].shape
    (dtype('int8'), (1, 8, 2, 6))

  References:
    PolyKV, 2025 (int8 q8_0 keys, Hadamard-rotated 3-bit Lloyd-Max values).

    T. Dao, D. Haziza, F. Massa & G. Sizov, 2023, "Flash-Decoding for long-context
    inference".
  """
  asked, backend = _pallas_request(module.implementation)
  if not asked or q.shape[1] != 1 or step.positions is None:
    return None
  spec = _spec.resolve(module.normalizer)
  if not (isinstance(spec, _spec.NormalizerSpec) and spec.name == "softmax"
          and spec is _spec.get("softmax")) or any(x is not None for x in params.values()):
    return None
  if set(kwargs) - {"scale"}:
    return None
  scale = kwargs.get("scale")
  if not (scale is None or _static_number(scale)):
    return None
  if jnp.dtype(q.dtype) == jnp.float64 or module.cache_window is not None:
    return None
  capacity = module.cached_key_codes[...].shape[1]
  if window is not None and (window[1] < 0 or window[0] < capacity):
    return None
  try:
    driver, interpret = kernels_pallas.pick_backend(backend)
  except NotImplementedError:
    return None
  b = q.shape[0]
  stored = _quantized_cache.stored(module)
  count = jnp.minimum(step.positions[0], capacity - 1) + 1
  lengths = jnp.broadcast_to(count.astype(jnp.int32), (b,))
  keys, values = _polykv.polykv_dequantize(stored)

  def kernel(q_, k_, v_, lengths_, hp_):
    return _polykv.polykv_decode_attention(q_, stored, lengths_, scale=scale, backend=driver,
                                          interpret=interpret)

  def dense(q_, k_, v_, lengths_, hp_):
    return _dense_decode(q_, k_, v_, lengths_, hp_, normalizer="softmax",
                                   scale=scale, cap=None)

  out = _decode_with_dense_derivative(kernel, dense)(q[:, 0], keys, values, lengths, {})
  return out[:, None].astype(q.dtype)
