"""CPU benchmark of top-k decoding with TokenSelect's Selection Cache (A11) vs full attention.

A decode loop of ``--steps`` single-token queries over a key/value cache of ``--length``
positions (B = 1, ``--heads`` query heads, ``--kv-heads`` key/value heads, head dim
``--dim``); the valid length grows by one position per step (``key_value_seq_lengths``),
and each step's query drifts from the previous one, q_t = rho q_{t-1} + sqrt(1 - rho^2) z_t
(``--rho``), so consecutive queries are similar as in real decoding. Three loops, each one
jitted ``lax.scan`` over the steps:

* ``cached``: ``selection_cache_step`` with threshold ``--threshold`` (reselects when the
  query's cosine similarity to the query of the cached selection falls below it);
* ``recompute``: the same step with threshold 2 (a new top-k selection every step);
* ``full``: ``jax.nn.dot_product_attention`` over all valid keys;
* ``full_einsum``: the same full attention written as two einsums and a masked softmax
  over a head-major [N, S, H] copy of the cache made once before the loop (on CPU faster
  than ``jax.nn``'s path for one query token: the fairer baseline).

The inputs are *topic* data, so that attention is sparse as in trained models: the keys of
every block of 64 positions share one of 32 random directions u (norm ``--signal``) plus
N(0, I) noise, and the query process drifts around one topic's direction.

Check first (in the same process, before any timing): every loop's outputs are finite, the
full loop matches float64 dense attention to 1e-4 (relative to max ||v||), and each top-k
loop's error per step and head is within the kept-mass bound
||o - o_dense|| <= 2 (1 - m_I) max_j ||v_j|| (+1e-4; m_I the dense softmax mass of the keys
used). A loop that fails is reported and no speed is printed for it. Then each loop's
median wall time over ``--reps`` runs, per step, and the ratios.

  python bench/token_select_cpu.py            # S = 16384, 8 heads, k = 256, 64 steps
  python bench/token_select_cpu.py --quick    # a tiny run (used by the tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention import init_selection_cache, selection_cache_step


def make_inputs(a):
  rng = np.random.default_rng(a.seed)
  S, N, K, H = a.length, a.heads, a.kv_heads, a.dim
  topics = rng.normal(size=(32, H))
  topics *= a.signal / np.linalg.norm(topics, axis=-1, keepdims=True)
  z = rng.integers(0, 32, size=-(-S // 64)).repeat(64)[:S]
  k = topics[z][:, None, :] + rng.normal(size=(S, K, H))
  v = rng.normal(size=(S, K, H))
  q = np.empty((a.steps, N, H))
  cur = rng.normal(size=(N, H))
  for t in range(a.steps):
    cur = a.rho * cur + np.sqrt(1 - a.rho ** 2) * rng.normal(size=(N, H))
    q[t] = topics[z[S // 3]] + cur
  lengths = (S - a.steps + 1 + np.arange(a.steps)).astype(np.int32)
  f32 = np.float32
  return q.astype(f32)[:, None], k.astype(f32)[None], v.astype(f32)[None], lengths


def loops(a):
  N, H, k = a.heads, a.dim, a.top_k

  def topk_loop(threshold):
    @jax.jit
    def run(qs, key, value, lengths):
      def step(cache, x):
        q, ln = x
        out, cache, re = selection_cache_step(q[:, None], key, value, cache, top_k=k,
                                              threshold=threshold,
                                              key_value_seq_lengths=ln[None])
        return cache, (out[0, 0], re[0], cache.indices[0])
      return jax.lax.scan(step, init_selection_cache(1, N, H, k), (qs, lengths))[1]
    return run

  @jax.jit
  def full(qs, key, value, lengths):
    def step(c, x):
      q, ln = x
      out = jax.nn.dot_product_attention(q[:, None], key, value, key_value_seq_lengths=ln[None])
      return c, (out[0, 0], jnp.ones((), bool), jnp.zeros((N, k), jnp.int32))
    return jax.lax.scan(step, 0, (qs, lengths))[1]

  @jax.jit
  def full_einsum(qs, key, value, lengths):
    G = N // key.shape[2]
    kk = jnp.repeat(key[0], G, axis=1).transpose(1, 0, 2)  # [N, S, H], once
    vv = jnp.repeat(value[0], G, axis=1).transpose(1, 0, 2)
    pos = jnp.arange(key.shape[1])

    def step(c, x):
      q, ln = x
      logits = jnp.einsum("nh,nsh->ns", q, kk) / np.sqrt(H)
      logits = jnp.where(pos < ln, logits, -jnp.inf)
      out = jnp.einsum("ns,nsh->nh", jax.nn.softmax(logits, axis=-1), vv)
      return c, (out, jnp.ones((), bool), jnp.zeros((N, k), jnp.int32))
    return jax.lax.scan(step, 0, (qs[:, 0], lengths))[1]

  return {"cached": topk_loop(a.threshold), "recompute": topk_loop(2.0), "full": full,
          "full_einsum": full_einsum}


def check(name, result, inputs):
  """(ok, message): finiteness, and the float64 dense comparison or the kept-mass bound."""
  out, re, idx = (np.asarray(r) for r in result)
  q, k, v, lengths = inputs
  if not np.isfinite(out).all():
    return False, "non-finite output"
  N, K = q.shape[2], k.shape[2]
  kr = np.repeat(np.asarray(k[0], np.float64), N // K, axis=1)  # [S, N, H]
  vr = np.repeat(np.asarray(v[0], np.float64), N // K, axis=1)
  vmax = np.linalg.norm(vr, axis=-1).max()
  worst, slack_min = 0.0, np.inf
  for t in range(q.shape[0]):
    ln = lengths[t]
    logits = np.einsum("nh,snh->ns", np.asarray(q[t, 0], np.float64), kr[:ln]) / np.sqrt(
        q.shape[-1])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dense = np.einsum("ns,snh->nh", p, vr[:ln])
    err = np.linalg.norm(out[t] - dense, axis=-1) / vmax
    worst = max(worst, err.max())
    if name.startswith("full"):
      if err.max() > 1e-4:
        return False, f"step {t}: error {err.max():.2e} > 1e-4 of max||v||"
      continue
    mass = np.take_along_axis(p, idx[t], axis=-1).sum(-1)
    bound = 2 * (1 - mass)
    slack_min = min(slack_min, (bound + 1e-4 - err).min())
    if (err > bound + 1e-4).any():
      return False, f"step {t}: error {err.max():.2e} above the kept-mass bound"
  extra = "" if name.startswith("full") else f", reselected {int(re.sum())}/{len(re)} steps"
  return True, f"max ||o - o_dense|| / max||v|| = {worst:.2e}{extra}"


def time_loop(fn, inputs, reps):
  jax.block_until_ready(fn(*inputs))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--length", type=int, default=16384)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--top-k", type=int, default=256)
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--threshold", type=float, default=0.9)
  p.add_argument("--rho", type=float, default=0.98)
  p.add_argument("--signal", type=float, default=8.0)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quick", action="store_true", help="a tiny run (S=256, k=16, 8 steps)")
  a = p.parse_args(argv)
  if a.quick:
    a.length, a.heads, a.kv_heads, a.dim, a.top_k, a.steps, a.reps = 256, 4, 2, 16, 16, 8, 2
  inputs = make_inputs(a)
  fns = loops(a)
  print(f"# TokenSelect decode on {jax.devices()[0].device_kind}: S={a.length}, "
        f"N={a.heads}, K={a.kv_heads}, H={a.dim}, k={a.top_k}, {a.steps} steps, "
        f"threshold={a.threshold}, rho={a.rho}")
  times = {}
  for name, fn in fns.items():
    ok, msg = check(name, fn(*inputs), inputs)
    print(f"{name}: check {'passed' if ok else 'FAILED'} ({msg})")
    if ok:
      times[name] = time_loop(fn, inputs, a.reps)
  print("\n| loop | ms / step |\n|---|---|")
  for name, t in times.items():
    print(f"| {name} | {1e3 * t / a.steps:.3f} |")
  pairs = [(f, d) for f in ("full", "full_einsum") for d in ("cached", "recompute")]
  for num, den in pairs + [("recompute", "cached")]:
    if num in times and den in times:
      print(f"{num} / {den}: {times[num] / times[den]:.2f}x")
  return 0 if len(times) == len(fns) else 1


if __name__ == "__main__":
  sys.exit(main())
