"""Argument checks shared by every jaxsoft package (public inside the project).

Each check raises a ``ValueError`` that names the function and the argument, so a user
sees ``"sparsemax_loss: `temperature` must be > 0, got -1.0"`` rather than an error from
deep inside a computation. Traced values (under ``jit``, ``grad``, ``vmap``) cannot be
checked at trace time: the value checks let them through, and the callers document
what happens to an out-of-range traced value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["concrete", "positive_int", "head_layout", "check_positive", "finite_float",
           "boolean_mask"]

_TRACED = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError)


def concrete(x: Any, dtype: Any = None) -> np.ndarray | None:
  """``x`` as a NumPy array (of ``dtype`` when given), or None when it is traced.

  Examples:
    >>> from jaxsoft._validation import concrete
    >>> concrete([1, 2])
    array([1, 2])
    >>> seen = []
    >>> _ = jax.jit(lambda x: seen.append(concrete(x)) or x)(1.0)   # traced: None
    >>> seen
    [None]
  """
  try:
    return np.asarray(x, dtype=dtype)
  except (TypeError, *_TRACED):
    return None


def positive_int(value: Any, name: str, owner: str) -> int:
  """``value`` as a Python int >= 1; ValueError naming ``owner`` and ``name`` otherwise.

  Bools are refused (``True`` is an int to Python, never a size to a user).

  Examples:
    >>> from jaxsoft._validation import positive_int
    >>> positive_int(4, "num_heads", "MultiHeadAttention")
    4
    >>> positive_int(0, "num_heads", "MultiHeadAttention")
    Traceback (most recent call last):
    ...
    ValueError: MultiHeadAttention: `num_heads` must be a positive int, got 0
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")
  return int(value)


def head_layout(d_model: Any, num_heads: Any, head_dim: Any, owner: str) -> tuple[int, int, int]:
  """``(d_model, num_heads, head_dim)`` of a layer, each a positive int; ``head_dim=None``
  is ``d_model // num_heads``, which ``num_heads`` must divide.

  Examples:
    >>> from jaxsoft._validation import head_layout
    >>> head_layout(64, 4, None, "PoNetMixer")
    (64, 4, 16)
  """
  d = positive_int(d_model, "d_model", owner)
  n = positive_int(num_heads, "num_heads", owner)
  if head_dim is None:
    if d % n:
      raise ValueError(f"{owner}: `num_heads` ({n}) must divide `d_model` ({d}) when "
                       "`head_dim` is not given")
    head_dim = d // n
  return d, n, positive_int(head_dim, "head_dim", owner)


def check_positive(value: Any, name: str, owner: str) -> Any:
  """Returns ``value`` unchanged after checking that every concrete entry is finite and > 0.

  A traced value (a learned temperature, say) passes unchecked.

  Examples:
    >>> from jaxsoft._validation import check_positive
    >>> check_positive(0.5, "temperature", "f")
    0.5
    >>> check_positive(-1.0, "temperature", "f")
    Traceback (most recent call last):
    ...
    ValueError: f: `temperature` must be a finite number > 0, got -1.0
  """
  values = concrete(value, np.float64)
  if values is None:
    return value
  if not np.all(np.isfinite(values) & (values > 0)):
    shown = value if values.ndim == 0 or values.size <= 8 else f"an array with {values.size} entries"
    raise ValueError(f"{owner}: `{name}` must be a finite number > 0, got {shown!r}")
  return value


def finite_float(value: Any, name: str, owner: str) -> float:
  """``value`` as a finite Python float (static); ValueError naming it otherwise."""
  try:
    v = float(value)
  except (TypeError, ValueError, *_TRACED):
    raise ValueError(f"{owner}: `{name}` must be a Python number (static), got {value!r}") from None
  if not math.isfinite(v):
    raise ValueError(f"{owner}: `{name}` must be finite, got {value!r}")
  return v


def boolean_mask(value: Any, shape: tuple[int, ...], name: str, owner: str,
                 target: str) -> jax.Array:
  """``value`` as a boolean array broadcast to ``shape``; ValueError naming it otherwise.

  ``target`` names what the mask must fit (e.g. ```logits```), for the message.
  """
  m = jnp.asarray(value)
  if m.dtype != jnp.bool_:
    raise ValueError(f"{owner}: `{name}` must be boolean, got {m.dtype}")
  try:
    return jnp.broadcast_to(m, shape)
  except (ValueError, TypeError):
    raise ValueError(f"{owner}: `{name}` of shape {m.shape} does not broadcast to {target} "
                     f"{tuple(shape)}") from None
