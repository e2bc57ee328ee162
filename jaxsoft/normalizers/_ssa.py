"""N07 SSA: softmax with a query- and position-dependent temperature (selective attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import _ssmax
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["ssa_softmax"]

_ALPHA = Param("alpha", 0.0, sample=-2.0, row_broadcast=True)
_TOKEN = Param("token_temperature", 0.0, sample=0.5, row_broadcast=True)


def _ssa_score_map(x, length, alpha=0.0, token_temperature=0.0, **_):
  """``(tau_tok + 1 + sigmoid(alpha) log n) x``: SSMax's scale with s = sigmoid(alpha)."""
  return _ssmax._scale(length, jax.nn.sigmoid(alpha), None, 1.0 + token_temperature) * x


@c.dense_rules
def ssa_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                alpha: ArrayLike = 0.0, token_temperature: ArrayLike = 0.0) -> jax.Array:
  r"""Selective (SSA) temperature softmax (feature N07, kernel class E; X. Zhang et al. 2024).

  From "Selective Attention: Enhancing Transformer through Principled Context Control"
  (X. Zhang, X. Chang, M. Li, A. Roy-Chowdhury, J. Chen & S. Oymak, NeurIPS 2024):

  .. math::
    w = \mathrm{softmax}(\tau\, x), \qquad
    \tau = \tau_{tok} + \tau_{pos}, \quad \tau_{pos} = 1 + \sigma(\alpha) \log n

  with n the number of visible keys of the row: the query's position i (1-based) under
  causal attention, so the position term is the paper's ``1 + sigma(alpha) log i`` and
  counts padding correctly. The token (query-dependent) part ``tau_tok`` is computed in
  the paper from the query token by a bounded map of a projection; here it is a per-row
  parameter (an array broadcast to the rows), default 0. The paper's value temperature
  rescales the values, not the weights: :class:`jaxsoft.nn.SSA` with
  ``value_temperature=True`` learns it and computes the whole attention. The exact
  parametrisation is reconstructed from the paper's description. ``tau = 1`` (alpha ->
  -inf, ``tau_tok = 0``) is softmax; a larger tau lowers the entropy. Shift invariant.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are not counted in n.
    alpha: position-scale logit (default 0: ``sigma(alpha) = 1/2``); a scalar or an array
      broadcast to the rows (one per head); differentiable.
    token_temperature: ``tau_tok`` (default 0); a scalar or an array broadcast to the rows
      (one per query); differentiable.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1; a row with no visible entry is all
    zeros with zero gradient.

  Tile rule: ``z = tau(n) x`` (known before the key pass: class E), softmax's
  ``e^{z - m}``.

  Examples:
    >>> x = jnp.zeros(64).at[0].set(2.0)
    >>> js.normalizers.softmax(x)[0], js.normalizers.ssa_softmax(x)[0]
    (Array(0.105, dtype=float32), Array(0.8824, dtype=float32))

  References:
    X. Zhang, X. Chang, M. Li, A. Roy-Chowdhury, J. Chen & S. Oymak, 2024, "Selective
    Attention: Enhancing Transformer through Principled Context Control".

    K. M. Nakanishi, 2025, "Scalable-Softmax Is Superior for Attention".
  """
  xs, mask, ax, top, hp = c.prepare_params(x, axis, where, "ssa_softmax", (_ALPHA, alpha),
                                           (_TOKEN, token_temperature), with_max=True)
  n = c.visible_count(mask, ax, xs.dtype)
  # tau >= 1 + tau_tok: known >= 0 for a concrete tau_tok >= -1.
  w = _ssmax.scaled_softmax(xs, mask, ax, _ssa_score_map(1.0, n, **hp), top,
                            nonnegative=_ssmax.known_at_least(-1.0, token_temperature))
  return c.finish(w, mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="ssa_softmax",
    fn=ssa_softmax,
    kernel_class="E",
    catalogue_id="N07",
    length_dependent=True,
    params=(_ALPHA, _TOKEN),
    tile=TileRule.softmax(_ssa_score_map),
    description="softmax((tau_tok + 1 + sigmoid(alpha) log n) x)",
))
