"""The ``blasst`` section of bench/gpu.py (K04): BLASST skip-softmax with the skip decided
inside the Pallas kernel (``kp.blasst_attention``, Triton; the backward is the engine's
over the kept pairs), causal, block 64, tau = 4, against dense causal softmax
``kp.attention`` (the baseline), forward and ``jax.grad`` of a sum, milliseconds (median
of ``--reps``), bf16, B·T = 16k, N = 16, H = 128, T in {8k, 16k}. q and k have topics (one
random direction per block, plus noise; bench/gpu.py's ``_topic_inputs``) so that whole
tiles skip a key block.

Correctness first, at B = 1, T = 1024, N = 4: the kernel's kept (row, key block) pairs
must equal those of ``jaxsoft.attention.block_sparse_attention(method="blasst",
implementation="xla_chunked")`` (the skip loop: its own decision pass) and its output and
q, k, v cotangents must match that call within 3e-2 relative (bf16); a failing kernel is
reported as FAIL and never timed. Each timed row prints the kept share of the causal
(row, key block) pairs; each ratio is baseline ms / kernel ms (above 1: faster).

    python bench/gpu.py --sections blasst                     # on a GPU
    python bench/gpu.py --sections blasst --interpret --tiny  # on CPU (a test)
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas as kp

TAU = 4.0


def _kept_share(kept, bs: int) -> float:
  """Kept (row, key block) pairs / the causal ones (row i sees i // bs + 1 blocks)."""
  t = kept.shape[2]
  visible = kept.shape[0] * kept.shape[1] * float(np.sum(np.arange(t) // bs + 1))
  return float(jnp.sum(kept)) / visible


def section(args, gpu) -> bool:
  """Runs the section; ``gpu`` is bench/gpu.py's module (its inputs, timing and row format),
  passed in by gpu.py, so that this file does not import it back."""
  import jaxsoft.attention as ja

  interpret, dtype = bool(args.interpret), jnp.bfloat16
  if args.tiny:
    bs, check_bth, reps = 16, (1, 64, 2, 32), args.reps or 2
    shapes = [(1, 64, 2, 32)]
  else:
    bs, check_bth, reps = 64, (1, 1024, 4, 128), args.reps or 5
    shapes = [(2, 8192, 16, 128), (1, 16384, 16, 128)]

  def ours(q, k, v, kept=False):
    return kp.blasst_attention(q, k, v, skip_threshold=TAU, block_size=bs, is_causal=True,
                               backend="triton", interpret=interpret, return_kept=kept)

  def loop(q, k, v, kept=False):
    out = ja.block_sparse_attention(q, k, v, method="blasst", block_size=bs,
                                    skip_threshold=TAU, is_causal=True, return_stats=kept)
    return (out[0], out[1]["kept_tokens"]) if kept else out

  def dense(q, k, v):
    return kp.attention(q, k, v, normalizer="softmax", is_causal=True, backend="triton",
                        interpret=interpret)

  b0, t0, n0, h0 = check_bth
  q, k, v = gpu._topic_inputs(b0, t0, n0, h0, dtype, block=bs, seed=1)
  ct = gpu._inputs(b0, t0, n0, h0, dtype, seed=2)[3]
  same = False
  try:
    kept_ours = jax.jit(lambda *a: ours(*a, kept=True)[1])(q, k, v)
    kept_loop = jax.jit(lambda *a: loop(*a, kept=True)[1])(q, k, v)
    same = bool(jnp.all(kept_ours == kept_loop))
  except Exception as e:  # an op that cannot run is reported, never timed
    print(f"# blasst kept: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
  err = gpu._try_err("blasst", lambda: tuple(
      jax.jit(lambda *a, fn=fn: gpu._vjp_all(fn, a[:3], a[3]))(q, k, v, ct)
      for fn in (ours, loop)))
  try:
    dense_ok = gpu.check(dense, "softmax", h0, True, min(t0, 512), dtype, tol=3e-2)
  except Exception as e:
    print(f"# blasst dense: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
    dense_ok = False
  ok = same and err <= 3e-2
  print(f"\n| K04 BLASST in-kernel skip (causal, block {bs}, tau {TAU:g}; topic inputs) | shape "
        "| fwd ms | grad ms | vs dense fwd | vs dense grad | status |\n"
        "|---|---|---|---|---|---|---|")
  for b, t, n, h in shapes:
    shape = f"B={b} T={t} N={n} H={h}"
    qkv = gpu._topic_inputs(b, t, n, h, dtype, block=bs)
    base = gpu._fwd_grad_ms(dense, qkv, reps) if dense_ok else [None, None]
    print(gpu._ms_row("dense kp.attention", shape, base, base, "ok" if dense_ok else "FAIL"))
    if not ok:
      print(f"| kp.blasst_attention | {shape} | - | - | - | - | FAIL (kept pairs equal: "
            f"{same}; vs xla_chunked {err:.2g}) |")
      continue
    share = _kept_share(jax.jit(lambda *a: ours(*a, kept=True)[1])(*qkv), bs)
    print(gpu._ms_row("kp.blasst_attention", shape, gpu._fwd_grad_ms(ours, qkv, reps), base,
                      f"ok (vs xla_chunked {err:.1e}, same kept pairs; kept {share:.3f} of "
                      "the causal pairs)"), flush=True)
  return ok and dense_ok
