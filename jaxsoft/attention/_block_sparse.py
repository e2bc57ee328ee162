"""Block-sparse attention (feature A12): skip whole key blocks, by a bound or by a selection.

Two blockwise XLA engines, neither of which builds a T x S array (forward or backward):

* a *skip* loop (``method="blasst"``): for each query block, a scan over the key blocks
  carrying FlashAttention's running max m, sum l and accumulator, where a key block whose
  rows all fall below ``m - skip_threshold`` is skipped (no exp, no P·V);
* a *gather* loop (``method="moba" | "bfla" | "prism"``): block scores from mean-pooled
  queries and keys ([B, N, nq, nk], small) choose at most ``top_k_blocks`` key blocks per
  query block and head; each query block then attends exactly over its gathered blocks.

Each query block's step is rematerialised in the backward pass (``jax.checkpoint``), so
the largest intermediate is one query block against the keys it visits.
"""

from __future__ import annotations

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

  def block_visible(self):
    """Which (query block, key block) pairs hold a visible entry: bool [B, 1, nq, nk]."""
    qb = jnp.arange(self.nq)[:, None]
    kb = jnp.arange(self.nk)[None, :]
    vis = jnp.ones((self.nq, self.nk), bool)
    if self.causal:
      vis = vis & (kb * self.bs <= jnp.minimum(qb * self.bs + self.bs - 1, self.T - 1))
    first_key = jnp.broadcast_to(kb * self.bs, (self.B, 1, 1, self.nk))
    return vis[None, None] & self.key_valid(first_key)


# ---------------------------------------------------------------------------- skip loop


def _blasst(lay: _Layout, tau: float):
  """BLASST's skip-softmax loop; returns (out [B, T, N, Hv], kept bool [B, N, nq, nk])."""
  B, K, G, bs = lay.B, lay.K, lay.G, lay.bs
  Hv = lay.v.shape[-1]
  qg = lay.q.reshape(B, K, G, lay.nq, bs, lay.H)

  def q_block(qi):
    q = qg[:, :, :, qi] * lay.scale  # [B, K, G, bs, H]
    qpos = qi * bs + jnp.arange(bs)

    def step(carry, kj):
      m, l, acc, kept = carry
      kpos = jnp.broadcast_to(kj * bs + jnp.arange(bs), (B, bs))
      vis = lay.visible(qpos, kpos)[:, None, None]  # [B, 1, 1, bs, bs]
      reachable = (kj * bs <= qi * bs + bs - 1) if lay.causal else jnp.bool_(True)

      def visit(c):
        m, l, acc, kept = c
        s = jnp.einsum("bkgqh,bksh->bkgqs", q, lay.k[:, :, kj])
        s_vis = jnp.where(vis, s, -jnp.inf)
        tile_max = jnp.max(s_vis, axis=-1)  # [B, K, G, bs]
        any_vis = jnp.any(jnp.broadcast_to(vis, s.shape), axis=(-2, -1))  # [B, K, G]
        # skip when every row's tile max is below its running max minus tau (rows without
        # a visible entry in the tile contribute nothing either way)
        below = (tile_max < m - tau) | (tile_max == -jnp.inf)
        skip = lax.stop_gradient(jnp.all(below, axis=-1) & any_vis)

        def update(c):
          m, l, acc, kept = c
          m_new = lax.stop_gradient(jnp.maximum(m, tile_max))
          m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
          alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_use), 0.0)
          p = jnp.where(vis, jnp.exp(jnp.where(vis, s, m_use[..., None]) - m_use[..., None]), 0.0)
          l_new = alpha * l + jnp.sum(p, axis=-1)
          acc_new = alpha[..., None] * acc + jnp.einsum("bkgqs,bksh->bkgqh", p, lay.v[:, :, kj])
          keep = ~skip
          return (jnp.where(keep[..., None], m_new, m), jnp.where(keep[..., None], l_new, l),
                  jnp.where(keep[..., None, None], acc_new, acc),
                  kept.at[..., kj].set(any_vis & keep))

        # a tile skipped for every batch and head costs no exp and no P·V
        return lax.cond(jnp.all(skip | ~any_vis), lambda c: c, update, c)

      return lax.cond(reachable, visit, lambda c: c, carry), None

    init = (jnp.full((B, K, G, bs), -jnp.inf, lay.cdt), jnp.zeros((B, K, G, bs), lay.cdt),
            jnp.zeros((B, K, G, bs, Hv), lay.cdt), jnp.zeros((B, K, G, lay.nk), bool))
    (m, l, acc, kept), _ = lax.scan(step, init, jnp.arange(lay.nk))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(B, lay.N, bs, Hv), kept.reshape(B, lay.N, lay.nk)

  out, kept = lax.map(jax.checkpoint(q_block), jnp.arange(lay.nq))
  return lay.unblock(out), jnp.moveaxis(kept, 0, 2)


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


def _forced_blocks(lay: _Layout):
  """The diagonal block of each query block (causal): bool [1, 1, nq, nk]."""
  qb = jnp.arange(lay.nq)[:, None]
  kb = jnp.arange(lay.nk)[None, :]
  return ((qb == kb) if lay.causal else jnp.zeros((lay.nq, lay.nk), bool))[None, None]


def _top_blocks(score, allowed, kb: int):
  """The ``kb`` best allowed blocks by ``score``: (idx, valid) [B, N, nq, kb]."""
  s = jnp.where(allowed, score, -jnp.inf)
  vals, idx = lax.top_k(lax.stop_gradient(s), kb)
  return idx, vals > -jnp.inf


def _moba_select(lay: _Layout, kb: int):
  """MoBA's gate: query block I scores key block J by q̄_I · k̄_J; the current block is
  always kept (causal), future blocks never."""
  qbar, kbar = lay.block_means()
  score = jnp.einsum("bnih,bnjh->bnij", qbar, kbar)
  forced = _forced_blocks(lay)
  allowed = lay.block_visible()
  return _top_blocks(jnp.where(forced, jnp.inf, score), allowed, kb)


def _bfla_select(lay: _Layout, kb: int, mass: float):
  """BFLA [R]: block mass M_IJ = softmax_J(s q̄_I·k̄_J) over the visible blocks; keep the
  fewest blocks reaching cumulative mass ``mass`` (at most kb), plus the rescued diagonal
  (causal) and first (sink) blocks."""
  qbar, kbar = lay.block_means()
  allowed = lay.block_visible()
  est = _masked_softmax(lay.scale * jnp.einsum("bnih,bnjh->bnij", qbar, kbar), allowed)
  forced = _forced_blocks(lay) | (jnp.arange(lay.nk) == 0)[None, None, None, :]
  key = jnp.where(forced, 2.0 + est, est)  # rescued blocks sort first
  order = jnp.argsort(-jnp.where(allowed, key, -1.0), axis=-1)
  sorted_mass = jnp.take_along_axis(jnp.broadcast_to(est, key.shape), order, axis=-1)
  sorted_forced = jnp.take_along_axis(jnp.broadcast_to(forced, key.shape), order, axis=-1)
  sorted_allowed = jnp.take_along_axis(jnp.broadcast_to(allowed, key.shape), order, axis=-1)
  before = jnp.cumsum(sorted_mass, axis=-1) - sorted_mass
  keep = sorted_allowed & (sorted_forced | (before < mass))
  return order[..., :kb], lax.stop_gradient(keep[..., :kb])


def prism_bands(H: int, high_pairs: int):
  """The (high-frequency, low-frequency) head dims for half-split RoPE (pair f = dims f and
  f + H/2, frequency theta_f = base^(-2f/H): small f rotates fastest)."""
  half = H // 2
  hi = [d for f in range(high_pairs) for d in (f, f + half)]
  lo = [d for d in range(H) if d not in hi]
  return sorted(hi), lo


def _prism_select(lay: _Layout, kb: int, high_pairs: int):
  """Prism [R]: block scores per frequency band, each divided by its energy attenuation
  (pooled energy / unpooled energy, which undoes mean pooling's low-pass loss), softmax over
  the visible blocks per band, and the blocks ranked by the larger of the two bands."""
  qbar, kbar = lay.block_means()
  allowed = lay.block_visible()
  kpos = jnp.arange(lay.nk * lay.bs)
  kval = lay.key_valid(jnp.broadcast_to(kpos, (lay.B, kpos.size)))  # [B, Sp]
  nonempty = lay.key_valid(jnp.broadcast_to(jnp.arange(lay.nk) * lay.bs, (lay.B, lay.nk)))[:, None]
  kfull = jnp.repeat(lay.k.reshape(lay.B, lay.K, -1, lay.H), lay.G, axis=1)  # [B, N, Sp, H]
  probs = []
  for dims in prism_bands(lay.H, high_pairs):
    d = jnp.asarray(dims)
    kb_bar, qb_bar = kbar[..., d], qbar[..., d]
    pooled = _masked_mean(jnp.sum(kb_bar ** 2, -1), nonempty, 2)  # [B, N]
    raw = _masked_mean(jnp.sum(kfull[..., d] ** 2, -1), kval[:, None], 2)
    atten = jnp.clip(pooled / jnp.maximum(raw, 1e-30), 1e-6, 1.0)
    score = lay.scale * jnp.einsum("bnih,bnjh->bnij", qb_bar, kb_bar) / atten[..., None, None]
    probs.append(_masked_softmax(score, allowed))
  score = jnp.maximum(*probs)
  return _top_blocks(jnp.where(_forced_blocks(lay), jnp.inf, score), allowed, kb)


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
  table). The skipped mass of a row is :math:`1 - \sum_{j \in \mathcal{K}} p_j` for the
  dense weights p, and the output error is at most twice the skipped mass times
  :math:`\max_j \|v_j\|`.

  * ``"blasst"``: BLASST skip-softmax ("BLASST", 2025; its authors and full title are not
    recorded in this project's sources; the rule is as in NVIDIA Model-Optimizer's
    skip-softmax kernel, which cites it). Key blocks are visited in order
    inside the online-softmax loop; a block is skipped when every row's block max is below
    its running max minus ``skip_threshold`` = tau (the paper's ``ln(1/lambda)``):
    :math:`\tilde m^{(j)} < m^{(j-1)} - \tau`. Each skipped weight is then at most
    :math:`e^{-\tau}` of the dense softmax (its logit is below the final max minus tau and
    the denominator is at least 1 at the final max), so the skipped mass of a row is at
    most :math:`n_{\mathrm{skipped}} e^{-\tau}`. ``skip_threshold=inf`` is exact. The
    decision is order dependent and taken per query block and head, as in a kernel.
  * ``"moba"``: MoBA (E. Lu et al., "MoBA: Mixture of Block Attention for Long-Context
    LLMs", 2025; used by SpikingBrain 2.0): the gate :math:`g_{IJ} = \bar q_I \cdot \bar
    k_J` (mean-pooled keys; MoBA gates each query token by :math:`q \cdot \bar k_J`, whose
    block mean is this) keeps the ``top_k_blocks`` best blocks; with ``is_causal`` the
    query block's own block is always kept and future blocks never. [R] One selection per
    query block (as block-sparse kernels do), not per token.
  * ``"bfla"``: BFLA [R] ("Block-Filtered Long-Context Attention", 2026; authors not
    recorded here; code Alicewithrabbit/BFLA):
    the estimated block mass :math:`M_{IJ} = \mathrm{softmax}_J(s\, \bar q_I \cdot \bar
    k_J)`; the fewest blocks reaching ``mass_threshold`` are kept (at most
    ``top_k_blocks``), plus the "rescued" diagonal (causal) and first (sink) blocks. The
    estimator and rescue rules are reconstructions.
  * ``"prism"``: Prism [R] (a training-free spectral-aware block selection, 2025-26; title
    and authors not recorded here): the
    head dimension is split into high- and low-frequency bands of half-split RoPE (the
    first ``high_frequency_pairs`` rotary pairs rotate fastest); each band's block score
    is divided by its energy attenuation (pooled / unpooled key energy, the mean pooling's
    low-pass loss), softmax-normalised over the blocks, and blocks are ranked by the larger
    band probability; top ``top_k_blocks`` kept (diagonal always, causal). The
    calibration is a reconstruction.

  No T x S array is built: BLASST runs a scan over key blocks per query block; the other
  methods score blocks on the pooled [nq, nk] grid and gather the kept blocks.

  Args:
    query: [B, T, N, H]; key: [B, S, K, H]; value: [B, S, K, Hv] (GQA: N % K == 0).
    method: one of ``"blasst"``, ``"moba"``, ``"bfla"``, ``"prism"``.
    block_size: positions per query and key block (an int >= 1).
    top_k_blocks: key blocks kept per query block (moba, prism: required; bfla: the cap,
      default all).
    skip_threshold: BLASST's tau >= 0 (required for blasst).
    mass_threshold: BFLA's target mass in (0, 1].
    high_frequency_pairs: Prism's high band, in rotary pairs (default H // 8, at least 1).
    scale: logit scale (None = 1/sqrt(H)); is_causal: query i sees keys j <= i;
    key_value_seq_lengths: optional int [B] (padding).
    return_stats: also return ``{"kept": bool [B, N, nq, nk]}``, the key blocks each query
      block attended to (blocks without a visible key are False).

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside), and the stats with ``return_stats``.
    Differentiable in query, key and value (the block choice is piecewise constant).

  Example:
    Causal MoBA keeping 2 key blocks of 4 positions per query block: its own block and the
    best earlier one; BLASST with an infinite threshold skips nothing (exact attention).

    >>> import jax.numpy as jnp
    >>> import jaxsoft as js
    >>> x = jnp.sin(jnp.arange(256.0)).reshape(2, 16, 2, 4)  # [B, T, N, H]
    >>> out, stats = js.attention.block_sparse_attention(
    ...     x, x, x, method="moba", block_size=4, top_k_blocks=2, is_causal=True,
    ...     return_stats=True)
    >>> stats["kept"][0, 0].astype(int)  # [query block, key block] of batch 0, head 0
    Array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]], dtype=int32)
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
  if method == "blasst":
    if skip_threshold is None:
      raise ValueError(f"{fn}: method 'blasst' needs `skip_threshold` (tau >= 0)")
    tau = float(skip_threshold)
    if not tau >= 0:
      raise ValueError(f"{fn}: `skip_threshold` must be >= 0, got {skip_threshold!r}")
    out, kept = _blasst(lay, tau)
  else:
    if method == "bfla":
      kb = lay.nk if top_k_blocks is None else _check_int(top_k_blocks, "top_k_blocks", 1, fn,
                                                           lay.nk)
      if not 0 < mass_threshold <= 1:
        raise ValueError(f"{fn}: `mass_threshold` must be in (0, 1], got {mass_threshold!r}")
      idx, valid = _bfla_select(lay, kb, float(mass_threshold))
    else:
      if top_k_blocks is None:
        raise ValueError(f"{fn}: method {method!r} needs `top_k_blocks`")
      kb = _check_int(top_k_blocks, "top_k_blocks", 1, fn, lay.nk)
      if method == "moba":
        idx, valid = _moba_select(lay, kb)
      else:
        pairs = max(1, lay.H // 8) if high_frequency_pairs is None else _check_int(
            high_frequency_pairs, "high_frequency_pairs", 1, fn, max(1, lay.H // 2 - 1))
        if lay.H < 4:
          raise ValueError(f"{fn}: method 'prism' needs a head dimension H >= 4, got {lay.H}")
        idx, valid = _prism_select(lay, kb, pairs)
    out = _gather_attend(lay, idx, valid)
    kept = jnp.any(jax.nn.one_hot(idx, lay.nk, dtype=bool) & valid[..., None], axis=-2)
    kept = kept & lay.block_visible()
  if return_stats:
    return out, {"kept": lax.stop_gradient(kept)}
  return out

