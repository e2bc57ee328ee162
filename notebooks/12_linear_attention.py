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
# # 12 · Linear attention: Taylor → softmax, and three exact forms (E05)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/12_linear_attention.ipynb)
#
# Linear attention replaces the softmax kernel `exp(q·k)` by a dot product of features
# `φ(q)·φ(k)`, so causal attention becomes a recurrence on a state of fixed size
# (A. Katharopoulos, A. Vyas, N. Pappas & F. Fleuret, "Transformers are RNNs", ICML 2020).
# With the order-m Taylor features of `exp`, the weights are the polynomial
# `P_m(s) = Σ_{i≤m} s^i / i!` of the score `s = q·k / √K`, and as m grows the layer tends to
# softmax attention itself (M. Mongaras & E. C. Larson, 2025, "On the Expressiveness of Softmax
# Attention: A Recurrent Neural Network Perspective"; order 2 is TaylorShift, T. Nauen,
# S. Palacio & A. Dengel, 2024). Every variant of `js.linear` computes the same numbers three
# ways, `implementation="parallel"` (a masked T × T product), `"recurrent"` (a scan over tokens)
# and `"chunked"` (a scan over chunks); the `js.nn` layers add a one-token decoding step.

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
from flax import nnx

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")

# %% [markdown]
# ## The Taylor form converges to softmax attention
# Causal attention over T tokens, 2 heads of dim K = 4, against `js.attention.dot_product_attention`
# (softmax). The state of the order-m form has `1 + K + … + K^m` rows. The remainder of the series
# is about `|s|^(m+1) / (m+1)!`, so queries and keys drawn with a larger spread (larger scores)
# need more terms; an odd order can even make a weight negative (`P_1(s) = 1 + s`), so the
# error need not fall at every step.

# %%
T, N, K = (32 if QUICK else 128), 2, 4
orders = list(range(0, 5 if QUICK else 9))
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
v = jax.random.normal(kv, (1, T, N, K))
taylor = jax.jit(js.linear.taylor_linear_attention, static_argnames=("order",))

fig, ax = plt.subplots(figsize=(7, 3.5))
taylor_errors = {}
for spread in (0.5, 0.75, 1.0):
  q = spread * jax.random.normal(kq, (1, T, N, K))
  k = spread * jax.random.normal(kk, (1, T, N, K))
  exact = js.attention.dot_product_attention(q, k, v, is_causal=True)
  errs = [float(jnp.max(jnp.abs(taylor(q, k, v, order=m) - exact))) for m in orders]
  taylor_errors[spread] = errs
  ax.semilogy(orders, errs, "o-", label=f"q, k ~ {spread} · N(0, 1)")
ax.set(xlabel="Taylor order m", ylabel="max |o_taylor − o_softmax|",
       title="order-m Taylor linear attention → softmax attention")
ax.legend()
plt.show()
for spread, errs in taylor_errors.items():
  print(f"spread {spread}: " + "  ".join(f"m={m}: {e:.1e}" for m, e in zip(orders, errs, strict=True)))
assert taylor_errors[0.5][-1] < taylor_errors[0.5][0] / 100, "small scores: fast convergence"

# %% [markdown]
# ## Recurrent = parallel = chunked
# For several variants, the largest difference between the three forms (forward) relative to the
# largest output, on the same inputs: random unit-scale q, k, v, data-dependent log decays `g ≤ 0`
# and write strengths `β ∈ (0, 1)`, a chunk size that does not divide T. (The unnormalised
# variants' outputs grow with T, hence relative.) float32 round-off: a few 1e-6 at most.

# %%
T2, N2, K2, CHUNK = (40 if QUICK else 200), 2, 8, (16 if QUICK else 48)
keys = jax.random.split(jax.random.key(1), 6)
q2, k2, v2 = (jax.random.normal(keys[i], (2, T2, N2, K2)) for i in range(3))
g_head = -jax.nn.softplus(jax.random.normal(keys[3], (2, T2, N2))) / 4
g_chan = -jax.nn.softplus(jax.random.normal(keys[4], (2, T2, N2, K2))) / 4
beta = jax.nn.sigmoid(jax.random.normal(keys[5], (2, T2, N2)))
kn = js.linear.l2_normalize(k2)

variants = {
    "linear (elu+1)": lambda impl: js.linear.linear_attention(
        q2, k2, v2, feature_map="elu1", implementation=impl, chunk_size=CHUNK),
    "taylor (m=2)": lambda impl: js.linear.taylor_linear_attention(
        q2, k2, v2, order=2, implementation=impl, chunk_size=CHUNK),
    "lightning": lambda impl: js.linear.lightning_attention(
        q2, k2, v2, layer_idx=1, num_layers=4, implementation=impl, chunk_size=CHUNK),
    "simple_gla": lambda impl: js.linear.simple_gla(
        q2, k2, v2, g_head, implementation=impl, chunk_size=CHUNK),
    "gla": lambda impl: js.linear.gla(q2, k2, v2, g_chan, implementation=impl, chunk_size=CHUNK),
    "delta_rule": lambda impl: js.linear.delta_rule(
        q2, kn, v2, beta, implementation=impl, chunk_size=CHUNK),
    "gated_delta_rule": lambda impl: js.linear.gated_delta_rule(
        q2, kn, v2, g_head, beta, implementation=impl, chunk_size=CHUNK),
}
if QUICK:  # CI: three of them (each form is compiled once per variant)
  variants = {n: variants[n] for n in ("linear (elu+1)", "taylor (m=2)", "gated_delta_rule")}
pairs = [("recurrent", "parallel"), ("chunked", "parallel"), ("chunked", "recurrent")]
diffs = {}
for name, fn in variants.items():
  outs = {impl: jax.jit(fn, static_argnums=0)(impl) for impl in ("parallel", "recurrent", "chunked")}
  size = float(jnp.max(jnp.abs(outs["parallel"])))
  diffs[name] = [float(jnp.max(jnp.abs(outs[a] - outs[b]))) / size for a, b in pairs]
  print(f"{name:>17}: " + "  ".join(f"{a} vs {b}: {d:.1e}" for (a, b), d in zip(pairs, diffs[name], strict=True)))

fig, ax = plt.subplots(figsize=(9, 3.5))
xs = np.arange(len(diffs))
for i, (a, b) in enumerate(pairs):
  ax.bar(xs + 0.27 * (i - 1), [max(d[i], 1e-9) for d in diffs.values()], width=0.27,
         label=f"{a} vs {b}")
ax.set_yscale("log")
ax.set_xticks(xs, list(diffs), rotation=20)
ax.set(ylabel="max |Δ| / max |o|", title="three exact forms of each recurrence agree to round-off")
ax.legend()
plt.show()
assert max(max(d) for d in diffs.values()) < 1e-4

# %% [markdown]
# ## Layers: decoding one token at a time
# `js.nn.GatedDeltaNet` (and `GLA`, `SimpleGLA`, `DeltaNet`, `LightningAttention`,
# `LinearAttention`) wrap a recurrence with the projections, short causal convolution, gates and
# SiLU output gate of their papers. `init_state` and `step` carry the convolution window and the
# recurrent state, so generating a token costs the same at any length; fed the sequence token by
# token they reproduce the full forward.

# %%
layer = js.nn.GatedDeltaNet(32, 4, conv_size=4, rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.key(2), (2, 24, 32))
full = nnx.jit(lambda m, x: m(x))(layer, x)
step = nnx.jit(lambda m, x, s: m.step(x, s))
state = layer.init_state(2)
decoded = []
for t in range(x.shape[1]):
  y, state = step(layer, x[:, t], state)
  decoded.append(y)
gap = float(jnp.max(jnp.abs(jnp.stack(decoded, 1) - full)))
print(f"GatedDeltaNet: max |decode − forward| = {gap:.1e};  state shapes:",
      jax.tree.map(lambda a: a.shape, state))
assert gap < 1e-4

# %% [markdown]
# ## Hedgehog: a feature map learned to mimic softmax
# `js.nn.HedgehogFeatureMap` (M. Zhang, K. Bhatia, H. Kumbong & C. Ré, 2024, "The Hedgehog & the
# Porcupine: Expressive Linear Attentions with Softmax Mimicry") is
# `[softmax(xW + b), softmax(−xW − b)]` per head, trained by *attention distillation*: the
# cross-entropy between the rows of causal softmax attention and the linear-attention map the
# features induce. A few hundred Adam steps on one batch of (peaky) queries and keys: the left
# plot is the loss, the right one a row of each attention map before and after.

# %%
T3, STEPS = (32, 60) if QUICK else (64, 400)
q3 = 2.0 * jax.random.normal(jax.random.key(3), (4, T3, N, K))
k3 = 2.0 * jax.random.normal(jax.random.key(4), (4, T3, N, K))
fmap = js.nn.HedgehogFeatureMap(N, K, 16, noise=0.1, rngs=nnx.Rngs(0))
graphdef, params = nnx.split(fmap)
opt = optax.adam(0.03)
opt_state = opt.init(params)


@jax.jit
def train_step(params, opt_state):
  loss, grads = jax.value_and_grad(
      lambda p: nnx.merge(graphdef, p).distillation_loss(q3, k3))(params)
  updates, opt_state = opt.update(grads, opt_state)
  return optax.apply_updates(params, updates), opt_state, loss


before = nnx.merge(graphdef, params).attention_weights(q3, k3)
losses = []
for _ in range(STEPS):
  params, opt_state, loss = train_step(params, opt_state)
  losses.append(float(loss))
after = nnx.merge(graphdef, params).attention_weights(q3, k3)
scores = jnp.einsum("btnk,bsnk->bnts", q3, k3) / np.sqrt(K)
teacher = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T3, T3), bool)), scores, -jnp.inf), -1)

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.5))
ax1.plot(losses)
ax1.set(xlabel="Adam step", ylabel="distillation cross-entropy", title="Hedgehog distillation")
row = T3 - 1
for name, w, style in (("softmax (teacher)", teacher, "k-"), ("Hedgehog, initial", before, ":"),
                       ("Hedgehog, trained", after, "--")):
  ax2.plot(np.asarray(w[0, 0, row]), style, label=name)
ax2.set(xlabel="key position j", ylabel=f"weight of query {row}", title="one attention row")
ax2.legend()
plt.show()
print(f"distillation loss: {losses[0]:.3f} → {losses[-1]:.3f}")
assert losses[-1] < losses[0]
