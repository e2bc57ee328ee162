"""CPU benchmark of the threshold normalizers: sparsemax, entmax15, entmax(alpha=1.5).

Compares jaxsoft on float32 rows ``[rows, n]`` with the baselines for the same mapping:
``optax.projections.projection_simplex`` (vmapped, jitted; sparsemax only) and the
PyTorch ``entmax`` package (``sparsemax``/``entmax15`` sort-based, ``entmax_bisect``), run on
the CPU with ``torch.no_grad()`` and as many threads as the machine has. ``jax.nn.softmax``
on the same rows is the speed reference. Every figure is the median of repeated runs in
this one process, and an op (jaxsoft's or a baseline's) whose output fails the correctness
check against a float64 sort-based oracle gets no time: its cell says FAILED.

Usage::

  python bench/normalizers.py            # rows 4096, n in {128, 1024, 8192}
  python bench/normalizers.py --quick    # tiny sizes, a smoke test
  python bench/normalizers.py --no-torch # skip the PyTorch baselines
  python bench/normalizers.py --single-thread  # one thread everywhere, CPU (process) time

``--single-thread`` sets ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` (and one
PyTorch thread) before JAX starts and times each call by ``time.process_time``: the CPU
time of this process, which other processes on a loaded machine barely change. The
figures are then per core; the ratios are the ones to compare.

Columns: ms per call; "vs fastest baseline" = (fastest baseline's ms) / (jaxsoft ms), so
> 1 means jaxsoft is faster; "/ softmax" = (jaxsoft ms) / (jax.nn.softmax ms).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SINGLE_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"
if __name__ == "__main__" and "--single-thread" in sys.argv[1:]:
  # XLA reads its flags once, when the CPU backend starts: before `import jax` is safest.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SINGLE_THREAD_FLAGS).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxsoft.normalizers import entmax, entmax15, sparsemax  # noqa: E402

CHECK_ROWS = 128  # rows checked against the float64 oracle before anything is timed
CHECK_ATOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Op:
  """A jaxsoft op to time: ``fn(x[rows, n]) -> weights`` computing ``mapping``."""

  name: str
  mapping: str  # "sparsemax" or "entmax15"
  fn: Callable


def default_ops() -> list[Op]:
  return [
      Op("sparsemax", "sparsemax", sparsemax),
      Op("entmax15", "entmax15", entmax15),
      # A Python 1.5 dispatches to the exact entmax15 solver ...
      Op("entmax(alpha=1.5)", "entmax15", lambda x: entmax(x, alpha=1.5)),
      # ... an array alpha runs the bisection for general alpha (30 steps).
      Op("entmax(alpha=array 1.5), bisection", "entmax15",
         lambda x: entmax(x, alpha=jnp.asarray(1.5, jnp.float32))),
  ]


# --- float64 oracles (sort-based, written for clarity) ------------------------------------


def oracle(mapping: str, x) -> np.ndarray:
  """Sort-based sparsemax (Martins & Astudillo 2016) / entmax15 (Peters et al. 2019)."""
  z = np.asarray(x, np.float64)
  if mapping == "entmax15":
    z = z / 2
  zs = -np.sort(-z, axis=-1)
  k = np.arange(1, z.shape[-1] + 1)
  cs = np.cumsum(zs, -1)
  if mapping == "sparsemax":
    kz = np.max(np.where(1 + k * zs > cs, k, 0), -1, keepdims=True)
    tau = (np.take_along_axis(cs, kz - 1, -1) - 1) / kz
    return np.maximum(z - tau, 0)
  mean = cs / k
  delta = (1 - k * (np.cumsum(zs * zs, -1) / k - mean**2)) / k
  tau_k = mean - np.sqrt(np.maximum(delta, 0))
  kz = np.max(np.where(tau_k <= zs, k, 0), -1, keepdims=True)
  tau = np.take_along_axis(tau_k, kz - 1, -1)
  return np.maximum(z - tau, 0) ** 2


# --- baselines ----------------------------------------------------------------------------


CLOCK: dict[str, Any] = {"fn": time.perf_counter, "threads": None}  # set by main()


def _torch():
  try:
    import entmax as torch_entmax  # noqa: PLC0415
    import torch  # noqa: PLC0415
  except Exception:  # torch / entmax absent: their columns read n/a
    return None, None
  torch.set_num_threads(CLOCK["threads"] or os.cpu_count() or 1)
  return torch, torch_entmax


def baselines(mapping: str, use_torch: bool) -> dict[str, Callable | None]:
  """name -> fn(np.ndarray) -> np.ndarray (None when unavailable), per column."""
  out: dict[str, Callable | None] = {"optax": None, "torch exact": None, "torch bisect": None}
  if mapping == "sparsemax":
    proj = jax.jit(jax.vmap(optax.projections.projection_simplex))
    out["optax"] = lambda x: proj(x).block_until_ready()
  torch, te = _torch() if use_torch else (None, None)
  if torch is not None:
    exact = te.sparsemax if mapping == "sparsemax" else te.entmax15
    alpha = 2.0 if mapping == "sparsemax" else 1.5

    def run_exact(x, exact=exact):
      with torch.no_grad():
        return exact(x, dim=-1)

    def run_bisect(x, alpha=alpha):
      with torch.no_grad():
        return te.entmax_bisect(x, alpha=alpha, dim=-1)

    out["torch exact"], out["torch bisect"] = run_exact, run_bisect
  return out


def _as_input(name: str, x: np.ndarray):
  if name.startswith("torch"):
    import torch  # noqa: PLC0415
    return torch.from_numpy(x)
  return jnp.asarray(x)


def _to_numpy(y) -> np.ndarray:
  if hasattr(y, "detach"):
    return y.detach().numpy()
  return np.asarray(y)


SLOW_CALL_S = 5.0  # a call slower than this is timed once: the ratio is clear already


def median_ms(fn, x, reps: int, warm_up: bool = True) -> float:
  """Median time of ``fn(x)`` in ms (outputs blocked on), after a warm-up call.

  Wall time, or this process's CPU time under ``--single-thread``. Without ``warm_up``
  (eager PyTorch: nothing to compile) the first call counts.
  """
  clock = CLOCK["fn"]
  if warm_up:
    jax.block_until_ready(fn(x))
  times = []
  for _ in range(reps):
    t0 = clock()
    jax.block_until_ready(fn(x))
    times.append(clock() - t0)
    if times[-1] > SLOW_CALL_S:
      break
  return 1e3 * statistics.median(times)


def check(fn, x_np: np.ndarray, mapping: str, name: str) -> float:
  """Max abs error of ``fn`` on the first CHECK_ROWS rows against the float64 oracle."""
  rows = x_np[:CHECK_ROWS]
  got = _to_numpy(fn(_as_input(name, rows)))
  if got.shape != rows.shape or not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.max(np.abs(got - oracle(mapping, rows))))


def _fmt(ms: float | None) -> str:
  return "n/a" if ms is None else (f"{ms:.3g}" if ms < 100 else f"{ms:.0f}")


def run(rows: int, sizes, reps: int, ops: list[Op], use_torch: bool = True, seed: int = 0,
        log=print) -> str:
  """Runs the benchmark and returns the markdown table."""
  lines = ["| n | op | jaxsoft ms | optax ms | torch exact ms | torch bisect ms "
           "| vs fastest baseline | / softmax |",
           "|---|---|---|---|---|---|---|---|"]
  rng = np.random.default_rng(seed)
  for n in sizes:
    x_np = rng.standard_normal((rows, n)).astype(np.float32)
    x = jnp.asarray(x_np)
    softmax = jax.jit(jax.nn.softmax)
    # The reference is timed before and after the ops and the faster median kept: a one-off
    # slow spell must not flatter the ratios (the reported ratio can only grow by this).
    softmax_ms = median_ms(softmax, x, reps)
    base_ms: dict[str, dict[str, float | str | None]] = {}
    for mapping in sorted({op.mapping for op in ops}):
      base_ms[mapping] = {}
      for bname, bfn in baselines(mapping, use_torch).items():
        if bfn is None:
          base_ms[mapping][bname] = None
          continue
        err = check(bfn, x_np, mapping, bname)
        if not err <= CHECK_ATOL:
          base_ms[mapping][bname] = f"FAILED check (err {err:.2g})"
          continue
        base_ms[mapping][bname] = median_ms(bfn, _as_input(bname, x_np), reps,
                                            warm_up=not bname.startswith("torch"))
        log(f"  n={n} {mapping} {bname}: {base_ms[mapping][bname]:.3f} ms")
    rows_n = []
    for op in ops:
      cells = base_ms[op.mapping]
      fn = jax.jit(op.fn)
      err = check(fn, x_np, op.mapping, op.name)
      timed = [v for v in cells.values() if isinstance(v, float)]
      fastest = min(timed) if timed else None
      if not err <= CHECK_ATOL:
        # Refuse to report a speed for an op that does not compute its mapping.
        ours, ratio, rel = f"FAILED check (err {err:.2g})", "-", "-"
      else:
        ms = median_ms(fn, x, reps)
        ours = _fmt(ms)
        ratio = "n/a" if fastest is None else f"{fastest / ms:.1f}x"
        rel = ms
        log(f"  n={n} {op.name}: {ms:.3f} ms")
      col = [c if isinstance(c, str) else _fmt(c) for c in
             (cells["optax"], cells["torch exact"], cells["torch bisect"])]
      rows_n.append((op.name, ours, col, ratio, rel))
    softmax_ms = min(softmax_ms, median_ms(softmax, x, reps))
    for name, ours, col, ratio, rel in rows_n:
      rel = rel if isinstance(rel, str) else f"{rel / softmax_ms:.1f}x"
      lines.append(f"| {n} | {name} | {ours} | {' | '.join(col)} | {ratio} | {rel} |")
    lines.append(f"| {n} | jax.nn.softmax (reference) | {_fmt(softmax_ms)} | | | | | 1.0x |")
  return "\n".join(lines)


def main(argv=None, ops: list[Op] | None = None, log=print) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
  parser.add_argument("--rows", type=int, default=None)
  parser.add_argument("--sizes", type=int, nargs="+", default=None)
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
  parser.add_argument("--single-thread", action="store_true",
                      help="one XLA/PyTorch thread, timed by process (CPU) time")
  args = parser.parse_args(argv)
  single = args.single_thread
  CLOCK["fn"], CLOCK["threads"] = (time.process_time, 1) if single else (time.perf_counter, None)
  if single and SINGLE_THREAD_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    log(f"note: XLA_FLAGS lacks {SINGLE_THREAD_FLAGS} (set it before JAX starts, e.g. run "
        "this file as a script); XLA may still use several threads")
  rows = args.rows or (64 if args.quick else 4096)
  sizes = args.sizes or ([16, 128] if args.quick else [128, 1024, 8192])
  reps = args.reps or (2 if args.quick else 7)
  torch, _ = _torch() if not args.no_torch else (None, None)
  log(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; "
      f"torch {getattr(torch, '__version__', 'absent')}"
      + (f" ({torch.get_num_threads()} threads)" if torch is not None else "")
      + f"; rows={rows}, median of {reps} (calls over {SLOW_CALL_S:g} s: one run); "
      + ("single-threaded, process (CPU) time" if single else "wall time"))
  table = run(rows, sizes, reps, default_ops() if ops is None else ops,
              use_torch=not args.no_torch, log=log)
  log(table)
  return table


if __name__ == "__main__":
  main(sys.argv[1:])
