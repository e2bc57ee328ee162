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
# # 05 · Kernels: one result, three ways (E04)
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/jaxsoft/jaxsoft/blob/main/notebooks/05_kernels.ipynb)
#
# jaxsoft computes attention three ways: the dense reference (`implementation="xla"`), the
# blockwise XLA path (`"xla_chunked"`, FlashAttention's online (m, l) recurrence generalised
# by each normalizer's tile rule, with a custom backward that recomputes blocks) and the Pallas
# kernels (`"pallas"`; here in interpret mode on the CPU). They must agree, forward and
# backward, for every normalizer they support; the chunked path must also need memory linear
# in the sequence length where the dense one needs T × S.

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

os.environ.setdefault("JAXSOFT_PALLAS_INTERPRET", "1")  # Pallas kernels in interpret mode on CPU

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import jaxsoft as js

QUICK = os.environ.get("JAXSOFT_NOTEBOOK_QUICK") == "1"
print("sizes:", "small (JAXSOFT_NOTEBOOK_QUICK=1, as CI runs it)" if QUICK else "full")

# %% [markdown]
# ## Agreement, forward and backward
# Causal attention, B = 1, T = S = 200 (not a multiple of any block), 2 heads of dim 64, for
# one normalizer of each kernel class. The bars are the largest absolute difference to the
# dense reference (log scale); float32 round-off is about 1e-6.

# %%
T, N, H = (136 if QUICK else 200), 2, 64
kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(kq, (1, T, N, H))
k = jax.random.normal(kk, (1, T, N, H))
v = jax.random.normal(kv, (1, T, N, H))
cot = jax.random.normal(kg, (1, T, N, H))


def value_and_grads(normalizer, implementation):
  f = lambda q, k, v: js.attention.dot_product_attention(
      q, k, v, is_causal=True, normalizer=normalizer, implementation=implementation)
  out, vjp = jax.vjp(f, q, k, v)
  return (out, *vjp(cot))


names = ["softmax", "softmax_1", "softpick", "stablemax", "sigmoid", "sparsemax"]
if QUICK:  # CI's smoke run: one normalizer of each kernel class (E, P, T)
  names = ["softmax", "sigmoid", "sparsemax"]
impls = ["xla_chunked", "pallas"]
errors = {}
for name in names:
  ref = value_and_grads(name, "xla")
  for impl in impls:
    try:
      got = value_and_grads(name, impl)
    except NotImplementedError as e:  # e.g. the Pallas engine has no class-T kernel yet
      errors[(name, impl)] = None
      print(f"{name} / {impl}: not supported ({str(e).splitlines()[0][:80]})")
      continue
    errors[(name, impl)] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ref, got))

fig, ax = plt.subplots(figsize=(9, 3.5))
xs = np.arange(len(names))
for i, impl in enumerate(impls):
  vals = [errors[(n, impl)] or np.nan for n in names]
  ax.bar(xs + 0.4 * i - 0.2, vals, width=0.4, label=impl)
ax.set_yscale("log")
ax.set_xticks(xs, [f"{n}\n[{js.normalizers.get(n).kernel_class}]" for n in names])
ax.set(ylabel="max |Δ| vs dense (out, dq, dk, dv)", title="every fast path matches the dense reference")
ax.legend()
plt.show()
for key, err in errors.items():
  assert err is None or err < 2e-4, f"{key}: {err}"
print({f"{n}/{i}": (f"{e:.1e}" if e is not None else "n/a") for (n, i), e in errors.items()})

# %% [markdown]
# ## Memory against length
# XLA's own buffer plan for a jitted forward + backward (`compiled.memory_analysis()`), one
# head of dim 64, causal. The dense path holds T × S scores; the chunked one holds a few
# blocks.

# %%
lengths = [256, 512] if QUICK else [256, 512, 1024, 2048, 4096, 8192]


def temp_bytes(implementation, t):
  x = jax.ShapeDtypeStruct((1, t, 1, 64), jnp.float32)
  loss = lambda q, k, v: jnp.sum(js.attention.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


mem = {impl: [temp_bytes(impl, t) / 2**20 for t in lengths] for impl in ["xla", "xla_chunked"]}
fig, ax = plt.subplots(figsize=(7, 3.5))
for impl, ys in mem.items():
  ax.loglog(lengths, ys, "o-", base=2, label=impl)
ax.set(xlabel="T = S", ylabel="temporary buffers (MiB)", title="dense grows as T², chunked as T")
ax.legend()
plt.show()
print({impl: [f"{m:.1f}" for m in ys] for impl, ys in mem.items()})
growth_dense = mem["xla"][-1] / mem["xla"][0]
growth_chunked = mem["xla_chunked"][-1] / max(mem["xla_chunked"][0], 1e-9)
assert growth_chunked < growth_dense, "chunked memory grows more slowly than dense"
