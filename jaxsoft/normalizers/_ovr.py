"""N33 one-vs-rest activations: the logistic sigmoid and the Gumbel CDF, elementwise (class P).

Each class (key) is scored on its own, with no competition between entries: the Jacobian
is diagonal and rows need not sum to 1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, TileRule, identity_score_map, register

__all__ = ["ovr_sigmoid", "gumbel_cdf"]

# Below this the Gumbel CDF exp(-e^{-x}) is 0 in float64 too (e^{80} = 5.5e34), and
# clamping keeps e^{-x} finite, so its gradient e^{-x} exp(-e^{-x}) is 0, not inf * 0.
_GUMBEL_FLOOR = -80.0


def gumbel_cdf_map(x):
  """``exp(-exp(-x))`` elementwise, with a finite gradient down to ``x = -inf``."""
  return jnp.exp(-jnp.exp(-jnp.maximum(x, _GUMBEL_FLOOR)))


@c.dense_rules(inf_limit=1.0)
def ovr_sigmoid(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""One-vs-rest sigmoid ``sigma(x_i)`` (feature N33, kernel class P).

  .. math::
    w_i = \sigma(x_i) = \frac{1}{1 + e^{-x_i}}

  The output of independent binary (one-vs-rest) classifiers, as in "Multi-Binary
  Classification" losses that drop softmax's inter-class competition, e.g. the
  keyword-spotting model of the PCOV-KWS paper, and the sigmoid head of LM quality
  estimation; its loss is ``optax.sigmoid_binary_cross_entropy``. No bias (compare
  :func:`sigmoid`, whose default bias is ``-log n``), no normalisation: several entries
  can exceed 1/2 at once. Weights in (0, 1); ``sigma'(x) = sigma (1 - sigma) <= 1/4``.

  Args:
    x: scores (logits).
    axis: the row axis (used for the mask and validation only).
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype; a fully masked row is all zeros.

  Examples:
    >>> js.normalizers.ovr_sigmoid(jnp.array([2.0, 1.0, 0.0, -1.0]))  # two above 1/2
    Array([0.8808, 0.7311, 0.5   , 0.2689], dtype=float32)

  References:
    K. P. Alexandridis, J. Deng, A. Nguyen & S. Luo, 2022, "Long-tailed Instance
    Segmentation using Gumbel Optimized Loss".
  """
  xs, mask, _ = c.prepare(x, axis, where, "ovr_sigmoid")
  return c.finish(jax.nn.sigmoid(xs), mask, jnp.asarray(x).dtype)


@c.dense_rules(inf_limit=1.0)
def gumbel_cdf(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""Gumbel-CDF activation ``exp(-exp(-x_i))`` (feature N33, kernel class P; Alexandridis et al. 2022).

  From "Long-tailed Instance Segmentation using Gumbel Optimized Loss" (K. P.
  Alexandridis, J. Deng, A. Nguyen & S. Luo, ECCV 2022):

  .. math::
    w_i = \eta(x_i) = \exp(-e^{-x_i})

  the CDF of the standard Gumbel distribution, used one-vs-rest in place of the sigmoid.
  Monotone, in (0, 1), asymmetric: ``eta(0) = 1/e`` (the sigmoid gives 1/2), a fast
  (doubly exponential) approach to 0 on the left and a slow one to 1 on the right,
  matching the low expected probability of rare classes. In float32 it is exactly 0 below
  about ``x = -4.6``; the gradient ``e^{-x} eta(x)`` is computed with ``x`` clamped at
  -80 so it stays finite (0) down to ``-inf``.

  Args:
    x, axis, where: as in :func:`ovr_sigmoid`.

  Returns:
    Weights of ``x``'s shape and dtype; a fully masked row is all zeros.

  Examples:
    >>> js.normalizers.gumbel_cdf(jnp.array([2.0, 1.0, 0.0, -1.0]))
    Array([0.8734, 0.6922, 0.3679, 0.066 ], dtype=float32)

  References:
    K. P. Alexandridis, J. Deng, A. Nguyen & S. Luo, 2022, "Long-tailed Instance
    Segmentation using Gumbel Optimized Loss".
  """
  xs, mask, _ = c.prepare(x, axis, where, "gumbel_cdf")
  return c.finish(gumbel_cdf_map(xs), mask, jnp.asarray(x).dtype)


def _sigmoid_numerator(z, m, **_):
  return jax.nn.sigmoid(z)


def _gumbel_numerator(z, m, **_):
  return gumbel_cdf_map(z)


_POINTWISE: dict[str, Any] = dict(kernel_class="P", catalogue_id="N33", sums_to_one=False,
                                  at_most_one=False, nonnegative=True, shift_invariant=False,
                                  smooth=True)

SPEC_OVR_SIGMOID = register(NormalizerSpec(
    name="ovr_sigmoid", fn=ovr_sigmoid, can_be_sparse=False,
    tile=TileRule(score_map=identity_score_map, numerator=_sigmoid_numerator),
    description="sigmoid(x), one-vs-rest", **_POINTWISE))

SPEC_GUMBEL_CDF = register(NormalizerSpec(
    name="gumbel_cdf", fn=gumbel_cdf, can_be_sparse=True,
    tile=TileRule(score_map=identity_score_map, numerator=_gumbel_numerator),
    description="exp(-exp(-x)), the Gumbel CDF, one-vs-rest", **_POINTWISE))
