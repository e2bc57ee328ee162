"""A Mosaic-GPU (Hopper, sm_90a) attention forward with FlashAttention-3 structure.

UNVERIFIED ON HARDWARE: this kernel has been lowered for CUDA (``jax.export`` assumes
sm_90a and 227 KiB of shared memory when no GPU is present) and run in Pallas's GPU
interpret mode on a CPU, never on an H100/H200. It is therefore not wired into
``implementation="pallas"``; ``bench/gpu.py --sections mosaic_gpu`` checks it against the
XLA path and times it on the next GPU session.

One CTA computes ``2 * block_q`` query rows of one (batch, head): a producer warpgroup
streams key and value tiles into a ``num_stages``-deep shared-memory ring with the TMA
unit (one barrier per slot for "loaded", one for "consumed"), and two consumer
warpgroups of ``block_q`` rows each run both matmuls on the tensor cores (``wgmma``),
ping-ponged by a schedule barrier so one warpgroup's softmax overlaps the other's
matmul. Between the two matmuls sits the normalizer's tile rule
(``jaxsoft.normalizers.TileRule``, the same per-class math the Triton/Mosaic-TPU engine
runs through ``kernels_pallas.engine``). For a query row with scaled logits ``s_j``::

    z_j = score_map(s_j, n)                        n the row's visible count
    m   = running max of z (class E), 0 (S, P)
    O   = sum_j numerator(z_j, m) v_j / D,   D = sum_j denominator(z_j, m) + offset(m, n)

Class E carries ``(m, l, acc)`` and rescales by ``alpha = e^{m - m'}`` when the max
grows; for softmax-like rules (``e^{z - m}`` numerator and denominator, a linear score
map: softmax, softmax_1, softmax_n, softmax_sink, temperature) ``log2(e)`` is folded into
the logits' scale and the tile is ``2^{z2 - m2}`` (one ``ex2`` per score). Class S carries
``(l, acc)``; class P carries ``acc`` only, and sigmoid's numerator is
``0.5 + 0.5 tanh(z / 2)`` (one ``tanh.approx`` per score, ``approx_math``).

Masks as block lists (splash attention's classification of the tiles into empty,
partial and full): query i sees key j when ``j < L_b`` (``key_value_seq_lengths``, read
by the kernel as a scalar of its batch entry), ``i - left <= j <= i + right``
(``local_window_size``) and ``j <= i`` (``is_causal``, top-left aligned as
``jax.nn.dot_product_attention``: ``right = 0``). Each row's visible keys are one
interval whose ends grow with i, so the tiles of a band of rows are classified from
these parameters alone (``_key_block_range``; the dK/dV pass's query blocks per key band,
``_query_block_range``), with no ``T x S`` or block table in memory: the empty blocks
form two runs that are never loaded (the producer streams the CTA's visible blocks),
the full blocks one run with no mask work, and the element mask is applied only on the
partial blocks at either end. Where the two consumer warpgroups of a CTA see different
blocks, each waits on and releases the slots loaded for the other only. A row that sees
no key gets a zero output and zero gradients (its stabiliser stays finite in the tile
math). Odd lengths are padded (queries to ``2 * block_q``, keys to ``block_k``) and the
padded keys masked in the last key block.

Segment ids (``segment_ids``: query i sees key j only when ``q_ids[i] == kv_ids[j]``, and
the masks above allow it) are block lists too, from tables XLA computes per band of 64
query rows (``_bands``): from the band's min and max id, the key interval ``[lo, hi)`` from
the first to the last key whose id lies in ``[min, max]``, and a full run ``[lo, hi)`` when
the band holds one id and every key between carries it (else none). The kernels read the
band's four scalars, intersect them with the interval bounds above (``_clip_to_band``;
a CTA streams the union of its warpgroups' intervals), and mask the partial blocks with
the ids themselves: the rows' ids (as float32 ranks, equal exactly where the ids are)
fetched with the query tile, the keys' streamed through the ring with the key tiles.
Packed (sorted, contiguous) ids make the interval exactly the keys of the band's
segments: a block of other segments is never loaded. Unsorted ids are correct but not
compacted: the interval spans every key whose id lies between the band's extremes, and
its blocks are loaded and masked (slower; class T's ``engine.live_block_tables`` style
compaction was not chosen: one interval keeps the producer's ring and the warpgroups'
skip and release loops as they are). The dK/dV pass uses the same tables per 64-key band
over the query positions. A row's visible count (the length-dependent score maps,
floors and offsets, class R's ``derive``) comes from XLA as a per-row operand, summed
band by band (no ``T x S`` array).

The maps are the rule's own functions, traced with their custom derivatives inlined
(Mosaic GPU lowers no ``custom_jvp``); the row statistics are 1-D ``[block_q]`` vectors in
the wgmma row layout, where ``jaxsoft.normalizers.tile.online_update`` carries ``[bq, 1]``
columns, so that function's steps are written out here (same formulas, same order).
``approx_math`` is on: ``ex2`` and ``tanh`` are the GPU's approximate instructions.

With ``rescale_threshold`` tau (softmax-like rules), a row's max moves only past
``m + tau`` and the accumulator is rescaled under a branch taken only when some row of
the warpgroup moved (FlashAttention-4's conditional rescaling).

Backward (FlashAttention-2's two passes, Dao 2023, with FlashAttention-3's warp
specialisation): differentiated, the forward also writes per-row statistics, and the
backward recomputes each tile's weights from them instead of storing the ``T x S``
weights. The weights do not depend on the stabiliser ``m`` (numerator, denominator and
offset scale alike when it moves), so ``m`` is a constant of the backward; with
``dP_ij = dO_i · v_j`` and ``Δ_i = dO_i · O_i`` (float32, from the rounded output), the tile
rule gives, per class::

    class E, exp2 rules   saved lse2_i = m2_i + log2 D_i:
                          w_ij = 2^{z2_ij - lse2_i},       dz_ij = w_ij (dP_ij - Δ_i)
    class E, other rules  saved m_i and 1 / D_i:
                          w_ij = num(z_ij, m_i) / D_i,
                          dz_ij = (num'(z_ij, m_i) dP_ij - den'(z_ij, m_i) Δ_i) / D_i
    class S               saved 1 / D_i: the same with m = 0
    class P               nothing saved, no Δ:   w_ij = num(z_ij),  dz_ij = num'(z_ij) dP_ij
                          (sigmoid: w = 0.5 + 0.5 tanh(z / 2), num' = w (1 - w))

then ``dx_ij = score_map'(x_ij, n_i) dz_ij`` for the natural-unit logits ``x = scale q·k``
and ``dV_j = sum_i w_ij dO_i``, ``dK_j = scale sum_i dx_ij q_i``, ``dQ_i = scale sum_j
dx_ij k_j``. (For exp2 rules ``D`` includes the offset, so ``w`` sums to less than 1 where
the offset has mass, as in the forward.) The derivatives ``num'``, ``den'`` and
``score_map'`` are the rule's own, taken as forward-mode products ``f'(z)·t`` (every map
is elementwise in its first argument) with custom derivatives inlined.

Two kernels, each with a TMA producer warpgroup and ``W`` wgmma consumer warpgroups
(``W = 2`` for H <= 128, 1 for H = 256, where two ``64 x 256`` float32 accumulators take
all 255 registers a thread has: expect spills there), 64 x 64 tiles and a 2-slot ring:

* dK/dV: a CTA owns ``64 W`` keys of one (batch, query head); each consumer holds its 64
  keys and values in shared memory and loops over query blocks streamed with their
  ``dO`` and row statistics, computing in the transposed orientation (keys as rows)
  ``S^T = K Q^T``, ``dP^T = V dO^T``, then ``dV += W^T dO`` and ``dK += dX^T Q``. Causal:
  the loop starts at the first query block that sees the keys (the masked diagonal block,
  then unmasked ones); the CTA's second warpgroup waits on and releases the slots loaded
  for the first one before its own start. GQA: dK/dV per query head, summed over each key
  head's query heads in float32 by the caller.
* dQ: a CTA owns ``64 W`` query rows; keys and values stream through the ring as in the
  forward, ``dQ += dX K``. Causal: the loop stops at the diagonal (a warpgroup that stops
  earlier releases the slots loaded for the other).

Class T runs in ``kernels_pallas.mosaic_gpu_threshold`` (its backward in
``kernels_pallas.mosaic_gpu_threshold_backward``) and class R in
``kernels_pallas.mosaic_gpu_row_stats``: a statistics kernel, then this forward running the
rule's second pass with the derived per-row hyperparameters as ``[B, N, Tp]`` operands
(``_Cfg.row_hp``); its backward runs the dQ kernel (which also sums the derived
hyperparameters' cotangents), a dQ kernel of the statistics' own gradient and the dK/dV
kernel with that gradient's tile cotangent added to ``dx``.

Not done yet: dense bias, segment ids for class T,
a compacted block list for unsorted segment ids, per-row hyperparameter arrays from the
caller, tuned configurations and a register-spill check (``MOSAIC_GPU_DUMP_PTXAS=1``) on
a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxsoft.attention.call import gqa_dims
from jaxsoft.attention.differentiation import first_order_only, refuse_unsupported_ad
from jaxsoft.normalizers import spec as _spec
from kernels_pallas.engine import LN2, LOG2E, MAX_RESCALE_THRESHOLD, UnsupportedError

__all__ = ["mosaic_gpu_attention", "gpu_interpret_params", "interpreter_runs_kernel",
           "smem_bytes", "bwd_smem_bytes", "SMEM_LIMIT", "SMEM_SLACK"]

# Hopper's per-CTA dynamic shared memory (227 KiB), what the export assumes without a GPU.
SMEM_LIMIT = 227 * 1024
# What the lowering allocates beyond the tiles of smem_bytes: barriers and alignment
# (2168 bytes measured at 3 ring slots); the wrapper keeps this much free.
SMEM_SLACK = 4096

# The entry points of the kernel classes built on this module's helpers, by class: "T"
# registered by kernels_pallas.mosaic_gpu_threshold, "R" by kernels_pallas.mosaic_gpu_row_stats
# on import (kernels_pallas/__init__ imports both): a registry rather than an import, so that
# the modules form no import cycle.
CLASS_KERNELS: dict[str, Any] = {}

# What the kernel needs from jax.experimental.pallas.mosaic_gpu (checked on first use).
_NEEDED = ("kernel", "wgmma", "copy_gmem_to_smem", "copy_smem_to_gmem", "wait_smem_to_gmem",
           "commit_smem", "barrier_wait", "barrier_arrive", "layout_cast", "Layout", "SMEM",
           "Barrier", "ACC", "TilingTransform", "SwizzleTransform", "set_max_registers",
           "broadcasted_iota", "CompilerParams")


def _plgpu():
  """The Pallas Mosaic-GPU module, or UnsupportedError naming what the installed JAX lacks."""
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except ImportError as e:  # pragma: no cover - every supported JAX has it
    raise UnsupportedError(
        f"mosaic_gpu_attention: jax {jax.__version__} has no "
        f"jax.experimental.pallas.mosaic_gpu ({e})") from e
  missing = [n for n in _NEEDED if not hasattr(plgpu, n)]
  if missing:
    raise UnsupportedError(
        f"mosaic_gpu_attention: jax {jax.__version__}'s pallas.mosaic_gpu lacks "
        f"{', '.join(missing)}")
  return plgpu


def _transposed(plgpu, ref):
  """``ref`` viewed transposed: ``plgpu.transpose_ref`` (JAX <= 0.11) or ``ref.transpose``
  (JAX >= 0.11.2, where transpose_ref was deprecated, then removed in 0.12.1)."""
  transpose_ref = getattr(plgpu, "transpose_ref", None)
  if transpose_ref is not None:
    return transpose_ref(ref, (1, 0))
  return ref.transpose((1, 0))


def gpu_interpret_params(**kwargs):
  """Pallas's GPU interpret-mode parameters (``InterpretGPUParams``) for the installed JAX.

  The GPU interpreter runs a Mosaic-GPU kernel on a CPU, simulating shared memory,
  warpgroups, TMA copies and barriers; ``detect_races=True`` reports a data race. It is
  public as ``jax.pallas.mosaic_gpu.InterpretGPUParams`` from JAX 0.12 and private
  (``jax._src.pallas.mosaic_gpu.interpret.params``) in 0.10 and 0.11.

  Args:
    **kwargs: fields of ``InterpretGPUParams`` (e.g. ``detect_races=True``).

  Returns:
    An ``InterpretGPUParams``; UnsupportedError when the installed JAX has none.

  Examples:
    >>> from kernels_pallas.mosaic_gpu import gpu_interpret_params
    >>> type(gpu_interpret_params()).__name__
    'InterpretGPUParams'

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
    arXiv:2407.08608 (the warp-specialised pipeline the interpreter simulates).
  """
  cls = None
  for path in ("jax.pallas.mosaic_gpu", "jax.experimental.pallas.mosaic_gpu",
               "jax._src.pallas.mosaic_gpu.interpret.params"):
    try:
      module = __import__(path, fromlist=["InterpretGPUParams"])
    except ImportError:
      continue
    cls = getattr(module, "InterpretGPUParams", None)
    if cls is not None:
      break
  if cls is None:
    raise UnsupportedError(
        f"jax {jax.__version__} has no Pallas GPU interpret mode (InterpretGPUParams)")
  return cls(**kwargs)


def _check_cuda_for_causal() -> None:
  """UnsupportedError on a CUDA runtime in [12.8.0, 12.9.1): JAX's own Mosaic-GPU
  FlashAttention refuses causal masking there (a ptxas miscompilation), and so does this
  kernel rather than risk a wrong answer. Nothing to check without the CUDA plugin (an
  export on a CPU runs nothing)."""
  try:
    from jax._src.lib import cuda_versions
  except ImportError:
    return
  if cuda_versions is None:
    return
  version = cuda_versions.cuda_runtime_get_version()
  if 12080 <= version < 12091:
    raise UnsupportedError(
        f"mosaic_gpu_attention: `is_causal=True` is not supported with CUDA runtime {version} "
        "(12.8.0 to 12.9.0 miscompile the causal kernel in ptxas, as JAX's own Mosaic-GPU "
        "attention says); use kernels_pallas.attention")


def interpreter_runs_kernel() -> bool:
  """Whether the installed JAX's GPU interpreter can run this kernel: it needs a rule for
  ``pl.run_state`` (the accumulator handed to the second wgmma), which JAX 0.12.1's
  interpreter has and JAX 0.10.2's lacks. Read from the interpreter's class (private
  module; False when it is absent).

  Returns:
    True when ``mosaic_gpu_attention(..., interpret=True)`` can run here.

  Examples:
    >>> from kernels_pallas.mosaic_gpu import interpreter_runs_kernel
    >>> interpreter_runs_kernel() in (True, False)  # True on JAX 0.12.1, False on 0.10.2
    True

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
    arXiv:2407.08608 (the kernel the interpreter runs).
  """
  try:
    from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret
  except ImportError:
    return False
  return any(hasattr(c, "_interpret_run_state_p") for c in vars(jaxpr_interpret).values()
             if isinstance(c, type))


# Primitives whose body is inlined before the kernel is lowered: the Mosaic-GPU lowering
# has no rule for a custom derivative (jax.nn.relu, jnp.logaddexp are custom_jvp) and the
# kernels need only the primal computation (the backward's map derivatives are traced
# forward-mode products, already plain primitives).
_INLINE = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
           "custom_vjp_call_jaxpr": "fun_jaxpr", "pjit": "jaxpr", "jit": "jaxpr",
           "closed_call": "call_jaxpr"}


def _exp2_exact(p):
  """``2^p`` exact for an integer ``p`` in [-126, 127] (``jnp.ldexp``'s ``pow(2, e)``, which
  the Mosaic-GPU lowering lacks): the power of two built from its exponent bits, times
  ``exp2`` of the fractional part (exactly 1 for an integer ``p``)."""
  e = jnp.clip(jax.lax.round(p), -126.0, 127.0)
  bits = jax.lax.shift_left(e.astype(jnp.int32) + 127, jnp.int32(23))
  return jax.lax.bitcast_convert_type(bits, jnp.float32) * jnp.exp2(p - e)


def _eval_inlined(jaxpr, consts, args):
  """Evaluates ``jaxpr`` with every primitive of :data:`_INLINE` replaced by its body (and
  a negative integer power by the reciprocal of a positive one, ``add_any`` by ``add``,
  ``is_finite(x)`` by ``|x| < inf``, ``2^p`` by :func:`_exp2_exact`)."""
  from jax.extend import core as jex_core

  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    field = _INLINE.get(eqn.primitive.name)
    inner = eqn.params.get(field) if field else None
    if inner is not None:
      if hasattr(inner, "jaxpr"):  # a ClosedJaxpr
        outs = _eval_inlined(inner.jaxpr, inner.consts, invals)
      else:
        outs = _eval_inlined(inner, (), invals)
    elif eqn.primitive.name == "add_any":  # a sum of tangents, as the lowering knows it
      outs = [jax.lax.add(*invals)]
    elif eqn.primitive.name == "is_finite":  # (no lowering rule): |x| < inf, False for NaN
      outs = [jnp.abs(invals[0]) < jnp.inf]
    elif (eqn.primitive.name == "pow" and isinstance(eqn.invars[0], jex_core.Literal)
          and float(eqn.invars[0].val) == 2.0):  # (no lowering rule) 2^p: jnp.ldexp's
      outs = [_exp2_exact(invals[1])]
    elif eqn.primitive.name == "stop_gradient":
      outs = list(invals)
    elif eqn.primitive.name == "integer_pow" and eqn.params["y"] < 0:
      # x^-p as 1 / x^p (the lowering has integer powers >= 2 and x^-1 only; a
      # derivative of 1 / (1 - x), stablemax's, is t x^-2)
      x, p = invals[0], -eqn.params["y"]
      outs = [1.0 / (x if p == 1 else jax.lax.integer_pow(x, p))]
    else:
      outs = eqn.primitive.bind(*invals, **eqn.params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def _primal(fn):
  """``fn`` (of arrays and Python values) with its custom derivatives and nested jits
  inlined, so that the Mosaic-GPU lowering sees plain primitives: its array arguments are
  traced to a jaxpr (the others closed over), which is then evaluated on them."""
  def call(*args, **kwargs):
    # keyword arrays (class R's per-row hyperparameters) are traced arguments too
    names = tuple(kwargs)
    allargs = args + tuple(kwargs[nm] for nm in names)
    is_array = [isinstance(a, jax.Array) or hasattr(a, "aval") for a in allargs]
    arrays = [a for a, x in zip(allargs, is_array, strict=True) if x]

    def flat(*arrs):
      it = iter(arrs)
      vals = [next(it) if x else a for a, x in zip(allargs, is_array, strict=True)]
      return fn(*vals[:len(args)], **dict(zip(names, vals[len(args):], strict=True)))

    closed, shape = jax.make_jaxpr(flat, return_shape=True)(*arrays)
    outs = _eval_inlined(closed.jaxpr, closed.consts, arrays)
    return jax.tree.unflatten(jax.tree.structure(shape), outs)
  return call


@dataclasses.dataclass(frozen=True)
class _Problem:
  """What every Mosaic-GPU kernel's static configuration holds (this module's and
  ``kernels_pallas.mosaic_gpu_threshold``'s): the resolved normalizer, its hyperparameters
  as sorted ``(name, value)`` pairs (hashable), the logits' scale, the causal flag and the
  unpadded lengths; each engine's configuration adds its tiles."""
  spec: Any
  hp: tuple[tuple[str, Any], ...]
  scale: float
  causal: bool
  t: int  # query length (unpadded)
  s: int  # key length (unpadded)

  @property
  def hp_dict(self) -> dict[str, Any]:
    return dict(self.hp)


@dataclasses.dataclass(frozen=True)
class _Cfg(_Problem):
  block_q: int
  block_k: int
  num_stages: int
  exp2: bool  # the class-E rule runs as 2^(z2 - m2)
  approx_sigmoid: bool  # class P sigmoid as 0.5 + 0.5 tanh(z / 2)
  rescale_threshold: float | None = None  # lazy rescaling (exp2 rules), natural units
  window: tuple[int, int] | None = None  # (left, right): query i sees keys i - left .. i + right
  kv_lengths: bool = False  # a per-batch key length array is the kernels' last input
  # class R: the derived per-row hyperparameters of the rule's second pass, operands
  # [B, N, Tp] float32 after the key lengths (kernels_pallas.mosaic_gpu_row_stats)
  row_hp: tuple[str, ...] = ()
  # segment ids: the kernels take the segment operands (_SegOps) after the other inputs
  segments: bool = False

  @property
  def left(self) -> int | None:
    """How far back a query sees (None: unbounded)."""
    return None if self.window is None else self.window[0]

  @property
  def right(self) -> int | None:
    """How far ahead a query sees (None: unbounded; 0 when causal)."""
    if self.causal:
      return 0
    return None if self.window is None else self.window[1]

  @property
  def masked(self) -> bool:
    """Whether some (query, key) pair inside the unpadded lengths is invisible."""
    return self.causal or self.window is not None or self.kv_lengths or self.segments

  @property
  def rule(self) -> _spec.TileRule:
    """The tile rule the kernels run: the spec's, or class R's second pass."""
    if self.spec.kernel_class == "R":
      return self.spec.row_stats.second
    return self.spec.tile

  @property
  def kind(self) -> str:
    """The kernels' class: E, S or P (class R: its second pass's)."""
    kind = self.rule.kernel_class if self.spec.kernel_class == "R" else self.spec.kernel_class
    assert kind is not None
    return kind


def smem_bytes(head_dim: int, dtype, block_q: int = 64, block_k: int = 128,
               num_stages: int = 2) -> int:
  """Shared memory one CTA of the forward kernel allocates, in bytes.

  ``2 block_q H`` query/output tiles (one per consumer warpgroup) plus ``2 num_stages
  block_k H`` key and value ring slots, at the input's item size; the lowering adds
  barriers and alignment (about 2 KiB; the wrapper keeps :data:`SMEM_SLACK` free).
  Hopper allows 227 KiB (:data:`SMEM_LIMIT`).

  Args:
    head_dim: the head dimension H.
    dtype: the input dtype (float16 or bfloat16).
    block_q: rows per consumer warpgroup.
    block_k: keys per ring slot.
    num_stages: ring slots.

  Returns:
    The byte count.

  Examples:
    >>> from kernels_pallas.mosaic_gpu import smem_bytes, SMEM_LIMIT
    >>> smem_bytes(256, jnp.bfloat16, 64, 64, 2) <= SMEM_LIMIT
    True
    >>> smem_bytes(256, jnp.bfloat16, 64, 128, 2) <= SMEM_LIMIT
    False

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
    arXiv:2407.08608.
  """
  item = jnp.dtype(dtype).itemsize
  return item * head_dim * (2 * block_q + 2 * num_stages * block_k)


def _default_blocks(head_dim: int, dtype) -> tuple[int, int, int]:
  """(block_q, block_k, num_stages): JAX's FlashAttention-3 example's tuned 64 x 128 x 2,
  64-key slots for H = 256 so the ring fits 227 KiB."""
  bk = 128 if head_dim <= 128 else 64
  return 64, bk, 2


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _key_block_range(cfg: _Cfg, q0, rows: int, bk: int, end):
  """The key blocks of query rows ``[q0, q0 + rows)``, splash attention's classification
  of the tiles computed from the mask's parameters: ``(lo, flo, fhi, hi)``, int32 scalars
  with ``lo <= flo <= fhi <= hi``; blocks ``[lo, hi)`` hold a key some row sees (the rest
  are empty and never loaded), blocks ``[flo, fhi)`` are full (every row sees every key:
  no mask work), the others partial (the element mask is applied).

  Query i sees key j when ``j < end`` (the key length: S, or the batch entry's
  ``key_value_seq_lengths`` below it), ``j >= i - left`` and ``j <= i + right``
  (:attr:`_Cfg.left`, :attr:`_Cfg.right`; causal is ``right = 0``). Visibility is an
  interval per row whose ends grow with i, so the visible blocks of a band of rows are
  one range: from the first row's first key to the last row's last, full from the last
  row's first key to the first row's last."""
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  left, right = cfg.left, cfg.right
  key_lo: Any = 0 if left is None else jnp.maximum(q0 - left, 0)
  key_hi: Any = end if right is None else jnp.minimum(end, q0 + rows + right)
  full_lo: Any = 0 if left is None else jnp.maximum(q0 + rows - 1 - left, 0)
  full_hi: Any = end if right is None else jnp.minimum(end, q0 + right + 1)
  lo = i32(key_lo) // bk
  hi = jnp.maximum(-(-i32(key_hi) // bk), lo)
  flo = jnp.clip(-(-i32(full_lo) // bk), lo, hi)
  fhi = jnp.clip(i32(full_hi) // bk, flo, hi)
  return lo, flo, fhi, hi


def _within(ranges, cta_lo, cta_hi):
  """A warpgroup's ``(lo, flo, fhi, hi)`` clamped into its CTA's ``[cta_lo, cta_hi)``: the
  same blocks when it has any (the CTA's range is their union), and an empty range at a
  place the CTA streams when it has none (an empty range's ``lo`` may lie past the CTA's
  blocks), so that the steps it skips before ``lo`` and after ``hi`` are exactly the
  CTA's other blocks."""
  lo, flo, fhi, hi = (jnp.clip(x, cta_lo, cta_hi) for x in ranges)
  return lo, flo, fhi, hi


def _query_block_range(cfg: _Cfg, k0, rows: int, bq: int, n_q: int, end):
  """The query blocks that see keys ``[k0, k0 + rows)`` (the dK/dV pass's loop), as
  :func:`_key_block_range`: ``(lo, flo, fhi, hi)``. ``end``: the key length below which
  keys exist (None: keys past S are padding whose gradients are dropped, so need no
  mask); a band with a key at or past ``end`` has no full block."""
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  left, right = cfg.left, cfg.right
  q_lo: Any = 0 if right is None else jnp.maximum(k0 - right, 0)
  q_hi: Any = n_q * bq if left is None else jnp.minimum(k0 + rows + left, n_q * bq)
  if end is not None:
    q_hi = jnp.where(k0 < end, q_hi, q_lo)  # keys past the length: seen by no query
  full_lo: Any = 0 if right is None else jnp.maximum(k0 + rows - 1 - right, 0)
  full_hi: Any = n_q * bq if left is None else jnp.minimum(k0 + left + 1, n_q * bq)
  if end is not None:
    full_hi = jnp.where(k0 + rows <= end, full_hi, 0)
  lo = i32(q_lo) // bq
  hi = jnp.maximum(-(-i32(q_hi) // bq), lo)
  flo = jnp.clip(-(-i32(full_lo) // bq), lo, hi)
  fhi = jnp.clip(i32(full_hi) // bq, flo, hi)
  return lo, flo, fhi, hi


def _visible(cfg: _Cfg, i, j, end):
  """Whether query i sees key j (int32 tiles; ``end`` as in :func:`_key_block_range`,
  None for no length test)."""
  vis = None if end is None else j < end
  for cond in ((None if cfg.left is None else j >= i - cfg.left),
               (None if cfg.right is None else j <= i + cfg.right)):
    if cond is not None:
      vis = cond if vis is None else jnp.logical_and(vis, cond)
  return vis


def _visible_count(cfg: _Cfg, i, end):
  """Query i's visible key count n (float32, of the shape of ``i``), or ``float(S)``
  (a Python number) when every query sees every key."""
  if not cfg.masked:
    return float(cfg.s)
  hi = end if cfg.right is None else jnp.minimum(end, i + cfg.right + 1)
  lo = 0 if cfg.left is None else jnp.maximum(i - cfg.left, 0)
  return jnp.maximum(hi - lo + 0 * i, 0).astype(jnp.float32)  # (i's shape and layout)


# --- segment ids as block lists -----------------------------------------------------------

SEG_BAND = 64  # rows (or keys) per band of the segment block lists: one warpgroup's tile


class _SegOps(NamedTuple):
  """The segment operands of one kernel (:func:`_segment_operands`): ``q_row`` the query
  rows' segment ranks and ``count`` their visible key counts, each ``[B, N, Tp]`` float32
  (streamed or fetched as the row statistics are), ``k_ids`` the keys' ranks ``[B, Sp]``
  float32, ``key_bands`` / ``query_bands`` flat int32 ``[B * bands * 4]`` tables read as
  scalars (:func:`_band`)."""
  q_row: Any
  count: Any
  k_ids: Any
  key_bands: Any
  query_bands: Any


def _segment_ranks(q_ids, kv_ids):
  """Segment ids ``[B, T]``, ``[B, S]`` as float32 ranks, equal exactly where the ids are
  equal: each id's position in the sorted ids of its batch entry (below ``T + S``, exact
  in float32 up to 2^24), so that the kernels compare ids as they compare row statistics."""
  both = jnp.concatenate([q_ids, kv_ids], axis=1)
  srt = jnp.sort(both, axis=1)
  rank = jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="left"))(srt, both)
  rank = rank.astype(jnp.float32)
  return rank[:, :q_ids.shape[1]], rank[:, q_ids.shape[1]:]


def _bands(ids_rows, ids_cols, n_cols: int):
  """Per band of ``SEG_BAND`` rows of ``ids_rows`` ``[B, R]`` (R a multiple of the band),
  the columns whose id may equal one of the band's, as positions ``(lo, hi, full_lo,
  full_hi)`` int32 ``[B, R / SEG_BAND, 4]``: ``[lo, hi)`` from the first to the last column
  ``j < n_cols`` with ``min_band <= id_j <= max_band`` (empty: ``(n_cols, 0)``), and
  ``[full_lo, full_hi) = [lo, hi)`` when the band holds one id and every column between
  carries it (else empty). Sorted (packed) ids make ``[lo, hi)`` exactly the visible
  columns; unsorted ids an interval holding them, whose other blocks are loaded and masked."""
  b, r = ids_rows.shape
  bands = ids_rows.reshape(b, r // SEG_BAND, SEG_BAND)
  bmin, bmax = bands.min(axis=2), bands.max(axis=2)
  cols = ids_cols[:, :n_cols]
  hit = (cols[:, None, :] >= bmin[..., None]) & (cols[:, None, :] <= bmax[..., None])
  any_hit = hit.any(axis=2)
  pos = jnp.arange(n_cols, dtype=jnp.int32)
  lo = jnp.where(hit, pos, n_cols).min(axis=2)
  hi = jnp.where(hit, pos + 1, 0).max(axis=2)
  lo = jnp.where(any_hit, lo, n_cols)
  full = (bmin == bmax) & any_hit & (hit.sum(axis=2) == hi - lo)
  zero = jnp.zeros_like(lo)
  return jnp.stack([lo, hi, jnp.where(full, lo, zero), jnp.where(full, hi, zero)],
                   axis=-1).astype(jnp.int32)


def _segment_counts(cfg: _Cfg, q_rank, kv_rank, kv_lengths):
  """Each query row's visible key count under every mask (segments, key lengths, window,
  causal): float32 ``[B, Tp]`` (``q_rank`` padded), summed band by band of ``SEG_BAND``
  rows (no ``T x S`` array)."""
  b, tp = q_rank.shape
  end = jnp.full((b,), cfg.s, jnp.int32) if kv_lengths is None else \
      jnp.clip(kv_lengths, 0, cfg.s).astype(jnp.int32)
  j = jnp.arange(cfg.s, dtype=jnp.int32)[None, None, :]

  def band(args):
    rows, i0 = args  # [B, SEG_BAND] ranks, the band's first row
    i = (i0 + jnp.arange(SEG_BAND, dtype=jnp.int32))[None, :, None]
    vis = _visible(cfg, i, j, end[:, None, None])
    same = rows[:, :, None] == kv_rank[:, None, :cfg.s]
    return jnp.logical_and(vis, same).sum(axis=2).astype(jnp.float32)

  nb = tp // SEG_BAND
  bands = q_rank.reshape(b, nb, SEG_BAND).transpose(1, 0, 2)
  out = jax.lax.map(band, (bands, jnp.arange(nb, dtype=jnp.int32) * SEG_BAND))
  return out.transpose(1, 0, 2).reshape(b, tp)


def _segment_operands(cfg: _Cfg, segment_ids, n: int, tp: int, sp: int, kv_lengths,
                      query_bands: bool = True):
  """The kernels' segment operands (:class:`_SegOps`) for queries padded to ``tp`` rows
  and keys to ``sp`` (padding repeats the last id, so the bands' ranges are unchanged; the
  padded keys are masked by the key length, the padded rows' results dropped), or None.
  ``query_bands``: also the dK/dV pass's table (the forward kernels need none: nothing is
  computed that no kernel reads, the GPU interpreter's callbacks wait on a small pool)."""
  if segment_ids is None:
    return None
  q_ids, kv_ids = segment_ids
  q_rank, kv_rank = _segment_ranks(q_ids, kv_ids)
  q_pad = jnp.pad(q_rank, ((0, 0), (0, tp - cfg.t)), mode="edge")
  kv_pad = jnp.pad(kv_rank, ((0, 0), (0, sp - cfg.s)), mode="edge")
  count = _segment_counts(cfg, q_pad, kv_rank, kv_lengths)
  per_head = lambda x: jnp.broadcast_to(x[:, None, :], (x.shape[0], n, x.shape[1]))
  return _SegOps(q_row=per_head(q_pad), count=per_head(count), k_ids=kv_pad,
                 key_bands=_bands(q_pad, kv_rank, cfg.s).reshape(-1),
                 query_bands=(_bands(kv_pad, q_rank, cfg.t).reshape(-1) if query_bands
                              else None))


def _band(ref, bi, band, n_bands: int):
  """Band ``band`` of batch entry ``bi`` of a flat band table (:func:`_bands`): its four
  int32 scalars ``(lo, hi, full_lo, full_hi)``."""
  base = (bi * n_bands + band) * 4
  return tuple(ref[base + c] for c in range(4))


def _merge_bands(bands):
  """The union's ``(lo, hi)`` of several bands (a CTA's), no full run."""
  lo = functools.reduce(jnp.minimum, [x[0] for x in bands])
  hi = functools.reduce(jnp.maximum, [x[1] for x in bands])
  return lo, hi, jnp.int32(0), jnp.int32(0)


def _clip_to_band(ranges, seg, blk: int):
  """``(lo, flo, fhi, hi)`` in blocks of ``blk`` intersected with a band's segment ranges
  ``seg`` (positions): visible blocks in both, full blocks full in both."""
  if seg is None:
    return ranges
  lo, flo, fhi, hi = ranges
  s_lo, s_hi, s_flo, s_fhi = seg
  lo = jnp.maximum(lo, s_lo // blk)
  hi = jnp.maximum(jnp.minimum(hi, -(-s_hi // blk)), lo)
  flo = jnp.clip(jnp.maximum(flo, -(-s_flo // blk)), lo, hi)
  fhi = jnp.clip(jnp.minimum(fhi, s_fhi // blk), flo, hi)
  return lo, flo, fhi, hi


def _or_nones(refs, count: int) -> Any:
  """``refs`` (a kernel's segment refs or scratch), or ``count`` Nones without segments."""
  return tuple(refs) if refs else (None,) * count


def _seg_same(mask, rows, cols):
  """``mask`` (None: all visible) and the segment test ``rows == cols`` (broadcast tiles)."""
  same = rows == cols
  return same if mask is None else jnp.logical_and(mask, same)


def _exp2_rule(rule: _spec.TileRule) -> bool:
  """Class E with ``e^{z - m}`` numerator and denominator and a linear score map: exact in
  the log2 domain (``kernels_pallas.engine.exp2_exact``'s condition)."""
  return (rule.uses_max and rule.numerator is _spec.exp_numerator
          and rule.denominator is _spec.exp_numerator
          and rule.score_map in (_spec.identity_score_map, _spec.temperature_score_map))


def _uses_length(rule: _spec.TileRule) -> bool:
  return rule.score_map not in (_spec.identity_score_map, _spec.temperature_score_map)


def _stat_names(cfg: _Cfg) -> tuple[str, ...]:
  """The per-row statistics the forward saves for the backward (each ``[B, N, Tp]``
  float32): ``lse2 = m2 + log2 D`` (class E in the exp2 domain), ``m`` and ``1 / D``
  (other class-E rules), ``1 / D`` (class S), none (class P)."""
  kind = cfg.kind
  if kind == "P":
    return ()
  if cfg.exp2:
    return ("lse2",)
  if kind == "E":
    return ("m", "inv")
  return ("inv",)


def _launch(plgpu, entry, out_type, grid, grid_names, num_threads: int, interpret):
  """``plgpu.kernel`` of ``entry`` with the engine's settings (warpgroup threads named
  ``"wg"``, approximate math; ``interpret`` passed on only when set)."""
  kwargs: dict[str, Any] = {} if interpret is None else {"interpret": interpret}
  return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names,
                      num_threads=num_threads, thread_name="wg",
                      compiler_params=plgpu.CompilerParams(approx_math=True), **kwargs)


# --- the warp-specialised CTA's scaffolding, shared by every kernel here and by
# kernels_pallas.mosaic_gpu_threshold (with _stream, the producer's ring, and _scores) ---

def _specialise(plgpu, wg, consumers: int, consumer, producer) -> None:
  """FlashAttention-3's warp specialisation of a CTA of ``consumers + 1`` warpgroups:
  warpgroups ``0 .. consumers - 1`` run ``consumer()`` (the wgmma math) with their
  register budget raised to 232 per thread (240 when there is one consumer), warpgroup
  ``consumers`` runs ``producer()`` (the TMA copies) with its budget lowered to 40, which
  frees the registers the consumers' accumulators take."""
  from jax.experimental import pallas as pl

  @pl.when(wg < consumers)
  def _consumer():
    plgpu.set_max_registers(232 if consumers == 2 else 240, action="increase")
    consumer()

  @pl.when(wg == consumers)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")
    producer()


def _swizzled(plgpu, shape, dtype):
  """A shared-memory buffer of 16-bit elements laid out as wgmma reads it: 128-byte
  swizzled (8, 64) tiles (every head dim here is at least 64 elements = 128 bytes wide)."""
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                              plgpu.SwizzleTransform(128)))


def _fetch(plgpu, copies) -> None:
  """A consumer warpgroup's resident tiles brought into shared memory: every copy of
  ``copies`` (``(gmem_ref, smem_ref, barrier)`` triples) issued on the TMA unit, then
  each barrier waited on in the same order."""
  for src, dst, barrier in copies:
    plgpu.copy_gmem_to_smem(src, dst, barrier)
  for _, _, barrier in copies:
    plgpu.barrier_wait(barrier)


def _write_back(plgpu, copies) -> None:
  """A consumer warpgroup's results, already written to shared memory, copied out: the
  writes committed (ordered before the TMA unit reads them), each ``(smem_ref,
  gmem_ref)`` of ``copies`` copied to global memory, and the copies waited for (the CTA's
  shared memory is released at its end)."""
  plgpu.commit_smem()
  for src, dst in copies:
    plgpu.copy_smem_to_gmem(src, dst)
  plgpu.wait_smem_to_gmem(0)


def _kv_head(q_head, groups: int):
  """The key/value head read by query head ``q_head`` (grouped-query attention:
  ``groups`` consecutive query heads share one)."""
  return jax.lax.div(q_head, jnp.array(groups, q_head.dtype))


def _cta(seq_axis: str = "q_seq"):
  """Where the running warpgroup is: ``(batch, query head, sequence tile, warpgroup)``,
  the indices of the kernels' grid ``("heads", seq_axis, "batch")`` (:func:`_launch`)
  and of its warpgroup axis ``"wg"``."""
  index = jax.lax.axis_index
  return index("batch"), index("heads"), index(seq_axis), index("wg")


def _slot(step, lo, stages: int):
  """The ring slot of ``step`` in a ring of ``stages`` slots that starts at step ``lo``:
  ``(step - lo) mod stages``."""
  return jax.lax.rem(step - lo, jnp.array(stages, jnp.int32))


def _forward(cfg: _Cfg, q, k, v, interpret, save_stats: bool = False, kv_lengths=None,
             rows=(), seg: _SegOps | None = None):
  """The kernel on padded inputs q [B, Tp, N, H], k/v [B, Sp, K, H] (and the int32 [B]
  ``kv_lengths`` when ``cfg.kv_lengths``; class R: ``rows``, the float32 [B, N, Tp] values
  of the per-row hyperparameters ``cfg.row_hp``; ``seg``: the segment operands when
  ``cfg.segments``); returns [B, Tp, N, H] (``save_stats``: and the tuple of
  :func:`_stat_names`'s ``[B, N, Tp]`` row statistics)."""
  plgpu = _plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  b, tp, n, h = q.shape
  sp, kh = k.shape[1], k.shape[2]
  groups = n // kh
  bq, bk = cfg.block_q, cfg.block_k
  n_kv = sp // bk  # key blocks (the last may hold padding)
  stages = min(cfg.num_stages, n_kv)
  dtype = q.dtype
  rule = cfg.rule
  score_map, numerator = _primal(rule.score_map), _primal(rule.numerator)
  denominator = None if rule.denominator is None else _primal(rule.denominator)
  offset = None if rule.offset is None else _primal(rule.offset)
  hp = cfg.hp_dict
  kind = cfg.kind
  uses_length = _uses_length(rule)
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = wgmma_layout.reduce(1)
  col_layout = wgmma_layout.reduce(0)
  # the logits' factor: scale, times log2(e) in the exp2 domain
  c = cfg.scale * (LOG2E if cfg.exp2 else 1.0)

  def row_floor(length_row, hp):
    if not rule.uses_max:
      return None
    floor = rule.floor_value(length_row, hp)
    if floor is None:
      return None
    return floor * LOG2E if cfg.exp2 else floor

  def bcast(row, shape):
    return lax.broadcast_in_dim(row, shape, [0])

  stat_names = _stat_names(cfg) if save_stats else ()

  n_rh = len(cfg.row_hp)
  n_bands = tp // SEG_BAND

  def kernel(q_ref, k_ref, v_ref, len_ref, hp_refs, seg_refs, out_ref, st_refs, scoped):
    bi, q_head, q_tile, wg = _cta()
    end: Any = cfg.s if len_ref is None else jnp.clip(len_ref[bi], 0, cfg.s)
    smem, loaded, consumed, schedule_barrier, st_smem2, hp_scoped, ks_scoped = scoped
    kseg_ref, bands_ref = _or_nones(seg_refs, 2)
    ks_smem, ks_loaded = _or_nones(ks_scoped, 2)

    def band_of(band):
      return None if bands_ref is None else _band(bands_ref, bi, band, n_bands)
    hp_smem2: Any = hp_scoped[0] if hp_scoped else None
    hp_loaded: Any = hp_scoped[1] if hp_scoped else None
    qo_smem2, k_smem, v_smem = smem
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed

    def schedule():
      plgpu.barrier_arrive(schedule_barrier)
      plgpu.barrier_wait(schedule_barrier)

    # the key blocks the producer streams: those the CTA's rows see (the empty ones skipped)
    cta_seg = None if bands_ref is None else \
        _merge_bands([band_of(2 * q_tile), band_of(2 * q_tile + 1)])
    cta_lo, _, _, cta_hi = _clip_to_band(
        _key_block_range(cfg, q_tile * (2 * bq), 2 * bq, bk, end), cta_seg, bk)
    slot_of = functools.partial(_slot, lo=cta_lo, stages=stages)

    def consumer():
      qo_smem = qo_smem2.at[wg]
      q_base = q_tile * (2 * bq) + wg * bq
      # this warpgroup's blocks: [lo, flo) and [fhi, hi) partial (masked), [flo, fhi) full
      lo, flo, fhi, hi = _within(_clip_to_band(_key_block_range(cfg, q_base, bq, bk, end),
                                               band_of(2 * q_tile + wg), bk), cta_lo, cta_hi)
      q_rows = (bi, pl.ds(q_base, bq), q_head)
      rows_at = (bi, q_head, pl.ds(q_base, bq))
      _fetch(plgpu, [(q_ref.at[q_rows], qo_smem, q_loaded.at[wg])]
             + [(ref.at[rows_at], hp_smem2.at[i, wg], hp_loaded.at[2 * i + wg])
                for i, ref in enumerate(hp_refs)])
      # class R's derived hyperparameters: [bq] rows (offset, floor), broadcast to the
      # [bq, bk] tile where the tile maps take them (built at each use, not held)
      hp_rows = {**hp, **{nm: _load_row(plgpu, hp_smem2.at[i, wg], row_layout)
                          for i, nm in enumerate(cfg.row_hp)}}
      # segments: the rows' segment ranks and visible counts (after class R's rows)
      seg_row = cnt_row = None
      if cfg.segments:
        seg_row = _load_row(plgpu, hp_smem2.at[n_rh, wg], row_layout)
        cnt_row = _load_row(plgpu, hp_smem2.at[n_rh + 1, wg], row_layout)

      def tile_hp():
        return {**hp, **{nm: bcast(hp_rows[nm], (bq, bk)) for nm in cfg.row_hp}}

      def iota(axis):  # built where used: a [bq, bk] array held across the loop costs
        # registers the accumulator needs
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=wgmma_layout)

      def lengths():
        """The rows' visible counts n as a [bq, bk] tile (S without a mask)."""
        if cnt_row is not None:
          return bcast(cnt_row, (bq, bk))
        return _visible_count(cfg, iota(0) + q_base, end)

      length_row: Any = float(cfg.s) if not cfg.masked else (
          cnt_row if cnt_row is not None else lengths().max(axis=1))
      floor = row_floor(length_row, hp_rows)

      m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf if rule.uses_max else 0.0,
                                       jnp.float32), row_layout)
      l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
      acc = plgpu.layout_cast(jnp.full((bq, h), 0.0, jnp.float32), wgmma_layout)

      pl.when(wg == 1)(schedule)

      def skip(kv_step, _):
        # a block the producer loaded for the other warpgroup only (its rows see earlier
        # keys): waited on (each barrier's phases in order) and released, the schedule
        # barrier passed twice as a step does
        slot = slot_of(kv_step)
        plgpu.barrier_wait(k_loaded.at[slot])
        plgpu.barrier_wait(v_loaded.at[slot])
        if ks_loaded is not None:
          plgpu.barrier_wait(ks_loaded.at[slot])
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_arrive(v_consumed.at[slot])
        schedule()
        schedule()

      if cfg.left is not None or cfg.segments:  # (the rows of warpgroup 1 start later)
        lax.fori_loop(cta_lo, lo, skip, None)

      @pl.when(lo < hi)
      def _():
        plgpu.barrier_wait(k_loaded.at[slot_of(lo)])

      def safe_max(m_new, mask):
        # a row none of whose keys so far is visible keeps m = -inf; 0 stands in for it
        # (its terms are 0 and its sums 0, not e^(-inf + inf))
        if mask is None or floor is not None:
          return m_new
        return jnp.where(m_new == -jnp.inf, 0.0, m_new)

      def tile_rule(x, mask, m_i, l_i):
        """(numerators [bq, bk], denominators (the same array when the rule's two maps
        are one function; None for class P), m', alpha·l, alpha or None) of one block of
        logits x."""
        if mask is not None:
          x = jnp.where(mask, x, 0.0)
        length_tile = lengths() if uses_length else float(cfg.s)  # (unused then)
        hp = tile_hp()
        alpha: Any
        if cfg.exp2:
          z = score_map(x, length_tile, **hp)
          zm = z if mask is None else jnp.where(mask, z, -jnp.inf)
          m_new = jnp.maximum(m_i, zm.max(axis=1))
          if floor is not None:
            m_new = jnp.maximum(m_new, floor)
          if cfg.rescale_threshold is not None:  # move m only past m + tau (log2 units)
            m_new = jnp.where(m_new > m_i + cfg.rescale_threshold * LOG2E, m_new, m_i)
          m_use = safe_max(m_new, mask)
          alpha = jnp.exp2(m_i - m_use)  # exactly 1 where m stayed
          p = jnp.exp2(zm - bcast(m_use, zm.shape))
          return p, p, m_new, l_i * alpha, alpha
        z = score_map(x, length_tile, **hp)
        alpha = None
        if kind == "E":
          zm = z if mask is None else jnp.where(mask, z, -jnp.inf)
          m_new = jnp.maximum(m_i, zm.max(axis=1))
          if floor is not None:
            m_new = jnp.maximum(m_new, floor)
          m_use = safe_max(m_new, mask)
          alpha = jnp.exp(m_i - m_use)
          l_i = l_i * alpha
          m_b = bcast(m_use, z.shape)
        else:
          m_new = m_i
          m_b = 0.0
        if cfg.approx_sigmoid:
          num = 0.5 + 0.5 * jnp.tanh(0.5 * z)
        else:
          num = numerator(z, m_b, **hp)
        if mask is not None:
          num = jnp.where(mask, num, 0.0)
        den = None
        if kind != "P":
          den = num
          if denominator is not None and rule.denominator is not rule.numerator:
            den = denominator(z, m_b, **hp)
            if mask is not None:
              den = jnp.where(mask, den, 0.0)
        return num, den, m_new, l_i, alpha

      def kv_loop(kv_step, carry, masked: bool = False):
        acc, m_i, l_i = carry
        slot = slot_of(kv_step)

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, _transposed(plgpu, k_smem.at[slot]))
          schedule()
          return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((bq, bk), jnp.float32))
        key_seg = None
        if ks_loaded is not None:  # (waited at every step: the barrier's phases in order)
          plgpu.barrier_wait(ks_loaded.at[slot])
          if masked:
            key_seg = _load_row(plgpu, ks_smem.at[slot], col_layout)
            plgpu.commit_smem()  # the reads ordered before the slot's next TMA write
        plgpu.barrier_arrive(k_consumed.at[slot])
        x = qk * c
        mask = None
        if masked:
          mask = _visible(cfg, iota(0) + q_base, iota(1) + kv_step * bk, end)
          if key_seg is not None:
            mask = _seg_same(mask, bcast(seg_row, (bq, bk)),
                             lax.broadcast_in_dim(key_seg, (bq, bk), [1]))
        p, den, m_i, l_i, alpha = tile_rule(x, mask, m_i, l_i)
        if alpha is not None and cfg.rescale_threshold is not None:
          # lazy: the accumulator is rescaled only when some row of the warpgroup moved
          # its stabiliser (a factor of exactly 1 is skipped: the same result)
          acc = lax.cond(jnp.min(alpha) < 1.0, lambda a: a * bcast(alpha, a.shape),
                         lambda a: a, acc)
        elif alpha is not None:
          acc = acc * bcast(alpha, acc.shape)
        p16 = p.astype(dtype)
        sums = den is not None

        def end_softmax():
          plgpu.barrier_arrive(schedule_barrier)  # done with the tile rule
          plgpu.barrier_wait(v_loaded.at[slot])
          plgpu.barrier_wait(schedule_barrier)  # the tensor cores are free

        # the order of the row sum and the barriers is the example's (head dim <= 128: sum
        # first, fenced by an optimization barrier)
        if h <= 128:
          if sums:
            l_i = l_i + den.sum(axis=1)
          acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
          end_softmax()
        else:
          end_softmax()
          if sums:
            l_i = l_i + den.sum(axis=1)

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
          wait_step = kv_step + 1
          wait_slot = slot_of(wait_step)

          @pl.when(wait_step < hi)
          def _wait():
            plgpu.barrier_wait(k_loaded.at[wait_slot])

        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_i, l_i

      masked_loop = functools.partial(kv_loop, masked=True)
      carry = (acc, m_i, l_i)
      if cfg.masked:
        carry = lax.fori_loop(lo, flo, masked_loop, carry)
        carry = lax.fori_loop(flo, fhi, kv_loop, carry)
        carry = lax.fori_loop(fhi, hi, masked_loop, carry)
      else:  # the last block may hold padded keys (hi = the blocks the producer streams)
        carry = lax.fori_loop(0, cfg.s // bk, kv_loop, carry)
        carry = lax.fori_loop(cfg.s // bk, hi, masked_loop, carry)
      acc, m_i, l_i = carry
      if cfg.right is not None or cfg.segments:  # (the rows of warpgroup 0 stop earlier)
        def flush(kv_step, _):
          # release the slots the producer filled for the other warpgroup's longer loop
          slot = slot_of(kv_step)
          plgpu.barrier_arrive(k_consumed.at[slot])
          plgpu.barrier_arrive(v_consumed.at[slot])
          schedule()
          schedule()

        lax.fori_loop(hi, cta_hi, flush, None)
      pl.when(wg == 0)(schedule)

      if kind != "P":
        m_nat = m_i * LN2 if cfg.exp2 else m_i
        d = l_i
        if offset is not None:
          d = d + offset(m_nat, length_row, **hp_rows)
        inv = jnp.where(d > 0.0, 1.0 / jnp.where(d > 0.0, d, 1.0), 0.0)
        acc = acc * bcast(inv, acc.shape)
        for name, st_smem in zip(stat_names, st_smem2, strict=True):
          if name == "lse2":  # +inf where D = 0 or no key is visible: the backward's
            # 2^(z2 - lse2) is 0 there
            seen = jnp.logical_and(d > 0.0, m_i > -jnp.inf)
            val = jnp.where(seen, m_i + jnp.log(jnp.where(seen, d, 1.0)) * LOG2E, jnp.inf)
          elif name == "m":  # (0 for a row that sees no key: its 1 / D is 0)
            val = jnp.where(m_i == -jnp.inf, 0.0, m_i)
          else:
            val = inv
          st_smem.at[wg][...] = val
      qo_smem[...] = acc.astype(dtype)
      _write_back(plgpu, [(qo_smem, out_ref.at[q_rows])]
                  + [(st_smem.at[wg], st_ref.at[bi, q_head, pl.ds(q_base, bq)])
                     for st_smem, st_ref in zip(st_smem2, st_refs, strict=True)])

    def producer():
      kv_head = _kv_head(q_head, groups)

      def load_ks(step, slot):
        if kseg_ref is not None:
          plgpu.copy_gmem_to_smem(kseg_ref.at[bi, pl.ds(step * bk, bk)], ks_smem.at[slot],
                                  ks_loaded.at[slot])

      def load(step, slot):
        sl = (bi, pl.ds(step * bk, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_loaded.at[slot])
        load_ks(step, slot)
        plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_loaded.at[slot])

      for i in range(stages):
        _when(cta_lo + i < cta_hi, functools.partial(load, cta_lo + i, i))

      @pl.loop(cta_lo, cta_hi - stages)
      def _ring(kv_step):
        step = kv_step + stages
        slot = slot_of(kv_step)
        sl = (bi, pl.ds(step * bk, bk), kv_head)
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_loaded.at[slot])
        load_ks(step, slot)
        plgpu.barrier_wait(v_consumed.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_loaded.at[slot])

    _specialise(plgpu, wg, 2, consumer, producer)

  def entry(q_ref, k_ref, v_ref, *refs):
    len_ref = refs[0] if cfg.kv_lengths else None
    refs = refs[int(cfg.kv_lengths):]
    n_hp = n_rh + 2 * int(cfg.segments)  # (the segment rows fetched as class R's are)
    hp_refs, refs = refs[:n_hp], refs[n_hp:]
    n_seg = 2 * int(cfg.segments)
    seg_refs, (out_ref, *st_refs) = refs[:n_seg], refs[n_seg:]
    scratch = [_swizzled(plgpu, (2, bq, h), dtype), _swizzled(plgpu, (stages, bk, h), dtype),
               _swizzled(plgpu, (stages, bk, h), dtype)]
    pl.run_scoped(
        lambda *args: kernel(q_ref, k_ref, v_ref, len_ref, hp_refs, seg_refs, out_ref, st_refs,
                             args),
        scratch,
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=2),
        tuple(plgpu.SMEM((2, bq), jnp.float32) for _ in stat_names),
        ((plgpu.SMEM((n_hp, 2, bq), jnp.float32), plgpu.Barrier(num_barriers=2 * n_hp))
         if n_hp else ()),
        ((plgpu.SMEM((stages, bk), jnp.float32), plgpu.Barrier(num_barriers=stages))
         if cfg.segments else ()),
        collective_axes="wg",
    )

  if (seg is None) == cfg.segments:
    raise ValueError("_forward: the segment operands go with `cfg.segments`")
  if len(rows) != len(cfg.row_hp):
    raise ValueError(f"_forward: {len(cfg.row_hp)} per-row hyperparameters, got {len(rows)}")
  out_type: Any = jax.ShapeDtypeStruct(q.shape, dtype)
  if save_stats:
    out_type = [out_type] + [jax.ShapeDtypeStruct((b, n, tp), jnp.float32)
                             for _ in stat_names]
  lens = (kv_lengths,) if cfg.kv_lengths else ()
  segs = () if seg is None else (seg.q_row, seg.count, seg.k_ids, seg.key_bands)
  res = _launch(plgpu, entry, out_type, (n, tp // (2 * bq), b), ("heads", "q_seq", "batch"), 3,
                interpret)(q, k, v, *lens, *rows, *segs)
  if save_stats:
    return res[0], tuple(res[1:])
  return res


# --- backward ------------------------------------------------------------------------------

# The backward kernels' tiles: 64 query rows x 64 keys (one warpgroup's wgmma M = 64 each
# way), a 2-slot TMA ring, and per CTA two consumer warpgroups at H <= 128, one at H = 256
# (whose two 64 x 256 float32 accumulators already take 256 registers per thread: ptxas
# will spill there; the issue keeps H = 256 on the Triton path).
BWD_BLOCK = 64
BWD_STAGES = 2


def _bwd_wgs(head_dim: int) -> int:
  return 2 if head_dim <= 128 else 1


def bwd_smem_bytes(head_dim: int, dtype, normalizer="softmax") -> tuple[int, int]:
  """Shared memory one CTA of each backward kernel allocates: ``(dQ kernel, dK/dV kernel)``
  in bytes.

  With ``W`` consumer warpgroups (2 for H <= 128, else 1), ``b = 64`` rows per tile and a
  2-slot ring: the dQ kernel holds ``W`` query and output-gradient tiles (``2 W b H``) and
  the ring of key and value tiles (``2 · 2 b H``), the dK/dV kernel ``W`` key and value
  tiles and the ring of query and output-gradient tiles, at the input's item size; plus
  the float32 row statistics (:func:`_stat_names`, and ``Δ``) per query tile. The lowering
  adds barriers and alignment (:data:`SMEM_SLACK` is kept free).

  Args:
    head_dim: the head dimension H.
    dtype: the input dtype (float16 or bfloat16).
    normalizer: the normalizer (its class sets how many row statistics are streamed).

  Returns:
    ``(dq_bytes, dkv_bytes)``.

  Examples:
    >>> from kernels_pallas.mosaic_gpu import bwd_smem_bytes, SMEM_LIMIT, SMEM_SLACK
    >>> max(bwd_smem_bytes(256, jnp.bfloat16, "softpick")) + SMEM_SLACK <= SMEM_LIMIT
    True

  References:
    T. Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning", arXiv:2307.08691 (the two backward passes).
  """
  if isinstance(head_dim, bool) or head_dim not in (64, 128, 256):
    raise ValueError(f"bwd_smem_bytes: `head_dim` must be 64, 128 or 256, got {head_dim!r}")
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"bwd_smem_bytes: `dtype` must be bfloat16 or float16, got {dtype!r}")
  spec = _spec.resolve(normalizer)
  kind = getattr(spec, "kernel_class", None)
  tile = getattr(spec, "tile", None)
  if kind not in ("E", "S", "P") or tile is None:
    raise ValueError(f"bwd_smem_bytes: `normalizer` {getattr(spec, 'name', spec)!r} is not "
                     "of class E, S or P with a tile rule")
  n_stats = 0 if kind == "P" else (1 if (kind == "S" or _exp2_rule(tile)) else 2) + 1
  item = jnp.dtype(dtype).itemsize
  w, b = _bwd_wgs(head_dim), BWD_BLOCK
  tiles = item * head_dim * (2 * w * b + 2 * BWD_STAGES * b)
  return tiles + 4 * n_stats * w * b, tiles + 4 * n_stats * BWD_STAGES * b


def _stream(lo, hi, stages: int, load, wait):
  """A producer warpgroup's ring over the steps ``[lo, hi)``: the first ``stages`` steps go
  into slots 0, 1, ... at once, each later step into the slot ``(step - lo) mod stages`` once
  ``wait(slot)`` has seen its consumers release it. ``load(step, slot)`` issues the copies."""
  from jax.experimental import pallas as pl
  for i in range(stages):
    _when(lo + i < hi, functools.partial(load, lo + i, i))

  @pl.loop(lo, hi - stages)
  def _ring(step):
    slot = _slot(step, lo, stages)
    wait(slot)
    load(step + stages, slot)


def _scores(plgpu, q_smem, k_smem, loaded, consumed, shape):
  """One float32 tile of q·kᵀ on the tensor cores (wgmma) from a key slot of the ring: wait
  until ``k_smem`` is ``loaded``, multiply, then release the slot (``consumed``)."""
  from jax.experimental import pallas as pl
  plgpu.barrier_wait(loaded)

  def compute(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, _transposed(plgpu, k_smem))
    return acc_ref[...]

  qk = pl.run_scoped(compute, plgpu.ACC(shape, jnp.float32))
  plgpu.barrier_arrive(consumed)
  return qk


def _when(cond, f):
  """``f()`` under ``pl.when(cond)``, or at once (or never) for a Python bool."""
  from jax.experimental import pallas as pl
  if isinstance(cond, bool):
    if cond:
      f()
    return
  pl.when(cond)(f)


def _load_row(plgpu, ref, layout):
  """``ref``'s 1-D float32 contents in ``layout`` (``plgpu.load``: an index argument on JAX
  <= 0.11, none after)."""
  import inspect
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def _bwd_tile_fn(cfg: _Cfg, theta_grad: bool = False):
  """The tile rule's backward on one recomputed tile: ``tile(x, mask, stats, delta, dp,
  length, th) -> (w, dx)`` with ``x`` the scaled logits (log2 domain for exp2 rules),
  ``stats`` the saved row statistics and ``delta`` Δ broadcast to the tile, ``dp = dO·v``,
  ``th`` the tiles of class R's derived hyperparameters ``cfg.row_hp`` (broadcast rows;
  empty otherwise); ``w`` the weights (for dV) and ``dx`` the cotangent of the
  natural-unit logits ``scale·q·k`` (the caller multiplies the matmul by the scale).
  Derivatives of the maps are forward-mode products ``jvp(f, z, t) = f'(z)·t`` (every map
  is elementwise in its first argument), traced with custom derivatives inlined
  (:func:`_primal`).

  ``theta_grad``: also the tiles ``dth`` whose row sums are the cotangents of the derived
  hyperparameters (the weights do not depend on the stabiliser m, a constant here)::

      class E:  dth_ij = (∂num_ij/∂θ dP_ij - ∂den_ij/∂θ Δ_i) / D_i
      class P:  dth_ij = ∂num_ij/∂θ dP_ij

  with ``∂/∂θ`` through the score map too (forward-mode, one map per hyperparameter), 0
  off the mask; returns ``(w, dx, dth)``."""
  rule = cfg.rule
  hp = cfg.hp_dict
  names = cfg.row_hp
  kind = cfg.kind
  numerator, denominator = rule.numerator, rule.denominator
  same = denominator is None or denominator is numerator
  score_map = _primal(rule.score_map)

  def params(th):
    return {**hp, **dict(zip(names, th, strict=True))}

  def jvp_of(f):
    return _primal(lambda z, m, t, *th: jax.jvp(lambda z_: f(z_, m, **params(th)), (z,), (t,)))

  jvp_num = jvp_of(numerator)
  jvp_den: Any = None if same else jvp_of(denominator)
  jvp_score = _primal(lambda x, n, t, *th: jax.jvp(
      lambda x_: rule.score_map(x_, n, **params(th)), (x,), (t,))[1])
  linear_identity = rule.score_map is _spec.identity_score_map

  def dtheta_of(i):
    """``(x, n, m, t_num, t_den, *th) -> ∂num/∂θ_i t_num + ∂den/∂θ_i t_den``."""
    def f(x, n, m, t_num, t_den, *th):
      def maps(th_i):
        p = params(th[:i] + (th_i,) + th[i + 1:])
        z = rule.score_map(x, n, **p)
        num = numerator(z, m, **p)
        if same or kind == "P" or denominator is None:
          return num, num
        return num, denominator(z, m, **p)
      _, (d_num, d_den) = jax.jvp(maps, (th[i],), (jnp.ones_like(th[i]),))
      return d_num * t_num if kind == "P" else d_num * t_num + d_den * t_den
    return _primal(f)

  dtheta = [dtheta_of(i) for i in range(len(names))] if theta_grad else []

  def tile(x, mask, stats, delta, dp, length, th=()):
    th = tuple(th)
    if mask is not None:
      x = jnp.where(mask, x, 0.0)
    m: Any = 0.0
    inv: Any = None
    if cfg.exp2:  # w = 2^(z2 - lse2), dz = w (dP - Δ)
      (lse2,) = stats
      w = jnp.exp2(score_map(x, length, **hp) - lse2)
      if mask is not None:
        w = jnp.where(mask, w, 0.0)
      dz = w * (dp - delta)
    else:
      z = score_map(x, length, **params(th))
      m = stats[0] if kind == "E" else 0.0
      inv = stats[-1] if kind != "P" else None
      if cfg.approx_sigmoid:  # w = σ(z) = 0.5 + 0.5 tanh(z / 2), σ' = w (1 - w)
        w = 0.5 + 0.5 * jnp.tanh(0.5 * z)
        dz = w * (1.0 - w) * dp
      elif kind == "P":
        w, dz = jvp_num(z, m, dp, *th)
      elif same:  # dz = num'(z) (dP - Δ) / D
        num, dz = jvp_num(z, m, (dp - delta) * inv, *th)
        w = num * inv
      else:  # dz = (num'(z) dP - den'(z) Δ) / D
        num, dz = jvp_num(z, m, dp * inv, *th)
        dz = dz + jvp_den(z, m, -delta * inv, *th)[1]
        w = num * inv
      if mask is not None:
        w = jnp.where(mask, w, 0.0)
    dx = dz if linear_identity else jvp_score(x, length, dz, *th)
    if mask is not None:
      dx = jnp.where(mask, dx, 0.0)
    if not theta_grad:
      return w, dx
    t_num = dp if kind == "P" else dp * inv
    t_den = 0.0 if kind == "P" else -delta * inv
    dth = [f(x, length, m, t_num, t_den, *th) for f in dtheta]
    if mask is not None:
      dth = [jnp.where(mask, d, 0.0) for d in dth]
    return w, dx, dth

  return tile


def _run_backward_scoped(plgpu, body, dtype, h: int, wgs: int, stages: int, *, resident: int,
                         streamed: int, n_rows: int, row_slots: int, row_len: int,
                         out_rows: int = 0, seg_slots: int = 0) -> None:
  """Runs a backward kernel's ``body`` with its shared memory and barriers: two resident
  ``[wgs, resident, h]`` tiles, two streamed ``[stages, streamed, h]`` ring buffers, ``n_rows``
  float32 row-statistic buffers ``[row_slots, row_len]`` (and ``out_rows`` float32 output
  rows ``[wgs, row_len]``, class R's dθ), their barriers, the ring's consumed barrier
  (one arrival per consumer warpgroup), and with ``seg_slots`` a float32 ``[seg_slots,
  64]`` buffer of key segment ranks with one barrier per slot (else ``()``)."""
  from jax.experimental import pallas as pl

  tile = lambda slots, rows: _swizzled(plgpu, (slots, rows, h), dtype)
  # (the segment scratch is a last argument only with segments: class T's kernels unpack
  # the others)
  seg = ((plgpu.SMEM((seg_slots, BWD_BLOCK), jnp.float32),
          plgpu.Barrier(num_barriers=seg_slots)),) if seg_slots else ()
  pl.run_scoped(
      body,
      (tile(wgs, resident), tile(wgs, resident), tile(stages, streamed), tile(stages, streamed),
       tuple(plgpu.SMEM((row_slots, row_len), jnp.float32) for _ in range(n_rows))
       + tuple(plgpu.SMEM((wgs, row_len), jnp.float32) for _ in range(out_rows))),
      (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs),
       plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
      tuple(plgpu.Barrier(num_barriers=row_slots) for _ in range(n_rows)),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
      *seg,
      collective_axes="wg",
  )


class _BwdSetup(NamedTuple):
  """What both backward kernels derive from their inputs."""
  b: int
  tp: int  # padded query length
  n: int  # query heads
  h: int
  sp: int  # padded key length
  groups: int  # query heads per key head
  wgs: int  # consumer warpgroups per CTA
  dtype: Any
  n_rows: int  # streamed row statistics (and Δ)
  c: float  # the logits' factor: scale, times log2(e) in the exp2 domain
  tile: Any  # :func:`_bwd_tile_fn`
  has_delta: bool
  n_base: int  # the saved statistics and Δ (the rows streamed first)
  n_th: int  # class R: the derived hyperparameters (next), then the tangent's rows


def _bwd_setup(cfg: _Cfg, q, k, rows, theta_grad: bool = False) -> _BwdSetup:
  b, tp, n, h = q.shape
  sp, kh = k.shape[1], k.shape[2]
  has_delta = cfg.kind != "P"
  return _BwdSetup(b=b, tp=tp, n=n, h=h, sp=sp, groups=n // kh, wgs=_bwd_wgs(h),
                   dtype=q.dtype, n_rows=len(rows),
                   c=cfg.scale * (LOG2E if cfg.exp2 else 1.0),
                   tile=_bwd_tile_fn(cfg, theta_grad), has_delta=has_delta,
                   n_base=len(_stat_names(cfg)) + int(has_delta), n_th=len(cfg.row_hp))


def _split_rows(st: _BwdSetup, vals):
  """The broadcast row tiles ``vals`` (in the kernels' operand order, the segment rows
  already taken off the end: :func:`_seg_rows`) split into ``(statistics, Δ or None,
  derived hyperparameters, the rest)``."""
  base, th, rest = vals[:st.n_base], vals[st.n_base:st.n_base + st.n_th], \
      vals[st.n_base + st.n_th:]
  delta = base[-1] if st.has_delta else None
  return list(base[:len(base) - int(st.has_delta)]), delta, th, rest


def _seg_rows(cfg: _Cfg, vals):
  """``(the other rows, (segment ranks, visible counts) or None)``: the segment rows
  end a backward kernel's streamed rows when ``cfg.segments``."""
  vals = list(vals)
  if not cfg.segments:
    return vals, None
  return vals[:-2], (vals[-2], vals[-1])


def _split_lengths(cfg: _Cfg, refs):
  """``(len_ref or None, the other refs)``: the key lengths lead the inputs after q, k, v
  (and dO) when ``cfg.kv_lengths``."""
  if cfg.kv_lengths:
    return refs[0], refs[1:]
  return None, refs


def _bwd_dq(cfg: _Cfg, q, k, v, do, rows, interpret, kv_lengths=None, theta_grad=False,
            seg: _SegOps | None = None):
  """dQ on padded inputs: one CTA per ``W·64`` query rows of one (batch, head), a producer
  warpgroup streaming key and value tiles through the ring (masked: only the blocks the
  rows see, :func:`_key_block_range`), ``W`` consumer warpgroups accumulating
  ``dQ = scale · sum_j dx_ij k_j``. ``rows``: the saved statistics, Δ, then class R's
  derived hyperparameters (``cfg.row_hp``); ``theta_grad``: returns ``(dQ, dθ)`` with the
  derived hyperparameters' cotangents ``dθ_i = sum_j dth_ij`` (:func:`_bwd_tile_fn`), each
  [B, N, Tp] float32, accumulated in the same sweep. ``seg``: the segment operands (keys
  padded as k) when ``cfg.segments``."""
  plgpu = _plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  if (seg is None) == cfg.segments:
    raise ValueError("_bwd_dq: the segment operands go with `cfg.segments`")
  if seg is not None:
    rows = tuple(rows) + (seg.q_row, seg.count)
  st = _bwd_setup(cfg, q, k, rows, theta_grad)
  n_out = st.n_th if theta_grad else 0
  b, tp, n, h, wgs, dtype, tile = st.b, st.tp, st.n, st.h, st.wgs, st.dtype, st.tile
  bq = bk = BWD_BLOCK
  n_kv = st.sp // bk
  stages = min(BWD_STAGES, n_kv)
  layout = plgpu.Layout.WGMMA
  row_layout = layout.reduce(1)
  col_layout = layout.reduce(0)
  n_bands = tp // SEG_BAND

  def kernel(q_ref, k_ref, v_ref, do_ref, len_ref, row_refs, seg_refs, dq_ref, dth_refs,
             scoped):
    (q_smem2, do_smem2, k_smem, v_smem, row_smem2), (q_bar, do_bar, k_loaded, v_loaded), \
        row_bar, consumed, *ks_scoped = scoped
    ks_scoped = ks_scoped[0] if ks_scoped else ()
    row_smem2, dth_smem2 = row_smem2[:st.n_rows], row_smem2[st.n_rows:]
    kseg_ref, bands_ref = _or_nones(seg_refs, 2)
    ks_smem, ks_loaded = _or_nones(ks_scoped, 2)
    bi, q_head, q_tile, wg = _cta()

    def band_of(band):
      return None if bands_ref is None else _band(bands_ref, bi, band, n_bands)

    end: Any = cfg.s if len_ref is None else jnp.clip(len_ref[bi], 0, cfg.s)
    cta_seg = None if bands_ref is None else \
        _merge_bands([band_of(wgs * q_tile + i) for i in range(wgs)])
    cta_lo, _, _, cta_hi = _clip_to_band(
        _key_block_range(cfg, q_tile * (wgs * bq), wgs * bq, bk, end), cta_seg, bk)
    slot_of = functools.partial(_slot, lo=cta_lo, stages=stages)

    def consumer():
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      q_base = q_tile * (wgs * bq) + wg * bq
      sl = (bi, pl.ds(q_base, bq), q_head)
      _fetch(plgpu, [(q_ref.at[sl], q_smem, q_bar.at[wg]), (do_ref.at[sl], do_smem, do_bar.at[wg])]
             + [(r_ref.at[bi, q_head, pl.ds(q_base, bq)], r_smem.at[wg], r_bar.at[wg])
                for r_ref, r_smem, r_bar in zip(row_refs, row_smem2, row_bar, strict=True)])
      row_vals, seg_vals = _seg_rows(
          cfg, [_load_row(plgpu, r_smem.at[wg], row_layout) for r_smem in row_smem2])

      lo, flo, fhi, hi = _within(_clip_to_band(_key_block_range(cfg, q_base, bq, bk, end),
                                               band_of(wgs * q_tile + wg), bk),
                                 cta_lo, cta_hi)

      def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=layout)

      def step(kv_step, carry, masked: bool = False):
        dq_acc, dth_acc = carry
        slot = slot_of(kv_step)
        plgpu.barrier_wait(k_loaded.at[slot])

        def compute_s(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, _transposed(plgpu, k_smem.at[slot]))
          return acc_ref[...]

        s = pl.run_scoped(compute_s, plgpu.ACC((bq, bk), jnp.float32))
        plgpu.barrier_wait(v_loaded.at[slot])

        def compute_dp(acc_ref):
          plgpu.wgmma(acc_ref, do_smem, _transposed(plgpu, v_smem.at[slot]))
          return acc_ref[...]

        dp = pl.run_scoped(compute_dp, plgpu.ACC((bq, bk), jnp.float32))
        key_seg = None
        if ks_loaded is not None:  # (waited at every step: the barrier's phases in order)
          plgpu.barrier_wait(ks_loaded.at[slot])
          if masked:
            key_seg = _load_row(plgpu, ks_smem.at[slot], col_layout)
        mask = None
        if masked:
          mask = _visible(cfg, iota(0) + q_base, iota(1) + kv_step * bk, end)
          if key_seg is not None:
            mask = _seg_same(mask, lax.broadcast_in_dim(seg_vals[0], (bq, bk), [0]),
                             lax.broadcast_in_dim(key_seg, (bq, bk), [1]))
        if seg_vals is not None:
          length = lax.broadcast_in_dim(seg_vals[1], (bq, bk), [0])
        else:
          length = _visible_count(cfg, iota(0) + q_base, end)
        bc = [lax.broadcast_in_dim(r, (bq, bk), [0]) for r in row_vals]
        stats, delta, th, _ = _split_rows(st, bc)
        res = tile(s * st.c, mask, stats, delta, dp, length, th)
        dx = res[1]
        if n_out:
          dth_acc = tuple(a + d.sum(axis=1) for a, d in zip(dth_acc, res[2], strict=True))

        def compute_dq(acc_ref):
          plgpu.wgmma(acc_ref, dx.astype(dtype), k_smem.at[slot])

        dq_acc = pl.run_state(compute_dq)(plgpu.ACC.init(dq_acc))
        if key_seg is not None:
          plgpu.commit_smem()  # the key ids' reads ordered before the slot's next TMA write
        plgpu.barrier_arrive(consumed.at[slot])
        return dq_acc, dth_acc

      def flush(kv_step, _):
        # the blocks the producer loaded for the other warpgroup only: waited on (each
        # barrier's phases in order) and released
        slot = slot_of(kv_step)
        plgpu.barrier_wait(k_loaded.at[slot])
        plgpu.barrier_wait(v_loaded.at[slot])
        if ks_loaded is not None:
          plgpu.barrier_wait(ks_loaded.at[slot])
        plgpu.barrier_arrive(consumed.at[slot])

      masked_step = functools.partial(step, masked=True)
      dq_acc = plgpu.layout_cast(jnp.full((bq, h), 0.0, jnp.float32), layout)
      carry = (dq_acc, tuple(plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
                             for _ in range(n_out)))
      if (cfg.left is not None or cfg.segments) and wgs > 1:  # (warpgroup 1 starts later)
        lax.fori_loop(cta_lo, lo, flush, None)
      if cfg.masked:
        carry = lax.fori_loop(lo, flo, masked_step, carry)
        carry = lax.fori_loop(flo, fhi, step, carry)
        carry = lax.fori_loop(fhi, hi, masked_step, carry)
      else:  # the last block may hold padded keys (hi = cdiv(S, bk): the blocks the
        # producer streams; the backward pads keys to whole CTAs, so n_kv may be larger)
        carry = lax.fori_loop(0, cfg.s // bk, step, carry)
        carry = lax.fori_loop(cfg.s // bk, hi, masked_step, carry)
      if (cfg.right is not None or cfg.segments) and wgs > 1:  # (warpgroup 0 stops earlier)
        lax.fori_loop(hi, cta_hi, flush, None)
      dq_acc, dth_acc = carry
      q_smem[...] = (dq_acc * cfg.scale).astype(dtype)
      for d_smem, d in zip(dth_smem2, dth_acc, strict=True):
        d_smem.at[wg][...] = d
      _write_back(plgpu, [(q_smem, dq_ref.at[sl])]
                  + [(d_smem.at[wg], d_ref.at[bi, q_head, pl.ds(q_base, bq)])
                     for d_smem, d_ref in zip(dth_smem2, dth_refs, strict=True)])

    def producer():
      kv_head = _kv_head(q_head, st.groups)

      def load(step, slot):
        sl = (bi, pl.ds(step * bk, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[sl], k_smem.at[slot], k_loaded.at[slot])
        if kseg_ref is not None:
          plgpu.copy_gmem_to_smem(kseg_ref.at[bi, pl.ds(step * bk, bk)], ks_smem.at[slot],
                                  ks_loaded.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[sl], v_smem.at[slot], v_loaded.at[slot])

      _stream(cta_lo, cta_hi, stages, load, lambda slot: plgpu.barrier_wait(consumed.at[slot]))

    _specialise(plgpu, wg, wgs, consumer, producer)

  n_seg = 2 * int(cfg.segments)

  def entry(q_ref, k_ref, v_ref, do_ref, *refs):
    len_ref, refs = _split_lengths(cfg, refs)
    row_refs, refs = refs[:st.n_rows], refs[st.n_rows:]
    seg_refs, dq_ref, dth_refs = refs[:n_seg], refs[n_seg], refs[n_seg + 1:]
    _run_backward_scoped(
        plgpu,
        lambda *args: kernel(q_ref, k_ref, v_ref, do_ref, len_ref, row_refs, seg_refs, dq_ref,
                             dth_refs, args),
        dtype, h, wgs, stages, resident=bq, streamed=bk, n_rows=st.n_rows, row_slots=wgs,
        row_len=bq, out_rows=n_out, seg_slots=stages if cfg.segments else 0)

  lens = (kv_lengths,) if cfg.kv_lengths else ()
  rows = tuple(rows) + (() if seg is None else (seg.k_ids, seg.key_bands))
  out_type: Any = jax.ShapeDtypeStruct(q.shape, dtype)
  if theta_grad:
    out_type = [out_type] + [jax.ShapeDtypeStruct((b, n, tp), jnp.float32)] * n_out
  res = _launch(plgpu, entry, out_type, (n, tp // (wgs * bq), b),
                ("heads", "q_seq", "batch"), wgs + 1, interpret)(q, k, v, do, *lens, *rows)
  if theta_grad:
    return res[0], tuple(res[1:])
  return res


def _bwd_dkv(cfg: _Cfg, q, k, v, do, rows, interpret, kv_lengths=None, extra_fn=None,
             seg: _SegOps | None = None):
  """dK and dV per query head on padded inputs: one CTA per ``W·64`` keys of one (batch,
  query head), a producer warpgroup streaming query, output-gradient and row-statistic
  tiles through the ring (masked: the query blocks that see the CTA's keys,
  :func:`_query_block_range`),
  ``W`` consumer warpgroups accumulating, in the transposed orientation (keys as rows),
  ``dV = sum_i w_ij dO_i`` and ``dK = scale · sum_i dx_ij q_i``. Returns ``(dK, dV)``,
  each ``[B, Sp, N, H]`` (the GQA sum over a key head's query heads is the caller's).
  ``rows``: the saved statistics, Δ, class R's derived hyperparameters (``cfg.row_hp``),
  then any rows ``extra_fn(x, mask, tiles)`` takes (class R: the rule's statistics and
  their cotangents), whose tile is added to ``dx`` (the statistics' own gradient).
  ``seg``: the segment operands (keys padded as k) when ``cfg.segments``: the query rows'
  ranks and counts stream after ``rows``, the CTA's key ranks are fetched with its keys."""
  plgpu = _plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  if (seg is None) == cfg.segments:
    raise ValueError("_bwd_dkv: the segment operands go with `cfg.segments`")
  if seg is not None:
    rows = tuple(rows) + (seg.q_row, seg.count)
  su = _bwd_setup(cfg, q, k, rows)
  b, tp, n, h, wgs, dtype, tile = su.b, su.tp, su.n, su.h, su.wgs, su.dtype, su.tile
  bq = bk = BWD_BLOCK
  n_q = tp // bq
  layout = plgpu.Layout.WGMMA
  col_layout = layout.reduce(0)
  row_layout = layout.reduce(1)
  stages = min(BWD_STAGES, n_q)
  n_bands = su.sp // SEG_BAND

  def kernel(q_ref, k_ref, v_ref, do_ref, len_ref, row_refs, seg_refs, dk_ref, dv_ref, scoped):
    (k_smem2, v_smem2, q_smem, do_smem, row_smem), (k_bar, v_bar, q_loaded, do_loaded), \
        row_loaded, consumed, *ks_scoped = scoped
    ks_scoped = ks_scoped[0] if ks_scoped else ()
    kseg_ref, bands_ref = _or_nones(seg_refs, 2)
    ks_smem, ks_bar = _or_nones(ks_scoped, 2)
    bi, q_head, kv_tile, wg = _cta("kv_seq")

    def band_of(band):
      return None if bands_ref is None else _band(bands_ref, bi, band, n_bands)

    # keys past the batch entry's length get zero gradients (seen by no query); keys
    # past S are padding whose gradients are dropped
    end: Any = None if len_ref is None else jnp.clip(len_ref[bi], 0, cfg.s)
    cta_seg = None if bands_ref is None else \
        _merge_bands([band_of(wgs * kv_tile + i) for i in range(wgs)])
    cta_start, _, _, cta_end = _clip_to_band(
        _query_block_range(cfg, kv_tile * (wgs * bk), wgs * bk, bq, n_q, end), cta_seg, bq)
    slot_of = functools.partial(_slot, lo=cta_start, stages=stages)

    def consumer():
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      kv_base = kv_tile * (wgs * bk) + wg * bk
      sl = (bi, pl.ds(kv_base, bk), _kv_head(q_head, su.groups))
      _fetch(plgpu, [(k_ref.at[sl], k_smem, k_bar.at[wg]), (v_ref.at[sl], v_smem, v_bar.at[wg])]
             + ([(kseg_ref.at[bi, pl.ds(kv_base, bk)], ks_smem.at[wg], ks_bar.at[wg])]
                if kseg_ref is not None else []))
      key_seg: Any = None if kseg_ref is None else _load_row(plgpu, ks_smem.at[wg], row_layout)
      # query blocks [lo, flo) and [fhi, hi) partial (masked), [flo, fhi) full
      lo, flo, fhi, hi = _within(_clip_to_band(_query_block_range(cfg, kv_base, bk, bq, n_q, end),
                                               band_of(wgs * kv_tile + wg), bq),
                                 cta_start, cta_end)

      def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, (bk, bq), axis, layout=layout)

      def wait_loaded(slot):
        plgpu.barrier_wait(q_loaded.at[slot])
        plgpu.barrier_wait(do_loaded.at[slot])
        for r_bar in row_loaded:
          plgpu.barrier_wait(r_bar.at[slot])

      def step(q_step, carry, masked: bool = False):
        dk_acc, dv_acc = carry
        slot = slot_of(q_step)
        wait_loaded(slot)

        def compute_st(acc_ref):
          plgpu.wgmma(acc_ref, k_smem, _transposed(plgpu, q_smem.at[slot]))
          return acc_ref[...]

        st = pl.run_scoped(compute_st, plgpu.ACC((bk, bq), jnp.float32))

        def compute_dpt(acc_ref):
          plgpu.wgmma(acc_ref, v_smem, _transposed(plgpu, do_smem.at[slot]))
          return acc_ref[...]

        dpt = pl.run_scoped(compute_dpt, plgpu.ACC((bk, bq), jnp.float32))
        bc = [lax.broadcast_in_dim(_load_row(plgpu, r.at[slot], col_layout), (bk, bq), [1])
              for r in row_smem]
        if row_smem:
          # a proxy fence: these plain (generic-proxy) reads of the slot are ordered before
          # the producer's next TMA (async-proxy) write into it, which the consumed
          # barrier alone does not order (the GPU interpreter's race detector finds it)
          plgpu.commit_smem()
        bc, seg_vals = _seg_rows(cfg, bc)
        mask = None
        if masked:  # (keys as rows, queries as columns)
          mask = _visible(cfg, iota(1) + q_step * bq, iota(0) + kv_base, end)
          if seg_vals is not None:
            mask = _seg_same(mask, lax.broadcast_in_dim(key_seg, (bk, bq), [0]), seg_vals[0])
        if seg_vals is not None:
          length = seg_vals[1]
        else:
          length = _visible_count(cfg, iota(1) + q_step * bq,
                                  cfg.s if end is None else end)
        stats, delta, th, extra = _split_rows(su, bc)
        w, dx = tile(st * su.c, mask, stats, delta, dpt, length, th)
        if extra_fn is not None:
          dx = dx + extra_fn(st * su.c, mask, extra)

        def compute(refs):
          dv_ref_, dk_ref_ = refs
          plgpu.wgmma(dv_ref_, w.astype(dtype), do_smem.at[slot])
          plgpu.wgmma(dk_ref_, dx.astype(dtype), q_smem.at[slot])

        dv_acc, dk_acc = pl.run_state(compute)((plgpu.ACC.init(dv_acc),
                                                plgpu.ACC.init(dk_acc)))
        plgpu.barrier_arrive(consumed.at[slot])
        return dk_acc, dv_acc

      def skip(q_step, _):
        # blocks the producer loaded for the other warpgroup (whose keys come earlier):
        # waited on (each barrier's phases in order) and released
        slot = slot_of(q_step)
        wait_loaded(slot)
        plgpu.barrier_arrive(consumed.at[slot])

      zeros = plgpu.layout_cast(jnp.full((bk, h), 0.0, jnp.float32), layout)
      carry = (zeros, zeros)
      masked_step = functools.partial(step, masked=True)
      if cfg.masked:
        if (cfg.right is not None or cfg.segments) and wgs > 1:  # (wg 1's keys seen later)
          lax.fori_loop(cta_start, lo, skip, None)
        carry = lax.fori_loop(lo, flo, masked_step, carry)
        carry = lax.fori_loop(flo, fhi, step, carry)
        carry = lax.fori_loop(fhi, hi, masked_step, carry)
        if (cfg.left is not None or cfg.kv_lengths or cfg.segments) and wgs > 1:
          # (warpgroup 0's keys are seen by no later query, or warpgroup 1's by none)
          lax.fori_loop(hi, cta_end, skip, None)
      else:
        carry = lax.fori_loop(0, n_q, step, carry)
      dk_acc, dv_acc = carry
      k_smem[...] = (dk_acc * cfg.scale).astype(dtype)
      v_smem[...] = dv_acc.astype(dtype)
      out = (bi, pl.ds(kv_base, bk), q_head)
      _write_back(plgpu, [(k_smem, dk_ref.at[out]), (v_smem, dv_ref.at[out])])

    def producer():
      def load(step, slot):
        sl = (bi, pl.ds(step * bq, bq), q_head)
        plgpu.copy_gmem_to_smem(q_ref.at[sl], q_smem.at[slot], q_loaded.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[sl], do_smem.at[slot], do_loaded.at[slot])
        for r_ref, r_smem, r_bar in zip(row_refs, row_smem, row_loaded, strict=True):
          plgpu.copy_gmem_to_smem(r_ref.at[bi, q_head, pl.ds(step * bq, bq)],
                                  r_smem.at[slot], r_bar.at[slot])

      _stream(cta_start, cta_end, stages, load,
              lambda slot: plgpu.barrier_wait(consumed.at[slot]))

    _specialise(plgpu, wg, wgs, consumer, producer)

  n_seg = 2 * int(cfg.segments)

  def entry(q_ref, k_ref, v_ref, do_ref, *refs):
    len_ref, refs = _split_lengths(cfg, refs)
    n_rows = su.n_rows
    row_refs, refs = refs[:n_rows], refs[n_rows:]
    seg_refs, dk_ref, dv_ref = refs[:n_seg], refs[n_seg], refs[n_seg + 1]
    _run_backward_scoped(
        plgpu,
        lambda *args: kernel(q_ref, k_ref, v_ref, do_ref, len_ref, row_refs, seg_refs, dk_ref,
                             dv_ref, args),
        dtype, h, wgs, stages, resident=bk, streamed=bq, n_rows=n_rows, row_slots=stages,
        row_len=bq, seg_slots=wgs if cfg.segments else 0)

  out = jax.ShapeDtypeStruct((b, su.sp, n, h), dtype)
  lens = (kv_lengths,) if cfg.kv_lengths else ()
  rows = tuple(rows) + (() if seg is None else (seg.k_ids, seg.query_bands))
  return _launch(plgpu, entry, [out, out], (n, su.sp // (wgs * bk), b),
                 ("heads", "kv_seq", "batch"), wgs + 1, interpret)(q, k, v, do, *lens, *rows)


def _backward(cfg: _Cfg, q, k, v, out, stats, g, interpret, kv_lengths=None,
              segment_ids=None):
  """(dq, dk, dv) of the unpadded inputs from the forward's output and row statistics
  (``segment_ids``: the ``(q_ids, kv_ids)`` pair when ``cfg.segments``)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  dtype = q.dtype
  need = max(bwd_smem_bytes(h, dtype, cfg.spec))
  if need + SMEM_SLACK > SMEM_LIMIT:  # (the fixed tiles fit every H accepted; kept honest)
    raise ValueError(f"mosaic_gpu_attention: the backward at head dim {h} needs {need} bytes "
                     f"of shared memory, over Hopper's {SMEM_LIMIT}")
  wgs = _bwd_wgs(h)
  tp = _round_up(t, 2 * cfg.block_q)  # the forward's padding (its statistics' length)
  sp = _round_up(s, wgs * BWD_BLOCK)
  g = g.astype(dtype)
  pad_t = ((0, 0), (0, tp - t), (0, 0), (0, 0))
  pad_s = ((0, 0), (0, sp - s), (0, 0), (0, 0))
  qp, dop = jnp.pad(q, pad_t), jnp.pad(g, pad_t)
  kp, vp = jnp.pad(k, pad_s), jnp.pad(v, pad_s)
  rows = tuple(stats)
  if cfg.kind != "P":
    # Δ_i = dO_i · O_i (float32), 0 on the padded rows
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), g.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    rows = rows + (jnp.pad(delta, ((0, 0), (0, 0), (0, tp - t))),)
  seg = _segment_operands(cfg, segment_ids, n, tp, sp, kv_lengths)
  dq = _bwd_dq(cfg, qp, kp, vp, dop, rows, interpret, kv_lengths, seg=seg)[:, :t]
  dk, dv = _bwd_dkv(cfg, qp, kp, vp, dop, rows, interpret, kv_lengths, seg=seg)
  groups = n // kh

  def head_sum(x):  # [B, Sp, N, H] -> [B, S, K, H]: each key head's query heads summed
    x = x[:, :s].reshape(b, s, kh, groups, h)
    return x.astype(jnp.float32).sum(axis=3).astype(dtype) if groups > 1 else x[:, :, :, 0]

  return dq, head_sum(dk), head_sum(dv)


def _padded(cfg: _Cfg, q, k, v):
  """q padded to whole CTAs (``2 block_q`` rows), k and v to whole key blocks."""
  tp, sp = _round_up(cfg.t, 2 * cfg.block_q), _round_up(cfg.s, cfg.block_k)
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))
  return pad(q, tp), pad(k, sp), pad(v, sp)


def _fwd_segments(cfg: _Cfg, segment_ids, qp, kp, kv_lengths):
  """The forward kernel's segment operands for the padded q, k (or None)."""
  return _segment_operands(cfg, segment_ids, qp.shape[2], qp.shape[1], kp.shape[1],
                           kv_lengths, query_bands=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _attention(cfg: _Cfg, q, k, v, kv_lengths, segment_ids, interpret):
  qp, kp, vp = _padded(cfg, q, k, v)
  seg = _fwd_segments(cfg, segment_ids, qp, kp, kv_lengths)
  return _forward(cfg, qp, kp, vp, interpret, kv_lengths=kv_lengths, seg=seg)[:, :cfg.t]


# Where a derivative the custom VJP does not give is refused, and the way out: the backward
# holds the keys, values and saved statistics constant, so differentiating it again would
# silently drop terms.
DIFFERENTIATION_WHERE = "mosaic_gpu_attention"
DIFFERENTIATION_ADVICE = (
    "Use kernels_pallas.attention (the Triton / Mosaic-TPU engine) for other first-order "
    "paths, or jaxsoft.attention.dot_product_attention(implementation='xla'), which takes "
    "any derivative.")


def _forward_saving(cfg, interpret, q, k, v, kv_lengths, segment_ids):
  qp, kp, vp = _padded(cfg, q, k, v)
  seg = _fwd_segments(cfg, segment_ids, qp, kp, kv_lengths)
  out, stats = _forward(cfg, qp, kp, vp, interpret, save_stats=True, kv_lengths=kv_lengths,
                        seg=seg)
  out = out[:, :cfg.t]
  return out, (q, k, v, kv_lengths, segment_ids, out, stats)


def _attention_fwd(cfg, q, k, v, kv_lengths, segment_ids, interpret):
  return first_order_only(functools.partial(_forward_saving, cfg, interpret),
                          DIFFERENTIATION_WHERE, DIFFERENTIATION_ADVICE)(
                              q, k, v, kv_lengths, segment_ids)


def _backward_of(cfg, interpret, res, g):
  q, k, v, kv_lengths, segment_ids, out, stats = res
  return _backward(cfg, q, k, v, out, stats, g, interpret, kv_lengths, segment_ids)


def _no_cotangent(segment_ids):
  """The (absent) cotangents of the integer segment ids."""
  return None if segment_ids is None else (None, None)


def _attention_bwd(cfg, interpret, res, g):
  dq, dk, dv = first_order_only(functools.partial(_backward_of, cfg, interpret),
                                DIFFERENTIATION_WHERE, DIFFERENTIATION_ADVICE)(res, g)
  return dq, dk, dv, None, _no_cotangent(res[4])


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_window(size) -> tuple[int, int] | None:
  """``local_window_size`` as ``(left, right)``, or ValueError naming it."""
  if size is None:
    return None
  pair = (size, size) if isinstance(size, int) and not isinstance(size, bool) else size
  ok = (isinstance(pair, (tuple, list)) and len(pair) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair))
  if not ok:
    raise ValueError(f"mosaic_gpu_attention: `local_window_size` must be None, a non-negative "
                     f"int or a (left, right) pair of them, got {size!r}")
  return int(pair[0]), int(pair[1])


def _check_segment_ids(segment_ids, b: int, t: int, s: int):
  """``segment_ids`` as an int32 ``(q_ids [B, T], kv_ids [B, S])`` pair (one ``[B, T]``
  array: self-attention, T = S), None when absent, or ValueError naming the argument."""
  if segment_ids is None:
    return None
  where = "mosaic_gpu_attention: `segment_ids`"
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2 or any(x is None for x in segment_ids):
      raise ValueError(f"{where} must be one [B, T] array or a pair (q_ids [B, T], kv_ids "
                       f"[B, S]) of arrays; got {len(segment_ids)} entries with "
                       f"{sum(x is None for x in segment_ids)} None (give both)")
    pair = tuple(segment_ids)
  else:
    if t != s:
      raise ValueError(f"{where}: one array is self-attention's (T = S); with T={t} and "
                       f"S={s} give the pair (q_ids [B, T], kv_ids [B, S])")
    pair = (segment_ids, segment_ids)
  out = []
  for name, ids, n, dim in (("q_ids", pair[0], t, "T"), ("kv_ids", pair[1], s, "S")):
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{where} ({name}) must be an integer array, got dtype {ids.dtype}")
    if ids.shape != (b, n):
      raise ValueError(f"{where} ({name}) must have shape [B, {dim}] = "
                       f"{[b, n]}, got {list(ids.shape)}")
    out.append(ids.astype(jnp.int32))
  return out[0], out[1]


def mosaic_gpu_attention(query, key, value, *, normalizer="softmax",
                         normalizer_params: Mapping[str, Any] | None = None,
                         scale: float | None = None, is_causal: bool = False,
                         block_q: int | None = None, block_k: int | None = None,
                         num_stages: int | None = None, interpret: Any = False,
                         approx_sigmoid: bool = True,
                         rescale_threshold: float | None = None,
                         key_value_seq_lengths=None,
                         local_window_size: int | tuple[int, int] | None = None,
                         segment_ids=None):
  r"""Attention forward on Hopper with a Mosaic-GPU kernel (FlashAttention-3 structure).

  .. math::
    O_i = \frac{\sum_{j \in V_i} \mathrm{num}(z_{ij}, m_i)\, v_j}{D_i},\quad
    z_{ij} = \mathrm{score\_map}(\mathrm{scale}\; q_i \cdot k_j, |V_i|),\quad
    D_i = \sum_{j \in V_i} \mathrm{den}(z_{ij}, m_i) + \mathrm{offset}(m_i, |V_i|)

  with the normalizer's tile rule (class E: ``m_i`` the row max of ``z``; S: ``m = 0``;
  P: ``D = 1``), ``V_i`` the keys query i sees: ``j < L_b`` (``key_value_seq_lengths``),
  ``i - left <= j <= i + right`` (``local_window_size``), ``j <= i`` (``is_causal``) and
  ``q_ids[i] == kv_ids[j]`` (``segment_ids``). The mask is applied as a block list: key blocks no row of a warpgroup sees are never
  loaded, blocks every row sees wholly run without mask work, and only the partial
  blocks between apply the element mask (forward and backward). Softmax-like rules
  run as ``2^{z2 - m2}`` with ``log2(e)`` folded into the scale. A TMA producer
  warpgroup feeds two ``wgmma`` consumer warpgroups through a shared-memory ring
  (module docstring).

  Differentiable: ``jax.grad`` runs two backward kernels (dK/dV, dQ) that recompute the
  weights from the forward's saved row statistics (module docstring, per-class formulas;
  class R adds the statistics' own gradient, ``kernels_pallas.mosaic_gpu_row_stats``).

  **Unverified on hardware**: lowered for CUDA and checked in Pallas's GPU interpreter
  only; not used by ``implementation="pallas"``.

  Args:
    query: ``[B, T, N, H]`` float16 or bfloat16, H in {64, 128, 256}.
    key, value: ``[B, S, K, H]`` of the query's dtype, ``N % K == 0`` (GQA / MQA).
    normalizer: a registered name or NormalizerSpec of kernel class E, S or P with a tile
      rule whose maps lower for Mosaic GPU (tested: softmax, softmax_1, softmax_n, softpick,
      ssmax, sigmoid, relu, stablemax, spherical_softmax; softplus-based rules need a
      ``log1p`` the lowering lacks). Class T (sparsemax, entmax15, top_k_softmax) runs
      ``kernels_pallas.mosaic_gpu_threshold`` (reverse mode; forward mode and second order
      raise); class R (every registered
      row-statistics rule: standardized_softmax, nap, adaptive_temperature_softmax,
      affine_softmax, clipped_softmax, sa_softmax_normalized, epsilon_softmax,
      eta_softmax) runs ``kernels_pallas.mosaic_gpu_row_stats`` (forward and backward).
    normalizer_params: the normalizer's hyperparameters as Python numbers (compiled in).
    scale: the logits' scale (None: ``1 / sqrt(H)``).
    is_causal: top-left aligned causal mask (query i sees keys j <= i).
    block_q: query rows per consumer warpgroup (64; two warpgroups per CTA).
    block_k: keys per ring slot (None: 128 for H <= 128, else 64), a multiple of 64.
    num_stages: ring slots (None: 2), at least 2.
    interpret: False for the GPU; True (or an ``InterpretGPUParams``, see
      :func:`gpu_interpret_params`) runs Pallas's GPU interpreter on a CPU.
    approx_sigmoid: sigmoid's numerator as ``0.5 + 0.5 tanh(z / 2)`` (``tanh.approx`` on
      the GPU, FlashSigmoid); False uses the rule's own ``jax.nn.sigmoid``.
    rescale_threshold: lazy rescaling tau in [0, 64] (FlashAttention-4's conditional
      rescaling; softmax-like rules only): a row's stabiliser moves only when a block's
      max exceeds it by more than tau, so tiles add terms up to ``e^tau``, and the
      accumulator is rescaled only when some row of the warpgroup moved (the same
      function; None: rescale at every block).
    key_value_seq_lengths: optional integer ``[B]``: batch entry b's keys ``j >= L_b``
      are padding (seen by no query; their gradients are 0). A row that sees no key
      gets a zero output.
    local_window_size: optional ``w`` or ``(left, right)`` non-negative ints (as
      ``jax.nn.dot_product_attention``): query i sees keys ``i - left .. i + right``
      (``w`` means ``(w, w)``; with ``is_causal`` the right side is 0).
    segment_ids: optional integer ``[B, T]`` (self-attention, T = S) or a pair
      ``(q_ids [B, T], kv_ids [B, S])`` (as ``kernels_pallas.attention`` and
      ``jaxsoft.attention.dot_product_attention``): query i sees key j only when their ids
      are equal. Classes E, S, P and R (class T refuses them). Packed (sorted) ids skip
      every key block of another segment; unsorted ids are correct but load more blocks
      (module docstring). A row whose segment has no visible key gets zeros.

  Returns:
    ``[B, T, N, H]`` of the query's dtype.

  Examples:
    >>> import kernels_pallas as kp
    >>> q = jnp.ones((1, 128, 1, 64), jnp.float16)
    >>> f = lambda q: kp.mosaic_gpu_attention(q, q, q, is_causal=True)
    >>> exp = jax.export.export(jax.jit(f), platforms=["cuda"])(q)  # lowers on a CPU
    >>> "mosaic_gpu" in exp.mlir_module()
    True

  References:
    J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar, P. Ramani & T. Dao, 2024,
    "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
    arXiv:2407.08608.

    T. Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning", arXiv:2307.08691.

    J. Ramapuram, F. Danieli, E. Dhekane, F. Weers, D. Busbridge, P. Ablin, T. Likhomanenko,
    J. Digani, Z. Gu, A. Shidani & R. Webb, 2024, "Theory, Analysis, and Best Practices for
    Sigmoid Self-Attention", arXiv:2409.04431.
  """
  spec = _spec.resolve(normalizer)
  if not isinstance(spec, _spec.NormalizerSpec) or not (
      (spec.kernel_class in ("E", "S", "P") and spec.tile is not None)
      or (spec.kernel_class == "T" and spec.threshold is not None)
      or (spec.kernel_class == "R" and spec.row_stats is not None
          and spec.row_stats.second is not None)):
    name = getattr(spec, "name", spec)
    kc = getattr(spec, "kernel_class", None)
    raise UnsupportedError(
        f"mosaic_gpu_attention: `normalizer` {name!r} (kernel class {kc}) is not of class "
        "E, S or P with a tile rule (T with a threshold rule, R with a row-statistics "
        "rule); it runs in kernels_pallas.attention only")
  threshold = spec.kernel_class == "T"  # class T: kernels_pallas.mosaic_gpu_threshold
  hp = dict(normalizer_params or {})
  for name, val in hp.items():
    if not isinstance(val, (int, float)) or isinstance(val, bool):
      raise UnsupportedError(
          f"mosaic_gpu_attention: `normalizer_params[{name!r}]` must be a Python number "
          f"(per-row arrays are not supported yet), got {type(val).__name__}")
  for arg, x in (("query", query), ("key", key), ("value", value)):
    if jnp.ndim(x) != 4:
      raise ValueError(f"mosaic_gpu_attention: `{arg}` must be [B, T, N, H], got shape "
                       f"{jnp.shape(x)}")
  b, t, n, h, s, kh = gqa_dims(query, key, value, "mosaic_gpu_attention")
  if value.shape[3] != h:
    raise ValueError(f"mosaic_gpu_attention: `value` must have the head dim of `key` ({h}), "
                     f"got {value.shape}")
  dtype = jnp.dtype(query.dtype)
  if dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"mosaic_gpu_attention: `query` must be float16 or bfloat16, got {dtype}")
  if key.dtype != dtype or value.dtype != dtype:
    raise ValueError(f"mosaic_gpu_attention: `key` and `value` must have the query's dtype "
                     f"{dtype}, got {key.dtype} and {value.dtype}")
  if h not in (64, 128, 256):
    raise ValueError(f"mosaic_gpu_attention: the head dim of `query` must be 64, 128 or 256, "
                     f"got {h}")
  dq, dk, dst = _default_blocks(h, dtype)
  block_q = dq if block_q is None else block_q
  block_k = dk if block_k is None else block_k
  num_stages = dst if num_stages is None else num_stages
  if block_q != 64:
    raise ValueError(f"mosaic_gpu_attention: `block_q` must be 64 (one warpgroup's wgmma "
                     f"tile), got {block_q}")
  if block_k % 64 or block_k <= 0:
    raise ValueError(f"mosaic_gpu_attention: `block_k` must be a positive multiple of 64, "
                     f"got {block_k}")
  if num_stages < 2:
    raise ValueError(f"mosaic_gpu_attention: `num_stages` must be at least 2, got {num_stages}")
  need = smem_bytes(h, dtype, block_q, block_k, min(num_stages, -(-s // block_k)))
  if need + SMEM_SLACK > SMEM_LIMIT:
    raise ValueError(
        f"mosaic_gpu_attention: `block_k`={block_k} x `num_stages`={num_stages} at head dim "
        f"{h} needs {need} bytes of shared memory, over Hopper's {SMEM_LIMIT}")
  window = _check_window(local_window_size)
  segments = _check_segment_ids(segment_ids, b, t, s)
  lengths = None
  if key_value_seq_lengths is not None:
    lengths = jnp.asarray(key_value_seq_lengths)
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(f"mosaic_gpu_attention: `key_value_seq_lengths` must be an integer "
                       f"[B] = [{b}] array, got {lengths.dtype}{list(lengths.shape)}")
    lengths = lengths.astype(jnp.int32)
  if scale is None:
    scale = 1.0 / math.sqrt(h)
  if interpret is True:
    interpret = gpu_interpret_params()
  elif interpret is False:
    interpret = None
  if is_causal and interpret is None:
    _check_cuda_for_causal()
  if interpret is not None and not interpreter_runs_kernel():
    raise UnsupportedError(
        f"mosaic_gpu_attention(interpret=...): the GPU interpreter of jax {jax.__version__} "
        "cannot run this kernel (no rule for pl.run_state); JAX 0.12.1 runs it")
  refuse_unsupported_ad((query, key, value), DIFFERENTIATION_WHERE, DIFFERENTIATION_ADVICE)
  if threshold and segments is not None:
    raise UnsupportedError(
        f"mosaic_gpu_attention: `segment_ids` are not supported for class T ({spec.name!r}); "
        "use kernels_pallas.attention or jaxsoft.attention.dot_product_attention")
  if threshold:
    return CLASS_KERNELS["T"](
        query, key, value, spec=spec, hp=hp, scale=float(scale), is_causal=bool(is_causal),
        block_k=block_k, num_stages=num_stages, interpret=interpret,
        rescale_threshold=rescale_threshold, local_window_size=window,
        key_value_seq_lengths=lengths)
  row_stats = spec.kernel_class == "R"  # class R: kernels_pallas.mosaic_gpu_row_stats
  rule = spec.row_stats.second if spec.row_stats is not None and row_stats else spec.tile
  assert rule is not None  # classes E, S, P, R (checked above)
  if rescale_threshold is not None:
    if not _exp2_rule(rule):
      raise ValueError(
          f"mosaic_gpu_attention: `rescale_threshold` needs a class-E normalizer with "
          f"e^(z - m) numerators and a linear score map, not {spec.name!r}")
    if not (isinstance(rescale_threshold, (int, float)) and not isinstance(rescale_threshold, bool)
            and 0.0 <= rescale_threshold <= MAX_RESCALE_THRESHOLD):
      raise ValueError(f"mosaic_gpu_attention: `rescale_threshold` must be None or a number "
                       f"in [0, {MAX_RESCALE_THRESHOLD}], got {rescale_threshold!r}")
    rescale_threshold = float(rescale_threshold)
  cfg = _Cfg(spec=spec, hp=tuple(sorted(hp.items())), scale=float(scale),
             causal=bool(is_causal), t=t, s=s, block_q=block_q, block_k=block_k,
             num_stages=num_stages, exp2=_exp2_rule(rule) and not row_stats,
             approx_sigmoid=bool(approx_sigmoid) and rule.numerator is _spec.sigmoid_numerator,
             rescale_threshold=rescale_threshold, window=window,
             kv_lengths=lengths is not None, segments=segments is not None)
  run: Any = CLASS_KERNELS["R"] if row_stats else _attention
  if interpret is None:
    return run(cfg, query, key, value, lengths, segments, interpret)
  try:
    return run(cfg, query, key, value, lengths, segments, interpret)
  except NotImplementedError as e:
    # JAX 0.10's GPU interpreter has no rule for pl.run_state (the accumulator handed to
    # the second wgmma); JAX 0.12's has. Said plainly instead of a stack of interpreter frames.
    if "run_state" not in str(e) or isinstance(e, UnsupportedError):
      raise
    raise UnsupportedError(
        f"mosaic_gpu_attention(interpret=...): the GPU interpreter of jax {jax.__version__} "
        f"cannot run this kernel ({e}); JAX 0.12.1 runs it") from e
