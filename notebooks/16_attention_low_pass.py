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
# # 16 · Softmax attention is a low-pass filter (E17)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/16_attention_low_pass.ipynb)
#
# **The claim.** D. Marin, J.-H. R. Chang, A. Ranjan, A. Prabhu, M. Rastegari & O. Tuzel
# ("Token Pooling in Vision Transformers", 2021/2023; catalogue 004#10): "under mild
# assumptions, softmax-attention acts as a high-dimensional low-pass (smoothing) filter", so
# its output is redundant and can be pooled.
#
# **What "low-pass" means for an attention matrix.** A softmax attention matrix P (one head,
# `P_ij = softmax_j(q_i·k_j)`) is row-stochastic with positive entries. So `P 1 = 1`: the
# constant signal over the tokens, the **DC component**, passes unchanged, and every other
# eigenvalue has `|λ| < 1`. With the centring `C = I − 11ᵀ/S` and `P 1 = 1`, `C P = C P C`:
# the non-constant (high-frequency, "HC") part of the output depends only on the HC part of
# the input, through `C P C`. Three measurements:
#
# 1. **A sequence with positional tokens** (sinusoidal encodings, `q = k`): P is exactly
#    circulant, its eigenvalues are the DFT of one row, i.e. its frequency response, and it is
#    a textbook low-pass filter. Deeper stacks multiply the responses.
# 2. **Random content tokens** (no order): there is no frequency axis, but the eigenvalues
#    and the HC gain `‖C P v‖ / ‖C v‖` still show the DC passing and the rest attenuated;
#    across depth the HC part decays geometrically.
# 3. **The "mild assumptions".** Two exact statements and one counterexample: the range
#    (max − min over tokens) of every feature contracts by Dobrushin's coefficient
#    `δ(P) = 1 − min_{i,i'} Σ_j min(P_ij, P_i'j) < 1` for *any* row-stochastic P; the HC
#    energy cannot grow under a doubly stochastic P (Sinkhorn-normalised attention) but *can*
#    grow under plain softmax attention when the logits are large (sharp, non-overlapping
#    rows). So the energy version of the claim is statistical, and fails at high logit scale.
#
# Attention matrices are computed with `js.attention.dot_product_attention`, with the identity
# as the values (the output is then P itself).

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

jax.config.update("jax_enable_x64", True)
QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
S, H = (32, 16) if QUICK else (128, 64)     # tokens, head size
DRAWS = 8 if QUICK else 32                    # random draws per setting
DEPTHS = [1, 2, 4, 8] if QUICK else [1, 2, 4, 8, 16]


@jax.jit
def attention_matrices(q, k):
  """P for a batch of heads: q, k [B, S, H] -> [B, S, S] (values = the identity, scale 1)."""
  eye = jnp.broadcast_to(jnp.eye(k.shape[1], dtype=k.dtype), (k.shape[0], k.shape[1], k.shape[1]))
  out = js.attention.dot_product_attention(q[:, :, None], k[:, :, None], eye[:, :, None], scale=1.0)
  return out[:, :, 0]


def centre(x):
  return x - x.mean(axis=-2, keepdims=True)


def hc_gain(P, v):
  """‖C P v‖_F / ‖C v‖_F per matrix in the batch."""
  return np.linalg.norm(centre(P @ v), axis=(-2, -1)) / np.linalg.norm(centre(v), axis=(-2, -1))


def dobrushin(P):
  """δ(P) = 1 − min over row pairs of Σ_j min(P_ij, P_i'j), per matrix of a batch [B, S, S]."""
  return np.array([1.0 - np.minimum(p[:, None, :], p[None, :, :]).sum(-1).min() for p in P])


# %% [markdown]
# ## 1 · Positional tokens: an exact low-pass filter
#
# Token t carries `x_t = √β [cos(ω_m t), sin(ω_m t)]_{m=1..4}`, `ω_m = 2πm/S`, and `q = k = x`.
# Then `q_i·k_j = β Σ_m cos(ω_m (i − j))` depends on `i − j` only: P is circulant, its
# eigenvectors are the Fourier modes and its eigenvalues `P̂(k)` (the DFT of a row) are the
# frequency response. β plays the role of the logit scale (an inverse temperature).

# %%
t = np.arange(S)
omega = 2 * np.pi * np.arange(1, 5) / S
pos = np.concatenate([np.cos(np.outer(t, omega)), np.sin(np.outer(t, omega))], axis=1)
betas = [0.5, 1.0, 2.0, 4.0]
P_pos = np.asarray(attention_matrices(*(jnp.asarray(np.stack([np.sqrt(b) * pos for b in betas])),) * 2))
circulant_err = max(np.abs(P[i] - np.roll(P[0], i)).max() for P in P_pos for i in range(S))
response = np.fft.fft(P_pos[:, 0], axis=-1)             # eigenvalues of each circulant P
eig = np.linalg.eigvals(P_pos[1])
print(f"max |P_ij − P_0,(j−i) mod S| = {circulant_err:.1e} (P is circulant)")
print("imaginary part of the response:", f"{np.abs(response.imag).max():.1e} (symmetric kernel)")
np.testing.assert_allclose(np.sort(eig.real), np.sort(response[1].real), atol=1e-10)
freqs = np.arange(S // 2 + 1)

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 4.6))
for b, r in zip(betas, response.real, strict=True):
  ax0.semilogy(freqs, np.maximum(np.abs(r[: S // 2 + 1]), 1e-17), "o-", ms=3, label=f"β = {b}")
ax0.set(xlabel="frequency k (cycles per sequence)", ylabel="|P̂(k)| (eigenvalue of P)",
        title="One attention layer: DC passes (1), high frequencies are cut", ylim=(1e-17, 2))
ax0.legend(fontsize=8)
r2 = response[betas.index(2.0)].real[: S // 2 + 1]
for depth in DEPTHS:
  ax1.semilogy(freqs, np.maximum(np.abs(r2) ** depth, 1e-17), "o-", ms=3, label=f"{depth} layer(s)")
ax1.set(xlabel="frequency k", ylabel="|P̂(k)|^L", ylim=(1e-17, 2),
        title="Stacks of L layers (β = 2): the response is raised to the power L")
ax1.legend(fontsize=8)
plt.tight_layout()
plt.show()
assert circulant_err < 1e-13 and abs(response[:, 0].real - 1).max() < 1e-13, "P 1 = 1: DC passes"
half = response.real[:, 1 : S // 2 + 1]
assert np.all(np.abs(half) < 1), "every non-DC frequency is attenuated"
assert np.all(np.diff(half[:, : S // 8], axis=1) < 0), "monotone low-pass over the first band"

# %% [markdown]
# Exactly as claimed for this input: the response is 1 at k = 0 and falls monotonically with k,
# by ten or more orders of magnitude at the highest frequency (to roundoff at β = ½); a larger
# logit scale β widens the pass band (sharper rows average fewer neighbours), and L layers
# give `P̂(k)^L`.
#
# ## 2 · Random content tokens, and depth
#
# Tokens `x ~ N(0, I)`, random `W_Q, W_K` with entries `N(0, 1/H)` times a logit scale `c`, so
# the logits are about `c·N(0, 1)` (c = 1: the usual 1/√H-scaled attention at init). Values: a
# random signal `v ~ N(0, I)` over the tokens (64 columns). With no order on the tokens the
# eigenvalues of P stand in for frequencies: one at exactly 1 (the DC), the rest inside the disc
# of radius `δ(P)` (the Dobrushin coefficient bounds every non-unit eigenvalue).

# %%
rng = np.random.default_rng(0)
scales = [0.5, 1.0, 2.0, 4.0, 8.0]


def content_matrices(c, n, seed):
  r = np.random.default_rng(seed)
  x = r.normal(size=(n, S, H))
  wq, wk = (r.normal(size=(n, H, H)) / np.sqrt(H) for _ in range(2))
  return np.asarray(attention_matrices(jnp.asarray(c * x @ wq / H ** 0.25),
                                       jnp.asarray(x @ wk / H ** 0.25)))


P1 = content_matrices(1.0, DRAWS, 1)
eigs = np.linalg.eigvals(P1)
top = np.abs(eigs).max(-1)
second = np.sort(np.abs(eigs), axis=-1)[:, -2]
delta = dobrushin(P1)
print(f"c = 1: largest |λ| = {top.min():.12f}..{top.max():.12f}; second |λ| median "
      f"{np.median(second):.3f}; δ(P) median {np.median(delta):.3f}")
assert np.all(np.abs(top - 1) < 1e-10) and np.all(second <= delta + 1e-12)

v = rng.normal(size=(S, 64))
gains = {c: hc_gain(content_matrices(c, DRAWS, 2), v) for c in scales}
stack = {}
for c in (1.0, 4.0):                       # products of independent layers, pure and residual
  Ps = content_matrices(c, DRAWS * max(DEPTHS), 3).reshape(DRAWS, max(DEPTHS), S, S)
  pure, lazy, out_p, out_r = [], [], v, v
  for layer in range(max(DEPTHS)):
    out_p = Ps[:, layer] @ out_p
    out_r = 0.5 * out_r + 0.5 * Ps[:, layer] @ out_r
    if layer + 1 in DEPTHS:
      pure.append(np.linalg.norm(centre(out_p), axis=(-2, -1)) / np.linalg.norm(centre(v)))
      lazy.append(np.linalg.norm(centre(out_r), axis=(-2, -1)) / np.linalg.norm(centre(v)))
  stack[c] = (np.array(pure), np.array(lazy))

fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(17, 4.6))
th = np.linspace(0, 2 * np.pi, 200)
ax0.plot(np.cos(th), np.sin(th), "k", lw=0.6)
ax0.plot(np.median(delta) * np.cos(th), np.median(delta) * np.sin(th), "k:", lw=0.8)
ax0.plot(eigs[:4].real.ravel(), eigs[:4].imag.ravel(), ".", ms=4)
ax0.set(aspect="equal", title="eigenvalues of P (4 draws, c = 1); dotted: δ(P)", xlabel="Re λ",
        ylabel="Im λ")
ax1.boxplot([gains[c] for c in scales])
ax1.set_xticks(range(1, len(scales) + 1), [str(c) for c in scales])
ax1.axhline(1, color="gray", lw=0.8)
ax1.set(xlabel="logit scale c", ylabel="‖C P v‖ / ‖C v‖ (HC gain)",
        title="One layer: the non-constant part is attenuated")
for c, style in ((1.0, "-"), (4.0, "--")):
  pure, lazy = stack[c]
  ax2.semilogy(DEPTHS, np.median(pure, 1), "o" + style, ms=3, label=f"pure attention, c = {c}")
  ax2.semilogy(DEPTHS, np.median(lazy, 1), "s" + style, ms=3, label=f"X ← ½X + ½PX, c = {c}")
ax2.set(xlabel="layers L", ylabel="‖C P_L⋯P_1 v‖ / ‖C v‖ (median)",
        title="Deeper stacks attenuate more")
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %%
for c in scales:
  print(f"c = {c}: HC gain median {np.median(gains[c]):.3f}, max {gains[c].max():.3f}")
for c in stack:
  print(f"c = {c}: HC left after {DEPTHS} layers (pure):",
        ", ".join(f"{h:.1e}" for h in np.median(stack[c][0], 1)))
assert np.median(gains[1.0]) < 0.5, "at the usual scale one layer removes most of the HC energy"
assert all(np.all(np.diff(np.median(stack[c][k], 1)) < 0) for c in stack for k in (0, 1)), (
    "every extra layer attenuates more")
assert np.median(gains[8.0]) > np.median(gains[0.5]), "sharper attention filters less"

# %% [markdown]
# ## 3 · The "mild assumptions": what holds always, and what does not
#
# * **Range contraction (always).** For any row-stochastic P, each output is a convex
#   combination of the inputs with overlapping weights, and `osc(P v) ≤ δ(P)·osc(v)` per
#   feature, `osc = max − min` over tokens; softmax rows are positive, so `δ(P) < 1`.
# * **Energy under a doubly stochastic P (always).** Sinkhorn-normalised attention (rows *and*
#   columns sum to 1, as in Sinkformers) keeps the mean and has `‖P‖₂ = 1`, so
#   `‖C P v‖ ≤ ‖C v‖`.
# * **Energy under plain softmax (not always).** The catalogue's counterexample: values
#   (0, ½, 1) and rows that pick (0, 1, 1) raise the HC energy from ½ to ⅔. Random projections
#   with values independent of the logits (section 2) never did that in our draws, even at
#   c = 8. But in *symmetric* self-attention, `q = k = v = x` (logits `c x_i·x_j/√H`, the setting
#   of Sinkformers), a large scale sends each token towards the extreme token in its own
#   direction, and the spread grows. Below, with `H = 4` features: the HC gain of plain and
#   Sinkhorn-normalised attention, and `δ(P)`, against the logit scale.

# %%
def sinkhorn(P, iters=200):
  for _ in range(iters):
    P = P / P.sum(-2, keepdims=True)
    P = P / P.sum(-1, keepdims=True)
  return P


wide = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
H_SYM = 4
x_sym = np.random.default_rng(4).normal(size=(DRAWS, S, H_SYM))
osc = lambda a: a.max(-2) - a.min(-2)  # noqa: E731
gain_plain, gain_sink, delta_med, osc_ok, sink_ok = [], [], [], True, True
for c in wide:
  q = jnp.asarray(np.sqrt(c) * x_sym / H_SYM ** 0.25)
  P = np.asarray(attention_matrices(q, q))
  D = sinkhorn(P, iters=500)
  col_err = np.abs(D.sum(-2) - 1).max()
  gain_plain.append(hc_gain(P, x_sym))
  gain_sink.append(hc_gain(D, x_sym))
  d = dobrushin(P)
  delta_med.append(np.median(d))
  osc_ok &= bool(np.all(osc(P @ x_sym) <= d[:, None] * osc(x_sym) + 1e-12))
  # ‖D‖₂ ≤ 1 + (column-sum error)·√S for a nearly doubly stochastic D
  sink_ok &= bool(np.all(gain_sink[-1] <= 1 + col_err * np.sqrt(S) + 1e-12))
  print(f"c = {c:5}: plain HC gain median {np.median(gain_plain[-1]):.3f} "
        f"(> 1 in {np.mean(gain_plain[-1] > 1):.0%} of draws); Sinkhorn max "
        f"{gain_sink[-1].max():.4f} (column sums within {col_err:.1e}); median δ(P) {delta_med[-1]:.4f}")
print("range contraction osc(Pv) ≤ δ(P) osc(v) in every draw:", osc_ok)

logits = 20.0 * np.array([[1.0, 0, 0], [0, 0, 1], [0, 0, 1]])
Pc = np.asarray(js.normalizers.softmax(jnp.asarray(logits)))
v3 = np.array([[0.0], [0.5], [1.0]])
print("counterexample: P v =", np.round((Pc @ v3).ravel(), 6), "HC energy",
      f"{np.sum(centre(v3) ** 2):.3f} → {np.sum(centre(Pc @ v3) ** 2):.3f}")

fig, ax = plt.subplots(figsize=(8, 4.2))
ax.semilogx(wide, [np.median(g) for g in gain_plain], "o-", label="plain softmax: median HC gain")
ax.fill_between(wide, [g.min() for g in gain_plain], [g.max() for g in gain_plain], alpha=0.2)
ax.semilogx(wide, [np.median(g) for g in gain_sink], "s--", label="Sinkhorn: median HC gain")
ax.semilogx(wide, delta_med, "^:", label="median Dobrushin δ(P) (range contraction factor)")
ax.axhline(1, color="gray", lw=0.8)
ax.set(xlabel="logit scale c (q = k = v = x, H = 4)", ylabel="‖C P x‖ / ‖C x‖",
       title="Where the low-pass claim needs its assumptions")
ax.legend(fontsize=8)
plt.show()
assert osc_ok and sink_ok, "the two exact statements hold in every draw"
assert np.sum(centre(Pc @ v3) ** 2) > np.sum(centre(v3) ** 2), "plain softmax can raise HC energy"
assert np.median(gain_plain[0]) < 0.5 and np.median(gain_plain[-1]) > 1, (
    "symmetric attention smooths at small scale and spreads the tokens at large scale")

# %% [markdown]
# ## What the runs show
#
# * **Agrees with the paper** at ordinary logit scales: the DC component passes exactly
#   (`P 1 = 1`), every other eigenvalue is inside the disc of radius `δ(P) < 1`, one layer at the
#   usual 1/√H scale removes most of the non-constant energy of a random signal, and every
#   extra layer removes more (section 2). On positional tokens attention is literally a
#   circulant low-pass filter with a monotone response (section 1).
# * **The assumptions matter.** Sharper attention (larger logit scale) filters less: its rows
#   overlap less and `δ(P)` approaches 1. With values independent of the logits no draw of
#   section 2 raised the non-constant energy, but in symmetric self-attention (`q = k = v = x`)
#   plain softmax *amplifies* it once the scale is large (section 3: the median HC gain passes
#   1 between c = 2 and c = 4), as does the three-token counterexample. The range contraction
#   by `δ(P)` holds in every draw, and so does the energy bound after Sinkhorn normalisation:
#   the low-pass property is exact for doubly stochastic attention, exact in the max-min
#   sense for any softmax attention, and only statistical and scale-dependent in the energy
#   sense for plain softmax attention.
# * Not reproduced: Token Pooling itself (the K-means / K-medoids downsampling of DeiT tokens
#   and its ImageNet cost-accuracy figures).
