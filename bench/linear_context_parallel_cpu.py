"""CPU benchmark of linear attention with its sequence split over 8 fake devices: memory per device.

``jaxsoft.linear.context_parallel(fn, axis_name="context")`` under ``jax.shard_map`` with the
time axis of q, k, v and the gates split contiguously over 8 CPU devices
(``--xla_force_host_platform_device_count=8``, set before JAX starts), against ``fn`` on one
device with the same arrays, for a family with one decay per head (``simple_gla``: diagonal
state maps) and a delta rule (``gated_delta_rule``: ``K x K`` maps). B = 1, N = 4 heads,
K = V = 64, float32, the chunked form (chunks of 64) on each device; ``--grad`` measures the
gradient of ``sum(sin(o))`` with respect to q, k, v and the gates too.

Each row first checks the output (and gradients) against the one-device result: the largest
absolute difference over the largest magnitude of the reference must be <= 1e-4 (float32
sums of the same terms in another order, the incoming states composed by an associative
scan); a failing row says FAILED with no figures and the script exits 1. The figures:

* temp MiB / device: ``compiled.memory_analysis().temp_size_in_bytes`` of the jitted call
  (XLA's scratch buffers of one device's program; for the one-device row the whole
  computation's), what the split divides: the chunk terms and the intermediates scale with
  the tokens a device holds, the states ``[N, K, V]`` and the gathered maps do not;
* ms: the median wall time of ``--reps`` calls after one warm-up (8 threads of one CPU
  process sharing the cores: how the work scales, not accelerator speed).

  python bench/linear_context_parallel_cpu.py                      # T = 4096, 16384
  python bench/linear_context_parallel_cpu.py --lengths 2048 --reps 1   # quick
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the bench scripts beside it
from context_parallel_cpu import measure_compiled, setup_fake_devices  # noqa: E402

DEVICES = 8  # (setup_fake_devices's default)
B, N, K = 1, 4, 64
TOLERANCE = 1e-4
FAMILIES = ("simple_gla", "gated_delta_rule")




def relative_error(out, ref) -> float:
  """Largest ``|out - ref|`` over the largest ``|ref|``, over every leaf (NaN stays NaN)."""
  import jax
  import numpy as np
  errs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-30))
          for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True)]
  return max(errs)


def row_cells(T: int, family: str, path: str, err: float, temp: float | None,
              ms: float) -> str:
  """One markdown row; a row whose check failed gets no figures (FAILED and its error)."""
  if not err <= TOLERANCE:
    return f"| {T} | {family} | {path} | FAILED (rel. err {err:.1e}) | - | - |"
  mib = "n/a" if temp is None else f"{temp:.1f}"
  return f"| {T} | {family} | {path} | {err:.1e} | {mib} | {ms:.1f} |"




def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
  parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
  parser.add_argument("--grad", action="store_true", help="forward and gradient")
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args(argv)
  setup_fake_devices()
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxsoft.linear as jl

  assert jax.device_count() == DEVICES, jax.devices()
  mesh = jax.make_mesh((DEVICES,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
  what = "forward and gradient" if args.grad else "forward"
  print(f"# linear context parallelism, {DEVICES} CPU devices, B={B} N={N} K=V={K}, float32, "
        f"{what}, chunked form (chunks of 64) per device")
  print("# CPU figures show how memory and work scale with the split, not accelerator speed")
  print("| T | family | path | rel. err vs 1 device | temp MiB / device | ms |")
  print("|---|---|---|---|---|---|")
  failed = False
  for T in args.lengths:
    keys = jax.random.split(jax.random.key(T), 5)
    q, k, v = (jax.random.normal(key, (B, T, N, K), jnp.float32) for key in keys[:3])
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, N), jnp.float32)) / 8
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, N), jnp.float32))
    for family in args.families:
      fn = getattr(jl, family)
      extra = (beta,) if family == "gated_delta_rule" else ()
      opts = dict(qk_l2norm=True) if family == "gated_delta_rule" else {}
      inputs = (q, k, v, g, *extra)

      def call(*a, fn=fn, opts=opts):
        return fn(*a, implementation="chunked", chunk_size=64, **opts)

      cp_fn = jl.context_parallel(fn, axis_name="context")
      sharded_call = jax.shard_map(
          lambda *a, cp_fn=cp_fn, opts=opts: cp_fn(*a, implementation="chunked", chunk_size=64,
                                                   **opts),
          mesh=mesh, in_specs=(P(None, "context"),) * len(inputs), out_specs=P(None, "context"))

      def measured(f, n=len(inputs)):
        if not args.grad:
          return f
        return jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=tuple(range(n)))

      ref, temp, ms = measure_compiled(measured(call), inputs, args.reps)
      print(row_cells(T, family, "1 device", 0.0, temp, ms), flush=True)
      placed = tuple(jax.device_put(x, NamedSharding(mesh, P(None, "context"))) for x in inputs)
      out, temp, ms = measure_compiled(measured(sharded_call), placed, args.reps)
      err = relative_error(out, ref)
      failed |= not err <= TOLERANCE
      print(row_cells(T, family, f"cp={DEVICES}", err, temp, ms), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
