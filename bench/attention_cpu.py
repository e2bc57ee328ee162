"""CPU benchmark of causal attention, forward + backward: xla_chunked vs xla vs jax.nn.

One head of dim 64, B = 1, ``is_causal=True``, ``jax.jit(jax.grad(...))`` of
``sum(out * ct)`` with respect to q, k and v. For every length T and implementation the
script starts a separate process that reports the median wall time of several runs and
the peak resident memory of that process (``ru_maxrss``; the baseline of an idle JAX
process is printed too). Before timing, each implementation is checked against
``jax.nn.dot_product_attention`` (output and the three gradients) in its own process at
T = min(T, 1024) — an implementation that fails is not timed. A 4096 x 4096 float32
matmul is timed in the same run to express each time as a fraction of the machine's
matmul peak (FLOPs of causal attention forward + backward with the recomputing backward
pass: 7·T²·H, i.e. 3.5 x the causal forward's 2·T²·H).

  python bench/attention_cpu.py                 # T in 1k..16k, markdown table on stdout
  python bench/attention_cpu.py --quick         # a tiny run (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

IMPLS = ("xla_chunked", "xla", "jax.nn")
H = 64


def _fn(impl: str):
  import jax
  import jax.numpy as jnp

  import jaxsoft

  def attn(q, k, v):
    if impl == "jax.nn":
      return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jaxsoft.attention.dot_product_attention(q, k, v, is_causal=True,
                                                   implementation=impl)

  def loss(q, k, v, ct):
    return jnp.sum(attn(q, k, v) * ct)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _inputs(T: int, seed: int = 0):
  import jax
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return tuple(jax.random.normal(kk, (1, T, 1, H)) for kk in ks)


def _cell_check(impl: str, T: int) -> dict:
  import numpy as np
  args = _inputs(T, seed=1)
  got = _fn(impl)(*args)
  want = _fn("jax.nn")(*args)
  errs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
          for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=False)]
  ok = all(np.isfinite(errs)) and max(errs) < 1e-3
  return {"ok": bool(ok), "max_err": max(errs)}


def _cell_time(impl: str, T: int, reps: int) -> dict:
  import jax
  base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  args = _inputs(T)
  f = _fn(impl)
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {"median_s": statistics.median(times), "min_s": min(times), "compile_s": compile_s,
          "peak_mib": peak / 1024, "base_mib": base / 1024}


def _cell_matmul(reps: int) -> dict:
  import jax
  import jax.numpy as jnp
  n = 4096
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
  f = jax.jit(jnp.matmul)
  jax.block_until_ready(f(a, b))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, b))
    times.append(time.perf_counter() - t0)
  return {"gflops": 2 * n**3 / statistics.median(times) / 1e9}


def _child(kind: str, *args) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--cell", kind, *map(str, args)]
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
  if proc.returncode != 0:
    return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
            f"exit {proc.returncode}"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny run: T = 256, 2 reps")
  p.add_argument("--lengths", type=str, default="1024,2048,4096,8192,16384")
  p.add_argument("--impls", type=str, default=",".join(IMPLS))
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--cell", nargs="+", help=argparse.SUPPRESS)
  a = p.parse_args(argv)

  if a.cell:  # a child process: one measurement, one JSON line
    kind = a.cell[0]
    if kind == "check":
      res = _cell_check(a.cell[1], int(a.cell[2]))
    elif kind == "time":
      res = _cell_time(a.cell[1], int(a.cell[2]), int(a.cell[3]))
    else:
      res = _cell_matmul(int(a.cell[1]))
    print(json.dumps(res))
    return 0

  lengths = [256] if a.quick else [int(t) for t in a.lengths.split(",")]
  reps = 2 if a.quick else a.reps
  impls = [i for i in a.impls.split(",") if i]
  for i in impls:
    if i not in IMPLS:
      p.error(f"unknown implementation {i!r}; choose from {IMPLS}")

  peak = _child("matmul", 3 if a.quick else 10)
  gflops = peak.get("gflops")
  print(f"4096x4096 float32 matmul: {gflops:.1f} GFLOP/s" if gflops else f"matmul: {peak}",
        file=sys.stderr)
  check_t = min(max(lengths), 1024)
  checks = {i: _child("check", i, check_t) for i in impls}
  for i, c in checks.items():
    print(f"correctness {i} at T={check_t}: {c}", file=sys.stderr)

  results = {}
  for T in lengths:
    for i in impls:
      if not checks[i].get("ok"):
        results[(i, T)] = {"error": "failed the correctness check: not timed"}
        continue
      results[(i, T)] = _child("time", i, T, reps)
      print(f"T={T} {i}: {results[(i, T)]}", file=sys.stderr)

  lines = [
      f"Causal attention, B=1, N=1, H={H}, forward+backward under jit, median of {reps}; "
      f"4096^2 float32 matmul peak {gflops:.1f} GFLOP/s; correctness vs jax.nn at "
      f"T={check_t}: " + ", ".join(f"{i} {'ok' if c.get('ok') else 'FAILED'}"
                                   for i, c in checks.items()),
      "",
      "| T | implementation | time (ms) | peak RSS (MiB) | time vs jax.nn | memory vs jax.nn |"
      " GFLOP/s | fraction of matmul peak |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for T in lengths:
    ref = results.get(("jax.nn", T), {})
    for i in impls:
      r = results[(i, T)]
      if "error" in r:
        lines.append(f"| {T} | {i} | {r['error']} | | | | | |")
        continue
      t = r["median_s"]
      fl = 7.0 * T * T * H / t / 1e9
      speed = f"{ref['median_s'] / t:.2f}x faster" if "median_s" in ref else "n/a"
      mem = f"{r['peak_mib'] / ref['peak_mib']:.3f}" if "peak_mib" in ref else "n/a"
      frac = f"{fl / gflops:.2f}" if gflops else "n/a"
      lines.append(f"| {T} | {i} | {1e3 * t:.1f} | {r['peak_mib']:.0f} | {speed} | {mem} | "
                   f"{fl:.1f} | {frac} |")
  base = [r["base_mib"] for r in results.values() if "base_mib" in r]
  if base:
    lines.append("")
    lines.append(f"Peak RSS includes the JAX runtime: an idle process with its inputs holds "
                 f"about {statistics.median(base):.0f} MiB.")
  print("\n".join(lines))
  bad = [k for k, r in results.items() if "error" in r]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
