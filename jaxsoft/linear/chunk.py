"""Chunk reshaping, padding and segment (packed-sequence) handling for the linear family.

Segments are turned into *run ids*: ``run[b, t]`` counts the segment changes up to ``t``
(``run[b, 0] = 0``), so two tokens share a run iff no change lies between them, even when
an id comes back later (``[1, 2, 1]`` is three runs). The recurrence resets where the run
changes; the chunked and parallel forms turn that into masks (never into an infinite log
decay, which would make the cumulative log decays ``-inf - -inf``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["run_ids", "pad_time", "to_chunks", "from_chunks"]


def run_ids(segment_ids: jax.Array | None, B: int, T: int) -> jax.Array:
  """``[B, T]`` int32 run ids (all zeros without segments)."""
  if segment_ids is None:
    return jnp.zeros((B, T), jnp.int32)
  change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
  return jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.cumsum(change, axis=1)], axis=1)


def pad_time(x: jax.Array, axis: int, pad: int, mode: str = "zero") -> jax.Array:
  """Pads ``pad`` steps at the end of ``axis``: zeros, or (``mode="edge"``) the last value.

  Padded tokens have ``k = v = q = 0``, ``g = 0`` and ``beta = 0`` and keep the last run id,
  so they change neither the outputs nor the final state.
  """
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, mode="edge" if mode == "edge" else "constant")


def to_chunks(x: jax.Array, axis: int, chunk: int) -> jax.Array:
  """Splits ``axis`` (a multiple of ``chunk``) into ``[n_chunks, chunk]``."""
  shape = x.shape
  return x.reshape(shape[:axis] + (shape[axis] // chunk, chunk) + shape[axis + 1:])


def from_chunks(x: jax.Array, axis: int) -> jax.Array:
  """Merges ``[n_chunks, chunk]`` at ``axis, axis + 1`` back into one axis."""
  shape = x.shape
  return x.reshape(shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2:])
