"""The ``+inf`` rule for the blockwise paths (``xla_chunked`` and the Pallas kernels).

The dense path (``implementation="xla"``) applies each normalizer's documented ``+inf``
rule (``jaxsoft.normalizers.common.dense_rules``): in a row whose visible logits hold k
``+inf`` entries, a normalizing normalizer (classes E, S, T, R) takes its limit as those
logits grow together -- ``1/k`` on each of them and 0 elsewhere for softmax and every
normalizer with the default rule (``share_among_inf``), a normalizer's own limit for the
others (clipped or affine softmax, the standardising ones) -- and the row's gradient with
respect to the logits is 0. The per-tile math of the blockwise paths cannot carry that
limit (softmax's running max becomes ``+inf`` and ``e^{inf - inf}`` is NaN; a threshold
search has no finite bracket), so :func:`with_posinf_rule` handles those rows beside it:

* the blockwise path hides ``+inf`` logits as it hides ``-inf`` ones (its tile visibility
  is ``|x| != inf`` for these classes: one more elementwise op per tile), so every row
  stays finite; rows without a ``+inf`` are computed exactly as before;
* only when the bias holds a ``+inf`` at all (the bias's max decides, in a
  ``lax.cond``: an ordinary call pays one max over its bias), a plain XLA pass over blocks
  of query rows sums, per row, the values over the visible ``+inf`` entries and over the
  other visible entries, and counts them (k and n); the limit's weight a on a ``+inf``
  entry and b on the other visible entries is ``1/k`` and 0 for a normalizer whose rule is
  the default share (probed once per normalizer and Python-valued hyperparameters, by its
  dense function on rows of k ``+inf`` and n - k zeros), else comes from its dense function
  on such a row for each row (the limits depend on a row only through k, n and the row's
  hyperparameters); ``out = a·Σ_{+inf} v + b·Σ_{other visible} v``;
* rows with a visible ``+inf`` take that output; their gradient reaches the values
  (``dv_j = w_j dO``) and the array hyperparameters (through the limit weights a and b:
  nothing for the default rule, whose limit does not depend on them; the derivative of
  the limit for clipped and affine softmax, e.g. ``d(α/k + β)/dα = 1/k``), as the dense
  path's does (its logits' cotangent there is 0).

Class P (pointwise) normalizers are not routed, and their tiles keep ``+inf`` logits
visible: each weight depends on its own score, and the tile's numerator at ``+inf`` is
already the entry's own limit (sigmoid 1, relu ``+inf``).

A ``+inf`` logit that comes from the scores (a float32 ``q·k`` that overflows, e.g.
``|q|, |k| ~ 1e20``) is found the same way: the rows are recomputed when the bias holds a
``+inf`` or a bound on the scores (``H max|q| max|k| |scale|`` plus the bias's max) comes
within a quarter of the dtype's largest value, and the rows take the dense path's logits.
Without a bias the tiles do not look for ``±inf`` logits (their fast path: no visibility
test on a tile the structure leaves whole), so the rows are taken out of the blockwise
pass instead: only when the bound is reached (a second ``lax.cond``; an ordinary call pays
max |q| and max |k|), a plain XLA pass finds the rows with a visible ``+inf`` score and
their queries enter the pass as zeros (finite logits; the pass's output and gradient for
those rows are discarded: the query's cotangent there is 0, as the dense path's), and the
rows take the ``+inf`` rule as above.

A score that overflows to ``-inf`` is a hidden key on the dense path (a ``-inf`` logit's
rule). The softmax-like tiles hide it too (its weight is 0 either way); for the rest:

* a class-R normalizer (row moments: standardized softmax, NAP, ...) without a bias runs
  on ``xla_chunked`` its pass with a zero bias of shape ``[1, 1, 1, 1]`` when the bound above is reached (a
  ``lax.cond``: an ordinary call pays the bound; both passes are compiled), so its tiles
  test every logit and the ``-inf`` key leaves the moments, as on the dense path (it was
  NaN); with a bias the tiles hid it already. The Pallas kernels run no such pass (with a
  bias their backward writes a T x S dS): there a class-R row with a visible overflowing
  ``-inf`` score is NaN in value and gradient, as a length-dependent row below. The same pass hides a ``+inf`` that a query
  of zeros still gives, so those rows take the ``+inf`` rule as well;
* a length-dependent normalizer's length count n is taken from the structure, the mask
  and the bias only (not the scores): it would count the key, a finite answer of another
  n. A row with a visible ``-inf`` score (not a ``-inf`` bias entry) and no ``+inf`` one
  is NaN instead, in value and gradient, never that number
  (tests/attention/test_neginf_overflow.py).

Left as the dense path does not: for the other normalizers without a bias, a ``+inf`` that
a query of zeros still gives (a distance score ``|k|`` or a decay term ``-ck`` that
overflows by itself) may leave its row NaN, never a plausible number.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention.masks import pad_axis
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["with_posinf_rule"]

# Query rows and keys of one tile of :func:`_row_sums` (64 x 128 logits per batch and head:
# its memory is linear in T and S, as on the blockwise paths); :func:`_limit_weights` takes
# its synthetic rows of length S in chunks of at most as many entries.
_TILE_Q, _TILE_K = 64, 128


def with_posinf_rule(call, run: Callable[[Any], Any], *, zero_bias_for_moments: bool = True):
  """``run(call)`` (a blockwise implementation) with the dense path's ``+inf`` rule.

  Args:
    call: a validated :class:`~jaxsoft.attention.call.AttentionCall`.
    run: the implementation, ``run(call) -> out`` (or ``(out, residual)`` with
      ``call.return_residual``); it must hide ``+inf`` logits as it hides ``-inf`` ones
      (both paths' tile visibility is ``|x| != inf``), so that every row stays finite.
    zero_bias_for_moments: a class-R call without a bias runs with a zero bias when its
      scores may overflow (below). The Pallas kernels pass False: with a bias their
      backward writes dS, a [B, N, T, S] array, so there a class-R row with an overflowing
      ``-inf`` score stays NaN (never a finite number) and the memory stays O(T·H).

  Returns:
    what ``run`` returns; rows with a visible ``+inf`` logit (from the bias or the
    scores) follow the normalizer's ``+inf`` rule (module docstring), their residual is
    ``+inf`` (the log-sum-exp and the threshold of such a row).
  """
  spec = call.spec
  if (not isinstance(spec, _spec.NormalizerSpec) or spec.kernel_class == "P"
      or spec.needs_key or (call.bias is None and call.logits_soft_cap is not None)):
    return run(call)  # (a soft cap keeps the scores finite: |c tanh(s / c)| <= c)
  arrays = {name: x for name, x in call.params.items()
            if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)}
  # Every other array the rows read goes in as an argument too: the custom VJP must not
  # close over a tracer (inside shard_map the mask would leak out of the trace).
  context = {"q": call.q, "k": call.k, "scale": jnp.asarray(call.scale),
             "decay_bias": call.decay_bias,
             "mask": call.mask, "query_seq_lengths": call.query_seq_lengths,
             "key_value_seq_lengths": call.key_value_seq_lengths,
             "segment_ids": call.segment_ids,
             "params": {name: x for name, x in call.params.items()
                        if name not in arrays and isinstance(x, (jax.Array, np.ndarray))}}
  bias = None if call.bias is None else jnp.asarray(call.bias)
  if bias is not None:
    result = run(call)
  elif spec.kernel_class == "R" and zero_bias_for_moments:
    # a -inf score must be hidden from a row's moments as the dense path hides it: when
    # the scores may overflow, the pass runs with a zero bias (the tiles then test every
    # logit)
    result = _with_zero_bias_when_overflowing(call, context, run)
  else:
    # without a bias the tiles keep +inf scores visible: those rows' queries go in as zeros
    result = run(dataclasses.replace(call, q=_without_posinf_rows(call, context)))
  out, stat = result if call.return_residual else (result, None)
  # (class R without the zero-bias pass: a row whose moments saw an overflowing -inf score
  # is NaN, as a length-dependent row whose n would be wrong)
  neg_is_nan = call.spec.length_dependent or (
      spec.kernel_class == "R" and bias is None and not zero_bias_for_moments)
  out, stat = _override_rows(call, neg_is_nan)(out, stat, call.v, bias, arrays, context)
  return out if stat is None else (out, stat)


def _with_context(call, context):
  """The call with its arrays taken from ``context`` (:func:`with_posinf_rule`'s)."""
  return dataclasses.replace(
      call, q=context["q"], k=context["k"], scale=context["scale"],
      decay_bias=context["decay_bias"],
      mask=context["mask"], query_seq_lengths=context["query_seq_lengths"],
      key_value_seq_lengths=context["key_value_seq_lengths"],
      segment_ids=context["segment_ids"], params={**call.params, **context["params"]})


def _with_zero_bias_when_overflowing(call, context, run):
  """``run(call)`` for a call without a bias, or, when :func:`_may_have_posinf` says a
  score may overflow, ``run`` of the call with a zero bias of shape ``[1, 1, 1, 1]`` (in a
  ``lax.cond``: an ordinary call pays the bound only). With a bias the tiles test every
  logit (``|x| != inf``): a ``-inf`` score is hidden, from a class-R row's moments too, as
  on the dense path, and a ``+inf`` one (a distance or a decay term that overflows by
  itself included) is hidden and left to the ``+inf`` rule."""
  zero = jnp.zeros((1, 1, 1, 1), compute_dtype(call.q.dtype))
  # varying like q inside jax.shard_map (default check_vma): its cotangent varies like q
  axis_type = getattr(jax.typeof(call.q), "manual_axis_type", None)
  if axis_type is not None and axis_type.varying:
    zero = lax.pcast(zero, tuple(sorted(axis_type.varying)), to="varying")

  def careful(_):
    return run(dataclasses.replace(call, bias=zero))

  def plain(_):
    return run(call)

  flag = _may_have_posinf(call, None, jax.tree.map(lax.stop_gradient, context))
  return lax.cond(flag, careful, plain, None)


def _without_posinf_rows(call, context):
  """The queries for a blockwise pass without a bias: ``q`` with the rows that have a
  visible ``+inf`` score set to 0 (those rows' logits are then finite, and their output
  is replaced by the ``+inf`` rule), in a ``lax.cond`` on :func:`_may_have_posinf`
  whose other branch returns ``q`` (an ordinary call pays the bound only). The rows are
  found on stopped values (a boolean has no tangent); ``q``'s cotangent on them is 0."""
  dtype = compute_dtype(call.q.dtype)

  def careful(q, context):
    context = jax.tree.map(lax.stop_gradient, context)
    count_k = _row_sums(_with_context(call, context), None, None, dtype)[2]  # [B, T, N]
    return jnp.where((count_k > 0)[..., None], jnp.zeros((), q.dtype), q)

  def plain(q, context):
    del context
    return q

  return lax.cond(_may_have_posinf(call, None, context), careful, plain, call.q, context)


def _may_have_posinf(call, bias, context):
  """Whether a logit can be ``+inf``: the bias holds one, or the
  scores plus the bias may overflow. The bound is per call, O((T + S) H):
  ``|s q·k| <= H max|q| max|k| |s|`` (the distance score: ``H (max|q| + max|k|)^2``, its
  squared terms), plus the decay terms' largest magnitudes and the bias's max (its max:
  a float reduction, 3x faster than ``jnp.any`` of a comparison on XLA:CPU; ``bias``
  None: no bias); a soft cap bounds the scores by itself. A NaN anywhere also takes the
  careful branch (its rows stay NaN there)."""
  dtype = compute_dtype(call.q.dtype)
  big = jnp.asarray(jnp.finfo(dtype).max / 4, dtype)
  bmax = jnp.asarray(-jnp.inf, dtype) if bias is None else jnp.max(bias)
  bound = jnp.maximum(bmax.astype(dtype), 0)
  if call.logits_soft_cap is None:
    q_max = jnp.max(jnp.abs(context["q"].astype(dtype)))
    k_max = jnp.max(jnp.abs(context["k"].astype(dtype)))
    h = call.q.shape[-1]
    if call.score == "distance":
      bound = bound + h * (q_max + k_max) ** 2
    else:
      bound = bound + h * q_max * k_max * jnp.abs(context["scale"].astype(dtype))
  if context["decay_bias"] is not None:
    bound = bound + sum(jnp.max(jnp.abs(jnp.asarray(c, dtype))) for c in context["decay_bias"])
  return (bmax == jnp.inf) | ~(bound <= big)


def _override_rows(call, neg_is_nan: bool):
  """``(out, stat, v, bias, array hyperparameters) -> (out, stat)`` with the rows that
  have a visible ``+inf`` replaced by the ``+inf`` rule (stat: ``+inf``; None stays None).

  Everything happens inside one ``lax.cond`` on :func:`_may_have_posinf`, whose other
  branch returns ``out`` and ``stat`` untouched, so an ordinary call pays the bias's max
  and the bound on its scores (max |q|, max |k|) and nothing else; a custom VJP whose residuals are its inputs (no zero-filled residuals of
  the other branch). Gradients: ``out``'s cotangent passes on the other rows, and ``v``
  and the array hyperparameters get the replaced rows' (``w_j dO``, and the derivative of
  the limit weights, as the dense path); the bias gets none from them."""
  dtype = compute_dtype(call.q.dtype)
  share = (not any(isinstance(x, (jax.Array, np.ndarray)) for x in call.params.values())
           and _shares_among_inf(call.spec, call.params))


  def rows(v, bias, arrays, context):
    """(out of the +inf rows, where a row has a visible +inf, where a row's output is NaN:
    a length-dependent normalizer's row with a visible -inf score and no +inf)"""
    call_ = _with_context(call, context)
    sum_inf, sum_rest, count_k, count_n, count_neg = _row_sums(call_, v, bias, dtype,
                                                               rest=not share)
    # (the blockwise length count n is taken without the scores: it would count a key whose
    # score overflows to -inf, which the dense path hides; such rows are NaN instead)
    nan_rows = (count_neg > 0) & (count_k == 0) if neg_is_nan else count_k < 0
    if share:  # 1/k on each +inf entry, 0 elsewhere
      return sum_inf / jnp.maximum(count_k, 1.0)[..., None], count_k > 0, nan_rows
    a, b = _limit_weights(call_, arrays, count_k, count_n, dtype)
    out = a[..., None] * sum_inf + jnp.where(count_k < count_n, b, 0.0)[..., None] * sum_rest
    return out, count_k > 0, nan_rows

  def replace(out, stat, v, bias, arrays, context):
    fixed, has, nan_rows = rows(v, bias, arrays, context)
    out = jnp.where(has[..., None], fixed.astype(out.dtype), out)
    out = jnp.where(nan_rows[..., None], jnp.asarray(jnp.nan, out.dtype), out)
    if stat is not None:
      stat = jnp.where(has, jnp.asarray(jnp.inf, stat.dtype), stat)
    return out, stat

  def keep(out, stat, v, bias, arrays, context):
    del v, bias, arrays, context
    return out, stat

  def forward(out, stat, v, bias, arrays, context):
    flag = _may_have_posinf(call, bias, context)
    return lax.cond(flag, replace, keep, out, stat, v, bias, arrays, context), flag

  @jax.custom_vjp
  def override(out, stat, v, bias, arrays, context):
    return forward(out, stat, v, bias, arrays, context)[0]

  def override_fwd(out, stat, v, bias, arrays, context):
    result, flag = forward(out, stat, v, bias, arrays, context)
    return result, (v, bias, arrays, context, flag)

  def override_bwd(saved, cotangents):
    v, bias, arrays, context, flag = saved
    d_out, d_stat = cotangents

    def replaced(d_out, v, bias, arrays, context):
      fixed, vjp = jax.vjp(lambda v_, arrays_: rows(v_, bias, arrays_, context)[0], v, arrays)
      _, has, nan_rows = rows(v, bias, arrays, context)  # (recomputed: cheap beside the vjp)
      d_fixed = jnp.where(has[..., None], d_out, 0.0).astype(fixed.dtype)
      dv, d_arrays = vjp(d_fixed)
      d_out = jnp.where(has[..., None], 0.0, d_out)
      # a NaN row's gradient is NaN too (the pass's would be that of the wrong n)
      d_out = jnp.where(nan_rows[..., None] & (d_out != 0), jnp.nan, d_out)
      return d_out.astype(d_out.dtype), dv, d_arrays

    def kept(d_out, v, bias, arrays, context):
      del bias, context
      return d_out, jnp.zeros_like(v), jax.tree.map(jnp.zeros_like, arrays)

    d_out, dv, d_arrays = lax.cond(flag, replaced, kept, d_out, v, bias, arrays, context)
    d_stat = None if d_stat is None else jnp.zeros_like(d_stat)  # (the callers stop it)
    return (d_out, d_stat, dv, None, d_arrays, jax.tree.map(lambda _: None, context))

  override.defvjp(override_fwd, override_bwd)
  return override


# (k, n) of the probe rows of :func:`_shares_among_inf`: k visible +inf logits out of n.
_PROBES = ((1, 1), (1, 3), (2, 3), (2, 5), (3, 4))


@functools.lru_cache(maxsize=256)
def _probe_share(spec, params: tuple) -> bool:
  width = max(n for _, n in _PROBES)
  cols = np.arange(width)[None, :]
  k = np.array([[p[0]] for p in _PROBES])
  n = np.array([[p[1]] for p in _PROBES])
  x = np.where(cols < k, np.inf, 0.0).astype(np.float32)
  # One compiled call (op-by-op it takes seconds), concrete even while a caller is being
  # traced, and outside the caller's mesh.
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), \
      jax.ensure_compile_time_eval():
    fn = jax.jit(lambda x, where: spec.fn(x, axis=-1, where=where, **dict(params)))
    w = np.asarray(fn(x, cols < n))
  return bool(np.allclose(w, np.where(cols < k, 1.0 / k, 0.0), rtol=1e-6, atol=1e-7))


def _shares_among_inf(spec, params) -> bool:
  """Whether the normalizer's ``+inf`` limit, with these (Python-valued) hyperparameters,
  is the default ``1/k`` share: probed once on rows of k ``+inf`` and n - k zeros (the
  limits depend on a row only through k and n). False when it cannot be probed."""
  try:
    return _probe_share(spec, tuple(sorted(params.items())))
  except Exception:  # noqa: BLE001 (unhashable or untraceable parameters: the general way)
    return False


def _row_sums(call, v, bias, dtype, rest: bool = True):
  """Per row: the sums of the values over the visible ``+inf`` entries and (with ``rest``,
  else None) over the other visible ones, [B, T, N, Hv] each (both None when ``v`` is
  None), and the counts k and n, [B, T, N]; plain XLA over tiles of ``_TILE_Q`` query rows
  by ``_TILE_K`` keys (a ``lax.map`` over row blocks, a ``lax.scan`` over key blocks), so
  its memory is linear in the lengths like the blockwise paths it serves. The logits are
  the dense path's (:func:`~jaxsoft.attention.dense_logits`: scores, decay, soft cap,
  bias), so a ``q·k`` that overflows to ``+inf`` counts as the bias's ``+inf`` does (the
  tiles hide it as they hide the bias's)."""
  B, T, N, _ = call.q.shape
  S, K = call.k.shape[1], call.k.shape[2]
  G = N // K
  st = call.structure
  bq, bk = min(T, _TILE_Q), min(S, _TILE_K)
  nq, nk = -(-T // bq), -(-S // bk)
  Tp, Sp = nq * bq, nk * bk

  bias_p = pad_axis(pad_axis(bias, 2, Tp, value=-jnp.inf), 3, Sp, value=-jnp.inf)
  mask = None if call.mask is None else jnp.asarray(call.mask)
  mask_p = pad_axis(pad_axis(mask, 2, Tp, value=False), 3, Sp, value=False)
  q_p = pad_axis(call.q, 1, Tp)
  k_p = pad_axis(call.k, 1, Sp)
  cq_p = ck_p = None
  if call.decay_bias is not None:
    cq_p = pad_axis(jnp.asarray(call.decay_bias[0]), 1, Tp)
    ck_p = pad_axis(jnp.asarray(call.decay_bias[1]), 1, Sp)
  q_seg = kv_seg = None
  if st.has_segments:
    q_seg = pad_axis(st.q_segment_ids, 1, Tp, mode="edge")
    kv_seg = pad_axis(st.kv_segment_ids, 1, Sp, mode="edge")
  values = None if v is None else pad_axis(v.astype(dtype), 1, Sp)
  rest = rest and v is not None
  Hv = 0 if values is None else values.shape[-1]

  def tile(a, axis, start, size):  # a block of a (broadcast dimensions stay 1)
    return a if a is None or a.shape[axis] == 1 else lax.dynamic_slice_in_dim(a, start, size,
                                                                             axis)

  def total(w, vals):  # [B, N, bq, bk] x [B, bk, K, Hv] -> [B, bq, N, Hv]
    w = w.astype(dtype).reshape(B, K, G, bq, bk)
    return jnp.einsum("bkgts,bskh->btkgh", w, vals).reshape(B, bq, N, Hv)

  # (checkpointed: differentiating the sums in v saves each step's carry, not its tile)
  @jax.checkpoint
  def block(qi):
    q0 = qi * bq
    q_pos = q0 + jnp.arange(bq, dtype=jnp.int32)
    q_blk = lax.dynamic_slice_in_dim(q_p, q0, bq, 1)
    seg = tile(q_seg, 1, q0, bq)
    cq = tile(cq_p, 1, q0, bq)
    bias_rows, mask_rows = tile(bias_p, 2, q0, bq), tile(mask_p, 2, q0, bq)

    @jax.checkpoint
    def key_block(ki):  # one tile's counts and sums (no loop carry: a carry built from zeros
      k0 = ki * bk      # would lack the inputs' varying mesh axes inside shard_map)
      vis = st.tile_visible(q_pos, k0 + jnp.arange(bk, dtype=jnp.int32), seg,
                            tile(kv_seg, 1, k0, bk))
      decay = None if cq is None else (cq, tile(ck_p, 1, k0, bk))
      x = dense_logits(q_blk, lax.dynamic_slice_in_dim(k_p, k0, bk, 1), scale=call.scale,
                       decay_bias=decay, logits_soft_cap=call.logits_soft_cap,
                       bias=tile(bias_rows, 3, k0, bk), score=call.score)  # [B, N, bq, bk]
      if mask_rows is not None:
        vis = vis & tile(mask_rows, 3, k0, bk)
      # a -inf score (not a -inf bias entry, which the blockwise paths count as hidden)
      neg = vis & (x == -jnp.inf)
      if bias_rows is not None:
        neg = neg & (tile(bias_rows, 3, k0, bk) != -jnp.inf)
      vis = jnp.broadcast_to(vis & (x != -jnp.inf), (B, N, bq, bk))
      hit = vis & (x == jnp.inf)
      counts = jnp.stack([jnp.sum(hit, -1), jnp.sum(vis, -1),
                          jnp.sum(jnp.broadcast_to(neg, (B, N, bq, bk)), -1)]).astype(dtype)
      if values is None:
        return counts, None, None
      vals = lax.dynamic_slice_in_dim(values, k0, bk, 1)
      return counts, total(hit, vals), total(vis & ~hit, vals) if rest else None

    counts, s_inf, s_rest = jax.tree.map(lambda a: jnp.sum(a, 0),
                                         lax.map(key_block, jnp.arange(nk, dtype=jnp.int32)))
    return (s_inf, s_rest,
            jnp.transpose(counts, (0, 1, 3, 2)))

  sum_inf, sum_rest, counts = lax.map(block, jnp.arange(nq, dtype=jnp.int32))

  def unblock(a, axis):  # [nq, ..., bq (at axis), ...] -> [..., Tp, ...][:T]
    a = jnp.moveaxis(a, 0, axis)
    shape = a.shape[:axis] + (Tp,) + a.shape[axis + 2:]
    return lax.slice_in_dim(a.reshape(shape), 0, T, axis=axis)

  counts = unblock(counts, 2)  # [3, B, T, N]
  return (None if sum_inf is None else unblock(sum_inf, 1),
          None if sum_rest is None else unblock(sum_rest, 1), counts[0], counts[1], counts[2])


def _limit_weights(call, arrays, count_k, count_n, dtype):
  """Per row ([B, T, N] each): the normalizer's weight on a ``+inf`` entry (a) and on a
  finite visible entry (b) of a row with k visible ``+inf`` logits out of n, from its
  dense function on a row of k ``+inf`` and n - k zeros (differentiable in the array
  hyperparameters ``arrays``, as the dense path's limit is; the counts carry none)."""
  B, T, N = count_k.shape
  S = call.k.shape[1]
  rows = N * T  # per batch entry
  chunk = max(1, _TILE_Q * _TILE_K // max(S, 1))  # (a tile's entries at most)
  if isinstance(B, int):  # (a symbolic batch under jax.export: the whole chunk per entry)
    chunk = max(1, chunk // B)
  if isinstance(rows, int):
    chunk = max(1, min(rows, chunk))
  n_chunks = -(-rows // chunk)

  # The loop runs over chunks of each batch entry's rows, with the batch a plain axis of
  # every step: a batch sharded on a mesh stays sharded (lax.map cannot loop over a
  # sharded axis).
  def chunked(x):  # [B, rows] -> [chunks, B, chunk, 1]
    x = x.reshape(B, n_chunks, chunk)
    return jnp.transpose(x, (1, 0, 2))[..., None]

  def per_row(x):  # [B, T, N] -> [chunks, B, chunk, 1]
    x = jnp.transpose(x, (0, 2, 1)).reshape(B, rows)
    return chunked(jnp.pad(x, ((0, 0), (0, n_chunks * chunk - rows))))

  def param_rows(x):  # broadcastable to [B, N, T, 1] -> [chunks, B or 1, chunk, 1]
    x = jnp.asarray(x)
    if x.ndim == 0:
      return jnp.broadcast_to(x, (n_chunks, 1, chunk, 1))
    x = jnp.broadcast_to(x.reshape((1,) * (4 - x.ndim) + x.shape), (B, N, T, 1)).reshape(B, rows)
    return chunked(jnp.pad(x, ((0, 0), (0, n_chunks * chunk - rows)), mode="edge"))

  ints = {name: x for name, x in call.params.items()
          if name not in arrays and isinstance(x, (jax.Array, np.ndarray))}
  static = {name: x for name, x in call.params.items() if name not in arrays and name not in ints}
  fn = call.spec.fn
  cols = jnp.arange(S, dtype=dtype)[None, None, :]

  def one(args):  # k, n [B, chunk, 1]; the rows [B, chunk, S]
    k, n, hp = args
    x = jnp.where(cols < k, jnp.asarray(jnp.inf, dtype), jnp.zeros((), dtype))
    w = fn(x, axis=-1, where=cols < n, **static, **hp).astype(dtype)
    first_finite = jnp.clip(k, 0, S - 1).astype(jnp.int32)
    return w[..., 0], jnp.take_along_axis(w, first_finite, axis=-1)[..., 0]

  hp_rows = {name: param_rows(x) for name, x in {**arrays, **ints}.items()}
  a, b = lax.map(one, (per_row(count_k), per_row(count_n), hp_rows))

  def back(x):  # [chunks, B, chunk] -> [B, T, N]
    x = jnp.transpose(x, (1, 0, 2)).reshape(B, n_chunks * chunk)[:, :rows]
    return jnp.transpose(x.reshape(B, N, T), (0, 2, 1))

  return back(a), back(b)
