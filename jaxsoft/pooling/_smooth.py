"""N35 softmax-weighted pooling of scalars: SoftPool, adaPool (and adaUnPool), log-mean-exp,
linear softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.pooling import _contract as u

__all__ = ["soft_pool", "ada_pool", "ada_unpool", "log_mean_exp", "linear_softmax_pool"]


def weighted_log_mean_exp(z, w, mask, axis: int):
  r"""``log sum_i w_i exp(z_i)`` (keepdims) for weights ``w`` that sum to 1 on the pool.

  Computed as :math:`m + \mathrm{log1p}(\sum_i w_i\, \mathrm{expm1}(z_i - m))` with ``m``
  the max of ``z`` over the entries with ``w > 0``: no overflow, and no cancellation when
  the ``z_i`` are close together (a log-mean-exp at a large temperature is then as
  accurate as the mean it tends to). ``z`` must be finite everywhere (masked entries
  hold a visible value, as :func:`jaxsoft.normalizers.common.prepare` gives); ``w`` is 0
  at masked entries. A pool with no weight gives 0.
  """
  live = jnp.logical_and(mask, w > 0)
  m = c.masked_max(z, live, axis)
  d = jnp.where(live, z - m, 0.0)
  s = jnp.sum(jnp.where(live, w * jnp.expm1(d), 0.0), axis=axis, keepdims=True)
  # s > -1 in exact arithmetic (the max entry contributes expm1(0) = 0); keep log1p finite.
  s = jnp.maximum(s, -1.0 + jnp.finfo(s.dtype).eps)
  return m + jnp.log1p(s)


def soft_pool(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
              keepdims: bool = False, temperature: ArrayLike = 1.0) -> jax.Array:
  r"""SoftPool: the softmax-weighted mean of a pool (feature N35).

  .. math::
    \mathrm{SoftPool}(x) = \sum_{i \in V} w_i x_i, \qquad
    w_i = \frac{e^{x_i / T}}{\sum_{j \in V} e^{x_j / T}}

  over the visible entries V of each pool. T = 1 is the paper's form (A. Stergiou,
  R. Poppe & G. Kalliatakis 2021, "Refining activation downsampling with SoftPool",
  ICCV 2021); the temperature T is an addition of this library: T -> 0 gives the max,
  T -> inf the mean. The result lies in [min, max] of the pool, is at least the mean,
  and SoftPool(x + c) = SoftPool(x) + c. Its gradient is
  ``w_i (1 + (x_i - out) / T)``.

  This reduces one axis; windowed (kernel/stride) pooling is this function applied to
  the windows (e.g. patches gathered by reshaping).

  Args:
    x: the values to pool.
    axis: the axis to pool over.
    where: optional boolean mask broadcastable to ``x``; False entries are left out,
      exactly as if deleted (``-inf`` entries too).
    keepdims: keep the pooled axis with size 1.
    temperature: T > 0, a scalar or an array broadcast to the pools (size 1 along
      ``axis``); differentiable.

  Returns:
    The pooled values in ``x``'s dtype (float32 for integers; computed in float32 for
    low precision); 0, with zero gradient, for a pool with no visible entry.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> pooling.soft_pool(x)  # between the mean 1 and the max 2
    Array(1.5752, dtype=float32)
    >>> pooling.soft_pool(x, where=jnp.array([False, True, True]))
    Array(0.7311, dtype=float32)
    >>> pooling.soft_pool(jnp.full(4, 3.0))  # a constant pool gives the constant
    Array(3., dtype=float32)

  References:
    A. Stergiou, R. Poppe & G. Kalliatakis, 2021, "Refining activation downsampling with
    SoftPool".
  """
  name = "soft_pool"
  u.check_range(temperature, "temperature", name, low=0.0, low_open=True)

  def reduce(xs, mask, ax):
    t = c.row_param(temperature, xs.shape, ax, "temperature", name, xs.dtype)
    return jnp.sum(c.exp_normalize(xs / t, mask, ax) * xs, axis=ax, keepdims=True)

  return u.pool(reduce, x, axis, where, keepdims, name)


def ada_pool(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
             keepdims: bool = False, beta: ArrayLike = 0.5) -> jax.Array:
  r"""adaPool: a learned blend of eDSCW pooling and SoftPool (feature N35).

  .. math::
    \mathrm{DSC}_i = \frac{2 \bar x\, x_i}{\bar x^2 + x_i^2}, \qquad
    o_D = \sum_{i \in V} \mathrm{softmax}(\mathrm{DSC})_i\, x_i, \qquad
    o_M = \mathrm{SoftPool}(x), \qquad
    \mathrm{adaPool}(x) = \beta\, o_D + (1 - \beta)\, o_M

  with :math:`\bar x` the mean of the visible entries V of the pool and β clamped to
  [0, 1]. From A. Stergiou & R. Poppe 2023, "AdaPool: Exponential Adaptive Pooling for
  Information-Retaining Downsampling", IEEE Transactions on Image Processing.

  Reconstructed parts: the element-wise Dice-Sørensen coefficient against the pool mean
  and the clamp of β follow third-party and official-wrapper code, not the paper's text;
  where :math:`\bar x^2 + x_i^2 = 0` (both 0) DSC is taken as 1, its value at
  :math:`x_i = \bar x`. β is one value per pool in the paper (a learned map over output
  locations); its initial value is not known, 0.5 here. Clamping means a β outside
  [0, 1] acts as 0 or 1 with zero gradient. The upsampling counterpart (adaUnPool) is
  :func:`ada_unpool`.

  β = 0 is exactly :func:`soft_pool`; the result is a convex combination, so it lies in
  [min, max] of the pool.

  Args:
    x: the values to pool.
    axis: the axis to pool over.
    where: optional boolean mask broadcastable to ``x``; False entries are left out,
      exactly as if deleted (the mean :math:`\bar x` is over the visible entries).
    keepdims: keep the pooled axis with size 1.
    beta: the blend β (clamped to [0, 1]), a scalar or an array broadcast to the pools
      (size 1 along ``axis``); differentiable inside [0, 1].

  Returns:
    The pooled values in ``x``'s dtype; 0, with zero gradient, for an empty pool.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([2.0, 1.0, 0.5])
    >>> pooling.ada_pool(x, beta=0.0)  # SoftPool
    Array(1.5584, dtype=float32)
    >>> pooling.ada_pool(x, beta=1.0)  # eDSCW: the entries nearest the mean weigh most
    Array(1.1901, dtype=float32)
    >>> pooling.ada_pool(x)
    Array(1.3742, dtype=float32)

  References:
    A. Stergiou & R. Poppe, 2023, "AdaPool: Exponential Adaptive Pooling for
    Information-Retaining Downsampling".

    A. Stergiou, R. Poppe & G. Kalliatakis, 2021, "Refining activation downsampling with
    SoftPool".
  """
  name = "ada_pool"
  u.check_range(beta, "beta", name)  # NaN check only: beta is clamped

  def reduce(xs, mask, ax):
    b, w_d, w_m = _ada_weights(xs, mask, ax, beta, name)
    out_d = jnp.sum(w_d * xs, axis=ax, keepdims=True)
    out_m = jnp.sum(w_m * xs, axis=ax, keepdims=True)
    return b * out_d + (1.0 - b) * out_m

  return u.pool(reduce, x, axis, where, keepdims, name)


def _ada_weights(xs, mask, ax: int, beta, name: str):
  """adaPool's blend ``b`` (clamped) and its eDSCW and eM (SoftPool) weights over ``ax``."""
  b = jnp.clip(c.row_param(beta, xs.shape, ax, "beta", name, xs.dtype), 0.0, 1.0)
  mean = jnp.sum(u.mean_weights(mask, ax, xs.dtype) * xs, axis=ax, keepdims=True)
  den = mean * mean + xs * xs
  ok = den > 0
  dsc = jnp.where(ok, 2.0 * mean * xs / jnp.where(ok, den, 1.0), 1.0)
  return b, c.exp_normalize(dsc, mask, ax), c.exp_normalize(xs, mask, ax)


def ada_unpool(y: ArrayLike, x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
               beta: ArrayLike = 0.5) -> jax.Array:
  r"""adaUnPool: a pooled value spread back over its pool by adaPool's weights (feature N35) [R].

  With :math:`\omega_i = \beta\, \mathrm{softmax}(\mathrm{DSC})_i + (1 - \beta)\,
  \mathrm{softmax}(x)_i` the weights by which :func:`ada_pool` averages the visible
  entries V of the pool of ``x`` (so that ``ada_pool(x) = sum_i omega_i x_i``),

  .. math::
    \mathrm{adaUnPool}(y; x)_i = \omega_i\, y \quad (i \in V), \qquad 0 \text{ elsewhere}

  The AdaPool paper (A. Stergiou & R. Poppe 2023) states that adaPool is bidirectional:
  the weights it learned for a region are reused to upsample (adaUnPool, used for super
  resolution and frame interpolation). Reconstructed [R]: the weights are recomputed from
  the guide ``x`` (the values that were pooled) and the pooled value ``y`` is
  distributed in proportion to them, which makes adaUnPool the adjoint of adaPool with
  its weights held fixed: ``sum_i unpool(y; x)_i z_i = y sum_i omega_i z_i`` for any z,
  and it conserves mass, ``sum_i unpool(y; x)_i = y``. Pooling a region and unpooling
  puts ``omega_i ada_pool(x)`` at each entry: the region's sum is kept, not its values.

  Args:
    y: the pooled values, of ``x``'s shape without ``axis`` (or with size 1 there).
    x: the guide, the values whose pools gave ``y`` (as passed to :func:`ada_pool`).
    axis: the pooled axis of ``x``.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are left out of the weights, as in :func:`ada_pool`.
    beta: the blend β (clamped to [0, 1]), as in :func:`ada_pool`.

  Returns:
    An array of ``x``'s shape in the result dtype of ``x`` and ``y`` (float32 for integer
    inputs; computed in float32 for low precision); an empty pool gives zeros with zero
    gradient. Differentiable in ``y``, ``x`` (through the weights) and β inside [0, 1].

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([2.0, 1.0, 0.5])
    >>> up = pooling.ada_unpool(jnp.array(3.0), x, beta=0.0)  # 3 softmax(x)
    >>> up
    Array([1.8856, 0.6937, 0.4207], dtype=float32)
    >>> up.sum()  # the pooled value is conserved
    Array(3., dtype=float32)
    >>> bool(jnp.allclose(jnp.vdot(pooling.ada_unpool(1.0, x), x), pooling.ada_pool(x)))
    True

  References:
    A. Stergiou & R. Poppe, 2023, "AdaPool: Exponential Adaptive Pooling for
    Information-Retaining Downsampling".
  """
  name = "ada_unpool"
  u.check_range(beta, "beta", name)  # NaN check only: beta is clamped
  xa, ya = jnp.asarray(x), jnp.asarray(y)
  c.check_real(ya, name)
  if xa.ndim == 0:
    raise ValueError(f"{name}: `x` must have the pooled axis (rank >= 1), got a scalar")
  ax = c.canonical_axis(axis, xa.ndim, name)
  reduced = xa.shape[:ax] + xa.shape[ax + 1:]
  if ya.ndim == xa.ndim - 1 and ya.shape == reduced:
    ya = jnp.expand_dims(ya, ax)
  elif not (ya.ndim == xa.ndim and ya.shape[ax] == 1 and ya.shape[:ax] == xa.shape[:ax]
            and ya.shape[ax + 1:] == xa.shape[ax + 1:]):
    raise ValueError(f"{name}: `y` of shape {ya.shape} is not a pooled value of `x` of shape "
                     f"{xa.shape} along axis {axis} (expected {reduced} or the same with "
                     "size 1 along the axis)")
  dtype = c.output_dtype(jnp.result_type(xa.dtype, ya.dtype))
  if xa.shape[ax] == 0:
    return jnp.zeros(xa.shape, dtype)
  xs, mask, ax = c.prepare(xa, ax, where, name)
  b, w_d, w_m = _ada_weights(xs, mask, ax, beta, name)
  omega = b * w_d + (1.0 - b) * w_m
  up = jnp.where(mask, omega * ya.astype(xs.dtype), 0.0)
  return up.astype(dtype)


def log_mean_exp(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                 keepdims: bool = False, tau: ArrayLike = 1.0) -> jax.Array:
  r"""Log-mean-exp pooling, a smooth max between the mean and the max (feature N35).

  .. math::
    \mathrm{LME}_\tau(x) = \tau \log \frac{1}{n} \sum_{i \in V} e^{x_i / \tau}
    = m + \tau\, \mathrm{log1p}\Big(\frac{1}{n} \sum_{i \in V}
      \mathrm{expm1}\big(\tfrac{x_i - m}{\tau}\big)\Big)

  over the n visible entries V of each pool, with m their max. The second form is the
  one computed: it cannot overflow, and for a large τ it does not lose the small
  differences to rounding. Bounds: mean ≤ LME ≤ max and LME ≥ max − τ log n; τ -> 0
  gives the max, τ -> inf the mean; its gradient is ``softmax(x / tau)``. Unlike
  ``jaxsoft.normalizers.smooth_max`` (a log-*sum*-exp), it does not grow with n.

  LSE pooling of P. O. Pinheiro & R. Collobert 2015, "From Image-level to Pixel-level
  Labeling with Convolutional Networks", CVPR 2015 (with r = 1/τ), and the smoothed-max
  pooling of D. Zhu et al. 2023, "Provable Multi-instance Deep AUC Maximization with
  Stochastic Pooling", ICML 2023.

  Args:
    x: the values to pool.
    axis: the axis to pool over.
    where: optional boolean mask broadcastable to ``x``; False entries are left out,
      exactly as if deleted (n counts the visible entries).
    keepdims: keep the pooled axis with size 1.
    tau: the temperature τ > 0, a scalar or an array broadcast to the pools (size 1
      along ``axis``); differentiable.

  Returns:
    The pooled values in ``x``'s dtype; 0, with zero gradient, for an empty pool.

  Examples:
    >>> from jaxsoft import pooling
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> pooling.log_mean_exp(x)  # log((e^2 + e + 1) / 3)
    Array(1.309, dtype=float32)
    >>> pooling.log_mean_exp(x, tau=0.01)  # ~ max - tau log 3
    Array(1.989, dtype=float32)
    >>> pooling.log_mean_exp(x, tau=1e4)  # ~ mean (+ 1e-4 / 3)
    Array(1., dtype=float32)

  References:
    P. O. Pinheiro & R. Collobert, 2015, "From Image-level to Pixel-level Labeling with
    Convolutional Networks".

    D. Zhu et al., 2023, "Provable Multi-instance Deep AUC Maximization with Stochastic
    Pooling".
  """
  name = "log_mean_exp"
  u.check_range(tau, "tau", name, low=0.0, low_open=True)

  def reduce(xs, mask, ax):
    t = c.row_param(tau, xs.shape, ax, "tau", name, xs.dtype)
    w = u.mean_weights(mask, ax, xs.dtype)
    out = t * weighted_log_mean_exp(xs / t, w, mask, ax)
    return jnp.where(u.any_visible(mask, ax), out, 0.0)

  return u.pool(reduce, x, axis, where, keepdims, name)


def linear_softmax_pool(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                        keepdims: bool = False) -> jax.Array:
  r"""Linear-softmax pooling of probabilities (feature N35).

  .. math::
    \mathrm{LinSoft}(y) = \frac{\sum_{i \in V} y_i^2}{\sum_{i \in V} y_i}

  the mean of y weighted by y itself, over the visible entries V of each pool. For frame
  probabilities y_i in [0, 1] it gives the clip probability of multiple-instance sound
  event detection (Y. Wang, J. Li & F. Metze 2019, "A Comparison of Five Multiple
  Instance Learning Pooling Functions for Sound Event Detection with Weak Labeling",
  ICASSP 2019). mean ≤ LinSoft ≤ max; its gradient ``(2 y_i - out) / sum y`` is
  positive exactly when y_i > out / 2. The inputs are expected to be ≥ 0 (they are
  not clipped); a pool that sums to 0 gives 0.

  Args:
    x: the probabilities y to pool (≥ 0).
    axis: the axis to pool over.
    where: optional boolean mask broadcastable to ``x``; False entries are left out,
      exactly as if deleted.
    keepdims: keep the pooled axis with size 1.

  Returns:
    The pooled values in ``x``'s dtype; 0, with zero gradient, for an empty pool or one
    whose entries sum to 0.

  Examples:
    >>> from jaxsoft import pooling
    >>> y = jnp.array([0.9, 0.1, 0.2])
    >>> pooling.linear_softmax_pool(y)  # (0.81 + 0.01 + 0.04) / 1.2
    Array(0.7167, dtype=float32)

  References:
    Y. Wang, J. Li & F. Metze, 2019, "A Comparison of Five Multiple Instance Learning
    Pooling Functions for Sound Event Detection with Weak Labeling".
  """
  def reduce(xs, mask, ax):
    y = jnp.where(mask, xs, 0.0)
    return c.safe_divide(jnp.sum(y * y, axis=ax, keepdims=True),
                         jnp.sum(y, axis=ax, keepdims=True))

  return u.pool(reduce, x, axis, where, keepdims, "linear_softmax_pool")
