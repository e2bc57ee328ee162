"""Gated attention output (feature A07): a sigmoid gate on each head's attention output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c

__all__ = ["gated_attention_output"]


def gated_attention_output(attn_out: ArrayLike, x: ArrayLike, w_gate: ArrayLike,
                           b_gate: ArrayLike | None = None) -> jax.Array:
  r"""Gated attention output: a sigmoid gate on each head's attention output (feature A07).

  The "G1" gate of Z. Qiu et al. (2025) sits right after the attention, before the output
  projection:

  .. math:: Y' = Y \odot \sigma(X W_\theta + b_\theta)

  an elementwise, head-specific, query-dependent sigmoid gate computed from the layer
  input ``X`` (the pre-norm hidden state the queries were projected from) and applied to
  the attention output ``Y = SDPA(Q, K, V)`` of each head before the output projection.
  A gate near 0 lets a head output nothing, which removes the need for an attention sink.

  Args:
    attn_out: ``Y``, ``[..., T, N, H]``.
    x: ``X``, ``[..., T, D]``.
    w_gate: ``[D, N, H]`` (elementwise gate) or ``[D, N]`` (one scalar gate per head).
    b_gate: optional bias ``[N, H]`` or ``[N]`` matching ``w_gate``.

  Returns:
    ``Y'`` of ``attn_out``'s shape and dtype (the gate is computed in float32 for
    low-precision inputs).

  Examples:
    One scalar gate per head (``w_gate`` [D, N]): with zero weights the gates are
    ``sigmoid(b)``, 0.5 for head 0 and 0.8808 for head 1.

    >>> y = jnp.ones((1, 3, 2, 4))   # [B, T, N, H]
    >>> x = jnp.ones((1, 3, 5))      # [B, T, D]
    >>> out = js.attention.gated_attention_output(y, x, jnp.zeros((5, 2)), jnp.array([0.0, 2.0]))
    >>> out.shape, out[0, 0, :, 0]
    ((1, 3, 2, 4), Array([0.5   , 0.8808], dtype=float32))

  References:
    Z. Qiu et al., 2025, "Gated Attention for Large Language Models: Non-linearity,
    Sparsity, and Attention-Sink-Free" (arXiv 2505.06708).
  """
  fn_name = "gated_attention_output"
  y = jnp.asarray(attn_out)
  x = jnp.asarray(x)
  w = jnp.asarray(w_gate)
  if y.ndim < 3:
    raise ValueError(f"{fn_name}: `attn_out` must have shape [..., T, N, H], got {y.shape}")
  if x.shape[:-1] != y.shape[:-2]:
    raise ValueError(
        f"{fn_name}: `x` [..., T, D] must match `attn_out` [..., T, N, H] in its leading "
        f"dimensions, got {x.shape} and {y.shape}")
  n, h = y.shape[-2:]
  d = x.shape[-1]
  if w.shape not in ((d, n, h), (d, n)):
    raise ValueError(
        f"{fn_name}: `w_gate` must have shape [D, N, H] = {(d, n, h)} or [D, N] = {(d, n)}, "
        f"got {w.shape}")
  cdt = c.compute_dtype(jnp.result_type(y.dtype, x.dtype, w.dtype))
  g = jnp.tensordot(x.astype(cdt), w.astype(cdt), axes=1)  # [..., T, N, H] or [..., T, N]
  if b_gate is not None:
    b = jnp.asarray(b_gate)
    if b.shape != w.shape[1:]:
      raise ValueError(f"{fn_name}: `b_gate` must have shape {w.shape[1:]}, got {b.shape}")
    g = g + b.astype(cdt).reshape((1,) * (g.ndim - b.ndim) + b.shape)
  g = jax.nn.sigmoid(g)
  if w.ndim == 2:
    g = g[..., None]
  return (y.astype(cdt) * g).astype(y.dtype)
