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
# # 21 · A prefix cannot change relative attention under softmax; sigmoid, softmax₁ and sinks (E11)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/21_prefix_attention.ipynb)
#
# A. Petrov, P. H. S. Torr & A. Bibi ("When Do Prompting and Prefix-Tuning Work? A Theory of
# Capabilities and Limitations", ICLR 2024) show that context-based fine-tuning (prompting,
# soft prompts, prefix-tuning) "cannot change the relative attention pattern over the content
# and can only bias the outputs of an attention layer in a fixed direction". With one prefix
# token (key `k_s`, value `v_s = W_V s`) and a query `q_i`, softmax attention over
# [prefix, content] gives
#
# $$\alpha_i = \frac{e^{q_i\cdot k_s}}{e^{q_i\cdot k_s} + \sum_j e^{q_i\cdot k_j}},\qquad
# A'_{ij} = (1-\alpha_i)\,A_{ij},\qquad t'_i = (1-\alpha_i)\,t_i + \alpha_i\, W_V s ,$$
#
# with `A` and `t` the attention weights and output without the prefix. Claims checked here:
#
# 1. the ratios `A'_ij / A'_ik` equal `A_ij / A_ik`: the relative attention over the content
#    does not move, whatever the prefix;
# 2. the output moves only along `W_V s` (one prefix), or inside the convex hull of the prefix
#    values (several prefixes);
# 3. by contrast, a low-rank update of W_Q (LoRA) does change the relative attention.
#
# And what other normalizers change (the library's `normalizer=` of
# `js.attention.dot_product_attention`): softmax₁ and a (learned) sink are softmax with one
# extra prefix whose value is 0, so the theorem covers them and they can only *shrink* the
# output; sigmoid attention has no normalisation, so a prefix with a fixed bias leaves every
# content weight unchanged but adds its value without any attenuation, while the recommended
# bias −log n (n counting the prefix) moves the relative attention; sparsemax's threshold moves
# with the prefix, so the relative attention changes and keys can leave the support.

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
D_MODEL, H = 16, 8                           # model width, head dimension
N = 12                                       # content tokens (all of them also query)
PREFIXES = 16 if QUICK else 256              # random prefixes (a stand-in for prefix-tuning)
rng = np.random.default_rng(0)
W_Q, W_K, W_V = (rng.standard_normal((D_MODEL, H)) / np.sqrt(D_MODEL) * 2 for _ in range(3))
X = rng.standard_normal((N, D_MODEL))        # the content


def attend(x_q, x_kv, w_q, normalizer_params=None, bias=None, mask=None, *, normalizer="softmax"):
  """(weights [B, T, S], outputs [B, T, H]) of one head for a batch of (query, key/value)
  inputs [B, T or S, D_MODEL] and query maps [B, D_MODEL, H]; one-hot values give the weights."""
  q, k, v = jnp.einsum("btd,bdh->bth", x_q, w_q), x_kv @ W_K, x_kv @ W_V
  B, S = x_kv.shape[:2]
  values = jnp.concatenate([jnp.broadcast_to(jnp.eye(S), (B, S, S)), v], axis=-1)
  out = js.attention.dot_product_attention(q[:, :, None], k[:, :, None], values[:, :, None],
                                           bias, mask, normalizer=normalizer,
                                           normalizer_params=normalizer_params)[:, :, 0]
  return out[..., :S], out[..., S:]


W_K, W_V = jnp.asarray(W_K, jnp.float32), jnp.asarray(W_V, jnp.float32)
attend = jax.jit(attend, static_argnames="normalizer")


def relative(w):
  """The relative attention over the content: each row renormalised to sum to 1 (NaN for a
  row whose content has no weight left)."""
  w = np.asarray(w, np.float64)
  total = w.sum(-1, keepdims=True)
  return np.where(total > 0, w, np.nan) / np.where(total > 0, total, 1.0)


def with_prefix(normalizer, prefix, params=None, w_q=W_Q, mask=None):
  """Content weights, prefix weights and outputs with `prefix` [(B,) m, D_MODEL] prepended
  (`mask` [B, m]: which prefix tokens are real)."""
  prefix = np.asarray(prefix)
  batched = prefix.ndim == 3
  prefix = prefix if batched else prefix[None]
  B, m = prefix.shape[:2]
  x_kv = np.concatenate([prefix, np.broadcast_to(X, (B, N, D_MODEL))], axis=1)
  w_q = np.broadcast_to(w_q, (B, D_MODEL, H))
  if mask is not None:
    mask = jnp.asarray(np.concatenate([mask, np.ones((B, N), bool)], 1))[:, None, None, :]
  w, out = attend(jnp.asarray(np.broadcast_to(X, (B, N, D_MODEL)), jnp.float32),
                  jnp.asarray(x_kv, jnp.float32), jnp.asarray(w_q, jnp.float32), params,
                  None, mask, normalizer=normalizer)
  w, out = np.asarray(w, np.float64), np.asarray(out, np.float64)
  res = (w[..., m:], w[..., :m], out)
  return res if batched else tuple(r[0] for r in res)


def without_prefix(normalizer, params=None, w_q=W_Q):
  """Weights and outputs over the content alone (w_q [D_MODEL, H] or a batch [B, D_MODEL, H])."""
  w_q = np.asarray(w_q)
  batched = w_q.ndim == 3
  w_q = w_q if batched else w_q[None]
  B = w_q.shape[0]
  xs = jnp.asarray(np.broadcast_to(X, (B, N, D_MODEL)), jnp.float32)
  w, out = attend(xs, xs, jnp.asarray(w_q, jnp.float32), params, normalizer=normalizer)
  w, out = np.asarray(w, np.float64), np.asarray(out, np.float64)
  return (w, out) if batched else (w[0], out[0])


# %% [markdown]
# ## Softmax: the ratios stay, the output moves along W_V s
# One random prefix token s (three times the content's scale, so it takes a visible share):
# the content weights against `(1 − α_i) A_ij`, and the shift `t'_i − (1 − α_i) t_i` against
# `α_i W_V s` (α_i is the prefix's weight in row i).

# %%
A, t = without_prefix("softmax")
s = 3 * rng.standard_normal((1, D_MODEL))
A_p, alpha, t_p = with_prefix("softmax", s)
alpha = alpha[:, 0]
v_s = (s @ W_V)[0]
ratio_err = np.max(np.abs(A_p - (1 - alpha)[:, None] * A))
shift = t_p - (1 - alpha)[:, None] * t
shift_err = np.max(np.abs(shift - alpha[:, None] * v_s))
print(f"prefix weight α_i per query: {np.round(alpha, 3)}")
print(f"max |A' − (1 − α)A| = {ratio_err:.1e};  max |t' − (1 − α)t − α W_V s| = {shift_err:.1e}"
      f"  (float32; outputs up to {np.abs(t_p).max():.1f})")
print(f"max relative change of the ratios A'_ij/A'_ik: "
      f"{np.max(np.abs(relative(A_p) / relative(A) - 1)):.1e}")

# %% [markdown]
# ## Several prefixes: the shift stays in the convex hull of the prefix values
# With m = 4 prefix tokens, `t'_i = (1 − α_i) t_i + α_i Σ_s β_is W_V s` with β_i the softmax over
# the prefix logits alone: the shift divided by α_i is a convex combination of the four prefix
# values (weights ≥ 0, summing to 1), whatever the query.

# %%
P = 3 * rng.standard_normal((4, D_MODEL))
A_p4, w_pre, t_p4 = with_prefix("softmax", P)
alpha4 = w_pre.sum(-1)
beta = w_pre / alpha4[:, None]
hull_err = np.max(np.abs(t_p4 - (1 - alpha4)[:, None] * t - (w_pre @ (P @ W_V))))
print(f"α_i = {np.round(alpha4, 3)}")
print(f"β rows ≥ 0: {bool(np.all(beta >= 0))}, sum to 1 within {np.max(np.abs(beta.sum(-1) - 1)):.0e};"
      f" max |t' − (1 − α)t − Σ_s w_is W_V s| = {hull_err:.1e}")
print(f"relative attention over the content: max change {np.max(np.abs(relative(A_p4) - relative(A))):.1e}")

# %% [markdown]
# ## A prefix search against a LoRA update, under four normalizers
# PREFIXES random prefixes of 1 to 8 tokens (random search stands in for prefix-tuning: the
# theorem holds for every prefix, so it holds for the tuned one); for each, the largest change
# of the relative attention over the content, `max_ij |Â'_ij − Â_ij|` (rows renormalised to sum
# to 1). The contrast is a rank-1 update of W_Q of the same size as the prefix's effect
# (W_Q + 0.3·u vᵀ, random unit u, v). For sigmoid the library's default bias is −log n, with n
# the number of visible keys, prefix included; "sigmoid, b = −2" fixes the bias.

# %%
NORMALIZERS = {"softmax": None, "softmax_1": None, "softmax_sink": {"sink_logit": 1.0},
               "sigmoid (b = −log n)": None, "sigmoid, b = −2": {"bias": -2.0},
               "sparsemax": None}
base_name = lambda name: name.split(" ")[0].rstrip(",")
lengths = rng.integers(1, 9, PREFIXES)
prefixes = rng.uniform(0.5, 2.5, (PREFIXES, 1, 1)) * rng.standard_normal((PREFIXES, 8, D_MODEL))
real = np.arange(8)[None] < lengths[:, None]                 # padded to 8 tokens, masked
u = rng.standard_normal((PREFIXES, D_MODEL))
v = rng.standard_normal((PREFIXES, H))
w_lora = W_Q + 0.3 * np.einsum("bi,bj->bij", u / np.linalg.norm(u, axis=-1, keepdims=True),
                               v / np.linalg.norm(v, axis=-1, keepdims=True))
moves, lora_moves, emptied = {}, {}, {}
max_move = lambda a, b: np.nanmax(np.abs(a - b), axis=(-2, -1))   # per prefix
for name, params in NORMALIZERS.items():
  A0, _ = without_prefix(base_name(name), params)
  Ap, _, _ = with_prefix(base_name(name), prefixes, params, mask=real)
  rel = relative(Ap)
  emptied[name] = int(np.sum(np.isnan(rel[..., 0])))         # rows the prefix took entirely
  rel = np.where(np.isnan(rel), relative(A0)[None], rel)     # those rows are not counted
  moves[name] = max_move(rel, relative(A0)[None])
  A_lora, _ = without_prefix(base_name(name), params, w_q=w_lora)
  lora_moves[name] = max_move(relative(A_lora), relative(A0)[None])
  if name == "sparsemax":
    support_lost = int(np.sum(np.any((A0[None] > 0) & (Ap == 0), axis=(-2, -1))))
for name in NORMALIZERS:
  print(f"{name:22s}: a prefix moves the relative attention by at most "
        f"{np.max(moves[name]):.1e} (median {np.median(moves[name]):.1e}; by > 1e-3 under "
        f"{np.mean(moves[name] > 1e-3):.0%} of the prefixes); "
        f"a rank-1 W_Q update by {np.median(lora_moves[name]):.1e} (median)")
print(f"sparsemax: a content key left the support under {support_lost} of {PREFIXES} prefixes; "
      f"in {emptied['sparsemax']} of {PREFIXES * N} rows the prefix took all the weight")
fig, ax = plt.subplots(figsize=(8, 3.8))
names = list(NORMALIZERS)
ax.boxplot([np.maximum(moves[n], 1e-9) for n in names], positions=np.arange(len(names)) - 0.18,
           widths=0.3, patch_artist=True, boxprops={"facecolor": "C0"})
ax.boxplot([np.maximum(lora_moves[n], 1e-9) for n in names], positions=np.arange(len(names)) + 0.18,
           widths=0.3, patch_artist=True, boxprops={"facecolor": "C1"})
ax.set_yscale("log")
ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
ax.set(ylabel="max change of the relative attention", title="blue: a prefix; orange: rank-1 W_Q")
ax.axhline(1e-6, color="k", ls=":", lw=0.8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Sinks and softmax₁ are prefixes with a zero value
# `softmax_sink` with sink logit b is softmax over [a prefix whose logit is b for every query
# (a zero key plus a bias b) and whose value is 0, then the content]; softmax₁ is b = 0. So the
# theorem covers them: the relative attention is softmax's, and the output is softmax's output
# times `(1 − α_i)`, a shrink towards 0 with no direction. A learned prefix on top of softmax₁
# still obeys `t' = (1 − α) t + α W_V s`.

# %%
A_soft, t_soft = without_prefix("softmax")
zero_prefix = np.zeros((1, D_MODEL))
for name, b in (("softmax_1", 0.0), ("softmax_sink", 1.0)):
  A_n, t_n = without_prefix(name, None if name == "softmax_1" else {"sink_logit": b})
  bias = jnp.asarray(np.concatenate([[b], np.zeros(N)]), jnp.float32)[None, None, None]
  w_z, out_z = attend(jnp.asarray(X[None], jnp.float32),
                      jnp.asarray(np.concatenate([zero_prefix, X])[None], jnp.float32),
                      jnp.asarray(W_Q[None], jnp.float32), None, bias, normalizer="softmax")
  # the zero prefix's value is W_V·0 = 0: its output is the sink attention's
  sink_gap = max(np.max(np.abs(np.asarray(w_z)[0, :, 1:] - A_n)),
                 np.max(np.abs(np.asarray(out_z)[0] - t_n)))
  keep = A_n.sum(-1)                                     # 1 − α_i
  scale_gap = np.max(np.abs(t_n - keep[:, None] * t_soft))
  print(f"{name:12s}: max |attention − softmax over [zero-value prefix, content]| = {sink_gap:.1e};"
        f" max |t − (1 − α) t_softmax| = {scale_gap:.1e}; 1 − α from {keep.min():.2f} to "
        f"{keep.max():.2f}")
A1, t1 = without_prefix("softmax_1")
A1p, a1, t1p = with_prefix("softmax_1", s)
c = A1p.sum(-1) / A1.sum(-1)                             # the common factor on content weights
one_err = np.max(np.abs(t1p - c[:, None] * t1 - a1 * v_s))
print(f"softmax_1 + a prefix: content weights scaled by one factor per row (ratios move by "
      f"{np.max(np.abs(relative(A1p) - relative(A1))):.1e}); max |t' − c t − w_s W_V s| = "
      f"{one_err:.1e}")

# %% [markdown]
# ## Sigmoid: no normalisation, so no attenuation
# With a fixed bias b the prefix leaves every content weight exactly as it was and adds
# `σ(q_i·k_s + b) W_V s`: the output still moves only along W_V s, but nothing is taken from
# the content (`t' = t + w_s W_V s`). With the default bias −log n the prefix changes n for every
# key of the row: all content weights drop, by different factors, and the relative attention
# moves (previous section).

# %%
As, ts = without_prefix("sigmoid", {"bias": -2.0})
Asp, ws, tsp = with_prefix("sigmoid", s, {"bias": -2.0})
sig_weights = np.max(np.abs(Asp - As))
sig_shift = np.max(np.abs(tsp - ts - ws * v_s))
print(f"sigmoid, b = −2: max |A' − A| = {sig_weights:.1e}; max |t' − t − w_s W_V s| = {sig_shift:.1e}")
Asn, _ = without_prefix("sigmoid")
Aspn, _, _ = with_prefix("sigmoid", s)
factor = Aspn / Asn
print(f"sigmoid, b = −log n: each content weight is multiplied by a factor between "
      f"{factor.min():.3f} and {factor.max():.3f} (not one factor per row)")

# %%
assert ratio_err < 1e-6 and shift_err < 1e-5, "softmax: A' = (1 − α)A, t' = (1 − α)t + α W_V s"
assert np.all(beta >= 0) and hull_err < 1e-5, "several prefixes: the convex hull"
for name in ("softmax", "softmax_1", "softmax_sink", "sigmoid, b = −2"):
  assert np.max(moves[name]) < 1e-5, f"{name}: a prefix does not move the relative attention"
for name in ("sigmoid (b = −log n)", "sparsemax"):
  assert np.mean(moves[name] > 1e-3) > 0.25, f"{name}: a prefix moves the relative attention"
for name in NORMALIZERS:
  assert np.median(lora_moves[name]) > 1e-3, f"{name}: a LoRA update moves it"
assert one_err < 1e-5 and sig_weights < 1e-6 and sig_shift < 1e-5
print("a prefix cannot move softmax's (or softmax₁'s, a sink's, fixed-bias sigmoid's) relative "
      "attention; it can under sparsemax and length-biased sigmoid; LoRA on W_Q can always")

# %% [markdown]
# ## What the run shows
#
# | the paper's claim | this run (full size) |
# |---|---|
# | A'_ij = (1 − α_i) A_ij: ratios over the content unchanged | one prefix: max \|A' − (1 − α)A\| = 1.2e-07 (float32), the ratios move by 1e-07 relative; 256 random prefixes of 1 to 8 tokens move the relative attention over the content by at most 2.5e-07 (rounding) |
# | t' = (1 − α)t + α W_V s: a shift along a fixed direction | to 1.2e-06 on outputs up to 5.2 |
# | several prefixes: the shift lies in the convex hull of the prefix values | four prefixes: β ≥ 0, summing to 1, and the decomposition holds to 1.9e-06 |
# | a LoRA update of W_Q does change the ratios | a rank-1 update of norm 0.3 moves softmax's relative attention by 0.084 (median over 256) |
# | (softmax₁, sinks) | both equal softmax over [a zero-value prefix, content] (4.8e-07, 9.5e-07): the theorem covers them, a prefix cannot move their relative attention (2.4e-07), and they only shrink the output, t = (1 − α)·t_softmax, towards 0 with no direction; a prefix on top of softmax₁ obeys t' = c·t + w_s W_V s (9.5e-07) |
# | (sigmoid) | with a fixed bias (b = −2) a prefix leaves every content weight bit-identical and adds w_s W_V s with no attenuation of t. With the library's default bias −log n, n counts the prefix: each content weight drops by its own factor (0.923 to 1.000 for one prefix) and the relative attention moves by 0.054 (median; 0.081 max), more than the LoRA update (0.042): a length-dependent bias gives prefixes a lever that softmax does not |
# | (sparsemax) | the threshold moves with the prefix: the relative attention moves by up to 0.41 (by more than 1e-3 under 36% of the prefixes; the others stay out of the support or take whole rows), a content key leaves the support under 203 of 256 prefixes, and in 807 of 3072 rows the prefix takes all the weight. The theorem is specific to the exponential |
