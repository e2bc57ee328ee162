r"""Infinite Self-Attention's learned per-head discount (feature A25) as a Flax NNX module.

The computation is ``jaxsoft.attention``'s :func:`~jaxsoft.attention.infsa_attention`
(or, with ``linear=True``, :func:`~jaxsoft.attention.linear_infsa_attention`); this module
holds its discount :math:`\gamma` per head.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.attention import infsa_attention, linear_infsa_attention

__all__ = ["InfSA"]


class InfSA(nnx.Module):
  r"""Infinite Self-Attention with a learned per-head discount (feature A25) [R].

  .. math::
    O = \sum_{t=1}^{\text{terms}} \gamma_n^{t} A^t V, \qquad
    \gamma_n = \sigma(z_n) \in (0, 1)

  (the exact solve :math:`\gamma_n (I - \gamma_n A)^{-1} A V` when ``terms`` is None), with
  A the attention map of head n: :func:`jaxsoft.attention.infsa_attention` with that
  gamma. The sigmoid is a safe parameterisation: the series converges for every z with a
  normalizer whose rows sum to at most 1 (e.g. the default softmax). As in the paper,
  gamma is a learnable per-head scalar under a sigmoid. With ``linear=True`` it is
  Linear-InfSA instead, :func:`jaxsoft.attention.linear_infsa_attention` with that gamma
  (every token gets :math:`\gamma_n` times the values pooled by the linearised principal
  eigenvector of :math:`\mathrm{ReLU}(Q K^\top / H)`; linear time, not causal).

  Args:
    num_heads: N.
    gamma_init: the initial discount, in (0, 1).
    terms: the number of powers of A summed, or None for the exact solve.
    normalize: the row-stochastic kernel :math:`(1 - \gamma)(I - \gamma A)^{-1} A`.
    linear: Linear-InfSA (``terms`` and ``normalize`` must then keep their defaults).
    iterations: Linear-InfSA's number of linearised power steps (``linear=True`` only).
    **attention_kwargs: further fixed arguments of ``infsa_attention`` (``is_causal``,
      ``normalizer``, ...) or of ``linear_infsa_attention`` (``key_value_seq_lengths``,
      ``scale``, ``eps``).

  Examples:
    >>> mod = js.nn.InfSA(2, gamma_init=0.25, terms=4, is_causal=True)
    >>> mod.gamma
    Array([0.25, 0.25], dtype=float32)
    >>> q = k = v = jnp.ones((1, 3, 2, 4))                 # [B, T, N, H]
    >>> apply = nnx.jit(lambda mod, q, k, v: mod(q, k, v))
    >>> apply(mod, q, k, v).shape
    (1, 3, 2, 4)
    >>> lin = js.nn.InfSA(2, gamma_init=0.25, linear=True)
    >>> bool(jnp.allclose(apply(lin, q, k, v), 0.25))           # 0.25 x the pooled value (1)
    True

  References:
    G. Roffo et al., 2026, "Self-Attention And Beyond the Infinite: Towards Linear
    Transformers with Infinite Self-Attention" (arXiv 2603.00175).
  """

  def __init__(self, num_heads: int, *, gamma_init: float = 0.5, terms: int | None = None,
               normalize: bool = False, linear: bool = False, iterations: int | None = None,
               **attention_kwargs: Any) -> None:
    positive_int(num_heads, "num_heads", "InfSA")
    if not isinstance(linear, bool):
      raise ValueError(f"InfSA: `linear` must be a bool, got {linear!r}")
    if linear and (terms is not None or normalize):
      raise ValueError("InfSA: `terms` and `normalize` are for the Neumann form; with "
                       f"linear=True leave them unset, got terms={terms!r}, "
                       f"normalize={normalize!r}")
    if iterations is not None:
      if not linear:
        raise ValueError(f"InfSA: `iterations` is for linear=True only, got {iterations!r}")
      positive_int(iterations, "iterations", "InfSA")
    if not 0.0 < float(gamma_init) < 1.0:
      raise ValueError(f"InfSA: `gamma_init` must be in (0, 1), got {gamma_init!r}")
    if "gamma" in attention_kwargs:
      raise ValueError("InfSA: `gamma` is the learned parameter; set `gamma_init`")
    g = float(gamma_init)
    self.gamma_logit = nnx.Param(jnp.full((num_heads,), math.log(g / (1.0 - g)), jnp.float32))
    self.terms = terms
    self.normalize = normalize
    self.linear = linear
    self.iterations = 1 if iterations is None else iterations
    self.attention_kwargs = attention_kwargs

  @property
  def gamma(self) -> jax.Array:
    """The per-head discount [N] in (0, 1)."""
    return jax.nn.sigmoid(self.gamma_logit[...])

  def __call__(self, query: ArrayLike, key: ArrayLike, value: ArrayLike,
               bias: ArrayLike | None = None, mask: ArrayLike | None = None,
               **kwargs: Any) -> jax.Array:
    """q [B, T, N, H], k [B, T, K, H], v [B, T, K, Hv] -> [B, T, N, Hv] (``bias`` and
    ``mask`` are for the Neumann form)."""
    if self.linear:
      if bias is not None or mask is not None:
        raise ValueError("InfSA: `bias` and `mask` are not used by linear=True (pad with "
                         "`key_value_seq_lengths`)")
      return linear_infsa_attention(query, key, value, gamma=self.gamma,
                                    iterations=self.iterations, **self.attention_kwargs,
                                    **kwargs)
    return infsa_attention(query, key, value, bias, mask, gamma=self.gamma, terms=self.terms,
                           normalize=self.normalize, **self.attention_kwargs, **kwargs)
