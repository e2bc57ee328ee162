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

  python bench/context_parallel_cpu.py                 # T = 512, 1024, 2048
  python bench/context_parallel_cpu.py --lengths 512 --reps 2   # quick (used by the tests)
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


def measure_compiled(fn, args, reps):
  """(output, temp MiB of the compiled program or None, median ms over ``reps`` calls)."""
  import jax
  compiled = jax.jit(fn).lower(*args).compile()
  memory = compiled.memory_analysis()
  temp = None if memory is None else memory.temp_size_in_bytes / 2**20
  out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return out, temp, 1e3 * statistics.median(times)


def row_cells(name, T, normalizer, err, temp, ms):
  """One markdown row; a row whose check failed gets no figures (FAILED and its error)."""
  if not err <= TOLERANCE:
    return f"| {T} | {normalizer} | {name} | FAILED (max err {err:.1e}) | - | - |"
  mib = "n/a" if temp is None else f"{temp:.1f}"
  return f"| {T} | {normalizer} | {name} | {err:.1e} | {mib} | {ms:.1f} |"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
  parser.add_argument("--normalizers", nargs="+", default=["softmax", "sparsemax"])
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args(argv)
  setup_fake_devices()
  import jax
  import jax.numpy as jnp

  from jaxsoft.attention import context_parallel as cp_module
  from jaxsoft.attention import dot_product_attention

  assert jax.device_count() == DEVICES, jax.devices()
  mesh = jax.make_mesh((DEVICES,), ("context",))
  strategies = sorted(cp_module.STRATEGIES)
  print(f"# context-parallel attention, {DEVICES} CPU devices, B={B} N=K={N} H={H}, causal, "
        "float32, forward, implementation='xla' per device")
  print("# CPU figures show how memory and work scale with the split, not accelerator speed")
  print("| T | normalizer | path | max err vs 1 device | temp MiB / device | ms |")
  print("|---|---|---|---|---|---|")
  failed = False
  for T in args.lengths:
    keys = jax.random.split(jax.random.key(T), 3)
    q, k, v = (jax.random.normal(key, (B, T, N, H), jnp.float32) for key in keys)
    for normalizer in args.normalizers:
      def single(q, k, v, normalizer=normalizer):
        return dot_product_attention(q, k, v, is_causal=True, normalizer=normalizer,
                                     implementation="xla")
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
