"""Where the numbers go: metrics.jsonl (always), a log line every --log_every, a tqdm bar with
the step, loss, tokens/s and time left on a terminal, TensorBoard as an option; and the plots:
the loss curves of a run (loss.png), its learned hyperparameters per layer and head
(learned.png), and the --compare table and loss curves.

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
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

__all__ = ["MetricsLogger", "read_jsonl", "write_comparison", "plot_curves", "plot_run",
           "plot_learned", "format_duration", "per_head_keys", "LONG_RUN_SECONDS"]

# A run measured (after its first timed steps) to need longer than this says so in the log.
LONG_RUN_SECONDS = 600.0
# The time left is measured over the steps after the first (compiling) one: said once, after
# this many timed steps or this many seconds, whichever comes first (at least 2 steps).
_MEASURE_STEPS, _MEASURE_SECONDS = 10, 30.0
# Prefixes of the per-layer, per-head records (train.learned_stats): ``PREFIX.../layerI/headH``.
_PER_HEAD = ("learned/", "gate/")


def format_duration(seconds: float) -> str:
  """``seconds`` as a person reads it: ``45 s``, ``12 min``, ``5 h 24 min``, ``3.2 days``."""
  if not math.isfinite(seconds):
    return "?"
  if seconds < 90:
    return f"{seconds:.0f} s"
  minutes = seconds / 60
  if minutes < 90:
    return f"{minutes:.0f} min"
  hours, rest = divmod(round(minutes), 60)
  if hours < 48:
    return f"{hours} h {rest} min"
  return f"{seconds / 86400:.1f} days"


def per_head_keys(record: dict[str, Any]) -> list[str]:
  """The keys of ``record`` that hold one layer's and head's learned value or gate."""
  return [k for k in record if k.startswith(_PER_HEAD)]


def _label(key: str) -> str:
  """``learned/alpha/layer0/head1`` -> ``alpha``; ``gate/layer0/head1`` -> ``gate``."""
  parts = key.split("/")
  return parts[1] if parts[0] == "learned" else parts[0]


def read_jsonl(path) -> list[dict[str, Any]]:
  path = epath.Path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
  """Logs on the main process only (every host computes the same replicated metrics)."""

  def __init__(self, workdir: str, *, start_step: int, total_steps: int, tokens_per_step: int,
               progress: str = "auto", tensorboard: bool = False, enabled: bool = True,
               clock: Callable[[], float] = time.perf_counter):
    """``clock``: seconds, for the tokens/s and the time left (tests pass a fake one)."""
    self.enabled = enabled
    self.clock = clock
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.tokens_per_step = tokens_per_step
    self.total_steps = total_steps
    self.loss = float("nan")
    self.seconds_left = float("nan")  # measured: the steps after the first, at their mean time
    self._said_time_left = False
    self._t0: float | None = None  # the clock starts after the first (compiling) step
    self._steps_timed = 0
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
      # The bar's own rate and ETA count the first (compiling) step: the postfix shows the
      # loss, tokens/s and time left of the steps after it.
      self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                      bar_format="{l_bar}{bar}| step {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
    self.tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self.tb = SummaryWriter(str(epath.Path(workdir) / "tb"))

  def step_done(self, step: int, loss: float | None = None) -> None:
    """Called after every step (host-side, metrics already fetched) with its loss."""
    now = self.clock()
    if loss is not None:
      self.loss = loss
    if self._t0 is None:
      self._t0 = now
    elif now > self._t0:
      self._steps_timed += 1
      elapsed = now - self._t0
      self.tokens_per_sec = self._steps_timed * self.tokens_per_step / elapsed
      self.seconds_left = (self.total_steps - step) * elapsed / self._steps_timed
      if not self._said_time_left and self._steps_timed >= 2 and (
          self._steps_timed >= _MEASURE_STEPS or elapsed >= _MEASURE_SECONDS):
        self._said_time_left = True
        if self.seconds_left > LONG_RUN_SECONDS:
          self.message(f"measured: {elapsed / self._steps_timed:.3g} s/step over "
                       f"{self._steps_timed} steps, about "
                       f"{format_duration(self.seconds_left)} left for the "
                       f"{self.total_steps - step} steps to go")
    if self.bar is not None:
      self.bar.update(1)
      self.bar.set_postfix_str(self.postfix(), refresh=False)

  def postfix(self) -> str:
    """What the bar shows after the step count: loss, tokens/s and the time left."""
    parts = [f"loss {self.loss:.4f}" if math.isfinite(self.loss) else "loss ?"]
    if math.isfinite(self.tokens_per_sec):
      parts += [f"{self.tokens_per_sec:,.0f} tok/s",
                f"{format_duration(self.seconds_left)} left"]
    return ", ".join(parts)

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
    heads = per_head_keys(record)
    line = f"step {step:6d} | " + " | ".join(
        f"{k} {v:.4g}" for k, v in record.items() if k != "step" and k not in heads)
    ranges: dict[str, list[float]] = {}  # the per-head values, as a range per name
    for key in heads:
      ranges.setdefault(_label(key), []).append(record[key])
    line += "".join(f" | {name} {min(v):.4g}..{max(v):.4g}" for name, v in ranges.items())
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
  _save_png(fig, path)


def plot_run(workdir: str, title: str) -> str:
  """loss.png of one run from its metrics.jsonl (train and held-out loss); returns its path."""
  records = read_jsonl(epath.Path(workdir) / "metrics.jsonl")
  path = epath.Path(workdir) / "loss.png"
  plot_curves({"loss": [(r["step"], r["loss"]) for r in records]}, path, title,
              eval_curves={"loss": [(r["step"], r["eval_loss"]) for r in records
                                    if "eval_loss" in r]})
  return str(path)


def plot_learned(workdir: str, title: str) -> str | None:
  """learned.png of one run: each learned hyperparameter (and output gate) against the step,
  one panel per name, one line per layer and head; None (no file) when the run learned none."""
  records = read_jsonl(epath.Path(workdir) / "metrics.jsonl")
  series: dict[str, dict[str, list[tuple[int, float]]]] = {}
  for record in records:
    for key in per_head_keys(record):
      parts = key.split("/")
      series.setdefault(_label(key), {}).setdefault("/".join(parts[-2:]), []).append(
          (record["step"], record[key]))
  if not series:
    return None
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(7, 3.2 * len(series)), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(len(series), 1, squeeze=False)[:, 0]
  for ax, (name, lines) in zip(axes, series.items(), strict=True):
    for label, points in lines.items():
      steps, values = zip(*points, strict=True)
      ax.plot(steps, values, marker="." if len(points) < 20 else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(name if name != "gate" else "mean output gate")
    ax.set_title(f"{name} per layer and head ({title})")
    ax.grid(alpha=0.3)
    if len(lines) <= 16:
      ax.legend(fontsize="small", ncol=2)
  path = epath.Path(workdir) / "learned.png"
  _save_png(fig, path)
  return str(path)


def _save_png(fig, path) -> None:
  """Saves a matplotlib Figure as a PNG at ``path`` (any epath)."""
  buffer = io.BytesIO()  # savefig knows local files only: write the bytes through epath
  fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
  epath.Path(path).write_bytes(buffer.getvalue())
