"""Argument checks and masking shared by the losses.

Conventions (as optax): a loss returns one value per example, of the logits' shape
without the class ``axis``, in the logits' dtype (computed in float32 for bf16/fp16;
integer and boolean logits promote to float32 as in the normalizers). Zero examples give
an empty result; a zero-sized class axis gives loss 0 for every example (no visible class).

``where`` is either an element mask broadcastable to ``logits`` (a False *class* is left
out of every sum, max and normaliser, as a ``-inf`` logit is) or, when it has exactly one
dimension fewer than ``logits``, a mask over *examples* (optax's convention): an example
whose mask is False gets loss 0 and zero gradient. To mask classes of a ``[B, K]`` batch
with one ``[K]`` row, pass it as ``[1, K]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft._validation import finite_float
from jaxsoft.normalizers import common as nc

Axis = int | tuple[int, ...] | None
"""A loss's ``axis``: one class axis, a tuple of axes forming one class axis, or None (all)."""


def float_input(a, name: str, fn_name: str) -> jax.Array:
  """``a`` as a floating array: integer and boolean arrays promote as jax.nn's inputs do.

  float32, or float64 for 64-bit integers under x64 (``normalizers.common.output_dtype``);
  any other dtype (complex, ...) is a ValueError naming the argument.
  """
  a = jnp.asarray(a)
  if jnp.issubdtype(a.dtype, jnp.floating):
    return a
  if not (jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == jnp.bool_):
    raise ValueError(f"{fn_name}: `{name}` must have a real dtype, got {a.dtype}")
  return a.astype(nc.output_dtype(a.dtype))


def check_logits(logits, fn_name: str):
  """``logits`` as a floating array with at least one dimension (:func:`float_input`)."""
  logits = float_input(logits, "logits", fn_name)
  if logits.ndim == 0:
    raise ValueError(f"{fn_name}: `logits` must have a class axis, got a scalar")
  return logits


def class_rows(logits, axis: Axis, where, fn_name: str, name: str = "logits",
               **like) -> tuple[jax.Array, Any, int, tuple[Any, ...]]:
  """A tuple ``axis`` (None: every axis) read as one class axis, as optax's losses read it.

  The named axes are moved last in the order given and merged, so an integer label is a
  flat index into the slice ``logits[axis]`` (``jnp.ravel_multi_index`` over their sizes).
  ``where`` of ``logits``' rank minus the number of named axes is an example mask (optax's
  convention); otherwise it must broadcast to ``logits``. Each array in ``like`` of
  ``logits``' rank (probability targets, a teacher's logits) must have ``logits``' shape
  and is merged the same way; other arrays (integer labels) already index the examples.

  Returns ``(logits, where, axis, like)``: unchanged for an int ``axis``; otherwise the
  merged arrays, ``axis=-1`` and ``like`` as a tuple in the order given.
  """
  if isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_)):
    return logits, where, int(axis), tuple(like.values())
  logits = float_input(logits, name, fn_name)
  if axis is None:
    axes: tuple = tuple(range(logits.ndim))
  elif isinstance(axis, (tuple, list)) and all(
      isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_)) for a in axis):
    axes = tuple(int(a) for a in axis)
  else:
    raise ValueError(f"{fn_name}: `axis` must be an int, a tuple of ints or None, got {axis!r}")
  named = tuple(nc.canonical_axis(a, logits.ndim, fn_name) for a in axes)
  if where is not None and jnp.ndim(where) == logits.ndim - len(set(named)):
    where = jnp.expand_dims(jnp.asarray(where), named)
  x, where, _, _ = nc.merge_axes(logits, axes, where, {}, fn_name)
  merged = []
  for key, a in like.items():
    if a is not None and jnp.ndim(a) == logits.ndim:
      a = jnp.asarray(a)
      if a.shape != logits.shape:
        raise ValueError(f"{fn_name}: `{key}` of shape {a.shape} must have the shape of "
                         f"`{name}` {logits.shape}")
      a = nc.merge_axes(a, axes, None, {}, fn_name)[0]
    merged.append(a)
  return x, where, -1, tuple(merged)


def example_where(where, logits_ndim: int, axis: int):
  """optax's convention: a mask with one dimension fewer is per example."""
  if where is None:
    return None
  where = jnp.asarray(where)
  if where.ndim == logits_ndim - 1:
    where = jnp.expand_dims(where, axis)
  return where


def prepare(logits, axis: int, where, fn_name: str) -> tuple[jax.Array, jax.Array, int]:
  """Returns ``(x, mask, axis)``: float32 logits with 0 at masked entries, the mask.

  ``mask`` is False for ``where=False`` entries, ``-inf`` logits and every class of a
  masked example; ``x`` is safe to differentiate everywhere.
  """
  logits = check_logits(logits, fn_name)
  axis = nc.canonical_axis(axis, logits.ndim, fn_name)
  return nc.prepare(logits, axis, example_where(where, logits.ndim, axis), fn_name)


def prepare_logits(logits, axis: int, where,
                   fn_name: str) -> tuple[jax.Array, jax.Array, int, Any]:
  """:func:`prepare` and the dtype the loss comes back in: ``(x, mask, axis, dtype)``."""
  logits = check_logits(logits, fn_name)
  x, mask, axis = prepare(logits, axis, where, fn_name)
  return x, mask, axis, logits.dtype


def check_probability_labels(labels, logits_shape, fn_name: str, hint: str = ""):
  """Probability targets: same shape as ``logits``, returned as float32."""
  labels = jnp.asarray(labels)
  if labels.shape != tuple(logits_shape):
    raise ValueError(
        f"{fn_name}: `labels` of shape {labels.shape} must have the shape of `logits` "
        f"{tuple(logits_shape)} (probability targets){hint}")
  if jnp.issubdtype(labels.dtype, jnp.floating):
    return labels.astype(nc.compute_dtype(labels.dtype))
  return labels.astype(jnp.float32)


def check_integer_labels(labels, logits_shape, axis: int, fn_name: str):
  """Integer labels: an integer array of ``logits``' shape without ``axis``."""
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"{fn_name}: `labels` must have an integer dtype, got {labels.dtype}")
  expected = tuple(logits_shape[:axis]) + tuple(logits_shape[axis + 1:])
  if labels.shape != expected:
    raise ValueError(
        f"{fn_name}: `labels` of shape {labels.shape} must have the shape of `logits` "
        f"{tuple(logits_shape)} without the class axis {axis}, i.e. {expected}")
  return labels


def integer_or_probability_labels(labels, x, mask, axis: int, ignore_index, fn_name: str):
  """Integer class labels or probability targets, told apart by their dtype.

  Returns ``(labels, None)`` for integer labels (checked against ``x`` without ``axis``)
  and ``(None, y)`` for probability targets (``x``'s shape, float32, 0 at masked entries);
  ``ignore_index`` applies to integer labels only.
  """
  labels = jnp.asarray(labels)
  if jnp.issubdtype(labels.dtype, jnp.integer):
    return check_integer_labels(labels, x.shape, axis, fn_name), None
  if ignore_index is not None:
    raise ValueError(f"{fn_name}: `ignore_index` applies to integer labels only")
  return None, jnp.where(mask, check_probability_labels(labels, x.shape, fn_name), 0.0)


def check_labels(labels, shape, fn_name: str, name: str = "labels",
                 what: str = "") -> jax.Array:
  """Integer ``labels`` of exactly ``shape`` (``what`` says where that shape comes from)."""
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"{fn_name}: `{name}` must have an integer dtype, got {labels.dtype}")
  if labels.shape != tuple(shape):
    raise ValueError(f"{fn_name}: `{name}` of shape {labels.shape} must have shape "
                     f"{tuple(shape)}{f' ({what})' if what else ''}")
  return labels


def example_labels(labels, shape, where, ignore_index,
                   fn_name: str) -> tuple[jax.Array, jax.Array]:
  """:func:`check_labels` and :func:`example_keep`: ``(labels, keep)``."""
  labels = check_labels(labels, shape, fn_name)
  return labels, example_keep(where, labels, ignore_index, fn_name)


def example_keep(where, labels, ignore_index, fn_name: str) -> jax.Array:
  """The examples that count: ``where`` (of ``labels``' shape) and not ``ignore_index``."""
  ignore_index = check_ignore_index(ignore_index, fn_name)
  keep = jnp.ones(labels.shape, bool)
  if where is not None:
    where = jnp.asarray(where)
    if where.shape != labels.shape:
      raise ValueError(f"{fn_name}: `where` of shape {where.shape} must have `labels`' shape "
                       f"{labels.shape} (one flag per example)")
    keep = where.astype(bool)
  return drop_ignored(keep, labels, ignore_index)


def drop_ignored(keep, labels, ignore_index):
  """``keep`` without the examples whose label is ``ignore_index`` (None: all kept)."""
  return keep if ignore_index is None else keep & (labels != ignore_index)


def nonnegative_float(value, name: str, fn_name: str, upper: float | None = None) -> float:
  """A static float in ``[0, upper)`` (``[0, inf)`` without ``upper``); ValueError otherwise."""
  v = finite_float(value, name, fn_name)
  if v < 0 or (upper is not None and not v < upper):
    rng = f"[0, {upper:.6g})" if upper is not None else "[0, inf)"
    raise ValueError(f"{fn_name}: `{name}` must be in {rng}, got {value!r}")
  return v


def int_in_range(value, name: str, lo: int, hi: int, fn_name: str, hint: str = "") -> int:
  """``value`` as an int in ``[lo, hi]`` (``hint`` ends the error message)."""
  if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
      or not lo <= value <= hi):
    raise ValueError(f"{fn_name}: `{name}` must be an int in [{lo}, {hi}]{hint}, got {value!r}")
  return int(value)


def check_ignore_index(ignore_index, fn_name: str):
  if ignore_index is None:
    return None
  if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(ignore_index, (int, np.integer)):
    raise ValueError(f"{fn_name}: `ignore_index` must be an int or None, got {ignore_index!r}")
  return int(ignore_index)


def check_label_smoothing(label_smoothing, fn_name: str):
  """``label_smoothing`` in [0, 1); concrete values are checked at trace time."""
  try:
    v = float(label_smoothing)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return label_smoothing  # a traced value: the caller vouches for it
  if not 0.0 <= v < 1.0:
    raise ValueError(f"{fn_name}: `label_smoothing` must be in [0, 1), got {label_smoothing}")
  return label_smoothing


def gather_label(x, mask, labels, axis: int):
  """The label's logit and whether the label names a visible class of its row.

  A label outside ``[0, n)`` or on a masked class is *not visible*: its logit is taken as
  0 (so no NaN flows anywhere) and the caller decides what the loss is.
  """
  n = x.shape[axis]
  in_range = (labels >= 0) & (labels < n)
  if _sharded_along(x, axis):
    # A gather along a sharded class axis has no unambiguous output sharding (explicit
    # meshes refuse it): select the label's entry with a one-hot mask and sum instead.
    hit = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis) == jnp.expand_dims(labels, axis)
    hit = jax.sharding.reshard(hit, jax.typeof(x).sharding.spec)
    x_y = jnp.sum(jnp.where(hit, x, jnp.zeros_like(x)), axis=axis)
    m_y = jnp.any(hit & mask, axis=axis)
    return x_y, in_range & m_y
  idx = jnp.expand_dims(jnp.where(in_range, labels, 0), axis)
  x_y = jnp.take_along_axis(x, idx, axis=axis).squeeze(axis)
  m_y = jnp.take_along_axis(mask, idx, axis=axis).squeeze(axis)
  return x_y, in_range & m_y


def _sharded_along(x, axis: int) -> bool:
  """Whether ``x`` is sharded along ``axis`` in its type (an explicit-sharding mesh)."""
  try:
    spec = jax.typeof(x).sharding.spec
  except (AttributeError, TypeError):
    return False
  return axis < len(spec) and spec[axis] is not None


def at_rank(a, ndim: int):
  """``a`` with leading size-1 axes up to rank ``ndim`` (numpy's right-aligned broadcast made
  explicit, so that it combines with a rank-``ndim`` array without implicit rank promotion)."""
  a = jnp.asarray(a)
  return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def one_hot(labels, n: int, axis: int, dtype=jnp.float32):
  """One-hot along ``axis``; labels outside [0, n) give an all-zero row."""
  return jnp.moveaxis(jax.nn.one_hot(labels, n, dtype=dtype), -1, axis)


def masked_logsumexp(x, mask, axis: int):
  """log sum_{visible} e^x (no keepdims) and the row's visible flag; 0 for empty rows.

  The max shift carries no gradient (it cancels), so the gradient is the masked
  softmax, free of NaN for fully masked rows. A NaN at a visible entry makes the sum NaN,
  and that row is *visible* (its LSE is NaN, so the caller's loss is NaN, as optax's):
  only a sum of exactly 0 (nothing visible) is an empty row.
  """
  m = nc.masked_max(x, mask, axis)
  s = jnp.sum(jnp.where(mask, jnp.exp(x - m), 0.0), axis=axis, keepdims=True)
  any_visible = s != 0  # True for a NaN sum (`s > 0` would take it for an empty row)
  lse = jnp.log(jnp.where(any_visible, s, 1.0)) + m
  return lse.squeeze(axis), any_visible.squeeze(axis)


def integer_cross_entropy(x, mask, labels, axis: int):
  """Softmax CE of integer labels over the visible entries, before :func:`integer_finish`:
  ``(LSE - x_y, the row's visible flag, the label's visible flag)``."""
  lse, visible = masked_logsumexp(x, mask, axis)
  x_y, label_visible = gather_label(x, mask, labels, axis)
  return lse - x_y, visible, label_visible


def finish(loss, keep, dtype):
  """0 (with zero gradient) where ``keep`` is False, then the logits' dtype."""
  return jnp.where(keep, loss, jnp.zeros_like(loss)).astype(dtype)


def integer_finish(loss, labels, visible, label_visible, ignore_index, dtype):
  """The edge cases of integer-label losses, then :func:`finish`.

  Loss 0 (zero gradient) for rows with no visible class and for ``labels == ignore_index``;
  ``+inf`` where the label names no visible class.
  """
  keep = drop_ignored(visible, labels, ignore_index)
  return finish(jnp.where(label_visible, loss, jnp.inf), keep, dtype)


def check_hidden_and_weights(h, w, fn: str, w_name: str = "w") -> tuple[jax.Array, jax.Array]:
  """``h [..., d]`` and ``w [d, N]`` as arrays, checked: floating dtypes, a feature axis,
  ``w``'s first axis equal to d and at least one column (ValueError naming the argument).

  (Callers that promote integer inputs pass them through :func:`float_input` first.)"""
  h = jnp.asarray(h)
  w = jnp.asarray(w)
  for name, a in (("h", h), (w_name, w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{fn}: `{name}` must have a floating dtype, got {a.dtype}")
  if h.ndim < 1:
    raise ValueError(f"{fn}: `h` must have a feature axis ([..., d]), got a scalar")
  if w.ndim != 2 or w.shape[0] != h.shape[-1]:
    raise ValueError(f"{fn}: `{w_name}` must be [d, N] with d = {h.shape[-1]} (the last axis "
                     f"of `h`), got shape {w.shape}")
  if w.shape[1] == 0:
    raise ValueError(f"{fn}: `{w_name}` must have at least one column, got shape {w.shape}")
  return h, w
