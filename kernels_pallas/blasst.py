r"""K04: BLASST skip-softmax with the skip decided inside the Pallas kernel.

One program per (query block, batch, head) runs FlashAttention's online softmax over the
key blocks in BLASST's order (from the query block's own, diagonal, block backwards,
wrapping round to the last block when not causal). For each key block j it computes the
score tile :math:`S = Q K_j^\top` and the block max of every row,
:math:`\tilde m_i^{(j)} = \max_{k \in j,\ \mathrm{visible}} S_{ik}`, and decides there, on
the running max :math:`m_i` of the blocks the row kept so far:

.. math::

   \mathrm{keep}_{ij} = \big[\tilde m_i^{(j)} \ne -\infty\big] \wedge
   \neg\big[\tilde m_i^{(j)} < m_i - \tau\big].

A skipped block lies below the running max, so skipping it never changes :math:`m_i`,
and the decisions are those of the reference loop
(``jaxsoft.attention.block_sparse_attention(method="blasst")``, whose decision pass is a
cumulative max over the block maxima). Only when some row of the tile keeps the block do
the tile's ``exp`` and its ``P V`` matmul run (``lax.cond`` in the Triton kernel's key
loop, ``pl.when`` in the Mosaic kernel's grid step); rows that skipped it are hidden from
the update, and V of a block no row kept is never read. The kernel writes the output, the
row log-sum-exp and the kept (row, key block) pairs as bits (32 key blocks per int32).

The backward pass is the attention engine's (``kernels_pallas.attention_from_call`` with
the kept blocks as the block table and each row's kept blocks as ``row_blocks``):
FlashAttention's backward over the kept pairs only (the block choice is piecewise
constant, so these are the derivatives of the computed function). It recomputes the
engine's row statistics over the kept pairs first (one more forward over the kept pairs
only).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.typing import ArrayLike

from jaxsoft.attention.call import AttentionCall
from kernels_pallas import _api
from kernels_pallas.backends import BACKENDS, pick_backend

__all__ = ["blasst_attention"]

_NAME = "kernels_pallas.blasst_attention"
_WORD = 32  # kept key blocks per int32 word of the kept bits


def _err(msg: str) -> ValueError:
  return ValueError(f"{_NAME}: {msg}")


def _pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _visited(diag, t, nk: int):
  """The t-th key block a row of diagonal block ``diag`` visits: (diag - t) mod nk."""
  return lax.rem(diag - t + nk, jnp.asarray(nk, jnp.int32))


def _decide(q, kb, qi, kj, klen, m, *, bs: int, t_len: int, causal: bool, tau: float):
  """The tile's scores, visibility, row block max and decision: (s [bs, bs], vis, mt
  [bs, 1], keep bool [bs, 1]). ``m`` [bs, 1]: the running max of the kept blocks."""
  s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), preferred_element_type=q.dtype)
  qpos = qi * bs + lax.broadcasted_iota(jnp.int32, (bs, 1), 0)
  kpos = kj * bs + lax.broadcasted_iota(jnp.int32, (1, bs), 1)
  vis = (kpos < klen) & (qpos < t_len)
  if causal:
    vis = vis & (kpos <= qpos)
  mt = jnp.max(jnp.where(vis, s, -jnp.inf), axis=1, keepdims=True)
  keep = (mt != -jnp.inf) & jnp.logical_not(mt < m - tau)  # NaN scores are kept
  return s, vis, mt, keep


def _accumulate(s, vis, mt, keep, vb, state):
  """FlashAttention's online update of (m, l, acc) by the kept rows of the tile."""
  m, l, acc = state
  m_new = jnp.where(keep, jnp.maximum(m, mt), m)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_use))
  hide = vis & keep
  p = jnp.where(hide, jnp.exp(jnp.where(hide, s, m_use) - m_use), 0.0)
  pv = lax.dot_general(p, vb, (((1,), (0,)), ((), ())), preferred_element_type=p.dtype)
  return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def _mark(bits, keep, kj, width: int):
  """Sets bit kj % 32 of word kj // 32 in the rows that kept block kj."""
  word = lax.div(kj, jnp.asarray(_WORD, jnp.int32))
  bit = jnp.left_shift(jnp.int32(1), lax.rem(kj, jnp.asarray(_WORD, jnp.int32)))
  cols = lax.broadcasted_iota(jnp.int32, (1, width), 1)
  return bits | jnp.where((cols == word) & keep, bit, jnp.int32(0))


def _any(keep):
  return jnp.max(jnp.where(keep, 1.0, 0.0)) > 0.0


def _finish(state):
  m, l, acc = state
  has = l > 0.0
  l1 = jnp.where(has, l, 1.0)
  return acc / l1, jnp.where(has, m + jnp.log(l1), -jnp.inf)


def _triton_forward(qs, k, v, klen, st: dict[str, Any]):
  """Triton driver: grid (query block, batch, head), the key loop inside the kernel."""
  b, n, tp, hp = qs.shape
  hvp, sp_len = v.shape[-1], k.shape[2]
  bs, nk, g, width = st["bs"], st["nk"], st["groups"], st["width"]
  nq, acc = tp // bs, qs.dtype
  tile = dict(bs=bs, t_len=st["t"], causal=st["causal"], tau=st["tau"])

  def kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, bits_ref):
    qi = pl.program_id(0)
    klen, q = len_ref[...], q_ref[...]
    diag = jnp.minimum(qi, nk - 1)
    stop = diag + 1 if st["causal"] else nk

    def body(t, carry):
      state, bits = carry
      kj = _visited(diag, t, nk)
      start = pl.multiple_of(kj * bs, bs)
      s, vis, mt, keep = _decide(q, k_ref[pl.ds(start, bs), :], qi, kj, klen, state[0],
                                 **tile)
      state = lax.cond(_any(keep),
                       lambda c: _accumulate(s, vis, mt, keep, v_ref[pl.ds(start, bs), :], c),
                       lambda c: c, state)
      return state, _mark(bits, keep, kj, width)

    init = ((jnp.full((bs, 1), -jnp.inf, acc), jnp.zeros((bs, 1), acc),
             jnp.zeros((bs, hvp), acc)), jnp.zeros((bs, width), jnp.int32))
    state, bits = lax.fori_loop(0, stop, body, init)
    o, lse = _finish(state)
    o_ref[...], lse_ref[...], bits_ref[...] = o, lse, bits

  at = lambda qi, bi, ni: (bi, ni, qi, 0)  # noqa: E731
  kv_at = lambda qi, bi, ni: (bi, lax.div(ni, jnp.asarray(g, ni.dtype)), 0, 0)  # noqa: E731
  return pl.pallas_call(
      kernel, grid=(nq, b, n),
      in_specs=[pl.BlockSpec((None, None), lambda qi, bi, ni: (bi, 0)),
                pl.BlockSpec((None, None, bs, hp), at),
                pl.BlockSpec((None, None, sp_len, hp), kv_at),
                pl.BlockSpec((None, None, sp_len, hvp), kv_at)],
      out_specs=[pl.BlockSpec((None, None, bs, hvp), at),
                 pl.BlockSpec((None, None, bs, 1), at),
                 pl.BlockSpec((None, None, bs, width), at)],
      out_shape=[jax.ShapeDtypeStruct((b, n, tp, hvp), acc),
                 jax.ShapeDtypeStruct((b, n, tp, 1), acc),
                 jax.ShapeDtypeStruct((b, n, tp, width), jnp.int32)],
      compiler_params=plgpu.CompilerParams(num_warps=4 if hp <= 64 else 8, num_stages=2),
      interpret=bool(st["interpret"]), name="jaxsoft_blasst_fwd",
  )(klen[:, None], qs, k, v)


def _mosaic_forward(qs, k, v, klen, st: dict[str, Any]):
  """Mosaic TPU driver: grid (batch, head, query block, visit step); the key block of step
  t is the t-th visited one (index map), the state lives in VMEM scratch."""
  b, n, tp, hp = qs.shape
  hvp = v.shape[-1]
  bs, nk, g, width, causal = st["bs"], st["nk"], st["groups"], st["width"], st["causal"]
  nq, acc = tp // bs, qs.dtype
  tile = dict(bs=bs, t_len=st["t"], causal=causal, tau=st["tau"])

  def diag_of(qi):
    return jnp.minimum(qi, nk - 1)

  def kv_index(bi, ni, qi, t, len_ref):
    diag = diag_of(qi)
    # causal: the steps after block 0 stay on block 0 (no new copy; nothing computed)
    kj = diag - jnp.minimum(t, diag) if causal else _visited(diag, t, nk)
    return bi, lax.div(ni, jnp.asarray(g, ni.dtype)), kj, 0

  def q_index(bi, ni, qi, t, len_ref):
    return bi, ni, qi, 0

  def kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, bits_ref, m_sc, l_sc, acc_sc,
             bits_sc):
    bi, qi, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    diag = diag_of(qi)
    kj = _visited(diag, t, nk)

    @pl.when(t == 0)
    def _init():
      m_sc[...] = jnp.full((bs, 1), -jnp.inf, acc)
      l_sc[...] = jnp.zeros((bs, 1), acc)
      acc_sc[...] = jnp.zeros((bs, hvp), acc)
      bits_sc[...] = jnp.zeros((bs, width), jnp.int32)

    @pl.when(t <= diag if causal else t >= 0)
    def _visit():
      s, vis, mt, keep = _decide(q_ref[...], k_ref[...], qi, kj, len_ref[bi], m_sc[...],
                                 **tile)
      bits_sc[...] = _mark(bits_sc[...], keep, kj, width)

      @pl.when(_any(keep))
      def _update():
        m, l, acc = _accumulate(s, vis, mt, keep, v_ref[...], (m_sc[...], l_sc[...],
                                                               acc_sc[...]))
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    @pl.when(t == nk - 1)
    def _write():
      o, lse = _finish((m_sc[...], l_sc[...], acc_sc[...]))
      o_ref[...], lse_ref[...], bits_ref[...] = o, lse, bits_sc[...]

  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(b, n, nq, nk),
          in_specs=[pl.BlockSpec((None, None, bs, hp), q_index),
                    pl.BlockSpec((None, None, bs, hp), kv_index),
                    pl.BlockSpec((None, None, bs, hvp), kv_index)],
          out_specs=[pl.BlockSpec((None, None, bs, hvp), q_index),
                     pl.BlockSpec((None, None, bs, 1), q_index),
                     pl.BlockSpec((None, None, bs, width), q_index)],
          scratch_shapes=[pltpu.VMEM((bs, 1), acc), pltpu.VMEM((bs, 1), acc),
                          pltpu.VMEM((bs, hvp), acc),
                          pltpu.VMEM((bs, width), jnp.int32)]),
      out_shape=[jax.ShapeDtypeStruct((b, n, tp, hvp), acc),
                 jax.ShapeDtypeStruct((b, n, tp, 1), acc),
                 jax.ShapeDtypeStruct((b, n, tp, width), jnp.int32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=st["interpret"] if st["interpret"] is not None else False,
      name="jaxsoft_blasst_fwd",
  )(klen, qs, k, v)


def _unpack(bits, nk: int):
  """Kept bits [..., words] -> bool [..., nk]."""
  j = jnp.arange(nk)
  shift = (j % _WORD).astype(jnp.int32).reshape((1,) * (bits.ndim - 1) + (nk,))
  return (jnp.right_shift(bits[..., j // _WORD], shift) & 1) == 1


def _heads_first(x, rows: int, lanes: int):
  """[B, L, heads, D] -> [B, heads, rows, lanes] zero-padded."""
  x = jnp.transpose(x, (0, 2, 1, 3))
  return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]), (0, lanes - x.shape[3])))


def _forward(qs, k, v, klen, st: dict[str, Any]):
  """The kernel on [B, T, N, H] inputs (qs scaled): (out [B, T, N, Hv] in qs's dtype, kept bool
  [B, N, T, nk])."""
  b, t, n, h = qs.shape
  s, hv = k.shape[1], v.shape[-1]
  bs, nk = st["bs"], st["nk"]
  tp, sp_len = -(-t // bs) * bs, nk * bs
  hp, hvp = _api._head_pad(st["backend"], h), _api._head_pad(st["backend"], hv)
  lens = jnp.full((b,), s, jnp.int32) if klen is None else jnp.minimum(klen, s)
  args = (_heads_first(qs, tp, hp), _heads_first(k, sp_len, hp), _heads_first(v, sp_len, hvp),
          lens.astype(jnp.int32))
  run = _triton_forward if st["backend"] == "triton" else _mosaic_forward
  o, _, bits = run(*args, st)
  out = jnp.transpose(o[:, :, :t, :hv], (0, 2, 1, 3))
  return out, _unpack(bits[:, :, :t], nk)


def _engine_vjp(qs, k, v, klen, kept, st: dict[str, Any]):
  """The engine's attention over the kept pairs, as a function of (qs, k, v)."""
  nq = -(-qs.shape[1] // st["bs"])
  pad = nq * st["bs"] - qs.shape[1]
  table = jnp.any(jnp.pad(kept, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(
      kept.shape[0], kept.shape[1], nq, st["bs"], st["nk"]), axis=3)
  sel = jnp.where(kept, jnp.arange(st["nk"], dtype=jnp.int32), -1)

  def f(qs, k, v):
    call = AttentionCall.create(qs, k, v, scale=1.0, is_causal=st["causal"],
                                key_value_seq_lengths=klen)
    return _api.attention_from_call(
        call, backend=st["backend"], interpret=st["interpret"],
        block_sizes=dict(block_q=st["bs"], block_k=st["bs"]), block_table=table,
        row_blocks=sel)

  return jax.vjp(f, qs, k, v)[1]


def _freeze(st: dict[str, Any]):
  return tuple(sorted(st.items()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _core(qs, k, v, klen, frozen):
  return _forward(qs, k, v, klen, dict(frozen))


def _core_fwd(qs, k, v, klen, frozen):
  out, kept = _forward(qs, k, v, klen, dict(frozen))
  return (out, kept), (qs, k, v, klen, kept)


def _core_bwd(frozen, res, cts):
  qs, k, v, klen, kept = res
  dq, dk, dv = _engine_vjp(qs, k, v, klen, kept, dict(frozen))(cts[0].astype(qs.dtype))
  return dq, dk, dv, None


_core.defvjp(_core_fwd, _core_bwd)


def blasst_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                     skip_threshold: float, block_size: int = 64, scale: float | None = None,
                     is_causal: bool = False, key_value_seq_lengths: ArrayLike | None = None,
                     backend: str | None = None, interpret: Any = None,
                     return_kept: bool = False) -> Any:
  r"""BLASST skip-softmax attention with the skip decided inside the Pallas kernel (K04).

  Query row i visits key blocks of ``block_size`` keys from its own block
  :math:`d = \min(\lfloor i / b \rfloor, n_k - 1)` backwards (then, without
  ``is_causal``, from the last block down to :math:`d + 1`), and skips block j when
  :math:`\tilde m_i^{(j)} < m_i - \tau`: the block's largest visible logit is more than
  ``skip_threshold`` = :math:`\tau` below the running max of the blocks it kept. The output
  is exact softmax attention over the kept (row, block) pairs,

  .. math::

     o_i = \frac{\sum_{j \in \mathcal K_i} \sum_{k \in j} e^{s_{ik}} v_k}
                {\sum_{j \in \mathcal K_i} \sum_{k \in j} e^{s_{ik}}},
     \qquad s_{ik} = \mathrm{scale}\; q_i \cdot k_k,

  and each skipped weight is at most :math:`e^{-\tau}` of the dense softmax, so the
  skipped mass of a row is at most :math:`n_{\mathrm{skipped}} e^{-\tau}`; ``inf`` is
  exact. The decision, the ``exp`` and the ``P V`` matmul of a tile run in the same kernel
  step: a tile whose rows all skip costs one ``Q K^T`` and no exp, no ``P V``, no read of V.
  The kept pairs are those of ``jaxsoft.attention.block_sparse_attention(method="blasst",
  implementation="xla_chunked")`` (its decision pass is the cumulative max of the block
  maxima, equal to the running max here because a skipped block never raises it).

  Args:
    query: [B, T, N, H]; key: [B, S, K, H]; value: [B, S, K, Hv] (GQA: N % K == 0).
    skip_threshold: :math:`\tau \ge 0` (a float; ``inf`` keeps every visible block).
    block_size: query and key block (Triton: a power of two >= 16; Mosaic TPU: a multiple
      of 8, of 128 with ``key_value_seq_lengths``, as the engine's backward needs).
    scale: logit scale (None = 1/sqrt(H)); is_causal: query i sees keys j <= i;
    key_value_seq_lengths: optional int [B] (padding).
    backend: ``"triton"``, ``"mosaic_tpu"`` or None (the platform's).
    interpret: None picks from the platform (:func:`kernels_pallas.pick_backend`; interpret
      mode on CPU with ``JAXSOFT_PALLAS_INTERPRET=1``), else the Pallas interpreter flag.
    return_kept: also return the kept pairs, bool [B, N, T, nk] (``nk = ceil(S /
      block_size)``).

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside; float64 for float64 inputs), and
    ``kept`` with ``return_kept``.
    Differentiable in query, key and value (first order; the block choice is piecewise
    constant): the engine's backward over the kept pairs.

  Examples:
    >>> from kernels_pallas import blasst_attention
    >>> x = jnp.sin(jnp.arange(512.0)).reshape(1, 32, 2, 8)
    >>> blasst = jax.jit(lambda x: blasst_attention(
    ...     x, x, x, skip_threshold=float("inf"), block_size=16, is_causal=True,
    ...     backend="triton", interpret=True, return_kept=True))
    >>> out, kept = blasst(x)
    >>> out.shape
    (1, 32, 2, 8)
    >>> kept[0, 0, ::16].astype(int)  # rows 0 and 16: their visible key blocks (tau = inf)
    Array([[1, 0],
           [1, 1]], dtype=int32)

  References:
    BLASST, 2025, skip-softmax block skipping (authors and full title not recorded in this
    project's sources; the rule as in NVIDIA Model-Optimizer's skip-softmax kernel).

    T. Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning" (arXiv 2307.08691).
  """
  call = AttentionCall.create(query, key, value, scale=scale, is_causal=is_causal,
                              key_value_seq_lengths=key_value_seq_lengths)
  if isinstance(skip_threshold, bool) or not isinstance(skip_threshold, (int, float)):
    raise _err(f"`skip_threshold` must be a number >= 0, got {skip_threshold!r}")
  tau = float(skip_threshold)
  if not tau >= 0:
    raise _err(f"`skip_threshold` must be >= 0, got {skip_threshold!r}")
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
    raise _err(f"`block_size` must be an int >= 1, got {block_size!r}")
  if backend is not None and backend not in BACKENDS:
    raise _err(f"`backend` must be one of {BACKENDS} or None, got {backend!r}")
  if interpret is None:
    backend, interpret = pick_backend(backend)
  elif backend is None:
    raise _err("`backend` is required with `interpret`")
  bs = block_size
  q, k, v = call.q, call.k, call.v
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  if backend == "triton" and (bs < 16 or bs & (bs - 1)):
    raise _err(f"`block_size` must be a power of two >= 16 for Triton, got {bs}")
  try:  # the backward is the engine's: its block rules (Mosaic: 128 with key lengths)
    _api.resolve_block_sizes(dict(block_q=bs, block_k=bs), backend, t, s, h,
                             call.key_value_seq_lengths is not None)
  except ValueError as e:
    raise _err(f"`block_size`={bs} cannot be the block of backend {backend!r}: {e}") from None
  nk = -(-s // bs)
  st = dict(bs=bs, nk=nk, t=t, causal=bool(call.is_causal), tau=tau, groups=n // kh,
            width=_pow2(-(-nk // _WORD)) if backend == "triton" else -(-nk // _WORD),
            backend=backend, interpret=interpret)
  cdt = jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), jnp.promote_types(
      v.dtype, jnp.float32))
  qs = q.astype(cdt) * jnp.asarray(call.scale, cdt)
  out, kept = _core(qs, k.astype(cdt), v.astype(cdt), call.key_value_seq_lengths,
                    _freeze(st))
  out = out.astype(q.dtype)
  if return_kept:
    return out, lax.stop_gradient(kept)
  return out

