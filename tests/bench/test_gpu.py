"""bench/gpu.py runs on CPU (interpret mode, tiny shapes) and refuses to time a wrong op."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from tests.helpers import ROOT, load_script

BENCH = str(ROOT / "bench" / "gpu.py")


def _load_bench():
  return load_script("bench/gpu.py", "bench_gpu")


# a subprocess run of the whole script (~15 s): the slow suite; the default run keeps the refusal tests
@pytest.mark.slow
def test_bench_interpret_tiny_runs():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, BENCH, "--interpret", "--tiny", "--normalizers", "softmax",
       "--reps", "1", "--sections", "attention"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
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
  rc = bench.main(["--interpret", "--tiny", "--normalizers", "softmax", "--reps", "1",
                   "--sections", "attention"])
  assert rc == 1
  # Only the baselines (jax.nn and JAX's Pallas reference, full and causal) were timed;
  # both kernel rows failed.
  assert len(timed) == 4


@pytest.mark.slow
def test_linear_and_ce_sections_check_then_time(capsys):
  """The K07 and K08 sections in interpret mode: every row checked against its XLA
  reference, then timed, with the ratio to the named baseline."""
  bench = _load_bench()
  rc = bench.main(["--interpret", "--tiny", "--sections", "linear,ce", "--reps", "1"])
  out = capsys.readouterr().out
  assert rc == 0, out
  linear = [line for line in out.splitlines()
            if line.startswith("| pallas | ") and " x 300 x " not in line]
  assert {line.split("|")[2].strip() for line in linear} == {"simple_gla", "gated_delta_rule"}
  assert all("| ok (check err" in line for line in linear), linear
  ce = {line.split("|")[1].strip(): line for line in out.splitlines()
        if line.startswith("| ") and " x 300 x " in line}
  assert set(ce) == {"optax (materialised)", "xla chunked", "pallas"}, out
  assert all(line.rstrip().endswith("| ok |") for line in ce.values()), ce


def test_a_linear_kernel_that_fails_its_check_is_not_timed(monkeypatch, capsys):
  bench = _load_bench()
  # stand-ins, so that no kernel compiles: the "pallas" one is wrong by a factor 1.5
  monkeypatch.setattr(bench, "_linear_call", lambda variant, impl: (
      lambda q, k, v, g, beta: v * (1.5 if impl == "pallas" else 1.0) * jnp.exp(g)[..., None]))
  monkeypatch.setattr(bench, "timeit", lambda *a: (_ for _ in ()).throw(AssertionError("timed")))
  assert not bench.linear_section(bench.argparse.Namespace(tiny=True, reps=1))
  out = capsys.readouterr().out
  assert out.count("FAIL") == 2 and "| xla chunked |" not in out


def test_extras_is_a_section_and_unknown_ones_are_refused():
  bench = _load_bench()
  assert "extras" in bench.SECTIONS and "--sections extras" in bench.__doc__
  with pytest.raises(SystemExit):
    bench.main(["--sections", "extras,nope"])


@pytest.mark.slow
def test_extras_section_checks_then_times(capsys):
  """K06 flags, block-sparse and decode in interpret mode: each row checked, then timed with
  the ratio to its named baseline (flags off, dense kp.attention, XLA decode)."""
  bench = _load_bench()
  rc = bench.main(["--interpret", "--tiny", "--sections", "extras", "--reps", "1"])
  out = capsys.readouterr().out
  assert rc == 0, out
  rows = [line for line in out.splitlines()
          if line.startswith("| ") and " ms |" not in line]  # not the headers
  assert {line.split("|")[1].strip() for line in rows} == {
      "flags off", "exp2", "rescale 8", "exp2 + rescale 8", "dense kp.attention",
      "moba pallas", "bfla pallas", "prism pallas", "xla dot_product_attention",
      "kp.decode_attention", "kp.decode_attention, paged (16)"}, out
  assert all("x | ok" in line for line in rows), rows
  assert sum(" T=64 B=1 N=2 " in line for line in rows) == 4 * 2  # K06: flags x masks


@pytest.mark.slow
def test_a_decode_kernel_that_fails_its_check_is_not_timed(monkeypatch, capsys):
  bench = _load_bench()
  real = bench.kp.decode_attention
  monkeypatch.setattr(bench.kp, "decode_attention", lambda *a, **kw: real(*a, **kw) * 1.5)
  timed = []
  monkeypatch.setattr(bench, "timeit", lambda f, args, reps: timed.append(f) or 1.0)
  args = bench.argparse.Namespace(tiny=True, reps=1)
  assert not bench._decode_part(args, True, jnp.bfloat16)
  out = capsys.readouterr().out
  assert "| kp.decode_attention | 2 x 64 | - | - | FAIL" in out and len(timed) == 1
  assert "| kp.decode_attention, paged (16) | 2 x 64 | - | - | FAIL" in out


@pytest.mark.slow  # ~13 s each in interpret mode; the refusal tests stay in the default run
@pytest.mark.parametrize("section,names", [
    ("sigmoid", {"softmax", "sigmoid", "sigmoid approx_sigmoid"}),
    pytest.param("fox", {"decay", "decay, pruned at -10", "distance + decay (idw_softmax)"},
                 marks=pytest.mark.slow)])
def test_sigmoid_and_fox_sections_check_then_time(section, names, capsys):
  """The approximate-sigmoid and FoX-pruning sections in interpret mode: every row checked
  against the dense reference (ok), then timed against its baseline (softmax; the
  unpruned decay)."""
  rc = _load_bench().main(["--interpret", "--tiny", "--sections", section, "--reps", "1"])
  out = capsys.readouterr().out
  assert rc == 0, out
  rows = [line for line in out.splitlines() if line.startswith("| ") and " ms |" not in line]
  assert {line.split("|")[1].strip() for line in rows} == names, out
  assert all("x | ok" in line for line in rows), rows


@pytest.mark.slow
@pytest.mark.parametrize("section,label", [("autotune", "| autotuned |"), ("fp8", "| fp8 |")])
def test_speed_flag_sections_run_and_check_first(section, label, capsys):
  """The K06 sections in interpret mode: each row is checked (ok) before it is timed."""
  rc = _load_bench().main(["--interpret", "--tiny", "--sections", section, "--reps", "1"])
  out = capsys.readouterr().out
  assert rc == 0, out
  rows = [line for line in out.splitlines() if line.startswith(label)]
  assert len(rows) == 2 and all(line.rstrip().endswith("| ok |") for line in rows), out


@pytest.mark.slow
def test_polykv_and_single_pass_sections_check_then_time(capsys):
  """K11 and K12 in interpret mode: each kernel checked against its jnp reference (ok),
  then timed against its baseline (kp.decode_attention on the bf16 cache; jax.nn.softmax)."""
  rc = _load_bench().main(["--interpret", "--tiny", "--sections", "polykv,single_pass",
                           "--reps", "1"])
  out = capsys.readouterr().out
  assert rc == 0, out
  rows = [line for line in out.splitlines() if line.startswith("| ") and " ms |" not in line]
  assert {line.split("|")[1].strip() for line in rows} == {
      "kp.decode_attention bf16 (128 B/token/head)",
      "kp.polykv_decode_attention (72 B/token/head)",  # 32 + 4 + 32 + 4 bytes
      "jax.nn.softmax", "ap_fixed<32, 10>", "float32"}, out
  assert all("x | ok" in line for line in rows), rows


@pytest.mark.slow
def test_a_polykv_or_single_pass_kernel_that_fails_its_check_is_not_timed(monkeypatch, capsys):
  bench = _load_bench()
  from kernels_pallas import polykv

  # stand-ins, so that no kernel compiles: the baselines right, the two kernels 1.5x off
  monkeypatch.setattr(bench.kp, "decode_attention", lambda q, k, v, n, **kw: polykv.polykv_reference(
      q, polykv.polykv_quantize(k, v), n))
  monkeypatch.setattr(bench.kp, "polykv_decode_attention",
                      lambda q, cache, n, **kw: polykv.polykv_reference(q, cache, n) * 1.5)
  monkeypatch.setattr(bench.kp, "single_pass_softmax",
                      lambda x, **kw: bench.jax.nn.softmax(x) * 1.5)
  timed = []
  monkeypatch.setattr(bench, "timeit", lambda f, args, reps: timed.append(f) or 1.0)
  args = bench.argparse.Namespace(tiny=True, reps=1, interpret=True)
  assert not bench.polykv_section(args)
  assert not bench.single_pass_section(args)
  out = capsys.readouterr().out
  assert "| kp.polykv_decode_attention | 2 x 64 | - | - | FAIL" in out
  assert "| ap_fixed<32, 10> | 64 x 40 | - | - | - | - | FAIL |" in out
  assert "| float32 | 64 x 40 | - | - | - | - | FAIL |" in out
  assert len(timed) == 1 + 2  # only the baselines: the bf16 decode, softmax fwd and grad
