"""bench/attention_cpu.py --quick runs end to end: correctness checks pass, the markdown
table has a timed row for every implementation and length, and the block-sparse rows
(T = 512 in --quick) carry a time, a ratio to xla_chunked and a measured error."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script


@pytest.mark.slow
def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "attention_cpu.py"), "--quick"],
      capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| 256 |")]
  dense = [r for r in rows if r.split("|")[2].strip() in ("xla_chunked", "xla", "jax.nn")]
  assert len(dense) == 3, proc.stdout  # T = 256 x 3 implementations
  for row in dense:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[3]) > 0, row  # time (ms), peak RSS (MiB)
  assert "xla_chunked ok" in proc.stdout and "FAILED" not in proc.stdout
  sparse = {row.split("|")[2].strip(): [c.strip() for c in row.strip("|").split("|")]
            for row in proc.stdout.splitlines() if row.startswith("| 512 |")}
  assert set(sparse) == {"xla_chunked", "moba", "blasst"}, proc.stdout
  for name in ("moba", "blasst"):
    cells = sparse[name]
    assert float(cells[3]) > 0 and cells[4].endswith("x") and float(cells[4][:-1]) > 0, cells
    err = [float(x) for x in cells[6].split("/")]  # max / mean
    assert 0 < float(cells[5]) <= 1 and 0 <= err[1] <= err[0] <= 0.15, cells  # kept, error
  threshold = {r.split("|")[2].strip(): [c.strip() for c in r.strip("|").split("|")]
               for r in rows if r.split("|")[2].strip() in ("softmax", "sparsemax", "entmax15")}
  assert set(threshold) == {"softmax", "sparsemax", "entmax15"}, proc.stdout
  for name in ("sparsemax", "entmax15"):
    cells = threshold[name]
    assert float(cells[2]) > 0 and float(cells[3][:-1]) > 0 and float(cells[4]) < 1e-3, cells


def test_a_sparse_row_whose_error_check_fails_is_not_timed(monkeypatch):
  """The sparse section prints no speed for a row whose check fails (children faked)."""
  bench = load_script("bench/attention_cpu.py", "bench_attention_cpu")
  calls = []

  def child(kind, impl, *args):
    calls.append((kind, impl))
    if kind == "sparse":  # moba passes its check and is timed, blasst fails it
      ok = impl == "moba"
      out = {"check": {"ok": ok, "rel_err": 0.01 if ok else 0.4, "mean_rel_err": 0.005,
                       "within_bound": True, "kept_fraction": 0.25}}
      return {**out, "time": {"median_s": 0.5, "peak_mib": 10.0}} if ok else out
    return {"median_s": 2.0, "peak_mib": 10.0}

  monkeypatch.setattr(bench, "_child", child)
  lines, failed = bench._sparse_section(512, 4, 1, 8, 0.15, ["moba", "blasst"])
  assert failed
  moba = next(line for line in lines if "| moba |" in line)
  blasst = next(line for line in lines if "| blasst |" in line)
  assert "| 500.0 | 4.00x |" in moba
  assert "FAILED" in blasst and "not timed" in blasst and "x |" not in blasst


@pytest.mark.slow
@pytest.mark.parametrize("row", ["idw_softmax:distance", "softmax:neg_sq_distance"])
def test_distance_rows_run_and_are_checked(row):
  """A row ``name:distance`` (A18) or ``name:neg_sq_distance`` (A50) runs with that score,
  is checked against the dense path and timed next to dot-product softmax."""
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "attention_cpu.py"), "--quick", "--threshold-only",
       "--threshold-normalizers", row],
      capture_output=True, text=True, timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  row = next(r for r in proc.stdout.splitlines() if f"| {row} |" in r)
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert float(cells[2]) > 0 and cells[3].endswith("x") and float(cells[4]) < 1e-3, cells


def test_a_row_name_carries_its_score():
  bench = load_script("bench/attention_cpu.py", "bench_attention_cpu_rows")
  assert bench._row("idw_softmax:distance") == ("idw_softmax", "distance")
  assert bench._row("sparsemax") == ("sparsemax", "dot")


def test_a_threshold_row_whose_check_fails_is_not_timed(monkeypatch):
  """The class-T section times a normalizer only after its check against the dense path
  passes, and gives its time as a ratio to softmax's from the same run (children faked)."""
  bench = load_script("bench/attention_cpu.py", "bench_attention_cpu_t")
  calls = []

  def child(kind, impl, t, *args):
    calls.append((kind, impl, args[-1] if args else None))
    if kind == "check":  # sparsemax passes, entmax15 fails
      return {"ok": args[0] == "sparsemax", "max_err": 2e-6 if args[0] == "sparsemax" else 0.3}
    return {"median_s": 0.2 if args[-1] == "softmax" else 0.5, "peak_mib": 10.0}

  monkeypatch.setattr(bench, "_child", child)
  lines, failed = bench._threshold_section(512, 1, ["sparsemax", "entmax15"])
  assert failed
  assert ("time", "xla_chunked", "entmax15") not in calls
  sparse = next(line for line in lines if "| sparsemax |" in line)
  ent = next(line for line in lines if "| entmax15 |" in line)
  assert "| 500.0 | 2.50x | 2.0e-06 |" in sparse
  assert "FAILED" in ent and "not timed" in ent and "x |" not in ent
