"""Multiscreen screening attention (feature A19): keys screened against an absolute threshold.

Cosine similarities screened by the N38 ``multiscreen`` normalizer in the attention slot
of :func:`dot_product_attention`: no competition between keys, no unit mass. A
reconstruction from its paper.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.attention._api import dot_product_attention
from jaxsoft.attention._checks import check_rank
from jaxsoft.attention._parameters import per_head
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["multiscreen_attention"]


def multiscreen_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                          bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                          theta: ArrayLike = 0.0, power: ArrayLike = 1.0, eps: float = 1e-6,
                          **kwargs: Any) -> jax.Array:
  r"""Multiscreen screening attention: keys kept by a threshold on cosine similarity (A19) [R].

  From K. M. Nakanishi's "Screening Is Enough" (2026): each key is judged
  against an explicit threshold on a *bounded* query-key similarity; keys below it are
  discarded and the rest aggregated, with no competition between keys and no unit mass to
  redistribute. The paper's exact map is not established; this is the reconstruction:

  .. math::
    s_{ij} = \frac{q_i \cdot k_j}{\|q_i\|\,\|k_j\|} \in [-1, 1], \qquad
    w_{ij} = \mathrm{clip}\Big(\frac{s_{ij} - \theta}{1 - \theta}, 0, 1\Big)^{p}, \qquad
    o_i = \sum_{j \in V_i} w_{ij}\, v_j

  i.e. :func:`dot_product_attention` with unit-norm queries and keys, ``scale=1`` and the
  N38 ``multiscreen`` normalizer in the attention slot. Weights lie in [0, 1]; a key below
  the threshold has weight exactly 0, so appending such keys leaves the output unchanged
  (softmax fails this) and a query with no key above it outputs 0. No normalisation by
  the other keys' weights is applied (the paper may use one that does not involve them).

  Args:
    query: [B, T, N, H]; key: [B, S, K, H]; value: [B, S, K, Hv] (GQA when N % K == 0).
    bias, mask: as :func:`dot_product_attention` (a bias is added to the cosine
      similarity; similarities above 1 then count as 1).
    theta: the threshold in [-1, 1), a scalar or per head ``[N]``; differentiable.
    power: the sharpness p > 0, a scalar or per head ``[N]``.
    eps: the floor of the norms (a zero query or key has similarity 0 with everything).
    **kwargs: the other arguments of :func:`dot_product_attention` (``is_causal``, the
      sequence lengths, ``local_window_size``, ``segment_ids``, ``implementation``, ...),
      except ``scale``, ``normalizer`` and ``normalizer_params``, which this fixes.

  Returns:
    [B, T, N, Hv] in query's dtype.

  Examples:
    One query over keys at cosine 1, 0.6 and 0 with ``theta = 0.5``: weights 1, 0.2 and
    exactly 0 (one-hot values show them); with only the screened-out key the output is 0.

    >>> q = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)                      # [B, T, N, H]
    >>> k = jnp.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]]).reshape(1, 3, 1, 2)
    >>> v = jnp.eye(3).reshape(1, 3, 1, 3)
    >>> js.attention.multiscreen_attention(q, k, v, theta=0.5)[0, 0, 0]
    Array([1. , 0.2, 0. ], dtype=float32)
    >>> js.attention.multiscreen_attention(q, k[:, 2:], v[:, 2:], theta=0.5)[0, 0, 0]
    Array([0., 0., 0.], dtype=float32)

  References:
    K. M. Nakanishi, 2026, "Screening Is Enough" (arXiv 2604.01178).
  """
  fn = "multiscreen_attention"
  for name in ("scale", "normalizer", "normalizer_params", "logits_soft_cap"):
    if name in kwargs:
      raise ValueError(f"{fn}: `{name}` is fixed by the screening rule and cannot be passed")
  q = check_rank(query, "query", 4, "[B, T, N, H]", fn)
  k = check_rank(key, "key", 4, "[B, S, K, H]", fn)
  if not float(eps) > 0:
    raise ValueError(f"{fn}: `eps` must be > 0, got {eps!r}")
  n_heads = q.shape[2]
  th = concrete(theta)
  if th is not None and (np.any(~np.isfinite(th)) or np.any(th < -1) or np.any(th >= 1)):
    raise ValueError(f"{fn}: `theta` must be in [-1, 1), got {theta!r}")
  pw = concrete(power)
  if pw is not None and (np.any(~np.isfinite(pw)) or np.any(pw <= 0)):
    raise ValueError(f"{fn}: `power` must be finite and > 0, got {power!r}")
  params = {"theta": per_head(theta, n_heads, "theta", fn),
            "power": per_head(power, n_heads, "power", fn)}
  out_dtype = q.dtype if jnp.issubdtype(q.dtype, jnp.floating) else jnp.float32
  cdt = compute_dtype(jnp.promote_types(q.dtype, k.dtype))

  def unit(x):
    x = x.astype(cdt)
    return x * lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), eps * eps))

  out = dot_product_attention(unit(q), unit(k), value, bias, mask, scale=1.0,
                              normalizer="multiscreen", normalizer_params=params, **kwargs)
  return out.astype(out_dtype)
