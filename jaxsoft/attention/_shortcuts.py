"""Attention with one normalizer and its per-head parameter (features A09, A10).

Shortcuts for :func:`dot_product_attention` with a fixed normalizer whose parameter may
be learned per head: :func:`ssmax_attention` (SSMax ``s``), :func:`entmax_attention`
(entmax ``alpha``) and :func:`sparsemax_attention`. The learned parameters are held by
``jaxsoft.nn.MultiHeadAttention(learned=...)``, kept in range by
:func:`softplus_to_range`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.attention._api import dot_product_attention
from jaxsoft.attention._checks import check_rank
from jaxsoft.attention._parameters import per_head

__all__ = ["ssmax_attention", "entmax_attention", "sparsemax_attention"]


def _num_heads(q, fn_name: str) -> int:
  return check_rank(q, "q", 4, "[B, T, N, H]", fn_name).shape[2]


def _merge_params(normalizer_params: Mapping[str, Any] | None, extra: dict[str, Any],
                  fn_name: str) -> dict[str, Any]:
  params = dict(normalizer_params or {})
  for k in extra:
    if k in params:
      raise ValueError(f"{fn_name}: `{k}` is given both as an argument and in `normalizer_params`")
  params.update(extra)
  return params


def ssmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, bias: ArrayLike | None = None,
                    mask: ArrayLike | None = None, *, s: ArrayLike = 0.43,
                    normalizer_params: Mapping[str, Any] | None = None, **kwargs: Any) -> jax.Array:
  r"""SSMax attention: softmax scaled by ``s log n``, ``s`` per head (feature A09).

  .. math::
    \mathrm{SSMax}(z)_j = \frac{n^{s z_j}}{\sum_l n^{s z_l}}
      = \mathrm{softmax}\big((s \log n)\, z\big)_j

  on the scaled logits of each query row, with ``n`` the number of keys that row sees
  (causal and padding aware, so query ``i`` of a causal row uses ``n = i + 1``): the
  attention stays peaked as the context grows. A learned ``s`` is kept positive as
  ``s = softplus(z)`` (:func:`softplus_to_range`);
  ``jaxsoft.nn.MultiHeadAttention(normalizer="ssmax", learned=("s",))`` holds it.

  Args:
    q, k, v, bias, mask: as :func:`dot_product_attention`.
    s: a scalar or a per-head vector ``[N]`` (differentiable).
    normalizer_params: other SSMax hyperparameters (e.g. its optional ``bias``).
    **kwargs: other arguments of :func:`dot_product_attention`.

  Returns:
    ``[B, T, N, Hv]`` in ``q``'s dtype, as :func:`dot_product_attention`.

  Examples:
    One query over three keys (scores 2, 1.5, -1): with ``s = 1`` the weights are
    ``softmax(log(3) z)``.

    >>> q, k, v = js.testing.weight_probe(jnp.array([2.0, 1.5, -1.0]))  # output = weights
    >>> js.attention.ssmax_attention(q, k, v, scale=1.0, s=1.0)[0, 0, 0]
    Array([0.6194, 0.3576, 0.0229], dtype=float32)

  References:
    K. M. Nakanishi, 2025, "Scalable-Softmax Is Superior for Attention" (arXiv
    2501.19399).
  """
  n_heads = _num_heads(q, "ssmax_attention")
  params = _merge_params(
      normalizer_params, {"s": per_head(s, n_heads, "s", "ssmax_attention")}, "ssmax_attention")
  return dot_product_attention(q, k, v, bias, mask, normalizer="ssmax", normalizer_params=params,
                               **kwargs)


def entmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, bias: ArrayLike | None = None,
                     mask: ArrayLike | None = None, *, alpha: ArrayLike = 1.5,
                     normalizer_params: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> jax.Array:
  r"""alpha-entmax attention: adaptively sparse weights, ``alpha`` per head (feature A10).

  .. math::
    \alpha\text{-entmax}(z)_j = \big[(\alpha - 1) z_j - \tau\big]_+^{1/(\alpha-1)},
    \quad \tau \text{ such that } \textstyle\sum_j = 1

  on the scaled logits of each query row: ``alpha -> 1`` is softmax, ``alpha = 2``
  sparsemax; keys below the threshold get exactly zero weight. A learned ``alpha`` is
  kept above 1 as ``alpha = 1 + softplus(z)`` (:func:`softplus_to_range` with ``low=1``);
  ``jaxsoft.nn.MultiHeadAttention(normalizer="entmax", learned=("alpha",))`` holds it.
  The gradient with respect to ``alpha`` flows through the normalizer.

  Args:
    q, k, v, bias, mask: as :func:`dot_product_attention`.
    alpha: ``> 1``, a scalar or a per-head vector ``[N]`` (differentiable).
    normalizer_params: other entmax hyperparameters.
    **kwargs: other arguments of :func:`dot_product_attention`.

  Returns:
    ``[B, T, N, Hv]`` in ``q``'s dtype, as :func:`dot_product_attention`.

  Examples:
    One query over three keys (scores 2, 1.5, -1): the last key gets exactly 0.

    >>> q, k, v = js.testing.weight_probe(jnp.array([2.0, 1.5, -1.0]))  # output = weights
    >>> js.attention.entmax_attention(q, k, v, scale=1.0, alpha=1.5)[0, 0, 0]
    Array([0.674, 0.326, 0.   ], dtype=float32)

  References:
    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers"
    (EMNLP 2019, arXiv 1909.00015).

    B. Peters, V. Niculae & A. F. T. Martins, 2019, "Sparse Sequence-to-Sequence Models"
    (ACL 2019; alpha-entmax).
  """
  fn_name = "entmax_attention"
  n_heads = _num_heads(q, fn_name)
  a = concrete(alpha, np.float64)
  if a is not None and (np.any(np.isnan(a)) or np.any(a <= 1.0)):
    raise ValueError(f"{fn_name}: `alpha` must be > 1, got {alpha}")
  params = _merge_params(
      normalizer_params, {"alpha": per_head(alpha, n_heads, "alpha", fn_name)}, fn_name)
  return dot_product_attention(q, k, v, bias, mask, normalizer="entmax", normalizer_params=params,
                               **kwargs)


def sparsemax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, bias: ArrayLike | None = None,
                        mask: ArrayLike | None = None, **kwargs: Any) -> jax.Array:
  r"""Sparsemax attention: the weights are the logits projected onto the simplex (A10).

  .. math:: \mathrm{sparsemax}(z) = \arg\min_{p \in \Delta} \lVert p - z \rVert^2

  on the scaled logits of each query row (feature A10 at ``alpha = 2``): keys far below
  the best get exactly zero weight.

  Args:
    q, k, v, bias, mask: as :func:`dot_product_attention`.
    **kwargs: other arguments of :func:`dot_product_attention`.

  Returns:
    ``[B, T, N, Hv]`` in ``q``'s dtype, as :func:`dot_product_attention`.

  Examples:
    One query over three keys (scores 2, 1.5, -1): sparsemax keeps the first two.

    >>> q, k, v = js.testing.weight_probe(jnp.array([2.0, 1.5, -1.0]))  # output = weights
    >>> js.attention.sparsemax_attention(q, k, v, scale=1.0)[0, 0, 0]
    Array([0.75, 0.25, 0.  ], dtype=float32)

  References:
    A. F. T. Martins & R. F. Astudillo, 2016, "From Softmax to Sparsemax: A Sparse Model
    of Attention and Multi-Label Classification" (ICML 2016, arXiv 1602.02068).
  """
  return dot_product_attention(q, k, v, bias, mask, normalizer="sparsemax", **kwargs)
