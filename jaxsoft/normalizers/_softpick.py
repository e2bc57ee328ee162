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
  nor ``e^{-m}`` can overflow (x = +-1000 is fine). Near 0 the difference would cancel
  (``e^x - 1`` at x = 3e-4 lost 4 digits in float32, and all of them at 1e-30 in
  float64), so it is computed as ``e^{max(x, 0) - m} (1 - e^{-|x|})`` with
  ``1 - e^{-|x|} = -expm1(-|x|)``: nothing cancels or overflows. Masked entries add 0 to
  the denominator (not ``|0 - 1|``, which a naive ``e^{-inf} - 1`` would add: a classic
  trap with causal masks).

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
  (computed as the function computes them, with ``expm1(y) = 2 tanh(y/2) / (1 - tanh(y/2))``
  for ``y <= 0``: Mosaic TPU lowers no expm1) both scale by ``e^{m_old - m_new}`` when
  the running max changes, so the online (m, l) merge is exact. The rule declares
  ``m_floor = 0``: a driver floors the running max at 0 (``m = max(m, 0)``, as the
  function does), since with the plain running max ``e^{-m}`` overflows float32 once
  every score seen so far is below about -88.

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
  xs, mask, ax, top = c.prepare(x, axis, where, "softpick", with_max=True)
  m = jnp.maximum(top, 0.0)
  d = jnp.where(mask, _abs_exp_minus_one(xs, m, jnp.expm1), 0.0)
  w = c.safe_divide(_positive(xs, d), jnp.sum(d, axis=ax, keepdims=True))
  return c.finish(w, mask, jnp.asarray(x).dtype)


def _abs_exp_minus_one(z, m, expm1):
  """``|e^z - 1| e^{-m}`` (m >= max(z, 0)) without cancellation near z = 0.

  ``e^{z-m} - e^{-m}`` loses the digits of ``e^z - 1`` near 0 (all of them below ~1e-8 in
  float32). Instead ``|e^z - 1| = e^{max(z, 0)} (1 - e^{-|z|})``, with ``1 - e^{-|z|} =
  -expm1(-|z|)`` in [0, 1) and ``e^{max(z,0) - m} <= 1``: nothing cancels or overflows.
  Its derivative is ``sign(z) e^{z - m}``, 0 at z = 0 (the subgradient of ``|.|``, as
  documented; ``jnp.abs`` has derivative 1 there, ``ReLU`` has 0).
  """
  a = jax.nn.relu(z) + jax.nn.relu(-z)
  return jnp.exp(jax.nn.relu(z) - m) * -expm1(-a)


def _positive(z, d):
  """``ReLU(e^z - 1) e^{-m}`` from ``d = |e^z - 1| e^{-m}``: d where z > 0, else 0 (with
  derivative 0 at z = 0, the subgradient of ReLU)."""
  return jnp.where(z > 0, d, jnp.zeros_like(d))


def _expm1_nonpositive(y):
  """``expm1(y)`` for ``y <= 0`` as ``2 tanh(y/2) / (1 - tanh(y/2))``: accurate (nothing
  cancels for y <= 0) and made of operations every Pallas backend lowers (Mosaic TPU has
  no expm1)."""
  h = jnp.tanh(0.5 * y)
  return 2.0 * h / (1.0 - h)


def _softpick_denominator(z, m, **_):
  """The tile rule's denominator term ``|e^z - 1| e^{-m}``."""
  return _abs_exp_minus_one(z, m, _expm1_nonpositive)


def _softpick_numerator(z, m, **_):
  """The numerator ``ReLU(e^z - 1) e^{-m}``: the positive part of the denominator's term."""
  return _positive(z, _softpick_denominator(z, m))


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
