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
# # 01 · Normalizer gallery
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/01_normalizer_gallery.ipynb)
#
# Every normalizer registered in `jaxsoft.normalizers` applied to the same score rows, how
# sparse the threshold family gets as α and the temperature change, and where each maps a
# three-way row on the 2-D probability simplex.

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

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"  # CI runs every notebook with small sizes
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")

# %% [markdown]
# ## Every registered normalizer on one row
# Bars above zero are weights; the title gives the kernel class (E exp family, S map + sum,
# P pointwise, T threshold, X other) and the row sum.

# %%
row = jnp.array([2.0, 1.5, 1.2, 0.8, 0.4, 0.1, -0.5, -1.0, -1.5, -3.0])
key = jax.random.key(0)
specs = [js.normalizers.get(n) for n in js.normalizers.names()]
cols = 4
fig, axes = plt.subplots(-(-len(specs) // cols), cols, figsize=(3.2 * cols, 2.2 * -(-len(specs) // cols)),
                         sharey=True, squeeze=False)
for ax, spec in zip(axes.flat, specs):
  w = np.asarray(spec.fn(key, row) if spec.needs_key else spec.fn(row))
  ax.bar(range(len(row)), w, color="C0" if spec.sums_to_one else "C1")
  ax.set_title(f"{spec.name} [{spec.kernel_class}] Σ={w.sum():.2f}", fontsize=9)
  ax.set_xticks([])
for ax in list(axes.flat)[len(specs):]:
  ax.axis("off")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Sparsity against α and temperature
# α-entmax interpolates between softmax (α → 1, dense) and sparsemax (α = 2): the number of
# exact zeros grows with α. Softmax is dense at every temperature; lowering the temperature
# only concentrates it.

# %%
x = jax.random.normal(jax.random.key(1), (64 if QUICK else 512, 32))
alphas = np.linspace(1.05, 2.5, 8 if QUICK else 24)
support = [float(jnp.mean(jnp.sum(js.normalizers.entmax(x, alpha=float(a)) > 0, -1))) for a in alphas]
temps = np.geomspace(0.05, 2.0, 8 if QUICK else 24)
top_mass = [float(jnp.mean(jnp.max(js.normalizers.softmax(x, temperature=float(t)), -1))) for t in temps]
fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 3.2))
a0.plot(alphas, support, "o-")
a0.set(xlabel="α", ylabel="mean support size (of 32)", title="entmax: support shrinks as α grows")
a1.semilogx(temps, top_mass, "o-", color="C2")
a1.set(xlabel="temperature", ylabel="mean max weight", title="softmax: dense, sharper when cold")
fig.tight_layout()
plt.show()
assert support[0] > support[-1], "entmax support should shrink as alpha grows"
assert np.all(np.diff(support) <= 1e-6), "support size is non-increasing in alpha"

# %% [markdown]
# ## The 2-D simplex
# Rows x = (x₁, x₂, 0) on a grid, mapped by softmax, sparsemax and entmax-1.5 and drawn in
# barycentric coordinates. Softmax never reaches the edges; sparsemax and entmax land on the
# edges and corners (exact zeros) for a whole region of inputs.

# %%
g = jnp.linspace(-3, 3, 25 if QUICK else 61)
grid = jnp.stack(jnp.meshgrid(g, g), -1).reshape(-1, 2)
rows3 = jnp.concatenate([grid, jnp.zeros((grid.shape[0], 1))], -1)
corners = np.array([[0.0, 0.0], [1.0, 0.0], [0.5, np.sqrt(3) / 2]])
fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
for ax, name in zip(axes, ["softmax", "sparsemax", "entmax15"]):
  p = np.asarray(js.normalizers.get(name).fn(rows3))
  xy = p @ corners
  on_face = (p == 0).any(-1)
  ax.plot(*np.vstack([corners, corners[:1]]).T, "k-", lw=0.8)
  ax.scatter(*xy[~on_face].T, s=4, c="C0", label="interior")
  ax.scatter(*xy[on_face].T, s=4, c="C3", label="on a face (exact zero)")
  ax.set_title(f"{name}: {on_face.mean():.0%} of rows sparse")
  ax.set_aspect("equal")
  ax.axis("off")
axes[0].legend(loc="upper left", fontsize=8)
fig.tight_layout()
plt.show()
