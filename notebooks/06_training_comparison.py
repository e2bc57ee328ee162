# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
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
# changing only the attention normalizer, and writes a table and the loss curves.

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
import json
import pathlib
import tempfile

import matplotlib.pyplot as plt

root = pathlib.Path.cwd()
while not (root / "train" / "train.py").exists() and root != root.parent:
  root = root.parent
sys.path.insert(0, str(root))
from train import train  # noqa: E402

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
NORMALIZERS = ["softmax", "softmax_1", "sigmoid", "ssmax"] if QUICK else [
    "softmax", "softmax_1", "ssmax", "sigmoid", "softpick", "stablemax", "sparsemax", "entmax15"]
STEPS = 30 if QUICK else 300
workdir = pathlib.Path(tempfile.mkdtemp(prefix="jaxsoft_compare_"))

# %%
code = train.main(["--preset", "smoke", "--workdir", str(workdir), "--steps", str(STEPS), "--warmup_steps", str(STEPS // 10),
                   "--compare", ",".join(NORMALIZERS), "--progress", "off"])
assert code == 0, f"train.main exited with {code}"

# %% [markdown]
# ## Loss curves (from each run's metrics.jsonl)

# %%
fig, ax = plt.subplots(figsize=(8, 4))
finals = {}
for name in NORMALIZERS:
  rows = [json.loads(line) for line in open(workdir / "compare" / name / "metrics.jsonl")]
  rows = [r for r in rows if "loss" in r]
  ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name)
  finals[name] = rows[-1]["loss"]
ax.set(xlabel="step", ylabel="train loss (nats / char)", title=f"smoke preset, {STEPS} steps")
ax.legend(fontsize=8)
plt.show()
print((workdir / "compare.md").read_text())
for name, loss in finals.items():
  assert loss == loss and loss < 10, f"{name} diverged"
