"""bench/gpu_blasst.py (the ``blasst`` section of bench/gpu.py, K04) runs on CPU (interpret
mode, tiny shapes): checked against the xla_chunked skip loop first, then timed against
dense kp.attention; a kernel that fails its check is not timed."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers import load_script


def _rows(out: str):
  return [line for line in out.splitlines() if line.startswith("| ") and " ms |" not in line
          and not line.startswith("|---")]


@pytest.mark.slow
def test_section_checks_then_times_in_interpret_mode(capsys):
  bench = load_script("bench/gpu.py", "bench_gpu")
  assert "blasst" in bench.SECTIONS and "--sections blasst" in bench.__doc__
  assert bench.main(["--interpret", "--tiny", "--sections", "blasst", "--reps", "1"]) == 0
  rows = _rows(capsys.readouterr().out)
  assert [line.split("|")[1].strip() for line in rows] == ["dense kp.attention",
                                                           "kp.blasst_attention"], rows
  assert "same kept pairs" in rows[1] and all("x | ok" in line for line in rows), rows


@pytest.mark.slow
def test_a_wrong_kernel_is_not_timed(monkeypatch, capsys):
  gpu = load_script("bench/gpu.py", "bench_gpu")
  section = load_script("bench/gpu_blasst.py", "bench_gpu_blasst")
  real = section.kp.blasst_attention

  def wrong(*a, **kw):  # right kept pairs, output 1.5 times too large
    out = real(*a, **kw)
    return (out[0] * 1.5, out[1]) if kw.get("return_kept") else out * 1.5

  monkeypatch.setattr(section.kp, "blasst_attention", wrong)
  assert not section.section(argparse.Namespace(interpret=True, tiny=True, reps=1), gpu)
  rows = _rows(capsys.readouterr().out)
  assert rows[-1].startswith("| kp.blasst_attention |") and "FAIL" in rows[-1], rows
