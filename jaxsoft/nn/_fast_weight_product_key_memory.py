"""Fast-weight product-key memory (feature A47, FwPKM): the value table of a product-key
memory updated chunk by chunk by a gradient step on a local reconstruction loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete, positive_int
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["fast_weight_pkm", "fast_weight_pkm_update"]


def _check(values, weights, indices, targets, learning_rate, fn: str):
  v, w, i, t = (jnp.asarray(a) for a in (values, weights, indices, targets))
  if v.ndim != 2:
    raise ValueError(f"{fn}: `values` must be [N, d_v], got shape {v.shape}")
  if w.ndim != 3:
    raise ValueError(f"{fn}: `weights` must be [T, heads, k], got shape {w.shape}")
  if i.shape != w.shape:
    raise ValueError(f"{fn}: `indices` must have the shape of `weights` {w.shape}, got {i.shape}")
  if not jnp.issubdtype(i.dtype, jnp.integer):
    raise ValueError(f"{fn}: `indices` must be integers, got dtype {i.dtype}")
  if t.shape != (w.shape[0], v.shape[1]):
    raise ValueError(f"{fn}: `targets` must be [T, d_v] = {[w.shape[0], v.shape[1]]}, "
                     f"got {t.shape}")
  if jnp.ndim(learning_rate) != 0:
    raise ValueError(f"{fn}: `learning_rate` must be a scalar, got shape "
                     f"{jnp.shape(learning_rate)}")
  lr = concrete(learning_rate, np.float64)
  if lr is not None and not (np.isfinite(lr) and lr >= 0):
    raise ValueError(f"{fn}: `learning_rate` must be a finite number >= 0, got {learning_rate!r}")
  cdt = compute_dtype(jnp.result_type(v.dtype, w.dtype, t.dtype))
  return v, w.astype(cdt), i, t.astype(cdt), jnp.asarray(learning_rate, cdt), cdt


def _read(v, w, i):
  """``o_t = sum_h sum_j w_{t,h,j} V[i_{t,h,j}]``: [T, d_v]."""
  return jnp.einsum("thk,thkv->tv", w, jnp.take(v, i, axis=0))


def _step(v, w, i, t, lr):
  """(read of the chunk from ``v``, ``v`` after one gradient step on the chunk's loss)."""
  out = _read(v, w, i)
  err = out - t                                             # dL/do_t times T
  rows = (w[..., None] * err[:, None, None, :]).reshape(-1, v.shape[-1])
  grad = jnp.zeros_like(v).at[i.reshape(-1)].add(rows) / w.shape[0]
  return out, v - lr * grad


def fast_weight_pkm_update(values: ArrayLike, weights: ArrayLike, indices: ArrayLike,
                           targets: ArrayLike, learning_rate: ArrayLike) -> jax.Array:
  r"""One fast-weight write of a product-key memory: a gradient step on a chunk's
  reconstruction loss with respect to the value table.

  With the chunk's read :math:`o_t = \sum_h \sum_{j} w_{t,h,j}\, V_{i_{t,h,j}}` (the
  softmax weights and slots of :func:`product_key_topk` / ``ProductKeyMemory.lookup``) and
  write targets :math:`v_t`, the local loss over the chunk's T tokens is

  .. math::
    L(V) = \frac{1}{2T} \sum_{t=1}^{T} \lVert o_t - v_t \rVert^2, \qquad
    V' = V - \eta\, \nabla_V L, \quad
    \nabla_{V_s} L = \frac{1}{T} \sum_{t,h,j:\ i_{t,h,j} = s} w_{t,h,j}\, (o_t - v_t),

  so only the (at most T·heads·k) slots the chunk addressed change. [R] FwPKM (2025) is
  known from its abstract ("local chunk-level gradient descent" on the memory's
  parameters); reconstructed here: the loss is the mean squared error above (factor 1/2,
  mean over the chunk's tokens), one plain gradient step with inner learning rate
  :math:`\eta`, only the values are fast weights (keys and addressing stay fixed), and
  the read and write addresses are the same lookup.

  Args:
    values: the value table V, [N, d_v].
    weights: addressing weights w, [T, heads, k] (each row of k usually sums to 1).
    indices: their slots in [0, N), [T, heads, k] (integers).
    targets: write targets v_t, [T, d_v].
    learning_rate: the inner learning rate :math:`\eta \ge 0` (a scalar; may be traced,
      and is differentiable).

  Returns:
    The updated table, [N, d_v] in ``values``' dtype (computed in float32 for bf16/fp16
    inputs, in float64 under ``JAX_ENABLE_X64`` for float64 ones).

  Examples:
    >>> V = jnp.zeros((4, 2))
    >>> w = jnp.array([[[0.75, 0.25]]])                  # T=1 token, 1 head, k=2 slots
    >>> idx = jnp.array([[[1, 3]]])
    >>> jax.jit(js.nn.fast_weight_pkm_update)(V, w, idx, jnp.array([[4.0, -8.0]]), 1.0)
    Array([[ 0.,  0.],
           [ 3., -6.],
           [ 0.,  0.],
           [ 1., -2.]], dtype=float32)

  References:
    G. Lample, A. Sablayrolles, M. Ranzato, L. Denoyer & H. Jégou, 2019, "Large Memory
    Layers with Product Keys".
    FwPKM authors (names not recorded here), 2025, "Fast-weight Product Key Memory"; the
    update rule here is reconstructed from its abstract.
  """
  v, w, i, t, lr, cdt = _check(values, weights, indices, targets, learning_rate,
                               "fast_weight_pkm_update")
  return _step(v.astype(cdt), w, i, t, lr)[1].astype(v.dtype)


def fast_weight_pkm(values: ArrayLike, weights: ArrayLike, indices: ArrayLike,
                    targets: ArrayLike, *, chunk_size: int,
                    learning_rate: ArrayLike) -> tuple[jax.Array, jax.Array]:
  r"""A fast-weight product-key memory over a sequence: read each chunk from the memory
  written by the chunks before it, then write the chunk (FwPKM, chunked scan form).

  With chunks :math:`c = 0, 1, \dots` of ``chunk_size`` tokens and :math:`V_0` = ``values``:

  .. math::
    o_t = \sum_h \sum_j w_{t,h,j}\, (V_c)_{i_{t,h,j}} \quad (t \in c), \qquad
    V_{c+1} = V_c - \eta\, \nabla_V L_c(V_c),

  with :math:`L_c` the chunk's reconstruction loss of :func:`fast_weight_pkm_update`. The
  read is causal at chunk granularity: chunk c sees only the writes of chunks < c (tokens
  of one chunk do not see each other's writes). :math:`\eta = 0` is the static product-key
  memory. The scan is differentiable in all float arguments (the outer loss's gradient
  flows through every write), for meta-learning the initial table, addressing and targets.
  [R]: the loss and update are reconstructed (see :func:`fast_weight_pkm_update`).

  Args:
    values: the initial value table :math:`V_0`, [N, d_v].
    weights: addressing weights, [T, heads, k]; indices: their slots in [0, N), same shape.
    targets: write targets, [T, d_v].
    chunk_size: tokens per chunk (a positive int dividing T).
    learning_rate: the inner learning rate :math:`\eta \ge 0` (scalar, may be traced).

  Returns:
    ``(outputs [T, d_v], final table [N, d_v])``; outputs in the result dtype of
    ``values``, ``weights`` and ``targets``, the table in ``values``' dtype. For a batch,
    ``jax.vmap`` it.

  Examples:
    >>> V = jnp.zeros((4, 1))
    >>> w = jnp.ones((4, 1, 1))                           # every token reads one slot
    >>> idx = jnp.array([0, 0, 1, 0]).reshape(4, 1, 1)
    >>> fwpkm = jax.jit(js.nn.fast_weight_pkm, static_argnames="chunk_size")
    >>> out, V2 = fwpkm(V, w, idx, jnp.ones((4, 1)), chunk_size=2, learning_rate=1.0)
    >>> out[:, 0]                      # chunk 1 reads slot 0 after chunk 0 wrote it
    Array([0., 0., 0., 1.], dtype=float32)
    >>> V2[:, 0]
    Array([1. , 0.5, 0. , 0. ], dtype=float32)

  References:
    G. Lample, A. Sablayrolles, M. Ranzato, L. Denoyer & H. Jégou, 2019, "Large Memory
    Layers with Product Keys".
    FwPKM authors (names not recorded here), 2025, "Fast-weight Product Key Memory"; the
    update rule here is reconstructed from its abstract.
  """
  fn = "fast_weight_pkm"
  v, w, i, t, lr, cdt = _check(values, weights, indices, targets, learning_rate, fn)
  c = positive_int(chunk_size, "chunk_size", fn)
  T, h, k = w.shape
  if T % c:
    raise ValueError(f"{fn}: `chunk_size` ({c}) must divide the sequence length T = {T}")
  n = T // c

  def body(vc, xs):
    out, v_next = _step(vc, xs[0], xs[1], xs[2], lr)
    return v_next, out

  xs = (w.reshape(n, c, h, k), i.reshape(n, c, h, k), t.reshape(n, c, -1))
  v_end, out = jax.lax.scan(body, v.astype(cdt), xs)
  out_dtype = jnp.result_type(v.dtype, jnp.asarray(weights).dtype, jnp.asarray(targets).dtype)
  return out.reshape(T, -1).astype(out_dtype), v_end.astype(v.dtype)
