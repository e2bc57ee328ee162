"""Argument checks shared by the attention variants (private to ``jaxsoft.attention``).

Each raises a ``ValueError`` that names the function and the argument, as
``jaxsoft._validation``'s checks do; these two are the attention-specific ones (an
array's rank with its layout in the message, an int in a range).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["check_rank", "check_int"]


def check_rank(x: Any, name: str, rank: int, layout: str, fn: str) -> jax.Array:
  """``x`` as an array of rank ``rank``; ValueError naming ``fn``, ``name`` and ``layout``."""
  x = jnp.asarray(x)
  if x.ndim != rank:
    raise ValueError(f"{fn}: `{name}` must have shape {layout}, got {x.shape}")
  return x


def check_int(value: Any, name: str, low: int, fn: str, high: int | None = None) -> int:
  """``value`` as a Python int in ``[low, high]`` (no upper bound when ``high`` is None).

  Bools are refused; ValueError naming ``fn`` and ``name`` otherwise.
  """
  bad = isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
  if bad or (high is not None and value > high):
    rng = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{fn}: `{name}` must be an int {rng}, got {value!r}")
  return int(value)
