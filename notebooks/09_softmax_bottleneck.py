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
# # 09 · The softmax bottleneck (E09)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/09_softmax_bottleneck.ipynb)
#
# A language-model head computes logits `H Wᵀ` from hidden states `H ∈ R^{T×d}` and an output
# embedding `W ∈ R^{V×d}`, so the logit matrix has rank ≤ d. `log_softmax` subtracts one
# constant per row (the log-sum-exp), which adds at most one more dimension:
# **rank(log_softmax(H Wᵀ)) ≤ d + 1** whatever the parameters (Z. Yang, Z. Dai, R. Salakhutdinov &
# W. W. Cohen, "Breaking the Softmax Bottleneck: A High-Rank RNN Language Model", ICLR 2018;
# N. Godey, É. de la Clergerie & B. Sagot, "Why do small language models underperform? Studying LM
# saturation via the softmax bottleneck", 2024). A target whose log-probability matrix has a
# higher rank cannot be fit exactly by a small d: below we show the rank bound numerically, then
# fit a high-rank target with several d and watch the best KL fall as d grows towards that rank.


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

jax.config.update("jax_enable_x64", True)  # exact ranks: float64 singular values
QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
T, V = (48, 64) if QUICK else (256, 512)        # contexts x vocabulary for the rank check
C, STEPS = (32, 250) if QUICK else (128, 1500)  # target rows = vocabulary, Adam steps per d


def numerical_rank(a):
  s = np.linalg.svd(np.asarray(a), compute_uv=False)
  return int(np.sum(s > s[0] * max(a.shape) * np.finfo(np.float64).eps)), s


# %% [markdown]
# ## rank(log_softmax(H Wᵀ)) ≤ d + 1
# Random H and W for each d; the rank of the logits is d, and that of the log-probabilities d + 1
# (the row log-sum-exp is not in the span of the logit columns). The cross-entropy of
# `js.losses` reads its values off the same matrix.

# %%
key = jax.random.key(0)
dims = [1, 2, 4, 8, 16, 32] if QUICK else [1, 2, 4, 8, 16, 32, 64, 128, 192]
ranks_logits, ranks_logp, spectra = [], [], {}
for d in dims:
  kh, kw, key = jax.random.split(key, 3)
  h = jax.random.normal(kh, (T, d), jnp.float64)
  w = jax.random.normal(kw, (V, d), jnp.float64)
  logits = h @ w.T
  logp = jax.nn.log_softmax(logits, axis=-1)
  np.testing.assert_allclose(js.losses.softmax_cross_entropy_with_integer_labels(
      logits, jnp.zeros(T, int)), -logp[:, 0], rtol=1e-10)
  r_z, _ = numerical_rank(logits)
  r_p, s = numerical_rank(logp)
  ranks_logits.append(r_z)
  ranks_logp.append(r_p)
  spectra[d] = s
  assert r_z <= d and r_p <= d + 1, (d, r_z, r_p)
print("d:                    ", dims)
print("rank(H Wᵀ):           ", ranks_logits)
print("rank(log_softmax):    ", ranks_logp)

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
ax0.plot(dims, ranks_logits, "o-", label="rank(H Wᵀ)")
ax0.plot(dims, ranks_logp, "s--", label="rank(log_softmax(H Wᵀ))")
ax0.plot(dims, np.asarray(dims) + 1, "k:", label="d + 1")
ax0.set(xlabel="hidden size d", ylabel="numerical rank", title=f"T = {T} contexts, V = {V} words")
ax0.legend()
for d in dims[1::2]:
  s = spectra[d]
  ax1.semilogy(np.arange(1, len(s) + 1), s / s[0], label=f"d = {d}")
ax1.set(xlabel="index k", ylabel="σ_k / σ_1", ylim=(1e-18, 2),
        title="singular values of log_softmax(H Wᵀ): a cliff after k = d + 1")
ax1.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Fitting a high-rank target
# Target rows `P*` drawn from Dirichlet(0.1) over a vocabulary of C words (C contexts): the matrix
# `log P*` has full rank. For each d, fit `softmax(H Wᵀ)` by Adam (cross-entropy against the soft
# targets, `js.losses.softmax_cross_entropy`) and report the final KL(P* ‖ P̂). It falls
# monotonically in d: a hidden size well below the rank of `log P*` leaves a large KL however
# long we train (its curve flattens early), and the fit becomes close to exact only once d is of
# the order of that rank.

# %%
p_star = jax.random.dirichlet(jax.random.key(1), jnp.full((C,), 0.1), (C,))
p_star = jnp.clip(p_star, 1e-12)
p_star = p_star / p_star.sum(-1, keepdims=True)
entropy = float(-jnp.mean(jnp.sum(p_star * jnp.log(p_star), -1)))
r_target, _ = numerical_rank(jnp.log(p_star))
print(f"rank(log P*) = {r_target} of {C}; mean entropy {entropy:.3f} nats")


def fit(d, seed=0):
  kh, kw = jax.random.split(jax.random.key(seed))
  params = {"h": 0.3 * jax.random.normal(kh, (C, d), jnp.float64),
            "w": 0.3 * jax.random.normal(kw, (C, d), jnp.float64)}
  tx = optax.adam(optax.cosine_decay_schedule(0.05, STEPS))

  def loss(p):
    return jnp.mean(js.losses.softmax_cross_entropy(p["h"] @ p["w"].T, p_star))

  def step(carry, _):
    p, s = carry
    v, g = jax.value_and_grad(loss)(p)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), v

  (p, _), curve = jax.lax.scan(step, (params, tx.init(params)), None, length=STEPS)
  return float(loss(p)) - entropy, np.asarray(curve) - entropy  # CE - H(P*) = KL


fit_dims = [1, 4, 16, 32] if QUICK else [1, 2, 4, 8, 16, 32, 64, 96, 128]
results = {d: fit(d) for d in fit_dims}
kls = [results[d][0] for d in fit_dims]
for d, kl in zip(fit_dims, kls, strict=True):
  print(f"d = {d:4d}: KL(P* || P̂) = {kl:.4f}")

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
ax0.semilogy(fit_dims, np.maximum(kls, 1e-6), "o-")
ax0.axvline(C, color="k", ls=":", label=f"full rank ({C})")
ax0.set(xlabel="hidden size d", ylabel="final KL(P* ‖ P̂)  [nats]",
        title="the bottleneck: small d cannot fit a high-rank target")
ax0.legend()
for d in fit_dims:
  ax1.semilogy(np.maximum(results[d][1], 1e-6), label=f"d = {d}")
ax1.set(xlabel="Adam step", ylabel="KL", title="training curves")
ax1.legend(fontsize=7, ncol=2)
plt.tight_layout()
plt.show()
assert all(a >= b - 1e-3 for a, b in zip(kls, kls[1:], strict=False)), "KL falls with d"
assert kls[0] > 10 * max(kls[-1], 1e-3), "a rank-1 head is far worse than a full-rank one"
