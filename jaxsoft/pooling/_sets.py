"""Pooling a set of vectors: SimPool attention pooling (A23) and entropic-OT pooling (N35)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft import normalizers
from jaxsoft.normalizers import common as c
from jaxsoft.pooling import _contract as u
from jaxsoft.pooling import _power

__all__ = ["attention_pool", "entropic_ot_weights", "entropic_ot_pool"]


def _tokens_like(a, name: str, x_shape, ax: int, fn_name: str, dtype):
  """An extra token array (keys) ``[..., N, dk]`` laid out as ``x``, token axis moved to -2."""
  a = jnp.asarray(a)
  if a.ndim != len(x_shape) or a.shape[:-1] != tuple(x_shape[:-1]):
    raise ValueError(f"{fn_name}: `{name}` of shape {a.shape} must have the shape of `x` "
                     f"{tuple(x_shape)} except for the last (feature) axis")
  return jnp.moveaxis(a.astype(dtype), ax, -2)


def attention_pool(x: ArrayLike, axis: int = -2, where: ArrayLike | None = None, *,
                   keepdims: bool = False, query: ArrayLike | None = None,
                   keys: ArrayLike | None = None, gamma: ArrayLike | None = 2.0,
                   scale: float | None = None, eps: ArrayLike = 1e-6) -> jax.Array:
  r"""SimPool attention pooling: one GAP query, softmax weights, power-mean values (A23).

  For tokens ``x`` ``[..., N, d]`` (features last), keys ``K`` (default ``x``) and a
  query ``q`` (default the mean of the visible keys, i.e. global average pooling):

  .. math::
    a = \mathrm{softmax}\Big(\frac{q K^\top}{\sqrt{d_k}}\Big), \qquad
    z_c = \mathrm{PM}_\gamma\big(x_{\cdot c};\ a\big)

  the softmax over the visible tokens (:func:`jaxsoft.normalizers.softmax`), and the
  values (``x`` itself, no value projection) pooled channel by channel with the
  a-weighted power mean :func:`power_mean_pool` of power γ. ``gamma=None`` (or 1) is
  plain attention pooling :math:`z = a^\top x`.

  B. Psomas, I. Kakogeorgiou, K. Karantzalos & Y. Avrithis 2023, "Keep It SimPool: Who
  Said Supervised Transformers Suffer from Attention Deficit?", ICCV 2023 (arXiv
  2309.06891). Their layer takes ``q = W_q LN(GAP(x))`` and ``K = W_k LN(x)`` (learned
  projections, one head) and γ = 2, then adds a learned scalar bias: pass such ``query``
  and ``keys`` (and add the bias) to reproduce it. The power mean is shifted by the
  per-pool min and shifted back (see :func:`power_mean_pool`; the authors' code uses the
  min of the whole tensor and no shift back).

  Properties: permutation invariant over tokens; uniform attention (a zero query) gives
  the power mean, and with γ = 1 the mean (global average pooling); each channel lies in
  [min, max] of its visible values.

  Args:
    x: tokens ``[..., N, d]``, also the values.
    axis: the token axis to pool over (not the last).
    where: optional token mask broadcastable to ``x.shape[:-1]`` (e.g. ``[B, N]``);
      False tokens are left out, exactly as if deleted.
    keepdims: keep the token axis with size 1.
    query: optional ``[..., d_k]`` (``x``'s shape without the token and feature axes,
      then d_k); default the masked mean of the keys.
    keys: optional ``[..., N, d_k]`` laid out as ``x``; default ``x``.
    gamma: the power γ > 0 of the value pooling, or None for γ = 1.
    scale: the score scale, default ``1 / sqrt(d_k)``.
    eps: the power mean's offset ε > 0.

  Returns:
    ``[..., d]`` (the token axis removed, or kept with size 1) in ``x``'s dtype; 0, with
    zero gradient, where no token is visible.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # N = 3 tokens, d = 2
    >>> pooling.attention_pool(x, gamma=None)
    Array([0.7224, 0.7224], dtype=float32)
    >>> pooling.attention_pool(x)  # gamma = 2
    Array([0.8499, 0.8499], dtype=float32)
    >>> pooling.attention_pool(x, query=jnp.zeros(2), gamma=None)  # uniform: the mean
    Array([0.6667, 0.6667], dtype=float32)

  References:
    B. Psomas, I. Kakogeorgiou, K. Karantzalos & Y. Avrithis, 2023, "Keep It SimPool: Who
    Said Supervised Transformers Suffer from Attention Deficit?".
  """
  name = "attention_pool"
  u.check_bool(keepdims, "keepdims", name)
  if gamma is not None:
    u.check_range(gamma, "gamma", name, low=0.0, low_open=True)
  if scale is not None:
    u.check_range(scale, "scale", name)
  x = jnp.asarray(x)
  xs, mask, ax = u.prepare_sets(x, axis, where, name)
  if keys is None:
    ks = xs
  else:
    ks = _tokens_like(keys, "keys", x.shape, ax, name, xs.dtype)
    ks = jnp.where(mask[..., None], ks, 0.0)
  dk = ks.shape[-1]
  if query is None:
    w_mean = u.mean_weights(mask, -1, xs.dtype)
    q = jnp.einsum("...n,...nd->...d", w_mean, ks)
  else:
    q = jnp.asarray(query).astype(xs.dtype)
    want = ks.shape[:-2] + (dk,)
    if q.shape != want:
      raise ValueError(f"{name}: `query` of shape {q.shape} must be {want} (the shape of the "
                       "keys without the token axis)")
  s = (1.0 / math.sqrt(dk)) if scale is None else scale
  scores = jnp.einsum("...d,...nd->...n", q, ks) * jnp.asarray(s, xs.dtype)
  a = normalizers.softmax(scores, axis=-1, where=mask)
  if xs.shape[-2] == 0:
    out = jnp.zeros(xs.shape[:-2] + xs.shape[-1:], xs.dtype)
  elif gamma is None:
    out = jnp.einsum("...n,...nd->...d", a, xs)
  else:
    out = _power.power_mean_pool(xs, -2, mask[..., None], p=gamma, weights=a[..., None],
                                 eps=eps)
  return u.sets_out(out, ax, x.ndim, keepdims, x.dtype)


def _masked_lse(z, valid, axis):
  """log-sum-exp over the ``valid`` entries of ``z`` along ``axis`` (0 if none; no NaN grad)."""
  m = c.masked_max(z, valid, axis)
  e = jnp.where(valid, jnp.exp(jnp.where(valid, z, m) - m), 0.0)
  s = jnp.sum(e, axis=axis, keepdims=True)
  return jnp.squeeze(m + jnp.log(jnp.where(s > 0, s, 1.0)), axis)


def _sinkhorn_row_mass(xs, mask, protos, mu, epsilon, num_iters):
  """Mass p_i that token i sends to the prototypes; xs ``[..., N, d]``, mask ``[..., N]``."""
  dt = xs.dtype
  protos = protos.reshape((1,) * (xs.ndim - protos.ndim) + protos.shape)  # explicit over pools
  cost = jnp.sum((xs[..., :, None, :] - protos[..., None, :, :]) ** 2, axis=-1)  # [..., N, M]
  n_proto = cost.shape[-1]
  cost = jnp.concatenate([cost, jnp.zeros(cost.shape[:-1] + (1,), dt)], axis=-1)  # + dustbin
  n = jnp.sum(mask, axis=-1, keepdims=True).astype(dt)
  log_a = jnp.where(mask, -jnp.log(jnp.maximum(n, 1.0)), 0.0)  # [..., N]
  rest = 1.0 - mu
  has_bin = rest > 0
  log_b = jnp.concatenate([
      jnp.broadcast_to(jnp.log(mu / n_proto), mu.shape[:-1] + (n_proto,)),
      jnp.log(jnp.where(has_bin, rest, 1.0))], axis=-1)  # [..., M + 1]
  col_ok = jnp.concatenate([jnp.ones(has_bin.shape[:-1] + (n_proto,), bool), has_bin], -1)
  row_ok = mask[..., :, None]
  valid = jnp.logical_and(row_ok, col_ok[..., None, :])
  eps_ = epsilon[..., None]  # [..., 1, 1]

  def f_update(g):
    return jnp.where(mask, epsilon * log_a - epsilon * _masked_lse(
        (g[..., None, :] - cost) / eps_, valid, -1), 0.0)

  def g_update(f):
    return jnp.where(col_ok, epsilon * log_b - epsilon * _masked_lse(
        (f[..., :, None] - cost) / eps_, valid, -2), 0.0)

  def body(_, f):
    return f_update(g_update(f))

  f0 = jnp.zeros(cost.shape[:-1], dt)
  f = jax.lax.fori_loop(0, num_iters, body, f0)
  g = g_update(f)
  # The last row update in closed form: pi_ij = a_i softmax_j((g_j - C_ij) / eps), so each
  # visible token sends exactly a_i = 1/n, and with no dustbin p_i = a_i to the last bit.
  z = (g[..., None, :] - cost) / eps_
  m = c.masked_max(z, valid, -1)
  e = jnp.where(valid, jnp.exp(jnp.where(valid, z, m) - m), 0.0)
  share = c.safe_divide(jnp.sum(e[..., :n_proto], axis=-1), jnp.sum(e, axis=-1))
  return jnp.where(mask, jnp.exp(log_a), 0.0) * share


def _ot_args(x, axis, where, prototypes, mu, epsilon, num_iters, name):
  u.check_range(mu, "mu", name, low=0.0, low_open=True, high=1.0)
  u.check_range(epsilon, "epsilon", name, low=0.0, low_open=True)
  if not isinstance(num_iters, (int, np.integer)) or isinstance(num_iters, bool) or num_iters < 0:
    raise ValueError(f"{name}: `num_iters` must be an int >= 0, got {num_iters!r}")
  x = jnp.asarray(x)
  xs, mask, ax = u.prepare_sets(x, axis, where, name)
  protos = jnp.asarray(prototypes)
  if protos.ndim < 2 or protos.shape[-1] != x.shape[-1] or protos.shape[-2] == 0:
    raise ValueError(f"{name}: `prototypes` must be [..., M, d] with M >= 1 and d = "
                     f"{x.shape[-1]} (the feature size of `x`), got shape {protos.shape}")
  protos = protos.astype(xs.dtype)
  batch = xs.shape[:-2]

  def per_pool(v, pname):
    v = jnp.asarray(v, xs.dtype)
    try:
      return jnp.broadcast_to(v, batch + (1,)) if v.ndim == 0 else jnp.broadcast_to(
          v[..., None], batch + (1,))
    except ValueError:
      raise ValueError(f"{name}: `{pname}` of shape {v.shape} does not broadcast to the "
                       f"pools {batch}") from None

  mu_ = per_pool(mu, "mu")
  eps_ = per_pool(epsilon, "epsilon")
  p = _sinkhorn_row_mass(xs, mask, protos, mu_, eps_, int(num_iters))
  w = c.safe_divide(p, jnp.sum(p, axis=-1, keepdims=True))
  return x, xs, w, ax


def entropic_ot_weights(x: ArrayLike, axis: int = -2, where: ArrayLike | None = None, *,
                        prototypes: ArrayLike, mu: ArrayLike = 0.5,
                        epsilon: ArrayLike = 0.1, num_iters: int = 50) -> jax.Array:
  r"""Pooling weights from entropic partial optimal transport to prototypes (feature N35).

  Reconstruction of Generalized Sum Pooling (Y. Z. Gürbüz, O. Şener & A. A. Alatan 2023,
  "Generalized Sum Pooling for Metric Learning", ICCV 2023), whose pooling weights
  solve an entropy-smoothed optimal transport problem; the exact constraint set is not
  known here, so this is one plausible form. The n visible tokens :math:`x_i` (mass 1/n
  each) are transported to M prototypes :math:`\omega_j` (mass μ/M each) and a dustbin
  (mass 1 − μ, cost 0), with costs :math:`C_{ij} = \lVert x_i - \omega_j \rVert^2`:

  .. math::
    \pi = \arg\min_{\pi \in U(a, b)} \langle C, \pi \rangle - \varepsilon H(\pi), \qquad
    w_i = \frac{\sum_{j \le M} \pi_{ij}}{\sum_k \sum_{j \le M} \pi_{kj}}

  so a fraction μ of the tokens' mass, the part nearest the prototypes, is selected. π
  comes from ``num_iters`` log-domain Sinkhorn iterations (each a column update, then a
  row update) and a last column and row update, so that every visible token sends
  exactly 1/n; the iterations are unrolled (a ``fori_loop``) and the gradient is
  autodiff through the iterations, not the implicit one. μ = 1 gives uniform weights
  1/n (global average pooling); as ε -> 0 the weights become uniform on the subset of
  the tokens nearest the prototypes. The costs are not normalised: choose ε relative to
  their scale.

  Args:
    x: tokens ``[..., N, d]``.
    axis: the token axis (not the last).
    where: optional token mask broadcastable to ``x.shape[:-1]``; False tokens are left
      out, exactly as if deleted.
    prototypes: ``[M, d]`` (or batched ``[..., M, d]``), differentiable.
    mu: the transported fraction μ in (0, 1], a scalar or one value per pool.
    epsilon: the entropic regularisation ε > 0, a scalar or one value per pool.
    num_iters: the Sinkhorn iterations (each a column and a row update).

  Returns:
    Weights ``[..., N]`` (``x.shape[:-1]``), ≥ 0, summing to 1 over the visible tokens of
    each pool; all 0 where no token is visible. float32 for low-precision input.

  Examples:
    >>> from jaxsoft import pooling
    >>> jnp.set_printoptions(precision=3, suppress=True)
    >>> x = jnp.array([[0.0], [0.1], [3.0], [4.0]])  # N = 4 tokens, d = 1
    >>> pooling.entropic_ot_weights(x, prototypes=jnp.zeros((1, 1)), mu=0.5)
    Array([0.5, 0.5, 0. , 0. ], dtype=float32)
    >>> pooling.entropic_ot_weights(x, prototypes=jnp.zeros((1, 1)), mu=1.0)  # uniform
    Array([0.25, 0.25, 0.25, 0.25], dtype=float32)

  References:
    Y. Z. Gürbüz, O. Şener & A. A. Alatan, 2023, "Generalized Sum Pooling for Metric
    Learning".

    M. Cuturi, 2013, "Sinkhorn Distances: Lightspeed Computation of Optimal Transport".
  """
  x_, _, w, ax = _ot_args(x, axis, where, prototypes, mu, epsilon, num_iters,
                          "entropic_ot_weights")
  return jnp.moveaxis(w, -1, ax).astype(c.compute_dtype(x_.dtype))


def entropic_ot_pool(x: ArrayLike, axis: int = -2, where: ArrayLike | None = None, *,
                     keepdims: bool = False, prototypes: ArrayLike, mu: ArrayLike = 0.5,
                     epsilon: ArrayLike = 0.1, num_iters: int = 50) -> jax.Array:
  r"""Entropic-OT pooling: tokens averaged with :func:`entropic_ot_weights` (feature N35).

  .. math::
    f = \sum_{i \in V} w_i x_i

  with the weights of the entropic partial transport to the prototypes (see
  :func:`entropic_ot_weights` for the formula, the reconstruction and the paper:
  Gürbüz, Şener & Alatan 2023, Generalized Sum Pooling). μ = 1 gives the mean of the
  visible tokens. Arguments as :func:`entropic_ot_weights`, plus ``keepdims``.

  Returns:
    ``[..., d]`` in ``x``'s dtype; 0, with zero gradient, where no token is visible.

  Examples:
    >>> from jaxsoft import pooling
    >>> jnp.set_printoptions(precision=3, suppress=True)
    >>> x = jnp.array([[0.0, 1.0], [0.2, 1.0], [3.0, -1.0], [4.0, -1.0]])
    >>> pooling.entropic_ot_pool(x, prototypes=jnp.zeros((1, 2)), mu=0.5)  # the near half
    Array([0.1, 1. ], dtype=float32)

  References:
    Y. Z. Gürbüz, O. Şener & A. A. Alatan, 2023, "Generalized Sum Pooling for Metric
    Learning".

    M. Cuturi, 2013, "Sinkhorn Distances: Lightspeed Computation of Optimal Transport".
  """
  name = "entropic_ot_pool"
  u.check_bool(keepdims, "keepdims", name)
  x_, xs, w, ax = _ot_args(x, axis, where, prototypes, mu, epsilon, num_iters, name)
  out = jnp.einsum("...n,...nd->...d", w, xs)
  return u.sets_out(out, ax, x_.ndim, keepdims, x_.dtype)
