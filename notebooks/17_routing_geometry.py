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
# # 17 · Routing geometry: dot products are distances only when key norms are equal (E18)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/17_routing_geometry.ipynb)
#
# K. R. Balasubramanian ("All Routes Lead to Collapse", 2026, arXiv 2606.22325) starts from the
# identity
#
# $$q\cdot k = -\tfrac12\lVert q-k\rVert^2 + \tfrac12\lVert q\rVert^2 + \tfrac12\lVert k\rVert^2 ,$$
#
# so `softmax_j(q·k_j) = softmax_j(−½‖q − k_j‖² + ½‖k_j‖²)` (the ‖q‖² term is the same for every
# key and cancels). Softmax attention is Boltzmann weighting over Euclidean distances **only when
# all key norms are equal**; otherwise every key gets a bonus ½‖k_j‖²: the score "omits a −‖k‖²
# term and is blind to key magnitude". The paper's claims:
#
# 1. the identity (exact);
# 2. with that norm-blind metric a content router compensates by concentrating its routing
#    (attention sinks) and collapsing what it routes, in nine pretrained transformers, graph
#    attention, a selective SSM, a recurrent mixer and learned residuals, with two ablations
#    showing the routing mechanism causes it;
# 3. the onset is set by the router's "positional brake"; a router with norm-normalised keys
#    concentrates just the same (so norm stratification is not needed).
#
# This notebook checks what can be checked without training: the identity in float64 and
# float32, the equality of dot-product and distance attention when key norms are equal, and the
# seed of a sink in a toy: **averaged over random queries**, the attention mass on a key grows
# with its norm under dot products (Jensen: `E exp(c·X)` grows with c) and shrinks under the
# distance score. Claims 2 and 3 need trained models and are not reproduced here.
# The distance score is `js.attention.dot_product_attention(..., score="neg_sq_distance")`
# (feature A50): logits `−(s/2)‖q_i − k_j‖²`, any normalizer, every implementation.

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

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
D = 16                                       # head dimension (scale s = 1/sqrt(D) = 1/4)
N_KEYS = 16                                  # keys per row
QUERIES = 512 if QUICK else 8192             # random queries averaged over
KEY_SETS = 2 if QUICK else 8                 # independent draws of the keys
C = np.array([0.25, 0.5, 1, 2, 4] if QUICK else [0.25, 0.35, 0.5, 0.7, 1, 1.4, 2, 2.8, 4, 5.6, 8],
             np.float32)                     # the norm scale c of key 0
S = 1.0 / np.sqrt(D)

attention = jax.jit(js.attention.dot_product_attention,
                    static_argnames=("score", "normalizer", "implementation"))


def c_axis(ax):
  """Log-2 x axis labelled at the powers of two of the c grid."""
  ax.set_xscale("log", base=2)
  ticks = [c for c in (0.25, 0.5, 1, 2, 4, 8) if C[0] <= c <= C[-1]]
  ax.set_xticks(ticks, [f"{c:g}" for c in ticks])
  ax.minorticks_off()


positive = lambda y: np.where(np.asarray(y) > 0, y, np.nan)  # exact zeros leave the log plot

# %% [markdown]
# ## The identity, in float64 and float32
# Random q and k (norms about 4): the identity's two sides in float64 differ by rounding only.
# The library's distance logits, `s·q·k + cq_i − ck_j` with the norm terms of
# `js.attention.scores.neg_sq_distance_terms`, against −(s/2)‖q − k‖² computed directly in
# float64: in float32 their error is bounded by about (D + 4)·u·s·(‖q‖² + ‖k‖²) (u = 2⁻²⁴),
# the same order as the dot product's own rounding.

# %%
rng = np.random.default_rng(0)
q64 = rng.standard_normal((64, D))
k64 = rng.standard_normal((64, D))
lhs = q64 @ k64.T
rhs = (-0.5 * np.sum((q64[:, None] - k64[None]) ** 2, -1) + 0.5 * np.sum(q64 ** 2, -1)[:, None]
       + 0.5 * np.sum(k64 ** 2, -1)[None])
print(f"float64: max |q·k − (−½‖q−k‖² + ½‖q‖² + ½‖k‖²)| = {np.max(np.abs(lhs - rhs)):.1e}"
      f"  (|q·k| up to {np.max(np.abs(lhs)):.1f})")

q32, k32 = (jnp.asarray(a, jnp.float32)[None, :, None, :] for a in (q64, k64))  # [1, 64, 1, D]
cq, ck = js.attention.scores.neg_sq_distance_terms(q32, k32, S)
logits32 = np.asarray(js.attention.dense_logits(q32, k32, scale=S, decay_bias=(cq, ck))[0, 0],
                      np.float64)
exact = -0.5 * S * np.sum((q64[:, None] - k64[None]) ** 2, -1)
bound = (D + 4) * 2.0 ** -24 * S * (np.sum(q64 ** 2, -1)[:, None] + np.sum(k64 ** 2, -1)[None])
err = np.abs(logits32 - exact)
print(f"float32 distance logits: max error {err.max():.1e}, largest error/bound {np.max(err / bound):.2f}")
identity_err, worst_ratio = float(np.max(np.abs(lhs - rhs))), float(np.max(err / bound))

# %% [markdown]
# ## Equal key norms: dot-product and distance attention coincide
# Keys rescaled to one common norm give the same softmax weights under both scores (up to float32
# rounding); keys of unequal norms do not. Dot-product attention is distance attention plus the
# key bonus (s/2)‖k_j‖², passed here as a `bias`: that equality holds for any key norms.

# %%
keys = rng.standard_normal((1, 32, 1, D)).astype(np.float32)
queries = rng.standard_normal((1, 8, 1, D)).astype(np.float32)
one_hot = np.eye(32, dtype=np.float32)[None, :, None, :]   # the output row is the weights
equal = 3.0 * keys / np.linalg.norm(keys, axis=-1, keepdims=True)
rows = {}
for name, kk in (("equal norms", equal), ("unequal norms", keys)):
  w_dot = attention(queries, kk, one_hot)
  w_dist = attention(queries, kk, one_hot, score="neg_sq_distance")
  rows[name] = float(jnp.max(jnp.abs(w_dot - w_dist)))
  print(f"{name:14s}: max |w_dot − w_dist| = {rows[name]:.1e}")
bonus = 0.5 * S * np.sum(keys ** 2, -1)[:, None, None, :, 0]        # [1, 1, 1, S]: bias per key
w_bonus = attention(queries, keys, one_hot, bonus, score="neg_sq_distance")
bonus_gap = float(jnp.max(jnp.abs(attention(queries, keys, one_hot) - w_bonus)))
print(f"distance + key bonus (s/2)‖k‖² vs dot product: max difference {bonus_gap:.1e}")

# %% [markdown]
# ## The seed of a sink: mass on a key against its norm
# N_KEYS random keys; key 0 is scaled by c. For each c, the attention weight on key 0 averaged
# over random queries (and several key draws), under dot-product softmax and distance softmax
# (both `dot_product_attention`, one-hot values so the outputs are the weights). The dashed line
# is the uniform share 1/N_KEYS.

# %%
def mass_on_key0(c_values, normalizer="softmax", seed=1):
  """Weights on key 0, [len(c), KEY_SETS, QUERIES], for both scores (one call each)."""
  r = np.random.default_rng(seed)
  base = r.standard_normal((KEY_SETS, N_KEYS, D)).astype(np.float32)
  qs = r.standard_normal((QUERIES, D)).astype(np.float32)
  k = np.repeat(base[None], len(c_values), 0)                        # [c, sets, n, D]
  k[:, :, 0] *= np.asarray(c_values, np.float32)[:, None, None]
  k = k.reshape(-1, N_KEYS, 1, D)
  q = np.broadcast_to(qs, (k.shape[0], QUERIES, D))[:, :, None]
  v = np.broadcast_to(np.eye(N_KEYS, dtype=np.float32), (k.shape[0], N_KEYS, N_KEYS))[:, :, None]
  out = {}
  for score in ("dot", "neg_sq_distance"):
    w = attention(q, k, v, score=score, normalizer=normalizer)[:, :, 0, 0]
    out[score] = np.asarray(w).reshape(len(c_values), KEY_SETS, QUERIES)
  cos = (qs @ base[:, 0].T / np.linalg.norm(qs, axis=-1)[:, None]
         / np.linalg.norm(base[:, 0], axis=-1)[None]).T                 # [sets, QUERIES]
  return out, cos


mass, cos = mass_on_key0(C)
mean_dot, mean_dist = (mass[s_].mean(axis=(1, 2)) for s_ in ("dot", "neg_sq_distance"))
for c, a, b in zip(C, mean_dot, mean_dist, strict=True):
  print(f"c = {c:5.2f}: mean weight on key 0  dot {a:.4f}   distance {b:.2e}")

i1, i4 = int(np.argmin(np.abs(C - 1))), int(np.argmin(np.abs(C - 4)))
shrinks = mass["dot"][i4] < mass["dot"][i1]                          # per query, c: 1 -> 4
print(f"dot product, c 1 -> 4: the weight on key 0 falls for {shrinks.mean():.0%} of the queries; "
      f"{np.mean(cos[shrinks] < 0):.0%} of those have a negative cosine with key 0")

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
ax0.semilogy(C, mean_dot, "o-", label="dot product  q·k")
ax0.semilogy(C, positive(mean_dist), "s-", label="distance  −½‖q − k‖²")
c_axis(ax0)
ax0.axhline(1 / N_KEYS, color="k", ls=":", label="uniform 1/n")
ax0.set(xlabel="norm scale c of key 0", ylabel="mean weight on key 0", ylim=(1e-6, 1.5),
        title=f"softmax, n = {N_KEYS}, d = {D}, {QUERIES} queries")
ax0.legend(fontsize=8)
change = (mass["dot"][i4] - mass["dot"][i1]).ravel()
ax1.scatter(cos.ravel(), change, s=2, alpha=0.3)
ax1.axhline(0, color="k", lw=0.8)
ax1.axvline(0, color="k", lw=0.8)
ax1.set(xlabel="cosine(q, key 0)", ylabel="weight(c = 4) − weight(c = 1)",
        title="dot product, per query: the mean grows, not every query")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Any normalizer in the slot
# The same sweep with sparsemax and with sigmoid (no normalisation, bias −log n) in place of
# softmax: the direction of the effect does not depend on the normalizer. Under the distance
# score a large-norm key is far from every query; under dot products it is close to half of them.

# %%
others = {}
for normalizer in ("sparsemax", "sigmoid"):
  m_, _ = mass_on_key0(C, normalizer=normalizer, seed=2)
  others[normalizer] = {s_: m_[s_].mean(axis=(1, 2)) for s_ in m_}
  print(f"{normalizer:9s}: dot {np.round(others[normalizer]['dot'], 4)}")
  print(f"{'':9s}  distance {np.array2string(others[normalizer]['neg_sq_distance'], precision=2)}")
fig, ax = plt.subplots(figsize=(6, 3.6))
for normalizer, style in (("sparsemax", "-"), ("sigmoid", "--")):
  ax.semilogy(C, positive(others[normalizer]["dot"]), "o" + style, label=f"{normalizer}, dot")
  ax.semilogy(C, positive(others[normalizer]["neg_sq_distance"]), "s" + style,
              label=f"{normalizer}, distance")
c_axis(ax)
ax.set(xlabel="norm scale c of key 0", ylabel="mean weight on key 0", ylim=(1e-8, 1.5),
       title="sparsemax and sigmoid (bias −log n)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %%
assert identity_err < 1e-12, "the identity holds to float64 rounding"
assert worst_ratio <= 1.0, "the float32 distance logits stay inside their error bound"
assert rows["equal norms"] < 1e-5 < 1e-2 < rows["unequal norms"], "equal norms: the same weights"
assert bonus_gap < 1e-5, "dot product = distance + key bonus"
assert np.all(np.diff(mean_dot) > 0), "dot product: the mean weight on key 0 grows with c"
assert np.all(np.diff(mean_dist) < 0), "distance: the mean weight on key 0 shrinks with c"
assert mean_dot[i4] > 2 / N_KEYS and mean_dist[i4] < 1e-3 / N_KEYS, "c = 4: a sink, and none"
assert 0 < shrinks.mean() < 1 and np.all(cos[shrinks] < 0.5), "average, not every query"
for normalizer in others:
  assert others[normalizer]["dot"][i4] > others[normalizer]["dot"][i1], normalizer
  assert others[normalizer]["neg_sq_distance"][i4] < others[normalizer]["neg_sq_distance"][i1]
print("the identity is exact; equal key norms make the two scores equal; the mean weight on a key"
      " grows with its norm under dot products and shrinks under the distance score")

# %% [markdown]
# ## What the run shows
#
# | the paper's claim | this run (full size) |
# |---|---|
# | q·k = −½‖q − k‖² + ½‖q‖² + ½‖k‖² (exact) | holds to float64 rounding (9e-15 on values up to 18); the library's float32 distance logits reach 0.11 of the bound (D + 4)·u·s·(‖q‖² + ‖k‖²) |
# | softmax attention is distance weighting only with equal key norms | equal norms: the weights agree to 6e-8 (float32 rounding); unequal norms: they differ by up to 0.12; dot = distance + (s/2)‖k‖² passed as a bias, for any norms, to 6e-8 |
# | a norm-blind metric seeds sinks: mass grows with key norm | averaged over 8192 queries and 8 key draws, the dot-product weight on key 0 grows monotonically with its norm scale c, from 0.044 (c = ¼) through 0.060 (c = 1) to 0.22 (c = 4, 3.5× the uniform 1/16) and 0.33 (c = 8); under the distance score it falls from 0.21 to 4e-6 (c = 4) and 8e-19 (c = 8). Not for every query: from c = 1 to 4 half of the queries lose dot-product weight, every one of them with a negative cosine to the key (the paper says to test the average) |
# | the direction does not hinge on softmax | sparsemax (0.001 → 0.41 under dot; 0.47 → exactly 0 from c = 2.8 under distance) and sigmoid with bias −log n (0.06 → 0.37; 0.009 → 0) show the same two directions |
# | trained routers concentrate (nine pretrained transformers, GAT, SSM, recurrent mixer, residuals; the positional brake; norm-normalised keys concentrate too) | not reproduced: it needs trained models. The toy shows a flip side the abstract does not discuss: under the distance score a key *near the origin* takes the mass (c = ¼: 0.21, 3.3× the uniform share), so distance attention concentrates too, on small keys instead of large ones |
