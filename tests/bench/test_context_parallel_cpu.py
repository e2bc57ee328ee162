"""bench/context_parallel_cpu.py: a failed correctness check reports no figures (both tables),
the weak-scaling peak is arguments + outputs + temp - aliased bytes, and (slow) the script runs
end to end on 8 CPU devices with a checked row for every path, the ring's memory per device
flat under weak scaling while all_gather's grows with T."""

import os
import subprocess
import sys
import types

import pytest

from tests.helpers import ROOT, load_script


def _bench():
  return load_script("bench/context_parallel_cpu.py", "bench_context_parallel_cpu")


def test_a_row_whose_check_fails_reports_no_figures():
  bench = _bench()
  ok = bench.row_cells("cp=8 all_gather", 512, "softmax", 3e-7, 4.8, 96.9)
  assert ok == "| 512 | softmax | cp=8 all_gather | 3.0e-07 | 4.8 | 96.9 |"
  for err in (2e-3, float("nan")):  # over the tolerance, or NaN: FAILED, no memory or time
    row = bench.row_cells("cp=8 ulysses", 512, "softmax", err, 4.5, 240.3)
    assert "FAILED" in row and "4.5" not in row and "240.3" not in row, row


def test_weak_rows_and_peak():
  bench = _bench()
  stats = types.SimpleNamespace(temp_size_in_bytes=3 * 2**20, argument_size_in_bytes=2**20,
                                output_size_in_bytes=2**19, alias_size_in_bytes=2**18)
  temp, io, peak = bench.memory_mib(stats)
  assert (temp, io, peak) == (3.0, 1.5, 4.25)
  assert bench.memory_mib(None) is None
  ok = bench.weak_row_cells(4, 2048, "entmax15", "cp=4 ring", 3e-6, (temp, io, peak), None)
  assert ok == "| 4 | 2048 | entmax15 | cp=4 ring | 3.0e-06 | 3.0 | 1.5 | 4.2 | - |", ok
  for err in (2e-3, float("nan")):
    row = bench.weak_row_cells(4, 2048, "entmax15", "cp=4 ring", err, (temp, io, peak), 12.5)
    assert "FAILED" in row and "3.0 |" not in row and "12.5" not in row, row


def _rows(stdout, width):
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines()
          if line.startswith("| ") and not line.startswith("| T ") and
          not line.startswith("| cp ")]
  assert rows and all(len(r) == width for r in rows), stdout
  return rows


@pytest.mark.slow
def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "context_parallel_cpu.py"), "--lengths", "256",
       "--reps", "1"], capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = _rows(proc.stdout, 6)
  paths = {(r[1], r[2]) for r in rows}
  assert {("softmax", "1 device"), ("softmax", "cp=8 all_gather"),
          ("sparsemax", "cp=8 ulysses")} <= paths, proc.stdout
  for r in rows:
    assert float(r[3]) <= 1e-4 and float(r[4]) > 0 and float(r[5]) > 0, r


@pytest.mark.slow
def test_weak_scaling_runs_and_the_ring_stays_flat():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "context_parallel_cpu.py"), "--weak", "256",
       "--cps", "2", "4", "8", "--normalizers", "softmax", "entmax15", "--reps", "0"],
      capture_output=True, text=True, timeout=1800, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  temp = {}
  for r in _rows(proc.stdout, 9):
    assert float(r[4]) <= 1e-4, r
    temp[int(r[0]), r[2], r[3].split()[-1]] = float(r[5])
  assert len(temp) == 3 * 2 * 4, temp
  for norm in ("softmax", "entmax15"):
    # T = 256 * cp: all_gather holds every key (temp ~ T), the ring one block at a time
    # (flat; entmax15's ring also holds the gathered queries, T x N x H floats, +1 MiB at
    # cp = 8 against tens of MiB of tiles)
    assert temp[8, norm, "all_gather"] > 3 * temp[2, norm, "all_gather"], temp
    assert temp[8, norm, "ring"] < 1.25 * temp[2, norm, "ring"], temp
    assert temp[8, norm, "device"] > 12 * temp[2, norm, "device"], temp
