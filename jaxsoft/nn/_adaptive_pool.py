"""AdaptiveAttentionPool (A53): a set pooled by one learned query, any normalizer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft import pooling
from jaxsoft._validation import positive_int
from jaxsoft.normalizers import spec as _spec

__all__ = ["AdaptiveAttentionPool"]


class AdaptiveAttentionPool(nnx.Module):
  r"""Adaptive attention pooling with a learned query (AdaPool; PMA with one seed) (A53).

  .. math::
    K = x W_K, \quad V = x W_V, \qquad
    z = f\Big(\frac{q K^\top}{\sqrt{d_k}}\Big) V

  with ``q`` a learned ``nnx.Param`` of width d_k, started at 0 so that the untrained
  layer is AvgPool (uniform weights) for any normalizer whose weights are uniform on equal
  scores; :math:`W_K` and :math:`W_V` are optional (identity when off);
  ``f`` any normalizer (:func:`jaxsoft.pooling.adaptive_attention_pool` gives the math, the
  padding contract and the dtypes).

  Args:
    in_features: the width d of the set's vectors.
    key_features: d_k of the key projection (default ``in_features``).
    out_features: the width of the value projection (default ``in_features``).
    use_key_proj: a learned key projection :math:`W_K` (else the keys are ``x``).
    use_value_proj: a learned value projection :math:`W_V` (else the values are ``x``).
    normalizer: a registered name, a NormalizerSpec or a callable.
    normalizer_params: the normalizer's fixed hyperparameters.
    use_bias: biases on the projections.
    param_dtype: the dtype of the parameters.
    rngs: the parameters' random streams.

  Returns:
    Called on ``x [..., N, d]`` with an optional token mask ``where`` broadcastable to
    ``[..., N]``: ``[..., d_v]``; 0 for a set with no visible token.

  Examples:
    >>> layer = js.nn.AdaptiveAttentionPool(4, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (2, 5, 4))
    >>> z = layer(x, where=jnp.arange(5) < 3)                # 3 visible tokens of 5
    >>> z.shape
    (2, 4)
    >>> bool(jnp.allclose(z, x[:, :3].mean(1)))              # query 0 at init: AvgPool
    True

  References:
    G. Brothers, 2025, "Robust Noise Attenuation via Adaptive Pooling of Transformer
    Outputs".

    J. Lee, Y. Lee, J. Kim, A. R. Kosiorek, S. Choi & Y. W. Teh, 2019, "Set Transformer: A
    Framework for Attention-based Permutation-Invariant Neural Networks".
  """

  def __init__(self, in_features: int, *, key_features: int | None = None,
               out_features: int | None = None, use_key_proj: bool = False,
               use_value_proj: bool = False,
               normalizer: str | _spec.NormalizerSpec | Callable[..., Any] = "softmax",
               normalizer_params: Mapping[str, Any] | None = None, use_bias: bool = True,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
    name = type(self).__name__
    d = positive_int(in_features, "in_features", name)
    for flag, fname in ((use_key_proj, "use_key_proj"), (use_value_proj, "use_value_proj")):
      if not isinstance(flag, bool):
        raise ValueError(f"{name}: `{fname}` must be a bool, got {flag!r}")
    dk = d if key_features is None else positive_int(key_features, "key_features", name)
    dv = d if out_features is None else positive_int(out_features, "out_features", name)
    if not use_key_proj and dk != d:
      raise ValueError(f"{name}: `key_features` ({dk}) needs `use_key_proj=True` (the keys "
                       f"are otherwise x, of width {d})")
    if not use_value_proj and dv != d:
      raise ValueError(f"{name}: `out_features` ({dv}) needs `use_value_proj=True` (the "
                       f"values are otherwise x, of width {d})")
    spec = _spec.resolve(normalizer)
    params = dict(normalizer_params or {})
    if isinstance(spec, _spec.NormalizerSpec):
      spec.validate(params)
    self.normalizer = normalizer
    self.normalizer_params = params
    self.query = nnx.Param(jnp.zeros((dk,), param_dtype))
    self.key_proj: nnx.Linear | None = (
        nnx.Linear(d, dk, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        if use_key_proj else None)
    self.value_proj: nnx.Linear | None = (
        nnx.Linear(d, dv, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        if use_value_proj else None)

  def __call__(self, x: ArrayLike, *, where: ArrayLike | None = None) -> jax.Array:
    """``x [..., N, d]`` -> ``[..., d_v]`` pooled over the token axis -2."""
    x = jnp.asarray(x)
    keys = None if self.key_proj is None else self.key_proj(x)
    values = None if self.value_proj is None else self.value_proj(x)
    return pooling.adaptive_attention_pool(
        x, -2, where, query=self.query[...], keys=keys, values=values,
        normalizer=self.normalizer, normalizer_params=self.normalizer_params)
