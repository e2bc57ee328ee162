"""CPU benchmark of context-parallel attention on 8 fake devices: memory per device and time.

``jaxsoft.attention.context_parallel_attention`` with the sequence split over a mesh axis of
8 CPU devices (``--xla_force_host_platform_device_count=8``, set before JAX starts), for
each strategy in its table (``all_gather``, ``ulysses``, and ``ring`` when registered),
against ``jaxsoft.attention.dot_product_attention`` on one device with the same arrays.
B = 1, N = K = 8 heads, H = 32, float32, causal (load-balanced dual chunks), forward only,
``implementation="xla"`` on each device (the dense path, whose buffers grow with the
query rows times the keys it holds: the quantity context parallelism divides).

For every length T and normalizer (softmax, sparsemax) each row first checks the output
against the one-device result (max abs difference <= 1e-4; both are float32 sums over the
same keys in another order) and reports figures only when the check passes; a failing row
says FAILED and the script exits 1. The figures:

* temp MiB / device: ``compiled.memory_analysis().temp_size_in_bytes`` of the jitted call
  (XLA's scratch buffers for one device's program; for the one-device row, the whole
  computation's);
* ms: the median wall time of ``--reps`` calls after one warm-up.

The 8 "devices" are threads of one CPU process sharing the same cores, so the times show
how the work and the collectives scale, not the speed of real accelerators (a
context-parallel call cannot be faster here than one device: the cores are the same).

Weak scaling (``--weak T0``): the context axis grows with the sequence, cp = 1, 2, 4, 8
(``--cps``) devices (a sub-mesh of the 8) with T = T0 * cp, so every device holds T0 queries
and T0 keys whatever cp. For each cp and normalizer (softmax, entmax15, sparsemax by default)
the one-device call at the same T, then every strategy on cp devices, the inputs laid out
sharded along the sequence (``jit`` ``in_shardings``), each row checked against the
one-device output first. Per device, from ``memory_analysis()`` of the compiled call:

* temp MiB: ``temp_size_in_bytes``, XLA's scratch buffers (the heap simulation's peak of
  the temporaries), the figure that depends on the algorithm;
* arg+out MiB: ``argument_size_in_bytes + output_size_in_bytes`` (the local shards of q, k,
  v and of the output; the whole arrays for the one-device row);
* peak MiB: arg+out + temp - ``alias_size_in_bytes``, an upper bound on the bytes the
  device's program holds at once. (``peak_memory_in_bytes`` is not used: on the CPU client
  it counts the arguments and outputs only, not the temporaries.)

A strategy whose memory per device does not depend on T at fixed T / cp keeps these
figures flat down a column (ring); all_gather and ulysses hold all T keys (or all T
queries of N / cp heads) and grow about linearly with T. For a threshold normalizer
(entmax15, sparsemax) the ring also all-gathers the queries (T x N x H floats) and keeps
the threshold search's per-row state for all T rows, a few MiB at T = 4096 next to the
tens of MiB of its [T0, T0] tiles.

  python bench/context_parallel_cpu.py                 # T = 512, 1024, 2048
  python bench/context_parallel_cpu.py --lengths 512 --reps 2   # quick (used by the tests)
  python bench/context_parallel_cpu.py --weak 512 --reps 1      # weak scaling, T up to 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEVICES = 8
B, N, H = 1, 8, 32
TOLERANCE = 1e-4


def setup_fake_devices(devices: int = DEVICES):
  """XLA flags for ``devices`` fake CPU devices (before jax is imported)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def compile_and_run(fn, args, reps, **jit_kwargs):
  """(output, ``memory_analysis()`` of the compiled program or None, median ms over ``reps``
  calls after the first, None when ``reps`` is 0)."""
  import jax
  compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile()
  memory = compiled.memory_analysis()
  out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return out, memory, (1e3 * statistics.median(times) if times else None)


def measure_compiled(fn, args, reps):
  """(output, temp MiB of the compiled program or None, median ms over ``reps`` calls)."""
  out, memory, ms = compile_and_run(fn, args, reps)
  temp = None if memory is None else memory.temp_size_in_bytes / 2**20
  return out, temp, ms


def memory_mib(memory) -> tuple[float, float, float] | None:
  """(temp, arguments + outputs, peak) MiB per device from a ``CompiledMemoryStats``, peak =
  arguments + outputs + temp - aliased bytes; None when XLA gives no analysis."""
  if memory is None:
    return None
  temp = memory.temp_size_in_bytes
  io = memory.argument_size_in_bytes + memory.output_size_in_bytes
  return temp / 2**20, io / 2**20, (io + temp - memory.alias_size_in_bytes) / 2**20


def row_cells(name, T, normalizer, err, temp, ms):
  """One markdown row; a row whose check failed gets no figures (FAILED and its error)."""
  if not err <= TOLERANCE:
    return f"| {T} | {normalizer} | {name} | FAILED (max err {err:.1e}) | - | - |"
  mib = "n/a" if temp is None else f"{temp:.1f}"
  time_cell = "-" if ms is None else f"{ms:.1f}"
  return f"| {T} | {normalizer} | {name} | {err:.1e} | {mib} | {time_cell} |"


def weak_row_cells(cp, T, normalizer, name, err, mib, ms):
  """One row of the weak-scaling table; a row whose check failed gets no figures."""
  head = f"| {cp} | {T} | {normalizer} | {name} |"
  if not err <= TOLERANCE:
    return f"{head} FAILED (max err {err:.1e}) | - | - | - | - |"
  temp, io, peak = ("n/a",) * 3 if mib is None else (f"{x:.1f}" for x in mib)
  time_cell = "-" if ms is None else f"{ms:.1f}"
  return f"{head} {err:.1e} | {temp} | {io} | {peak} | {time_cell} |"


def _inputs(T: int):
  """q, k, v [B, T, N, H] float32 (seeded by T)."""
  import jax
  import jax.numpy as jnp
  keys = jax.random.split(jax.random.key(T), 3)
  return tuple(jax.random.normal(key, (B, T, N, H), jnp.float32) for key in keys)


def _one_device(normalizer):
  """The one-device call the sharded ones are checked against: causal, dense (``xla``)."""
  from jaxsoft.attention import dot_product_attention

  def single(q, k, v):
    return dot_product_attention(q, k, v, is_causal=True, normalizer=normalizer,
                                 implementation="xla")
  return single


def weak_scaling(t0: int, cps, normalizers, reps: int) -> bool:
  """Prints the weak-scaling table (T = t0 * cp on cp devices); True when every row passed
  its check."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from jaxsoft.attention import context_parallel as cp_module

  strategies = sorted(cp_module.STRATEGIES)
  print(f"# weak scaling: T = {t0} * cp on cp of {DEVICES} CPU devices, B={B} N=K={N} H={H}, "
        "causal, float32, forward, implementation='xla' per device; inputs sharded along T")
  print("# peak = args + outputs + temp - aliased, per device (memory_analysis of the compiled "
        "call); CPU times show scaling, not speed")
  print("| cp | T | normalizer | path | max err vs 1 device | temp MiB / device | "
        "arg+out MiB / device | peak MiB / device | ms |")
  print("|---|---|---|---|---|---|---|---|---|")
  ok = True
  for cp in cps:
    T = t0 * cp
    mesh = jax.make_mesh((cp,), ("context",), devices=jax.devices()[:cp])
    seq = NamedSharding(mesh, PartitionSpec(None, "context"))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    q, k, v = _inputs(T)
    for normalizer in normalizers:
      single = _one_device(normalizer)
      ref, memory, ms = compile_and_run(single, (q, k, v), reps, in_shardings=(one,) * 3,
                                        out_shardings=one)
      print(weak_row_cells(cp, T, normalizer, "1 device", 0.0, memory_mib(memory), ms),
            flush=True)
      for strategy in strategies:
        def sharded(q, k, v, normalizer=normalizer, strategy=strategy, mesh=mesh):
          return cp_module.context_parallel_attention(
              q, k, v, mesh=mesh, strategy=strategy, is_causal=True, normalizer=normalizer,
              implementation="xla")
        out, memory, ms = compile_and_run(sharded, (q, k, v), reps, in_shardings=(seq,) * 3,
                                          out_shardings=seq)
        err = float(jnp.max(jnp.abs(jax.device_get(out) - jax.device_get(ref))))
        ok &= err <= TOLERANCE
        print(weak_row_cells(cp, T, normalizer, f"cp={cp} {strategy}", err, memory_mib(memory),
                             ms), flush=True)
  return ok


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
  parser.add_argument("--normalizers", nargs="+", default=None,
                      help="default: softmax sparsemax (with --weak: softmax entmax15 sparsemax)")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--weak", type=int, metavar="T0", default=None,
                      help="weak scaling instead: T = T0 * cp on cp devices (--cps)")
  parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
  args = parser.parse_args(argv)
  if args.reps < 0:
    parser.error("--reps must be >= 0")
  if args.weak is not None:
    if args.weak < 2 or args.weak % 2:
      parser.error(f"--weak T0 must be an even length >= 2 (load balancing cuts T0 in two), "
                   f"got {args.weak}")
    if any(cp < 1 or cp > DEVICES or N % cp for cp in args.cps):
      parser.error(f"--cps must divide the {N} heads (ulysses splits them) and be at most "
                   f"{DEVICES}, got {args.cps}")
  setup_fake_devices()
  import jax
  import jax.numpy as jnp

  from jaxsoft.attention import context_parallel as cp_module

  assert jax.device_count() == DEVICES, jax.devices()
  if args.weak is not None:
    normalizers = args.normalizers or ["softmax", "entmax15", "sparsemax"]
    return 0 if weak_scaling(args.weak, args.cps, normalizers, args.reps) else 1
  normalizers = args.normalizers or ["softmax", "sparsemax"]
  mesh = jax.make_mesh((DEVICES,), ("context",))
  strategies = sorted(cp_module.STRATEGIES)
  print(f"# context-parallel attention, {DEVICES} CPU devices, B={B} N=K={N} H={H}, causal, "
        "float32, forward, implementation='xla' per device")
  print("# CPU figures show how memory and work scale with the split, not accelerator speed")
  print("| T | normalizer | path | max err vs 1 device | temp MiB / device | ms |")
  print("|---|---|---|---|---|---|")
  failed = False
  for T in args.lengths:
    q, k, v = _inputs(T)
    for normalizer in normalizers:
      single = _one_device(normalizer)
      ref, temp, ms = measure_compiled(single, (q, k, v), args.reps)
      print(row_cells("1 device", T, normalizer, 0.0, temp, ms), flush=True)
      for strategy in strategies:
        def sharded(q, k, v, normalizer=normalizer, strategy=strategy):
          return cp_module.context_parallel_attention(
              q, k, v, mesh=mesh, strategy=strategy, is_causal=True, normalizer=normalizer,
              implementation="xla")
        out, temp, ms = measure_compiled(sharded, (q, k, v), args.reps)
        err = float(jnp.max(jnp.abs(out - ref)))
        failed |= not err <= TOLERANCE
        print(row_cells(f"cp={DEVICES} {strategy}", T, normalizer, err, temp, ms), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
