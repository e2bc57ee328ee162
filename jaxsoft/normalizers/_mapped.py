"""Softmax of a mapped score row: the dense form shared by the class-E normalizers whose
tile rule is ``e^{z - m}`` of a score map ``z`` (SDM, MultiMax, IDW, polar)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsoft.normalizers import common as c

__all__ = ["exp_normalize"]


def exp_normalize(z, mask, axis: int, null=None):
  """``e^{z_i} / (sum_{j in V} e^{z_j} [+ e^{null}])`` over the visible entries V.

  ``z`` is finite at masked entries (as :func:`common.prepare` leaves them). The
  stabiliser is the row max of ``z`` over V, floored at the null logit when there is one
  (so ``e^{null - m} <= 1`` cannot overflow, as the tile rule's ``m_floor``); it cancels,
  so it carries no gradient. A row with nothing visible gets zeros.
  """
  m = c.masked_max(z, mask, axis)
  if null is not None:
    m = jnp.maximum(m, jax.lax.stop_gradient(null))
  e = jnp.where(mask, jnp.exp(z - m), 0.0)
  den = jnp.sum(e, axis=axis, keepdims=True)
  if null is not None:
    den = den + jnp.exp(null - m)
  return c.safe_divide(e, den)
