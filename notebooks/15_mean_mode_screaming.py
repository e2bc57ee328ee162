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
# # 15 · Mean-mode screaming: the logit gradient dies when the values homogenise (E16)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/15_mean_mode_screaming.ipynb)
#
# **The claim.** The "Mean Mode Screaming" paper (Mean-Variance Split residuals for
# deep Diffusion Transformers, 2025-26; catalogue 001#25) traces the collapse of very deep
# DiTs partly to "the structural suppression of attention-logit gradients through the null
# space of the Softmax Jacobian once values homogenize".
#
# **The argument** (derived here, not copied from the paper). One attention row:
# `o = Σ_j p_j v_j`, `p = softmax(s)`, upstream gradient `g = ∂L/∂o`. Then
#
# `∂L/∂s = J (V g)`, `J = diag(p) − p pᵀ`, so `∂L/∂s_j = p_j (v_j − v̄)·g`, `v̄ = Σ_k p_k v_k`.
#
# `J 1 = 0`: the constant vector spans the Jacobian's null space. Split the values into a
# mean-coherent part and a centred part, `v_j = μ + ε e_j`. The mean part gives `V g ∋ (μ·g) 1`,
# which `J` sends to 0, whatever μ and g are; only the centred part survives, so
# `∂L/∂s = ε J E g` is **exactly linear in the spread ε** and vanishes with it. The gradient into
# the values, `∂L/∂v_j = p_j g`, does not depend on ε at all: homogenised values still learn, the
# queries and keys (which only reach the loss through `s`) stop learning. Bound per row:
# `‖∂L/∂s_i‖ ≤ ½ σ_max(V − 1 mᵀ) ‖g_i‖` for any m (the token mean below), since `‖J‖₂ ≤ ½`.
#
# **What this notebook runs:** (1) the spread scan on one attention row through
# `js.attention.dot_product_attention` (the logits enter as its `bias`), in float64 and float32;
# (2) a toy stack of pure softmax-attention layers, where the tokens homogenise with depth by
# themselves, and the logit gradient of each layer falls with its value spread while the value
# gradient does not. What it does not run: the paper's 400- and 1000-layer DiTs and its
# MV-Split residual (its equations are not in the abstract).

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

jax.config.update("jax_enable_x64", True)  # float64 where asked for; float32 stays float32
QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
S, H = (16, 8) if QUICK else (64, 32)       # keys, head size
DEPTH = 8 if QUICK else 24                    # layers of the toy stack
SEEDS = 2 if QUICK else 16

# %% [markdown]
# ## 1 · One row: ‖∂L/∂s‖ against the spread of the values
#
# Values `v_j = μ + ε e_j` with fixed random μ, e_j, logits s and upstream gradient g; the
# loss is `L = o·g`. ε runs from 1 down to 10⁻¹⁰. The logits reach the attention as its `bias`
# (queries and keys zero), so `jax.grad` with respect to the bias is the logit gradient.

# %%
rng = np.random.default_rng(0)
s0, mu, E, g = (rng.normal(size=shape) for shape in [(S,), (H,), (S, H), (H,)])
mu *= 3.0                                   # a large mean mode, as in the collapsed state
eps = np.logspace(0, -10, 21)


def row_loss(bias, v):
  zeros_q, zeros_k = jnp.zeros((1, 1, 1, H), v.dtype), jnp.zeros((1, S, 1, H), v.dtype)
  o = js.attention.dot_product_attention(zeros_q, zeros_k, v[None, :, None, :],
                                         bias=bias[None, None, None, :])
  return jnp.sum(o[0, 0, 0] * g.astype(v.dtype))


row_grads = jax.jit(jax.vmap(jax.grad(row_loss, argnums=(0, 1)), in_axes=(None, 0)))
scan = {}
for dtype in (np.float64, np.float32):
  V = (mu[None, None] + eps[:, None, None] * E[None]).astype(dtype)
  gs, gv = row_grads(jnp.asarray(s0, dtype), jnp.asarray(V))
  scan[np.dtype(dtype).name] = (np.linalg.norm(np.asarray(gs, np.float64), axis=-1),
                                np.linalg.norm(np.asarray(gv, np.float64).reshape(len(eps), -1), axis=-1))

# The reference in numpy float64, written from the formula: ∂L/∂s = ε · J E g (the mean part
# dropped analytically, so no cancellation).
p = np.exp(s0 - s0.max())
p /= p.sum()
J = np.diag(p) - np.outer(p, p)
ref = eps * np.linalg.norm(J @ (E @ g))
print("J·1 =", np.abs(J @ np.ones(S)).max(), "(the null space of the softmax Jacobian)")
print("‖∂L/∂s‖ / ε, float64, from ε = 1 to 1e-10:", np.round(scan["float64"][0] / eps, 6)[::5])
np.testing.assert_allclose(scan["float64"][0], ref, rtol=1e-5)  # 1e-16·|μ·g| / ε ≤ 1e-5 at 1e-10

fig, ax = plt.subplots(figsize=(8, 4.5))
ax.loglog(eps, scan["float64"][0], "o-", ms=3, label="‖∂L/∂s‖, float64")
ax.loglog(eps, scan["float32"][0], "s--", ms=3, label="‖∂L/∂s‖, float32")
ax.loglog(eps, ref, "k:", lw=1, label="ε ‖J E g‖ (formula)")
ax.loglog(eps, scan["float64"][1], "^-", ms=3, label="‖∂L/∂V‖ (does not depend on ε)")
u32 = 2.0 ** -24 * abs(mu @ g) / np.sqrt(S)  # u |μ·g| p_j per entry, p_j ~ 1/S
ax.axhline(u32, color="gray", lw=0.8, ls="--")
ax.text(eps[-1], u32 * 1.5, "float32 roundoff of the mean mode, 2⁻²⁴·|μ·g|/√S", fontsize=8)
ax.set(xlabel="spread of the values ε (v_j = μ + ε e_j)", ylabel="gradient norm",
       title="The logit gradient is linear in the value spread; the value gradient is not")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The logit gradient falls exactly in proportion to ε (float64: the ratio ‖∂L/∂s‖/ε is the same
# to six digits over ten decades), while the value gradient stays put. In float32 the
# cancellation of the mean mode is only as good as the row sum `Σ p_j = 1` is, so the logit
# gradient floors at a few units of roundoff times `|μ·g|` instead of reaching 0: a
# homogenised row in float32 gets **noise** for a logit gradient, not a signal.

# %% [markdown]
# ## 2 · A stack that homogenises by itself
#
# `DEPTH` softmax-attention layers with a lazy residual, `X ← ½ X + ½ attn(X)` (no MLP), random
# `W_Q, W_K` at scale `1/√H`, `W_V = I` (the values are the tokens, so the mean token is kept),
# tokens `X₀ ~ N(0, 1)` plus a shared mean token. Attention averages tokens, so the spread
# between tokens shrinks layer by layer (the rank collapse of Dong, Cordonnier & Loukas 2021;
# notebook 16 measures it as a low-pass filter). Without the residual it collapses to roundoff
# within five layers; the lazy residual makes the decay exponential instead of doubly
# exponential, so every layer has a spread to measure. The loss is `Σ o_L · G` with a random G
# at the last layer; each layer's logits get a zero `bias` so that `jax.grad` returns them.
# Per layer we record the relative spread of its values, `‖V − 1 mᵀ‖_F / ‖V‖_F` (m = token
# mean), the logit-gradient norm, the value-gradient norm and the bound
# `½ σ_max(V − 1 mᵀ) ‖∂L/∂O‖_F` of the argument above.

# %%
@jax.jit
def layer_gradients(W, X0, G):
  """Logit, value and output gradients of every layer (zero additive handles on each)."""
  def forward(handles):
    hb, hv, ho = handles
    X, vals = X0, []
    for layer in range(DEPTH):
      q, k, v = (X @ W[layer, i] for i in range(3))
      v = v + hv[layer]
      vals.append(v)
      attn = js.attention.dot_product_attention(q[None, :, None], k[None, :, None],
                                                v[None, :, None], bias=hb[layer][None, None])
      X = 0.5 * X + 0.5 * (attn[0, :, 0] + ho[layer])
    return jnp.sum(X * G), jnp.stack(vals)

  zeros = (jnp.zeros((DEPTH, S, S)), jnp.zeros((DEPTH, S, H)), jnp.zeros((DEPTH, S, H)))
  (gb, gv, go), vals = jax.grad(forward, has_aux=True)(zeros)
  return gb, gv, go, vals


rows = []
for seed in range(SEEDS):
  r = np.random.default_rng(seed)
  W = r.normal(size=(DEPTH, 3, H, H)) / np.sqrt(H)
  W[:, 2] = np.eye(H)                      # W_V = I: the values are the tokens
  X0 = r.normal(size=(S, H)) + 2.0 * r.normal(size=(1, H))
  G = r.normal(size=(S, H))
  gb, gv, go, vals = (np.asarray(a) for a in layer_gradients(*map(jnp.asarray, (W, X0, G))))
  centred = vals - vals.mean(axis=1, keepdims=True)
  upstream = np.linalg.norm(go, axis=(1, 2))                    # ‖∂L/∂O‖ of each layer
  rows.append(np.stack([
      np.linalg.norm(centred, axis=(1, 2)) / np.linalg.norm(vals, axis=(1, 2)),
      np.linalg.norm(gb, axis=(1, 2)) / upstream,
      np.linalg.norm(gv, axis=(1, 2)) / upstream,
      0.5 * np.linalg.norm(centred, ord=2, axis=(1, 2)),
      np.linalg.norm(centred, axis=(1, 2))]))
rows = np.stack(rows)                              # [seed, quantity, layer]
spread, g_logit, g_value, bound, abs_spread = (rows[:, i] for i in range(5))
assert np.all(g_logit <= bound * (1 + 1e-9)), "‖∂L/∂s‖ ≤ ½ σ_max(V − 1mᵀ) ‖∂L/∂O‖ in every layer"

layers = np.arange(1, DEPTH + 1)
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 4.8))
med = lambda a: np.median(a, axis=0)  # noqa: E731
ax0.semilogy(layers, med(spread), "o-", ms=3, label="relative value spread ‖V − 1mᵀ‖/‖V‖")
ax0.semilogy(layers, med(g_logit), "s-", ms=3, label="‖∂L/∂s‖ / ‖∂L/∂O‖ (logits)")
ax0.semilogy(layers, med(g_value), "^-", ms=3, label="‖∂L/∂V‖ / ‖∂L/∂O‖ (values)")
ax0.semilogy(layers, med(bound), "k:", lw=1, label="bound on the logit ratio: ½ σ_max(V − 1mᵀ)")
ax0.set(xlabel="layer", ylabel=f"median over {SEEDS} random stacks",
        title="Depth homogenises the values; the logit gradient follows them down")
ax0.legend(fontsize=8)
ax1.loglog(abs_spread.ravel(), g_logit.ravel(), ".", ms=4, alpha=0.6, label="logits")
ax1.loglog(abs_spread.ravel(), g_value.ravel(), ".", ms=4, alpha=0.6, label="values")
ax1.set(xlabel="value spread of the layer ‖V − 1mᵀ‖_F",
        ylabel="gradient norm per unit of ‖∂L/∂O‖, same layer",
        title="Per layer and seed: logit and value gradients against the spread")
ax1.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %%
slope = np.polyfit(np.log(abs_spread.ravel()), np.log(g_logit.ravel()), 1)[0]
first, last = med(spread)[0], med(spread)[-1]
print(f"median relative value spread: layer 1 {first:.3g}, layer {DEPTH} {last:.3g}")
print(f"median ‖∂L/∂s‖/‖∂L/∂O‖: layer 1 {med(g_logit)[0]:.3g}, layer {DEPTH} {med(g_logit)[-1]:.3g}; "
      f"‖∂L/∂V‖/‖∂L/∂O‖: {med(g_value)[0]:.3g} → {med(g_value)[-1]:.3g}")
print(f"log-log slope of the logit gradient (per unit upstream) against the spread: {slope:.2f}")
tightness = np.median(g_logit / bound, axis=0)
print(f"median ‖∂L/∂s‖ / bound: layer 1 {tightness[0]:.3g}, layer {DEPTH} {tightness[-1]:.3g}")
logit_fall, value_fall = med(g_logit)[0] / med(g_logit)[-1], med(g_value)[0] / med(g_value)[-1]
assert last < first / 2, "the stack homogenises its tokens"
assert logit_fall > 10 * value_fall, "the logit gradient falls much further than the value gradient"
assert 0.8 < slope < 1.25, "the logit gradient falls in proportion to the spread"

# %% [markdown]
# ## What the runs show
#
# * **Agrees with the paper's mechanism.** The logit gradient of a softmax-attention row is
#   exactly `J` applied to the values' projection on g, the mean mode lies in `J`'s null space,
#   and so `‖∂L/∂s‖` is linear in the value spread, to six digits over ten decades in float64
#   (section 1). In float32 it floors at roundoff of the mean mode instead of reaching zero.
# * **In a stack that homogenises its tokens** (section 2) the logit gradient of each layer
#   (per unit of the gradient arriving at that layer's output) follows the spread of that
#   layer's values down, under the bound `½ σ_max(V − 1mᵀ)` in every layer: the fitted
#   log-log slope against `‖V − 1mᵀ‖_F` is 1.0 (printed above), over seven decades of spread on
#   the full run. The gradient into the values, per unit upstream, stays near 1 except in the
#   last few layers, where it falls by about ten (there the upstream gradient is the loss's
#   random, token-centred G, and a nearly uniform attention passes only its token mean),
#   against about 10⁷ for the logits: the suppression is specific to the logits (so to the
#   queries and keys), as the paper says.
# * **Not shown here:** the paper's DiT-scale results (the collapse of a 400-layer DiT, the
#   1000-layer run) and its MV-Split fix. The toy stack homogenises at initialisation because
#   its residual is lazy and it has no MLP; the paper's DiTs reach the mean-dominated state
#   through training (its "mean-coherent backward shock"), which is not reproduced here.
