r"""RALA: rank-augmented linear attention (bidirectional, as in the paper's vision model).

Feature A37 (Fan, Huang & He 2025, "Breaking the Low-Rank Dilemma of Linear
Attention", CVPR 2025; the RAVLT backbone). The paper raises the rank of linear attention
from two sides, the KV buffer and the output features. The equations here are a
reconstruction [R] of that description: the keys are re-weighted by how well they match
the mean query (a softmax over tokens, which a single ``K' x V`` buffer cannot express),

.. math::
  α_j = T \cdot \operatorname{softmax}_j\!\big(\bar q \cdot k_j / \sqrt{K}\big), \quad
  \bar q = \tfrac1T \sum_t q_t, \qquad
  KV = \sum_j α_j φ(k_j) v_j^\top, \quad Z = \sum_j α_j φ(k_j),

and the output is multiplied elementwise by a gate computed from the input (``x_i W_g`` in
a layer, passed here as ``gate``): ``y_i = (φ(q_i)^\top KV / φ(q_i)^\top Z) ⊙ gate_i``.
Uniform ``α`` (a mean query orthogonal to every key, or all keys equal) gives
bidirectional linear attention times the gate. It is O(T·K'·V) with no sequential
dependency, so it has one form; the mean query makes it non-causal by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _features, _linear_attention

__all__ = ["rala", "rala_key_weights"]


def rala_key_weights(q: ArrayLike, k: ArrayLike) -> jax.Array:
  r"""RALA's key weights: how well each key matches the mean query (feature A37, [R]).

  .. math::
    α_j = T \operatorname{softmax}_j(\bar q \cdot k_j / \sqrt K), \qquad
    \bar q = \tfrac1T \sum_t q_t,

  per sequence and head, so ``Σ_j α_j = T`` (uniform weights are all 1).

  Args:
    q, k: ``[B, T, N, K]``.

  Returns:
    ``α [B, T, N]`` float32 (float64 for float64 ``q, k``).

  Examples:
    >>> q = jnp.zeros((1, 3, 1, 2)); k = jnp.ones((1, 3, 1, 2))
    >>> rala_key_weights(q, k)[0, :, 0]
    Array([1., 1., 1.], dtype=float32)

  References:
    Q. Fan, H. Huang & R. He, 2025, "Breaking the Low-Rank Dilemma of Linear Attention".
  """
  q, k = jnp.asarray(q), jnp.asarray(k)
  cdt = _checks.compute_dtype_of(q, k)
  q, k = q.astype(cdt), k.astype(cdt)
  T, K = q.shape[1], q.shape[-1]
  q_mean = jnp.mean(q, axis=1, keepdims=True)
  return T * jax.nn.softmax(jnp.sum(q_mean * k, -1) * K ** -0.5, axis=1)


def rala(q: ArrayLike, k: ArrayLike, v: ArrayLike, gate: ArrayLike | None = None, *,
         feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
         eps: float = 1e-6) -> jax.Array:
  r"""Rank-augmented (bidirectional) linear attention (feature A37, [R]).

  .. math::
    y_i = \frac{φ(q_i)^\top \sum_j α_j φ(k_j) v_j^\top}{φ(q_i)^\top \sum_j α_j φ(k_j)}
          \odot \text{gate}_i, \qquad
    α_j = T \operatorname{softmax}_j(\bar q \cdot k_j / \sqrt K)

  (Fan et al. 2025, "Breaking the Low-Rank Dilemma of Linear Attention"; reconstruction,
  see the module docstring).

  Args:
    q, k: ``[B, T, N, K]`` (before the feature map); v: ``[B, T, N, V]``.
    gate: ``[B, T, N, V]`` output gate (``x W_g``), or None (no gate).
    feature_map: as in :func:`jaxsoft.linear.linear_attention`.
    eps: the smallest denominator magnitude (its sign kept).

  Returns:
    ``y [B, T, N, V]`` in the inputs' dtype.

  Examples:
    >>> q = k = jnp.zeros((1, 2, 1, 1)); v = jnp.array([1.0, 3.0]).reshape(1, 2, 1, 1)
    >>> rala(q, k, v, gate=jnp.full((1, 2, 1, 1), 2.0))[0, :, 0, 0]   # 2 * mean(v)
    Array([4., 4.], dtype=float32)

    ``[B, T, N, K] = [1, 8, 2, 4]``; a zero-mean query gives uniform key weights, so RALA is
    then bidirectional linear attention:

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> q = jnp.concatenate([q[:, :4], -q[:, :4]], axis=1)    # mean query 0
    >>> y = rala(q, k, v)
    >>> y.shape
    (1, 8, 2, 4)
    >>> fq, fk = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1
    >>> w = jnp.einsum("btnk,bsnk->bnts", fq, fk)
    >>> plain = jnp.einsum("bnts,bsnv->btnv", w / w.sum(-1, keepdims=True), v)
    >>> bool(jnp.allclose(y, plain, atol=1e-5))
    True

  References:
    Q. Fan, H. Huang & R. He, 2025, "Breaking the Low-Rank Dilemma of Linear Attention".
  """
  fn_name = "rala"
  phi = _features.resolve(feature_map, fn_name)
  eps = _checks.check_eps(eps, fn_name)
  fq, fk, v, dtype = _features.apply(phi, q, k, v, fn_name)
  cdt = _checks.compute_dtype_of(fq, fk, v)
  if gate is not None:
    gate = _checks.check_gate_logits(gate, v.shape, fn_name, "gate", dtype=cdt)
  alpha = rala_key_weights(q, k)[..., None].astype(cdt)
  fq, fk = fq.astype(cdt), fk.astype(cdt)
  kv = jnp.einsum("btnk,btnv->bnkv", alpha * fk, v.astype(cdt))
  z = jnp.einsum("btnk->bnk", alpha * fk)
  y = _linear_attention.safe_divide(jnp.einsum("btnk,bnkv->btnv", fq, kv),
                                    jnp.einsum("btnk,bnk->btn", fq, z)[..., None], eps)
  if gate is not None:
    y = y * gate
  return y.astype(dtype)
