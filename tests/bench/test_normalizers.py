"""bench/normalizers.py runs (--quick), prints a table, and refuses to time a wrong op."""

import time

import jax
import numpy as np

import jaxsoft.normalizers as jn
from tests import helpers


def _bench():
  return helpers.load_script("bench/normalizers.py", "bench_normalizers")


def _table_rows(table):
  return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_oracle_is_the_projection():
  bench = _bench()
  x = np.random.default_rng(0).standard_normal((16, 9))
  p = bench.oracle("sparsemax", x)
  np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-12)
  np.testing.assert_allclose(p, np.asarray(jn.sparsemax(x)), atol=1e-6)
  q = bench.oracle("entmax15", x)
  np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-12)
  np.testing.assert_allclose(q, np.asarray(jn.entmax15(x)), atol=1e-6)


def test_quick_run_reports_a_table_without_torch():
  bench = _bench()
  logged = []
  table = bench.main(["--quick", "--no-torch", "--rows", "32", "--sizes", "24", "--reps", "1"],
                     log=logged.append)
  assert table in logged
  rows = _table_rows(table)
  assert table.splitlines()[0].startswith("| n | op | jaxsoft ms")
  names = [r[1] for r in rows]
  assert "sparsemax" in names and "entmax15" in names and "jax.nn.softmax (reference)" in names
  for r in rows[:-1]:
    assert float(r[2]) > 0  # every jaxsoft op passed its check and got a time
    assert r[4] == "n/a" and r[5] == "n/a"  # the torch columns degrade without torch
  sparse = rows[names.index("sparsemax")]
  assert float(sparse[3]) > 0 and sparse[6].endswith("x")  # optax timed, ratio reported


def test_refuses_to_time_an_op_that_fails_its_check():
  bench = _bench()
  wrong = bench.Op("softmax posing as sparsemax", "sparsemax", jax.nn.softmax)
  right = bench.Op("sparsemax", "sparsemax", jn.sparsemax)
  table = bench.main(["--quick", "--no-torch", "--rows", "16", "--sizes", "12", "--reps", "1"],
                     ops=[wrong, right], log=lambda *_: None)
  rows = {r[1]: r for r in _table_rows(table)}
  assert rows["softmax posing as sparsemax"][2].startswith("FAILED check")
  assert rows["softmax posing as sparsemax"][6] == "-"
  assert float(rows["sparsemax"][2]) > 0


def test_single_thread_mode_times_by_process_time():
  bench = _bench()
  logged = []
  ops = [bench.Op("sparsemax", "sparsemax", jn.sparsemax)]
  try:
    table = bench.main(["--quick", "--no-torch", "--single-thread", "--rows", "8", "--sizes", "12",
                        "--reps", "1"], ops=ops, log=logged.append)
    assert bench.CLOCK["fn"] is time.process_time and bench.CLOCK["threads"] == 1
  finally:
    bench.main(["--quick", "--no-torch", "--rows", "4", "--sizes", "6", "--reps", "1"], ops=ops,
               log=lambda *_: None)
  assert bench.CLOCK["fn"] is time.perf_counter  # the default mode restores wall time
  assert any("single-threaded, process (CPU) time" in line for line in logged)
  assert float(_table_rows(table)[0][2]) > 0
