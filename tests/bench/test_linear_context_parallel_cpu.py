"""bench/linear_context_parallel_cpu.py: a failed correctness check reports no figures, and
(slow) the script runs on 8 CPU devices with a checked row for each family."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, load_script


def test_a_row_whose_check_fails_reports_no_figures():
  bench = load_script("bench/linear_context_parallel_cpu.py", "bench_linear_cp_cpu")
  ok = bench.row_cells(4096, "simple_gla", "cp=8", 3e-7, 1.5, 12.25)
  assert ok == "| 4096 | simple_gla | cp=8 | 3.0e-07 | 1.5 | 12.2 |", ok
  for err in (2e-3, float("nan")):  # over the tolerance, or NaN: FAILED, no memory or time
    row = bench.row_cells(4096, "gated_delta_rule", "cp=8", err, 1.5, 12.25)
    assert "FAILED" in row and "1.5" not in row and "12.2" not in row, row
  # The error is relative to the reference's largest magnitude, over every leaf.
  ref = (np.array([2.0, -4.0]), np.array([1.0]))
  assert bench.relative_error((np.array([2.0, -4.004]), np.array([1.0])), ref) == \
      pytest.approx(1e-3)
  assert np.isnan(bench.relative_error((np.array([np.nan, -4.0]), np.array([1.0])), ref))


@pytest.mark.slow
def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "linear_context_parallel_cpu.py"), "--lengths",
       "1024", "--reps", "1", "--grad"], capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = [[c.strip() for c in line.strip("|").split("|")]
          for line in proc.stdout.splitlines() if line.startswith("| 1024 |")]
  assert {(r[1], r[2]) for r in rows} == {(f, p) for f in ("simple_gla", "gated_delta_rule")
                                          for p in ("1 device", "cp=8")}, proc.stdout
  for r in rows:
    assert float(r[3]) <= 1e-4 and float(r[4]) > 0 and float(r[5]) > 0, r
