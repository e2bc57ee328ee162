"""A20 Polar attention (ATMA): a unit direction times a bounded magnitude, with the
extreme-value null sink and the gated-delta memory channel.

From the ATMA paper (Polar attention with a gated-delta memory; reference code
kreasof-ai/atma). :func:`polar_attention` is this library's first reconstruction [R] of
the two attention channels (a sigmoid magnitude against ``PR_null = n``);
:func:`polar_sink_attention` is the checked form of the reference code: the weights of
:func:`jaxsoft.normalizers.polar_softmax`, whose virtual null logit tracks the
extreme-value scale of n unrelated scores, the null value, and a tanh magnitude of the
sink-corrected participation ratio; :func:`polar_memory` is the memory channel (the
gated delta rule of :func:`jaxsoft.linear.gated_delta_rule`, RMS-normalised and gated).
``jaxsoft.nn.PolarMemoryAttention`` combines the three with their projections.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft import linear as _linear
from jaxsoft._validation import concrete as _concrete
from jaxsoft.attention._dense import dense_weights
from jaxsoft.attention._parameters import per_head
from jaxsoft.attention.scores import safe_distance

__all__ = ["polar_attention", "polar_sink_attention", "polar_memory"]

# ATMA's retention bias: gamma_t = sigmoid(W x + b + 3.9), about 0.98 at W x + b = 0.
RETENTION_BIAS = 3.9

_ALLOWED = frozenset({
    "scale", "is_causal", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
    "segment_ids", "logits_soft_cap", "normalizer", "normalizer_params", "decay_bias", "score"})


def _positive_eps(eps, fn: str) -> float:
  """``eps`` as a float > 0; ValueError naming ``fn`` otherwise."""
  try:
    eps_f = float(eps)
  except TypeError:
    raise ValueError(f"{fn}: `eps` must be a float > 0, got {eps!r}") from None
  if not eps_f > 0:
    raise ValueError(f"{fn}: `eps` must be > 0, got {eps!r}")
  return eps_f


def _per_head_rows(value, num_heads: int, name: str, fn: str):
  """A scalar or per-head ``[N]`` -> broadcastable against per-row arrays [B, N, T] (rank 3:
  no implicit rank promotion)."""
  v = per_head(value, num_heads, name, fn)
  return v if v.ndim == 0 else v.reshape(1, num_heads, 1)


def polar_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    magnitude_slope: ArrayLike = 1.0, magnitude_bias: ArrayLike = 0.0,
                    eps: float = 1e-6, return_parts: bool = False, **kwargs: Any) -> Any:
  r"""Polar attention: a unit direction times a bounded magnitude, reconstructed (feature A20) [R].

  From the ATMA paper ("Polar attention" with a gated-delta memory; reference code by
  kreasof-ai; authors and year not established):
  attention split into a count-blind unit-vector direction channel and a bounded
  magnitude channel driven by the participation ratio of the matches against a null
  expectation. The paper's exact maps are not established; this is the reconstruction.
  With w the weights of the normalizer slot (any jaxsoft normalizer; default softmax, as
  in ATMA) over the visible keys V_i of query i and n_i = |V_i|:

  .. math::
    s_i = \sum_{j \in V_i} w_{ij} v_j, \qquad
    u_i = \frac{s_i}{\max(\|s_i\|, \epsilon)}, \qquad
    \mathrm{PR}_i = \frac{(\sum_j w_{ij})^2}{\sum_j w_{ij}^2}

  .. math::
    m_i = \sigma\big(a\,(\log \mathrm{PR}_{\mathrm{null}}(n_i) - \log \mathrm{PR}_i) + b\big),
    \qquad \mathrm{PR}_{\mathrm{null}}(n) = n, \qquad o_i = m_i\, u_i

  PR is the effective number of matched keys (n for uniform weights, 1 for one-hot); the
  null expectation is taken as n, the participation ratio when no key stands out (the
  ATMA reference code corrects it with an extreme-value null sink instead: that form is
  :func:`polar_sink_attention`, and its memory channel :func:`polar_memory`). So ``m`` is ``sigma(b)`` for uniform weights (no match) and
  rises towards 1 as the weights concentrate; at the defaults ``a = 1, b = 0``,
  ``m = n / (n + PR)``. Pass a negative ``magnitude_bias`` for a magnitude near 0 on a
  null context; ``a`` and ``b`` are differentiable (learn them per head).

  Count-blind: repeating every key/value pair twice halves each softmax weight, so u
  is unchanged, and doubles both n and PR, so m is unchanged too (for any normalizer whose
  weights do not depend on n, e.g. sigmoid without its length bias, u and m are unchanged
  as well: PR is homogeneous of degree 0 in w).

  A row with no visible key (or all-zero weights) has ``u = 0``, ``m = 0`` and output 0,
  with zero gradient. The norm's gradient is taken as 0 where ``s_i = 0``.

  Args:
    query: [B, T, N, H] (or [T, N, H]); key: [B, S, K, H]; value: [B, S, K, Hv] (GQA
      when N % K == 0).
    bias, mask: as :func:`dot_product_attention`.
    magnitude_slope: a > 0, a scalar or per head ``[N]``; differentiable.
    magnitude_bias: b, a scalar or per head ``[N]``; differentiable.
    eps: the floor of ``||s_i||`` (> 0).
    return_parts: also return the channels.
    **kwargs: ``scale``, ``is_causal``, the sequence lengths, ``local_window_size``,
      ``segment_ids``, ``logits_soft_cap``, ``normalizer`` (default ``"softmax"``),
      ``normalizer_params``, ``decay_bias`` and ``score``, as :func:`dot_product_attention`
      (dense computation, O(T·S) memory per head).

  Returns:
    o [B, T, N, Hv] in query's dtype (float32 for integer inputs); with ``return_parts``,
    ``(o, u [B, T, N, Hv], m [B, T, N], PR [B, T, N])`` (u, m and PR in the compute dtype,
    float32 or float64). Unbatched inputs give unbatched results.

  Examples:
    Query 0 matches one key of four (PR near 1: m = n / (n + PR) = 0.8); query 1 matches
    none (uniform weights, PR = n: m = sigma(0) = 0.5).

    >>> q = jnp.array([[10.0, 0.0], [0.0, 0.0]]).reshape(1, 2, 1, 2)   # [B, T, N, H]
    >>> k = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]).reshape(1, 4, 1, 2)
    >>> v = jnp.array([[3.0, 4.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]).reshape(1, 4, 1, 2)
    >>> out, u, m, pr = js.attention.polar_attention(q, k, v, scale=1.0, return_parts=True)
    >>> m[0, :, 0]
    Array([0.8, 0.5], dtype=float32)
    >>> out[0, 0, 0]   # 0.8 times the unit direction (0.6, 0.8) of the matched value
    Array([0.48, 0.64], dtype=float32)

  References:
    ATMA / Polar attention (reference code by kreasof-ai; authors and year not established
    in this project's sources).
  """
  fn = "polar_attention"
  if not isinstance(return_parts, (bool, np.bool_)):
    raise ValueError(f"{fn}: `return_parts` must be a bool, got {return_parts!r}")
  eps_f = _positive_eps(eps, fn)
  slope = _concrete(magnitude_slope)
  if slope is not None and (np.any(~np.isfinite(slope)) or np.any(slope <= 0)):
    raise ValueError(f"{fn}: `magnitude_slope` must be finite and > 0, got {magnitude_slope!r}")
  b0 = _concrete(magnitude_bias)
  if b0 is not None and np.any(~np.isfinite(b0)):
    raise ValueError(f"{fn}: `magnitude_bias` must be finite, got {magnitude_bias!r}")
  unbatched = jnp.ndim(query) == 3
  heads = jnp.shape(query)[-2] if jnp.ndim(query) >= 2 else 1
  a = _per_head_rows(magnitude_slope, heads, "magnitude_slope", fn)
  b = _per_head_rows(magnitude_bias, heads, "magnitude_bias", fn)
  call, w, visible = dense_weights(fn, query, key, value, bias, mask, kwargs, _ALLOWED)
  B, T, N, _ = call.q.shape
  K = call.k.shape[2]
  cdt = w.dtype
  a, b = a.astype(cdt), b.astype(cdt)

  n = jnp.sum(visible, axis=-1).astype(cdt)  # [B, N, T]
  sw = jnp.sum(w, axis=-1)
  sw2 = jnp.sum(w * w, axis=-1)
  has = sw2 > 0
  pr = jnp.where(has, sw * sw / jnp.where(has, sw2, 1.0), 0.0)
  ok = has & (pr > 0) & (n > 0)
  z = a * (jnp.log(jnp.where(ok, n, 1.0)) - jnp.log(jnp.where(ok, pr, 1.0))) + b
  m = jnp.where(ok, jax.nn.sigmoid(z), 0.0)  # [B, N, T]

  wg = w.reshape(B, K, N // K, T, -1)
  s = jnp.einsum("bkgts,bskh->btkgh", wg, call.v.astype(cdt)).reshape(B, T, N, -1)
  norm = safe_distance(jnp.sum(s * s, axis=-1, keepdims=True))
  u = s / jnp.maximum(norm, eps_f)
  m_t = jnp.transpose(m, (0, 2, 1))  # [B, T, N]
  out_dtype = call.q.dtype
  out = (m_t[..., None] * u).astype(out_dtype)
  parts = [out, u, m_t, jnp.transpose(pr, (0, 2, 1))]
  if unbatched:
    parts = [p[0] for p in parts]
  return tuple(parts) if return_parts else parts[0]


def _null_value(null_value, heads: int, hv: int, dtype, fn: str):
  """``v_null`` as ``[N, Hv]`` (zeros by default; a ``[Hv]`` vector is shared by the heads)."""
  if null_value is None:
    return jnp.zeros((heads, hv), dtype)
  v = jnp.asarray(null_value)
  if v.shape == (hv,):
    v = jnp.broadcast_to(v, (heads, hv))
  if v.shape != (heads, hv):
    raise ValueError(f"{fn}: `null_value` must be [Hv] = ({hv},) or [N, Hv] = ({heads}, {hv}), "
                     f"got shape {v.shape}")
  return v.astype(dtype)


def polar_sink_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                         bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                         alpha: ArrayLike = 0.0, null_bias: ArrayLike = 0.0,
                         gamma: ArrayLike = 0.0, magnitude_gain: ArrayLike = 0.0,
                         null_value: ArrayLike | None = None, eps: float = 1e-6,
                         return_parts: bool = False, **kwargs: Any) -> Any:
  r"""Polar attention with ATMA's extreme-value null sink: direction and magnitude (feature A20).

  The two attention channels of ATMA as the reference code computes them (the checked form;
  kreasof-ai/atma). With :math:`\sigma_{ij}` the scaled scores of query i over its
  :math:`n_i` visible keys and per-head parameters :math:`\alpha, b, \gamma, \beta`:

  .. math::
    t_i = 1 + \mathrm{softplus}(\alpha) \log n_i, \qquad
    \nu_i = b + \mathrm{softplus}(\gamma) \sqrt{\log(n_i + 1)}, \qquad
    [w_{i\bullet}, w_{iN}] = \mathrm{softmax}\big(t_i \cdot [\sigma_{i\bullet}, \nu_i]\big)

  .. math::
    s_i = \sum_j w_{ij} v_j + w_{iN} v_{\mathrm{null}}, \qquad
    c_i = \frac{s_i}{\max(\|s_i\|, \epsilon)}, \qquad
    n_{\mathrm{eff},i} = \frac{(\sum_j w_{ij})^2}{\sum_j w_{ij}^2}, \qquad
    \mu_i = \tanh\big(\mathrm{softplus}(\beta) \log(1 + n_{\mathrm{eff},i} (1 - w_{iN}))\big)

  The null sink is the extreme-value correction: the largest of n unrelated scores grows
  like :math:`\sqrt{2 \log n}` (for standard normal scores), so a null logit
  :math:`\nu` growing like :math:`\sqrt{\log n}` keeps up with what chance alone reaches
  at every context length, and a query with no real match puts its mass on the sink
  (``w_N`` near 1, ``mu`` near 0) however long the context. The weights ``w`` are exactly
  :func:`jaxsoft.normalizers.polar_softmax`'s (``w_N = 1 - sum_j w_j``); ``n_eff`` is
  the participation ratio of the normalised real weights (n for uniform, 1 for one-hot)
  and ``n_eff (1 - w_N)`` the effective number of matches. ATMA's layer output is
  ``W_o (c ⊙ sigmoid(W_gate c)) + W_mu mu`` plus the memory channel
  (:func:`polar_memory`); those projections are the layer's
  (``jaxsoft.nn.PolarMemoryAttention``), so this returns the channels.

  Properties: ``||c|| <= 1`` (1 unless ``s = 0``); ``mu`` in [0, 1); duplicating every
  key/value pair leaves ``n_eff / n`` unchanged at fixed ``t`` and ``nu`` (count-blind
  direction up to the length terms). A row with no visible key has ``c = 0``, ``mu = 0``
  and ``w_N = 0`` (no sink: there is no context to refuse), with zero gradient.

  Args:
    query: [B, T, N, H] (or [T, N, H]); key: [B, S, K, H]; value: [B, S, K, Hv] (GQA
      when N % K == 0).
    bias, mask: as :func:`dot_product_attention`.
    alpha, null_bias, gamma: :func:`jaxsoft.normalizers.polar_softmax`'s parameters, each
      a scalar or per head ``[N]``; differentiable.
    magnitude_gain: ``beta`` of ``mu``, a scalar or per head ``[N]``; differentiable.
    null_value: ``v_null`` ``[Hv]`` or per head ``[N, Hv]`` (default zeros, as at ATMA's
      initialisation); differentiable.
    eps: the floor of ``||s_i||`` (> 0).
    return_parts: also return ``n_eff`` and ``w_N``.
    **kwargs: ``scale``, ``is_causal``, the sequence lengths, ``local_window_size``,
      ``segment_ids``, ``logits_soft_cap``, ``decay_bias`` and ``score``, as
      :func:`dot_product_attention` (dense computation, O(T·S) memory per head).

  Returns:
    ``(c [B, T, N, Hv] in query's dtype, mu [B, T, N])``, with ``return_parts``
    ``(c, mu, n_eff [B, T, N], w_null [B, T, N])`` (mu, n_eff and w_null in the compute
    dtype, float32 or float64). Unbatched inputs give unbatched results.

  Examples:
    Query 0 matches one key of four; query 1 matches none (all scores 0, below the null
    logit ``nu = 3 + log(2) sqrt(log 5) = 3.88``), so its weight goes to the sink:

    >>> q = jnp.array([[10.0, 0.0], [0.0, 0.0]]).reshape(1, 2, 1, 2)   # [B, T, N, H]
    >>> k = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]).reshape(1, 4, 1, 2)
    >>> v = jnp.array([[3.0, 4.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]).reshape(1, 4, 1, 2)
    >>> c, mu, n_eff, w_null = js.attention.polar_sink_attention(
    ...     q, k, v, scale=1.0, null_bias=3.0, magnitude_gain=1.0, return_parts=True)
    >>> w_null[0, :, 0].round(3)
    Array([0.   , 0.998], dtype=float32)
    >>> mu[0, :, 0]   # one match: tanh(softplus(1) log 2); none: near 0
    Array([0.7213, 0.0104], dtype=float32)
    >>> c[0, 0, 0]    # the unit direction of the matched value
    Array([0.6, 0.8], dtype=float32)

  References:
    ATMA / Polar attention (reference code kreasof-ai/atma; authors and year not
    established in this project's sources).
  """
  fn = "polar_sink_attention"
  if not isinstance(return_parts, (bool, np.bool_)):
    raise ValueError(f"{fn}: `return_parts` must be a bool, got {return_parts!r}")
  for name in ("normalizer", "normalizer_params"):
    if name in kwargs:
      raise ValueError(f"{fn}: `{name}` is fixed (the weights are polar_softmax's)")
  eps_f = _positive_eps(eps, fn)
  for name, val in (("alpha", alpha), ("null_bias", null_bias), ("gamma", gamma),
                    ("magnitude_gain", magnitude_gain)):
    v0 = _concrete(val)
    if v0 is not None and np.any(~np.isfinite(v0)):
      raise ValueError(f"{fn}: `{name}` must be finite, got {val!r}")
  unbatched = jnp.ndim(query) == 3
  heads = jnp.shape(query)[-2] if jnp.ndim(query) >= 2 else 1
  params = {name: per_head(val, heads, name, fn) for name, val in
            (("alpha", alpha), ("null_bias", null_bias), ("gamma", gamma))}
  gain = _per_head_rows(magnitude_gain, heads, "magnitude_gain", fn)
  hv = jnp.shape(value)[-1] if jnp.ndim(value) >= 1 else 0
  vnull = _null_value(null_value, heads, hv, jnp.float32, fn)  # checked before the work
  call, w, visible = dense_weights(fn, query, key, value, bias, mask,
                                   {**kwargs, "normalizer": "polar_softmax",
                                    "normalizer_params": params}, _ALLOWED)
  B, T, N, _ = call.q.shape
  K = call.k.shape[2]
  cdt = w.dtype
  gain = gain.astype(cdt)
  vnull = _null_value(null_value, N, hv, cdt, fn)

  has = jnp.any(visible, axis=-1)  # [B, N, T]
  sw = jnp.sum(w, axis=-1)
  sw2 = jnp.sum(w * w, axis=-1)
  pos = sw2 > 0
  n_eff = jnp.where(pos, sw * sw / jnp.where(pos, sw2, 1.0), 0.0)
  w_null = jnp.where(has, 1.0 - sw, 0.0)
  m_eff = n_eff * sw  # n_eff (1 - w_null) on rows with keys, 0 elsewhere
  mu = jnp.tanh(jax.nn.softplus(gain) * jnp.log1p(m_eff))

  wg = w.reshape(B, K, N // K, T, -1)
  s = jnp.einsum("bkgts,bskh->btkgh", wg, call.v.astype(cdt)).reshape(B, T, N, hv)
  s = s + jnp.transpose(w_null, (0, 2, 1))[..., None] * vnull[None, None]  # [B, T, N, Hv]
  norm = safe_distance(jnp.sum(s * s, axis=-1, keepdims=True))
  c = (s / jnp.maximum(norm, eps_f)).astype(call.q.dtype)
  parts = [c] + [jnp.transpose(a, (0, 2, 1)) for a in (mu, n_eff, w_null)]
  if unbatched:
    parts = [p[0] for p in parts]
  return tuple(parts) if return_parts else tuple(parts[:2])


def polar_memory(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                 retention_logit: ArrayLike, write_strength: ArrayLike,
                 gate_logit: ArrayLike | None = None, *,
                 retention_bias: float = RETENTION_BIAS, eps: float = 1e-6,
                 initial_state: ArrayLike | None = None, output_final_state: bool = False,
                 implementation: str | None = None, chunk_size: int = 64) -> Any:
  r"""ATMA's memory channel: a gated-delta fast-weight memory, RMS-normalised and gated (feature A20).

  The long-term recurrent compression memory of ATMA (reference code kreasof-ai/atma), with
  unit-norm queries and keys:

  .. math::
    M_t = \gamma_t M_{t-1} (I - \beta_t k_t k_t^\top) + \beta_t v_t k_t^\top, \qquad
    r_t = M_t q_t, \qquad
    \gamma_t = \mathrm{sigmoid}(\rho_t + 3.9)

  .. math::
    \mathrm{out}_t = \frac{r_t}{\sqrt{\mathrm{mean}(r_t^2) + \epsilon}} \odot
    \mathrm{sigmoid}(g_t)

  with :math:`\rho_t` the retention logit (ATMA: ``W_gamma x_t + b_gamma``; the 3.9 makes
  the initial retention about 0.98) and :math:`g_t` the output gate's logit (ATMA:
  ``W_g x_t + b_g``). This is :func:`jaxsoft.linear.gated_delta_rule` with
  ``g = log gamma``, ``scale = 1`` and ``qk_l2norm=True`` (its ``S`` is ``M^T``), so its
  chunked, recurrent and Pallas implementations all apply. In ATMA the result is
  projected by a zero-initialised ``W_mem`` and added to the attention output
  (``jaxsoft.nn.PolarMemoryAttention``). The RMS normalisation has no learned scale here
  (ATMA's is not recorded) [R].

  Properties: with ``gamma = beta = 1`` the write stores ``v_t`` exactly
  (``M_t k_t = v_t``); with ``gamma <= gamma_max < 1`` and ``beta`` in [0, 1] the state
  stays bounded, ``||M_t|| <= max_s ||v_s|| / (1 - gamma_max)``.

  Args:
    query, key: ``[B, T, N, K]``; value: ``[B, T, N, V]`` (L2-normalised inside).
    retention_logit: ``rho [B, T, N]``; ``gamma = sigmoid(rho + retention_bias)``.
    write_strength: ``beta [B, T, N]`` in [0, 1] (ATMA: a sigmoid of a projection).
    gate_logit: ``g [B, T, N, V]`` (or broadcastable), or None for no gate.
    retention_bias: added to ``rho`` (default 3.9, ATMA's).
    eps: added to the mean square of ``r_t`` (> 0).
    initial_state, output_final_state, implementation, chunk_size: as
      :func:`jaxsoft.linear.gated_delta_rule` (the state is ``M^T``, ``[B, N, K, V]``).

  Returns:
    ``out [B, T, N, V]`` in the inputs' dtype, or ``(out, final_state)``.

  Examples:
    Retention and write strength near 1: the key written at step 0 reads its value back
    at step 1 (RMS-normalised: ``(3, 4) / sqrt(12.5)``):

    >>> k = jnp.array([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    >>> v = jnp.array([[3.0, 4.0], [0.0, 0.0]]).reshape(1, 2, 1, 2)
    >>> q = jnp.array([[1.0, 0.0], [1.0, 0.0]]).reshape(1, 2, 1, 2)
    >>> out = js.attention.polar_memory(q, k, v, jnp.full((1, 2, 1), 30.0),
    ...                                 jnp.array([[[1.0], [0.0]]]))
    >>> out[0, 1, 0]
    Array([0.8485, 1.1314], dtype=float32)

  References:
    ATMA / Polar attention (reference code kreasof-ai/atma; authors and year not
    established in this project's sources).

    S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving Mamba2 with
    Delta Rule".
  """
  fn = "polar_memory"
  eps_f = _positive_eps(eps, fn)
  rb = _concrete(retention_bias)
  if rb is None or rb.size != 1 or not np.isfinite(rb).all():
    raise ValueError(f"{fn}: `retention_bias` must be a finite float, got {retention_bias!r}")
  if gate_logit is not None:
    g = jnp.asarray(gate_logit)
    out_shape = tuple(jnp.shape(query)[:-1]) + tuple(jnp.shape(value)[-1:])
    if g.ndim != len(out_shape):
      raise ValueError(f"{fn}: `gate_logit` must have rank {len(out_shape)} (no implicit rank "
                       f"promotion), got shape {g.shape}")
    try:
      jnp.broadcast_shapes(g.shape, out_shape)
    except ValueError:
      raise ValueError(f"{fn}: `gate_logit` of shape {g.shape} does not broadcast to the "
                       f"output's {out_shape}") from None
  rho = jnp.asarray(retention_logit)
  log_gamma = jax.nn.log_sigmoid(rho.astype(jnp.promote_types(rho.dtype, jnp.float32))
                                 + float(rb.reshape(())))
  res = _linear.gated_delta_rule(query, key, value, log_gamma, write_strength, scale=1.0,
                                 initial_state=initial_state,
                                 output_final_state=output_final_state,
                                 implementation=implementation, chunk_size=chunk_size,
                                 qk_l2norm=True)
  r, state = (res if output_final_state else (res, None))
  dtype = r.dtype
  rc = r.astype(jnp.promote_types(dtype, jnp.float32))
  out = rc * jax.lax.rsqrt(jnp.mean(rc * rc, axis=-1, keepdims=True) + eps_f)
  if gate_logit is not None:
    out = out * jax.nn.sigmoid(jnp.asarray(gate_logit).astype(out.dtype))
  out = out.astype(dtype)
  return (out, state) if output_final_state else out
