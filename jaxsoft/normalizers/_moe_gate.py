"""N32 dense-to-sparse MoE gate with an activation: softmax(sigmoid(x) / tau)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["moe_gate"]

# tau is learned with the gate in the paper's model; 1 is this library's default.
_TAU = Param("tau", 1.0, low=0.0, low_open=True, sample=0.25, row_broadcast=True)


def _moe_gate_score_map(x, length, tau=1.0, **_):
  """``sigmoid(x) / tau``: the activation between the router's linear layer and softmax."""
  return jax.nn.sigmoid(x) / tau


@c.dense_rules
def _moe_gate(x, axis=-1, where=None, *, tau=1.0):
  return c.score_map_softmax(x, axis, where, "moe_gate", _moe_gate_score_map, (_TAU, tau))


def moe_gate(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
             tau: ArrayLike = 1.0) -> jax.Array:
  r"""Activation dense-to-sparse MoE gate (feature N32, kernel class E; Nguyen, Akbarian & Ho 2024).

  From "Is Temperature Sample Efficient for Softmax Gaussian Mixture of Experts?"
  (H. Nguyen, P. Akbarian & N. Ho, ICML 2024). The dense-to-sparse gate of a mixture of
  experts is ``softmax((W x + b) / tau)``: a temperature tau, annealed from large to
  small, moves the gate from dense to (nearly) sparse. Because that gate depends on
  ``(W, b, tau)`` only through ``(W, b) / tau``, its parameters are tied by a partial
  differential equation and their estimation rates can be as slow as ``O(1/log n)``. The
  paper's fix routes the router's linear output through an activation before the softmax:

  .. math::
    G(x)_i = \mathrm{softmax}_i\big(\sigma(x) / \tau\big), \qquad x = W h + b

  (``x``, the router logits, are this function's input). [R] The paper leaves ``sigma``
  open (any activation whose derivatives satisfy its linear-independence conditions);
  here ``sigma`` is the logistic sigmoid. ``tanh`` gives the same family, since
  ``sigmoid(z) = (1 + tanh(z/2))/2`` and softmax ignores the constant:
  ``softmax(tanh(z/2) / (2 tau))``. The activation breaks the degree-0 homogeneity of the
  plain gate, and it bounds the logits in ``(0, 1/tau)``: every entry keeps a weight of at
  least ``e^{-1/tau}`` times the largest, so the gate is dense for ``tau >= 1`` and only
  becomes sparse as ``tau -> 0``. Sums to 1; not shift invariant.

  Args:
    x: router logits (scores).
    axis: the axis to normalize over (the experts).
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    tau: temperature ``tau > 0`` (default 1); a scalar or an array broadcast to the rows;
      differentiable.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1; a row with no visible entry is all
    zeros with zero gradient. A ``+inf`` logit takes the formula's limit,
    ``sigmoid(+inf) = 1`` (the score ``1/tau``, with zero gradient): it does not take the
    row's mass, the other entries keep theirs. ``-inf`` masks the entry, as everywhere in
    the library.

  Tile rule: ``z = sigmoid(x) / tau`` elementwise (class E), then softmax's ``e^{z - m}``.

  Examples:
    >>> x = jnp.array([3.0, 1.0, -2.0])
    >>> js.normalizers.softmax(x)
    Array([0.8756, 0.1185, 0.0059], dtype=float32)
    >>> js.normalizers.moe_gate(x)  # bounded logits: dense
    Array([0.4473, 0.3584, 0.1944], dtype=float32)
    >>> js.normalizers.moe_gate(x, tau=0.1)[0]  # a low temperature: sparser
    Array(0.9014, dtype=float32)

  References:
    H. Nguyen, P. Akbarian & N. Ho, 2024, "Is Temperature Sample Efficient for Softmax
    Gaussian Mixture of Experts?".
  """
  return _moe_gate(_saturate_posinf(x), axis, where, tau=tau)


def _saturate_posinf(x):
  """``+inf`` replaced by the dtype's largest float, whose sigmoid is exactly 1 with a zero
  derivative: the formula's limit, before the library's +inf rule (all the mass) applies."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return jnp.where(x == jnp.inf, jnp.asarray(jnp.finfo(x.dtype).max, x.dtype), x)


setattr(moe_gate, "_jaxsoft_dense_rules", True)  # noqa: B010 (_moe_gate applies the rules)


SPEC = register(NormalizerSpec(
    name="moe_gate",
    fn=moe_gate,
    kernel_class="E",
    catalogue_id="N32",
    shift_invariant=False,
    params=(_TAU,),
    tile=TileRule.softmax(_moe_gate_score_map),
    description="softmax(sigmoid(x) / tau), the activation dense-to-sparse MoE gate",
))
