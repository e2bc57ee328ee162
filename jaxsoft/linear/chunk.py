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

__all__ = ["run_ids", "pad_time", "to_chunks", "from_chunks", "vary_like", "sum_like"]


def run_ids(segment_ids: jax.Array | None, B: int, T: int,
            like: jax.Array | None = None) -> jax.Array:
  """``[B, T]`` int32 run ids (all zeros without segments).

  Built from the inputs (``segment_ids``, else ``like``: a ``[B, T, ...]`` input), never
  from ``jnp.zeros(shape)``, so that the ids carry the batch sharding of an explicit mesh
  and the varying axes of ``jax.shard_map``, as the loops over them need."""
  if segment_ids is None:
    if like is None:
      return jnp.zeros((B, T), jnp.int32)
    # A reduction, not an index: selecting entry 0 of a head axis sharded on an explicit
    # mesh is refused by JAX's sharding rules; a sum over it is not.
    return jnp.zeros_like(jnp.sum(like, axis=tuple(range(2, like.ndim))), dtype=jnp.int32)
  change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
  first = jnp.zeros_like(segment_ids[:, :1], dtype=jnp.int32)
  return jnp.concatenate([first, jnp.cumsum(change, axis=1)], axis=1)


def _varying(x) -> frozenset:
  """The mesh axes ``x`` varies over inside ``jax.shard_map`` (empty elsewhere)."""
  axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset() if axis_type is None else frozenset(axis_type.varying)


def vary_like(x: jax.Array, *refs: jax.Array | None) -> jax.Array:
  """``x`` marked as varying over every ``jax.shard_map`` axis one of ``refs`` varies over.

  A loop carry must keep its type; a carry that starts from a state the caller left
  invariant (or from zeros) and is updated from varying inputs would change it
  ("loop carry types differ" under the default ``check_vma``). Outside ``shard_map``
  (and when nothing is missing) ``x`` comes back unchanged."""
  want = frozenset().union(*(_varying(r) for r in refs if r is not None))
  missing = tuple(sorted(want - _varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def pad_time(x: jax.Array, axis: int, pad: int, mode: str = "zero") -> jax.Array:
  """Pads ``pad`` steps at the end of ``axis``: zeros, or (``mode="edge"``) the last value.

  Padded tokens have ``k = v = q = 0``, ``g = 0`` and ``beta = 0`` and keep the last run id,
  so they change neither the outputs nor the final state.
  """
  if pad == 0:
    return x
  if mode == "edge":   # the last step repeated (jnp.pad's edge mode slices every axis,
    # which an explicit mesh refuses on the sharded batch axis)
    last = jax.lax.slice_in_dim(x, x.shape[axis] - 1, x.shape[axis], axis=axis)
    return jnp.concatenate([x, jnp.repeat(last, pad, axis=axis)], axis=axis)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def to_chunks(x: jax.Array, axis: int, chunk: int) -> jax.Array:
  """Splits ``axis`` (a multiple of ``chunk``) into ``[n_chunks, chunk]``."""
  shape = x.shape
  return x.reshape(shape[:axis] + (shape[axis] // chunk, chunk) + shape[axis + 1:])


def from_chunks(x: jax.Array, axis: int) -> jax.Array:
  """Merges ``[n_chunks, chunk]`` at ``axis, axis + 1`` back into one axis."""
  shape = x.shape
  return x.reshape(shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2:])


def sum_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """The cotangent ``ct`` summed over the ``jax.shard_map`` axes it varies over and
  ``primal`` does not (the transpose of :func:`vary_like`, as autodiff transposes
  ``pcast`` to varying): what a custom backward pass returns for an input the caller left
  invariant (a replicated weight used by every shard). Outside ``shard_map`` a no-op."""
  extra = tuple(sorted(_varying(ct) - _varying(primal)))
  return jax.lax.psum(ct, extra) if extra else ct
