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
#
# Four learned, length-aware variants, each at its initial (default) parameters:
#
# * **QASSMax** (TabICLv2, 2026) rescales the queries by log n (times learned gates that start
#   at 1): at init it is SSMax with s = 1, so the needle weight is n^Δ/(n^Δ + n − 1).
# * **SSA** (Zhang et al., "Selective Attention", 2024) multiplies the scores by the temperature
#   τ = 1 + σ(α)·log n (σ(0) = ½ at init): the needle weight e^{τΔ}/(e^{τΔ} + n − 1) → 1.
# * **ASEntmax** (Vasylenko et al. 2025) scales entmax's scores by δ + β(log n)^γ: exact zeros
#   on the distractors at every n.
# * **Polar** (ATMA) tempers by t = 1 + softplus(α)·log n and adds a null logit
#   ν = softplus(γ)·√log(n + 1) that takes the mass nothing deserves; the needle weight is
#   e^{tΔ}/(e^{tΔ} + n − 1 + e^{tν}). ν grows like the largest of n unrelated scores, so the
#   null's share rises again at large n, and once ν passes Δ (n ≈ 10⁸ here) a needle of
#   margin 3 counts as noise and the null takes over.

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

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
DELTA = 3.0
ns = 2 ** np.arange(4, 13 if QUICK else 17)


# Every length in one call: row i holds the needle and n_i − 1 distractors, the rest of the
# row is masked (`where`), and a masked entry is a deleted one (n counts visible entries only).
visible = np.arange(ns[-1])[None, :] < ns[:, None]
rows = jnp.zeros(visible.shape).at[:, 0].set(DELTA)


def needle_weight(fn, **kw):
  return np.asarray(fn(rows, where=visible, **kw)[:, 0], np.float64)


curves = {
    "softmax": needle_weight(js.normalizers.softmax),
    **{f"ssmax s·Δ={s * DELTA:.1f}": needle_weight(js.normalizers.ssmax, s=s)
       for s in (1.5 / DELTA, 1.0 / DELTA, 0.6 / DELTA)},
    "sparsemax": needle_weight(js.normalizers.sparsemax),
    "entmax15": needle_weight(js.normalizers.entmax15),
    "softpick": needle_weight(js.normalizers.softpick),
    "sigmoid (b = −log n)": needle_weight(js.normalizers.sigmoid),
}

# QASSMax acts on the queries: one head of size 1 with q = 1 and keys k_j = x_j gives the
# scores q~·k_j = scale(n)·x_j, with the module at its initial parameters.
qassmax = js.nn.QASSMax(1, 1, hidden=8, rngs=nnx.Rngs(0))


def qassmax_fn(x, where):
  scale = qassmax(jnp.ones((len(ns), 1, 1, 1)), ns[:, None])[:, 0, 0]  # [len(ns), 1]
  return js.normalizers.softmax(scale * x, where=where)


curves.update({
    "QASSMax (init)": needle_weight(qassmax_fn),
    "SSA (init)": needle_weight(js.normalizers.ssa_softmax),
    "ASEntmax (init)": needle_weight(js.normalizers.asentmax),
    "Polar (init)": needle_weight(js.normalizers.polar_softmax),
})

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
for i, (name, ys) in enumerate(curves.items()):
  style = "o-" if i < 4 else ("s--" if i < 8 else "^:")
  ax.semilogx(ns, ys, style, ms=3, label=name, base=2)
ax.set(xlabel="n (keys)", ylabel=f"weight on the needle (margin Δ = {DELTA})",
       title="Softmax fades with n, the alternatives do not (or decay by design)")
ax.legend(fontsize=8, ncol=2)
# The curves near 1 differ in how fast the rest of the mass vanishes: 1 − w on a log scale,
# computed in float64 (float32 rounds w to 1 long before). sparsemax, entmax15, softpick and
# ASEntmax lose exactly nothing here: not drawn.
with jax.enable_x64(True):
  rows64 = jnp.asarray(rows, jnp.float64)
  sharp = {"softmax": js.normalizers.softmax,
           "ssmax s·Δ=1.5": lambda x, where: js.normalizers.ssmax(x, where=where, s=1.5 / DELTA),
           "QASSMax (init)": qassmax_fn, "SSA (init)": js.normalizers.ssa_softmax,
           "Polar (init)": js.normalizers.polar_softmax}
  for name, fn in sharp.items():
    lost = 1.0 - np.asarray(fn(rows64, where=visible)[:, 0], np.float64)
    ax2.loglog(ns, lost, "o-" if "init" not in name else "^:", ms=3, label=name, base=2)
ax2.set(xlabel="n (keys)", ylabel="1 − needle weight (mass off the needle)",
        title="How fast the sharp ones approach 1 (ASEntmax, entmax: exactly 1)")
ax2.legend(fontsize=8)
plt.tight_layout()
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
np.testing.assert_allclose(curves["QASSMax (init)"], ns ** DELTA / (ns ** DELTA + ns - 1), rtol=1e-4)
tau = 1 + 0.5 * np.log(ns)
np.testing.assert_allclose(curves["SSA (init)"], 1 / (1 + (ns - 1) * np.exp(-tau * DELTA)), rtol=1e-4)
assert min(curves["ASEntmax (init)"]) == 1.0, "exact zeros on the distractors at every n"
t, nu = 1 + np.log(2) * np.log(ns), np.log(2) * np.sqrt(np.log(ns + 1))
np.testing.assert_allclose(curves["Polar (init)"],
                           1 / (1 + (ns - 1) * np.exp(-t * DELTA) + np.exp(t * (nu - DELTA))), rtol=1e-4)
for name in ("QASSMax (init)", "SSA (init)", "Polar (init)"):
  assert curves[name][-1] > 0.99, f"{name}: the needle keeps its weight as n grows"
print("every curve matches its closed form; the claims hold at n up to", int(n_big))

# %% [markdown]
# ## Noisy distractors
# With Gaussian distractor scores (σ = 1) the picture is less clean: softpick's distractors
# now have |e^x − 1| > 0 and take denominator mass, and sparsemax keeps a few distractors in
# the support once n is large enough that some of them approach the needle. The log n scales
# of SSA and ASEntmax sharpen the row as it grows, so the needle keeps most of its weight;
# Polar's null logit grows like the largest of n Gaussian scores and takes part of the mass.

# %%
rng = np.random.default_rng(0)
noisy = {name: None for name in ["softmax", "ssmax", "sparsemax", "entmax15", "softpick",
                               "ssa_softmax", "asentmax", "polar_softmax"]}
scores = jnp.asarray(rng.normal(size=(len(ns), 8, ns[-1])), jnp.float32).at[..., 0].set(DELTA + 2.0)
for name in noisy:  # every length in one call, as above: [len(ns), 8 rows, n_max]
  kw = {"s": 0.5} if name == "ssmax" else {}
  w = js.normalizers.get(name).fn(scores, where=visible[:, None, :], **kw)
  noisy[name] = np.asarray(jnp.mean(w[..., 0], axis=-1))
fig, ax = plt.subplots(figsize=(8, 4))
for name, ys in noisy.items():
  ax.semilogx(ns, ys, "o-" if len(name) < 9 else "s--", ms=3, label=name, base=2)
ax.set(xlabel="n", ylabel="mean needle weight", title=f"needle at {DELTA + 2}, distractors ~ N(0, 1)")
ax.legend(fontsize=8)
plt.show()
