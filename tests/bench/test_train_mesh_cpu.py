"""bench/train_mesh_cpu.py: a mesh whose losses disagree with the baseline's reports no
figures, and (slow) the script runs on 8 CPU devices with a checked row for each mesh."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script


def test_a_mesh_whose_losses_disagree_reports_no_figures():
  bench = load_script("bench/train_mesh_cpu.py", "bench_train_mesh_cpu")
  base = [5.5, 5.25, 5.0]
  ok = bench.row_cells("fsdp=8", [5.5, 5.25 * (1 + 2e-6), 5.0], base, 1234.0, 2468.0)
  assert ok == "| fsdp=8 | 2.0e-06 | 1,234 | 0.50 |", ok
  # One step off by more than the tolerance, a NaN, or a missing step: FAILED, no figures.
  for losses in ([5.5, 5.25, 5.01], [5.5, float("nan"), 5.0], [5.5, 5.25]):
    row = bench.row_cells("data=2,context=4", losses, base, 1234.0, 2468.0)
    assert "FAILED" in row and "1,234" not in row and "0.50" not in row, row
  assert not bench.losses_agree([], [])


@pytest.mark.slow
def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "train_mesh_cpu.py"), "--meshes", "data=8",
       "fsdp=2,tensor=2,context=2", "--warmup", "1", "--steps", "1"],
      capture_output=True, text=True, timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = [[c.strip() for c in line.strip("|").split("|")]
          for line in proc.stdout.splitlines() if line.startswith("| data=8 |")
          or line.startswith("| fsdp=2,tensor=2,context=2 |")]
  assert len(rows) == 2, proc.stdout
  assert rows[0][3] == "1.00" and float(rows[1][1]) <= 1e-4, rows
  for r in rows:
    assert float(r[2].replace(",", "")) > 0, r
