"""bench/residuals.py measures residual memory and refuses a figure for a wrong op."""

import jax.numpy as jnp

from tests import helpers


def _bench():
  return helpers.load_script("bench/residuals.py", "bench_residuals")


def test_table_ranks_output_residuals_below_the_others():
  lines = _bench().main(["--rows", "8", "--n", "12", "--names", "softmax", "sparsemax",
                         "stablemax"])
  ratio = {ln.split()[0]: float(ln.split()[2].rstrip("x")) for ln in lines[2:]}
  assert ratio["softmax"] <= 1.25 and ratio["sparsemax"] <= 1.25
  assert ratio["stablemax"] > 2.0  # keeps its input and intermediates


def test_an_op_that_fails_its_check_gets_no_figure():
  bench = _bench()
  x = jnp.ones((4, 5))
  rows = bench.measure({"nan": lambda v: v * jnp.nan, "ok": lambda v: 2.0 * v}, x)
  assert rows[0] == ("nan", None) and rows[1][1] is not None
