"""``sharded_attention``: the kernel under ``jax.shard_map`` over batch and heads.

Pallas calls are not auto-partitioned by XLA; a jitted data-parallel (or head-parallel)
step calls the kernel through this wrapper, which runs it on each device's shard. Every
array with a batch or head axis is split like q: q/k/v, the array hyperparameters, the
dense ``bias`` / ``mask`` (a broadcast axis of size 1 stays whole on every device) and
FoX's ``decay_bias``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas._api import attention, is_static, rows

__all__ = ["sharded_attention"]


def sharded_attention(mesh, q, k, v, bias=None, mask=None, *, batch_axis: Any = "data",
                      head_axis: Any = None, normalizer_params=None, segment_ids=None,
                      query_seq_lengths=None, key_value_seq_lengths=None, decay_bias=None,
                      **kwargs):
  """:func:`kernels_pallas.attention` on a mesh: each device runs it on its shard.

  q ``[B, T, N, H]`` and k/v ``[B, S, K, H]`` are split over ``batch_axis`` (B) and
  ``head_axis`` (N and K; K must divide by that axis's size so each shard keeps whole GQA
  groups); sequences stay whole. Array hyperparameters are broadcast to the rows
  ``[B, N, T, 1]`` and split the same way. A dense ``bias`` / ``mask`` (broadcastable to
  ``[B, N, T, S]``, e.g. ``[B, 1, T, S]`` or ``[T, S]``) is split along the batch and
  head axes it holds in full; an axis of size 1 is not copied but kept whole on every
  device (its gradient is summed over the devices sharing it). FoX's ``decay_bias``
  ``(cq [B, T, N], ck [B, S, N])`` is split over B and N. Everything else is passed
  through.

  Args:
    mesh: a ``jax.sharding.Mesh`` (or abstract mesh) holding the named axes.
    q, k, v, bias, mask: as for :func:`kernels_pallas.attention`.
    batch_axis, head_axis: mesh axis names (or None to keep that dimension whole).
    normalizer_params, segment_ids, query_seq_lengths, key_value_seq_lengths,
      decay_bias, **kwargs: as for :func:`kernels_pallas.attention`.

  Returns:
    The attention output ``[B, T, N, H]``, sharded like q (with ``return_residual=True``,
    the pair ``(out, residual [B, T, N])``).

  Examples:
    A one-device mesh (a data-parallel step's on one CPU), interpret mode, against the
    dense path:

    >>> from jaxsoft.attention import dot_product_attention
    >>> from kernels_pallas import sharded_attention
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> q = jax.random.normal(jax.random.key(0), (1, 16, 2, 16))   # [B, T, N, H]
    >>> run = jax.jit(lambda q: sharded_attention(mesh, q, q, q, is_causal=True,
    ...                                           backend="triton", interpret=True))
    >>> o = run(q)
    >>> dense = jax.jit(lambda q: dot_product_attention(q, q, q, is_causal=True,
    ...                                                 implementation="xla"))
    >>> o.shape, bool(jnp.allclose(o, dense(q), atol=1e-5))
    ((1, 16, 2, 16), True)

  References:
    T. Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning" (the kernel run on each shard).
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
  bias, bias_spec = _dense(bias, "bias", batch_axis, head_axis)
  mask, mask_spec = _dense(mask, "mask", batch_axis, head_axis)
  decay, decay_spec = None, None
  if decay_bias is not None:
    try:
      decay = tuple(jnp.asarray(x) for x in decay_bias)
    except TypeError:
      decay = ()
    if len(decay) != 2:
      raise ValueError("`decay_bias` must be a pair (cq [B, T, N], ck [B, S, N])")
    decay_spec = (P(batch_axis, None, head_axis),) * 2

  def local(q_, k_, v_, dyn_, seg_, ql_, kl_, bias_, mask_, decay_):
    hp = dict(static)
    hp.update(zip(dyn_names, dyn_, strict=True))
    return attention(q_, k_, v_, bias_, mask_, normalizer_params=hp, segment_ids=seg_,
                     query_seq_lengths=ql_, key_value_seq_lengths=kl_, decay_bias=decay_,
                     **kwargs)

  in_specs = (qkv, qkv, qkv, [row] * len(dyn), seg_spec, None if ql is None else blen,
              None if kl is None else blen, bias_spec, mask_spec, decay_spec)
  args = (q, k, v, dyn, seg, ql, kl, bias, mask, decay)
  args = jax.tree_util.tree_map(lambda x, sp: _place(mesh, x, sp), args, in_specs,
                                is_leaf=lambda x: x is None)
  out_specs: P | tuple[P, P] = qkv
  if kwargs.get("return_residual"):  # (out, residual [B, T, N])
    out_specs = (qkv, P(batch_axis, None, head_axis))
  fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                     check_vma=False)
  return fn(*args)


def _dense(x, name: str, batch_axis, head_axis):
  """A dense bias or mask as 4-D ``[B|1, N|1, T|1, S|1]`` and its spec: the batch and
  head axes it holds in full are split like q's, an axis of size 1 stays whole."""
  if x is None:
    return None, None
  x = jnp.asarray(x)
  if x.ndim > 4:
    raise ValueError(f"`{name}` must have at most 4 dimensions [B, N, T, S], got shape "
                     f"{x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  return x, P(batch_axis if x.shape[0] > 1 else None, head_axis if x.shape[1] > 1 else None,
              None, None)


def _place(mesh, x, spec):
  """Lays ``x`` out as ``spec`` on the mesh (explicit axes need a reshard, not a hint)."""
  if x is None or spec is None:
    return x
  explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
  if explicit:
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

