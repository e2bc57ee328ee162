"""Attention scores other than the scaled dot product (public inside jaxsoft).

* ``score="distance"`` (A18): the dense and chunked paths and the Pallas engine all compute
  the Euclidean distance with :func:`safe_distance`.
* ``score="neg_sq_distance"`` (A50): :func:`neg_sq_distance_terms` turns the dot-product
  logits into ``-(s/2)||q_i - k_j||^2`` through the row and column terms of the decay hook
  that every implementation already computes (:func:`with_neg_sq_distance`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers.common import compute_dtype

if TYPE_CHECKING:
  from jaxsoft.attention.call import AttentionCall

__all__ = ["safe_distance", "SCORE_NAMES", "base_score", "neg_sq_distance_terms",
           "with_neg_sq_distance"]

# Every ``score`` of dot_product_attention; "neg_sq_distance" reaches the implementations as
# "dot" plus row and column terms (with_neg_sq_distance), so AttentionCall never sees it.
SCORE_NAMES = ("dot", "distance", "neg_sq_distance")


def safe_distance(d2: ArrayLike) -> jax.Array:
  """``sqrt(max(d2, 0))`` with gradient 0 (not infinity) where ``d2 <= 0``.

  ``d2`` is a squared distance computed as ``|q|^2 + |k|^2 - 2 q·k`` (slightly negative
  after rounding when q = k). The derivative ``1 / (2 d)`` is replaced by 0 at ``d = 0``:
  the distance's gradient ``(q - k) / d`` becomes 0 there, a subgradient of the norm.

  Examples:
    >>> from jaxsoft.attention.scores import safe_distance
    >>> safe_distance(jnp.array([4.0, 0.0, -1e-7]))
    Array([2., 0., 0.], dtype=float32)
    >>> jax.grad(lambda d2: safe_distance(d2).sum())(jnp.array([4.0, 0.0]))
    Array([0.25, 0.  ], dtype=float32)
  """
  d2 = jnp.asarray(d2)
  pos = d2 > 0
  return jnp.where(pos, jnp.sqrt(jnp.where(pos, d2, 1.0)), 0.0)


def base_score(score: Any) -> str:
  """The ``score`` an :class:`~jaxsoft.attention.call.AttentionCall` is built with.

  ``"neg_sq_distance"`` is built as ``"dot"`` (:func:`with_neg_sq_distance` then adds its
  norm terms); ``"dot"`` and ``"distance"`` are themselves. Anything else is a ValueError
  listing :data:`SCORE_NAMES`.

  Examples:
    >>> from jaxsoft.attention.scores import base_score
    >>> base_score("neg_sq_distance"), base_score("distance")
    ('dot', 'distance')
  """
  if not isinstance(score, str) or score not in SCORE_NAMES:
    raise ValueError(f"`score` must be one of {SCORE_NAMES}, got {score!r}")
  return "dot" if score == "neg_sq_distance" else score


def neg_sq_distance_terms(q: ArrayLike, k: ArrayLike, scale: float | ArrayLike
                          ) -> tuple[jax.Array, jax.Array]:
  r"""The row and column terms that turn scaled dot products into ``-(s/2)||q - k||^2``.

  Norm-aware distance attention (feature A50) weights keys by a Boltzmann factor of their
  squared Euclidean distance to the query, the score dot-product attention is blind to
  key norms without. Expanding the square,

  .. math::
    -\frac{s}{2}\lVert q_i - k_j\rVert^2
      = s\, q_i \cdot k_j \;+\; c^q_i \;-\; c^k_j, \qquad
    c^q_i = -\frac{s}{2}\lVert q_i\rVert^2, \quad c^k_j = \frac{s}{2}\lVert k_j\rVert^2,

  so the distance logits are the dot-product logits plus a term per query row and a term
  per key column: the shape of Forgetting attention's decay ``cq_i - ck_j``, which every
  implementation (xla, xla_chunked, the Pallas kernels) adds to the scaled logits before
  the soft cap, with its gradients. Under softmax the row term cancels and the weights are
  ``softmax_j(s q_i·k_j - (s/2)||k_j||^2)``: the key-norm penalty that dot products drop
  (with equal key norms the two weightings coincide). Other normalizers (sigmoid, ReLU, ...)
  see the row term too, so the logits are the distances themselves (always <= 0).

  Error: computed in the compute dtype (float32; float64 for float64 inputs) with unit
  roundoff u, the logit is the difference of terms of size ``s·||q||·||k||`` and
  ``(s/2)(||q||^2 + ||k||^2)``, so its absolute error is at most about
  ``(H + 4)·u·s·(||q_i||^2 + ||k_j||^2)`` (the dot product's own error is
  ``H·u·s·||q_i||·||k_j||``, the same order for comparable norms), whatever the distance:
  the relative error of a tiny distance can be large, but softmax weights depend on the
  absolute logit error only (each weight's relative error is at most ``e^{2δ} - 1`` for a
  logit error δ).

  Args:
    q: queries [B, T, N, H].
    k: keys [B, S, K, H] (N % K == 0: query head n uses key head n // (N / K), GQA).
    scale: s, a Python float or a scalar array (differentiable).

  Returns:
    ``(cq [B, T, N], ck [B, S, N])`` in the compute dtype (float32 for bf16 / float16
    inputs): the ``decay_bias`` pair of :func:`~jaxsoft.attention.dot_product_attention`.

  Examples:
    The decay pair reproduces the distance logits exactly:

    >>> from jaxsoft.attention.scores import neg_sq_distance_terms
    >>> q = jnp.array([[[[1.0, 0.0]]]])                       # [B, T, N, H]
    >>> k = jnp.array([[[[1.0, 0.0]], [[3.0, 0.0]], [[0.0, 2.0]]]])  # [B, S, K, H]
    >>> cq, ck = neg_sq_distance_terms(q, k, 1.0)
    >>> js.attention.dense_logits(q, k, scale=1.0, decay_bias=(cq, ck))[0, 0]
    Array([[ 0. , -2. , -2.5]], dtype=float32)

  References:
    K. R. Balasubramanian, 2026, "All Routes Lead to Collapse" (arXiv 2606.22325): softmax
    attention is Boltzmann weighting over Euclidean distances only when all key norms are
    equal; its score omits the ``-||k||^2`` term.
  """
  q, k = jnp.asarray(q), jnp.asarray(k)
  if q.ndim != 4 or k.ndim != 4 or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
    raise ValueError(f"neg_sq_distance_terms: `q` [B, T, N, H] and `k` [B, S, K, H] must share "
                     f"B and H, got {q.shape} and {k.shape}")
  N, K = q.shape[2], k.shape[2]
  if K == 0 or N % K:
    raise ValueError(f"neg_sq_distance_terms: N={N} query heads must be a multiple of K={K}")
  cdt = compute_dtype(jnp.result_type(q, k))
  half = 0.5 * jnp.asarray(scale, cdt) if not isinstance(scale, float) else 0.5 * scale
  qn = jnp.sum(jnp.square(q.astype(cdt)), axis=-1)  # [B, T, N]
  kn = jnp.repeat(jnp.sum(jnp.square(k.astype(cdt)), axis=-1), N // K, axis=2)  # [B, S, N]
  return -half * qn, half * kn


def with_neg_sq_distance(call: AttentionCall) -> AttentionCall:
  """``call`` (built with ``score="dot"``) with the norm terms of ``score="neg_sq_distance"``.

  The terms of :func:`neg_sq_distance_terms` join the call's ``decay_bias`` (summed with a
  caller's decay, which then acts on the distance logits as it acts on dot products); a
  ``decay_prune_threshold`` is a ValueError (its skip bound is stated for a decay alone).

  Examples:
    >>> from jaxsoft.attention.call import AttentionCall
    >>> from jaxsoft.attention.scores import with_neg_sq_distance
    >>> call = AttentionCall.create(jnp.ones((2, 1, 4)), jnp.ones((3, 1, 4)), jnp.ones((3, 1, 4)))
    >>> with_neg_sq_distance(call).decay_bias[1].shape              # ck [B, S, N]
    (1, 3, 1)
  """
  if call.decay_prune_threshold is not None:
    raise ValueError("`decay_prune_threshold` cannot be used with score='neg_sq_distance' "
                     "(its skip bound is stated for a decay alone, not for distance logits)")
  cq, ck = neg_sq_distance_terms(call.q, call.k, call.scale)
  if call.decay_bias is not None:
    dq, dk = call.decay_bias
    cq, ck = cq + dq, ck + dk
  return dataclasses.replace(call, decay_bias=(cq, ck))
