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
# # 08 · Gumbel-softmax and the Gumbel-max trick (E07)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/08_gumbel_softmax.ipynb)
#
# The Gumbel-max trick: argmax(log π + g) with g ~ Gumbel(0, 1) i.i.d. is an *exact* sample
# from the categorical π. Gumbel-softmax (Jang et al. 2017; Maddison et al. 2017) relaxes the
# argmax to softmax((log π + g)/τ), which tends to the one-hot sample as τ → 0; `hard=True`
# returns the one-hot sample with the straight-through gradient of the relaxed one.

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
from scipy import stats

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
num = 4000 if QUICK else 40000

# %% [markdown]
# ## Gumbel-max frequencies against π (χ² test)

# %%
pi = jnp.array([0.05, 0.1, 0.15, 0.3, 0.4])
keys = jax.random.split(jax.random.key(0), num)
hard = jax.vmap(lambda k: js.normalizers.gumbel_softmax(k, jnp.log(pi), hard=True))(keys)
counts = np.asarray(hard.sum(0))
chi2 = stats.chisquare(counts, np.asarray(pi) * num)
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(np.arange(5) - 0.2, counts / num, width=0.4, label="Gumbel-max frequency")
ax.bar(np.arange(5) + 0.2, np.asarray(pi), width=0.4, label="π")
ax.set(title=f"{num} samples: χ² = {chi2.statistic:.1f}, p = {chi2.pvalue:.2f}", xlabel="category")
ax.legend()
plt.show()
assert np.all(np.asarray(hard).sum(-1) == 1), "hard samples are one-hot"
assert chi2.pvalue > 0.001, "frequencies match pi"

# %% [markdown]
# ## Annealing τ: the relaxed sample tends to one-hot

# %%
taus = np.geomspace(0.05, 5.0, 10 if QUICK else 30)
soft_max = [float(jnp.mean(jnp.max(jax.vmap(
    lambda k, t=t: js.normalizers.gumbel_softmax(k, jnp.log(pi), tau=float(t)))(keys[:1000]), -1)))
            for t in taus]
fig, ax = plt.subplots(figsize=(6, 3))
ax.semilogx(taus, soft_max, "o-")
ax.set(xlabel="τ", ylabel="mean largest weight", title="cold τ → one-hot, hot τ → uniform")
plt.show()
assert soft_max[0] > 0.95 and soft_max[-1] < 0.5

# %% [markdown]
# ## Straight-through gradient
# `hard=True` returns the one-hot sample in the forward pass, but its gradient is that of the
# relaxed sample with the same noise.

# %%
logits = jnp.log(pi)
key = jax.random.key(3)
v = jnp.arange(5.0)
g_hard = jax.grad(lambda l: js.normalizers.gumbel_softmax(key, l, tau=0.5, hard=True) @ v)(logits)
g_soft = jax.grad(lambda l: js.normalizers.gumbel_softmax(key, l, tau=0.5) @ v)(logits)
print("straight-through gradient:", np.round(np.asarray(g_hard), 4))
np.testing.assert_allclose(g_hard, g_soft, rtol=1e-5, atol=1e-6)
