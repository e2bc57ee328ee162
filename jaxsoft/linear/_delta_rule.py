r"""The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet).

Feature A39. The state ``S [K, V]`` is corrected towards ``v_t`` along ``k_t``:

.. math::
  S_t = S_{t-1} + \beta_t k_t (v_t - S_{t-1}^\top k_t)^\top
      = (I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t v_t^\top

(Schlag, Irie & Schmidhuber 2021, "Linear Transformers Are Secretly Fast Weight
Programmers"; the chunked form is the UT / WY representation of Yang, Wang, Zhang, Shen &
Kim 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length").
The gated form decays the state first, ``S_t <- e^{g_t} S_{t-1}`` (Yang, Kautz &
Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule"). ``beta`` in
``(1, 2]`` gives the transition a negative eigenvalue (Grazzi et al. 2025, "Unlocking
State-Tracking in Linear RNNs Through Negative Eigenvalues"). The transition is a
contraction when ``||k_t|| = 1``: normalise ``k`` yourself or pass ``qk_l2norm=True``
(flash-linear-attention's ``use_qk_l2norm_in_kernel``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _dispatch, recurrence

__all__ = ["delta_rule", "delta_rule_step", "gated_delta_rule", "gated_delta_rule_step",
           "l2_normalize"]


def l2_normalize(x: ArrayLike, eps: float = 1e-6) -> jax.Array:
  """Unit-norm vectors along the last axis, ``x / sqrt(sum(x^2) + eps)`` (finite at 0).

  The keys of the delta rules should have unit norm (the transition ``I - beta k k^T`` is then
  a contraction); ``qk_l2norm=True`` applies this to ``q`` and ``k``
  (flash-linear-attention's ``use_qk_l2norm_in_kernel``).

  Args:
    x: ``[..., K]``.
    eps: added to the squared norm (``0`` gives exact unit vectors, and NaN at 0).

  Returns:
    ``x`` scaled to (nearly) unit L2 norm along the last axis, in ``x``'s dtype.

  Examples:
    >>> l2_normalize(jnp.array([3.0, 4.0]), eps=0.0)
    Array([0.6, 0.8], dtype=float32)

  References:
    S. Yang, B. Wang, Y. Zhang, Y. Shen & Y. Kim, 2024, "Parallelizing Linear Transformers
    with the Delta Rule over Sequence Length" (L2-normalised keys and queries).
  """
  x = jnp.asarray(x)
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def _delta(fn_name: str, gated: bool, q, k, v, g, beta, *, scale, initial_state,
           output_final_state, segment_ids, implementation, chunk_size, qk_l2norm):
  call = _dispatch.prepare(fn_name, q, k, v, scale=scale, segment_ids=segment_ids,
                           implementation=implementation, chunk_size=chunk_size, pallas=True)
  B, T, N, K = call.q.shape
  if gated:
    g = _checks.check_gate(g, (B, T, N), "[B, T, N]", fn_name)
  beta = _checks.check_beta(beta, (B, T, N), fn_name)
  S0 = _checks.check_optional_state(initial_state, (B, N, K, call.v.shape[-1]), fn_name,
                                    dtype=call.q.dtype)
  q, k = call.q, call.k
  if qk_l2norm:
    q, k = l2_normalize(q), l2_normalize(k)
  o, S_T = _dispatch.forward(call, q * call.scale, k, call.v, g, beta, S0)
  return _dispatch.finish(o, S_T, call.dtype, output_final_state)


def delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, beta: ArrayLike, *,
               scale: float | None = None, initial_state: ArrayLike | None = None,
               output_final_state: bool = False, segment_ids: ArrayLike | None = None,
               implementation: str | None = None, chunk_size: int = 64,
               qk_l2norm: bool = False) -> Any:
  r"""DeltaNet: linear attention whose state is corrected by the delta rule (feature A39).

  .. math::
    S_t = S_{t-1} + \beta_t k_t (v_t - S_{t-1}^\top k_t)^\top, \qquad
    o_t = S_t^\top (\text{scale} \cdot q_t)

  (Schlag et al. 2021; parallelised over the sequence by Yang et al. 2024). The chunked
  and parallel forms use the UT / WY representation: one unit-lower-triangular inverse per
  chunk (``[chunk, chunk]``; ``[T, T]`` for the parallel form), no loop over tokens.

  Args:
    q, k: ``[B, T, N, K]`` (``k`` normally L2-normalised; see ``qk_l2norm``).
    v: ``[B, T, N, V]``.
    beta: ``[B, T, N]`` write strengths in ``[0, 2]`` (``(1, 2]``: negative eigenvalues).
    scale: multiplies ``q``; default ``K ** -0.5``.
    initial_state: ``[B, N, K, V]`` or None (zeros).
    output_final_state: also return the final state ``[B, N, K, V]`` (in the compute dtype:
      float32, float64 for float64 inputs).
    segment_ids: ``[B, T]`` ints; the state is reset where the id changes.
    implementation: ``"parallel"``, ``"recurrent"``, ``"chunked"`` or None (parallel when
      T <= chunk_size, else chunked); ``"pallas"``: the chunked form by Pallas kernels
      (as in :func:`jaxsoft.linear.simple_gla`; the chunk-local UT inverse is computed in
      XLA before the kernels).
    chunk_size: the chunk length of the chunked form (T need not be a multiple).
    qk_l2norm: L2-normalise ``q`` and ``k`` along K first (:func:`l2_normalize`).

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> k = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2).repeat(2, axis=1)  # the same key twice
    >>> v = jnp.array([1.0, 3.0]).reshape(1, 2, 1, 1)
    >>> o, S = delta_rule(k, k, v, jnp.full((1, 2, 1), 0.5), scale=1.0,
    ...                   output_final_state=True)
    >>> o[0, :, 0, 0]   # 0.5 * 1, then 0.5 + 0.5 * (3 - 0.5)
    Array([0.5 , 1.75], dtype=float32)

    The three forms agree (``[B, T, N, K] = [1, 8, 2, 4]``, two chunks of 4; the options
    are static under ``jax.jit``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(1), (1, 8, 2)))
    >>> fn = jax.jit(delta_rule, static_argnames=("implementation", "chunk_size", "qk_l2norm"))
    >>> o = fn(q, k, v, beta, qk_l2norm=True, implementation="recurrent")
    >>> o.shape
    (1, 8, 2, 4)
    >>> o_chunked = fn(q, k, v, beta, qk_l2norm=True, implementation="chunked", chunk_size=4)
    >>> bool(jnp.allclose(o, o_chunked, atol=1e-5))
    True

  References:
    I. Schlag, K. Irie & J. Schmidhuber, 2021, "Linear Transformers Are Secretly Fast Weight
    Programmers".

    S. Yang, B. Wang, Y. Zhang, Y. Shen & Y. Kim, 2024, "Parallelizing Linear Transformers
    with the Delta Rule over Sequence Length".
  """
  return _delta("delta_rule", False, q, k, v, None, beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                segment_ids=segment_ids, implementation=implementation,
                chunk_size=chunk_size, qk_l2norm=qk_l2norm)


def gated_delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, beta: ArrayLike,
                     *, scale: float | None = None, initial_state: ArrayLike | None = None,
                     output_final_state: bool = False, segment_ids: ArrayLike | None = None,
                     implementation: str | None = None, chunk_size: int = 64,
                     qk_l2norm: bool = False) -> Any:
  r"""Gated DeltaNet: a scalar decay per head, then the delta-rule write (feature A39).

  .. math::
    \tilde S_t = e^{g_t} S_{t-1}, \qquad
    S_t = \tilde S_t + \beta_t k_t (v_t - \tilde S_t^\top k_t)^\top, \qquad
    o_t = S_t^\top (\text{scale} \cdot q_t)

  (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with Delta
  Rule"). The chunked form is the delta rule's UT / WY form with the decays folded in
  (``A_ij = beta_i e^{G_i - G_j} k_i · k_j``), exponents masked before ``exp``.

  Args:
    q, k, v, beta, scale, initial_state, output_final_state, segment_ids, implementation,
      chunk_size, qk_l2norm: as in :func:`delta_rule`.
    g: ``[B, T, N]`` log decays, ``<= 0`` and finite.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> k = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2).repeat(2, axis=1)
    >>> v = jnp.array([1.0, 3.0]).reshape(1, 2, 1, 1)
    >>> g = jnp.log(jnp.full((1, 2, 1), 0.5))
    >>> gated_delta_rule(k, k, v, g, jnp.full((1, 2, 1), 0.5), scale=1.0)[0, :, 0, 0]
    Array([0.5  , 1.625], dtype=float32)

    Without decay (``g = 0``) it is :func:`delta_rule` (``[B, T, N, K] = [1, 8, 2, 4]``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> k = l2_normalize(k); beta = jnp.full((1, 8, 2), 0.5)
    >>> o = jax.jit(gated_delta_rule)(q, k, v, jnp.zeros((1, 8, 2)), beta)
    >>> o.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(o, jax.jit(delta_rule)(q, k, v, beta), atol=1e-5))
    True

  References:
    S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving Mamba2 with
    Delta Rule".

    R. Grazzi, J. Siems, J. K. H. Franke, A. Zela, F. Hutter & M. Pontil, 2025, "Unlocking
    State-Tracking in Linear RNNs Through Negative Eigenvalues" (``beta`` in ``(1, 2]``).
  """
  return _delta("gated_delta_rule", True, q, k, v, g, beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                segment_ids=segment_ids, implementation=implementation,
                chunk_size=chunk_size, qk_l2norm=qk_l2norm)


def _delta_step(fn_name: str, gated: bool, q, k, v, g, beta, state, scale, qk_l2norm):
  (q, k, v, S), dtype, scale = _dispatch.prepare_step(fn_name, q, k, v, state, scale=scale)
  B, N, _ = q.shape
  if gated:
    g = _checks.check_gate(g, (B, N), "[B, N]", fn_name).astype(q.dtype)
  beta = _checks.check_beta(beta, (B, N), fn_name).astype(q.dtype)
  if qk_l2norm:
    q, k = l2_normalize(q), l2_normalize(k)
  o, S = recurrence.step(S, q * scale, k, v, g, beta)
  return o.astype(dtype), S


def delta_rule_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, beta: ArrayLike,
                    state: ArrayLike | None = None, *, scale: float | None = None,
                    qk_l2norm: bool = False) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`delta_rule`: ``S += beta k (v - S^T k)^T``, ``o = S^T (scale q)``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``; beta: ``[B, N]`` in ``[0, 2]``.
    state: ``[B, N, K, V]`` or None (zeros).
    scale: default ``K ** -0.5``.
    qk_l2norm: L2-normalise ``q`` and ``k`` first.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state [B, N, K, V] in the compute dtype)``.

  Examples:
    >>> k = jnp.array([[[1.0, 0.0]]])
    >>> o, S = delta_rule_step(k, k, jnp.ones((1, 1, 1)), jnp.ones((1, 1)), scale=1.0)
    >>> o   # beta = 1 writes v exactly
    Array([[[1.]]], dtype=float32)

  References:
    Schlag et al., 2021; Yang et al., 2024, "Parallelizing Linear Transformers"
    (in full: :func:`delta_rule`).
  """
  return _delta_step("delta_rule_step", False, q, k, v, None, beta, state, scale, qk_l2norm)


def gated_delta_rule_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike,
                          beta: ArrayLike, state: ArrayLike | None = None, *,
                          scale: float | None = None,
                          qk_l2norm: bool = False) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`gated_delta_rule`: ``S = e^g S``, then the delta write.

  Args:
    q, k, v, beta, state, scale, qk_l2norm: as in :func:`delta_rule_step`.
    g: ``[B, N]`` log decays (``<= 0``).

  Returns:
    ``(o, new_state)`` as :func:`delta_rule_step`.

  Examples:
    >>> k = jnp.array([[[1.0, 0.0]]]); S = jnp.full((1, 1, 2, 1), 2.0)
    >>> o, S = gated_delta_rule_step(k, k, jnp.zeros((1, 1, 1)), jnp.log(jnp.full((1, 1), 0.5)),
    ...                              jnp.zeros((1, 1)), S, scale=1.0)
    >>> S[0, 0, :, 0]   # beta = 0: only the decay
    Array([1., 1.], dtype=float32)

  References:
    Yang, Kautz & Hatamizadeh, 2025, "Gated Delta Networks" (in full: :func:`gated_delta_rule`).
  """
  return _delta_step("gated_delta_rule_step", True, q, k, v, g, beta, state, scale, qk_l2norm)
