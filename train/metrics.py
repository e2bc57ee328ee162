"""Where the numbers go: metrics.jsonl (always), a log line every --log_every, a tqdm bar with
tokens/s on a terminal, TensorBoard as an option; and the --compare table and loss-curve plot.

Every file is written through etils.epath, whole (object stores such as gs:// have no append):
metrics.jsonl is rewritten from memory at each ``flush`` (the train loop flushes with every log
line and every checkpoint, so a resumed run finds every step up to its checkpoint).
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from etils import epath

__all__ = ["MetricsLogger", "read_jsonl", "write_comparison", "plot_curves", "plot_run"]


def read_jsonl(path) -> list[dict[str, Any]]:
  path = epath.Path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
  """Logs on the main process only (every host computes the same replicated metrics)."""

  def __init__(self, workdir: str, *, start_step: int, total_steps: int, tokens_per_step: int,
               progress: str = "auto", tensorboard: bool = False, enabled: bool = True):
    self.enabled = enabled
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.tokens_per_step = tokens_per_step
    self._t0: float | None = None  # the clock starts after the first (compiling) step
    self._steps_timed = 0
    self._last_log = (time.perf_counter(), start_step)
    self.tokens_per_sec = float("nan")
    self.records: list[dict[str, float]] = []
    self._dirty = False
    if not enabled:
      self.bar, self.tb = None, None
      return
    # A resumed run drops records past its checkpoint, so each step appears once.
    self.records = [r for r in read_jsonl(self.path) if r["step"] <= start_step]
    self._dirty = True
    self.flush()
    show = progress == "on" or (progress == "auto" and sys.stderr.isatty())
    self.bar = None
    if show:
      from tqdm import tqdm  # pylint: disable=import-outside-toplevel
      self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
    self.tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.tb = SummaryWriter(str(epath.Path(workdir) / "tb"))

  def step_done(self, step: int) -> None:
    """Called after every step (host-side, metrics already fetched)."""
    now = time.perf_counter()
    if self._t0 is None:
      self._t0, self._last_log = now, (now, step)
    else:
      self._steps_timed += 1
      self.tokens_per_sec = self._steps_timed * self.tokens_per_step / (now - self._t0)
    if self.bar is not None:
      self.bar.update(1)
      if math.isfinite(self.tokens_per_sec):
        self.bar.set_postfix_str(f"{self.tokens_per_sec:,.0f} tok/s", refresh=False)

  def log(self, step: int, metrics: dict[str, float], echo: bool = True) -> None:
    """One record in metrics.jsonl; with ``echo`` also a line on stdout and TensorBoard."""
    if not self.enabled:
      return
    record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
    if math.isfinite(self.tokens_per_sec):
      record["tokens_per_sec"] = self.tokens_per_sec
    self.records.append(record)
    self._dirty = True
    if not echo:
      return
    line = f"step {step:6d} | " + " | ".join(
        f"{k} {v:.4g}" for k, v in record.items() if k != "step")
    if self.bar is not None:
      self.bar.write(line)
    else:
      print(line, flush=True)
    if self.tb is not None:
      for k, v in record.items():
        if k != "step":
          self.tb.add_scalar(k, v, step)

  def flush(self) -> None:
    """Writes metrics.jsonl (all records so far) if anything changed since the last flush."""
    if self.enabled and self._dirty:
      self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
      self._dirty = False

  def message(self, text: str) -> None:
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.write(text)
    else:
      print(text, flush=True)

  def close(self) -> None:
    self.flush()
    if self.bar is not None:
      self.bar.close()
    if self.tb is not None:
      self.tb.close()


def write_comparison(workdir: str, names: Sequence[str], runs: Sequence[str]) -> tuple[str, str]:
  """compare.md and compare.png: final train and held-out losses, speed, attention statistics.

  The table has, per normalizer, the train loss (mean of the last 10% of steps), the held-out
  loss of the last evaluation, tokens/s and the attention entropy and sparsity; the plot the train
  loss curves (lines) and the held-out losses (dashed, with markers).
  """
  rows = ["| normalizer | final loss (last 10% of steps) | eval loss (held out) | tokens/s | "
          "attn entropy | attn sparsity |",
          "|---|---|---|---|---|---|"]
  curves, eval_curves = {}, {}
  for name, run in zip(names, runs, strict=True):
    records = read_jsonl(epath.Path(run) / "metrics.jsonl")
    curves[name] = [(r["step"], r["loss"]) for r in records]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    eval_curves[name] = evals
    tail = records[-max(1, len(records) // 10):]
    last = dict(tail[-1]) if tail else {}
    if tail:  # single-batch losses are noisy: report the mean over the last 10% of steps
      last["loss"] = sum(r["loss"] for r in tail) / len(tail)
    stats = [r for r in records if "attn_entropy" in r]
    stat = stats[-1] if stats else {}

    def fmt(x, spec):
      return format(x, spec) if isinstance(x, (int, float)) else "—"

    rows.append(f"| {name} | {fmt(last.get('loss'), '.4f')} | "
                f"{fmt(evals[-1][1] if evals else None, '.4f')} | "
                f"{fmt(last.get('tokens_per_sec'), ',.0f')} | "
                f"{fmt(stat.get('attn_entropy'), '.3f')} | "
                f"{fmt(stat.get('attn_sparsity'), '.3f')} |")
  table = "\n".join(rows) + "\n"
  md_path = epath.Path(workdir) / "compare.md"
  md_path.write_text(table)

  png_path = epath.Path(workdir) / "compare.png"
  plot_curves(curves, png_path, "loss curves, identical data and seeds", eval_curves=eval_curves)
  return str(md_path), str(png_path)


Curves = dict[str, list[tuple[int, float]]]


def plot_curves(curves: Curves, path, title: str, eval_curves: Curves | None = None) -> None:
  """Loss against step, one line per entry of ``curves``, saved as a PNG at ``path`` (any epath).

  ``eval_curves`` (same names) are drawn dashed with markers in the colour of their train curve.
  """
  # A Figure of its own with the Agg canvas: no pyplot state and no global backend switch, so
  # a notebook that calls train.main keeps showing its own figures.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(7, 4.5))
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  eval_curves = eval_curves or {}
  labelled = 0
  for name, points in curves.items():
    color = None
    if points:
      steps, losses = zip(*points, strict=True)
      (line,) = ax.plot(steps, losses, label=f"{name} (train)" if eval_curves.get(name) else name)
      color, labelled = line.get_color(), labelled + 1
    held = eval_curves.get(name) or []
    if held:
      steps, losses = zip(*held, strict=True)
      ax.plot(steps, losses, "--o", color=color, markersize=3, label=f"{name} (held out)")
      labelled += 1
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.set_title(title)
  if labelled > 1:
    ax.legend()
  ax.grid(alpha=0.3)
  buffer = io.BytesIO()  # savefig knows local files only: write the bytes through epath
  fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
  epath.Path(path).write_bytes(buffer.getvalue())


def plot_run(workdir: str, title: str) -> str:
  """loss.png of one run from its metrics.jsonl (train and held-out loss); returns its path."""
  records = read_jsonl(epath.Path(workdir) / "metrics.jsonl")
  path = epath.Path(workdir) / "loss.png"
  plot_curves({"loss": [(r["step"], r["loss"]) for r in records]}, path, title,
              eval_curves={"loss": [(r["step"], r["eval_loss"]) for r in records
                                    if "eval_loss" in r]})
  return str(path)
