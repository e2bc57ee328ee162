"""Forgetting attention (feature A08; FoX) and its adaptive computation pruning (ACP).

:func:`forget_gate_decay` turns per-token forget gates into the rank-1 decay bias
``D_ij = c_i - c_j`` of :func:`dot_product_attention`; :func:`forgetting_attention` is
causal attention with it; :func:`acp_prune_threshold` is the decay below which every
weight is provably below ``epsilon``, so whole key blocks can be skipped.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.attention._api import dot_product_attention
from jaxsoft.normalizers import common as c

__all__ = ["forget_gate_decay", "forgetting_attention", "acp_prune_threshold"]


def forget_gate_decay(log_f: ArrayLike) -> tuple[jax.Array, jax.Array]:
  r"""The Forgetting-attention decay bias ``(cq, ck)`` from forget gates (feature A08).

  The form ``dot_product_attention(decay_bias=(cq, ck))`` takes (a rank-1 bias, never a
  T x S array).

  With per-token, per-head log forget gates :math:`\log f_t = \log\sigma(w_f^\top x_t + b_f)
  \le 0` and their cumulative sum :math:`c_t = \sum_{l \le t} \log f_l`,

  .. math:: D_{ij} = \sum_{l=j+1}^{i} \log f_l = c_i - c_j \quad (j \le i)

  is added to the scaled logits (Lin et al., ICLR 2025): ``cq = ck = c``. ``D_ij <= 0`` and
  decreases as ``j`` moves into the past; ``f = 1`` gives plain causal attention and a
  constant ``f`` an ALiBi slope of ``-log f``. Only ``j <= i`` is meaningful: use it with
  causal attention. The cumulative sum is taken in float32 (float64 for float64 input);
  ``c_i - c_j`` then carries an absolute error of about ``eps·|c_T|``.

  Args:
    log_f: ``[B, T, N]`` log forget gates (e.g. ``jax.nn.log_sigmoid(gate_logits)``).

  Returns:
    ``(cq, ck)``, both ``[B, T, N]``.

  Examples:
    Every gate at 1/2: the bias halves a key's weight for each step it lies in the past.

    >>> log_f = jnp.log(jnp.full((1, 4, 1), 0.5))   # [B, T, N]
    >>> cq, ck = js.attention.forget_gate_decay(log_f)
    >>> cq[0, 3, 0] - ck[0, :, 0]   # D_3j for j = 0..3
    Array([-2.0794, -1.3863, -0.6931,  0.    ], dtype=float32)

  References:
    Z. Lin, E. Nikishin, X. O. He & A. Courville, 2025, "Forgetting Transformer: Softmax
    Attention with a Forget Gate" (ICLR 2025, arXiv 2503.02130).
  """
  lf = jnp.asarray(log_f)
  if lf.ndim != 3:
    raise ValueError(f"forget_gate_decay: `log_f` must have shape [B, T, N], got {lf.shape}")
  cum = jnp.cumsum(lf.astype(c.compute_dtype(lf.dtype)), axis=1)
  return cum, cum


def acp_prune_threshold(q: ArrayLike, k: ArrayLike, *, epsilon: float,
                        scale: float | None = None) -> jax.Array:
  r"""The ACP threshold: a decay below which every FoX weight is below ``epsilon`` (A08).

  Adaptive computation pruning (ACP, Lin et al. 2025) skips the (i, j) pairs whose decay
  :math:`D_{ij}` is so negative that their weight is negligible. With the scaled logits
  :math:`s_{ij}` bounded by :math:`|s_{ij}| \le U`, softmax weights satisfy

  .. math::
    a_{ij} = \frac{e^{s_{ij} + D_{ij}}}{\sum_l e^{s_{il} + D_{il}}}
      \le e^{s_{ij} + D_{ij} - s_{ii} - D_{ii}} \le e^{2U + D_{ij}}

  (the denominator holds the diagonal term, with :math:`D_{ii} = 0`), so
  :math:`D_{ij} < \log\epsilon - 2U \Rightarrow a_{ij} < \epsilon`. Here
  :math:`U = \text{scale} \cdot \max_i \lVert q_i \rVert \cdot \max_j \lVert k_j \rVert`
  (Cauchy-Schwarz), one bound over the whole batch. Since :math:`D_{ij}` only decreases
  as ``j`` moves into the past, the pruned pairs of a row form a prefix, so a blockwise
  kernel skips whole key blocks. Dropping pruned weights of total mass ``P`` and
  renormalising changes an output by at most ``2 P max|v|``, so with at most ``S`` pruned
  keys per row the error is below ``2 S epsilon max|v|``. The bound needs the diagonal
  (self-attention, causal, the query's own key visible) and the softmax normalizer.

  Args:
    q: ``[B, T, N, H]``; k: ``[B, S, K, H]``.
    epsilon: the weight bound, in (0, 1).
    scale: the logit scale (default ``1/sqrt(H)``).

  Returns:
    A scalar threshold (float32) for ``forgetting_attention(prune_threshold=...)``; it is
    a function of ``q`` and ``k`` but carries no gradient. The chunked path builds its
    block skip table from a concrete float, so compute it outside ``jit`` (e.g. once from
    a representative batch, or from a static bound ``U`` as ``log(eps) - 2U``).

  Examples:
    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k = jnp.cos(q)
    >>> thr = js.attention.acp_prune_threshold(q, k, epsilon=1e-3)
    >>> bool(thr < jnp.log(1e-3))   # log(eps) - 2U, below log(eps)
    True

  References:
    Z. Lin et al., 2025, "Adaptive Computation Pruning for the Forgetting Transformer"
    (arXiv 2504.06949).
  """
  if not 0.0 < float(epsilon) < 1.0:
    raise ValueError(f"acp_prune_threshold: `epsilon` must be in (0, 1), got {epsilon}")
  q = jnp.asarray(q)
  k = jnp.asarray(k)
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  cdt = c.compute_dtype(jnp.result_type(q.dtype, k.dtype))
  qn = jnp.max(jnp.linalg.norm(q.astype(cdt), axis=-1))
  kn = jnp.max(jnp.linalg.norm(k.astype(cdt), axis=-1))
  u = jnp.abs(jnp.asarray(scale, cdt)) * qn * kn
  return jax.lax.stop_gradient(math.log(epsilon) - 2.0 * u)


def forgetting_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, log_f: ArrayLike, *,
                         prune_threshold: float | None = None, is_causal: bool = True,
                         **kwargs: Any) -> jax.Array:
  r"""Forgetting attention (FoX): causal attention with a forget-gate decay (feature A08).

  .. math::
    o_i = \sum_{j \le i} \frac{e^{s_{ij} + D_{ij}}}{\sum_{l \le i} e^{s_{il} + D_{il}}} v_j,
    \qquad D_{ij} = \sum_{l=j+1}^{i} \log f_l

  (Z. Lin, E. Nikishin, X. O. He & A. Courville, "Forgetting Transformer: Softmax
  Attention with a Forget Gate", ICLR 2025, arXiv 2503.02130), computed by
  :func:`dot_product_attention` with ``decay_bias=forget_gate_decay(log_f)``: a rank-1
  structured bias, so the chunked and Pallas paths never materialise ``D``.

  ``prune_threshold`` turns on adaptive computation pruning (ACP; Z. Lin et al. 2025,
  "Adaptive Computation Pruning for the Forgetting Transformer", arXiv 2504.06949): key
  blocks whose decay is below the threshold for every pair are skipped
  (``decay_prune_threshold``). With the threshold of :func:`acp_prune_threshold`
  (``log eps - 2U``, ``U`` a bound on ``|s_ij|``) every skipped weight is below ``eps``
  and each output moves by less than ``2 S eps max|v|``; a very negative threshold prunes
  nothing.

  Args:
    q, k, v: ``[B, T, N, H]``, ``[B, T, K, H]``, ``[B, T, K, H]`` (self-attention: the
      gates belong to the tokens, so queries and keys are the same sequence).
    log_f: ``[B, T, N]`` log forget gates (``<= 0``), one per query head.
    prune_threshold: optional concrete float ``< 0``, the decay threshold of ACP (used by
      the ``"xla_chunked"`` path; the dense path computes every pair); ``None`` prunes
      nothing.
    is_causal: default True (the decay is defined for ``j <= i`` only).
    **kwargs: any other argument of :func:`dot_product_attention` (mask, segment_ids,
      normalizer, implementation, ...).

  Returns:
    ``[B, T, N, H]`` in ``q``'s dtype.

  Examples:
    Gates of 1 (``log_f = 0``) forget nothing: plain causal attention.

    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k, v = jnp.cos(q), q
    >>> out = js.attention.forgetting_attention(q, k, v, jnp.zeros((1, 4, 2)))
    >>> out.shape
    (1, 4, 2, 8)
    >>> bool(jnp.allclose(out, js.attention.dot_product_attention(q, k, v, is_causal=True),
    ...                   atol=1e-6))
    True

  References:
    Z. Lin, E. Nikishin, X. O. He & A. Courville, 2025, "Forgetting Transformer: Softmax
    Attention with a Forget Gate" (ICLR 2025, arXiv 2503.02130).

    Z. Lin et al., 2025, "Adaptive Computation Pruning for the Forgetting Transformer"
    (arXiv 2504.06949).
  """
  fn_name = "forgetting_attention"
  for bad in ("decay_bias", "decay_prune_threshold"):
    if bad in kwargs:
      raise ValueError(f"{fn_name}: `{bad}` is set from `log_f` / `prune_threshold`")
  q = jnp.asarray(q)
  k = jnp.asarray(k)
  lf = jnp.asarray(log_f)
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"{fn_name}: `q` and `k` must be [B, T, N, H], got {q.shape}, {k.shape}")
  if q.shape[1] != k.shape[1]:
    raise ValueError(
        f"{fn_name}: forget gates need self-attention (`q` and `k` of the same length), got "
        f"T={q.shape[1]} and S={k.shape[1]}")
  if lf.shape != q.shape[:3]:
    raise ValueError(
        f"{fn_name}: `log_f` must have shape [B, T, N] = {q.shape[:3]}, got {lf.shape}")
  cq, ck = forget_gate_decay(lf)
  return dot_product_attention(
      q, k, v, is_causal=is_causal, decay_bias=(cq, ck),
      decay_prune_threshold=prune_threshold, **kwargs)
