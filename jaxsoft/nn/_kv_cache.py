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

from jaxsoft.attention._masks import normalize_window

__all__ = ["DecodeStep", "init_cache", "check_decode_call", "update_cache", "has_cache"]

_NAME = "MultiHeadAttention"
# Keywords of dot_product_attention a decode call cannot take: the cache defines the keys'
# visibility (and its lengths), so a per-call mask or length over [T, S] has no meaning.
_REFUSED = ("query_seq_lengths", "key_value_seq_lengths", "bias", "decay_bias",
            "decay_prune_threshold", "return_residual")


@dataclasses.dataclass(frozen=True)
class DecodeStep:
  """What a decode call attends with: keys/values ``[B, C + L, K, H]`` (cached slots then
  the new tokens), the visibility ``mask [1, 1, L, C + L]``, the FoX ``decay_bias`` (or
  None) and ``overflow``: None when the position was checked eagerly, else a traced bool
  that is True when the call wrote past ``max_length`` (the output is then NaN)."""

  key: jax.Array
  value: jax.Array
  mask: jax.Array
  decay_bias: tuple[jax.Array, jax.Array] | None
  overflow: jax.Array | None


def has_cache(module: Any) -> bool:
  return getattr(module, "cache_index", None) is not None


def _positive_int(value: Any, arg: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{_NAME}.init_cache: `{arg}` must be a positive int, got {value!r}")
  return int(value)


def init_cache(module: Any, batch: int | Sequence[int], max_length: int, *,
               local_window_size: int | tuple[int, int] | None = None,
               dtype: Any = None) -> None:
  """Creates (or resets) ``module``'s cache as ``nnx.Cache`` variables; see the module doc.

  ``batch``: the batch size or the batch shape of the inputs ``[batch..., L, D]``;
  ``max_length``: the most positions the cache will hold; ``local_window_size``: int
  ``w`` (= ``(w, w)``) or ``(left, right)``: a ring buffer of ``max(left, 1)`` slots for
  a sliding window; ``dtype``: of the stored keys and values (default the module's
  ``dtype``, else its ``param_dtype``).
  """
  batch_shape = (batch,) if isinstance(batch, (int, np.integer)) else batch
  try:
    batch_shape = tuple(batch_shape)
  except TypeError:
    raise ValueError(
        f"{_NAME}.init_cache: `batch` must be an int or a tuple of ints, got {batch!r}") from None
  for d in batch_shape:
    _positive_int(d, "batch")
  batch_shape = tuple(int(d) for d in batch_shape)
  max_length = _positive_int(max_length, "max_length")
  try:
    window = normalize_window(local_window_size)
  except ValueError as e:
    raise ValueError(f"{_NAME}.init_cache: {e}") from None
  if window is not None and window[0] < 0:
    raise ValueError(
        f"{_NAME}.init_cache: `local_window_size` left side must be >= 0 for causal "
        f"decoding, got {local_window_size!r}")
  capacity = max_length if window is None else min(max_length, max(window[0], 1))
  if dtype is None:
    dtype = module.dtype if module.dtype is not None else module.param_dtype
  dtype = jnp.dtype(dtype)
  bsz = math.prod(batch_shape)
  shape = (bsz, capacity, module.num_kv_heads, module.head_dim)
  module.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
  module.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
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
  cached_k = module.cached_key[...]
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
  values = jnp.concatenate([module.cached_value[...], v.astype(cached_k.dtype)], axis=1)

  decay = None
  n_new = min(length, capacity)  # only the last `capacity` new tokens can be kept
  slots = pos_q[length - n_new:] % capacity
  if module.forget_gate:
    c_new = module.decay_total[...][:, None, :] + jnp.cumsum(
        module.log_forget_gates(xq), axis=1)
    decay = (c_new, jnp.concatenate([module.cached_decay[...], c_new], axis=1))
    module.cached_decay[...] = module.cached_decay[...].at[:, slots].set(c_new[:, length - n_new:])
    module.decay_total[...] = c_new[:, -1]

  module.cached_key[...] = cached_k.at[:, slots].set(keys[:, capacity + length - n_new:])
  module.cached_value[...] = module.cached_value[...].at[:, slots].set(
      values[:, capacity + length - n_new:])
  module.cached_positions[...] = module.cached_positions[...].at[slots].set(
      pos_q[length - n_new:])
  module.cache_index[...] = index + length
  return DecodeStep(keys, values, visible[None, None], decay, overflow)
