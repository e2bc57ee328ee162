"""``sharded_attention``: the kernel under ``jax.shard_map`` over batch and heads.

Pallas calls are not auto-partitioned by XLA; a jitted data-parallel (or head-parallel)
step calls the kernel through this wrapper, which runs it on each device's shard. Every
array with a batch or head axis is split like q: q/k/v, the array hyperparameters, the
dense ``bias`` / ``mask`` (a broadcast axis of size 1 stays whole on every device) and
FoX's ``decay_bias``.

``jaxsoft.attention.dot_product_attention(implementation="pallas")`` routes a call whose
inputs carry a mesh sharding (:func:`call_layout`) through the same ``shard_map``
(:func:`sharded_attention_from_call`), so a batch sharded outside ``shard_map`` gives the
unsharded call's result, sharded like q.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# The module, not its names: jaxsoft.attention imports this module while kernels_pallas._api
# is still loading (kernels_pallas._api -> jaxsoft.attention.call -> jaxsoft -> here).
from kernels_pallas import _api

__all__ = ["sharded_attention", "sharded_attention_from_call", "call_layout"]


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
  static = {name: x for name, x in params.items() if _api.is_static(x)}
  dyn_names = sorted(set(params) - set(static))
  dyn = [_api.rows(params[name], b, n, t) for name in dyn_names]
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
    return _api.attention(q_, k_, v_, bias_, mask_, normalizer_params=hp, segment_ids=seg_,
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



def _named_sharding(x) -> NamedSharding | None:
  """The NamedSharding ``x`` carries: a concrete array's own (its Auto or Explicit axes),
  a tracer's type (only Explicit axes are known at trace time), or None."""
  s = None
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    s = x.sharding
  else:
    try:
      s = jax.typeof(x).sharding
    except (AttributeError, TypeError):
      return None
  return s if isinstance(s, NamedSharding) else None


def _axes(entry) -> tuple:
  """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _size(mesh, entry) -> int:
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  out = 1
  for name in _axes(entry):
    out *= sizes[name]
  return out


def call_layout(call) -> tuple[Any, Any, Any] | None:
  """``(mesh, batch_axis, head_axis)`` of a call whose q, k or v is sharded over a mesh
  (outside ``jax.shard_map``), or None.

  The batch and head axes are q's (dimensions 0 and 2 of ``[B, T, N, H]``); a head axis
  that does not divide the key/value heads K is dropped (each shard must hold whole GQA
  groups: the heads stay whole), and a sharded sequence or feature dimension is gathered.
  Under ``jit`` only Explicit mesh axes are visible in an array's type; Auto axes are seen
  on concrete (eager) arrays only.

  Examples:
    >>> from jaxsoft.attention.call import AttentionCall
    >>> from kernels_pallas.sharding import call_layout
    >>> q = jnp.ones((2, 16, 2, 16))
    >>> call_layout(AttentionCall.create(q, q, q)) is None   # one device, no mesh
    True
  """
  shardings = [_named_sharding(x) for x in (call.q, call.k, call.v)]
  named = [s for s in shardings if s is not None and any(_axes(e) for e in s.spec)]
  if not named:
    return None
  mesh = named[0].mesh
  if any(t == jax.sharding.AxisType.Manual for t in getattr(mesh, "axis_types", ())):
    return None  # inside shard_map: the caller split the arrays
  entries = tuple(shardings[0].spec) if shardings[0] is not None else ()
  entries += (None,) * (4 - len(entries))
  batch, head = (e if _axes(e) else None for e in (entries[0], entries[2]))
  b, n, kh = call.q.shape[0], call.q.shape[2], call.k.shape[2]
  if batch is not None and b % _size(mesh, batch):
    batch = None
  if head is not None and (n % _size(mesh, head) or kh % _size(mesh, head)):
    head = None
  return mesh, batch, head


def sharded_attention_from_call(call, mesh, batch_axis: Any = None, head_axis: Any = None,
                                **kwargs):
  """:func:`kernels_pallas.attention_from_call` under ``jax.shard_map``: each device runs
  the kernel on its shard of the batch (``batch_axis``) and heads (``head_axis``).

  What ``dot_product_attention(implementation="pallas")`` runs for sharded inputs
  (:func:`call_layout`). Every array of ``call`` with a batch or head axis is split like
  q (dense ``bias`` / ``mask`` only along the axes they hold in full, per-row
  hyperparameters broadcast to ``[B, N, T, 1]``); the rest is replicated.

  Args:
    call: a validated :class:`jaxsoft.attention.call.AttentionCall` (no PRNG key).
    mesh: the mesh (concrete or abstract) holding the axes.
    batch_axis, head_axis: mesh axis names (or tuples of names), or None.
    **kwargs: the kernel's settings, as for :func:`kernels_pallas.attention_from_call`.

  Returns:
    The output ``[B, T, N, Hv]`` sharded like q (with ``call.return_residual``, also the
    residual ``[B, T, N]``).

  Examples:
    >>> from jaxsoft.attention.call import AttentionCall
    >>> from kernels_pallas.sharding import sharded_attention_from_call
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> q = jax.random.normal(jax.random.key(0), (2, 16, 2, 16))
    >>> call = AttentionCall.create(q, q, q, is_causal=True)
    >>> o = sharded_attention_from_call(call, mesh, "data", backend="triton", interpret=True)
    >>> ref = js.attention.dot_product_attention(q, q, q, is_causal=True, implementation="xla")
    >>> o.shape, bool(jnp.allclose(o, ref, atol=1e-5))
    ((2, 16, 2, 16), True)
  """
  b, t, n, _ = call.q.shape
  qkv = P(batch_axis, None, head_axis, None)
  row = P(batch_axis, head_axis, None, None)
  static = {name: x for name, x in call.params.items() if _api.is_static(x)}
  dyn_names = sorted(set(call.params) - set(static))

  def dense(x):  # [B|1, N|1, T|1, S|1]: split the batch / head axes it holds in full
    return None if x is None else P(batch_axis if x.shape[0] > 1 else None,
                                     head_axis if x.shape[1] > 1 else None, None, None)

  fields = dict(q=call.q, k=call.k, v=call.v, bias=call.bias, mask=call.mask,
                query_seq_lengths=call.query_seq_lengths,
                key_value_seq_lengths=call.key_value_seq_lengths,
                segment_ids=call.segment_ids, decay_bias=call.decay_bias,
                scale=None if _api.is_static(call.scale) else call.scale)
  specs = dict(q=qkv, k=qkv, v=qkv, bias=dense(call.bias), mask=dense(call.mask),
               query_seq_lengths=P(batch_axis), key_value_seq_lengths=P(batch_axis),
               segment_ids=(P(batch_axis, None),) * 2,
               decay_bias=(P(batch_axis, None, head_axis),) * 2, scale=P())
  specs = {name: (None if fields[name] is None else sp) for name, sp in specs.items()}
  fields["params"] = [_api.rows(call.params[name], b, n, t) for name in dyn_names]
  specs["params"] = [row] * len(dyn_names)
  fields = jax.tree_util.tree_map(lambda x, sp: _put(mesh, x, sp), fields, specs,
                                  is_leaf=lambda x: x is None)

  def local(f):
    f = dict(f)
    params = {**static, **dict(zip(dyn_names, f.pop("params"), strict=True))}
    if f["scale"] is None:
      f["scale"] = call.scale
    return _api.attention_from_call(dataclasses.replace(call, params=params, **f), **kwargs)

  out_specs: P | tuple[P, P] = qkv
  if call.return_residual:  # (out, residual [B, T, N])
    out_specs = (qkv, P(batch_axis, None, head_axis))
  fn = jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_specs,
                     check_vma=False)
  # eagerly (concrete arrays), one compiled program instead of shard_map's op-by-op run
  return (fn if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(fields))
          else jax.jit(fn))(fields)


def _put(mesh, x, spec):
  """``x`` laid out as ``spec``: a concrete array is placed, a traced one resharded."""
  if x is None or spec is None:
    return x
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return jax.device_put(x, NamedSharding(mesh, spec))
  return _place(mesh, x, spec)
