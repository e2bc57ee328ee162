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
# # 18 · Pooling against the signal-to-noise ratio (E19)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/18_pooling_snr.ipynb)
#
# Brothers ("Robust Noise Attenuation via Adaptive Pooling of Transformer Outputs", 2025) frames
# pooling a set of vectors as vector quantisation: when only a subset carries the signal and the
# rest are distractors, the signal-optimal pool is the centroid C* of the signal vectors
# (`js.pooling.signal_optimal_pool`), the minimiser of the signal loss
# L(z) = (1/k) Σ_S ‖x_i − z‖² = L(C*) + ‖z − C*‖² (`js.pooling.signal_loss`). The paper claims:
#
# 1. AvgPool, MaxPool and ClsToken "are vulnerable to performance collapse as the
#    signal-to-noise ratio (SNR) of inputs fluctuates";
# 2. attention pooling with one query, z = softmax(q Kᵀ/√d) V (`js.pooling.adaptive_attention_pool`,
#    the layer `js.nn.AdaptiveAttentionPool`), "can approximate the signal-optimal vector
#    quantizer within derived error bounds for any SNR".
#
# The run (catalogue 004#30, a reconstruction [R]): sets of N = 64 vectors in R¹⁶; k of them are
# signal ~ N(μ_s, σ²I), the rest distractors ~ N(μ_n, σ²I); SNR = k/N from 1/64 to 1. Each
# pool z is scored by its excess signal loss ‖z − C*‖² against the signal centroid of its own
# set, averaged over sets; the plots show its root (RMS ‖z − C*‖). AvgPool has the closed-form
# bias (1 − SNR)·‖μ_s − μ_n‖, so E‖z − C*‖² = (1 − SNR)²‖μ_s − μ_n‖² + dσ²(1/k − 1/N) (the
# second term: the sampling noise of the two means); MaxPool (per coordinate) has no closed form; attention pooling is run with the oracle query q ∝ μ_s − μ_n
# (`js.pooling.snr_oracle_query`), with sparsemax in the same slot, and with a query learned by
# Adam on sets of mixed SNR. ClsToken needs a trained transformer and is not run here.

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
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
T0 = time.perf_counter()
N, D = 64, 16                      # set size, width
SIGMA = 0.5                        # within-cluster standard deviation
SEP = 4.0                          # ‖μ_s − μ_n‖
BETA = 8.0                         # oracle query norm: margin β·SEP/√D = 8 between the means
K_GRID = np.array([1, 2, 4, 8, 16, 32, 48, 64])   # signal vectors per set: SNR = k/64
SETS = 32 if QUICK else 512        # sets per SNR level (evaluation)
STEPS = 5 if QUICK else 300        # Adam steps for the learned query
POOL = 128 if QUICK else 4096      # training sets, SNR levels of the grid in equal shares
TRAIN_SETS = 64 if QUICK else 128  # sets per Adam step, drawn from the pool

rng = np.random.default_rng(0)
mu_s = rng.standard_normal(D)
mu_n = rng.standard_normal(D)
mu_n = mu_s + SEP * (mu_n - mu_s) / np.linalg.norm(mu_n - mu_s)


def draw(ks, sets, seed):
  """x [len(ks), sets, N, D] float32 and the signal mask [len(ks), sets, N] (the first k tokens
  are signal: no permutation-invariant pool can tell). numpy draws: no random-number program
  to compile."""
  r = np.random.default_rng(seed)
  sig = np.arange(N)[None, None, :] < np.asarray(ks)[:, None, None]
  sig = np.broadcast_to(sig, (len(ks), sets, N))
  mean = np.where(sig[..., None], mu_s, mu_n)
  return (mean + SIGMA * r.standard_normal(mean.shape)).astype(np.float32), sig


@jax.jit
def errors(x, sig, q_learned):
  """‖z − C*‖ of every pool ({method: [L, sets]}) and the error bound of the oracle pool."""
  cen = js.pooling.signal_optimal_pool(x, sig)
  q = js.pooling.snr_oracle_query(jnp.asarray(mu_s, jnp.float32), jnp.asarray(mu_n, jnp.float32),
                                  beta=BETA)
  pools = {
      "AvgPool": jnp.mean(x, -2),
      "MaxPool": jnp.max(x, -2),
      "attention, oracle q": js.pooling.adaptive_attention_pool(x, query=q),
      "sparsemax, oracle q": js.pooling.adaptive_attention_pool(x, query=q, normalizer="sparsemax"),
      "attention, learned q": js.pooling.adaptive_attention_pool(x, query=q_learned),
  }
  err = {name: jnp.linalg.norm(z - cen, axis=-1) for name, z in pools.items()}
  scores = jnp.einsum("...nd,d->...n", x, q) / jnp.sqrt(D)
  return err, js.pooling.adaptive_pool_error_bound(scores, x, sig)


x_eval, sig_eval = draw(K_GRID, SETS, seed=1)
SNR = K_GRID / N

# %% [markdown]
# ## The learned query
# A `js.nn.AdaptiveAttentionPool` (no projections: keys = values = x; the query starts at 0,
# i.e. as AvgPool) trained with Adam to minimise the excess signal loss ‖z − C*‖² on minibatches
# of a pool of training sets drawn at every SNR of the grid (independent of the evaluation sets): the layer sees no label of which vectors are signal,
# only the target centroid.

# %%
layer = js.nn.AdaptiveAttentionPool(D, rngs=nnx.Rngs(0))
graphdef, params = nnx.split(layer, nnx.Param)
opt = optax.adam(0.1)


x_pool, sig_pool = draw(K_GRID, POOL // len(K_GRID), seed=2)     # the training sets
x_pool, sig_pool = x_pool.reshape(POOL, N, D), sig_pool.reshape(POOL, N)
batches = np.random.default_rng(3).integers(0, POOL, (STEPS, TRAIN_SETS))


def loss_fn(p, idx):
  x, sig = jnp.asarray(x_pool)[idx], jnp.asarray(sig_pool)[idx]
  pooled = nnx.merge(graphdef, p)(x)
  cen = js.pooling.signal_optimal_pool(x, sig)
  return jnp.mean(jnp.sum(jnp.square(pooled - cen), -1))     # the excess signal loss


@jax.jit
def train(p, batches):
  def step(carry, idx):
    p, s = carry
    loss, g = jax.value_and_grad(loss_fn)(p, idx)
    upd, s = opt.update(g, s, p)
    return (optax.apply_updates(p, upd), s), loss
  (p, _), losses = jax.lax.scan(step, (p, opt.init(p)), batches)
  return p, losses


params, losses = train(params, batches)
nnx.update(layer, params)
q_learned = layer.query[...]
q_oracle = np.asarray(js.pooling.snr_oracle_query(mu_s, mu_n, beta=BETA))
cos_q = float(q_learned @ q_oracle / (np.linalg.norm(q_learned) * np.linalg.norm(q_oracle)))
print(f"{STEPS} Adam steps: excess signal loss {losses[0]:.3f} -> {losses[-1]:.4f}; "
      f"learned query norm {np.linalg.norm(q_learned):.1f}, cosine with μ_s − μ_n {cos_q:.3f}")

# %% [markdown]
# ## The sweep

# %%
err, bound = errors(x_eval, sig_eval, q_learned)
err = {name: np.asarray(e) for name, e in err.items()}
bound = np.asarray(bound)
mean_err = {name: np.sqrt(np.mean(e ** 2, -1)) for name, e in err.items()}     # RMS over sets
avg_closed = np.sqrt(((1 - SNR) * SEP) ** 2 + D * SIGMA ** 2 * (1 / K_GRID - 1 / N))
print("SNR      " + "".join(f"{s:8.3f}" for s in SNR))
print(f"{'AvgPool closed form':28s}" + "".join(f"{v:8.3f}" for v in avg_closed))
for name, e in mean_err.items():
  print(f"{name:28s}" + "".join(f"{v:8.3f}" for v in e))
print(f"{'oracle: error bound (mean)':28s}" + "".join(f"{v:8.3f}" for v in bound.mean(-1)))
bound_holds = bool(np.all(err["attention, oracle q"] <= bound * (1 + 1e-4) + 1e-5))
print("the bound holds on every set:", bound_holds)

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
for name, e in mean_err.items():
  ax0.plot(SNR, e, "o-", label=name)
ax0.plot(SNR, avg_closed, "k:", label="AvgPool closed form")
ax0.set_xscale("log", base=2)
ax0.set(xlabel="SNR = k / N", ylabel="RMS ‖z − C*‖", title=f"N = {N}, d = {D}, σ = {SIGMA}")
ax0.legend(fontsize=7)
ax1.plot(SNR, bound.mean(-1), "s--", label="its bound (mean over sets)")
ax1.plot(SNR, np.mean(err["attention, oracle q"], -1), "^:", label="error (mean over sets)")
ax1.set_xscale("log", base=2)
ax1.set_yscale("log")
ax1.set(xlabel="SNR = k / N", ylabel="‖z − C*‖", title="softmax pooling within its bound")
ax1.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %%
lo = 0                                             # SNR = 1/64
# the RMS over SETS sets: its square has relative standard error about sqrt(2 / SETS)
np.testing.assert_allclose(mean_err["AvgPool"], avg_closed, rtol=2 / np.sqrt(SETS), atol=1e-3)
assert bound_holds, "the oracle pool stays within its error bound"
att = mean_err["attention, oracle q"]
assert att.max() < 0.25 * SEP, "oracle attention: small error at every SNR"
assert np.all(att < mean_err["MaxPool"]), "oracle attention beats MaxPool at every SNR"
assert np.all(att[:-1] < mean_err["AvgPool"][:-1]), "and AvgPool wherever there are distractors"
assert mean_err["AvgPool"][lo] > 0.9 * SEP, "AvgPool collapses at low SNR"
if not QUICK:
  assert cos_q > 0.9, "the learned query aligns with μ_s − μ_n"
  assert mean_err["attention, learned q"].max() < 0.25 * SEP, "the learned query is robust too"
print(f"done in {time.perf_counter() - T0:.1f} s")

# %% [markdown]
# ## What the run shows
#
# | the paper's claim | this run (full size: 512 sets per SNR, 300 Adam steps) |
# |---|---|
# | AvgPool, MaxPool collapse as the SNR fluctuates | AvgPool is exact only at SNR = 1 and follows its closed form to within 0.5 % everywhere (RMS ‖z − C*‖ 4.42 at SNR = 1/64, 2.02 at ½, 0 at 1): its error is the distractors' share (1 − SNR)·‖μ_s − μ_n‖. MaxPool is far off at every SNR (6.5-7.1 with distractors, still 4.75 with none: the per-coordinate max of 64 noisy vectors sits about 2.4σ above the mean in every coordinate) |
# | attention pooling approximates the signal-optimal quantiser within derived error bounds for any SNR | with the oracle query (‖q‖ = 8) the RMS error stays between 0.24 and 0.80 from SNR = 1/64 to 1 (AvgPool: 4.4 to 0), and every one of the 4096 pools lies within the bound of `adaptive_pool_error_bound` (a reconstruction [R]; the paper's exact statement is not reproduced). A query learned from zero (AvgPool) by 300 Adam steps on sets of mixed SNR turns to μ_s − μ_n (cosine 0.999) with a smaller norm, 6.2, and keeps the error between 0.44 and 0.73 at every SNR |
#
# What the run adds. Attention pooling does not reach C* exactly: a sharp query puts little mass
# on the distractors but tilts the weights towards the signal vectors that score highest (the
# first term of the bound), so its error at SNR = 1 (0.57) is where AvgPool's is 0. The norm of
# the query trades the two: the learned query, blunter than the oracle, loses at SNR = 1/64
# (0.73 against 0.24: more distractor mass) and wins from SNR = 1/32 up. The bound is valid but
# loose (2.8 on average against errors below 0.8): its tilt term uses the worst-case spread of
# the signal scores. Sparsemax in the same slot is a worse quantiser here: it keeps only the
# few top-scoring signal vectors, exact at one signal vector (SNR = 1/64, error 0) and 1.1-1.8
# from SNR = 1/32 up, where softmax averages more of them. ClsToken and the paper's RL and
# vision benchmarks are not run.
