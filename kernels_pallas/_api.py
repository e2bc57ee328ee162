"""``kernels_pallas.attention`` and the adapter ``jaxsoft.attention`` calls.

Both go through :func:`attention_from_call`, which takes a validated call
(:class:`jaxsoft.attention.call.AttentionCall`, validated once by ``AttentionCall.create``) and its
:class:`~jaxsoft.attention.MaskStructure`, and raises NotImplementedError for every call the
engine cannot compute *exactly*, so that the dispatcher falls back to XLA.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention.call import AttentionCall
from jaxsoft.attention.differentiation import refuse_unsupported_ad
from jaxsoft.attention.masks import table_ranges
from jaxsoft.attention.posinf import with_posinf_rule
from jaxsoft.normalizers import spec as _spec
from kernels_pallas import autotune, core
from kernels_pallas import engine as E
from kernels_pallas import fp8 as fp8_mod
from kernels_pallas import row_stats as row_stats_core
from kernels_pallas.backends import BACKENDS, INTERPRET_ENV, pick_backend

__all__ = ["attention", "attention_from_call", "resolve_block_sizes", "pick_backend",
           "BlockSizes", "INTERPRET_ENV"]

BlockSizes = E.BlockSizes
def is_static(x) -> bool:
  """A hyperparameter compiled into the kernel (a Python or NumPy scalar)."""
  return x is None or isinstance(x, (bool, int, float, np.integer, np.floating))


def rows(x, b: int, n: int, t: int, dtype=None):
  """A per-row hyperparameter (validated to broadcast against [B, N, T, 1]) -> [B, N, T, 1]."""
  x = jnp.asarray(x, dtype)
  return jnp.broadcast_to(x.reshape((1,) * (4 - x.ndim) + x.shape), (b, n, t, 1))


def resolve_block_sizes(block_sizes, backend: str, t: int, s: int, h: int, key_lanes: bool):
  """The block sizes a kernel launch will use: ``block_sizes`` (None, a ``BlockSizes`` or a
  dict of its fields) resolved against the backend's defaults and checked.

  Args:
    block_sizes: None (the engine's default for this shape), a ``BlockSizes`` or a dict.
    backend: ``"triton"`` or ``"mosaic_tpu"``.
    t, s, h: query length, key length and head dimension.
    key_lanes: some array is blocked along the keys in its last dimension (segment ids, a
      dense bias or mask, the decay's ck), so Mosaic key blocks must be multiples of 128
      lanes.

  Returns:
    A resolved ``BlockSizes`` (every backward block filled in).

  Raises:
    ValueError naming the field the backend cannot tile with.

  Examples:
    >>> from kernels_pallas import resolve_block_sizes
    >>> bl = resolve_block_sizes({"block_q": 32, "block_k": 16}, "triton", 64, 64, 16, False)
    >>> bl.block_q, bl.block_k
    (32, 16)
  """
  if block_sizes is None:
    bl = E.default_block_sizes(backend, t, s, h)
  elif isinstance(block_sizes, E.BlockSizes):
    bl = block_sizes
  else:
    bl = E.BlockSizes(**dict(block_sizes))
  bl = bl.resolved()
  for name, ok in (("num_warps", (1, 2, 4, 8, 16)), ("num_stages", tuple(range(1, 9)))):
    x = getattr(bl, name)
    if x is None:
      continue
    if backend != "triton":
      raise ValueError(f"`block_sizes.{name}` is a Triton setting; {backend} takes None, "
                       f"got {x!r}")
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x not in ok:
      raise ValueError(f"`block_sizes.{name}` must be one of {ok}, got {x!r}")
  for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
    x = getattr(bl, name)
    if not isinstance(x, (int, np.integer)) or x <= 0:
      raise ValueError(f"`block_sizes.{name}` must be a positive int, got {x!r}")
    if backend == "triton" and (x < 16 or x & (x - 1)):
      raise ValueError(f"`block_sizes.{name}` must be a power of two >= 16 for Triton, got {x}")
    # Mosaic: query blocks of 8 sublanes; key blocks of 128 lanes when an array is blocked
    # along the keys in its last dimension.
    mult = 128 if backend == "mosaic_tpu" and name.startswith("block_k") and key_lanes else 8
    if backend == "mosaic_tpu" and x % mult:
      raise ValueError(
          f"`block_sizes.{name}` must be a multiple of {mult} for Mosaic TPU, got {x}")
  return bl


def attention_from_call(call, *, backend: str | None = None, interpret=None,
                        block_sizes: E.BlockSizes | Mapping[str, int] | None = None,
                        debug: bool = False, block_table=None, row_blocks=None,
                        exp2: bool = False, rescale_threshold: float | None = None,
                        fp8: str | None = None, fp8_rotation: bool = True,
                        fp8_dot: bool | None = None, approx_sigmoid: bool = False):
  """Runs the engine for a validated call (a :class:`jaxsoft.attention.call.AttentionCall`).

  What ``jaxsoft.attention.dot_product_attention(implementation="pallas")`` calls; the
  arguments after ``call`` are the kernel's own settings, as for :func:`attention`.

  Args:
    call: the canonical call; its ``structure`` (a MaskStructure) gives the visible counts,
      the block tables and the kernel's segment ids.
    backend: ``"triton"``, ``"mosaic_tpu"``, or None for the platform's.
    interpret: None picks the driver from the platform (:func:`pick_backend`); otherwise
      the Pallas interpreter flag (or a ``pltpu.InterpretParams``) for ``backend``.
    block_sizes: a :class:`BlockSizes` or a dict of its fields; default per backend.
    debug: print the Pallas kernels' jaxprs.
    block_table: optional bool ``[B|1, N|1, nq, nk]``: the key blocks each query block
      attends to (``nq = ceil(T / block_q)``, ``nk = ceil(S / block_k)``); the forward and
      dQ key loops visit only the listed blocks (that also hold a visible entry of the
      structure) and the dK/dV pass the transposed lists, so an unlisted block is never
      read. Needs ``block_sizes`` with one tile shape for every pass and a normalizer of
      class E, S or P without a dense bias, mask or decay. The visible count n of a row
      (for length-dependent maps) stays the structure's, not the table's.
    row_blocks: optional int ``[B|1, N|1, T, r]`` (with ``block_table``): the key blocks
      each query row may see (-1 = none); a listed tile hides the rows that did not list
      its key block (per-token selections, whose union over a query block is its table
      row).
    exp2: K06: the forward's tile numerators as exp2 in the log2 domain (log2 e folded
      into the kernel's scale; the saved statistics in natural units). Class E with
      ``e^{z - m}`` numerators and a linear score map only (``engine.check_flags``).
    rescale_threshold: K06: tau >= 0 (natural-log units of the scores, at most
      ``engine.MAX_RESCALE_THRESHOLD``): the forward moves its running max, and rescales,
      only where a block's max exceeds it by more than tau (FlashAttention-4's
      conditional rescaling); None (or 0): every time. Class E with ``e^{z - m}``
      numerators.
    fp8: K06: None or ``"e4m3"``: q and k (after ``fp8_rotation``) block-quantised to
      float8_e4m3fn (``kernels_pallas.fp8``); see :func:`attention`.
    fp8_rotation: with ``fp8``, rotate q and k by the seeded randomized Hadamard first.
    fp8_dot: with ``fp8``, whether the forward's scores are a native fp8 dot (float8
      operands, the scales applied to the float32 tile); None: on Triton for classes E,
      S and P, which need an fp8-capable GPU (sm_89+).
    approx_sigmoid: K06, Triton, the sigmoid normalizer: its numerator as
      ``0.5 + 0.5 tanh(z / 2)`` with the GPU's ``tanh.approx.f32`` in every pass
      (``engine.approx_sigmoid_numerator``; |error| < 2.5e-4 on each weight).

  Dense ``bias`` and ``mask`` are read per tile in every pass, broadcast over batch,
  heads, queries or keys without copies; the bias's gradient is the logits' cotangent
  written by the dQ pass (summed over its broadcast axes). A value head dim
  other than the key's, q/k/v of different dtypes (promoted to their common dtype; the
  output takes q's), a traced ``scale`` (folded into q) and Forgetting attention's
  ``decay_bias`` (``cq_i - ck_j`` added per tile from the two vectors before the soft
  cap; its gradients are the row sums of the logits' cotangent, from the dQ passes, and
  minus the column sums, from the dK/dV passes) are supported. So are ``score="distance"``
  (A18: ``|q_i|^2`` and ``-|k_j|^2`` ride on the decay's row and column operands with
  scale -2, as a second term beside a decay; the logit is the square root of the tile's
  ``-2 q.k + |q|^2 + |k|^2`` and the backward chains through it: ``engine.score_tile``,
  ``engine.logits_grad``, ``engine.term_grads``) and
  ``return_residual`` (``m + log D`` from the forward's row statistics for classes E and
  S, 0 for P, the search's tau for T; no gradient). A row whose bias holds a visible
  ``+inf`` follows the normalizer's ``+inf`` rule as the dense path does
  (``jaxsoft.attention.posinf.with_posinf_rule``; its residual is ``+inf``).

  Returns:
    ``o`` [B, T, N, Hv] in q's dtype, or ``(o, residual [B, T, N])`` with
    ``call.return_residual``.

  Raises:
    NotImplementedError: ``return_residual`` for class R (no row statistic is defined), a
      plain callable, a normalizer of kernel class X (or T/R without its blockwise rule),
      a stochastic normalizer, or (with ``interpret=None``) a platform with no Pallas
      backend.
    ValueError: bad block sizes or backend, a block table of the wrong shape, or
      ``exp2`` / ``rescale_threshold`` for a normalizer they do not fit.

  Examples:
    >>> from jaxsoft.attention.call import AttentionCall
    >>> from kernels_pallas import attention_from_call
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 16, 2, 16))
    >>> call = AttentionCall.create(q, k, v, is_causal=True, normalizer="sigmoid")
    >>> attention_from_call(call, backend="triton", interpret=True).shape
    (1, 16, 2, 16)
  """
  settings = dict(backend=backend, interpret=interpret, block_sizes=block_sizes, debug=debug,
                  block_table=block_table, row_blocks=row_blocks, exp2=exp2,
                  rescale_threshold=rescale_threshold, fp8=fp8, fp8_rotation=fp8_rotation,
                  fp8_dot=fp8_dot, approx_sigmoid=approx_sigmoid)
  # (no zero bias for class-R moments: the kernels' backward would write a T x S dS)
  return with_posinf_rule(call, functools.partial(_attention_from_call, **settings),
                          zero_bias_for_moments=False)


def _attention_from_call(call, *, backend: str | None = None, interpret=None,
                         block_sizes: E.BlockSizes | Mapping[str, int] | None = None,
                         debug: bool = False, block_table=None, row_blocks=None,
                         exp2: bool = False, rescale_threshold: float | None = None,
                         fp8: str | None = None, fp8_rotation: bool = True,
                         fp8_dot: bool | None = None, approx_sigmoid: bool = False):
  """The engine for :func:`attention_from_call`, without the ``+inf`` rule."""
  spec = call.spec
  tau = rescale_threshold
  if tau is not None:
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.integer, np.floating)):
      raise ValueError(f"`rescale_threshold` must be None or a number, got {tau!r}")
    tau = float(tau)
  if block_table is None and row_blocks is not None:
    raise ValueError("`row_blocks` needs a `block_table`")
  distance = call.score == "distance"
  if not isinstance(spec, _spec.NormalizerSpec):
    raise E.UnsupportedError("the Pallas engine needs a registered NormalizerSpec, not a callable")
  threshold = spec.kernel_class == "T" and spec.threshold is not None
  row_stats = spec.kernel_class == "R" and spec.row_stats is not None
  if not (threshold or row_stats) and (spec.kernel_class not in ("E", "S", "P")
                                       or spec.tile is None):
    raise E.UnsupportedError(
        f"normalizer {spec.name!r} is of kernel class {spec.kernel_class} without a "
        "blockwise rule; the Pallas engine runs classes E, S and P, T with a ThresholdRule "
        "and R with a RowStatsRule")
  if spec.needs_key:
    raise E.UnsupportedError(f"normalizer {spec.name!r} is stochastic")
  if row_stats and call.return_residual:
    raise E.UnsupportedError(
        f"`return_residual`: normalizer {spec.name!r} (kernel class R) has no row statistic")
  if interpret is None:
    backend, interpret = pick_backend(backend)
  elif backend not in BACKENDS:
    raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")

  # q, k, v in their common dtype (the output takes q's, as xla_chunked's does); a traced
  # scale (e.g. learned) is folded into q in the compute dtype, the kernel's scale is 1 and
  # autodiff of the product gives its gradient (the soft cap and the length-dependent maps
  # see the same scaled logits).
  out_dtype = call.q.dtype
  dtype = jnp.promote_types(jnp.promote_types(call.q.dtype, call.k.dtype), call.v.dtype)
  acc = "float64" if dtype == jnp.float64 else "float32"
  q, k, v = (x.astype(dtype) for x in (call.q, call.k, call.v))
  if distance:  # |q - k|^2 = -2 q.k + |q|^2 + |k|^2 (engine.score_tile); not scaled
    scale = -2.0
  else:
    try:
      scale = float(call.scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
      q = (q.astype(acc) * jnp.asarray(call.scale, acc)).astype(dtype)
      scale = 1.0
  if fp8 not in (None, "e4m3"):
    raise ValueError(f"`fp8` must be None or 'e4m3', got {fp8!r}")
  if not isinstance(fp8_rotation, bool):
    raise ValueError(f"`fp8_rotation` must be a bool, got {fp8_rotation!r}")
  if fp8 is not None and dtype == jnp.float64:
    raise ValueError("`fp8` needs float32/bfloat16/float16 inputs, not float64")
  if fp8 is not None and distance:
    raise ValueError("`fp8` quantises dot-product scores, not score='distance'")
  if not (fp8_dot is None or isinstance(fp8_dot, bool)):
    raise ValueError(f"`fp8_dot` must be None or a bool, got {fp8_dot!r}")
  if fp8_dot is not None and fp8 is None:
    raise ValueError("`fp8_dot` needs `fp8='e4m3'`")
  if fp8_dot and (threshold or row_stats):
    raise ValueError(f"`fp8_dot=True` runs the class E/S/P forward; normalizer {spec.name!r} "
                     f"(class {spec.kernel_class}) multiplies the dequantised q and k "
                     "(leave `fp8_dot` None)")
  # the native fp8 dot: Triton by default (sm_89+ GPUs multiply e4m3 natively); Mosaic on
  # request (TPUs before v7 have no fp8 matrix unit)
  native = fp8 is not None and not (threshold or row_stats) and (
      fp8_dot if fp8_dot is not None else backend == "triton")
  if fp8 is not None and fp8_rotation:  # same orthogonal R on q and k: q.k unchanged
    q, k = (fp8_mod.hadamard_rotation(x).astype(dtype) for x in (q, k))

  st = call.structure
  b, t, n, h = q.shape
  s, kh, hv = k.shape[1], k.shape[2], v.shape[3]
  key_lanes = st.is_per_batch or any(x is not None for x in (call.bias, call.mask,
                                                              call.decay_bias))
  bl = resolve_block_sizes(block_sizes, backend, t, s, h, key_lanes)
  if fp8 is not None:  # per (batch, head, block) e4m3 scales; straight-through gradient
    q_fp8 = fp8_mod.quantize_blocks(jax.lax.stop_gradient(q), bl.block_q)[:2]
    k_fp8 = fp8_mod.quantize_blocks(jax.lax.stop_gradient(k), bl.block_k)[:2]
    q = fp8_mod.straight_through(q, *q_fp8).astype(dtype)
    k = fp8_mod.straight_through(k, *k_fp8).astype(dtype)
  # ACP block pruning of a decay: classes E, S, P follow a block table of the tiles the
  # bound keeps (a dense bias's gradient is 0 on the skipped tiles, as the dQ passes write
  # it); classes T and R hide the pruned tiles inside every pass (engine.prune_mask)
  pruning = call.decay_prune_threshold is not None and call.decay_bias is not None
  prune = block_table is None and pruning and not (threshold or row_stats)
  if block_table is not None:
    _check_table_call(call, threshold or row_stats, block_sizes, bl, block_table, row_blocks)
  elif threshold or row_stats or prune:
    # Class T: the live-block tables of the search serve every pass, so one tile shape;
    # class R: the backward recomputes exactly the statistics pass's tiles; a pruned
    # decay: the table's tiles. The default is the backward passes' (the smaller: more
    # per-row arrays are live).
    tq, tk = (bl.block_q, bl.block_k) if block_sizes is not None else (bl.block_q_dq,
                                                                       bl.block_k_dq)
    bl = E.BlockSizes(tq, tk, num_warps=bl.num_warps, num_stages=bl.num_stages).resolved()
  t_pad = -(-t // math.lcm(bl.block_q, bl.block_q_dkv, bl.block_q_dq))
  t_pad *= math.lcm(bl.block_q, bl.block_q_dkv, bl.block_q_dq)
  s_pad = -(-s // math.lcm(bl.block_k, bl.block_k_dkv, bl.block_k_dq))
  s_pad *= math.lcm(bl.block_k, bl.block_k_dkv, bl.block_k_dq)
  h_pad, hv_pad = _head_pad(backend, h, fp8_dot=native), _head_pad(backend, hv)
  if prune:
    block_table = _decay_keep_table(call.decay_bias, call.decay_prune_threshold, bl, t_pad,
                                    s_pad)

  bias, mask, bias_full, mask_full = _dense_inputs(call, acc, t_pad, s_pad)
  row_ranges = st.row_ranges()  # one search serves the counts and the three block tables
  length = jnp.broadcast_to(st.visible_counts(row_ranges, acc), (b, t))
  if bias is not None or mask is not None:
    length = _dense_counts(call, acc)  # [B, N or 1, T]: the mask and -inf bias hide keys
  length_rows = length.ndim == 3

  params = sorted(call.params.items())
  dyn_names = tuple(nm for nm, x in params if not is_static(x))
  cfg = E.Config(
      spec=spec, static_hp=tuple((nm, x) for nm, x in params if is_static(x) and x is not None),
      dyn_hp=dyn_names, scale=scale, soft_cap=call.logits_soft_cap, causal=st.is_causal,
      window=st.window, has_segments=st.is_per_batch, t=t, s=s, t_pad=t_pad, s_pad=s_pad,
      head_dim_pad=h_pad, num_heads=n, num_kv_heads=kh, blocks=bl, backend=backend,
      interpret=interpret, debug=debug, acc=acc, value_dim_pad=hv_pad, bias_full=bias_full,
      mask_full=mask_full, length_rows=length_rows,
      decay=call.decay_bias is not None or distance, distance=distance,
      distance_decay=distance and call.decay_bias is not None,
      prune_threshold=(float(call.decay_prune_threshold)
                       if pruning and (threshold or row_stats) else None),
      key_table=block_table is not None,
      row_select=0 if row_blocks is None else _select_width(backend, row_blocks),
      exp2=exp2, rescale_threshold=tau, fp8_dot=native, approx_sigmoid=approx_sigmoid)
  E.check_flags(cfg)

  # Per-row parameters [B, N, T_pad, 1]; autodiff of the broadcast sums their cotangents back.
  pad_rows = ((0, 0), (0, 0), (0, t_pad - t), (0, 0))
  dyn = tuple(jnp.pad(rows(call.params[nm], b, n, t, cfg.acc_dtype), pad_rows, mode="edge")
              for nm in dyn_names)
  ids = st.kernel_segment_ids(t_pad, s_pad)

  def ranges(bq, bk, axis):
    table = st.block_table(bq, bk, t_pad // bq, s_pad // bk, ranges=row_ranges)
    return table_ranges(jnp.broadcast_to(table, (b,) + table.shape[1:]), axis)

  tables = {}
  if block_table is None:
    f_lo, f_hi = ranges(bl.block_q, bl.block_k, 2)
    q_lo, q_hi = ranges(bl.block_q_dq, bl.block_k_dq, 2)
    k_lo, k_hi = ranges(bl.block_q_dkv, bl.block_k_dkv, 1)
  else:
    f_lo = f_hi = q_lo = q_hi = k_lo = k_hi = None
    tables = _table_lists(cfg, st, row_ranges, block_table, row_blocks, b, n, t)
  if length_rows:
    length = jnp.pad(jnp.broadcast_to(length, (b, n, t)), ((0, 0), (0, 0), (0, t_pad - t)))
  else:
    length = jnp.pad(length, ((0, 0), (0, t_pad - t)))
  pad_q = ((0, 0), (0, t_pad - t), (0, 0), (0, h_pad - h))
  pad_k = ((0, 0), (0, s_pad - s), (0, 0), (0, h_pad - h))
  if native:  # the forward's float8 operands and their per-row / per-key scales
    q8, q_scale = fp8_mod.kernel_operands(*q_fp8, t_pad)
    k8, k_scale = fp8_mod.kernel_operands(*k_fp8, s_pad)
    tables.update(q8=jnp.pad(q8, ((0, 0),) * 3 + (pad_q[3],)), q_scale=q_scale[..., None],
                  k8=jnp.pad(k8, ((0, 0),) * 3 + (pad_k[3],)), k_scale=k_scale[:, :, None])
  aux = E.Aux(
      q_seg=None if ids is None else ids[0][..., None],
      k_seg=None if ids is None else ids[1][:, None, :],
      length=length[..., None],
      fwd_lo=f_lo, fwd_hi=f_hi, dq_lo=q_lo, dq_hi=q_hi, dkv_lo=k_lo, dkv_hi=k_hi, mask=mask,
      **tables)
  pad_v = ((0, 0), (0, s_pad - s), (0, 0), (0, hv_pad - hv))
  args = (cfg, jnp.pad(q, pad_q), jnp.pad(k, pad_k), jnp.pad(v, pad_v), dyn, aux)
  decay = _decay_rows(call, acc, t_pad, s_pad)
  if distance:  # the squared norms first, then the decay's terms (Config.distance_decay)
    norms = _distance_rows(q, k, acc, t_pad, s_pad)
    decay = norms if decay is None else (jnp.concatenate((norms[0], decay[0]), axis=3),
                                         jnp.concatenate((norms[1], decay[1]), axis=2))
  refuse_unsupported_ad((args[1:5], bias, decay), core.WHERE)
  if threshold:
    assert spec.threshold is not None  # class T with its rule (``threshold`` above)
    if spec.threshold.stats is not None:  # its derived rows first (top-p: softmax's m, l)
      cfg, dyn = row_stats_core.with_derived_rows(cfg, *args[1:3], args[4], aux, bias, decay,
                                                  constant=True)
      args = (cfg, *args[1:4], dyn, aux)
    o, stat = core.threshold_core(*args, bias, decay)
  elif row_stats:
    o, stat = row_stats_core.row_stats_attention(*args, bias, decay)
  else:
    o, stat = core.attention_core(*args, bias, decay)
  o = o[:, :t, :, :hv].astype(out_dtype)
  if not call.return_residual:
    return o
  stat = jax.lax.stop_gradient(jnp.swapaxes(stat[:, :, :t, 0], 1, 2))  # [B, T, N]
  return o, stat.astype(out_dtype)


def _check_table_call(call, threshold_or_row_stats: bool, block_sizes, bl: E.BlockSizes,
                      block_table, row_blocks):
  """What a block-table call needs (``attention_from_call(block_table=...)``)."""
  if threshold_or_row_stats:
    raise E.UnsupportedError(
        f"a `block_table` runs normalizers of class E, S or P, not {call.spec.name!r} (class "
        f"{call.spec.kernel_class})")
  if any(x is not None for x in (call.bias, call.mask, call.decay_bias)):
    raise E.UnsupportedError("a `block_table` takes no dense bias, mask or decay_bias")
  if block_sizes is None:
    raise ValueError("`block_sizes` is required with a `block_table` (its block shape)")
  if (bl.block_q_dkv, bl.block_q_dq, bl.block_k_dkv, bl.block_k_dq) != (
      bl.block_q, bl.block_q, bl.block_k, bl.block_k):
    raise ValueError(f"`block_sizes` must be one tile shape for every pass with a "
                     f"`block_table` (the table's blocks), got {bl}")
  (b, t, n, _), s = call.q.shape, call.k.shape[1]
  nq, nk = -(-t // bl.block_q), -(-s // bl.block_k)
  shape = jnp.shape(block_table)
  if len(shape) != 4 or shape[2:] != (nq, nk) or shape[0] not in (1, b) or \
      shape[1] not in (1, n):
    raise ValueError(f"`block_table` must have shape [B|1, N|1, nq, nk] = [{b}, {n}, {nq}, "
                     f"{nk}], got {shape}")
  if row_blocks is not None:
    shape = jnp.shape(row_blocks)
    if len(shape) != 4 or shape[2] != t or shape[0] not in (1, b) or shape[1] not in (1, n) \
        or not jnp.issubdtype(jnp.result_type(row_blocks), jnp.integer):
      raise ValueError(f"`row_blocks` must be int [B|1, N|1, T, r] with T={t}, got "
                       f"{jnp.result_type(row_blocks)} {shape}")


def _select_width(backend: str, row_blocks) -> int:
  """The kernel's width of the per-row block lists (a power of two for Triton)."""
  r = max(1, jnp.shape(row_blocks)[-1])
  return E._next_pow2(r) if backend == "triton" else r


def _table_lists(cfg: E.Config, st, row_ranges, block_table, row_blocks, b: int, n: int,
                 t: int) -> dict[str, Any]:
  """The Aux fields of a block-table call: the compacted lists of the table (restricted to
  the tiles holding a visible entry of the structure) and the padded per-row lists."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  nq, nk = cfg.t_pad // bq, cfg.s_pad // bk
  table = jnp.asarray(block_table)  # shapes checked by _check_table_call
  structure = st.block_table(bq, bk, nq, nk, ranges=row_ranges)  # [B|1, nq, nk]
  table = jnp.logical_and(jnp.broadcast_to(table != 0, (b, n, nq, nk)), structure[:, None])
  idx, cnt, idx_t, cnt_t = core.block_lists(cfg, jax.lax.stop_gradient(table))
  out = dict(fwd_idx=idx, fwd_cnt=cnt, dkv_idx=idx_t, dkv_cnt=cnt_t)
  if row_blocks is not None:
    sel = jnp.asarray(row_blocks)
    sel = jnp.broadcast_to(sel.astype(jnp.int32), (b, n, t, sel.shape[3]))
    out["sel"] = jnp.pad(sel, ((0, 0), (0, 0), (0, cfg.t_pad - t),
                               (0, cfg.row_select - sel.shape[3])), constant_values=-1)
  return out


def _decay_keep_table(decay_bias, threshold: float, bl: E.BlockSizes, t_pad: int,
                      s_pad: int):
  """ACP block pruning of Forgetting attention's decay (Lin et al. 2025, "Adaptive
  Computation Pruning for the Forgetting Transformer"): the tiles to compute, bool [B, N,
  nq, nk] (no gradient). A tile of batch b and head n is kept when
  ``max_i cq_i - min_j ck_j >= threshold`` over its rows and columns, so every logit of a
  skipped tile has a decay term below the threshold (xla_chunked's bound, there taken over
  all batches and heads at once). Padded rows and keys take no part in the bound."""
  cq, ck = (jax.lax.stop_gradient(jnp.asarray(x, jnp.float32)) for x in decay_bias)
  (b, t, n), s = cq.shape, ck.shape[1]
  bq, bk = bl.block_q, bl.block_k
  cq = jnp.pad(cq, ((0, 0), (0, t_pad - t), (0, 0)), constant_values=-jnp.inf)
  ck = jnp.pad(ck, ((0, 0), (0, s_pad - s), (0, 0)), constant_values=jnp.inf)
  q_max = jnp.max(cq.reshape(b, t_pad // bq, bq, n), axis=2)  # [B, nq, N]
  k_min = jnp.min(ck.reshape(b, s_pad // bk, bk, n), axis=2)  # [B, nk, N]
  keep = q_max[:, :, None, :] - k_min[:, None, :, :] >= threshold  # [B, nq, nk, N]
  return jnp.transpose(keep, (0, 3, 1, 2))


def _decay_rows(call: AttentionCall, acc: str, t_pad: int, s_pad: int):
  """Forgetting attention's ``(cq [B, T, N], ck [B, S, N])`` as the kernel's row and column
  vectors (:func:`_row_column`; None without a decay). The ``decay_prune_threshold`` acts
  through :func:`_decay_keep_table`."""
  if call.decay_bias is None:
    return None
  return _row_column(*call.decay_bias, acc, t_pad, s_pad)


def _distance_rows(q, k, acc: str, t_pad: int, s_pad: int):
  """``score="distance"``: ``|q_i|^2`` and ``-|k_j|^2`` (each key head's repeated for the
  query heads of its group) as the kernel's row and column vectors, differentiable (the
  kernel returns their cotangents as the decay's; autodiff chains them to q and k)."""
  qn = jnp.sum(jnp.square(q.astype(acc)), axis=-1)  # [B, T, N]
  kn = jnp.sum(jnp.square(k.astype(acc)), axis=-1)  # [B, S, K]
  kn = jnp.repeat(kn, q.shape[2] // k.shape[2], axis=2)  # query head n reads kv head n // G
  return _row_column(qn, -kn, acc, t_pad, s_pad)


def _row_column(cq, ck, acc: str, t_pad: int, s_pad: int):
  """``(cq [B, T, N], ck [B, S, N])`` -> the kernel's ``(cq [B, N, T_pad, 1], ck [B, N, 1,
  S_pad])`` in the compute dtype, zero-padded."""
  cq, ck = (jnp.swapaxes(x.astype(acc), 1, 2) for x in (cq, ck))
  cq = jnp.pad(cq, ((0, 0), (0, 0), (0, t_pad - cq.shape[2])))[..., None]
  ck = jnp.pad(ck, ((0, 0), (0, 0), (0, s_pad - ck.shape[2])))[:, :, None, :]
  return cq, ck


def _head_pad(backend: str, h: int, fp8_dot: bool = False) -> int:
  """A head dim padded as the driver needs: a power of two >= 16 (Triton; >= 32 for an
  fp8 dot, the reduction depth of Hopper's fp8 MMA), 64 or a multiple of 128 (Mosaic)."""
  if backend == "triton":
    return max(32 if fp8_dot else 16, 1 << (h - 1).bit_length())
  return h if (h % 128 == 0 or h == 64) else -(-h // 128) * 128


def _full_axes(x) -> tuple[bool, bool, bool, bool]:
  """Which axes of a [B, N, T, S]-broadcastable array are held in full (size > 1)."""
  return tuple(bool(d > 1) for d in x.shape)  # type: ignore[return-value]


def _pad_dense(x, t_pad: int, s_pad: int, value):
  """Pads the held T and S axes of a 4-D bias/mask to the kernel's lengths."""
  t, s = x.shape[2], x.shape[3]
  pads = ((0, 0), (0, 0), (0, t_pad - t if t > 1 else 0), (0, s_pad - s if s > 1 else 0))
  return jnp.pad(x, pads, constant_values=value)


def _dense_inputs(call, acc: str, t_pad: int, s_pad: int):
  """(bias, mask, bias_full, mask_full): the dense bias in the compute dtype and the mask as
  int32 (1 = attend), each padded along the axes it holds and never broadcast (a
  broadcast axis stays of size 1: every block's index map pins it to block 0)."""
  bias = mask = bias_full = mask_full = None
  if call.bias is not None:
    bias_full = _full_axes(call.bias)
    bias = _pad_dense(call.bias.astype(acc), t_pad, s_pad, 0.0)
  if call.mask is not None:
    mask_full = _full_axes(call.mask)
    mask = _pad_dense(call.mask.astype(jnp.int32), t_pad, s_pad, 0)
  return bias, mask, bias_full, mask_full


def _dense_counts(call, acc: str):
  """The visible count n of each row with a dense mask or bias, as the dense path counts
  it: the structure, the mask and the keys whose bias is not ``-inf``. Returns [B, T]
  when neither varies over heads, else [B, N, T] (one fused reduction over the inputs)."""
  vis = call.structure.dense()  # [B|1, 1, T, S]
  if call.mask is not None:
    vis = jnp.logical_and(vis, call.mask)
  if call.bias is not None:
    vis = jnp.logical_and(vis, jax.lax.stop_gradient(call.bias) != -jnp.inf)
  cnt = jnp.sum(vis, axis=-1, dtype=acc)  # [B|1, N|1, T]
  b, t = call.q.shape[0], call.q.shape[1]
  if cnt.shape[1] == 1:
    return jnp.broadcast_to(cnt[:, 0], (b, t))
  return cnt


def attention(q, k, v, bias=None, mask=None, *, normalizer="softmax",
              normalizer_params: Mapping[str, Any] | None = None, scale=None,
              is_causal: bool = False, local_window_size=None, segment_ids=None,
              logits_soft_cap=None, backend: str = "triton", interpret=False,
              block_sizes: E.BlockSizes | Mapping[str, int] | str | None = None,
              query_seq_lengths=None, key_value_seq_lengths=None, decay_bias=None,
              debug: bool = False, exp2: bool = False,
              rescale_threshold: float | None = None, fp8: str | None = None,
              fp8_rotation: bool = True, fp8_dot: bool | None = None,
              return_residual: bool = False, score: str = "dot",
              decay_prune_threshold: float | None = None, approx_sigmoid: bool = False):
  r"""Blockwise ("flash") attention for any normalizer of kernel class E, S, P, T or R.

  .. math::
    O_i = \sum_{j \in V_i} f(s_{ij})\, v_j,\qquad s_{ij} = \mathrm{cap}\cdot\tanh\!\Big(
    \frac{\mathrm{scale}\; q_i \cdot k_j}{\mathrm{cap}}\Big)

  with ``f`` the normalizer applied over the row's visible keys ``V_i`` (causal, window,
  segments, sequence lengths), exactly as ``normalizer(logits, where=mask) @ v`` but without
  any T x S buffer. The kernel body is generated from the normalizer's tile rule
  (``kernels_pallas.engine``); forward and backward are Pallas kernels (FlashAttention-2
  backward: a dK/dV pass and a dQ pass from per-row statistics). The arguments are
  validated as by ``jaxsoft.attention.dot_product_attention``, which reaches the same
  kernel with ``implementation="pallas"``.

  Args:
    q: queries ``[B, T, N, H]`` (or ``[T, N, H]``).
    k, v: keys ``[B, S, K, H]`` and values ``[B, S, K, Hv]``, ``N % K == 0`` (GQA/MQA;
      K/V are not copied); q, k, v may differ in dtype (promoted; the output takes q's).
    bias: a float bias added to the (soft-capped) logits, broadcastable to
      ``[B, N, T, S]`` (e.g. ``[T, S]``, ``[1, N, T, S]``); ``-inf`` hides a key. It is
      differentiable and never broadcast to a copy.
    mask: a boolean mask (True = attend), broadcastable to ``[B, N, T, S]``.
    normalizer: a registered name or a NormalizerSpec of class E, S or P, of class T
      with a ThresholdRule (sparsemax, entmax15, entmax with a per-head ``alpha``,
      top_k_softmax: the AdaSplash-style kernels, kernels_pallas/README.md) or of class R
      with a RowStatsRule.
    normalizer_params: hyperparameters of the normalizer: Python scalars (compiled in) or
      arrays broadcast to the rows of the scores ``[B, N, T, 1]`` (e.g. per head
      ``[N, 1, 1]``), which are differentiable. Learned attention sinks are
      ``normalizer="softmax_sink"`` with ``{"sink_logit": sinks.reshape(N, 1, 1)}``.
    scale: logit scale, default ``1/sqrt(H)``; a traced (e.g. learned) scale is folded
      into q and differentiable.
    is_causal: query i sees keys j <= i.
    local_window_size: ``w`` or ``(left, right)``: query i sees keys in [i - left, i + right].
    segment_ids: ``[B, T]`` (self-attention) or a pair (``[B, T]``, ``[B, S]``); only equal
      ids attend.
    logits_soft_cap: ``cap`` of the tanh soft cap (Gemma 2), or None.
    backend: ``"triton"`` (GPU) or ``"mosaic_tpu"``.
    interpret: run in the Pallas interpreter (CPU); a ``pltpu.InterpretParams`` selects TPU
      interpret mode for the Mosaic driver.
    block_sizes: a :class:`BlockSizes` (or a dict of its fields); default per backend
      (``engine.default_block_sizes``); ``"auto"``: the fastest legal shape that agrees
      with the default's result, timed forward + backward once per call key and cached
      (K06, :func:`kernels_pallas.autotune.autotune_block_sizes`).
    query_seq_lengths, key_value_seq_lengths: ``[B]`` valid lengths (padding masks).
    decay_bias: Forgetting attention's ``(cq [B, T, N], ck [B, S, N])``: ``cq_i - ck_j`` is
      added to the scaled logits before the soft cap (differentiable).
    debug: print the Pallas kernels' jaxprs.
    exp2: compute the forward's numerators with exp2, log2 e folded into the scale
      (FlashAttention-2/3; class E with e^(z - m) numerators and a linear score map:
      softmax, softmax_1, softmax_n, softmax_sink; any soft cap, bias, decay).
    rescale_threshold: tau in [0, 64] or None: the forward rescales its accumulator only
      when a block's max exceeds the running one by more than tau (FlashAttention-4;
      class E with e^(z - m) numerators). Both flags give the same result up to float32
      rounding and leave the backward unchanged.
    fp8: K06, None or ``"e4m3"`` (FlashAttention-3's fp8 forward numerics): q and k are
      rotated along the head dim by a fixed seeded randomized Hadamard matrix
      (``fp8_rotation``; head dim zero-padded to a power of two; q . k unchanged, outlier
      channels spread), then quantised to float8_e4m3fn per (batch, head, query block)
      and per (batch, kv-head, key block) with float32 scales amax/448. The forward's
      scores are a native fp8 dot (``fp8_dot``) times the two scales, or the dot of the
      dequantised values, equal up to float32 rounding: either way they carry exactly
      the fp8 error. v is not quantised. Any normalizer/mask the kernel runs. Gradient:
      straight-through (identity through the quantiser); the backward passes run on the
      dequantised q, k, so the saved statistics are consistent, and the rotation is
      differentiated exactly. Measured forward error vs the float32 dense reference
      (B=1, T=256, N=2, H=64, blocks 64, causal; tests/kernels_pallas/test_fp8.py), max
      abs / mean abs of the output: see ``kernels_pallas.fp8.ERRORS``.
    fp8_rotation: apply the Hadamard rotation with ``fp8`` (default True).
    fp8_dot: with ``fp8``: True, the forward's score tiles are a native fp8 dot (float8
      q and k operands, float32 accumulation, the scales applied to the tile: the
      operation FlashAttention-3's fp8 forward speeds up); False, the kernel multiplies
      the dequantised values; None (default), native on Triton (an fp8-capable GPU,
      sm_89+, is needed) and dequantised on Mosaic (TPUs before v7 have no fp8 matrix
      unit). Classes E, S and P; class T and R always multiply dequantised values.
    return_residual: also return the row statistic of ``jaxsoft.attention``'s
      ``return_residual`` (no gradient): the log-sum-exp ``m + log D`` for classes E and
      S (their offset's mass included), 0 for P, the threshold tau for T; class R
      defines none (NotImplementedError).
    score: ``"dot"`` or ``"distance"`` (A18: the logit is ``|q_i - k_j|``, unscaled: leave
      ``scale`` None; not with a ``decay_bias`` or ``fp8``).
    approx_sigmoid: K06 (Triton, ``normalizer="sigmoid"``): the numerator as
      ``0.5 + 0.5 tanh(z / 2)`` with the GPU's ``tanh.approx.f32`` (FlashSigmoid), forward
      and backward; each weight within 2.5e-4 of the exact sigmoid (PTX's documented
      bound). In interpret mode ``jnp.tanh`` stands in.
    decay_prune_threshold: with ``decay_bias``, a float t < 0: ACP block pruning (Lin et
      al. 2025): a tile whose decay bound ``max_i cq_i - min_j ck_j`` is below t is
      skipped in every pass (a block table; one tile shape for all passes), so each
      skipped logit's decay term is below t (``jaxsoft.attention``'s bound on the
      output). Every class: E, S and P skip the tiles through the block table (with a
      dense bias too: its gradient is 0 on the skipped tiles), T and R hide them inside
      every pass (``engine.prune_mask``).

  Returns:
    ``[B, T, N, Hv]`` in q's dtype (with ``return_residual``, the pair ``(out, residual
    [B, T, N])``). A query row with no visible key gives zeros (and residual ``-inf``
    for classes E, S and T).

  Raises:
    NotImplementedError (``engine.UnsupportedError``): a normalizer of class X, a plain
      callable, or a stochastic normalizer; the dispatcher falls back to XLA.
    ValueError: bad shapes or arguments (the message names the argument).

  Examples:
    In the Pallas interpreter on a CPU (on a GPU or TPU leave ``interpret`` False),
    softmax attention equals jax.nn's:

    >>> import kernels_pallas as kp
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 16, 2, 16))   # [B, T, N, H]
    >>> out = kp.attention(q, k, v, is_causal=True, backend="triton", interpret=True)
    >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
    ((1, 16, 2, 16), True)
  """
  if isinstance(block_sizes, str):
    if block_sizes != "auto":
      raise ValueError("`block_sizes` must be None, 'auto', a BlockSizes or a dict, got "
                       f"{block_sizes!r}")
    block_sizes = autotune.autotune_block_sizes(
        attention, q, k, v, backend=backend, interpret=interpret, is_causal=is_causal,
        normalizer=normalizer, bias=bias, mask=mask, normalizer_params=normalizer_params,
        scale=scale, local_window_size=local_window_size, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, decay_bias=decay_bias, exp2=exp2,
        rescale_threshold=rescale_threshold, fp8=fp8, fp8_rotation=fp8_rotation,
        fp8_dot=fp8_dot, score=score, approx_sigmoid=approx_sigmoid)
  call = AttentionCall.from_scope(q, k, v, locals())
  out = attention_from_call(call, backend=backend, interpret=interpret,
                            block_sizes=block_sizes, debug=debug, exp2=exp2,
                            rescale_threshold=rescale_threshold, fp8=fp8,
                            fp8_rotation=fp8_rotation, fp8_dot=fp8_dot,
                            approx_sigmoid=approx_sigmoid)
  if jnp.ndim(q) == 3:  # unbatched
    return tuple(x[0] for x in out) if return_residual else out[0]
  return out
