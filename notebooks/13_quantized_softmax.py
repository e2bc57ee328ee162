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
# # 13 · The bias of a quantised softmax, and its correction (E12)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/13_quantized_softmax.ipynb)
#
# An integer attention kernel stores the softmax output `p` with b bits. The uniform quantiser
# `Q(p) = s·clip(round(p/s), 0, 2^b − 1)`, `s = 1/(2^b − 1)`, sends every probability below
# `s/2` to 0, and in a long row most of them are that small: the quantised rows sum to **less
# than 1**, more so the longer the row, and an attention output `Σ_j Q(p_j) v_j` shrinks with
# them. N. P. Pandey, M. Fournarakis, C. Patel & M. Nagel ("Softmax Bias Correction for
# Quantized Generative Models", ICCV Workshops 2023) correct it by adding the mean error
# `β = E[p − Q(p)]`, measured once on calibration data, to every entry (folded into the
# quantiser's offset, so it costs nothing at run time). Below: the row-sum deficit against the
# row length, its effect on a toy attention output, the correction (and stochastic rounding, an
# unbiased baseline), then the error of the uniform, log2 and tan quantisers against the bit
# width, and a table-lookup exp against its error bound (`js.normalizers.quantized_softmax`,
# `softmax_quantization_bias`, `lut_exp`).

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
import math
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")
ROWS = 32 if QUICK else 256                    # attention rows per batch
LENGTHS = [16, 128, 1024] if QUICK else [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
SCALE = 1.0                                    # std of the scores: near-uniform attention
BITS = 8


def scores(seed, n):
  return jnp.asarray(SCALE * np.random.default_rng(seed).standard_normal((ROWS, n)), jnp.float32)


# Compiled once per shape and setting (bits and method are static: they shape the quantiser).
qsoftmax = jax.jit(js.normalizers.quantized_softmax,
                   static_argnames=("bits", "method", "bias_correction"))
calibrate = jax.jit(js.normalizers.softmax_quantization_bias, static_argnames=("bits",))
softmax = jax.jit(js.normalizers.softmax)
sulq = jax.jit(js.normalizers.log2_quantize, static_argnames=("bits", "shift"))
lut_exp = jax.jit(js.normalizers.lut_exp, static_argnames=("table_size", "x_min", "frac_bits"))


# %% [markdown]
# ## The row sums of an 8-bit softmax
# For each length n: β is calibrated on one batch of score rows and applied to another (the
# same distribution, different draws), as a deployed model would. The plain quantised rows lose
# a growing share of their mass; the corrected ones sum to 1 on average; stochastic rounding
# (`key=`) is unbiased too, at the price of noise in every entry.

# %%
plain, corrected, stochastic, betas = [], [], [], []
for i, n in enumerate(LENGTHS):
  x, calib = scores(2 * i, n), scores(2 * i + 1, n)
  beta = calibrate(calib, bits=BITS)
  betas.append(float(beta))
  plain.append(np.asarray(qsoftmax(x, bits=BITS)).sum(-1))
  corrected.append(np.asarray(qsoftmax(x, bits=BITS, bias_correction=True, bias=beta)).sum(-1))
  stochastic.append(np.asarray(qsoftmax(x, bits=BITS, key=jax.random.key(i))).sum(-1))
mean = lambda rows: np.array([float(r.mean()) for r in rows])
for n, a, b, c_, beta in zip(LENGTHS, mean(plain), mean(corrected), mean(stochastic), betas,
                             strict=True):
  print(f"n = {n:5d}: mean row sum  plain {a:.4f}   corrected {b:.4f}   stochastic {c_:.4f}"
        f"   (beta = {beta:.2e})")

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
ax0.semilogx(LENGTHS, mean(plain), "o-", label="round to nearest")
ax0.semilogx(LENGTHS, mean(corrected), "s-", label="+ bias correction β")
ax0.semilogx(LENGTHS, mean(stochastic), "^--", label="stochastic rounding")
ax0.axhline(1.0, color="k", ls=":")
ax0.set(xlabel="row length n", ylabel="mean Σ_j Q(p)_j", ylim=(-0.05, 1.15),
        title=f"{BITS}-bit softmax: the row sums")
ax0.legend()
n_show = LENGTHS[-2]
idx = LENGTHS.index(n_show)
ax1.hist(plain[idx], bins=20, alpha=0.6, label="round to nearest")
ax1.hist(corrected[idx], bins=20, alpha=0.6, label="+ β")
ax1.hist(stochastic[idx], bins=20, alpha=0.6, label="stochastic")
ax1.set(xlabel="Σ_j Q(p)_j", ylabel="rows", title=f"row sums at n = {n_show}")
ax1.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## A toy attention output
# Values `v_j ~ N(1, 1)` (a mean away from 0, as after a non-centred projection): the exact
# output is about 1; the quantised one is scaled by the row sum. The bias (the mean of
# `o_quantised − o_exact` over rows and channels) is what the correction removes; the spread
# that remains is rounding noise, which does not average out of any single row.

# %%
H = 8
bias_plain, bias_corr, bias_stoch, rmse_corr = [], [], [], []
for i, n in enumerate(LENGTHS):
  x = scores(2 * i, n)
  v = 1.0 + np.random.default_rng(100 + i).standard_normal((n, H))
  o = np.asarray(softmax(x), np.float64) @ v
  err = lambda w, o=o, v=v: np.asarray(w, np.float64) @ v - o
  e_p = err(qsoftmax(x, bits=BITS))
  e_c = err(qsoftmax(x, bits=BITS, bias_correction=True, bias=betas[i]))
  e_s = err(qsoftmax(x, bits=BITS, key=jax.random.key(i)))
  bias_plain.append(e_p.mean())
  bias_corr.append(e_c.mean())
  bias_stoch.append(e_s.mean())
  rmse_corr.append(np.sqrt((e_c ** 2).mean()))

fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.semilogx(LENGTHS, bias_plain, "o-", label="round to nearest")
ax.semilogx(LENGTHS, bias_corr, "s-", label="+ bias correction β")
ax.semilogx(LENGTHS, bias_stoch, "^--", label="stochastic rounding")
ax.semilogx(LENGTHS, rmse_corr, "k:", label="RMS error with β (noise)")
ax.axhline(0.0, color="gray", lw=0.8)
ax.set(xlabel="row length n", ylabel="mean(o_quantised − o_exact)",
       title=f"attention output bias, {BITS}-bit softmax, v ~ N(1, 1)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Quantisers against the bit width
# The mean absolute error of `Q(softmax(x))` against the exact softmax, rows of n = 256. The
# log2 quantiser (levels `2^{-k}`) is fine near 0 but has nothing between 1/2 and 1, so more
# bits stop helping; its shifted variant (SULQ, a reconstruction) and the tan quantiser (a
# reconstruction of TanQ: fine steps near 0 and near 1) keep improving, as does the uniform one.

# %%
x = scores(7, 256)
p = np.asarray(softmax(x), np.float64)
bit_range = [2, 4, 8] if QUICK else [2, 3, 4, 5, 6, 8, 10, 12]
curves = {
    "uniform": lambda b: qsoftmax(x, bits=b, method="uniform"),
    "log2": lambda b: qsoftmax(x, bits=b, method="log2"),
    "log2, shift 1e-3 (SULQ)": lambda b: sulq(p, bits=b, shift=1e-3),
    "tan": lambda b: qsoftmax(x, bits=b, method="tan"),
}
errors = {name: [float(np.mean(np.abs(np.asarray(f(b), np.float64) - p))) for b in bit_range]
          for name, f in curves.items()}

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
for name, e in errors.items():
  ax0.semilogy(bit_range, e, "o-", label=name)
ax0.set(xlabel="bits b", ylabel="mean |Q(p) − p|", title="quantiser error, n = 256")
ax0.legend(fontsize=8)

# A table-lookup exp: error against the argument, and its bound e^x (e^{Δ/2} − 1) + 2^{-F-1}.
d = np.linspace(-14.0, 0.0, 2001, dtype=np.float32)
for size, frac in [(32, None), (128, None), (128, 10)]:
  step = 12.0 / (size - 1)
  got = np.asarray(lut_exp(d, table_size=size, x_min=-12.0, frac_bits=frac), np.float64)
  ex = np.exp(np.asarray(d, np.float64))
  bound = np.where(np.asarray(d) >= -12.0 - step / 2,
                   ex * math.expm1(step / 2) + (0 if frac is None else 2.0 ** (-frac - 1)),
                   math.exp(-12.0 - step / 2))
  assert np.all(np.abs(got - ex) <= bound * (1 + 1e-5) + 1e-7), (size, frac)
  label = f"N = {size}" + ("" if frac is None else f", F = {frac}")
  line, = ax1.semilogy(np.asarray(d), np.abs(got - ex) + 1e-12, lw=0.8, label=label)
  ax1.semilogy(np.asarray(d), bound, color=line.get_color(), ls="--", lw=1)
ax1.set(xlabel="x (scores minus the row max)", ylabel="|LUT(x) − e^x|", ylim=(1e-9, 1),
        title="lookup-table exp (dashed: the bound), x_min = −12")
ax1.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %%
deficit = 1.0 - mean(plain)
assert deficit[-1] > deficit[0] and deficit[-1] > 0.2, "the deficit grows with the row length"
assert np.all(np.abs(mean(corrected) - 1.0) < 0.02), "the corrected rows sum to 1 on average"
assert abs(bias_corr[-1]) < abs(bias_plain[-1]) / 10, "the output bias is removed"
assert errors["uniform"][-1] < errors["uniform"][0] / 3 and errors["tan"][-1] < errors["tan"][0] / 10
print("the deficit of the row sums grows with n; the calibrated β removes it and the output bias")
