r"""Softmax Linear Attention: softmax competition across heads on top of a linear attention.

Feature A34 (Xu, Lin, Guo, Xu & Cui 2026, "Softmax Linear Attention: Reclaiming Global
Competition"). The paper lifts softmax from the token axis to the head axis: heads act as
coarse slots and a softmax over heads selects the relevant ones, on top of a linear
attention backbone (RetNet, GLA, Gated DeltaNet). Its exact equations were not available;
this is a reconstruction [R]: with gate logits ``a_t, c_t [N]`` per token,

.. math::
  γ^q_t = \operatorname{softmax}_n(a_t / τ), \qquad γ^k_t = \operatorname{softmax}_n(c_t / τ),
  \\
  S_{t,n} = e^{g_{t,n}} S_{t-1,n} + γ^k_{t,n}\, k_{t,n} u_{t,n}^\top, \qquad
  o_{t,n} = γ^q_{t,n}\, S_{t,n}^\top (\text{scale} \cdot q_{t,n}),

``u = v`` (a decayed linear attention) or the delta-rule write
``u = β (v - \tilde S^\top k)`` (the write gate then scales ``β``). The effective weight of
key ``s`` for query ``t`` in head ``n`` is ``γ^q_{t,n} γ^k_{s,n} (q·k)`` times the decay:
heads compete through both gates. Without the key gate (``k_gate_logits=None``) only the
read competes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _dispatch, recurrence
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["softmax_linear_attention", "softmax_linear_attention_step", "head_gates"]


def head_gates(logits: ArrayLike, temperature: float = 1.0) -> jax.Array:
  r"""Softmax gates over heads: heads compete for each token's read or write (feature A34).

  .. math::
    γ_{t,n} = \operatorname{softmax}_n(\text{logits}_{t,n} / τ)

  Args:
    logits: ``[..., N]``, the head axis last.
    temperature: ``τ > 0``.

  Returns:
    ``γ [..., N]`` float32 (float64 for float64 logits), positive and summing to 1 over
    the heads.

  Examples:
    >>> head_gates(jnp.zeros((1, 4)))
    Array([[0.25, 0.25, 0.25, 0.25]], dtype=float32)

  References:
    Xu, Lin, Guo, Xu & Cui, 2026, "Softmax Linear Attention: Reclaiming Global Competition"
    (the gates' placement here is a reconstruction).
  """
  logits = jnp.asarray(logits)
  return jax.nn.softmax(logits.astype(compute_dtype(logits.dtype)) / temperature, axis=-1)


def _gates(fn_name: str, shape: tuple[int, ...], v, q_gate_logits, k_gate_logits, g, beta,
           temperature) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
  """The read gates ``γ^q`` and the backbone's ``v, g, beta`` with the write gate ``γ^k``
  folded in (``γ^k v`` without ``beta``, else ``γ^k β``); ``shape`` is ``[B, T, N]`` or a
  step's ``[B, N]``."""
  temperature = _checks.check_positive_number(temperature, "temperature", fn_name)
  cdt = v.dtype   # the call's compute dtype: every gate is cast to it
  gq = head_gates(_checks.check_gate_logits(q_gate_logits, shape, fn_name, "q_gate_logits",
                                            dtype=cdt), temperature)
  gk = None if k_gate_logits is None else head_gates(
      _checks.check_gate_logits(k_gate_logits, shape, fn_name, "k_gate_logits", dtype=cdt),
      temperature)
  g, beta = _checks.check_decay_and_beta(g, beta, shape, fn_name, dtype=cdt)
  if gk is not None:
    if beta is None:
      v = v * gk[..., None]      # S += γ^k k v^T
    else:
      beta = beta * gk           # u = γ^k β (v - S^T k)
  return gq, v, g, beta


def softmax_linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, q_gate_logits: ArrayLike,
                             k_gate_logits: ArrayLike | None = None, *,
                             g: ArrayLike | None = None, beta: ArrayLike | None = None,
                             temperature: float = 1.0, scale: float | None = None,
                             initial_state: ArrayLike | None = None,
                             output_final_state: bool = False,
                             segment_ids: ArrayLike | None = None,
                             implementation: str | None = None, chunk_size: int = 64) -> Any:
  r"""Linear attention whose heads compete through a softmax over heads (feature A34, [R]).

  .. math::
    S_{t,n} = e^{g_{t,n}} S_{t-1,n} + γ^k_{t,n} k_{t,n} u_{t,n}^\top, \qquad
    o_{t,n} = γ^q_{t,n} S_{t,n}^\top (\text{scale}\, q_{t,n}), \qquad
    γ_t = \operatorname{softmax}_n(\text{logits}_t / τ)

  (Xu et al. 2026, "Softmax Linear Attention: Reclaiming Global Competition"; the gates'
  placement is a reconstruction, see the module docstring). The backbone is chosen by the
  arguments: no ``g`` and no ``beta``: plain linear attention (unnormalised); ``g``: RetNet
  / simple GLA; ``beta``: the delta rule (``u = β(v - \tilde S^T k)``); both: Gated DeltaNet.

  Args:
    q, k: ``[B, T, N, K]``; v: ``[B, T, N, V]``.
    q_gate_logits: ``[B, T, N]`` read-gate logits (``x_t W_g`` in a layer).
    k_gate_logits: ``[B, T, N]`` write-gate logits, or None (no write gate).
    g: ``[B, T, N]`` log decays ``<= 0``, or None.
    beta: ``[B, T, N]`` delta-rule strengths in ``[0, 2]``, or None.
    temperature: ``τ > 0``.
    scale, initial_state, output_final_state, segment_ids, implementation, chunk_size: as in
      :func:`jaxsoft.linear.gated_delta_rule`.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> q = k = jnp.ones((1, 1, 2, 1)); v = jnp.ones((1, 1, 2, 1))
    >>> softmax_linear_attention(q, k, v, jnp.array([[[0.0, jnp.log(3.0)]]]), scale=1.0)[0, 0, :, 0]
    Array([0.25, 0.75], dtype=float32)

    The forms agree (``[B, T, N, K] = [1, 8, 2, 4]``, two chunks of 4; the options are
    static under ``jax.jit``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> gate_q, gate_k = jax.random.normal(jax.random.key(1), (2, 1, 8, 2))
    >>> g = jnp.full((1, 8, 2), jnp.log(0.9))
    >>> fn = jax.jit(softmax_linear_attention, static_argnames=("implementation", "chunk_size"))
    >>> o = fn(q, k, v, gate_q, gate_k, g=g, implementation="recurrent")
    >>> o.shape
    (1, 8, 2, 4)
    >>> o_chunked = fn(q, k, v, gate_q, gate_k, g=g, implementation="chunked", chunk_size=4)
    >>> bool(jnp.allclose(o, o_chunked, atol=1e-5))
    True

  References:
    Xu, Lin, Guo, Xu & Cui, 2026, "Softmax Linear Attention: Reclaiming Global Competition"
    (the gates' placement here is a reconstruction).
  """
  fn_name = "softmax_linear_attention"
  call = _dispatch.prepare(fn_name, q, k, v, scale=scale, segment_ids=segment_ids,
                           implementation=implementation, chunk_size=chunk_size)
  B, T, N, K = call.q.shape
  gq, v_in, g, beta = _gates(fn_name, (B, T, N), call.v, q_gate_logits, k_gate_logits, g, beta,
                             temperature)
  S0 = _checks.check_optional_state(initial_state, (B, N, K, call.v.shape[-1]), fn_name,
                                    dtype=call.q.dtype)
  o, S_T = _dispatch.forward(call, call.q * call.scale, call.k, v_in, g, beta, S0)
  return _dispatch.finish(o * gq[..., None], S_T, call.dtype, output_final_state)


def softmax_linear_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                                  q_gate_logits: ArrayLike,
                                  k_gate_logits: ArrayLike | None = None,
                                  state: ArrayLike | None = None, *, g: ArrayLike | None = None,
                                  beta: ArrayLike | None = None, temperature: float = 1.0,
                                  scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`softmax_linear_attention` (``[B, N, ...]`` per token).

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``; q_gate_logits, k_gate_logits, g, beta: ``[B, N]``
      (the last three optional).
    state: ``[B, N, K, V]`` or None (zeros).
    temperature, scale: as in :func:`softmax_linear_attention`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state [B, N, K, V] in the compute dtype)``.

  Examples:
    >>> o, S = softmax_linear_attention_step(jnp.ones((1, 2, 1)), jnp.ones((1, 2, 1)),
    ...                                      jnp.ones((1, 2, 1)), jnp.zeros((1, 2)), scale=1.0)
    >>> o[0, :, 0]
    Array([0.5, 0.5], dtype=float32)

  References:
    Xu et al., 2026, "Softmax Linear Attention" (in full: :func:`softmax_linear_attention`).
  """
  fn_name = "softmax_linear_attention_step"
  (qf, kf, vf, S), dtype, scale = _dispatch.prepare_step(fn_name, q, k, v, state, scale=scale)
  B, N, _ = qf.shape
  gq, vf, g, beta = _gates(fn_name, (B, N), vf, q_gate_logits, k_gate_logits, g, beta,
                           temperature)
  o, S = recurrence.step(S, qf * scale, kf, vf, g, beta)
  return (o * gq[..., None]).astype(dtype), S
