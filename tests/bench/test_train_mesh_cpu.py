"""bench/train_mesh_cpu.py: a mesh whose losses disagree with the baseline's reports no
figures; the timed steps run in rounds, interleaved in a rotated order with the garbage
collector off, and each round's ratio is taken within the round; (slow) the script runs on 8
CPU devices with a checked row for each mesh."""

import gc
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script


def _bench():
  return load_script("bench/train_mesh_cpu.py", "bench_train_mesh_cpu")


def test_a_mesh_whose_losses_disagree_reports_no_figures():
  bench = _bench()
  base = [5.5, 5.25, 5.0]
  # three rounds: the row's tokens/s is the median rate, its ratio the median of the rounds'
  # own ratios (1000/2000, 1500/2500, 1200/2000 -> 0.5, 0.6, 0.6), not a ratio of medians
  rates, base_rates = [1000.0, 1500.0, 1200.0], [2000.0, 2500.0, 2000.0]
  ok = bench.row_cells("fsdp=8", [5.5, 5.25 * (1 + 2e-6), 5.0], base, rates, base_rates)
  assert ok == "| fsdp=8 | 2.0e-06 | 1,200 | 0.60 | 0.50-0.60 |", ok
  cpu = bench.row_cells("fsdp=8", base, base, rates, base_rates, [90.0, 80.0, 70.0],
                        [100.0, 100.0, 100.0])
  assert cpu == "| fsdp=8 | 0.0e+00 | 1,200 | 0.60 | 0.50-0.60 | 0.80 | 0.70-0.90 |", cpu
  # One step off by more than the tolerance, a NaN, or a missing step: FAILED, no figures.
  for losses in ([5.5, 5.25, 5.01], [5.5, float("nan"), 5.0], [5.5, 5.25]):
    for row in (bench.row_cells("data=2,context=4", losses, base, rates, base_rates),
                bench.row_cells("data=2,context=4", losses, base, rates, base_rates,
                                [90.0, 80.0, 70.0], [100.0, 100.0, 100.0])):
      assert "FAILED" in row and "1,200" not in row and "0.60" not in row, row
      assert "0.80" not in row, row
  assert not bench.losses_agree([], [])


def test_rounds_rotate_the_mesh_order_with_the_collector_off(monkeypatch):
  bench = _bench()
  calls = []
  collections = []  # (a full collection of the test process's heap takes seconds)
  monkeypatch.setattr(gc, "collect", lambda: collections.append(len(calls)))

  def fake_step(r):
    def step(state, batch):
      calls.append((r, batch, gc.isenabled()))
      return state + 1, {"loss": 5.0 - 0.25 * batch}
    return step

  runs = [(fake_step(r), 0, list(range(2 + 3 * 2))) for r in range(3)]
  assert gc.isenabled()
  results = bench.measure(runs, warmup=2, rounds=3, steps=2, tokens=100)
  assert gc.isenabled()  # restored
  assert collections == [6, 12, 18]  # before each round
  assert [r for r, _, _ in calls[:6]] == [0, 1, 2, 0, 1, 2]  # warm-up: every mesh, in order
  timed = calls[6:]
  assert [r for r, _, _ in timed] == [0, 1, 2] * 2 + [1, 2, 0] * 2 + [2, 0, 1] * 2
  assert not any(enabled for _, _, enabled in timed)
  for r, (losses, rates, cpu_rates) in enumerate(results):  # every mesh saw batches 0..7 in order
    assert [b for m, b, _ in calls if m == r] == list(range(8))
    assert losses == [5.0 - 0.25 * b for b in range(8)] and len(rates) == len(cpu_rates) == 3
    assert all(rate > 0 for rate in rates + cpu_rates)


def test_a_passed_deadline_stops_after_the_minimum_rounds(monkeypatch):
  bench = _bench()
  monkeypatch.setattr(gc, "collect", lambda: None)
  runs = [(lambda state, batch: (state, {"loss": 1.0}), 0, list(range(1 + 10 * 2)))] * 2
  results = bench.measure(runs, warmup=1, rounds=10, steps=2, tokens=100, deadline=0.0)
  for losses, rates, cpu_rates in results:
    assert len(rates) == len(cpu_rates) == bench.MIN_ROUNDS and len(losses) == 1 + 2 * bench.MIN_ROUNDS


def test_a_busy_host_or_moving_baseline_is_flagged():
  bench = _bench()
  assert bench.host_note(1.5, 2, 1.1) is None
  assert "load average reached 3.5 on 2 cores" in bench.host_note(3.5, 2, 1.1)
  assert "moved by 1.60x" in bench.host_note(0.5, 2, 1.6)


@pytest.mark.slow
def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "train_mesh_cpu.py"), "--meshes", "data=8",
       "fsdp=2,tensor=2,context=2", "--warmup", "1", "--rounds", "2", "--steps", "1"],
      capture_output=True, text=True, timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = [[c.strip() for c in line.strip("|").split("|")]
          for line in proc.stdout.splitlines() if line.startswith("| data=8 |")
          or line.startswith("| fsdp=2,tensor=2,context=2 |")]
  assert len(rows) == 2, proc.stdout
  assert rows[0][3:] == ["1.00", "1.00-1.00"] * 2 and float(rows[1][1]) <= 1e-4, rows
  for r in rows:
    assert float(r[2].replace(",", "")) > 0, r
    for median, span in ((r[3], r[4]), (r[5], r[6])):
      low, high = (float(x) for x in span.split("-"))
      assert 0 < low <= float(median) <= high, r
