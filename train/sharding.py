"""Devices, the mesh and how arrays are laid out on it.

One mesh axis, ``data``, over every device of every host (``jax.make_mesh``). Batches are split
along it (data parallelism). Parameters and optimizer state are replicated by default; with
``--fsdp`` each array is split along its largest dimension the axis divides (ZeRO-3 style: XLA
inserts the all-gathers and reduce-scatters). Pallas kernels are not auto-partitioned, so a Pallas
attention call runs under ``jax.shard_map`` over the batch axis.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train.config import Config, ConfigError

__all__ = ["setup_devices", "make_mesh", "check_batch", "batch_sharding", "param_sharding",
           "global_batch", "needs_shard_map", "shard_map_attention", "DATA"]

DATA = "data"

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
      have = jax.device_count()
      if have != cfg.num_cpu_devices:
        raise ConfigError(
            f"--num_cpu_devices {cfg.num_cpu_devices}: JAX is already initialised with {have} "
            "device(s) in this process; start a fresh process (or set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={cfg.num_cpu_devices})")
    else:
      jax.config.update("jax_platforms", "cpu")
      jax.config.update("jax_num_cpu_devices", cfg.num_cpu_devices)
  wanted = cfg.distributed == "on" or (cfg.distributed == "auto" and _is_multihost())
  if wanted and not jax.distributed.is_initialized():
    jax.distributed.initialize()  # coordinator, process count and id auto-detected


def check_batch(batch_size: int, grad_accum: int, num_devices: int, num_processes: int = 1) -> None:
  """Raises ConfigError unless each micro-batch splits evenly over the devices and the hosts."""
  micro = batch_size // grad_accum
  if batch_size % grad_accum:
    raise ConfigError(
        f"--batch_size ({batch_size}) must be divisible by --grad_accum ({grad_accum})")
  if micro % num_devices:
    what = f"--batch_size ({batch_size})" if grad_accum == 1 else \
        f"the micro-batch --batch_size/--grad_accum ({micro})"
    raise ConfigError(f"{what} must be divisible by the number of devices ({num_devices})")
  if micro % num_processes:
    raise ConfigError(f"the micro-batch ({micro}) must be divisible by the number of hosts "
                      f"({num_processes})")


def make_mesh(cfg: Config) -> jax.sharding.Mesh:
  """A 1-D ``data`` mesh over all devices, after checking the batch divides evenly over it."""
  check_batch(cfg.batch_size, cfg.grad_accum, jax.device_count(), jax.process_count())
  # Auto axes: the train step is written for the compiler's sharding propagation.
  return jax.make_mesh((jax.device_count(),), (DATA,),
                       axis_types=(jax.sharding.AxisType.Auto,))


def batch_sharding(mesh) -> NamedSharding:
  """Batches are ``[grad_accum, micro_batch, seq]``: split the micro-batch rows over ``data``."""
  return NamedSharding(mesh, P(None, DATA))


def _fsdp_spec(shape: tuple[int, ...], n: int) -> P:
  # Split the largest dimension that ``n`` divides; small or indivisible arrays stay replicated.
  dims = sorted(range(len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] % n == 0 and shape[d] >= n:
      spec = [None] * len(shape)
      spec[d] = DATA
      return P(*spec)
  return P()


def param_sharding(mesh, abstract_tree: Any, fsdp: bool) -> Any:
  """A NamedSharding per leaf of ``abstract_tree`` (params, optimizer state, or the whole state)."""
  n = mesh.shape[DATA]

  def one(leaf):
    shape = tuple(getattr(leaf, "shape", ()))
    return NamedSharding(mesh, _fsdp_spec(shape, n) if fsdp and shape else P())

  return jax.tree.map(one, abstract_tree)


def global_batch(dataset, position: int, cfg: Config,
                 sharding: NamedSharding) -> dict[str, jax.Array]:
  """Global batch ``position`` as sharded arrays; each process builds only the rows it holds."""
  shape = (cfg.grad_accum, cfg.micro_batch, cfg.seq_len)
  # The micro-batch rows this process's devices hold (a contiguous range on every mesh jax makes).
  index_map = sharding.addressable_devices_indices_map(shape)
  local = sorted({r for idx in index_map.values() for r in range(*idx[1].indices(shape[1]))})
  rows = (np.arange(cfg.grad_accum)[:, None] * cfg.micro_batch + np.asarray(local)[None, :])
  host = dataset.batch(position, rows.reshape(-1))
  out = {}
  for key, value in host.items():
    value = value.reshape(cfg.grad_accum, len(local), cfg.seq_len)
    out[key] = jax.make_array_from_process_local_data(sharding, value, shape)
  return out


def needs_shard_map(cfg: Config) -> bool:
  """Pallas may run: an explicit pallas* implementation, or jaxsoft's default choice off CPU."""
  impl = cfg.implementation
  return impl.startswith("pallas") or (not impl and jax.default_backend() != "cpu")


def shard_map_attention(mesh) -> Callable[..., Callable[..., jax.Array]]:
  """Wraps an attention function ``f(q, k, v, *replicated)`` to run per data shard (shard_map).

  ``q, k, v`` are split over the data axis; further arguments (learned hyperparameters, a pytree)
  are replicated.
  """

  def wrap(fn):
    def call(q, k, v, *replicated):
      specs = (P(DATA), P(DATA), P(DATA)) + (P(),) * len(replicated)
      return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(DATA),
                           check_vma=False)(q, k, v, *replicated)
    return call

  return wrap
