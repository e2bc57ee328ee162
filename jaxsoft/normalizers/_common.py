"""Masking, dtype and broadcasting helpers shared by every normalizer.

Numerics policy (as in the README's "Numerics" section): low-precision inputs are
computed in float32 and cast back; masked entries (``where=False`` or a ``-inf`` logit)
get exactly 0 weight and enter no max, sum or threshold; a row with no visible entry
returns zeros with zero gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "canonical_axis",
    "compute_dtype",
    "prepare",
    "visible_count",
    "masked_max",
    "safe_divide",
    "row_param",
    "finish",
    "to_last",
    "from_last",
    "along_axis",
    "map_row_blocks",
    "decouple",
    "passes_until_done",
]


def canonical_axis(axis: int, ndim: int, fn_name: str) -> int:
  """Returns ``axis`` in [0, ndim); ValueError naming ``axis`` otherwise."""
  if not isinstance(axis, (int, np.integer)):
    raise ValueError(f"{fn_name}: `axis` must be an int, got {axis!r}")
  if ndim == 0:
    raise ValueError(f"{fn_name}: `x` must have at least one dimension, got a scalar")
  if not -ndim <= axis < ndim:
    raise ValueError(f"{fn_name}: `axis` {axis} is out of range for `x` of rank {ndim}")
  return int(axis) % ndim


def compute_dtype(dtype) -> jnp.dtype:
  """float32 for bf16/fp16/int inputs, the dtype itself for float32/float64."""
  dtype = jnp.dtype(dtype)
  if dtype in (jnp.float32, jnp.float64):
    return dtype
  return jnp.dtype(jnp.float32)


def prepare(x, axis: int, where, fn_name: str):
  """Validates and upcasts ``x``; returns ``(x_safe, mask, axis)``.

  ``mask`` is a boolean array of ``x``'s shape: ``where`` (broadcast) and ``x > -inf``.
  ``x_safe`` holds 0 at masked positions so no gradient through them is NaN.
  """
  x = jnp.asarray(x)
  axis = canonical_axis(axis, x.ndim, fn_name)
  xc = x.astype(compute_dtype(x.dtype))
  mask = xc != -jnp.inf
  if where is not None:
    where = jnp.asarray(where)
    try:
      where = jnp.broadcast_to(where, x.shape)
    except ValueError:
      raise ValueError(
          f"{fn_name}: `where` of shape {where.shape} does not broadcast to `x` of shape "
          f"{x.shape}") from None
    mask = jnp.logical_and(mask, where.astype(bool))
  x_safe = jnp.where(mask, xc, jnp.zeros_like(xc))
  return x_safe, mask, axis


def visible_count(mask, axis: int, dtype=jnp.float32):
  """n: the number of visible entries of each row, keepdims."""
  return jnp.sum(mask, axis=axis, keepdims=True).astype(dtype)


def masked_max(z, mask, axis: int):
  """Row max over visible entries (keepdims), 0 for a fully masked row, no gradient.

  The stabiliser of class-E normalizers; its value cancels in the result, so it carries
  no gradient (as in jax.nn.softmax).
  """
  m = jnp.max(jnp.where(mask, z, -jnp.inf), axis=axis, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))
  return jax.lax.stop_gradient(m)


def safe_divide(num, den):
  """``num / den`` where ``den != 0``, else 0, with a gradient free of NaN."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, jnp.ones_like(den)), jnp.zeros_like(num))


def row_param(value, x_shape, axis: int, name: str, fn_name: str, dtype=jnp.float32):
  """A hyperparameter given as a scalar or an array broadcast to the rows of ``x``.

  Arrays broadcast against ``x`` numpy-style (aligned on the right) and must have size 1
  along ``axis``: e.g. a per-head alpha for scores ``[B, N, T, S]`` is ``[N, 1, 1]``.
  """
  v = jnp.asarray(value, dtype=dtype)
  if v.ndim == 0:
    return v
  ndim = len(x_shape)
  if v.ndim > ndim:
    raise ValueError(
        f"{fn_name}: `{name}` of shape {v.shape} has more dimensions than `x` {tuple(x_shape)}")
  full = (1,) * (ndim - v.ndim) + tuple(v.shape)
  if full[axis] != 1:
    raise ValueError(
        f"{fn_name}: `{name}` must have size 1 along the normalized axis {axis} (one value "
        f"per row), got shape {v.shape} for `x` of shape {tuple(x_shape)}")
  try:
    np.broadcast_shapes(full, tuple(x_shape))
  except ValueError:
    raise ValueError(
        f"{fn_name}: `{name}` of shape {v.shape} does not broadcast to the rows of `x` "
        f"{tuple(x_shape)}") from None
  return v.reshape(full)


def finish(w, mask, dtype):
  """Exact zeros at masked entries, then the input dtype."""
  return jnp.where(mask, w, jnp.zeros_like(w)).astype(dtype)


# --- threshold solves over the last axis (class T) ------------------------------------------


def to_last(a, axis: int):
  """``a`` with ``axis`` moved last (no-op when it already is)."""
  return a if axis == a.ndim - 1 else jnp.moveaxis(a, axis, -1)


def from_last(a, axis: int):
  """Inverse of :func:`to_last`."""
  return a if axis == a.ndim - 1 else jnp.moveaxis(a, -1, axis)


def along_axis(fn_last, x, axis: int, where, fn_name: str):
  """``fn_last(xs, mask)``, a normalizer of the last axis, applied along ``axis`` of ``x``.

  With the numerics policy of :func:`prepare` and :func:`finish` around it.
  """
  xs, mask, axis = prepare(x, axis, where, fn_name)
  p = from_last(fn_last(to_last(xs, axis), to_last(mask, axis)), axis)
  return finish(p, mask, jnp.asarray(x).dtype)


# Rows are solved in blocks of about this many entries (256 KiB of float32), so the few
# passes each threshold solve makes over a block run from cache instead of memory: about
# 3x less time on CPU than passes over the whole [rows, n] array.
BLOCK_ENTRIES = 1 << 16


def map_row_blocks(fn, ym, *row_args):
  """``fn(ym_block, *row_arg_blocks) -> [rows, 1]`` applied over blocks of rows of ``ym``.

  ``row_args`` broadcast to ``ym.shape[:-1] + (1,)``; padding rows are fully masked
  (``-inf``), which every threshold solver handles.
  """
  lead, n = ym.shape[:-1], ym.shape[-1]
  rows = int(np.prod(lead, dtype=np.int64))
  if rows == 0 or n == 0:
    return jnp.zeros(lead + (1,), ym.dtype)
  per = max(1, min(rows, BLOCK_ENTRIES // max(n, 1)))
  nblocks = -(-rows // per)
  pad = nblocks * per - rows
  shape1 = lead + (1,)
  flat = [ym.reshape(rows, n)] + [jnp.broadcast_to(a, shape1).reshape(rows, 1) for a in row_args]
  fill = [-jnp.inf] + [1.0] * len(row_args)
  blocks = [jnp.pad(a, ((0, pad), (0, 0)), constant_values=v).reshape(nblocks, per, -1)
            for a, v in zip(flat, fill, strict=True)]
  if nblocks == 1:
    out = fn(*[b[0] for b in blocks])[None]
  else:
    out = jax.lax.map(lambda bs: fn(*bs), tuple(blocks))
  return out.reshape(nblocks * per, 1)[:rows].reshape(shape1)


def decouple(t, s):
  """``t`` made to depend on the reduction ``s`` without changing its value.

  XLA:CPU fuses sibling row reductions of one array into a multi-output loop that it does
  not vectorise (about 5x slower than two separate reductions); a data dependency of the
  second reduction on the first keeps them apart.
  """
  return t + 0.0 * s


def passes_until_done(step, init, n_max: int):
  """Row-wise fixed-point passes: ``step(*state) -> (new_state, now_done)`` until every row is done.

  ``init`` is a tuple of ``[rows..., 1]`` arrays. A row's state stops changing once a pass
  reports it done (the pass that does still writes its ``new_state``); the loop ends when
  every row is done or after ``n_max`` passes. Returns the final state tuple.
  """
  def cond(carry):
    i, _, done = carry
    return jnp.logical_and(i < n_max, ~jnp.all(done))

  def body(carry):
    i, state, done = carry
    new, now_done = step(*state)
    state = tuple(jnp.where(done, a, b) for a, b in zip(state, new, strict=True))
    return i + 1, state, jnp.logical_or(done, now_done)

  carry = (jnp.asarray(0), tuple(init), jnp.zeros(init[0].shape, bool))
  return jax.lax.while_loop(cond, body, carry)[1]
