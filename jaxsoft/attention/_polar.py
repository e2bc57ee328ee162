"""A20 Polar attention (ATMA): a unit direction times a bounded magnitude [R].

From the ATMA paper (Polar attention with a gated-delta memory; reference code by
kreasof-ai; authors and year not established). It splits attention into a count-blind
unit-vector *direction* channel and a *magnitude* channel in [0, 1] driven by the
participation ratio of the matches against a null expectation. Its exact definitions are
not established; this module is a reconstruction of the two attention channels (the memory branch is not part of it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete as _concrete
from jaxsoft.attention._dense import dense_weights
from jaxsoft.attention._parameters import per_head
from jaxsoft.attention.scores import safe_distance

__all__ = ["polar_attention"]

_ALLOWED = frozenset({
    "scale", "is_causal", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
    "segment_ids", "logits_soft_cap", "normalizer", "normalizer_params", "decay_bias", "score"})


def _per_head_rows(value, num_heads: int, name: str, fn: str):
  """A scalar or per-head ``[N]`` -> broadcastable against per-row arrays [B, N, T]."""
  v = per_head(value, num_heads, name, fn)
  return v if v.ndim == 0 else v.reshape(num_heads, 1)


def polar_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    magnitude_slope: ArrayLike = 1.0, magnitude_bias: ArrayLike = 0.0,
                    eps: float = 1e-6, return_parts: bool = False, **kwargs: Any) -> Any:
  r"""Polar attention: a unit direction times a bounded magnitude (feature A20) [R].

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
  ATMA paper corrects it with an extreme-value null sink; that correction is not
  reconstructed here). So ``m`` is ``sigma(b)`` for uniform weights (no match) and
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
  try:
    eps_f = float(eps)
  except TypeError:
    raise ValueError(f"{fn}: `eps` must be a float > 0, got {eps!r}") from None
  if not eps_f > 0:
    raise ValueError(f"{fn}: `eps` must be > 0, got {eps!r}")
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
