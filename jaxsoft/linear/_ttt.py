r"""TTT-Linear: a linear fast-weight model trained by mini-batch gradient descent at test time.

Feature A39 (Sun, Li, Dalal, Xu, Vikram, Zhang, Dubois, Chen, Wang, Koyejo, Hashimoto &
Guestrin 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden States").
The state is the weight ``W [K, V]`` of the inner model ``f(x) = W^T x``; each token is a
training example with the reconstruction loss ``ℓ_t(W) = ½ ‖W^T k_t - v_t‖²``, whose
gradient is ``k_t (W^T k_t - v_t)^T``. With mini-batches of ``b`` tokens, every token of a
mini-batch takes its gradient at the mini-batch's start weights ``W_s``:

.. math::
  W_t = W_s - \sum_{j=s+1}^{t} η_j\, k_j (W_s^\top k_j - v_j)^\top, \qquad
  o_t = W_t^\top (\text{scale} \cdot q_t),

and the next mini-batch starts from the last ``W_t``. ``b = 1`` is online gradient descent,
which is the delta rule with ``β = η`` (:func:`jaxsoft.linear.delta_rule`). The chunked form
is the paper's "dual form": per mini-batch ``E = K W_s - V``, ``O = Q W_s - ((Q K^T) ⊙
M_η) E`` with ``M_η[i, j] = η_j`` for ``j <= i`` and ``W_{end} = W_s - K^T \operatorname{diag}(η) E``,
with a scan over mini-batches only. The paper's layer adds a LayerNorm and a residual
inside ``f`` and learns ``η_t`` and ``W_0``; those are layer choices (pass ``eta`` and
``initial_state``), the operator here is the plain linear inner model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete, positive_int
from jaxsoft.linear import _checks, chunk
from jaxsoft.linear.context_parallel import active as _cp_active
from jaxsoft.linear.context_parallel import ttt_states as _cp_ttt_states

__all__ = ["ttt_linear", "ttt_linear_step"]


def _check_inner(mini_batch_size, eta, shape, fn_name: str, dtype) -> tuple[int, jax.Array]:
  """The inner learner's settings, as :func:`ttt_linear` and its step take them: the
  mini-batch size ``b`` (a positive int) and the inner learning rates ``eta`` of ``shape``
  ([B, T, N], or [B, N] for a step), finite and >= 0, returned in ``dtype``."""
  mini_batch_size = positive_int(mini_batch_size, "mini_batch_size", fn_name)
  eta = _checks.check_floating(eta, "eta", fn_name)
  if eta.shape != tuple(shape):
    layout = "[B, T, N]" if len(shape) == 3 else "[B, N]"
    raise ValueError(f"{fn_name}: `eta` must have shape {layout} = {list(shape)}, got {eta.shape}")
  values = concrete(eta, np.float64)
  if values is not None and not np.all(np.isfinite(values) & (values >= 0.0)):
    raise ValueError(f"{fn_name}: `eta` (inner learning rates) must be finite and >= 0")
  return mini_batch_size, eta.astype(dtype)


def _zero_state(k, v):
  """Zero weights ``[B, N, K, V]`` built from ``k [B, T, N, K]`` and ``v``: they carry the
  inputs' batch sharding on an explicit mesh (``jnp.zeros(shape)`` carries none)."""
  return jnp.zeros_like(jnp.einsum("bnk,bnv->bnkv", k[:, 0], v[:, 0]))


def _recurrent(q, k, v, eta, S0, b):
  """Token by token: ``(W_s, W_t)`` carried; a new mini-batch starts every ``b`` tokens."""
  T = q.shape[1]
  time_first = lambda x: jnp.moveaxis(x, 1, 0)
  starts = (jnp.arange(T) % b) == 0

  def body(carry, x):
    Ws, Wt = carry
    q_t, k_t, v_t, e_t, new = x
    Ws = jnp.where(new, Wt, Ws)
    err = jnp.einsum("bnkv,bnk->bnv", Ws, k_t) - v_t
    Wt = Wt - e_t[..., None, None] * k_t[..., :, None] * err[..., None, :]
    return (Ws, Wt), jnp.einsum("bnkv,bnk->bnv", Wt, q_t)

  (_, W_T), o = jax.lax.scan(
      body, (S0, S0), (time_first(q), time_first(k), time_first(v), time_first(eta), starts))
  return jnp.moveaxis(o, 0, 1), W_T


def _chunked(q, k, v, eta, S0, b):
  """The dual form: a scan over mini-batches for their start weights, outputs batched."""
  T = q.shape[1]
  pad = (-T) % b
  q, k, v, eta = (chunk.pad_time(x, 1, pad) for x in (q, k, v, eta))   # padded: eta = 0
  qc, kc, vc, ec = (jnp.moveaxis(chunk.to_chunks(x, 1, b), 1, 0) for x in (q, k, v, eta))
  tril = jnp.tril(jnp.ones((b, b), bool))

  def body(Ws, x):
    k_c, v_c, e_c = x                                                   # [B, b, N, ...]
    err = jnp.einsum("bcnk,bnkv->bcnv", k_c, Ws) - v_c
    return Ws - jnp.einsum("bcnk,bcnv->bnkv", k_c * e_c[..., None], err), Ws

  W_T, starts = jax.lax.scan(body, S0, (kc, vc, ec))                  # starts [nC, B, N, K, V]
  err = jnp.einsum("mbcnk,mbnkv->mbcnv", kc, starts) - vc
  scores = jnp.where(tril[:, :, None], jnp.einsum("mbink,mbjnk->mbijn", qc, kc), 0.0)
  o = (jnp.einsum("mbcnk,mbnkv->mbcnv", qc, starts)
       - jnp.einsum("mbijn,mbjnv->mbinv", scores * ec[:, :, None], err))
  o = chunk.from_chunks(jnp.moveaxis(o, 0, 1), 1)
  return o[:, :T], W_T


def ttt_linear(q: ArrayLike, k: ArrayLike, v: ArrayLike, eta: ArrayLike, *,
               mini_batch_size: int = 16, scale: float | None = None,
               initial_state: ArrayLike | None = None, output_final_state: bool = False,
               implementation: str | None = None) -> Any:
  r"""TTT-Linear: fast weights trained by mini-batch gradient descent at test time (feature A39).

  The inner loss is ``½‖W^T k - v‖²``.

  .. math::
    W_t = W_s - \sum_{s < j \le t} η_j\, k_j (W_s^\top k_j - v_j)^\top, \qquad
    o_t = W_t^\top (\text{scale} \cdot q_t),

  ``W_s`` the weights at the start of ``t``'s mini-batch (tokens ``0..b-1``, ``b..2b-1``,
  ...). Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden
  States". ``mini_batch_size=1`` is the delta rule with ``β = η``.

  Args:
    q, k: ``[B, T, N, K]`` (the paper's test view and training view of the token).
    v: ``[B, T, N, V]`` (the reconstruction target).
    eta: ``[B, T, N]`` inner learning rates, ``>= 0``.
    mini_batch_size: ``b``, a positive int (the paper uses 16); T need not be a multiple.
    scale: multiplies ``q``; default ``K ** -0.5``.
    initial_state: ``W_0 [B, N, K, V]`` or None (zeros).
    output_final_state: also return ``W_T`` (in the compute dtype: float32, float64 for
      float64 inputs).
    implementation: ``"recurrent"`` (a scan over tokens), ``"chunked"`` (the dual form, one
      step per mini-batch) or None (chunked). There is no T x T "parallel" form: the
      mini-batches chain nonlinearly in ``W``.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, W_T)``.

  Examples:
    >>> k = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2).repeat(2, axis=1)
    >>> v = jnp.array([2.0, 2.0]).reshape(1, 2, 1, 1)
    >>> fn = jax.jit(ttt_linear, static_argnames=("implementation", "mini_batch_size"))
    >>> fn(k, k, v, jnp.full((1, 2, 1), 0.5), mini_batch_size=2, scale=1.0)[0, :, 0, 0]
    Array([1., 2.], dtype=float32)

    The two forms give the same output (``[B, T, N, K] = [1, 8, 2, 4]``, mini-batches of 4):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> eta = jnp.full((1, 8, 2), 0.1)
    >>> o = fn(q, k, v, eta, mini_batch_size=4, implementation="recurrent")
    >>> o.shape
    (1, 8, 2, 4)
    >>> o_chunked = fn(q, k, v, eta, mini_batch_size=4, implementation="chunked")
    >>> bool(jnp.allclose(o, o_chunked, atol=1e-5))
    True

  References:
    Y. Sun, X. Li, K. Dalal, J. Xu, A. Vikram, G. Zhang, Y. Dubois, X. Chen, X. Wang,
    S. Koyejo, T. Hashimoto & C. Guestrin, 2024, "Learning to (Learn at Test Time): RNNs with
    Expressive Hidden States".
  """
  fn_name = "ttt_linear"
  q, k, v = _checks.check_qkv(q, k, v, fn_name)
  B, T, N, K = q.shape
  V = v.shape[-1]
  cdt = _checks.compute_dtype_of(q, k, v)
  mini_batch_size, eta = _check_inner(mini_batch_size, eta, (B, T, N), fn_name, cdt)
  implementation = _checks.check_forms(implementation, ("recurrent", "chunked"), "chunked",
                                       fn_name)
  scale = _checks.resolve_scale(scale, K, fn_name)
  q, k, v = q.astype(cdt), k.astype(cdt), v.astype(cdt)
  S0 = (_zero_state(k, v) if initial_state is None
        else _checks.check_state(initial_state, (B, N, K, V), fn_name, dtype=cdt))
  plan = _cp_active()
  if plan is not None:   # under context_parallel: this shard's incoming weights, the final ones
    S0, W_final = _cp_ttt_states(k, v, eta, S0, mini_batch_size, plan, fn_name)
  S0 = chunk.vary_like(S0, q, k, v, eta)   # the scans carry it (jax.shard_map's check_vma)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  form = _recurrent if implementation == "recurrent" else _chunked
  o, W_T = form(q * scale, k, v, eta, S0, mini_batch_size)
  if plan is not None:
    W_T = W_final
  o = o.astype(dtype)
  return (o, W_T) if output_final_state else o


def ttt_linear_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, eta: ArrayLike,
                    state: Any = None, *, mini_batch_size: int = 16,
                    scale: float | None = None) -> tuple[jax.Array, Any]:
  r"""One decoding step of :func:`ttt_linear`.

  The state is ``(W_s, W_t, i)``: the mini-batch's start weights, the current weights and
  the number of tokens seen (``i % b == 0`` starts a new mini-batch). ``None`` is the
  start of a sequence with ``W_0 = 0``; pass ``(W_0, W_0, 0)`` for another ``W_0``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``; eta: ``[B, N]``.
    state: ``(W_s [B, N, K, V], W_t [B, N, K, V], i)`` or None.
    mini_batch_size, scale: as in :func:`ttt_linear`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state)``.

  Examples:
    >>> k = jnp.array([[[1.0, 0.0]]])
    >>> o, state = ttt_linear_step(k, k, jnp.full((1, 1, 1), 2.0), jnp.full((1, 1), 0.5),
    ...                            scale=1.0)
    >>> o
    Array([[[1.]]], dtype=float32)

  References:
    Sun et al., 2024, "Learning to (Learn at Test Time)" (in full: :func:`ttt_linear`).
  """
  fn_name = "ttt_linear_step"
  q, k, v, (B, N, K, V), cdt = _checks.check_step_inputs(q, k, v, fn_name)
  mini_batch_size, eta = _check_inner(mini_batch_size, eta, (B, N), fn_name, cdt)
  scale = _checks.resolve_scale(scale, K, fn_name)
  if state is None:
    zeros = jnp.zeros((B, N, K, V), cdt)
    state = (zeros, zeros, 0)
  _checks.check_tuple(state, 3, "state", fn_name, "(W_s, W_t, i)")
  Ws = _checks.check_state(state[0], (B, N, K, V), fn_name, "state", dtype=cdt)
  Wt = _checks.check_state(state[1], (B, N, K, V), fn_name, "state", dtype=cdt)
  i = jnp.asarray(state[2])
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  q, k, v = (x.astype(cdt) for x in (q, k, v))
  new = (i % mini_batch_size) == 0
  Ws = jnp.where(new, Wt, Ws)
  err = jnp.einsum("bnkv,bnk->bnv", Ws, k) - v
  Wt = Ws - eta[..., None, None] * k[..., :, None] * err[..., None, :] + jnp.where(
      new, 0.0, Wt - Ws)
  o = jnp.einsum("bnkv,bnk->bnv", Wt, q * scale)
  return o.astype(dtype), (Ws, Wt, i + 1)
