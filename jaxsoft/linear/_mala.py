r"""MALA: magnitude-aware linear attention, normalised additively instead of by division.

Feature A32 (Fan et al. 2025, "Rectifying Magnitude Neglect in Linear Attention", ICCV
2025). Plain normalised linear attention ``φ(q)·φ(k_j) / Σ_l φ(q)·φ(k_l)`` is unchanged when
``q`` is scaled (for a homogeneous ``φ``): the query's magnitude is lost. MALA keeps it: with
``n`` visible keys and ``s_j = c φ(q)·φ(k_j) / n``, ``z = Σ_j s_j``,

.. math::
  o = \Big(1 + \frac{1}{z}\Big) \sum_j s_j v_j - \frac{z}{n} \sum_j v_j
    = \sum_j w_j v_j, \qquad w_j = \Big(1 + \frac{1}{z}\Big) s_j - \frac{z}{n},

so ``Σ_j w_j = 1`` exactly while the weights (which may be negative) spread more as ``|q|``
grows. The paper's model is non-causal (vision); the causal form here is a
reconstruction [R]: query ``t`` sees the ``n_t`` keys of its segment up to ``t`` (plus
those summarised by an initial state), and ``n_t`` replaces ``n``. With all keys visible it
is the paper's formula. It is one linear-attention recurrence on the augmented features
``[φ(k), 1]`` and values ``[v, 1]``: the state ``[[Σ φ(k) v^T, Σ φ(k)], [Σ v^T, n]]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _dispatch, _features
from jaxsoft.linear import recurrence as _recurrence

__all__ = ["mala", "mala_step"]


def _augment(fq, fk, v, scale):
  """Two query sets stacked on the head axis: ``[scale φ(q), 0]`` reads ``(Σ s̃ v, Σ s̃)``
  and ``[0, 1]`` reads ``(Σ v, n)``; keys ``[φ(k), 1]``, values ``[v, 1]``."""
  one = jnp.ones_like(fk[..., :1])
  k2 = jnp.concatenate([fk, one], axis=-1)
  v2 = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
  q_att = jnp.concatenate([fq * scale, jnp.zeros_like(one)], axis=-1)
  q_cnt = jnp.concatenate([jnp.zeros_like(fq), one], axis=-1)
  return q_att, q_cnt, k2, v2


def _combine(att: jax.Array, cnt: jax.Array, eps: float) -> jax.Array:
  """``o = (1 + 1/z) A / n - (z / n) Σv`` from ``att = (A, a)`` and ``cnt = (Σv, n)``,
  ``z = a / n``."""
  n = jnp.maximum(cnt[..., -1:], 1.0)
  z = att[..., -1:] / n
  return (1.0 + 1.0 / (z + eps)) * att[..., :-1] / n - z / n * cnt[..., :-1]


def mala(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
         feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
         scale: float | None = None, initial_state: ArrayLike | None = None,
         output_final_state: bool = False, segment_ids: ArrayLike | None = None,
         implementation: str | None = None, chunk_size: int = 64, eps: float = 1e-6) -> Any:
  r"""Causal magnitude-aware linear attention (feature A32).

  The causal form is a reconstruction [R] (see the module docstring).

  .. math::
    s_{tj} = \frac{c\, φ(q_t) \cdot φ(k_j)}{n_t}, \quad z_t = \sum_{j \le t} s_{tj}, \quad
    o_t = \Big(1 + \frac{1}{z_t + ε}\Big) \sum_{j \le t} s_{tj} v_j
          - \frac{z_t}{n_t} \sum_{j \le t} v_j

  (Fan et al. 2025, "Rectifying Magnitude Neglect in Linear Attention"), ``n_t`` the number
  of keys query ``t`` sees. The weights sum to 1 (up to ``ε``) and may be negative.

  Args:
    q, k: ``[B, T, N, K]``.
    v: ``[B, T, N, V]``.
    feature_map: as in :func:`jaxsoft.linear.linear_attention` (the paper: ``"elu1"``).
    scale: ``c``, multiplies ``φ(q)``; default ``K' ** -0.5`` (it does not cancel here).
    initial_state: ``[B, N, K' + 1, V + 1]``, the augmented state
      ``[[Σ φ(k) v^T, Σ φ(k)], [Σ v^T, n]]``, or None (zeros).
    output_final_state: also return the final augmented state (in the compute dtype:
      float32, float64 for float64 inputs).
    segment_ids, implementation, chunk_size: as in :func:`jaxsoft.linear.linear_attention`.
    eps: ``ε`` in ``1 / (z + ε)``.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> q = k = jnp.zeros((1, 2, 1, 1)); v = jnp.array([1.0, 3.0]).reshape(1, 2, 1, 1)
    >>> fn = jax.jit(mala)
    >>> fn(q, k, v, scale=1.0)[0, :, 0, 0]   # s = 1/n: z = 1, o = 2 mean(v) - mean(v)
    Array([1., 2.], dtype=float32)

    The weights sum to 1, so a constant ``v`` comes back (``[B, T, N, K] = [1, 8, 2, 4]``):

    >>> q, k = jax.random.normal(jax.random.key(0), (2, 1, 8, 2, 4))
    >>> o = fn(q, k, jnp.full((1, 8, 2, 4), 2.5))
    >>> o.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(o, 2.5, rtol=1e-4))
    True

  References:
    Q. Fan et al., 2025, "Rectifying Magnitude Neglect in Linear Attention".
  """
  fn_name = "mala"
  phi = _features.resolve(feature_map, fn_name)
  eps = _checks.check_eps(eps, fn_name)
  fq, fk, v, dtype = _features.apply(phi, q, k, v, fn_name)
  call = _dispatch.prepare(fn_name, fq, fk, v, scale=scale, segment_ids=segment_ids,
                           implementation=implementation, chunk_size=chunk_size)
  B, T, N, K = call.q.shape
  V = call.v.shape[-1]
  S0 = _checks.check_optional_state(initial_state, (B, N, K + 1, V + 1), fn_name,
                                    dtype=call.q.dtype)
  q_att, q_cnt, k2, v2 = _augment(call.q, call.k, call.v, call.scale)
  twice = lambda x: jnp.concatenate([x, x], axis=2)          # the two query sets as 2N heads
  o, S_T = _dispatch.forward(call, jnp.concatenate([q_att, q_cnt], axis=2), twice(k2),
                             twice(v2), None, None,
                             None if S0 is None else jnp.concatenate([S0, S0], axis=1))
  o = _combine(o[:, :, :N], o[:, :, N:], eps)
  return _dispatch.finish(o, S_T[:, :N], dtype, output_final_state)


def mala_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, state: ArrayLike | None = None, *,
              feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
              scale: float | None = None, eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`mala`.

  The augmented state gains ``[φ(k), 1]^T [v, 1]``; then ``o = (1 + 1/(z + ε)) A/n - (z/n) Σv``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``.
    state: ``[B, N, K' + 1, V + 1]`` or None (zeros).
    feature_map, scale, eps: as in :func:`mala`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state in the compute dtype)``.

  Examples:
    >>> o, S = mala_step(jnp.zeros((1, 1, 1)), jnp.zeros((1, 1, 1)), jnp.ones((1, 1, 1)))
    >>> o, S[0, 0]
    (Array([[[1.]]], dtype=float32), Array([[1., 1.],
           [1., 1.]], dtype=float32))

  References:
    Fan et al., 2025, "Rectifying Magnitude Neglect in Linear Attention" (in full: :func:`mala`).
  """
  fn_name = "mala_step"
  phi = _features.resolve(feature_map, fn_name)
  eps = _checks.check_eps(eps, fn_name)
  fq, fk, va, dtype = _features.apply(phi, q, k, v, fn_name, step=True)
  (fq, fk, vf, _), _, scale = _dispatch.prepare_step(fn_name, fq, fk, va, None, scale=scale)
  B, N, K = fq.shape
  V = vf.shape[-1]
  S = _checks.check_optional_state(state, (B, N, K + 1, V + 1), fn_name, "state",
                                   dtype=fq.dtype)
  if S is None:
    S = jnp.zeros((B, N, K + 1, V + 1), fq.dtype)
  q_att, q_cnt, k2, v2 = _augment(fq, fk, vf, scale)
  att, S_new = _recurrence.step(S, q_att, k2, v2, None, None)
  cnt = jnp.einsum("bnkv,bnk->bnv", S_new, q_cnt)
  return _combine(att, cnt, eps).astype(dtype), S_new
