"""Regularisers of attention weights: the head-wise attention-entropy penalty of AERO
(feature L17)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["attention_entropy_penalty"]


def attention_entropy_penalty(probs: ArrayLike, threshold: ArrayLike, *,
                              tolerance: float = 0.5,
                              where: ArrayLike | None = None) -> jax.Array:
  r"""Head-wise attention-entropy penalty with a tolerance margin (AERO, feature L17) [R].

  From N. K. Jha & B. Reagen, "AERO: Softmax-Only LLMs for Efficient Private Inference"
  (2024), whose regulariser penalises heads whose attention entropy is extreme ("entropy
  collapse" in deep layers, "entropic overload" in early ones) relative to a learnable
  per-head target. Reconstruction [R]: for attention weights :math:`a` ``[..., H, T, S]``,

  .. math::
    E_h = \frac1T \sum_i -\sum_j a_{ij}\log a_{ij}, \qquad
    \delta_h = \bigl|E_h - \theta_h E_{\max}\bigr|, \qquad
    \mathrm{pen}_h = \delta_h\, \mathbb{1}[\delta_h > \gamma E_{\max}],

  with :math:`E_{\max} = \log S`. Add :math:`\lambda \cdot \mathrm{mean}_h\, \mathrm{pen}_h`
  to the task loss. The penalty is 0 inside the tolerance band and its gradient reaches
  both the weights and :math:`\theta` (keep :math:`\theta \in [0, 1]` by construction,
  e.g. a sigmoid of a free parameter). :math:`0 \log 0 = 0`, with gradient 0 there.

  Args:
    probs: ``[..., H, T, S]`` attention weights (rows over the S keys sum to 1).
    threshold: θ, broadcastable to ``[..., H]``: each head's target entropy as a fraction
      of :math:`\log S`.
    tolerance: γ >= 0, the half-width of the band, as a fraction of :math:`\log S`.
    where: optional mask broadcastable to ``probs``; a query row with no visible key is
      left out of its head's mean (masked keys have weight 0 and add no entropy).

  Returns:
    ``[..., H]`` penalties in float32 (float64 for float64 weights).

  Examples:
    >>> a = jnp.stack([jnp.eye(4), jnp.full((4, 4), 0.25)])[None]  # [1, H=2, 4, 4]
    >>> pen = js.losses.attention_entropy_penalty(a, jnp.array([0.5, 0.5]), tolerance=0.25)
    >>> print(pen / jnp.log(4.0))  # collapsed head and uniform head, both 0.5 log 4 off
    [[0.5 0.5]]

  References:
    N. K. Jha & B. Reagen, 2024, "AERO: Softmax-Only LLMs for Efficient Private Inference".
  """
  fn = "attention_entropy_penalty"
  a = lc.float_input(probs, "probs", fn)
  if a.ndim < 3:
    raise ValueError(f"{fn}: `probs` must be floating [..., H, T, S], got {a.shape} {a.dtype}")
  gamma = lc.nonnegative_float(tolerance, "tolerance", fn)
  dtype = nc.compute_dtype(a.dtype)
  ac = a.astype(dtype)
  rows = jnp.ones(a.shape[:-1], bool)
  if where is not None:
    w = jnp.broadcast_to(jnp.asarray(where, bool), a.shape)
    ac = jnp.where(w, ac, 0.0)
    rows = jnp.any(w, axis=-1)
  pos = (ac > 0) | jnp.isnan(ac)  # a NaN weight makes its row's entropy NaN (never 0)
  safe = jnp.where(pos, ac, 1.0)
  ent = -jnp.sum(jnp.where(pos, safe * jnp.log(safe), 0.0), axis=-1)  # [..., H, T]
  e_head = nc.safe_divide(jnp.sum(jnp.where(rows, ent, 0.0), axis=-1),
                          jnp.sum(rows, axis=-1).astype(dtype))  # [..., H]
  e_max = math.log(a.shape[-1]) if a.shape[-1] > 0 else 0.0
  theta = jnp.asarray(threshold, dtype)
  try:
    shape = jnp.broadcast_shapes(theta.shape, e_head.shape)
  except ValueError:
    raise ValueError(f"{fn}: `threshold` of shape {theta.shape} does not broadcast to the "
                     f"heads {e_head.shape}") from None
  theta, e_head = jnp.broadcast_to(theta, shape), jnp.broadcast_to(e_head, shape)  # explicit
  delta = jnp.abs(e_head - theta * e_max)
  return jnp.where((delta > gamma * e_max) | jnp.isnan(delta), delta, 0.0)
