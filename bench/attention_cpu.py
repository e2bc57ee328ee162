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

Block-sparse rows (A12, ``block_sparse_attention``; ``--sparse-length``, default 16384,
``--sparse-only`` skips the dense table): MoBA and BLASST forward + backward at one causal
length, next to xla_chunked softmax timed in the same run on the same inputs (the ratio is
xla_chunked time / sparse time). Sparse attention only pays where attention is sparse, so
these rows use *topic* inputs instead of white noise: every block of 64 positions gets
one of ``--topics`` (default 32) random directions u_z (norm sqrt(H)), q and k are
u_z + N(0, I) at the positions of that block, v ~ N(0, I): a query block's softmax mass
sits on the earlier blocks of its own topic. Defaults (the documented sparsity): MoBA
block 64, top 8 key blocks per query token (its own block + 7); BLASST block 256, skip
threshold tau = 4 (block 128 skips more pairs but was not faster at T = 16384 on CPU: its
pass over the block maxima runs over 4x as many, smaller tiles). The error is
measured against dense float64 softmax attention on a sampled subset of query rows
(``--sparse-rows`` rows, evenly spaced, the last row included; the dense weights of a row
are 1 x S, so the reference fits memory at any T): err = max over those rows of
||o - o_dense|| / max_j ||v_j||. A sparse row is timed only if its check passes: every
output finite, err <= ``--sparse-tol`` (default 0.15) and err within the kept-block bound
2 x (dense mass outside the row's kept blocks) x max||v|| (+1e-4); the check and the
timing share a process, so a sparse row's peak RSS includes its check's forward. The table also gives
the mean of ||o - o_dense|| / max_j ||v_j|| over the sampled rows.

Class-T rows (K03; ``--threshold-length``, default 8192, ``--threshold-only`` runs only
them): sparsemax and entmax15 attention with xla_chunked, forward + backward on the same
white-noise inputs, next to xla_chunked softmax timed in the same run (ratio = class T
time / softmax time: the threshold search's extra passes over the key blocks). Each is
first checked against jaxsoft's dense ``implementation="xla"`` (output and gradients) at
T = min(T, 1024) in its own process and is not timed if that check fails. A row named
``name:distance`` uses ``score="distance"`` (A18, inverse-distance attention: the logit is
``|q_i - k_j|``), e.g. ``idw_softmax:distance``: the cost of the distance scores next to
the dot product's; ``softmax:neg_sq_distance`` likewise runs A50, norm-aware distance
attention (logits ``-(s/2)||q_i - k_j||^2``, the norm terms on the decay hook's operands).

  python bench/attention_cpu.py                 # T in 1k..16k, markdown table on stdout
  python bench/attention_cpu.py --quick         # a tiny run (used by the tests)
  python bench/attention_cpu.py --sparse-only --sparse-length 4096   # sparse rows only
  python bench/attention_cpu.py --threshold-only --reps 3           # class-T rows only
  python bench/attention_cpu.py --threshold-only --threshold-normalizers \
      idw_softmax:distance,softmax:distance                          # A18 rows
  python bench/attention_cpu.py --threshold-only --threshold-normalizers \
      softmax:neg_sq_distance                                        # the A50 row
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
SPARSE = {  # the documented default sparsity of the block-sparse rows
    "moba": dict(method="moba", block_size=64, top_k_blocks=8),
    "blasst": dict(method="blasst", block_size=256, skip_threshold=4.0),
}
THRESHOLD = ("sparsemax", "entmax15")  # the class-T rows
TOPIC_BLOCK = 64
H = 64


def _row(normalizer: str) -> tuple[str, str]:
  """``"name"`` or ``"name:distance"`` -> (normalizer, score)."""
  name, _, score = normalizer.partition(":")
  return name, score or "dot"


def _fn(impl: str, normalizer: str = "softmax"):
  import jax
  import jax.numpy as jnp

  import jaxsoft

  name, score = _row(normalizer)

  def attn(q, k, v):
    if impl == "jax.nn":
      return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jaxsoft.attention.dot_product_attention(q, k, v, is_causal=True, normalizer=name,
                                                   score=score, implementation=impl)

  def loss(q, k, v, ct):
    return jnp.sum(attn(q, k, v) * ct)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _sparse_fn(impl: str, stats: bool = False):
  import jax
  import jax.numpy as jnp

  import jaxsoft

  def attn(q, k, v):
    if impl == "xla_chunked":
      return jaxsoft.attention.dot_product_attention(q, k, v, is_causal=True,
                                                     implementation="xla_chunked")
    return jaxsoft.attention.block_sparse_attention(q, k, v, is_causal=True,
                                                    return_stats=stats, **SPARSE[impl])

  if stats:
    return jax.jit(attn)

  def loss(q, k, v, ct):
    return jnp.sum(attn(q, k, v) * ct)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _topic_inputs(T: int, topics: int, seed: int = 0):
  """q, k = u_z + noise with one topic z per block of TOPIC_BLOCK positions; v, ct noise."""
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  u = jax.random.normal(ks[0], (topics, H))
  u = u / jnp.linalg.norm(u, axis=-1, keepdims=True) * jnp.sqrt(H)
  nb = -(-T // TOPIC_BLOCK)
  z = jnp.repeat(jax.random.randint(ks[1], (nb,), 0, topics), TOPIC_BLOCK)[:T]
  base = u[z][None, :, None, :]  # [1, T, 1, H]
  q = base + jax.random.normal(ks[2], (1, T, 1, H))
  k = base + jax.random.normal(ks[3], (1, T, 1, H))
  v = jax.random.normal(ks[4], (1, T, 1, H))
  ct = jax.random.normal(ks[5], (1, T, 1, H))
  return q, k, v, ct


def _cell_sparse_check(impl: str, T: int, topics: int, n_rows: int, tol: float) -> dict:
  """Error of the sparse forward against dense float64 softmax on sampled query rows."""
  import numpy as np
  q, k, v, _ = _topic_inputs(T, topics)
  out, stats = _sparse_fn(impl, stats=True)(q, k, v)
  bs = SPARSE[impl]["block_size"]
  rows = np.unique(np.linspace(0, T - 1, min(n_rows, T)).astype(int))
  q64, k64, v64 = (np.asarray(x, np.float64)[0, :, 0] for x in (q, k, v))
  kept = np.asarray(stats["kept_tokens"])[0, 0, rows]  # [rows, nk]
  vmax = float(np.linalg.norm(v64, axis=-1).max())
  errs, bound = [], []
  for r, kr in zip(rows, kept, strict=True):
    z = k64[:r + 1] @ q64[r] / np.sqrt(H)
    p = np.exp(z - z.max())
    p /= p.sum()
    dense = p @ v64[:r + 1]
    skipped = p[~kr[np.arange(r + 1) // bs]].sum()
    errs.append(np.linalg.norm(np.asarray(out, np.float64)[0, r, 0] - dense))
    bound.append(2 * skipped * vmax + 1e-4)
  err = float(np.max(errs)) / vmax
  mean_err = float(np.mean(errs)) / vmax
  finite = bool(np.all(np.isfinite(np.asarray(out))))
  within = bool(np.all(np.asarray(errs) <= np.asarray(bound)))
  nk = kept.shape[-1]
  visible = np.minimum(rows // bs + 1, nk).sum()
  return {"ok": finite and within and err <= tol, "rel_err": err, "mean_rel_err": mean_err,
          "within_bound": within,
          "rows": int(len(rows)), "kept_fraction": float(kept.sum() / visible)}


def _cell_sparse_time(impl: str, T: int, topics: int, reps: int) -> dict:
  import jax
  args = _topic_inputs(T, topics)
  f = _sparse_fn(impl)
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
          "peak_mib": peak / 1024}


def _untimed(check: dict, result: dict | None, why_check: str) -> str | None:
  """Why a row carries no time (its check failed, or its timing errored), or None."""
  if not check.get("ok"):
    return check.get("error") or f"{why_check}: not timed"
  if result is not None and "error" in result:
    return result["error"]
  return None


def _sparse_section(T: int, topics: int, reps: int, n_rows: int, tol: float, impls):
  """The block-sparse rows: (markdown lines, failed)."""
  # one process per implementation: the error check, then (only if it passes) the timing
  both = {i: _child("sparse", i, T, topics, reps, n_rows, tol) for i in impls}
  checks = {i: b.get("check", b) for i, b in both.items()}
  res = {i: b["time"] for i, b in both.items() if "time" in b}
  for i in impls:
    print(f"T={T} {i}: {both[i]}", file=sys.stderr)
  ref = _child("sparse_time", "xla_chunked", T, topics, reps)
  print(f"T={T} xla_chunked (topic inputs): {ref}", file=sys.stderr)
  lines = [
      "",
      f"Block-sparse causal attention at T={T}, B=1, N=1, H={H}, forward+backward under jit, "
      f"median of {reps}; topic inputs ({topics} topics, blocks of {TOPIC_BLOCK}); error vs "
      f"dense float64 softmax on {n_rows} sampled rows (||o - o_dense|| / max ||v||, the max "
      f"limited to {tol}); xla_chunked timed in the same run on the same inputs; kept blocks: "
      f"kept / causally visible (row, key block) pairs of the sampled rows",
      "",
      "| T | implementation | settings | time (ms) | xla_chunked / this | kept blocks | "
      "rel. error (max / mean) | peak RSS (MiB) |",
      "|---|---|---|---|---|---|---|---|",
  ]
  failed = "error" in ref
  if failed:
    lines.append(f"| {T} | xla_chunked | | {ref['error']} | | | | |")
  else:
    lines.append(f"| {T} | xla_chunked | dense | {1e3 * ref['median_s']:.1f} | 1.00x | 1 | 0 | "
                 f"{ref['peak_mib']:.0f} |")
  for i in impls:
    c = checks[i]
    cfg = ", ".join(f"{a}={b}" for a, b in SPARSE[i].items() if a != "method")
    r = res.get(i)
    why = _untimed(c, r, f"error check FAILED (rel. error {c.get('rel_err', float('nan')):.3g}, "
                         f"within bound {c.get('within_bound')})")
    if why is not None or r is None:
      failed = True
      lines.append(f"| {T} | {i} | {cfg} | {why} | | | | |")
      continue
    ratio = f"{ref['median_s'] / r['median_s']:.2f}x" if "median_s" in ref else "n/a"
    lines.append(f"| {T} | {i} | {cfg} | {1e3 * r['median_s']:.1f} | {ratio} | "
                 f"{c['kept_fraction']:.3f} | {c['rel_err']:.2e} / {c['mean_rel_err']:.2e} | "
                 f"{r['peak_mib']:.0f} |")
  return lines, failed


def _threshold_section(T: int, reps: int, normalizers):
  """The class-T rows: (markdown lines, failed)."""
  check_t = min(T, 1024)
  checks = {n: _child("check", "xla_chunked", check_t, n) for n in normalizers}
  ref = _child("time", "xla_chunked", T, reps, "softmax")
  print(f"T={T} xla_chunked softmax: {ref}", file=sys.stderr)
  res = {}
  for n in normalizers:
    print(f"correctness xla_chunked {n} at T={check_t}: {checks[n]}", file=sys.stderr)
    if checks[n].get("ok"):
      res[n] = _child("time", "xla_chunked", T, reps, n)
      print(f"T={T} xla_chunked {n}: {res[n]}", file=sys.stderr)
  lines = [
      "",
      f"Attention rows (class T: K03; name:distance: score=\"distance\", A18) with "
      f"xla_chunked at T={T}, B=1, N=1, H={H}, causal, "
      f"forward+backward under jit, median of {reps}; softmax timed in the same run on the "
      f"same inputs; check: max abs difference of the output and gradients from jaxsoft's "
      f"dense implementation=\"xla\" at T={check_t}",
      "",
      "| T | normalizer | time (ms) | this / softmax | check (max abs diff) |",
      "|---|---|---|---|---|",
  ]
  failed = "error" in ref
  if failed:
    lines.append(f"| {T} | softmax | {ref['error']} | | |")
  else:
    lines.append(f"| {T} | softmax | {1e3 * ref['median_s']:.1f} | 1.00x | |")
  for n in normalizers:
    c, r = checks[n], res.get(n)
    why = _untimed(c, r, f"check FAILED (max abs diff {c.get('max_err')})")
    if why is not None or r is None:
      failed = True
      lines.append(f"| {T} | {n} | {why} | | |")
      continue
    ratio = f"{r['median_s'] / ref['median_s']:.2f}x" if "median_s" in ref else "n/a"
    lines.append(f"| {T} | {n} | {1e3 * r['median_s']:.1f} | {ratio} | {c['max_err']:.1e} |")
  return lines, failed


def _inputs(T: int, seed: int = 0):
  import jax
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return tuple(jax.random.normal(kk, (1, T, 1, H)) for kk in ks)


def _cell_check(impl: str, T: int, normalizer: str = "softmax") -> dict:
  """impl against jax.nn (softmax) or against jaxsoft's dense "xla" path (any other)."""
  import numpy as np
  args = _inputs(T, seed=1)
  got = _fn(impl, normalizer)(*args)
  want = _fn("jax.nn" if normalizer == "softmax" else "xla", normalizer)(*args)
  errs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
          for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=False)]
  ok = all(np.isfinite(errs)) and max(errs) < 1e-3
  return {"ok": bool(ok), "max_err": max(errs)}


def _cell_time(impl: str, T: int, reps: int, normalizer: str = "softmax") -> dict:
  import jax
  base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  args = _inputs(T)
  f = _fn(impl, normalizer)
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
  p.add_argument("--sparse-length", type=int, default=16384,
                 help="T of the block-sparse rows (default 16384)")
  p.add_argument("--sparse-impls", type=str, default=",".join(SPARSE))
  p.add_argument("--sparse-only", action="store_true", help="only the block-sparse rows")
  p.add_argument("--topics", type=int, default=32, help="topics of the sparse rows' inputs")
  p.add_argument("--sparse-rows", type=int, default=256, help="rows sampled for the error")
  p.add_argument("--sparse-tol", type=float, default=0.15, help="error limit of a timed row")
  p.add_argument("--threshold-length", type=int, default=8192,
                 help="T of the class-T rows (default 8192)")
  p.add_argument("--threshold-normalizers", type=str, default=",".join(THRESHOLD))
  p.add_argument("--threshold-only", action="store_true", help="only the class-T rows")
  p.add_argument("--cell", nargs="+", help=argparse.SUPPRESS)
  a = p.parse_args(argv)

  if a.cell:  # a child process: one measurement, one JSON line
    kind = a.cell[0]
    if kind == "check":  # impl T [normalizer]
      res = _cell_check(a.cell[1], int(a.cell[2]), *a.cell[3:4])
    elif kind == "time":  # impl T reps [normalizer]
      res = _cell_time(a.cell[1], int(a.cell[2]), int(a.cell[3]), *a.cell[4:5])
    elif kind == "sparse":  # impl T topics reps rows tol
      impl, T, topics = a.cell[1], int(a.cell[2]), int(a.cell[3])
      res = {"check": _cell_sparse_check(impl, T, topics, int(a.cell[5]), float(a.cell[6]))}
      if res["check"]["ok"]:
        res["time"] = _cell_sparse_time(impl, T, topics, int(a.cell[4]))
    elif kind == "sparse_time":
      res = _cell_sparse_time(a.cell[1], int(a.cell[2]), int(a.cell[3]), int(a.cell[4]))
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
  sparse_impls = [i for i in a.sparse_impls.split(",") if i]
  for i in sparse_impls:
    if i not in SPARSE:
      p.error(f"unknown sparse implementation {i!r}; choose from {tuple(SPARSE)}")
  sparse_t = 512 if a.quick else a.sparse_length
  if sparse_t < 1:
    p.error(f"--sparse-length must be >= 1, got {sparse_t}")
  threshold_t = 256 if a.quick else a.threshold_length
  if threshold_t < 1:
    p.error(f"--threshold-length must be >= 1, got {threshold_t}")
  threshold_norms = [n for n in a.threshold_normalizers.split(",") if n]
  if a.threshold_only:
    lines, failed = _threshold_section(threshold_t, reps, threshold_norms)
    print("\n".join(lines[1:]))
    return 1 if failed else 0
  if a.sparse_only:
    lines, failed = _sparse_section(sparse_t, a.topics, reps, a.sparse_rows, a.sparse_tol,
                                    sparse_impls)
    print("\n".join(lines[1:]))
    return 1 if failed else 0

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
  sparse_lines, sparse_failed = _sparse_section(sparse_t, a.topics, reps, a.sparse_rows,
                                                a.sparse_tol, sparse_impls)
  threshold_lines, threshold_failed = _threshold_section(threshold_t, reps, threshold_norms)
  print("\n".join(lines + sparse_lines + threshold_lines))
  bad = [k for k, r in results.items() if "error" in r]
  return 1 if bad or sparse_failed or threshold_failed else 0


if __name__ == "__main__":
  sys.exit(main())
