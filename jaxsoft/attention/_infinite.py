"""Infinite Self-Attention (feature A25): attention propagated along all walks of the token graph.

The Neumann series :math:`\\sum_{t \\ge 1} \\gamma^t A^t V = ((I - \\gamma A)^{-1} - I) V`
of the dense attention map A, truncated or solved. A reconstruction from its paper; dense
(O(T^2) memory per head, O(T^3) time for the exact solve).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.attention._checks import check_rank
from jaxsoft.attention._parameters import per_head
from jaxsoft.attention._uniattn import attention_map
from jaxsoft.normalizers import spec as _spec

__all__ = ["infsa_attention"]

_HI = lax.Precision.HIGHEST


def infsa_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    gamma: ArrayLike, terms: int | None = None, normalize: bool = False,
                    **kwargs: Any) -> jax.Array:
  r"""Infinite Self-Attention: attention propagated along all walks of the tokens (A25) [R].

  With A the dense self-attention map, the discounted Neumann (Katz / PageRank) kernel sums
  the walks of every length t >= 1:

  .. math::
    O = \sum_{t=1}^{\infty} \gamma^{t} A^t V = \big((I - \gamma A)^{-1} - I\big) V
      = \gamma\, (I - \gamma A)^{-1} A V, \qquad
    O_{\text{terms}} = \sum_{t=1}^{\text{terms}} \gamma^{t} A^t V

  The series converges when the spectral radius :math:`\rho(\gamma A) < 1`; for a
  normalizer whose rows sum to at most 1 (softmax, sparsemax, ...) :math:`|\gamma| < 1`
  suffices, and the truncation error is then at most
  :math:`|\gamma|^{\text{terms}+1} / (1 - |\gamma|) \max|V|`. With ``normalize`` the kernel
  is :math:`(1 - \gamma)(I - \gamma A)^{-1} A` instead (the same kernel times
  :math:`(1-\gamma)/\gamma`): for a row-stochastic A it is row-stochastic too (outputs are
  convex combinations of values), and ``gamma=0`` is plain attention :math:`A V`. A causal
  A is lower triangular and so are its powers and the inverse: the result stays causal.
  GQA: each query head propagates along its own map, starting from its key/value head's
  values.

  [R] The paper (G. Roffo et al. 2026) sums
  the series across layers on a ReLU, Frobenius-normalised map (pass such a normalizer to
  match its base); here the series of its kernel :math:`(I - \gamma A)^{-1} - I` is applied
  to one map (softmax by default), truncated or solved exactly. Linear-InfSA (the principal
  eigenvector form) is not reproduced.

  Args:
    query: [B, T, N, H]; key: [B, T, K, H]; value: [B, T, K, Hv] (self-attention: S = T).
    bias, mask: as :func:`dot_product_attention`.
    gamma: the discount, a scalar or per head ``[N]`` (differentiable, e.g. a learned
      ``sigmoid`` of a free parameter) with :math:`\rho(\gamma A) < 1`: |gamma| < 1 for a
      normalizer whose rows sum to at most 1; for any other normalizer (or a callable)
      :math:`|\gamma| \rho(A) < 1`. Both are checked when the values are concrete (not
      under jit or grad, where an invalid gamma gives a meaningless result).
    terms: the number of powers of A summed (an int >= 1), or None for the exact solve
      with ``jnp.linalg.solve`` (O(T^3) per head).
    normalize: use the row-stochastic kernel :math:`(1-\gamma)(I - \gamma A)^{-1} A`.
    **kwargs: ``scale``, ``is_causal``, the sequence lengths, ``local_window_size``,
      ``segment_ids``, ``logits_soft_cap``, ``normalizer``, ``normalizer_params``,
      ``decay_bias``, as :func:`dot_product_attention`.

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside).

  Examples:
    The truncated series approaches the exact solve; the normalised kernel at
    ``gamma = 0`` is attention, and it is row-stochastic (values of 1 give 1).

    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k, v = jnp.cos(q), q
    >>> exact = js.attention.infsa_attention(q, k, v, gamma=0.5, is_causal=True)
    >>> exact.shape
    (1, 4, 2, 8)
    >>> series = js.attention.infsa_attention(q, k, v, gamma=0.5, terms=30, is_causal=True)
    >>> bool(jnp.allclose(series, exact, atol=1e-5))
    True
    >>> plain = js.attention.infsa_attention(q, k, v, gamma=0.0, normalize=True, is_causal=True)
    >>> bool(jnp.allclose(plain, js.attention.dot_product_attention(q, k, v, is_causal=True),
    ...                   atol=1e-6))
    True
    >>> ones = js.attention.infsa_attention(q, k, jnp.ones_like(v), gamma=0.5, normalize=True)
    >>> bool(jnp.allclose(ones, 1.0, atol=1e-5))
    True

  References:
    G. Roffo et al., 2026, "Self-Attention And Beyond the Infinite: Towards Linear
    Transformers with Infinite Self-Attention" (arXiv 2603.00175).

    L. Katz, 1953, "A New Status Index Derived from Sociometric Analysis" (Psychometrika
    18; the discounted walk sum).
  """
  fn = "infsa_attention"
  q = check_rank(query, "query", 4, "[B, T, N, H]", fn)
  v = check_rank(value, "value", 4, "[B, T, K, Hv]", fn)
  if isinstance(gamma, bool):
    raise ValueError(f"{fn}: `gamma` must be a float or a per-head array, got {gamma!r}")
  g = per_head(gamma, q.shape[2], "gamma", fn)  # [] or [N, 1, 1]
  g_np = concrete(g)
  if g_np is not None and not np.all(np.isfinite(g_np)):
    raise ValueError(f"{fn}: `gamma` must be finite, got {gamma!r}")
  if terms is not None and (isinstance(terms, bool) or not isinstance(terms, numbers.Integral)
                            or terms < 1):
    raise ValueError(f"{fn}: `terms` must be an int >= 1 or None, got {terms!r}")
  if not isinstance(normalize, (bool, np.bool_)):
    raise ValueError(f"{fn}: `normalize` must be a bool, got {normalize!r}")
  spec = _spec.resolve(kwargs.get("normalizer", "softmax"))
  bounded = isinstance(spec, _spec.NormalizerSpec) and spec.at_most_one
  if bounded and g_np is not None and not np.all(np.abs(g_np) < 1):
    raise ValueError(f"{fn}: `gamma` must satisfy |gamma| < 1 (spectral radius of gamma*A "
                     f"below 1 for rows summing to at most 1), got {gamma!r}")
  a = attention_map(fn, query, key, bias, mask, kwargs)  # [B, N, T, S]
  B, N, T, S = a.shape
  if S != T:
    raise ValueError(f"{fn}: `key` must have the queries' length T={T} (self-attention), "
                     f"got S={S}")
  if not bounded:
    a_np = concrete(a)
    if a_np is not None and g_np is not None and a_np.size:
      rho = np.max(np.abs(np.linalg.eigvals(np.asarray(a_np, np.float64))), axis=(0, 2))  # [N]
      if not np.all(np.abs(g_np).reshape(-1) * rho < 1):
        raise ValueError(f"{fn}: `gamma` must satisfy |gamma| * rho(A) < 1 for convergence; "
                         f"rho(A) per head = {np.round(rho, 4).tolist()}, got gamma = {gamma!r}")
  g = g.astype(a.dtype)
  g = g.reshape((1,) * (4 - g.ndim) + g.shape)  # [N, 1, 1] -> [1, N, 1, 1], explicitly
  K = v.shape[2]
  cdt = a.dtype
  vn = jnp.repeat(v.astype(cdt), N // K, axis=2)  # query head n reads value head n // G
  vn = jnp.transpose(vn, (0, 2, 1, 3))  # [B, N, T, Hv]

  def apply(y):
    return jnp.einsum("bnts,bnsh->bnth", a, y, precision=_HI)

  first = apply(vn)
  if terms is None:  # sum_{t>=1} gamma^(t-1) A^t V = (I - gamma A)^-1 A V
    base = jnp.linalg.solve(jnp.eye(T, dtype=cdt)[None, None] - g * a, first)
  else:
    def step(_, carry):
      total, power = carry
      power = g * apply(power)
      return total + power, power

    base, _ = lax.fori_loop(1, int(terms), step, (first, first))
  out = ((1.0 - g) if normalize else g) * base
  out_dtype = q.dtype if jnp.issubdtype(q.dtype, jnp.floating) else jnp.float32
  return jnp.transpose(out, (0, 2, 1, 3)).astype(out_dtype)
