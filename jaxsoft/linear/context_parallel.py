r"""Context parallelism for the recurrent linear-attention families: the sequence split over a
mesh axis, one ``all_gather`` of each shard's state map, a fold in sequence order.

The families of the shared front end run one recurrence (:mod:`jaxsoft.linear.recurrence`)
whose state evolves, token by token, by a map that is affine in the state,

.. math::
  S_t = A_t S_{t-1} + k_t u_t^\top, \qquad
  A_t = \operatorname{diag}(e^{g_t}) \ \text{(linear attention, GLA: } u_t = v_t), \qquad
  A_t = (I - \beta_t k_t k_t^\top)\operatorname{diag}(e^{g_t}) \ \text{(delta rules)},

the write ``k_t u_t^T`` not depending on the state except through ``A_t`` (the delta rule's
``u_t = β_t (v_t - \tilde S_t^T k_t)`` is the ``-β_t k_t k_t^T`` in ``A_t``). Over the
``T/P`` tokens of shard ``p`` of ``P`` (contiguous: shard ``p`` holds tokens
``[p T/P, (p + 1) T/P)``) the state map composes to

.. math::
  S_{\text{out}} = \mathcal A_p S_{\text{in}} + \mathcal B_p, \qquad
  \mathcal A_p = A_{t_1} \cdots A_{t_0}, \qquad \mathcal B_p = S_{\text{out}}(S_{\text{in}} = 0),

a diagonal (one decay per key channel, or one per head: ``[B, N, K]`` / ``[B, N, 1]``) for the
gated linear attentions and a ``K x K`` matrix for the delta rules. Each shard builds its
``(\mathcal A_p, \mathcal B_p)`` from a zero state with the chunked form's own per-chunk maps
(``recurrence._state_map``: ``S_end = (diag(e^{G_C}) - \bar K^T W) S + \bar K^T \tilde U``,
composed over the shard's chunks by one ``lax.scan`` carrying ``[\mathcal B | \mathcal A]``
``[K, V + K]``, or ``[K, V]`` and a product of decays for the diagonal families). One
``all_gather`` over ``axis_name`` gives every shard all ``P`` maps; a
``jax.lax.associative_scan`` of the compositions
``(\mathcal A_2, \mathcal B_2) \circ (\mathcal A_1, \mathcal B_1) = (\mathcal A_2 \mathcal A_1,
\mathcal A_2 \mathcal B_1 + \mathcal B_2)`` in sequence order gives the state entering each
shard,

.. math::
  S_{\text{in}, 0} = S_0, \qquad
  S_{\text{in}, p} = (\mathcal A_{p-1}, \mathcal B_{p-1}) \circ \cdots \circ
  (\mathcal A_0, \mathcal B_0)\,(S_0),

and the last shard's output state is the global final state (every shard has it: it is what
the functions return as ``final_state``). The shard's outputs are then its forward pass (the
call's own form: parallel, chunked, recurrent or Pallas) started from ``S_{in, p}``; that is
exact, and costs the chunk terms twice (once for the map, once in the pass) plus
``log2 P`` compositions of ``[K, K]`` (delta rules) or ``[K]`` maps on every shard; the
communication is one ``all_gather`` of the maps, ``P·B·N·K·(V + K)`` numbers for the delta
rules and ``P·B·N·(K·V + K)`` (per-channel decays) or ``P·B·N·(K·V + 1)`` (one decay per
head) for the diagonal families, one ``psum`` of the final state ``[B, N, K, V]`` and, with
``segment_ids``, one ``ppermute`` of ``B`` ids.

Packed sequences: a reset inside a shard zeroes the map from the reset on (the chunk terms
already mask the decays where the run changes, so ``\mathcal A_p`` comes out 0 and
``\mathcal B_p`` holds only the last run's writes); a reset AT the shard boundary (the
shard's first id differs from the previous shard's last, one ``ppermute``) multiplies the
incoming state by 0: the map used in the fold is ``keep_p \mathcal A_p``. The initial state
``S_0`` enters at shard 0, which always keeps it (as the unsharded call does at ``t = 0``).

States and maps are in the call's compute dtype (float32, float64 for float64 inputs under
``JAX_ENABLE_X64``). Gradients flow through everything (``all_gather`` transposes to a
reduce-scatter; each shard's ``S_{in}`` receives the cotangent of its own outputs only).

Sequence order: linear context parallelism needs CONTIGUOUS shards in sequence order. The
causal load balancing of ring attention (shard ``i`` holding chunks ``i`` and ``2P - 1 - i``)
breaks that order; a hybrid model that reorders for its attention layers undoes the reorder
around its linear layers (or runs the linear layers on contiguous shards and reorders only
the attention inputs). There is no ``chunk_order`` argument.

Four families need more than the shared front end (each reads the active context through a
small hook; the costs are in addition to the family's own forward pass on the shard):

* ``cosformer`` is linear attention on the features ``[relu(x) cos a_i, relu(x) sin a_i]``,
  ``a_i = π i / 2M``: the incoming state holds the earlier shards' keys at their global
  positions, so each shard passes its traced offset ``start_position = s + p T/P`` and the
  GLOBAL ``max_len = M`` (default ``s + T``, the whole sequence's length), then runs the
  shared recurrence and fold above. Cost: that of ``linear_attention`` on ``2K`` features.
* ``ttt_linear``: a mini-batch of ``b`` tokens maps the inner weights affinely,
  ``W_end = (I - K^T \operatorname{diag}(η) K) W_s + K^T \operatorname{diag}(η) V``, so the
  shard's mini-batches compose to ``(\mathcal A [K, K], \mathcal B [K, V])``, folded like
  the delta rules' maps (all_gather of ``P·B·N·K·(K + V)`` numbers, ``log2 P`` ``[K, K]``
  products). Mini-batches are counted from the sequence's start, so ``T/P`` must be a
  multiple of ``b`` (ValueError otherwise).
* ``native_hybrid_attention``: the slots ``h_t = α_t h_{t-1} + (1 - α_t) x_t`` are a diagonal
  map per slot (``\mathcal A_p = \prod_t α_t``, 0 after a reset), folded on ``[K̃ | Ṽ]``
  (all_gather of ``P·B·N·M·(1 + K + V)`` numbers); the sliding window's first ``w - 1``
  queries need the previous shard's last ``w - 1`` keys and values, a halo brought by
  ``ppermute`` (``B·(w - 1)·N·(K + V)`` numbers, and their segment ids): ``T/P >= w - 1``.
  The halo enters every form (the parallel form's keys, the chunked form's block before
  block 0, the recurrent form's ring buffer) with the segment rule of the window.
* ``mhla`` (no recurrent state of fixed size; its decoding state is every block's summary):
  query ``t`` in block ``i`` reads ``Σ_{β<i} c_{iβ} S_β`` plus its own block causally; the block summaries ``S_β = Σ_{j∈β} φ(k_j)[v_j; 1]^T`` are one ``all_gather`` of
  ``B·M·N·K'·(V + 1)`` numbers (``M = T/b`` blocks in all, no fold: ``C`` mixes every earlier
  block, not one state), each shard reads its rows ``c_{i·}`` of the global ``C [M, M]``.
  ``T/P`` must be a multiple of ``b``; the chunked (block-summary) form runs whatever
  ``implementation`` says (the parallel form would need every key).

None of the four needs a sequential relay (shard ``p`` waiting for shard ``p - 1``'s final
state: ``P`` rounds of ``ppermute``, ``O(P)`` latency, exact for any recurrence): every state
map here is affine and composes associatively in ``log2 P`` steps.

Short convolutions: :func:`short_conv_halo` brings the previous shard's last
``conv_size - 1`` inputs (one ``ppermute``), and :func:`context_parallel_mixer` runs a
:class:`jaxsoft.nn.LinearMixer` with it (no change to the layer).

References:
  S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
  with Hardware-Efficient Training" (arXiv:2312.06635): the chunk-level state passing.

  W. Sun, Z. Qin, D. Li, X. Shen, Y. Qiao & Y. Zhong, 2025, "Linear Attention Sequence
  Parallelism" (arXiv:2404.02882): the sequence split over devices with state passing.

  S. Yang, B. Wang, Y. Zhang, Y. Shen & Y. Kim, 2024, "Parallelizing Linear Transformers with
  the Delta Rule over Sequence Length" (arXiv:2406.06484): the delta rule's chunk map.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft.linear import chunk as _chunk
from jaxsoft.linear import recurrence as _recurrence

__all__ = ["context_parallel", "context_parallel_mixer", "short_conv_halo",
           "CONTEXT_PARALLEL_FAMILIES", "CONTEXT_PARALLEL_UNSUPPORTED"]

# The recurrent families (a ``*_step`` function in jaxsoft.linear) that run exactly under
# context parallelism: the first twelve route their recurrence(s) through the shared front end;
# cosformer too, with its global positions; ttt_linear, native_hybrid_attention and mhla
# through their own hooks (the module docstring has the maps).
CONTEXT_PARALLEL_FAMILIES: tuple[str, ...] = (
    "linear_attention", "simple_gla", "gla", "delta_rule", "gated_delta_rule",
    "lightning_attention", "taylor_linear_attention", "mala", "ccq",
    "softmax_linear_attention", "interdomain_attention", "transnormer_attention",
    "cosformer", "ttt_linear", "native_hybrid_attention", "mhla")

# The recurrent families that refuse, and why (each raises NotImplementedError): none today.
CONTEXT_PARALLEL_UNSUPPORTED: dict[str, str] = {}

# LinearMixer kinds -> the function each calls (the mixer path accepts the supported ones).
_MIXER_FUNCTIONS = {
    "gated_delta_rule": "gated_delta_rule", "delta_rule": "delta_rule",
    "simple_gla": "simple_gla", "gla": "gla", "lightning_attention": "lightning_attention",
    "linear": "linear_attention", "mala": "mala", "ccq": "ccq",
    "softmax_linear_attention": "softmax_linear_attention", "interdomain": "interdomain_attention",
    "ttt_linear": "ttt_linear", "native_hybrid": "native_hybrid_attention",
}


@dataclasses.dataclass
class _Plan:
  """The active context: the mesh axis and how many recurrences used it."""

  axis_name: Any
  uses: int = 0


_ACTIVE: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar(
    "jaxsoft_linear_context_parallel", default=None)


def active() -> _Plan | None:
  """The active plan (inside :func:`context_parallel`'s call), else None."""
  return _ACTIVE.get()


@contextlib.contextmanager
def _activated(axis_name: Any) -> Iterator[_Plan]:
  plan = _Plan(axis_name)
  token = _ACTIVE.set(plan)
  try:
    yield plan
  finally:
    _ACTIVE.reset(token)


def _axis_size(axis_name: Any, fn_name: str) -> int:
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError:
    raise ValueError(f"{fn_name}: `axis_name` {axis_name!r} is not a bound mesh axis: call it "
                     "inside jax.shard_map over a mesh with that axis (the sequence axis "
                     "split over it)") from None


def _shard_map(q, k, v, g, beta, run, chunk: int):
  r"""``(\mathcal A, \mathcal B)`` of this shard's tokens (``[B, N, T, ...]`` layout): the
  per-chunk maps of ``recurrence._state_map`` composed over the chunks in order.
  ``\mathcal A`` is ``[B, N, K or 1]`` (a diagonal) without ``beta``, else ``[B, N, K, K]``."""
  B, N, T, K = q.shape
  C = min(chunk, T)
  pad = (-T) % C
  q, k, v = (_chunk.pad_time(x, 2, pad) for x in (q, k, v))
  g = jnp.zeros_like(q[..., 0]) if g is None else _chunk.pad_time(g, 2, pad)
  run = _chunk.pad_time(run, 1, pad, mode="edge")
  bc = None if beta is None else _chunk.to_chunks(_chunk.pad_time(beta, 2, pad), 2, C)
  xs = tuple(_chunk.to_chunks(x, 2, C) for x in (q, k, v, g)) + (bc,)
  rc = _chunk.to_chunks(run, 1, C)
  run_prev = jnp.concatenate([rc[:, :1, 0], rc[:, :-1, -1]], axis=1)
  terms = _recurrence._terms(xs, rc, run_prev)
  ds = terms[2]                                                        # [B, N, nC, K or 1]
  M, b = _recurrence._state_map(terms)                                 # M [.., K, K] or None
  first = lambda x: jnp.moveaxis(x, 2, 0)
  if M is None:
    def body(S, x):
      ds_c, b_c = x
      return S * ds_c[..., None] + b_c, None

    S0 = _chunk.vary_like(jnp.zeros_like(b[:, :, 0]), b)
    B_map, _ = jax.lax.scan(body, S0, (first(ds), first(b)))
    return jnp.prod(ds, axis=2), B_map
  V = b.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(K, dtype=b.dtype), (B, N, K, K))
  X0 = _chunk.vary_like(jnp.concatenate([jnp.zeros_like(b[:, :, 0]), eye], axis=-1), b, M)

  def body_m(X, x):   # X = [B | A]: S_end = diag(ds) S - M S + b on both blocks
    ds_c, m_c, b_c = x
    X = X * ds_c[..., None] - jnp.einsum("bnkj,bnjw->bnkw", m_c, X)
    return X.at[..., :V].add(b_c), None

  X, _ = jax.lax.scan(body_m, X0, (first(ds), first(M), first(b)))
  return X[..., V:], X[..., :V]


def _apply(A, S):
  """``A S`` for a diagonal ``A [..., K or 1]`` or a matrix ``A [..., K, K]``."""
  if A.ndim == S.ndim:
    return jnp.einsum("...kj,...jv->...kv", A, S)
  return A[..., None] * S


def _compose(earlier, later):
  """``later ∘ earlier`` of affine maps ``(A, B)``: ``(A_l A_e, A_l B_e + B_l)``."""
  A_e, B_e = earlier
  A_l, B_l = later
  A = (jnp.einsum("...kj,...jl->...kl", A_l, A_e) if A_l.ndim == B_l.ndim else A_l * A_e)
  return A, _apply(A_l, B_e) + B_l


def _boundary_keep(seg, axis: Any, P: int, idx, dtype) -> jax.Array:
  """``[B]``: 0 where this shard's first token starts a new segment (its id differs from the
  previous shard's last: one ``ppermute`` of ``B`` ids), else 1; shard 0 keeps."""
  prev_last = jax.lax.ppermute(seg[:, -1], axis, [(i, i + 1) for i in range(P - 1)])
  return jnp.where(idx == 0, True, seg[:, 0] == prev_last).astype(dtype)


def _fold(A, B_map, S0, keep, axis: Any, P: int, idx) -> tuple[jax.Array, jax.Array]:
  r"""``(S_in, S_final)`` from this shard's affine map ``(\mathcal A, \mathcal B)``: one
  ``all_gather`` of the maps, their associative scan in sequence order from ``S0`` (the state
  before the whole sequence), this shard's incoming state (times ``keep [B]``, the reset at
  its first token, where given) and the last shard's end state (every shard has it)."""
  if keep is not None:
    A = A * keep.reshape((-1,) + (1,) * (A.ndim - 1))
  A_all = jax.lax.all_gather(A, axis)                                          # [P, B, N, ...]
  B_all = jax.lax.all_gather(B_map, axis)
  A_pre, B_pre = jax.lax.associative_scan(_compose, (A_all, B_all), axis=0)
  ends = _apply(A_pre, S0[None]) + B_pre                               # [P, B, N, K, V]
  starts = jnp.concatenate([S0[None].astype(ends.dtype) + jnp.zeros_like(ends[:1]),
                            ends[:-1]], axis=0)
  S_in = jax.lax.dynamic_index_in_dim(starts, idx, axis=0, keepdims=False)
  if keep is not None:
    S_in = S_in * keep.reshape((-1,) + (1,) * (S_in.ndim - 1))
  # every shard folded the same maps; the last shard's copy, summed, is typed invariant over
  # the axis (``out_specs=P()``), and the final state's cotangent reaches that copy only
  S_final = jax.lax.psum(jnp.where(idx == P - 1, ends[-1], 0.0), axis)
  return S_in, S_final


def states(call: Any, q, k, v, g, beta, run, S0, plan: _Plan) -> tuple[jax.Array, jax.Array]:
  """``(S_in, S_final)``: this shard's incoming state (the keep at its first token applied)
  and the global final state, for ``_dispatch.forward`` (``[B, N, T, ...]`` layout, ``q``
  scaled, every array in the compute dtype; ``S0`` None: zeros)."""
  axis = plan.axis_name
  plan.uses += 1
  P = _axis_size(axis, call.fn_name)
  idx = jax.lax.axis_index(axis)
  A, B_map = _shard_map(q, k, v, g, beta, run, call.chunk_size)
  S0 = jnp.zeros(B_map.shape, B_map.dtype) if S0 is None else S0.astype(B_map.dtype)
  seg = call.segment_ids
  keep = None if seg is None else _boundary_keep(seg, axis, P, idx, B_map.dtype)
  return _fold(A, B_map, S0, keep, axis, P, idx)


def ttt_states(k, v, eta, S0, b: int, plan: _Plan,
               fn_name: str) -> tuple[jax.Array, jax.Array]:
  r"""``(W_in, W_final)`` for ``ttt_linear`` (``[B, T, N, ...]`` layout, compute dtype).

  One mini-batch of ``b`` tokens maps its start weights affinely,
  ``W_end = W_s - K^T \operatorname{diag}(η)(K W_s - V) = (I - K^T \operatorname{diag}(η) K)
  W_s + K^T \operatorname{diag}(η) V``; the shard's mini-batches compose to one
  ``(\mathcal A [K, K], \mathcal B [K, V])`` (a scan carrying ``[\mathcal B | \mathcal A]``),
  folded like the delta rules' maps. Needs ``T_shard % b == 0`` (no mini-batch straddles
  two shards, so the shard's own mini-batches are the global ones)."""
  axis = plan.axis_name
  plan.uses += 1
  P = _axis_size(axis, fn_name)
  idx = jax.lax.axis_index(axis)
  B, T, N, K = k.shape
  V = v.shape[-1]
  if T % b:
    raise ValueError(f"{fn_name}: under context_parallel each shard's length must be a multiple "
                     f"of `mini_batch_size` = {b} (a mini-batch may not straddle two shards), "
                     f"got T_shard = {T}")
  kc, vc, ec = (jnp.moveaxis(_chunk.to_chunks(x, 1, b), 1, 0) for x in (k, v, eta))
  zeros = jnp.zeros_like(jnp.einsum("bnk,bnv->bnkv", k[:, 0], v[:, 0]))
  eye = jnp.broadcast_to(jnp.eye(K, dtype=zeros.dtype), (B, N, K, K))
  X0 = _chunk.vary_like(jnp.concatenate([zeros, eye], axis=-1), k, v, eta)

  def body(X, x):   # X = [B | A] <- (I - K^T diag(η) K) X + [K^T diag(η) V | 0]
    k_c, v_c, e_c = x                                                  # [B, b, N, ...]
    ke = k_c * e_c[..., None]
    X = X - jnp.einsum("bcnk,bcnj,bnjw->bnkw", ke, k_c, X)
    return X.at[..., :V].add(jnp.einsum("bcnk,bcnv->bnkv", ke, v_c)), None

  X, _ = jax.lax.scan(body, X0, (kc, vc, ec))
  return _fold(X[..., V:], X[..., :V], S0.astype(X.dtype), None, axis, P, idx)


def hybrid_states(k, v, a, seg, run, K0, V0, window: int, plan: _Plan, fn_name: str, *,
                  zero_start_slots):
  r"""``((K̃_in, Ṽ_in), halo, (K̃_T, Ṽ_T))`` for ``native_hybrid_attention`` (``[B, T, N, ...]``
  layout, compute dtype; ``seg`` the segment ids or None, ``run`` this shard's run ids).

  The slots follow ``h_t = α_t h_{t-1} + (1 - α_t) x_t`` per slot (``α_t := 0`` at a reset):
  over the shard ``h_out = (\prod_t α_t) h_in + h_out(h_in = 0)``, a diagonal map folded over
  the shards on ``[K̃ | Ṽ]`` (``[B, N, M, K + V]``). The halo is the previous shard's last
  ``w - 1`` keys and values (one ``ppermute`` each, and one of their segment ids) with their
  run ids in this shard's numbering: 0 where the halo token lies in the run of this shard's
  first token (no segment change between them), else -1 (never visible; all of shard 0's).
  ``zero_start_slots`` is the family's own ``(keep [B, T], K̃_T, Ṽ_T)``: its reset mask and
  this shard's final slots from zero slots (the map's constant part)."""

  axis = plan.axis_name
  plan.uses += 1
  P = _axis_size(axis, fn_name)
  idx = jax.lax.axis_index(axis)
  T, K = k.shape[1], k.shape[-1]
  H = window - 1
  if T < H:
    raise ValueError(f"{fn_name}: under context_parallel each shard must hold at least "
                     f"`window` - 1 = {H} tokens (the window reaches into the previous shard "
                     f"only), got T_shard = {T}")
  keep, K_end, V_end = zero_start_slots
  A = jnp.exp(jnp.sum(a, axis=1)) * jnp.all(keep, axis=1)[:, None, None]   # [B, N, M]
  B_map = jnp.concatenate([K_end, V_end], axis=-1)                       # [B, N, M, K + V]
  boundary = None if seg is None else _boundary_keep(seg, axis, P, idx, B_map.dtype)
  S_in, S_final = _fold(A, B_map, jnp.concatenate([K0, V0], axis=-1).astype(B_map.dtype),
                        boundary, axis, P, idx)
  send = lambda x: jax.lax.ppermute(x[:, T - H:], axis, [(i, i + 1) for i in range(P - 1)])
  visible = jnp.broadcast_to(idx > 0, run[:, :H].shape)
  if seg is not None:   # the halo's tokens with no segment change up to this shard's first
    same = (send(seg) == seg[:, :1]).astype(jnp.int32)
    visible = visible & (jnp.flip(jnp.cumprod(jnp.flip(same, 1), axis=1), 1) == 1)
  halo = (send(k), send(v), jnp.where(visible, 0, -1).astype(run.dtype))
  split = lambda S: (S[..., :K], S[..., K:])
  return split(S_in), halo, split(S_final)


def block_summaries(S: jax.Array, plan: _Plan, fn_name: str) -> tuple[jax.Array, jax.Array]:
  r"""``(S_all, first)`` for ``mhla``: every shard's block summaries ``[B, M, N, K', V + 1]``
  in sequence order (one ``all_gather`` of this shard's ``[B, m, N, K', V + 1]``) and the
  global index ``p m`` of this shard's first block."""
  axis = plan.axis_name
  plan.uses += 1
  _axis_size(axis, fn_name)
  first = jax.lax.axis_index(axis) * S.shape[1]
  return jax.lax.all_gather(S, axis, axis=1, tiled=True), first


def shard_count(plan: _Plan, fn_name: str) -> int:
  """The number of shards ``P`` of the active plan's axis."""
  return _axis_size(plan.axis_name, fn_name)


def context_parallel(fn: Callable[..., Any], *, axis_name: Any) -> Callable[..., Any]:
  r"""A recurrent family of :mod:`jaxsoft.linear` run with its sequence split over a mesh axis.

  Inside ``jax.shard_map`` with the time axis of ``q, k, v`` (and of the gates, ``beta``,
  ``segment_ids``) split contiguously over ``axis_name`` (shard ``p`` holds tokens
  ``[p T/P, (p + 1) T/P)``), ``context_parallel(fn, axis_name=...)(q, k, v, ...)`` returns
  this shard's outputs of the unsharded ``fn(q, k, v, ...)`` and, with
  ``output_final_state=True``, the global final state on every shard. Each shard composes
  its tokens' affine state map ``S_out = \mathcal A_p S_in + \mathcal B_p`` from a zero state,
  one ``all_gather`` and an associative scan in sequence order give its incoming state

  .. math::
    S_{\text{in}, p} = (\mathcal A_{p-1}, \mathcal B_{p-1}) \circ \cdots \circ
    (\mathcal A_0, \mathcal B_0)(S_0),

  and its forward pass is run from there (the module docstring has the maps, the packed
  sequences' resets and the costs). ``initial_state`` is the state before the whole sequence;
  ``transnormer_attention`` gets the global positions ``p T/P + t`` when ``positions`` is None,
  ``cosformer`` the positions ``s + p T/P + t`` and ``max_len`` of the whole sequence.
  ``ttt_linear`` and ``mhla`` need ``T/P`` to be a multiple of ``mini_batch_size`` /
  ``block_size``; ``native_hybrid_attention`` needs ``T/P >= window - 1``; ``mhla`` takes the
  whole sequence's ``mixing`` ``[M, M]``, ``M = T / block_size``.

  Args:
    fn: one of ``CONTEXT_PARALLEL_FAMILIES`` (the function itself, e.g.
      ``jaxsoft.linear.gla``); a family of ``CONTEXT_PARALLEL_UNSUPPORTED`` raises
      NotImplementedError with the reason.
    axis_name: the mesh axis the sequence is split over (bound by ``jax.shard_map``).

  Returns:
    A function with ``fn``'s signature, to be called inside ``jax.shard_map``.

  Examples:
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> q = k = v = jnp.ones((1, 4, 1, 2)); g = jnp.full((1, 4, 1), jnp.log(0.5))
    >>> cp_gla = context_parallel(js.linear.simple_gla, axis_name="cp")
    >>> f = jax.jit(jax.shard_map(lambda q, k, v, g: cp_gla(q, k, v, g, scale=1.0), mesh=mesh,
    ...                           in_specs=(P(None, "cp"),) * 4, out_specs=P(None, "cp")))
    >>> f(q, k, v, g)[0, :, 0, 0]
    Array([2.  , 3.  , 3.5 , 3.75], dtype=float32)

  References:
    W. Sun, Z. Qin, D. Li, X. Shen, Y. Qiao & Y. Zhong, 2025, "Linear Attention Sequence
    Parallelism" (arXiv:2404.02882).

    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training" (arXiv:2312.06635).
  """
  fn_name = "context_parallel"
  name = getattr(fn, "__name__", None)
  if name in CONTEXT_PARALLEL_UNSUPPORTED:
    raise NotImplementedError(f"{fn_name}: {name} has no context-parallel form: "
                              f"{CONTEXT_PARALLEL_UNSUPPORTED[name]}")
  if name not in CONTEXT_PARALLEL_FAMILIES or not getattr(fn, "__module__", "").startswith(
      "jaxsoft.linear."):
    raise ValueError(f"{fn_name}: `fn` must be one of the jaxsoft.linear functions "
                     f"{CONTEXT_PARALLEL_FAMILIES}, got {fn!r}")

  def sharded(*args: Any, **kwargs: Any) -> Any:
    _axis_size(axis_name, fn_name)   # a clear error outside shard_map
    if name == "transnormer_attention" and kwargs.get("positions") is None:
      T = jnp.shape(args[0] if args else kwargs["q"])[1]
      kwargs["positions"] = jax.lax.axis_index(axis_name) * T + jnp.arange(T)
    with _activated(axis_name) as plan:
      out = fn(*args, **kwargs)
    if plan.uses == 0:   # never reached: every family listed runs the shared recurrence
      raise AssertionError(f"{fn_name}: {name} did not run the shared recurrence")
    return out

  sharded.__name__ = f"context_parallel_{name}"
  sharded.__doc__ = f"{name} with its sequence split over mesh axis {axis_name!r}."
  return sharded


def short_conv_halo(x: jax.Array, conv_size: int, *, axis_name: Any) -> jax.Array:
  r"""The previous shard's last ``conv_size - 1`` time steps (zeros on the first shard).

  A causal convolution of width ``c`` reads ``y_t = Σ_{i<c} w_i x_{t-c+1+i}``: a shard's first
  ``c - 1`` outputs need the ``c - 1`` inputs before it, which one ``jax.lax.ppermute`` from
  shard ``p - 1`` to ``p`` brings. ``causal_conv(concat([halo, x]), w)[:, c - 1:]`` is then
  this shard's part of the unsharded convolution.

  Args:
    x: this shard's ``[B, T_shard, C]`` (time on axis 1), ``T_shard >= conv_size - 1``.
    conv_size: the width ``c >= 1``.
    axis_name: the mesh axis the time axis is split over (inside ``jax.shard_map``).

  Returns:
    ``[B, conv_size - 1, C]``.

  Examples:
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> halo = jax.shard_map(lambda x: short_conv_halo(x, 3, axis_name="cp"), mesh=mesh,
    ...                      in_specs=P(None, "cp"), out_specs=P(None, "cp"))
    >>> halo(jnp.ones((1, 4, 1))).shape   # the first shard's halo: zeros
    (1, 2, 1)

  References:
    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training" (the short convolution of its layers).
  """
  fn_name = "short_conv_halo"
  if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 1:
    raise ValueError(f"{fn_name}: `conv_size` must be an int >= 1, got {conv_size!r}")
  x = jnp.asarray(x)
  if x.ndim < 2 or x.shape[1] < conv_size - 1:
    raise ValueError(f"{fn_name}: `x` must be [B, T_shard, ...] with T_shard >= conv_size - 1 "
                     f"= {conv_size - 1}, got shape {x.shape}")
  P = _axis_size(axis_name, fn_name)
  tail = x[:, x.shape[1] - (conv_size - 1):]
  return jax.lax.ppermute(tail, axis_name, [(i, i + 1) for i in range(P - 1)])


def context_parallel_mixer(layer: Any, x: jax.Array, *, axis_name: Any) -> jax.Array:
  r"""A :class:`jaxsoft.nn.LinearMixer` on this shard's ``x [B, T_shard, d]``, the sequence
  split contiguously over ``axis_name`` (inside ``jax.shard_map``): ``layer(x)`` of the whole
  sequence, this shard's part.

  .. math::
    [q; k; v] = \mathrm{SiLU}(\mathrm{conv}_w([\text{halo}; W x]))_{c-1:}, \qquad
    o = \text{context\_parallel}(\text{mix})(q, k, v, \text{gates})

  with the halo of :func:`short_conv_halo` and the kind's recurrence under
  :func:`context_parallel`; the gates, the per-head norm, the output gate and the projection
  are per token. The layer is unchanged (its own parameters and pieces are used).

  Args:
    layer: a ``LinearMixer`` whose kind calls one of ``CONTEXT_PARALLEL_FAMILIES``
      (``"cosformer"``, whose layer starts every call at position 0, ``"transnormer"``,
      ``"mhla"``, whose layer takes the corner of its mixing matrix for the shard's length,
      and ``"rala"`` raise NotImplementedError).
    x: ``[B, T_shard, d]``.
    axis_name: the mesh axis the sequence is split over.

  Returns:
    ``[B, T_shard, d]``.

  Examples:
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> layer = js.nn.LinearMixer("gla", d_model=8, num_heads=2, rngs=nnx.Rngs(0))
    >>> mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.jit(jax.shard_map(lambda x: context_parallel_mixer(layer, x, axis_name="cp"),
    ...                           mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp")))
    >>> x = jnp.ones((1, 4, 8))
    >>> unsharded = jax.jit(lambda x: layer(x))
    >>> bool(jnp.allclose(f(x), unsharded(x), atol=1e-6))
    True

  References:
    W. Sun, Z. Qin, D. Li, X. Shen, Y. Qiao & Y. Zhong, 2025, "Linear Attention Sequence
    Parallelism" (arXiv:2404.02882).
  """
  fn_name = "context_parallel_mixer"
  kind = getattr(layer, "kind", None)
  if kind not in _MIXER_FUNCTIONS:
    raise NotImplementedError(f"{fn_name}: a LinearMixer of kind {kind!r} has no "
                              f"context-parallel form (supported kinds: {tuple(_MIXER_FUNCTIONS)})")
  x = layer._check_x(x, 3, "[B, T, d]")
  w = layer.conv[...].astype(layer.dtype)
  c, t = w.shape[0], x.shape[1]
  u = layer.qkv(x)
  # jaxsoft.nn.causal_conv with the halo in place of its zero padding
  padded = jnp.concatenate([short_conv_halo(u, c, axis_name=axis_name), u], axis=1)
  y = w[None, 0:1] * padded[:, :t]
  for i in range(1, c):
    y = y + w[None, i:i + 1] * padded[:, i:i + t]
  q, k, v = (layer._heads(part) for part in jnp.split(jax.nn.silu(y), 3, axis=-1))
  _axis_size(axis_name, fn_name)
  with _activated(axis_name) as plan:
    o = layer.linear_kind.forward(layer, q, k, v, layer._gates(x))
  if plan.uses == 0:
    raise AssertionError(f"{fn_name}: kind {kind!r} did not run the shared recurrence")
  return layer._finish(o, x)
