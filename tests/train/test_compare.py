"""--compare trains each normalizer on identical data and writes a table and a loss plot."""

import os

import numpy as np
import pytest

from tests import helpers
from train import config, metrics
from train import train as train_lib

TINY = helpers.train_argv("--log_every", helpers.TRAIN_STEPS)


# ~12 s: notebooks/06_training_comparison runs `train.py --compare` in every default run\[email protected]
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


def test_compare_with_a_learned_hyperparameter_checks_each_run_not_the_base(tmp_path,
                                                                            monkeypatch):
  """--compare entmax,ssa_softmax --learned alpha: --learned is checked against each compared
  normalizer (both take alpha), not against --normalizer's default, softmax (which has none)."""
  seen = []
  monkeypatch.setattr(train_lib, "compare",
                      lambda cfg, mesh, names: seen.append((cfg, list(names))) or 0)
  argv = TINY + ["--workdir", str(tmp_path), "--learned", "alpha"]
  assert train_lib.main(argv + ["--compare", "entmax,ssa_softmax"]) == 0
  assert [sub.normalizer for sub in train_lib._runs(*seen[0])] == ["entmax", "ssa_softmax"]
  with pytest.raises(SystemExit) as info:  # a compared normalizer without alpha is named
    train_lib.main(argv + ["--compare", "entmax,sparsemax"])
  assert info.value.code == train_lib.EXIT_USAGE


@pytest.mark.slow
def test_compare_trains_a_learned_alpha_per_normalizer(tmp_path):
  assert train_lib.main(TINY + ["--workdir", str(tmp_path), "--learned", "alpha",
                                "--compare", "entmax,ssa_softmax"]) == 0
  rows = (tmp_path / "compare.md").read_text().splitlines()[2:]
  assert sorted(line.split("|")[1].strip() for line in rows) == ["entmax", "ssa_softmax"]
  for name in ("entmax", "ssa_softmax"):
    _, losses, _ = helpers.train_records(tmp_path / "compare" / name)
    assert len(losses) == helpers.TRAIN_STEPS and np.all(np.isfinite(losses))
    saved = config.load(str(tmp_path / "compare" / name / "config.json"))
    assert saved["normalizer"] == name and saved["learned"] == "alpha"
