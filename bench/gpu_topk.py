"""The ``topk`` section of bench/gpu.py (K01): ``kp.softmax_top_k``, the fused softmax +
top-k Pallas kernel (Triton), against ``jax.lax.top_k(jax.nn.softmax(x), k)`` under jit
(the baseline), forward and ``jax.grad`` of a weighted sum of the values, milliseconds
(median of ``--reps``), rows x n = 4096 x 32768, k in {8, 64}, bf16 and float32.

Correctness first: for each (k, dtype) the kernel's values, indices and gradient are
compared with the baseline computed in float32 at 256 x 32768 (values within 1e-6 + 1e-5
times the value, the gradient within 1e-6 + 1e-5 times its largest entry, bf16 a relative
2^-8 more; every index equal); a failing case is reported as FAIL and never
timed. Each ratio is baseline ms / kernel ms (above 1: the kernel is faster).

    python bench/gpu.py --sections topk                     # on a GPU
    python bench/gpu.py --sections topk --interpret --tiny  # on CPU (a test)
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import kernels_pallas as kp

KS = (8, 64)
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def _median_ms(f, args, reps: int) -> float:
  jax.block_until_ready(f(*args))  # compile and warm up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def _ours(k: int, interpret: bool):
  return lambda x: kp.softmax_top_k(x, k, backend="triton", interpret=interpret)


def _baseline(k: int):
  return lambda x: jax.lax.top_k(jax.nn.softmax(x), k)


def _grad(fn):
  """d/dx of sum(values * g): one program (g an argument, not a folded constant)."""
  return jax.jit(jax.grad(lambda x, g: jnp.sum(fn(x)[0].astype(jnp.float32) * g)))


def _check(k: int, dtype, shape, interpret: bool) -> tuple[bool, str]:
  x = (jax.random.normal(jax.random.key(1), shape) * 3.0).astype(dtype)
  g = jax.random.normal(jax.random.key(2), (shape[0], k))
  v, i = jax.jit(_ours(k, interpret))(x)
  rv, ri = jax.jit(_baseline(k))(x.astype(jnp.float32))  # the reference in float32
  verr = float(jnp.max(jnp.abs(v.astype(jnp.float32) - rv) / (1e-6 + 1e-5 * rv)))
  same = float(jnp.mean((i == ri).astype(jnp.float32)))
  dref = _grad(_baseline(k))(x.astype(jnp.float32), g)
  gerr = float(jnp.max(jnp.abs(_grad(_ours(k, interpret))(x, g).astype(jnp.float32) - dref))
               / (1e-6 + 1e-5 * jnp.max(jnp.abs(dref))))
  # bf16 rounds the values and the gradient to a relative 2^-9, beyond float32 rounding
  tol = 1.0 if dtype == jnp.float32 else 1.0 + 2.0 ** -8 / 1e-5
  ok = verr <= tol and same == 1.0 and gerr <= tol
  return ok, (f"values err {verr:.2g}, gradient err {gerr:.2g} (1 = the tolerance "
              f"1e-6 + 1e-5 |ref|), indices equal {same:.4f}")


def section(args) -> bool:
  """K01: the fused softmax + top-k kernel against lax.top_k(jax.nn.softmax) (the
  baseline), forward and gradient; each (k, dtype) checked first."""
  interpret = bool(args.interpret)
  if args.tiny:
    shape, check_shape, ks, reps = (64, 300), (48, 300), KS, args.reps or 2
  else:
    shape, check_shape, ks, reps = (4096, 32768), (256, 32768), KS, args.reps or 20
  oks = {}
  for name, dtype in DTYPES.items():
    for k in ks:
      try:
        oks[name, k], msg = _check(k, dtype, check_shape, interpret)
      except Exception as e:  # a kernel that does not compile or run: FAIL, not a crash
        oks[name, k], msg = False, f"{type(e).__name__}: {str(e)[:1500]}"
      print(f"# K01 {name} k={k}: {msg}", file=sys.stdout if oks[name, k] else sys.stderr)
  print("\n| K01 softmax + top-k | rows x n, k, dtype | fwd ms | grad ms | baseline / fwd "
        "| baseline / grad | status |\n|---|---|---|---|---|---|---|")
  x32 = jax.random.normal(jax.random.key(0), shape) * 3.0
  for name, dtype in DTYPES.items():
    x = x32.astype(dtype)
    for k in ks:
      g = jax.random.normal(jax.random.key(3), (shape[0], k))
      label = f"{shape[0]} x {shape[1]}, k={k}, {name}"
      base = [_median_ms(jax.jit(_baseline(k)), (x,), reps),
              _median_ms(_grad(_baseline(k)), (x, g), reps)]
      print(f"| lax.top_k(softmax) | {label} | {base[0]:.3g} | {base[1]:.3g} | 1.00x | "
            "1.00x | ok |")
      if not oks[name, k]:
        print(f"| kp.softmax_top_k | {label} | - | - | - | - | FAIL |")
        continue
      ms = [_median_ms(jax.jit(_ours(k, interpret)), (x,), reps),
            _median_ms(_grad(_ours(k, interpret)), (x, g), reps)]
      print(f"| kp.softmax_top_k | {label} | {ms[0]:.3g} | {ms[1]:.3g} | "
            f"{base[0] / ms[0]:.2f}x | {base[1] / ms[1]:.2f}x | ok |", flush=True)
  return all(oks.values())


if __name__ == "__main__":
  import argparse

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
  p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
  p.add_argument("--reps", type=int, default=None)
  sys.exit(0 if section(p.parse_args()) else 1)
