"""GPU benchmark of the Pallas attention engine, as one short script (under 5 minutes).

Correctness first: for each (normalizer, head dim, causal) the kernel's output and
cotangents are compared with a dense float32 reference at a small length; an op that
fails is reported as FAIL and never timed. Then TFLOP/s, forward and forward+backward,
median of ``--reps`` runs, against ``jax.nn.dot_product_attention(implementation="cudnn")``
and ``tokamax.dot_product_attention`` (when importable), for softmax, softmax_1, sigmoid,
relu and softpick through this kernel.

FLOPs: 4·B·N·T·S·H for the forward pass (halved for causal); forward+backward counts 3.5x
the forward FLOPs (the backward recomputes QK^T and does four more matmuls: 2.5x).
Shapes: B·T = 16k tokens, N·H = 2048, H in {64, 128}, T in {1k, 4k, 16k}, bf16.

    python bench/gpu.py                      # on a GPU, under 5 minutes
    python bench/gpu.py --interpret --tiny   # on CPU: interpret mode, tiny shapes (a test)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft.normalizers as jn
import kernels_pallas as kp

NORMALIZERS = ("softmax", "softmax_1", "sigmoid", "relu", "softpick")


@dataclasses.dataclass
class Row:
  op: str
  normalizer: str
  h: int
  t: int
  b: int
  n: int
  causal: bool
  fwd_tflops: float | None = None
  fwdbwd_tflops: float | None = None
  status: str = "ok"


def reference(q, k, v, normalizer, causal):
  """Dense float32 attention: normalizer(logits, where=mask) @ v (GQA not needed here)."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  t, s, h = q.shape[1], k.shape[1], q.shape[-1]
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  mask = jnp.tril(jnp.ones((t, s), bool)) if causal else jnp.ones((t, s), bool)
  w = jn.get(normalizer).fn(logits, where=mask[None, None])
  return jnp.einsum("bnts,bsnh->btnh", w, v)


def _inputs(b, t, n, h, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  return tuple(jax.random.normal(kk, (b, t, n, h), dtype) for kk in ks)


def _fwd_bwd(fn):
  def f(q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(ct)
  return jax.jit(f)


def check(fn, normalizer, h, causal, t, dtype, tol):
  """True when fn's output and cotangents match the dense reference within tol (relative)."""
  q, k, v, ct = _inputs(1, t, 2, h, dtype, seed=1)
  out, grads = _fwd_bwd(fn)(q, k, v, ct)
  rout, rgrads = _fwd_bwd(lambda q, k, v: reference(q, k, v, normalizer, causal))(
      q, k, v, ct.astype(jnp.float32))
  for a, r in zip((out, *grads), (rout, *rgrads), strict=True):
    a = np.asarray(a, np.float32)
    r = np.asarray(r, np.float32)
    if not np.all(np.isfinite(a)):
      return False
    if np.max(np.abs(a - r)) > tol * max(1.0, float(np.max(np.abs(r)))):
      return False
  return True


def timeit(f, args, reps):
  jax.block_until_ready(f(*args))  # compile + warm up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def measure(fn, b, t, n, h, causal, dtype, reps):
  q, k, v, ct = _inputs(b, t, n, h, dtype)
  flops = 4.0 * b * n * t * t * h * (0.5 if causal else 1.0)
  fwd = jax.jit(fn)
  t_f = timeit(fwd, (q, k, v), reps)
  loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)
                                                  * ct.astype(jnp.float32)), argnums=(0, 1, 2)))
  t_fb = timeit(loss, (q, k, v), reps)
  return flops / t_f / 1e12, 3.5 * flops / t_fb / 1e12


def ops(args):
  """name -> (normalizer -> fn(q, k, v) or None) for the kernel and the baselines."""
  interpret = bool(args.interpret)

  def ours(normalizer, causal):
    return lambda q, k, v: kp.attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                        backend="triton", interpret=interpret)

  table = {"jaxsoft_pallas": ours}
  on_gpu = jax.default_backend() == "gpu"
  if on_gpu:
    table["cudnn"] = lambda normalizer, causal: None if normalizer != "softmax" else (
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                     implementation="cudnn"))
  else:  # the reference point on CPU: XLA's dense attention
    table["jax_nn_xla"] = lambda normalizer, causal: None if normalizer != "softmax" else (
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                     implementation="xla"))
  try:
    import tokamax  # noqa: F401
    if on_gpu:
      table["tokamax"] = lambda normalizer, causal: None if normalizer != "softmax" else (
          lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal))
  except ImportError:
    print("# tokamax not importable: no tokamax column", file=sys.stderr)
  return table


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
  p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
  p.add_argument("--normalizers", default=",".join(NORMALIZERS))
  p.add_argument("--reps", type=int, default=None)
  p.add_argument("--json", default=None, help="also write the rows as JSON here")
  args = p.parse_args(argv)
  dtype = jnp.bfloat16
  if args.tiny:
    shapes = [(64, 64, 1, 2)]  # (H, T, B, N)
    check_t, reps = 40, args.reps or 2
  else:
    shapes = [(h, t, 16384 // t, 2048 // h) for h in (64, 128) for t in (1024, 4096, 16384)]
    check_t, reps = 512, args.reps or 10
  normalizers = [x for x in args.normalizers.split(",") if x]
  table = ops(args)
  print(f"# backend: {jax.default_backend()}  devices: {jax.devices()}  jax {jax.__version__}")
  rows: list[Row] = []
  checked: dict = {}
  for h, t, b, n in shapes:
    for causal in (False, True):
      for name, make in table.items():
        for normalizer in normalizers:
          fn = make(normalizer, causal)
          if fn is None:
            continue
          row = Row(name, normalizer, h, t, b, n, causal)
          key = (name, normalizer, h, causal)
          if key not in checked:
            try:
              checked[key] = check(fn, normalizer, h, causal, check_t, dtype, tol=3e-2)
            except Exception as e:  # an op that cannot run is reported, never timed
              print(f"# {key}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
              checked[key] = False
          if not checked[key]:
            row.status = "FAIL"
          else:
            row.fwd_tflops, row.fwdbwd_tflops = measure(fn, b, t, n, h, causal, dtype, reps)
          rows.append(row)
          print(_fmt(row), flush=True)
  print()
  print(summary(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
  return 0 if all(r.status == "ok" for r in rows) else 1


def _fmt(r: Row) -> str:
  f = "-" if r.fwd_tflops is None else f"{r.fwd_tflops:.4g}"
  fb = "-" if r.fwdbwd_tflops is None else f"{r.fwdbwd_tflops:.4g}"
  return (f"| {r.op} | {r.normalizer} | H={r.h} T={r.t} B={r.b} N={r.n} | "
          f"{'causal' if r.causal else 'full'} | {f} | {fb} | {r.status} |")


def summary(rows):
  """Markdown table with the ratio to the baseline of the same shape (softmax)."""
  base = {}
  for r in rows:
    if r.op != "jaxsoft_pallas" and r.fwd_tflops is not None:
      base.setdefault((r.h, r.t, r.causal), r)
  lines = ["| op | normalizer | shape | mask | fwd TFLOP/s | fwd+bwd TFLOP/s | "
           "fwd / baseline | fwd+bwd / baseline | status |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    b = base.get((r.h, r.t, r.causal))
    rf = rfb = "-"
    if b is not None and r.fwd_tflops is not None:
      rf = f"{r.fwd_tflops / b.fwd_tflops:.2f}x {b.op}"
      rfb = f"{r.fwdbwd_tflops / b.fwdbwd_tflops:.2f}x {b.op}"
    f = "-" if r.fwd_tflops is None else f"{r.fwd_tflops:.4g}"
    fb = "-" if r.fwdbwd_tflops is None else f"{r.fwdbwd_tflops:.4g}"
    lines.append(f"| {r.op} | {r.normalizer} | H={r.h} T={r.t} B={r.b} N={r.n} | "
                 f"{'causal' if r.causal else 'full'} | {f} | {fb} | {rf} | {rfb} | {r.status} |")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
