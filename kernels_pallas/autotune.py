"""Autotuned block shapes for the Pallas attention engine (catalogue row K06).

K06 collects the FlashAttention-2/3/4 speed tricks; this module is its "larger and tuned
tiles per backend" part. The best tile shape depends on the chip, the dtype, the head dim,
the sequence lengths and the mask, so :func:`autotune_block_sizes` times the jitted
forward + backward (``value_and_grad`` of a scalar loss) of :func:`kernels_pallas.attention`
for each legal candidate of :func:`candidate_block_sizes` and returns the fastest. Every
candidate's output (and gradients, ``check=True``) is first compared with the default
shape's (``engine.default_block_sizes``); a candidate that disagrees is rejected, never
chosen. Results are cached per (backend, device kind, dtype, power-of-two buckets of T
and S, head dims, normalizer, static flags); :func:`clear_autotune_cache` empties it.

What is tuned, and why: the forward tile (block_q x block_k) and one tile for both
backward passes (dK/dV and dQ). Larger tiles amortise the per-block rescale and the
loads of the resident operand (FlashAttention-2 uses 128 x 128 forward tiles on A100/H100
for d <= 128); too large tiles spill registers (Triton) or VMEM (Mosaic).

Bounds used for the candidates:

* Triton: the anchors' measured winners first (tokamax's Pallas-Triton autotuning on an
  H100, bf16, d = 128: forward 128 x 128 with 8 warps and 3 stages, backward 64 x 64 with 4
  warps and 2 stages; ``kernels_pallas.triton.launch_params`` gives those tiles those
  warps and stages), then powers of two >= 16 (Triton's rule), at most the next power of
  two of T (query blocks) or S (key blocks). Register/shared-memory bound: a forward tile
  keeps a q tile and an fp32 accumulator (block_q x d) plus a k and a v tile (block_k x d) and the score
  tile (block_q x block_k); we require ``(block_q + block_k) * d_pad <= 32768`` elements
  and ``block_q * block_k <= 16384`` (the 128 x 128 tile of FlashAttention-2 at d = 128 is
  the largest), with ``d_pad`` the next power of two of the larger head dim. The backward
  passes hold about twice as many tiles, so their bound is half of that. The default tiles
  also run with 3 and 4 software-pipeline stages (``BlockSizes.num_stages``; the default
  is 2, and Hopper's FlashAttention kernels keep 3-4 loads in flight): each stage buffers
  a k and a v tile in shared memory, 4 x 2 x 64 x 128 bf16 = 128 KiB at most for those
  tiles, under the 227 KiB of an H100/H200.
* Mosaic TPU: multiples of 128 (lanes; legal for key blocks even when an array is blocked
  along the keys) up to 1024 (2048 for d <= 64), at most T or S rounded up to 128: the
  working set ``(block_q + 2 block_k) * d`` stays a few MiB of the 16-32 MiB VMEM.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import engine as E
from kernels_pallas.backends import BACKENDS, pick_backend
from kernels_pallas.engine import BlockSizes
from kernels_pallas.triton import ANCHOR_BACKWARD, ANCHOR_FORWARD

__all__ = ["autotune_block_sizes", "candidate_block_sizes", "clear_autotune_cache",
           "AutotuneResult", "TRITON_TILE_ELEMS", "TRITON_SCORE_ELEMS"]

TRITON_TILE_ELEMS = 32768  # (block_q + block_k) * d_pad, forward; half for the backward
TRITON_SCORE_ELEMS = 16384  # block_q * block_k, forward; half for the backward

_CACHE: dict[tuple, BlockSizes] = {}
LAST_RESULT: AutotuneResult | None = None


@dataclasses.dataclass
class AutotuneResult:
  """What the last tuning saw: seconds per candidate, and the rejected ones with errors."""

  best: BlockSizes
  times: dict[BlockSizes, float]
  rejected: dict[BlockSizes, str]
  cached: bool = False


def clear_autotune_cache() -> None:
  """Forgets every tuned shape (the next :func:`autotune_block_sizes` call re-times).

  Examples:
    >>> from kernels_pallas import clear_autotune_cache
    >>> clear_autotune_cache()
  """
  _CACHE.clear()


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def _round_up(x: int, m: int) -> int:
  return -(-int(x) // m) * m


def candidate_block_sizes(backend: str, t: int, s: int, head_dim: int,
                          head_dim_v: int | None = None) -> list[BlockSizes]:
  """Legal candidate block shapes for ``backend``, the default first.

  Forward tile (block_q, block_k) and one backward tile for both passes, within the
  register / shared-memory (Triton) or VMEM and lane (Mosaic) bounds of the module
  docstring.

  Args:
    backend: ``"triton"`` or ``"mosaic_tpu"``.
    t, s: query and key lengths.
    head_dim, head_dim_v: head dimensions of q/k and of v (default ``head_dim``).

  Returns:
    A list of resolved ``BlockSizes``, the backend's default first.

  Examples:
    >>> from kernels_pallas import candidate_block_sizes
    >>> cands = candidate_block_sizes("mosaic_tpu", 1024, 1024, 128)
    >>> all(c.block_q % 128 == 0 and c.block_k % 128 == 0 for c in cands), len(cands) > 1
    (True, True)
  """
  if backend not in BACKENDS:
    raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
  for name, x in (("t", t), ("s", s), ("head_dim", head_dim), ("head_dim_v", head_dim_v)):
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer))
                          or x <= 0):
      raise ValueError(f"`{name}` must be a positive int, got {x!r}")
  hv = head_dim if head_dim_v is None else head_dim_v
  default = E.default_block_sizes(backend, t, s, head_dim).resolved()
  out = [default]
  if backend == "mosaic_tpu":
    cap = 2048 if max(head_dim, hv) <= 64 else 1024
    qs = [x for x in (128, 256, 512, 1024, 2048) if x <= min(cap, _round_up(t, 128))]
    ks = [x for x in (128, 256, 512, 1024, 2048) if x <= min(cap, _round_up(s, 128))]
    qs, ks = qs or [128], ks or [128]
    for bq in qs:
      for bk in ks:
        if bq >= 256 or bk >= 256 or (bq == bk == 128):
          out.append(BlockSizes(bq, bk, bq, bk, bq, bk))
  else:
    d = _next_pow2(max(head_dim, hv, 16))
    tq, ts = max(16, _next_pow2(t)), max(16, _next_pow2(s))
    sizes = (16, 32, 64, 128, 256)

    def fits(bq, bk, div):
      return ((bq + bk) * d <= TRITON_TILE_ELEMS // div
              and bq * bk <= TRITON_SCORE_ELEMS // div)

    fwd = [(bq, bk) for bq in sizes for bk in sizes
           if bq <= tq and bk <= ts and bq >= 32 and bk >= 32 and fits(bq, bk, 1)]
    bwd = [(bq, bk) for bq in sizes for bk in sizes
           if bq <= tq and bk <= ts and bq >= 32 and bk >= 32 and fits(bq, bk, 2)]
    fwd = fwd or [(default.block_q, default.block_k)]
    assert default.block_q_dkv is not None and default.block_k_dkv is not None  # resolved
    bwd = bwd or [(default.block_q_dkv, default.block_k_dkv)]
    # The anchors' measured winners first (the starting point: a 128 x 128 forward tile
    # with 8 warps and 3 stages, 64 x 64 backward tiles with 4 warps and 2 stages, which
    # the Triton driver gives these tiles by default: triton.launch_params), then forward
    # tiles with the default backward, the default forward with larger backward tiles,
    # and large forward x large backward (keeps the list short).
    af, ab = ANCHOR_FORWARD[:2], ANCHOR_BACKWARD[:2]
    if af in fwd and ab in bwd:
      out.append(BlockSizes(*af, *ab, *ab))
    dfb = (default.block_q_dkv, default.block_k_dkv)
    for f in fwd:
      out.append(BlockSizes(*f, *dfb, *dfb))
    for b in bwd:
      out.append(BlockSizes(default.block_q, default.block_k, *b, *b))
    big_f = [f for f in fwd if f[0] * f[1] >= 128 * 64]
    big_b = [b for b in bwd if b[0] * b[1] >= 64 * 64]
    for f in big_f:
      for b in big_b:
        out.append(BlockSizes(*f, *b, *b))
    for stages in (3, 4):  # deeper pipelining of the default tiles
      out.append(dataclasses.replace(default, num_stages=stages))
  seen, uniq = set(), []
  for c in out:
    c = c.resolved()
    if c not in seen:
      seen.add(c)
      uniq.append(c)
  return uniq


def _default_timer(fn: Callable[[], Any], reps: int = 3) -> float:
  """Median seconds of ``fn()`` over ``reps`` runs, after an excluded warm-up call."""
  jax.block_until_ready(fn())
  ts = []
  for _ in range(max(1, reps)):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def _bucket(x: int) -> int:
  return _next_pow2(max(1, int(x)))


def _freeze(x):
  if isinstance(x, dict):
    return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
  if isinstance(x, (list, tuple)):
    return tuple(_freeze(v) for v in x)
  if isinstance(x, (jax.Array, np.ndarray)):
    return ("array", tuple(x.shape), str(x.dtype))
  try:
    hash(x)
    return x
  except TypeError:
    return repr(x)


def _stand_in(x, seed):
  """A concrete array like the tracer ``x`` (normal values; True for a bool mask)."""
  if not isinstance(x, jax.core.Tracer):
    return x
  if x.dtype == jnp.bool_:
    return np.ones(x.shape, bool)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return np.zeros(x.shape, x.dtype)
  return np.random.default_rng(seed).standard_normal(x.shape).astype(x.dtype)


def _device_kind() -> str:
  try:
    return jax.devices()[0].device_kind
  except Exception:  # pragma: no cover
    return "unknown"


def _tolerance(dtype) -> float:
  return 2e-2 if jnp.dtype(dtype).itemsize <= 2 else 2e-4


def _max_rel_err(got, want) -> float:
  errs = []
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    g = np.asarray(g, np.float32)
    w = np.asarray(w, np.float32)
    if not np.all(np.isfinite(g) == np.isfinite(w)):
      return float("inf")
    fin = np.isfinite(w)
    scale = max(1.0, float(np.max(np.abs(w[fin]), initial=0.0)))
    errs.append(float(np.max(np.abs(g[fin] - w[fin]), initial=0.0)) / scale)
  return max(errs, default=0.0)


def autotune_block_sizes(attention_fn: Callable[..., Any], q, k, v, *,
                         backend: str | None = None, interpret=None,
                         candidates: Sequence[BlockSizes] | None = None,
                         is_causal: bool = False, normalizer="softmax", reps: int = 3,
                         timer: Callable[[Callable[[], Any]], float] | None = None,
                         check: bool = True, use_cache: bool = True,
                         **attention_kwargs) -> BlockSizes:
  """The fastest legal, correct block shape for this attention call (K06).

  Times ``jax.jit(value_and_grad(sum(attention(q, k, v, ...) * ct)))`` for each candidate
  (default: :func:`candidate_block_sizes`), after checking its output (and q/k/v
  gradients when ``check``) against the default shape's within a dtype tolerance
  (float32 2e-4, bf16/fp16 2e-2, relative to the largest magnitude); a disagreeing or
  failing candidate is rejected and reported in ``LAST_RESULT.rejected``.

  Args:
    attention_fn: the function to tune, called as ``attention_fn(q, k, v, normalizer=...,
      is_causal=..., backend=..., interpret=..., block_sizes=..., **attention_kwargs)``:
      :func:`kernels_pallas.attention` (what ``block_sizes="auto"`` passes) or a wrapper.
    q, k, v: the call's arrays (``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, Hv]``).
    backend, interpret: as for :func:`kernels_pallas.attention`; None picks from the
      platform (:func:`kernels_pallas.backends.pick_backend`).
    candidates: the shapes to try (the default shape is always added as the reference).
    timer: ``timer(fn) -> seconds`` for a zero-arg ``fn``; default: median of ``reps``
      ``block_until_ready`` runs after an excluded warm-up.
    use_cache: reuse (and store) the result for the same key.
    **attention_kwargs: further static arguments of ``attention`` (part of the cache key).

  Returns:
    The fastest ``BlockSizes`` whose results agree with the default's
    (``LAST_RESULT`` keeps the times and the rejections).

  Examples:
    On a GPU, ``kp.autotune_block_sizes(kp.attention, q, k, v, is_causal=True)`` times
    every legal candidate. Here, in the interpreter, with one candidate and a stand-in
    timer, the (checked) default wins:

    >>> import kernels_pallas as kp
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 16, 1, 16))
    >>> best = kp.autotune_block_sizes(
    ...     kp.attention, q, k, v, backend="triton", interpret=True, is_causal=True,
    ...     candidates=[], timer=lambda f: 1.0, use_cache=False)
    >>> best == kp.default_block_sizes("triton", 16, 16, 16).resolved()
    True
  """
  global LAST_RESULT
  if backend is None or interpret is None:
    be, interp = pick_backend(backend)
    backend = be
    interpret = interp if interpret is None else interpret
  fn = attention_fn
  t, s = q.shape[-3], k.shape[-3]
  h, hv = q.shape[-1], v.shape[-1]
  key = (backend, bool(interpret), _device_kind(), str(jnp.result_type(q, k, v)),
         _bucket(t), _bucket(s), h, hv, _freeze(normalizer), bool(is_causal),
         _freeze(attention_kwargs), getattr(fn, "__qualname__", repr(fn)),
         None if candidates is None else tuple(candidates))
  if use_cache and key in _CACHE:
    LAST_RESULT = AutotuneResult(_CACHE[key], {}, {}, cached=True)
    return _CACHE[key]

  if any(isinstance(x, jax.core.Tracer)
         for x in jax.tree_util.tree_leaves((q, k, v, attention_kwargs))):
    # Called while tracing (e.g. block_sizes="auto" under jit): tune on concrete stand-ins
    # of the same shapes and dtypes in a fresh thread (JAX's trace state is per thread).
    box: dict[str, BlockSizes] = {}
    errors: list[BaseException] = []

    def work():
      try:
        box["best"] = autotune_block_sizes(
            attention_fn, *(_stand_in(x, i) for i, x in enumerate((q, k, v))),
            backend=backend, interpret=interpret, candidates=candidates,
            is_causal=is_causal, normalizer=normalizer, reps=reps, timer=timer, check=check,
            use_cache=use_cache,
            **jax.tree_util.tree_map(lambda x: _stand_in(x, 3), attention_kwargs))
      except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
        errors.append(e)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    if errors:
      raise errors[0]
    best = box["best"]
    return best

  default = E.default_block_sizes(backend, t, s, h).resolved()
  cands = list(candidate_block_sizes(backend, t, s, h, hv) if candidates is None
               else candidates)
  cands = [c.resolved() for c in cands]
  if default not in cands:
    cands.insert(0, default)
  else:
    cands.remove(default)
    cands.insert(0, default)

  ct = jax.random.normal(jax.random.PRNGKey(0), q.shape[:-1] + (hv,), jnp.float32)

  def make(bl):
    # ct is an argument, not a closure constant: a captured [B, T, N, H] array becomes an
    # HLO constant that XLA constant-folds at every compile (seen on a GPU: > 1 s each).
    def loss(q, k, v, ct):
      out = fn(q, k, v, normalizer=normalizer, is_causal=is_causal, backend=backend,
               interpret=interpret, block_sizes=bl, **attention_kwargs)
      return jnp.sum(out.astype(jnp.float32) * ct), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  tol = _tolerance(jnp.result_type(q, k, v))
  timer = timer or (lambda f: _default_timer(f, reps))
  times, rejected, ref = {}, {}, None
  for bl in cands:
    try:
      f = make(bl)
      (_, out), grads = f(q, k, v, ct)
      res = (out, grads) if check else out
      if ref is None:
        ref = res
      else:
        err = _max_rel_err(res, ref)
        if not err <= tol:
          rejected[bl] = f"max relative error {err:.3g} > {tol:g} vs the default"
          continue
      times[bl] = float(timer(functools.partial(f, q, k, v, ct)))
    except Exception as e:  # noqa: BLE001 - an illegal or failing shape is skipped
      if bl == default:
        raise
      rejected[bl] = f"{type(e).__name__}: {e}"[:300]
  best = min(times, key=lambda b: (times[b], b != default))
  LAST_RESULT = AutotuneResult(best, times, rejected)
  if use_cache:
    _CACHE[key] = best
  return best
