"""N11 MultiMax: softmax of a piecewise (segmented-ReLU) modulation of the scores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["multimax", "multimax_modulator"]

# t and b are learned per layer (initialised near 0 in the official code): every one a
# row parameter, default 0 (MultiMax = softmax).
_PARAMS = (
    Param("t1", 0.0, sample=0.5, row_broadcast=True),
    Param("t2", 0.0, sample=0.5, row_broadcast=True),
    Param("t3", 0.0, sample=-0.1, row_broadcast=True),
    Param("t4", 0.0, sample=0.1, row_broadcast=True),
    Param("b1", 0.0, sample=-1.0, row_broadcast=True),
    Param("b2", 0.0, sample=1.0, row_broadcast=True),
    Param("b3", 0.0, sample=-2.0, row_broadcast=True),
    Param("b4", 0.0, sample=2.0, row_broadcast=True),
)
_NAMES = tuple(p.name for p in _PARAMS)


def multimax_modulator(x, t1=0.0, t2=0.0, t3=0.0, t4=0.0, b1=0.0, b2=0.0, b3=0.0, b4=0.0):
  r"""MultiMax's segmented-ReLU modulator, elementwise.

  .. math::
    \sigma(x) = x + t_1 [b_1 - x]_+ + t_2 [x - b_2]_+ + t_3 [b_3 - x]_+^2 + t_4 [x - b_4]_+^2

  Examples:
    >>> js.normalizers.multimax_modulator(jnp.array([-2.0, 0.0, 2.0]), t1=0.5, t2=0.5,
    ...                                   b1=-1.0, b2=1.0)
    Array([-1.5,  0. ,  2.5], dtype=float32)

  References:
    Y. Zhou, M. Fritz & M. Keuper, 2024, "MultiMax: Sparse and Multi-Modal Attention
    Learning".
  """
  # t r^2 as (t r) r: with t = 0 (the defaults) r^2 overflows to inf from |x| ~ 1.8e19 in
  # float32 and 0 * inf is NaN; (t r) r overflows only where t r^2 itself does (r >= 1).
  r3 = jax.nn.relu(b3 - x)
  r4 = jax.nn.relu(x - b4)
  return (x + t1 * jax.nn.relu(b1 - x) + t2 * jax.nn.relu(x - b2)
          + (t3 * r3) * r3 + (t4 * r4) * r4)


def _multimax_score_map(x, length, **hp):
  return multimax_modulator(x, **{k: hp.get(k, 0.0) for k in _NAMES})


@c.dense_rules
def multimax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
             t1: ArrayLike = 0.0, t2: ArrayLike = 0.0, t3: ArrayLike = 0.0,
             t4: ArrayLike = 0.0, b1: ArrayLike = 0.0, b2: ArrayLike = 0.0,
             b3: ArrayLike = 0.0, b4: ArrayLike = 0.0) -> jax.Array:
  r"""MultiMax (feature N11, kernel class E; Zhou, Fritz & Keuper, ICML 2024).

  From "MultiMax: Sparse and Multi-Modal Attention Learning" (Y. Zhou, M. Fritz &
  M. Keuper, ICML 2024), in the form of the official code:

  .. math::
    \mathrm{MultiMax}(x) = \mathrm{softmax}(\sigma(x)), \quad
    \sigma(x) = x + t_1 [b_1 - x]_+ + t_2 [x - b_2]_+ + t_3 [b_3 - x]_+^2
    + t_4 [x - b_4]_+^2

  (:func:`multimax_modulator`). Scores inside ``[b_1, b_2]`` (and ``[b_3, b_4]``) are
  left as they are; ``t_1 > 0`` flattens the scores below ``b_1`` and ``t_2 > 0``
  steepens those above ``b_2``, so irrelevant entries lose mass and several large ones
  keep theirs (sparse yet multi-modal). All ``t = 0`` (the defaults) is exactly softmax.
  The map is monotone, so the weights keep the order of the scores, when
  ``1 - t_1 >= 0``, ``1 + t_2 >= 0`` and the quadratic terms do not turn it (``t_3 <= 0``,
  ``t_4 >= 0`` suffice); the function does not enforce it. Not shift invariant (the
  breakpoints are fixed); piecewise smooth, with kinks at ``b_1`` and ``b_2``.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    t1, t2, t3, t4: slopes (learned per layer; default 0); scalars or arrays broadcast to
      the rows; differentiable.
    b1, b2, b3, b4: breakpoints (default 0); scalars or arrays broadcast to the rows.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1; a row with no visible entry is all
    zeros with zero gradient.

  Tile rule: ``z = sigma(x)`` elementwise (class E), then softmax's ``e^{z - m}``.

  Examples:
    >>> x = jnp.array([2.0, 1.8, 0.0, -1.0, -2.0])
    >>> js.normalizers.softmax(x)
    Array([0.4945, 0.4049, 0.0669, 0.0246, 0.0091], dtype=float32)
    >>> js.normalizers.multimax(x, t2=1.0, b2=1.0)  # the two large scores take the mass
    Array([0.573 , 0.3841, 0.0285, 0.0105, 0.0039], dtype=float32)

  References:
    Y. Zhou, M. Fritz & M. Keuper, 2024, "MultiMax: Sparse and Multi-Modal Attention
    Learning".
  """
  given = dict(t1=t1, t2=t2, t3=t3, t4=t4, b1=b1, b2=b2, b3=b3, b4=b4)
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "multimax",
                                      *((p, given[p.name]) for p in _PARAMS))
  w = c.exp_normalize(multimax_modulator(xs, **hp), mask, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="multimax",
    fn=multimax,
    kernel_class="E",
    catalogue_id="N11",
    shift_invariant=False,
    smooth=False,
    params=_PARAMS,
    tile=TileRule.softmax(_multimax_score_map),
    description="softmax(x + t1[b1-x]+ + t2[x-b2]+ + t3[b3-x]+^2 + t4[x-b4]+^2)",
))
