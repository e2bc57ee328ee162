"""N10 SDM activation: softmax in base ``2 + q`` with the exponent scaled by ``d``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import _ssmax
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["sdm"]

_Q = Param("q", 0.0, low=0.0, sample=3.0, row_broadcast=True)
_D = Param("d", 1.0, low=0.0, high=1.0, sample=0.5, row_broadcast=True)


def _sdm_score_map(x, length, q=0.0, d=1.0, **_):
  """``d log(2 + q) x``: ``(2 + q)^{d x} = e^{d log(2 + q) x}``."""
  return d * jnp.log(2.0 + q) * x


@c.dense_rules
def sdm(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
        q: ArrayLike = 0.0, d: ArrayLike = 1.0) -> jax.Array:
  r"""SDM (Similarity-Distance-Magnitude) activation (feature N10, kernel class E; A. Schmaltz 2025).

  From "Similarity-Distance-Magnitude Activations" and "Similarity-Distance-Magnitude Universal
  Verification" (A. Schmaltz, 2025); q and d can be estimated from data with
  :func:`sdm_similarity` and :func:`sdm_distance_quantile`:

  .. math::
    \mathrm{sdm}(x)_i = \frac{(2 + q)^{d\,x_i}}{\sum_{j \in V} (2 + q)^{d\,x_j}}
    = \mathrm{softmax}\big(d \log(2 + q)\, x\big)_i

  over the visible entries V. ``q >= 0`` (Similarity: in the paper, the count of
  consecutive nearest training matches that were predicted correctly) raises the base,
  ``d`` in [0, 1] (Distance: a quantile of the distance to the training data) scales the
  exponent; both are per example, so pass them as arrays broadcast to the rows. The
  output sharpens monotonically in q and in d; ``d = 0`` is uniform and ``2 + q = e``
  with ``d = 1`` is softmax. Shift invariant (q and d fixed per row). Computed as
  ``e^{c (x_i - max x)}`` normalised, ``c = d log(2 + q)`` (the product after the
  difference, so scaled scores past 1e9 stay exact under ``jit``).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    q: similarity ``q >= 0`` (default 0: base 2); a scalar or an array broadcast to the
      rows; differentiable.
    d: distance quantile in [0, 1] (default 1); a scalar or an array broadcast to the
      rows; differentiable.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1; a row with no visible entry is all
    zeros with zero gradient.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.sdm(x)  # base 2: 4, 2, 1 over 7
    Array([0.5714, 0.2857, 0.1429], dtype=float32)
    >>> js.normalizers.sdm(x, q=8.0)  # a higher similarity sharpens
    Array([0.9009, 0.0901, 0.009 ], dtype=float32)
    >>> js.normalizers.sdm(x, d=0.0)  # no distance credit: uniform
    Array([0.3333, 0.3333, 0.3333], dtype=float32)

  References:
    A. Schmaltz, 2025, "Similarity-Distance-Magnitude Activations" (arXiv 2509.12760).

    A. Schmaltz, 2025, "Similarity-Distance-Magnitude Universal Verification".
  """
  xs, mask, ax, top, hp = c.prepare_params(x, axis, where, "sdm", (_Q, q), (_D, d),
                                           with_max=True)
  # softmax(c x) as e^{c (x - max x)}: not c x - max(c x), which XLA turns into an FMA.
  w = _ssmax.scaled_softmax(xs, mask, ax, _sdm_score_map(1.0, None, **hp), top,
                            nonnegative=_ssmax.known_at_least(0.0, q, d))
  return c.finish(w, mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="sdm",
    fn=sdm,
    kernel_class="E",
    catalogue_id="N10",
    params=(_Q, _D),
    tile=TileRule.softmax(_sdm_score_map),
    description="(2+q)^(d x) / sum (2+q)^(d x)",
))
