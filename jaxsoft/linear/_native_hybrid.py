r"""Native Hybrid Attention: one softmax over linear-RNN memory slots and a sliding window.

Feature A45 (Du et al. 2025, "Native Hybrid Attention for Efficient Sequence Modeling").
Long-term context lives in ``M`` key / value slots written by a gated linear RNN;
short-term context is a sliding window over the last ``w`` tokens; one softmax is taken
over both:

.. math::
  \tilde K_t = \operatorname{diag}(α_t) \tilde K_{t-1} + (1 - α_t) k_t^\top, \qquad
  \tilde V_t = \operatorname{diag}(α_t) \tilde V_{t-1} + (1 - α_t) v_t^\top,
  \\
  o_t = \operatorname{softmax}\big(\text{scale} \cdot q_t [\tilde K_t ; k_{t-w+1..t}]^\top\big)
        [\tilde V_t ; v_{t-w+1..t}],

``α_t = e^{a_t} \in (0, 1]^M`` per slot. The slot update is that of Gated Slot Attention,
a reconstruction [R] of the paper's (the softmax over slots and window is the paper's).
``w`` alone moves the layer between linear (small ``w``) and full attention (``w >= T``). Slots start at zero (or at an
initial state), and a zero slot still takes part in the softmax with score 0.

Forms: ``"recurrent"`` (a scan over tokens carrying the slots and a ring buffer of the last
``w`` keys and values: memory O(M + w) per step), ``"parallel"`` (the window as a masked
``[T, T]`` score matrix) and ``"chunked"`` (the window blockwise: each block of
``C = max(chunk_size, w)`` queries sees its own and the previous block's keys; no T x T
buffer). The parallel and chunked forms compute every token's slots with an associative
scan (memory O(T·M·(K + V))).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.linear import _checks, chunk
from jaxsoft.linear.context_parallel import active as _cp_active
from jaxsoft.linear.context_parallel import hybrid_states as _cp_hybrid_states

__all__ = ["native_hybrid_attention", "native_hybrid_attention_step"]


def _keep(run):
  """``[B, T]``: False where a new run (segment) starts, built from ``run`` (its sharding)."""
  return jnp.concatenate([jnp.ones_like(run[:, :1], dtype=bool), run[:, 1:] == run[:, :-1]],
                         axis=1)


def _slots_all(a, k, v, keep, K0, V0):
  """Every token's slots ``[B, T, N, M, K]`` and ``[B, T, N, M, V]`` by an associative scan of
  ``h_t = α_t h_{t-1} + (1 - α_t) x_t`` (``α_t := 0`` where the segment starts anew)."""
  alpha = jnp.exp(a)                                                   # [B, T, N, M]
  decay = jnp.where(keep[:, :, None, None], alpha, 0.0)
  xk = (1.0 - alpha)[..., None] * k[:, :, :, None, :]
  xv = (1.0 - alpha)[..., None] * v[:, :, :, None, :]
  # the initial state enters as a token before t = 0
  xk = xk.at[:, 0].add(decay[:, 0, ..., None] * K0)
  xv = xv.at[:, 0].add(decay[:, 0, ..., None] * V0)

  def combine(left, right):
    d1, k1, v1 = left
    d2, k2, v2 = right
    return d1 * d2, d2[..., None] * k1 + k2, d2[..., None] * v1 + v2

  _, Ks, Vs = jax.lax.associative_scan(combine, (decay, xk, xv), axis=1)
  return Ks, Vs


def _joint_softmax(slot_logits, win_logits):
  """The unnormalised weights ``(e^{slot - m}, e^{win - m})`` and their sum ``den`` of
  ``softmax([slot_logits ; win_logits])`` (masked window logits are ``-inf``)."""
  m = jnp.max(win_logits, -1)   # the token itself is always in its window: finite
  if slot_logits.shape[-1]:
    m = jnp.maximum(m, jnp.max(slot_logits, -1))
  m = m[..., None]
  ps, pw = jnp.exp(slot_logits - m), jnp.exp(win_logits - m)
  den = jnp.sum(ps, -1, keepdims=True) + jnp.sum(pw, -1, keepdims=True)
  return ps, pw, den


def _with_halo(k, v, run, halo):
  """``k, v, run`` with ``halo = (k_h, v_h, run_h)`` (the previous shard's last ``w - 1``
  tokens under context parallelism, run id -1 where not visible) in front, or unchanged."""
  if halo is None:
    return k, v, run
  return tuple(jnp.concatenate([h, x], axis=1) for h, x in zip(halo, (k, v, run), strict=True))


def _parallel(q, k, v, a, run, K0, V0, w, halo=None):
  B, T, N, _ = q.shape
  keep = _keep(run)
  Ks, Vs = _slots_all(a, k, v, keep, K0, V0)
  slot_logits = jnp.einsum("btnk,btnmk->btnm", q, Ks)
  kx, vx, rx = _with_halo(k, v, run, halo)
  t, s = jnp.arange(T), jnp.arange(T - kx.shape[1], T)                 # halo positions < 0
  band = (t[:, None] >= s[None, :]) & (t[:, None] - s[None, :] < w)
  mask = band[None] & (run[:, :, None] == rx[:, None, :])              # [B, T, S]
  win_logits = jnp.where(mask[:, None], jnp.einsum("btnk,bsnk->bnts", q, kx), -jnp.inf)
  win_logits = jnp.moveaxis(win_logits, 1, 2)                          # [B, T, N, S]
  ps, pw, den = _joint_softmax(slot_logits, win_logits)
  o = jnp.einsum("btnm,btnmv->btnv", ps, Vs) + jnp.einsum("btns,bsnv->btnv", pw, vx)
  return o / den, (Ks[:, -1], Vs[:, -1])


def _chunked(q, k, v, a, run, K0, V0, w, C, halo=None):
  B, T, N, K = q.shape
  keep = _keep(run)
  Ks, Vs = _slots_all(a, k, v, keep, K0, V0)
  slot_logits = jnp.einsum("btnk,btnmk->btnm", q, Ks)
  pad = (-T) % C
  qp, kp, vp = (chunk.pad_time(x, 1, pad) for x in (q, k, v))
  rp = chunk.pad_time(run, 1, pad, mode="edge")
  n = (T + pad) // C
  qc = chunk.to_chunks(qp, 1, C)                                      # [B, n, C, N, K]
  kc, vc, rc = (chunk.to_chunks(x, 1, C) for x in (kp, vp, rp))
  # block 0's predecessor: nothing (run id -1 never matches), or the context-parallel halo
  first: tuple[jax.Array, ...] = (jnp.zeros_like(kc[:, :1]), jnp.zeros_like(vc[:, :1]),
                                  jnp.full_like(rc[:, :1], -1))
  if halo is not None:
    first = tuple(f.at[:, 0, C - h.shape[1]:].set(h) for f, h in zip(first, halo, strict=True))
  prev = lambda x, f: jnp.concatenate([f, x[:, :-1]], axis=1)
  k2 = jnp.concatenate([prev(kc, first[0]), kc], axis=2)               # [B, n, 2C, N, K]
  v2 = jnp.concatenate([prev(vc, first[1]), vc], axis=2)
  r_prev = prev(rc, first[2])                                         # the previous block's
  r2 = jnp.concatenate([r_prev, rc], axis=2)                          # [B, n, 2C]
  pos_q = jnp.arange(n)[:, None] * C + jnp.arange(C)[None]             # [n, C]
  pos_k = jnp.arange(n)[:, None] * C + jnp.arange(-C, C)[None]         # [n, 2C]
  diff = pos_q[:, :, None] - pos_k[:, None, :]
  band = (diff >= 0) & (diff < w)                                      # [n, C, 2C]
  mask = band[None] & (rc[:, :, :, None] == r2[:, :, None, :])         # [B, n, C, 2C]
  win_logits = jnp.where(mask[:, :, :, None],
                         jnp.einsum("bicnk,bijnk->bicnj", qc, k2), -jnp.inf)
  win_logits = chunk.from_chunks(win_logits, 1)[:, :T]               # [B, T, N, 2C]
  ps, pw, den = _joint_softmax(slot_logits, win_logits)
  pw_c = chunk.to_chunks(chunk.pad_time(pw, 1, pad), 1, C)
  o_win = chunk.from_chunks(jnp.einsum("bicnj,bijnv->bicnv", pw_c, v2), 1)[:, :T]
  o = jnp.einsum("btnm,btnmv->btnv", ps, Vs) + o_win
  return o / den, (Ks[:, -1], Vs[:, -1])


def _token(carry, x, w):
  """One token: ``carry = (K̃, Ṽ, ring_k [B, w, N, K], ring_v, valid [B, w], t)``."""
  Kt, Vt, ring_k, ring_v, valid, t = carry
  q_t, k_t, v_t, a_t, keep_t = x
  alpha = jnp.exp(a_t)
  kept = jnp.where(keep_t[:, None, None], alpha, 0.0)[..., None]
  Kt = kept * Kt + (1.0 - alpha)[..., None] * k_t[:, :, None]
  Vt = kept * Vt + (1.0 - alpha)[..., None] * v_t[:, :, None]
  valid = valid & keep_t[:, None]
  slot = t % w
  ring_k = ring_k.at[:, slot].set(k_t)
  ring_v = ring_v.at[:, slot].set(v_t)
  valid = valid.at[:, slot].set(True)
  sl = jnp.einsum("bnk,bnmk->bnm", q_t, Kt)
  wl = jnp.where(valid[:, None], jnp.einsum("bnk,bwnk->bnw", q_t, ring_k), -jnp.inf)
  ps, pw, den = _joint_softmax(sl, wl)
  o = (jnp.einsum("bnm,bnmv->bnv", ps, Vt) + jnp.einsum("bnw,bwnv->bnv", pw, ring_v)) / den
  return (Kt, Vt, ring_k, ring_v, valid, t + 1), o


def _empty_window(k, v, w):
  """The empty ring buffer ``(ring_k [B, w, N, K], ring_v [B, w, N, V], valid [B, w])``,
  built from ``k, v [B, T, N, ...]`` so that it carries their batch sharding."""
  ring = lambda x: jnp.zeros_like(jnp.broadcast_to(x[:, :1], (x.shape[0], w) + x.shape[2:]))
  # a reduction over the heads, not head 0: a head axis sharded on an explicit mesh
  first = jnp.sum(k[:, :1], axis=(2, 3))
  return ring(k), ring(v), jnp.zeros_like(first, dtype=bool).repeat(w, axis=1)


def _recurrent(q, k, v, a, run, K0, V0, w, halo=None):
  keep = _keep(run)
  tf = lambda x: jnp.moveaxis(x, 1, 0)
  window = _empty_window(k, v, w)
  if halo is not None:   # the ring holds the halo's tokens at their slots (t - w + 1 .. -1) % w
    at = (jnp.arange(halo[0].shape[1]) - halo[0].shape[1]) % w
    window = tuple(r.at[:, at].set(h) for r, h in zip(window, (*halo[:2], halo[2] >= 0), strict=True))
  carry = (K0, V0, *window)
  # every part of the carry varies over the shard_map axes the inputs do (check_vma)
  carry = tuple(chunk.vary_like(c, q, k, v, a, run) for c in carry)
  carry = carry + (jnp.zeros((), jnp.int32),)
  (K_T, V_T, *_), o = jax.lax.scan(lambda c, x: _token(c, x, w), carry,
                                   (tf(q), tf(k), tf(v), tf(a), tf(keep)))
  return jnp.moveaxis(o, 0, 1), (K_T, V_T)


def _slot_gates(slot_log_gates, lead: tuple[int, ...], fn_name: str) -> jax.Array:
  """``slot_log_gates`` checked: ``[*lead, M]`` log forget gates ``<= 0`` of the M slots,
  ``lead`` ``(B, T, N)`` (a sequence) or ``(B, N)`` (one step)."""
  layout = "B, T, N" if len(lead) == 3 else "B, N"
  sg = jnp.asarray(slot_log_gates)
  if sg.ndim != len(lead) + 1 or sg.shape[:-1] != tuple(lead):
    raise ValueError(f"{fn_name}: `slot_log_gates` must have shape [{layout}, M] with "
                     f"[{layout}] = {list(lead)}, got {sg.shape}")
  return _checks.check_gate(sg, sg.shape, f"[{layout}, M]", fn_name, "slot_log_gates")


def native_hybrid_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, slot_log_gates: ArrayLike,
                            *, window: int, scale: float | None = None,
                            initial_state: Any = None, output_final_state: bool = False,
                            segment_ids: ArrayLike | None = None,
                            implementation: str | None = None, chunk_size: int = 64) -> Any:
  r"""One softmax over ``M`` linear-RNN slots and a sliding window of ``w`` tokens (A45).

  .. math::
    \tilde K_t = \operatorname{diag}(α_t) \tilde K_{t-1} + (1 - α_t) k_t^\top, \quad
    \tilde V_t = \operatorname{diag}(α_t) \tilde V_{t-1} + (1 - α_t) v_t^\top, \quad
    o_t = \operatorname{softmax}(\text{scale}\, q_t [\tilde K_t ; K_{W_t}]^\top)
          [\tilde V_t ; V_{W_t}]

  with ``W_t = {t-w+1, ..., t}`` (within ``t``'s segment) and ``α_t = e^{a_t}`` (Du et al.
  2025, "Native Hybrid Attention for Efficient Sequence Modeling"; the slot update is the
  Gated-Slot-Attention form [R]). Slots reset at a segment change.

  Args:
    q, k: ``[B, T, N, K]``; v: ``[B, T, N, V]``.
    slot_log_gates: ``[B, T, N, M]`` log forget gates ``a_t <= 0`` of the ``M`` slots
      (``M = 0``: sliding-window softmax attention alone).
    window: ``w >= 1``, the sliding window (the token itself included).
    scale: multiplies the scores; default ``K ** -0.5``.
    initial_state: ``(K̃_0 [B, N, M, K], Ṽ_0 [B, N, M, V])`` or None (zeros). The window
      starts empty.
    output_final_state: also return the slots ``(K̃_T, Ṽ_T)`` (the window's cache is the
      caller's last ``w - 1`` keys and values).
    segment_ids: ``[B, T]`` ints.
    implementation: ``"parallel"``, ``"recurrent"``, ``"chunked"`` or None (parallel when
      ``T <= chunk_size``, else chunked).
    chunk_size: the query block of the chunked form (raised to ``w`` if smaller).

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, (K̃_T, Ṽ_T))``.

  Examples:
    >>> q = jnp.zeros((1, 2, 1, 1)); v = jnp.array([2.0, 4.0]).reshape(1, 2, 1, 1)
    >>> a = jnp.log(jnp.full((1, 2, 1, 1), 0.5))        # one slot, gate 1/2
    >>> native_hybrid_attention(q, q, v, a, window=1)[0, :, 0, 0]   # (1 + 2)/2, (2.5 + 4)/2
    Array([1.5 , 3.25], dtype=float32)

    ``[B, T, N, K] = [1, 8, 2, 4]``: with no slots and a window covering the sequence it is
    causal softmax attention:

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> no_slots = jnp.zeros((1, 8, 2, 0))
    >>> fn = jax.jit(native_hybrid_attention, static_argnames=("implementation", "window"))
    >>> o = fn(q, k, v, no_slots, window=8, implementation="recurrent")
    >>> o.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(o, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
    True

  References:
    J. Du, J. Hu, T. Zhang, W. Sun & Y. Cheng, 2025, "Native Hybrid Attention for Efficient
    Sequence Modeling".

    Y. Zhang et al., 2024, "Gated Slot Attention for Efficient Linear-Time Sequence Modeling"
    (the slot update).
  """
  fn_name = "native_hybrid_attention"
  q, k, v = _checks.check_qkv(q, k, v, fn_name)
  B, T, N, K = q.shape
  V = v.shape[-1]
  window = positive_int(window, "window", fn_name)
  chunk_size = _checks.check_chunk_size(chunk_size, fn_name)
  impl = _checks.check_implementation(implementation, T, chunk_size, fn_name)
  cdt = _checks.compute_dtype_of(q, k, v)
  a = _slot_gates(slot_log_gates, (B, T, N), fn_name).astype(cdt)
  M = a.shape[-1]
  seg = _checks.check_segment_ids(segment_ids, (B, T), fn_name)
  scale = _checks.resolve_scale(scale, K, fn_name)
  if initial_state is None:   # zeros built from the inputs: their batch sharding
    K0 = jnp.zeros_like(jnp.einsum("bnm,bnk->bnmk", a[:, 0], k[:, 0]), dtype=cdt)
    V0 = jnp.zeros_like(jnp.einsum("bnm,bnv->bnmv", a[:, 0], v[:, 0]), dtype=cdt)
  else:
    _checks.check_tuple(initial_state, 2, "initial_state", fn_name,
                        "a pair (K̃ [B, N, M, K], Ṽ [B, N, M, V])")
    K0 = _checks.check_state(initial_state[0], (B, N, M, K), fn_name, dtype=cdt)
    V0 = _checks.check_state(initial_state[1], (B, N, M, V), fn_name, dtype=cdt)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  qs, kf, vf = q.astype(cdt) * scale, k.astype(cdt), v.astype(cdt)
  run = chunk.run_ids(seg, B, T, like=q)
  halo = final = None
  plan = _cp_active()
  if plan is not None:   # under context_parallel: the incoming slots, the previous window
    keep = _keep(run)
    Ks, Vs = _slots_all(a, kf, vf, keep, jnp.zeros_like(K0), jnp.zeros_like(V0))
    (K0, V0), halo, final = _cp_hybrid_states(kf, vf, a, seg, run, K0, V0, window, plan, fn_name,
                                              zero_start_slots=(keep, Ks[:, -1], Vs[:, -1]))
  if impl == "recurrent":
    o, state = _recurrent(qs, kf, vf, a, run, K0, V0, window, halo)
  elif impl == "chunked":
    o, state = _chunked(qs, kf, vf, a, run, K0, V0, window, max(chunk_size, window), halo)
  else:
    o, state = _parallel(qs, kf, vf, a, run, K0, V0, window, halo)
  state = state if final is None else final
  o = o.astype(dtype)
  return (o, state) if output_final_state else o


def native_hybrid_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                                 slot_log_gates: ArrayLike, state: Any = None, *, window: int,
                                 scale: float | None = None) -> tuple[jax.Array, Any]:
  r"""One decoding step of :func:`native_hybrid_attention`.

  The state is ``(K̃ [B, N, M, K], Ṽ [B, N, M, V], ring_k [B, w, N, K], ring_v [B, w, N, V],
  valid [B, w], t)``: the slots, a ring buffer of the last ``w`` keys and values and the
  number of tokens seen. None starts a sequence (zero slots, an empty window).

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``; slot_log_gates: ``[B, N, M]`` (``<= 0``).
    state: as above, or None.
    window, scale: as in :func:`native_hybrid_attention`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state)``.

  Examples:
    >>> o, state = native_hybrid_attention_step(
    ...     jnp.zeros((1, 1, 1)), jnp.zeros((1, 1, 1)), jnp.full((1, 1, 1), 2.0),
    ...     jnp.log(jnp.full((1, 1, 1), 0.5)), window=1)
    >>> o   # (slot 0.5 * 2 + window 2) / 2
    Array([[[1.5]]], dtype=float32)

  References:
    Du et al., 2025, "Native Hybrid Attention" (in full: :func:`native_hybrid_attention`).
  """
  fn_name = "native_hybrid_attention_step"
  q, k, v, (B, N, K, V), cdt = _checks.check_step_inputs(q, k, v, fn_name)
  window = positive_int(window, "window", fn_name)
  a = _slot_gates(slot_log_gates, (B, N), fn_name)
  M = a.shape[-1]
  scale = _checks.resolve_scale(scale, K, fn_name)
  if state is None:
    state = (jnp.zeros((B, N, M, K), cdt), jnp.zeros((B, N, M, V), cdt),
             *_empty_window(k[:, None], v[:, None], window), jnp.zeros((), jnp.int32))
  _checks.check_tuple(state, 6, "state", fn_name, "(K̃, Ṽ, ring_k, ring_v, valid, t)")
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  c = lambda x: jnp.asarray(x).astype(cdt)
  state = (*(c(x) for x in state[:4]), *state[4:])   # slots and window in the compute dtype
  state, o = _token(state, (c(q) * scale, c(k), c(v), c(a), jnp.ones((B,), bool)), window)
  return o.astype(dtype), state
