"""bench/gpu_topk.py (the ``topk`` section of bench/gpu.py, K01) runs on CPU (interpret mode,
tiny shapes), and refuses to time a kernel that fails its check."""

from __future__ import annotations

import argparse

import jax
import pytest

from tests.helpers import load_script


def _load():
  return load_script("bench/gpu_topk.py", "bench_gpu_topk")


def _rows(out: str):
  return [line for line in out.splitlines() if line.startswith("| ") and " ms |" not in line
          and not line.startswith("|---")]


@pytest.mark.slow
def test_section_checks_then_times_in_interpret_mode(capsys):
  args = argparse.Namespace(interpret=True, tiny=True, reps=1)
  assert _load().section(args)
  rows = _rows(capsys.readouterr().out)
  assert len(rows) == 2 * 2 * 2  # (baseline, kernel) x k in {8, 64} x {bf16, f32}
  assert all(line.rstrip().endswith("| ok |") for line in rows), rows
  assert {line.split("|")[1].strip() for line in rows} == {"lax.top_k(softmax)",
                                                          "kp.softmax_top_k"}


@pytest.mark.slow  # ~2.6 CPU s of small compiles: beyond the default run's budget
def test_a_kernel_that_fails_its_check_is_not_timed(monkeypatch, capsys):
  bench = _load()
  # a stand-in (nothing compiles): the right indices, values 1.5x off
  monkeypatch.setattr(bench.kp, "softmax_top_k", lambda x, k, **kw: (
      lambda v, i: (v * 1.5, i))(*jax.lax.top_k(jax.nn.softmax(x), k)))
  timed = []
  monkeypatch.setattr(bench, "_median_ms", lambda f, args, reps: timed.append(f) or 1.0)
  monkeypatch.setattr(bench, "KS", (8,))
  monkeypatch.setattr(bench, "DTYPES", {"f32": jax.numpy.float32})
  assert not bench.section(argparse.Namespace(interpret=True, tiny=True, reps=1))
  out = capsys.readouterr()
  assert "| kp.softmax_top_k | 64 x 300, k=8, f32 | - | - | - | - | FAIL |" in out.out
  assert "# K01 f32 k=8: values err" in out.err
  assert len(timed) == 2  # only the baseline's fwd and grad
