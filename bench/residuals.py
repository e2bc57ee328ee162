"""Reverse-mode residual memory of every registered normalizer, against jax.nn.softmax.

The residuals are the arrays the VJP of ``jax.jit(f)`` keeps between the forward and the
backward pass (traced with ``jax.eval_shape``, nothing runs), reported as a multiple of the
input's bytes on float32 rows ``[rows, n]``. ``jax.nn.softmax`` (which keeps its output) is
the baseline, measured in the same run. A normalizer whose jitted forward differs from its
eager call (or is not finite on these finite rows) gets no figure: its row says FAILED.

Usage::

  python bench/residuals.py               # rows 64, n 96, every registered normalizer
  python bench/residuals.py --rows 256 --n 1024
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js


def residual_bytes(f, x) -> int:
  """Bytes of the leaves of the VJP closure of ``jit(f)`` at ``x``."""
  vjp = jax.eval_shape(lambda a: jax.vjp(jax.jit(f), a)[1], x)
  return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(vjp))


def _fn(name):
  spec = js.normalizers.get(name)
  hp = {"k": 2} if name == "top_k_softmax" else {}
  if spec.needs_key:
    return lambda v: spec.fn(jax.random.key(0), v, -1, None, **hp)
  return lambda v: spec.fn(v, -1, None, **hp)


def measure(fns, x):
  """``[(name, ratio or None)]``: residual bytes / input bytes of each ``name -> f`` at
  ``x``; None (FAILED) when ``jit(f)(x)`` is not finite or differs from ``f(x)``."""
  out = []
  for name, f in fns.items():
    got, want = np.asarray(jax.jit(f)(x)), np.asarray(f(x))
    ok = np.isfinite(got).all() and np.allclose(got, want, rtol=1e-5, atol=1e-6)
    out.append((name, residual_bytes(f, x) / x.nbytes if ok else None))
  return out


def main(argv=None) -> list[str]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--n", type=int, default=96)
  parser.add_argument("--names", nargs="*", default=None, help="default: every registered one")
  args = parser.parse_args(argv)
  x = jax.random.normal(jax.random.key(0), (args.rows, args.n), jnp.float32)
  base = residual_bytes(jax.nn.softmax, x) / x.nbytes
  names = args.names or js.normalizers.names()
  lines = [f"float32 [{args.rows}, {args.n}]; residuals / input bytes; "
           f"jax.nn.softmax: {base:.2f}x",
           f"{'normalizer':32s} {'declared':9s} {'residuals':>10s} {'/ jax.nn':>9s}"]
  for name, r in measure({n: _fn(n) for n in names}, x):
    declared = js.normalizers.get(name).residuals
    cells = f"{'FAILED':>10s}" if r is None else f"{r:9.2f}x {r / base:8.2f}x"
    lines.append(f"{name:32s} {declared:9s} {cells}")
  print("\n".join(lines))
  return lines


if __name__ == "__main__":
  main()
