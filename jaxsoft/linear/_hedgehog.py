r"""Hedgehog: a learned feature map for linear attention, distilled from softmax attention.

Feature A30 (Zhang, Bhatia, Kumbong & Ré 2024, "The Hedgehog & the Porcupine: Expressive
Linear Attentions with Softmax Mimicry", ICLR 2024). A per-head linear layer followed by a
softmax over the feature axis, applied to ``±(x W + b)``:

.. math::
  φ(x) = \big[\operatorname{softmax}(x W + b),\ \operatorname{softmax}(-x W - b)\big]
  \in \mathbb{R}^{2F}_{>0},

(the paper's exp feature map ``[e^{xW + b}, e^{-xW - b}]`` normalised over the features,
as in its released code; the normalisation cancels per query in normalised linear
attention only up to a per-key factor, so the two differ as maps but serve the same
role). ``W`` starts at the identity. The map is trained by *attention distillation*: the
cross-entropy between the rows of causal softmax attention ``A_{ij} = softmax_j(s_{ij})``
and those of the linear attention it induces, ``Â_{ij} = φ(q_i)·φ(k_j) / Σ_{l<=i}
φ(q_i)·φ(k_l)``. The functions here are pure: the parameters are a dict of arrays
(``W [N, K, F]``, ``b [N, F]``) that an optax optimiser or a Flax module can own.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["hedgehog_init", "hedgehog_feature_map", "hedgehog_attention_weights",
           "hedgehog_distillation_loss"]


def hedgehog_init(num_heads: int, head_dim: int, feature_dim: int | None = None, *,
                  key: jax.Array | None = None, noise: float = 0.0) -> dict[str, jax.Array]:
  """Initial parameters of a Hedgehog feature map: ``W`` the identity, ``b = 0``.

  ``W [N, K, F]`` is the identity per head (``F = K`` by default; the first ``min(K, F)``
  diagonal entries otherwise), so the map starts as ``[softmax(x), softmax(-x)]``; with a
  ``key``, ``noise · N(0, 1)`` is added to ``W`` and ``b``.

  Args:
    num_heads: ``N >= 1``.
    head_dim: ``K >= 1``, the last axis of ``q`` and ``k``.
    feature_dim: ``F >= 1`` (the map has ``2F`` features); default ``K``.
    key: a PRNG key for the noise, or None (no noise).
    noise: the standard deviation of the noise.

  Returns:
    ``{"W": [N, K, F], "b": [N, F]}``, float32.

  Examples:
    >>> p = hedgehog_init(2, 3)
    >>> p["W"].shape, p["b"].shape
    ((2, 3, 3), (2, 3))

  References:
    M. Zhang, K. Bhatia, H. Kumbong & C. Ré, 2024, "The Hedgehog & the Porcupine: Expressive
    Linear Attentions with Softmax Mimicry".
  """
  fn_name = "hedgehog_init"
  F = head_dim if feature_dim is None else feature_dim
  for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("feature_dim", F)):
    positive_int(value, name, fn_name)
  W = jnp.broadcast_to(jnp.eye(head_dim, F, dtype=jnp.float32), (num_heads, head_dim, F))
  b = jnp.zeros((num_heads, F), jnp.float32)
  if key is not None:
    kw, kb = jax.random.split(key)
    W = W + noise * jax.random.normal(kw, W.shape)
    b = b + noise * jax.random.normal(kb, b.shape)
  return {"W": W, "b": b}


def hedgehog_feature_map(params: dict[str, ArrayLike]) -> Callable[[jax.Array], jax.Array]:
  r"""The Hedgehog feature map: a softmax over learned features of ``±(x W + b)``, per head.

  .. math::
    φ(x) = \big[\operatorname{softmax}(x W_n + b_n),\ \operatorname{softmax}(-x W_n - b_n)\big]

  for ``x [..., N, K]`` in head ``n`` (Zhang et al. 2024). Pass it as ``feature_map=`` to
  :func:`jaxsoft.linear.linear_attention` (which applies it to ``q, k [B, T, N, K]``).

  Args:
    params: ``{"W": [N, K, F], "b": [N, F]}`` (:func:`hedgehog_init`).

  Returns:
    A function ``[..., N, K] -> [..., N, 2F]`` (float32, float64 for float64 ``x`` or
    params; every feature in ``(0, 1)``, each half summing to 1).

  Examples:
    >>> phi = hedgehog_feature_map(hedgehog_init(1, 2))
    >>> phi(jnp.zeros((3, 1, 2)))[0, 0]
    Array([0.5, 0.5, 0.5, 0.5], dtype=float32)

    As the feature map of linear attention (``[B, T, N, K] = [1, 8, 2, 4]``):

    >>> from jaxsoft.linear import linear_attention
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> phi = hedgehog_feature_map(hedgehog_init(2, 4, key=jax.random.key(1), noise=0.1))
    >>> linear_attention(q, k, v, feature_map=phi).shape
    (1, 8, 2, 4)

  References:
    M. Zhang, K. Bhatia, H. Kumbong & C. Ré, 2024, "The Hedgehog & the Porcupine: Expressive
    Linear Attentions with Softmax Mimicry".
  """
  W, b = jnp.asarray(params["W"]), jnp.asarray(params["b"])
  if W.ndim != 3 or b.shape != (W.shape[0], W.shape[2]):
    raise ValueError(f"hedgehog_feature_map: `params` must hold W [N, K, F] and b [N, F], got "
                     f"{W.shape} and {b.shape}")

  def phi(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape[-2:] != W.shape[:2]:
      raise ValueError(f"hedgehog features: `x` must end in [N, K] = {list(W.shape[:2])}, "
                       f"got {x.shape}")
    z = jnp.einsum("...nk,nkf->...nf", x.astype(compute_dtype(x.dtype)), W)
    z = z + b.reshape((1,) * (z.ndim - 2) + b.shape)
    return jnp.concatenate([jax.nn.softmax(z, axis=-1), jax.nn.softmax(-z, axis=-1)], axis=-1)

  return phi


def _causal(T: int) -> jax.Array:
  return jnp.tril(jnp.ones((T, T), bool))


def hedgehog_attention_weights(params: dict[str, ArrayLike], q: ArrayLike, k: ArrayLike,
                               eps: float = 1e-12) -> jax.Array:
  r"""The causal attention map that linear attention with Hedgehog features applies.

  .. math::
    Â_{ij} = \frac{φ(q_i) \cdot φ(k_j)}{\sum_{l \le i} φ(q_i) \cdot φ(k_l)}, \quad j \le i,

  and 0 above the diagonal, ``φ`` :func:`hedgehog_feature_map` ``(params)``.

  Args:
    params: ``{"W": [N, K, F], "b": [N, F]}``.
    q, k: ``[B, T, N, K]``.
    eps: the floor of each row's sum.

  Returns:
    ``Â [B, N, T, T]`` float32 (float64 for float64 inputs), each row summing to 1.

  Examples:
    >>> w = hedgehog_attention_weights(hedgehog_init(1, 2), jnp.zeros((1, 2, 1, 2)),
    ...                                jnp.zeros((1, 2, 1, 2)))
    >>> w[0, 0]
    Array([[1. , 0. ],
           [0.5, 0.5]], dtype=float32)

  References:
    M. Zhang, K. Bhatia, H. Kumbong & C. Ré, 2024, "The Hedgehog & the Porcupine: Expressive
    Linear Attentions with Softmax Mimicry".
  """
  phi = hedgehog_feature_map(params)
  s = jnp.einsum("btnf,bsnf->bnts", phi(jnp.asarray(q)), phi(jnp.asarray(k)))
  s = jnp.where(_causal(s.shape[-1]), s, 0.0)
  return s / jnp.maximum(jnp.sum(s, axis=-1, keepdims=True), eps)


def hedgehog_distillation_loss(params: dict[str, ArrayLike], q: ArrayLike, k: ArrayLike, *,
                               scale: float | None = None, eps: float = 1e-12) -> jax.Array:
  r"""Attention distillation: cross-entropy from causal softmax attention to Hedgehog's map.

  The mean over query rows of the cross-entropy between causal softmax attention and the
  Hedgehog map,

  .. math::
    \mathcal{L} = -\frac{1}{B N T} \sum_{b, n, i} \sum_{j \le i} A_{ij} \log Â_{ij}, \qquad
    A_{ij} = \operatorname{softmax}_{j \le i}(\text{scale}\, q_i \cdot k_j),

  (Zhang et al. 2024). It differs from the mean KL(A ‖ Â) by the teacher's entropy, a
  constant of the parameters. Quadratic in T: a training-time loss on short sequences.

  Args:
    params: ``{"W": [N, K, F], "b": [N, F]}``.
    q, k: ``[B, T, N, K]`` (the teacher's queries and keys).
    scale: the softmax temperature; default ``K ** -0.5``.
    eps: the floor of ``Â`` inside the log.

  Returns:
    A scalar loss, float32 (float64 for float64 ``q, k``).

  Examples:
    >>> q = k = jnp.zeros((1, 3, 1, 2))   # both maps uniform over j <= i
    >>> loss = hedgehog_distillation_loss(hedgehog_init(1, 2), q, k)
    >>> bool(jnp.isclose(loss, (0 + jnp.log(2) + jnp.log(3)) / 3))
    True

  References:
    M. Zhang, K. Bhatia, H. Kumbong & C. Ré, 2024, "The Hedgehog & the Porcupine: Expressive
    Linear Attentions with Softmax Mimicry".
  """
  q, k = jnp.asarray(q), jnp.asarray(k)
  cdt = compute_dtype(jnp.result_type(q.dtype, k.dtype))
  q, k = q.astype(cdt), k.astype(cdt)
  K = q.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  mask = _causal(q.shape[1])
  logits = jnp.where(mask, jnp.einsum("btnk,bsnk->bnts", q, k) * scale, -jnp.inf)
  teacher = jax.nn.softmax(logits, axis=-1)
  student = hedgehog_attention_weights(params, q, k, eps)
  ce = -jnp.sum(jnp.where(mask, teacher * jnp.log(jnp.maximum(student, eps)), 0.0), axis=-1)
  return jnp.mean(ce)
