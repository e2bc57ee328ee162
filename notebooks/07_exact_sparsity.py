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
# # 07 · Exact sparsity of α-entmax (E06)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/07_exact_sparsity.ipynb)
#
# α-entmax (Peters, Niculae & Martins 2019) is softmax at α → 1 and sparsemax at α = 2; in
# between it assigns *exact* zeros to every score below a threshold τ. How many entries
# survive depends on α and on the row length n. Adaptively Sparse Transformers (Correia et
# al. 2019) learn α per head through the closed-form gradient ∂p/∂α; the last section does
# that on a toy problem.

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
import optax

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")

# %% [markdown]
# ## Support size against α and n
# Scores are i.i.d. standard normal. The heat map shows the mean fraction of entries with
# non-zero weight.

# %%
alphas = np.linspace(1.1, 2.0, 6 if QUICK else 16)
ns = 2 ** np.arange(3, 10 if QUICK else 13)
rows = 16 if QUICK else 128
frac = np.zeros((len(alphas), len(ns)))
count = np.zeros_like(frac)
for j, n in enumerate(ns):
  x = jax.random.normal(jax.random.key(int(n)), (rows, int(n)))
  for i, a in enumerate(alphas):
    support = jnp.sum(js.normalizers.entmax(x, alpha=float(a)) > 0, axis=-1)
    frac[i, j] = float(jnp.mean(support)) / n
    count[i, j] = float(jnp.mean(support))
fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 3.8))
im = a0.imshow(frac, aspect="auto", origin="lower", cmap="viridis",
               extent=[np.log2(ns[0]) - 0.5, np.log2(ns[-1]) + 0.5, alphas[0], alphas[-1]])
a0.set(xlabel="log2 n", ylabel="α", title="fraction of entries in the support")
fig.colorbar(im, ax=a0)
for i in range(0, len(alphas), max(1, len(alphas) // 4)):
  a1.loglog(ns, count[i], "o-", ms=3, base=2, label=f"α = {alphas[i]:.2f}")
a1.set(xlabel="n", ylabel="mean support size", title="support grows sub-linearly with n")
a1.legend(fontsize=8)
fig.tight_layout()
plt.show()

assert np.all(np.diff(frac, axis=0) <= 1e-6), "support fraction is non-increasing in alpha"
assert np.all(frac[-1] < frac[0]), "sparsemax (alpha = 2) is sparser than alpha = 1.1 at every n"
assert frac[-1, -1] < 0.05, "sparsemax keeps a small fraction of a long Gaussian row"

# %% [markdown]
# ## Learning α per head
# Four "heads" each see rows produced by α-entmax with a different true α. Starting from
# α = 1 + softplus(z) at z = 0 for every head, we fit the outputs by gradient descent on z;
# the gradient flows through the closed-form ∂ entmax / ∂α.

# %%
true_alpha = jnp.array([1.2, 1.5, 1.8, 2.0])[:, None, None]  # per head, broadcast to rows
x = jax.random.normal(jax.random.key(7), (4, 32 if QUICK else 128, 16)) * 2.0
target = js.normalizers.entmax(x, alpha=true_alpha)


def loss(z):
  alpha = js.normalizers.learned_alpha(z)
  return jnp.mean((js.normalizers.entmax(x, alpha=alpha) - target) ** 2)


z = jnp.zeros((4, 1, 1))
opt = optax.adam(0.1)
state = opt.init(z)
history = []
step = jax.jit(lambda z, s: (lambda l, g: (l, *opt.update(g, s)))(*jax.value_and_grad(loss)(z)))
for _ in range(60 if QUICK else 200):
  l, updates, state = step(z, state)
  z = optax.apply_updates(z, updates)
  history.append(np.asarray(js.normalizers.learned_alpha(z)).ravel())
history = np.array(history)
fig, ax = plt.subplots(figsize=(7, 3.5))
for h in range(4):
  ax.plot(history[:, h], color=f"C{h}", label=f"head {h}")
  ax.axhline(float(true_alpha[h, 0, 0]), color=f"C{h}", ls=":")
ax.set(xlabel="step", ylabel="α", title="learned α per head (dotted: the true α)")
ax.legend(fontsize=8)
plt.show()
print("learned α:", np.round(history[-1], 3), "true α:", np.asarray(true_alpha).ravel())
assert np.allclose(history[-1], np.asarray(true_alpha).ravel(), atol=0.1), "alpha is recovered"
