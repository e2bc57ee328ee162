"""``attention_fn``: any jaxsoft normalizer inside ``flax.nnx.MultiHeadAttention``.

``nnx.MultiHeadAttention(attention_fn=attention_fn(normalizer="sparsemax"))`` swaps the
softmax of a stock Flax attention layer for any registered normalizer, leaving the layer
and its parameters unchanged. The function returned follows the calling convention of
``flax.nnx.dot_product_attention`` (flax 0.12): the arguments the module passes (mask,
dropout, dtype, precision, module for weight sowing, is_causal) are all honoured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax.typing import ArrayLike

from jaxsoft.attention import dot_product_attention
from jaxsoft.normalizers import spec as _spec

__all__ = ["attention_fn", "attention_weights"]


def _flatten_batch(x, name: str, fn_name: str):
  """``[batch..., L, N, H]`` -> ``([B, L, N, H], batch_shape)`` (no batch dims -> B = 1)."""
  x = jnp.asarray(x)
  if x.ndim < 3:
    raise ValueError(f"{fn_name}: `{name}` must have shape [batch..., length, heads, depth], "
                     f"got {x.shape}")
  batch = tuple(x.shape[:-3])
  return x.reshape((math.prod(batch),) + x.shape[-3:]), batch


def flatten_logit_array(a, batch: tuple[int, ...], name: str, fn_name: str):
  """A mask or bias broadcastable to ``[batch..., N, T, S]`` -> ``[B or 1, n, t, s]``."""
  if a is None:
    return None
  a = jnp.asarray(a)
  rank = len(batch) + 3
  if a.ndim > rank:
    raise ValueError(
        f"{fn_name}: `{name}` of shape {a.shape} has more dimensions than the logits "
        f"[batch..., N, T, S] (rank {rank})")
  a = a.reshape((1,) * (rank - a.ndim) + a.shape)
  lead = a.shape[:len(batch)]
  try:
    lead = jnp.broadcast_shapes(lead, batch)  # jnp's: symbolic (jax.export) dims allowed
  except ValueError:
    raise ValueError(
        f"{fn_name}: `{name}` of shape {a.shape} does not broadcast to the batch "
        f"dimensions {batch}") from None
  if all(d == 1 for d in a.shape[:len(batch)]):
    return a.reshape((1,) + a.shape[len(batch):])
  a = jnp.broadcast_to(a, batch + a.shape[len(batch):])
  return a.reshape((math.prod(batch),) + a.shape[len(batch):])


def check_value(key_shape, value_shape, fn_name: str) -> None:
  """``value`` ``[batch..., S, K, Hv]`` must match ``key`` ``[batch..., S, K, H]`` but in Hv."""
  if tuple(key_shape[:-1]) != tuple(value_shape[:-1]):
    raise ValueError(
        f"{fn_name}: `value` of shape {tuple(value_shape)} must match `key` of shape "
        f"{tuple(key_shape)} in all but the last dimension ([batch..., S, K]: the same "
        "length S and heads K)")


def _rank4(a):
  """A mask or bias broadcastable to the ``[B, N, T, S]`` logits with its leading size-1 axes
  made explicit (numpy's broadcast by rank, without implicit rank promotion)."""
  a = jnp.asarray(a)
  return a.reshape((1,) * (4 - a.ndim) + a.shape)


def _segment_mask(segment_ids, t: int, s: int):
  """``segment_ids`` ([B, T] for self-attention, or a pair ([B, T], [B, S])) -> [B, 1, T, S]."""
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  else:
    q_seg = kv_seg = segment_ids
  q_seg = jnp.asarray(q_seg)
  kv_seg = jnp.asarray(kv_seg)
  if q_seg.shape[-1] != t or kv_seg.shape[-1] != s:
    raise ValueError(
        f"attention_weights: `segment_ids` must be [B, T] / ([B, T], [B, S]) with T={t}, "
        f"S={s}, got {q_seg.shape} and {kv_seg.shape}")
  return (q_seg[..., :, None] == kv_seg[..., None, :])[:, None]


def attention_weights(
    q: ArrayLike, k: ArrayLike, bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
    scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None, key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    logits_soft_cap: float | None = None,
    normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
    normalizer_params: Mapping[str, Any] | None = None,
    decay_bias: tuple[ArrayLike, ArrayLike] | None = None,
    precision: jax.lax.PrecisionLike = None) -> jax.Array:
  r"""The dense attention weights ``[B, N, T, S]`` that ``dot_product_attention`` applies.

  .. math::
    W = f\big(\mathrm{cap}(\text{scale}\cdot Q K^\top + c^q_i - c^k_j) + \text{bias}\big)
    \quad\text{over the visible keys of each row}

  with ``f`` the normalizer (its ``where`` = the combined mask, so length-dependent
  normalizers see n = visible keys of the row and masked keys get exactly 0), ``cap`` the
  optional tanh soft-cap ``c·tanh(x/c)``. Same arguments and mask semantics as
  :func:`jaxsoft.attention.dot_product_attention` (q ``[B, T, N, H]``, k ``[B, S, K, H]``,
  GQA when N % K == 0; ``is_causal``: query i sees keys j <= i; ``local_window_size``
  ``(left, right)`` or an int for ``(w, w)``). This is the clear dense form, used where the
  weights themselves are needed (dropout on the weights, sowing them for inspection); it
  ignores ``decay_prune_threshold`` (no pruning).

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]``, N % K == 0.
    bias: added to the logits, broadcastable to ``[B, N, T, S]``.
    mask: True (or nonzero) = attend, broadcastable to ``[B, N, T, S]``.
    scale: the logit scale (default ``1 / sqrt(H)``).
    is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size, segment_ids:
      the keys each query sees, as :func:`jaxsoft.attention.dot_product_attention`.
    logits_soft_cap: ``c`` of the tanh soft-cap, or None.
    normalizer: a registered name, a NormalizerSpec or a callable ``f(x, axis, where,
      **params)``.
    normalizer_params: its hyperparameters.
    decay_bias: ``(c_q [B, T, N], c_k [B, S, N])``, the FoX forget-gate decay
      ``c^q_i - c^k_j`` added to the logits.
    precision: of the ``Q K^T`` einsum.

  Returns:
    Weights ``[B, N, T, S]`` in float32 (float64 for float64 inputs).

  Examples:
    >>> q = k = jnp.ones((1, 3, 2, 4))                 # [B, T, N, H]
    >>> w = js.nn.attention_weights(q, k, is_causal=True)
    >>> w.shape                                        # [B, N, T, S]
    (1, 2, 3, 3)
    >>> w[0, 0]                                        # equal scores: uniform over j <= i
    Array([[1.    , 0.    , 0.    ],
           [0.5   , 0.5   , 0.    ],
           [0.3333, 0.3333, 0.3333]], dtype=float32)

  References:
    A. Vaswani, N. Shazeer, N. Parmar, J. Uszkoreit, L. Jones, A. N. Gomez, Ł. Kaiser &
    I. Polosukhin, 2017, "Attention Is All You Need".
  """
  fn_name = "attention_weights"
  q = jnp.asarray(q)
  k = jnp.asarray(k)
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"{fn_name}: `q` and `k` must be [B, T, N, H] / [B, S, K, H], got "
                     f"{q.shape} and {k.shape}")
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  if k.shape[-1] != h:
    raise ValueError(f"{fn_name}: `q` and `k` head dims differ: {h} and {k.shape[-1]}")
  if n % kh:
    raise ValueError(f"{fn_name}: query heads N={n} must be a multiple of key heads K={kh}")
  cdt = jnp.promote_types(jnp.result_type(q.dtype, k.dtype), jnp.float32)
  if scale is None:
    scale = 1.0 / math.sqrt(h)
  qg = q.astype(cdt).reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(cdt), precision=precision)
  logits = logits.reshape(b, n, t, s) * jnp.asarray(scale, cdt)
  if decay_bias is not None:
    cq, ck = decay_bias
    logits = logits + (jnp.transpose(jnp.asarray(cq, cdt), (0, 2, 1))[..., :, None]
                       - jnp.transpose(jnp.asarray(ck, cdt), (0, 2, 1))[..., None, :])
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if bias is not None:
    logits = logits + _rank4(bias).astype(cdt)

  visible = jnp.ones((1, 1, t, s), bool)
  if mask is not None:
    visible = jnp.logical_and(visible, _rank4(mask).astype(bool))
  row = jnp.arange(t).reshape(1, 1, t, 1)
  col = jnp.arange(s).reshape(1, 1, 1, s)
  if is_causal:
    visible = jnp.logical_and(visible, col <= row)
  if local_window_size is not None:
    left, right = ((local_window_size, local_window_size)
                   if isinstance(local_window_size, int) else local_window_size)
    if left is not None and left >= 0:
      visible = jnp.logical_and(visible, col >= row - left)
    if right is not None and right >= 0:
      visible = jnp.logical_and(visible, col <= row + right)
  if query_seq_lengths is not None:
    qlen = jnp.asarray(query_seq_lengths)
    visible = jnp.logical_and(visible, row < qlen[:, None, None, None])
  if key_value_seq_lengths is not None:
    kvlen = jnp.asarray(key_value_seq_lengths)
    visible = jnp.logical_and(visible, col < kvlen[:, None, None, None])
  if segment_ids is not None:
    visible = jnp.logical_and(visible, _segment_mask(segment_ids, t, s))
  visible = jnp.broadcast_to(visible, logits.shape)

  fn = _spec.resolve(normalizer)
  params = dict(normalizer_params or {})
  if isinstance(fn, _spec.NormalizerSpec):
    fn.validate(params)
  w = fn(jnp.where(visible, logits, 0.0), axis=-1, where=visible, **params)
  return jnp.where(visible, w, 0.0).astype(cdt)


def _apply_weights(w, v, precision=None):
  """``[B, N, T, S]`` weights, ``[B, S, K, H]`` values -> ``[B, T, N, H]`` (GQA aware)."""
  b, n, t, s = w.shape
  kh = v.shape[2]
  wg = w.reshape(b, kh, n // kh, t, s)
  out = jnp.einsum("bkgts,bskh->btkgh", wg, v.astype(w.dtype), precision=precision)
  return out.reshape(b, t, n, v.shape[-1])


def _dropout(w, rng, rate: float, broadcast: bool, batch_shape):
  """Inverted dropout on the weights, drawn as flax.nnx.dot_product_attention draws it.

  ``w`` is ``[B, N, T, S]`` with ``B = prod(batch_shape)``; the keep mask is drawn in the
  caller's unflattened shape (``[1..., 1, T, S]`` when broadcast over batch and heads) so
  the same key drops the same entries as Flax.
  """
  keep_prob = 1.0 - rate
  full = tuple(batch_shape) + w.shape[1:]
  shape = (1,) * (len(full) - 2) + w.shape[-2:] if broadcast else full
  keep = jax.random.bernoulli(rng, keep_prob, shape)
  keep = keep.reshape((-1,) + keep.shape[-3:]) if not broadcast else keep.reshape(
      (1, 1) + w.shape[-2:])
  return w * (keep.astype(w.dtype) / jnp.asarray(keep_prob, w.dtype))


def _sow_weights(module, w) -> None:
  """Sows the attention weights where the module's framework keeps them, as Flax's own attention.

  NNX: ``nnx.Intermediate`` ``'attention_weights'``; Linen: the ``'intermediates'``
  collection, ``'attention_weights'``.
  """
  if isinstance(module, nnx.Module):
    module.sow(nnx.Intermediate, "attention_weights", w)
  else:
    module.sow("intermediates", "attention_weights", w)


def attend(q, k, v, bias=None, mask=None, *, normalizer="softmax", normalizer_params=None,
           implementation=None, dropout_rng=None, dropout_rate: float = 0.0,
           broadcast_dropout: bool = True, deterministic: bool = True, module=None,
           precision=None, batch_shape=None, weights_dtype=None, fn_name: str = "attention",
           **kwargs):
  """dot_product_attention, or the dense weights path when dropout or sowing needs them.

  q ``[B, T, N, H]``, k/v ``[B, S, K, H]``; ``kwargs`` are further arguments of
  ``dot_product_attention`` (is_causal, segment_ids, decay_bias, ...). ``batch_shape``
  (default ``(B,)``) is the caller's batch shape the weights are sown and dropped in.
  ``weights_dtype`` (default: q's dtype) is the dtype the weights are kept, sown, dropped
  and applied in; the result comes back in it promoted with q's (Linen's
  ``force_fp32_for_softmax``: float32 weights and output for bf16 inputs).
  """
  check_value(k.shape, v.shape, fn_name)
  batch_shape = (q.shape[0],) if batch_shape is None else tuple(batch_shape)
  use_dropout = (not deterministic) and dropout_rate > 0.0
  if not use_dropout and module is None:
    if weights_dtype is not None:
      q, k, v = (a.astype(jnp.promote_types(a.dtype, weights_dtype)) for a in (q, k, v))
    return dot_product_attention(
        q, k, v, bias, mask, normalizer=normalizer, normalizer_params=normalizer_params,
        implementation=implementation, **kwargs)
  kwargs.pop("decay_prune_threshold", None)  # the dense weights are exact: nothing to prune
  w = attention_weights(q, k, bias, mask, normalizer=normalizer,
                        normalizer_params=normalizer_params, precision=precision, **kwargs)
  w = w.astype(q.dtype if weights_dtype is None else weights_dtype)
  if module is not None:
    _sow_weights(module, w.reshape(batch_shape + w.shape[1:]))
  if use_dropout:
    if dropout_rng is None:
      raise ValueError("attention: `dropout_rng` is required when dropout_rate > 0 and not "
                       "deterministic")
    w = _dropout(w, dropout_rng, dropout_rate, broadcast_dropout, batch_shape)
  return _apply_weights(w, v, precision).astype(jnp.promote_types(q.dtype, w.dtype))


def _fp32_weights(dtype, force_fp32_for_softmax: bool):
  """Linen's ``force_fp32_for_softmax``: float32 weights for inputs narrower than float32.

  (Flax casts any non-float32 dtype; float64 stays float64 here, never computed narrower.)
  """
  if (force_fp32_for_softmax and jnp.issubdtype(dtype, jnp.floating)
      and jnp.finfo(dtype).bits < 32):
    return jnp.float32
  return None


def attention_fn(normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
                 implementation: str | Sequence[str] | None = None,
                 **normalizer_params: Any) -> Callable[..., jax.Array]:
  r"""An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` using any jaxsoft normalizer.

  .. math:: \mathrm{Attention}(Q, K, V) = f\big(QK^\top/\sqrt{d} + \text{bias}\big)\, V

  with ``f`` the normalizer (a registered name, a NormalizerSpec or a callable) and its
  fixed hyperparameters ``normalizer_params`` (scalars, or arrays broadcast right-aligned
  against the logits ``[batch..., N, T, S]`` with size 1 along the keys, e.g. per head
  ``[N, 1, 1]``)::

    layer = nnx.MultiHeadAttention(
        num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
        attention_fn=js.nn.attention_fn("entmax", alpha=1.5))

  The returned function has the signature of ``flax.nnx.dot_product_attention``:
  ``(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
  dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
  promote_dtype=..., is_causal=False, **kwargs)``; any batch dimensions (or none), GQA.
  ``mask`` (True or nonzero = attend) and ``is_causal`` restrict the keys; extra keywords
  (``segment_ids``, ``local_window_size``, ``query_seq_lengths``, ...) go to
  ``jaxsoft.attention.dot_product_attention``. Dropout on the weights (with the same
  random draw as Flax) and sowing the weights into ``nnx.Intermediate`` under
  ``'attention_weights'`` when the module asks (``sow_weights=True``) go through the dense
  weights; otherwise the call goes to ``dot_product_attention`` with ``implementation``.
  As a Linen ``attention_fn`` (``flax.linen.MultiHeadDotProductAttention``, which passes
  only the keywords the signature names), ``force_fp32_for_softmax=True`` with bf16/fp16
  inputs keeps the weights in float32 (sown, dropped and applied in float32) and returns
  float32, as Linen's own ``dot_product_attention``; custom einsums
  (``qk_attn_weights_einsum``) raise ``NotImplementedError`` rather than being ignored.

  With ``normalizer="softmax"`` the result equals Flax's default, except that a query row
  with no visible key gives zeros (Flax's softmax over ``finfo.min`` logits averages the
  values there).

  Args:
    normalizer: a registered name, a NormalizerSpec or a callable ``f(x, axis, where,
      **params)``.
    implementation: passed to :func:`jaxsoft.attention.dot_product_attention` (a name or
      a sequence tried in order; default: its own choice).
    **normalizer_params: the normalizer's fixed hyperparameters.

  Returns:
    A function with the signature of ``flax.nnx.dot_product_attention``, for the
    ``attention_fn`` argument of ``flax.nnx.MultiHeadAttention``.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 3, 8))
    >>> flax_own = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
    >>> ours = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0),
    ...                               attention_fn=js.nn.attention_fn("softmax"))
    >>> apply = nnx.jit(lambda layer, x: layer(x))
    >>> same = jnp.allclose(apply(ours, x), apply(flax_own, x), atol=1e-6)
    >>> bool(same)   # same parameters, same output
    True
    >>> ours.attention_fn = js.nn.attention_fn("sparsemax")   # swap the normalizer
    >>> apply(ours, x).shape
    (1, 3, 8)

  References:
    A. Vaswani, N. Shazeer, N. Parmar, J. Uszkoreit, L. Jones, A. N. Gomez, Ł. Kaiser &
    I. Polosukhin, 2017, "Attention Is All You Need".
  """
  spec = _spec.resolve(normalizer)
  if isinstance(spec, _spec.NormalizerSpec):
    spec.validate(normalizer_params)

  def fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
         dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False, dtype=None,
         precision=None, module=None, promote_dtype=dtypes.promote_dtype,
         is_causal: bool = False, force_fp32_for_softmax: bool = False,
         qk_attn_weights_einsum=None, attn_weights_value_einsum=None, **kwargs):
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise NotImplementedError(
          "attention_fn: `qk_attn_weights_einsum` / `attn_weights_value_einsum` (custom "
          "einsums, e.g. quantized) are not supported; leave them None")
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    check_value(jnp.shape(key), jnp.shape(value), "attention_fn")
    q, batch = _flatten_batch(query, "query", "attention_fn")
    k, kbatch = _flatten_batch(key, "key", "attention_fn")
    v, vbatch = _flatten_batch(value, "value", "attention_fn")
    if not batch == kbatch == vbatch:
      raise ValueError(f"attention_fn: query, key and value batch dimensions differ: {batch}, "
                       f"{kbatch}, {vbatch}")
    m = flatten_logit_array(mask, batch, "mask", "attention_fn")
    if m is not None:
      m = m.astype(bool)
    b = flatten_logit_array(bias, batch, "bias", "attention_fn")
    out = attend(
        q, k, v, b, m, normalizer=normalizer, normalizer_params=normalizer_params or None,
        implementation=implementation, dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout, deterministic=deterministic, module=module,
        precision=precision, batch_shape=batch, is_causal=is_causal,
        weights_dtype=_fp32_weights(q.dtype, force_fp32_for_softmax), fn_name="attention_fn",
        **kwargs)
    return out.reshape(batch + out.shape[1:])

  fn.__name__ = f"attention_fn_{getattr(spec, 'name', 'custom')}"
  return fn

