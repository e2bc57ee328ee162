"""The backward of class T (sparsemax, entmax-1.5, top-k) on the Mosaic-GPU (Hopper) engine.

UNVERIFIED ON HARDWARE, like ``kernels_pallas.mosaic_gpu``: lowered for CUDA by
``jax.export`` (sm_90a, 227 KiB of shared memory assumed) and run in Pallas's GPU
interpreter on a CPU only. ``kernels_pallas.mosaic_gpu_threshold``'s custom VJP calls
:func:`threshold_backward`.

The math is the Triton / Mosaic-TPU engine's (``kernels_pallas.engine``'s class-T section):
per query row ``i`` with the visible keys ``V_i``, the scaled logits ``x_ij = scale q_i·k_j``,
``z_ij = score_map(x_ij, |V_i|)``, the forward's threshold ``tau_i``, stabiliser ``m'_i``
and weight sum ``W_i = sum_j weight(z_ij, tau_i, m'_i)``, ``dP_ij = dO_i·v_j`` and
``Δ_i = dO_i·O_i`` (float32, from the rounded output), the implicit function theorem on
``F(tau) = sum_j mass(z_j, tau) - target`` gives::

    coef_i = [sum_j d_tau weight_ij (dP_ij - Δ_i)] / (W_i sum_j d_tau mass_ij)
    dz_ij  = weight'_ij (dP_ij - Δ_i) / W_i  -  coef_i mass'_ij
    dx_ij  = score_map'(x_ij) dz_ij
    dV_j = sum_i (weight_ij / W_i) dO_i,  dK_j = scale sum_i dx_ij q_i,
    dQ_i = scale sum_j dx_ij k_j

(``'`` the derivative in z, ``d_tau`` in tau; forward-mode products of the rule's own
maps, custom derivatives inlined, as ``mosaic_gpu._bwd_tile_fn``). A rule whose weight
jumps at tau (top-k: ``1[z >= tau] e^{z - m'}``) has ``d_tau weight = d_tau mass = 0``
almost everywhere (the engine's forward-mode products give exactly 0, and its ``coef``
is 0 over a zero denominator): its ``coef`` is 0 and the coefficient sweep is not run.

Every sum runs over the live key blocks of the forward's search only (a block whose
visible scores are all below tau has zero weights and zero gradient), at the backward's
64 x 64 tiles: the search's per-warpgroup flags (64 query rows x ``block_k`` keys) are
split into 64-key blocks, OR-ed over the rows of a dQ CTA into its key-block list, and
transposed and OR-ed over the keys of a dK/dV CTA into its query-block list
(``engine.live_block_tables``). Both kernels use ``mosaic_gpu``'s set-up (a TMA producer
warpgroup, ``W`` wgmma consumer warpgroups, ``W = 2`` for H <= 128 else 1, a 2-slot ring):

* **dQ** (:func:`_dq`): a CTA owns ``64 W`` query rows; the producer streams the listed
  key and value blocks twice (once for rules with a jump): sweep 1 sums per row
  ``sum d_tau weight (dP - Δ)`` and ``sum d_tau mass`` and forms ``coef`` (written out for
  dK/dV), sweep 2 accumulates ``dQ += dX K``.
* **dK/dV** (:func:`_dkv`): a CTA owns ``64 W`` keys of one (batch, query head); the
  producer streams the listed query blocks with their ``dO`` and row statistics
  (``tau, m', 1 / W, Δ`` and ``coef``), the consumers compute in the transposed
  orientation ``S^T = K Q^T``, ``dP^T = V dO^T``, ``dV += P^T dO``, ``dK += dX^T Q``.
  GQA: per query head, summed over each key head's query heads in float32 here.

Every tile applies the element mask (padded keys and query rows, ``key_value_seq_lengths``
read as the batch entry's scalar, ``local_window_size``, causal: :func:`_mask_and_length`),
as the forward does; the lists come from the forward's flags, which are 0 outside each
CTA's visible key interval, so a key block no row sees is loaded by neither kernel, and
its keys' dK, dV are 0 (as for a row that sees no key, whose ``1 / W`` is 0); the two warpgroups of a CTA share one list (the union of their rows' or keys'
blocks: a block live for one only adds zero terms for the other).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers import tile
from kernels_pallas import engine
from kernels_pallas import mosaic_gpu as mga

__all__ = ["threshold_backward", "backward_tables"]


def _indicator(cfg) -> bool:
  """Whether the rule's weight jumps at tau (top-k): then ``coef = 0``."""
  hp = {**{k: v for k, v in cfg.spec.defaults.items() if v is not None}, **cfg.hp_dict}
  return tile.jumps_at_threshold(cfg.spec.threshold, hp)


def _tile_fns(cfg, indicator: bool):
  """``(coef_tile, grad_tile)`` on one recomputed tile (rows and columns either way; the
  row statistics broadcast to the tile by the caller; ``x`` the scaled logits, ``mask``
  the visible entries, ``length`` the visible counts).

  ``coef_tile(x, mask, length, tau, m, dp, delta) -> (g, mt)`` the tile's
  ``d_tau weight (dP - Δ)`` and ``d_tau mass``, 0 where masked (the caller sums them);
  ``grad_tile(x, mask, length, tau, m, inv, delta, coef, dp) -> (p, dx)`` the normalised
  weights ``weight / W`` and the cotangent of ``x``, 0 where masked."""
  rule = cfg.rule
  hp = cfg.hp_dict
  score_map = mga._primal(rule.score_map)
  weight_dtau = mga._primal(lambda z, t, m: jax.jvp(lambda t_: rule.weight(z, t_, m, **hp), (t,),
                                                (jnp.ones_like(t),))[1])
  mass_dtau = mga._primal(lambda z, t: jax.jvp(lambda t_: rule.mass(z, t_, **hp), (t,),
                                           (jnp.ones_like(t),))[1])
  weight_dz = mga._primal(lambda z, t, m, g: jax.jvp(lambda z_: rule.weight(z_, t, m, **hp), (z,),
                                                 (g,)))
  mass_dz = mga._primal(lambda z, t, g: jax.jvp(lambda z_: rule.mass(z_, t, **hp), (z,), (g,))[1])
  score_dx = mga._primal(lambda x, n, g: jax.jvp(lambda x_: rule.score_map(x_, n, **hp), (x,),
                                             (g,))[1])
  identity = rule.score_map is _spec.identity_score_map

  def scores(x, mask, length, m):
    x = jnp.where(mask, x, 0.0)
    return x, jnp.where(mask, score_map(x, length, **hp), m)

  def coef_tile(x, mask, length, tau, m, dp, delta):
    _, z = scores(x, mask, length, m)
    g = jnp.where(mask, weight_dtau(z, tau, m) * (dp - delta), 0.0)
    return g, jnp.where(mask, mass_dtau(z, tau), 0.0)

  def grad_tile(x, mask, length, tau, m, inv, delta, coef, dp):
    x, z = scores(x, mask, length, m)
    w, dz = weight_dz(z, tau, m, (dp - delta) * inv)
    if not indicator:
      dz = dz + mass_dz(z, tau, -coef)
    dx = dz if identity else score_dx(x, length, dz)
    return jnp.where(mask, w * inv, 0.0), jnp.where(mask, dx, 0.0)

  return coef_tile, grad_tile


def _safe_inverse(d):
  """``1 / d`` where ``d != 0``, else 0."""
  nz = d != 0.0
  return jnp.where(nz, 1.0 / jnp.where(nz, d, 1.0), 0.0)


def backward_tables(flags, block_k: int, wgs: int, nk64: int):
  """The backward's block lists from the search's live flags ``[B, N, nq, 2, nkp]`` (per
  128-row CTA and consumer warpgroup of 64 rows, per key block of ``block_k``): the tile
  table at 64 x 64 (``[B, N, Tp / 64, nk64]``, each forward key block split into
  ``block_k / 64``, zero past it), then ``(idx, cnt)`` of each dQ CTA of ``64 wgs`` rows
  (its key blocks, OR over its rows) and ``(idx_t, cnt_t)`` of each dK/dV CTA of
  ``64 wgs`` keys (its query blocks, OR over its keys), by ``engine.live_block_tables``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from kernels_pallas.mosaic_gpu_threshold_backward import backward_tables
    >>> # rows 0..63 live on keys 128..255, rows 64..127 on keys 0..127 (block_k = 128)
    >>> flags = jnp.array([[0, 1], [1, 0]], jnp.int32).reshape(1, 1, 1, 2, 2)
    >>> idx, cnt, idx_t, cnt_t = backward_tables(flags, 128, 2, 4)
    >>> idx[0, 0, 0].tolist(), int(cnt[0, 0, 0])  # rows 0..127: every 64-key block
    ([0, 1, 2, 3], 4)
    >>> idx_t[0, 0].tolist(), cnt_t[0, 0].tolist()  # keys 0..127: query block 1, 128..255: 0
    ([[1, 1], [0, 0]], [1, 1])
  """
  b, n, nq, two, _ = flags.shape
  n_kv = nk64 * mga.BWD_BLOCK // block_k
  f = flags[..., :n_kv].reshape(b, n, nq * two, n_kv)
  f = jnp.repeat(f, block_k // mga.BWD_BLOCK, axis=-1)  # [B, N, Tp / 64, nk64]
  nq64 = nq * two
  rows = jnp.max(f.reshape(b, n, nq64 // wgs, wgs, nk64), axis=3)
  idx, cnt = engine.live_block_tables(rows)
  cols = jnp.max(jnp.swapaxes(f, 2, 3).reshape(b, n, nk64 // wgs, wgs, nq64), axis=3)
  idx_t, cnt_t = engine.live_block_tables(cols)
  return idx, cnt, idx_t, cnt_t


def _end(cfg, len_ref, bi):
  """The batch entry's key length: S, or its ``key_value_seq_lengths`` clipped to [0, S]
  (a scalar read in the kernel)."""
  return cfg.s if len_ref is None else jnp.clip(len_ref[bi], 0, cfg.s)


def _mask_and_length(cfg, q_pos, k_pos, end):
  """Whether query ``q_pos`` sees key ``k_pos`` (int32 tiles: ``k_pos < end``, the window
  ``q_pos - left <= k_pos <= q_pos + right``, causal ``right = 0``, padded query rows
  hidden; ``mosaic_gpu._visible``) and the rows' visible counts |V| (a float32 tile, 0 for
  a row that sees no key; ``mosaic_gpu._visible_count``). Shared by the forward's kernels."""
  mask = jnp.logical_and(q_pos < cfg.t, mga._visible(cfg, q_pos, k_pos, end))
  length = mga._visible_count(cfg, q_pos, end)
  if isinstance(length, float):  # no mask: every row sees S keys
    length = jnp.full(q_pos.shape, length, jnp.float32)
  return mask, length


def _split_lengths(cfg, refs):
  """``(len_ref or None, the other refs)``: the key lengths follow the tensor inputs when
  ``cfg.kv_lengths``."""
  if cfg.kv_lengths:
    return refs[0], refs[1:]
  return None, refs


def _dq(cfg, q, k, v, do, rows, idx, cnt, indicator: bool, interpret, kv_lengths=None):
  """dQ (and ``coef``) on padded inputs: ``rows = (tau, m', 1 / W, Δ)`` each ``[B, N, Tp]``
  float32, ``idx``/``cnt`` the key-block lists of the ``64 W``-row CTAs. Returns
  ``(dq [B, Tp, N, H], coef [B, N, Tp] float32)`` (``coef`` zeros for a rule with a jump)."""
  plgpu = mga._plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  b, tp, n, h = q.shape
  groups = n // k.shape[2]
  wgs = mga._bwd_wgs(h)
  bq = bk = mga.BWD_BLOCK
  stages = mga.BWD_STAGES
  dtype = q.dtype
  sweeps = 1 if indicator else 2
  coef_tile, grad_tile = _tile_fns(cfg, indicator)
  layout = plgpu.Layout.WGMMA
  row_layout = layout.reduce(1)

  def kernel(q_ref, k_ref, v_ref, do_ref, len_ref, idx_ref, cnt_ref, row_refs, dq_ref,
             coef_ref, scoped):
    (q_smem2, do_smem2, k_smem, v_smem, row_smem2), (q_bar, do_bar, k_loaded, v_loaded), \
        row_bar, consumed = scoped[:4]  # (a trailing segment buffer: none here)
    bi, q_head, q_tile, wg = mga._cta()
    end = _end(cfg, len_ref, bi)
    count = cnt_ref[bi, q_head, q_tile]

    def block(step):  # the key block of a global step (each sweep runs the list)
      return idx_ref[bi, q_head, q_tile, lax.rem(step, jnp.maximum(count, 1))]

    def consumer():
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      q_base = q_tile * (wgs * bq) + wg * bq
      sl = (bi, pl.ds(q_base, bq), q_head)
      mga._fetch(plgpu, [(q_ref.at[sl], q_smem, q_bar.at[wg]), (do_ref.at[sl], do_smem, do_bar.at[wg])]
             + [(r_ref.at[bi, q_head, pl.ds(q_base, bq)], r_smem.at[wg], r_bar.at[wg])
                for r_ref, r_smem, r_bar in zip(row_refs, row_smem2, row_bar, strict=True)])
      tau, m_w, inv, delta = (mga._load_row(plgpu, r_smem.at[wg], row_layout)
                              for r_smem in row_smem2)

      def bc(row):
        return lax.broadcast_in_dim(row, (bq, bk), [0])

      def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), axis, layout=layout)

      def tiles(step):
        slot = lax.rem(step, jnp.array(stages, jnp.int32))
        plgpu.barrier_wait(k_loaded.at[slot])

        def compute_s(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, mga._transposed(plgpu, k_smem.at[slot]))
          return acc_ref[...]

        s = pl.run_scoped(compute_s, plgpu.ACC((bq, bk), jnp.float32))
        plgpu.barrier_wait(v_loaded.at[slot])

        def compute_dp(acc_ref):
          plgpu.wgmma(acc_ref, do_smem, mga._transposed(plgpu, v_smem.at[slot]))
          return acc_ref[...]

        dp = pl.run_scoped(compute_dp, plgpu.ACC((bq, bk), jnp.float32))
        mask, length = _mask_and_length(cfg, iota(0) + q_base, iota(1) + block(step) * bk, end)
        return slot, s * cfg.scale, dp, mask, length

      zero_row = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
      coef = zero_row
      if not indicator:
        def coef_step(step, sums):
          slot, x, dp, mask, length = tiles(step)
          g, mt = coef_tile(x, mask, length, bc(tau), bc(m_w), dp, bc(delta))
          plgpu.barrier_arrive(consumed.at[slot])
          return sums[0] + g.sum(axis=1), sums[1] + mt.sum(axis=1)

        g_tau, m_tau = lax.fori_loop(0, count, coef_step, (zero_row, zero_row))
        coef = g_tau * inv * _safe_inverse(m_tau)

      def grad_step(step, dq_acc):
        slot, x, dp, mask, length = tiles(step)
        _, dx = grad_tile(x, mask, length, bc(tau), bc(m_w), bc(inv), bc(delta), bc(coef), dp)

        def compute_dq(acc_ref):
          plgpu.wgmma(acc_ref, dx.astype(dtype), k_smem.at[slot])

        dq_acc = pl.run_state(compute_dq)(plgpu.ACC.init(dq_acc))
        plgpu.barrier_arrive(consumed.at[slot])
        return dq_acc

      dq_acc = plgpu.layout_cast(jnp.full((bq, h), 0.0, jnp.float32), layout)
      dq_acc = lax.fori_loop((sweeps - 1) * count, sweeps * count, grad_step, dq_acc)
      q_smem[...] = (dq_acc * cfg.scale).astype(dtype)
      coef_smem = row_smem2[0].at[wg]  # (tau's slot: tau is in registers)
      coef_smem[...] = coef
      mga._write_back(plgpu, [(q_smem, dq_ref.at[sl]),
                          (coef_smem, coef_ref.at[bi, q_head, pl.ds(q_base, bq)])])

    def producer():
      kv_head = mga._kv_head(q_head, groups)

      def load(step, slot):
        src = (bi, pl.ds(block(step) * bk, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_loaded.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_loaded.at[slot])

      mga._stream(0, sweeps * count, stages, load, lambda slot: plgpu.barrier_wait(consumed.at[slot]))

    mga._specialise(plgpu, wg, wgs, consumer, producer)

  def entry(q_ref, k_ref, v_ref, do_ref, *refs):
    len_ref, refs = _split_lengths(cfg, refs)
    idx_ref, cnt_ref, refs = refs[0], refs[1], refs[2:]
    row_refs, dq_ref, coef_ref = refs[:4], refs[4], refs[5]
    mga._run_backward_scoped(
        plgpu,
        lambda *args: kernel(q_ref, k_ref, v_ref, do_ref, len_ref, idx_ref, cnt_ref, row_refs,
                             dq_ref, coef_ref, args),
        dtype, h, wgs, stages, resident=bq, streamed=bk, n_rows=4, row_slots=wgs, row_len=bq)

  out_type = [jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, n, tp), jnp.float32)]
  lens = (kv_lengths,) if cfg.kv_lengths else ()
  return mga._launch(plgpu, entry, out_type, (n, tp // (wgs * bq), b), ("heads", "q_seq", "batch"),
                 wgs + 1, interpret)(q, k, v, do, *lens, idx, cnt, *rows)


def _dkv(cfg, q, k, v, do, rows, idx_t, cnt_t, indicator: bool, interpret, kv_lengths=None):
  """dK and dV per query head on padded inputs: ``rows = (tau, m', 1 / W, Δ[, coef])``
  each ``[B, N, Tp]`` float32 (no coef for a rule with a jump), ``idx_t``/``cnt_t`` the
  query-block lists of the ``64 W``-key CTAs. Returns ``(dK, dV)``, each
  ``[B, Sp, N, H]``."""
  plgpu = mga._plgpu()
  from jax import lax
  from jax.experimental import pallas as pl

  b, tp, n, h = q.shape
  sp = k.shape[1]
  groups = n // k.shape[2]
  wgs = mga._bwd_wgs(h)
  bq = bk = mga.BWD_BLOCK
  stages = mga.BWD_STAGES
  dtype = q.dtype
  n_rows = len(rows)
  _, grad_tile = _tile_fns(cfg, indicator)
  layout = plgpu.Layout.WGMMA
  col_layout = layout.reduce(0)

  def kernel(q_ref, k_ref, v_ref, do_ref, len_ref, idx_ref, cnt_ref, row_refs, dk_ref, dv_ref,
             scoped):
    (k_smem2, v_smem2, q_smem, do_smem, row_smem), (k_bar, v_bar, q_loaded, do_loaded), \
        row_loaded, consumed = scoped[:4]  # (a trailing segment buffer: none here)
    bi, q_head, kv_tile, wg = mga._cta("kv_seq")
    end = _end(cfg, len_ref, bi)
    count = cnt_ref[bi, q_head, kv_tile]

    def consumer():
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      kv_base = kv_tile * (wgs * bk) + wg * bk
      sl = (bi, pl.ds(kv_base, bk), mga._kv_head(q_head, groups))
      mga._fetch(plgpu, [(k_ref.at[sl], k_smem, k_bar.at[wg]), (v_ref.at[sl], v_smem, v_bar.at[wg])])

      def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, (bk, bq), axis, layout=layout)

      def step(i, carry):
        dk_acc, dv_acc = carry
        slot = lax.rem(i, jnp.array(stages, jnp.int32))
        plgpu.barrier_wait(q_loaded.at[slot])
        plgpu.barrier_wait(do_loaded.at[slot])
        for r_bar in row_loaded:
          plgpu.barrier_wait(r_bar.at[slot])

        def compute_st(acc_ref):
          plgpu.wgmma(acc_ref, k_smem, mga._transposed(plgpu, q_smem.at[slot]))
          return acc_ref[...]

        st = pl.run_scoped(compute_st, plgpu.ACC((bk, bq), jnp.float32))

        def compute_dpt(acc_ref):
          plgpu.wgmma(acc_ref, v_smem, mga._transposed(plgpu, do_smem.at[slot]))
          return acc_ref[...]

        dpt = pl.run_scoped(compute_dpt, plgpu.ACC((bk, bq), jnp.float32))
        q_block = idx_ref[bi, q_head, kv_tile, i]
        # keys as rows, queries as columns
        mask, length = _mask_and_length(cfg, iota(1) + q_block * bq, iota(0) + kv_base, end)
        bc = [lax.broadcast_in_dim(mga._load_row(plgpu, r.at[slot], col_layout), (bk, bq), [1])
              for r in row_smem]
        # a proxy fence: these plain reads of the slot are ordered before the producer's
        # next TMA write into it (as mosaic_gpu's dK/dV kernel)
        plgpu.commit_smem()
        tau, m_w, inv, delta = bc[:4]
        coef = bc[4] if len(bc) > 4 else jnp.zeros_like(tau)
        p, dx = grad_tile(st * cfg.scale, mask, length, tau, m_w, inv, delta, coef, dpt)

        def compute(refs):
          dv_ref_, dk_ref_ = refs
          plgpu.wgmma(dv_ref_, p.astype(dtype), do_smem.at[slot])
          plgpu.wgmma(dk_ref_, dx.astype(dtype), q_smem.at[slot])

        dv_acc, dk_acc = pl.run_state(compute)((plgpu.ACC.init(dv_acc), plgpu.ACC.init(dk_acc)))
        plgpu.barrier_arrive(consumed.at[slot])
        return dk_acc, dv_acc

      zeros = plgpu.layout_cast(jnp.full((bk, h), 0.0, jnp.float32), layout)
      dk_acc, dv_acc = lax.fori_loop(0, count, step, (zeros, zeros))
      k_smem[...] = (dk_acc * cfg.scale).astype(dtype)
      v_smem[...] = dv_acc.astype(dtype)
      out = (bi, pl.ds(kv_base, bk), q_head)
      mga._write_back(plgpu, [(k_smem, dk_ref.at[out]), (v_smem, dv_ref.at[out])])

    def producer():
      def load(i, slot):
        q_block = idx_ref[bi, q_head, kv_tile, i]
        src = (bi, pl.ds(q_block * bq, bq), q_head)
        plgpu.copy_gmem_to_smem(q_ref.at[src], q_smem.at[slot], q_loaded.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[src], do_smem.at[slot], do_loaded.at[slot])
        for r_ref, r_smem, r_bar in zip(row_refs, row_smem, row_loaded, strict=True):
          plgpu.copy_gmem_to_smem(r_ref.at[bi, q_head, pl.ds(q_block * bq, bq)],
                                  r_smem.at[slot], r_bar.at[slot])

      mga._stream(0, count, stages, load, lambda slot: plgpu.barrier_wait(consumed.at[slot]))

    mga._specialise(plgpu, wg, wgs, consumer, producer)

  def entry(q_ref, k_ref, v_ref, do_ref, *refs):
    len_ref, refs = _split_lengths(cfg, refs)
    idx_ref, cnt_ref, refs = refs[0], refs[1], refs[2:]
    row_refs, dk_ref, dv_ref = refs[:n_rows], refs[n_rows], refs[n_rows + 1]
    mga._run_backward_scoped(
        plgpu,
        lambda *args: kernel(q_ref, k_ref, v_ref, do_ref, len_ref, idx_ref, cnt_ref, row_refs,
                             dk_ref, dv_ref, args),
        dtype, h, wgs, stages, resident=bk, streamed=bq, n_rows=n_rows, row_slots=stages,
        row_len=bq)

  out = jax.ShapeDtypeStruct((b, sp, n, h), dtype)
  lens = (kv_lengths,) if cfg.kv_lengths else ()
  return mga._launch(plgpu, entry, [out, out], (n, sp // (wgs * bk), b),
                 ("heads", "kv_seq", "batch"), wgs + 1, interpret)(q, k, v, do, *lens, idx_t,
                                                                  cnt_t, *rows)


def threshold_backward(cfg, q, k, v, out, m, tau, w_sum, flags, g, interpret, kv_lengths=None):
  """``(dq, dk, dv)`` of the unpadded inputs from the forward's output, row max ``m``,
  threshold ``tau``, weight sum ``W`` (each ``[B, N, Tp]`` float32) and the search's live
  flags ``[B, N, Tp / 128, 2, nkp]`` (0 on every block outside a CTA's visible interval);
  ``g`` the output's cotangent; ``kv_lengths`` the int32 ``[B]`` key lengths when
  ``cfg.kv_lengths`` (module docstring)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  dtype = q.dtype
  wgs = mga._bwd_wgs(h)
  tp = m.shape[-1]  # the forward's padding (128 rows)
  sp = mga._round_up(s, math.lcm(cfg.block_k, wgs * mga.BWD_BLOCK))
  nk64 = sp // mga.BWD_BLOCK
  indicator = _indicator(cfg)
  g = g.astype(dtype)
  pad_t = ((0, 0), (0, tp - t), (0, 0), (0, 0))
  pad_s = ((0, 0), (0, sp - s), (0, 0), (0, 0))
  qp, dop = jnp.pad(q, pad_t), jnp.pad(g, pad_t)
  kp, vp = jnp.pad(k, pad_s), jnp.pad(v, pad_s)
  # Δ_i = dO_i · O_i (float32, from the rounded output), 0 on the padded rows
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), g.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, tp - t)))
  # 1 / W (0 where W is 0 or NaN: a padded row), the weights' stabiliser
  inv = jnp.where(w_sum > 0.0, 1.0 / jnp.where(w_sum > 0.0, w_sum, 1.0), 0.0)
  m_w = tile.weight_stabiliser(m)
  # the forward's key blocks past the padded length (nkp rounds them up) hold no key
  n_kv = -(-s // cfg.block_k)
  flags = jnp.pad(flags[..., :n_kv], ((0, 0),) * 4 + ((0, sp // cfg.block_k - n_kv),))
  idx, cnt, idx_t, cnt_t = backward_tables(flags, cfg.block_k, wgs, nk64)
  rows: tuple[Any, ...] = (tau, m_w, inv, delta)
  dq, coef = _dq(cfg, qp, kp, vp, dop, rows, idx, cnt, indicator, interpret, kv_lengths)
  rows_t = rows if indicator else rows + (coef,)
  dk, dv = _dkv(cfg, qp, kp, vp, dop, rows_t, idx_t, cnt_t, indicator, interpret, kv_lengths)
  groups = n // kh

  def head_sum(x):  # [B, Sp, N, H] -> [B, S, K, H]: each key head's query heads summed
    x = x[:, :s].reshape(b, s, kh, groups, h)
    return x.astype(jnp.float32).sum(axis=3).astype(dtype) if groups > 1 else x[:, :, :, 0]

  return dq[:, :t], head_sum(dk), head_sum(dv)
