"""CPU benchmark of the linear (chunked-vocabulary) cross-entropy, forward + backward.

``jax.jit(jax.value_and_grad(...))`` of the mean per-token loss with respect to the hidden
states h ``[tokens, d]`` and the output matrix w ``[d, V]``, float32, for

* ``optax``: ``optax.softmax_cross_entropy_with_integer_labels(h @ w, labels)`` on the
  materialised ``[tokens, V]`` logits (the reference), and
* ``chunked``: ``jaxsoft.losses.linear_cross_entropy(h, w, labels)`` (the chunked XLA path;
  its default chunks unless ``--token-chunk`` / ``--vocab-chunk``), and
* ``pallas`` (``--pallas``, on a GPU or TPU only): ``implementation="pallas"``.

Memory: every (size, path) runs in a process of its own, which reports XLA's compiled
memory analysis (temporaries + outputs: the bytes the computation allocates besides its
arguments h, w, labels), and the growth of the resident memory during one run after
compiling: the peak RSS is reset (``/proc/self/clear_refs``) after compiling, so "run
RSS" is the run's own high-water mark minus the RSS before it ("peak RSS" the process's
high-water mark during the run; ``ru_maxrss`` where the reset is unavailable). Time: all
paths of one size are compiled in one process and run in interleaved rounds (each round
runs every path once, the order rotating), so that a machine busy with other work slows
them alike; "time vs optax" is the median of the per-round ratios.

Before timing, each path is checked against ``optax`` in its own process at
``min(tokens, 1024) x min(V, 8192)``: the loss and both gradients, to 1e-4 relative to
the largest entry. A path that fails is not timed (its row says so).

  python bench/losses.py                                  # 8k x 128k and 16k x 256k, d = 256
  python bench/losses.py --sizes 2048x32768,8192x32768    # what fits a small machine
  python bench/losses.py --quick                          # a tiny run (used by the tests)
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

PATHS = ("optax", "chunked", "pallas")
REFERENCE = "optax"
CHECK_TOKENS, CHECK_VOCAB = 1024, 8192
TOLERANCE = 1e-4


def _inputs(n: int, d: int, vocab: int, seed: int = 0):
  import jax
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  h = jax.random.normal(ks[0], (n, d))
  w = jax.random.normal(ks[1], (d, vocab)) / d ** 0.5
  y = jax.random.randint(ks[2], (n,), 0, vocab)
  return h, w, y


def _fn(path: str, token_chunk: int | None, vocab_chunk: int | None):
  import jax
  import jax.numpy as jnp
  import optax

  import jaxsoft

  def loss(h, w, y):
    if path == "optax":
      per_token = optax.softmax_cross_entropy_with_integer_labels(h @ w, y)
    else:
      per_token = jaxsoft.losses.linear_cross_entropy(
          h, w, y, token_chunk_size=token_chunk, vocab_chunk_size=vocab_chunk,
          implementation="pallas" if path == "pallas" else None)
    return jnp.mean(per_token)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _chunks(a) -> tuple[int | None, int | None]:
  return (a.token_chunk or None), (a.vocab_chunk or None)


def _cell_check(path: str, n: int, d: int, vocab: int, tc: int, vc: int) -> dict:
  import jax
  import numpy as np
  args = _inputs(n, d, vocab, seed=1)
  got = _fn(path, tc or None, vc or None)(*args)
  want = _fn(REFERENCE, None, None)(*args)
  errs = []
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    errs.append(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)))
  ok = bool(all(np.isfinite(errs)) and max(errs) < TOLERANCE)
  return {"ok": ok, "max_rel_err": max(errs)}


def _cell_memory(path: str, n: int, d: int, vocab: int, tc: int, vc: int) -> dict:
  """One path in a process of its own: XLA's compiled memory analysis and the growth of the
  peak RSS over one run."""
  import jax
  args = _inputs(n, d, vocab)
  jax.block_until_ready(args)
  compiled = _fn(path, tc or None, vc or None).lower(*args).compile()
  mem = compiled.memory_analysis()
  xla_bytes = None if mem is None else int(mem.temp_size_in_bytes + mem.output_size_in_bytes)
  reset = _reset_peak_rss()  # Linux: the peak RSS restarts from the current RSS
  base = _status_kib("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  jax.block_until_ready(compiled(*args))
  peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {"peak_mib": peak / 1024, "base_mib": base / 1024, "run_mib": (peak - base) / 1024,
          "xla_mib": None if xla_bytes is None else xla_bytes / 2**20}


def _reset_peak_rss() -> bool:
  """Resets the process's peak RSS (VmHWM) to its current RSS; False where unsupported."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return _status_kib("VmHWM") is not None
  except OSError:
    return False


def _status_kib(field: str) -> int | None:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def _cell_time(paths: str, n: int, d: int, vocab: int, tc: int, vc: int, reps: int) -> dict:
  """Every path of one size in one process, interleaved: each round runs every path once
  (the order rotating), so that a busy machine slows all of them alike; the ratio to the
  reference is the median of the per-round ratios."""
  import jax
  names = paths.split(",")
  args = _inputs(n, d, vocab)
  compiled = {x: _fn(x, tc or None, vc or None).lower(*args).compile() for x in names}
  for c in compiled.values():  # warm-up
    jax.block_until_ready(c(*args))
  times: dict[str, list[float]] = {x: [] for x in names}
  for r in range(reps):
    for x in names[r % len(names):] + names[:r % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(compiled[x](*args))
      times[x].append(time.perf_counter() - t0)
  ref = times[REFERENCE]
  return {x: {"median_s": statistics.median(t),
              "ratio": statistics.median(a / b for a, b in zip(t, ref, strict=True))}
          for x, t in times.items()}


def _child(kind: str, *args) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--cell", kind, *map(str, args)]
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
  if proc.returncode != 0:
    err = proc.stderr.strip().splitlines()
    return {"error": err[-1] if err else f"exit {proc.returncode}"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_sizes(text: str) -> list[tuple[int, int]]:
  """``"8192x131072,16384x262144"`` -> [(tokens, V), ...]."""
  out = []
  for item in text.split(","):
    n, _, v = item.strip().lower().partition("x")
    if not (n.isdigit() and v.isdigit()) or int(n) < 1 or int(v) < 1:
      raise ValueError(f"`--sizes`: expected TOKENSxVOCAB items, got {item!r}")
    out.append((int(n), int(v)))
  return out


def _ratio(r: dict, ref: dict, key: str) -> str:
  if r.get(key) is None or not ref.get(key):
    return "n/a"
  return f"{r[key] / ref[key]:.3f}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny run: 256 x 2048, d = 32, 2 reps")
  p.add_argument("--sizes", type=str, default="8192x131072,16384x262144",
                 help="comma-separated TOKENSxVOCAB")
  p.add_argument("--hidden", type=int, default=256, help="d, the hidden size")
  p.add_argument("--token-chunk", type=int, default=0, help="0: linear_cross_entropy's default")
  p.add_argument("--vocab-chunk", type=int, default=0, help="0: linear_cross_entropy's default")
  p.add_argument("--pallas", action="store_true", help="also time implementation='pallas'")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--cell", nargs="+", help=argparse.SUPPRESS)
  a = p.parse_args(argv)

  if a.cell:  # a child process: one measurement, one JSON line
    kind, path, *nums = a.cell
    nums = [int(x) for x in nums]
    cells = {"check": _cell_check, "memory": _cell_memory, "time": _cell_time}
    res = cells[kind](path, *nums)
    print(json.dumps(res))
    return 0

  try:
    sizes = [(256, 2048)] if a.quick else parse_sizes(a.sizes)
  except ValueError as e:
    p.error(str(e))
  d = 32 if a.quick else a.hidden
  reps = 2 if a.quick else a.reps
  tc, vc = a.token_chunk, a.vocab_chunk
  paths = [x for x in PATHS if x != "pallas" or a.pallas]

  check_n = min(max(n for n, _ in sizes), CHECK_TOKENS)
  check_v = min(max(v for _, v in sizes), CHECK_VOCAB)
  checks = {x: _child("check", x, check_n, d, check_v, tc, vc) for x in paths if x != REFERENCE}
  for x, c in checks.items():
    print(f"correctness {x} vs {REFERENCE} at {check_n}x{check_v}: {c}", file=sys.stderr)
  checks[REFERENCE] = {"ok": True}

  results = {}
  for n, vocab in sizes:
    ok = [x for x in paths if checks[x].get("ok")]
    timed = _child("time", ",".join(ok), n, d, vocab, tc, vc, reps)
    for x in paths:
      if x not in ok:
        results[(x, n, vocab)] = {"error": "failed the correctness check: not timed"}
      elif "error" in timed:
        results[(x, n, vocab)] = timed
      else:
        mem = _child("memory", x, n, d, vocab, tc, vc)
        results[(x, n, vocab)] = {**timed[x], **mem}
      print(f"{n}x{vocab} {x}: {results[(x, n, vocab)]}", file=sys.stderr)

  lines = [
      f"Cross-entropy of h @ w, d={d}, float32, forward+backward (h and w) under jit, median of "
      f"{reps} interleaved rounds; chunks: tokens {tc or 'default'}, vocabulary {vc or 'default'}; checked vs "
      f"{REFERENCE} at {check_n}x{check_v}: " + ", ".join(
          f"{x} {'ok' if c.get('ok') else 'FAILED'} ({c.get('max_rel_err', c.get('error'))})"
          for x, c in checks.items() if x != REFERENCE),
      "",
      "| tokens x V | path | time (ms) | XLA temp+out (MiB) | run RSS (MiB) | peak RSS (MiB) |"
      f" time vs {REFERENCE} | XLA memory vs {REFERENCE} | run RSS vs {REFERENCE} |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for n, vocab in sizes:
    ref = results.get((REFERENCE, n, vocab), {})
    for x in paths:
      r = results[(x, n, vocab)]
      if "error" in r:
        lines.append(f"| {n}x{vocab} | {x} | {r['error']} | | | | | | |")
        continue
      xla = "n/a" if r["xla_mib"] is None else f"{r['xla_mib']:.1f}"
      lines.append(
          f"| {n}x{vocab} | {x} | {1e3 * r['median_s']:.1f} | {xla} | {r['run_mib']:.0f} | "
          f"{r['peak_mib']:.0f} | {r['ratio']:.3f} | {_ratio(r, ref, 'xla_mib')} | "
          f"{_ratio(r, ref, 'run_mib')} |")
  lines += ["", "XLA temp+out: the compiled computation's temporaries and outputs (its "
            "arguments h, w, labels excluded). run RSS: the high-water mark of the resident memory "
            "during one run minus the resident memory before it (after compiling). time vs optax: the median of the "
            "per-round ratios. Ratios below 1: smaller/faster."]
  print("\n".join(lines))
  bad = [k for k, r in results.items() if "error" in r]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
