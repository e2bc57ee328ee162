"""CPU benchmark of the linear-attention family, forward + backward: chunked vs parallel.

B = 1, N = 4 heads, K = V = 64, ``jax.jit(jax.value_and_grad(...))`` of ``sum(o * ct)``
with respect to every differentiable input (q, k, v and the decays / beta). For every
variant, form and length T the script starts a separate process that reports the median
wall time of several runs and the peak resident memory of that process (``ru_maxrss``).
The named baseline is causal softmax attention, ``jaxsoft.attention.dot_product_attention(
..., implementation="xla_chunked")``, timed in the same run with the same shapes.

Before timing, each variant's chunked form (chunk 64) is checked against its parallel form
in a process of its own at T = 256 (4 chunks): the output and every gradient, to 1e-4
relative to the largest entry. A variant that fails is not timed.

Every cell runs under a cap on its data segment (``resource.RLIMIT_DATA``: the private
writable memory it maps, not the address space it merely reserves; ``--memory-gib``, default
20 GiB, lowered to the machine's available memory less 2 GiB), so that a parallel form that
needs more (it holds several [B, N, T, T] float32 buffers: 4 GiB each at T = 16384) fails
inside its own process, and its row says "did not fit in N GiB" instead of a time, with the
size of XLA's buffers (``memory_analysis()`` of the compiled step; a cell whose buffers
alone exceed the cap is not run). (gla's per-channel scores are built by recursive secondary chunking, so its parallel
form holds [T, T] per head as the others do, not [T, T, K].) The delta rules' parallel
forms invert one [T, T] matrix (O(T^3); about a minute at T = 4096 on 2 cores): they are not
run above T = 4096, and the row says so.

With ``--rounds R`` every cell is timed R times, the rounds interleaved (all cells once,
then all again), and the table gives the median over the rounds: the machine's load drifts
less between the cells of one round than over a whole sequential sweep.

  python bench/linear_cpu.py                  # T = 1024, 4096; markdown table on stdout
  python bench/linear_cpu.py --lengths 1024 4096 16384 --rounds 3 --reps 3
  python bench/linear_cpu.py --forms chunked --variants simple_gla,gated_delta_rule
  python bench/linear_cpu.py --quick          # a tiny run (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("linear_attention", "simple_gla", "lightning_attention", "gla", "delta_rule",
            "gated_delta_rule")
FORMS = ("chunked", "parallel")
BASELINE = "softmax xla_chunked"
B, N, H = 1, 4, 64
CHECK_T = 256
MEMORY_GIB = 20.0            # default cap on each cell's data segment (RLIMIT_DATA)
CUBIC_PARALLEL = ("delta_rule", "gated_delta_rule")
CUBIC_PARALLEL_MAX_T = 4096  # the delta rules' parallel forms: one [T, T] inverse, O(T^3)
OOM_MARKERS = ("Out of memory", "RESOURCE_EXHAUSTED", "MemoryError", "bad_alloc",
               "Cannot allocate memory")


def _inputs(variant: str, T: int, seed: int = 0) -> dict:
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  a = {"q": jax.random.normal(ks[0], (B, T, N, H)),
       "k": jax.random.normal(ks[1], (B, T, N, H)),
       "v": jax.random.normal(ks[2], (B, T, N, H))}
  if variant in ("delta_rule", "gated_delta_rule"):
    a["k"] = a["k"] / jnp.linalg.norm(a["k"], axis=-1, keepdims=True)
    a["beta"] = jax.random.uniform(ks[3], (B, T, N), minval=0.1, maxval=1.0)
  if variant in ("simple_gla", "gated_delta_rule"):
    a["g"] = jax.random.uniform(ks[4], (B, T, N), minval=-0.1, maxval=0.0)
  if variant == "gla":
    a["g"] = jax.random.uniform(ks[4], (B, T, N, H), minval=-0.1, maxval=0.0)
  if variant == "lightning_attention":
    a["g"] = jax.random.uniform(ks[4], (N,), minval=-0.1, maxval=-0.01)
  return a


def _fn(variant: str, form: str):
  import jax
  import jax.numpy as jnp

  import jaxsoft
  from jaxsoft import linear

  def run(a):
    q, k, v = a["q"], a["k"], a["v"]
    if variant == BASELINE:
      return jaxsoft.attention.dot_product_attention(q, k, v, is_causal=True,
                                                     implementation="xla_chunked")
    kw = dict(implementation=form, chunk_size=64)
    if variant == "linear_attention":
      return linear.linear_attention(q, k, v, **kw)
    if variant in ("simple_gla", "gla", "lightning_attention"):
      return getattr(linear, variant)(q, k, v, a["g"], **kw)
    if variant == "delta_rule":
      return linear.delta_rule(q, k, v, a["beta"], **kw)
    return linear.gated_delta_rule(q, k, v, a["g"], a["beta"], **kw)

  def loss(a, ct):
    return jnp.sum(run(a) * ct)

  return jax.jit(jax.value_and_grad(loss))


def _cotangent(T: int):
  import jax
  return jax.random.normal(jax.random.PRNGKey(99), (B, T, N, H))


def parallel_buffer_bytes(variant: str, T: int) -> int:
  """The size of one ``[B, N, T, T]`` float32 buffer (every variant, gla included)."""
  return 4 * B * N * T * T


def skip_reason(variant: str, form: str, T: int) -> str | None:
  """Why a cell is not run at all (None: run it, under the memory cap)."""
  if form == "parallel" and variant in CUBIC_PARALLEL and T > CUBIC_PARALLEL_MAX_T:
    return (f"not run: the parallel form inverts one T x T matrix (O(T^3)); run up to "
            f"T = {CUBIC_PARALLEL_MAX_T}")
  return None


def memory_cap_bytes(gib: float) -> int:
  """``gib`` GiB, lowered to the available memory (``/proc/meminfo``) less 2 GiB, so that a
  capped cell fails in its own process before the machine runs short."""
  cap = int(gib * 2**30)
  try:
    with open("/proc/meminfo") as f:
      avail = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}["MemAvailable"]
    cap = min(cap, avail - 2 * 2**30)
  except (OSError, KeyError, ValueError):
    pass
  return max(cap, 2**30)


def run_capped(cmd: list[str], cap: int, env: dict | None = None) -> dict:
  """Runs ``cmd`` (``cmd[0]`` a path) with its data segment capped at ``cap`` bytes; its last
  stdout line is JSON. A child that ran out of memory (an allocation failed, or it was
  killed) gives ``{"error": "did not fit in N GiB (...)"}``, any other failure its last
  stderr line."""
  # the limit is set by a small Python trampoline that then execs ``cmd`` (no preexec_fn:
  # forking a process that runs JAX's threads may deadlock)
  setcap = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_DATA, "
            f"({cap}, {cap})); os.execv(sys.argv[1], sys.argv[1:])")
  proc = subprocess.run([sys.executable, "-c", setcap, *cmd], capture_output=True, text=True,
                        env=env)
  if proc.returncode != 0:
    err = proc.stderr.strip()
    if proc.returncode == -9 or any(m in err for m in OOM_MARKERS):
      need = re.findall(r"xla_buffer_bytes=(\d+)", err)
      why = "killed" if proc.returncode == -9 else "an allocation failed"
      if need:
        why += f"; XLA's buffers: {int(need[-1]) / 2**30:.1f} GiB"
      return {"error": f"did not fit in {cap / 2**30:.1f} GiB ({why})"}
    return {"error": err.splitlines()[-1] if err else f"exit {proc.returncode}"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _cell_check(variant: str, T: int) -> dict:
  import jax
  import numpy as np
  a, ct = _inputs(variant, T, seed=1), _cotangent(T)
  got = _fn(variant, "chunked")(a, ct)
  want = _fn(variant, "parallel")(a, ct)
  errs = []
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    errs.append(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)))
  ok = all(np.isfinite(errs)) and max(errs) < 1e-4
  return {"ok": bool(ok), "max_rel_err": max(errs)}


def xla_buffer_bytes(compiled) -> int:
  """The bytes XLA allocates to run ``compiled``: temporaries, arguments and outputs
  (``memory_analysis()`` of the compiled executable)."""
  m = compiled.memory_analysis()
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def _cell_time(variant: str, form: str, T: int, reps: int) -> dict:
  import jax
  base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  a, ct = _inputs(variant, T), _cotangent(T)
  t0 = time.perf_counter()
  f = _fn(variant, form).lower(a, ct).compile()
  need = xla_buffer_bytes(f)
  print(f"xla_buffer_bytes={need}", file=sys.stderr, flush=True)
  cap = resource.getrlimit(resource.RLIMIT_DATA)[0]
  if cap != resource.RLIM_INFINITY and need > cap:   # would fail: say so without running
    return {"error": f"did not fit in {cap / 2**30:.1f} GiB (XLA's buffers: "
                     f"{need / 2**30:.1f} GiB)"}
  jax.block_until_ready(f(a, ct))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, ct))
    times.append(time.perf_counter() - t0)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {"median_s": statistics.median(times), "compile_s": compile_s,
          "peak_mib": peak / 1024, "base_mib": base / 1024}


def _child(cap: int, kind: str, *args) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--cell", kind, *map(str, args)]
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  return run_capped(cmd, cap, env)


def parse_lengths(items: list[str]) -> list[int]:
  """``["1024", "4096"]`` or ``["1024,4096"]`` (or a mix) -> ``[1024, 4096]``."""
  return [int(t) for item in items for t in item.split(",") if t]


def merge_rounds(rs: list[dict]) -> dict:
  """One cell's rounds -> the median time over the timed rounds, the largest peak RSS (an
  error only when no round was timed)."""
  ok = [r for r in rs if "median_s" in r]
  if not ok:
    return rs[0]
  return {"median_s": statistics.median(r["median_s"] for r in ok),
          "compile_s": statistics.median(r["compile_s"] for r in ok),
          "peak_mib": max(r["peak_mib"] for r in ok),
          "base_mib": statistics.median(r["base_mib"] for r in ok), "rounds": len(ok)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny run: T = 128, 2 reps, simple_gla only")
  p.add_argument("--lengths", nargs="+", default=["1024,4096"],
                 help="sequence lengths, space- or comma-separated (e.g. 1024 4096 16384)")
  p.add_argument("--variants", type=str, default=",".join(VARIANTS))
  p.add_argument("--forms", type=str, default=",".join(FORMS),
                 help="chunked,parallel (default) or one of them")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--rounds", type=int, default=1,
                 help="time every cell this many times, rounds interleaved; median over rounds")
  p.add_argument("--memory-gib", type=float, default=MEMORY_GIB,
                 help="cap on each cell's data segment (lowered to the available memory "
                      "less 2 GiB); a cell that needs more reports 'did not fit'")
  p.add_argument("--cell", nargs="+", help=argparse.SUPPRESS)
  a = p.parse_args(argv)

  if a.cell:  # a child process: one measurement, one JSON line
    if a.cell[0] == "check":
      res = _cell_check(a.cell[1], int(a.cell[2]))
    else:
      res = _cell_time(a.cell[1], a.cell[2], int(a.cell[3]), int(a.cell[4]))
    print(json.dumps(res))
    return 0

  lengths = [128] if a.quick else parse_lengths(a.lengths)
  forms = [f for f in a.forms.split(",") if f]
  for f in forms:
    if f not in FORMS:
      p.error(f"unknown form {f!r}; choose from {FORMS}")
  reps = 2 if a.quick else a.reps
  variants = ["simple_gla"] if a.quick else [
      v for v in a.variants.split(",") if v]
  for v in variants:
    if v not in VARIANTS:
      p.error(f"unknown variant {v!r}; choose from {VARIANTS}")
  check_t = min(CHECK_T, max(lengths))

  cap = memory_cap_bytes(a.memory_gib)
  checks = {v: _child(cap, "check", v, check_t) for v in variants}
  for v, c in checks.items():
    print(f"correctness {v} chunked vs parallel at T={check_t}: {c}", file=sys.stderr)

  cells = []
  for T in lengths:
    cells.append((BASELINE, "", T))
    for v in variants:
      for form in forms:
        cells.append((v, form, T))
  rounds: dict = {c: [] for c in cells}
  for _ in range(max(a.rounds, 1)):
    for v, form, T in cells:
      if v != BASELINE and not checks[v].get("ok"):
        r = {"error": "failed the correctness check: not timed"}
      elif skip_reason(v, form, T):
        r = {"error": skip_reason(v, form, T)}
      else:   # the cap again: the other processes' memory may have changed
        r = _child(memory_cap_bytes(a.memory_gib), "time", v, form, T, reps)
      rounds[(v, form, T)].append(r)
      print(f"T={T} {v} {form}: {r}", file=sys.stderr)
  results = {c: merge_rounds(rs) for c, rs in rounds.items()}

  lines = [
      f"Linear attention, B={B}, N={N}, K=V={H}, chunk 64, forward+backward under jit, median "
      f"of {reps} (median over {max(a.rounds, 1)} interleaved rounds); chunked vs parallel "
      f"checked at T={check_t}; each cell's memory capped at "
      f"{cap / 2**30:.1f} GiB: " + ", ".join(
          f"{v} {'ok' if c.get('ok') else 'FAILED'}" for v, c in checks.items()),
      "",
      "| T | variant | form | time (ms) | peak RSS (MiB) | chunked speed-up vs parallel |"
      f" time vs {BASELINE} | memory vs {BASELINE} |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for T in lengths:
    ref = results[(BASELINE, "", T)]
    rows = [(BASELINE, "")] + [(v, f) for v in variants for f in forms]
    for v, form in rows:
      r = results[(v, form, T)]
      if "error" in r:
        lines.append(f"| {T} | {v} | {form} | {r['error']} | | | | |")
        continue
      t = r["median_s"]
      par = results.get((v, "parallel", T), {})
      speed = (f"{par['median_s'] / t:.2f}x" if form == "chunked" and "median_s" in par
               else "")
      vs_t = f"{t / ref['median_s']:.2f}x" if "median_s" in ref else "n/a"
      vs_m = f"{r['peak_mib'] / ref['peak_mib']:.2f}" if "peak_mib" in ref else "n/a"
      lines.append(f"| {T} | {v} | {form or 'causal'} | {1e3 * t:.1f} | {r['peak_mib']:.0f} | "
                   f"{speed} | {vs_t} | {vs_m} |")
  base = [r["base_mib"] for r in results.values() if "base_mib" in r]
  if base:
    lines.append("")
    lines.append(f"Peak RSS includes the JAX runtime: an idle process with its inputs holds "
                 f"about {statistics.median(base):.0f} MiB. 'time vs {BASELINE}' is the time "
                 f"divided by the softmax baseline's (below 1: faster).")
  print("\n".join(lines))
  bad = [k for k, r in results.items()
         if "error" in r and not r["error"].startswith(("not run", "did not fit"))]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
