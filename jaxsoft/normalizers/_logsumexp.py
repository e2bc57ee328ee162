"""N02 log-softmax, logsumexp and the smooth max/min LSE_eps (class E reductions).

These return log-weights or a row reduction, not weights, so they are plain functions
and not registered NormalizerSpecs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import Param

__all__ = ["log_softmax", "logsumexp", "smooth_max", "smooth_min"]

_TEMPERATURE = Param("temperature", 1.0, low=0.0, low_open=True, sample=0.5, row_broadcast=True)
_EPS = Param("eps", 1.0, low=0.0, low_open=True, sample=0.1, row_broadcast=True)


def _masked_lse_parts(z, mask, axis):
  """``(m, log s)`` with ``LSE = m + log s`` over visible entries (keepdims).

  ``m`` is the max stabiliser (no gradient: it cancels); ``log s`` is ``-inf`` for a row
  with no visible entry, taken of a sum replaced by 1 there so that its gradient is 0
  rather than ``inf * 0``.
  """
  m = c.masked_max(z, mask, axis)
  s = jnp.sum(jnp.where(mask, jnp.exp(z - m), 0.0), axis=axis, keepdims=True)
  ok = s > 0
  return m, jnp.where(ok, jnp.log(jnp.where(ok, s, 1.0)), -jnp.inf)


def _masked_lse(z, mask, axis):
  """Row logsumexp over visible entries (keepdims); -inf for a row with none."""
  m, log_s = _masked_lse_parts(z, mask, axis)
  return m + log_s


def logsumexp(x: ArrayLike, axis: int | tuple[int, ...] = -1, where: ArrayLike | None = None,
              keepdims: bool = False) -> jax.Array:
  r"""Log-sum-exp over the visible entries of a row (feature N02, kernel class E).

  .. math::
    \mathrm{LSE}(x) = \log \sum_{j \in V} e^{x_j} = m + \log \sum_{j \in V} e^{x_j - m},
    \quad m = \max_{j \in V} x_j

  with V the visible entries (``where`` True and ``x > -inf``). Its gradient is
  ``softmax(x)`` (0 at masked entries).

  Args:
    x: scores.
    axis: the axis to reduce over, or a tuple of axes reduced together (as ``jax.nn``).
    where: optional boolean mask broadcastable to ``x``; False entries are left out.
    keepdims: keep the reduced axis with size 1.

  Returns:
    The row LSE in ``x``'s dtype (computed in float32 for low precision). A row with no
    visible entry gives ``-inf`` (the log of an empty sum, as ``jax.nn.logsumexp``) with a
    zero gradient, never NaN.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.logsumexp(x)
    Array(2.4076, dtype=float32)
    >>> js.normalizers.logsumexp(x, where=jnp.array([False, True, True]))  # log(e + 1)
    Array(1.3133, dtype=float32)

  References:
    P. Blanchard, D. J. Higham & N. J. Higham, 2021, "Accurately Computing the Log-Sum-Exp
    and Softmax Functions".
  """
  if isinstance(axis, tuple):  # one row over several axes, as jax.nn.logsumexp
    x_rows, where_rows, _, _ = c.merge_axes(x, axis, where, {}, "logsumexp")
    out = logsumexp(x_rows, -1, where_rows)  # the other axes, in their order
    named = sorted(a % jnp.ndim(x) for a in axis)
    return jnp.expand_dims(out, named) if keepdims else out
  xs, mask, ax = c.prepare(x, axis, where, "logsumexp")
  out = _masked_lse(xs, mask, ax)
  if not keepdims:
    out = jnp.squeeze(out, axis=ax)
  return out.astype(jnp.asarray(x).dtype)


def log_softmax(x: ArrayLike, axis: int | tuple[int, ...] = -1, where: ArrayLike | None = None,
                temperature: ArrayLike = 1.0) -> jax.Array:
  r"""Log-softmax with temperature (feature N02, kernel class E).

  .. math::
    \log \mathrm{softmax}(x)_i = \frac{x_i}{T} - \log \sum_{j \in V} e^{x_j / T}

  over the visible entries V of the row, in float32 for low-precision inputs. The
  derivative is written in terms of the output ``l`` (``dl = dz - <e^l, dz>``), so reverse
  mode keeps only ``l`` and one flag per row, as ``jax.nn.log_softmax`` keeps its output.

  Args:
    x: scores.
    axis: the axis to normalize over, or a tuple of axes that form one row (as ``jax.nn``).
    where: optional boolean mask broadcastable to ``x``.
    temperature: T > 0, a scalar or an array broadcast to the rows (size 1 along
      ``axis``); differentiable.

  Returns:
    Log-weights of ``x``'s shape and dtype. As in ``jax.nn.log_softmax``, a masked entry
    (``where`` False, or a ``-inf`` score) holds ``-inf``, the log of its weight 0, and a
    fully masked row is all ``-inf``; no gradient flows to or through a masked entry (it is
    0, never NaN). Take ``jnp.where(where, log_p, 0.0)`` before forming ``p * log_p``.
    Non-finite scores follow softmax's rules in the log domain: a row with k visible
    ``+inf`` entries gives ``-log k`` on them and ``-inf`` elsewhere; a row with a visible
    NaN is NaN on its visible entries; both have a zero gradient.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.log_softmax(x)
    Array([-0.4076, -1.4076, -2.4076], dtype=float32)
    >>> js.normalizers.log_softmax(x, where=jnp.array([True, True, False]))
    Array([-0.3133, -1.3133,    -inf], dtype=float32)
    >>> js.normalizers.log_softmax(jnp.array([jnp.inf, 0.0, jnp.inf]))  # log of 1/2, 0, 1/2
    Array([-0.6931,    -inf, -0.6931], dtype=float32)

  References:
    J. S. Bridle, 1990, "Probabilistic Interpretation of Feedforward Classification
    Network Outputs, with Relationships to Statistical Pattern Recognition".

    P. Blanchard, D. J. Higham & N. J. Higham, 2021, "Accurately Computing the Log-Sum-Exp
    and Softmax Functions".
  """
  _TEMPERATURE.validate(temperature, "log_softmax")  # (a concrete value: inside, it is traced)
  return _log_softmax_saving_output(x, where, (temperature,), (axis,))


def _log_softmax_rows(x, axis, where, temperature):
  """:func:`log_softmax`'s forward pass."""
  if isinstance(axis, tuple):  # one row over several axes, as jax.nn.log_softmax
    x_rows, where_rows, hp, restore = c.merge_axes(x, axis, where,
                                                   {"temperature": temperature}, "log_softmax")
    return restore(_log_softmax_rows(x_rows, -1, where_rows, hp["temperature"]))
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "log_softmax",
                                      (_TEMPERATURE, temperature))
  # The shared rules (docs/numerics.md) in the log domain: a row with a visible +inf keeps
  # only its k +inf entries (log 1/k each, the log of softmax's limit); a row with a
  # visible NaN is NaN on its visible entries. Both are computed as finite rows.
  posinf = xs == jnp.inf
  inf_row = jnp.any(mask & posinf, axis=ax, keepdims=True)
  nan_row = jnp.any(mask & jnp.isnan(xs), axis=ax, keepdims=True)
  visible = mask
  mask = mask & ~nan_row & (posinf | ~inf_row)
  xs = jnp.where(inf_row | nan_row, jnp.zeros((), xs.dtype), xs)
  z = xs / hp["temperature"]
  m, log_s = _masked_lse_parts(z, mask, ax)
  # (z - m) - log s, not z - LSE: subtracting two large numbers would lose the low bits
  # (x = 1000 has an f32 ulp of 6e-5). A fully masked row has log s = -inf; use 0 there,
  # inside the where, so that its gradient is 0 rather than NaN.
  log_s = jnp.where(jnp.isfinite(log_s), log_s, 0.0)
  out = jnp.where(mask, (z - m) - log_s, -jnp.inf)  # jax.nn's -inf at masked entries
  out = jnp.where(nan_row & visible, jnp.asarray(jnp.nan, out.dtype), out)
  return out.astype(c.output_dtype(jnp.asarray(x).dtype))


def _log_softmax_tangent(out, odd, dx, params, dparams, static):
  r"""``dl = dz - <p, dz>`` with ``z = x/T``, ``p = e^l``, from the output ``l`` alone.

  The temperature's term is ``-(dT/T) (l - <p, l>)`` (``z`` is ``l`` up to a per-row
  constant). Masked entries (``l = -inf``) and the rows holding a visible NaN or ``+inf``
  get a zero tangent.
  """
  (axis,), (temperature,), (dt,) = static, params, dparams
  cd = c.compute_dtype(out.dtype)
  t = c.row_value(temperature, out.ndim, cd)
  zero = jnp.zeros((), cd)
  lv = out.astype(cd)
  vis = (lv > -jnp.inf) & ~odd
  lv = jnp.where(vis, lv, zero)
  p = jnp.where(vis, jnp.exp(lv), zero)

  def centred(v):  # v - <p, v> on the visible entries, 0 elsewhere
    return jnp.where(vis, v - jnp.sum(p * v, axis=axis, keepdims=True), zero)

  parts = []
  if not c.is_zero_tangent(dx):
    parts.append(centred(jnp.where(vis, dx.astype(cd), zero) / t))
  if not c.is_zero_tangent(dt):
    parts.append(-(c.row_value(dt, out.ndim, cd) / t) * centred(lv))
  return sum(parts[1:], parts[0]).astype(out.dtype)


# Reverse mode keeps the output and one flag per row (as jax.nn.log_softmax keeps its output).
_log_softmax_saving_output = c.saving_output(
    lambda x, where, params, static: _log_softmax_rows(x, static[0], where, params[0]),
    _log_softmax_tangent, "log_softmax")


def _smooth_extreme(x, eps, axis, where, keepdims, sign, fn_name):
  """``sign * eps * LSE(sign * x / eps)`` over visible entries (sign=+1 max, -1 min)."""
  # The mask comes from x itself, so a -inf (masked) entry stays masked for smooth_min.
  xs, mask, ax, hp = c.prepare_params(x, axis, where, fn_name, (_EPS, eps))
  out = sign * hp["eps"] * _masked_lse(sign * xs / hp["eps"], mask, ax)
  if not keepdims:
    out = jnp.squeeze(out, axis=ax)
  return out.astype(jnp.asarray(x).dtype)


def smooth_max(x: ArrayLike, eps: ArrayLike = 1.0, axis: int = -1, where: ArrayLike | None = None,
               keepdims: bool = False) -> jax.Array:
  r"""Smooth maximum ``LSE_eps`` (feature N02, kernel class E).

  .. math::
    \mathrm{LSE}_\varepsilon(x) = \varepsilon \log \sum_{j \in V} e^{x_j / \varepsilon},
    \qquad \max_V x \le \mathrm{LSE}_\varepsilon(x) \le \max_V x + \varepsilon \log n

  It tends to the max as eps -> 0 (the tropical limit) and its gradient is
  ``softmax(x / eps)``. Used, for example, as smoothed-max pooling over the instances of a
  bag (D. Zhu et al. 2023, "Provable Multi-instance Deep AUC Maximization with Stochastic
  Pooling", ICML 2023).

  Args:
    x: scores.
    eps: smoothing eps > 0, a scalar or an array broadcast to the rows (size 1 along
      ``axis``); differentiable.
    axis: the axis to reduce over.
    where: optional boolean mask broadcastable to ``x``; False entries are left out.
    keepdims: keep the reduced axis with size 1.

  Returns:
    The row value in ``x``'s dtype (float32 compute for low precision); ``-inf`` for a row
    with no visible entry, with zero gradient.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.smooth_max(x, eps=0.1)  # close to max(x) = 2
    Array(2., dtype=float32)
    >>> js.normalizers.smooth_max(x, eps=1.0)  # = logsumexp(x), at most 2 + log 3
    Array(2.4076, dtype=float32)

  References:
    D. Zhu et al., 2023, "Provable Multi-instance Deep AUC Maximization with Stochastic
    Pooling".

    M. Cuturi & M. Blondel, 2017, "Soft-DTW: a Differentiable Loss Function for Time-Series".
  """
  return _smooth_extreme(x, eps, axis, where, keepdims, 1.0, "smooth_max")


def smooth_min(x: ArrayLike, eps: ArrayLike = 1.0, axis: int = -1, where: ArrayLike | None = None,
               keepdims: bool = False) -> jax.Array:
  r"""Smooth minimum ``-LSE_eps(-x)`` (feature N02, kernel class E).

  .. math::
    \mathrm{softmin}_\varepsilon(x) = -\varepsilon \log \sum_{j \in V} e^{-x_j / \varepsilon}
    \in [\min_V x - \varepsilon \log n, \min_V x]

  Its gradient is ``softmax(-x / eps)``. Arguments as :func:`smooth_max`; ``-inf``
  entries are masked (not the minimum). A row with no visible entry gives ``+inf``, with
  zero gradient. This is the soft minimum of soft-DTW (M. Cuturi & M. Blondel 2017,
  "Soft-DTW: a Differentiable Loss Function for Time-Series", ICML 2017, arXiv
  1703.01353) and of the elastic-distance losses built on it.

  Examples:
    >>> js.normalizers.smooth_min(jnp.array([2.0, 1.0, 0.0]), eps=0.5)  # just below min = 0
    Array(-0.0715, dtype=float32)

  References:
    M. Cuturi & M. Blondel, 2017, "Soft-DTW: a Differentiable Loss Function for Time-Series".
  """
  return _smooth_extreme(x, eps, axis, where, keepdims, -1.0, "smooth_min")
