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
# # 03 · Attention sinks (E03)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/03_attention_sinks.ipynb)
#
# **The papers' claims.** Gu et al. ("When Attention Sink Emerges in Language Models: An
# Empirical View", ICLR 2025, arXiv 2410.10781) trace attention sinks — heads that park most of
# their weight on the first token — to softmax's sum-to-one constraint: a head with nothing to do
# must still put its unit of mass somewhere, and the first token becomes a key bias whose value
# contributes nothing. Replacing softmax by sigmoid attention without normalisation removes the
# sinks in their LMs up to 1B parameters. Miller's softmax₁ (an extra zero logit, "Attention Is
# Off By One", 2023) lets a head attend to nothing; softpick (Zuhri et al. 2025, arXiv
# 2504.20966) reports a 0 % sink rate; gated attention (Qiu et al. 2025, arXiv 2505.06708), an
# output gate σ(X W_θ) after attention, lowers the attention on the first token of their LMs
# from 46.7 % to 4.8 %.
#
# **The task.** Ran-Milo ("Attention Sinks Are Provably Necessary in Softmax Transformers:
# Evidence from Trigger-Conditional Tasks", 2026, arXiv 2603.11487) proves that a trigger-
# conditional task forces a sink on softmax attention and not on ReLU attention: at a trigger
# token the output is the average of the preceding tokens' representations, everywhere else it
# is **zero**. Softmax's output is a convex combination of the values, so to output zero in every
# context it must put its mass on a token whose value is zero (BOS); the other normalizers can
# output zero by putting no mass anywhere, and the gate by closing. We
# train one causal attention layer (one head, learned token and position embeddings, d = 32,
# sequences of 16 with BOS first, a trigger at each later position with probability 0.15, MSE
# loss) with each normalizer, and measure the mean weight on BOS over the idle (non-trigger)
# queries at positions ≥ 4. With Gu et al., a head is a sink when that weight exceeds ε = 0.3.
# Each variant trains from two seeds; the verdict at the end is computed from the runs.
#
# An earlier version of this notebook used a two-layer model on a trigger-*recall* task (predict
# a "nothing yet" token until the trigger, then the token after it). There softmax's sink was
# marginal (peak head weight 0.35) and softmax₁ (0.35) and gated softmax (0.42) were no lower: an
# idle head did not have to output zero, since the MLP can read "nothing yet" from any average.
# The task below isolates the mechanism the papers describe. tests/properties/test_attention_sinks.py
# checks the claims this notebook shows (a small size by default, this size under `-m slow`).

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
VOCAB, BOS, TRIGGER = 16, 16, 17
L, D, P_TRIGGER = 16, 32, 0.15
STEPS = 30 if QUICK else 1000
SEEDS = (0,) if QUICK else (0, 1)
# the representation each token contributes to the average (fixed, random); BOS and the trigger 0
TARGETS = jax.random.normal(jax.random.key(99), (VOCAB + 2, D)).at[BOS].set(0.0).at[TRIGGER].set(0.0)


def make_batch(key, batch=64):
  """Tokens [B, L] (BOS first), targets [B, L, D] and the trigger mask [B, L]."""
  k1, k2 = jax.random.split(key)
  tokens = jax.random.randint(k1, (batch, L), 0, VOCAB)
  trigger = jax.random.bernoulli(k2, P_TRIGGER, (batch, L)).at[:, :3].set(False)
  tokens = jnp.where(trigger, TRIGGER, tokens).at[:, 0].set(BOS)
  c = TARGETS[tokens]
  before = jnp.cumsum(c, 1) - c                        # sum over the tokens s < t (BOS adds 0)
  mean = before / jnp.maximum(jnp.arange(L) - 1.0, 1.0)[None, :, None]   # over 1 <= s < t
  return tokens, jnp.where(trigger[..., None], mean, 0.0), trigger


def init(key):
  keys = jax.random.split(key, 7)
  dense = lambda k: jax.random.normal(k, (D, D)) / jnp.sqrt(D)
  return {"embed": jax.random.normal(keys[0], (VOCAB + 2, D)), "pos": jax.random.normal(keys[1], (L, D)) * 0.5,
          **{name: dense(k) for name, k in zip(("wq", "wk", "wv", "wo", "wg"), keys[2:])}}


def layer_norm(x):
  return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def forward(params, tokens, normalizer, gated):
  """One causal attention layer, one head; returns the output [B, L, D] and the weights [B, L, L]."""
  x = layer_norm(params["embed"][tokens] + params["pos"])
  q, k, v = (x @ params[w] for w in ("wq", "wk", "wv"))
  o = js.attention.dot_product_attention(q[:, :, None], k[:, :, None], v[:, :, None], is_causal=True,
                                         normalizer=normalizer, implementation="xla")   # [B, L, 1, D]
  if gated:  # gated attention (Qiu et al.'s G1): SDPA ⊙ σ(X W_θ), the gate computed from the layer input
    o = js.attention.gated_attention_output(o, x, params["wg"][:, None])
  o = o[:, :, 0]
  # the dense weights, for measuring the sink: the same logits and normalizer
  logits = jnp.einsum("bth,bsh->bts", q, k) / jnp.sqrt(D)
  weights = js.normalizers.get(normalizer).fn(logits, where=jnp.tril(jnp.ones((L, L), bool)))
  return o @ params["wo"], weights


def train(normalizer, gated, seed):
  params = init(jax.random.key(seed))
  opt = optax.adam(3e-3)

  def loss_fn(params, tokens, targets):
    out, _ = forward(params, tokens, normalizer, gated)
    return jnp.mean(jnp.sum((out - targets) ** 2, -1))

  def step(carry, key):
    params, state = carry
    tokens, targets, _ = make_batch(key)
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, state = opt.update(grads, state)
    return (optax.apply_updates(params, updates), state), loss

  keys = jax.random.split(jax.random.key(seed + 1), STEPS)
  (params, _), losses = jax.jit(lambda c, ks: jax.lax.scan(step, c, ks))((params, opt.init(params)), keys)
  return params, np.asarray(losses)


VARIANTS = {"softmax": ("softmax", False), "softmax_1": ("softmax_1", False),
            "sigmoid (b = −log n)": ("sigmoid", False), "ReLU/n": ("relu_n", False),
            "softpick": ("softpick", False), "gated softmax": ("softmax", True)}
if QUICK:  # CI's smoke run: one model per kind of fix (no verdict is drawn in quick mode)
  VARIANTS = {n: VARIANTS[n] for n in ("softmax", "softmax_1", "gated softmax")}
trained = {(name, seed): train(*cfg, seed) for name, cfg in VARIANTS.items() for seed in SEEDS}

# %% [markdown]
# ## The weight on BOS at idle queries
# For each run: the held-out MSE (against 0.75, the MSE of always predicting zero), the mean
# weight on BOS at idle queries and at trigger queries, and the total mass an idle query puts
# anywhere (1 for softmax by construction; the others may put none); for gated softmax also the
# mean gate σ(X W_θ) at idle and at trigger queries.

# %%
tokens, targets, trigger = make_batch(jax.random.key(123), batch=512)
zero_mse = float(jnp.mean(jnp.sum(targets ** 2, -1)))
late = jnp.arange(L)[None] >= 4                       # early queries see few keys
idle, active = ~trigger & late, trigger & late
stats = {}
for (name, seed), (params, _) in trained.items():
  out, w = forward(params, tokens, *VARIANTS[name])
  mean_over = lambda a, m: float(jnp.sum(jnp.where(m, a, 0.0)) / jnp.sum(m))
  stats[name, seed] = {"mse": float(jnp.mean(jnp.sum((out - targets) ** 2, -1))),
                       "bos_idle": mean_over(w[..., 0], idle), "bos_trigger": mean_over(w[..., 0], active),
                       "mass_idle": mean_over(w.sum(-1), idle)}
  if VARIANTS[name][1]:  # the gated model: how far its gate is open at idle and at trigger queries
    x = layer_norm(params["embed"][tokens] + params["pos"])
    gate = jax.nn.sigmoid(x @ params["wg"]).mean(-1)
    stats[name, seed]["gate"] = (mean_over(gate, idle), mean_over(gate, active))
print(f"held-out MSE of predicting zero everywhere: {zero_mse:.3f}")
print(f"{'':<22}{'seed':>5}{'MSE':>8}{'BOS weight, idle':>18}{'BOS weight, trigger':>21}{'total mass, idle':>18}")
for (name, seed), st in stats.items():
  print(f"{name:<22}{seed:>5}{st['mse']:>8.3f}{st['bos_idle']:>18.3f}{st['bos_trigger']:>21.3f}{st['mass_idle']:>18.3f}"
        + (f"   mean gate: idle {st['gate'][0]:.2f}, trigger {st['gate'][1]:.2f}" if "gate" in st else ""))

fig, (a0, a1) = plt.subplots(1, 2, figsize=(13, 3.8))
for (name, seed), (_, losses) in trained.items():
  a0.plot(losses, label=f"{name}, seed {seed}", color=f"C{list(VARIANTS).index(name)}", ls="-" if seed == 0 else ":")
a0.set(yscale="log", xlabel="step", ylabel="train MSE", title="trigger-conditional average")
a0.legend(fontsize=7, ncol=2)
xs = np.arange(len(VARIANTS))
for i, seed in enumerate(SEEDS):
  a1.bar(xs + 0.8 * (i + 0.5) / len(SEEDS) - 0.4, [stats[n, seed]["bos_idle"] for n in VARIANTS],
         width=0.8 / len(SEEDS), label=f"seed {seed}")
a1.axhline(0.3, color="k", ls=":", lw=1)
a1.set_xticks(xs, list(VARIANTS), rotation=20, fontsize=8)
a1.set(ylabel="mean weight on BOS, idle queries", title="dotted: Gu et al.'s sink threshold ε = 0.3")
a1.legend(fontsize=8)
fig.tight_layout()
plt.show()

fig, axes = plt.subplots(1, len(VARIANTS), figsize=(3 * len(VARIANTS), 3))
example = int(jnp.argmax(trigger.sum(-1) == 2))       # a sequence with two triggers
for ax, name in zip(axes, VARIANTS):
  m = np.asarray(forward(trained[name, SEEDS[0]][0], tokens[example:example + 1], *VARIANTS[name])[1][0])
  ax.imshow(m, cmap="magma", vmin=0, vmax=max(m.max(), 1e-6))
  ax.set_title(f"{name}, seed {SEEDS[0]}\ntriggers at {np.flatnonzero(trigger[example]).tolist()}", fontsize=8)
  ax.set_xlabel("key")
  ax.set_ylabel("query")
fig.tight_layout()
plt.show()

EPSILON = 0.3  # Gu et al.'s threshold: a head with more than ε of its weight on BOS is a sink
sink = {n: min(stats[n, s]["bos_idle"] for s in SEEDS) > EPSILON for n in VARIANTS}
no_sink = {n: max(stats[n, s]["bos_idle"] for s in SEEDS) <= EPSILON for n in VARIANTS}
if QUICK:
  print(f"quick mode ({STEPS} steps, as CI runs it): too short for the model to learn the task "
        "or to grow a sink, so no verdict here; the committed notebook shows the full-size run")
elif not sink["softmax"]:
  print("verdict: softmax did not grow a sink in every seed, so there is nothing to remove")
else:
  removed = [n for n in VARIANTS if n != "softmax" and no_sink[n]]
  kept = [n for n in VARIANTS if n != "softmax" and sink[n]]
  mixed = [n for n in VARIANTS if n != "softmax" and not sink[n] and not no_sink[n]]
  print(f"verdict: softmax grows a sink in every seed (BOS weight at idle queries > ε = {EPSILON}); "
        f"no sink in any seed: {', '.join(removed) or 'none'}; a sink in every seed: {', '.join(kept) or 'none'}"
        + (f"; depends on the seed: {', '.join(mixed)}" if mixed else ""))
for key, st in stats.items():
  assert np.isfinite(st["mse"]) and np.isfinite(trained[key][1]).all(), f"{key} trained without NaN"

# %% [markdown]
# **What the committed full-size run shows** (two seeds each, 1000 steps):
# - softmax grows a sink in both seeds (0.82 and 0.94 of an idle query's weight on BOS); in seed
#   0 it parks every query on BOS and does not learn the task (MSE 0.66 against 0.75 for
#   predicting zero), in seed 1 it learns it (0.045) and the trigger queries leave BOS (0.001);
# - softmax₁ and sigmoid learn the task better (MSE ≤ 0.008) with no sink: their idle queries put
#   0.000–0.001 on BOS and 0.006–0.018 mass anywhere, i.e. they attend to nothing, as Miller and
#   Gu et al. describe; ReLU/n has no sink either (0.000, MSE 0.06–0.12);
# - softpick: no sink in seed 0 (0.015), a borderline one in seed 1 (0.326 > ε), and it learns the
#   task worst of the normalizers (MSE 0.33–0.43): at this size the run does not support Zuhri et
#   al.'s 0 % sink rate for every seed;
# - gated softmax learns the task best (MSE 0.001–0.002) but **keeps the sink** in both seeds
#   (0.995, 0.998): its gate does partly close at idle queries (mean 0.32–0.40 against 0.83–0.89 at
#   triggers), yet the model also parks them on BOS. The gate removes the *need* for a sink, not
#   the sink: in this one-layer model both routes to a zero output are learned at once, and
#   nothing makes the sink go away. Qiu et al.'s reduction (46.7 % → 4.8 % on the first token) is
#   measured in LMs of billions of parameters; this run does not reproduce it.
