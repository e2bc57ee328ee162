"""bench/attention_cpu.py --quick runs end to end: correctness checks pass and the markdown
table has a timed row for every implementation and length."""

import os
import subprocess
import sys

from tests.helpers import ROOT


def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "attention_cpu.py"), "--quick"],
      capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| 256 |")]
  assert len(rows) == 3, proc.stdout  # T = 256 x 3 implementations
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[3]) > 0, row  # time (ms), peak RSS (MiB)
  assert "xla_chunked ok" in proc.stdout and "FAILED" not in proc.stdout
