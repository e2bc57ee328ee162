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
# # 20 · The curvature of softmax attention at the isotropic point is the key covariance (E10)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/20_curvature_identity.ipynb)
#
# D. Le, T. Nguyen, C.-D. Nguyen & A. T. Luu ("Don't Read Everything: A Curvature-Conditioned
# Query for Linear Attention", 2026, arXiv 2606.01294) expand the softmax log-partition
# `f(q) = log Σ_{j≤t} exp(q·k_j)` to second order at the isotropic point q = 0 (every key gets the
# same weight 1/t):
#
# $$f(q) \approx \log t + q\cdot\mu_t + \tfrac12\, q^\top C_t\, q,\qquad
# \mu_t = \tfrac1t\textstyle\sum_j k_j,\quad C_t = \tfrac1t\sum_j k_j k_j^\top - \mu_t\mu_t^\top .$$
#
# So **the curvature of softmax attention there is the running key covariance**. CCQ (the
# library's `js.linear.ccq`, feature A35) uses it to contract the linear-attention query along
# the directions where the memory is dense, `q̃ = q − λ C_t q` (the operator is a
# reconstruction [R]: the abstract does not give it), maintained as one more linear-attention
# recurrence. The paper's claims:
#
# 1. the identity: `∇f(0) = μ_t`, `∇²f(0) = C_t` (exact);
# 2. the statistics can be kept recurrently / chunkwise alongside the state;
# 3. the operator contracts the query most along the dominant key directions;
# 4. on GLA and Gated DeltaNet, better perplexity, retrieval and length extrapolation at small
#    extra cost.
#
# This notebook checks 1 to 3 (claim 4 needs trained language models and is not reproduced),
# and shows how far from q = 0 the quadratic model holds.

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

jax.config.update("jax_enable_x64", True)    # the identity is checked in float64
QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
K = 8                                        # key dimension
T = 16 if QUICK else 64                      # sequence length
TRIALS = 4 if QUICK else 32                  # random key sets


def log_partition(q, keys, t):
  """f(q) = log Σ_{j<=t} exp(q·k_j) (keys after position t masked)."""
  return jax.nn.logsumexp(jnp.where(jnp.arange(keys.shape[0]) < t, keys @ q, -jnp.inf))


def moments(keys, t):
  """μ_t and C_t from the first t keys, numpy float64 (the population covariance)."""
  kt = np.asarray(keys[:t], np.float64)
  mu = kt.mean(0)
  return mu, kt.T @ kt / t - np.outer(mu, mu)


# %% [markdown]
# ## The identity, with jax.hessian as the oracle
# For random keys (anisotropic: scales 2, 1.5, …, 0.25 along the axes) and every prefix length
# t, the gradient and Hessian of f at q = 0 from `jax.grad` / `jax.hessian` in float64, against
# μ_t and C_t computed from their definitions. Why it holds: ∇f(q) = Σ_j p_j k_j and
# ∇²f(q) = Σ_j p_j k_j k_jᵀ − (Σ_j p_j k_j)(Σ_j p_j k_j)ᵀ with p = softmax(q·k): the mean and
# covariance of the keys under the attention weights, which are uniform at q = 0.

# %%
AXES = np.linspace(2.0, 0.25, K)
grad_f = jax.jit(jax.vmap(jax.grad(log_partition), in_axes=(None, None, 0)))
hess_f = jax.jit(jax.vmap(jax.hessian(log_partition), in_axes=(None, None, 0)))
rng = np.random.default_rng(0)
worst_grad = worst_hess = 0.0
for _ in range(TRIALS):
  keys = jnp.asarray(rng.standard_normal((T, K)) * AXES)
  ts = jnp.arange(1, T + 1)
  g0, h0 = np.asarray(grad_f(jnp.zeros(K), keys, ts)), np.asarray(hess_f(jnp.zeros(K), keys, ts))
  for t in range(1, T + 1):
    mu, cov = moments(keys, t)
    worst_grad = max(worst_grad, float(np.max(np.abs(g0[t - 1] - mu))))
    worst_hess = max(worst_hess, float(np.max(np.abs(h0[t - 1] - cov))))
print(f"{TRIALS} key sets × t = 1..{T}: max |∇f(0) − μ_t| = {worst_grad:.1e}, "
      f"max |∇²f(0) − C_t| = {worst_hess:.1e} (float64; entries of C_t up to ~4)")

# %% [markdown]
# ## How far the quadratic model holds
# Along a unit direction u, f(s·u) against the model `log t + s u·μ + ½ s² uᵀCu` for the last
# key set and t = T. The error is the third cumulant of the keys' projections, O(s³), until the
# attention stops being nearly uniform (s·‖k‖ ≈ 1) and the model fails: the identity is about
# the isotropic point only. Away from it the Hessian is the covariance under the attention
# weights p(q) (checked below at a random q).

# %%
mu, cov = moments(keys, T)
s_grid = np.geomspace(1e-3, 3, 40)
u_dirs = {"top eigenvector of C": np.linalg.eigh(cov)[1][:, -1],
          "random direction": rng.standard_normal(K)}
model_err = {}
for name, u in u_dirs.items():
  u = u / np.linalg.norm(u)
  exact = np.array([float(log_partition(jnp.asarray(s * u), keys, T)) for s in s_grid])
  model = np.log(T) + s_grid * (u @ mu) + 0.5 * s_grid ** 2 * (u @ cov @ u)
  model_err[name] = np.abs(exact - model)
  slope = np.polyfit(np.log(s_grid[5:15]), np.log(model_err[name][5:15]), 1)[0]
  print(f"{name:22s}: |f − model| at s = 0.01, 0.1, 1: "
        f"{np.interp(0.01, s_grid, model_err[name]):.1e}, "
        f"{np.interp(0.1, s_grid, model_err[name]):.1e}, {np.interp(1, s_grid, model_err[name]):.2f}"
        f"   (log-log slope for small s: {slope:.2f})")
slopes = {n: np.polyfit(np.log(s_grid[5:15]), np.log(e[5:15]), 1)[0] for n, e in model_err.items()}
q_rand = jnp.asarray(rng.standard_normal(K) * 0.7)
p = np.asarray(jax.nn.softmax(keys @ q_rand))
kk = np.asarray(keys, np.float64)
weighted_cov = (kk * p[:, None]).T @ kk - np.outer(p @ kk, p @ kk)
away = float(np.max(np.abs(np.asarray(hess_f(q_rand, keys, jnp.array([T])))[0] - weighted_cov)))
print(f"at a random q: max |∇²f(q) − Cov_p(q)(k)| = {away:.1e}; "
      f"and |∇²f(q) − C_T| = {np.max(np.abs(weighted_cov - cov)):.2f}")
fig, ax = plt.subplots(figsize=(6, 3.6))
for name, err in model_err.items():
  ax.loglog(s_grid, err + 1e-18, label=name)
ax.loglog(s_grid, 0.1 * s_grid ** 3, "k:", label="∝ s³")
ax.set(xlabel="distance s from the isotropic point", ylabel="|f(s u) − quadratic model|",
       title=f"t = {T} keys, d = {K}")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## The running statistics of `js.linear.ccq` are the batch covariance
# With plain linear attention as the backbone (no decay, no delta rule), CCQ's output is
# `o_t = scale · Σ_{j≤t} (q̃_t·k_j) v_j` with `q̃_t = q_t − λ C_t q_t`. The reference below builds
# C_t from the definition (numpy float64, per t) and the output from that formula; the library
# keeps C_t as a linear-attention recurrence over `[k, 1]` in its recurrent and chunked forms.
# With a decay g, the reference weights key j at time t by `exp(g_{j+1} + … + g_t)`.

# %%
def ccq_reference(q, k, v, g, lam, scale):
  """o [T, V] from the definition: decayed mean/covariance per t, then the read."""
  q, k, v, g = (np.asarray(a, np.float64) for a in (q, k, v, g))
  out = np.zeros((q.shape[0], v.shape[1]))
  csum = np.cumsum(g)
  for t in range(q.shape[0]):
    w = np.exp(csum[t] - csum[:t + 1])                 # weight of key j <= t at time t
    n = w.sum()
    mu = w @ k[:t + 1] / n
    cov = (k[:t + 1] * w[:, None]).T @ k[:t + 1] / n - np.outer(mu, mu)
    q_tilde = q[t] - lam * cov @ q[t]
    out[t] = scale * (w * (k[:t + 1] @ q_tilde)) @ v[:t + 1]   # the decayed linear-attention read
  return out


LAM = 0.5
r = np.random.default_rng(3)
q, k, v = (jnp.asarray(r.standard_normal((1, T, 1, K)), jnp.float32) for _ in range(3))
k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)       # unit keys: ‖C_t‖ <= 1
g_none = np.zeros(T)
g_decay = np.log(np.full(T, 0.95))
ccq = jax.jit(js.linear.ccq, static_argnames=("strength", "implementation", "chunk_size", "scale"))
errors = {}
for label, g in (("no decay", None), ("decay 0.95", jnp.asarray(g_decay, jnp.float32)[None, :, None])):
  ref = ccq_reference(q[0, :, 0], k[0, :, 0], v[0, :, 0], g_none if g is None else g_decay, LAM,
                      1.0)
  for impl in ("recurrent", "chunked"):
    o = ccq(q, k, v, g, strength=LAM, scale=1.0, implementation=impl, chunk_size=4)
    errors[(label, impl)] = float(np.max(np.abs(np.asarray(o[0, :, 0], np.float64) - ref)))
    print(f"{label:10s} {impl:9s}: max |ccq − reference| = {errors[(label, impl)]:.1e} "
          f"(outputs up to {np.abs(ref).max():.1f}, float32)")

# %% [markdown]
# ## The contraction: strongest along the dominant key directions
# `q̃ = (I − λC_t) q` scales the component of q along each eigenvector `e_i` of C_t by
# `1 − λ c_i`: with unit keys (eigenvalues in [0, 1]) and λ ≤ 2 it never grows, and it shrinks
# most where the keys vary most. Below, ‖q̃‖/‖q‖ for q along each eigenvector of an anisotropic
# key set (t = T, λ = 0.5, 1, 2), against `|1 − λ c_i|`.

# %%
keys_aniso = rng.standard_normal((T, K)) * AXES
keys_aniso /= np.linalg.norm(keys_aniso, axis=-1, keepdims=True)
_, cov = moments(keys_aniso, T)
c, E = np.linalg.eigh(cov)
shrink = {}
for lam in (0.5, 1.0, 2.0):
  q_tilde = E - lam * cov @ E                            # columns: q = e_i
  shrink[lam] = np.linalg.norm(q_tilde, axis=0)
  np.testing.assert_allclose(shrink[lam], np.abs(1 - lam * c), rtol=1e-10)
  print(f"λ = {lam}: ‖q̃‖/‖q‖ along the eigenvectors (c = {np.round(c, 3)}): "
        f"{np.round(shrink[lam], 3)}")
fig, ax = plt.subplots(figsize=(6, 3.4))
for lam in shrink:
  ax.plot(c, shrink[lam], "o-", label=f"λ = {lam}")
ax.set(xlabel="eigenvalue c_i of C_t (unit keys)", ylabel="‖q̃‖ / ‖q‖ for q = e_i",
       title="the query shrinks where the keys vary most")
ax.legend()
plt.show()

# %%
assert worst_grad < 1e-12 and worst_hess < 1e-12, "∇f(0) = μ_t and ∇²f(0) = C_t"
assert all(2.5 < s_ < 3.5 for s_ in slopes.values()), "the model's error is O(s³)"
assert away < 1e-12, "away from 0 the Hessian is the attention-weighted covariance"
assert max(errors.values()) < 1e-4, "ccq's running statistics are the batch statistics"
assert np.all(np.diff(shrink[1.0]) <= 1e-12), "the largest eigenvalue shrinks q the most"
print("the identity is exact; the quadratic model holds near q = 0 only; ccq's statistics match")

# %% [markdown]
# ## What the run shows
#
# | the paper's claim | this run (full size) |
# |---|---|
# | ∇f(0) = μ_t, ∇²f(0) = C_t | 32 anisotropic key sets, every t = 1..64: jax.grad / jax.hessian in float64 against the definitions agree to 5.6e-16 (gradient) and 3.6e-15 (Hessian; entries up to ~4): exact |
# | (how far the model holds) | the quadratic model's error grows as s³ (fitted slopes 3.00 and 3.03): 6.6e-05 at s = 0.1 along the top eigenvector, 0.13 at s = 1. Away from 0 the Hessian is the covariance under the attention weights (to 7.9e-15), which differs from C_T by up to 4.05 at a random q: the identity is a statement about the isotropic point only |
# | the statistics can be kept recurrently / chunkwise | `js.linear.ccq` (plain linear attention backbone, λ = 0.5) against a reference that builds μ_t, C_t from their definition at every t: 2.4e-06 without decay, 1.9e-06 with decay 0.95 (weighted statistics), recurrent and chunked forms, float32 outputs up to 22 |
# | the operator contracts the query most along dense key directions | q̃ = (I − λC)q scales the component on eigenvector e_i by exactly \|1 − λc_i\| (unit keys, c_i ≤ 0.30): at λ = 2 from 0.99 on the flattest direction to 0.40 on the dominant one |
# | better perplexity, retrieval, extrapolation on GLA / Gated DeltaNet | not reproduced: it needs trained language models |
