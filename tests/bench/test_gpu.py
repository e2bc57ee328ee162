"""bench/gpu.py runs on CPU (interpret mode, tiny shapes) and refuses to time a wrong op."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import ROOT, load_script

BENCH = str(ROOT / "bench" / "gpu.py")


def _load_bench():
  return load_script("bench/gpu.py", "bench_gpu")


def test_bench_interpret_tiny_runs():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, BENCH, "--interpret", "--tiny", "--normalizers", "softmax",
       "--reps", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| jaxsoft_pallas")]
  assert len(rows) == 2 * 2  # (per-row line + summary line) x (full, causal)
  assert all(line.rstrip().endswith("| ok |") for line in rows)
  assert "fwd / baseline" in proc.stdout


def test_bench_refuses_to_time_a_wrong_op(monkeypatch):
  bench = _load_bench()
  real = bench.kp.attention
  # A broken kernel: right shape, wrong values.
  monkeypatch.setattr(bench.kp, "attention", lambda q, k, v, **kw: real(q, k, v, **kw) * 1.5)
  timed = []
  monkeypatch.setattr(bench, "measure", lambda *a, **k: timed.append(a) or (1.0, 1.0))
  rc = bench.main(["--interpret", "--tiny", "--normalizers", "softmax", "--reps", "1"])
  assert rc == 1
  # Only the baseline (jax.nn, full and causal) was timed; both kernel rows failed.
  assert len(timed) == 2
