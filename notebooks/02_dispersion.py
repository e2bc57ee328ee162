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
# # 02 · Dispersion against length (E01)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/02_dispersion.ipynb)
#
# One *needle* score Δ above n − 1 equal distractors. Veličković et al. ("softmax is not
# enough", 2024) prove that softmax must disperse: its needle weight e^Δ/(e^Δ + n − 1) → 0 as
# n grows, for any fixed margin. The alternatives each claim a way out:
#
# * **SSMax** (Nakanishi 2025) multiplies the scores by s·log n, so the needle weight
#   n^{sΔ}/(n^{sΔ} + n − 1) → 1 if sΔ > 1, → ½ if sΔ = 1, → 0 if sΔ < 1.
# * **sparsemax / entmax** put exact zeros on the distractors once the margin clears the
#   threshold, whatever n is.
# * **softpick** gives a zero-score distractor exactly zero weight (ReLU(e⁰ − 1) = 0) and
#   zero denominator mass, so a needle above zeros keeps weight 1.
# * **sigmoid** with bias −log n has no competition at all: the needle weight is σ(Δ − log n),
#   which also decays, but because of the bias, not because of the distractors.

# %%
# Installs jaxsoft on Colab; a local checkout already has it. REPO is where the project is
# published (the `url` of setup.cfg); to install a fork, run `%env JAXSOFT_REPO=<its URL>` first
# (append `@<branch>` for a branch). pip keeps Colab's preinstalled JAX unless it is older than
# the version jaxsoft requires (no --upgrade: only what is missing or too old is installed).
import importlib.util
import os
import subprocess
import sys

REPO = os.environ.get("JAXSOFT_REPO", "https://github.com/jaxsoft/jaxsoft")
if importlib.util.find_spec("jaxsoft") is None:
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"git+{REPO}"], check=True)

# %%
import os

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
DELTA = 3.0
ns = 2 ** np.arange(4, 13 if QUICK else 17)


def needle_weight(fn, n, **kw):
  row = jnp.zeros((int(n),)).at[0].set(DELTA)
  return float(fn(row, **kw)[0])


curves = {
    "softmax": [needle_weight(js.normalizers.softmax, n) for n in ns],
    **{f"ssmax s·Δ={s * DELTA:.1f}": [needle_weight(js.normalizers.ssmax, n, s=s) for n in ns]
       for s in (1.5 / DELTA, 1.0 / DELTA, 0.6 / DELTA)},
    "sparsemax": [needle_weight(js.normalizers.sparsemax, n) for n in ns],
    "entmax15": [needle_weight(js.normalizers.entmax15, n) for n in ns],
    "softpick": [needle_weight(js.normalizers.softpick, n) for n in ns],
    "sigmoid (b = −log n)": [needle_weight(js.normalizers.sigmoid, n) for n in ns],
}

fig, ax = plt.subplots(figsize=(8, 4.5))
for i, (name, ys) in enumerate(curves.items()):
  ax.semilogx(ns, ys, "o-" if i < 4 else "s--", ms=3, label=name, base=2)
ax.set(xlabel="n (keys)", ylabel=f"weight on the needle (margin Δ = {DELTA})",
       title="Dispersion: softmax fades with n, the alternatives do not (or decay by design)")
ax.legend(fontsize=8, ncol=2)
plt.show()

# %% [markdown]
# ## Each curve against its paper's closed form

# %%
n_big = float(ns[-1])
softmax_closed = np.exp(DELTA) / (np.exp(DELTA) + ns - 1)
np.testing.assert_allclose(curves["softmax"], softmax_closed, rtol=1e-4)
for s in (1.5 / DELTA, 1.0 / DELTA, 0.6 / DELTA):
  closed = ns ** (s * DELTA) / (ns ** (s * DELTA) + ns - 1)
  np.testing.assert_allclose(curves[f"ssmax s·Δ={s * DELTA:.1f}"], closed, rtol=1e-4)
np.testing.assert_allclose(curves["sigmoid (b = −log n)"], 1 / (1 + np.exp(-(DELTA - np.log(ns)))), rtol=1e-4)
assert curves["softmax"][-1] < 0.01, "softmax disperses"
assert curves["ssmax s·Δ=1.5"][-1] > curves["ssmax s·Δ=1.5"][0], "sΔ > 1: the needle gains weight with n"
assert abs(curves["ssmax s·Δ=1.0"][-1] - 0.5) < 0.05, "sΔ = 1: the needle tends to 1/2"
assert curves["ssmax s·Δ=0.6"][-1] < curves["ssmax s·Δ=0.6"][0], "sΔ < 1: it still disperses"
assert min(curves["sparsemax"]) == 1.0 and min(curves["entmax15"]) == 1.0, "exact sparsity keeps the needle"
assert min(curves["softpick"]) == 1.0, "zero-score distractors take no softpick mass"
print("every curve matches its closed form; the claims hold at n up to", int(n_big))

# %% [markdown]
# ## Noisy distractors
# With Gaussian distractor scores (σ = 1) the picture is less clean: softpick's distractors
# now have |e^x − 1| > 0 and take denominator mass, and sparsemax keeps a few distractors in
# the support once n is large enough that some of them approach the needle.

# %%
rng = np.random.default_rng(0)
noisy = {name: [] for name in ["softmax", "ssmax", "sparsemax", "entmax15", "softpick"]}
for n in ns:
  row = jnp.asarray(rng.normal(size=(8, int(n))), jnp.float32).at[:, 0].set(DELTA + 2.0)
  for name in noisy:
    kw = {"s": 0.5} if name == "ssmax" else {}
    noisy[name].append(float(jnp.mean(js.normalizers.get(name).fn(row, **kw)[:, 0])))
fig, ax = plt.subplots(figsize=(8, 4))
for name, ys in noisy.items():
  ax.semilogx(ns, ys, "o-", ms=3, label=name, base=2)
ax.set(xlabel="n", ylabel="mean needle weight", title=f"needle at {DELTA + 2}, distractors ~ N(0, 1)")
ax.legend(fontsize=8)
plt.show()
