"""``sharded_attention``: the kernel under ``jax.shard_map`` over batch and heads.

Pallas calls are not auto-partitioned by XLA; a jitted data-parallel (or head-parallel)
step calls the kernel through this wrapper, which runs it on each device's shard.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas._api import attention, is_static, rows

__all__ = ["sharded_attention"]


def sharded_attention(mesh, q, k, v, *, batch_axis: Any = "data", head_axis: Any = None,
                      normalizer_params=None, segment_ids=None,
                      query_seq_lengths=None, key_value_seq_lengths=None, **kwargs):
  """:func:`kernels_pallas.attention` on a mesh: each device runs it on its shard.

  q ``[B, T, N, H]`` and k/v ``[B, S, K, H]`` are split over ``batch_axis`` (B) and
  ``head_axis`` (N and K; K must divide by that axis's size so each shard keeps whole GQA
  groups); sequences stay whole. Array hyperparameters are broadcast to the rows
  ``[B, N, T, 1]`` and split the same way. Everything else is passed through.

  Args:
    mesh: a ``jax.sharding.Mesh`` (or abstract mesh) holding the named axes.
    q, k, v: as for :func:`kernels_pallas.attention`.
    batch_axis, head_axis: mesh axis names (or None to keep that dimension whole).
    normalizer_params, segment_ids, query_seq_lengths, key_value_seq_lengths,
      **kwargs: as for :func:`kernels_pallas.attention`.

  Returns:
    The attention output ``[B, T, N, H]``, sharded like q.
  """
  b, t, n, _ = q.shape
  qkv = P(batch_axis, None, head_axis, None)
  row = P(batch_axis, head_axis, None, None)
  params = dict(normalizer_params or {})
  static = {name: x for name, x in params.items() if is_static(x)}
  dyn_names = sorted(set(params) - set(static))
  dyn = [rows(params[name], b, n, t) for name in dyn_names]
  seg = segment_ids
  seg_spec = None
  if seg is not None:
    seg_spec = (P(batch_axis, None), P(batch_axis, None)) if isinstance(seg, (tuple, list)) \
        else P(batch_axis, None)
    seg = tuple(seg) if isinstance(seg, (tuple, list)) else seg
  ql, kl = query_seq_lengths, key_value_seq_lengths
  blen = P(batch_axis)

  def local(q_, k_, v_, dyn_, seg_, ql_, kl_):
    hp = dict(static)
    hp.update(zip(dyn_names, dyn_, strict=True))
    return attention(q_, k_, v_, normalizer_params=hp, segment_ids=seg_,
                     query_seq_lengths=ql_, key_value_seq_lengths=kl_, **kwargs)

  in_specs = (qkv, qkv, qkv, [row] * len(dyn), seg_spec, None if ql is None else blen,
              None if kl is None else blen)
  args = (q, k, v, dyn, seg, ql, kl)
  args = jax.tree_util.tree_map(lambda x, sp: _place(mesh, x, sp), args, in_specs,
                                is_leaf=lambda x: x is None)
  fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=qkv, check_vma=False)
  return fn(*args)


def _place(mesh, x, spec):
  """Lays ``x`` out as ``spec`` on the mesh (explicit axes need a reshard, not a hint)."""
  if x is None or spec is None:
    return x
  explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
  if explicit:
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

