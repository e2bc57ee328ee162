"""bench/gpu.py's row-kernel sections (``two_pass``: K05 / K06, ``quantized``: K09): checked
against the jnp references before timing, a failing kernel never timed; the whole sections
in interpret mode at tiny shapes. Both slow: each section compiles about forty programs
(the stand-ins' test: about 15 s of CPU; the interpreted kernels': about 45 s)."""

from __future__ import annotations

import pytest

from tests.helpers import load_script


def _load_bench():
  return load_script("bench/gpu.py", "bench_gpu_rows")


@pytest.mark.slow
def test_a_row_kernel_that_fails_its_check_is_not_timed(monkeypatch, capsys):
  bench = _load_bench()
  jn = bench.jn
  # stand-ins, so that no kernel compiles: two_pass exp=native right (the reference), poly
  # 1.5x off; the quantised softmax right, the LUT softmax shifted by 1e-3
  monkeypatch.setattr(bench.kp, "two_pass_softmax", lambda x, exp, **kw: (
      jn.softmax(x) if exp == "native" else jn.softmax(x) * 1.5))
  monkeypatch.setattr(bench.kp, "quantized_softmax", lambda x, b, method, **kw: (
      jn.quantized_softmax(x.astype("float32"), b, method=method).astype(x.dtype)))
  monkeypatch.setattr(bench.kp, "lut_softmax", lambda x, **kw: jn.lut_softmax(x) * 1.5)
  monkeypatch.setattr(bench.jn, "two_pass_softmax", jn.softmax)  # (a cheaper compile)
  timed = []
  monkeypatch.setattr(bench, "timeit", lambda f, args, reps: timed.append(f) or 1.0)
  args = bench.argparse.Namespace(tiny=True, reps=1, interpret=True)
  assert not bench.two_pass_section(args)
  assert not bench.quantized_section(args)
  out = capsys.readouterr().out
  for dt in ("float32", "bf16"):
    assert f"| kp.two_pass_softmax exp=native | 32 x 40 {dt} | 1e+03 | 1e+03 | 1.00x |" in out
    assert f"| kp.two_pass_softmax exp=poly | 32 x 40 {dt} | - | - | - | - | FAIL |" in out
    assert f"| kp.quantized_softmax log2 4-bit | 32 x 40 {dt} | 1e+03" in out
    assert f"| kp.lut_softmax 256 to -16 | 32 x 40 {dt} | - | - | - | - | FAIL |" in out
  # per dtype: the two-pass reference (shared) and native; 3 quantised references and 2
  # quantised kernels; fwd and grad each
  assert len(timed) == 2 * 2 * (2 + 3 + 2)


@pytest.mark.slow
def test_row_sections_check_then_time_in_interpret_mode(capsys):
  rc = _load_bench().main(["--interpret", "--tiny", "--sections", "two_pass,quantized",
                           "--reps", "1"])
  out = capsys.readouterr().out
  assert rc == 0, out
  rows = [line for line in out.splitlines() if line.startswith("| kp.")]
  assert len(rows) == 2 * (3 + 6)  # per dtype: reference + 2 two-pass; 3 x (ref + kernel)
  assert all("| ok" in line for line in rows), rows
