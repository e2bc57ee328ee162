"""N27 affine-scaled softmax: ``alpha * softmax(x) + beta``, a per-row scale and bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import row_blocks as blocks
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, identity_score_map, register

__all__ = ["affine_softmax"]

_ALPHA = Param("alpha", 1.0, low=0.0, sample=0.8, row_broadcast=True)
_BETA = Param("beta", None, sample=0.05, row_broadcast=True)


def _bias(beta, alpha, n, shape, axis):
  """``beta`` as a row parameter, or the tied ``(1 - alpha) / n`` when it is None."""
  if beta is None:
    return (1.0 - alpha) / jnp.maximum(n, 1.0)
  return c.row_param(beta, shape, axis, "beta", "affine_softmax", n.dtype)


def _inf_limit(posinf, axis, hparams, visible):
  """The limit as the k visible ``+inf`` logits grow together: softmax tends to 1/k on
  them and 0 elsewhere, so the weights tend to ``alpha/k + beta`` and ``beta`` (the bias
  stays on every visible entry; tied: ``(1 - alpha) / n``, n counting the +inf ones)."""
  shape = posinf.shape
  alpha = hparams.get("alpha", 1.0)
  # The widest float in play (float64 under x64), as the finite rows compute in.
  alpha = c.row_param(alpha, shape, axis, "alpha", "affine_softmax", jnp.result_type(alpha, float))
  n = jnp.sum(visible, axis=axis, keepdims=True).astype(alpha.dtype)
  k = jnp.sum(posinf, axis=axis, keepdims=True).astype(alpha.dtype)
  share = posinf / jnp.maximum(k, 1.0)
  return alpha * share + _bias(hparams.get("beta"), alpha, n, shape, axis)


@c.dense_rules(inf_limit=_inf_limit)
def affine_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                   alpha: ArrayLike = 1.0, beta: ArrayLike | None = None) -> jax.Array:
  r"""Affine-scaled softmax (feature N27, kernel class R; J. Bae et al. 2026).

  From "Affine-Scaled Attention: Towards Flexible and Stable Transformer Attention"
  (J. Bae et al., 2026, arXiv 2602.23057):

  .. math::
    w_i = \alpha\,\mathrm{softmax}(x)_i + \beta, \qquad
    \beta = \frac{1 - \alpha}{n} \text{ when not given}

  over the visible entries of the row (n of them). In the paper alpha and beta are
  input-dependent (computed from the query token): pass them as arrays broadcast to the
  rows, or learn them with :class:`jaxsoft.nn.AffineScaled` (a projection of the query per
  head, in :class:`jaxsoft.nn.MultiHeadAttention` through ``learned=``). The exact parametrisation is not known from the abstract (a reconstruction): the
  default *tied* bias ``(1 - alpha) / n`` keeps rows summing to 1 while interpolating
  between softmax (alpha = 1) and uniform (alpha = 0); a given ``beta`` relaxes the
  normalisation (rows sum to ``alpha + n beta``). alpha = 1 with the tied bias (the
  defaults) is softmax. Shift invariant; weights can be negative (tied bias with
  alpha > 1, or a negative beta).

  Kernel class R: the bias is added to *normalised* weights, so a blockwise pass needs the
  row's softmax statistics (m, l) first; blockwise attention (``xla_chunked``,
  ``pallas``) runs a statistics pass over the key blocks, then a pointwise pass (in
  attention ``o = alpha (A V) + beta sum_j v_j``). ``+inf`` logits take the formula's
  limit: with k visible ``+inf`` entries, ``alpha/k + beta`` on each of them and ``beta``
  on the other visible entries (softmax's own limit, 1/k and 0, scaled and shifted).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are not counted in n.
    alpha: scale ``alpha >= 0`` (default 1); a scalar or an array broadcast to the rows.
    beta: bias; ``None`` (default) ties it to ``(1 - alpha) / n``; a scalar or an array
      broadcast to the rows.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros with zero
    gradient.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.affine_softmax(x, alpha=0.5)  # halfway to uniform, sums to 1
    Array([0.4993, 0.289 , 0.2117], dtype=float32)
    >>> js.normalizers.affine_softmax(x, alpha=0.5, beta=0.1)  # free bias: sums to 0.8
    Array([0.4326, 0.2224, 0.145 ], dtype=float32)

  References:
    J. Bae et al., 2026, "Affine-Scaled Attention: Towards Flexible and Stable Transformer
    Attention".
  """
  _BETA.validate(beta, "affine_softmax")
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "affine_softmax", (_ALPHA, alpha))
  b = _bias(beta, hp["alpha"], c.visible_count(mask, ax, xs.dtype), xs.shape, ax)
  p = c.exp_normalize(xs, mask, ax)
  return c.finish(hp["alpha"] * p + b, mask, jnp.asarray(x).dtype)


def _derive(stats, length, alpha=1.0, beta=None, **_):
  offset = (1.0 - alpha) / jnp.maximum(length, 1.0) if beta is None else beta
  return {**blocks.softmax_derived(*stats), "offset": offset}


def _numerator(z, m, alpha=1.0, row_max=0.0, row_sum=1.0, offset=0.0, **_):
  return alpha * blocks.softmax_of(z, row_max, row_sum) + offset


# blockwise: softmax's (m, l) first, then the pointwise alpha p + beta (a class-P pass)
ROW_RULE = blocks.row_stats_rule(
    (blocks.SOFTMAX,), _derive,
    TileRule(score_map=identity_score_map, numerator=_numerator, kernel_class="P"))

SPEC = register(NormalizerSpec(
    name="affine_softmax",
    fn=affine_softmax,
    kernel_class="R",
    catalogue_id="N27",
    sums_to_one=False,
    at_most_one=False,
    nonnegative=False,
    length_dependent=True,
    params=(_ALPHA, _BETA),
    row_stats=ROW_RULE,
    description="alpha softmax(x) + beta, beta = (1 - alpha)/n by default",
))
