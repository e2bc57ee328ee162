"""Ring attention: context-parallel attention for every normalizer with a tile rule.

Run INSIDE ``jax.shard_map`` over a mesh axis ``axis_name`` of size ``cp`` that shards the
sequence: each device holds a query block ``q`` [B, Tl, N, H] and a key/value block
``k``, ``v`` [B, Sl, K, H] (GQA: N = K·G), with the GLOBAL positions of its rows (the
caller may have reordered chunks for causal load balancing, e.g. the dual-chunk order in
which shard i holds chunks i and 2cp-1-i).

Classes E, S and P (Liu, Zaharia & Abbeel 2023): the key/value blocks travel around the
ring (``lax.ppermute`` to the next device, issued before the current block is computed on,
so the transfer overlaps the compute); each device carries per query row the state of the
normalizer's tile rule (``jaxsoft.normalizers.tile``: ``(m, l, acc)`` for class E, ``(l,
acc)`` for S, ``acc`` for P) and folds each block in with ``tile.online_update``. After cp
hops ``tile.finalize`` and ``tile.normalize`` give the output. A hop whose block no query of
the device can see (causal: the block entirely in the future) skips its compute
(``lax.cond`` on a scalar computed from positions) but still passes the block on. The
positions, segment ids and validity of the key blocks are all-gathered once (int32/bool,
[B, S]: a few bytes per key, against 2·K·H floats per key for K/V), so only K/V travel.

Backward (FlashAttention-2 style, Dao 2023): a ``jax.custom_vjp`` keeps ``(m, D)`` per row
and recomputes each hop's tile with ``tile.tile_vjp``; dQ stays on the device, and dK/dV
of a block accumulate in a buffer that travels around the ring one step behind its K/V
block, so after cp hops and one last transfer every device holds the full dK/dV of its
own block.

Class T (sparsemax, entmax, top-k, top-p): exact across the axis. The scores are
partitioned by KEY shard: Q (and its positions) is all-gathered once, every device
evaluates the threshold search's partial sums over its own keys for all T = cp·Tl query
rows (in cp chunks of Tl rows, so its temporaries stay O(Tl·Sl)), and a ``lax.psum``
reduces the few floats per row of each search step (the row max first, by ``lax.pmax``).
The search schedule is the chunked path's (``tile.search_*`` with Newton steps and early
exit), so the thresholds agree with ``implementation='xla_chunked'`` up to the order of
the partial sums. Each device then computes ``sum_j w_ij v_j`` over its keys and the
partial outputs are added across shards with ``lax.psum_scatter`` back to the queries'
owners (like class P). Communication of class T per forward call, against all-gathering
K/V (2·B·S·K·H values): an all-gather of Q (B·T·N·H values), one psum per search step
of 6 (Newton: three masses and three slopes) or 3 floats per row, one pmax (and for top-k
one more for the gap below tau) and one psum of W (1 float per row), and one psum_scatter
of the output (B·T·N·H values). The backward all-gathers Q, dO and Δ, psums two floats per
row and psum_scatters dQ; dK/dV stay local. Top-k (a Python int k) needs no search: each
shard takes the min(k, Sl) largest of its scores per row, one all-gather merges them
(cp·min(k, Sl) floats per row) and the min(k, n)-th largest of the merged candidates is
tau, the k-th largest score of the whole row (against up to 24 psums of 3 floats per row
for top-k's multisection). Class R (two passes) is not run on the ring.

Memory per device: the [Tl, Sl] tiles of one hop, so flat in T at a fixed shard length for
E/S/P; class T also holds the all-gathered Q and the per-row search state of all T rows,
which grow with cp (``bench/context_parallel_cpu.py`` measures it).

``implementation`` is accepted and ignored: every hop is jnp on one [Tl, Sl] tile.

Differentiation: first-order reverse mode (``jax.grad``, ``jax.vjp``); forward mode and
second order raise :class:`jaxsoft.attention.UnsupportedDifferentiation`.

The papers are listed under :func:`ring_attention`'s References.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsoft.attention.differentiation import first_order_only, refuse_unsupported_ad
from jaxsoft.attention.masks import normalize_window
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers import tile
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["ring_attention"]

_WHERE = "context_parallel_attention(strategy='ring')"
_ADVICE = ("Use strategy='all_gather' (K/V gathered, then the single-device path, which "
           "supports them).")


def _axis_size(axis_name: str) -> int:
  size = getattr(lax, "axis_size", None)
  if size is not None:
    return int(size(axis_name))
  return int(lax.psum(1, axis_name))


def _like(x, ref):
  """``x`` given the varying mesh axes of ``ref`` (a loop carry built from a shape is
  invariant inside ``jax.shard_map``; the loop's output is not)."""
  return x + jnp.zeros_like(ref.reshape(-1)[:1], dtype=x.dtype).reshape(())


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one ring call."""

  kind: str  # "E", "S", "P" or "T"
  rule: Any  # TileRule or ThresholdRule
  hp: tuple  # ((name, value), ...) static hyperparameters
  dtype: Any
  cap: float | None
  causal: bool
  window: tuple[int, int] | None
  axis: str
  cp: int

  @property
  def params(self) -> dict:
    return dict(self.hp)


def _visible(plan: _Plan, q_pos, q_seg, kv_pos, kv_seg, kv_valid):
  """bool [B, 1, 1, Tq, Sk]: key j visible to query i."""
  qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
  vis = jnp.ones(jnp.broadcast_shapes(qp.shape, kp.shape), bool)
  if kv_valid is not None:
    vis = vis & kv_valid[:, None, :]
  if q_seg is not None:
    vis = vis & (q_seg[:, :, None] == kv_seg[:, None, :])
  if plan.causal:
    vis = vis & (kp <= qp)
  if plan.window is not None:
    left, right = plan.window
    vis = vis & (kp >= qp - left) & (kp <= qp + right)
  return vis[:, None, None]


def _logits(plan: _Plan, q5, kb):
  """``(s, x)``: q·k (q pre-scaled) and the soft-capped logits, [B, K, G, Tq, Sk]."""
  s = jnp.einsum("bkgqh,bksh->bkgqs", q5, kb, preferred_element_type=plan.dtype)
  x = s if plan.cap is None else plan.cap * jnp.tanh(s / plan.cap)
  return s, x


def _cap_grad(plan: _Plan, s, dx):
  if plan.cap is None:
    return dx
  th = jnp.tanh(s / plan.cap)
  return dx * (1.0 - th * th)


def _next(plan: _Plan, tree):
  """Sends ``tree`` to the next device of the ring (device i receives from i - 1)."""
  perm = [(j, (j + 1) % plan.cp) for j in range(plan.cp)]
  return jax.tree.map(lambda a: lax.ppermute(a, plan.axis, perm), tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Meta:
  """Positions, segments and validity (no gradient). ``q_*`` are the local rows [B, Tl];
  ``kv_*`` every shard's keys, [cp, B, Sl] (all-gathered once); ``n`` the visible count
  of the local rows (class E/S/P) [B, 1, 1, Tl, 1], at least 1."""

  q_pos: Any
  q_seg: Any
  kv_pos: Any
  kv_seg: Any
  kv_valid: Any
  n: Any = None

  def block(self, src):
    """``(kv_pos, kv_seg, kv_valid)`` of shard ``src``'s keys, [B, Sl] each."""
    pick = (lambda a: None if a is None else lax.dynamic_index_in_dim(a, src, 0, False))
    return pick(self.kv_pos), pick(self.kv_seg), pick(self.kv_valid)


# ------------------------------------------------------------------------ classes E, S, P


def _source(plan: _Plan, h):
  """The shard whose K/V block this device holds at hop ``h``."""
  return (lax.axis_index(plan.axis) - h) % plan.cp


def _block_visible(plan: _Plan, meta: _Meta, src):
  """bool [B, 1, 1, Tl, Sl]: the local queries' view of shard ``src``'s keys."""
  return _visible(plan, meta.q_pos, meta.q_seg, *meta.block(src))


def _fold_visible(plan: _Plan, meta: _Meta, h, fold, carry):
  """``fold(vis, carry)`` with the visibility ``vis`` [B, 1, 1, Tl, Sl] of the key block
  held at hop ``h``, or ``carry`` unchanged when no local query sees any of its keys (a
  ``lax.cond`` on a scalar: a causal block wholly in the future costs no compute)."""
  vis = _block_visible(plan, meta, _source(plan, h))
  return lax.cond(jnp.any(vis), lambda c: fold(vis, c), lambda c: c, carry)


def _ring_forward(plan: _Plan, q5, k4, v4, meta: _Meta):
  """Returns ``(out, m, D)``, out [B, K, G, Tl, Hv], (m, D) per row."""
  rule, hp, n = plan.rule, plan.params, meta.n
  row = q5.shape[:-1] + (1,)
  m0, l0 = tile.init_rows(rule, row, plan.dtype)
  state = (_like(m0, q5), _like(l0, q5),
           _like(jnp.zeros(row[:-1] + (v4.shape[-1],), plan.dtype), q5))

  def compute(h, kb, vb, state):
    def fold(vis, state):
      m, l, acc = state
      _, x = _logits(plan, q5, kb)
      m, l, num, alpha = tile.online_update(rule, x, vis, m, l, n, hp)
      pv = jnp.einsum("bkgqs,bksh->bkgqh", num, vb, preferred_element_type=plan.dtype)
      return m, l, tile.rescale(acc, alpha) + pv

    return _fold_visible(plan, meta, h, fold, state)

  def hop(h, carry):
    kb, vb, state = carry
    nxt = _next(plan, (kb, vb))  # in flight while this block is computed on
    return (*nxt, compute(h, kb, vb, state))

  kb, vb, state = lax.fori_loop(0, plan.cp - 1, hop, (k4, v4, state))
  m, l, acc = compute(plan.cp - 1, kb, vb, state)
  m, d = tile.finalize(rule, m, l, n, hp)
  return tile.normalize(rule, acc, d), m, d


def _ring_backward(plan: _Plan, q5, k4, v4, meta: _Meta, res, dout):
  """dq, dk, dv from the saved ``(out, m, D)`` (see the module docstring)."""
  out, m, d = res
  rule, n = plan.rule, meta.n
  delta = jnp.sum(dout * out, axis=-1, keepdims=True)

  def compute(h, kb, vb, grads):
    def fold(vis, grads):
      dq, dkb, dvb = grads
      s, x = _logits(plan, q5, kb)
      dp = jnp.einsum("bkgqh,bksh->bkgqs", dout, vb, preferred_element_type=plan.dtype)
      w, dx, _ = tile.tile_vjp(rule, x, vis, m, d, delta, dp, n, plan.params, {})
      ds = _cap_grad(plan, s, dx)
      return (dq + jnp.einsum("bkgqs,bksh->bkgqh", ds, kb),
              dkb + jnp.einsum("bkgqs,bkgqh->bksh", ds, q5),
              dvb + jnp.einsum("bkgqs,bkgqh->bksh", w, dout))

    return _fold_visible(plan, meta, h, fold, grads)

  def hop(h, carry):
    kb, vb, dq, dkb, dvb = carry
    nxt = _next(plan, (kb, vb))
    dq, dkb, dvb = compute(h, kb, vb, (dq, dkb, dvb))
    return (*nxt, dq, *_next(plan, (dkb, dvb)))  # dK/dV one step behind their block

  init = (k4, v4, jnp.zeros_like(q5), jnp.zeros_like(k4), jnp.zeros_like(v4))
  kb, vb, dq, dkb, dvb = lax.fori_loop(0, plan.cp - 1, hop, init)
  dq, dkb, dvb = compute(plan.cp - 1, kb, vb, (dq, dkb, dvb))
  dk, dv = _next(plan, (dkb, dvb))  # home: the owner of the block is the next device
  return dq, dk, dv


# -------------------------------------------------------------------------------- class T


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Rows:
  """Every query row of the axis in cp chunks of Tl (class T): q [cp, B, K, G, Tl, H],
  positions and segments [cp, B, Tl], and the local keys' metadata [B, Sl]."""

  q: Any
  q_pos: Any
  q_seg: Any
  kv_pos: Any
  kv_seg: Any
  kv_valid: Any


def _gather_rows(plan: _Plan, q5, meta: _Meta) -> _Rows:
  def gather(a):
    return None if a is None else lax.all_gather(a, plan.axis, axis=0, tiled=False)

  local = meta.block(lax.axis_index(plan.axis))
  return _Rows(q=gather(q5), q_pos=gather(meta.q_pos), q_seg=gather(meta.q_seg),
               kv_pos=local[0], kv_seg=local[1], kv_valid=local[2])


def _chunks(plan: _Plan, rows: _Rows, k4, fn, xs, init=None):
  """Runs ``fn(vis, s, x, qc, *x_c)`` over the cp query chunks against the local keys:
  ``lax.map`` (``init`` None) stacking the results, else ``lax.scan`` with carry
  ``init`` (``fn(carry, vis, s, x, qc, *x_c) -> (carry, y)``)."""
  def tiles(c_xs):
    qc, pos, seg, *rest = c_xs
    vis = _visible(plan, pos, seg, rows.kv_pos, rows.kv_seg, rows.kv_valid)
    s, x = _logits(plan, qc, k4)
    return vis, s, x, qc, rest

  base = (rows.q, rows.q_pos, rows.q_seg, *xs)
  if init is None:
    def mapped(c_xs):
      vis, s, x, qc, rest = tiles(c_xs)
      return fn(vis, s, x, qc, *rest)
    return lax.map(mapped, base)

  def scanned(carry, c_xs):
    vis, s, x, qc, rest = tiles(c_xs)
    return fn(carry, vis, s, x, qc, *rest)
  return lax.scan(scanned, init, base)


def _threshold_forward(plan: _Plan, q5, k4, v4, meta: _Meta):
  """Class T: ``(out, m, D, (tau, n, theta))``; the per-row arrays are of every row of
  the axis, [cp, B, K, G, Tl, 1] (replicated), the output the local rows'."""
  rule, hp = plan.rule, plan.params
  rows = _gather_rows(plan, q5, meta)

  def count(vis, s, x, qc):
    return jnp.sum(jnp.broadcast_to(vis, x.shape), axis=-1, keepdims=True).astype(plan.dtype)

  n = jnp.maximum(lax.psum(_chunks(plan, rows, k4, count, ()), plan.axis), 1.0)
  theta: dict = {}
  if rule.stats is not None:
    st = rule.stats
    part = _chunks(plan, rows, k4,
                   lambda vis, s, x, qc: st.block(x, jnp.broadcast_to(vis, x.shape)), ())
    every = lax.all_gather(part, plan.axis, axis=0, tiled=False)  # [cp (shard), cp, ...]
    stats = jax.tree.map(lambda a: a[0], every)
    for i in range(1, plan.cp):
      stats = st.merge(stats, jax.tree.map(lambda a, i=i: a[i], every))
    theta = {name: lax.stop_gradient(jnp.broadcast_to(jnp.asarray(x, plan.dtype), n.shape))
             for name, x in st.derive(stats, n, **hp).items()}

  def params(th):
    return {**hp, **th}

  def max_step(vis, s, x, qc, nc, th):
    z = rule.score_map(jnp.where(vis, x, 0.0), nc, **params(th))
    return tile.running_max(z, vis, jnp.full(nc.shape, -jnp.inf, plan.dtype))

  m = lax.pmax(_chunks(plan, rows, k4, max_step, (n, theta)), plan.axis)
  m, state, target = tile.search_start(rule, m, n, params(theta))
  if _merges_candidates(rule, hp):
    tau = _top_k_threshold(plan, rows, k4, m, n, state[0])
  else:
    tau = _search(plan, rows, k4, m, n, theta, state, target)
  if tile.jumps_at_threshold(rule, hp):  # top-k / top-p: tau into the gap below it
    def below_step(vis, s, x, qc, mc, nc, tc, th):
      z = tile.scores(rule, x, vis, mc, nc, params(th))
      return tile.max_below(z, vis, tc, jnp.full(mc.shape, -jnp.inf, plan.dtype))

    below = lax.pmax(_chunks(plan, rows, k4, below_step, (m, n, tau, theta)), plan.axis)
    tau = tile.gap_threshold(tau, below)
  m = tile.weight_stabiliser(m)

  def weight_step(vis, s, x, qc, mc, nc, tc, th):
    w, _ = tile.threshold_maps(rule, x, vis, tc, mc, nc, params(th))
    pv = jnp.einsum("bkgqs,bksh->bkgqh", w, v4, preferred_element_type=plan.dtype)
    return jnp.sum(w, axis=-1, keepdims=True), pv

  l, acc = _chunks(plan, rows, k4, weight_step, (m, n, tau, theta))
  d = lax.psum(l, plan.axis)
  acc = lax.psum_scatter(acc, plan.axis, scatter_dimension=0, tiled=False)
  own = lax.dynamic_index_in_dim(d, lax.axis_index(plan.axis), 0, False)
  return acc * tile.safe_inverse(own), m, d, (tau, n, theta)


def _merges_candidates(rule, hp) -> bool:
  """Top-k with a Python int k: its threshold is the k-th largest score, found by merging
  each shard's k largest instead of a search."""
  top_k = _spec.REGISTRY.get("top_k_softmax")
  return (top_k is not None and rule is top_k.threshold
          and isinstance(hp.get("k"), (int, np.integer)) and hp["k"] >= 1)


def _top_k_threshold(plan: _Plan, rows: _Rows, k4, m, n, lo):
  """Top-k's tau: ``max(z_(min(k, n)), lo)``, the min(k, n)-th largest visible score of
  the row (``lo``, the search's lower bracket, where that is lower or the row is empty,
  as the search would end). Each shard takes the ``min(k, Sl)`` largest of its keys per
  row (``lax.top_k``), one all-gather merges them (cp·min(k, Sl) floats per row, against
  up to ``iterations / 2`` psums of 3 floats per row for the search) and the k-th largest
  of the merged candidates is the global k-th largest score."""
  k = int(plan.params["k"])
  kk = min(k, k4.shape[2])

  def local(vis, s, x, qc, mc, nc):
    z = tile.scores(plan.rule, x, vis, mc, nc, plan.params)
    return lax.top_k(jnp.where(vis, z, -jnp.inf), kk)[0]

  top = lax.all_gather(_chunks(plan, rows, k4, local, (m, n)), plan.axis, axis=0, tiled=False)
  top = jnp.moveaxis(top, 0, -2)
  top = lax.top_k(top.reshape(top.shape[:-2] + (-1,)), min(k, top.shape[-2] * kk))[0]
  index = jnp.minimum(jnp.minimum(n, k), top.shape[-1]).astype(jnp.int32) - 1
  kth = jnp.take_along_axis(top, index, axis=-1)
  return lax.stop_gradient(jnp.maximum(kth, lo))


def _search(plan: _Plan, rows: _Rows, k4, m, n, theta, state, target):
  """The threshold search of ``_chunked._threshold_search`` over the key shards: each step
  sums the masses at the candidates over the local keys and psums them."""
  rule, hp = plan.rule, plan.params

  def params(th):
    return {**hp, **th}

  count_, steps, newton = tile.search_schedule(rule, rule.iterations, early_exit=True)

  def search_step(carry):
    i, _, state = carry
    lo, hi, point = state
    taus = tile.search_candidates(lo, hi, point, count_)

    def sums_step(vis, s, x, qc, mc, nc, th, *taus_c):
      z = tile.scores(rule, x, vis, mc, nc, params(th))
      zero = [jnp.zeros_like(mc)] * (count_ * (1 + int(newton)))
      return tile.search_sums(rule, z, vis, list(taus_c), zero, params(th), newton,
                              stacked=True)

    sums = lax.psum(_chunks(plan, rows, k4, sums_step, (m, n, theta, *taus)), plan.axis)
    state = tile.search_update(rule, state, taus, list(sums), target, params(theta), newton)
    return i + 1, varying(jnp.all(tile.search_done(state))), varying(state)

  def more(carry):
    i, done, _ = carry
    return jnp.logical_and(i < steps, jnp.logical_not(done))

  # every device holds the same state (its sums are psums), typed as varying along the axis
  # (a derived hyperparameter gathered from the shards is): one type for the loop carry
  def varying(tree):
    return jax.tree.map(lambda a: _like(a, k4), tree)

  done = varying(jnp.all(tile.search_done(state)))
  _, _, state = lax.while_loop(more, search_step, (jnp.int32(0), done, varying(state)))
  return lax.stop_gradient(tile.search_threshold(state, newton))


def _threshold_backward(plan: _Plan, q5, k4, v4, meta: _Meta, res, dout):
  """Class T: the implicit-function gradient of ``_chunked`` with the sums over keys
  reduced across the axis: ``dz_j = w'_j (dP_j - Δ)/W - (g_tau / M_tau)·mass'_j``."""
  out, m, d, (tau, n, theta) = res
  rule, hp = plan.rule, plan.params
  rows = _gather_rows(plan, q5, meta)
  delta = lax.all_gather(jnp.sum(dout * out, axis=-1, keepdims=True), plan.axis, axis=0,
                         tiled=False)
  do_all = lax.all_gather(dout, plan.axis, axis=0, tiled=False)
  inv_w = tile.safe_inverse(d)

  def params(th):
    return {**hp, **th}

  def coef_step(vis, s, x, qc, mc, nc, tc, dl, doc, iw, th):
    _, (dw, dm) = jax.jvp(lambda t: tile.threshold_maps(rule, x, vis, t, mc, nc, params(th)),
                          (tc,), (jnp.ones_like(tc),))
    dp = jnp.einsum("bkgqh,bksh->bkgqs", doc, v4, preferred_element_type=plan.dtype)
    return (jnp.sum(dw * (dp - dl), axis=-1, keepdims=True) * iw,
            jnp.sum(dm, axis=-1, keepdims=True))

  g_tau, m_tau = lax.psum(
      _chunks(plan, rows, k4, coef_step, (m, n, tau, delta, do_all, inv_w, theta)), plan.axis)
  coef = g_tau * tile.safe_inverse(m_tau)

  def grad_step(carry, vis, s, x, qc, mc, nc, tc, dl, doc, iw, cf, th):
    dk, dv = carry
    (w, mass), vjp = jax.vjp(
        lambda x_: tile.threshold_maps(rule, x_, vis, tc, mc, nc, params(th)), x)
    dp = jnp.einsum("bkgqh,bksh->bkgqs", doc, v4, preferred_element_type=plan.dtype)
    cot_mass = jnp.where(vis, jnp.broadcast_to(-cf, mass.shape), 0.0)
    (dx,) = vjp(((dp - dl) * iw, cot_mass))
    ds = _cap_grad(plan, s, dx)
    dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds, qc)
    dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", w * iw, doc)
    return (dk, dv), jnp.einsum("bkgqs,bksh->bkgqh", ds, k4)

  (dk, dv), dq = _chunks(plan, rows, k4, grad_step,
                         (m, n, tau, delta, do_all, inv_w, coef, theta),
                         init=(jnp.zeros_like(k4), jnp.zeros_like(v4)))
  dq = lax.psum_scatter(dq, plan.axis, scatter_dimension=0, tiled=False)
  return dq, dk, dv


# ------------------------------------------------------------------------------ the call


def _attend(plan: _Plan):
  """``attend(q5, k4, v4, meta) -> out`` with the recomputing custom VJP."""
  fwd_fn, bwd_fn = ((_threshold_forward, _threshold_backward) if plan.kind == "T"
                    else (_ring_forward, _ring_backward))
  forward = first_order_only(functools.partial(fwd_fn, plan), _WHERE, _ADVICE)
  backward = first_order_only(functools.partial(bwd_fn, plan), _WHERE, _ADVICE)

  @jax.custom_vjp
  def attend(q5, k4, v4, meta):
    return forward(q5, k4, v4, meta)[0]

  def attend_fwd(q5, k4, v4, meta):
    res = forward(q5, k4, v4, meta)
    return res[0], (q5, k4, v4, meta, res)

  def attend_bwd(saved, dout):
    q5, k4, v4, meta, res = saved
    dq, dk, dv = backward(q5, k4, v4, meta, res, dout)
    return dq, dk, dv, None

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def _ring_rule(normalizer):
  """(kernel class, rule) for the ring; NotImplementedError naming what it cannot run."""
  spec = _spec.resolve(normalizer)
  if not isinstance(spec, _spec.NormalizerSpec):
    raise NotImplementedError(
        f"{_WHERE}: needs a registered normalizer with a tile or threshold rule, got the plain "
        f"callable {normalizer!r}. {_ADVICE}")
  if spec.needs_key:
    raise NotImplementedError(f"{_WHERE}: normalizer {spec.name!r} is stochastic (kernel class "
                              f"X), which the ring does not run. {_ADVICE}")
  if spec.kernel_class == "R":
    raise NotImplementedError(
        f"{_WHERE}: normalizer {spec.name!r} is kernel class R (row statistics, then a second "
        f"pass over every key), which the ring does not run. {_ADVICE}")
  rule = spec.threshold if spec.kernel_class == "T" else spec.tile
  if rule is None:
    raise NotImplementedError(f"{_WHERE}: normalizer {spec.name!r} (kernel class "
                              f"{spec.kernel_class}) has no blockwise rule. {_ADVICE}")
  return spec, rule


def _static_params(spec, normalizer_params) -> tuple:
  """The hyperparameters as static Python values; NotImplementedError for traced or
  non-scalar arrays (the ring does not differentiate hyperparameters)."""
  given = dict(normalizer_params or {})
  spec.validate(given)
  out = []
  for name, value in {**spec.defaults, **given}.items():
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
      if isinstance(value, jax.core.Tracer) or np.ndim(value) != 0:
        raise NotImplementedError(
            f"{_WHERE}: `normalizer_params[{name!r}]` must be a Python number (or a concrete "
            f"scalar) on the ring, got an array of shape {np.shape(value)}; per-head or "
            f"learned hyperparameters are not supported here. {_ADVICE}")
      value = value.item()
    out.append((name, value))
  return tuple(out)


def _check_rows(name: str, a, shape, kind: str):
  if a is None:
    return None
  a = jnp.asarray(a)
  if a.shape != shape:
    raise ValueError(f"ring_attention: `{name}` must have shape {shape} (batch, local "
                     f"length), got {a.shape}")
  if kind == "bool":
    if a.dtype != jnp.bool_:
      raise ValueError(f"ring_attention: `{name}` must be a bool array, got {a.dtype}")
    return a
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise ValueError(f"ring_attention: `{name}` must be an integer array, got {a.dtype}")
  return a.astype(jnp.int32)


def ring_attention(q, k, v, *, axis_name: str, q_positions, kv_positions, q_segment_ids,
                   kv_segment_ids, kv_valid, is_causal: bool, local_window_size, normalizer,
                   normalizer_params, scale, logits_soft_cap, implementation) -> jax.Array:
  r"""Ring attention over the mesh axis ``axis_name``, called inside ``jax.shard_map``.

  For each local query row i (global position ``q_positions[b, i]``), head n and the keys
  j of every shard of the axis:

  .. math::
    \ell_{ij} = c \tanh\Big(\frac{s\, q_i \cdot k_j}{c}\Big), \qquad
    w_{i\cdot} = f(\ell_{i\cdot};\ \mathrm{where}=V_i), \qquad o_i = \sum_{j \in V_i} w_{ij} v_j

  with s = ``scale``, c = ``logits_soft_cap`` (no tanh when None), f the normalizer, and
  j in V_i iff ``kv_valid[j]``, equal segment ids (when given), ``kv_pos[j] <= q_pos[i]``
  when ``is_causal``, and ``q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right`` for
  ``local_window_size = (left, right)`` (an int w is (w, w)). A row with no visible key is
  zeros. Classes E/S/P pass K/V around the ring with the tile rule's online state
  (FlashAttention's (m, l) for class E); class T (sparsemax, entmax, top-k, top-p) is
  exact: its threshold search reduces per-row partial sums over the key shards (see the
  module docstring for the communication). Class R raises NotImplementedError.

  Args:
    q: local queries [B, Tl, N, H].
    k, v: local keys and values [B, Sl, K, H] (N = K·G, GQA).
    axis_name: the mesh axis that shards the sequence.
    q_positions, kv_positions: int [B, Tl] and [B, Sl], global positions (any order).
    q_segment_ids, kv_segment_ids: int [B, Tl] and [B, Sl], or None (both or neither).
    kv_valid: bool [B, Sl] or None (every key valid).
    is_causal: keys after the query are hidden.
    local_window_size: None, an int or ``(left, right)``.
    normalizer: a registered name or spec of kernel class E, S, P or T.
    normalizer_params: hyperparameters (Python numbers or concrete scalars), or None.
    scale: the logit scale (None: ``1/sqrt(H)``).
    logits_soft_cap: c, or None.
    implementation: ignored (each hop is jnp on one tile), accepted for the strategy table.

  Returns:
    The local output [B, Tl, N, H] in ``q.dtype``.

  Examples:
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxsoft.attention._ring import ring_attention
    >>> mesh = jax.make_mesh((1,), ("context",), devices=jax.devices()[:1],
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> q = jnp.linspace(-1.0, 1.0, 64).reshape(1, 8, 2, 4)
    >>> pos = jnp.arange(8, dtype=jnp.int32)[None]
    >>> def f(q, k, v, pos):
    ...   return ring_attention(q, k, v, axis_name="context", q_positions=pos,
    ...                         kv_positions=pos, q_segment_ids=None, kv_segment_ids=None,
    ...                         kv_valid=None, is_causal=True, local_window_size=None,
    ...                         normalizer="softmax", normalizer_params=None, scale=None,
    ...                         logits_soft_cap=None, implementation=None)
    >>> ring = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "context"),
    ...                              out_specs=P(None, "context")))
    >>> dense = js.attention.dot_product_attention(q, q, q, is_causal=True)
    >>> bool(jnp.allclose(ring(q, q, q, pos), dense, atol=1e-6))
    True

  References:
    H. Liu, M. Zaharia & P. Abbeel, 2023, "Ring Attention with Blockwise Transformers for
    Near-Infinite Context", arXiv:2310.01889.

    W. Brandon, A. Nrusimha, K. Qian, Z. Ankner, T. Jin, Z. Song & J. Ragan-Kelley, 2023,
    "Striped Attention: Faster Ring Attention for Causal Transformers", arXiv:2311.09431.

    T. Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning", arXiv:2307.08691.
  """
  del implementation  # every hop is jnp on one tile
  spec, rule = _ring_rule(normalizer)
  hp = _static_params(spec, normalizer_params)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"ring_attention: `q`, `k`, `v` must be 4-D [B, T, N, H]; got shapes "
                     f"{q.shape}, {k.shape}, {v.shape}")
  B, Tl, N, H = q.shape
  Sl, K = k.shape[1], k.shape[2]
  if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != H or N % K:
    raise ValueError(f"ring_attention: `k` must be [B, Sl, K, H] and `v` [B, Sl, K, Hv] with "
                     f"N a multiple of K; got q {q.shape}, k {k.shape}, v {v.shape}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("ring_attention: give both `q_segment_ids` and `kv_segment_ids` or "
                     "neither")
  q_pos = _check_rows("q_positions", q_positions, (B, Tl), "int")
  kv_pos = _check_rows("kv_positions", kv_positions, (B, Sl), "int")
  q_seg = _check_rows("q_segment_ids", q_segment_ids, (B, Tl), "int")
  kv_seg = _check_rows("kv_segment_ids", kv_segment_ids, (B, Sl), "int")
  valid = _check_rows("kv_valid", kv_valid, (B, Sl), "bool")
  if logits_soft_cap is not None and not float(logits_soft_cap) > 0:
    raise ValueError(f"ring_attention: `logits_soft_cap` must be > 0, got {logits_soft_cap}")
  cp = _axis_size(axis_name)
  G = N // K
  dtype = compute_dtype(q.dtype)
  plan = _Plan(kind=spec.kernel_class, rule=rule, hp=hp, dtype=dtype,
               cap=None if logits_soft_cap is None else float(logits_soft_cap),
               causal=bool(is_causal), window=normalize_window(local_window_size),
               axis=axis_name, cp=cp)
  s = 1.0 / np.sqrt(H) if scale is None else scale
  q5 = (q.astype(dtype) * s).reshape(B, Tl, K, G, H).transpose(0, 2, 3, 1, 4)
  k4 = k.astype(dtype).transpose(0, 2, 1, 3)
  v4 = v.astype(dtype).transpose(0, 2, 1, 3)

  def gather(a):
    return None if a is None else lax.all_gather(a, axis_name, axis=0, tiled=False)

  meta = _Meta(q_pos=q_pos, q_seg=q_seg, kv_pos=gather(kv_pos), kv_seg=gather(kv_seg),
               kv_valid=gather(valid))
  if plan.kind != "T":
    meta = dataclasses.replace(meta, n=_local_counts(plan, meta, (B, K, G, Tl, 1)))
  refuse_unsupported_ad((q5, k4, v4), _WHERE, _ADVICE)
  out = _attend(plan)(q5, k4, v4, meta)  # [B, K, G, Tl, Hv]
  return out.transpose(0, 3, 1, 2, 4).reshape(B, Tl, N, v.shape[-1]).astype(q.dtype)


def _local_counts(plan: _Plan, meta: _Meta, row):
  """Visible keys of each local row over every shard, [B, 1, 1, Tl, 1], at least 1."""
  def body(src, cnt):
    vis = _block_visible(plan, meta, src)
    return cnt + jnp.sum(vis, axis=-1, keepdims=True).astype(plan.dtype)

  zero = _like(jnp.zeros((row[0], 1, 1, row[3], 1), plan.dtype), meta.q_pos)
  return jnp.maximum(lax.fori_loop(0, plan.cp, body, zero), 1.0)
