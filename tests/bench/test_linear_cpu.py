"""bench/linear_cpu.py --quick runs end to end: the chunked form passes its check against
the parallel form and the table has a timed row for the softmax baseline and both forms."""

import os
import subprocess
import sys

from tests.helpers import ROOT, load_script


def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "linear_cpu.py"), "--quick"],
      capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| 128 |")]
  assert len(rows) == 3, proc.stdout  # the softmax baseline + chunked + parallel
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[3]) > 0 and float(cells[4]) > 0, row  # time (ms), peak RSS (MiB)
  assert "simple_gla ok" in proc.stdout and "FAILED" not in proc.stdout
  chunked = [r for r in rows if "| chunked |" in r][0]
  assert chunked.split("|")[6].strip().endswith("x"), chunked   # the speed-up vs parallel


def test_parallel_buffer_limit():
  """gla's parallel form holds [B, N, T, T, K]: refused above 512 MiB (T >= 1024); the
  scalar-decay variants' [B, N, T, T] is run up to T = 4096 (256 MiB)."""
  bench = load_script("bench/linear_cpu.py", "bench_linear_cpu")
  assert bench.parallel_buffer_bytes("gla", 1024) > bench.PARALLEL_LIMIT_BYTES
  assert bench.parallel_buffer_bytes("gla", 256) <= bench.PARALLEL_LIMIT_BYTES
  assert bench.parallel_buffer_bytes("gated_delta_rule", 4096) <= bench.PARALLEL_LIMIT_BYTES
