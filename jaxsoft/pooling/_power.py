"""N35 power-mean pooling: GeM, GGeM and the SimPool power mean."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.pooling import _contract as u
from jaxsoft.pooling._smooth import weighted_log_mean_exp

__all__ = ["gem", "ggem", "power_mean_pool"]


def _power_mean(y, w, mask, axis, p):
  r"""``(sum_i w_i y_i^p)^(1/p)`` for ``y > 0``, computed as ``exp(LME(p log y) / p)``."""
  return jnp.exp(weighted_log_mean_exp(p * jnp.log(y), w, mask, axis) / p)


def gem(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
        keepdims: bool = False, p: ArrayLike = 3.0, eps: ArrayLike = 1e-6) -> jax.Array:
  r"""Generalized-mean (GeM) pooling (feature N35).

  .. math::
    \mathrm{GeM}_p(x) = \Big(\frac{1}{n} \sum_{i \in V} \max(x_i, \varepsilon)^p\Big)^{1/p}

  over the n visible entries V of each pool: p = 1 is the mean of the clamped input,
  p -> inf the max, p -> 0 the geometric mean; non-decreasing in p, and
  GeM(λx) = λ GeM(x) for λ > 0 (where no entry is clamped). Computed in the log domain,
  ``exp(LME(p log max(x, eps)) / p)`` with the stable log-mean-exp of
  :func:`log_mean_exp`, so a large p neither overflows nor underflows. Entries below
  ``eps`` have zero gradient.

  F. Radenović, G. Tolias & O. Chum 2018, "Fine-tuning CNN Image Retrieval with No Human
  Annotation", IEEE TPAMI (arXiv 1711.02512), where p is learned and starts at 3. An
  array ``p`` gives one power per pool, e.g. per channel; :func:`ggem` shares one power
  per group of channels.

  Args:
    x: the values to pool (clamped at ``eps``).
    axis: the axis to pool over.
    where: optional boolean mask broadcastable to ``x``; False entries are left out,
      exactly as if deleted.
    keepdims: keep the pooled axis with size 1.
    p: the power p > 0, a scalar or an array broadcast to the pools (size 1 along
      ``axis``); differentiable.
    eps: the clamp ε > 0, a scalar or an array broadcast to the pools.

  Returns:
    The pooled values in ``x``'s dtype; 0, with zero gradient, for an empty pool.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([3.0, 1.0, 2.0])
    >>> pooling.gem(x)  # (36 / 3) ** (1/3)
    Array(2.2894, dtype=float32)
    >>> pooling.gem(x, p=1.0)  # the mean
    Array(2., dtype=float32)
    >>> pooling.gem(x, p=50.0)  # close to the max
    Array(2.9348, dtype=float32)

  References:
    F. Radenović, G. Tolias & O. Chum, 2018, "Fine-tuning CNN Image Retrieval with No Human
    Annotation".
  """
  name = "gem"
  u.check_range(p, "p", name, low=0.0, low_open=True)
  u.check_range(eps, "eps", name, low=0.0, low_open=True)

  def reduce(xs, mask, ax):
    pp = c.row_param(p, xs.shape, ax, "p", name, xs.dtype)
    y = jnp.maximum(xs, c.row_param(eps, xs.shape, ax, "eps", name, xs.dtype))
    out = _power_mean(y, u.mean_weights(mask, ax, xs.dtype), mask, ax, pp)
    return jnp.where(u.any_visible(mask, ax), out, 0.0)

  return u.pool(reduce, x, axis, where, keepdims, name)


def ggem(x: ArrayLike, axis: int = -2, where: ArrayLike | None = None, *,
         keepdims: bool = False, p: ArrayLike, eps: ArrayLike = 1e-6) -> jax.Array:
  r"""Group generalized-mean (GGeM) pooling of tokens (feature N35).

  ``x`` is a set of tokens ``[..., N, C]`` (channels last), pooled over the token
  ``axis``; the C channels are split into G equal contiguous groups (as the heads of a
  vision transformer) and group g uses its own power :math:`p_g`:

  .. math::
    \mathrm{GGeM}(x)_c = \Big(\frac{1}{n} \sum_{i \in V}
      \max(x_{ic}, \varepsilon)^{p_{g(c)}}\Big)^{1/p_{g(c)}},
    \qquad g(c) = \lfloor c\, G / C \rfloor

  i.e. :func:`gem` with p repeated C/G times along the channels. G = 1 is GeM with one
  p; G = C is per-channel GeM. From B. Ko et al. 2022, "Group Generalized Mean Pooling
  for Vision Transformer" (arXiv preprint).

  Args:
    x: tokens ``[..., N, C]``.
    axis: the token axis to pool over (not the last).
    where: optional boolean mask broadcastable to ``x`` (e.g. ``[..., N, 1]`` for a
      token mask); False entries are left out, exactly as if deleted.
    keepdims: keep the pooled axis with size 1.
    p: the G powers ``[G]``, all > 0, with G dividing C; differentiable.
    eps: the clamp ε > 0.

  Returns:
    ``[..., C]`` (the token axis removed) in ``x``'s dtype; 0 with zero gradient where
    no token is visible.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([[1.0, 1.0, 3.0, 3.0], [3.0, 3.0, 1.0, 1.0]])  # N = 2, C = 4
    >>> pooling.ggem(x, p=jnp.array([1.0, 8.0]))  # channels 0-1: mean; 2-3: near max
    Array([2.    , 2.    , 2.7511, 2.7511], dtype=float32)

  References:
    B. Ko et al., 2022, "Group Generalized Mean Pooling for Vision Transformer".

    F. Radenović, G. Tolias & O. Chum, 2018, "Fine-tuning CNN Image Retrieval with No Human
    Annotation".
  """
  name = "ggem"
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"{name}: `x` must be tokens [..., N, C] (rank >= 2), got shape {x.shape}")
  ax = c.canonical_axis(axis, x.ndim, name)
  if ax == x.ndim - 1:
    raise ValueError(f"{name}: `axis` must be a token axis, not the last (channel) axis")
  p_arr = jnp.asarray(p)
  if p_arr.ndim != 1 or p_arr.shape[0] == 0:
    raise ValueError(f"{name}: `p` must be a 1-D array of G group powers, got shape {p_arr.shape}")
  groups, channels = p_arr.shape[0], x.shape[-1]
  if channels % groups:
    raise ValueError(f"{name}: `p` has {groups} groups, which do not divide the {channels} "
                     "channels of `x`")
  u.check_range(p, "p", name, low=0.0, low_open=True)
  p_full = jnp.repeat(p_arr, channels // groups, total_repeat_length=channels)
  return gem(x, ax, where, keepdims=keepdims, p=p_full, eps=eps)


def power_mean_pool(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                    keepdims: bool = False, p: ArrayLike = 2.0,
                    weights: ArrayLike | None = None, eps: ArrayLike = 1e-6) -> jax.Array:
  r"""Shifted weighted power mean, the value pooling of SimPool (feature N35).

  .. math::
    \mathrm{PM}_p(x) = \Big(\sum_{i \in V} a_i\, (x_i - m + \varepsilon)^p\Big)^{1/p}
      + m - \varepsilon, \qquad m = \min_{i \in V} x_i, \quad
      a_i = \frac{w_i}{\sum_{j \in V} w_j}

  over the visible entries V of each pool, with weights ``w`` (default uniform). The
  shift by the pool's min makes every base positive, so any real input works: p = 1 is
  exactly the (weighted) mean, p -> inf approaches the max over the entries with
  positive weight, and PM(x + c) = PM(x) + c. Computed in the log domain (as
  :func:`gem`), so a large p does not overflow.

  B. Psomas, I. Kakogeorgiou, K. Karantzalos & Y. Avrithis 2023, "Keep It SimPool: Who
  Said Supervised Transformers Suffer from Attention Deficit?", ICCV 2023 (arXiv
  2309.06891), pools the values with this power mean, γ = p = 2. Reconstructed: the
  authors' code subtracts the min of the whole value tensor (across the batch) and
  does not add it back (a learned scalar bias follows); here the min is per pool and is
  added back, which gives the properties above.

  Args:
    x: the values to pool.
    axis: the axis to pool over.
    where: optional boolean mask broadcastable to ``x``; False entries are left out,
      exactly as if deleted (also from the min).
    keepdims: keep the pooled axis with size 1.
    p: the power p > 0, a scalar or an array broadcast to the pools (size 1 along
      ``axis``); differentiable.
    weights: optional weights w ≥ 0 broadcastable to ``x`` (e.g. attention weights),
      normalised over the visible entries of each pool; differentiable.
    eps: the offset ε > 0 that keeps the smallest base positive.

  Returns:
    The pooled values in ``x``'s dtype; 0, with zero gradient, for an empty pool or one
    whose weights sum to 0.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([-1.0, 0.0, 2.0])
    >>> pooling.power_mean_pool(x, p=1.0)  # the mean
    Array(0.3333, dtype=float32)
    >>> pooling.power_mean_pool(x)  # sqrt((0 + 1 + 9) / 3) - 1
    Array(0.8257, dtype=float32)
    >>> pooling.power_mean_pool(x, p=1.0, weights=jnp.array([1.0, 1.0, 2.0]))
    Array(0.75, dtype=float32)

  References:
    B. Psomas, I. Kakogeorgiou, K. Karantzalos & Y. Avrithis, 2023, "Keep It SimPool: Who
    Said Supervised Transformers Suffer from Attention Deficit?".
  """
  name = "power_mean_pool"
  u.check_range(p, "p", name, low=0.0, low_open=True)
  u.check_range(eps, "eps", name, low=0.0, low_open=True)
  u.check_range(weights, "weights", name, low=0.0)

  def reduce(xs, mask, ax):
    pp = c.row_param(p, xs.shape, ax, "p", name, xs.dtype)
    e = c.row_param(eps, xs.shape, ax, "eps", name, xs.dtype)
    if weights is None:
      w = u.mean_weights(mask, ax, xs.dtype)
    else:
      wa = jnp.asarray(weights)
      try:
        wa = jnp.broadcast_to(wa, xs.shape).astype(xs.dtype)
      except ValueError:
        raise ValueError(f"{name}: `weights` of shape {wa.shape} does not broadcast to `x` "
                         f"of shape {xs.shape}") from None
      w = c.sum_normalize(wa, mask, ax)
    # Masked entries of xs hold the pool's visible max, so this is the visible min.
    m = jnp.min(xs, axis=ax, keepdims=True)
    out = _power_mean(xs - m + e, w, mask, ax, pp) + m - e
    ok = jnp.any(jnp.logical_and(mask, w > 0), axis=ax, keepdims=True)
    return jnp.where(ok, out, 0.0)

  return u.pool(reduce, x, axis, where, keepdims, name)
