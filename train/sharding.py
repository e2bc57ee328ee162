"""Devices, the mesh and how arrays are laid out on it.

The mesh has four named axes, outermost first (``--mesh data=N,fsdp=N,context=N,tensor=N``):

* ``data``: data parallelism; outermost, so on several hosts it spans the hosts (the slow links
  carry only the gradient all-reduce).
* ``fsdp``: the batch is split over it too, and so are the parameters and the optimizer state
  (ZeRO-3 style: XLA inserts the all-gathers and reduce-scatters). ``--fsdp true`` is shorthand
  for ``fsdp=-1``.
* ``context``: the sequence is split over it (context parallelism). Attention stays exact: the
  keys and values are gathered over ``context`` by sharding constraints (GSPMD); the linear
  mixers are left to GSPMD too.
* ``tensor``: Megatron-style tensor parallelism: the Q/K/V and MLP-up projections are split by
  output column (heads, MLP units), the attention output and MLP-down projections by input row,
  and the embedding and output matrices by vocabulary entry (vocab-parallel: with ``--loss
  dense`` the logits stay split over ``tensor`` and the softmax cross-entropy's max and sum
  are all-reduced across it, as Megatron-LM's vocab-parallel cross-entropy; with the default
  ``--loss linear_ce`` GSPMD partitions its chunked scan over the vocabulary as it can, and may
  gather the output matrix for the step, as it gathers every ``fsdp``-split matrix).

A batch ``[grad_accum, micro_batch, seq_len]`` is laid out ``P(None, ('data', 'fsdp'),
'context')``. Parameters carry Flax NNX logical axis names (``nnx.with_partitioning`` in
train.model, e.g. a query projection ``('embed', 'heads')``); :data:`LOGICAL_AXIS_RULES`, the one
table of this module, maps each logical name to a mesh axis. A dimension the mapped axes do not
divide is left unsplit (replicated) rather than refused, and parameters without names get the
FSDP rule: their largest dimension ``fsdp`` divides (the mixers of train.layers are named by
``train.layers.PARAMETER_NAMES``). Every mesh axis is
``AxisType.Auto`` (the train step is written for the compiler's sharding propagation, and the
default axis type of ``jax.make_mesh`` differs between JAX releases, so it is always passed).

Several slices (TPU multislice): ``--dcn_mesh data=N,...`` gives the axes' sizes across slices
and ``--mesh`` those within a slice; the mesh comes from
``jax.experimental.mesh_utils.create_hybrid_device_mesh`` (each process is a slice when the
devices do not name several slices, e.g. on CPU or GPU hosts).

Pallas kernels are not auto-partitioned, so a Pallas attention call runs under
``jax.shard_map`` over the batch axes (each shard sees the whole sequence and every head).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train.config import Config, ConfigError
from train.mesh_flags import CONTEXT, DATA, FSDP, MESH_AXES, TENSOR, context_strategies, parse_mesh

__all__ = ["setup_devices", "make_mesh", "check_batch", "batch_sharding", "state_sharding",
           "param_sharding", "state_specs", "global_batch", "needs_shard_map", "shard_map_attention", "DATA",
           "FSDP", "CONTEXT", "TENSOR", "MESH_AXES", "BATCH_AXES", "LOGICAL_AXIS_RULES",
           "parse_mesh", "resolve_mesh", "mesh_shape", "hybrid_mesh_shapes", "logical_spec",
           "logical_axes", "activate", "in_mesh", "constrain", "context_strategies",
           "context_parallel_wrap"]

BATCH_AXES = (DATA, FSDP)  # the batch rows are split over both

# The one table: logical axis name -> mesh axis (or axes, or None = replicated). Parameter names
# come from train.model's nnx.with_partitioning annotations; ``act_*`` names are activations,
# constrained with :func:`constrain` inside the model.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Parameters.
    ("embed", FSDP),        # the model width of every matrix (and the embedding's columns)
    ("heads", TENSOR),      # query heads x head_dim: Q column-parallel, O row-parallel
    ("kv_heads", TENSOR),   # key/value heads x head_dim: K, V column-parallel
    ("mlp", TENSOR),        # MLP units: up column-parallel, down row-parallel
    ("vocab", TENSOR),      # the embedding rows / output columns: vocab-parallel (Megatron)
    ("norm", None),         # RMSNorm scales: small, replicated
    # Activations.
    ("act_batch", BATCH_AXES),
    ("act_length", CONTEXT),
    ("act_embed", None),    # the residual stream is whole on every tensor shard (Megatron)
    ("act_heads", TENSOR),
    ("act_kv_heads", TENSOR),
    ("act_mlp", TENSOR),
    ("act_vocab", TENSOR),  # the logits of --loss dense: a vocab-parallel softmax
)
_RULES = dict(LOGICAL_AXIS_RULES)

# Environment variables that mean "this process is one of several" (TPU pod slices, SLURM, MPI,
# or an explicit coordinator); jax.distributed.initialize() auto-detects the rest from them.
_MULTIHOST_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                  "TPU_WORKER_HOSTNAMES")


def _is_multihost() -> bool:
  for name in _MULTIHOST_ENV:
    value = os.environ.get(name, "")
    if name == "TPU_WORKER_HOSTNAMES":
      if "," in value:
        return True
    elif name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
      if value.isdigit() and int(value) > 1:
        return True
    elif value:
      return True
  return False


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    return bool(xla_bridge.backends_are_initialized())
  except Exception:  # pragma: no cover - private API moved; assume the worst
    return True


def setup_devices(cfg: Config) -> None:
  """Fake CPU devices and multi-host initialisation; must run before anything touches a device."""
  if cfg.num_cpu_devices:
    if _backends_initialized():
      have = jax.local_device_count()
      if have != cfg.num_cpu_devices:
        raise ConfigError(
            f"--num_cpu_devices {cfg.num_cpu_devices}: JAX is already initialised with {have} "
            "device(s) in this process; start a fresh process (or set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={cfg.num_cpu_devices})")
    else:
      jax.config.update("jax_platforms", "cpu")
      jax.config.update("jax_num_cpu_devices", cfg.num_cpu_devices)
  explicit = _distributed_args(cfg)
  wanted = cfg.distributed == "on" or (cfg.distributed == "auto" and (
      _is_multihost() or "coordinator_address" in explicit))
  if wanted and not jax.distributed.is_initialized():
    # What the flags (or $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID) leave
    # unset, JAX detects (TPU pods, SLURM, Open MPI).
    jax.distributed.initialize(**explicit)


def _distributed_args(cfg: Config) -> dict[str, Any]:
  """jax.distributed.initialize's keywords from the flags, else the environment."""
  out: dict[str, Any] = {}
  address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  if address:
    out["coordinator_address"] = address
  for key, value, env, unset in (("num_processes", cfg.num_processes, "JAX_NUM_PROCESSES", 0),
                                 ("process_id", cfg.process_id, "JAX_PROCESS_ID", -1)):
    if value == unset and os.environ.get(env, "").strip():
      try:
        value = int(os.environ[env])
      except ValueError:
        raise ConfigError(f"${env} must be an integer, got {os.environ[env]!r}") from None
    if value != unset:
      out[key] = value
  return out


# ---------------------------------------------------------------------------------------------
# The mesh flags.


def resolve_mesh(sizes: Mapping[str, int], num_devices: int, flag: str = "--mesh",
                 what: str = "devices", shown: str | None = None) -> tuple[int, ...]:
  """The size of each of :data:`MESH_AXES` (omitted axes 1, ``-1`` the rest) over
  ``num_devices``; their product must be ``num_devices`` (ConfigError otherwise)."""
  known = math.prod(size for size in sizes.values() if size != -1)
  if shown is None:
    shown = ",".join(f"{k}={v}" for k, v in sizes.items())
  if num_devices % known:
    raise ConfigError(f"{flag} {shown}: the sizes (product {known}) must divide the number of "
                      f"{what} ({num_devices})")
  fill = num_devices // known
  out = tuple(fill if sizes.get(axis, 1) == -1 else sizes.get(axis, 1) for axis in MESH_AXES)
  if math.prod(out) != num_devices:
    raise ConfigError(f"{flag} {shown}: the sizes multiply to {math.prod(out)}, not the number "
                      f"of {what} ({num_devices}); give one axis -1 to take the rest")
  return out


def _with_defaults(sizes: dict[str, int], fsdp: bool) -> dict[str, int]:
  """``--fsdp true`` is ``fsdp=-1``; with no ``-1`` and no ``data`` given, ``data`` takes the
  rest."""
  sizes = dict(sizes)
  if fsdp and FSDP not in sizes:
    if -1 in sizes.values():
      axis = next(k for k, v in sizes.items() if v == -1)
      raise ConfigError(f"--fsdp true means fsdp=-1, but --mesh already gives -1 to {axis!r} "
                        "(-1 twice); name the fsdp size in --mesh instead")
    sizes[FSDP] = -1
  if -1 not in sizes.values() and DATA not in sizes:
    sizes[DATA] = -1
  return sizes


def mesh_shape(mesh: str, fsdp: bool, num_devices: int) -> tuple[int, ...]:
  """The ``(data, fsdp, context, tensor)`` sizes ``--mesh`` and ``--fsdp`` ask for."""
  return resolve_mesh(_with_defaults(parse_mesh(mesh), fsdp), num_devices, shown=mesh)


def hybrid_mesh_shapes(mesh: str, dcn_mesh: str, fsdp: bool, num_devices: int,
                       num_slices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(ici, dcn)`` sizes of :data:`MESH_AXES` within a slice (``--mesh``, over
  ``num_devices / num_slices`` devices) and across slices (``--dcn_mesh``, over ``num_slices``;
  with no ``-1``, ``data`` takes the rest). The mesh's size per axis is their product."""
  if num_devices % num_slices:
    raise ConfigError(f"--dcn_mesh: {num_devices} devices do not split into {num_slices} "
                      "equal slices")
  dcn_sizes = parse_mesh(dcn_mesh, "--dcn_mesh")
  if -1 not in dcn_sizes.values() and DATA not in dcn_sizes:
    dcn_sizes[DATA] = -1
  dcn = resolve_mesh(dcn_sizes, num_slices, "--dcn_mesh", "slices", shown=dcn_mesh)
  ici = resolve_mesh(_with_defaults(parse_mesh(mesh), fsdp), num_devices // num_slices,
                     "--mesh", "devices per slice", shown=mesh)
  return ici, dcn


def _num_slices(devices: Sequence[Any]) -> tuple[int, bool]:
  """(slices, whether each process counts as one): TPU devices of several slices name their
  slice; elsewhere (CPU and GPU devices say slice 0, or nothing) each process is one."""
  if all(getattr(d, "slice_index", None) is not None for d in devices):
    slices = len({d.slice_index for d in devices})
    if slices > 1:
      return slices, False
  return len({d.process_index for d in devices}), True


def check_batch(batch_size: int, grad_accum: int, num_devices: int, num_processes: int = 1,
                *, seq_len: int | None = None, context: int = 1,
                total_devices: int | None = None) -> None:
  """Raises ConfigError unless each micro-batch splits evenly over the batch devices
  (``data x fsdp``; every device on a 1-axis mesh) and the hosts, and ``seq_len`` over
  ``context``."""
  micro = batch_size // grad_accum
  if batch_size % grad_accum:
    raise ConfigError(
        f"--batch_size ({batch_size}) must be divisible by --grad_accum ({grad_accum})")
  if micro % num_devices:
    what = f"--batch_size ({batch_size})" if grad_accum == 1 else \
        f"the micro-batch --batch_size/--grad_accum ({micro})"
    raise ConfigError(f"{what} must be divisible by the number of devices ({num_devices})"
                      if total_devices in (None, num_devices) else
                      f"{what} must be divisible by the batch devices data x fsdp "
                      f"({num_devices})")
  if micro % num_processes:
    raise ConfigError(f"the micro-batch ({micro}) must be divisible by the number of hosts "
                      f"({num_processes})")
  if seq_len is not None and seq_len % context:
    raise ConfigError(f"--seq_len ({seq_len}) must be divisible by the context axis ({context})")


def make_mesh(cfg: Config) -> jax.sharding.Mesh:
  """The ``(data, fsdp, context, tensor)`` mesh of ``--mesh`` / ``--dcn_mesh`` / ``--fsdp``
  over all devices, after checking the batch splits evenly over it."""
  n = jax.device_count()
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  if cfg.dcn_mesh:
    from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
    slices, by_process = _num_slices(jax.devices())
    ici, dcn = hybrid_mesh_shapes(cfg.mesh, cfg.dcn_mesh, cfg.fsdp, n, slices)
    devices = mesh_utils.create_hybrid_device_mesh(ici, dcn, jax.devices(),
                                                   process_is_granule=by_process)
    # (per axis: the slices' blocks side by side, so the slow links carry the outer axes)
    mesh = jax.sharding.Mesh(devices, MESH_AXES, axis_types=auto)
  else:
    shape = mesh_shape(cfg.mesh, cfg.fsdp, n)
    mesh = jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  batch_devices = mesh.shape[DATA] * mesh.shape[FSDP]
  # Rows per host: the batch axes span the hosts (data outermost); context/tensor stay inside.
  hosts = min(jax.process_count(), batch_devices)
  check_batch(cfg.batch_size, cfg.grad_accum, batch_devices, hosts, seq_len=cfg.seq_len,
              context=mesh.shape[CONTEXT], total_devices=n)
  return mesh


# ---------------------------------------------------------------------------------------------
# Logical axis names -> PartitionSpecs.


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int]
                 ) -> P:
  """The PartitionSpec of an array ``shape`` whose dimensions have the logical ``names``.

  Each name maps to mesh axes by :data:`LOGICAL_AXIS_RULES`; a mesh axis of size 1, one already
  used by an earlier dimension, or one whose size (times the others kept) does not divide the
  dimension is dropped, so the dimension is split by what is left (replicated when nothing).
  """
  if len(names) != len(shape):
    raise ValueError(f"names: {len(names)} logical names for an array of rank {len(shape)}")
  used: set[str] = set()
  out: list[Any] = []
  for name, dim in zip(names, shape, strict=True):
    if name is not None and name not in _RULES:
      raise ValueError(f"names: logical axis {name!r} is not in LOGICAL_AXIS_RULES")
    rule = _RULES.get(name) if name is not None else None
    axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    kept: list[str] = []
    for axis in axes:
      size = mesh_shape.get(axis, 1)
      if size > 1 and axis not in used and dim % (math.prod(mesh_shape[a] for a in kept) * size) \
          == 0:
        kept.append(axis)
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _fsdp_spec(shape: tuple[int, ...], n: int) -> P:
  # Split the largest dimension that ``n`` divides; small or indivisible arrays stay replicated.
  if n <= 1:
    return P()
  for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[d] % n == 0 and shape[d] >= n:
      return P(*[None] * d, FSDP)
  return P()


def _key(entry: Any) -> str:
  return str(getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry))))


def _sharding_names(variable: Any) -> tuple[str | None, ...] | None:
  metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
  for key in ("out_sharding", "sharding_names", "sharding"):  # flax 0.12 / 0.11 / older
    names = metadata.get(key)
    if names is not None:
      return tuple(names)
  return None


def logical_axes(abstract_state: Any) -> dict[tuple[str, ...], tuple[str | None, ...] | None]:
  """``{parameter path: logical axis names}`` of an ``nnx.State`` (None: not annotated).

  Paths are tuples of strings, as the keys of ``nnx.to_pure_dict`` of the state read.
  """
  from flax import nnx  # pylint: disable=import-outside-toplevel

  out: dict[tuple[str, ...], tuple[str | None, ...] | None] = {}
  for path, variable in nnx.to_flat_state(abstract_state):
    out[tuple(str(p) for p in path)] = _sharding_names(variable)
  return out


def state_sharding(mesh, abstract_tree: Any,
                   axes: Mapping[tuple[str, ...], tuple[str | None, ...] | None]) -> Any:
  """A NamedSharding per leaf of ``abstract_tree``: :func:`state_specs` on ``mesh``."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                      state_specs(dict(mesh.shape), abstract_tree, axes),
                      is_leaf=lambda x: isinstance(x, P))


def state_specs(sizes: Mapping[str, int], abstract_tree: Any,
                axes: Mapping[tuple[str, ...], tuple[str | None, ...] | None]) -> Any:
  """A PartitionSpec per leaf of ``abstract_tree`` (params, optimizer state, or the whole
  state) on a mesh of axis ``sizes``.

  A leaf whose key path ends with a parameter's path in ``axes`` (the parameter itself, or its
  Adam moments in the optimizer state) and has that parameter's rank gets
  :func:`logical_spec` of the parameter's names; an unnamed parameter the FSDP rule (its
  largest dimension ``fsdp`` divides); anything else (step, counts, RNG) is replicated.
  """
  by_length = sorted({len(path) for path in axes}, reverse=True)

  def one(path, leaf):
    shape = tuple(getattr(leaf, "shape", ()))
    keys = tuple(_key(k) for k in path)
    spec = P()
    for length in by_length:
      if len(keys) >= length and keys[-length:] in axes:
        names = axes[keys[-length:]]
        if names is not None and len(names) == len(shape):
          spec = logical_spec(names, shape, sizes)
        elif names is None and shape:
          spec = _fsdp_spec(shape, sizes.get(FSDP, 1))
        break
    return spec

  return jax.tree_util.tree_map_with_path(one, abstract_tree)


def param_sharding(mesh, abstract_tree: Any, fsdp: bool) -> Any:
  """Shardings by the FSDP rule alone (no logical names): each leaf's largest dimension the
  ``fsdp`` axis divides, when ``fsdp``; else replicated."""
  n = mesh.shape[FSDP] if fsdp else 1

  def one(leaf):
    shape = tuple(getattr(leaf, "shape", ()))
    return NamedSharding(mesh, _fsdp_spec(shape, n) if shape else P())

  return jax.tree.map(one, abstract_tree)


# ---------------------------------------------------------------------------------------------
# Activations: sharding constraints inside the model, active while a step is traced.

_ACTIVE: list[Any] = []


@contextlib.contextmanager
def activate(mesh) -> Iterator[None]:
  """While active (around tracing a step), :func:`constrain` lays activations out on ``mesh``."""
  _ACTIVE.append(mesh)
  try:
    yield
  finally:
    _ACTIVE.pop()


def in_mesh(mesh, fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` traced with :func:`activate` ``(mesh)``."""

  def call(*args, **kwargs):
    with activate(mesh):
      return fn(*args, **kwargs)

  return call


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """``x`` with a sharding constraint from its logical dimension ``names`` (activations); ``x``
  unchanged when no mesh is active (sampling, layer tests) or the mesh has one device."""
  if not _ACTIVE or _ACTIVE[-1].size == 1:
    return x
  mesh = _ACTIVE[-1]
  spec = logical_spec(names, x.shape, dict(mesh.shape))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ---------------------------------------------------------------------------------------------
# Batches.


def batch_sharding(mesh) -> NamedSharding:
  """Batches are ``[grad_accum, micro_batch, seq]``: rows over ``('data', 'fsdp')``, positions
  over ``context``."""
  return NamedSharding(mesh, P(None, BATCH_AXES, CONTEXT))


def _local_range(index_map: Mapping[Any, tuple[slice, ...]], dim: int, size: int) -> np.ndarray:
  """The indices along ``dim`` this process's devices hold (one contiguous range)."""
  held = sorted({i for idx in index_map.values() for i in range(*idx[dim].indices(size))})
  if held != list(range(held[0], held[-1] + 1)):
    raise ValueError(f"this process holds a non-contiguous range along dimension {dim}")
  return np.asarray(held)


def global_batch(dataset, position: int, cfg: Config,
                 sharding: NamedSharding) -> dict[str, jax.Array]:
  """Global batch ``position`` as sharded arrays; each process builds only the rows (and
  positions) it holds, which ``jax.make_array_from_process_local_data`` assembles."""
  shape = (cfg.grad_accum, cfg.micro_batch, cfg.seq_len)
  index_map = sharding.addressable_devices_indices_map(shape)
  local = _local_range(index_map, 1, shape[1])
  cols = _local_range(index_map, 2, shape[2])
  rows = (np.arange(cfg.grad_accum)[:, None] * cfg.micro_batch + local[None, :])
  host = dataset.batch(position, rows.reshape(-1))
  out = {}
  for key, value in host.items():
    value = value.reshape(cfg.grad_accum, len(local), cfg.seq_len)[:, :, cols[0]:cols[-1] + 1]
    out[key] = jax.make_array_from_process_local_data(sharding, value, shape)
  return out


def context_parallel_wrap(mesh, strategy: str) -> Callable[..., Callable[..., jax.Array]]:
  """Wraps the model's attention ``f(q, k, v, hparams, *, kwargs, call)`` to call
  ``jaxsoft.attention.context_parallel_attention`` with ``strategy`` over the ``context`` axis
  (and the batch over ``('data', 'fsdp')`` when they divide it) instead of
  ``dot_product_attention``."""
  from jaxsoft.attention import context_parallel  # pylint: disable=import-outside-toplevel

  batch_size = mesh.shape[DATA] * mesh.shape[FSDP]

  def call(q, k, v, **kwargs):
    batch_axes = BATCH_AXES if q.shape[0] % batch_size == 0 else None
    return context_parallel.context_parallel_attention(
        q, k, v, mesh=mesh, axis_name=CONTEXT, strategy=strategy, batch_axes=batch_axes,
        **kwargs)

  def wrap(fn):
    return functools.partial(fn, call=call)

  wrap.context_parallel = True  # type: ignore[attr-defined]  (the model keeps K/V sharded)
  return wrap


def needs_shard_map(cfg: Config) -> bool:
  """Pallas may run: an explicit pallas* implementation, or jaxsoft's default choice off CPU."""
  impl = cfg.implementation
  return impl.startswith("pallas") or (not impl and jax.default_backend() != "cpu")


def shard_map_attention(mesh) -> Callable[..., Callable[..., jax.Array]]:
  """Wraps an attention function ``f(q, k, v, *replicated)`` to run per batch shard (shard_map).

  ``q, k, v`` are split over the batch axes ``('data', 'fsdp')`` only: each shard holds whole
  sequences and every head (gathered over ``context`` and ``tensor`` first), so the kernel's
  causal mask and the per-head hyperparameters stay right. Further arguments (learned
  hyperparameters, a pytree) are replicated.
  """
  batch = P(BATCH_AXES)

  def wrap(fn):
    def call(q, k, v, *replicated):
      specs = (batch, batch, batch) + (P(),) * len(replicated)
      return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=batch,
                           check_vma=False)(q, k, v, *replicated)
    return call

  return wrap
