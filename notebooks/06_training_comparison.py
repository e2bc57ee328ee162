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
# # 06 · Training comparison
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/06_training_comparison.ipynb)
#
# `train/train.py --compare` trains the same small decoder LM on the same data (the
# `pydoc_data` topics text that ships with Python, character level) with identical seeds,
# changing only the attention normalizer, and writes a table and the loss curves (training
# and held-out).

# %%
# On Colab: clone the repository (train/ is not part of the pip package) and install it; a
# local checkout already has it. REPO is where the project is published (the `url` of
# setup.cfg); to use a fork, run `%env JAXSOFT_REPO=<its URL>` first. pip keeps Colab's
# preinstalled JAX unless it is older than the version jaxsoft requires (no --upgrade).
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
import io
import json
import pathlib
import tempfile

import matplotlib.pyplot as plt
from IPython.display import Image, display

root = pathlib.Path.cwd()
while not (root / "train" / "train.py").exists() and root != root.parent:
  root = root.parent
sys.path.insert(0, str(root))
from train import train  # noqa: E402

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
NORMALIZERS = ["softmax", "softmax_1", "sigmoid", "ssmax"] if QUICK else [
    "softmax", "softmax_1", "ssmax", "sigmoid", "softpick", "stablemax", "sparsemax", "entmax15"]
STEPS = 12 if QUICK else 200
workdir = pathlib.Path(tempfile.mkdtemp(prefix="jaxsoft_compare_"))

# %%
code = train.main(["--preset", "smoke", "--workdir", str(workdir), "--steps", str(STEPS), "--warmup_steps", str(STEPS // 10),
                   "--eval_every", str(STEPS // 5), "--compare", ",".join(NORMALIZERS), "--progress", "off"])
assert code == 0, f"train.main exited with {code}"

# %% [markdown]
# ## Loss curves (from each run's metrics.jsonl)
# Solid: the training loss of each step; dashed with dots: the loss on the held-out split,
# evaluated every `STEPS // 5` steps and at the end.

# %%
fig, ax = plt.subplots(figsize=(8, 4))
finals, evals = {}, {}
for i, name in enumerate(NORMALIZERS):
  rows = [json.loads(line) for line in open(workdir / "compare" / name / "metrics.jsonl")]
  train_rows = [r for r in rows if "loss" in r]
  eval_rows = [r for r in rows if "eval_loss" in r]
  ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], color=f"C{i}", lw=1,
          alpha=0.7, label=name)
  ax.plot([r["step"] for r in eval_rows], [r["eval_loss"] for r in eval_rows], "o--", ms=3,
          color=f"C{i}")
  finals[name], evals[name] = train_rows[-1]["loss"], eval_rows[-1]["eval_loss"]
ax.set(xlabel="step", ylabel="loss (nats / char)",
       title=f"smoke preset, {STEPS} steps (dashed: held-out)")
ax.legend(fontsize=8, ncol=2)
png = io.BytesIO()  # shown as a PNG: train.py's own plots switched matplotlib to the Agg backend
fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(png.getvalue()))
print((workdir / "compare.md").read_text())
for name in NORMALIZERS:
  assert finals[name] < 10 and evals[name] < 10, f"{name} diverged"
