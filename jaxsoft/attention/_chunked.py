"""implementation="xla_chunked": blockwise attention with the normalizer's tile rule.

The logits are never materialised for the whole problem: an outer loop runs over query
blocks and an inner loop over the key blocks that block can see (the range comes from the
mask structure, so causal, sliding-window, padding and segment structure skip whole
blocks), carrying per query row only what the normalizer's kernel class needs
(DESIGN.md §3):

* class E (softmax family): the running max m and sum ell, merged with the rescaling
  ``l <- l·e^{m - m'} + sum_j den(z_j, m')`` of FlashAttention;
* class S: the running sum l (no stabiliser);
* class P: nothing (``D = 1``);
* class T (sparsemax, entmax, top-k): a first pass for the row max, then ``tau`` by
  multi-section search over key blocks (several candidate taus per pass, a fixed number
  of passes from the rule's iteration count), then a weighted pass.

A custom_vjp recomputes each tile in the backward pass (memory O(B·N·T·H); the only
T x S-sized arrays are the caller's own ``bias``/``mask`` and their gradient). Tile
gradients use the TileRule formula: with dP_j = dO·v_j and Δ = dO·O,
``dL/dnum_j = dP_j / D`` and ``dL/dden_j = -Δ / D``; the elementwise maps (score map,
numerator, denominator, offset) are differentiated with ``jax.vjp`` at fixed m, which
also yields the gradients of array hyperparameters (per-head temperature, alpha, s,
sink logit, ...). Class T adds the implicit-function term of tau:
``dz_j = w'_j (dP_j - Δ)/W - (g_tau / M_tau)·mass'_j`` with
``g_tau = sum_k d_tau weight_k (dP_k - Δ)/W`` and ``M_tau = sum_k d_tau mass_k``.

Internally everything is float32 (float64 for float64 inputs); q is pre-multiplied by the
scale (so ``scale`` and its gradient are handled by ordinary autodiff outside the
custom_vjp) and GQA keeps one copy
of K/V: q is viewed as [B, K, G, T, H] and each key block serves the G query heads of its
group in one batched matmul.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsoft.attention._masks import MaskStructure
from jaxsoft.normalizers._common import compute_dtype
from jaxsoft.normalizers._spec import NormalizerSpec

__all__ = ["chunked_attention", "BLOCK_Q", "BLOCK_K", "THRESHOLD_CANDIDATES"]

# Default block sizes (query rows x key columns). 512 x 512 keeps a tile's float32 logits at
# 1 MiB (L2-sized on CPUs) while each matmul is large enough to run near the GEMM peak.
BLOCK_Q = 512
BLOCK_K = 512
# Candidate taus evaluated per pass of the class-T search: each pass shrinks the bracket by
# a factor THRESHOLD_CANDIDATES + 1 (2 bits per pass for 3), so a rule's ``iterations``
# bisection steps take ceil(iterations / 2) passes over the key blocks.
THRESHOLD_CANDIDATES = 3


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _pad_axis(a, axis: int, new: int, mode="constant", value=0):
  if a is None or a.shape[axis] == new or a.shape[axis] == 1:
    return a
  pad = [(0, 0)] * a.ndim
  pad[axis] = (0, new - a.shape[axis])
  if mode == "edge":
    return jnp.pad(a, pad, mode="edge")
  return jnp.pad(a, pad, constant_values=value)


def _slice(a, start, size: int, axis: int):
  """A block of ``a`` along ``axis``, or ``a`` itself where it broadcasts (size 1)."""
  if a is None or a.shape[axis] == 1:
    return a
  return lax.dynamic_slice_in_dim(a, start, size, axis)


def _heads5(a, N: int, K: int, G: int):
  """A 4-D [b, n, t, s] array broadcastable to [B, N, T, S] -> 5-D [b, k, g, t, s]."""
  b, n, t, s = a.shape
  if n == 1:
    return a.reshape(b, 1, 1, t, s)
  return a.reshape(b, K, G, t, s)


def _reduce_to(x, shape):
  """Sums ``x`` over the axes where ``shape`` broadcasts (size 1)."""
  axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, shape, strict=True))
               if want == 1 and have != 1)
  if axes:
    x = jnp.sum(x, axis=axes, keepdims=True)
  return x


def _set_block(buf, upd, start, axis: int):
  """``buf[..., start:start + size, ...] += upd`` along ``axis`` (or plain += if size 1)."""
  if buf.shape[axis] == 1:
    return buf + upd
  cur = lax.dynamic_slice_in_dim(buf, start, upd.shape[axis], axis)
  return lax.dynamic_update_slice_in_dim(buf, cur + upd, start, axis)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one chunked call."""

  kind: str  # "E", "S", "P" or "T"
  dtype: Any  # the compute dtype (float32; float64 for float64 inputs)
  rule: Any  # TileRule or ThresholdRule
  static_hp: tuple  # ((name, python value), ...)
  cap: float | None
  bq: int
  bk: int
  nq: int
  nk: int
  T: int
  S: int
  has_bias: bool
  has_mask: bool
  has_decay: bool
  has_prune: bool
  may_skip_mask: bool  # tiles fully inside the structure need no masking


# ------------------------------------------------------------------------------- tiles


class _Tiles:
  """Per-block slicing and per-tile logits (shared by every pass)."""

  def __init__(self, cfg: _Config, d: dict, aux: dict):
    self.cfg, self.d, self.aux = cfg, d, aux

  def q_block(self, qi):
    cfg, d, aux = self.cfg, self.d, self.aux
    start = qi * cfg.bq
    st: MaskStructure = aux["structure"]
    qb = {
        "start": start,
        "q": lax.dynamic_slice_in_dim(d["q"], start, cfg.bq, 3),
        "n": _slice(aux["counts"], start, cfg.bq, 3),
        "hp": {name: _slice(a, start, cfg.bq, 3) for name, a in d["hp"].items()},
        "q_pos": start + jnp.arange(cfg.bq, dtype=jnp.int32),
    }
    if cfg.has_decay:
      qb["cq"] = lax.dynamic_slice_in_dim(d["cq"], start, cfg.bq, 3)
    if cfg.has_bias:
      qb["bias"] = _slice(d["bias"], start, cfg.bq, 3)
    if cfg.has_mask:
      qb["mask"] = _slice(aux["mask"], start, cfg.bq, 3)
    if st.has_segments:
      qb["q_seg"] = lax.dynamic_slice_in_dim(aux["q_seg"], start, cfg.bq, 1)
    return qb

  def static_hp(self):
    """Hyperparameters that get no gradient: Python values and integer arrays."""
    return {**dict(self.cfg.static_hp), **self.aux["hp_int"]}

  def hp(self, qb):
    return {**self.static_hp(), **qb["hp"]}

  def logits(self, qb, kj, masked: bool):
    """(pre-cap logits, logits, visibility or None, k block, v block) of tile (qb, kj)."""
    cfg, d, aux = self.cfg, self.d, self.aux
    ks = kj * cfg.bk
    k_blk = lax.dynamic_slice_in_dim(d["k"], ks, cfg.bk, 2)
    v_blk = lax.dynamic_slice_in_dim(d["v"], ks, cfg.bk, 2)
    s = jnp.einsum("bkgqh,bksh->bkgqs", qb["q"], k_blk, preferred_element_type=cfg.dtype)
    if cfg.has_decay:
      ck = lax.dynamic_slice_in_dim(d["ck"], ks, cfg.bk, 3)
      s = s + (qb["cq"][..., :, None] - ck[..., None, :])
    x = s
    if cfg.cap is not None:
      x = cfg.cap * jnp.tanh(s / cfg.cap)
    if cfg.has_bias:
      x = x + _slice(qb["bias"], ks, cfg.bk, 4)
    vis = None
    if masked:
      st: MaskStructure = aux["structure"]
      k_pos = ks + jnp.arange(cfg.bk, dtype=jnp.int32)
      kv_seg = (lax.dynamic_slice_in_dim(aux["kv_seg"], ks, cfg.bk, 1)
                if st.has_segments else None)
      vis = st.tile_visible(qb["q_pos"], k_pos, qb.get("q_seg"), kv_seg)[:, :, None]
      if cfg.has_mask:
        vis = vis & _slice(qb["mask"], ks, cfg.bk, 4)
      if cfg.has_bias:
        vis = vis & (x > -jnp.inf)
    return s, x, vis, k_blk, v_blk

  def loop(self, qi, step, init):
    """Runs ``step(kj, carry, masked)`` over the key blocks query block ``qi`` can see."""
    cfg, aux = self.cfg, self.aux
    st: MaskStructure = aux["structure"]

    def body(kj, carry):
      def run(c):
        if not cfg.may_skip_mask:
          return step(kj, c, True)
        full = st.tile_is_full(qi * cfg.bq, cfg.bq, kj * cfg.bk, cfg.bk)
        return lax.cond(full, lambda c: step(kj, c, False), lambda c: step(kj, c, True), c)

      if cfg.has_prune:
        return lax.cond(aux["prune"][qi, kj], lambda c: c, run, carry)
      return run(carry)

    return lax.fori_loop(aux["kb_lo"][qi], aux["kb_hi"][qi], body, init)


def _where(vis, a, b):
  return a if vis is None else jnp.where(vis, a, b)


# ---------------------------------------------------------------------- class E / S / P


def _esp_maps(cfg: _Config, x, vis, m, n, hp):
  """(numerator, denominator) of a tile at fixed stabiliser m; 0 at masked entries."""
  rule = cfg.rule
  xs = _where(vis, x, 0.0)
  z = rule.score_map(xs, n, **hp)
  # masked entries get z = m (a finite value near the row's scale) so that no inf/NaN
  # arises there even in the unselected branch of the gradient
  z = _where(vis, z, m)
  num = _where(vis, rule.numerator(z, m, **hp), 0.0)
  if cfg.kind == "P":
    return num, None
  den_fn = rule.denominator if rule.denominator is not None else rule.numerator
  den = num if den_fn is rule.numerator else _where(vis, den_fn(z, m, **hp), 0.0)
  return num, den


def _offset(cfg: _Config, m, n, hp):
  if cfg.kind == "P" or cfg.rule.offset is None:
    return None
  return cfg.rule.offset(m, n, **hp)


def _uses_max(cfg: _Config) -> bool:
  return cfg.kind == "E" and cfg.rule.uses_max


def _fwd_esp(cfg: _Config, d: dict, aux: dict):
  tiles = _Tiles(cfg, d, aux)
  B, K, G = d["q"].shape[:3]
  Hv = d["v"].shape[-1]
  row = (B, K, G, cfg.bq, 1)

  def q_block(qi):
    qb = tiles.q_block(qi)
    hp = tiles.hp(qb)
    n = qb["n"]

    def step(kj, carry, masked):
      m, ell, acc = carry
      _, x, vis, _, v_blk = tiles.logits(qb, kj, masked)
      if _uses_max(cfg):
        z = cfg.rule.score_map(_where(vis, x, 0.0), n, **hp)
        m_new = jnp.maximum(m, jnp.max(_where(vis, z, -jnp.inf), axis=-1, keepdims=True))
        floor = getattr(cfg.rule, "m_floor", None)
        if floor is not None:
          # the rule's stabiliser floor (e^{-m} terms must not overflow); -inf stays -inf
          m_new = jnp.where(m_new == -jnp.inf, m_new, jnp.maximum(m_new, floor))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(jnp.where(m == -jnp.inf, -jnp.inf, m - m_use))
      else:
        m_new = m_use = m
        alpha = None
      num, den = _esp_maps(cfg, x, vis, m_use, n, hp)
      pv = jnp.einsum("bkgqs,bksh->bkgqh", num, v_blk, preferred_element_type=cfg.dtype)
      if alpha is not None:
        acc = acc * alpha + pv
        ell = ell * alpha + jnp.sum(den, axis=-1, keepdims=True)
      else:
        acc = acc + pv
        if den is not None:
          ell = ell + jnp.sum(den, axis=-1, keepdims=True)
      return m_new, ell, acc

    m0 = jnp.full(row, -jnp.inf if _uses_max(cfg) else 0.0, cfg.dtype)
    init = (m0, jnp.zeros(row, cfg.dtype), jnp.zeros(row[:-1] + (Hv,), cfg.dtype))
    m, ell, acc = tiles.loop(qi, step, init)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    if cfg.kind == "P":
      D = jnp.ones_like(ell)
    else:
      off = _offset(cfg, m, n, hp)
      D = ell if off is None else ell + off
    out = _safe_div(acc, D)
    return out, m, D

  out, m, D = lax.map(q_block, jnp.arange(cfg.nq, dtype=jnp.int32))
  return _unblock(out), _unblock(m), _unblock(D)


def _safe_div(num, den):
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def _unblock(a):
  """[nq, B, K, G, bq, X] -> [B, K, G, nq·bq, X]."""
  nq, B, K, G, bq, X = a.shape
  return jnp.moveaxis(a, 0, 3).reshape(B, K, G, nq * bq, X)


def _bwd_esp(cfg: _Config, d: dict, aux: dict, res: dict, dout):
  tiles = _Tiles(cfg, d, aux)
  out, m_all, D_all = res["out"], res["m"], res["D"]
  delta_all = jnp.sum(dout * out, axis=-1, keepdims=True)

  def q_block(carry, qi):
    dk, dv, dck, dbias, dhp = carry
    qb = tiles.q_block(qi)
    start = qb["start"]
    hp_static = tiles.static_hp()
    n = qb["n"]
    m = lax.dynamic_slice_in_dim(m_all, start, cfg.bq, 3)
    D = lax.dynamic_slice_in_dim(D_all, start, cfg.bq, 3)
    do = lax.dynamic_slice_in_dim(dout, start, cfg.bq, 3)
    delta = lax.dynamic_slice_in_dim(delta_all, start, cfg.bq, 3)
    inv_d = _safe_div(jnp.ones_like(D), D)
    hp_arr = qb["hp"]
    same_den = cfg.kind != "P" and cfg.rule.denominator in (None, cfg.rule.numerator)

    def step(kj, c, masked):
      dq, dcq, dk, dv, dck, dbias, dhp_b = c
      ks = kj * cfg.bk
      s, x, vis, k_blk, v_blk = tiles.logits(qb, kj, masked)

      def maps(x, hpa):
        return _esp_maps(cfg, x, vis, m, n, {**hp_static, **hpa})

      dp = jnp.einsum("bkgqh,bksh->bkgqs", do, v_blk)
      if cfg.kind == "P":
        num, vjp1 = jax.vjp(lambda x, hpa: maps(x, hpa)[0], x, hp_arr)
        dx, dhp_t = vjp1(dp)
        w = num
      elif same_den:
        # numerator == denominator: one cotangent (dP - Δ)/D
        num, vjp1 = jax.vjp(lambda x, hpa: maps(x, hpa)[0], x, hp_arr)
        dx, dhp_t = vjp1((dp - delta) * inv_d)
        w = num * inv_d
      else:
        (num, den), vjp2 = jax.vjp(maps, x, hp_arr)
        dx, dhp_t = vjp2((dp * inv_d, jnp.broadcast_to(-delta * inv_d, den.shape)))
        w = num * inv_d
      dv_t = jnp.einsum("bkgqs,bkgqh->bksh", w, do)
      dv = _set_block(dv, dv_t, ks, 2)
      if cfg.has_bias:
        dbias = _add_bias_grad(cfg, dbias, dx, start, ks)
      if cfg.cap is not None:
        t = jnp.tanh(s / cfg.cap)
        dx = dx * (1.0 - t * t)
      if cfg.has_decay:
        dcq = dcq + jnp.sum(dx, axis=-1)
        dck = _set_block(dck, -jnp.sum(dx, axis=-2), ks, 3)
      dq = dq + jnp.einsum("bkgqs,bksh->bkgqh", dx, k_blk)
      dk = _set_block(dk, jnp.einsum("bkgqs,bkgqh->bksh", dx, qb["q"]), ks, 2)
      dhp_b = jax.tree.map(jnp.add, dhp_b, dhp_t)
      return dq, dcq, dk, dv, dck, dbias, dhp_b

    dq0 = jnp.zeros_like(qb["q"])
    dcq0 = jnp.zeros_like(qb["cq"]) if cfg.has_decay else jnp.zeros(())
    dhp0 = jax.tree.map(jnp.zeros_like, hp_arr)
    dq, dcq, dk, dv, dck, dbias, dhp_b = tiles.loop(
        qi, step, (dq0, dcq0, dk, dv, dck, dbias, dhp0))
    # the offset's hyperparameters (e.g. a learned sink logit): dL/dD = -Δ/D
    if cfg.kind != "P" and cfg.rule.offset is not None and hp_arr:
      _, vjp_off = jax.vjp(lambda hpa: cfg.rule.offset(m, n, **{**hp_static, **hpa}), hp_arr)
      (dhp_off,) = vjp_off(jnp.broadcast_to(-delta * inv_d, m.shape))
      dhp_b = jax.tree.map(jnp.add, dhp_b, dhp_off)
    dhp = _add_hp_grad(dhp, dhp_b, start)
    return (dk, dv, dck, dbias, dhp), (dq, dcq)

  return _bwd_driver(cfg, d, q_block)


def _add_bias_grad(cfg, dbias, dx, qs, ks):
  """Accumulates a tile's logit gradient into the bias gradient (broadcast dims summed)."""
  b, k, g, t, s = dbias.shape
  upd = _reduce_to(dx, (b, k, g, 1 if t == 1 else dx.shape[3], 1 if s == 1 else dx.shape[4]))
  if t != 1 and s != 1:
    zero = jnp.zeros((), jnp.int32)
    idx = (zero, zero, zero, jnp.asarray(qs, jnp.int32), jnp.asarray(ks, jnp.int32))
    cur = lax.dynamic_slice(dbias, idx, upd.shape)
    return lax.dynamic_update_slice(dbias, cur + upd, idx)
  if t != 1:
    return _set_block(dbias, upd, qs, 3)
  if s != 1:
    return _set_block(dbias, upd, ks, 4)
  return dbias + upd


def _add_hp_grad(dhp, dhp_b, start):
  """Adds a query block's hyperparameter gradients (reduced to each parameter's shape)."""
  new = {}
  for name, g in dhp_b.items():
    full = dhp[name]
    new[name] = _set_block(full, g, start, 3)
  return new


def _bwd_driver(cfg: _Config, d: dict, q_block):
  dk0 = jnp.zeros_like(d["k"])
  dv0 = jnp.zeros_like(d["v"])
  dck0 = jnp.zeros_like(d["ck"]) if cfg.has_decay else jnp.zeros(())
  dbias0 = jnp.zeros_like(d["bias"]) if cfg.has_bias else jnp.zeros(())
  dhp0 = jax.tree.map(jnp.zeros_like, d["hp"])
  (dk, dv, dck, dbias, dhp), (dq, dcq) = lax.scan(
      q_block, (dk0, dv0, dck0, dbias0, dhp0), jnp.arange(cfg.nq, dtype=jnp.int32))
  grads = {"q": _unblock(dq), "k": dk, "v": dv, "hp": dhp,
           "bias": dbias if cfg.has_bias else None}
  if cfg.has_decay:
    nq, B, K, G, bq = dcq.shape
    grads["cq"] = jnp.moveaxis(dcq, 0, 3).reshape(B, K, G, nq * bq)
    grads["ck"] = dck
  else:
    grads["cq"] = grads["ck"] = None
  return grads


# ----------------------------------------------------------------------------- class T


def _t_maps(cfg: _Config, x, vis, tau, m, n, hp):
  """(weight, mass) of a tile at a fixed threshold tau; 0 at masked entries."""
  rule = cfg.rule
  z = rule.score_map(_where(vis, x, 0.0), n, **hp)
  z = _where(vis, z, m)
  weight = _where(vis, rule.weight(z, tau, m, **hp), 0.0)
  mass = _where(vis, rule.mass(z, tau, **hp), 0.0)
  return weight, mass


def _t_search(cfg: _Config, tiles: _Tiles, qi, qb, hp, n):
  """Row max m and threshold tau of query block qi (no gradient)."""
  rule = cfg.rule
  B, K, G = tiles.d["q"].shape[:3]
  row = (B, K, G, cfg.bq, 1)

  def max_step(kj, m, masked):
    _, x, vis, _, _ = tiles.logits(qb, kj, masked)
    z = rule.score_map(_where(vis, x, 0.0), n, **hp)
    return jnp.maximum(m, jnp.max(_where(vis, z, -jnp.inf), axis=-1, keepdims=True))

  m = tiles.loop(qi, max_step, jnp.full(row, -jnp.inf, cfg.dtype))
  m = jnp.where(m == -jnp.inf, 0.0, m)
  lo, hi = rule.bracket(m, n, **hp)
  lo = jnp.broadcast_to(jnp.asarray(lo, cfg.dtype), row)
  hi = jnp.broadcast_to(jnp.asarray(hi, cfg.dtype), row)
  target = jnp.broadcast_to(jnp.asarray(rule.target(n, **hp), cfg.dtype), row)
  C = THRESHOLD_CANDIDATES
  passes = max(1, math.ceil(rule.iterations / math.log2(C + 1)))
  fracs = jnp.arange(1, C + 1, dtype=cfg.dtype) / (C + 1)

  def search_pass(_, bracket):
    lo, hi = bracket
    taus = lo[..., None] + (hi - lo)[..., None] * fracs  # [..., 1, C]

    def mass_step(kj, acc, masked):
      _, x, vis, _, _ = tiles.logits(qb, kj, masked)
      z = rule.score_map(_where(vis, x, 0.0), n, **hp)
      z = _where(vis, z, m)
      hpc = {k: (v[..., None] if isinstance(v, jax.Array) and v.ndim else v)
             for k, v in hp.items()}
      mass = rule.mass(z[..., None], taus, **hpc)  # [..., bk, C]
      if vis is not None:
        mass = jnp.where(vis[..., None], mass, 0.0)
      return acc + jnp.sum(mass, axis=-2)[..., None, :]

    total = tiles.loop(qi, mass_step, jnp.zeros(row + (C,), cfg.dtype))
    ok = total >= target[..., None]  # mass non-increasing in tau: True up to the root
    # new lo: the largest candidate with enough mass; new hi: the smallest without
    new_lo = jnp.max(jnp.where(ok, taus, lo[..., None]), axis=-1)
    new_hi = jnp.min(jnp.where(ok, hi[..., None], taus), axis=-1)
    return new_lo, new_hi

  lo, hi = lax.fori_loop(0, passes, search_pass, (lo, hi))
  # tau = lo keeps sum(mass) >= target > 0, so every visible row has a non-empty support;
  # the final normalisation removes the residual error of the finite search.
  # The weights are evaluated at m' = the next float above m: a rule may clamp as
  # exp(min(z - m, 0)) against overflow, and at the row's argmax (z == m) that clamp's
  # derivative is a tie (1/2); strictly above every visible z it is inactive, and the
  # uniform factor e^{m - m'} cancels in the normalisation.
  m_w = jnp.nextafter(m, jnp.asarray(jnp.inf, m.dtype))
  return m_w, lax.stop_gradient(lo)


def _fwd_t(cfg: _Config, d: dict, aux: dict):
  tiles = _Tiles(cfg, d, aux)
  B, K, G = d["q"].shape[:3]
  Hv = d["v"].shape[-1]
  row = (B, K, G, cfg.bq, 1)

  def q_block(qi):
    qb = tiles.q_block(qi)
    hp = tiles.hp(qb)
    n = qb["n"]
    m, tau = _t_search(cfg, tiles, qi, qb, hp, n)

    def step(kj, carry, masked):
      ell, acc = carry
      _, x, vis, _, v_blk = tiles.logits(qb, kj, masked)
      w, _ = _t_maps(cfg, x, vis, tau, m, n, hp)
      acc = acc + jnp.einsum("bkgqs,bksh->bkgqh", w, v_blk)
      return ell + jnp.sum(w, axis=-1, keepdims=True), acc

    ell, acc = tiles.loop(qi, step, (jnp.zeros(row, cfg.dtype),
                                   jnp.zeros(row[:-1] + (Hv,), cfg.dtype)))
    return _safe_div(acc, ell), m, ell, tau

  out, m, W, tau = lax.map(q_block, jnp.arange(cfg.nq, dtype=jnp.int32))
  return _unblock(out), _unblock(m), _unblock(W), _unblock(tau)


def _bwd_t(cfg: _Config, d: dict, aux: dict, res: dict, dout):
  tiles = _Tiles(cfg, d, aux)
  rule = cfg.rule
  out, m_all, W_all, tau_all = res["out"], res["m"], res["D"], res["tau"]
  delta_all = jnp.sum(dout * out, axis=-1, keepdims=True)
  B, K, G = d["q"].shape[:3]
  row = (B, K, G, cfg.bq, 1)

  def q_block(carry, qi):
    dk, dv, dck, dbias, dhp = carry
    qb = tiles.q_block(qi)
    start = qb["start"]
    hp_static = tiles.static_hp()
    hp_arr = qb["hp"]
    hp = {**hp_static, **hp_arr}
    n = qb["n"]
    sl = lambda a: lax.dynamic_slice_in_dim(a, start, cfg.bq, 3)  # noqa: E731
    m, W, tau, do, delta = sl(m_all), sl(W_all), sl(tau_all), sl(dout), sl(delta_all)
    inv_w = _safe_div(jnp.ones_like(W), W)

    # pass 1: g_tau = sum_k d_tau weight_k (dP_k - Δ)/W and M_tau = sum_k d_tau mass_k
    def tau_step(kj, c, masked):
      g, mt = c
      _, x, vis, _, v_blk = tiles.logits(qb, kj, masked)
      (_, _), (dw, dm) = jax.jvp(lambda t: _t_maps(cfg, x, vis, t, m, n, hp), (tau,),
                                 (jnp.ones_like(tau),))
      dp = jnp.einsum("bkgqh,bksh->bkgqs", do, v_blk)
      g = g + jnp.sum(dw * (dp - delta), axis=-1, keepdims=True) * inv_w
      return g, mt + jnp.sum(dm, axis=-1, keepdims=True)

    zero = jnp.zeros(row, cfg.dtype)
    g_tau, m_tau = tiles.loop(qi, tau_step, (zero, zero))
    coef = _safe_div(g_tau, m_tau)  # dL/dtau / (dF/dtau): the implicit-function factor

    # pass 2: the gradients of logits (and hyperparameters), tau held by the implicit term
    def step(kj, c, masked):
      dq, dcq, dk, dv, dck, dbias, dhp_b = c
      ks = kj * cfg.bk
      s, x, vis, k_blk, v_blk = tiles.logits(qb, kj, masked)
      (w, mass), vjp = jax.vjp(
          lambda x, hpa: _t_maps(cfg, x, vis, tau, m, n, {**hp_static, **hpa}), x, hp_arr)
      dp = jnp.einsum("bkgqh,bksh->bkgqs", do, v_blk)
      cot_mass = -coef * jnp.ones_like(mass)
      if vis is not None:
        cot_mass = jnp.where(vis, cot_mass, 0.0)
      dx, dhp_t = vjp(((dp - delta) * inv_w, cot_mass))
      dv = _set_block(dv, jnp.einsum("bkgqs,bkgqh->bksh", w * inv_w, do), ks, 2)
      if cfg.has_bias:
        dbias = _add_bias_grad(cfg, dbias, dx, start, ks)
      if cfg.cap is not None:
        t = jnp.tanh(s / cfg.cap)
        dx = dx * (1.0 - t * t)
      if cfg.has_decay:
        dcq = dcq + jnp.sum(dx, axis=-1)
        dck = _set_block(dck, -jnp.sum(dx, axis=-2), ks, 3)
      dq = dq + jnp.einsum("bkgqs,bksh->bkgqh", dx, k_blk)
      dk = _set_block(dk, jnp.einsum("bkgqs,bkgqh->bksh", dx, qb["q"]), ks, 2)
      dhp_b = jax.tree.map(jnp.add, dhp_b, dhp_t)
      return dq, dcq, dk, dv, dck, dbias, dhp_b

    dq0 = jnp.zeros_like(qb["q"])
    dcq0 = jnp.zeros_like(qb["cq"]) if cfg.has_decay else jnp.zeros(())
    dhp0 = jax.tree.map(jnp.zeros_like, hp_arr)
    dq, dcq, dk, dv, dck, dbias, dhp_b = tiles.loop(
        qi, step, (dq0, dcq0, dk, dv, dck, dbias, dhp0))
    if hp_arr:
      # F = sum mass - target(n): the target's hyperparameters enter with +coef
      _, vjp_t = jax.vjp(
          lambda hpa: jnp.broadcast_to(
              jnp.asarray(rule.target(n, **{**hp_static, **hpa}), cfg.dtype), row), hp_arr)
      (dhp_tgt,) = vjp_t(coef)
      dhp_b = jax.tree.map(jnp.add, dhp_b, dhp_tgt)
    dhp = _add_hp_grad(dhp, dhp_b, start)
    return (dk, dv, dck, dbias, dhp), (dq, dcq)

  return _bwd_driver(cfg, d, q_block)


# ------------------------------------------------------------------------------ driver


def _make_attend(cfg: _Config):
  fwd_fn = _fwd_t if cfg.kind == "T" else _fwd_esp
  bwd_fn = _bwd_t if cfg.kind == "T" else _bwd_esp

  def forward(d, aux):
    outs = fwd_fn(cfg, d, aux)
    res = {"out": outs[0], "m": outs[1], "D": outs[2]}
    if cfg.kind == "T":
      res["tau"] = outs[3]
    return res

  @jax.custom_vjp
  def attend(d, aux):
    return forward(d, aux)["out"]

  def attend_fwd(d, aux):
    res = forward(d, aux)
    return res["out"], (d, aux, res)

  def attend_bwd(saved, dout):
    d, aux, res = saved
    grads = bwd_fn(cfg, d, aux, res, dout)
    dd = {name: grads[name] if d.get(name) is not None else None for name in d}
    dd["hp"] = grads["hp"]
    return dd, None

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def _params_5d(value, N: int, K: int, G: int, T: int, Tp: int, dtype):
  """A row-broadcast hyperparameter array -> 5-D [b, k, g, t, 1] padded along T."""
  a = jnp.asarray(value, dtype)
  a = a.reshape((1,) * (4 - a.ndim) + a.shape)
  a = _heads5(a, N, K, G)
  if a.shape[3] == T and T != 1:
    a = _pad_axis(a, 3, Tp, mode="edge")
  return a


def _block_prune_table(cq5, ck5, bq: int, bk: int, threshold: float):
  """True where a (query block, key block) pair may be skipped by the decay bound."""
  B, K, G, Tp = cq5.shape
  Sp = ck5.shape[-1]
  cq_max = jnp.max(cq5.reshape(B, K, G, Tp // bq, bq), axis=-1)
  ck_min = jnp.min(ck5.reshape(B, K, G, Sp // bk, bk), axis=-1)
  bound = cq_max[..., :, None] - ck_min[..., None, :]
  return jnp.max(bound, axis=(0, 1, 2)) < threshold


def _dense_counts(cfg: _Config, d: dict, aux: dict):
  """Visible keys per row including the dense mask and -inf bias (a pass over key blocks).

  Only used for length-dependent normalizers with a dense ``mask`` or a ``bias``: these
  can hide keys the structure cannot describe. No matmul: only the mask/bias tiles.
  """
  st: MaskStructure = aux["structure"]
  B, K, G = d["q"].shape[:3]

  def q_block(qi):
    start = qi * cfg.bq
    q_pos = start + jnp.arange(cfg.bq, dtype=jnp.int32)
    q_seg = (lax.dynamic_slice_in_dim(aux["q_seg"], start, cfg.bq, 1)
             if st.has_segments else None)
    mask_rows = _slice(aux.get("mask"), start, cfg.bq, 3)
    bias_rows = _slice(d.get("bias"), start, cfg.bq, 3)

    def body(kj, cnt):
      ks = kj * cfg.bk
      k_pos = ks + jnp.arange(cfg.bk, dtype=jnp.int32)
      kv_seg = (lax.dynamic_slice_in_dim(aux["kv_seg"], ks, cfg.bk, 1)
                if st.has_segments else None)
      vis = st.tile_visible(q_pos, k_pos, q_seg, kv_seg)[:, :, None]
      if mask_rows is not None:
        vis = vis & _slice(mask_rows, ks, cfg.bk, 4)
      if bias_rows is not None:
        vis = vis & (_slice(bias_rows, ks, cfg.bk, 4) > -jnp.inf)
      vis = jnp.broadcast_to(vis, (B, K, G, cfg.bq, cfg.bk))
      return cnt + jnp.sum(vis, axis=-1, keepdims=True).astype(cfg.dtype)

    return lax.fori_loop(aux["kb_lo"][qi], aux["kb_hi"][qi], body,
                         jnp.zeros((B, K, G, cfg.bq, 1), cfg.dtype))

  return _unblock(lax.map(q_block, jnp.arange(cfg.nq, dtype=jnp.int32)))


def chunked_attention(call, block_q: int | None = None, block_k: int | None = None):
  """Blockwise attention for a validated AttentionCall (see the module docstring).

  Raises NotImplementedError for what the chunked path cannot compute: plain callables,
  stochastic normalizers and kernel classes R and X (the dispatcher then falls back to
  "xla").
  """
  spec = call.spec
  if not isinstance(spec, NormalizerSpec):
    raise NotImplementedError(
        "xla_chunked needs a registered normalizer with a tile or threshold rule, got a plain "
        "callable")
  if spec.needs_key:
    raise NotImplementedError(f"xla_chunked does not support stochastic normalizers ({spec.name})")
  kind = spec.kernel_class
  if kind in ("E", "S", "P"):
    rule = spec.tile
  elif kind == "T":
    rule = spec.threshold
  else:
    rule = None
  if rule is None:
    raise NotImplementedError(
        f"xla_chunked has no blockwise rule for normalizer {spec.name!r} (kernel class "
        f"{kind}); use implementation='xla'")

  q, k, v = call.q, call.k, call.v
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  Hv = v.shape[-1]
  block_q = block_q or BLOCK_Q
  block_k = block_k or BLOCK_K
  bq = T if T <= block_q else block_q
  bk = S if S <= block_k else block_k
  Tp, Sp = _round_up(T, bq), _round_up(S, bk)
  nq, nk = Tp // bq, Sp // bk

  cdt = compute_dtype(q.dtype)  # float32, or float64 for float64 inputs
  # differentiable inputs in the compute dtype, GQA view of q with the scale folded in
  qs = (q.astype(cdt) * call.scale).reshape(B, T, K, G, H)
  qs = _pad_axis(jnp.transpose(qs, (0, 2, 3, 1, 4)), 3, Tp)
  k4 = _pad_axis(jnp.transpose(k.astype(cdt), (0, 2, 1, 3)), 2, Sp)
  v4 = _pad_axis(jnp.transpose(v.astype(cdt), (0, 2, 1, 3)), 2, Sp)
  d = {"q": qs, "k": k4, "v": v4}
  has_bias = call.bias is not None
  if has_bias:
    b5 = _heads5(call.bias.astype(cdt), N, K, G)
    if T != 1:
      b5 = _pad_axis(b5, 3, Tp)
    if S != 1:
      b5 = _pad_axis(b5, 4, Sp)
    d["bias"] = b5
  has_decay = call.decay_bias is not None
  if has_decay:
    cq, ck = call.decay_bias
    d["cq"] = _pad_axis(jnp.transpose(cq, (0, 2, 1)).reshape(B, K, G, T), 3, Tp, mode="edge")
    d["ck"] = _pad_axis(jnp.transpose(ck, (0, 2, 1)).reshape(B, K, G, S), 3, Sp, mode="edge")
  params = {**spec.defaults, **call.params}
  static_hp, hp, hp_int = [], {}, {}
  for name, value in params.items():
    if isinstance(value, (jax.Array, np.ndarray)) and jnp.issubdtype(value.dtype, jnp.floating):
      hp[name] = _params_5d(value, N, K, G, T, Tp, cdt)
    elif isinstance(value, (jax.Array, np.ndarray)):
      hp_int[name] = jnp.asarray(value)  # integer arrays: not differentiable
    else:
      static_hp.append((name, value))
  d["hp"] = hp

  # non-differentiable inputs
  st = call.structure
  aux = {"structure": st, "hp_int": hp_int}
  has_mask = call.mask is not None
  if has_mask:
    m5 = _heads5(call.mask, N, K, G)
    if T != 1:
      m5 = _pad_axis(m5, 3, Tp, value=False)
    if S != 1:
      m5 = _pad_axis(m5, 4, Sp, value=False)
    aux["mask"] = m5
  if st.has_segments:
    aux["q_seg"] = _pad_axis(st.q_segment_ids, 1, Tp, mode="edge")
    aux["kv_seg"] = _pad_axis(st.kv_segment_ids, 1, Sp, mode="edge")
  kb_lo, kb_hi = st.block_key_ranges(bq, nq, bk)
  aux["kb_lo"], aux["kb_hi"] = kb_lo, kb_hi
  has_prune = call.decay_prune_threshold is not None
  if has_prune:
    aux["prune"] = _block_prune_table(d["cq"], d["ck"], bq, bk, call.decay_prune_threshold)

  cfg = _Config(
      kind=kind, dtype=cdt, rule=rule, static_hp=tuple(static_hp), cap=call.logits_soft_cap, bq=bq,
      bk=bk, nq=nq, nk=nk, T=T, S=S, has_bias=has_bias, has_mask=has_mask,
      has_decay=has_decay, has_prune=has_prune,
      may_skip_mask=not (has_bias or has_mask or st.has_segments))

  counts = st.visible_counts()  # [B|1, T]
  counts = _pad_axis(counts, 1, Tp, value=0.0)
  counts = counts.reshape(counts.shape[0], 1, 1, Tp, 1)
  if spec.length_dependent and (has_bias or has_mask):
    dd = {**d, "bias": lax.stop_gradient(d["bias"])} if has_bias else d
    counts = _dense_counts(cfg, dd, aux)
  # n >= 1 inside the tile maps: a row with n = 0 has no visible entry, and log(0)-style
  # length terms must not create NaN in masked branches
  aux["counts"] = jnp.maximum(counts, 1.0)

  out = _make_attend(cfg)(d, aux)  # [B, K, G, Tp, Hv]
  out = jnp.transpose(out[:, :, :, :T], (0, 3, 1, 2, 4)).reshape(B, T, N, Hv)
  return out.astype(q.dtype)
