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
  r"""SSMax attention with a per-head ``s`` (feature A09; K. M. Nakanishi 2025).

  From "Scalable-Softmax Is Superior for Attention" (Nakanishi 2025, arXiv 2501.19399):

  .. math::
    \mathrm{SSMax}(z)_j = \frac{n^{s z_j}}{\sum_l n^{s z_l}}
      = \mathrm{softmax}\big((s \log n)\, z\big)_j

  on the scaled logits of each query row, with ``n`` the number of keys that row sees
  (causal and padding aware, so query ``i`` of a causal row uses ``n = i + 1``). A
  learned ``s`` is kept positive as ``s = softplus(z)`` (:func:`softplus_to_range`);
  ``jaxsoft.nn.MultiHeadAttention(normalizer="ssmax", learned=("s",))`` holds it.

  Args:
    q, k, v, bias, mask: as :func:`dot_product_attention`.
    s: a scalar or a per-head vector ``[N]`` (differentiable).
    normalizer_params: other SSMax hyperparameters (e.g. its optional ``bias``).
    **kwargs: other arguments of :func:`dot_product_attention`.
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
  r"""alpha-entmax attention with a per-head ``alpha`` (feature A10; Correia et al. 2019).

  From "Adaptively Sparse Transformers" (G. M. Correia, V. Niculae & A. F. T. Martins,
  EMNLP 2019, arXiv 1909.00015):

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
    **kwargs: other arguments of :func:`dot_product_attention`.
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
  r"""Sparsemax attention (feature A10 at ``alpha = 2``; Martins & Astudillo 2016).

  Sparsemax is from A. F. T. Martins & R. F. Astudillo, "From Softmax to Sparsemax: A
  Sparse Model of Attention and Multi-Label Classification" (ICML 2016, arXiv
  1602.02068):

  .. math:: \mathrm{sparsemax}(z) = \arg\min_{p \in \Delta} \lVert p - z \rVert^2

  on the scaled logits of each query row: the Euclidean projection onto the simplex.
  """
  return dot_product_attention(q, k, v, bias, mask, normalizer="sparsemax", **kwargs)
