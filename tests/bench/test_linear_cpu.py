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
  """The parallel forms hold [B, N, T, T] (gla too: its per-channel scores are built without
  a [T, T, K] tensor): refused above 512 MiB (T = 16384), run up to T = 4096 (256 MiB)."""
  bench = load_script("bench/linear_cpu.py", "bench_linear_cpu")
  for variant in ("gla", "gated_delta_rule"):
    assert bench.parallel_buffer_bytes(variant, 16384) > bench.PARALLEL_LIMIT_BYTES
    assert bench.parallel_buffer_bytes(variant, 4096) <= bench.PARALLEL_LIMIT_BYTES


def test_lengths_and_rounds():
  """``--lengths 1024 4096 16384`` and ``--lengths 1024,4096`` both parse; the rounds of a
  cell merge to the median time and the largest peak RSS, errors only when none was timed."""
  bench = load_script("bench/linear_cpu.py", "bench_linear_cpu")
  assert bench.parse_lengths(["1024", "4096", "16384"]) == [1024, 4096, 16384]
  assert bench.parse_lengths(["1024,4096"]) == [1024, 4096]
  rounds = [{"median_s": t, "compile_s": 1.0, "peak_mib": m, "base_mib": 100.0}
            for t, m in ((3.0, 10.0), (1.0, 30.0), (2.0, 20.0))]
  merged = bench.merge_rounds(rounds + [{"error": "exit 1"}])
  assert merged["median_s"] == 2.0 and merged["peak_mib"] == 30.0 and merged["rounds"] == 3
  assert bench.merge_rounds([{"error": "exit 1"}]) == {"error": "exit 1"}
