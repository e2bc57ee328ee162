"""Learned parameters of the tier-3 attention rows: UniAttn's compensation (A22) and
InfSA's per-head discount (A25). The computations are ``jaxsoft.attention``'s
:func:`~jaxsoft.attention.uniattn` and :func:`~jaxsoft.attention.infsa_attention`."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft.attention._tier3 import infsa_attention, uniattn

__all__ = ["UniAttnCompensation", "InfSA"]


def _positive_int(value, name: str, cls: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{cls}: `{name}` must be a positive int, got {value!r}")
  return value


class UniAttnCompensation(nnx.Module):
  r"""UniAttn's linear compensation for the L blocks of a superblock (feature A22) [R].

  Holds :math:`W_c` [L, C, N, Hv] and computes :math:`o_l = A V_l + X_l W_{c,l}` with
  :func:`jaxsoft.attention.uniattn`. :math:`W_c` starts at zero, so before post-training
  the superblock is plain map sharing (exact when the blocks' queries and keys agree).
  From Y. Xiong et al., "UniAttn: Reducing Inference Costs via Softmax Unification for
  Post-Training LLMs" (2025, arXiv 2502.00439).

  Args:
    num_layers: L; in_features: C (the blocks' input width); num_heads: N; head_dim: Hv.
    param_dtype: the dtype of :math:`W_c`.
  """

  def __init__(self, num_layers: int, in_features: int, num_heads: int, head_dim: int, *,
               param_dtype: Any = jnp.float32) -> None:
    shape = tuple(_positive_int(v, n, "UniAttnCompensation") for v, n in (
        (num_layers, "num_layers"), (in_features, "in_features"), (num_heads, "num_heads"),
        (head_dim, "head_dim")))
    self.w_c = nnx.Param(jnp.zeros(shape, param_dtype))

  def __call__(self, attn_map: ArrayLike, values: ArrayLike, x: ArrayLike) -> jax.Array:
    """attn_map [B, N, T, S], values [L, B, S, K, Hv], x [L, B, T, C] -> [L, B, T, N, Hv]."""
    return uniattn(attn_map, values, x, self.w_c[...])


class InfSA(nnx.Module):
  r"""Infinite Self-Attention with a learned per-head discount (feature A25) [R].

  :math:`\gamma_n = \sigma(z_n) \in (0, 1)` (a safe parameterisation: the series converges
  for every z with a normalizer whose rows sum to at most 1, e.g. the default softmax), and
  the output is :func:`jaxsoft.attention.infsa_attention` with that gamma. From G. Roffo
  et al., "Self-Attention And Beyond the Infinite: Towards Linear Transformers with
  Infinite Self-Attention" (2026, arXiv 2603.00175), where gamma is a learnable per-head
  scalar under a sigmoid.

  Args:
    num_heads: N.
    gamma_init: the initial discount, in (0, 1).
    terms, normalize, **attention_kwargs: fixed arguments of ``infsa_attention``
      (``is_causal``, ``normalizer``, ...).
  """

  def __init__(self, num_heads: int, *, gamma_init: float = 0.5, terms: int | None = None,
               normalize: bool = False, **attention_kwargs: Any) -> None:
    _positive_int(num_heads, "num_heads", "InfSA")
    if not 0.0 < float(gamma_init) < 1.0:
      raise ValueError(f"InfSA: `gamma_init` must be in (0, 1), got {gamma_init!r}")
    if "gamma" in attention_kwargs:
      raise ValueError("InfSA: `gamma` is the learned parameter; set `gamma_init`")
    g = float(gamma_init)
    self.gamma_logit = nnx.Param(jnp.full((num_heads,), math.log(g / (1.0 - g)), jnp.float32))
    self.terms = terms
    self.normalize = normalize
    self.attention_kwargs = attention_kwargs

  @property
  def gamma(self) -> jax.Array:
    """The per-head discount [N] in (0, 1)."""
    return jax.nn.sigmoid(self.gamma_logit[...])

  def __call__(self, query: ArrayLike, key: ArrayLike, value: ArrayLike,
               bias: ArrayLike | None = None, mask: ArrayLike | None = None,
               **kwargs: Any) -> jax.Array:
    """q [B, T, N, H], k [B, T, K, H], v [B, T, K, Hv] -> [B, T, N, Hv]."""
    return infsa_attention(query, key, value, bias, mask, gamma=self.gamma, terms=self.terms,
                           normalize=self.normalize, **self.attention_kwargs, **kwargs)
