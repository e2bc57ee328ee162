"""bench/losses.py --quick runs end to end: the chunked path passes its check against optax
and the table has a timed row, with memory figures, for both paths."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, load_script


# a subprocess run of the whole script (~15 s): the slow suite; the default run keeps the refusal tests
@pytest.mark.slow
def test_quick_benchmark_runs():
  proc = subprocess.run(
      [sys.executable, str(ROOT / "bench" / "losses.py"), "--quick"],
      capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| 256x2048 |")]
  assert len(rows) == 2, proc.stdout  # optax (the reference) and chunked
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[5]) > 0, row
    assert float(cells[6]) > 0 and float(cells[7]) > 0, row   # the ratios to optax
  assert "chunked ok" in proc.stdout and "FAILED" not in proc.stdout


def test_parse_sizes():
  bench = load_script("bench/losses.py", "bench_losses")
  assert bench.parse_sizes("8192x131072, 16x4") == [(8192, 131072), (16, 4)]
  for bad in ("8192", "0x5", "ax4"):
    with pytest.raises(ValueError, match="sizes"):
      bench.parse_sizes(bad)


def test_a_path_failing_its_check_is_not_timed(capsys):
  bench = load_script("bench/losses.py", "bench_losses_refuse")
  timed = []

  def fake_child(kind, path, *args):
    if kind == "check":
      return {"ok": False, "max_rel_err": 0.5}
    if kind == "time":
      timed.extend(path.split(","))
      return {x: {"median_s": 1.0, "ratio": 1.0} for x in path.split(",")}
    return {"peak_mib": 10.0, "run_mib": 5.0, "xla_mib": 4.0}

  bench._child = fake_child
  assert bench.main(["--sizes", "64x128"]) == 1
  out = capsys.readouterr().out
  assert timed == ["optax"]                       # the reference only
  assert "| 64x128 | chunked | failed the correctness check: not timed |" in out
  assert "chunked FAILED" in out
