"""bench/linear_cpu.py --quick runs end to end: the chunked form passes its check against
the parallel form and the table has a timed row for the softmax baseline and both forms."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script


# a subprocess run of the whole script (~15 s): the slow suite; the default run keeps the refusal tests
@pytest.mark.slow
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


def test_parallel_cells_run_under_a_memory_cap():
  """The parallel forms are no longer refused by the size of one [B, N, T, T] buffer (4 GiB
  at T = 16384): every cell runs capped, and only the delta rules' O(T^3) parallel forms are
  skipped above T = 4096, with the reason. A child that allocates past its cap is reported
  as "did not fit in N GiB", with the size of XLA's buffers the child printed (not as a
  failure); one within it returns its JSON line."""
  bench = load_script("bench/linear_cpu.py", "bench_linear_cpu")
  assert bench.parallel_buffer_bytes("gla", 16384) == 4 * 2**30
  for variant in ("linear_attention", "simple_gla", "lightning_attention", "gla"):
    assert bench.skip_reason(variant, "parallel", 16384) is None
  for variant in ("delta_rule", "gated_delta_rule"):
    assert "O(T^3)" in bench.skip_reason(variant, "parallel", 16384)
    assert bench.skip_reason(variant, "parallel", 4096) is None
    assert bench.skip_reason(variant, "chunked", 16384) is None
  cap = 2**30
  assert 2**30 <= bench.memory_cap_bytes(1.0) <= cap
  alloc = ("import json, sys, numpy as np; print('xla_buffer_bytes=3221225472', file=sys.stderr);"
           " x = np.ones({n}, np.uint8); print(json.dumps({{'n': x.size}}))")
  small = bench.run_capped([sys.executable, "-c", alloc.format(n=2**20)], cap)
  assert small == {"n": 2**20}
  big = bench.run_capped([sys.executable, "-c", alloc.format(n=2 * 2**30)], cap)
  assert big == {"error": "did not fit in 1.0 GiB (an allocation failed; XLA's buffers: 3.0 GiB)"}
  crash = bench.run_capped([sys.executable, "-c", "raise SystemExit('boom')"], cap)
  assert crash == {"error": "boom"}


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
