"""jaxsoft.attention.dot_product_attention: the one entry point (validation and dispatch)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

import kernels_pallas
from jaxsoft.attention import _chunked, _debug_checks, _dense, _tokamax
from jaxsoft.attention import scores as _scores
from jaxsoft.attention.call import IMPLEMENTATIONS, AttentionCall, implementation_order
from jaxsoft.attention.differentiation import UnsupportedDifferentiation
from jaxsoft.normalizers import spec as _spec
from kernels_pallas import sharding as _pallas_sharding

__all__ = ["dot_product_attention", "IMPLEMENTATIONS"]


# implementation=None uses the chunked path when one head's score matrix has at least this
# many entries (T·S >= 1024·1024, 4 MiB of float32): below it the dense path's T x S
# buffers are small and its few large fused ops are faster on CPU; above it the chunked
# path is faster (causal block skipping, no T x S round trips to memory) and its memory
# is O(T·H) instead of O(T·S).
CHUNKED_MIN_SCORES = 1024 * 1024


# ------------------------------------------------------------------------ implementations


def _run_xla(call: AttentionCall):
  statistic = None
  if call.return_residual:
    spec, params = call.spec, call.params
    if isinstance(spec, _spec.NormalizerSpec) and spec.needs_key:
      raise NotImplementedError(f"`return_residual`: normalizer {spec.name!r} is stochastic")
    statistic = lambda logits, visible: _dense.row_statistic(spec, params, logits, visible)
  return _dense.dense_attention(
      call.q, call.k, call.v, bias=call.bias, mask=call.mask, structure=call.structure,
      scale=call.scale, logits_soft_cap=call.logits_soft_cap, normalize=call.normalize_fn(),
      decay_bias=call.decay_bias, statistic=statistic, score=call.score,
      zeros_where_masked=isinstance(call.spec, _spec.NormalizerSpec))


def _run_cudnn(call: AttentionCall):
  """jax.nn's cuDNN flash attention, for what it computes: softmax on a CUDA GPU."""
  if call.score != "dot":
    raise NotImplementedError(f"cudnn computes dot-product scores only, not score={call.score!r}")
  if jax.default_backend() not in ("gpu", "cuda"):
    raise NotImplementedError(
        f"cudnn needs a CUDA GPU (the default backend is {jax.default_backend()!r})")
  spec = call.spec
  if not (isinstance(spec, _spec.NormalizerSpec) and spec.name == "softmax" and not call.params):
    raise NotImplementedError("cudnn computes softmax attention only (no normalizer_params)")
  unsupported = [name for name, value in (
      ("segment_ids", call.segment_ids), ("logits_soft_cap", call.logits_soft_cap),
      ("decay_bias", call.decay_bias)) if value is not None]
  if unsupported:
    raise NotImplementedError(f"cudnn does not take {', '.join(unsupported)}")
  if call.v.shape != call.k.shape or not call.q.dtype == call.k.dtype == call.v.dtype:
    raise NotImplementedError("cudnn needs value shaped like key and one dtype for q, k, v")
  if not isinstance(call.scale, float):
    raise NotImplementedError("cudnn needs a concrete Python float `scale`")
  cudnn: Any = jax.nn.dot_product_attention  # its overloads want a literal return_residual
  return cudnn(
      call.q, call.k, call.v, call.bias, call.mask, scale=call.scale, is_causal=call.is_causal,
      query_seq_lengths=call.query_seq_lengths,
      key_value_seq_lengths=call.key_value_seq_lengths,
      local_window_size=call.local_window_size, implementation="cudnn",
      return_residual=call.return_residual)


def _run_cudnn_auto(call: AttentionCall):
  """cuDNN as the automatic first choice on a CUDA GPU (measured on an H200 with bf16, H =
  128, T = 4k-16k: 1.7-2.1x the Pallas kernel's forward rate, 2.9-3.7x forward+backward,
  docs/benchmarks.md). Only
  for calls whose every query row sees a key, where cuDNN and jaxsoft agree on the
  result: no dense mask, no sequence lengths, no residual. jax.nn's own refusals (a
  ValueError or RuntimeError at trace time: an unsupported head dim, sharding along the
  sequence, no cuDNN) become NotImplementedError, so the next implementation runs."""
  kept = [name for name, value in (
      ("mask", call.mask), ("query_seq_lengths", call.query_seq_lengths),
      ("key_value_seq_lengths", call.key_value_seq_lengths)) if value is not None]
  if kept or call.return_residual:
    raise NotImplementedError(
        "cudnn is chosen automatically only where no row can be fully masked and no "
        f"residual is asked for (this call has {', '.join(kept) or 'return_residual'})")
  try:
    return _run_cudnn(call)
  except (ValueError, RuntimeError) as e:
    raise NotImplementedError(f"cudnn refused the call: {e}") from e


def _run_xla_chunked(call: AttentionCall):
  return _chunked.chunked_attention(call)


def _run_pallas(call: AttentionCall, backend):
  """The Pallas kernel; inputs sharded over a mesh (outside ``shard_map``) run it on each
  device's shard of the batch and heads (a pallas_call is not partitioned by XLA: Explicit
  axes fail, Auto ones are gathered)."""
  layout = _pallas_sharding.call_layout(call) if call.key is None else None
  if layout is not None:
    return _pallas_sharding.sharded_attention_from_call(call, *layout, backend=backend)
  return kernels_pallas.attention_from_call(call, backend=backend)


# (the blockwise paths run as one jitted computation under jax.debug_infs / debug_nans:
# their internal -inf sentinels stay inside it, as the dense path's do; _debug_checks)
_RUNNERS = {
    "xla": _run_xla,
    "xla_chunked": _debug_checks.checked(_run_xla_chunked, "xla_chunked"),
    "pallas": _debug_checks.checked(lambda call: _run_pallas(call, None), "pallas"),
    "pallas_triton": _debug_checks.checked(lambda call: _run_pallas(call, "triton"),
                                           "pallas_triton"),
    "pallas_mosaic_tpu": _debug_checks.checked(lambda call: _run_pallas(call, "mosaic_tpu"),
                                               "pallas_mosaic_tpu"),
    "cudnn": _run_cudnn,
    "cudnn_auto": _run_cudnn_auto,  # the automatic order's cudnn (never a user's name)
    "tokamax": _tokamax.run_tokamax,
    "tokamax_auto": _tokamax.run_tokamax_auto,  # after cudnn_auto, where importable
}


def _empty_result(call: AttentionCall):
  """B = 0, T = 0 or S = 0: zeros [B, T, N, Hv] (and a ``-inf`` residual), as jax.nn."""
  B, T, N, _ = call.q.shape
  out = jnp.zeros((B, T, N, call.v.shape[-1]), call.q.dtype)
  if not call.return_residual:
    return out
  return out, jnp.full((B, T, N), -jnp.inf, call.q.dtype)


def _default_order(call: AttentionCall) -> list[str]:
  order = []
  if jax.default_backend() in ("gpu", "cuda"):
    order.append("cudnn_auto")
    if _tokamax.tokamax_module() is not None:
      order.append("tokamax_auto")
  if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu"):
    order.append("pallas")
  T, S = call.q.shape[1], call.k.shape[1]
  if T * S >= CHUNKED_MIN_SCORES:
    order.append("xla_chunked")
  order.append("xla")
  return order


def dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
    mask: ArrayLike | None = None, *, scale: float | ArrayLike | None = None,
    is_causal: bool = False, query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | Sequence[str] | None = None,
    return_residual: bool = False,
    segment_ids: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    logits_soft_cap: float | None = None,
    normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
    normalizer_params: Mapping[str, Any] | None = None,
    decay_bias: tuple[ArrayLike, ArrayLike] | None = None,
    decay_prune_threshold: float | None = None,
    score: str = "dot") -> Any:
  r"""Scaled dot-product attention with any normalizer (features A01, A02; docs/feature_ids.md).

  A drop-in superset of :func:`jax.nn.dot_product_attention`: the same arguments (names
  ``query``, ``key``, ``value``, ``bias``, ``mask`` in the same positions, the same
  keywords, ``implementation="xla"`` / ``"cudnn"`` and ``return_residual``), with the
  same meaning. For each batch b, head n and query i:

  .. math::
    \ell_{ij} = c \tanh\Big(\frac{s\, q_i \cdot k_j + cq_i - ck_j}{c}\Big) + \mathrm{bias}_{ij},
    \qquad w_{i\cdot} = f(\ell_{i\cdot};\ \mathrm{where}=V_i), \qquad
    o_i = \sum_{j \in V_i} w_{ij} v_j

  where s is ``scale`` (default 1/sqrt(H)), c is ``logits_soft_cap`` (no tanh when
  None), the decay terms appear only with ``decay_bias``, f is the normalizer over the
  key axis, and V_i is the set of keys query i sees: the intersection of ``mask``,
  ``is_causal`` (j <= i), ``local_window_size`` (i - left <= j <= i + right), the
  sequence lengths (i < query_seq_lengths[b], j < key_value_seq_lengths[b]), equal
  ``segment_ids``, and finite logits (a ``-inf`` in ``bias`` masks too).

  With ``normalizer="softmax"`` the result and its gradients equal jax.nn's, with one
  documented difference: **a query row with no visible key returns zeros** (with zero
  gradient, and a residual of ``-inf``), where jax.nn returns the average of the values
  (its masked logits are a large finite negative number, and so is its residual). Rows
  past ``query_seq_lengths`` are zeros in both. Keys past ``key_value_seq_lengths`` are
  padding: what their key and value hold (NaN and inf included) reaches no output and no
  gradient on any path. A NaN logit at a visible key (from q, k or the bias) makes its row
  NaN; a NaN bias entry at a hidden logit is ignored (output and gradients). A NaN in
  ``value`` makes that component NaN in every row that sees its key, and may reach rows
  that the mask, the causal structure, a window or segments hide it from (a weight of 0
  times NaN in the weighted sum, as in jax.nn). Empty inputs (B, T or S = 0) return zeros
  of the output's shape (residual ``-inf``), as jax.nn. Integer and bool inputs are
  computed in float32 and the result is float32 (jax.nn casts the weights back to the
  integer dtype and returns zeros).

  Args:
    query: queries [B, T, N, H] (or [T, N, H]).
    key: keys [B, S, K, H] (or [S, K, H]); N % K == 0 (GQA/MQA: query head n uses
      key/value head n // (N / K), as jax.nn).
    value: values [B, S, K, Hv] (Hv may differ from H).
    bias: optional float array broadcastable to [B, N, T, S] (right-aligned), added to the
      logits after soft-capping; differentiable. A boolean array is a ValueError (pass it
      as ``mask``; jax.nn would add it as 0/1).
    mask: optional boolean array broadcastable to [B, N, T, S]; True = attend.
    scale: logit scale; None = 1/sqrt(H).
    is_causal: query i sees keys j <= i (top-left aligned when T != S, as jax.nn).
    query_seq_lengths, key_value_seq_lengths: optional int arrays [B] (padding). A
      concrete length below 0 or above T / S is a ValueError; traced lengths (under jit,
      grad, vmap) cannot be checked and are clamped to [0, T] / [0, S] (a negative length
      is 0, one past the sequence is the whole sequence, as in jax.nn).
    local_window_size: int w (= (w, w)) or (left, right), Python ints (static): query i
      sees keys i - left .. i + right; ``left + right < 0`` (no key for any query, e.g.
      -1 or (-3, 0)) is a ValueError.
    segment_ids: int [B, T] (self-attention) or a pair (q_ids [B, T], kv_ids [B, S]) for
      packed sequences: a query sees only keys of its own segment.
    logits_soft_cap: optional c > 0: logits -> c·tanh(logits / c) (before bias and mask).
    normalizer: a registered name (``jaxsoft.normalizers.names()``), a NormalizerSpec or a
      callable ``f(x, axis=-1, where=None, **params)``.
    normalizer_params: dict of the normalizer's hyperparameters. Array values broadcast
      right-aligned against the logits [B, N, T, S] with size 1 along S (a per-head
      value has shape [N, 1, 1]); they are differentiable. A stochastic normalizer gets its
      PRNG key as ``normalizer_params["key"]``. Length-dependent normalizers (ssmax,
      sigmoid with bias -log n, ...) use n = the number of visible keys of each query row.
    implementation: None, "xla", "xla_chunked", "pallas", "pallas_triton",
      "pallas_mosaic_tpu", "cudnn", "tokamax", or a sequence of these tried in order: an implementation that
      cannot handle the call raises NotImplementedError and the next one is tried; a single
      explicitly requested implementation that cannot handle it raises. None tries
      "cudnn" on a CUDA GPU (see below), "pallas" on GPU/TPU, then "xla_chunked" when T·S >= 1024·1024 (and the normalizer has
      a tile, threshold or row-statistics rule), then "xla". "xla" is the dense reference (O(T·S) memory);
      "xla_chunked" computes blockwise with the normalizer's tile rule and a recomputing
      backward pass (O(T·H) memory; causal/window/length/segment structure skips blocks);
      it is differentiable in reverse mode (grad, vjp) once: use "xla" for jvp or
      higher-order derivatives. "cudnn" is jax.nn's cuDNN flash attention
      (``jax.nn.dot_product_attention(implementation="cudnn")``) for what it computes:
      softmax without ``normalizer_params``, ``segment_ids``, ``logits_soft_cap`` or
      ``decay_bias``, value shaped like key, one dtype, on a CUDA GPU; any other call
      raises NotImplementedError. None tries it first on a CUDA GPU for calls with no
      dense ``mask``, no sequence lengths and no ``return_residual`` (so no row is fully
      masked, where cuDNN's convention differs): it was 1.7-3.7x faster than the Pallas
      kernel there (H200, bf16, forward and forward+backward, docs/benchmarks.md).
      "tokamax" is tokamax's flash-attention kernel (an optional dependency, ``pip install
      'jaxsoft[tokamax]'``: Python >= 3.12, JAX >= 0.11.1; its Mosaic-GPU kernel on a CUDA
      GPU, its XLA reference on CPU) for softmax without ``normalizer_params``,
      ``segment_ids``, ``decay_bias``, ``return_residual`` or a soft cap beside a bias;
      rows with no visible key are zeros as here. None tries it after "cudnn" on a CUDA
      GPU where tokamax imports (for the calls cuDNN refuses).
    return_residual: also return the residual, one number per query row, [B, T, N] (or
      [T, N]) in the output's dtype and without gradient (as jax.nn). It is the row
      statistic of the normalizer's kernel class: E and S (softmax family, stablemax,
      lssar, ...): ``log D``, the log of the row's denominator in the logits' own scale
      (``w_j = numerator_j / D``): for softmax the log-sum-exp of the logits (jax.nn's
      residual; ``-inf`` for a row with no visible key); softmax_sink / softmax_n /
      softmax_1 include their offset (``log(e^s + sum_j e^{l_j})``), ssmax the
      log-sum-exp of its scaled scores ``s log(n) l``. P (sigmoid, relu, ...): 0 (there is
      no denominator: D = 1). T (sparsemax, entmax, top-k): the threshold tau in the
      rule's score units (sparsemax ``w = [l - tau]_+``; top-k: the k-th largest logit,
      or a value at most the smallest visible logit when fewer than k are visible; ``-inf`` for a
      row with no visible key; top-p: its threshold on the weights). Class R (epsilon/eta
      softmax, standardized_softmax, ...), stochastic normalizers (gumbel) and plain
      callables define none: NotImplementedError. Every implementation but cuDNN's
      (which returns jax.nn's log-sum-exp for plain softmax) computes the same statistic.
    decay_bias: optional (cq [B, T, N], ck [B, S, N]) float arrays; cq[b, i, n] - ck[b, j, n]
      is added to the scaled logits (before soft-capping), as in Forgetting attention
      (FoX, feature A08) where cq = ck = cumulative sums of log forget gates;
      differentiable.
    decay_prune_threshold: optional float t < 0, only with ``decay_bias``; used by
      "xla_chunked" and the Pallas kernels (every class; "xla" stays exact): a (query block, key block) pair
      is skipped when ``max_i cq[i] - min_j ck[j] < t`` over the pair (xla_chunked: over
      all batches and heads at once; Pallas: per batch and head, on its own tiles). Every
      skipped logit is then below its undecayed value plus t, so for class-E normalizers
      (softmax) each skipped weight is at most ``e^t · e^{l_ij} / D_i``, with l_ij the
      logit without the decay term and D_i the row's full denominator; when the
      query's own key is visible with zero decay (FoX: cq = ck), D_i >= e^{l_ii}, so each
      skipped weight is <= e^{t + l_ij - l_ii} and the output changes by at most
      ``2·max|v|·sum_{skipped j} e^{t + l_ij - l_ii}``.
    score: ``"dot"`` (default): the scaled dot product ``s q_i·k_j`` above.
      ``"distance"`` (feature A18): the Euclidean distance ``d_ij = ||q_i - k_j||`` takes
      its place (no scale: passing ``scale`` is a ValueError), meant for
      ``normalizer="idw_softmax"``, which maps distances to Shepard's inverse-distance
      weights ``d^{-p} / sum d^{-p}``: inverse-distance attention, from "Inverse distance
      weighting attention" (C. McCarter, 2023). It is computed in float32 (float64 for
      float64 inputs) as ``sqrt(max(|q|^2 + |k|^2 - 2 q·k, 0))``; its gradient
      ``(q_i - k_j) / d_ij`` is taken as 0 where ``d_ij = 0`` (a subgradient of the norm
      at 0, which keeps the gradient finite when a query equals a key). Implementations
      "xla", "xla_chunked" and the Pallas ones (also together with a ``decay_bias``,
      added to the distance before the soft cap); cuDNN raises NotImplementedError.
      ``"neg_sq_distance"`` (feature A50, norm-aware distance attention): the logit is
      ``-(s/2)||q_i - k_j||^2 = s q_i·k_j - (s/2)||q_i||^2 - (s/2)||k_j||^2`` (s =
      ``scale``, default 1/sqrt(H)), the dot product with the key-norm penalty it lacks
      (K. R. Balasubramanian, 2026, "All Routes Lead to Collapse"); any normalizer, every
      argument above. The norm terms ride on the row and column terms of ``decay_bias``
      (summed with a caller's; no ``decay_prune_threshold``), computed in float32 (float64
      for float64 inputs) by :func:`jaxsoft.attention.scores.neg_sq_distance_terms`
      (its error bound there), so "xla", "xla_chunked" and the Pallas kernels run it
      unchanged; cuDNN refuses a decay.

  Returns:
    [B, T, N, Hv] (or [T, N, Hv]) in the dtype query, key and value promote to as jnp
    promotes (float32 for integer or bool inputs; bf16 with float32 gives float32, where
    ``jax.nn`` raises); with ``return_residual``, the pair ``(out, residual)``.

  Raises:
    ValueError naming the argument for impossible shapes, dtypes or values; KeyError for
    an unknown normalizer name; NotImplementedError when no requested implementation can
    handle the call.

  Examples:
    One query, three keys and one-hot values, so each output row is the query's
    attention weights:

    >>> q = jnp.ones((1, 1, 1))                             # [T, N, H]: one query, one head
    >>> k = jnp.array([1.0, 0.5, -1.0]).reshape(3, 1, 1)    # [S, K, H]: scores 1, 0.5, -1
    >>> v = jnp.eye(3).reshape(3, 1, 3)                     # [S, K, Hv]: one-hot values
    >>> js.attention.dot_product_attention(q, k, v, scale=1.0)[0, 0]
    Array([0.5741, 0.3482, 0.0777], dtype=float32)
    >>> js.attention.dot_product_attention(q, k, v, scale=1.0, normalizer="sparsemax")[0, 0]
    Array([0.75, 0.25, 0.  ], dtype=float32)
    >>> js.attention.dot_product_attention(
    ...     q, k, v, scale=1.0, normalizer="entmax", normalizer_params={"alpha": 1.5})[0, 0]
    Array([0.674, 0.326, 0.   ], dtype=float32)
    >>> js.attention.dot_product_attention(  # a masked key gets exactly 0
    ...     q, k, v, scale=1.0, mask=jnp.array([True, True, False]))[0, 0]
    Array([0.6225, 0.3775, 0.    ], dtype=float32)
    >>> js.attention.dot_product_attention(  # logits -||q - k||^2 / 2 = 0, -0.125, -2
    ...     q, k, v, scale=1.0, score="neg_sq_distance")[0, 0]
    Array([0.4956, 0.4373, 0.0671], dtype=float32)

    With softmax it matches :func:`jax.nn.dot_product_attention` (and so does
    ``implementation="xla_chunked"``, blockwise, for long sequences):

    >>> x = jnp.sin(jnp.arange(128.0)).reshape(2, 8, 2, 4)  # [B, T, N, H]
    >>> out = js.attention.dot_product_attention(x, x, x, is_causal=True)
    >>> ref = jax.nn.dot_product_attention(x, x, x, is_causal=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
    ((2, 8, 2, 4), True)
  """
  order = implementation_order(implementation)
  unbatched = jnp.ndim(query) == 3
  call = AttentionCall.from_scope(query, key, value, locals(), score=_scores.base_score(score))
  if score == "neg_sq_distance":  # A50: dot products plus the norm terms, on every path
    call = _scores.with_neg_sq_distance(call)

  def unbatch(result):
    if not unbatched:
      return result
    return tuple(r[0] for r in result) if return_residual else result[0]

  B, T = call.q.shape[:2]
  if B == 0 or T == 0 or call.k.shape[1] == 0:
    return unbatch(_empty_result(call))
  explicit = order is not None
  if order is None:
    order = _default_order(call)
  reasons, errors = [], []
  for name in order:
    try:
      out = _RUNNERS[name](call)
    except NotImplementedError as e:
      reasons.append(f"{name.removesuffix('_auto')}: {e}")
      errors.append(e)
      continue
    return unbatch(out)
  # A derivative every tried path refuses stays an UnsupportedDifferentiation (callers catch it).
  refusal = (UnsupportedDifferentiation
             if all(isinstance(e, UnsupportedDifferentiation) for e in errors)
             else NotImplementedError)
  if explicit and len(order) == 1:
    raise refusal(
        f"`implementation`={order[0]!r} cannot handle this call: {reasons[0]}")
  raise refusal(
      f"no implementation in `implementation`={order} can handle this call: "
      + "; ".join(reasons))
