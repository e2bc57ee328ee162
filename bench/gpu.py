"""GPU benchmark of the Pallas kernels, as one short script (under 5 minutes).

Correctness first: for each (normalizer, head dim, causal) the kernel's output and
cotangents are compared with a dense float32 reference at a small length; an op that
fails is reported as FAIL and never timed. Then TFLOP/s, forward and forward+backward,
median of ``--reps`` runs, against ``jax.nn.dot_product_attention(implementation="cudnn")``
and ``tokamax.dot_product_attention`` (when importable), for softmax, softmax_1, sigmoid,
relu, softpick, sparsemax and entmax15 (class T, K03) through this kernel; softmax also
through JAX's own Pallas Triton FlashAttention (``jax.experimental.pallas.ops.gpu.attention
.mha``, deprecated in favour of tokamax but still shipped): the same framework's reference
point, which tells a gap of this kernel from a gap of Pallas Triton itself.

Two more sections (``--sections``), each checked before it is timed:

* ``linear`` (K07): ``simple_gla`` and ``gated_delta_rule`` with ``implementation="pallas"``
  against their XLA chunked form (the baseline), forward and forward+backward milliseconds,
  bf16, B = 4, T = 4096 and B = 1, T = 16384, N = 16, K = V = 128, chunk 64; the check
  compares the output and every cotangent with the chunked form in float32.
* ``ce`` (K08): ``linear_cross_entropy(implementation="pallas")`` against the XLA chunked
  path and optax on the materialised logits (the baseline), forward+backward milliseconds and
  XLA's temporary memory, bf16, tokens x vocab x d = 8192 x 32768 x 1024 and 16384 x 131072 x
  1024 (the issue's sizes need more memory than the materialised baseline leaves: the
  baseline is not run where its logits would exceed 16 GiB).
* ``extras`` (milliseconds, bf16; every op checked first, a failed one is never timed):

  - K06 flags: ``kp.attention(normalizer="softmax", backend="triton")`` with ``exp2=True``,
    ``rescale_threshold=8.0`` and both, forward ms against the same call with the flags off
    (the baseline), H = 128, T in {4k, 16k}, full and causal; checked (output and
    cotangents) against the dense float32 reference.
  - block-sparse (A12): ``jaxsoft.attention.block_sparse_attention(method=moba | bfla |
    prism, block_size=64, top_k_blocks=8, is_causal=True, implementation="pallas")``,
    forward and ``jax.grad`` of a sum, B·T = 16k, N = 16, H = 128, T in {8k, 16k}, against
    dense causal softmax ``kp.attention`` (the baseline); checked (output and cotangents,
    bf16) against ``implementation="xla_chunked"`` of the same call. q and k have topics
    (one random direction per block, plus noise): with i.i.d. inputs the union of a query
    block's per-token choices, which is the kernel's block table, covers every causal block
    (1.000 for all three methods at T = 2048 on CPU). Each row prints that union's share of
    the causal blocks (with topics at T = 8k on CPU: moba 0.55, bfla 0.15, prism 0.54).
  - decode (K05): ``kp.decode_attention`` (split-K, one query token per sequence), B = 8,
    N = 32 query heads on K = 8 KV heads (GQA), H = 128, KV cache of 32k and 128k tokens
    with ragged lengths, against ``jaxsoft.attention.dot_product_attention(
    key_value_seq_lengths=..., implementation="xla")`` (the baseline and the check).

  Each ratio is baseline ms / op ms (above 1: the op is faster), both measured in this run.
* ``autotune`` (K06 tiles): ``kp.autotune_block_sizes`` for softmax attention, bf16,
  H = 128, T in {4k, 16k} (B·T = 16k, N = 16), full and causal: the default shape is
  checked against the dense float32 reference first, every candidate against the default
  (a disagreeing one is rejected); prints the chosen shape and default fwd+bwd ms / chosen
  fwd+bwd ms.

* ``sigmoid`` (K06 ``approx_sigmoid=True``: sigmoid's numerator with tanh.approx.f32,
  FlashSigmoid) and the exact sigmoid kernel against the softmax kernel (the baseline of
  issue 15's goal: sigmoid at least 1.10x softmax forward), forward and ``jax.grad`` of a
  sum, bf16, H = 128, T in {4k, 16k}, full and causal; each checked against the dense
  float32 reference.
* ``fox`` (A08, ACP block pruning): causal softmax ``kp.attention(decay_bias=...,
  decay_prune_threshold=-10)`` against the same call unpruned (the baseline), forward and
  ``jax.grad`` of a sum, bf16, H = 128, T in {4k, 16k}; the decay terms are cumulative log
  forget gates with a per-head mix of memory lengths; both checked against the dense
  float32 reference (the pruned mass is below e^-10). A third row times
  ``score="distance"`` (A18, ``idw_softmax``) with the same decay (the row and column
  operands then carry two terms each) against the unpruned dot-product decay.
* ``fp8`` (K06): ``kp.attention(fp8="e4m3")`` (Hadamard-rotated, block-quantised q and k),
  with the native fp8 dot (the Triton default) and with ``fp8_dot=False`` (the kernel
  multiplies dequantised values), each checked against the bf16 kernel (max / mean abs
  output error printed; fails above 0.25 max abs), then forward ms of each / bf16 at
  H = 128, T in {4k, 16k}, full and causal.

* ``polykv`` (K11): ``kp.polykv_decode_attention`` (split-K decode through a PolyKV cache:
  q8_0 int8 keys, Hadamard-rotated 3-bit Lloyd-Max value codes) against
  ``kp.decode_attention`` on the same cache unquantised in bf16 (the baseline), B = 8,
  N = 32 query heads on K = 8 KV heads, H = 128, S_max of 32k and 128k with ragged
  lengths, ms; checked first against ``polykv_reference`` (attention on the dequantised
  cache, float32; fails above 1e-4) and its error against the exact bf16 decode printed;
  each row prints the bytes per cached token of both caches.
* ``single_pass`` (K12): ``kp.single_pass_softmax`` (Edge-MoE's streamed running max / sum,
  ap_fixed<32, 10> emulated, and the float32 form) against ``jax.nn.softmax`` (XLA, the
  baseline), forward and ``jax.grad`` of a weighted sum, float32, rows x entries of
  65536 x 197 (ViT-S/16 attention rows) and 8192 x 1024, ms; checked first against
  ``js.normalizers.single_pass_softmax`` (fails beyond 4 grid steps + 1e-6) and softmax's
  gradient.
* ``two_pass`` (K05, K06): ``kp.two_pass_softmax`` (Dukhan & Ablavatski's (mantissa,
  exponent) softmax, no max pass), with ``exp="native"`` and ``exp="poly"`` (the software
  exp2), against its jnp reference ``js.normalizers.two_pass_softmax`` under jit (the
  baseline), forward and ``jax.grad`` of a weighted sum, float32 and bf16, rows x n of
  4096 x 4096 and 16384 x 1024, ms; checked first against the reference (fails beyond
  1e-6 in float32, 2^-8 in bf16, and a gradient beyond 1e-5 / 2^-6).
* ``quantized`` (K09): ``kp.quantized_softmax`` (8-bit uniform, 4-bit log2) and
  ``kp.lut_softmax`` (256 entries down to -16) against ``js.normalizers.quantized_softmax``
  / ``lut_softmax`` under jit (the baselines), same shapes, dtypes and columns as
  ``two_pass``; checked first against the reference (in bf16: the reference on x's float32
  values, rounded once, as the kernels compute; a quantised weight may move one
  level where the sum, added in another order, moves it across a boundary: fails beyond
  one level + 1e-6 or on more than 0.1% of the entries; the LUT softmax beyond 1e-6).
* ``blasst`` (K04; bench/gpu_blasst.py): ``kp.blasst_attention`` (BLASST's skip decided
  inside the kernel) against dense causal ``kp.attention``, forward and ``jax.grad`` of a
  sum, bf16, T in {8k, 16k}; checked first against the xla_chunked skip loop (the same
  kept pairs; output and cotangents within 3e-2).
* ``mosaic_gpu`` (bench/gpu_mosaic_gpu.py): ``kp.mosaic_gpu_attention``, the Mosaic-GPU
  (Hopper) forward, unverified on hardware until this section runs, against cuDNN softmax
  and the Triton kernel, bf16, H = 128, T in {4k, 16k}, full and causal, CUPTI device
  time; each normalizer checked first against a float64 dense reference.

FLOPs: 4·B·N·T·S·H for the forward pass (halved for causal); forward+backward counts 3.5x
the forward FLOPs (the backward recomputes QK^T and does four more matmuls: 2.5x).
Shapes: B·T = 16k tokens, N·H = 2048, H in {64, 128}, T in {1k, 4k, 16k}, bf16.

    python bench/gpu.py                      # on a GPU, under 5 minutes
    python bench/gpu.py --interpret --tiny   # on CPU: interpret mode, tiny shapes (a test)
    python bench/gpu.py --sections extras    # only the K06 / block-sparse / decode rows
    python bench/gpu.py --sections polykv,single_pass   # the K11 / K12 rows
    python bench/gpu.py --sections two_pass,quantized   # the K05 / K06 / K09 row kernels
    python bench/gpu.py --sections topk                 # K01, fused softmax + top-k
    python bench/gpu.py --sections blasst               # K04, BLASST's skip in the kernel
    python bench/gpu.py --sections mosaic_gpu           # the Mosaic-GPU (Hopper) forward
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft.normalizers as jn
import kernels_pallas as kp

NORMALIZERS = ("softmax", "softmax_1", "sigmoid", "relu", "softpick", "sparsemax", "entmax15")
SECTIONS = ("attention", "linear", "ce", "extras", "autotune", "fp8", "sigmoid", "fox",
            "polykv", "single_pass", "two_pass", "quantized", "topk", "blasst", "mosaic_gpu")


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
  # ct is an argument: a captured array would be an HLO constant, folded at every compile
  loss = jax.jit(jax.grad(lambda q, k, v, ct: jnp.sum(fn(q, k, v).astype(jnp.float32)
                                                      * ct.astype(jnp.float32)),
                          argnums=(0, 1, 2)))
  t_fb = timeit(loss, (q, k, v, ct), reps)
  return flops / t_f / 1e12, 3.5 * flops / t_fb / 1e12


def ops(args):
  """name -> (normalizer -> fn(q, k, v) or None) for the kernel and the baselines."""
  interpret = bool(args.interpret)

  def ours(normalizer, causal):
    return lambda q, k, v: kp.attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                        backend="triton", interpret=interpret)

  table = {}  # the baselines first: a run cut short still has them for every shape
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
  try:  # JAX's own Pallas Triton FlashAttention: the same framework's reference point
    import warnings

    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      from jax.experimental.pallas.ops.gpu import attention as jax_pallas_mha
    table["jax_pallas_triton"] = lambda normalizer, causal: None if normalizer != "softmax" else (
        lambda q, k, v: jax_pallas_mha.mha(q, k, v, None, sm_scale=1.0 / np.sqrt(q.shape[-1]),
                                           causal=causal, interpret=interpret))
  except ImportError:
    print("# jax.experimental.pallas.ops.gpu.attention not importable: no column",
          file=sys.stderr)
  table["jaxsoft_pallas"] = ours
  return table


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
  p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
  p.add_argument("--normalizers", default=",".join(NORMALIZERS))
  p.add_argument("--reps", type=int, default=None)
  p.add_argument("--json", default=None, help="also write the rows as JSON here")
  p.add_argument("--lengths", default=None,
                 help="comma-separated sequence lengths T for the attention, K06 flag, autotune "
                      "and fp8 rows (default: each section's own)")
  p.add_argument("--head-dims", default=None,
                 help="comma-separated head dims for the attention section (default 64,128)")
  p.add_argument("--sections", default=",".join(SECTIONS),
                 help=f"comma-separated subset of {SECTIONS}")
  args = p.parse_args(argv)
  args.lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
  args.head_dims = [int(x) for x in args.head_dims.split(",")] if args.head_dims else None
  sections = [x for x in args.sections.split(",") if x]
  for x in sections:
    if x not in SECTIONS:
      p.error(f"unknown section {x!r}; choose from {SECTIONS}")
  if args.interpret:  # the js.linear / js.losses entry points read it at call time
    os.environ["JAXSOFT_PALLAS_INTERPRET"] = "1"
  ok = True
  print(f"# backend: {jax.default_backend()}  devices: {jax.devices()}  jax {jax.__version__}")
  if "attention" in sections:
    ok &= attention_section(args)
  if "linear" in sections:
    ok &= linear_section(args)
  if "ce" in sections:
    ok &= ce_section(args)
  if "extras" in sections:
    ok &= extras_section(args)
  if "sigmoid" in sections:
    ok &= _sigmoid_part(args, bool(args.interpret), jnp.bfloat16)
  if "fox" in sections:
    ok &= _fox_part(args, bool(args.interpret), jnp.bfloat16)
  if "autotune" in sections:
    ok &= autotune_section(args)
  if "fp8" in sections:
    ok &= fp8_section(args)
  if "polykv" in sections:
    ok &= polykv_section(args)
  if "single_pass" in sections:
    ok &= single_pass_section(args)
  if "two_pass" in sections:
    ok &= two_pass_section(args)
  if "quantized" in sections:
    ok &= quantized_section(args)
  if "topk" in sections:  # K01: the section lives in bench/gpu_topk.py, beside this script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_topk
    ok &= gpu_topk.section(args)
  if "blasst" in sections:  # K04: bench/gpu_blasst.py, beside this script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_blasst
    ok &= gpu_blasst.section(args, sys.modules[__name__])
  if "mosaic_gpu" in sections:  # bench/gpu_mosaic_gpu.py, beside this script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_mosaic_gpu
    ok &= gpu_mosaic_gpu.section(args)
  return 0 if ok else 1


def attention_section(args) -> bool:
  """The attention engine against cuDNN / tokamax (or jax.nn's XLA path on CPU)."""
  dtype = jnp.bfloat16
  if args.tiny:
    shapes = [(64, 64, 1, 2)]  # (H, T, B, N)
    check_t, reps = 40, args.reps or 2
  else:
    shapes = [(h, t, max(1, 16384 // t), 2048 // h) for h in (args.head_dims or (64, 128))
              for t in (args.lengths or (1024, 4096, 16384))]
    check_t, reps = 512, args.reps or 10
  normalizers = [x for x in args.normalizers.split(",") if x]
  table = ops(args)
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
              # JAX's Pallas reference needs whole 32-row backward blocks; ours takes any T
              t_chk = check_t if name == "jaxsoft_pallas" else -(-check_t // 64) * 64
              checked[key] = check(fn, normalizer, h, causal, t_chk, dtype, tol=3e-2)
            except Exception as e:  # an op that cannot run is reported, never timed
              print(f"# {key}: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
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
  return all(r.status == "ok" for r in rows)


# ----------------------------------------------------------------------------- linear (K07)


def _linear_call(variant: str, implementation: str):
  import jaxsoft.linear as jl

  def f(q, k, v, g, beta):
    if variant == "simple_gla":
      return jl.simple_gla(q, k, v, g, implementation=implementation, chunk_size=64)
    return jl.gated_delta_rule(q, k, v, g, beta, implementation=implementation, chunk_size=64)
  return f


def _linear_inputs(b, t, n, kd, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  q, k, v = (jax.random.normal(kk, (b, t, n, kd), jnp.float32) for kk in ks[:3])
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule's keys are unit vectors
  g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, n))) / 8  # log decays <= 0
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, n)))
  ct = jax.random.normal(ks[5], (b, t, n, kd), jnp.float32)
  cast = lambda x: x.astype(dtype)  # noqa: E731
  return tuple(map(cast, (q, k, v))) + (g, beta, cast(ct))


def _vjp_all(fn, args, ct):
  out, vjp = jax.vjp(fn, *args)
  return (out, *vjp(ct))


def _max_rel_err(got, want) -> float:
  err = 0.0
  for a, r in zip(got, want, strict=True):
    a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
    if not np.all(np.isfinite(a)):
      return float("inf")
    err = max(err, float(np.max(np.abs(a - r))) / max(1.0, float(np.max(np.abs(r)))))
  return err


def linear_section(args) -> bool:
  """Pallas chunk kernels against the XLA chunked form (ms; the ratio is XLA / Pallas)."""
  if args.tiny:
    shapes, check_shape, reps = [(1, 40, 2, 16)], (1, 40, 2, 16), args.reps or 2
  else:
    shapes, check_shape, reps = [(4, 4096, 16, 128), (1, 16384, 16, 128)], (1, 512, 4, 64), (
        args.reps or 10)
  print("\n| op | variant | shape (B, T, N, K) | fwd ms | fwd+bwd ms | "
        "vs XLA chunked fwd | fwd+bwd | status |\n|---|---|---|---|---|---|---|---|")
  ok = True
  for variant in ("simple_gla", "gated_delta_rule"):
    q, k, v, g, beta, ct = _linear_inputs(*check_shape, jnp.float32, seed=1)
    try:
      want, got = (jax.jit(lambda *a, fn=_linear_call(variant, impl): _vjp_all(fn, a[:5], a[5]))(
          q, k, v, g, beta, ct) for impl in ("chunked", "pallas"))
      err = _max_rel_err(got, want)
    except Exception as e:  # a kernel that cannot run is reported, never timed
      print(f"# linear {variant}: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
      err = float("inf")
    passed = err <= 1e-2
    ok &= passed
    for b, t, n, kd in shapes:
      shape = f"{b}, {t}, {n}, {kd}"
      if not passed:
        print(f"| pallas | {variant} | {shape} | - | - | - | - | FAIL (max rel err {err:.2g}) |")
        continue
      args_t = _linear_inputs(b, t, n, kd, jnp.bfloat16)
      times = {}
      for impl in ("chunked", "pallas"):
        fn = _linear_call(variant, impl)
        fwd = jax.jit(fn)
        fb = jax.jit(lambda *a, fn=fn: _vjp_all(fn, a[:5], a[5]))
        times[impl] = (timeit(fwd, args_t[:5], reps) * 1e3, timeit(fb, args_t, reps) * 1e3)
      (xf, xb), (pf, pb) = times["chunked"], times["pallas"]
      print(f"| xla chunked | {variant} | {shape} | {xf:.3g} | {xb:.3g} | 1.00x | 1.00x | ok |")
      print(f"| pallas | {variant} | {shape} | {pf:.3g} | {pb:.3g} | {xf / pf:.2f}x | "
            f"{xb / pb:.2f}x | ok (check err {err:.1e}) |", flush=True)
  return ok


# -------------------------------------------------------------------------------- CE (K08)


def _temp_mib(compiled) -> float | None:
  try:
    m = compiled.memory_analysis()
    return (m.temp_size_in_bytes + m.output_size_in_bytes) / 2**20
  except Exception:  # not every backend reports it
    return None


def ce_section(args) -> bool:
  """linear_cross_entropy: Pallas and XLA chunked against optax on materialised logits."""
  import optax

  import jaxsoft.losses as jlo

  def ours(impl):
    return lambda h, w, y: jnp.sum(jlo.linear_cross_entropy(h, w, y, implementation=impl))

  def optax_ce(h, w, y):
    z = (h @ w).astype(jnp.float32)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(z, y))

  table = {"optax (materialised)": optax_ce, "xla chunked": ours(None), "pallas": ours("pallas")}
  if args.tiny:
    sizes, check_size, reps = [(64, 300, 32)], (64, 300, 32), args.reps or 2
  else:
    sizes, check_size, reps = [(8192, 32768, 1024), (16384, 131072, 1024)], (512, 4096, 256), (
        args.reps or 10)

  def inputs(t, vocab, d, dtype, seed=0):
    kh, kw, ky = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (t, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (d, vocab), jnp.float32) / np.sqrt(d)).astype(dtype)
    return h, w, jax.random.randint(ky, (t,), 0, vocab)

  h, w, y = inputs(*check_size, jnp.float32, seed=1)
  want = jax.jit(jax.value_and_grad(optax_ce, argnums=(0, 1)))(h, w, y)
  passed = {}
  for name, fn in table.items():
    try:
      got = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, w, y)
      err = _max_rel_err((got[0], *got[1]), (want[0], *want[1]))
    except Exception as e:
      print(f"# ce {name}: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
      err = float("inf")
    passed[name] = (err <= 2e-2, err)
  print("\n| op | tokens x vocab x d | fwd+bwd ms | XLA temp+out MiB | time vs optax | "
        "memory vs optax | status |\n|---|---|---|---|---|---|---|")
  for t, vocab, d in sizes:
    hb, wb, yb = inputs(t, vocab, d, jnp.bfloat16)
    res = {}
    for name, fn in table.items():
      ok_, err = passed[name]
      if not ok_:
        res[name] = None
        print(f"| {name} | {t} x {vocab} x {d} | - | - | - | - | FAIL (err {err:.2g}) |")
        continue
      if name.startswith("optax") and t * vocab * 4 > 16 * 2**30:
        res[name] = None
        print(f"| {name} | {t} x {vocab} x {d} | - | - | - | - | not run (logits > 16 GiB) |")
        continue
      grad = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
      mib = _temp_mib(grad.lower(hb, wb, yb).compile())
      res[name] = (timeit(grad, (hb, wb, yb), reps) * 1e3, mib)
    base = res.get("optax (materialised)")
    for name, r in res.items():
      if r is None:
        continue
      ms, mib = r
      tr = f"{ms / base[0]:.2f}x" if base else "-"
      mr = f"{mib / base[1]:.3f}" if base and mib and base[1] else "-"
      mib_s = "-" if mib is None else f"{mib:.0f}"
      print(f"| {name} | {t} x {vocab} x {d} | {ms:.3g} | {mib_s} | {tr} | {mr} | ok |",
            flush=True)
  return all(v[0] for v in passed.values())


# --------------------------------------------- extras: K06 flags, block-sparse, decode


def _try_err(label: str, thunk) -> float:
  """thunk() -> (got, want) tuples; their max relative error, inf when it cannot run."""
  try:
    return _max_rel_err(*thunk())
  except Exception as e:  # an op that cannot run is reported, never timed
    print(f"# {label}: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
    return float("inf")


def _grad_sum(fn):
  """jit of jax.grad of sum(fn(q, k, v)) in q, k and v."""
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                          argnums=(0, 1, 2)))


def _fwd_grad_ms(fn, qkv, reps):
  """[forward ms, jax.grad-of-a-sum ms] of fn(q, k, v)."""
  return [timeit(jax.jit(fn), qkv, reps) * 1e3, timeit(_grad_sum(fn), qkv, reps) * 1e3]


def _ms_row(label, shape, ms, base, status):
  """A table row: ms per column, and base / ms ("x faster than the baseline")."""
  cells = " | ".join("-" if m is None else f"{m:.3g}" for m in ms)
  ratios = " | ".join("-" if m is None or b is None else f"{b / m:.2f}x"
                      for m, b in zip(ms, base, strict=True))
  return f"| {label} | {shape} | {cells} | {ratios} | {status} |"


def _check_all(fns, normalizer_of, h, causal, t, dtype) -> dict[str, bool]:
  """{name: whether fns[name] passes :func:`check` against the dense reference of
  ``normalizer_of(name)`` (bf16 tolerance 3e-2)}; an op that raises fails, with its error
  on stderr."""
  passed = {}
  for name, fn in fns.items():
    try:
      passed[name] = check(fn, normalizer_of(name), h, causal, t, dtype, tol=3e-2)
    except Exception as e:
      print(f"# K06 {name}: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
      passed[name] = False
  return passed


def _k06_part(args, interpret, dtype) -> bool:
  shapes, check_t, reps = _k06_sizes(args, 40, 512)
  if args.tiny:
    reps = args.reps or 2
  flags = {"flags off": {}, "exp2": dict(exp2=True), "rescale 8": dict(rescale_threshold=8.0),
           "exp2 + rescale 8": dict(exp2=True, rescale_threshold=8.0)}
  print("\n| K06 kp.attention softmax | shape | fwd ms | vs flags off | status |\n"
        "|---|---|---|---|---|")
  ok = True
  for causal in (False, True):
    fns = {name: (lambda q, k, v, kw=kw, causal=causal: kp.attention(
        q, k, v, normalizer="softmax", is_causal=causal, backend="triton",
        interpret=interpret, **kw)) for name, kw in flags.items()}
    passed = _check_all(fns, lambda name: "softmax", shapes[0][0], causal, check_t, dtype)
    ok &= all(passed.values())
    for h, t, b, n in shapes:
      shape = f"H={h} T={t} B={b} N={n} {'causal' if causal else 'full'}"
      q, k, v, _ = _inputs(b, t, n, h, dtype)
      base = timeit(jax.jit(fns["flags off"]), (q, k, v), reps) * 1e3 if passed[
          "flags off"] else None
      for name, fn in fns.items():
        if not passed[name]:
          print(f"| {name} | {shape} | - | - | FAIL |")
          continue
        ms = base if name == "flags off" else timeit(jax.jit(fn), (q, k, v), reps) * 1e3
        print(_ms_row(name, shape, [ms], [base], "ok"), flush=True)
  return ok


def _block_sparse_part(args, interpret, dtype) -> bool:
  import jaxsoft.attention as ja

  if args.tiny:
    bs, top, check_bth, reps = 16, 2, (1, 64, 2, 32), args.reps or 2
    shapes = [(1, 64, 2, 32)]  # (B, T, N, H)
  else:
    bs, top, check_bth, reps = 64, 8, (1, 1024, 4, 128), args.reps or 5
    shapes = [(2, 8192, 16, 128), (1, 16384, 16, 128)]

  def sparse(method, impl):
    return lambda q, k, v: ja.block_sparse_attention(
        q, k, v, method=method, block_size=bs, top_k_blocks=top, is_causal=True,
        implementation=impl)

  def dense(q, k, v):
    return kp.attention(q, k, v, normalizer="softmax", is_causal=True, backend="triton",
                        interpret=interpret)

  b0, t0, n0, h0 = check_bth
  try:
    dense_ok = check(dense, "softmax", h0, True, min(t0, 512), dtype, tol=3e-2)
  except Exception as e:
    print(f"# block-sparse dense: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
    dense_ok = False
  q, k, v = _topic_inputs(b0, t0, n0, h0, dtype, block=bs, seed=1)
  ct = _inputs(b0, t0, n0, h0, dtype, seed=2)[3]
  errs = {}
  for method in ("moba", "bfla", "prism"):
    errs[method] = _try_err(f"block-sparse {method}", lambda m=method: tuple(
        jax.jit(lambda *a, fn=sparse(m, impl): _vjp_all(fn, a[:3], a[3]))(q, k, v, ct)
        for impl in ("pallas", "xla_chunked")))
  print(f"\n| block-sparse causal (block {bs}, top {top}; topic inputs) | shape | fwd ms | "
        "grad ms | vs dense fwd | vs dense grad | status |\n|---|---|---|---|---|---|---|")
  for b, t, n, h in shapes:
    shape = f"B={b} T={t} N={n} H={h}"
    qkv = _topic_inputs(b, t, n, h, dtype, block=bs)
    base = _fwd_grad_ms(dense, qkv, reps) if dense_ok else [None, None]
    print(_ms_row("dense kp.attention", shape, base, base, "ok" if dense_ok else "FAIL"))
    for method, err in errs.items():
      if err > 3e-2:
        print(f"| {method} pallas | {shape} | - | - | - | - | FAIL (vs xla_chunked {err:.2g}) |")
        continue
      kept = _kept_fraction(method, top, qkv, bs)
      print(_ms_row(f"{method} pallas", shape, _fwd_grad_ms(sparse(method, "pallas"), qkv, reps),
                    base, f"ok (vs xla_chunked {err:.1e}; kept {kept:.3f} of the causal "
                    "blocks)"), flush=True)
  return dense_ok and all(e <= 3e-2 for e in errs.values())


def _topic_inputs(b, t, n, h, dtype, block: int, topics: int = 32, seed: int = 0):
  """q, k = u_z + noise with one topic z per ``block`` positions (v: noise). With i.i.d.
  random q and k every token of a query block picks different key blocks, and their union
  (the kernel's block table) covers nearly every causal block, so block sparsity cannot
  show; here the tokens of a block agree."""
  ks = jax.random.split(jax.random.key(seed), 5)
  u = jax.random.normal(ks[0], (topics, h))
  u = u / jnp.linalg.norm(u, axis=-1, keepdims=True) * np.sqrt(h)
  z = jnp.repeat(jax.random.randint(ks[1], (-(-t // block),), 0, topics), block)[:t]
  base = u[z][None, :, None, :]
  q, k, v = (base + jax.random.normal(kk, (b, t, n, h)) for kk in ks[2:])
  return q.astype(dtype), k.astype(dtype), (v - base).astype(dtype)


def _kept_fraction(method: str, top: int, qkv, bs: int) -> float:
  """The fraction of the causal (query block, key block) pairs in ``method``'s union table."""
  import jaxsoft.attention as ja

  t = qkv[0].shape[1]
  nb = -(-t // bs)
  kept = jax.jit(lambda q, k, v: ja.block_sparse_attention(
      q, k, v, method=method, block_size=bs, top_k_blocks=top, is_causal=True,
      return_stats=True)[1]["kept"])(*qkv)
  return float(jnp.mean(kept.astype(jnp.float32))) * nb * nb / (nb * (nb + 1) / 2)


def _decode_part(args, interpret, dtype) -> bool:
  import jaxsoft.attention as ja

  if args.tiny:
    shapes, check_shape, reps = [(2, 64)], (2, 64), args.reps or 2  # (B, S_max)
    n, kh, h, block_k = 4, 2, 16, 16
  else:
    shapes, check_shape, reps = [(8, 32768), (8, 131072)], (4, 4096), args.reps or 10
    n, kh, h, block_k = 32, 8, 128, None

  def inputs(b, s, seed=0):
    kq, kk, kv, kl = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, n, h), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(x, (b, s, kh, h), jnp.float32).astype(dtype) for x in (kk, kv))
    lengths = jax.random.randint(kl, (b,), s // 2, s + 1).at[0].set(s)  # ragged, one full
    return q, k, v, lengths

  page = block_k or 128  # the Triton default key block at H = 128

  def pallas(q, k, v, lengths):
    return kp.decode_attention(q, k, v, lengths, backend="triton", interpret=interpret,
                               block_k=block_k)

  def paged(q, k_pool, v_pool, lengths, table):
    return kp.decode_attention(q, k_pool, v_pool, lengths, backend="triton",
                               interpret=interpret, page_table=table)

  def as_pages(q, k, v, lengths):  # the same cache as a shuffled page pool and its table
    k_pool, v_pool, table = _page_pool(k, v, page)
    return q, k_pool, v_pool, lengths, table

  def xla(q, k, v, lengths):
    return ja.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lengths,
                                    implementation="xla")[:, 0]

  # name: (op, its arguments from the contiguous inputs; built before timing)
  ops = {"kp.decode_attention": (pallas, lambda *a: a),
         f"kp.decode_attention, paged ({page})": (paged, as_pages)}
  cargs = inputs(*check_shape, seed=1)
  want = jax.jit(xla)(*cargs)
  errs = {name: _try_err(name, lambda fn=fn, prep=prep: ((jax.jit(fn)(*prep(*cargs)),),
                                                         (want,)))
          for name, (fn, prep) in ops.items()}
  print(f"\n| decode, N={n} K={kh} H={h} | B x S_max | ms | vs XLA | status |\n"
        "|---|---|---|---|---|")
  for b, s in shapes:
    shape = f"{b} x {s}"
    a = inputs(b, s)
    base = timeit(jax.jit(xla), a, reps) * 1e3
    print(_ms_row("xla dot_product_attention", shape, [base], [base], "ok"))
    for name, (fn, prep) in ops.items():
      if errs[name] > 3e-2:
        print(f"| {name} | {shape} | - | - | FAIL (err {errs[name]:.2g}) |")
        continue
      ms = timeit(jax.jit(fn), prep(*a), reps) * 1e3
      print(_ms_row(name, shape, [ms], [base], f"ok (check err {errs[name]:.1e})"),
            flush=True)
  return all(e <= 3e-2 for e in errs.values())


def _page_pool(k, v, page: int, seed: int = 0):
  """Contiguous caches ``[B, S, K, H]`` (S a multiple of ``page``) as a page pool in a
  random order and the table ``[B, S / page]`` of each row's pages."""
  b, s = k.shape[:2]
  order = jax.random.permutation(jax.random.key(seed), b * (s // page)).astype(jnp.int32)

  def pool(x):
    flat = x.reshape(b * (s // page), page, *x.shape[2:])
    return jnp.zeros_like(flat).at[order].set(flat)

  return pool(k), pool(v), order.reshape(b, s // page)


def _sigmoid_part(args, interpret, dtype) -> bool:
  """K06 approx_sigmoid: sigmoid's numerator with tanh.approx.f32 (FlashSigmoid) against
  the exact sigmoid kernel and the softmax kernel (the baseline of issue 15's goal: sigmoid
  at least 1.10x softmax forward); each checked against the dense float32 reference."""
  shapes, check_t, reps = _k06_sizes(args, 40, 512)
  if args.tiny:
    reps = args.reps or 2
  runs = {"softmax": ("softmax", {}), "sigmoid": ("sigmoid", {}),
          "sigmoid approx_sigmoid": ("sigmoid", dict(approx_sigmoid=True))}
  print("\n| K06 sigmoid, kp.attention | shape | fwd ms | grad ms | vs softmax fwd | "
        "vs softmax grad | status |\n|---|---|---|---|---|---|---|")
  ok = True
  for causal in (False, True):
    fns = {name: (lambda q, k, v, nm=nm, kw=kw, causal=causal: kp.attention(
        q, k, v, normalizer=nm, is_causal=causal, backend="triton", interpret=interpret,
        **kw)) for name, (nm, kw) in runs.items()}
    passed = _check_all(fns, lambda name: runs[name][0], shapes[0][0], causal, check_t,
                        dtype)
    ok &= all(passed.values())
    for h, t, b, n in shapes:
      shape = f"H={h} T={t} B={b} N={n} {'causal' if causal else 'full'}"
      qkv = _inputs(b, t, n, h, dtype)[:3]
      base = _fwd_grad_ms(fns["softmax"], qkv, reps) if passed["softmax"] else [None, None]
      for name, fn in fns.items():
        if not passed[name]:
          print(f"| {name} | {shape} | - | - | - | - | FAIL |")
          continue
        ms = base if name == "softmax" else _fwd_grad_ms(fn, qkv, reps)
        print(_ms_row(name, shape, ms, base, "ok"), flush=True)
  return ok


def _fox_decay(b, t, n, seed=0):
  """FoX-style decay terms cq = ck = cumulative log forget gates, a per-head mix of short
  and long memories: gate logits around linspace(1, 6) over the heads (log forget of
  -0.31 to -0.0025 per step)."""
  bias = jnp.linspace(1.0, 6.0, n)[None, None, :]
  z = bias + 0.5 * jax.random.normal(jax.random.key(seed), (b, t, n))
  c = jnp.cumsum(jax.nn.log_sigmoid(z), axis=1)
  return c, c


def _fox_part(args, interpret, dtype) -> bool:
  """A08 + ACP: causal softmax with a FoX decay, ``decay_prune_threshold=-10`` against the
  same call without pruning (the baseline); checked (output and cotangents) against the
  dense float32 reference with the decay, where the pruned mass is below e^-10."""
  import jaxsoft.attention as ja

  shapes, check_t, reps = _k06_sizes(args, 64, 1024)
  if args.tiny:
    reps = args.reps or 2
  runs = {"decay": {}, "decay, pruned at -10": dict(decay_prune_threshold=-10.0),
          "distance + decay (idw_softmax)": dict(score="distance", normalizer="idw_softmax")}

  def call(kw, decay):
    return lambda q, k, v: kp.attention(q, k, v, is_causal=True, decay_bias=decay,
                                        backend="triton", interpret=interpret, **kw)

  def dense(kw, decay):
    kw = {key: x for key, x in kw.items() if key != "decay_prune_threshold"}
    return lambda q, k, v: ja.dot_product_attention(q, k, v, is_causal=True, decay_bias=decay,
                                                    implementation="xla", **kw)

  h0 = shapes[0][0]
  q, k, v, ct = (x.astype(jnp.float32) for x in _inputs(1, check_t, 4, h0, dtype, seed=3))
  decay = _fox_decay(1, check_t, 4, seed=4)
  errs = {name: _try_err(f"FoX {name}", lambda kw=kw: (
      jax.jit(lambda *a: _vjp_all(call(kw, decay), a[:3], a[3]))(q, k, v, ct),
      _vjp_all(dense(kw, decay), (q, k, v), ct))) for name, kw in runs.items()}
  print("\n| A08 FoX decay, causal softmax | shape | fwd ms | grad ms | vs unpruned fwd | "
        "vs unpruned grad | status |\n|---|---|---|---|---|---|---|")
  for h, t, b, n in shapes:
    shape = f"H={h} T={t} B={b} N={n}"
    qkv = _inputs(b, t, n, h, dtype)[:3]
    decay = _fox_decay(b, t, n)
    base = None
    for name, kw in runs.items():
      if errs[name] > 3e-2:
        print(f"| {name} | {shape} | - | - | - | - | FAIL (vs dense {errs[name]:.2g}) |")
        continue
      ms = _fwd_grad_ms(call(kw, decay), qkv, reps)
      base = base or ms
      print(_ms_row(name, shape, ms, base, f"ok (vs dense {errs[name]:.1e})"), flush=True)
  return all(e <= 3e-2 for e in errs.values())


def extras_section(args) -> bool:
  """K06 flags, block-sparse attention and split-K decode, each against its baseline."""
  interpret, dtype = bool(args.interpret), jnp.bfloat16
  ok = _k06_part(args, interpret, dtype)
  ok &= _block_sparse_part(args, interpret, dtype)
  return _decode_part(args, interpret, dtype) and ok



# ----------------------------------------------------------------------------- fp8 (K06)


def _k06_sizes(args, check_tiny: int, check_full: int):
  """(shapes as (H, T, B, N), the check's T, reps) of the K06 sections: T = 4k and 16k at
  H = 128 (B*T = 16k tokens), or one tiny shape with --tiny."""
  if args.tiny:
    return [(64, 64, 1, 2)], check_tiny, args.reps or 1
  lengths = args.lengths or (4096, 16384)
  return [(128, t, max(1, 16384 // t), 16) for t in lengths], check_full, args.reps or 10


def fp8_section(args) -> bool:
  """K06 fp8 forward: the native fp8 dot (``fp8_dot`` default on Triton) and the
  dequantised kernel (``fp8_dot=False``) checked against the bf16 kernel, then fwd ms of
  each against bf16."""
  interpret, dtype = bool(args.interpret), jnp.bfloat16
  shapes, check_t, reps = _k06_sizes(args, 64, 1024)
  print("\n| K06 fp8 e4m3 softmax | shape | bf16 fwd ms | fp8 native fwd ms | fp8 dequantised "
        "fwd ms | native / bf16 | dequantised / bf16 | status |\n|---|---|---|---|---|---|---|---|")
  ok = True
  runs = {"bf16": {}, "native": dict(fp8="e4m3"), "dequantised": dict(fp8="e4m3", fp8_dot=False)}
  for causal in (False, True):
    fns = {name: (lambda q, k, v, kw=kw, causal=causal: kp.attention(
        q, k, v, normalizer="softmax", is_causal=causal, backend="triton",
        interpret=interpret, **kw)) for name, kw in runs.items()}
    q, k, v, _ = _inputs(1, check_t, 2, shapes[0][0], dtype)
    passed = True
    try:
      base = jax.jit(fns["bf16"])(q, k, v).astype(jnp.float32)
      for name in ("native", "dequantised"):
        err = jnp.abs(jax.jit(fns[name])(q, k, v).astype(jnp.float32) - base)
        mx, mean = float(err.max()), float(err.mean())
        passed &= mx < 0.25
        print(f"# fp8 {name} vs bf16 kernel ({'causal' if causal else 'full'}, T={check_t}): "
              f"max abs {mx:.3g}, mean abs {mean:.3g}")
    except Exception as e:
      print(f"# fp8: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
      passed = False
    ok &= passed
    for h, t, b, n in shapes:
      shape = f"H={h} T={t} B={b} N={n} {'causal' if causal else 'full'}"
      if not passed:
        print(f"| fp8 | {shape} | - | - | - | - | - | FAIL |")
        continue
      q, k, v, _ = _inputs(b, t, n, h, dtype)
      ms = {name: timeit(jax.jit(fn), (q, k, v), reps) * 1e3 for name, fn in fns.items()}
      print(f"| fp8 | {shape} | {ms['bf16']:.3g} | {ms['native']:.3g} | "
            f"{ms['dequantised']:.3g} | {ms['native'] / ms['bf16']:.2f} | "
            f"{ms['dequantised'] / ms['bf16']:.2f} | ok |", flush=True)
  return ok


# -------------------------------------------------------------------- PolyKV decode (K11)


def polykv_section(args) -> bool:
  """K11: split-K decode through a PolyKV cache against kp.decode_attention on the bf16
  cache (the baseline); checked against polykv_reference first."""
  from kernels_pallas import polykv

  interpret = bool(args.interpret)
  if args.tiny:
    shapes, check_shape, reps = [(2, 64)], (2, 64), args.reps or 2  # (B, S_max)
    n, kh, h, block_k = 4, 2, 32, 16
  else:
    shapes, check_shape, reps = [(8, 32768), (8, 131072)], (4, 4096), args.reps or 10
    n, kh, h, block_k = 32, 8, 128, None

  def inputs(b, s, seed=0):
    kq, kk, kv, kl = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, n, h), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(x, (b, s, kh, h), jnp.float32).astype(jnp.bfloat16)
            for x in (kk, kv))
    lengths = jax.random.randint(kl, (b,), s // 2, s + 1).at[0].set(s)  # ragged, one full
    return q, k, v, lengths

  def baseline(q, k, v, lengths):
    return kp.decode_attention(q, k, v, lengths, backend="triton", interpret=interpret,
                               block_k=block_k)

  def ours(q, cache, lengths):
    return kp.polykv_decode_attention(q, cache, lengths, backend="triton",
                                      interpret=interpret, block_k=block_k)

  quantize = jax.jit(polykv.polykv_quantize)
  q, k, v, lengths = inputs(*check_shape, seed=1)
  q = q.astype(jnp.float32)  # the check in float32 (a bf16 q gives a bf16 output)
  try:
    cache = quantize(k, v)
    got = jax.jit(ours)(q, cache, lengths)
    err = float(jnp.max(jnp.abs(got - jax.jit(polykv.polykv_reference)(q, cache, lengths))))
    exact = float(jnp.max(jnp.abs(got - jax.jit(baseline)(q, k, v, lengths).astype(
        jnp.float32))))
    print(f"# K11 PolyKV vs polykv_reference: max abs {err:.2g}; vs the exact bf16 decode "
          f"(the quantisation): max abs {exact:.3g}")
  except Exception as e:  # an op that cannot run is reported, never timed
    print(f"# K11 PolyKV: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
    err = float("inf")
  passed = err <= 1e-4  # float32 kernel vs float32 jnp on the same dequantised cache
  print(f"\n| K11 decode, N={n} K={kh} H={h} | B x S_max | ms | vs bf16 decode | status |\n"
        "|---|---|---|---|---|")
  for b, s in shapes:
    shape = f"{b} x {s}"
    q, k, v, lengths = inputs(b, s)
    base = timeit(jax.jit(baseline), (q, k, v, lengths), reps) * 1e3
    print(_ms_row(f"kp.decode_attention bf16 ({4 * h} B/token/head)", shape, [base], [base],
                  "ok"))
    if not passed:
      print(f"| kp.polykv_decode_attention | {shape} | - | - | FAIL (err {err:.2g}) |")
      continue
    cache = quantize(k, v)
    del k, v
    per_token = sum(x.dtype.itemsize * x[0, 0, 0].size for x in (
        cache.k_codes, cache.k_scales, cache.v_codes, cache.v_rho))
    ms = timeit(jax.jit(ours), (q, cache, lengths), reps) * 1e3
    print(_ms_row(f"kp.polykv_decode_attention ({per_token} B/token/head)", shape, [ms],
                  [base], f"ok (check err {err:.1e})"), flush=True)
  return passed


# ---------------------------------------------------------------- single-pass softmax (K12)


def single_pass_section(args) -> bool:
  """K12: the single-pass softmax kernel (fixed point and float32) against jax.nn.softmax
  (the baseline), forward and gradient; each checked against the jnp reference first."""
  interpret = bool(args.interpret)
  if args.tiny:
    shapes, check_shape, reps = [(64, 40)], (48, 37), args.reps or 2  # (rows, entries)
  else:
    shapes, check_shape, reps = [(65536, 197), (8192, 1024)], (1024, 197), args.reps or 10
  runs = {"ap_fixed<32, 10>": (32, 10), "float32": None}

  def ours(fmt):
    return lambda x: kp.single_pass_softmax(x, fixed_point=fmt, backend="triton",
                                            interpret=interpret)

  def grad_of(fn):
    return jax.jit(jax.grad(lambda x, g: jnp.sum(fn(x) * g)))

  x = jax.random.normal(jax.random.key(1), check_shape) * 3.0
  g = jax.random.normal(jax.random.key(2), check_shape)
  want_grad = grad_of(jax.nn.softmax)(x, g)
  errs = {}
  for name, fmt in runs.items():
    step = 2.0 ** -(fmt[0] - fmt[1]) if fmt else 0.0
    try:
      got = jax.jit(ours(fmt))(x)
      ref = jax.jit(lambda x, fmt=fmt: jn.single_pass_softmax(x, fixed_point=fmt))(x)
      err = float(jnp.max(jnp.abs(got - ref)))
      gerr = float(jnp.max(jnp.abs(grad_of(ours(fmt))(x, g) - want_grad)))
      errs[name] = err if (err <= 4 * step + 1e-6 and gerr <= 1e-5) else float("inf")
      print(f"# K12 {name}: vs the jnp reference max abs {err:.2g} (grid step {step:.2g}); "
            f"gradient vs softmax's {gerr:.2g}")
    except Exception as e:
      print(f"# K12 {name}: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
      errs[name] = float("inf")
  print("\n| K12 single-pass softmax | rows x entries | fwd ms | grad ms | vs jax.nn.softmax fwd "
        "| vs jax.nn.softmax grad | status |\n|---|---|---|---|---|---|---|")
  for r, s in shapes:
    shape = f"{r} x {s}"
    x = jax.random.normal(jax.random.key(0), (r, s)) * 3.0
    g = jax.random.normal(jax.random.key(3), (r, s))
    base = [timeit(jax.jit(jax.nn.softmax), (x,), reps) * 1e3,
            timeit(grad_of(jax.nn.softmax), (x, g), reps) * 1e3]
    print(_ms_row("jax.nn.softmax", shape, base, base, "ok"))
    for name, fmt in runs.items():
      if errs[name] == float("inf"):
        print(f"| {name} | {shape} | - | - | - | - | FAIL |")
        continue
      ms = [timeit(jax.jit(ours(fmt)), (x,), reps) * 1e3,
            timeit(grad_of(ours(fmt)), (x, g), reps) * 1e3]
      print(_ms_row(name, shape, ms, base, f"ok (check err {errs[name]:.1e})"), flush=True)
  return all(e != float("inf") for e in errs.values())


# ------------------------------------------- row kernels: two-pass (K05, K06), quantised (K09)


def _row_shapes(args):
  """(timed shapes, check shape, reps) of the row-kernel sections."""
  if args.tiny:
    return [(32, 40)], (24, 37), args.reps or 2
  return [(4096, 4096), (16384, 1024)], (512, 1000), args.reps or 10


def _row_grad(fn):
  return jax.jit(jax.grad(lambda x, g: jnp.sum(fn(x).astype(jnp.float32) * g)))


def _row_section(args, title: str, runs: dict, check) -> bool:
  """Each run ``name -> (kernel fn(x, interpret), reference fn(x))``: checked by
  ``check(name, got, ref, dtype)`` (an error or inf), then timed against its reference under
  jit (the baseline), forward and gradient, float32 and bf16."""
  interpret = bool(args.interpret)
  shapes, check_shape, reps = _row_shapes(args)
  dtypes = {"float32": jnp.float32, "bf16": jnp.bfloat16}
  errs = {}
  x0 = jax.random.normal(jax.random.key(1), check_shape) * 3.0
  g0 = jax.random.normal(jax.random.key(2), check_shape)
  for name, (ours, ref) in runs.items():
    for dname, dt in dtypes.items():
      key = (name, dname)
      try:
        x = x0.astype(dt)
        got = jax.jit(lambda x, ours=ours: ours(x, interpret))(x)
        # the kernels compute in float32 and round once on output: the reference on the
        # float32 values of x, rounded to x's dtype (a bf16 reference rounds p first)
        ref32 = (lambda x, ref=ref: ref(x.astype(jnp.float32)).astype(x.dtype))
        want = jax.jit(ref32)(x)
        gerr = float(jnp.max(jnp.abs(_row_grad(lambda x, ours=ours: ours(x, interpret))(x, g0)
                                     - _row_grad(ref32)(x, g0))))
        err = check(name, np.asarray(got, np.float32), np.asarray(want, np.float32), dname)
        gtol = 1e-5 if dname == "float32" else 2.0 ** -6
        errs[key] = err if gerr <= gtol else float("inf")
        print(f"# {title} {name} {dname}: vs the jnp reference {err:.2g}; gradient {gerr:.2g}")
      except Exception as e:
        print(f"# {title} {name} {dname}: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
        errs[key] = float("inf")
  print(f"\n| {title} | rows x n | fwd ms | grad ms | vs reference fwd | vs reference grad "
        "| status |\n|---|---|---|---|---|---|---|")
  for r, n in shapes:
    for dname, dt in dtypes.items():
      shape = f"{r} x {n} {dname}"
      x = (jax.random.normal(jax.random.key(0), (r, n)) * 3.0).astype(dt)
      g = jax.random.normal(jax.random.key(3), (r, n))
      bases: dict = {}  # one baseline per reference (the two-pass runs share theirs)
      for name, (ours, ref) in runs.items():
        if ref not in bases:
          bases[ref] = [timeit(jax.jit(ref), (x,), reps) * 1e3,
                        timeit(_row_grad(ref), (x, g), reps) * 1e3]
          print(_ms_row(f"{name}: jnp reference", shape, bases[ref], bases[ref], "ok"))
        base = bases[ref]
        if errs[(name, dname)] == float("inf"):
          print(f"| {name} | {shape} | - | - | - | - | FAIL |")
          continue
        fn = functools.partial(ours, interpret=interpret)
        ms = [timeit(jax.jit(fn), (x,), reps) * 1e3, timeit(_row_grad(fn), (x, g), reps) * 1e3]
        print(_ms_row(name, shape, ms, base, f"ok (check err {errs[(name, dname)]:.1e})"),
              flush=True)
  return all(e != float("inf") for e in errs.values())


def two_pass_section(args) -> bool:
  """K05 / K06: the two-pass softmax kernel (native exp, software exp2) against its jnp
  reference under jit; each checked against the reference first."""
  ref = jn.two_pass_softmax
  runs = {f"kp.two_pass_softmax exp={e}": (
      lambda x, interpret, e=e: kp.two_pass_softmax(x, exp=e, backend="triton",
                                                    interpret=interpret), ref)
          for e in ("native", "poly")}

  def check(name, got, want, dname):
    err = float(np.max(np.abs(got - want)))
    return err if err <= (1e-6 if dname == "float32" else 2.0 ** -8) else float("inf")
  return _row_section(args, "K05 two-pass softmax", runs, check)


def quantized_section(args) -> bool:
  """K09: the quantised-softmax and LUT-softmax kernels against their jnp references under
  jit; each checked against the reference first."""
  quant = {"uniform 8-bit": (8, "uniform"), "log2 4-bit": (4, "log2")}
  runs = {}
  for label, (bits, method) in quant.items():
    runs[f"kp.quantized_softmax {label}"] = (
        lambda x, interpret, b=bits, m=method: kp.quantized_softmax(
            x, b, method=m, backend="triton", interpret=interpret),
        lambda x, b=bits, m=method: jn.quantized_softmax(x, b, method=m))
  runs["kp.lut_softmax 256 to -16"] = (
      lambda x, interpret: kp.lut_softmax(x, backend="triton", interpret=interpret),
      jn.lut_softmax)

  def check(name, got, want, dname):
    diff = np.abs(got - want)
    low = 1e-6 if dname == "float32" else 2.0 ** -8
    if "lut" in name:
      return float(diff.max()) if diff.max() <= low else float("inf")
    step = (1.0 / 255) if "uniform" in name else 0.5  # one level (log2: up to 1/2 - 1/4)
    moved = float(np.mean(diff > low))
    return float(diff.max()) if (diff.max() <= step + low and moved <= 1e-3) else float("inf")
  return _row_section(args, "K09 quantised softmax", runs, check)


# ----------------------------------------------------------------------------- autotune (K06)


def autotune_section(args) -> bool:
  """K06 autotuned block shapes: the chosen shape's fwd+bwd time against the default's."""
  from kernels_pallas import autotune as kat

  interpret, dtype = bool(args.interpret), jnp.bfloat16
  shapes, check_t, reps = _k06_sizes(args, 40, 512)
  print("\n| K06 autotune softmax | shape | chosen (fwd q x k, bwd q x k) | default fwd+bwd ms "
        "| chosen fwd+bwd ms | default / chosen | rejected | status |\n"
        "|---|---|---|---|---|---|---|---|")
  ok = True
  for causal in (False, True):
    fn = lambda q, k, v, causal=causal, bl=None: kp.attention(  # noqa: E731
        q, k, v, normalizer="softmax", is_causal=causal, backend="triton",
        interpret=interpret, block_sizes=bl)
    try:
      passed = check(fn, "softmax", shapes[0][0], causal, check_t, dtype, tol=3e-2)
    except Exception as e:
      print(f"# autotune default: {type(e).__name__}: {str(e)[:1500]}", file=sys.stderr)
      passed = False
    for h, t, b, n in shapes:
      shape = f"H={h} T={t} B={b} N={n} {'causal' if causal else 'full'}"
      if not passed:
        print(f"| default | {shape} | - | - | - | - | - | FAIL |")
        ok = False
        continue
      q, k, v, ct = _inputs(b, t, n, h, dtype)
      cands = kat.candidate_block_sizes("triton", t, t, h)
      if args.tiny:
        cands = cands[:3]
      best = kat.autotune_block_sizes(kp.attention, q, k, v, backend="triton", interpret=interpret,
                                      candidates=cands, is_causal=causal,
                                      normalizer="softmax", reps=reps)
      rejected = len(kat.LAST_RESULT.rejected) if kat.LAST_RESULT else 0

      def fwd_bwd(bl, fn=fn):
        return jax.jit(jax.grad(lambda q_, k_, v_, ct_: jnp.sum(
            fn(q_, k_, v_, bl=bl).astype(jnp.float32) * ct_.astype(jnp.float32)),
            argnums=(0, 1, 2)))

      base = timeit(fwd_bwd(None), (q, k, v, ct), reps) * 1e3
      ms = timeit(fwd_bwd(best), (q, k, v, ct), reps) * 1e3
      tile = (f"{best.block_q}x{best.block_k}, {best.block_q_dkv}x{best.block_k_dkv}, "
              f"{best.num_stages or 2} stages")
      print(f"| autotuned | {shape} | {tile} | {base:.3g} | {ms:.3g} | {base / ms:.2f}x | "
            f"{rejected} | ok |", flush=True)
  return ok

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
