r"""Linear attention with a feature map (Katharopoulos et al. 2020), optionally normalised.

Feature A30. With a feature map ``φ`` applied to queries and keys,

.. math::
  S_t = S_{t-1} + φ(k_t) v_t^\top, \qquad z_t = z_{t-1} + φ(k_t), \qquad
  o_t = \frac{S_t^\top q'_t}{q'_t \cdot z_t}, \quad q'_t = \text{scale} \cdot φ(q_t)

(Katharopoulos, Vyas, Pappas & Fleuret 2020, "Transformers are RNNs: Fast Autoregressive
Transformers with Linear Attention", ICML 2020). ``normalize=False`` returns the numerator
alone (flash-linear-attention's ``normalize=False``). The normaliser is the same
recurrence with a column of ones appended to ``v``: the state is ``[S | z]``, so all
three forms compute it with the code of the unnormalised one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _dispatch, _features
from jaxsoft.linear import recurrence as _recurrence

__all__ = ["linear_attention", "linear_attention_step", "mapped_attention", "mapped_step",
           "safe_divide"]


def safe_divide(num: jax.Array, den: jax.Array, eps: float) -> jax.Array:
  """``num / den`` with ``|den|`` clamped to at least ``eps`` (its sign kept; 0 counts as +)."""
  den = jnp.where(jnp.abs(den) >= eps, den, jnp.where(den < 0, -eps, eps))
  return num / den


def _split_state(state, shape, normalize: bool, fn_name: str, name: str, dtype):
  """The state as one ``[B, N, K, V(+1)]`` array in ``dtype`` (z as the last column when
  normalising)."""
  if state is None:
    return None
  if not normalize:
    return _checks.check_state(state, shape, fn_name, name, dtype=dtype)
  if not (isinstance(state, (tuple, list)) and len(state) == 2):
    raise ValueError(
        f"{fn_name}: with normalize=True `{name}` must be a pair (S [B, N, K, V], z [B, N, K]),"
        f" got {type(state).__name__}")
  S = _checks.check_state(state[0], shape, fn_name, name, dtype=dtype)
  z = jnp.asarray(state[1])
  if z.shape != shape[:3] or not jnp.issubdtype(z.dtype, jnp.floating):
    raise ValueError(
        f"{fn_name}: `{name}[1]` (z) must be a floating array of shape [B, N, K] = "
        f"{list(shape[:3])}, got {z.shape} {z.dtype}")
  return jnp.concatenate([S, z.astype(dtype)[..., None]], axis=-1)


def _join_state(S: jax.Array, normalize: bool) -> Any:
  return (S[..., :-1], S[..., -1]) if normalize else S


def linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                     feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
                     normalize: bool = True, scale: float | None = None,
                     initial_state: Any = None, output_final_state: bool = False,
                     segment_ids: ArrayLike | None = None, implementation: str | None = None,
                     chunk_size: int = 64, eps: float = 1e-6) -> Any:
  r"""Causal linear attention ``φ(Q)(φ(K)^T V) / φ(Q)φ(K)^T 1`` (feature A30).

  .. math::
    S_t = S_{t-1} + φ(k_t) v_t^\top, \quad z_t = z_{t-1} + φ(k_t), \quad
    o_t = \frac{S_t^\top q'_t}{q'_t \cdot z_t}, \quad q'_t = \text{scale} \cdot φ(q_t)

  (Katharopoulos, Vyas, Pappas & Fleuret 2020, "Transformers are RNNs"). The denominator
  is kept away from 0: its magnitude is clamped to at least ``eps`` (a zero one gives
  ``num / eps``; with ``φ >= 0`` the numerator is then 0 too).

  Args:
    q, k: ``[B, T, N, K]`` (before the feature map).
    v: ``[B, T, N, V]``.
    feature_map: ``"elu1"`` (``elu(x) + 1``, the paper's), ``"relu"``, ``"identity"``,
      ``"taylor"`` (:func:`taylor_features` of order 2, on the unscaled ``q``; see
      :func:`taylor_linear_attention`) or a callable mapping ``[..., K]`` to ``[..., K']``
      (applied to ``q`` and ``k`` in the compute dtype: float32, float64 for float64 inputs).
    normalize: divide by ``q'_t · z_t`` (True) or return the numerator (False).
    scale: multiplies ``φ(q)``; default ``K' ** -0.5`` (it cancels when normalising).
    initial_state: ``S [B, N, K', V]``, or with ``normalize=True`` the pair ``(S, z [B, N, K'])``;
      None: zeros.
    output_final_state: also return the final state (the same form, in the compute dtype).
    segment_ids: ``[B, T]`` ints; the state (and z) is reset where the id changes.
    implementation: ``"parallel"``, ``"recurrent"``, ``"chunked"`` or None (parallel when
      T <= chunk_size, else chunked); ``"pallas"`` raises NotImplementedError.
    chunk_size: the chunk length of the chunked form (T need not be a multiple).
    eps: the smallest denominator magnitude.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> q = k = jnp.zeros((1, 3, 1, 2)); v = jnp.arange(3.0).reshape(1, 3, 1, 1)
    >>> linear_attention(q, k, v)[0, :, 0, 0]   # φ = 1 everywhere: the running mean of v
    Array([0. , 0.5, 1. ], dtype=float32)

    The three forms agree (``[B, T, N, K] = [1, 8, 2, 4]``, two chunks of 4; the options
    are static under ``jax.jit``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> fn = jax.jit(linear_attention, static_argnames=("implementation", "chunk_size"))
    >>> o = fn(q, k, v, implementation="recurrent")
    >>> o.shape
    (1, 8, 2, 4)
    >>> o_chunked = fn(q, k, v, implementation="chunked", chunk_size=4)
    >>> bool(jnp.allclose(o, o_chunked, atol=1e-5))
    True

  References:
    A. Katharopoulos, A. Vyas, N. Pappas & F. Fleuret, 2020, "Transformers are RNNs: Fast
    Autoregressive Transformers with Linear Attention".
  """
  fn_name = "linear_attention"
  phi = _features.resolve(feature_map, fn_name)
  eps = _checks.check_eps(eps, fn_name)
  fq, fk, v, dtype = _features.apply(phi, q, k, v, fn_name)
  return mapped_attention(fn_name, fq, fk, v, dtype, normalize=normalize, scale=scale,
                          initial_state=initial_state, output_final_state=output_final_state,
                          segment_ids=segment_ids, implementation=implementation,
                          chunk_size=chunk_size, eps=eps)


def mapped_attention(fn_name: str, fq, fk, v, dtype, *, normalize: bool, scale, initial_state,
                     output_final_state: bool, segment_ids, implementation, chunk_size,
                     eps: float) -> Any:
  """The body of :func:`linear_attention` on feature-mapped ``fq, fk [B, T, N, K']``
  (shared with the variants whose features depend on more than ``x``: Taylor, cosFormer)."""
  call = _dispatch.prepare(fn_name, fq, fk, v, scale=scale, segment_ids=segment_ids,
                           implementation=implementation, chunk_size=chunk_size)
  B, T, N, K = call.q.shape
  V = call.v.shape[-1]
  S0 = _split_state(initial_state, (B, N, K, V), normalize, fn_name, "initial_state",
                    call.q.dtype)
  vv = jnp.concatenate([call.v, jnp.ones_like(call.v[..., :1])], axis=-1) if normalize else call.v
  o, S_T = _dispatch.forward(call, call.q * call.scale, call.k, vv, None, None, S0)
  if normalize:
    o = safe_divide(o[..., :-1], o[..., -1:], eps)
  return _dispatch.finish(o, _join_state(S_T, normalize), dtype, output_final_state)


def linear_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, state: Any = None, *,
                          feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
                          normalize: bool = True, scale: float | None = None,
                          eps: float = 1e-6) -> tuple[jax.Array, Any]:
  r"""One decoding step of :func:`linear_attention`.

  ``S = S + φ(k) v^T``, ``z = z + φ(k)``, ``o = S^T q' / (q' · z)`` with ``q' = scale φ(q)``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``.
    state: ``S [B, N, K', V]``, or with ``normalize=True`` the pair ``(S, z [B, N, K'])``;
      None: zeros.
    feature_map, normalize, scale, eps: as in :func:`linear_attention`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state)`` (the state in the form it was given).

  Examples:
    >>> o, (S, z) = linear_attention_step(jnp.zeros((1, 1, 2)), jnp.zeros((1, 1, 2)),
    ...                                   jnp.full((1, 1, 1), 3.0))
    >>> o, z
    (Array([[[3.]]], dtype=float32), Array([[[1., 1.]]], dtype=float32))

  References:
    Katharopoulos et al., 2020, "Transformers are RNNs" (in full: :func:`linear_attention`).
  """
  fn_name = "linear_attention_step"
  phi = _features.resolve(feature_map, fn_name)
  eps = _checks.check_eps(eps, fn_name)
  fq, fk, va, dtype = _features.apply(phi, q, k, v, fn_name, step=True)
  return mapped_step(fn_name, fq, fk, va, state, dtype, normalize=normalize, scale=scale,
                     eps=eps)


def mapped_step(fn_name: str, fq, fk, v, state, dtype, *, normalize: bool, scale,
                eps: float) -> tuple[jax.Array, Any]:
  """The body of :func:`linear_attention_step` on feature-mapped ``fq, fk [B, N, K']``."""
  (fq, fk, vf, _), _, scale = _dispatch.prepare_step(fn_name, fq, fk, v, None, scale=scale)
  B, N, K = fq.shape
  V = vf.shape[-1]
  S = _split_state(state, (B, N, K, V), normalize, fn_name, "state", fq.dtype)
  if S is None:
    S = jnp.zeros((B, N, K, V + int(normalize)), fq.dtype)
  vv = jnp.concatenate([vf, jnp.ones_like(vf[..., :1])], axis=-1) if normalize else vf
  o, S = _recurrence.step(S, fq * scale, fk, vv, None, None)
  if normalize:
    o = safe_divide(o[..., :-1], o[..., -1:], eps)
  return o.astype(dtype), _join_state(S, normalize)
