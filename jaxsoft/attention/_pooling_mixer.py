"""PoNet's multi-granularity pooling token mixer (feature A51): global attention pooling,
segment max pooling and local max pooling, fused with an output gate, in O(T·d)."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft._validation import finite_float, positive_int
from jaxsoft.normalizers import common as c

__all__ = ["ponet_mix"]

_HI = lax.Precision.HIGHEST


def _tokens(value: Any, shape: tuple[int, ...], name: str, fn: str) -> jax.Array:
  """``value`` broadcast to the token shape ``[..., T]``; ValueError naming it otherwise."""
  v = jnp.asarray(value)
  try:
    return jnp.broadcast_to(v, shape)
  except ValueError:
    raise ValueError(f"{fn}: `{name}` of shape {v.shape} does not broadcast to the token shape "
                     f"{shape} ([..., T] of the inputs)") from None


def _segmented_cummax(v: jax.Array, start: jax.Array) -> jax.Array:
  """Running max of ``v [..., T, N, D]`` along T, restarted where ``start [..., T, 1, 1]``."""
  def combine(a, b):
    (fa, va), (fb, vb) = a, b
    return jnp.logical_or(fa, fb), jnp.where(fb, vb, jnp.maximum(va, vb))
  return lax.associative_scan(combine, (start, v), axis=v.ndim - 3)[1]


def _segment_max(v: jax.Array, start: jax.Array) -> jax.Array:
  """The max of ``v [..., T, N, D]`` over each run that ``start [..., T]`` opens, at each token.

  One scatter-max over the runs numbered across the flattened leading axes, then a gather.
  """
  T = v.shape[-3]
  rows = math.prod(v.shape[:-3])
  run = jnp.cumsum(start.reshape(rows, T), axis=-1) - 1
  gid = (jnp.arange(rows)[:, None] * T + run).reshape(-1)
  flat = v.reshape(rows * T, *v.shape[-2:])
  top = jax.ops.segment_max(flat, gid, num_segments=rows * T, indices_are_sorted=True)
  return top[gid].reshape(v.shape)


def ponet_mix(query: ArrayLike, key: ArrayLike, gate: ArrayLike, segment_values: ArrayLike,
              local_values: ArrayLike, *, value: ArrayLike | None = None,
              segment_ids: ArrayLike | None = None, segment_size: int | None = None,
              window: int = 3, mask: ArrayLike | None = None, scale: float | None = None,
              causal: bool = False) -> jax.Array:
  r"""PoNet's token mixing: global, segment and local pooling fused by a gate (feature A51).

  From the projections of a sequence (queries Q, keys K, values V, gate O, and the inputs
  S and L of the two max poolings), per head and per token i:

  .. math::
    \bar q = \frac{1}{n} \sum_{j \in V} Q_j, \qquad
    g = \sum_{j \in V} \mathrm{softmax}_j\big(s\, \bar q \cdot K_j\big)\, V_j
    \qquad \text{(global aggregation)}

    s_i = \max_{j \in \mathrm{seg}(i) \cap V} S_j, \qquad
    l_i = \max_{|j - i| \le \lfloor w/2 \rfloor,\ j \in V} L_j
    \qquad \text{(segment and local max pooling, per channel)}

    o_i = (g + s_i) \odot O_i + l_i \qquad \text{(pooling fusion)}

  over the visible tokens V (n of them), with s the ``scale`` (1/√d_k). Every path is
  O(T·d): the global token is one query attending to the sequence. This is the fusion of
  the authors' code (C.-H. Tan et al. 2022): the global path's values are its keys there
  (``value=None`` here), and ``(g + s_i)`` multiplies the gate, the local path is added.

  Segments are the maximal runs of equal ``segment_ids`` (sentences, as the paper's
  pre-training segments them, or packed documents); ``segment_size=k`` cuts the sequence
  into runs of k tokens (the paper's LRA code uses a fixed number of equal segments).

  Masks: a masked token (``mask`` False, e.g. padding) is deleted from every pool (the
  mean, the softmax, both maxima; whatever it holds, NaN included, never reaches a visible
  token's output) and its own output is 0, as in the reference code. The local window of a
  visible token always holds the token itself, so no max is empty.

  ``causal=True`` is a reconstruction [R]: the paper's model is an encoder (its code: "Decoder
  is not yet implemented"). Token i then sees only j ≤ i: the global query is the running
  mean :math:`\bar q_i` of :math:`Q_{j \le i}` attending to :math:`K_{j \le i}` (O(T^2·d):
  each token has its own query), the segment max is the running max of i's segment up to
  i, and the local window is the ``window`` tokens ending at i.

  Args:
    query: Q ``[..., T, N, Dk]`` (T tokens, N heads).
    key: K ``[..., T, N, Dk]``.
    gate: O ``[..., T, N, Dv]``, the gate of the global and segment paths.
    segment_values: S ``[..., T, N, Dv]``, max-pooled over each segment.
    local_values: L ``[..., T, N, Dv]``, max-pooled over the window.
    value: V ``[..., T, N, Dv]`` of the global attention; None: ``key`` (the reference).
    segment_ids: integer ids broadcastable to ``[..., T]``; a change of id starts a segment.
    segment_size: the length of the fixed segments instead (exactly one of the two).
    window: w, the local window: odd (centred on the token) unless ``causal``.
    mask: boolean, broadcastable to ``[..., T]``; True for the tokens to mix.
    scale: the scale of the global logits (default ``1/sqrt(Dk)``).
    causal: the causal reconstruction above.

  Returns:
    ``[..., T, N, Dv]`` in the inputs' dtype (bf16 and fp16 computed in float32); 0 at
    masked tokens.

  Examples:
    >>> q = k = jnp.zeros((1, 4, 1, 2))                   # [B, T, N, Dk]: uniform softmax
    >>> v = jnp.array([1., 2., 3., 4.]).reshape(1, 4, 1, 1) * jnp.ones((1, 1, 1, 2))
    >>> o = jnp.ones_like(v)                              # gate 1
    >>> out = js.attention.ponet_mix(q, k, o, v, v, value=v, segment_size=2, window=3)
    >>> out[0, :, 0, 0]   # global mean 2.5 + segment max (2, 2, 4, 4) + local max (2, 3, 4, 4)
    Array([ 6.5,  7.5, 10.5, 10.5], dtype=float32)
    >>> out = js.attention.ponet_mix(q, k, o, v, v, value=v, segment_size=2, window=3,
    ...                              mask=jnp.array([True, True, True, False]))
    >>> out[0, :, 0, 0]   # the last token deleted: global 2, segments (2, 2, 3), local (2, 3, 3)
    Array([6., 7., 8., 0.], dtype=float32)
    >>> out = js.attention.ponet_mix(q, k, o, v, v, value=v, segment_size=2, window=2,
    ...                              causal=True)
    >>> out[0, :, 0, 0]   # running mean (1, 1.5, 2, 2.5) + running segment max + last 2
    Array([ 3. ,  5.5,  8. , 10.5], dtype=float32)

  References:
    C.-H. Tan, Q. Chen, W. Wang, Q. Zhang, S. Zheng & Z.-H. Ling, 2022, "PoNet: Pooling
    Network for Efficient Token Mixing in Long Sequences" (ICLR 2022).
  """
  fn = "ponet_mix"
  arrays = {"query": query, "key": key, "gate": gate, "segment_values": segment_values,
            "local_values": local_values}
  if value is not None:
    arrays["value"] = value
  arrs = {n: jnp.asarray(a) for n, a in arrays.items()}
  for n, a in arrs.items():
    c.check_real(a, fn)
    if a.ndim < 3:
      raise ValueError(f"{fn}: `{n}` must have shape [..., T, N, D], got {a.shape}")
  q, k = arrs["query"], arrs["key"]
  v = arrs.get("value", k)
  if k.shape != q.shape:
    raise ValueError(f"{fn}: `key` must have the shape of `query` {q.shape}, got {k.shape}")
  vshape = v.shape
  if vshape[:-1] != q.shape[:-1]:
    raise ValueError(f"{fn}: `value` must have shape {q.shape[:-1]} + (Dv,), got {vshape}")
  for n in ("gate", "segment_values", "local_values"):
    if arrs[n].shape != vshape:
      raise ValueError(f"{fn}: `{n}` must have the shape of the values {vshape}, got "
                       f"{arrs[n].shape}")
  if not isinstance(causal, bool):
    raise ValueError(f"{fn}: `causal` must be a bool, got {causal!r}")
  w = positive_int(window, "window", fn)
  if not causal and w % 2 == 0:
    raise ValueError(f"{fn}: `window` must be odd (centred on the token) unless `causal`, "
                     f"got {w}")
  if (segment_ids is None) == (segment_size is None):
    raise ValueError(f"{fn}: give exactly one of `segment_ids` and `segment_size`")
  size = None if segment_size is None else positive_int(segment_size, "segment_size", fn)
  s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else finite_float(scale, "scale", fn)
  ids = None if segment_ids is None else jnp.asarray(segment_ids)
  m = None if mask is None else jnp.asarray(mask)
  return _mix(q, k, v, arrs["gate"], arrs["segment_values"], arrs["local_values"], ids, m,
              size=size, window=w, causal=causal, scale=s)


@functools.partial(jax.jit, static_argnames=("size", "window", "causal", "scale"))
def _mix(q, k, v, gate, segment_values, local_values, segment_ids, mask, *, size, window,
         causal, scale):
  """:func:`ponet_mix` past its static checks, one program (an eager call compiles once)."""
  fn = "ponet_mix"
  w, s = window, scale
  tok_shape = q.shape[:-2]
  T = q.shape[-3]
  if size is not None:
    ids = jnp.broadcast_to(jnp.arange(T) // size, tok_shape)
  else:
    ids = _tokens(segment_ids, tok_shape, "segment_ids", fn)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{fn}: `segment_ids` must be integers, got {ids.dtype}")
  m = (jnp.ones(tok_shape, bool) if mask is None
       else _tokens(mask, tok_shape, "mask", fn).astype(bool))
  out_dtype = jnp.result_type(q, k, v, gate, segment_values, local_values)
  cdt = c.compute_dtype(out_dtype)
  if T == 0:  # no token: nothing to mix
    return jnp.zeros(v.shape, c.output_dtype(out_dtype))
  mt = m[..., None, None]  # [..., T, 1, 1]

  def clean(a):  # masked tokens deleted: 0 in the sums, no NaN from them, no gradient
    return jnp.where(mt, a.astype(cdt), jnp.zeros((), cdt))

  qc, kc, vc, oc = clean(q), clean(k), clean(v), clean(gate)
  # -- global aggregation
  if causal:
    count = jnp.cumsum(m, axis=-1).astype(cdt)[..., None, None]  # [..., T, 1, 1]
    qbar = c.safe_divide(jnp.cumsum(qc, axis=-3), count)          # running mean
    logits = s * jnp.einsum("...ind,...jnd->...nij", qbar, kc, precision=_HI)
    pos = jnp.arange(T)
    causal_tt = (pos[None, :] <= pos[:, None]).reshape((1,) * (m.ndim - 1) + (1, T, T))
    allowed = jnp.logical_and(causal_tt, m[..., None, None, :])  # [..., 1, T, T]
    a = c.exp_normalize(logits, allowed, -1)
    g = jnp.einsum("...nij,...jnd->...ind", a, vc, precision=_HI)
  else:
    count = jnp.sum(m, axis=-1).astype(cdt)[..., None, None]     # [..., 1, 1]
    qbar = c.safe_divide(jnp.sum(qc, axis=-3), count)              # [..., N, Dk]
    logits = s * jnp.einsum("...nd,...jnd->...nj", qbar, kc, precision=_HI)
    a = c.exp_normalize(logits, m[..., None, :], -1)
    g = jnp.einsum("...nj,...jnd->...nd", a, vc, precision=_HI)[..., None, :, :]
  # -- segment max pooling (runs of equal ids), masked tokens as -inf
  neg = jnp.asarray(-jnp.inf, cdt)
  sv = jnp.where(mt, segment_values.astype(cdt), neg)
  change = ids[..., 1:] != ids[..., :-1]
  edge = jnp.ones(tok_shape[:-1] + (1,), bool)
  start = jnp.concatenate([edge, change], axis=-1)
  if causal:
    seg = _segmented_cummax(sv, start[..., None, None])
  else:
    seg = _segment_max(sv, start)
  # -- local max pooling over the window
  lv = jnp.where(mt, local_values.astype(cdt), neg)
  pad = (w - 1, 0) if causal else (w // 2, w // 2)
  ndim = lv.ndim
  loc = lax.reduce_window(  # (a Python -inf init: the differentiable max-pool form)
      lv, -jnp.inf, lax.max, (1,) * (ndim - 3) + (w, 1, 1), (1,) * ndim,
      ((0, 0),) * (ndim - 3) + (pad, (0, 0), (0, 0)))
  # A visible token's maxima hold the token itself: finite. Masked tokens' are zeroed
  # before the product, so no -inf meets the gate (nor a 0 * inf in the gradient).
  seg = jnp.where(mt, seg, jnp.zeros((), cdt))
  loc = jnp.where(mt, loc, jnp.zeros((), cdt))
  out = jnp.where(mt, (g + seg) * oc + loc, jnp.zeros((), cdt))
  return out.astype(c.output_dtype(out_dtype))
