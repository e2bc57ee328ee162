"""Monotonic attention (feature A52): hard / expected monotonic, chunkwise, window, segment.

Each output step i (query i) has a latent key position t_i >= t_{i-1}. Raffel et al.
(2017) choose it by a left-to-right scan in which key j is selected with probability
p_{ij} = sigmoid(e_{ij}) (e the monotonic energies, here the attention logits
s q_i·k_j + bias); training uses the expected alignment alpha_{ij} = P(t_i = j) and
inference the hard first-hit position. Around that position the context is then

* the key itself (hard monotonic attention; :func:`monotonic_attention` in expectation,
  :func:`hard_monotonic_attention` at inference);
* a normalizer over the chunk [t_i - w + 1, t_i] (MoChA; :func:`chunkwise_attention`);
* a normalizer over the window [t_i - l, t_i + r] (:func:`local_window_attention`);
* a normalizer over the segment (t_{i-1}, t_i] (:func:`segmental_attention`).

All of them are pure functions on the [B, T, N, H] layout of
:func:`~jaxsoft.attention.dot_product_attention` (GQA: query head n reads key/value head
n // (N / K)); the state of a decode step (the alignment or the position) goes in as
``initial_state`` and comes back with ``return_state=True``, so calling one step at a
time equals the full-sequence call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft._validation import boolean_mask, concrete
from jaxsoft.attention._checks import check_int
from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention.call import AttentionCall
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["monotonic_attention_probs", "monotonic_attention", "hard_monotonic_attention",
           "chunkwise_attention", "local_window_attention", "segmental_attention",
           "ALIGNMENT_METHODS"]

ALIGNMENT_METHODS = ("parallel", "cumprod", "loop")


# ----------------------------------------------------------------------------------------
# the expected alignment (training form)


def _step_parallel(p, a_prev):
  """alpha_i = p_i * q_i with q_j = (1 - p_{j-1}) q_{j-1} + a_prev_j (an associative scan:
  the first-order linear recurrence, no division)."""
  decay = jnp.concatenate([jnp.zeros_like(p[..., :1]), 1.0 - p[..., :-1]], axis=-1)

  def combine(x, y):
    (a1, b1), (a2, b2) = x, y
    return a1 * a2, a2 * b1 + b2

  _, q = lax.associative_scan(combine, (decay, a_prev), axis=p.ndim - 1)
  return p * q


def _step_cumprod(p, a_prev, eps: float):
  """Raffel et al.'s closed form: p * cumprod_excl(1 - p) * cumsum(a_prev / clip(cumprod))."""
  cp = jnp.cumprod(jnp.concatenate([jnp.ones_like(p[..., :1]), 1.0 - p[..., :-1]], axis=-1),
                   axis=-1)
  return p * cp * jnp.cumsum(a_prev / jnp.clip(cp, eps, 1.0), axis=-1)


def _step_loop(p, a_prev):
  """The recurrence q_j = (1 - p_{j-1}) q_{j-1} + a_prev_j, one key at a time."""
  pt, at = jnp.moveaxis(p, -1, 0), jnp.moveaxis(a_prev, -1, 0)

  def body(carry, x):
    q_prev, p_prev = carry
    pj, aj = x
    q = (1.0 - p_prev) * q_prev + aj
    return (q, pj), pj * q

  zero = jnp.zeros_like(pt[0])
  _, alpha = lax.scan(body, (zero, zero), (pt, at))
  return jnp.moveaxis(alpha, 0, -1)


def _alignment(p, a0, method: str, eps: float):
  """Scan over the output steps: p [..., T, S], a0 [..., S] -> alpha [..., T, S]."""
  def step(a_prev, p_i):
    if method == "parallel":
      a = _step_parallel(p_i, a_prev)
    elif method == "cumprod":
      a = _step_cumprod(p_i, a_prev, eps)
    else:
      a = _step_loop(p_i, a_prev)
    return a, a

  _, alpha = lax.scan(step, a0, jnp.moveaxis(p, -2, 0))
  return jnp.moveaxis(alpha, 0, -2)


def _check_method(method: Any, fn: str) -> str:
  if method not in ALIGNMENT_METHODS:
    raise ValueError(f"{fn}: `method` must be one of {ALIGNMENT_METHODS}, got {method!r}")
  return method


def monotonic_attention_probs(p_choose: ArrayLike, previous_alignment: ArrayLike | None = None,
                              *, where: ArrayLike | None = None, method: str = "parallel",
                              eps: float = 1e-10) -> jax.Array:
  r"""The expected monotonic alignment: P(t_i = j) under Raffel et al.'s scan (A52).

  At output step i a scan starts at the previous position t_{i-1} and, moving right, stops
  at key j with probability :math:`p_{ij}`; :math:`\alpha_{ij} = P(t_i = j)`:

  .. math::
    \alpha_{ij} = p_{ij} \sum_{k \le j} \alpha_{i-1,k} \prod_{l=k}^{j-1} (1 - p_{il})
      = p_{ij}\, q_{ij}, \qquad q_{ij} = (1 - p_{i,j-1})\, q_{i,j-1} + \alpha_{i-1,j}

  with :math:`\alpha_0` = ``previous_alignment`` (default :math:`\delta_{j,0}`: the scan
  starts at the first key). A row sums to at most 1; the missing mass is the probability
  that the scan ran off the end (then the hard attention's context is 0). ``method``:

  * ``"parallel"`` (default): q by an associative scan over the keys (the first-order linear
    recurrence; O(log S) depth, no division, exact);
  * ``"cumprod"``: the paper's closed form :math:`\alpha_i = p_i \cdot
    \mathrm{cumprod}(1 - p_i) \cdot \mathrm{cumsum}(\alpha_{i-1} / \mathrm{cumprod}(1 -
    p_i))` with the exclusive cumulative product clipped to ``[eps, 1]`` as the paper does
    (inexact once a product falls below eps);
  * ``"loop"``: the recurrence one key at a time (``lax.scan``), the float64-checkable form.

  Output steps are always a ``lax.scan`` (step i needs step i - 1). Masked keys
  (``where`` False) are skipped: their p is taken as 0, so their alignment is exactly 0
  and the scan passes over them. Differentiable in both inputs.

  Args:
    p_choose: selection probabilities [..., T, S] in [0, 1] (a concrete value outside is
      a ValueError; a traced one is not checked).
    previous_alignment: [..., S] broadcastable to ``p_choose[..., 0, :]``: the alignment
      before the first step (a decode step passes the last row of the previous call).
    where: optional bool mask broadcastable to ``p_choose``: True = a key can be chosen.
    method: ``"parallel"``, ``"cumprod"`` or ``"loop"``.
    eps: the clip of ``"cumprod"``.

  Returns:
    alpha [..., T, S] in float32 (float64 for float64 inputs; bf16/fp16 computed and
    returned in float32).

  Examples:
    Stopping probability 1 at key i for step i (0 elsewhere) moves the alignment one key
    per step; a uniform 0.5 spreads it out, with rows summing to less than 1.

    >>> p = jnp.eye(3, 4)
    >>> js.attention.monotonic_attention_probs(p)
    Array([[1., 0., 0., 0.],
           [0., 1., 0., 0.],
           [0., 0., 1., 0.]], dtype=float32)
    >>> js.attention.monotonic_attention_probs(jnp.full((2, 3), 0.5))
    Array([[0.5   , 0.25  , 0.125 ],
           [0.25  , 0.25  , 0.1875]], dtype=float32)

  References:
    C. Raffel, M.-T. Luong, P. J. Liu, R. J. Weiss & D. Eck, 2017, "Online and
    Linear-Time Attention by Enforcing Monotonic Alignments" (ICML 2017).
  """
  fn = "monotonic_attention_probs"
  _check_method(method, fn)
  p = jnp.asarray(p_choose)
  if p.ndim < 2 or not jnp.issubdtype(p.dtype, jnp.floating):
    raise ValueError(f"{fn}: `p_choose` must be a float array [..., T, S], got {p.dtype} {p.shape}")
  values = concrete(p)
  if values is not None and values.size and not ((values >= 0) & (values <= 1)).all():
    raise ValueError(f"{fn}: `p_choose` must lie in [0, 1] (probabilities, e.g. a sigmoid)")
  if not float(eps) > 0:
    raise ValueError(f"{fn}: `eps` must be > 0, got {eps!r}")
  cdt = compute_dtype(p.dtype)
  p = p.astype(cdt)
  if where is not None:
    p = jnp.where(boolean_mask(where, p.shape, "where", fn, "`p_choose`"), p, 0.0)
  row = p.shape[:-2] + p.shape[-1:]
  if previous_alignment is None:
    a0 = jnp.zeros(row, cdt).at[..., 0].set(1.0) if p.shape[-1] else jnp.zeros(row, cdt)
  else:
    a0 = jnp.asarray(previous_alignment)
    try:
      a0 = jnp.broadcast_to(a0, row).astype(cdt)
    except ValueError:
      raise ValueError(
          f"{fn}: `previous_alignment` {a0.shape} must broadcast to [..., S] = {row}") from None
  if p.shape[-1] == 0 or p.shape[-2] == 0:
    return jnp.zeros(p.shape, cdt)
  return _alignment(p, a0, method, float(eps))


# ----------------------------------------------------------------------------------------
# the attention forms


def _call(fn: str, query, key, value, bias, mask, scale, key_value_seq_lengths,
          normalizer="softmax", normalizer_params=None) -> AttentionCall:
  for t, name in ((query, "query"), (key, "key"), (value, "value")):
    if jnp.ndim(t) != 4:
      raise ValueError(f"{fn}: `{name}` must have shape [B, L, heads, H], got {jnp.shape(t)}")
  try:
    return AttentionCall.create(query, key, value, bias=bias, mask=mask, scale=scale,
                                key_value_seq_lengths=key_value_seq_lengths,
                                normalizer=normalizer, normalizer_params=normalizer_params)
  except ValueError as e:
    raise ValueError(f"{fn}: {e}") from None


def _visible(call: AttentionCall):
  """Which keys each (b, n, i) may choose: key lengths and ``mask``, [B, N or 1, T, S]."""
  vis = jnp.broadcast_to(call.structure.dense(), (call.q.shape[0], 1) + call.structure.dense().shape[2:])
  if call.mask is not None:
    vis = vis & call.mask
  return vis


def _p_choose(call: AttentionCall, vis):
  """(p = sigmoid(monotonic energies) [B, N, T, S], 0 on invisible keys; the energies)."""
  logits = dense_logits(call.q, call.k, scale=call.scale, bias=call.bias)
  return jnp.where(vis, jax.nn.sigmoid(logits), 0.0), logits


def _attend(weights, v, dtype):
  """[B, N, T, S] weights times v [B, S, K, Hv] -> [B, T, N, Hv] (GQA grouping)."""
  B, N, T, S = weights.shape
  K = v.shape[2]
  wg = weights.reshape(B, K, N // K, T, S)
  out = jnp.einsum("bkgts,bskh->btkgh", wg, v.astype(weights.dtype))
  return out.reshape(B, T, N, v.shape[-1]).astype(dtype)


def _initial_alignment(initial_state, shape, cdt, fn: str):
  B, N, _, S = shape
  if initial_state is None:
    start = jnp.zeros((B, N, S), cdt)
    return start.at[..., 0].set(1.0) if S else start
  a0 = jnp.asarray(initial_state)
  if not jnp.issubdtype(a0.dtype, jnp.floating):
    raise ValueError(f"{fn}: `initial_state` of the expected form is an alignment [B, N, S] "
                     f"(float), got {a0.dtype}")
  try:
    return jnp.broadcast_to(a0, (B, N, S)).astype(cdt)
  except ValueError:
    raise ValueError(f"{fn}: `initial_state` {a0.shape} must broadcast to [B, N, S] = "
                     f"{[B, N, S]}") from None


def _initial_position(initial_state, shape, default: int, fn: str):
  B, N, _, S = shape
  if initial_state is None:
    return jnp.full((B, N), default, jnp.int32)
  t0 = jnp.asarray(initial_state)
  if not jnp.issubdtype(t0.dtype, jnp.integer):
    raise ValueError(f"{fn}: `initial_state` of the hard form is a position [B, N] (int), "
                     f"got {t0.dtype}")
  try:
    return jnp.broadcast_to(t0, (B, N)).astype(jnp.int32)
  except ValueError:
    raise ValueError(f"{fn}: `initial_state` {t0.shape} must broadcast to [B, N] = "
                     f"{[B, N]}") from None


def _hard_positions(p, t0, threshold):
  """t_i = the first j >= max(t_{i-1}, 0) with p_ij >= threshold; S when there is none."""
  S = p.shape[-1]
  if S == 0:
    return jnp.zeros(p.shape[:3], jnp.int32)  # no key: off the end (t = S = 0) at once
  j = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]: prev is [B, N]

  def step(prev, p_i):
    hit = (j >= jnp.maximum(prev, 0)[..., None]) & (p_i >= threshold)
    t = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1).astype(jnp.int32), S)
    return t, t

  _, t = lax.scan(step, t0, jnp.moveaxis(lax.stop_gradient(p), 2, 0))
  return jnp.moveaxis(t, 0, 2)  # [B, N, T]


def _check_threshold(threshold, fn: str) -> float:
  try:
    thr = float(threshold)
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise ValueError(f"{fn}: `threshold` must be a Python float in (0, 1], got {threshold!r}") from None
  if not 0 < thr <= 1:
    raise ValueError(f"{fn}: `threshold` must be in (0, 1], got {threshold!r}")
  return thr


def monotonic_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                        bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                        scale: float | None = None,
                        key_value_seq_lengths: ArrayLike | None = None,
                        initial_state: ArrayLike | None = None, method: str = "parallel",
                        return_state: bool = False) -> Any:
  r"""Monotonic attention in expectation: the training form of hard monotonic attention (A52).

  With the monotonic energies :math:`e_{ij} = s\, q_i \cdot k_j + \mathrm{bias}_{ij}`
  (GQA as :func:`dot_product_attention`), :math:`p_{ij} = \sigma(e_{ij})` and the expected
  alignment :math:`\alpha` of :func:`monotonic_attention_probs`,

  .. math:: c_i = \sum_j \alpha_{ij}\, v_j

  the expectation of the hard context :math:`v_{t_i}` (0 when the scan runs off the end)
  of :func:`hard_monotonic_attention`. Raffel et al. add Gaussian noise to the energies
  before the sigmoid in training so that p becomes nearly 0/1, and an offset r
  (initialised negative) to them; both are the caller's, through ``bias``. [R] Their
  energy is :math:`g\, v^\top \tanh(W s_{i-1} + V h_j + b)/\|v\| + r`; the dot product here
  is the [B, T, N, H] layout's.

  Args:
    query: [B, T, N, H] (the decoder states s_{i-1}); key: [B, S, K, H]; value:
      [B, S, K, Hv].
    bias: added to the energies, broadcastable to [B, N, T, S] (e.g. the offset r).
    mask: bool broadcastable to [B, N, T, S]; False keys are skipped (p = 0).
    scale: the energy scale (default 1/sqrt(H)).
    key_value_seq_lengths: int [B]; keys past the length are skipped.
    initial_state: the alignment before step 1, float [B, N, S] (default one-hot at 0).
    method: how each step's alignment is computed (see :func:`monotonic_attention_probs`).
    return_state: also return the alignment [B, N, T, S]; its last step
      ``state[:, :, -1]`` is the next call's ``initial_state`` (one decode step at a time
      equals the full call).

  Returns:
    [B, T, N, Hv] in query's dtype (computed in float32 for bf16/fp16), and the alignment
    when ``return_state``. Differentiable in query, key, value and bias.

  Examples:
    Energies that stop the scan at key i for step i: each step reads one value.

    >>> v = jnp.arange(4.0).reshape(1, 4, 1, 1)       # values 0, 1, 2, 3
    >>> q, k = jnp.ones((1, 3, 1, 1)), jnp.ones((1, 4, 1, 1))
    >>> bias = 40.0 * (2 * jnp.eye(3, 4) - 1)          # p ~ 1 at j = i, ~0 elsewhere
    >>> js.attention.monotonic_attention(q, k, v, bias, scale=0.0)[0, :, 0, 0]
    Array([0., 1., 2.], dtype=float32)

  References:
    C. Raffel, M.-T. Luong, P. J. Liu, R. J. Weiss & D. Eck, 2017, "Online and
    Linear-Time Attention by Enforcing Monotonic Alignments" (ICML 2017).
  """
  fn = "monotonic_attention"
  _check_method(method, fn)
  call = _call(fn, query, key, value, bias, mask, scale, key_value_seq_lengths)
  vis = _visible(call)
  p, _ = _p_choose(call, vis)
  a0 = _initial_alignment(initial_state, p.shape, p.dtype, fn)
  alpha = _alignment(p, a0, method, 1e-10) if p.shape[2] and p.shape[3] else jnp.zeros_like(p)
  out = _attend(alpha, call.v, call.q.dtype)
  return (out, alpha) if return_state else out


def hard_monotonic_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                             bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                             scale: float | None = None,
                             key_value_seq_lengths: ArrayLike | None = None,
                             threshold: float = 0.5, initial_state: ArrayLike | None = None,
                             return_state: bool = False) -> Any:
  r"""Hard monotonic attention: each step reads the first key at or after the last one (A52).

  The inference form of :func:`monotonic_attention`: with :math:`p_{ij} = \sigma(e_{ij})`,

  .. math::
    t_i = \min\{\, j \ge t_{i-1} : p_{ij} \ge \theta,\ j \text{ visible} \,\},
    \qquad c_i = v_{t_i}

  and :math:`c_i = 0`, :math:`t_i = S` when there is no such j (the scan ran off the end;
  every later step then reads nothing too). Linear time, online: step i needs only
  :math:`t_{i-1}`, which a decode step carries (``initial_state`` / ``return_state``).
  When every p is 0 or 1 it equals the expected form exactly. The gradient reaches the
  values (the positions are piecewise constant).

  Args:
    query, key, value, bias, mask, scale, key_value_seq_lengths: as
      :func:`monotonic_attention`.
    threshold: theta, a float in (0, 1] (the paper's 0.5: p >= 0.5).
    initial_state: int [B, N], the position before step 1 (default 0; negative values
      search from 0).
    return_state: also return the positions t, int32 [B, N, T] (S = ran off the end);
      ``state[:, :, -1]`` is the next call's ``initial_state``.

  Returns:
    [B, T, N, Hv] in query's dtype, and the positions when ``return_state``.

  Examples:
    Key 1 is the first with p >= 0.5 for step 0; step 1 cannot go back to key 0.

    >>> v = jnp.arange(3.0).reshape(1, 3, 1, 1)
    >>> q, k = jnp.ones((1, 2, 1, 1)), jnp.ones((1, 3, 1, 1))
    >>> bias = jnp.array([[-1.0, 1.0, 1.0], [1.0, -1.0, 1.0]])   # energies [T, S]
    >>> out, t = js.attention.hard_monotonic_attention(q, k, v, bias, scale=0.0,
    ...                                                return_state=True)
    >>> out[0, :, 0, 0], t[0, 0]
    (Array([1., 2.], dtype=float32), Array([1, 2], dtype=int32))

  References:
    C. Raffel, M.-T. Luong, P. J. Liu, R. J. Weiss & D. Eck, 2017, "Online and
    Linear-Time Attention by Enforcing Monotonic Alignments" (ICML 2017).
  """
  fn = "hard_monotonic_attention"
  thr = _check_threshold(threshold, fn)
  call = _call(fn, query, key, value, bias, mask, scale, key_value_seq_lengths)
  vis = _visible(call)
  p, _ = _p_choose(call, vis)
  t0 = _initial_position(initial_state, p.shape, 0, fn)
  t = _hard_positions(p, t0, thr)
  weights = (jnp.arange(p.shape[-1], dtype=jnp.int32)[None, None, None, :]
             == t[..., None]).astype(p.dtype)
  out = _attend(weights, call.v, call.q.dtype)
  return (out, t) if return_state else out


# ----------------------------------------------------------------------------------------
# a normalizer around the monotonic position


def _normalize(call: AttentionCall, x, where, extra_axes: int = 0):
  """The call's normalizer over the last axis of ``x`` [B, N, T, (extra...), L]; its array
  hyperparameters ([B, N, T, 1]-broadcastable) get ``extra_axes`` more axes before the last."""
  spec, params, key = call.spec, dict(call.params), call.key
  if extra_axes:
    for name, value in params.items():
      if value is None or isinstance(value, (bool, int, float, str)):
        continue
      arr = jnp.asarray(value)
      if arr.ndim:
        arr = arr.reshape((1,) * (4 - arr.ndim) + arr.shape)
        params[name] = arr.reshape(arr.shape[:3] + (1,) * extra_axes + arr.shape[3:])
  if isinstance(spec, _spec.NormalizerSpec):
    if spec.needs_key:
      return spec.fn(key, x, axis=-1, where=where, **params)
    return spec.fn(x, axis=-1, where=where, **params)
  return spec(x, axis=-1, where=where, **params)


def _soft_logits(fn: str, call: AttentionCall, chunk_query, chunk_key, chunk_bias, scale,
                 energies):
  """The logits of the soft part (MoChA's chunk energies u): from (chunk_query, chunk_key,
  chunk_bias), each defaulting to the monotonic energies' own."""
  if chunk_query is None and chunk_key is None and chunk_bias is None:
    return energies
  cq = call.q if chunk_query is None else jnp.asarray(chunk_query)
  ck = call.k if chunk_key is None else jnp.asarray(chunk_key)
  cb = call.bias if chunk_bias is None else chunk_bias
  if (cq.ndim != 4 or ck.ndim != 4 or cq.shape[:3] != call.q.shape[:3]
      or ck.shape[:3] != call.k.shape[:3] or cq.shape[3] != ck.shape[3]):
    raise ValueError(
        f"{fn}: `chunk_query` {cq.shape} / `chunk_key` {ck.shape} must match `query` "
        f"{call.q.shape} / `key` {call.k.shape} in [B, L, heads] and share a head dimension")
  c2 = _call(fn, cq, ck, ck, cb, None, scale, None)  # default scale 1/sqrt(H')
  return dense_logits(c2.q, c2.k, scale=c2.scale, bias=c2.bias)


def _expected_window(call, alpha, u, vis, left: int, right: int):
  """beta_ij = sum_t alpha_it f(u_i restricted to [t - left, t + right])_j, exactly: the
  windows are gathered ([B, N, T, S, W], W = left + right + 1), normalised, weighted by
  alpha and scattered back to their keys."""
  S = u.shape[-1]
  offsets = jnp.arange(-left, right + 1, dtype=jnp.int32)
  idx = jnp.arange(S, dtype=jnp.int32)[:, None] + offsets[None, :]  # [S (position t), W]
  inside = (idx >= 0) & (idx < S)
  idxc = jnp.clip(idx, 0, S - 1)
  u_win = jnp.take(u, idxc, axis=-1)  # [B, N, T, S, W]
  vis_win = jnp.take(jnp.broadcast_to(vis, u.shape), idxc, axis=-1) & inside[None, None, None]
  w_win = _normalize(call, jnp.where(vis_win, u_win, 0.0), vis_win, extra_axes=1)
  w_win = jnp.where(vis_win, w_win, 0.0).astype(u.dtype)
  contrib = (alpha[..., None] * w_win).reshape(u.shape[:3] + (-1,))
  return jnp.zeros_like(u).at[..., idxc.reshape(-1)].add(contrib)


# The keyword options the three windowed variants pass through to ``_windowed`` unchanged.
_OPTIONS = ("chunk_query", "chunk_key", "chunk_bias", "scale", "key_value_seq_lengths", "hard",
            "threshold", "initial_state", "method", "normalizer", "normalizer_params",
            "return_state")


def _options(scope: Mapping[str, Any]) -> dict[str, Any]:
  """The pass-through options a windowed variant's call scope defines (``_OPTIONS``)."""
  return {name: scope[name] for name in _OPTIONS if name in scope}


def _windowed(fn: str, query, key, value, bias, mask, *, left, right, segment, chunk_query,
              chunk_key, chunk_bias, scale, key_value_seq_lengths, hard, threshold,
              initial_state, method, normalizer, normalizer_params, return_state):
  """The shared body of the chunk, window and segment forms."""
  if not isinstance(hard, (bool,)):
    raise ValueError(f"{fn}: `hard` must be a bool, got {hard!r}")
  thr = _check_threshold(threshold, fn)
  _check_method(method, fn)
  call = _call(fn, query, key, value, bias, mask, scale, key_value_seq_lengths, normalizer,
               normalizer_params)
  vis = _visible(call)
  p, e = _p_choose(call, vis)
  u = _soft_logits(fn, call, chunk_query, chunk_key, chunk_bias, scale, e)
  B, N, T, S = p.shape
  j = jnp.arange(S, dtype=jnp.int32)[None, None, None, :]  # [1, 1, 1, S]: t is [B, N, T]
  if hard:
    t0 = _initial_position(initial_state, p.shape, -1 if segment else 0, fn)
    t = _hard_positions(p, t0, thr)
    on = (t < S)[..., None]
    if segment:
      prev = jnp.concatenate([t0[..., None], t[..., :-1]], axis=-1)
      start = jnp.where(t > prev, prev + 1, t)  # [R] an empty segment (t_i = t_{i-1}) is {t_i}
      inwin = (j >= start[..., None]) & (j <= t[..., None])
    else:
      inwin = (j >= t[..., None] - left) & (j <= t[..., None] + right)
    where = jnp.broadcast_to(vis, p.shape) & inwin & on
    weights = _normalize(call, jnp.where(where, u, 0.0), where)
    weights = jnp.where(where, weights, 0.0).astype(p.dtype)
    state: Any = t
  else:
    a0 = _initial_alignment(initial_state, p.shape, p.dtype, fn)
    alpha = _alignment(p, a0, method, 1e-10) if T and S else jnp.zeros_like(p)
    weights = _expected_window(call, alpha, u, vis, left, right) if T and S else alpha
    state = alpha
  out = _attend(weights, call.v, call.q.dtype)
  return (out, state) if return_state else out


def chunkwise_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                        bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                        chunk_size: int, chunk_query: ArrayLike | None = None,
                        chunk_key: ArrayLike | None = None, chunk_bias: ArrayLike | None = None,
                        scale: float | None = None,
                        key_value_seq_lengths: ArrayLike | None = None, hard: bool = False,
                        threshold: float = 0.5, initial_state: ArrayLike | None = None,
                        method: str = "parallel",
                        normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
                        normalizer_params: Mapping[str, Any] | None = None,
                        return_state: bool = False) -> Any:
  r"""Monotonic chunkwise attention (MoChA): a softmax over the w keys ending at t_i (A52).

  The monotonic position :math:`t_i` is chosen as in :func:`hard_monotonic_attention`
  (energies e, :math:`p = \sigma(e)`); the context is a soft attention over the chunk
  :math:`[t_i - w + 1, t_i]` with the chunk energies :math:`u_{ij}` (the logits of
  ``chunk_query``·``chunk_key`` + ``chunk_bias``, each defaulting to the monotonic
  energies' own). At inference (``hard=True``)

  .. math:: c_i = \sum_{j = t_i - w + 1}^{t_i} \frac{e^{u_{ij}}}{\sum_{l = t_i - w + 1}^{t_i}
            e^{u_{il}}}\, v_j

  (0 when the scan ran off the end); in training (``hard=False``) its expectation over
  :math:`t_i \sim \alpha_i` (:func:`monotonic_attention_probs`), Chiu & Raffel's

  .. math:: \beta_{ij} = \sum_{k=j}^{j+w-1} \alpha_{ik}\,
            \frac{e^{u_{ij}}}{\sum_{l=k-w+1}^{k} e^{u_{il}}}, \qquad c_i = \sum_j \beta_{ij} v_j

  computed exactly by gathering each chunk (memory O(B N T S w); no division by a sum of
  exponentials that can underflow, unlike the paper's moving-sum form). w = 1 is hard
  monotonic attention (and its expectation, :func:`monotonic_attention`); w >= S with
  every p = 1 at j = S - 1 is a softmax over all keys. Any registered normalizer can
  replace the softmax within the chunk (``normalizer``; the chunk is its ``where``).

  Args:
    query, key, value, bias, mask, scale, key_value_seq_lengths: as
      :func:`monotonic_attention` (bias and mask act on the monotonic energies; the mask
      and lengths also hide keys from the chunks).
    chunk_size: w, an int >= 1.
    chunk_query: [B, T, N, H'] and chunk_key: [B, S, K, H']: the chunk energies' inputs
      (default query and key; ``scale`` applies to them too, default 1/sqrt(H'));
      chunk_bias: added to them (default ``bias``).
    hard: inference (positions) instead of the expectation.
    threshold: as in :func:`hard_monotonic_attention` (``hard=True`` only).
    initial_state: the alignment [B, N, S] (expected) or position [B, N] (hard) before
      step 1; default one-hot at 0 / position 0.
    method: the alignment's method (see :func:`monotonic_attention_probs`).
    normalizer, normalizer_params: the normalizer within a chunk (as in
      :func:`dot_product_attention`; array hyperparameters broadcast against [B, N, T, 1]).
    return_state: also return the alignment [B, N, T, S] (expected) or the positions
      int32 [B, N, T] (hard); the last step is the next decode call's ``initial_state``.

  Returns:
    [B, T, N, Hv] in query's dtype (computed in float32 at least: bf16 and fp16 widen, float64 stays), and the state when ``return_state``.
    Differentiable in every float input (only through the values and chunk energies when
    ``hard``).

  Examples:
    Chunks of 2 ending at the hard positions 1 and 3 (p = 1 there) with equal chunk
    energies: each step averages the values of its chunk.

    >>> v = jnp.arange(4.0).reshape(1, 4, 1, 1)
    >>> q, k = jnp.ones((1, 2, 1, 1)), jnp.ones((1, 4, 1, 1))
    >>> e = 40.0 * jnp.array([[-1.0, 1, -1, -1], [-1, -1, -1, 1]])    # p ~ 1 at 1 and 3
    >>> zero = jnp.zeros((2, 4))
    >>> js.attention.chunkwise_attention(q, k, v, e, chunk_size=2, chunk_bias=zero,
    ...                                  scale=0.0, hard=True)[0, :, 0, 0]
    Array([0.5, 2.5], dtype=float32)
    >>> js.attention.chunkwise_attention(q, k, v, e, chunk_size=2, chunk_bias=zero,
    ...                                  scale=0.0)[0, :, 0, 0]          # the expectation
    Array([0.5, 2.5], dtype=float32)

  References:
    C.-C. Chiu & C. Raffel, 2018, "Monotonic Chunkwise Attention" (ICLR 2018).

    C. Raffel, M.-T. Luong, P. J. Liu, R. J. Weiss & D. Eck, 2017, "Online and
    Linear-Time Attention by Enforcing Monotonic Alignments" (ICML 2017).
  """
  fn = "chunkwise_attention"
  w = check_int(chunk_size, "chunk_size", 1, fn)
  S = jnp.shape(key)[1] if jnp.ndim(key) == 4 else 1
  return _windowed(fn, query, key, value, bias, mask, left=min(w - 1, max(S - 1, 0)), right=0,
                   segment=False, **_options(locals()))


def local_window_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                           bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                           window: int | tuple[int, int], chunk_query: ArrayLike | None = None,
                           chunk_key: ArrayLike | None = None,
                           chunk_bias: ArrayLike | None = None, scale: float | None = None,
                           key_value_seq_lengths: ArrayLike | None = None, hard: bool = False,
                           threshold: float = 0.5, initial_state: ArrayLike | None = None,
                           method: str = "parallel",
                           normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
                           normalizer_params: Mapping[str, Any] | None = None,
                           return_state: bool = False) -> Any:
  r"""Local windowed soft attention around the monotonic position (A52).

  As :func:`chunkwise_attention` with the window :math:`[t_i - l, t_i + r]` in place of
  the chunk (``window = w`` means l = r = w):

  .. math:: c_i = \sum_{j = t_i - l}^{t_i + r} f\big(u_{i, [t_i - l,\, t_i + r]}\big)_j\, v_j

  at inference, and its expectation :math:`\sum_t \alpha_{it}\, c_i(t)` in training. The
  window looks ahead of the position (r > 0), so it is not online beyond r keys. Keys
  outside the window get exactly 0; a window covering every key (l, r >= S - 1) with a
  position that stays on the keys is global attention with f. The expected form gathers
  every window: memory O(B N T S (l + r + 1)), so a wide window belongs to ``hard=True``
  (O(B N T S)). From Zeyer et al.'s
  comparison of latent monotonic attention variants ("local windowed soft attention");
  [R] the latent position's model here is Raffel et al.'s scan, and their
  training by marginalising the latent with their own transition model is not
  reproduced.

  Args:
    query, key, value, bias, mask, chunk_query, chunk_key, chunk_bias, scale,
      key_value_seq_lengths, hard, threshold, initial_state, method, normalizer,
      normalizer_params, return_state: as :func:`chunkwise_attention`.
    window: w (an int >= 0: the same on both sides) or ``(l, r)``.

  Returns:
    As :func:`chunkwise_attention`.

  Examples:
    Hard position 1 (p = 1 there) and a window of 1 on each side: the mean of keys 0..2.

    >>> v = jnp.arange(5.0).reshape(1, 5, 1, 1)
    >>> q, k = jnp.ones((1, 1, 1, 1)), jnp.ones((1, 5, 1, 1))
    >>> e = 40.0 * jnp.array([[-1.0, 1, -1, -1, -1]])
    >>> js.attention.local_window_attention(q, k, v, e, window=1, chunk_bias=jnp.zeros((1, 5)),
    ...                                     scale=0.0, hard=True)[0, 0, 0, 0]
    Array(1., dtype=float32)

  References:
    A. Zeyer, R. Schlüter & H. Ney, 2021, "A study of latent monotonic attention variants"
    (arXiv 2103.16710).

    C. Raffel, M.-T. Luong, P. J. Liu, R. J. Weiss & D. Eck, 2017, "Online and
    Linear-Time Attention by Enforcing Monotonic Alignments" (ICML 2017).
  """
  fn = "local_window_attention"
  if isinstance(window, tuple):
    if len(window) != 2:
      raise ValueError(f"{fn}: `window` must be an int or a pair (left, right), got {window!r}")
    left = check_int(window[0], "window[0]", 0, fn)
    right = check_int(window[1], "window[1]", 0, fn)
  else:
    left = right = check_int(window, "window", 0, fn)
  S = jnp.shape(key)[1] if jnp.ndim(key) == 4 else 1
  cap = max(S - 1, 0)
  return _windowed(fn, query, key, value, bias, mask, left=min(left, cap),
                   right=min(right, cap), segment=False, **_options(locals()))


def segmental_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                        bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                        chunk_query: ArrayLike | None = None, chunk_key: ArrayLike | None = None,
                        chunk_bias: ArrayLike | None = None, scale: float | None = None,
                        key_value_seq_lengths: ArrayLike | None = None,
                        threshold: float = 0.5, initial_state: ArrayLike | None = None,
                        normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
                        normalizer_params: Mapping[str, Any] | None = None,
                        return_state: bool = False) -> Any:
  r"""Segmental soft attention: a normalizer over the keys since the last position (A52).

  With the hard monotonic positions :math:`t_i` (:func:`hard_monotonic_attention`; the
  boundaries of the segments),

  .. math:: c_i = \sum_{j = t_{i-1} + 1}^{t_i} f\big(u_{i, (t_{i-1},\, t_i]}\big)_j\, v_j

  with :math:`t_0 = -1` by default (the first segment starts at key 0). The segments tile
  the keys up to the last boundary without overlap, and the form is online (step i needs
  :math:`t_{i-1}` and :math:`t_i` only). [R] Raffel et al.'s scan may stay
  (:math:`t_i = t_{i-1}`); that step's segment is then the key :math:`t_i` alone (the
  paper's latent model has no empty segments). Off the end (:math:`t_i = S`) the context
  is 0. Only the inference form: the expected form needs the joint distribution of
  :math:`(t_{i-1}, t_i)`, which Zeyer et al. marginalise with their own transition model
  (not reproduced here). The gradient reaches the values and the segment energies u.

  Args:
    query, key, value, bias, mask, chunk_query, chunk_key, chunk_bias, scale,
      key_value_seq_lengths, threshold, normalizer, normalizer_params: as
      :func:`chunkwise_attention`.
    initial_state: int [B, N], the boundary before step 1 (default -1).
    return_state: also return the boundaries t, int32 [B, N, T]; ``state[:, :, -1]`` is
      the next decode call's ``initial_state``.

  Returns:
    [B, T, N, Hv] in query's dtype, and the boundaries when ``return_state``.

  Examples:
    Boundaries 1 and 4: the first step averages keys 0..1, the second keys 2..4.

    >>> v = jnp.arange(5.0).reshape(1, 5, 1, 1)
    >>> q, k = jnp.ones((1, 2, 1, 1)), jnp.ones((1, 5, 1, 1))
    >>> e = 40.0 * jnp.array([[-1.0, 1, -1, -1, -1], [-1, -1, -1, -1, 1]])
    >>> js.attention.segmental_attention(q, k, v, e, chunk_bias=jnp.zeros((2, 5)),
    ...                                  scale=0.0)[0, :, 0, 0]
    Array([0.5, 3. ], dtype=float32)

  References:
    A. Zeyer, R. Schlüter & H. Ney, 2021, "A study of latent monotonic attention variants"
    (arXiv 2103.16710).

    C. Raffel, M.-T. Luong, P. J. Liu, R. J. Weiss & D. Eck, 2017, "Online and
    Linear-Time Attention by Enforcing Monotonic Alignments" (ICML 2017).
  """
  return _windowed("segmental_attention", query, key, value, bias, mask, left=0, right=0,
                   segment=True, hard=True, method="parallel", **_options(locals()))

