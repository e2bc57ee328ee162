"""Rotary position embedding, shared by the normalizer block (train.model) and the sparse
self-attention layers (train.layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["rope"]


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  r"""Rotary position embedding (Su et al., 2021) on ``x [B, T, N, H]``.

  Pairs (x_i, x_{i + H/2}) are rotated by the angle ``p · base^{-2i/H}``, so the score
  ``q_p · k_s`` depends only on ``p - s``. Computed in float32.
  """
  half = x.shape[-1] // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions[:, :, None, None].astype(jnp.float32) * freqs[None, None, None]  # [B, T, 1, H/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)
