r"""Taylor linear attention: softmax attention with ``exp`` replaced by its Taylor polynomial.

Feature A40. Since ``exp(s) = Σ_i s^i / i!`` and ``(q·k)^i = <q^{⊗i}, k^{⊗i}>``, causal
softmax attention is an infinite sum of linear attentions with tensor-power features
(Mongaras & Larson 2025, "On the Expressiveness of Softmax Attention: A Recurrent Neural
Network Perspective"). Truncating at order ``m``:

.. math::
  o_t = \frac{\sum_{j \le t} P_m(s_{tj}) v_j}{\sum_{j \le t} P_m(s_{tj})}, \qquad
  P_m(s) = \sum_{i=0}^{m} \frac{s^i}{i!}, \qquad s_{tj} = \text{scale} \cdot q_t \cdot k_j,

computed as :func:`jaxsoft.linear.linear_attention` with the features of
:func:`jaxsoft.linear.taylor_features` applied to ``scale · q`` and ``k``. Order 2 is
TaylorShift's Taylor-softmax (Nauen, Palacio & Dengel 2024, "TaylorShift: Shifting the
Complexity of Self-Attention from Squared to Linear (and Back) using Taylor-Softmax"),
whose weights are positive since ``1 + s + s^2/2 > 0``; odd orders can give negative
weights and denominators (kept away from 0 by ``eps``, sign kept). TaylorShift also
L2-normalises ``q`` and ``k`` and uses a temperature: pass ``q`` and ``k`` normalised and the
temperature as ``scale``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _features, _linear_attention

__all__ = ["taylor_linear_attention", "taylor_linear_attention_step"]


def _taylor_qkv(fn_name: str, q, k, v, order, scale, eps, step: bool):
  """The checked arguments and the features ``φ_m(scale · q)``, ``φ_m(k)``:
  ``(fq, fk, v, dtype, eps)``."""
  order = _checks.check_int(order, "order", fn_name)
  eps = _checks.check_eps(eps, fn_name)
  q, k, v = (_checks.check_qkv_step if step else _checks.check_qkv)(q, k, v, fn_name)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  scale = _checks.resolve_scale(scale, q.shape[-1], fn_name)
  cdt = _checks.compute_dtype_of(q, k, v)
  fq = _features.taylor_features(q.astype(cdt) * scale, order)
  fk = _features.taylor_features(k.astype(cdt), order)
  return fq, fk, v, dtype, eps


def taylor_linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, order: int = 2,
                            scale: float | None = None, normalize: bool = True,
                            initial_state: Any = None, output_final_state: bool = False,
                            segment_ids: ArrayLike | None = None,
                            implementation: str | None = None, chunk_size: int = 64,
                            eps: float = 1e-6) -> Any:
  r"""Causal attention with ``exp`` replaced by its order-m Taylor polynomial (feature A40).

  The weights are ``P_m(scale · q·k) = Σ_{i<=m} (scale · q·k)^i / i!``, computed in linear
  time.

  .. math::
    S_t = S_{t-1} + φ_m(k_t) v_t^\top, \quad z_t = z_{t-1} + φ_m(k_t), \quad
    o_t = \frac{S_t^\top φ_m(\text{scale}\, q_t)}{φ_m(\text{scale}\, q_t) \cdot z_t}

  with ``φ_m`` :func:`taylor_features` (Mongaras & Larson 2025; order 2: Nauen et al. 2024,
  "TaylorShift"). As ``m`` grows it tends to causal softmax attention; the state has
  ``1 + K + ... + K^m`` rows, so keep ``K`` and ``m`` small.

  Args:
    q, k: ``[B, T, N, K]``.
    v: ``[B, T, N, V]``.
    order: ``m >= 0`` (0: the running mean of ``v``; 2: TaylorShift).
    scale: multiplies ``q`` inside the polynomial; default ``K ** -0.5`` (as softmax attention).
    normalize: divide by the sum of the weights (True), or return the numerator.
    initial_state: ``S [B, N, K_m, V]``, or with ``normalize=True`` the pair
      ``(S, z [B, N, K_m])``, ``K_m = 1 + K + ... + K^m``; None: zeros.
    output_final_state, segment_ids, implementation, chunk_size, eps: as in
      :func:`jaxsoft.linear.linear_attention`.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> q = jnp.zeros((1, 2, 1, 2)); k = jnp.ones((1, 2, 1, 2))
    >>> v = jnp.array([1.0, 3.0]).reshape(1, 2, 1, 1)
    >>> fn = jax.jit(taylor_linear_attention, static_argnames="order")
    >>> fn(q, k, v)[0, :, 0, 0]   # q = 0: every weight is P(0) = 1
    Array([1., 2.], dtype=float32)

    Order 0 gives every key the weight 1: the running mean of ``v`` (``[B, T, N, K] =
    [1, 8, 2, 4]``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> o = fn(q, k, v, order=0)
    >>> o.shape
    (1, 8, 2, 4)
    >>> running_mean = jnp.cumsum(v, axis=1) / jnp.arange(1, 9)[None, :, None, None]
    >>> bool(jnp.allclose(o, running_mean, atol=1e-5))
    True

  References:
    G. Mongaras & E. C. Larson, 2025, "On the Expressiveness of Softmax Attention: A
    Recurrent Neural Network Perspective".

    T. C. Nauen, S. Palacio & A. Dengel, 2024, "TaylorShift: Shifting the Complexity of
    Self-Attention from Squared to Linear (and Back) using Taylor-Softmax".
  """
  fn_name = "taylor_linear_attention"
  fq, fk, v, dtype, eps = _taylor_qkv(fn_name, q, k, v, order, scale, eps, step=False)
  return _linear_attention.mapped_attention(
      fn_name, fq, fk, v, dtype, normalize=normalize, scale=1.0, initial_state=initial_state,
      output_final_state=output_final_state, segment_ids=segment_ids,
      implementation=implementation, chunk_size=chunk_size, eps=eps)


def taylor_linear_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, state: Any = None,
                                 *, order: int = 2, scale: float | None = None,
                                 normalize: bool = True,
                                 eps: float = 1e-6) -> tuple[jax.Array, Any]:
  r"""One decoding step of :func:`taylor_linear_attention`.

  ``S = S + φ_m(k) v^T``, ``z = z + φ_m(k)``, ``o = S^T φ_m(scale q) / (φ_m(scale q) · z)``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``.
    state: ``S [B, N, K_m, V]``, or with ``normalize=True`` the pair ``(S, z [B, N, K_m])``;
      None: zeros.
    order, scale, normalize, eps: as in :func:`taylor_linear_attention`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state)``.

  Examples:
    >>> o, (S, z) = taylor_linear_attention_step(jnp.zeros((1, 1, 2)), jnp.ones((1, 1, 2)),
    ...                                          jnp.ones((1, 1, 1)), order=1)
    >>> o, z.shape
    (Array([[[1.]]], dtype=float32), (1, 1, 3))

  References:
    Mongaras & Larson, 2025; Nauen et al., 2024, "TaylorShift"
    (in full: :func:`taylor_linear_attention`).
  """
  fn_name = "taylor_linear_attention_step"
  fq, fk, v, dtype, eps = _taylor_qkv(fn_name, q, k, v, order, scale, eps, step=True)
  return _linear_attention.mapped_step(fn_name, fq, fk, v, state, dtype, normalize=normalize,
                                       scale=1.0, eps=eps)
