"""bench/context_parallel_cpu.py: a failed correctness check reports no figures, and (slow) the
script runs end to end on 8 CPU devices with a checked, timed row for every path."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script


def test_a_row_whose_check_fails_reports_no_figures():
  bench = load_script("bench/context_parallel_cpu.py", "bench_context_parallel_cpu")
  ok = bench.row_cells("cp=8 all_gather", 512, "softmax", 3e-7, 4.8, 96.9)
  assert ok == "| 512 | softmax | cp=8 all_gather | 3.0e-07 | 4.8 | 96.9 |"
  for err in (2e-3, float("nan")):  # over the tolerance, or NaN: FAILED, no memory or time
    row = bench.row_cells("cp=8 ulysses", 512, "softmax", err, 4.5, 240.3)
    assert "FAILED" in row and "4.5" not in row and "240.3" not in row, row


@pytest.mark.slow
def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "context_parallel_cpu.py"), "--lengths", "256",
       "--reps", "1"], capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = [[c.strip() for c in line.strip("|").split("|")]
          for line in proc.stdout.splitlines() if line.startswith("| 256 |")]
  paths = {(r[1], r[2]) for r in rows}
  assert {("softmax", "1 device"), ("softmax", "cp=8 all_gather"),
          ("sparsemax", "cp=8 ulysses")} <= paths, proc.stdout
  for r in rows:
    assert float(r[3]) <= 1e-4 and float(r[4]) > 0 and float(r[5]) > 0, r
