"""N39 tropical (max-plus) aggregation and its log-sum-exp smoothing (for A16 tropical attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c

__all__ = ["tropical_max_plus", "tropical_hilbert_scores"]


def tropical_max_plus(scores: ArrayLike, values: ArrayLike, where: ArrayLike | None = None, *,
                      eps: float = 0.0) -> jax.Array:
  r"""Max-plus aggregation of values by scores (feature N39, kernel class X).

  From Hashemi, Pasque, Teska, Yoshida, "Tropical Attention: Neural Algorithmic Reasoning
  for Combinatorial Algorithms" (2025): attention in the max-plus semiring replaces the
  softmax-weighted sum by

  .. math::
    o_{i,r} = \max_{j \in V_i} (S_{ij} + v_{j,r}), \qquad
    o^{\epsilon}_{i,r} = \epsilon \log \sum_{j \in V_i} e^{(S_{ij} + v_{j,r})/\epsilon}
    \ \ (\epsilon > 0),

  the second being the smooth LSE_eps version (the reference code's "temperature" tau is
  1/eps), with ``max <= o^eps <= max + eps log n``, so it tends to the max as eps -> 0.
  There is no normalisation, hence no dilution: keys whose ``S_ij + v_j`` is dominated do
  not change the hard output however many there are; ``o`` is translation equivariant
  (``v + c`` or ``S + c`` gives ``o + c``), monotone and 1-Lipschitz in the sup norm.
  The smooth version's weights ``softmax((S_i + v_{:,r})/eps)`` are per output channel,
  so the whole ``[..., T, S, H]`` sum is formed (no ``T x S`` weight matrix suffices).

  Args:
    scores: ``S`` of shape ``[..., T, S]`` (e.g. :func:`tropical_hilbert_scores`).
    values: ``v`` of shape ``[..., S, H]`` (leading dims broadcast against ``scores``'s).
    where: optional boolean mask broadcastable to ``scores``; False keys are left out.
    eps: smoothing eps >= 0; 0 is the hard max-plus product.

  Returns:
    ``o`` of shape ``[..., T, H]`` in the promoted dtype of the inputs (computed in float32
    for low-precision inputs); a query row with no visible key gives 0, with zero gradient.

  Examples:
    >>> s = jnp.array([[0.0, -1.0, -5.0]])
    >>> v = jnp.array([[1.0], [3.0], [0.0]])
    >>> js.normalizers.tropical_max_plus(s, v)  # max(0 + 1, -1 + 3, -5 + 0)
    Array([[2.]], dtype=float32)
    >>> js.normalizers.tropical_max_plus(s, v, eps=0.01)
    Array([[2.]], dtype=float32)

  References:
    Hashemi, Pasque, Teska & Yoshida, 2025, "Tropical Attention: Neural Algorithmic
    Reasoning for Combinatorial Algorithms".
  """
  name = "tropical_max_plus"
  s = jnp.asarray(scores)
  v = jnp.asarray(values)
  if s.ndim < 2 or v.ndim < 2:
    raise ValueError(f"{name}: `scores` [..., T, S] and `values` [..., S, H] need rank >= 2, "
                     f"got {s.shape} and {v.shape}")
  if s.shape[-1] != v.shape[-2]:
    raise ValueError(f"{name}: `scores` has {s.shape[-1]} keys but `values` has "
                     f"{v.shape[-2]} (shapes {s.shape} and {v.shape})")
  try:
    eps_f = float(eps)
  except TypeError:
    raise ValueError(f"{name}: `eps` must be a Python number, got {eps!r}") from None
  if not eps_f >= 0.0:
    raise ValueError(f"{name}: `eps` must be >= 0, got {eps!r}")
  out_dtype = c.output_dtype(jnp.result_type(s.dtype, v.dtype))
  cdt = c.compute_dtype(out_dtype)
  s, v = s.astype(cdt), v.astype(cdt)
  mask = s > -jnp.inf
  if where is not None:
    try:
      mask = mask & jnp.broadcast_to(jnp.asarray(where, bool), s.shape)
    except ValueError:
      raise ValueError(f"{name}: `where` of shape {jnp.shape(where)} does not broadcast to "
                       f"`scores` {s.shape}") from None
  # masked keys hold a finite value of their row (no NaN in any branch or gradient)
  s = jnp.where(mask, s, c.masked_max(s, mask, s.ndim - 1))
  a = s[..., :, :, None] + v[..., None, :, :]  # [..., T, S, H]
  vis = mask[..., :, :, None]
  top = jnp.max(jnp.where(vis, a, -jnp.inf), axis=-2)  # [..., T, H]
  any_vis = jnp.any(mask, axis=-1)[..., None]
  if eps_f == 0.0:
    out = top
  else:
    m = jax.lax.stop_gradient(jnp.where(any_vis, top, 0.0))
    e = jnp.where(vis, jnp.exp((a - m[..., None, :]) / eps_f), 0.0)
    total = jnp.sum(e, axis=-2)
    out = m + eps_f * jnp.log(jnp.where(any_vis, total, 1.0))
  return jnp.where(any_vis, out, 0.0).astype(out_dtype)


def tropical_hilbert_scores(q: ArrayLike, k: ArrayLike) -> jax.Array:
  r"""Scores ``S_ij = -d_H(q_i, k_j)`` of tropical attention (Hashemi et al. 2025).

  .. math::
    d_H(a, b) = \max_r (a_r - b_r) - \min_r (a_r - b_r),

  the tropical Hilbert projective metric: non-negative, symmetric, with the triangle
  inequality, and ``d_H(a, b + c 1) = 0`` for b = a (projective invariance).

  Args:
    q: ``[..., T, H]``.
    k: ``[..., S, H]``.

  Returns:
    ``[..., T, S]``.

  Examples:
    >>> q = jnp.array([[0.0, 1.0, 2.0]])
    >>> k = jnp.array([[5.0, 6.0, 7.0], [0.0, 0.0, 0.0]])  # q + 5; flat
    >>> js.normalizers.tropical_hilbert_scores(q, k)  # distance 0 to q + c 1
    Array([[-0., -2.]], dtype=float32)

  References:
    Hashemi, Pasque, Teska & Yoshida, 2025, "Tropical Attention: Neural Algorithmic
    Reasoning for Combinatorial Algorithms".
  """
  q, k = jnp.asarray(q), jnp.asarray(k)
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"tropical_hilbert_scores: `q` and `k` need the same last dimension, "
                     f"got {q.shape} and {k.shape}")
  d = q[..., :, None, :] - k[..., None, :, :]
  return -(jnp.max(d, axis=-1) - jnp.min(d, axis=-1))
