"""train.metrics: the progress bar's step, loss, tokens/s and time left; the measured time-left
line of a long run; the per-head records of the learned hyperparameters (console, TensorBoard,
learned.png). No training here: the logger is driven with a fake clock."""

import json
import sys
import types

import pytest

from train import metrics


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


class _FakeWriter:
  """tensorboardX.SummaryWriter's interface, recording what it is given."""

  instances: list["_FakeWriter"] = []

  def __init__(self, logdir):
    self.logdir, self.scalars, self.closed = logdir, [], False
    _FakeWriter.instances.append(self)

  def add_scalar(self, tag, value, step):
    self.scalars.append((tag, value, step))

  def close(self):
    self.closed = True


@pytest.fixture
def fake_tensorboardx(monkeypatch):
  _FakeWriter.instances = []
  monkeypatch.setitem(sys.modules, "tensorboardX",
                      types.SimpleNamespace(SummaryWriter=_FakeWriter))
  return _FakeWriter.instances


def _drive(logger, clock, steps, seconds_per_step, first_step=1):
  """Steps ``first_step..steps``: the first takes 5 s (compiling), the others ``seconds_per_step``;
  the loss of step k is 3 / k."""
  for step in range(first_step, steps + 1):
    clock.now += 5.0 if step == first_step else seconds_per_step
    logger.step_done(step, loss=3.0 / step)


@pytest.mark.parametrize("seconds,text", [
    (12.4, "12 s"), (89, "89 s"), (600, "10 min"), (5399, "90 min"), (5400, "1 h 30 min"),
    (19440, "5 h 24 min"), (2 * 86400, "2.0 days"), (float("nan"), "?")])
def test_format_duration(seconds, text):
  assert metrics.format_duration(seconds) == text


def test_progress_bar_shows_step_loss_tokens_per_second_and_time_left(tmp_path, capsys):
  clock = _Clock()
  logger = metrics.MetricsLogger(str(tmp_path), start_step=0, total_steps=100,
                                 tokens_per_step=1000, progress="on", clock=clock)
  _drive(logger, clock, 11, 0.5)
  # 10 timed steps of 0.5 s (the compiling first excluded): 2000 tokens/s, 89 steps x 0.5 s left.
  assert logger.postfix() == "loss 0.2727, 2,000 tok/s, 44 s left"
  logger.close()
  err = capsys.readouterr().err
  final = err.replace("\r", "\n").strip().splitlines()[-1]
  assert "step 11/100" in final and "loss 0.2727, 2,000 tok/s, 44 s left" in final, final
  assert "measured" not in err  # 44 s: not a long run


def test_long_run_says_its_measured_time_left_once(tmp_path, capsys):
  clock = _Clock()
  logger = metrics.MetricsLogger(str(tmp_path), start_step=0, total_steps=3000,
                                 tokens_per_step=8192, progress="off", clock=clock)
  _drive(logger, clock, 30, 6.5)
  logger.close()
  out = capsys.readouterr().out
  # Said once, after 5 timed steps (step 6: 32.5 s >= 30 s): 6.5 s/step x 2994 steps to go
  # = 19461 s.
  assert out.count("measured:") == 1, out
  assert ("measured: 6.5 s/step over 5 steps, about 5 h 24 min left for the 2994 steps to go"
          in out), out


def test_a_fast_run_says_its_time_left_after_10_steps(tmp_path, capsys):
  clock = _Clock()
  logger = metrics.MetricsLogger(str(tmp_path), start_step=0, total_steps=100_000,
                                 tokens_per_step=1, progress="off", clock=clock)
  _drive(logger, clock, 20, 0.25)
  # After 10 timed steps (2.5 s): 0.25 s/step x 99989 steps = 24997 s.
  assert "over 10 steps, about 6 h 57 min left for the 99989 steps" in capsys.readouterr().out


def test_a_short_run_whose_steps_are_slow_says_it_after_30_seconds(tmp_path, capsys):
  clock = _Clock()
  logger = metrics.MetricsLogger(str(tmp_path), start_step=100, total_steps=200,
                                 tokens_per_step=1, progress="off", clock=clock)
  _drive(logger, clock, 104, 20.0, first_step=101)
  # Step 103 (2 timed steps, 40 s >= 30 s): 97 steps x 20 s = 1940 s; from a resumed step 100.
  assert "about 32 min left for the 97 steps to go" in capsys.readouterr().out


def test_per_head_values_are_recorded_and_summarised(tmp_path, capsys, fake_tensorboardx):
  logger = metrics.MetricsLogger(str(tmp_path), start_step=0, total_steps=2, tokens_per_step=1,
                                 progress="off", tensorboard=True)
  heads = {"learned/alpha/layer0/head0": 1.5, "learned/alpha/layer0/head1": 1.25,
           "learned/alpha/layer1/head0": 2.0, "gate/layer1/head0": 0.75}
  logger.log(1, {"loss": 2.0, **heads})
  logger.log(2, {"loss": 1.0}, echo=False)
  logger.close()
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert records == [{"step": 1, "loss": 2.0, **heads}, {"step": 2, "loss": 1.0}]
  line = capsys.readouterr().out.strip()
  assert line == "step      1 | loss 2 | alpha 1.25..2 | gate 0.75..0.75", line
  (writer,) = fake_tensorboardx
  assert writer.logdir == str(tmp_path / "tb") and writer.closed
  expected = [("loss", 2.0, 1), *((k, v, 1) for k, v in heads.items())]
  assert sorted(writer.scalars) == sorted(expected)


def test_plot_learned(tmp_path):
  log = metrics.MetricsLogger(str(tmp_path), start_step=0, total_steps=3, tokens_per_step=1,
                              progress="off")
  for step in (1, 2, 3):
    log.log(step, {"loss": 1.0}, echo=False)
  log.flush()
  assert metrics.plot_learned(str(tmp_path), "none") is None  # no learned values: no file
  assert not (tmp_path / "learned.png").exists()
  for step in (4, 5):
    log.log(step, {"loss": 1.0, "learned/s/layer0/head0": 0.4 + step,
                   "learned/s/layer0/head1": 0.5, "gate/layer0/head0": 0.5}, echo=False)
  log.close()
  path = metrics.plot_learned(str(tmp_path), "two panels")
  assert path == str(tmp_path / "learned.png")
  data = (tmp_path / "learned.png").read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  height = int.from_bytes(data[20:24], "big")  # IHDR: width, height
  # Two panels (s and the gate) of 3.2 inches each at 120 dpi: 768 pixels, give or take the
  # trimming to the contents (one panel would be half).
  assert 0.8 * 768 < height < 1.2 * 768, height
