"""The contract every pooling function keeps (private): argument checks, masks, empty
pools, the reduced shape and the output dtype.

The pooling functions follow the normalizers' numerics policy (jaxsoft.normalizers.common):
masked entries are left out exactly, a pool with no visible entry gives 0 with a zero
gradient, low-precision inputs are computed in float32 and returned in their dtype.
:func:`pool` runs a reduction of one axis under that contract; :func:`prepare_sets` and
:func:`sets_out` do the same for the pooling of token sets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.normalizers import common as c


def check_range(value, name: str, fn_name: str, *, low: float | None = None,
                low_open: bool = False, high: float | None = None,
                high_open: bool = False) -> None:
  """ValueError naming ``name`` when a *concrete* value (scalar or array) is out of range.

  Traced values are not checked (they are only known at run time).
  """
  if value is None or isinstance(value, jax.core.Tracer):
    return
  try:
    v = np.asarray(value, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"{fn_name}: `{name}` must be a number or an array of numbers, "
                     f"got {value!r}") from None
  if v.size == 0:
    return
  if np.any(np.isnan(v)):
    raise ValueError(f"{fn_name}: `{name}` must not be NaN")
  if low is not None and np.any((v <= low) if low_open else (v < low)):
    op = ">" if low_open else ">="
    raise ValueError(f"{fn_name}: `{name}` must be {op} {low}, got {value}")
  if high is not None and np.any((v >= high) if high_open else (v > high)):
    op = "<" if high_open else "<="
    raise ValueError(f"{fn_name}: `{name}` must be {op} {high}, got {value}")


def check_bool(value, name: str, fn_name: str) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{fn_name}: `{name}` must be a bool, got {value!r}")


def reduce_out(out, axis: int, keepdims: bool, dtype):
  """``out`` (keepdims along ``axis``) squeezed unless ``keepdims``, in the output dtype."""
  if not keepdims:
    out = jnp.squeeze(out, axis=axis)
  return out.astype(c.output_dtype(dtype))


def any_visible(mask, axis: int):
  return jnp.any(mask, axis=axis, keepdims=True)


def mean_weights(mask, axis: int, dtype):
  """``1/n`` on the n visible entries of each pool, 0 elsewhere (0 for an empty pool)."""
  n = c.visible_count(mask, axis, dtype)
  return c.safe_divide(mask.astype(dtype), n)


def empty_result(x, axis: int, keepdims: bool):
  """Zeros for an input whose pooled axis has length 0 (the reduced shape, output dtype)."""
  shape = list(x.shape)
  if keepdims:
    shape[axis] = 1
  else:
    del shape[axis]
  return jnp.zeros(tuple(shape), c.output_dtype(x.dtype))


def pool(reduce, x, axis: int, where, keepdims, fn_name: str):
  """``reduce(xs, mask, ax)``, a pooled value keepdims along ``ax``, under the contract.

  Checks ``keepdims``; prepares ``x`` as the normalizers do (``common.prepare``: validated,
  upcast, masked entries holding a visible value of their pool); gives zeros of the
  reduced shape for a pooled axis of length 0 without calling ``reduce``; and returns the
  pooled value squeezed unless ``keepdims``, in the output dtype.
  """
  check_bool(keepdims, "keepdims", fn_name)
  xs, mask, ax = c.prepare(x, axis, where, fn_name)
  if xs.shape[ax] == 0:
    return empty_result(jnp.asarray(x), ax, keepdims)
  return reduce_out(reduce(xs, mask, ax), ax, keepdims, jnp.asarray(x).dtype)


def prepare_sets(x, axis: int, where, fn_name: str):
  """Validates a set of vectors ``x [..., N, d]`` pooled over ``axis`` (not the last one).

  Returns ``(xs, mask, ax)``: ``xs`` upcast with the token axis moved to -2, masked token
  vectors replaced by zeros (no gradient reaches them), ``mask`` of shape ``xs.shape[:-1]``
  (``where`` broadcast to the token shape ``x.shape[:-1]``), and ``ax`` the canonical
  token axis of ``x``.
  """
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"{fn_name}: `x` must have a token axis and a feature axis (rank >= 2), "
                     f"got shape {x.shape}")
  ax = c.canonical_axis(axis, x.ndim, fn_name)
  if ax == x.ndim - 1:
    raise ValueError(f"{fn_name}: `axis` must be a token axis, not the last (feature) axis")
  xc = x.astype(c.compute_dtype(x.dtype))
  tok_shape = x.shape[:-1]
  if where is None:
    mask = jnp.ones(tok_shape, bool)
  else:
    w = jnp.asarray(where)
    try:
      mask = jnp.broadcast_to(w, tok_shape).astype(bool)
    except ValueError:
      raise ValueError(
          f"{fn_name}: `where` of shape {w.shape} does not broadcast to the token shape "
          f"{tuple(tok_shape)} of `x` (its shape without the feature axis)") from None
  xs = jnp.where(mask[..., None], xc, jnp.zeros_like(xc))
  return jnp.moveaxis(xs, ax, -2), jnp.moveaxis(mask, ax, -1), ax


def sets_out(out, ax: int, ndim: int, keepdims: bool, dtype):
  """A pooled ``[..., d]`` back in place: the token axis ``ax`` kept with size 1 if asked."""
  if keepdims:
    out = jnp.expand_dims(out, ax if ax < ndim - 1 else ndim - 2)
  return out.astype(c.output_dtype(dtype))
