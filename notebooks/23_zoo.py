# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 23 · The zoo: every normalizer and attention variant trained like for like
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/23_zoo.ipynb)
#
# `train/zoo.py` trains every registered normalizer usable in attention, every attention layer
# kind of `train/` and a 3:1 hybrid on four tasks (a character LM, multi-query associative
# recall, the character LM trained at T = 256 and evaluated at 256 / 1024 / 4096, and a
# ListOps-style task), and the loss variants (softmax CE, StableMax CE, the orthogonal gradient,
# the sparsemax / 1.5-entmax Fenchel-Young losses) on modular-arithmetic grokking. Per task every
# entrant has the same model, batches, step budget and schedule; its learning rate is the best
# of a fixed 3-point sweep on seed 0, then seeds 1 and 2 train at that rate.
#
# **This notebook trains nothing**: it reads the records the zoo appended to
# `bench/zoo/results.jsonl` (one per run, with the date, the commit and the JAX version that
# produced it) and draws the tables and plots, so it takes seconds. The zoo runs in parts across
# sessions: while it is incomplete the tables mark the missing cells and the plots show what is
# recorded. To add records: `python -m train.zoo run --parts i/n` (resumable), then
# `python -m train.zoo report` (bench/zoo/README.md and the guide in docs/choosing.md).

# %%
# On Colab: clone the repository (train/ and bench/zoo/results.jsonl are not part of the pip
# package) and install it; a local checkout already has them. REPO is where the project is
# published (the `url` of setup.cfg); to use a fork, run `%env JAXSOFT_REPO=<its URL>` first.
# pip keeps Colab's preinstalled JAX unless it is older than the version jaxsoft requires.
import importlib.util
import os
import subprocess
import sys

REPO = os.environ.get("JAXSOFT_REPO", "https://github.com/jaxsoft/jaxsoft")
if importlib.util.find_spec("jaxsoft") is None:
  subprocess.run(["git", "clone", "-q", "--depth", "1", REPO, "jaxsoft"], check=True)
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "./jaxsoft[train]"], check=True)
  os.chdir("jaxsoft")

# %%
import collections
import pathlib

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

root = pathlib.Path.cwd()
while not (root / "train" / "zoo.py").exists() and root != root.parent:
  root = root.parent
sys.path.insert(0, str(root))
from train import zoo, zoo_tasks  # noqa: E402

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
# (nothing here depends on QUICK: reading the records is as quick at any size)
print("sizes: full (nothing is trained: the committed records are read)")
records = [r for r in zoo.read_results(str(root / "bench" / "zoo" / "results.jsonl"))
           if r["protocol"] == zoo.PROTOCOL]
print(f"{len(records)} records of protocol {zoo.PROTOCOL}")
if records:
  dates = sorted(r["date"] for r in records)
  print(f"recorded {dates[0]} .. {dates[-1]}; commits "
        f"{sorted({r['commit'][:10] for r in records})}; JAX {sorted({r['jax'] for r in records})}")
  print("failed runs:", sum(r.get("status") != "ok" for r in records))

# %% [markdown]
# ## How far the zoo has got
# An entrant is complete on a task when its three sweep runs and the two further seeds are
# recorded (five runs).

# %%
summaries = {t: zoo.task_summaries(records, t) for t in zoo_tasks.TASKS}
runs_per_unit = len(zoo_tasks.TASKS["lm"].lrs) + len(zoo.SEEDS) - 1
for t, summary in summaries.items():
  runs = sum(1 for r in records if r["task"] == t)
  complete = sum(s["n"] == len(zoo.SEEDS) for s in summary.values())
  print(f"{t:8s} {complete:3d} of {len(summary):3d} entrants complete, "
        f"{runs:4d} of {len(summary) * runs_per_unit:4d} runs recorded")

# %% [markdown]
# ## The tables
# Mean ± standard deviation over the three seeds at the chosen rate; **≈** marks a tie with the
# best (within the sum of the two standard deviations), (n/3) a cell with n seeds so far. Only
# the entrants with a record are listed here; bench/zoo/README.md lists them all.

# %%
for t in zoo_tasks.TASKS:
  seen = {r["entrant"] for r in records if r["task"] == t}
  table = zoo.task_table(records, t).splitlines()
  start = next(i for i, line in enumerate(table) if line.startswith("| entrant"))
  text = [line for line in table[:start] if line]  # the title, the model, why these sizes
  rows = [line for line in table[start + 2:]
          if line.startswith("| ") and line.split("|")[1].strip() in seen]
  count = next(line for line in table if "entrants complete" in line)
  display(Markdown("\n\n".join([text[0].replace("## ", "### "), *text[1:]]) + "\n\n"
                   + ("\n".join(table[start:start + 2] + rows) if rows else "(no records yet)")
                   + "\n\n" + count))

# %% [markdown]
# ## Loss curves per task
# The training loss (mean over the seeds at the chosen rate) of every entrant with a record;
# softmax (or softmax CE on the grokking task) in black.


# %%
def reference(t):
  return "loss:softmax_ce" if zoo_tasks.TASKS[t].loss_task else "normalizer:softmax"


def curve(summary):
  curves = [np.asarray(r["curve"]) for r in summary["records"]
            if r.get("status") == "ok" and r.get("curve")]
  if not curves:
    return None
  n = min(len(c) for c in curves)
  return np.mean([c[:n] for c in curves], axis=0)


fig, axes = plt.subplots(1, len(summaries), figsize=(4 * len(summaries), 3.5))
for ax, (t, summary) in zip(axes, summaries.items(), strict=True):
  drawn = 0
  for name, s in summary.items():
    c = curve(s)
    if c is None:
      continue
    ref = name == reference(t)
    ax.plot(c[:, 0], c[:, 1], lw=1.6 if ref else 0.6, color="black" if ref else None,
            alpha=1.0 if ref else 0.6, label=name if ref else None, zorder=3 if ref else 2)
    drawn += 1
  if not drawn:
    ax.text(0.5, 0.5, "no records yet", ha="center", va="center", transform=ax.transAxes)
  elif any(line.get_label() == reference(t) for line in ax.lines):
    ax.legend(fontsize=7)
  ax.set(title=f"{t} ({drawn} entrants)", xlabel="step", ylabel="training loss")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Held-out loss against evaluation length
# The character LM trained at T = 256 and evaluated on held-out text at T = 256, 1024 and 4096
# (the loss averaged over every position of the window): a normalizer whose weights spread out as
# the row grows (the dispersion of softmax) or whose positions were never seen loses accuracy
# beyond the trained length. Each line an entrant (mean over its seeds); lower is better.

# %%
lengths = zoo_tasks.LENGTHS
fig, ax = plt.subplots(figsize=(7, 4.5))
lines = []
for name, s in summaries["length"].items():
  rs = [r["results"] for r in s["records"] if r.get("status") == "ok"]
  if not rs:
    continue
  ys = [np.mean([r[f"len{t}/loss"] for r in rs]) for t in lengths]
  ref = name == reference("length")
  ax.plot(lengths, ys, marker="o", lw=1.6 if ref else 0.7, color="black" if ref else None,
          label=name if ref else None, alpha=1.0 if ref else 0.6)
  lines.append((ys[-1], name))
if lines:
  for y, name in sorted(lines)[:5]:  # the five best at 4096, named
    ax.annotate(name.split(":", 1)[-1], (lengths[-1], y), fontsize=6, xytext=(4, 0),
                textcoords="offset points")
  if any(name == reference("length") for _, name in lines):
    ax.legend(fontsize=7)
else:
  ax.text(0.5, 0.5, "no records yet", ha="center", va="center", transform=ax.transAxes)
ax.set_xscale("log", base=2)
ax.minorticks_off()
ax.set(xticks=list(lengths), xticklabels=[str(t) for t in lengths],
       xlabel="evaluation length T", ylabel="held-out loss (nats/char)",
       title="held-out loss against evaluation length (trained at 256)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Speed against quality
# Training tokens per second on the machine that recorded them (the zoo runs on a shared 2-core
# CPU: compare the order, not the absolute speed) against the task metric.

# %%
attention_tasks = [t for t in summaries if not zoo_tasks.TASKS[t].loss_task]
fig, axes = plt.subplots(1, len(attention_tasks), figsize=(4 * len(attention_tasks), 3.6))
for ax, t in zip(axes, attention_tasks, strict=True):
  points = collections.OrderedDict()
  for name, s in summaries[t].items():
    rs = [r for r in s["records"] if r.get("status") == "ok" and r.get("tokens_per_s")]
    if rs:
      points[name] = (np.mean([r["tokens_per_s"] for r in rs]), np.mean([r["value"] for r in rs]))
  for name, (x, y) in points.items():
    ref = name == reference(t)
    ax.scatter(x, y, s=30 if ref else 10, color="black" if ref else "C0", zorder=3 if ref else 2)
    ax.annotate(name.split(":", 1)[-1], (x, y), fontsize=5)
  if not points:
    ax.text(0.5, 0.5, "no records yet", ha="center", va="center", transform=ax.transAxes)
  task = zoo_tasks.TASKS[t]
  ax.set(xscale="log", xlabel="training tokens/s", ylabel=task.metric,
         title=f"{t} ({'higher' if task.higher_is_better else 'lower'} is better)")
  ax.xaxis.set_minor_formatter(plt.NullFormatter())
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The guide's numbers
# What docs/choosing.md quotes, computed from the same records (`train.zoo.guide_rows`): for
# each need the best entrant among those with all three seeds, against softmax. A row is
# *provisional* until every entrant of its task is complete.

# %%
# (the guide's links are relative to docs/; here they point to the repository)
display(Markdown(zoo.guide_markdown(records).replace(
    "](../", "](https://github.com/jaxsoft/jaxsoft/blob/main/")))
