"""N20 softpick: rectified softmax with no sink (weights may sum to less than 1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, TileRule, identity_score_map, register

__all__ = ["softpick"]


@c.dense_rules
def softpick(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""Softpick (feature N20, kernel class E; Z. M. K. Zuhri, E. H. Fuadi & A. F. Aji 2025).

  From "Softpick: No Attention Sink, No Massive Activations with Rectified Softmax"
  (Zuhri, Fuadi & Aji 2025, arXiv 2504.20966):

  .. math::
    \mathrm{softpick}(x)_i = \frac{\mathrm{ReLU}(e^{x_i} - 1)}{\sum_{j \in V} |e^{x_j} - 1|}
    = \frac{\mathrm{ReLU}(e^{x_i - m} - e^{-m})}{\sum_{j \in V} |e^{x_j - m} - e^{-m}|}

  over the visible entries V. The second (overflow-free) form multiplies numerator and
  denominator by ``e^{-m}``; here ``m = max(max_V x, 0)`` so that neither ``e^{x - m}``
  nor ``e^{-m}`` can overflow (x = +-1000 is fine). Masked entries add 0 to the
  denominator (not ``|0 - 1|``, which a naive ``e^{-inf} - 1`` would add: a classic trap
  with causal masks).

  Properties: exact zeros where ``x_i <= 0``; rows sum to at most 1, to exactly 1 iff no
  visible ``x_j < 0``, and to 0 when all ``x <= 0`` ("attend to nothing"); not shift
  invariant. The paper adds eps = 1e-8 to the denominator, which matters only when every
  visible entry is exactly 0; here that 0/0 row is defined as zeros exactly, with no eps
  (so all other rows are exact). Gradient at ``x = 0``: the subgradient 0 of ReLU and of
  ``|.|``.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype (f32 compute); a fully masked row is all zeros with
    zero gradient.

  Tile rule: ``numerator = ReLU(e^{z-m} - e^{-m})`` and ``denominator = |e^{z-m} - e^{-m}|``
  both scale by ``e^{m_old - m_new}`` when the running max changes, so the online (m, l)
  merge is exact. The rule declares ``m_floor = 0``: a driver floors the running max at 0
  (``m = max(m, 0)``, as the function does), since with the plain running max ``e^{-m}``
  overflows float32 once every score seen so far is below about -88.

  Examples:
    >>> w = js.normalizers.softpick(jnp.array([2.0, 1.0, 0.0, -1.0]))
    >>> w  # exact zeros where x <= 0
    Array([0.7311, 0.1966, 0.    , 0.    ], dtype=float32)
    >>> w.sum()  # a negative score still takes mass in the denominator
    Array(0.9277, dtype=float32)
    >>> js.normalizers.softpick(jnp.array([-1.0, -2.0, -3.0]))  # attend to nothing
    Array([0., 0., 0.], dtype=float32)

  References:
    Z. M. K. Zuhri, E. H. Fuadi & A. F. Aji, 2025, "Softpick: No Attention Sink, No Massive
    Activations with Rectified Softmax".
  """
  xs, mask, ax = c.prepare(x, axis, where, "softpick")
  m = jnp.maximum(c.masked_max(xs, mask, ax), 0.0)
  d = jnp.where(mask, jnp.exp(xs - m) - jnp.exp(-m), 0.0)
  # jax.nn.relu has derivative 0 at 0 (jnp.maximum would give 1/2 at the tie).
  w = c.safe_divide(jax.nn.relu(d), jnp.sum(jnp.abs(d), axis=ax, keepdims=True))
  return c.finish(w, mask, jnp.asarray(x).dtype)



def _softpick_numerator(z, m, **_):
  return jax.nn.relu(jnp.exp(z - m) - jnp.exp(-m))


def _softpick_denominator(z, m, **_):
  return jnp.abs(jnp.exp(z - m) - jnp.exp(-m))


SPEC = register(NormalizerSpec(
    name="softpick",
    fn=softpick,
    kernel_class="E",
    catalogue_id="N20",
    sums_to_one=False,
    shift_invariant=False,
    can_be_sparse=True,
    smooth=False,
    tile=TileRule(score_map=identity_score_map, numerator=_softpick_numerator,
                  denominator=_softpick_denominator, m_floor=0.0),
    description="ReLU(e^x - 1) / sum |e^x - 1|",
))
