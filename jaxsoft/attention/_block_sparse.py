"""Block-sparse attention (feature A12): skip whole key blocks, by a bound or by a selection.

Three blockwise XLA engines, none of which builds a T x S array (forward or backward):

* a *skip* loop (``method="blasst"``): each query row visits the key blocks from its own
  block backwards and skips a block whose scores all fall below its running max minus
  ``skip_threshold``. A skipped block never raises the running max, so the decisions are a
  cumulative max over the per-row block maxima (one pass of Q Kᵀ over the visible tiles,
  no exp); FlashAttention's online softmax then runs over the kept (row, key block) pairs
  only, gathered by key block into dense tiles (a pair skipped by its row costs no exp, no
  P·V and no backward work, whatever the other rows of its block decided);
* a *token* loop (``method="moba"``, and every selecting method under ``is_causal``): each
  query token scores the key blocks from its own query vector and mean-pooled keys ([B, N,
  T, nk], small next to T x S), keeps at most ``top_k_blocks``, and attends exactly over
  them; the (token, block) pairs are sorted by key block and computed as [bs, bs] tiles;
* a *gather* loop (``method="bfla" | "prism"`` without ``is_causal``): block scores from
  mean-pooled queries and keys ([B, N, nq, nk]) choose the key blocks per query block,
  which then attends exactly over its gathered blocks.

With ``implementation="pallas"`` (or ``"pallas_triton"``, ``"pallas_mosaic_tpu"``) the
selecting methods compute the same selection and run the attention in the Pallas engine
(``kernels_pallas``) through a block table: the kept key blocks of each (batch, head,
query block), and for per-token selections each token's own list, which hides in a
tile the rows that did not select its key block; forward and backward visit only the
listed blocks. BLASST runs its own kernel (``kernels_pallas.blasst``), which decides
each skip inside the key loop on the running max, then the engine's backward over each
row's kept key blocks.

Causality: under ``is_causal`` no decision about token i uses a query, key or pooled key
later than i, so a token's output (and gradient) never depends on later tokens, and
decoding on prefixes equals the full forward. The skip loop has a custom FlashAttention
backward over the pairs it kept; the other loops rematerialise each step in the backward
pass (``jax.checkpoint``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

import kernels_pallas
from jaxsoft.attention._blasst_calibration import blasst_skip_threshold
from jaxsoft.attention._checks import check_int
from jaxsoft.attention.call import AttentionCall
from jaxsoft.attention.differentiation import first_order_only, refuse_unsupported_ad

__all__ = ["block_sparse_attention", "BLOCK_SPARSE_METHODS"]

BLOCK_SPARSE_METHODS = ("blasst", "moba", "bfla", "prism")
BLOCK_SPARSE_IMPLEMENTATIONS = ("xla_chunked", "pallas", "pallas_triton", "pallas_mosaic_tpu")
_PALLAS_BACKENDS = {"pallas": None, "pallas_triton": "triton", "pallas_mosaic_tpu": "mosaic_tpu"}


def _pad_to(x, axis: int, size: int):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _masked_mean(x, valid, axis: int):
  """Mean of ``x`` over ``axis`` where ``valid`` (0 where nothing is valid)."""
  w = valid.astype(x.dtype)
  n = jnp.sum(w, axis=axis)
  return jnp.sum(x * w, axis=axis) / jnp.maximum(n, 1.0)


def _masked_softmax(z, vis):
  m = jnp.max(jnp.where(vis, z, -jnp.inf), axis=-1, keepdims=True)
  m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.where(vis, jnp.exp(jnp.where(vis, z, m) - m), 0.0)
  d = jnp.sum(e, axis=-1, keepdims=True)
  return e / jnp.where(d > 0, d, 1.0)


class _Layout:
  """Inputs in blocked, head-major form: q [B, N, nq, bs, H], k/v [B, K, nk, bs, ·]."""

  def __init__(self, call, bs: int):
    q, k, v = call.q, call.k, call.v
    self.B, self.T, self.N, self.H = q.shape
    self.S, self.K = k.shape[1], k.shape[2]
    self.G = self.N // self.K
    self.bs = bs
    self.nq, self.nk = -(-self.T // bs), -(-self.S // bs)
    self.cdt = jnp.promote_types(q.dtype, jnp.float32)
    self.scale = call.scale
    self.causal = call.is_causal
    self.kv_len = call.key_value_seq_lengths  # [B] or None
    qt = _pad_to(jnp.transpose(q.astype(self.cdt), (0, 2, 1, 3)), 2, self.nq * bs)
    self.q = qt.reshape(self.B, self.N, self.nq, bs, self.H)
    kt = _pad_to(jnp.transpose(k.astype(self.cdt), (0, 2, 1, 3)), 2, self.nk * bs)
    vt = _pad_to(jnp.transpose(v.astype(self.cdt), (0, 2, 1, 3)), 2, self.nk * bs)
    self.k = kt.reshape(self.B, self.K, self.nk, bs, self.H)
    self.v = vt.reshape(self.B, self.K, self.nk, bs, v.shape[-1])
    self.out_dtype = q.dtype

  def key_valid(self, kpos):
    """Key positions that exist (< S and < the batch's key length): [B, ...]."""
    ok = kpos < self.S
    if self.kv_len is not None:
      ok = ok & (kpos < self.kv_len.reshape((self.B,) + (1,) * (kpos.ndim - 1)))
    return ok

  def visible(self, qpos, kpos):
    """Structure visibility of query positions ``qpos`` [bs] and keys ``kpos`` [..., s]."""
    qcol = qpos.reshape((1,) * (kpos.ndim - 1) + (-1, 1))  # [1, ..., bs, 1]
    vis = self.key_valid(kpos)[..., None, :] & (qcol < self.T)
    if self.causal:
      vis = vis & (kpos[..., None, :] <= qcol)
    return vis

  def unblock(self, out):
    """[nq, B, N, bs, Hv] -> [B, T, N, Hv] in the output dtype."""
    out = jnp.moveaxis(out, 0, 2).reshape(self.B, self.N, self.nq * self.bs, -1)[:, :, :self.T]
    return jnp.transpose(out, (0, 2, 1, 3)).astype(self.out_dtype)

  def block_means(self):
    """Mean-pooled queries [B, N, nq, H] and keys [B, N, nk, H] (keys repeated per group),
    over the positions that exist."""
    qpos = jnp.arange(self.nq * self.bs).reshape(self.nq, self.bs)
    kpos = jnp.broadcast_to(jnp.arange(self.nk * self.bs).reshape(self.nk, self.bs),
                            (self.B, self.nk, self.bs))
    qbar = _masked_mean(self.q, (qpos < self.T)[None, None, :, :, None], 3)
    kval = self.key_valid(kpos)[:, None, :, :, None]
    kbar = _masked_mean(self.k, kval, 3)
    return qbar, jnp.repeat(kbar, self.G, axis=1)


# ---------------------------------------------------------------------------- skip loop

# kept (row, key block) pairs gathered per tile of the attention loop: on XLA:CPU fewer,
# larger tiles beat the padding of each key block's last chunk (16k: 512 > 256 > 128, 1024)
_BLASST_CHUNK = 512
_BLASST_DECIDE_WINDOW = (2, 4)  # (query, key) blocks per score tile of the decision pass


def _blasst_tile_vis(kvalid, qpos, kj, bs: int, T: int, causal: bool):
  """Visibility of query positions ``qpos`` [r] against key block kj of one head: [r, bs]."""
  vis = (kvalid[kj] > 0)[None, :] & (qpos < T)[:, None]
  if causal:
    vis = vis & ((kj * bs + jnp.arange(bs))[None, :] <= qpos[:, None])
  return vis


def _blasst_decide(q, k, kvalid, tau: float, causal: bool, T: int):
  """BLASST's skip decisions of one key/value head: q [G, Tp, H] (scaled), k [nk, bs, H],
  kvalid [nk, bs]; returns kept bool [G, Tp, nk].

  Row i visits key blocks from its own (diagonal) block backwards (wrapping round when not
  causal) and skips block j when its max score m̃_j < m - tau, m the running max of the
  blocks visited before. A skipped block lies below the running max, so m is the prefix max
  of *all* visited block maxima and the loop's decisions are a cumulative max over the
  [Tp, nk] block maxima (one pass of Q Kᵀ over the visible tiles, no exp)."""
  G, Tp, H = q.shape
  nk, bs = k.shape[:2]
  nq = Tp // bs
  # QB query blocks against W key blocks per step: [QB bs, W bs] score tiles run XLA:CPU's
  # matmul faster than [bs, bs] ones (the same dot products, so the same maxima); the
  # positions padded to whole windows are invisible
  W, QB = min(_BLASST_DECIDE_WINDOW[1], nk), min(_BLASST_DECIDE_WINDOW[0], nq)
  nw, nqq = -(-nk // W), -(-nq // QB)
  kw = _pad_to(k, 0, nw * W).reshape(nw, W * bs, H)
  kvw = _pad_to(kvalid, 0, nw * W).reshape(nw, W * bs) > 0
  qw = _pad_to(q, 1, nqq * QB * bs).reshape(G, nqq, QB * bs, H)

  def block(xs):
    qi, qr = xs  # qr [G, QB bs, H]
    qpos = qi * QB * bs + jnp.arange(QB * bs)

    def body(wj, M):
      vis = kvw[wj][None, :] & (qpos < T)[:, None]
      if causal:
        vis = vis & ((wj * W * bs + jnp.arange(W * bs))[None, :] <= qpos[:, None])
      s = jnp.einsum("gqh,sh->gqs", qr, kw[wj])
      mx = jnp.max(jnp.where(vis, s, -jnp.inf).reshape(G, QB * bs, W, bs), axis=-1)
      return lax.dynamic_update_slice(M, jnp.moveaxis(mx, 2, 0), (wj * W, 0, 0))

    hi = (jnp.minimum(qi * QB + QB, nk) + W - 1) // W if causal else nw
    M = lax.fori_loop(0, hi, body, jnp.full((nw * W, G, QB * bs), -jnp.inf, q.dtype))
    return M[:nk]

  M = lax.map(block, (jnp.arange(nqq), jnp.moveaxis(qw, 1, 0)))  # [nqq, nk, G, QB bs]
  M = jnp.moveaxis(M.reshape(nqq, nk, G, QB, bs), 3, 1).reshape(nqq * QB, nk, G, bs)[:nq]
  M = jnp.transpose(M, (2, 0, 3, 1)).reshape(G, Tp, nk)  # [nq, nk, G, bs] -> [G, Tp, nk]
  diag = jnp.minimum(jnp.arange(Tp) // bs, nk - 1)
  order = (diag[:, None] - jnp.arange(nk)[None, :]) % nk  # [Tp, t]: t-th visited block
  Mo = jnp.take_along_axis(M, jnp.broadcast_to(order, M.shape), axis=-1)
  prev = lax.cummax(Mo, axis=2)
  prev = jnp.concatenate([jnp.full_like(prev[..., :1], -jnp.inf), prev[..., :-1]], axis=-1)
  keep = (Mo != -jnp.inf) & ~(Mo < prev - tau)  # NaN scores are kept (and propagate)
  # t -> (diag - t) mod nk is its own inverse: the same gather puts keep back in block order
  return jnp.take_along_axis(keep, jnp.broadcast_to(order, M.shape), axis=-1)


def _blasst_chunks(kept, C: int, causal: bool, bs: int, Tp: int):
  """The kept pairs of one head, grouped by key block into chunks of C rows: kept [R, nk]
  (R = G * Tp) -> (rows [maxc, C] int32: each chunk's rows in increasing order, R where the
  chunk runs out; kj [maxc]: each chunk's key block; n: the number of chunks). The table is
  built once by one scatter (no search inside the attention loops); maxc bounds n."""
  R, nk = kept.shape
  if causal:  # a row of query block qi sees at most min(qi + 1, nk) key blocks
    nq = Tp // bs
    pairs = (R // Tp) * bs * sum(min(qi + 1, nk) for qi in range(nq))
  else:
    pairs = R * nk
  maxc = max(1, min(nk + pairs // C, -(-R // C) * nk))
  ki = kept.T.astype(jnp.int32)  # [nk, R]
  cum = jnp.cumsum(ki, axis=1)
  nch = (cum[:, -1] + C - 1) // C
  ends = jnp.cumsum(nch)
  rank = cum - 1
  slot = ((ends - nch)[:, None] + rank // C) * C + rank % C
  slot = jnp.where(ki > 0, slot, maxc * C)
  rows = jnp.full((maxc * C,), R, jnp.int32).at[slot.reshape(-1)].set(
      jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32), (nk, R)).reshape(-1), mode="drop")
  kj = jnp.minimum(jnp.searchsorted(ends, jnp.arange(maxc), side="right"), nk - 1)
  return rows.reshape(maxc, C), kj.astype(jnp.int32), ends[-1]


def _blasst_chunk(c, plan, R: int):
  """Chunk c: its key block kj, its rows [C] (R where the chunk runs out) and their mask."""
  rows, kj, _ = plan
  r = rows[c]
  return kj[c], r, r < R


def _blasst_head_forward(q, k, v, kvalid, tau: float, causal: bool, T: int, C: int):
  """One key/value head: q [G, Tp, H] (scaled), k/v [nk, bs, ·], kvalid [nk, bs]; returns
  out [G, Tp, Hv], lse [G, Tp], kept bool [G, Tp, nk] and the chunk plan (reused by the
  backward pass). The decisions first, then FlashAttention's online softmax over the kept
  pairs only, gathered into [C, bs] tiles."""
  G, Tp, H = q.shape
  nk, bs, Hv = k.shape[0], k.shape[1], v.shape[-1]
  R = G * Tp
  kept = _blasst_decide(q, k, kvalid, tau, causal, T)
  plan = _blasst_chunks(kept.reshape(R, nk), C, causal, bs, Tp)
  q2 = q.reshape(R, H)

  def body(c, carry):
    m, l, acc = carry
    kj, rows, ok = _blasst_chunk(c, plan, R)
    rc = jnp.minimum(rows, R - 1)
    vis = _blasst_tile_vis(kvalid, rc % Tp, kj, bs, T, causal) & ok[:, None]
    s = q2[rc] @ k[kj].T
    m_old = m[rc]
    m_new = jnp.maximum(m_old, jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1))
    m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.where(jnp.isfinite(m_old), jnp.exp(m_old - m_use), 0.0)
    p = jnp.where(vis, jnp.exp(jnp.where(vis, s, m_use[:, None]) - m_use[:, None]), 0.0)
    l_new = alpha * l[rc] + jnp.sum(p, axis=-1)
    acc_new = alpha[:, None] * acc[rc] + p @ v[kj]
    return (m.at[rows].set(m_new, mode="drop"), l.at[rows].set(l_new, mode="drop"),
            acc.at[rows].set(acc_new, mode="drop"))

  init = (jnp.full((R,), -jnp.inf, q.dtype), jnp.zeros((R,), q.dtype),
          jnp.zeros((R, Hv), q.dtype))
  m, l, acc = lax.fori_loop(0, plan[-1], body, init)
  has = l > 0
  l1 = jnp.where(has, l, 1.0)
  out = (acc / l1[:, None]).reshape(G, Tp, Hv)
  return out, jnp.where(has, m + jnp.log(l1), -jnp.inf).reshape(G, Tp), kept, plan


def _blasst_head_backward(q, k, v, kvalid, out, lse, plan, dout, causal: bool, T: int):
  """FlashAttention's backward of one key/value head over the kept pairs (the forward's
  chunks)."""
  G, Tp, H = q.shape
  bs, Hv = k.shape[1], v.shape[-1]
  R = G * Tp
  q2, do2 = q.reshape(R, H), dout.reshape(R, Hv)
  D = jnp.sum(do2 * out.reshape(R, Hv), axis=-1)
  L = jnp.where(jnp.isfinite(lse), lse, 0.0).reshape(R)

  def body(c, carry):
    dq, dk, dv = carry
    kj, rows, ok = _blasst_chunk(c, plan, R)
    rc = jnp.minimum(rows, R - 1)
    vis = _blasst_tile_vis(kvalid, rc % Tp, kj, bs, T, causal) & ok[:, None]
    qr, dor, kj_, vj = q2[rc], do2[rc], k[kj], v[kj]
    Lr = L[rc][:, None]
    p = jnp.where(vis, jnp.exp(jnp.where(vis, qr @ kj_.T, Lr) - Lr), 0.0)
    ds = p * (dor @ vj.T - D[rc][:, None])
    # dK, dV as (x^T tile)^T: the [C, bs] tiles stay row-major right operands (a^T b
    # makes XLA:CPU copy the whole tile transposed); only thin [C, H] blocks transpose
    return (dq.at[rows].add(ds @ kj_, mode="drop"), dk.at[kj].add((qr.T @ ds).T),
            dv.at[kj].add((dor.T @ p).T))

  dq, dk, dv = lax.fori_loop(0, plan[-1], body,
                             (jnp.zeros_like(q2), jnp.zeros_like(k), jnp.zeros_like(v)))
  return dq.reshape(G, Tp, H), dk, dv


_BLASST_WHERE = "block_sparse_attention(method='blasst')"
# BLASST has no dense twin under the same name: its skips depend on the running max. The
# same values and first derivatives come from the dense path under the kept-block mask.
_BLASST_ADVICE = ("For these derivatives take the kept key blocks (return_stats=True) and "
                  "call dot_product_attention(..., implementation='xla') with them as the "
                  "mask: the same output, and every derivative of the dense path (the block "
                  "choice is piecewise constant).")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _blasst_core(qs, k, v, kvalid, tau, causal, T, C):
  return _blasst_core_fwd(qs, k, v, kvalid, tau, causal, T, C)[0]


def _blasst_core_fwd(qs, k, v, kvalid, tau, causal, T, C):
  """qs [BK, G, Tp, H], k/v [BK, nk, bs, ·], kvalid [BK, nk, bs]: one lax.map step per key/
  value head."""
  out, lse, kept, plan = lax.map(
      lambda a: _blasst_head_forward(a[0], a[1], a[2], a[3], tau, causal, T, C),
      (qs, k, v, kvalid))
  return (out, kept), (qs, k, v, kvalid, out, lse, plan)


def _blasst_core_bwd(tau, causal, T, C, res, cts):
  """FlashAttention's backward over the (row, key block) pairs the forward kept: with the
  final log-sum-exp L, P = exp(S - L) on kept entries, dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - D),
  D = rowsum(dO ∘ O), dQ = dS K, dK = dSᵀ Q. The block choice is piecewise constant."""
  qs, k, v, kvalid, out, lse, plan = res
  dout = cts[0].astype(out.dtype)

  def backward(*args):
    return lax.map(
        lambda a: _blasst_head_backward(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
                                        causal, T), args)

  # Differentiating this backward again (a Hessian) would drop the terms of the kept
  # blocks' running statistics: refused by name instead.
  dq, dk, dv = first_order_only(backward, _BLASST_WHERE, _BLASST_ADVICE)(
      qs, k, v, kvalid, out, lse, plan, dout)
  return dq, dk, dv, jnp.zeros_like(kvalid)


_blasst_core.defvjp(_blasst_core_fwd, _blasst_core_bwd)


def _blasst_heads(lay: _Layout):
  """Per key/value head: (qs [BK, G, Tp, H] scaled, k [BK, nk, bs, H], v [BK, nk, bs, Hv],
  kvalid [BK, nk, bs])."""
  B, K, G, bs, nq, nk = lay.B, lay.K, lay.G, lay.bs, lay.nq, lay.nk
  kpos = jnp.broadcast_to(jnp.arange(nk * bs), (B, nk * bs))
  kvalid = jnp.repeat(lay.key_valid(kpos).astype(lay.cdt).reshape(B, nk, bs), K, axis=0)
  qs = lay.q.reshape(B * K, G, nq * bs, lay.H) * lay.scale
  return (qs, lay.k.reshape(B * K, nk, bs, lay.H), lay.v.reshape(B * K, nk, bs, -1), kvalid)


def _blasst_rows(lay: _Layout, kept):
  """kept bool [BK, G, Tp, nk] -> [B, N, Tp, nk], padded query rows False."""
  Tp = lay.nq * lay.bs
  kept = kept.reshape(lay.B, lay.N, Tp, lay.nk)
  return kept & (jnp.arange(Tp) < lay.T)[None, None, :, None]


def _blasst(lay: _Layout, tau: float):
  """BLASST's skip-softmax, decided per query row; returns (out [B, T, N, Hv], kept bool
  [B, N, Tp, nk]: the key blocks each query row attended to). The backward pass is a custom
  FlashAttention backward over the kept pairs (no differentiation of the loop)."""
  G, bs, nq = lay.G, lay.bs, lay.nq
  Hv, Tp = lay.v.shape[-1], nq * bs
  refuse_unsupported_ad((lay.q, lay.k, lay.v), _BLASST_WHERE, _BLASST_ADVICE)
  qs, k, v, kvalid = _blasst_heads(lay)
  out, kept = _blasst_core(qs, k, v, kvalid, float(tau), bool(lay.causal), lay.T,
                           min(_BLASST_CHUNK, G * Tp))
  out = jnp.moveaxis(out.reshape(lay.B, lay.N, nq, bs, Hv), 2, 0)
  return lay.unblock(out), _blasst_rows(lay, kept)


def _blasst_pallas(call, lay: _Layout, tau: float, pallas):
  """BLASST in the Pallas kernel :func:`kernels_pallas.blasst_attention`: the skip is
  decided inside the kernel's key loop on its running max (the same decisions as the
  skip loop's decision pass), a tile whose rows all skip a key block costs no exp and no
  P V; the backward is the engine's over the kept pairs. Returns (out, kept [B, N, Tp,
  nk])."""
  refuse_unsupported_ad((lay.q, lay.k, lay.v), _BLASST_WHERE, _BLASST_ADVICE)
  backend, interpret = pallas
  out, kept = kernels_pallas.blasst_attention(
      call.q, call.k, call.v, skip_threshold=tau, block_size=lay.bs, scale=call.scale,
      is_causal=lay.causal, key_value_seq_lengths=lay.kv_len, backend=backend,
      interpret=interpret, return_kept=True)
  return out, jnp.pad(kept, ((0, 0), (0, 0), (0, lay.nq * lay.bs - lay.T), (0, 0)))


# --------------------------------------------------------------------------- gather loop


def _gather_attend(lay: _Layout, idx, valid):
  """Exact attention of each query block over its key blocks ``idx`` [B, N, nq, kb]."""
  B, K, G, bs = lay.B, lay.K, lay.G, lay.bs
  kb = idx.shape[-1]
  Hv = lay.v.shape[-1]
  idx = lax.stop_gradient(jnp.clip(idx, 0, lay.nk - 1)).astype(jnp.int32)
  kflat = lay.k.reshape(B, K, 1, lay.nk, bs * lay.H)
  vflat = lay.v.reshape(B, K, 1, lay.nk, bs * Hv)

  def q_block(qi):
    q = lay.q[:, :, qi] * lay.scale  # [B, N, bs, H]
    ib = idx[:, :, qi].reshape(B, K, G, kb, 1)
    ks = jnp.take_along_axis(kflat, ib, axis=3).reshape(B, lay.N, kb * bs, lay.H)
    vs = jnp.take_along_axis(vflat, ib, axis=3).reshape(B, lay.N, kb * bs, Hv)
    kpos = (idx[:, :, qi, :, None] * bs + jnp.arange(bs)[None, None, None]).reshape(B, lay.N, kb * bs)
    qpos = qi * bs + jnp.arange(bs)
    vis = lay.visible(qpos, kpos)  # [B, N, bs, kb·bs]
    vis = vis & jnp.repeat(valid[:, :, qi], bs, axis=-1)[:, :, None, :]
    w = _masked_softmax(jnp.einsum("bnqh,bnsh->bnqs", q, ks), vis)
    return jnp.einsum("bnqs,bnsh->bnqh", w, vs)

  return lay.unblock(lax.map(jax.checkpoint(q_block), jnp.arange(lay.nq)))


def _token_attend(lay: _Layout, idx, valid):
  """Exact attention of each query *token* over its own key blocks ``idx`` [B, N, Tp, kb].

  MoBA's varlen layout (as in its reference implementation): the (token, block) pairs are
  sorted by key block and cut into chunks of ``block_size`` pairs that share one key block;
  each chunk is a [bs, bs] score tile giving a partial log-sum-exp and a normalised partial
  output per pair, and each token merges its ``kb`` partials by their log-sum-exp. The work
  is Tp·kb·bs scores, a step holds at most Tp x bs of them, and no T x S array exists.
  """
  B, K, G, bs, nk = lay.B, lay.K, lay.G, lay.bs, lay.nk
  Tp, H, Hv = lay.nq * bs, lay.H, lay.v.shape[-1]
  kb = idx.shape[-1]
  C = bs  # query rows per chunk
  P = Tp * kb
  g = max(1, min(lay.nq, 65536 // (C * bs)))  # chunks per step
  chunks = -(-(P + nk * (C - 1)) // C)  # enough when each block's pairs start a new chunk
  ngroup = -(-chunks // g)
  nchunk = ngroup * g
  Ppad = nchunk * C
  valid = lax.stop_gradient(valid & (jnp.arange(Tp) < lay.T)[None, None, :, None])
  idx = lax.stop_gradient(jnp.clip(idx, 0, nk - 1)).astype(jnp.int32)
  q = lay.q.reshape(B, K, G, Tp, H) * lay.scale
  klen = jnp.full((B,), lay.S) if lay.kv_len is None else jnp.minimum(lay.kv_len, lay.S)
  causal = lay.causal

  def one(q, k, v, idx, valid, klen):  # q [Tp, H]; k, v [nk, bs, ·]; idx, valid [Tp, kb]
    blk = jnp.where(valid, idx, nk).reshape(P)  # invalid pairs sort last (block nk)
    tok = jnp.repeat(jnp.arange(Tp, dtype=jnp.int32), kb)
    order = jnp.argsort(blk, stable=True)
    sblk, stok = blk[order], tok[order]
    counts = jnp.zeros(nk + 1, jnp.int32).at[blk].add(1)
    start = jnp.cumsum(counts) - counts
    padded = (counts[:nk] + C - 1) // C * C
    ends = jnp.cumsum(padded)
    rank = jnp.arange(P) - start[sblk]
    dest = jnp.where(sblk < nk, (ends - padded)[jnp.minimum(sblk, nk - 1)] + rank, Ppad)
    slot_tok = jnp.full(Ppad, -1, jnp.int32).at[dest].set(stok, mode="drop")
    pos = jnp.zeros(P, jnp.int32).at[order].set(dest.astype(jnp.int32)).reshape(Tp, kb)
    chunk_blk = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nchunk) * C, side="right"),
                            nk - 1)

    def group(gi):
      ct = lax.dynamic_slice(slot_tok, (gi * g * C,), (g * C,)).reshape(g, C)
      cb = lax.dynamic_slice(chunk_blk, (gi * g,), (g,))
      kpos = cb[:, None] * bs + jnp.arange(bs)[None, :]  # [g, bs]
      vis = (ct >= 0)[:, :, None] & (kpos < klen)[:, None, :]
      if causal:
        vis = vis & (kpos[:, None, :] <= ct[:, :, None])
      s = jnp.einsum("gch,gsh->gcs", q[jnp.maximum(ct, 0)], k[cb])
      m = lax.stop_gradient(jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1))
      m = jnp.where(jnp.isfinite(m), m, 0.0)
      e = jnp.where(vis, jnp.exp(jnp.where(vis, s, m[..., None]) - m[..., None]), 0.0)
      l = jnp.sum(e, axis=-1)
      has = l > 0
      l1 = jnp.where(has, l, 1.0)
      o = jnp.einsum("gcs,gsh->gch", e, v[cb]) / l1[..., None]
      lse = jnp.where(has, m + jnp.log(l1), -jnp.inf)
      return lse.reshape(g * C), o.reshape(g * C, Hv)

    lse, o = lax.map(jax.checkpoint(group), jnp.arange(ngroup))
    lse = jnp.concatenate([lse.reshape(Ppad), jnp.full((1,), -jnp.inf, lse.dtype)])
    o = jnp.concatenate([o.reshape(Ppad, Hv), jnp.zeros((1, Hv), o.dtype)])
    lp, op = lse[pos], o[pos]  # [Tp, kb], [Tp, kb, Hv]
    fin = jnp.isfinite(lp)
    mx = lax.stop_gradient(jnp.max(lp, axis=-1, keepdims=True))
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.where(fin, jnp.exp(jnp.where(fin, lp, mx) - mx), 0.0)
    den = jnp.sum(w, axis=-1)
    return jnp.einsum("tj,tjh->th", w, op) / jnp.where(den > 0, den, 1.0)[:, None]

  f = jax.vmap(one, in_axes=(0, None, None, 0, 0, None))  # heads of a group
  f = jax.vmap(f, in_axes=(0, 0, 0, 0, 0, None))  # kv heads
  f = jax.vmap(f, in_axes=(0, 0, 0, 0, 0, 0))  # batch
  out = f(q, lay.k, lay.v, idx.reshape(B, K, G, Tp, kb), valid.reshape(B, K, G, Tp, kb), klen)
  out = out.reshape(B, lay.N, lay.nq, bs, Hv)
  return lay.unblock(jnp.moveaxis(out, 2, 0))


# ------------------------------------------------------------------------------ selection


def _row_masks(lay: _Layout, per_token: bool):
  """(allowed, forced) bool [B, 1, R, nk] for the selection rows: query tokens (R = Tp) or,
  without ``is_causal`` only, query blocks (R = nq). ``allowed``: the key blocks that may be
  scored, those holding a key and, causal, lying wholly before the row's own block (so no
  score uses a key, or a pooled key, later than its query); ``forced``: causal, the row's
  own block, kept unscored (its causal mask is applied inside)."""
  kb = jnp.arange(lay.nk)
  nonempty = lay.key_valid(jnp.broadcast_to(kb * lay.bs, (lay.B, lay.nk)))[:, None, None, :]
  R = lay.nq * lay.bs if per_token else lay.nq
  if not lay.causal:
    allowed = jnp.broadcast_to(nonempty, (lay.B, 1, R, lay.nk))
    return allowed, jnp.zeros_like(allowed)
  assert per_token, "a causal selection is made per query token"
  own = (jnp.arange(R) // lay.bs)[None, None, :, None]  # [1, 1, R, 1]
  kb4 = kb[None, None, None, :]                          # [1, 1, 1, nk]
  return nonempty & (kb4 < own), nonempty & (kb4 == own)


def _top_blocks(score, allowed, forced, kb: int):
  """The ``kb`` best allowed blocks by ``score``, forced blocks first: (idx, valid)."""
  s = jnp.where(forced, jnp.inf, jnp.where(allowed, score, -jnp.inf))
  vals, idx = lax.top_k(lax.stop_gradient(s), kb)
  return idx, vals > -jnp.inf


def _moba_select(qf, kbar, allowed, forced, kb: int):
  """MoBA's gate: row (query token) i scores key block J by q_i · k̄_J; with ``is_causal``
  its own block is always kept and later blocks never."""
  return _top_blocks(jnp.einsum("bnih,bnjh->bnij", qf, kbar), allowed, forced, kb)


def _bfla_select(lay: _Layout, qf, kbar, allowed, forced, kb: int, mass: float):
  """BFLA [R]: block mass M_iJ = softmax_J(s q_i·k̄_J) over the allowed blocks; keep the
  fewest blocks reaching cumulative mass ``mass`` (at most kb), plus the rescued own
  (causal) and first (sink) blocks."""
  est = _masked_softmax(lay.scale * jnp.einsum("bnih,bnjh->bnij", qf, kbar), allowed)
  rescued = forced | (allowed & (jnp.arange(lay.nk) == 0)[None, None, None, :])
  any_ok = allowed | forced
  key = jnp.where(rescued, 2.0 + est, est)  # rescued blocks sort first
  order = jnp.argsort(-jnp.where(any_ok, key, -1.0), axis=-1)
  shape = key.shape
  sorted_mass = jnp.take_along_axis(jnp.broadcast_to(est, shape), order, axis=-1)
  sorted_rescued = jnp.take_along_axis(jnp.broadcast_to(rescued, shape), order, axis=-1)
  sorted_ok = jnp.take_along_axis(jnp.broadcast_to(any_ok, shape), order, axis=-1)
  before = jnp.cumsum(sorted_mass, axis=-1) - sorted_mass
  keep = sorted_ok & (sorted_rescued | (before < mass))
  return order[..., :kb], lax.stop_gradient(keep[..., :kb])


def prism_bands(H: int, high_pairs: int):
  """The (high-frequency, low-frequency) head dims for half-split RoPE (pair f = dims f and
  f + H/2, frequency theta_f = base^(-2f/H): small f rotates fastest)."""
  half = H // 2
  hi = [d for f in range(high_pairs) for d in (f, f + half)]
  lo = [d for d in range(H) if d not in hi]
  return sorted(hi), lo


def _prism_attenuation(lay: _Layout, d, kbar, per_token: bool):
  """Band energy attenuation pooled / unpooled key energy: [B, N, 1] over every key, or
  (causal) [B, N, Tp] over the key blocks wholly before each token's own block."""
  nonempty = lay.key_valid(jnp.broadcast_to(jnp.arange(lay.nk) * lay.bs, (lay.B, lay.nk)))
  kpos = jnp.arange(lay.nk * lay.bs).reshape(lay.nk, lay.bs)
  kval = lay.key_valid(jnp.broadcast_to(kpos, (lay.B, lay.nk, lay.bs)))[:, None]  # [B,1,nk,bs]
  raw = jnp.sum(jnp.sum(lay.k[..., d] ** 2, -1) * kval, -1)  # [B, K, nk]
  sums = [jnp.sum(kbar[..., d] ** 2, -1) * nonempty[:, None],  # [B, N, nk]
          jnp.broadcast_to(nonempty[:, None], kbar.shape[:3]).astype(kbar.dtype),
          jnp.repeat(raw, lay.G, axis=1),
          jnp.broadcast_to(jnp.sum(kval, -1), kbar.shape[:3]).astype(kbar.dtype)]
  if lay.causal and per_token:
    own = jnp.minimum(jnp.arange(lay.nq * lay.bs) // lay.bs, lay.nk)
    sums = [jnp.concatenate([jnp.zeros_like(x[..., :1]), jnp.cumsum(x, -1)], -1)[..., own]
            for x in sums]
  else:
    sums = [jnp.sum(x, -1, keepdims=True) for x in sums]
  pooled = sums[0] / jnp.maximum(sums[1], 1.0)
  unpooled = sums[2] / jnp.maximum(sums[3], 1.0)
  return jnp.clip(pooled / jnp.maximum(unpooled, 1e-30), 1e-6, 1.0)


def _prism_select(lay: _Layout, qf, kbar, allowed, forced, kb: int, high_pairs: int,
                  per_token: bool):
  """Prism [R]: block scores per frequency band, each divided by its energy attenuation
  (pooled energy / unpooled energy, which undoes mean pooling's low-pass loss), softmax over
  the allowed blocks per band, and the blocks ranked by the larger of the two bands."""
  probs = []
  for dims in prism_bands(lay.H, high_pairs):
    d = jnp.asarray(dims)
    atten = _prism_attenuation(lay, d, kbar, per_token)
    score = lay.scale * jnp.einsum("bnih,bnjh->bnij", qf[..., d], kbar[..., d])
    probs.append(_masked_softmax(score / atten[..., None], allowed))
  return _top_blocks(jnp.maximum(*probs), allowed, forced, kb)


def _union_blocks(lay: _Layout, kept_tokens):
  """The key blocks kept by some token of each query block: [B, N, Tp, nk] -> [B, N, nq, nk]."""
  return jnp.any(kept_tokens.reshape(lay.B, lay.N, lay.nq, lay.bs, lay.nk), axis=3)


def _pallas_backend(implementation: str, lay: _Layout, fn: str):
  """``(backend, interpret)`` of a Pallas ``implementation``; a
  ``block_size`` the backend cannot tile raises ValueError naming it."""
  backend, interpret = kernels_pallas.pick_backend(_PALLAS_BACKENDS[implementation])
  try:  # the engine's own block rules (Mosaic: 128-lane key blocks with key lengths)
    kernels_pallas.resolve_block_sizes(dict(block_q=lay.bs, block_k=lay.bs), backend, lay.T, lay.S, lay.H,
                         lay.kv_len is not None)
  except ValueError as e:
    raise ValueError(f"{fn}: `block_size`={lay.bs} cannot be the block of implementation "
                     f"{implementation!r} ({backend}): {e}") from None
  return backend, interpret


def _pallas_attend(call, lay: _Layout, table, sel, pallas):
  """Softmax attention in the Pallas engine over the kept key blocks: ``table`` bool [B, N,
  nq, nk] (forward and dQ loops; its transpose for dK/dV) and, for per-token selections,
  ``sel`` int [B, N, T, kb] each token's blocks (-1 = none), hiding in a tile the rows that
  did not select its key block. Block size = ``lay.bs``; ``pallas`` is
  :func:`_pallas_backend`'s answer."""
  backend, interpret = pallas
  return kernels_pallas.attention_from_call(
      call, backend=backend, interpret=interpret,
      block_sizes=dict(block_q=lay.bs, block_k=lay.bs), block_table=table, row_blocks=sel)


def block_sparse_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, *, method: str, block_size: int = 64,
    top_k_blocks: int | None = None, skip_threshold: float | None = None,
    skip_calibration: float | None = None, mass_threshold: float = 0.9, high_frequency_pairs: int | None = None,
    scale: float | None = None, is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None, return_stats: bool = False,
    implementation: str = "xla_chunked") -> Any:
  r"""Block-sparse attention: exact softmax attention over the kept key blocks (A12).

  Queries and keys are cut into blocks of ``block_size`` positions. For query block I each
  method keeps a set of key blocks :math:`\mathcal{K}_I` (per batch and head) and computes
  exact softmax attention over the visible keys of those blocks, so the result equals
  :func:`dot_product_attention` with the mask "key block kept" (``return_stats`` gives that
  table; MoBA, and every method under ``is_causal``, keeps a set per query token). The skipped mass of a row is :math:`1 - \sum_{j \in \mathcal{K}} p_j` for the
  dense weights p, and the output error is at most twice the skipped mass times
  :math:`\max_j \|v_j\|`.

  * ``"blasst"``: BLASST skip-softmax ("BLASST", 2025; its authors and full title are not
    recorded in this project's sources; the rule is as in NVIDIA Model-Optimizer's
    skip-softmax kernel, which cites it). Each query row visits the key blocks from its
    own (diagonal) block backwards, as FlashAttention-2's causal loop does (without
    ``is_causal`` it wraps round to the last block after block 0), and skips a block when
    the block's max for that row is below its running max minus ``skip_threshold`` = tau
    (the paper's ``ln(1/lambda)``): :math:`\tilde m^{(j)} < m^{(j-1)} - \tau`; starting
    next to the row, where attention is usually strongest, makes the running max large
    early and the skips many. Each skipped weight is then
    at most :math:`e^{-\tau}` of the dense softmax (its logit is below the final max minus
    tau and the denominator is at least 1 at the final max), so the skipped mass of a row
    is at most :math:`n_{\mathrm{skipped}} e^{-\tau}`. ``skip_threshold=inf`` is exact.
    The decision is order dependent and taken per query row (a kernel's per-tile "all
    rows" rule would let a later token of the tile change an earlier token's output);
    only the kept (row, key block) pairs are computed, forward and backward.
  * ``"moba"``: MoBA (E. Lu et al., "MoBA: Mixture of Block Attention for Long-Context
    LLMs", 2025; used by SpikingBrain 2.0): each query token i gates key block J by
    :math:`g_{iJ} = q_i \cdot \bar k_J` (mean-pooled keys) and keeps its
    ``top_k_blocks`` best blocks, per token as in the paper; with ``is_causal`` the token's
    own block is always kept (its causal mask applies inside) and only blocks wholly
    before it are scored.
  * ``"bfla"``: BFLA [R] ("Block-Filtered Long-Context Attention", 2026; authors not
    recorded here; code Alicewithrabbit/BFLA):
    the estimated block mass :math:`M_{IJ} = \mathrm{softmax}_J(s\, \bar q_I \cdot \bar
    k_J)`; the fewest blocks reaching ``mass_threshold`` are kept (at most
    ``top_k_blocks``), plus the "rescued" first (sink) block and, causal, the own block.
    The estimator and rescue rules are reconstructions. With ``is_causal`` the pooled
    query :math:`\bar q_I` (which holds later tokens of the block) is replaced by each
    token's own :math:`q_i`, and the softmax runs over the blocks wholly before it.
  * ``"prism"``: Prism [R] (a training-free spectral-aware block selection, 2025-26; title
    and authors not recorded here): the
    head dimension is split into high- and low-frequency bands of half-split RoPE (the
    first ``high_frequency_pairs`` rotary pairs rotate fastest); each band's block score
    is divided by its energy attenuation (pooled / unpooled key energy, the mean pooling's
    low-pass loss), softmax-normalised over the blocks, and blocks are ranked by the larger
    band probability; top ``top_k_blocks`` kept. The calibration is a reconstruction. With
    ``is_causal`` the selection is per token as for BFLA, and the attenuation of token i
    uses only the key blocks wholly before its own block (always kept).

  No T x S array is built: BLASST scans the key blocks per query block for the block maxima
  ([T, nk]) and then loops over its kept pairs only; the other
  methods score blocks on the pooled [T or nq, nk] grid and visit only the kept blocks.
  With a Pallas ``implementation`` the same selection drives the Pallas engine's block
  tables (kernels_pallas/README.md, "Block tables"): the kernel's key loops visit only
  the kept blocks, forward and backward, and a tile hides the rows that did not keep its
  block. BLASST's Pallas forward (:func:`kernels_pallas.blasst_attention`) decides each
  skip inside its key loop, on its running max, with the same decisions; its backward is
  the engine's over the kept pairs.

  Args:
    query: [B, T, N, H]; key: [B, S, K, H]; value: [B, S, K, Hv] (GQA: N % K == 0).
    method: one of ``"blasst"``, ``"moba"``, ``"bfla"``, ``"prism"``.
    block_size: positions per query and key block (an int >= 1).
    top_k_blocks: key blocks kept per query token or block (moba, prism: required; bfla:
      the cap, default all); an int >= 1, more than the number of key blocks keeps them all.
    skip_threshold: BLASST's tau >= 0 (blasst: this or ``skip_calibration``).
    skip_calibration: BLASST's constant c > 0 of :math:`\lambda = c / L`: the call
      uses :math:`\tau = \max(0, \ln(S / c))` for its S keys
      (:func:`blasst_skip_threshold`; c from :func:`blasst_calibrate`).
    mass_threshold: BFLA's target mass in (0, 1].
    high_frequency_pairs: Prism's high band, in rotary pairs (default H // 8, at least 1).
    scale: logit scale (None = 1/sqrt(H)); is_causal: query i sees keys j <= i;
    key_value_seq_lengths: optional int [B] (padding).
    return_stats: also return ``{"kept": bool [B, N, nq, nk], "kept_tokens": bool [B, N,
      T, nk]}``: the key blocks each query token attended to, and their union over each
      query block (blocks without a visible key are False).
    implementation: ``"xla_chunked"`` (default: the blockwise XLA loops above),
      ``"pallas"`` (the platform's Pallas backend; in interpret mode on CPU with
      ``JAXSOFT_PALLAS_INTERPRET=1``), ``"pallas_triton"`` or ``"pallas_mosaic_tpu"``; the
      Pallas ones run every method, with ``block_size`` as the kernel's block
      (Triton: a power of two >= 16; Mosaic: a multiple of 8, of 128 with
      ``key_value_seq_lengths``).

  Returns:
    [B, T, N, Hv] in query's dtype (computed in float32 at least: bf16 and fp16 widen, float64 stays), and the stats with ``return_stats``.
    Differentiable in query, key and value (the block choice is piecewise constant).

  Examples:
    Causal MoBA keeping 2 key blocks of 4 positions per query token: its own block and the
    best earlier one (shown: the union over each query block's tokens); BLASST with an
    infinite threshold skips nothing (exact attention).

    >>> x = jnp.sin(jnp.arange(256.0)).reshape(2, 16, 2, 4)  # [B, T, N, H]
    >>> out, stats = js.attention.block_sparse_attention(
    ...     x, x, x, method="moba", block_size=4, top_k_blocks=2, is_causal=True,
    ...     return_stats=True)
    >>> stats["kept"][0, 0].astype(int)  # [query block, key block] of batch 0, head 0
    Array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 0, 1, 1]], dtype=int32)
    >>> exact = js.attention.block_sparse_attention(
    ...     x, x, x, method="blasst", block_size=4, skip_threshold=float("inf"), is_causal=True)
    >>> bool(jnp.allclose(exact, js.attention.dot_product_attention(x, x, x, is_causal=True),
    ...                   atol=1e-5))
    True

  References:
    E. Lu et al., 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs" (arXiv
    2502.13189).

    BLASST, 2025, skip-softmax block skipping (authors and full title not recorded in this
    project's sources; the rule as in NVIDIA Model-Optimizer's skip-softmax kernel).

    BFLA, 2026, "Block-Filtered Long-Context Attention" (authors not recorded here; code
    Alicewithrabbit/BFLA).

    Prism, 2025-26, training-free spectral-aware block selection (title and authors not
    recorded here).
  """
  fn = "block_sparse_attention"
  if method not in BLOCK_SPARSE_METHODS:
    raise ValueError(f"{fn}: `method` must be one of {BLOCK_SPARSE_METHODS}, got {method!r}")
  if jnp.ndim(query) != 4:
    raise ValueError(f"{fn}: `query` must have shape [B, T, N, H], got {jnp.shape(query)}")
  bs = check_int(block_size, "block_size", 1, fn)
  if implementation not in BLOCK_SPARSE_IMPLEMENTATIONS:
    raise ValueError(f"{fn}: `implementation` must be one of {BLOCK_SPARSE_IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  call = AttentionCall.create(query, key, value, scale=scale, is_causal=is_causal,
                              key_value_seq_lengths=key_value_seq_lengths)
  lay = _Layout(call, bs)
  Tp = lay.nq * bs
  pallas = None if implementation == "xla_chunked" else _pallas_backend(implementation, lay, fn)
  if method == "blasst":
    if (skip_threshold is None) == (skip_calibration is None):
      raise ValueError(f"{fn}: method 'blasst' needs exactly one of `skip_threshold` (tau >= 0) "
                       "and `skip_calibration` (c > 0, lambda = c / L)")
    tau = (blasst_skip_threshold(lay.S, skip_calibration) if skip_calibration is not None
           else float(skip_threshold))  # type: ignore[arg-type]
    if not tau >= 0:
      raise ValueError(f"{fn}: `skip_threshold` must be >= 0, got {skip_threshold!r}")
    if pallas is None:
      out, kept_tokens = _blasst(lay, tau)
    else:
      out, kept_tokens = _blasst_pallas(call, lay, tau, pallas)
  else:
    if method == "bfla":
      kb = lay.nk if top_k_blocks is None else check_int(top_k_blocks, "top_k_blocks", 1, fn)
      if not 0 < mass_threshold <= 1:
        raise ValueError(f"{fn}: `mass_threshold` must be in (0, 1], got {mass_threshold!r}")
    else:
      if top_k_blocks is None:
        raise ValueError(f"{fn}: method {method!r} needs `top_k_blocks`")
      kb = check_int(top_k_blocks, "top_k_blocks", 1, fn)
    kb = min(kb, lay.nk)  # a short sequence (a decoding prefix) keeps all its blocks
    if method == "prism":
      pairs = max(1, lay.H // 8) if high_frequency_pairs is None else check_int(
          high_frequency_pairs, "high_frequency_pairs", 1, fn, max(1, lay.H // 2 - 1))
      if lay.H < 4:
        raise ValueError(f"{fn}: method 'prism' needs a head dimension H >= 4, got {lay.H}")
    # MoBA selects per query token (as its paper); the others per query block, except under
    # is_causal, where a block-level choice would use the block's later tokens
    per_token = method == "moba" or lay.causal
    qbar, kbar = lay.block_means()
    qf = lay.q.reshape(lay.B, lay.N, Tp, lay.H) if per_token else qbar
    allowed, forced = _row_masks(lay, per_token)
    if method == "moba":
      idx, valid = _moba_select(qf, kbar, allowed, forced, kb)
    elif method == "bfla":
      idx, valid = _bfla_select(lay, qf, kbar, allowed, forced, kb, float(mass_threshold))
    else:
      idx, valid = _prism_select(lay, qf, kbar, allowed, forced, kb, pairs, per_token)
    rows = jnp.any(jax.nn.one_hot(idx, lay.nk, dtype=bool) & valid[..., None], axis=-2)
    rows = rows & (allowed | forced)
    if per_token:
      kept_tokens = rows & (jnp.arange(Tp) < lay.T)[None, None, :, None]
    else:
      kept_tokens = jnp.repeat(rows, bs, axis=2) & (jnp.arange(Tp) < lay.T)[None, None, :, None]
    if pallas is not None:
      # per-token selections: each token's own list (exactly the pairs the token loop
      # computes), their union over the query block as its table row
      sel = jnp.where(valid, idx, -1)[:, :, :lay.T].astype(jnp.int32) if per_token else None
      table = _union_blocks(lay, kept_tokens) if per_token else rows
      out = _pallas_attend(call, lay, table, sel, pallas)
    elif per_token:
      out = _token_attend(lay, idx, valid)
    else:
      out = _gather_attend(lay, idx, valid)
  kept = _union_blocks(lay, kept_tokens)
  if return_stats:
    return out, {"kept": lax.stop_gradient(kept),
                 "kept_tokens": lax.stop_gradient(kept_tokens[:, :, :lay.T])}
  return out

