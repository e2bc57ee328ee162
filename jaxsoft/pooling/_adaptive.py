"""Adaptive attention pooling as a signal-optimal vector quantiser (A53).

Pooling a set ``x [..., N, d]`` in which a subset carries the signal and the rest are
distractors: :func:`adaptive_attention_pool` (one query, any normalizer), the quantiser it
approximates (:func:`signal_optimal_pool`, the signal centroid), the loss it is judged by
(:func:`signal_loss`), the error bound of softmax pooling (:func:`adaptive_pool_error_bound`)
and the oracle query for two-cluster data (:func:`snr_oracle_query`).

References:
  G. Brothers, 2025, "Robust Noise Attenuation via Adaptive Pooling of Transformer Outputs".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import spec as _spec
from jaxsoft.pooling import _contract as u
from jaxsoft.pooling._sets import _tokens_like

__all__ = ["adaptive_attention_pool", "signal_optimal_pool", "signal_loss",
           "adaptive_pool_error_bound", "snr_oracle_query"]

def _batch_query(query, batch_shape, dk: int, name: str, dtype):
  q = jnp.asarray(query)
  want = tuple(batch_shape) + (dk,)
  if q.ndim == 0 or q.shape[-1] != dk:
    raise ValueError(f"{name}: `query` of shape {q.shape} must end in the key width {dk}")
  try:
    return jnp.broadcast_to(q.astype(dtype), want)
  except ValueError:
    raise ValueError(f"{name}: `query` of shape {q.shape} does not broadcast to {want} (the "
                     "shape of the keys without the token axis)") from None


def adaptive_attention_pool(
    x: ArrayLike, axis: int = -2, where: ArrayLike | None = None, *, query: ArrayLike,
    keys: ArrayLike | None = None, values: ArrayLike | None = None,
    normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
    normalizer_params: Mapping[str, Any] | None = None, scale: float | None = None,
    keepdims: bool = False) -> jax.Array:
  r"""Adaptive (attention) pooling: a set pooled by one query, any normalizer in the slot.

  For a set ``x`` ``[..., N, d]`` (features last), keys ``K`` and values ``V`` (both
  default ``x``; pass projections for the PMA-style layer) and one query ``q``:

  .. math::
    a = f\Big(\frac{q K^\top}{\sqrt{d_k}}\Big), \qquad z = a V = \sum_i a_i v_i

  with ``f`` the normalizer over the visible tokens (softmax by default: AdaPool of
  Brothers 2025, the pooling-by-multihead-attention of the Set Transformer with one seed).
  Framed as a vector quantiser, :math:`z` approximates the signal centroid
  :func:`signal_optimal_pool`; with softmax the error obeys
  :func:`adaptive_pool_error_bound`. A zero query gives uniform weights: AvgPool.

  Args:
    x: the set ``[..., N, d]``.
    axis: the token axis (not the last).
    where: optional token mask broadcastable to ``x.shape[:-1]``; False tokens are left
      out exactly, as if deleted (padding).
    query: ``[d_k]`` (one learned query for every set) or ``[..., d_k]``, broadcast to the
      keys' shape without the token axis.
    keys: optional ``[..., N, d_k]`` laid out as ``x``; default ``x``.
    values: optional ``[..., N, d_v]`` laid out as ``x``; default ``x``.
    normalizer: a registered name, a NormalizerSpec or a callable
      ``f(scores, axis=-1, where=mask, **params)``.
    normalizer_params: the normalizer's hyperparameters (e.g. ``{"alpha": 1.5}``).
    scale: the score scale > 0, default ``1/sqrt(d_k)``.
    keepdims: keep the token axis with size 1.

  Returns:
    ``[..., d_v]`` in ``x``'s dtype (bf16/fp16 computed in float32); 0, with zero
    gradient, for a set with no visible token.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([[2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    >>> pooling.adaptive_attention_pool(x, query=jnp.zeros(2))   # uniform: AvgPool
    Array([1.3333, 1.3333], dtype=float32)
    >>> pooling.adaptive_attention_pool(x, query=jnp.array([8.0, -8.0]))  # token 0 wins
    Array([2.0000e+00, 2.4409e-05], dtype=float32)
    >>> pooling.adaptive_attention_pool(x, query=jnp.array([1.0, 0.0]),
    ...                                 normalizer="sparsemax")  # tokens 0 and 2, half each
    Array([2., 1.], dtype=float32)

  References:
    G. Brothers, 2025, "Robust Noise Attenuation via Adaptive Pooling of Transformer
    Outputs".

    J. Lee, Y. Lee, J. Kim, A. R. Kosiorek, S. Choi & Y. W. Teh, 2019, "Set Transformer: A
    Framework for Attention-based Permutation-Invariant Neural Networks".
  """
  name = "adaptive_attention_pool"
  u.check_bool(keepdims, "keepdims", name)
  if scale is not None:
    u.check_range(scale, "scale", name, low=0.0, low_open=True)
  fn = _spec.resolve(normalizer)
  params = dict(normalizer_params or {})
  if isinstance(fn, _spec.NormalizerSpec):
    fn.validate(params)
  x = jnp.asarray(x)
  xs, mask, ax = u.prepare_sets(x, axis, where, name)
  ks = xs if keys is None else jnp.where(
      mask[..., None], _tokens_like(keys, "keys", x.shape, ax, name, xs.dtype), 0.0)
  vs = xs if values is None else jnp.where(
      mask[..., None], _tokens_like(values, "values", x.shape, ax, name, xs.dtype), 0.0)
  dk = ks.shape[-1]
  q = _batch_query(query, ks.shape[:-2], dk, name, xs.dtype)
  s = (1.0 / math.sqrt(dk)) if scale is None else scale
  scores = jnp.einsum("...d,...nd->...n", q, ks) * jnp.asarray(s, xs.dtype)
  a = fn(jnp.where(mask, scores, 0.0), axis=-1, where=mask, **params)
  a = jnp.where(mask, a, 0.0).astype(xs.dtype)
  out = jnp.einsum("...n,...nd->...d", a, vs)
  out = jnp.where(jnp.any(mask, -1, keepdims=True), out, 0.0)
  return u.sets_out(out, ax, x.ndim, keepdims, x.dtype)


def _signal_masks(x, signal, axis, where,
                  name) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, int]:
  """(x as an array, xs [..., N, d], visible [..., N], signal-and-visible [..., N], ax)."""
  x = jnp.asarray(x)
  xs, mask, ax = u.prepare_sets(x, axis, where, name)
  sig = jnp.asarray(signal)
  try:
    sig = jnp.broadcast_to(sig, x.shape[:-1]).astype(bool)
  except ValueError:
    raise ValueError(f"{name}: `signal` of shape {sig.shape} does not broadcast to the token "
                     f"shape {tuple(x.shape[:-1])} of `x`") from None
  sig = jnp.logical_and(jnp.moveaxis(sig, ax, -1), mask)
  return x, xs, mask, sig, ax


def _signal_centroid(xs, sig):
  r""":math:`C^* = \frac1k \sum_{i \in S} x_i` of ``xs [..., N, d]`` over the signal mask
  ``sig [..., N]`` (0 for no signal vector)."""
  return jnp.einsum("...n,...nd->...d", u.mean_weights(sig, -1, xs.dtype), xs)


def _without_axis(a, want, arg: str, axis_name: str, name: str):
  """``a`` as an array, checked to have the shape ``want`` of ``x`` without one axis."""
  a = jnp.asarray(a)
  if a.shape != tuple(want):
    raise ValueError(f"{name}: `{arg}` of shape {a.shape} must be {tuple(want)} (the shape of "
                     f"`x` without the {axis_name} axis)")
  return a


def signal_optimal_pool(x: ArrayLike, signal: ArrayLike, axis: int = -2,
                        where: ArrayLike | None = None, *, keepdims: bool = False) -> jax.Array:
  r"""The signal-optimal vector quantiser: the centroid of the signal vectors.

  .. math:: C^*(X) = \frac{1}{k}\sum_{i \in S} x_i = \arg\min_z L(X_S, z)

  the minimiser of the signal loss :func:`signal_loss` (weights 1/k on the k signal
  vectors, 0 on the distractors). AvgPool equals it only without distractors.

  Args:
    x: the set ``[..., N, d]``.
    signal: bool mask of the signal tokens, broadcastable to ``x.shape[:-1]``.
    axis: the token axis (not the last).
    where: optional visibility mask (padding) as in :func:`adaptive_attention_pool`.
    keepdims: keep the token axis with size 1.

  Returns:
    ``[..., d]`` in ``x``'s dtype; 0 for a set with no visible signal vector.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([[1.0, 0.0], [3.0, 2.0], [9.0, 9.0]])
    >>> pooling.signal_optimal_pool(x, jnp.array([True, True, False]))
    Array([2., 1.], dtype=float32)

  References:
    G. Brothers, 2025, "Robust Noise Attenuation via Adaptive Pooling of Transformer
    Outputs": the quantiser adaptive pooling approximates.
  """
  name = "signal_optimal_pool"
  u.check_bool(keepdims, "keepdims", name)
  x, xs, _, sig, ax = _signal_masks(x, signal, axis, where, name)
  return u.sets_out(_signal_centroid(xs, sig), ax, x.ndim, keepdims, x.dtype)


def signal_loss(z: ArrayLike, x: ArrayLike, signal: ArrayLike, axis: int = -2,
                where: ArrayLike | None = None) -> jax.Array:
  r"""The signal loss of a pooled vector: its mean squared distance to the signal vectors.

  .. math::
    L(X_S, z) = \frac{1}{k}\sum_{i \in S} \lVert x_i - z\rVert^2
      = L(X_S, C^*) + \lVert z - C^*\rVert^2

  (the second form: the bias-variance split around the centroid :math:`C^*`, so the
  excess loss of a pool is its squared distance to :func:`signal_optimal_pool`).

  Args:
    z: pooled vectors ``[..., d]`` (``x``'s shape without the token axis).
    x: the set ``[..., N, d]``.
    signal: bool mask of the signal tokens, broadcastable to ``x.shape[:-1]``.
    axis: the token axis of ``x`` (not the last).
    where: optional visibility mask (padding).

  Returns:
    ``[...]`` in the compute dtype of ``x`` (float32 for bf16); 0 for a set with no
    visible signal vector.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([[1.0, 0.0], [3.0, 2.0], [9.0, 9.0]])
    >>> sig = jnp.array([True, True, False])
    >>> pooling.signal_loss(jnp.array([2.0, 1.0]), x, sig)   # at the centroid: the spread
    Array(2., dtype=float32)
    >>> pooling.signal_loss(x.mean(0), x, sig)                # AvgPool: 2 + |bias|^2
    Array(14.5556, dtype=float32)

  References:
    G. Brothers, 2025, "Robust Noise Attenuation via Adaptive Pooling of Transformer
    Outputs": the loss pooling is judged by.
  """
  name = "signal_loss"
  _, xs, _, sig, _ = _signal_masks(x, signal, axis, where, name)
  zz = _without_axis(z, xs.shape[:-2] + xs.shape[-1:], "z", "token", name)
  d2 = jnp.sum(jnp.square(xs - zz.astype(xs.dtype)[..., None, :]), -1)
  w = u.mean_weights(sig, -1, xs.dtype)
  return jnp.sum(w * d2, -1)


def adaptive_pool_error_bound(scores: ArrayLike, x: ArrayLike, signal: ArrayLike,
                              axis: int = -2, where: ArrayLike | None = None) -> jax.Array:
  r"""A bound on the distance of softmax pooling from the signal centroid [R].

  For softmax weights :math:`a = \mathrm{softmax}(s)` over a set with k signal vectors S
  and m distractors :math:`\eta`, the pool :math:`z = \sum_i a_i x_i` and the centroid
  :math:`C^* = \frac1k\sum_S x_i` satisfy

  .. math::
    \lVert z - C^*\rVert \le \min\Big((e^{\delta} - 1)\,\frac1k\sum_{i\in S}\lVert x_i - C^*\rVert,
      \ \max_{i\in S}\lVert x_i - C^*\rVert\Big)
      + \frac{m}{m + k\,e^{\Delta}}\,\max_{j\in\eta}\lVert x_j - C^*\rVert

  with :math:`\delta = \max_S s - \min_S s` (the spread of the signal scores) and
  :math:`\Delta = \min_S s - \max_\eta s` (the margin of signal over distractors). The
  second factor bounds the attention mass on the distractors at any SNR = k/(k + m):
  the bound goes to 0 as the margin grows and the signal scores agree, which a query
  aligned with :math:`\mu_s - \mu_n` (:func:`snr_oracle_query`) achieves. The first term
  is the price of a sharp query on noisy signal vectors: the weights tilt towards the
  signal vectors that score highest.

  [R] The paper derives error bounds of this kind for softmax attention pooling; its exact
  statement is not reproduced here. This one follows from
  :math:`z - C^* = (1-\varepsilon)\sum_S (p_i - \tfrac1k)(x_i - C^*) + \sum_\eta a_j (x_j - C^*)`,
  with :math:`\varepsilon` the distractor mass, :math:`p` the softmax over S alone
  (:math:`|p_i - 1/k| \le (e^\delta - 1)/k`; and since :math:`\sum_S (x_i - C^*) = 0` the
  first sum is :math:`\sum_S p_i (x_i - C^*)`, at most the largest distance) and
  :math:`\varepsilon \le m e^{\max_\eta s}/(m e^{\max_\eta s} + k e^{\min_S s})`.

  Args:
    scores: ``[..., N]`` the pooling scores (``x``'s token shape, token axis ``axis``).
    x: the set ``[..., N, d]`` (the values).
    signal: bool mask of the signal tokens, broadcastable to ``x.shape[:-1]``.
    axis: the token axis of ``x`` (not the last).
    where: optional visibility mask (padding).

  Returns:
    ``[...]`` the bound (compute dtype of ``x``); 0 where no distractor and equal signal
    scores; ``+inf`` for a set with no visible signal vector (no centroid).

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([[1.0, 0.0], [1.0, 0.2], [-1.0, 0.0]])
    >>> sig = jnp.array([True, True, False])
    >>> pooling.adaptive_pool_error_bound(jnp.array([4.0, 4.0, -4.0]), x, sig)
    Array(0.0003, dtype=float32)

  References:
    G. Brothers, 2025, "Robust Noise Attenuation via Adaptive Pooling of Transformer
    Outputs": the paper's bound, in the form reconstructed here.
  """
  name = "adaptive_pool_error_bound"
  x, xs, mask, sig, ax = _signal_masks(x, signal, axis, where, name)
  s = _without_axis(scores, x.shape[:-1], "scores", "feature", name)
  s = jnp.moveaxis(s.astype(xs.dtype), ax, -1)
  noise = jnp.logical_and(mask, jnp.logical_not(sig))
  k = jnp.sum(sig, -1).astype(xs.dtype)
  m = jnp.sum(noise, -1).astype(xs.dtype)
  cen = _signal_centroid(xs, sig)
  dist = jnp.sqrt(jnp.sum(jnp.square(xs - cen[..., None, :]), -1))
  neg, pos = -jnp.inf, jnp.inf
  s_max = jnp.max(jnp.where(sig, s, neg), -1)
  s_min = jnp.min(jnp.where(sig, s, pos), -1)
  n_max = jnp.max(jnp.where(noise, s, neg), -1)
  has_sig, has_noise = k > 0, m > 0
  spread = jnp.where(has_sig, s_max - s_min, 0.0)
  mean_sig = c.safe_divide(jnp.sum(jnp.where(sig, dist, 0.0), -1), k)
  within = jnp.minimum(jnp.expm1(spread) * mean_sig, jnp.max(jnp.where(sig, dist, 0.0), -1))
  # the distractor-mass bound m e^{max_eta} / (m e^{max_eta} + k e^{min_S}) as a sigmoid
  logit = (jnp.log(jnp.where(has_noise, m, 1.0)) - jnp.log(jnp.where(has_sig, k, 1.0))
           + jnp.where(has_noise & has_sig, n_max - s_min, 0.0))
  eps = jnp.where(has_noise, jax.nn.sigmoid(logit), 0.0)
  far = jnp.max(jnp.where(noise, dist, 0.0), -1)
  return jnp.where(has_sig, within + eps * far, jnp.inf)


def snr_oracle_query(mu_signal: ArrayLike, mu_noise: ArrayLike, *,
                     beta: ArrayLike = 1.0) -> jax.Array:
  r"""The oracle query for signal and distractors around two means: :math:`q \propto \mu_s - \mu_n`.

  .. math:: q = \beta\,\frac{\mu_s - \mu_n}{\lVert \mu_s - \mu_n\rVert}

  With keys = values = x and the :math:`1/\sqrt d` scale, a vector at :math:`\mu_s` scores
  :math:`\beta\lVert\mu_s-\mu_n\rVert/\sqrt d` above one at :math:`\mu_n` (the margin Δ of
  :func:`adaptive_pool_error_bound`), so a larger β puts exponentially less mass on the
  distractors at any SNR, at the price of a larger spread δ among noisy signal vectors.

  Args:
    mu_signal: ``[..., d]`` the signal mean.
    mu_noise: ``[..., d]`` the distractor mean.
    beta: the query norm β > 0 (an inverse temperature).

  Returns:
    ``[..., d]`` the query (float32 for low-precision inputs); 0 where the means coincide.

  Examples:
    >>> from jaxsoft import pooling
    >>> pooling.snr_oracle_query(jnp.array([3.0, 1.0]), jnp.array([0.0, 5.0]), beta=10.0)
    Array([ 6., -8.], dtype=float32)

  References:
    G. Brothers, 2025, "Robust Noise Attenuation via Adaptive Pooling of Transformer
    Outputs": the oracle query of its two-cluster analysis.
  """
  name = "snr_oracle_query"
  u.check_range(beta, "beta", name, low=0.0, low_open=True)
  ms, mn = jnp.asarray(mu_signal), jnp.asarray(mu_noise)
  if ms.ndim == 0 or ms.shape != mn.shape:
    raise ValueError(f"{name}: `mu_signal` {ms.shape} and `mu_noise` {mn.shape} must be "
                     "vectors of one shape")
  dt = c.compute_dtype(jnp.result_type(ms, mn))
  diff = ms.astype(dt) - mn.astype(dt)
  norm = jnp.sqrt(jnp.sum(jnp.square(diff), -1, keepdims=True))
  return jnp.asarray(beta, dt) * c.safe_divide(diff, norm)
