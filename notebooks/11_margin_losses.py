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
# # 11 · Margin losses: the feature geometry of softmax CE and ArcFace
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/11_margin_losses.ipynb)
#
# Softmax cross-entropy on linear logits `x · w_j` only asks each feature to fall on the right
# side of the decision boundaries: the classes fill wedges that touch, and the feature norms carry
# part of the confidence. ArcFace (J. Deng, J. Guo, N. Xue & S. Zafeiriou, "ArcFace: Additive
# Angular Margin Loss for Deep Face Recognition", CVPR 2019) classifies by angle,
# `s · cos(θ_y + m)` for the true class, so each class must sit at least an angle m closer to its own
# centre than to any other: compact classes with gaps between them. `js.losses.arcface_loss`
# takes the embeddings and the class centres directly. We train the same small network with a


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

# **2-D embedding** under both losses for a few hundred optax steps and plot the features.

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
N, STEPS = (1000, 300) if QUICK else (4000, 1500)
K, DIM = 6, 16  # classes, input dimension

# %% [markdown]
# ## Data, network and the two losses
# Six Gaussian classes in 16 dimensions, overlapping a little; an MLP maps them to 2-D features.

# %%
rng = np.random.default_rng(0)
means = 1.2 * rng.standard_normal((K, DIM)).astype(np.float32)


def sample(n):
  y = rng.integers(0, K, n)
  return (means[y] + rng.standard_normal((n, DIM))).astype(np.float32), y


x_train, y_train = sample(N)
x_test, y_test = sample(N)


def init(key):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  return {"w1": jax.random.normal(k1, (DIM, 64)) / 4.0, "b1": jnp.zeros(64),
          "w2": jax.random.normal(k2, (64, 64)) / 8.0, "b2": jnp.zeros(64),
          "w3": jax.random.normal(k3, (64, 2)) / 8.0,
          "centres": jax.random.normal(k4, (2, K))}


def embed(p, x):
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  h = jax.nn.relu(h @ p["w2"] + p["b2"])
  return h @ p["w3"]


def softmax_loss(p, x, y):
  return jnp.mean(js.losses.softmax_cross_entropy_with_integer_labels(embed(p, x) @ p["centres"], y))


def arcface(p, x, y):
  return jnp.mean(js.losses.arcface_loss(embed(p, x), p["centres"], y, scale=16.0, margin=0.3))


def train(loss_fn, seed=0):
  tx = optax.adam(optax.cosine_decay_schedule(3e-3, STEPS))
  p = init(jax.random.key(seed))

  def step(carry, _):
    p, s = carry
    v, g = jax.value_and_grad(loss_fn)(p, x_train, y_train)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), v

  (p, _), curve = jax.jit(lambda c: jax.lax.scan(step, c, None, length=STEPS))((p, tx.init(p)))
  return p, np.asarray(curve)


runs = {"softmax CE": train(softmax_loss), "ArcFace (s = 16, m = 0.3)": train(arcface)}

# %% [markdown]
# ## Geometry
# For each model: test accuracy (nearest centre by cosine for ArcFace, argmax of the logits for
# CE), the mean angle between a feature and its class centre (intra-class spread) and the smallest
# angle between two class centres.

# %%


def geometry(name, p):
  e = np.asarray(embed(p, x_test))
  c = np.asarray(p["centres"])
  ang = np.arctan2(e[:, 1], e[:, 0])
  c_ang = np.arctan2(c[1], c[0])
  if name.startswith("ArcFace"):
    cos = (e / np.linalg.norm(e, axis=1, keepdims=True)) @ (c / np.linalg.norm(c, axis=0))
    pred = cos.argmax(1)
  else:
    pred = (e @ c).argmax(1)
  diff = np.angle(np.exp(1j * (ang - c_ang[y_test])))
  spread = float(np.degrees(np.mean(np.abs(diff))))
  cc = np.angle(np.exp(1j * (c_ang[:, None] - c_ang[None, :])))
  gap = float(np.degrees(np.min(np.abs(cc[~np.eye(K, dtype=bool)]))))
  return e, c, float(np.mean(pred == y_test)), spread, gap


geo = {name: geometry(name, p) for name, (p, _) in runs.items()}
for name, (_, _, acc, spread, gap) in geo.items():
  print(f"{name:26s} accuracy {acc:.3f}  intra-class angle {spread:5.1f}°  "
        f"closest centres {gap:5.1f}°")

fig, axes = plt.subplots(1, 3, figsize=(16, 5))
colors = plt.cm.tab10(np.arange(K))
for ax, (name, (e, c, acc, spread, _)) in zip(axes[:2], geo.items(), strict=True):
  r = np.linalg.norm(e, axis=1).max()
  ax.scatter(*e.T, s=3, c=colors[y_test], alpha=0.5)
  for j in range(K):
    d = c[:, j] / np.linalg.norm(c[:, j]) * r
    ax.plot([0, d[0]], [0, d[1]], color=colors[j], lw=2)
  ax.set(title=f"{name}: acc {acc:.2f}, spread {spread:.1f}°", aspect="equal")
for name, (_, curve) in runs.items():
  axes[2].semilogy(curve, label=name)
axes[2].set(xlabel="Adam step", ylabel="training loss", title="training")
axes[2].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The same features on the unit circle (angle only), which is all ArcFace looks at.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3), sharey=True)
bins = np.linspace(-180, 180, 73)
for ax, (name, (e, c, *_)) in zip(axes, geo.items(), strict=True):
  ang = np.degrees(np.arctan2(e[:, 1], e[:, 0]))
  for j in range(K):
    ax.hist(ang[y_test == j], bins=bins, color=colors[j], alpha=0.7)
    ax.axvline(np.degrees(np.arctan2(c[1, j], c[0, j])), color=colors[j], ls="--")
  ax.set(title=name, xlabel="feature angle (degrees)")
axes[0].set(ylabel="test points")
plt.tight_layout()
plt.show()
(_, _, acc_ce, spread_ce, _), (_, _, acc_arc, spread_arc, _) = geo.values()
assert acc_ce > 0.8 and acc_arc > 0.8, (acc_ce, acc_arc)
assert spread_arc < spread_ce, "ArcFace gives more compact classes (in angle)"
