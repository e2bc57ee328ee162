r"""CCQ: the query contracted by the running key covariance before the linear-attention read.

Feature A35 (Le, Nguyen, Nguyen & Luu 2026, "Don't Read Everything: A Curvature-Conditioned
Query for Linear Attention"). The softmax log-partition ``f(q) = log Σ_{j<=t} exp(q·k_j)``
expanded at the isotropic point ``q = 0`` is

.. math::
  f(q) ≈ \log t + q \cdot μ_t + \tfrac12 q^\top C_t q, \qquad
  μ_t = \tfrac1t \sum_j k_j, \quad C_t = \tfrac1t \sum_j k_j k_j^\top - μ_t μ_t^\top,

so the curvature of softmax attention at that point is the running key covariance ``C_t``
(exactly: ``∇f(0) = μ_t``, ``∇²f(0) = C_t``). CCQ contracts the query along the directions
where the memory is dense before it reads the state: ``o_t = S_t^\top \tilde q_t``. The
operator and normalisation are not in the abstract; this is a reconstruction [R] with the
first-order operator ``\tilde q = q - λ C_t q`` (of ``(I + λ C_t)^{-1} q``), and ``μ_t, C_t``
kept with the backbone's decay: weights ``w_{tj} = e^{g_{j+1} + ... + g_t}``,
``n_t = Σ_j w_{tj}``, ``μ_t = Σ_j w_{tj} k_j / n_t``, ``C_t = Σ_j w_{tj} k_j k_j^\top / n_t -
μ_t μ_t^\top``. The statistics are one more linear-attention recurrence (keys ``[k, 1]``,
values ``[k, 1]``, state ``[[Σ w k k^T, Σ w k], [Σ w k^T, n]]``), so every form of the
backbone carries over.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _dispatch
from jaxsoft.linear import recurrence as _recurrence

__all__ = ["ccq", "ccq_step", "curvature_query"]


def curvature_query(call, q, k, g, M0) -> tuple[jax.Array, jax.Array]:
  """``(C_t q_t [B, T, N, K], M_T)``: the running (decayed) key covariance applied to each
  query, from the statistics recurrence in ``call``'s form; ``M0``/``M_T`` the statistics
  state ``[B, N, K + 1, K + 1]`` (None: zeros)."""
  one = jnp.ones_like(k[..., :1])
  k1 = jnp.concatenate([k, one], axis=-1)
  q_read = jnp.concatenate([q, jnp.zeros_like(one)], axis=-1)        # reads (Σ w k (k·q), m·q)
  q_count = jnp.concatenate([jnp.zeros_like(q), one], axis=-1)       # reads (m, n)
  two = lambda a, b: jnp.concatenate([a, b], axis=2)                 # stacked on the head axis
  g2 = None if g is None else two(g, g)
  S0 = None if M0 is None else jnp.concatenate([M0, M0], axis=1)   # [B, 2N, K + 1, K + 1]
  o, M_T = _dispatch.forward(call, two(q_read, q_count), two(k1, k1), two(k1, k1), g2, None, S0)
  N = q.shape[2]
  read, count = o[:, :, :N], o[:, :, N:]
  n = count[..., -1:]
  mean = count[..., :-1] / n
  cq = read[..., :-1] / n - mean * (read[..., -1:] / n)
  return cq, M_T[:, :N]


def ccq(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike | None = None,
        beta: ArrayLike | None = None, *, strength: float = 1.0, scale: float | None = None,
        initial_state: Any = None, output_final_state: bool = False,
        segment_ids: ArrayLike | None = None, implementation: str | None = None,
        chunk_size: int = 64) -> Any:
  r"""Curvature-conditioned query: read the state with ``q - λ C_t q`` (feature A35, [R]).

  .. math::
    \tilde q_t = q_t - λ C_t q_t, \qquad o_t = S_t^\top (\text{scale} \cdot \tilde q_t)

  with ``C_t`` the decayed running key covariance (module docstring) and ``S_t`` the
  backbone's state: plain linear attention (no ``g``, no ``beta``), simple GLA (``g``), the
  delta rule (``beta``) or Gated DeltaNet (both). Le et al. 2026, "Don't Read Everything:
  A Curvature-Conditioned Query for Linear Attention". ``strength=0`` is the backbone.
  ``‖\tilde q‖ <= ‖q‖`` when ``λ ‖C_t‖ <= 2`` (keys L2-normalised give ``‖C_t‖ <= 1``).

  Args:
    q, k: ``[B, T, N, K]``; v: ``[B, T, N, V]``.
    g: ``[B, T, N]`` log decays ``<= 0`` (the state's and the statistics'), or None.
    beta: ``[B, T, N]`` in ``[0, 2]`` for a delta-rule backbone, or None.
    strength: ``λ``.
    scale: multiplies ``\tilde q``; default ``K ** -0.5``.
    initial_state: None or the pair ``(S [B, N, K, V], M [B, N, K + 1, K + 1])``, ``M`` the
      statistics state ``[[Σ w k k^T, Σ w k], [Σ w k^T, n]]``.
    output_final_state: also return ``(S_T, M_T)``.
    segment_ids, implementation, chunk_size: as in :func:`jaxsoft.linear.gated_delta_rule`.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, (S_T, M_T))``.

  Examples:
    >>> k = jnp.array([[1.0, 0.0], [-1.0, 0.0]]).reshape(1, 2, 1, 2)   # variance 1 along x
    >>> q = jnp.ones((1, 2, 1, 2)); v = jnp.ones((1, 2, 1, 1))
    >>> o = ccq(q, k, v, strength=0.5, scale=1.0)    # t = 1: q~ = (1 - 0.5, 1)
    >>> o[0, :, 0, 0]
    Array([1., 0.], dtype=float32)

    The forms agree (``[B, T, N, K] = [1, 8, 2, 4]``, two chunks of 4; the options are
    static under ``jax.jit``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)        # unit keys: ‖C_t‖ <= 1
    >>> g = jnp.full((1, 8, 2), jnp.log(0.9))
    >>> fn = jax.jit(ccq, static_argnames=("implementation", "chunk_size", "strength"))
    >>> o = fn(q, k, v, g, strength=0.5, implementation="recurrent")
    >>> o.shape
    (1, 8, 2, 4)
    >>> o_chunked = fn(q, k, v, g, strength=0.5, implementation="chunked", chunk_size=4)
    >>> bool(jnp.allclose(o, o_chunked, atol=1e-5))
    True

  References:
    Le, Nguyen, Nguyen & Luu, 2026, "Don't Read Everything: A Curvature-Conditioned Query for
    Linear Attention" (the operator here is a reconstruction).
  """
  fn_name = "ccq"
  call = _dispatch.prepare(fn_name, q, k, v, scale=scale, segment_ids=segment_ids,
                           implementation=implementation, chunk_size=chunk_size)
  B, T, N, K = call.q.shape
  V = call.v.shape[-1]
  if isinstance(strength, bool) or not isinstance(strength, (int, float)):
    raise ValueError(f"{fn_name}: `strength` must be a float, got {strength!r}")
  g, beta = _checks.check_decay_and_beta(g, beta, (B, T, N), fn_name, dtype=call.q.dtype)
  S0 = M0 = None
  if initial_state is not None:
    _checks.check_tuple(initial_state, 2, "initial_state", fn_name,
                        "a pair (S [B, N, K, V], M [B, N, K + 1, K + 1])")
    S0 = _checks.check_state(initial_state[0], (B, N, K, V), fn_name, dtype=call.q.dtype)
    M0 = _checks.check_state(initial_state[1], (B, N, K + 1, K + 1), fn_name,
                             dtype=call.q.dtype)
  cq, M_T = curvature_query(call, call.q, call.k, g, M0)
  q_tilde = call.q - strength * cq
  o, S_T = _dispatch.forward(call, q_tilde * call.scale, call.k, call.v, g, beta, S0)
  return _dispatch.finish(o, (S_T, M_T), call.dtype, output_final_state)


def ccq_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike | None = None,
             beta: ArrayLike | None = None, state: Any = None, *, strength: float = 1.0,
             scale: float | None = None) -> tuple[jax.Array, Any]:
  r"""One decoding step of :func:`ccq`.

  The statistics ``M = e^g M + [k, 1][k, 1]^T``, then ``q~ = q - λ C q`` and the backbone's
  step read with ``q~``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``; g, beta: ``[B, N]`` or None.
    state: ``(S [B, N, K, V], M [B, N, K + 1, K + 1])`` or None (zeros).
    strength, scale: as in :func:`ccq`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, (S, M))``.

  Examples:
    >>> o, (S, M) = ccq_step(jnp.ones((1, 1, 2)), jnp.ones((1, 1, 2)), jnp.ones((1, 1, 1)))
    >>> M[0, 0, -1, -1]   # the token count
    Array(1., dtype=float32)

  References:
    Le et al., 2026, "Don't Read Everything" (in full: :func:`ccq`).
  """
  fn_name = "ccq_step"
  _, _, _, (B, N, K, V), cdt = _checks.check_step_inputs(q, k, v, fn_name)
  if state is None:
    state = (jnp.zeros((B, N, K, V), cdt), jnp.zeros((B, N, K + 1, K + 1), cdt))
  _checks.check_tuple(state, 2, "state", fn_name, "a pair (S, M)")
  (qf, kf, vf, S), dtype, scale = _dispatch.prepare_step(fn_name, q, k, v, state[0],
                                                         scale=scale)
  M = _checks.check_state(state[1], (B, N, K + 1, K + 1), fn_name, "state", dtype=cdt)
  g, beta = _checks.check_decay_and_beta(g, beta, (B, N), fn_name, dtype=cdt)
  k1 = jnp.concatenate([kf, jnp.ones_like(kf[..., :1])], axis=-1)
  if g is not None:
    M = M * jnp.exp(g)[..., None, None]
  M = M + k1[..., :, None] * k1[..., None, :]
  n = M[..., -1, -1][..., None]
  mean = M[..., -1, :-1] / n
  cq = jnp.einsum("bnij,bnj->bni", M[..., :-1, :-1], qf) / n - mean * jnp.sum(
      mean * qf, -1, keepdims=True)
  o, S = _recurrence.step(S, (qf - strength * cq) * scale, kf, vf, g, beta)
  return o.astype(dtype), (S, M)
