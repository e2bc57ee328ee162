"""--compare trains each normalizer on identical data and writes a table and a loss plot."""

import os

import numpy as np

from tests import helpers
from train import metrics
from train import train as train_lib

TINY = helpers.train_argv("--log_every", helpers.TRAIN_STEPS)


def test_compare_writes_a_table_and_a_plot(tmp_path, capsys):
  assert train_lib.main(TINY + ["--workdir", str(tmp_path), "--compare", "softmax,sigmoid"]) == 0
  table = (tmp_path / "compare.md").read_text().splitlines()
  assert "eval loss (held out)" in table[0]
  rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in table[2:]}
  assert sorted(rows) == ["sigmoid", "softmax"]
  for name, cells in rows.items():
    records = metrics.read_jsonl(tmp_path / "compare" / name / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, helpers.TRAIN_STEPS + 1))
    # Fewer than 20 steps: the "last 10%" window is the last step.
    np.testing.assert_allclose(float(cells[0]), records[-1]["loss"], atol=1e-4)
    # The held-out loss of the last evaluation (at the last step), then the attention entropy.
    np.testing.assert_allclose(float(cells[1]), records[-1]["eval_loss"], atol=1e-4)
    np.testing.assert_allclose(float(cells[3]), records[-1]["attn_entropy"], atol=1e-3)
  # Each run really used its own normalizer (same seed and data, different attention weights).
  first = {n: metrics.read_jsonl(tmp_path / "compare" / n / "metrics.jsonl")[0]["loss"]
           for n in rows}
  assert first["softmax"] != first["sigmoid"]
  with open(tmp_path / "compare.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(tmp_path / "compare.png") > 1000
  assert "compare.md" in capsys.readouterr().out


def test_plots_leave_the_matplotlib_backend_alone(tmp_path):
  """A notebook that calls train.main keeps its own backend (and so its inline figures)."""
  import matplotlib

  before = matplotlib.get_backend()
  matplotlib.use("svg")
  try:
    metrics.plot_curves({"a": [(0, 2.0), (1, 1.5)]}, tmp_path / "loss.png", "t",
                        eval_curves={"a": [(1, 1.7)]})
    assert matplotlib.get_backend() == "svg"
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  finally:
    matplotlib.use(before)
