r"""Interdomain attention: kernel features projected onto a basis kept by a diagonal SSM.

Feature A41, reconstructed [R] from the abstract of Kiyohara et al. 2026, "Interdomain
Attention: Beyond Token-Level Key-Value Memory": the
attention kernel is approximated by a finite feature map ``κ(q, k) ≈ φ(q)·φ(k)``; key
features and values are projected onto ``R`` basis functions whose coefficients one SSM
recurrence keeps online (HiPPO-style), and each query reads the compressed coefficients
through its own feature map. The paper's exact layer (a "learned relaxation") is not
public in the abstract. The reconstruction here uses a diagonal SSM, one decay per basis
function and head:

.. math::
  C_t[r] = e^{a_r} C_{t-1}[r] + b_{t,r}\, φ(k_t) v_t^\top, \qquad
  o_t = \sum_r ψ_{t,r}\, C_t[r]^\top (\text{scale} \cdot φ(q_t)),

``b_t`` the input projections onto the basis and ``ψ_t`` the query's basis read-out (both
token-dependent arrays, ``x_t W`` in a layer). The state ``[R, K', V]`` is independent of
``t``. It is gated linear attention (:func:`jaxsoft.linear.gla`) on the product features
``ψ_t ⊗ φ(q_t)`` and ``b_t ⊗ φ(k_t)`` with the per-channel decay ``a_r`` repeated over the
features, so its three forms are those of GLA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _dispatch, _features
from jaxsoft.linear import recurrence as _recurrence

__all__ = ["interdomain_attention", "interdomain_attention_step"]


def interdomain_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, basis_in: ArrayLike,
                          basis_out: ArrayLike, log_decay: ArrayLike, *,
                          feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
                          scale: float | None = None, initial_state: ArrayLike | None = None,
                          output_final_state: bool = False,
                          segment_ids: ArrayLike | None = None,
                          implementation: str | None = None, chunk_size: int = 64) -> Any:
  r"""Kernel-feature attention through an SSM basis of ``R`` functions (feature A41, [R]).

  .. math::
    C_t[r] = e^{a_r} C_{t-1}[r] + b_{t,r} φ(k_t) v_t^\top, \qquad
    o_t = \sum_r ψ_{t,r} C_t[r]^\top (\text{scale}\, φ(q_t))

  (reconstructed from the abstract of Kiyohara et al. 2026; see the module
  docstring). ``R = 1``, ``b = ψ = 1`` is :func:`jaxsoft.linear.simple_gla` with a constant
  decay on ``φ(q), φ(k)``.

  Args:
    q, k: ``[B, T, N, K]`` (before the feature map); v: ``[B, T, N, V]``.
    basis_in: ``[B, T, N, R]`` the key's coefficients ``b_t`` on the basis.
    basis_out: ``[B, T, N, R]`` the query's read-out ``ψ_t``.
    log_decay: ``[N, R]`` per head and basis function, ``<= 0``.
    feature_map: as in :func:`jaxsoft.linear.linear_attention` (``"elu1"``, ``"relu"``,
      ``"identity"``, a callable).
    scale: multiplies ``φ(q)``; default ``K' ** -0.5``.
    initial_state: ``[B, N, R, K', V]`` or None (zeros).
    output_final_state: also return the final state ``[B, N, R, K', V]``.
    segment_ids, implementation, chunk_size: as in :func:`jaxsoft.linear.gla`.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> q = k = jnp.zeros((1, 2, 1, 1)); v = jnp.ones((1, 2, 1, 1))   # φ = elu + 1 = 1
    >>> b = psi = jnp.ones((1, 2, 1, 2))
    >>> a = jnp.log(jnp.array([[1.0, 0.5]]))
    >>> fn = jax.jit(interdomain_attention, static_argnames=("implementation", "chunk_size"))
    >>> fn(q, k, v, b, psi, a, scale=1.0)[0, :, 0, 0]   # (1 + 1), (2 + 1.5)
    Array([2. , 3.5], dtype=float32)

    The forms agree (``[B, T, N, K] = [1, 8, 2, 4]``, two chunks of 4; the options are
    static under ``jax.jit``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> b, psi = jax.random.normal(jax.random.key(1), (2, 1, 8, 2, 3))     # R = 3
    >>> a = jnp.log(jnp.array([[0.5, 0.9, 1.0], [0.7, 0.8, 0.99]]))
    >>> o = fn(q, k, v, b, psi, a, implementation="recurrent")
    >>> o.shape
    (1, 8, 2, 4)
    >>> o_chunked = fn(q, k, v, b, psi, a, implementation="chunked", chunk_size=4)
    >>> bool(jnp.allclose(o, o_chunked, atol=1e-4))
    True

  References:
    N. Kiyohara, H. B. H. Zhu, R. El Hassanin, Z. Sun, W. Chen, S. Bhatt & Y. Li, 2026,
    "Interdomain Attention: Beyond Token-Level Key-Value Memory" (the layer here is
    reconstructed from its abstract).
  """
  fn_name = "interdomain_attention"
  phi = _features.resolve(feature_map, fn_name)
  fq, fk, v, dtype = _features.apply(phi, q, k, v, fn_name)
  B, T, N, Kf = fq.shape
  cdt = _checks.compute_dtype_of(fq, fk, v)
  b_in = jnp.asarray(basis_in)
  if b_in.ndim != 4 or b_in.shape[:3] != (B, T, N):
    raise ValueError(f"{fn_name}: `basis_in` must have shape [B, T, N, R] with [B, T, N] = "
                     f"{[B, T, N]}, got {b_in.shape}")
  R = b_in.shape[-1]
  b_in = _checks.check_gate_logits(b_in, (B, T, N, R), fn_name, "basis_in", dtype=cdt)
  psi = _checks.check_gate_logits(basis_out, (B, T, N, R), fn_name, "basis_out", dtype=cdt)
  a = _checks.check_gate(log_decay, (N, R), "[N, R]", fn_name, "log_decay")
  call = _dispatch.prepare(fn_name, (psi[..., :, None] * fq[..., None, :]).reshape(
      B, T, N, R * Kf), (b_in[..., :, None] * fk[..., None, :]).reshape(B, T, N, R * Kf), v,
      scale=Kf ** -0.5 if scale is None else scale, segment_ids=segment_ids,
      implementation=implementation, chunk_size=chunk_size)
  V = call.v.shape[-1]
  S0 = _checks.check_optional_state(initial_state, (B, N, R, Kf, V), fn_name, dtype=cdt)
  S0 = None if S0 is None else S0.reshape(B, N, R * Kf, V)
  g = jnp.broadcast_to(jnp.repeat(a.astype(cdt), Kf, axis=-1), (B, T, N, R * Kf))
  o, S_T = _dispatch.forward(call, call.q * call.scale, call.k, call.v, g, None, S0)
  return _dispatch.finish(o, S_T.reshape(B, N, R, Kf, V), dtype, output_final_state)


def interdomain_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, basis_in: ArrayLike,
                               basis_out: ArrayLike, log_decay: ArrayLike,
                               state: ArrayLike | None = None, *,
                               feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
                               scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`interdomain_attention`.

  ``C[r] = e^{a_r} C[r] + b_r φ(k) v^T``, ``o = Σ_r ψ_r C[r]^T (scale φ(q))``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``; basis_in, basis_out: ``[B, N, R]``;
      log_decay: ``[N, R]``.
    state: ``[B, N, R, K', V]`` or None (zeros).
    feature_map, scale: as in :func:`interdomain_attention`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state [B, N, R, K', V] in the compute dtype)``.

  Examples:
    >>> o, C = interdomain_attention_step(jnp.zeros((1, 1, 1)), jnp.zeros((1, 1, 1)),
    ...                                   jnp.ones((1, 1, 1)), jnp.ones((1, 1, 2)),
    ...                                   jnp.ones((1, 1, 2)), jnp.zeros((1, 2)), scale=1.0)
    >>> o
    Array([[[2.]]], dtype=float32)

  References:
    Kiyohara et al., 2026, "Interdomain Attention" (in full: :func:`interdomain_attention`).
  """
  fn_name = "interdomain_attention_step"
  phi = _features.resolve(feature_map, fn_name)
  fq, fk, v, dtype = _features.apply(phi, q, k, v, fn_name, step=True)
  B, N, Kf = fq.shape
  V = v.shape[-1]
  cdt = _checks.compute_dtype_of(fq, fk, v)
  b_in = jnp.asarray(basis_in)
  if b_in.ndim != 3 or b_in.shape[:2] != (B, N):
    raise ValueError(f"{fn_name}: `basis_in` must have shape [B, N, R], got {b_in.shape}")
  R = b_in.shape[-1]
  b_in = _checks.check_gate_logits(b_in, (B, N, R), fn_name, "basis_in", dtype=cdt)
  psi = _checks.check_gate_logits(basis_out, (B, N, R), fn_name, "basis_out", dtype=cdt)
  a = _checks.check_gate(log_decay, (N, R), "[N, R]", fn_name, "log_decay")
  C = (jnp.zeros((B, N, R * Kf, V), cdt) if state is None else _checks.check_state(
      state, (B, N, R, Kf, V), fn_name, "state", dtype=cdt).reshape(B, N, R * Kf, V))
  scale = Kf ** -0.5 if scale is None else scale
  qx = (psi[..., :, None] * fq[..., None, :]).reshape(B, N, R * Kf) * scale
  kx = (b_in[..., :, None] * fk[..., None, :]).reshape(B, N, R * Kf)
  g = jnp.broadcast_to(jnp.repeat(a.astype(cdt), Kf, axis=-1), (B, N, R * Kf))
  o, C = _recurrence.step(C, qx, kx, v.astype(cdt), g, None)
  return o.astype(dtype), C.reshape(B, N, R, Kf, V)
