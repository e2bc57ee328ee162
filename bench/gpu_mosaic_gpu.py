"""The ``mosaic_gpu`` section of bench/gpu.py: ``kp.mosaic_gpu_attention`` (the Mosaic-GPU
Hopper forward, FlashAttention-3 structure, never run on a GPU before this section)
against cuDNN softmax (``jax.nn.dot_product_attention(implementation="cudnn")``) and
this library's Triton kernel (``kp.attention(backend="triton")``) for the same
normalizer: bf16, H = 128, B·T = 16k tokens, N = 16, T in {4k, 16k}, full and causal.
Two tables: the forward for softmax, softmax_1, sigmoid, relu and stablemax (classes E,
E, P, P, S), sparsemax, entmax15 and top_k_softmax (class T: the threshold search kernel,
then the pass over the live key blocks, ``kernels_pallas.mosaic_gpu_threshold``) and
softmax with lazy rescaling (``rescale_threshold=8``, a ``mosaic_gpu tau=8`` row);
forward+backward (``jax.vjp``: the forward saving its row statistics, then the dK/dV and
dQ kernels) for softmax, softmax_1, sigmoid and stablemax, and for sparsemax, entmax15 and
top_k_softmax (class T: the forward also saves tau, W and the live flags; the dQ kernel
sweeps the live key blocks twice, the implicit-function coefficient then dQ, and dK/dV
runs over each key block's live query blocks, ``kernels_pallas.mosaic_gpu_threshold_backward``).

Correctness first: every (normalizer, causal) is compared at T = 512 (``--tiny``: 128)
with a dense float64 attention of the same rounded inputs; the kernel rounds the weights
and the output to bf16 once each, so ``|O - O_ref| <= 2u sum_j |w_j| |v_j|`` (u = 2^-8)
plus ``ex2.approx`` / ``tanh.approx``'s relative 2^-22 / 2^-11 on the GPU: a case beyond
``3u sum_j |w_j||v_j|`` is reported as FAIL and never timed.

The gradients are checked the same way first, at the same T, against the float32
dense gradient (the normalizer's own function, ``jax.vjp``, highest matmul precision: a
relative 1e-6): each of dQ, dK, dV within ``8u`` in relative Frobenius norm (the kernel's
elementwise error is at most about 6u of the magnitudes ``sum |dx| |q|`` and ``sum |w|
|dO|``: rounding dx and w to bf16, Δ from the rounded output, the rounded per-head
gradients; see tests/kernels_pallas/test_mosaic_gpu.py), else FAIL and not timed.

On a GPU each causal kernel is also compiled once in a subprocess with
``MOSAIC_GPU_DUMP_PTXAS=1``; its registers and spill bytes are printed (``-- SPILLS``
when ptxas spilled).

Times are the GPU's own (CUPTI, ``jax.experimental.mosaic.gpu.profiler.measure``, median
of ``--reps`` runs of the kernels alone), or wall clock around a call off a GPU (the
``clock`` column says which). TFLOP/s counts 4·B·N·T²·H for the forward and 3.5 times that
for forward+backward (the backward's five matmuls, FlashAttention's convention), halved
for causal; ``x cuDNN`` is cuDNN softmax's time over the row's (above 1: faster than cuDNN
softmax), forward against forward and forward+backward against forward+backward.

    python bench/gpu.py --sections mosaic_gpu                       # on an H100 / H200
    python bench/gpu.py --sections mosaic_gpu --interpret --tiny    # CPU, JAX >= 0.12.1
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft.normalizers as jn
import kernels_pallas as kp

NORMALIZERS = ("softmax", "softmax_1", "sigmoid", "relu", "stablemax",
               "sparsemax", "entmax15", "top_k_softmax",
               "standardized_softmax", "nap")  # E, E, P, P, S, T, T, T, R (then E), R (then P)
LAZY = {"softmax": 8.0}  # also timed with lazy rescaling at this tau (a "tau=" row)
GRAD_NORMALIZERS = ("softmax", "softmax_1", "sigmoid", "stablemax",
                    "sparsemax", "entmax15", "top_k_softmax",
                    "standardized_softmax", "nap")  # E (exp2), E, P, S, T, T, T, R, R


def _inputs(b, t, n, h, dtype, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((b, t, n, h), np.float32), dtype)
               for _ in range(3))


def _reference(q, k, v, normalizer, causal):
  """(dense attention of the rounded inputs, sum_j |w_j| |v_j|) in float64, numpy."""
  q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
  t, s, h = q.shape[1], k.shape[1], q.shape[-1]
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  mask = np.tril(np.ones((t, s), bool)) if causal else np.ones((t, s), bool)
  # the weights in float32 (a relative 1e-7, far below bf16's 2^-8), the rest float64
  fn = jax.jit(lambda x: jn.get(normalizer).fn(x, where=mask[None, None]))  # one compile
  w = np.asarray(fn(jnp.asarray(logits, jnp.float32)), np.float64)
  return (np.einsum("bnts,bsnh->btnh", w, v),
          np.einsum("bnts,bsnh->btnh", np.abs(w), np.abs(v)))


def _mosaic(normalizer: str, causal: bool, interpret: bool, **kw):
  return lambda q, k, v: kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer,
                                                 is_causal=causal, interpret=interpret, **kw)


def _triton(normalizer: str, causal: bool, interpret: bool):
  return lambda q, k, v: kp.attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                      backend="triton", interpret=interpret)


def _cudnn(causal: bool):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation="cudnn")


def check(normalizer: str, causal: bool, t: int, interpret: bool, **kw) -> tuple[bool, str]:
  """(ok, what was measured): the Mosaic kernel (``kw``: its options) against the float64
  reference."""
  q, k, v = _inputs(1, t, 2, 128, jnp.bfloat16, seed=1)
  try:
    out = np.asarray(jax.jit(_mosaic(normalizer, causal, interpret, **kw))(q, k, v)
                     .astype(jnp.float32), np.float64)
  except Exception as e:  # a kernel that does not compile or run is a FAIL row, not a crash
    return False, f"{type(e).__name__}: {str(e)[:300]}"
  ref, bound = _reference(q, k, v, normalizer, causal)
  ratio = float(np.max(np.abs(out - ref) / (3 * 2.0 ** -8 * bound + 1e-6)))
  ok = bool(np.all(np.isfinite(out))) and ratio <= 1.0
  return ok, f"error / tolerance {ratio:.3g} (tolerance 3u sum|w||v|, u = 2^-8)"


def _fwd_bwd(attn):
  """``(q, k, v, do) -> (dq, dk, dv)``: the forward (saving what its backward needs) and
  the backward of ``attn``, as one function (what a training step runs)."""
  def f(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)
  return f


def _reference_grads(q, k, v, do, normalizer, causal):
  """(dq, dk, dv) of dense attention in float32 at the highest matmul precision."""
  t, s, h = q.shape[1], k.shape[1], q.shape[-1]
  mask = jnp.tril(jnp.ones((t, s), bool)) if causal else jnp.ones((t, s), bool)
  fn = jn.get(normalizer).fn
  hi = jax.lax.Precision.HIGHEST

  def attn(q, k, v):
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) / np.sqrt(h)
    w = fn(logits, where=mask[None, None])
    return jnp.einsum("bnts,bsnh->btnh", w, v, precision=hi)

  args = tuple(x.astype(jnp.float32) for x in (q, k, v, do))
  return [np.asarray(g, np.float64) for g in jax.jit(_fwd_bwd(attn))(*args)]


def check_grad(normalizer: str, causal: bool, t: int, interpret: bool) -> tuple[bool, str]:
  """(ok, what was measured): the Mosaic kernel's dQ, dK, dV against the float32 dense
  gradients, each within 8u (u = 2^-8) in relative Frobenius norm."""
  q, k, v, do = _inputs(1, t, 2, 128, jnp.bfloat16, seed=1) + _inputs(
      1, t, 2, 128, jnp.bfloat16, seed=2)[:1]
  try:
    got = [np.asarray(g.astype(jnp.float32), np.float64) for g in
           jax.jit(_fwd_bwd(_mosaic(normalizer, causal, interpret)))(q, k, v, do)]
  except Exception as e:  # a kernel that does not compile or run is a FAIL row, not a crash
    return False, f"{type(e).__name__}: {str(e)[:300]}"
  ref = _reference_grads(q, k, v, do, normalizer, causal)
  rel = [float(np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30))
         for a, r in zip(got, ref, strict=True)]
  ok = all(bool(np.all(np.isfinite(a))) for a in got) and max(rel) <= 8 * 2.0 ** -8
  return ok, ("relative errors dq, dk, dv " + ", ".join(f"{r:.3g}" for r in rel)
              + " (tolerance 8u = 0.031)")


def _device_ms(f, args, reps: int) -> tuple[float, str]:
  """Median milliseconds of ``f(*args)``: CUPTI's kernel time on a GPU, else wall clock."""
  jax.block_until_ready(f(*args))  # compile and warm up
  if jax.default_backend() == "gpu":
    try:
      from jax.experimental.mosaic.gpu import profiler
      _, times = profiler.measure(f, iterations=reps)(*args)
      if times:
        return statistics.median(times), "cupti"
    except Exception as e:  # noqa: BLE001 - reported, then the wall clock
      print(f"# CUPTI measure failed ({type(e).__name__}: {e}); wall clock instead",
            file=sys.stderr)
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3, "wall"


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> tuple[int, int, int] | None:
  """(most registers of a kernel, spill store bytes, spill load bytes) over the kernels of
  ptxas's verbose report (``ptxas -v`` lines such as ``0 bytes stack frame, 0 bytes spill
  stores, 0 bytes spill loads`` and ``Used 168 registers, ...``), or None without one."""
  spills = [(int(a), int(b)) for a, b in _SPILLS.findall(text)]
  if not spills:
    return None
  regs = [int(r) for r in _REGISTERS.findall(text)]
  return (max(regs) if regs else -1, sum(a for a, _ in spills), sum(b for _, b in spills))


def ptxas_report(normalizer: str, causal: bool, timeout: float = 300.0):
  """Compiles the kernel (T = 4k, H = 128, bf16) in a fresh process with
  ``MOSAIC_GPU_DUMP_PTXAS=1`` (Mosaic GPU prints ptxas's verbose report there, from C++:
  a subprocess captures it) and returns :func:`parse_ptxas` of its output."""
  code = ("import jax, jax.numpy as jnp, kernels_pallas as kp\n"
          "q = jnp.zeros((1, 4096, 16, 128), jnp.bfloat16)\n"
          f"f = jax.jit(lambda q: kp.mosaic_gpu_attention(q, q, q, normalizer={normalizer!r}, "
          f"is_causal={causal}))\n"
          "jax.block_until_ready(f(q))\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "MOSAIC_GPU_DUMP_PTXAS": "1",
         "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
  try:
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=root)
  except subprocess.TimeoutExpired:
    return None
  return parse_ptxas(r.stdout + r.stderr)


def _tau(tau) -> str:
  return "" if tau is None else f" tau={tau:g}"


def _row(kernel, normalizer, shape, causal, ms, clock, flops, base_ms, status):
  if ms is None:
    print(f"| {kernel} | {normalizer} | {shape} | {causal} | - | - | - | - | {status} |")
    return
  ratio = f"{base_ms / ms:.2f}" if base_ms else "-"
  print(f"| {kernel} | {normalizer} | {shape} | {causal} | {ms:.3f} | {clock} | "
        f"{flops / ms / 1e9:.1f} | {ratio} | {status} |")


def section(args) -> bool:
  """The Mosaic-GPU forward against cuDNN softmax and the Triton kernel, each case
  checked first; False when any check failed."""
  interpret = bool(args.interpret)
  on_gpu = jax.default_backend() == "gpu"
  if args.tiny:
    shapes, check_t, reps = [(1, 128, 2)], 128, args.reps or 1  # (B, T, N)
  else:
    shapes, check_t, reps = [(4, 4096, 16), (1, 16384, 16)], 512, args.reps or 20
  h = 128
  names = NORMALIZERS
  ok_all = True
  print("\n## Mosaic-GPU forward (kp.mosaic_gpu_attention), bf16, H = 128\n")
  print("| kernel | normalizer | B x T x N | causal | ms | clock | TFLOP/s | x cuDNN | status |")
  print("|---|---|---|---|---|---|---|---|---|")
  variants = [(name, None) for name in names] + [
      (name, tau) for name, tau in LAZY.items() if name in names]
  for causal in (False, True):
    checked = {}
    for name, tau in variants:
      kw = {} if tau is None else {"rescale_threshold": tau}
      ok, what = check(name, causal, check_t, interpret, **kw)
      print(f"# mosaic_gpu {name}{_tau(tau)} causal={causal}: {what}", file=sys.stderr)
      checked[name, tau] = ok
      ok_all &= ok
      if tau is not None:
        continue
      if ok and on_gpu and causal:  # the masked (larger) kernel's registers and spills
        rep = ptxas_report(name, causal)
        print(f"# ptxas {name} causal: " + ("no ptxas report in the output (does this "
              "jaxlib honour MOSAIC_GPU_DUMP_PTXAS?)" if rep is None else
              f"{rep[0]} registers, {rep[1]} B spill stores, {rep[2]} B spill loads"
              + (" -- SPILLS" if rep[1] or rep[2] else "")), file=sys.stderr)
    for b, t, n in shapes:
      q, k, v = _inputs(b, t, n, h, jnp.bfloat16)
      flops = 4.0 * b * n * t * t * h * (0.5 if causal else 1.0)
      shape = f"{b} x {t} x {n}"
      base = None
      if on_gpu:
        base, clock = _device_ms(jax.jit(_cudnn(causal)), (q, k, v), reps)
        _row("cudnn", "softmax", shape, causal, base, clock, flops, base, "ok")
      for name, tau in variants:
        label = "mosaic_gpu" + _tau(tau)
        if not checked[name, tau]:
          _row(label, name, shape, causal, None, None, flops, base, "FAIL")
          continue
        kw = {} if tau is None else {"rescale_threshold": tau}
        ms, clock = _device_ms(jax.jit(_mosaic(name, causal, interpret, **kw)), (q, k, v),
                               reps)
        _row(label, name, shape, causal, ms, clock, flops, base, "ok")
        if tau is not None:
          continue
        try:
          ms, clock = _device_ms(jax.jit(_triton(name, causal, interpret)), (q, k, v), reps)
          _row("triton", name, shape, causal, ms, clock, flops, base, "ok")
        except Exception as e:  # noqa: BLE001 - the Triton row is context, not the subject
          print(f"# triton {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
  ok_all &= grad_table(shapes, check_t, reps, interpret, h)
  return ok_all


def grad_table(shapes, check_t: int, reps: int, interpret: bool, h: int = 128) -> bool:
  """The forward+backward table (each normalizer's gradients checked first); False when
  any check failed."""
  on_gpu = jax.default_backend() == "gpu"
  ok_all = True
  print("\n## Mosaic-GPU forward+backward (jax.vjp of kp.mosaic_gpu_attention), bf16, "
        "H = 128\n")
  print("| kernel | normalizer | B x T x N | causal | ms | clock | TFLOP/s | x cuDNN | status |")
  print("|---|---|---|---|---|---|---|---|---|")
  for causal in (False, True):
    checked = {}
    for name in GRAD_NORMALIZERS:
      ok, what = check_grad(name, causal, check_t, interpret)
      print(f"# mosaic_gpu fwd+bwd {name} causal={causal}: {what}", file=sys.stderr)
      checked[name] = ok
      ok_all &= ok
    for b, t, n in shapes:
      q, k, v = _inputs(b, t, n, h, jnp.bfloat16)
      do = _inputs(b, t, n, h, jnp.bfloat16, seed=5)[0]
      flops = 3.5 * 4.0 * b * n * t * t * h * (0.5 if causal else 1.0)
      shape = f"{b} x {t} x {n}"
      args = (q, k, v, do)
      base = None
      if on_gpu:
        base, clock = _device_ms(jax.jit(_fwd_bwd(_cudnn(causal))), args, reps)
        _row("cudnn fwd+bwd", "softmax", shape, causal, base, clock, flops, base, "ok")
      for name in GRAD_NORMALIZERS:
        if not checked[name]:
          _row("mosaic_gpu fwd+bwd", name, shape, causal, None, None, flops, base, "FAIL")
          continue
        ms, clock = _device_ms(jax.jit(_fwd_bwd(_mosaic(name, causal, interpret))), args,
                               reps)
        _row("mosaic_gpu fwd+bwd", name, shape, causal, ms, clock, flops, base, "ok")
        try:
          ms, clock = _device_ms(jax.jit(_fwd_bwd(_triton(name, causal, interpret))), args,
                                 reps)
          _row("triton fwd+bwd", name, shape, causal, ms, clock, flops, base, "ok")
        except Exception as e:  # noqa: BLE001 - the Triton row is context, not the subject
          print(f"# triton fwd+bwd {name}: {type(e).__name__}: {str(e)[:200]}",
                file=sys.stderr)
  return ok_all
