r"""cosFormer: ReLU linear attention re-weighted by ``cos(π/2 · (i - j) / M)``.

Feature A31 (Qin, Sun, Deng, Li, Wei, Lv, Yan, Kong & Zhong 2022, "cosFormer: Rethinking
Softmax in Attention", ICLR 2022). The similarity of query ``i`` and key ``j`` is

.. math::
  s_{ij} = \big(\mathrm{relu}(q_i) \cdot \mathrm{relu}(k_j)\big)
           \cos\Big(\frac{\pi}{2} \frac{i - j}{M}\Big),

and ``o_i = Σ_{j<=i} s_ij v_j / Σ_{j<=i} s_ij`` (causal). By
``cos(a_i - a_j) = cos a_i cos a_j + sin a_i sin a_j`` with ``a_i = π i / 2M`` this is a
linear attention with the position-dependent features
``φ_i(x) = [relu(x) cos a_i, relu(x) sin a_i]`` (width 2K): the state holds the cos and the
sin halves. ``M`` must be at least the largest distance ``i - j`` so that the cosine (and
every weight) stays ``>= 0``; the paper takes ``M`` to be the sequence length, which is the
default here (``start_position + T``). For decoding, fix ``M`` (``max_len``) to the longest
sequence you will generate and pass the same value to the full call and to the steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.linear import _checks, _linear_attention
from jaxsoft.linear.context_parallel import active as _cp_active
from jaxsoft.linear.context_parallel import shard_count as _cp_shard_count

__all__ = ["cosformer", "cosformer_step"]


def _position_features(x: jax.Array, position: jax.Array, max_len: float, dtype) -> jax.Array:
  """``[relu(x) cos a, relu(x) sin a]``, ``a = π position / (2 max_len)``; ``position``
  broadcasts against ``x[..., 0]``."""
  a = (jnp.pi / (2.0 * max_len)) * position.astype(dtype)
  r = jax.nn.relu(x.astype(dtype))
  return jnp.concatenate([r * jnp.cos(a)[..., None], r * jnp.sin(a)[..., None]], axis=-1)


def _check_max_len(max_len: Any, longest: int | None, fn_name: str) -> float:
  M = _checks.check_positive_number(max_len, "max_len", fn_name)
  if longest is not None and M < longest:
    raise ValueError(
        f"{fn_name}: `max_len` must be >= the largest query-key distance start_position + "
        f"T - 1 = {longest} (else cos((π/2)(i - j)/M) < 0), got {max_len}")
  return M


def _check_start(start_position: Any, max_len: Any, fn_name: str) -> Any:
  """A Python int ``>= 0``, or a traced integer scalar (a shard's offset under
  :func:`jaxsoft.linear.context_parallel`), which needs an explicit ``max_len``."""
  if isinstance(start_position, jax.Array) and concrete(start_position) is None:
    if start_position.shape != () or not jnp.issubdtype(start_position.dtype, jnp.integer):
      raise ValueError(f"{fn_name}: `start_position` must be an int >= 0 or a traced integer "
                       f"scalar, got {start_position.shape} {start_position.dtype}")
    if max_len is None:
      raise ValueError(f"{fn_name}: a traced `start_position` needs `max_len` (the largest "
                       "query-key distance is not known when tracing)")
    return start_position
  return _checks.check_int(start_position, "start_position", fn_name)


def _shard_positions(start_position: Any, max_len: Any, T: int, plan: Any,
                     fn_name: str) -> tuple[Any, float]:
  """Under :func:`jaxsoft.linear.context_parallel`, shard ``p`` of ``P`` starts at the traced
  ``s + p T`` and ``M`` is the whole sequence's: default ``s + P T`` (or the caller's, checked
  against ``s + P T - 1``)."""
  start = _checks.check_int(start_position, "start_position", fn_name)
  P = _cp_shard_count(plan, fn_name)
  M = _check_max_len(start + P * T if max_len is None else max_len, start + P * T - 1, fn_name)
  return start + jax.lax.axis_index(plan.axis_name) * T, M


def cosformer(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, max_len: float | None = None,
              start_position: Any = 0, scale: float | None = None, normalize: bool = True,
              initial_state: Any = None, output_final_state: bool = False,
              segment_ids: ArrayLike | None = None, implementation: str | None = None,
              chunk_size: int = 64, eps: float = 1e-6) -> Any:
  r"""Causal cosFormer attention (feature A31).

  .. math::
    o_i = \frac{\sum_{j \le i} (\mathrm{relu}(q_i) \cdot \mathrm{relu}(k_j))
          \cos(\frac{\pi}{2} \frac{i - j}{M}) v_j}
          {\sum_{j \le i} (\mathrm{relu}(q_i) \cdot \mathrm{relu}(k_j))
          \cos(\frac{\pi}{2} \frac{i - j}{M})}

  (Qin et al. 2022, "cosFormer: Rethinking Softmax in Attention"), computed as a linear
  attention on ``[relu(x) cos(π p / 2M), relu(x) sin(π p / 2M)]`` at positions
  ``p = start_position + t``. Only ``i - j`` enters, so positions may run on across packed
  segments (``segment_ids`` still reset the state).

  Args:
    q, k: ``[B, T, N, K]``.
    v: ``[B, T, N, V]``.
    max_len: ``M``, at least ``start_position + T - 1``; default ``start_position + T`` (the
      paper's choice, the sequence length). Fix it when decoding.
    start_position: the position of the first token (when continuing from ``initial_state``):
      an int, or a traced integer scalar with ``max_len`` given (a shard's offset under
      :func:`jaxsoft.linear.context_parallel`, which passes it).
    scale: multiplies ``φ(q)``; default ``(2K) ** -0.5`` (it cancels when normalising).
    normalize: divide by the sum of the weights (True), or return the numerator.
    initial_state: ``S [B, N, 2K, V]``, or with ``normalize=True`` the pair ``(S, z [B, N, 2K])``;
      None: zeros.
    output_final_state, segment_ids, implementation, chunk_size, eps: as in
      :func:`jaxsoft.linear.linear_attention`.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> q = k = jnp.ones((1, 2, 1, 1)); v = jnp.array([0.0, 1.0]).reshape(1, 2, 1, 1)
    >>> cos = jax.jit(cosformer, static_argnames="max_len")
    >>> cos(q, k, v, max_len=2)[0, :, 0, 0]   # weights cos(π/4) and 1 at t = 1
    Array([0.    , 0.5858], dtype=float32)

    The rows are normalised, so scaling ``q`` changes nothing (``[B, T, N, K] = [1, 8, 2, 4]``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> o = cos(q, k, v)
    >>> o.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(cos(3.0 * q, k, v), o, atol=1e-5))
    True

  References:
    Z. Qin, W. Sun, H. Deng, D. Li, Y. Wei, B. Lv, J. Yan, L. Kong & Y. Zhong, 2022,
    "cosFormer: Rethinking Softmax in Attention".
  """
  fn_name = "cosformer"
  eps = _checks.check_eps(eps, fn_name)
  q, k, v = _checks.check_qkv(q, k, v, fn_name)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  T = q.shape[1]
  plan = _cp_active()
  if plan is not None:   # under context_parallel: global positions, the whole sequence's M
    start, M = _shard_positions(start_position, max_len, T, plan, fn_name)
  else:
    start = _check_start(start_position, max_len, fn_name)
    M = _check_max_len(start + T if max_len is None else max_len,
                       start + T - 1 if isinstance(start, int) else None, fn_name)
  pos = (start + jnp.arange(T))[None, :, None]                      # [1, T, 1]
  cdt = _checks.compute_dtype_of(q, k, v)
  fq, fk = _position_features(q, pos, M, cdt), _position_features(k, pos, M, cdt)
  return _linear_attention.mapped_attention(
      fn_name, fq, fk, v, dtype, normalize=normalize, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, segment_ids=segment_ids,
      implementation=implementation, chunk_size=chunk_size, eps=eps)


def cosformer_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, state: Any = None, *,
                   position: ArrayLike, max_len: float, scale: float | None = None,
                   normalize: bool = True, eps: float = 1e-6) -> tuple[jax.Array, Any]:
  r"""One decoding step of :func:`cosformer` at token ``position``.

  ``S = S + φ_p(k) v^T``, ``z = z + φ_p(k)``, ``o = S^T φ_p(q) / (φ_p(q) · z)`` with
  ``φ_p(x) = [relu(x) cos(π p / 2M), relu(x) sin(π p / 2M)]``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``.
    state: ``S [B, N, 2K, V]``, or with ``normalize=True`` the pair ``(S, z [B, N, 2K])``;
      None: zeros.
    position: the token's position ``p >= 0``: an int or ``[B]`` ints (may be traced).
    max_len: ``M``, the same value as in the full call (``>= p`` for all steps).
    scale, normalize, eps: as in :func:`cosformer`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state)``.

  Examples:
    >>> one = jnp.ones((1, 1, 1))
    >>> o, state = cosformer_step(one, one, 0.0 * one, position=0, max_len=2)
    >>> o, state = cosformer_step(one, one, one, state, position=1, max_len=2)
    >>> o
    Array([[[0.5858]]], dtype=float32)

  References:
    Qin et al., 2022, "cosFormer: Rethinking Softmax in Attention" (in full: :func:`cosformer`).
  """
  fn_name = "cosformer_step"
  eps = _checks.check_eps(eps, fn_name)
  M = _check_max_len(max_len, None, fn_name)
  q, k, v = _checks.check_qkv_step(q, k, v, fn_name)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  pos = jnp.asarray(position)
  if not jnp.issubdtype(pos.dtype, jnp.integer) or pos.shape not in ((), (q.shape[0],)):
    raise ValueError(
        f"{fn_name}: `position` must be an int or [B] = [{q.shape[0]}] ints, got "
        f"{pos.shape} {pos.dtype}")
  values = concrete(pos, np.float64)
  if values is not None and not np.all((values >= 0) & (values <= M)):
    raise ValueError(f"{fn_name}: `position` must lie in [0, max_len = {M}], got {values}")
  pos = jnp.broadcast_to(pos, (q.shape[0],))[:, None]                # [B, 1]
  cdt = _checks.compute_dtype_of(q, k, v)
  fq, fk = _position_features(q, pos, M, cdt), _position_features(k, pos, M, cdt)
  return _linear_attention.mapped_step(fn_name, fq, fk, v, state, dtype, normalize=normalize,
                                       scale=scale, eps=eps)
