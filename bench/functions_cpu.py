"""CPU benchmark of the pooling, output-layer and monotonic-attention functions.

The functions that are neither an attention path of ``dot_product_attention`` nor a
normalizer of the registry (which bench/attention_cpu.py, bench/normalizers.py and the zoo
measure), each timed next to the plain operation of the same shape it replaces, in the same
run on the same inputs:

* ``stochastic_softmax_pool`` (N41, STAR's training draw), against its evaluation form
  (``soft_pool``, the softmax-weighted mean);
* ``monotonic_attention`` (A52, the expected alignment, by each ``method``: the associative
  scan, the paper's cumprod form, the key-by-key loop) and ``chunkwise_attention`` (A52,
  MoChA's expectation, chunk 4), against dense softmax ``dot_product_attention``;
* ``adaptive_attention_pool`` (A53, one learned query), against the masked mean (AvgPool);
* ``acol_loss`` (L18, k = 4 softmax nodes per class with the GAR terms), against
  ``optax.softmax_cross_entropy_with_integer_labels`` over the same C·k nodes;
* ``spilled_energy`` and ``marginalized_energy`` (L19, training-free scores: forward only),
  against ``jax.nn.logsumexp`` over the vocabulary.

Every row except L19's is timed as ``jax.jit(jax.value_and_grad(...))`` with respect to its
float inputs (a sum of squares of the output, or the loss itself). Both the row and its
baseline are compiled first, then run in ``--reps`` interleaved rounds (each round runs
each once, so that a machine busy with other work slows them alike): the times are the
medians, "this / baseline" the median of the per-round ratios. Before anything of a row is timed, its output
at a small size is checked against a float64 NumPy oracle written in this file from the
formula (for the training draw: the evaluation form against the oracle and every drawn value
one of its pool's visible entries); a row whose check fails, or whose timed call gives a
value or gradient that is not finite, gets no time, its cell says FAILED, and the script
exits with 1.

Usage::

  python bench/functions_cpu.py            # the default sizes (a few seconds each)
  python bench/functions_cpu.py --quick    # tiny sizes, a smoke test (used by the tests)
  python bench/functions_cpu.py --rows acol_loss,spilled_energy

Columns: ms per call (median), the baseline's ms, this / baseline (the median per-round
ratio), the check's max error (relative to the oracle's largest magnitude, at least 1) and
its limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsoft as js


@dataclasses.dataclass(frozen=True)
class Row:
  """One benchmarked function: inputs at a size, the function, its baseline, its check."""

  name: str
  feature: str
  baseline: str
  inputs: Callable[[dict[str, int], int], tuple[Any, ...]]  # (sizes, seed) -> arrays
  fn: Callable[..., jax.Array]
  base: Callable[..., jax.Array]
  check: Callable[[Callable[..., jax.Array], tuple[Any, ...]], float]  # (fn, args) -> error
  tol: float
  sizes: dict[str, int]
  quick: dict[str, int]
  check_sizes: dict[str, int]
  argnums: tuple[int, ...] = (0,)
  forward_only: bool = False


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape or not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.max(np.abs(got - want), initial=0.0) / max(1.0, np.max(np.abs(want),
                                                                           initial=0.0)))


def _softmax64(z, mask=None, axis=-1):
  z = np.asarray(z, np.float64)
  mask = np.ones(z.shape, bool) if mask is None else np.broadcast_to(mask, z.shape)
  zm = np.where(mask, z, -np.inf)
  m = np.max(zm, axis=axis, keepdims=True)
  e = np.where(mask, np.exp(zm - np.where(np.isfinite(m), m, 0.0)), 0.0)
  d = e.sum(axis=axis, keepdims=True)
  return np.where(d > 0, e / np.where(d > 0, d, 1.0), 0.0)


def _lse64(z, axis=-1):
  z = np.asarray(z, np.float64)
  m = np.max(z, axis=axis, keepdims=True)
  return (m + np.log(np.sum(np.exp(z - m), axis=axis, keepdims=True))).squeeze(axis)


# ------------------------------------------------------------------ N41 stochastic pooling


def _pool_inputs(s, seed):
  rng = np.random.default_rng(seed)
  x = (1.5 * rng.standard_normal((s["rows"], s["n"]))).astype(np.float32)
  mask = rng.random(x.shape) < 0.9
  mask[:, 0] = True
  return jnp.asarray(x), jnp.asarray(mask)


_KEY = jax.random.key(0)


def _stochastic(x, mask):
  return js.pooling.stochastic_softmax_pool(x, where=mask, key=_KEY)


def _soft(x, mask):
  return js.pooling.soft_pool(x, where=mask)


def _check_stochastic(fn, args) -> float:
  x, mask = (np.asarray(a) for a in args)
  want = np.sum(_softmax64(x, mask) * np.where(mask, x, 0.0), axis=-1)
  evaluation = jax.jit(lambda x, m: js.pooling.stochastic_softmax_pool(
      x, where=m, deterministic=True))(*args)
  err = _rel(evaluation, want)
  drawn = np.asarray(jax.jit(fn)(*args))
  visible = [set(r[m].tolist()) for r, m in zip(x, mask, strict=True)]
  if not all(d in v for d, v in zip(drawn.tolist(), visible, strict=True)):
    return float("inf")  # a draw that is not one of its pool's visible entries
  return err


# ------------------------------------------------------------------ A52 monotonic attention


def _attn_inputs(s, seed):
  rng = np.random.default_rng(seed)
  shape = (1, s["t"], s["heads"], s["h"])
  return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))


def _alignment64(q, k):
  """p = sigmoid(q.k / sqrt(H)) [B, N, T, S] and Raffel et al.'s recurrence, float64:
  alpha_ij = p_ij q_ij, q_ij = (1 - p_i,j-1) q_i,j-1 + alpha_i-1,j, alpha_0 = delta_j0."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  e = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  p = 1.0 / (1.0 + np.exp(-e))
  b, n, t, s = p.shape
  prev = np.zeros((b, n, s))
  prev[..., 0] = 1.0
  alpha = np.zeros_like(p)
  for i in range(t):
    carry = np.zeros((b, n))
    for j in range(s):
      carry = (1.0 - p[..., i, j - 1]) * carry + prev[..., j] if j else prev[..., 0]
      alpha[..., i, j] = p[..., i, j] * carry
    prev = alpha[..., i, :]
  return alpha, e


def _check_monotonic(fn, args) -> float:
  """c_i = sum_j alpha_ij v_j with the float64 alignment."""
  q, k, v = args
  alpha, _ = _alignment64(q, k)
  want = np.einsum("bnts,bsnh->btnh", alpha, np.asarray(v, np.float64))
  return _rel(jax.jit(fn)(*args), want)


def _monotonic(method):
  return lambda q, k, v: js.attention.monotonic_attention(q, k, v, method=method)


def _chunkwise(q, k, v):
  return js.attention.chunkwise_attention(q, k, v, chunk_size=4)


def _check_chunkwise(fn, args) -> float:
  """Chiu & Raffel's beta_ij = sum_{k=j}^{j+w-1} alpha_ik e^{u_ij} / sum_{l=k-w+1}^{k}
  e^{u_il}, u = the monotonic energies (the default chunk energies), w = 4."""
  q, k, v = args
  alpha, u = _alignment64(q, k)
  s, w = alpha.shape[-1], 4
  beta = np.zeros_like(alpha)
  for j in range(s):
    for kk in range(j, min(j + w, s)):
      lo = max(0, kk - w + 1)
      den = np.sum(np.exp(u[..., lo:kk + 1]), axis=-1)
      beta[..., j] += alpha[..., kk] * np.exp(u[..., j]) / den
  want = np.einsum("bnts,bsnh->btnh", beta, np.asarray(v, np.float64))
  return _rel(jax.jit(fn)(*args), want)


def _dense(q, k, v):
  return js.attention.dot_product_attention(q, k, v, implementation="xla")


# ------------------------------------------------------------------ A53 adaptive pooling


def _set_inputs(s, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((s["sets"], s["n"], s["d"])).astype(np.float32)
  q = rng.standard_normal((s["d"],)).astype(np.float32)
  mask = rng.random(x.shape[:-1]) < 0.8
  mask[:, 0] = True
  return jnp.asarray(x), jnp.asarray(q), jnp.asarray(mask)


def _adaptive(x, q, mask):
  return js.pooling.adaptive_attention_pool(x, where=mask, query=q)


def _mean_pool(x, q, mask):
  del q
  m = mask[..., None].astype(x.dtype)
  return jnp.sum(x * m, axis=-2) / jnp.sum(m, axis=-2)


def _check_adaptive(fn, args) -> float:
  x, q, mask = (np.asarray(a) for a in args)
  x64 = x.astype(np.float64)
  a = _softmax64(x64 @ q.astype(np.float64) / np.sqrt(x.shape[-1]), mask)
  return _rel(jax.jit(fn)(*args), np.einsum("bn,bnd->bd", a, x64))


# ------------------------------------------------------------------ L18 ACOL


def _acol_inputs(s, seed):
  rng = np.random.default_rng(seed)
  z = (2.0 * rng.standard_normal((s["batch"], s["classes"], s["k"]))).astype(np.float32)
  y = rng.integers(0, s["classes"], s["batch"]).astype(np.int32)
  return jnp.asarray(z), jnp.asarray(y)


def _acol(z, y):
  return js.losses.acol_loss(z, y)


def _flat_ce(z, y):
  flat = z.reshape(z.shape[0], -1)  # the same C k nodes, one of the label's as the target
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(flat, y * z.shape[-1]))


def _check_acol(fn, args) -> float:
  """Pooled CE + alpha + (1 - beta) + 1e-6 ||Z||_F^2 from N = B^T B, V = v v^T (explicit
  n x n matrices), the defaults c_alpha = c_beta = 1, c_F = 1e-6."""
  z, y = np.asarray(args[0], np.float64), np.asarray(args[1])
  m, c, k = z.shape
  parent = _lse64(z)  # [m, C]
  ce = np.mean(_lse64(parent) - parent[np.arange(m), y])
  b = np.maximum(z.reshape(m, c * k), 0.0)
  nn_ = b.T @ b
  v = np.diag(nn_)
  vv = np.outer(v, v)
  n = c * k
  affinity = (nn_.sum() - np.trace(nn_)) / ((n - 1) * np.trace(nn_))
  balance = (vv.sum() - np.trace(vv)) / ((n - 1) * np.trace(vv))
  want = ce + affinity + (1.0 - balance) + 1e-6 * np.sum(z * z)
  return _rel(jax.jit(fn)(*args), want)


# ------------------------------------------------------------------ L19 energy scores


def _energy_inputs(s, seed):
  rng = np.random.default_rng(seed)
  z = (3.0 * rng.standard_normal((s["seqs"], s["t"], s["vocab"]))).astype(np.float32)
  y = rng.integers(0, s["vocab"], (s["seqs"], s["t"])).astype(np.int32)
  return jnp.asarray(z), jnp.asarray(y)


def _spilled(z, y):
  return js.losses.spilled_energy(z, y)


def _marginalized(z, y):
  del y
  return js.losses.marginalized_energy(z)


def _logsumexp(z, y):
  del y
  return jax.nn.logsumexp(z, axis=-1)


def _check_spilled(fn, args) -> float:
  """Delta_t = LSE(z_{t+1}) - z_{t, y_t}, t < T - 1 (beta = 1)."""
  z, y = np.asarray(args[0], np.float64), np.asarray(args[1])
  picked = np.take_along_axis(z[:, :-1], y[:, :-1, None], axis=-1)[..., 0]
  return _rel(jax.jit(fn)(*args), _lse64(z[:, 1:]) - picked)


def _check_marginalized(fn, args) -> float:
  return _rel(jax.jit(fn)(*args), -_lse64(np.asarray(args[0], np.float64)))


# ------------------------------------------------------------------ the rows


_POOL = dict(sizes=dict(rows=4096, n=256), quick=dict(rows=64, n=32),
             check_sizes=dict(rows=64, n=40))
_ATTN = dict(sizes=dict(t=256, heads=4, h=32), quick=dict(t=16, heads=2, h=8),
             check_sizes=dict(t=12, heads=2, h=8), argnums=(0, 1, 2))
_ENERGY = dict(sizes=dict(seqs=8, t=256, vocab=8192), quick=dict(seqs=2, t=8, vocab=64),
               check_sizes=dict(seqs=2, t=12, vocab=300), forward_only=True)

# float32 against float64: a softmax and a weighted sum of <= 40 terms of |x| <= 8, ~1e-6;
# the alignment scans of <= 12 keys and steps, ~1e-6; 1e-4 leaves a wide margin and still
# fails any wrong formula (a wrong term moves the result by O(0.01) or more).
ROWS = {r.name: r for r in [
    Row("stochastic_softmax_pool", "N41", "soft_pool (evaluation form)", _pool_inputs,
        _stochastic, _soft, _check_stochastic, 1e-5, **_POOL),
    *(Row(f"monotonic_attention:{m}", "A52", "dot_product_attention (dense softmax)",
          _attn_inputs, _monotonic(m), _dense, _check_monotonic, 1e-4, **_ATTN)
      for m in ("parallel", "cumprod", "loop")),
    Row("chunkwise_attention:4", "A52", "dot_product_attention (dense softmax)", _attn_inputs,
        _chunkwise, _dense, _check_chunkwise, 1e-4, **_ATTN),
    Row("adaptive_attention_pool", "A53", "masked mean (AvgPool)", _set_inputs, _adaptive,
        _mean_pool, _check_adaptive, 1e-5, sizes=dict(sets=512, n=256, d=64),
        quick=dict(sets=8, n=16, d=8), check_sizes=dict(sets=16, n=24, d=8), argnums=(0, 1)),
    Row("acol_loss", "L18", "optax softmax CE over the C*k nodes", _acol_inputs, _acol,
        _flat_ce, _check_acol, 1e-5, sizes=dict(batch=4096, classes=100, k=4),
        quick=dict(batch=32, classes=5, k=3), check_sizes=dict(batch=64, classes=6, k=4)),
    Row("spilled_energy", "L19", "jax.nn.logsumexp over the vocabulary", _energy_inputs,
        _spilled, _logsumexp, _check_spilled, 1e-5, **_ENERGY),
    Row("marginalized_energy", "L19", "jax.nn.logsumexp over the vocabulary", _energy_inputs,
        _marginalized, _logsumexp, _check_marginalized, 1e-5, **_ENERGY),
]}


def _timed(fn, row: Row):
  if row.forward_only:
    return jax.jit(fn)

  def loss(*args):
    out = fn(*args)
    return jnp.sum(out * out) if out.ndim else out

  return jax.jit(jax.value_and_grad(loss, argnums=row.argnums))


def _finite(out) -> bool:
  return all(bool(np.all(np.isfinite(np.asarray(a)))) for a in jax.tree.leaves(out))


def interleaved_ms(f, g, args, reps: int) -> tuple[float, float, float, bool]:
  """(median ms of ``f``, of ``g``, median of the per-round ratios f / g, whether ``f``'s
  first outputs, the value and the gradients, are all finite): both compiled first, then
  ``reps`` rounds each running ``f`` and ``g`` once, so that a machine busy with other work
  slows them alike."""
  finite = _finite(jax.block_until_ready(f(*args)))  # compile
  jax.block_until_ready(g(*args))
  tf, tg = [], []
  for _ in range(reps):
    for fn, ts in ((f, tf), (g, tg)):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      ts.append(time.perf_counter() - t0)
  ratio = statistics.median(a / b for a, b in zip(tf, tg, strict=True))
  return 1e3 * statistics.median(tf), 1e3 * statistics.median(tg), ratio, finite


def measure(row: Row, reps: int, quick: bool) -> dict[str, Any]:
  """``{"err", "ok"}`` and, only when the check passed, ``{"ms", "base_ms", "ratio"}``: the
  check against the oracle first; a timed call whose value or gradients are not finite
  fails the row too (its times are dropped)."""
  err = row.check(row.fn, row.inputs(row.check_sizes, 1))
  res: dict[str, Any] = {"err": err, "ok": bool(err <= row.tol)}
  if res["ok"]:
    args = row.inputs(row.quick if quick else row.sizes, 0)
    ms, base_ms, ratio, finite = interleaved_ms(_timed(row.fn, row), _timed(row.base, row),
                                                args, reps)
    if finite:
      res.update(ms=ms, base_ms=base_ms, ratio=ratio)
    else:
      res.update(ok=False, err=float("inf"))
  return res


def table(results: dict[str, dict[str, Any]], reps: int, quick: bool) -> list[str]:
  lines = [f"CPU, float32, median of {reps} runs after compiling; forward + backward under "
           f"jit (L19: forward); sizes: {'quick' if quick else 'default'}",
           "",
           "| row | function | size | baseline | time (ms) | baseline (ms) | this / baseline "
           "| check (max rel. error / limit) |",
           "|---|---|---|---|---|---|---|---|"]
  for name, res in results.items():
    row = ROWS[name]
    size = ", ".join(f"{k}={v}" for k, v in (row.quick if quick else row.sizes).items())
    check = f"{res['err']:.1e} / {row.tol:.0e}"
    if not res["ok"]:
      lines.append(f"| {row.feature} | {name} | {size} | {row.baseline} | FAILED (check): "
                   f"not timed | | | {check} |")
      continue
    lines.append(f"| {row.feature} | {name} | {size} | {row.baseline} | {res['ms']:.2f} | "
                 f"{res['base_ms']:.2f} | {res['ratio']:.2f}x | {check} |")
  return lines


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny sizes, 2 reps")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--rows", type=str, default=",".join(ROWS),
                 help=f"comma-separated, from {', '.join(ROWS)}")
  a = p.parse_args(argv)
  names = [n for n in a.rows.split(",") if n]
  for n in names:
    if n not in ROWS:
      p.error(f"unknown row {n!r}; choose from {tuple(ROWS)}")
  reps = 2 if a.quick else a.reps
  if reps < 1:
    p.error(f"--reps must be >= 1, got {reps}")
  results = {}
  for n in names:
    results[n] = measure(ROWS[n], reps, a.quick)
    print(f"{n}: {results[n]}", file=sys.stderr)
  print("\n".join(table(results, reps, a.quick)))
  return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
