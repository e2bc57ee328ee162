r"""Pallas chunk kernels for the scalar-decay linear recurrences (feature K07).

``implementation="pallas"`` of ``jaxsoft.linear.simple_gla``, ``lightning_attention``,
``delta_rule`` and ``gated_delta_rule``. The recurrence (per batch and head, ``q`` already
scaled, ``g`` a log decay per token, ``beta`` the delta rule's write strength)

.. math::
  \tilde S_t = e^{g_t} S_{t-1}, \qquad S_t = \tilde S_t + k_t u_t^\top, \qquad
  o_t = S_t^\top q_t,

with ``u_t = v_t`` (simple GLA, Lightning Attention) or ``u_t = \beta_t (v_t - \tilde
S_t^\top k_t)`` (the gated delta rule), is computed in chunks of ``C`` tokens. With
``G_i`` the cumulative log decay from the chunk start and ``S`` the chunk-start state,

.. math::
  U = \tilde U - W S, \qquad
  O = \operatorname{diag}(f^q) Q S + ((Q K^\top) \odot \Gamma) U, \qquad
  S' = d\, S + (\operatorname{diag}(f^k) K)^\top U,

``Γ_ij = e^{G_i - G_j}`` for ``j <= i`` in the same segment run (else 0, masked before
``exp``), ``f^q_i = e^{G_i}``, ``f^k_i = e^{G_C - G_i}``, ``d = e^{G_C}`` (each zeroed
where a segment boundary cuts it). Without ``beta``: ``\tilde U = V``, ``W = 0``. With
``beta`` (the UT / WY form of Yang, Wang, Zhang, Shen & Kim 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length"; gated: Yang, Kautz & Hatamizadeh
2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule")
``\tilde U = (I + A)^{-1} (\beta \odot V)`` and ``W = (I + A)^{-1} \operatorname{diag}(
\beta f^q) K`` with ``A_ij = \beta_i e^{G_i - G_j} k_i \cdot k_j`` (``j < i``).

Split between XLA and the kernels. The per-token factors (``G``, ``f^q``, ``f^k``, ``d``)
and, for the delta rule, the chunk-local UT inverse and ``\tilde U, W`` are computed in XLA
before the kernels, for all chunks at once (``_recurrence.unit_lower_inverse``: a
``[C, C]`` unit-lower-triangular inverse per chunk, by recursive block inversion, which
neither Triton nor Mosaic expresses well in a kernel); autodiff differentiates that
preparation, under ``jax.checkpoint`` for the delta rule, so that its ``[C, C]`` terms are
rebuilt in the backward pass instead of being kept. The kernels do the sequential part,
which is what a Pallas kernel buys:

* forward: one program per (batch x head) walks the chunks in order, carrying the
  ``[K, V]`` state in registers (Triton: a ``fori_loop`` inside the kernel, and one program
  per block of ``block_v`` value columns, the recurrence being separable in the columns of
  V) or VMEM scratch (Mosaic: the chunk axis of the grid is "arbitrary"); per chunk it builds the
  decay-masked intra-chunk scores ``(Q K^T) ⊙ Γ`` and writes ``O``, the chunk-start state
  (the only residual besides the inputs: ``[T / C, K, V]``) and finally ``S_T``;
* backward (recomputing, as in Lightning Attention: Qin, Sun, Li, Shen, Sun & Zhong 2024,
  "Lightning Attention-2: A Free Lunch for Handling Unlimited Sequence Lengths in Large
  Language Models"): one program per (batch x head) walks the chunks in reverse, carrying
  ``dS`` (the cotangent of the chunk-end state), rebuilds the chunk's scores from its
  inputs and its stored start state and writes ``dQ, dK, d\tilde U, dW`` and the
  cotangents of ``G, f^q, f^k, d`` (Triton: per V block, summed in XLA); ``dS_0`` (the
  initial state's) comes out last:

.. math::
  dU = P^\top dO + \operatorname{diag}(f^k) K\, dS', \quad dP = dO\, U^\top, \quad
  dQ = (dP \odot Γ) K + \operatorname{diag}(f^q)\, dO\, S^\top, \quad
  dK = (dP \odot Γ)^\top Q + \operatorname{diag}(f^k)\, U\, dS'^\top,

  dG_i = \textstyle\sum_j L_{ij} - \sum_j L_{ji}, \quad L = dP \odot (Q K^\top) \odot Γ,
  \qquad dS = (\operatorname{diag}(f^q) Q)^\top dO + d\, dS' - W^\top dU .

Layouts: Triton keeps ``[BN, T, ...]`` blocks of the whole sequence and slices one chunk
at a time (``pl.ds``); Mosaic gets ``[C, ...]`` blocks per grid step. Head dims are padded
to a power of two >= 16 for Triton (tensor-core dots), the chunk must be a power of two
>= 16 there and a multiple of 8 for Mosaic. Everything runs in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec

from jaxsoft.linear import chunk as _chunk
from jaxsoft.linear import recurrence as _recurrence
from kernels_pallas.backends import check_backend
from kernels_pallas.engine import varying_like

__all__ = ["chunked", "check_chunk"]



@dataclasses.dataclass(frozen=True)
class _Cfg:
  """Static description of one kernel call (hashable: it keys the custom_vjp)."""

  backend: str
  interpret: Any
  chunk: int
  delta: bool     # W is present (the delta rule)
  segments: bool  # run ids are present
  block_v: int    # Triton: the V columns of one program (a divisor of the padded V)
  acc: str = "float32"  # the compute dtype: float32, or float64 for float64 inputs

  @property
  def dt(self):
    return jnp.dtype(self.acc)


# --------------------------------------------------------------------------------------
# Per-chunk math (pure jnp; runs inside the kernels of both drivers).


def _dot(a, b, trans_b: bool = False):
  """``a @ b`` (or ``a @ b^T``) in float32."""
  return jax.lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())),
                             preferred_element_type=a.dtype)


def _gamma(C: int, gc, gr, rc, rr):
  """``Γ [C, C]``: ``e^{G_i - G_j}`` for ``j <= i`` in the same run, exactly 0 elsewhere."""
  rows = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
  mask = rows >= cols
  if rc is not None:
    mask = jnp.logical_and(mask, rc == rr)
  return jnp.exp(jnp.where(mask, gc - gr, -jnp.inf))


def _last(row):
  """The last entry of a ``[1, C]`` row, as ``[1, 1]``."""
  cols = jax.lax.broadcasted_iota(jnp.int32, row.shape, 1)
  return jnp.sum(jnp.where(cols == row.shape[1] - 1, row, 0.0), axis=1, keepdims=True)


def chunk_forward(x: dict, S):
  """One chunk: ``x`` holds ``q, k [C, K]``, ``u [C, V]``, ``w [C, K]`` (or None), the
  columns ``gc, fq, fk [C, 1]``, the rows ``gr, ds [1, C]`` and the run ids ``rc [C, 1]``,
  ``rr [1, C]`` (or None). Returns ``(o [C, V], S' [K, V])``."""
  q, k, u, w = x["q"], x["k"], x["u"], x.get("w")
  gamma = _gamma(q.shape[0], x["gc"], x["gr"], x.get("rc"), x.get("rr"))
  P = _dot(q, k, trans_b=True) * gamma
  U = u if w is None else u - _dot(w, S)
  o = _dot(q * x["fq"], S) + _dot(P, U)
  S_new = _last(x["ds"]) * S + _dot((k * x["fk"]).T, U)
  return o, S_new


def chunk_backward(x: dict, S, do, dS):
  """The cotangents of one chunk from ``do [C, V]`` and ``dS`` (that of its end state).

  Returns ``(grads, dS_start)``; ``grads`` has ``q, k, u, w, gc, fq, fk, gr, ds``."""
  q, k, u, w, fq, fk = x["q"], x["k"], x["u"], x.get("w"), x["fq"], x["fk"]
  gamma = _gamma(q.shape[0], x["gc"], x["gr"], x.get("rc"), x.get("rr"))
  A = _dot(q, k, trans_b=True)
  P = A * gamma
  U = u if w is None else u - _dot(w, S)
  kd, qd = k * fk, q * fq
  dU = _dot(P.T, do) + _dot(kd, dS)
  dP = _dot(do, U, trans_b=True)
  dA = dP * gamma
  dlog = dA * A                                   # d/d(G_i - G_j) of the scores
  dqd = _dot(do, S, trans_b=True)
  dkd = _dot(U, dS, trans_b=True)
  ds = _last(x["ds"])
  dds = jnp.sum(jnp.sum(S * dS, axis=1, keepdims=True), axis=0, keepdims=True)
  cols = jax.lax.broadcasted_iota(jnp.int32, x["ds"].shape, 1)
  grads = dict(
      q=_dot(dA, k) + fq * dqd,
      k=_dot(dA.T, q) + fk * dkd,
      u=dU,
      gc=jnp.sum(dlog, axis=1, keepdims=True),
      gr=-jnp.sum(dlog, axis=0, keepdims=True),
      fq=jnp.sum(dqd * q, axis=1, keepdims=True),
      fk=jnp.sum(dkd * k, axis=1, keepdims=True),
      ds=jnp.where(cols == x["ds"].shape[1] - 1, dds, 0.0))
  dS_start = _dot(qd.T, do) + ds * dS
  if w is not None:
    grads["w"] = -_dot(dU, S, trans_b=True)
    dS_start = dS_start - _dot(w.T, dU)
  return grads, dS_start


# --------------------------------------------------------------------------------------
# Operands. Canonical layouts: sequences [BN, T, X] (X = K, V or 1 for the columns), rows
# [BN, nC, C]; each driver reshapes the rows ([BN, 1, T] Triton, [BN, nC, 1, C] Mosaic).

SEQ = ("q", "k", "u", "w", "gc", "fq", "fk", "rc")   # [BN, T, X]
ROWS = ("gr", "ds", "rr")                            # [BN, nC, C]
DIFF = ("q", "k", "u", "w", "gc", "fq", "fk", "gr", "ds")


def _names(cfg: _Cfg, group) -> list[str]:
  skip = set() if cfg.delta else {"w"}
  if not cfg.segments:
    skip |= {"rc", "rr"}
  return [n for n in group if n not in skip]


# --------------------------------------------------------------------------------------
# Triton driver: grid (BN, V blocks), the chunk loop inside the kernel. The recurrence is
# separable in the columns of V (U = U~ - W S column by column): each program carries a
# [K, block_v] slice of the state; the backward pass's V-independent cotangents (dQ, dK,
# dW, the decay terms) come out per V block and are summed in XLA.

VSPLIT = ("u", "o", "s0", "starts", "do", "dst")   # arrays blocked along V (their last axis)


def _triton_call(cfg: _Cfg, kernel, name, grid, operands: list, out_specs, out_shape):
  out_shape = varying_like(out_shape, [o[1] for o in operands])
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[o[0] for o in operands],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=cfg.interpret, name=f"jaxsoft_linear_{name}",
  )(*(o[1] for o in operands))


def _tspec(name: str, shape, bv: int):
  """One whole [a, b] block per (BN, V block) program; arrays in VSPLIT blocked along V."""
  if name in VSPLIT:
    return pl.BlockSpec((None, shape[1], bv), lambda i, j: (i, 0, j))
  return pl.BlockSpec((None,) + tuple(shape[1:]), lambda i, j: (i, 0, 0))


def _triton_operands(cfg: _Cfg, x: dict, extra: dict) -> tuple[list, list[str]]:
  """(spec, array) pairs of the chunk inputs, then ``extra`` (name -> [BN, a, b] arrays);
  rows become [BN, 1, T]."""
  arrays = {n: x[n] for n in _names(cfg, SEQ)}
  arrays.update({n: x[n].reshape(x[n].shape[0], 1, -1) for n in _names(cfg, ROWS)})
  arrays.update(extra)
  return ([(_tspec(n, a.shape, cfg.block_v), a) for n, a in arrays.items()], list(arrays))


def _chunk_loop(n: int, body, init):
  """``fori_loop(0, n, body, init)`` from a traced start (0 = ``program_id - program_id``):
  a ``while`` loop, which Triton still lowers to ``scf.for`` (it matches the fori pattern).
  With constant bounds the loop is a ``scan``, which the Pallas interpreter inside
  ``jax.shard_map`` (default ``check_vma``) cannot run: the refs it carries vary over the mesh
  axes on the way in but not on the way out of the body traced with the kernel."""
  i = pl.program_id(0)
  return jax.lax.fori_loop(i - i, n, body, init)


def _triton_chunk(refs: dict, names, C: int, c):
  sl = pl.ds(c * C, C)
  return {n: (refs[n][:, sl] if n in ROWS else refs[n][sl, :]) for n in names}


def _triton_forward(cfg: _Cfg, x: dict, S0):
  BN, T, K = x["q"].shape
  V, C, bv = x["u"].shape[-1], cfg.chunk, cfg.block_v
  nC = T // C
  ops, names = _triton_operands(cfg, x, {"s0": S0})
  chunk_names = names[:-1]
  outs = {"o": (BN, T, V), "st": (BN, K, V), "starts": (BN, nC * K, V)}

  def kernel(*refs):
    r = dict(zip(names, refs[:len(names)], strict=True))
    o_ref, st_ref, starts_ref = refs[len(names):]

    def body(c, S):
      o, S_new = chunk_forward(_triton_chunk(r, chunk_names, C, c), S)
      o_ref[pl.ds(c * C, C), :] = o
      starts_ref[pl.ds(c * K, K), :] = S
      return S_new

    st_ref[...] = _chunk_loop(nC, body, r["s0"][...])

  o, S_T, starts = _triton_call(
      cfg, kernel, "fwd", (BN, V // bv), ops,
      [_tspec("o" if n == "st" else n, sh, bv) for n, sh in outs.items()],
      [jax.ShapeDtypeStruct(sh, cfg.dt) for sh in outs.values()])
  return o, S_T, starts.reshape(BN, nC, K, V)


def _triton_backward(cfg: _Cfg, x: dict, starts, do, dS_T):
  BN, T, K = x["q"].shape
  V, C, bv = x["u"].shape[-1], cfg.chunk, cfg.block_v
  nC, nV = T // C, V // bv
  extra = {"starts": starts.reshape(BN, nC * K, V), "do": do, "dst": dS_T}
  ops, names = _triton_operands(cfg, x, extra)
  chunk_names = names[:-len(extra)]
  outs = _names(cfg, DIFF)
  out_specs, out_shape = [], []
  for n in outs:
    if n == "u":
      out_specs.append(_tspec("u", (BN, T, V), bv))
      out_shape.append(jax.ShapeDtypeStruct((BN, T, V), cfg.dt))
    else:   # one partial cotangent per V block: [BN, nV, T, X] (rows [BN, nV, 1, T])
      sh = (T, x[n].shape[-1]) if n in SEQ else (1, T)
      out_specs.append(pl.BlockSpec((None, None) + sh, lambda i, j: (i, j, 0, 0)))
      out_shape.append(jax.ShapeDtypeStruct((BN, nV) + sh, cfg.dt))
  out_specs.append(_tspec("s0", (BN, K, V), bv))
  out_shape.append(jax.ShapeDtypeStruct((BN, K, V), cfg.dt))

  def kernel(*refs):
    r = dict(zip(names, refs[:len(names)], strict=True))
    out = dict(zip(outs, refs[len(names):-1], strict=True))
    ds0_ref = refs[-1]

    def body(i, dS):
      c = nC - 1 - i
      sl = pl.ds(c * C, C)
      S = r["starts"][pl.ds(c * K, K), :]
      grads, dS_start = chunk_backward(_triton_chunk(r, chunk_names, C, c), S,
                                       r["do"][sl, :], dS)
      for n in outs:
        if n in ROWS:
          out[n][:, sl] = grads[n]
        else:
          out[n][sl, :] = grads[n]
      return dS_start

    ds0_ref[...] = _chunk_loop(nC, body, r["dst"][...])

  res = _triton_call(cfg, kernel, "bwd", (BN, nV), ops, out_specs, out_shape)
  grads = {}
  for n, a in zip(outs, res[:-1], strict=True):
    if n != "u":
      a = a.sum(axis=1)
    grads[n] = a.reshape(BN, nC, C) if n in ROWS else a
  return grads, res[-1]


# --------------------------------------------------------------------------------------
# Mosaic TPU driver: grid (BN, nC), the chunk axis "arbitrary", the state in VMEM scratch.


def _tpu_specs(cfg: _Cfg, x: dict, nC: int, reverse: bool) -> tuple[list, list[str]]:
  C = cfg.chunk
  chunk = (lambda c: nC - 1 - c) if reverse else (lambda c: c)
  ops, names = [], []
  for n in _names(cfg, SEQ):
    a = x[n]
    ops.append((pl.BlockSpec((None, C, a.shape[-1]), lambda i, c: (i, chunk(c), 0)), a))
    names.append(n)
  for n in _names(cfg, ROWS):
    a = x[n].reshape(x[n].shape[0], nC, 1, C)
    ops.append((pl.BlockSpec((None, None, 1, C), lambda i, c: (i, chunk(c), 0, 0)), a))
    names.append(n)
  return ops, names


def _tpu_call(cfg: _Cfg, kernel, name, grid, ops, out_specs, out_shape, scratch):
  out_shape = varying_like(out_shape, [o[1] for o in ops])
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=grid, in_specs=[o[0] for o in ops],
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=cfg.interpret, name=f"jaxsoft_linear_{name}",
  )(*(o[1] for o in ops))


def _tpu_forward(cfg: _Cfg, x: dict, S0):
  BN, T, K = x["q"].shape
  V, C = x["u"].shape[-1], cfg.chunk
  nC = T // C
  ops, names = _tpu_specs(cfg, x, nC, reverse=False)
  state = pl.BlockSpec((None, K, V), lambda i, c: (i, 0, 0))
  ops.append((state, S0))
  out_specs = [pl.BlockSpec((None, C, V), lambda i, c: (i, c, 0)), state,
               pl.BlockSpec((None, None, K, V), lambda i, c: (i, c, 0, 0))]
  out_shape = [jax.ShapeDtypeStruct((BN, T, V), cfg.dt), jax.ShapeDtypeStruct((BN, K, V), cfg.dt),
               jax.ShapeDtypeStruct((BN, nC, K, V), cfg.dt)]

  def kernel(*refs):
    r = dict(zip(names, refs[:len(names)], strict=True))
    s0_ref, o_ref, st_ref, starts_ref, S_sc = refs[len(names):]
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _init():
      S_sc[...] = s0_ref[...]

    S = S_sc[...]
    o, S_new = chunk_forward({n: r[n][...] for n in names}, S)
    o_ref[...] = o
    starts_ref[...] = S
    S_sc[...] = S_new

    @pl.when(c == nC - 1)
    def _finish():
      st_ref[...] = S_new

  return tuple(_tpu_call(cfg, kernel, "fwd", (BN, nC), ops, out_specs, out_shape,
                         [pltpu.VMEM((K, V), cfg.dt)]))


def _tpu_backward(cfg: _Cfg, x: dict, starts, do, dS_T):
  BN, T, K = x["q"].shape
  V, C = x["u"].shape[-1], cfg.chunk
  nC = T // C
  rev = lambda c: nC - 1 - c
  ops, names = _tpu_specs(cfg, x, nC, reverse=True)
  state = pl.BlockSpec((None, K, V), lambda i, c: (i, 0, 0))
  ops += [(pl.BlockSpec((None, None, K, V), lambda i, c: (i, rev(c), 0, 0)), starts),
          (pl.BlockSpec((None, C, V), lambda i, c: (i, rev(c), 0)), do), (state, dS_T)]
  outs = _names(cfg, DIFF)
  out_specs, out_shape = [], []
  for n in outs:
    if n in SEQ:
      X = x[n].shape[-1]
      out_specs.append(pl.BlockSpec((None, C, X), lambda i, c: (i, rev(c), 0)))
      out_shape.append(jax.ShapeDtypeStruct((BN, T, X), cfg.dt))
    else:
      out_specs.append(pl.BlockSpec((None, None, 1, C), lambda i, c: (i, rev(c), 0, 0)))
      out_shape.append(jax.ShapeDtypeStruct((BN, nC, 1, C), cfg.dt))
  out_specs.append(state)
  out_shape.append(jax.ShapeDtypeStruct((BN, K, V), cfg.dt))

  def kernel(*refs):
    r = dict(zip(names, refs[:len(names)], strict=True))
    starts_ref, do_ref, dst_ref = refs[len(names):len(names) + 3]
    out_refs = refs[len(names) + 3:-2]
    ds0_ref, dS_sc = refs[-2:]
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _init():
      dS_sc[...] = dst_ref[...]

    grads, dS_start = chunk_backward({n: r[n][...] for n in names}, starts_ref[...],
                                     do_ref[...], dS_sc[...])
    for n, ref in zip(outs, out_refs, strict=True):
      ref[...] = grads[n]
    dS_sc[...] = dS_start

    @pl.when(c == nC - 1)
    def _finish():
      ds0_ref[...] = dS_start

  res = _tpu_call(cfg, kernel, "bwd", (BN, nC), ops, out_specs, out_shape,
                  [pltpu.VMEM((K, V), cfg.dt)])
  grads = {n: (a.reshape(BN, nC, C) if n in ROWS else a)
           for n, a in zip(outs, res[:-1], strict=True)}
  return grads, res[-1]


# --------------------------------------------------------------------------------------
# The custom VJP around the kernels.


def _forward(cfg: _Cfg, x, S0):
  if cfg.backend == "triton":
    return _triton_forward(cfg, x, S0)
  return _tpu_forward(cfg, x, S0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg: _Cfg, x: dict, S0):
  """``(o [BN, T, V], S_T [BN, K, V])`` of the chunk inputs ``x`` (canonical layouts)."""
  o, S_T, _ = _forward(cfg, x, S0)
  return o, S_T


def _core_fwd(cfg, x, S0):
  o, S_T, starts = _forward(cfg, x, S0)
  # Residuals: the chunk inputs and the chunk-start states [BN, T / C, K, V] only (and an
  # empty slice of S0: its type, the mesh axes it varies over inside shard_map).
  return (o, S_T), (x, starts, S0[:0])


def _core_bwd(cfg, res, cts):
  x, starts, _ = res
  do, dS_T = cts
  backward = _triton_backward if cfg.backend == "triton" else _tpu_backward
  grads, dS0 = backward(cfg, x, starts, do.astype(cfg.dt), dS_T.astype(cfg.dt))
  # None for the run ids; inside shard_map (check_vma) an input the caller left invariant
  # over a mesh axis (the zero decays without `g`) gets its cotangent summed over that axis
  dx = {n: None if grads.get(n) is None else _chunk.sum_like(grads[n], a) for n, a in x.items()}
  return dx, _chunk.sum_like(dS0, res[2])


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------------------
# The XLA preparation (differentiated by autodiff) and the entry point.


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def check_chunk(chunk: int, T: int, backend: str, fn_name: str = "chunked") -> int:
  """The chunk length the linear-recurrence kernels use for a requested one.

  ``chunk`` itself, or for ``T < chunk`` the shortest legal chunk holding ``T``: Triton
  needs a power of two >= 16, Mosaic TPU a multiple of 8.

  Args:
    chunk: the requested chunk length (``chunk_size``).
    T: the sequence length.
    backend: ``"triton"`` or ``"mosaic_tpu"``.
    fn_name: the caller's name, for the error message.

  Returns:
    The chunk length, an int.

  Raises:
    ValueError: a chunk the backend cannot tile, or an unknown backend.

  Examples:
    >>> from kernels_pallas import linear
    >>> linear.check_chunk(64, 40, "triton"), linear.check_chunk(64, 40, "mosaic_tpu")
    (64, 40)
    >>> linear.check_chunk(24, 100, "triton")
    Traceback (most recent call last):
    ...
    ValueError: chunked: `chunk_size` must be a power of two >= 16 for the Triton kernels, got 24

  References:
    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention
    Transformers with Hardware-Efficient Training" (the chunkwise form and its chunk).
  """
  check_backend(backend, fn_name)
  if backend == "triton":
    if chunk < 16 or chunk & (chunk - 1):
      raise ValueError(f"{fn_name}: `chunk_size` must be a power of two >= 16 for the Triton "
                       f"kernels, got {chunk}")
    return min(chunk, max(16, _next_pow2(T)))
  if chunk % 8:
    raise ValueError(
        f"{fn_name}: `chunk_size` must be a multiple of 8 for the Mosaic TPU kernels, got {chunk}")
  return min(chunk, -(-T // 8) * 8)


def _masked_exp(mask, x):
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


def _ut_form(kc, vc, bc, fq, G, rel):
  """The delta rule's ``W = (I + A)^{-1} diag(beta f^q) K`` and ``\\tilde U = (I + A)^{-1}
  (beta ⊙ V)`` of every chunk, ``A_ij = beta_i e^{G_i - G_j} k_i · k_j`` (``j < i``, same
  run), by :func:`jaxsoft.linear.recurrence.unit_lower_inverse`."""
  C = kc.shape[-2]
  i = jnp.arange(C)
  same = rel[..., :, None] == rel[..., None, :]
  below = i[:, None] > i[None, :]
  strict = (same & below.reshape((1,) * (same.ndim - 2) + below.shape))[:, None]
  b = bc[..., None]
  A = b * jnp.einsum("...ik,...jk->...ij", kc, kc) * _masked_exp(
      strict, G[..., :, None] - G[..., None, :])
  T_inv = _recurrence.unit_lower_inverse(A)                            # (I + A)^{-1}
  return T_inv @ (b * fq[..., None] * kc), T_inv @ (b * vc)


def _pad_last(x, size: int):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def chunked(q, k, v, g, beta, run, S0, *, chunk: int, backend: str = "triton",
            interpret: bool = False, segments: bool = True,
            block_v: int | None = None, layout=None) -> tuple[jax.Array, jax.Array]:
  r"""The chunked scalar-decay linear recurrence (simple GLA, Lightning, delta rule) in Pallas.

  Per batch and head, with ``S_0`` the initial state:

  .. math::
    \tilde S_t = e^{g_t} S_{t-1}, \qquad S_t = \tilde S_t + k_t u_t^\top, \qquad
    o_t = S_t^\top q_t,

  ``u_t = v_t`` without ``beta``, ``u_t = \beta_t (v_t - \tilde S_t^\top k_t)`` (the
  gated delta rule) with it; a change of ``run`` resets the state to 0. Computed in chunks
  of ``chunk`` tokens (see the module docstring); the same layout and result as
  :func:`jaxsoft.linear.recurrence.chunked`, differentiable in every array input.

  Args:
    q, k: ``[B, N, T, K]`` float32 (``q`` scaled; float64 computes in float64, for tests);
      v: ``[B, N, T, V]``; every array in the dtype of ``q``.
    g: ``[B, N, T]`` log decays (one per head and token) or None (no decay).
    beta: ``[B, N, T]`` delta-rule write strengths, or None (``u = v``).
    run: ``[B, T]`` int32 run ids (``_chunk.run_ids``; a change resets the state).
    S0: ``[B, N, K, V]`` float32.
    chunk: the chunk length (see :func:`check_chunk`).
    backend: ``"triton"`` or ``"mosaic_tpu"``.
    interpret: run the kernels in the Pallas interpreter (CPU); a ``pltpu.InterpretParams``
      selects TPU interpret mode for the Mosaic driver.
    segments: False when ``run`` is all zeros (the kernels then skip the run masks).
    block_v: Triton only: the value columns per program, a power of two >= 16 (default:
      the padded V up to 64); the grid is (B·N, V_pad / block_v).
    layout: None, or ``(mesh, batch_axis, head_axis)`` (what
      :func:`kernels_pallas.sharding.call_layout` finds for inputs sharded on a mesh outside
      ``jax.shard_map``): XLA does not partition a ``pallas_call``, so the kernels then run
      under ``jax.shard_map`` on each device's shard of B (``batch_axis``) and N
      (``head_axis``), each a mesh axis name or None; the result is sharded the same way.

  Returns:
    ``(o [B, N, T, V], S_T [B, N, K, V])`` float32.

  Examples:
    Simple GLA (a log decay per token, no ``beta``) in interpret mode on CPU, against the
    XLA chunked form:

    >>> import functools
    >>> from jaxsoft.linear import recurrence
    >>> from kernels_pallas import linear
    >>> ks = jax.random.split(jax.random.key(0), 4)
    >>> q = jax.random.normal(ks[0], (1, 1, 32, 16)) / 4          # [B, N, T, K], scaled
    >>> k = jax.random.normal(ks[1], (1, 1, 32, 16)) / 4
    >>> v = jax.random.normal(ks[2], (1, 1, 32, 16))
    >>> g = -jax.nn.softplus(jax.random.normal(ks[3], (1, 1, 32)))  # log decays
    >>> run, S0 = jnp.zeros((1, 32), jnp.int32), jnp.zeros((1, 1, 16, 16))
    >>> pallas = jax.jit(functools.partial(linear.chunked, chunk=16, interpret=True,
    ...                                    segments=False))
    >>> xla = jax.jit(functools.partial(recurrence.chunked, chunk=16))
    >>> (o, S), (o_ref, S_ref) = pallas(q, k, v, g, None, run, S0), xla(q, k, v, g, None, run, S0)
    >>> o.shape, bool(jnp.allclose(o, o_ref, atol=1e-5)), bool(jnp.allclose(S, S_ref, atol=1e-5))
    ((1, 1, 32, 16), True, True)

  References:
    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention
    Transformers with Hardware-Efficient Training".

    Z. Qin, W. Sun, D. Li, X. Shen, W. Sun & Y. Zhong, 2024, "Lightning Attention-2: A
    Free Lunch for Handling Unlimited Sequence Lengths in Large Language Models".

    S. Yang, B. Wang, Y. Zhang, Y. Shen & Y. Kim, 2024, "Parallelizing Linear Transformers
    with the Delta Rule over Sequence Length".

    S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving Mamba2 with
    Delta Rule".
  """
  if layout is not None:
    return _on_mesh(layout, q, k, v, g, beta, run, S0, chunk=chunk, backend=backend,
                    interpret=interpret, segments=segments, block_v=block_v)
  B, N, T, K = q.shape
  V = v.shape[-1]
  if g is not None and g.ndim != 3:
    raise ValueError("chunked: the Pallas kernels take one log decay per head and token "
                     f"(`g` [B, N, T]), got shape {g.shape}")
  C = check_chunk(chunk, T, backend)
  pad = (-T) % C
  nC = (T + pad) // C
  q, k, v = (_chunk.pad_time(x, 2, pad) for x in (q, k, v))
  g = jnp.zeros((B, N, T + pad), q.dtype) if g is None else _chunk.pad_time(g, 2, pad)
  run = _chunk.pad_time(run, 1, pad, mode="edge")
  rc = _chunk.to_chunks(run, 1, C)                                     # [B, nC, C]
  run_prev = jnp.concatenate([rc[:, :1, 0], rc[:, :-1, -1]], axis=1)
  rel = rc - run_prev[..., None]                                       # runs since chunk start
  sees_start = (rel == 0)[:, None]                                     # [B, 1, nC, C]
  reaches_end = (rel == rel[..., -1:])[:, None]
  carries = (rel[..., -1] == 0)[:, None]                               # [B, 1, nC]

  G = jnp.cumsum(_chunk.to_chunks(g, 2, C), axis=3)                    # [B, N, nC, C]
  G_last = G[..., -1]
  fq = _masked_exp(sees_start, G)
  fk = _masked_exp(reaches_end, G_last[..., None] - G)
  ds = jnp.broadcast_to(_masked_exp(carries, G_last)[..., None], G.shape)
  qc, kc, vc = (_chunk.to_chunks(x, 2, C) for x in (q, k, v))          # [B, N, nC, C, X]
  w = None
  u = vc
  if beta is not None:
    bc = _chunk.to_chunks(_chunk.pad_time(beta, 2, pad), 2, C)
    # Rematerialised in the backward pass: no [C, C] array (A, the inverse) is kept.
    w, u = jax.checkpoint(_ut_form)(kc, vc, bc, fq, G, rel)

  Kp, Vp = K, V
  if backend == "triton":   # tensor-core dots: power-of-two head dims >= 16
    Kp, Vp = max(16, _next_pow2(K)), max(16, _next_pow2(V))
    block_v = min(Vp, 64) if block_v is None else block_v
    if block_v < 16 or block_v & (block_v - 1):
      raise ValueError(f"chunked: `block_v` must be a power of two >= 16, got {block_v}")
    block_v = min(block_v, Vp)
  else:
    block_v = V
  BN, Tp = B * N, T + pad
  seq = lambda a, X: _pad_last(a.reshape(BN, Tp, a.shape[-1]), X)
  col = lambda a: a.reshape(BN, Tp, 1)
  x = dict(q=seq(qc, Kp), k=seq(kc, Kp), u=seq(u, Vp), gc=col(G), fq=col(fq), fk=col(fk),
           gr=G.reshape(BN, nC, C), ds=ds.reshape(BN, nC, C))
  if w is not None:
    x["w"] = seq(w, Kp)
  if segments:
    rel_bn = jnp.broadcast_to(rel[:, None], (B, N, nC, C)).astype(jnp.int32)
    x["rc"] = rel_bn.reshape(BN, Tp, 1)
    x["rr"] = rel_bn.reshape(BN, nC, C)
  interpret = interpret if isinstance(interpret, pltpu.InterpretParams) else bool(interpret)
  cfg = _Cfg(backend, interpret, C, beta is not None, segments, block_v,
             "float64" if q.dtype == jnp.float64 else "float32")
  S0p = jnp.pad(S0.astype(q.dtype).reshape(BN, K, V), ((0, 0), (0, Kp - K), (0, Vp - V)))
  o, S_T = _core(cfg, x, S0p)
  o = o[:, :T, :V].reshape(B, N, T, V)
  return o, S_T[:, :K, :V].reshape(B, N, K, V)


def _on_mesh(layout, q, k, v, g, beta, run, S0, **kwargs):
  """:func:`chunked` under ``jax.shard_map`` over ``layout = (mesh, batch_axis, head_axis)``:
  ``[B, N, ...]`` arrays split over both axes, the run ids ``[B, T]`` over the batch axis;
  the output and final state come back split the same way (as the attention kernels do,
  :func:`kernels_pallas.sharding.sharded_attention_from_call`)."""
  from kernels_pallas import sharding  # here: it imports jaxsoft.attention, which loads late

  mesh, batch, head = layout
  bn = lambda nd: PartitionSpec(batch, head, *([None] * (nd - 2)))
  args = dict(q=q, k=k, v=v, g=g, beta=beta, run=run, S0=S0)
  specs = {n: None if a is None else (PartitionSpec(batch, None) if n == "run" else bn(a.ndim))
           for n, a in args.items()}
  args = {n: sharding._put(mesh, a, specs[n]) for n, a in args.items()}
  fn = jax.shard_map(lambda a: chunked(**a, **kwargs), mesh=mesh, in_specs=(specs,),
                     out_specs=(bn(4), bn(4)), check_vma=False)
  # eagerly (concrete arrays), one compiled program instead of shard_map's op-by-op run
  return (fn if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
          else jax.jit(fn))(args)
