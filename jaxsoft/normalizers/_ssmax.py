"""N05 SSMax (Scalable-Softmax): softmax with a log-length scale on the scores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["ssmax"]

# s init 0.43: the default of the unofficial port gdevos010/Scalable-Softmax, which says "as
# used in paper" (not verified against the paper). s is learnable per layer/head.
_S = Param("s", 0.43, low=0.0, sample=1.0, row_broadcast=True)
_NPARAM = Param("n", None, low=1.0, sample=64.0, row_broadcast=True)
_BIAS = Param("bias", 0.0, sample=0.25, row_broadcast=True)


def _scale(length, s, n, bias):
  """``s log n + b`` with n the visible count unless given; log(max(n, 1)) keeps an
  empty row (n = 0) finite."""
  nn = length if n is None else n
  return s * jnp.log(jnp.where(nn >= 1.0, nn, 1.0)) + bias


def exp_scaled(v, mask, axis: int, scale, pivot, null=None):
  r"""``e^{c (v - p)}`` over the visible entries, normalised (with the null logit's
  ``e^{c (\nu - p)}`` added to the row sum): ``softmax(c [v, \nu])`` for any per-row
  ``p`` at which ``c v`` (and ``c nu``) is largest, so every exponent is ``<= 0``.

  The product is taken after the difference, not as ``c v - max(c v)``: under ``jit`` XLA
  contracts that into a fused multiply-add, ``fma(c, v, -round(max(c v)))``, whose value
  at the row's argmax is the rounding error of ``c v``, not 0: ``e^{+-1e12}`` at a
  scaled score of 1e20 (zeros or NaN). ``(v - p)`` is taken in halves so that it cannot
  overflow, and ``c = 0`` gives a uniform row even then. ``p`` carries no gradient (it
  cancels). A row with nothing visible gets zeros.
  """
  def exponent(a):
    return 2.0 * (scale * (0.5 * a - 0.5 * pivot))

  e = jnp.where(mask, jnp.exp(jnp.where(mask, exponent(v), 0.0)), 0.0)
  den = jnp.sum(e, axis=axis, keepdims=True)
  if null is not None:
    den = den + jnp.exp(exponent(null))
  return c.safe_divide(e, den)


def known_at_least(bound: float, *values) -> bool:
  """Whether every value is concrete (not traced) and ``>= bound``: what a scale built
  from them is known to be when the function is traced (``>= 0`` skips a row-min pass)."""
  try:
    return all(bool(np.all(np.asarray(v) >= bound)) for v in values)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return False


def scaled_softmax(v, mask, axis: int, scale, top, null=None, *, nonnegative: bool = False):
  """``softmax(scale [v, null])`` over the visible entries (:func:`exp_scaled`), scale per
  row.

  ``top`` is the row's visible max of ``v``, the pivot where ``scale >= 0``. Unless the
  caller knows the scale is ``>= 0`` (``nonnegative``), rows with ``scale < 0`` pivot at
  the row min, computed only when some row needs it; ``v`` holds, at masked entries,
  values of its row's visible ones (as :func:`c.prepare` leaves them), so its plain row
  min is the visible one.
  """
  scale = jnp.asarray(scale)
  if nonnegative:
    pivot = top if null is None else jnp.maximum(top, null)
  else:
    negative = scale < 0
    low = jax.lax.cond(jnp.any(negative),
                       lambda v, top: jnp.min(v, axis=axis, keepdims=True),
                       lambda v, top: top, v, top)
    pivot = jnp.where(negative, low, top)
    if null is not None:
      pivot = jnp.where(negative, jnp.minimum(pivot, null), jnp.maximum(pivot, null))
  return exp_scaled(v, mask, axis, scale, jax.lax.stop_gradient(pivot), null)


@c.dense_rules
def ssmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
          s: ArrayLike = 0.43, n: ArrayLike | None = None, bias: ArrayLike = 0.0) -> jax.Array:
  r"""Scalable-Softmax (feature N05, kernel class E; K. M. Nakanishi 2025, arXiv 2501.19399).

  From "Scalable-Softmax Is Superior for Attention" (Nakanishi 2025):

  .. math::
    \mathrm{SSMax}(x)_i = \frac{n^{s x_i}}{\sum_{j \in V} n^{s x_j}}
    = \mathrm{softmax}\big((s \log n + b)\, x\big)_i

  with n the number of visible entries of the row (for causal attention, row i sees
  n_i = i + 1 keys) and ``b`` the optional bias of the paper's bias variant (off by
  default; the paper reports it helps training but can hurt length generalization). The
  scale *multiplies* the scores: a port that writes ``exp(x - s log n)`` instead is a
  no-op under softmax (a per-row shift). ``s log n = 1`` gives softmax. With the tiny
  default s = 0.43 short rows are flattened: n <= 10 gives a scale below 1.

  Args:
    x: scores.
    s: scale s >= 0 (default 0.43, the unofficial port's "as used in paper" init; treat
      as unverified); a scalar or an array broadcast to the rows; differentiable.
    n: length n >= 1 to use instead of the visible count (e.g. a fixed training length);
      a scalar or an array broadcast to the rows.
    bias: b, added to the scale; a scalar or an array broadcast to the rows.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are not counted in n.

  Returns:
    Weights of ``x``'s shape and dtype, summing to 1 on rows with a visible entry; a row
    with none is all zeros with zero gradient. A one-entry row is ``[1]`` (log 1 = 0).

  The function computes ``e^{c (x_i - max x)}``, ``c = s log n + b``: the product after
  the difference, exact under ``jit`` for scaled scores past 1e9, where ``c x - max(c x)``
  is contracted into a fused multiply-add (which gave zeros or NaN there).

  Tile rule: ``z = (s log n + b) x`` (the per-row scale is known before the key pass, so
  SSMax stays in class E), then softmax's ``e^{z - m}``.

  Examples:
    One needle score of 2 among zeros: softmax's weight on it fades as the row grows,
    SSMax's does not.

    >>> js.normalizers.ssmax(jnp.array([2.0, 0.0, 0.0, 0.0]), s=1.0)
    Array([0.8421, 0.0526, 0.0526, 0.0526], dtype=float32)
    >>> x = jnp.zeros(64).at[0].set(2.0)
    >>> js.normalizers.ssmax(x, s=1.0)[0], js.normalizers.softmax(x)[0]
    (Array(0.9849, dtype=float32), Array(0.105, dtype=float32))

  References:
    K. M. Nakanishi, 2025, "Scalable-Softmax Is Superior for Attention".
  """
  _NPARAM.validate(n, "ssmax")
  xs, mask, ax, top, hp = c.prepare_params(x, axis, where, "ssmax", (_S, s), (_BIAS, bias),
                                           with_max=True)
  nv = None if n is None else c.row_param(n, xs.shape, ax, "n", "ssmax", xs.dtype)
  scale = _scale(c.visible_count(mask, ax, xs.dtype), hp["s"], nv, hp["bias"])
  w = scaled_softmax(xs, mask, ax, scale, top, nonnegative=known_at_least(0.0, s, bias))
  return c.finish(w, mask, jnp.asarray(x).dtype)


def _ssmax_score_map(x, length, s=0.43, n=None, bias=0.0, **_):
  return _scale(length, s, n, bias) * x


SPEC = register(NormalizerSpec(
    name="ssmax",
    fn=ssmax,
    kernel_class="E",
    catalogue_id="N05",
    length_dependent=True,
    params=(_S, _NPARAM, _BIAS),
    tile=TileRule.softmax(_ssmax_score_map),
    description="softmax((s log n + b) x), n = visible keys",
))
