"""bench/functions_cpu.py: a row is checked against its float64 oracle before it is timed, a
wrong function gets no figure, and --quick runs every row end to end."""

import dataclasses

import jax
import pytest

from tests import helpers


def _bench():
  return helpers.load_script("bench/functions_cpu.py", "bench_functions_cpu")


def test_a_row_is_timed_only_after_its_check_and_a_wrong_one_is_not():
  bench = _bench()
  row = bench.ROWS["marginalized_energy"]
  good = bench.measure(row, 1, quick=True)
  assert good["ok"] and good["err"] < 1e-6 and min(good["ms"], good["base_ms"], good["ratio"]) > 0
  # the sign flipped (the log-partition instead of the energy): the check must refuse it
  wrong = dataclasses.replace(row, fn=lambda z, y: jax.nn.logsumexp(z, axis=-1))
  bad = bench.measure(wrong, 1, quick=True)
  assert not bad["ok"] and "ms" not in bad
  lines = bench.table({"marginalized_energy": bad}, 1, True)
  assert "FAILED (check): not timed" in lines[-1]
  # a value that is not finite at the timing size fails the row as well
  nan = dataclasses.replace(row, fn=lambda z, y: jax.numpy.where(
      z.shape[-1] == row.quick["vocab"], jax.numpy.nan, 1.0) * bench._marginalized(z, y))
  res = bench.measure(nan, 1, quick=True)
  assert not res["ok"] and "ms" not in res


def test_the_oracles_see_a_wrong_alignment_and_a_wrong_acol_term():
  bench = _bench()
  mono = bench.ROWS["monotonic_attention:parallel"]
  args = mono.inputs(mono.check_sizes, 1)
  assert mono.check(mono.fn, args) <= mono.tol
  # the scan started at the second key instead of the first: a different alignment
  shifted = lambda q, k, v: bench.js.attention.monotonic_attention(  # noqa: E731
      q, k, v, initial_state=jax.numpy.eye(k.shape[1])[1][None, None].repeat(q.shape[2], 1))
  assert mono.check(shifted, args) > mono.tol
  acol = bench.ROWS["acol_loss"]
  args = acol.inputs(acol.check_sizes, 1)
  assert acol.check(acol.fn, args) <= acol.tol
  no_balance = lambda z, y: bench.js.losses.acol_loss(z, y, balance_weight=0.0)  # noqa: E731
  assert acol.check(no_balance, args) > acol.tol


@pytest.mark.slow
def test_quick_run_times_every_row():
  bench = _bench()
  assert bench.main(["--quick"]) == 0
