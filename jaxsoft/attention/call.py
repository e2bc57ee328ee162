"""The validated attention call: what every implementation receives (public inside jaxsoft).

:meth:`AttentionCall.create` checks and canonicalises the arguments of
:func:`jaxsoft.attention.dot_product_attention` once: 4-D ``q, k, v``, masks and biases
broadcastable to ``[B, N, T, S]``, lengths clamped, the normalizer resolved to its
``NormalizerSpec``, its hyperparameters validated. The XLA paths, the attention variants
and the Pallas kernels (``kernels_pallas``) all start from an ``AttentionCall``; none of them
imports the entry point, so the kernels are an ordinary dependency of the entry point.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxsoft._validation import concrete
from jaxsoft.attention.masks import MaskStructure, normalize_segment_ids, normalize_window
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["AttentionCall", "CALL_OPTIONS", "SCORES", "IMPLEMENTATIONS", "implementation_order",
           "gqa_dims"]

SCORES = ("dot", "distance")

IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas", "pallas_triton", "pallas_mosaic_tpu", "cudnn",
                   "tokamax")


@dataclasses.dataclass
class AttentionCall:
  """A validated call in canonical form (what every implementation receives).

  q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] (4-D; unbatched inputs got B = 1);
  bias float and mask bool, each None or 4-D broadcastable to [B, N, T, S];
  scale a float (or scalar array); window ``(left, right)`` or None; segment_ids
  ``(q_ids [B, T], kv_ids [B, S])`` int32 or None; lengths int32 [B] or None;
  spec a NormalizerSpec or a plain callable; params the hyperparameters (a dict,
  without ``key``); key the PRNG key of a stochastic normalizer or None;
  decay_bias ``(cq [B, T, N], ck [B, S, N])`` float32 or None; return_residual: the
  runners return ``(out, residual [B, T, N])`` instead of ``out``; score ``"dot"`` (the
  scaled q·k) or ``"distance"`` (the Euclidean distance ||q_i - k_j||, with scale 1.0).
  """

  q: Any
  k: Any
  v: Any
  bias: Any
  mask: Any
  scale: Any
  is_causal: bool
  query_seq_lengths: Any
  key_value_seq_lengths: Any
  local_window_size: tuple[int, int] | None
  segment_ids: tuple[Any, Any] | None
  logits_soft_cap: float | None
  spec: Any
  params: dict
  key: Any
  decay_bias: tuple[Any, Any] | None
  decay_prune_threshold: float | None
  return_residual: bool = False
  score: str = "dot"

  @property
  def structure(self) -> MaskStructure:
    q_ids, kv_ids = self.segment_ids if self.segment_ids is not None else (None, None)
    return MaskStructure(
        T=self.q.shape[1], S=self.k.shape[1], is_causal=bool(self.is_causal),
        window=self.local_window_size, q_lengths=self.query_seq_lengths,
        kv_lengths=self.key_value_seq_lengths, q_segment_ids=q_ids, kv_segment_ids=kv_ids)

  def normalize_fn(self) -> Callable[[Any, Any], Any]:
    """``(logits, where) -> weights`` with the hyperparameters bound."""
    spec, params, key = self.spec, self.params, self.key
    if isinstance(spec, _spec.NormalizerSpec):
      if spec.needs_key:
        return lambda x, where: spec.fn(key, x, axis=-1, where=where, **params)
      return lambda x, where: spec.fn(x, axis=-1, where=where, **params)
    return lambda x, where: spec(x, axis=-1, where=where, **params)


  @classmethod
  def create(cls, q: Any, k: Any, v: Any, *, bias: Any = None, mask: Any = None,
             scale: Any = None, is_causal: bool = False, query_seq_lengths: Any = None,
             key_value_seq_lengths: Any = None, local_window_size: Any = None,
             segment_ids: Any = None, logits_soft_cap: Any = None, normalizer: Any = "softmax",
             normalizer_params: Mapping[str, Any] | None = None, decay_bias: Any = None,
             decay_prune_threshold: Any = None, return_residual: bool = False,
             score: str = "dot") -> AttentionCall:
    """Checks the arguments of :func:`~jaxsoft.attention.dot_product_attention` (the same
    names and meanings) and returns them in canonical form.

    Raises ValueError naming the argument for an impossible shape, dtype or value, and
    KeyError for an unknown normalizer name.

    Examples:
      >>> from jaxsoft.attention.call import AttentionCall
      >>> call = AttentionCall.create(jnp.ones((4, 2, 8)), jnp.ones((6, 1, 8)),
      ...                             jnp.ones((6, 1, 8)), is_causal=True, normalizer="sparsemax")
      >>> call.q.shape, call.k.shape, round(call.scale, 4), call.spec.name
      ((1, 4, 2, 8), (1, 6, 1, 8), 0.3536, 'sparsemax')
    """
    if not isinstance(score, str) or score not in SCORES:
      raise ValueError(f"`score` must be one of {SCORES}, got {score!r}")
    if score == "distance" and scale is not None:
      raise ValueError("`scale` must be None with score='distance' (distances are not scaled)")
    q, k, v = _as_float(q, "query"), _as_float(k, "key"), _as_float(v, "value")
    # Mixed float dtypes promote as jnp does (bf16 with f32 -> f32), so the output is never
    # narrower than an input (jax.nn raises instead).
    common = jnp.result_type(q, k, v)
    q, k, v = q.astype(common), k.astype(common), v.astype(common)
    for t, name in ((q, "query"), (k, "key"), (v, "value")):
      if t.ndim not in (3, 4):
        raise ValueError(
            f"`{name}` must have shape [B, L, heads, H] or [L, heads, H], got {t.shape}")
    if not q.ndim == k.ndim == v.ndim:
      raise ValueError(
          f"`query`, `key` and `value` must have the same rank, got {q.ndim}, {k.ndim}, {v.ndim}")
    q, k, v = _ensure_4d(q), _ensure_4d(k), _ensure_4d(v)
    B, S, K, H = k.shape
    _, T, N, Hq = q.shape
    if q.shape[0] != B:
      raise ValueError(f"`query` batch {q.shape[0]} does not match `key` batch {B}")
    if Hq != H:
      raise ValueError(
          f"`query` head dimension {Hq} does not match `key` head dimension {H} "
          f"(query {q.shape}, key {k.shape})")
    if v.shape[:3] != (B, S, K):
      raise ValueError(
          f"`value` of shape {v.shape} must match `key` [B, S, K] = {[B, S, K]} in its first "
          "three dimensions")
    if K == 0 or N % K != 0:
      raise ValueError(
          f"the number of `query` heads N={N} must be a multiple of the number of `key`/`value` "
          f"heads K={K} (GQA/MQA)")
    target = (B, N, T, S)
    if bias is not None:
      bias = _check_broadcast(bias, "bias", target)
      if bias.dtype == jnp.bool_:  # it would be added as 0/1: a mask passed in bias's place
        raise ValueError("`bias` must be numeric (it is added to the logits); pass a boolean "
                         "mask as `mask`")
      if not jnp.issubdtype(bias.dtype, jnp.floating):
        bias = bias.astype(jnp.float32)  # e.g. an integer bias
    if mask is not None:
      mask = _check_broadcast(mask, "mask", target)
      if jnp.issubdtype(mask.dtype, jnp.floating):
        raise ValueError("`mask` must be boolean (True = attend); pass an additive mask as `bias`")
      mask = mask.astype(bool)
    if score == "distance":
      scale = 1.0
    elif scale is None:
      scale = 1.0 / float(np.sqrt(H))
    elif isinstance(scale, (int, float, np.integer, np.floating)):
      scale = float(scale)
    else:
      scale = jnp.asarray(scale, jnp.float32)
      if scale.ndim != 0:
        raise ValueError(f"`scale` must be a scalar, got shape {scale.shape}")
    if not isinstance(is_causal, (bool, np.bool_)):
      raise ValueError(f"`is_causal` must be a bool, got {is_causal!r}")
    if not isinstance(return_residual, (bool, np.bool_)):
      raise ValueError(f"`return_residual` must be a bool, got {return_residual!r}")
    query_seq_lengths = _check_lengths(query_seq_lengths, "query_seq_lengths", B, T)
    key_value_seq_lengths = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", B, S)
    window = normalize_window(local_window_size)
    segment_ids = normalize_segment_ids(segment_ids, B, T, S)
    if logits_soft_cap is not None:
      try:
        cap = float(logits_soft_cap)
      except TypeError:
        raise ValueError(
            f"`logits_soft_cap` must be a positive float or None, got {logits_soft_cap!r}") from None
      if not cap > 0:
        raise ValueError(f"`logits_soft_cap` must be > 0, got {logits_soft_cap!r}")
      logits_soft_cap = cap
    spec = _resolve_normalizer(normalizer)
    params, key = _check_params(spec, normalizer_params, target)
    if decay_bias is not None:
      try:
        cq, ck = decay_bias
      except (TypeError, ValueError):
        raise ValueError("`decay_bias` must be a pair (cq [B, T, N], ck [B, S, N])") from None
      cq, ck = jnp.asarray(cq), jnp.asarray(ck)
      if q.ndim == 4 and cq.ndim == 2:
        cq, ck = cq[None], ck[None]
      if cq.shape != (B, T, N) or ck.shape != (B, S, N):
        raise ValueError(
            f"`decay_bias` must be (cq [B, T, N] = {[B, T, N]}, ck [B, S, N] = {[B, S, N]}), got "
            f"{cq.shape} and {ck.shape}")
      cdt = compute_dtype(jnp.promote_types(cq.dtype, ck.dtype))
      decay_bias = (cq.astype(cdt), ck.astype(cdt))
    if decay_prune_threshold is not None:
      if decay_bias is None:
        raise ValueError("`decay_prune_threshold` needs `decay_bias`")
      try:
        thr = float(decay_prune_threshold)
      except TypeError:
        raise ValueError(
            f"`decay_prune_threshold` must be a float < 0, got {decay_prune_threshold!r}") from None
      if not thr < 0:
        raise ValueError(f"`decay_prune_threshold` must be < 0, got {decay_prune_threshold!r}")
      decay_prune_threshold = thr
    if key_value_seq_lengths is not None:
      # Keys past the length are padding: zeroed, so that what they hold (NaN, inf) reaches
      # no output and no gradient on any path (a masked weight 0 times NaN is NaN).
      kv_valid = jnp.arange(S, dtype=jnp.int32)[None, :] < key_value_seq_lengths[:, None]
      k = jnp.where(kv_valid[:, :, None, None], k, 0)
      v = jnp.where(kv_valid[:, :, None, None], v, 0)
    return cls(
        q=q, k=k, v=v, bias=bias, mask=mask, scale=scale, is_causal=bool(is_causal),
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=window, segment_ids=segment_ids, logits_soft_cap=logits_soft_cap,
        spec=spec, params=params, key=key, decay_bias=decay_bias,
        decay_prune_threshold=decay_prune_threshold, return_residual=bool(return_residual),
        score=score)

  @classmethod
  def from_scope(cls, q: Any, k: Any, v: Any, scope: Mapping[str, Any],
                 **overrides: Any) -> AttentionCall:
    """:meth:`create` with its keyword arguments read by name from ``scope``: the
    ``locals()`` of an entry point whose parameters carry :meth:`create`'s names
    (``jaxsoft.attention.dot_product_attention``, ``kernels_pallas.attention``), so the
    list of call arguments is written once. ``overrides`` replace entries of ``scope``;
    a keyword of :meth:`create` in neither is a TypeError (never a silent default).

    Examples:
      >>> from jaxsoft.attention.call import AttentionCall, CALL_OPTIONS
      >>> q = jnp.ones((3, 1, 4))                                  # [T, N, H]
      >>> scope = dict.fromkeys(CALL_OPTIONS) | dict(              # an entry point's locals()
      ...     is_causal=True, normalizer="sparsemax", return_residual=False, score="dot")
      >>> call = AttentionCall.from_scope(q, q, q, scope, normalizer="softmax")
      >>> call.is_causal, call.spec.name
      (True, 'softmax')
      >>> AttentionCall.from_scope(q, q, q, {"is_causal": True})
      Traceback (most recent call last):
      ...
      TypeError: AttentionCall.from_scope: `scope` lacks ['bias', 'mask', 'scale', ...]
    """
    missing = [n for n in CALL_OPTIONS if n not in scope and n not in overrides]
    if missing:
      raise TypeError(f"AttentionCall.from_scope: `scope` lacks {missing}")
    options = {name: scope[name] for name in CALL_OPTIONS if name not in overrides}
    return cls.create(q, k, v, **options, **overrides)


# The keyword arguments of AttentionCall.create (:meth:`AttentionCall.from_scope` reads them).
CALL_OPTIONS: tuple[str, ...] = tuple(
    name for name, p in inspect.signature(AttentionCall.create).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)


# ------------------------------------------------------------------------ validation


def _ensure_4d(t):
  t = jnp.asarray(t)
  return t.reshape((1,) * (4 - t.ndim) + t.shape) if t.ndim < 4 else t


def _check_broadcast(t, name: str, target: tuple[int, ...]):
  t = jnp.asarray(t)
  if t.ndim > 4:
    raise ValueError(f"`{name}` must have at most 4 dimensions [B, N, T, S], got shape {t.shape}")
  t = _ensure_4d(t)
  for d, (have, want) in enumerate(zip(t.shape, target, strict=False)):
    if have not in (1, want):
      raise ValueError(
          f"`{name}` of shape {t.shape} does not broadcast to [B, N, T, S] = {list(target)} "
          f"(dimension {d})")
  return t


def _check_lengths(x, name: str, B: int, L: int):
  """Sequence lengths -> int32 [B] in [0, L]: ValueError naming ``name`` for a concrete
  value outside [0, L]; traced values are clamped to [0, L] (a negative length is 0, a
  length past the sequence is the whole sequence)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"`{name}` must be an integer array of shape [B], got dtype {x.dtype}")
  if x.ndim == 0:
    x = jnp.broadcast_to(x, (B,))
  if x.shape != (B,):
    raise ValueError(f"`{name}` must have shape [B] = [{B}], got {x.shape}")
  values = concrete(x)
  if values is not None and np.any(values < 0):
    raise ValueError(f"`{name}` must be >= 0, got {values.tolist()}")
  if values is not None and np.any(values > L):
    what = "query" if name.startswith("query") else "key/value"
    raise ValueError(f"`{name}` must be <= {L}, the {what} sequence length, got "
                     f"{values.tolist()}")
  return jnp.clip(x, 0, L).astype(jnp.int32)


def _resolve_normalizer(normalizer):
  """``_spec.resolve`` with errors naming the argument (KeyError, ValueError)."""
  try:
    return _spec.resolve(normalizer)
  except KeyError as e:
    raise KeyError(f"`normalizer`: {e.args[0]}") from None
  except TypeError as e:
    raise ValueError(str(e)) from None


def _check_params(spec, normalizer_params, target):
  """Validates normalizer_params; returns (params without 'key', key)."""
  if normalizer_params is None:
    params = {}
  elif isinstance(normalizer_params, Mapping):
    params = dict(normalizer_params)
  else:
    raise ValueError(f"`normalizer_params` must be a mapping (dict) or None, got {normalizer_params!r}")
  key = params.pop("key", None)
  if isinstance(spec, _spec.NormalizerSpec):
    if spec.needs_key and key is None:
      raise ValueError(
          f"normalizer {spec.name!r} is stochastic: pass its PRNG key as "
          "`normalizer_params['key']`")
    if not spec.needs_key and key is not None:
      raise ValueError(
          f"`normalizer_params['key']`: normalizer {spec.name!r} takes no PRNG key")
    try:
      spec.validate(params)
    except ValueError as e:
      raise ValueError(f"`normalizer_params`: {e}") from None
  elif key is not None:
    params["key"] = key  # a plain callable gets everything as keywords
    key = None
  B, N, T, _ = target
  for name, value in params.items():
    if value is None or isinstance(value, (bool, int, float, str, np.integer, np.floating)):
      continue
    try:
      arr = jnp.asarray(value)
    except TypeError:
      continue
    if arr.ndim == 0:
      continue
    full = (1,) * (4 - arr.ndim) + tuple(arr.shape) if arr.ndim <= 4 else None
    ok = full is not None and full[3] == 1 and all(
        h in (1, w) for h, w in zip(full[:3], (B, N, T), strict=False))
    if not ok:
      raise ValueError(
          f"`normalizer_params['{name}']` of shape {arr.shape} must broadcast right-aligned "
          f"against the logits [B, N, T, S] = [{B}, {N}, {T}, S] with size 1 along S "
          "(e.g. a per-head value has shape [N, 1, 1])")
  return params, key


def _as_float(t, name: str):
  """An array input as a floating array: integer and bool arrays take the compute dtype
  (float32), as the normalizers promote; anything else is a ValueError naming it."""
  t = jnp.asarray(t)
  if jnp.issubdtype(t.dtype, jnp.floating):
    return t
  if jnp.issubdtype(t.dtype, jnp.integer) or t.dtype == jnp.bool_:
    return t.astype(compute_dtype(t.dtype))
  raise ValueError(f"`{name}` must be a real (floating, integer or bool) array, got dtype {t.dtype}")


def implementation_order(implementation: Any) -> list[str] | None:
  """The ``implementation=`` argument as a list of names to try in order.

  None stays None (the automatic order); a name or a sequence of names becomes a list;
  anything else is a ValueError naming the argument.

  Examples:
    >>> from jaxsoft.attention.call import implementation_order
    >>> implementation_order("xla"), implementation_order(("pallas", "xla")), implementation_order(None)
    (['xla'], ['pallas', 'xla'], None)
  """
  if implementation is None:
    return None
  names = [implementation] if isinstance(implementation, str) else implementation
  try:
    names = list(names)
  except TypeError:
    raise ValueError(
        f"`implementation` must be None, one of {IMPLEMENTATIONS} or a sequence of them, got "
        f"{implementation!r}") from None
  if not names:
    raise ValueError("`implementation` must not be an empty sequence")
  for name in names:
    if name not in IMPLEMENTATIONS:
      raise ValueError(
          f"`implementation`: unknown implementation {name!r}; choose from {IMPLEMENTATIONS} "
          "(or None, or a sequence of them)")
  return names


def gqa_dims(query: Any, key: Any, value: Any, fn: str) -> tuple[int, int, int, int, int, int]:
  """The sizes ``(B, T, N, H, S, K)`` of 4-D ``query [B, T, N, H]``, ``key [B, S, K, H]``
  and ``value [B, S, K, Hv]`` (grouped-query heads: N a multiple of K, query head n reading
  key/value head n // (N / K)), for an entry point that checks its inputs itself rather
  than through :meth:`AttentionCall.create`.

  A ValueError names ``fn`` and the argument: ``key`` whose batch or head dimension is not
  the query's, ``value`` whose ``[B, S, K]`` is not the key's, or N not a multiple of K.

  Examples:
    >>> from jaxsoft.attention.call import gqa_dims
    >>> gqa_dims(jnp.ones((2, 5, 4, 8)), jnp.ones((2, 7, 2, 8)), jnp.ones((2, 7, 2, 3)), "f")
    (2, 5, 4, 8, 7, 2)
  """
  b, t, n, h = query.shape
  if key.shape[0] != b or key.shape[3] != h or value.shape[:3] != key.shape[:3]:
    raise ValueError(f"{fn}: `key` must be [B, S, K, H] = [{b}, S, K, {h}] and `value` "
                     f"[B, S, K, Hv] with the same B, S, K, got {key.shape} and {value.shape}")
  s, kh = key.shape[1], key.shape[2]
  if kh == 0 or n % kh:
    raise ValueError(f"{fn}: the query heads ({n}) must be a multiple of the key/value heads "
                     f"({kh})")
  return b, t, n, h, s, kh
