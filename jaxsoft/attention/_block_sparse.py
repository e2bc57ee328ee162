"""Block-sparse attention (feature A12): skip whole key blocks, by a bound or by a selection.

Three blockwise XLA engines, none of which builds a T x S array (forward or backward):

* a *skip* loop (``method="blasst"``): for each query block, a scan over the key blocks
  carrying FlashAttention's running max m, sum l and accumulator; each query row skips a
  key block whose scores all fall below its ``m - skip_threshold`` (the tile costs no exp
  and no P·V when every row skips it);
* a *token* loop (``method="moba"``, and every selecting method under ``is_causal``): each
  query token scores the key blocks from its own query vector and mean-pooled keys ([B, N,
  T, nk], small next to T x S), keeps at most ``top_k_blocks``, and attends exactly over
  them; the (token, block) pairs are sorted by key block and computed as [bs, bs] tiles;
* a *gather* loop (``method="bfla" | "prism"`` without ``is_causal``): block scores from
  mean-pooled queries and keys ([B, N, nq, nk]) choose the key blocks per query block,
  which then attends exactly over its gathered blocks.

Causality: under ``is_causal`` no decision about token i uses a query, key or pooled key
later than i, so a token's output (and gradient) never depends on later tokens, and
decoding on prefixes equals the full forward. The skip loop has a custom blockwise
FlashAttention backward over the tiles it kept; the other loops rematerialise each step in
the backward pass (``jax.checkpoint``).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._api import _canonical_call

__all__ = ["block_sparse_attention", "BLOCK_SPARSE_METHODS"]

BLOCK_SPARSE_METHODS = ("blasst", "moba", "bfla", "prism")


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
    vis = self.key_valid(kpos)[..., None, :] & (qpos < self.T)[:, None]
    if self.causal:
      vis = vis & (kpos[..., None, :] <= qpos[:, None])
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


def _blasst_tile_vis(kvalid, qi, kj, bs: int, T: int, causal: bool):
  """Visibility of query block qi against key block kj: bool [B, 1, 1, bs, bs]."""
  qpos = qi * bs + jnp.arange(bs)
  kpos = kj * bs + jnp.arange(bs)
  vis = (kvalid[:, kj] > 0)[:, None, :] & (qpos < T)[None, :, None]
  if causal:
    vis = vis & (kpos[None, :] <= qpos[:, None])[None]
  return vis[:, None, None]


def _blasst_forward(qs, k, v, kvalid, tau: float, causal: bool, T: int):
  """The skip loop: qs [B, K, G, nq, bs, H] (scaled), k/v [B, K, nk, bs, ·], kvalid [B, nk,
  bs]; returns out [B, K, G, nq, bs, Hv], lse [B, K, G, nq, bs], kept [B, K, G, nq, bs, nk]."""
  B, K, G, nq, bs, _ = qs.shape
  nk, Hv = k.shape[2], v.shape[-1]
  cdt = qs.dtype

  def q_block(qi):
    q = qs[:, :, :, qi]  # [B, K, G, bs, H]

    def step(carry, kj):
      reachable = (kj * bs <= qi * bs + bs - 1) if causal else jnp.bool_(True)

      def visit(c):
        m, l, acc, kept = c
        vis = _blasst_tile_vis(kvalid, qi, kj, bs, T, causal)
        s = jnp.einsum("bkgqh,bksh->bkgqs", q, k[:, :, kj])
        tile_max = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1)  # [B, K, G, bs]
        # each row decides alone (a row without a visible entry in the tile has nothing to
        # add): its tile max below its own running max minus tau. A decision shared by the
        # rows of a query block would let a later token change an earlier token's output.
        skip = (tile_max < m - tau) | (tile_max == -jnp.inf)

        def update(c):
          m, l, acc, kept = c
          m_new = jnp.maximum(m, tile_max)
          m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
          alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_use), 0.0)
          p = jnp.where(vis, jnp.exp(jnp.where(vis, s, m_use[..., None]) - m_use[..., None]), 0.0)
          l_new = alpha * l + jnp.sum(p, axis=-1)
          acc_new = alpha[..., None] * acc + jnp.einsum("bkgqs,bksh->bkgqh", p, v[:, :, kj])
          keep = ~skip
          return (jnp.where(keep, m_new, m), jnp.where(keep, l_new, l),
                  jnp.where(keep[..., None], acc_new, acc), kept.at[..., kj].set(keep))

        # a tile skipped by every row, batch and head costs no exp and no P·V
        return lax.cond(jnp.all(skip), lambda c: c, update, c)

      return lax.cond(reachable, visit, lambda c: c, carry), None

    init = (jnp.full((B, K, G, bs), -jnp.inf, cdt), jnp.zeros((B, K, G, bs), cdt),
            jnp.zeros((B, K, G, bs, Hv), cdt), jnp.zeros((B, K, G, bs, nk), bool))
    (m, l, acc, kept), _ = lax.scan(step, init, jnp.arange(nk))
    has = l > 0
    l1 = jnp.where(has, l, 1.0)
    return acc / l1[..., None], jnp.where(has, m + jnp.log(l1), -jnp.inf), kept

  out, lse, kept = lax.map(q_block, jnp.arange(nq))
  return jnp.moveaxis(out, 0, 3), jnp.moveaxis(lse, 0, 3), jnp.moveaxis(kept, 0, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _blasst_core(qs, k, v, kvalid, tau, causal, T):
  out, _, kept = _blasst_forward(qs, k, v, kvalid, tau, causal, T)
  return out, kept


def _blasst_core_fwd(qs, k, v, kvalid, tau, causal, T):
  out, lse, kept = _blasst_forward(qs, k, v, kvalid, tau, causal, T)
  return (out, kept), (qs, k, v, kvalid, out, lse, kept)


def _blasst_core_bwd(tau, causal, T, res, cts):
  """FlashAttention's backward over the (row, key block) pairs the forward kept: with the
  final log-sum-exp L, P = exp(S - L) on kept entries, dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - D),
  D = rowsum(dO ∘ O), dQ = dS K, dK = dSᵀ Q. The block choice is piecewise constant."""
  qs, k, v, kvalid, out, lse, kept = res
  dout = cts[0].astype(out.dtype)
  B, K, G, nq, bs, _ = qs.shape
  nk = k.shape[2]
  D = jnp.sum(dout * out, axis=-1)  # [B, K, G, nq, bs]
  lse0 = jnp.where(jnp.isfinite(lse), lse, 0.0)

  def q_block(carry, qi):
    dk, dv = carry
    q, do, Di, Li, kp = (x[:, :, :, qi] for x in (qs, dout, D, lse0, kept))

    def step(c, kj):
      dq, dk, dv = c
      rows = kp[..., kj]  # [B, K, G, bs]

      def visit(c):
        dq, dk, dv = c
        vis = _blasst_tile_vis(kvalid, qi, kj, bs, T, causal) & rows[..., None]
        kj_, vj = k[:, :, kj], v[:, :, kj]
        s = jnp.einsum("bkgqh,bksh->bkgqs", q, kj_)
        p = jnp.where(vis, jnp.exp(jnp.where(vis, s, Li[..., None]) - Li[..., None]), 0.0)
        dp = jnp.einsum("bkgqh,bksh->bkgqs", do, vj)
        ds = p * (dp - Di[..., None])
        dq = dq + jnp.einsum("bkgqs,bksh->bkgqh", ds, kj_)
        dk = dk.at[:, :, kj].add(jnp.einsum("bkgqs,bkgqh->bksh", ds, q))
        dv = dv.at[:, :, kj].add(jnp.einsum("bkgqs,bkgqh->bksh", p, do))
        return dq, dk, dv

      return lax.cond(jnp.any(rows), visit, lambda c: c, c), None

    (dq, dk, dv), _ = lax.scan(step, (jnp.zeros_like(q), dk, dv), jnp.arange(nk))
    return (dk, dv), dq

  (dk, dv), dq = lax.scan(q_block, (jnp.zeros_like(k), jnp.zeros_like(v)), jnp.arange(nq))
  return jnp.moveaxis(dq, 0, 3), dk, dv, jnp.zeros_like(kvalid)


_blasst_core.defvjp(_blasst_core_fwd, _blasst_core_bwd)


def _blasst(lay: _Layout, tau: float):
  """BLASST's skip-softmax loop, decided per query row; returns (out [B, T, N, Hv], kept bool
  [B, N, Tp, nk]: the key blocks each query row attended to). The backward pass is a custom
  blockwise FlashAttention backward over the kept tiles (no differentiation of the loop)."""
  B, K, G, bs, nq, nk = lay.B, lay.K, lay.G, lay.bs, lay.nq, lay.nk
  Hv = lay.v.shape[-1]
  kpos = jnp.broadcast_to(jnp.arange(nk * bs), (B, nk * bs))
  kvalid = lay.key_valid(kpos).astype(lay.cdt).reshape(B, nk, bs)
  qs = lay.q.reshape(B, K, G, nq, bs, lay.H) * lay.scale
  out, kept = _blasst_core(qs, lay.k, lay.v, kvalid, float(tau), bool(lay.causal), lay.T)
  out = jnp.moveaxis(out.reshape(B, lay.N, nq, bs, Hv), 2, 0)
  kept = kept.reshape(B, lay.N, nq * bs, nk)
  return lay.unblock(out), kept & (jnp.arange(nq * bs) < lay.T)[:, None]


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
    kpos = (idx[:, :, qi, :, None] * bs + jnp.arange(bs)).reshape(B, lay.N, kb * bs)
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
  valid = lax.stop_gradient(valid & (jnp.arange(Tp) < lay.T)[:, None])
  idx = lax.stop_gradient(jnp.clip(idx, 0, nk - 1)).astype(jnp.int32)
  q = lay.q.reshape(B, K, G, Tp, H) * lay.scale
  klen = jnp.full((B,), lay.S) if lay.kv_len is None else jnp.minimum(lay.kv_len, lay.S)
  causal = lay.causal

  def one(q, k, v, idx, valid, klen):  # q [Tp, H]; k, v [nk, bs, ·]; idx, valid [Tp, kb]
    blk = jnp.where(valid, idx, nk).reshape(P)  # invalid pairs sort last (block nk)
    tok = jnp.repeat(jnp.arange(Tp), kb)
    order = jnp.argsort(blk, stable=True)
    sblk, stok = blk[order], tok[order]
    counts = jnp.zeros(nk + 1, jnp.int32).at[blk].add(1)
    start = jnp.cumsum(counts) - counts
    padded = (counts[:nk] + C - 1) // C * C
    ends = jnp.cumsum(padded)
    rank = jnp.arange(P) - start[sblk]
    dest = jnp.where(sblk < nk, (ends - padded)[jnp.minimum(sblk, nk - 1)] + rank, Ppad)
    slot_tok = jnp.full(Ppad, -1, jnp.int32).at[dest].set(stok, mode="drop")
    pos = jnp.zeros(P, jnp.int32).at[order].set(dest).reshape(Tp, kb)
    chunk_blk = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nchunk) * C, side="right"),
                            nk - 1)

    def group(gi):
      ct = lax.dynamic_slice(slot_tok, (gi * g * C,), (g * C,)).reshape(g, C)
      cb = lax.dynamic_slice(chunk_blk, (gi * g,), (g,))
      kpos = cb[:, None] * bs + jnp.arange(bs)  # [g, bs]
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
  own = (jnp.arange(R) // lay.bs)[:, None]
  return nonempty & (kb < own), nonempty & (kb == own)


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
  rescued = forced | (allowed & (jnp.arange(lay.nk) == 0))
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


def _check_int(value, name: str, low: int, fn: str, high: int | None = None):
  bad = isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
  if bad or (high is not None and value > high):
    rng = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{fn}: `{name}` must be an int {rng}, got {value!r}")
  return int(value)


def block_sparse_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, *, method: str, block_size: int = 64,
    top_k_blocks: int | None = None, skip_threshold: float | None = None,
    mass_threshold: float = 0.9, high_frequency_pairs: int | None = None,
    scale: float | None = None, is_causal: bool = False,
    key_value_seq_lengths: ArrayLike | None = None, return_stats: bool = False) -> Any:
  r"""Block-sparse attention: softmax attention restricted to the kept key blocks (A12).

  Queries and keys are cut into blocks of ``block_size`` positions. For query block I each
  method keeps a set of key blocks :math:`\mathcal{K}_I` (per batch and head) and computes
  exact softmax attention over the visible keys of those blocks, so the result equals
  :func:`dot_product_attention` with the mask "key block kept" (``return_stats`` gives that
  table; MoBA, and every method under ``is_causal``, keeps a set per query token). The skipped mass of a row is :math:`1 - \sum_{j \in \mathcal{K}} p_j` for the
  dense weights p, and the output error is at most twice the skipped mass times
  :math:`\max_j \|v_j\|`.

  * ``"blasst"``: BLASST skip-softmax ("BLASST", 2025; its authors and full title are not
    recorded in this project's sources; the rule is as in NVIDIA Model-Optimizer's
    skip-softmax kernel, which cites it). Key blocks are visited in order
    inside the online-softmax loop; a query row skips a block when the block's max for
    that row is below its running max minus ``skip_threshold`` = tau (the paper's
    ``ln(1/lambda)``): :math:`\tilde m^{(j)} < m^{(j-1)} - \tau`. Each skipped weight is then
    at most :math:`e^{-\tau}` of the dense softmax (its logit is below the final max minus
    tau and the denominator is at least 1 at the final max), so the skipped mass of a row
    is at most :math:`n_{\mathrm{skipped}} e^{-\tau}`. ``skip_threshold=inf`` is exact.
    The decision is order dependent and taken per query row (a kernel's per-tile "all
    rows" rule would let a later token of the tile change an earlier token's output); a
    tile is computed only when some row keeps it.
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

  No T x S array is built: BLASST runs a scan over key blocks per query block; the other
  methods score blocks on the pooled [T or nq, nk] grid and visit only the kept blocks.

  Args:
    query: [B, T, N, H]; key: [B, S, K, H]; value: [B, S, K, Hv] (GQA: N % K == 0).
    method: one of ``"blasst"``, ``"moba"``, ``"bfla"``, ``"prism"``.
    block_size: positions per query and key block (an int >= 1).
    top_k_blocks: key blocks kept per query token or block (moba, prism: required; bfla:
      the cap, default all); an int >= 1, more than the number of key blocks keeps them all.
    skip_threshold: BLASST's tau >= 0 (required for blasst).
    mass_threshold: BFLA's target mass in (0, 1].
    high_frequency_pairs: Prism's high band, in rotary pairs (default H // 8, at least 1).
    scale: logit scale (None = 1/sqrt(H)); is_causal: query i sees keys j <= i;
    key_value_seq_lengths: optional int [B] (padding).
    return_stats: also return ``{"kept": bool [B, N, nq, nk], "kept_tokens": bool [B, N,
      T, nk]}``: the key blocks each query token attended to, and their union over each
      query block (blocks without a visible key are False).

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside), and the stats with ``return_stats``.
    Differentiable in query, key and value (the block choice is piecewise constant).

  Example:
    Causal MoBA keeping 2 key blocks of 4 positions per query token: its own block and the
    best earlier one (shown: the union over each query block's tokens); BLASST with an
    infinite threshold skips nothing (exact attention).

    >>> import jax.numpy as jnp
    >>> import jaxsoft as js
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
  """
  fn = "block_sparse_attention"
  if method not in BLOCK_SPARSE_METHODS:
    raise ValueError(f"{fn}: `method` must be one of {BLOCK_SPARSE_METHODS}, got {method!r}")
  if jnp.ndim(query) != 4:
    raise ValueError(f"{fn}: `query` must have shape [B, T, N, H], got {jnp.shape(query)}")
  bs = _check_int(block_size, "block_size", 1, fn)
  call = _canonical_call(query, key, value, None, None, scale, is_causal, None,
                         key_value_seq_lengths, None, None, None, "softmax", None, None, None)
  lay = _Layout(call, bs)
  Tp = lay.nq * bs
  if method == "blasst":
    if skip_threshold is None:
      raise ValueError(f"{fn}: method 'blasst' needs `skip_threshold` (tau >= 0)")
    tau = float(skip_threshold)
    if not tau >= 0:
      raise ValueError(f"{fn}: `skip_threshold` must be >= 0, got {skip_threshold!r}")
    out, kept_tokens = _blasst(lay, tau)
  else:
    if method == "bfla":
      kb = lay.nk if top_k_blocks is None else _check_int(top_k_blocks, "top_k_blocks", 1, fn)
      if not 0 < mass_threshold <= 1:
        raise ValueError(f"{fn}: `mass_threshold` must be in (0, 1], got {mass_threshold!r}")
    else:
      if top_k_blocks is None:
        raise ValueError(f"{fn}: method {method!r} needs `top_k_blocks`")
      kb = _check_int(top_k_blocks, "top_k_blocks", 1, fn)
    kb = min(kb, lay.nk)  # a short sequence (a decoding prefix) keeps all its blocks
    if method == "prism":
      pairs = max(1, lay.H // 8) if high_frequency_pairs is None else _check_int(
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
      out = _token_attend(lay, idx, valid)
      kept_tokens = rows & (jnp.arange(Tp) < lay.T)[:, None]
    else:
      out = _gather_attend(lay, idx, valid)
      kept_tokens = jnp.repeat(rows, bs, axis=2) & (jnp.arange(Tp) < lay.T)[:, None]
  kept = jnp.any(kept_tokens.reshape(lay.B, lay.N, lay.nq, bs, lay.nk), axis=3)
  if return_stats:
    return out, {"kept": lax.stop_gradient(kept),
                 "kept_tokens": lax.stop_gradient(kept_tokens[:, :, :lay.T])}
  return out

