"""implementation="xla": the dense reference, written for clarity, not speed.

Every other implementation is a faster way to compute exactly this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.attention._masks import MaskStructure
from jaxsoft.normalizers._common import compute_dtype

__all__ = ["dense_logits", "dense_attention"]


def dense_logits(q: ArrayLike, k: ArrayLike, *, scale: float,
                 decay_bias: tuple[ArrayLike, ArrayLike] | None = None,
                 logits_soft_cap: float | None = None, bias: ArrayLike | None = None) -> jax.Array:
  r"""Logits [B, N, T, S] (float32; float64 for float64 inputs) in the order all paths use.

  .. math::
    \ell_{bnij} = c\,\tanh\!\Big(\frac{s\, q_{bin} \cdot k_{bj\kappa(n)}
        + cq_{bin} - ck_{bjn}}{c}\Big) + \mathrm{bias}_{bnij}

  with s the scale, c the soft cap (no tanh when None), the decay terms only with
  ``decay_bias=(cq, ck)``, and kappa(n) = n // (N / K) the key/value head of query
  head n (GQA; jax.nn's grouping).
  """
  q, k = jnp.asarray(q), jnp.asarray(k)
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  cdt = compute_dtype(q.dtype)  # float32 (float64 for float64 inputs)
  qg = q.astype(cdt).reshape(B, T, K, G, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(cdt))
  logits = scale * logits.reshape(B, N, T, k.shape[1])
  if decay_bias is not None:
    cq, ck = jnp.asarray(decay_bias[0], cdt), jnp.asarray(decay_bias[1], cdt)
    logits = logits + (jnp.transpose(cq, (0, 2, 1))[..., :, None]
                       - jnp.transpose(ck, (0, 2, 1))[..., None, :])
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if bias is not None:
    logits = logits + jnp.asarray(bias, cdt)
  return logits


def dense_attention(q, k, v, *, bias, mask, structure: MaskStructure, scale, logits_soft_cap,
                    normalize, decay_bias=None):
  """Dense attention: weights = normalize(logits, visible), out = weights @ v.

  Args:
    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv].
    bias: None or broadcastable to [B, N, T, S]; mask: None or bool, same.
    structure: the mask structure (causal, window, lengths, segments).
    scale: the logit scale; logits_soft_cap: None or the tanh cap.
    normalize: ``normalize(logits, where)`` -> weights [B, N, T, S] (the normalizer with
      its hyperparameters bound); it sees the visibility as ``where`` and counts the
      visible keys of each row itself (length-dependent normalizers).
    decay_bias: None or (cq [B, T, N], ck [B, S, N]).

  Returns:
    [B, T, N, Hv] in q's dtype.
  """
  B, T, N, _ = q.shape
  K = k.shape[2]
  logits = dense_logits(q, k, scale=scale, decay_bias=decay_bias,
                        logits_soft_cap=logits_soft_cap, bias=bias)
  visible = jnp.broadcast_to(structure.dense(), logits.shape)
  if mask is not None:
    visible = visible & mask
  weights = normalize(logits, visible).astype(logits.dtype)
  # exact zeros off the visible set, whatever the normalizer does there
  weights = jnp.where(visible, weights, 0.0)
  weights = weights.reshape(B, K, N // K, T, -1)
  out = jnp.einsum("bkgts,bskh->btkgh", weights, v.astype(logits.dtype))
  return out.reshape(B, T, N, v.shape[-1]).astype(q.dtype)
