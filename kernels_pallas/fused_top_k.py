r"""K01: fused softmax + top-k as one Pallas kernel (Triton and Mosaic TPU).

One pass over each row of logits carries both the online softmax normaliser
(Milakov & Gimelshein's ``(m, d)``: running maximum and running sum rescaled to it) and
the row's ``k`` best entries seen so far, then emits only the ``k`` normalised
probabilities and their indices: the ``[rows, n]`` probability array of
``lax.top_k(softmax(x), k)`` is never written, and ``x`` is read once.

The selection inside a block of columns is a bounded insertion loop: while some row of
the tile has a column entry that beats the worst of its ``k`` kept entries (value, then
lower index first, as ``lax.top_k`` breaks ties), that entry replaces it. A block with no
such entry costs one comparison per entry; later blocks of a long row rarely insert.

The gradient (``jax.custom_vjp``) is the softmax Jacobian restricted to the selected
entries, in XLA from the saved input and the kernel's ``(m, d)``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kernels_pallas.backends import BACKENDS, hide_masked, row_grid_params

__all__ = ["softmax_top_k"]

_NAME = "softmax_top_k"
_BIG = np.iinfo(np.int32).max  # the index of an empty slot or of a consumed entry


def _err(msg: str) -> ValueError:
  return ValueError(f"kernels_pallas.{_NAME}: {msg}")


def _pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _select(xc, ic, tv, ti, slot):
  """Insert the entries of one column block (``xc``, ``ic`` [br, bc]) into the kept list
  (``tv``, ``ti`` [br, kp]) while one of them beats the list's worst (per row)."""
  kp = tv.shape[1]
  big = jnp.int32(_BIG)

  def step(state):
    xc, ic, tv, ti, _ = state
    bv = jnp.max(xc, axis=1, keepdims=True)  # the block's best: max value, lowest index
    bi = jnp.min(jnp.where(xc == bv, ic, big), axis=1, keepdims=True)
    wv = jnp.min(tv, axis=1, keepdims=True)  # the list's worst: min value, highest index
    wi = jnp.max(jnp.where(tv == wv, ti, -1), axis=1, keepdims=True)
    ws = jnp.min(jnp.where((tv == wv) & (ti == wi), slot, kp), axis=1, keepdims=True)
    better = (bv > wv) | ((bv == wv) & (bi < wi))
    put = better & (slot == ws)
    take = better & (ic == bi)
    more = jnp.max(better.astype(jnp.float32)) > 0
    return (jnp.where(take, -jnp.inf, xc), jnp.where(take, big, ic),
            jnp.where(put, bv, tv), jnp.where(put, bi, ti), more)

  _, _, tv, ti, _ = jax.lax.while_loop(lambda s: s[-1], step, (xc, ic, tv, ti, jnp.bool_(True)))
  return tv, ti


def _kernel(x_ref, v_ref, i_ref, m_ref, d_ref, *, bc: int, n: int, cdt):
  br, kp = v_ref.shape
  big = jnp.int32(_BIG)
  slot = jax.lax.broadcasted_iota(jnp.int32, (br, kp), 1)
  col = jax.lax.broadcasted_iota(jnp.int32, (br, bc), 1)

  def block(c, carry):
    tv, ti, m, d = carry
    start = pl.multiple_of(c * bc, bc)
    xc = x_ref[:, pl.ds(start, bc)].astype(cdt)
    ic = col + c * bc
    live = ic < n
    xc = jnp.where(live, xc, -jnp.inf)  # columns padded past n: hidden and never selected
    ic = jnp.where(live, ic, big)
    # the online normaliser (m, d): d = sum_j exp(x_j - m), m the running max
    m_new = jnp.maximum(m, jnp.max(xc, axis=1, keepdims=True))
    m_use = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    d = d * jnp.exp(m - m_use) + jnp.sum(jnp.exp(xc - m_use), axis=1, keepdims=True)
    tv, ti = _select(xc, ic, tv, ti, slot)
    return tv, ti, m_new, d

  init = (jnp.full((br, kp), -jnp.inf, cdt), jnp.full((br, kp), big, jnp.int32),
          jnp.full((br, 1), -jnp.inf, cdt), jnp.zeros((br, 1), cdt))
  tv, ti, m, d = jax.lax.fori_loop(0, x_ref.shape[1] // bc, block, init)
  m_use = jnp.where(m > -jnp.inf, m, 0.0)
  has = d > 0
  v_ref[...] = jnp.where(has, jnp.exp(tv - m_use) / jnp.where(has, d, 1.0), 0.0)
  i_ref[...] = ti
  m_ref[...] = m
  d_ref[...] = d


def _kernel_call(x2, k: int, backend: str, interpret: Any, block_rows, block_cols, cdt):
  """``x2 [R, n]`` (-inf = hidden) -> (probabilities [R, kp], indices [R, kp], m, d [R, 1]):
  the row's ``kp >= k`` largest logits, unordered, and its normaliser."""
  r, n = x2.shape
  kp = _pow2(max(k, 8))
  if backend == "triton":
    br = block_rows or 16
    bc = block_cols or min(512, _pow2(max(n, 16)))
    for name, v in (("block_rows", br), ("block_cols", bc)):
      if v != _pow2(v):
        raise _err(f"`{name}` must be a power of two for Triton, got {v}")
  else:
    br, bc = block_rows or 8, block_cols or min(512, -(-n // 128) * 128)
    if br % 8 or bc % 128:
      raise _err("Mosaic TPU needs `block_rows` a multiple of 8 and `block_cols` a multiple "
                 f"of 128, got {br} and {bc}")
  r_pad, n_pad = -(-r // br) * br, -(-n // bc) * bc
  if (r_pad, n_pad) != (r, n):
    x2 = jnp.pad(x2, ((0, r_pad - r), (0, n_pad - n)), constant_values=-jnp.inf)
  kernel = functools.partial(_kernel, bc=bc, n=n, cdt=cdt)
  params, interp = row_grid_params(backend, interpret)
  row = lambda i: (i, 0)  # noqa: E731
  vals, idx, m, d = pl.pallas_call(
      kernel, grid=(r_pad // br,), in_specs=[pl.BlockSpec((br, n_pad), row)],
      out_specs=[pl.BlockSpec((br, kp), row), pl.BlockSpec((br, kp), row),
                 pl.BlockSpec((br, 1), row), pl.BlockSpec((br, 1), row)],
      out_shape=[jax.ShapeDtypeStruct((r_pad, kp), cdt),
                 jax.ShapeDtypeStruct((r_pad, kp), jnp.int32),
                 jax.ShapeDtypeStruct((r_pad, 1), cdt), jax.ShapeDtypeStruct((r_pad, 1), cdt)],
      compiler_params=params, interpret=interp, name="jaxsoft_softmax_top_k")(x2)
  return vals[:r], idx[:r], m[:r], d[:r]


def _probs(x2, m, d, cdt):
  """The dense softmax from the kernel's normaliser (hidden entries and empty rows 0)."""
  m_use = jnp.where(m > -jnp.inf, m, 0.0)
  has = d > 0
  return jnp.where(has, jnp.exp(x2.astype(cdt) - m_use) / jnp.where(has, d, 1.0), 0.0)


def _forward(x2, k: int, backend: str, interpret: Any, block_rows, block_cols):
  cdt = jnp.float64 if x2.dtype == jnp.float64 else jnp.float32
  vals, idx, m, d = _kernel_call(x2, k, backend, interpret, block_rows, block_cols, cdt)
  # lax.top_k's order: probability descending, lower index first among equal ones
  neg, idx = jax.lax.sort((-vals, idx), dimension=1, num_keys=2)
  vals, idx = -neg[:, :k], idx[:, :k]

  def zero_fill(vi):
    # a row with fewer than k nonzero probabilities: lax.top_k fills its zero slots with
    # the lowest indices among all its zero-probability entries (hidden ones, and visible
    # ones whose probability underflows), not with the next largest logits; one dense
    # pass over such batches only
    # (zero as this pass computes it, for the selected entries too: a subnormal the
    # kernel kept and XLA flushes is then one zero entry, never listed twice)
    vals, idx = vi
    n = x2.shape[1]
    p = _probs(x2, m, d, cdt)
    zero = p == 0
    lowest = jax.lax.top_k(jnp.where(zero, -jnp.arange(n, dtype=jnp.int32), -n), k)[0]
    nz = jnp.sum(jnp.take_along_axis(p, idx, axis=1) > 0, axis=1, keepdims=True)
    pos = jnp.arange(k, dtype=jnp.int32)[None, :]
    fill = jnp.take_along_axis(-lowest, jnp.clip(pos - nz, 0, k - 1), axis=1)
    return jnp.where(pos < nz, vals, 0.0).astype(vals.dtype), jnp.where(pos < nz, idx, fill)

  vals, idx = jax.lax.cond(jnp.any(vals[:, -1] == 0), zero_fill, lambda vi: vi, (vals, idx))
  return vals, idx, m, d


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _call(x2, k, backend, interpret, block_rows, block_cols):
  return _forward(x2, k, backend, interpret, block_rows, block_cols)[:2]


def _call_fwd(x2, k, backend, interpret, block_rows, block_cols):
  vals, idx, m, d = _forward(x2, k, backend, interpret, block_rows, block_cols)
  return (vals, idx), (x2, vals, idx, m, d)


def _call_bwd(k, backend, interpret, block_rows, block_cols, res, cts):
  r"""dL/dx_j = sum_i g_i p_i (delta_ij - p_j) over the selected i: the selected entries
  get g_i p_i, every entry loses p_j sum_i g_i p_i."""
  x2, vals, idx, m, d = res
  gp = cts[0].astype(vals.dtype) * vals
  rows = jnp.arange(x2.shape[0])[:, None]
  dx = jnp.zeros(x2.shape, vals.dtype).at[rows, idx].add(gp)
  dx = dx - _probs(x2, m, d, vals.dtype) * jnp.sum(gp, axis=1, keepdims=True)
  return (dx.astype(x2.dtype),)


_call.defvjp(_call_fwd, _call_bwd)


def softmax_top_k(x, k: int, where=None, *, backend: str = "triton", interpret: Any = False,
                  block_rows: int | None = None,
                  block_cols: int | None = None) -> tuple[jax.Array, jax.Array]:
  r"""Fused softmax and top-k over the last axis, as one Pallas kernel (K01).

  Returns the ``k`` largest softmax probabilities of each row and their indices, as
  ``jax.lax.top_k(jax.nn.softmax(x, where=where), k)``, from one pass over ``x`` that
  carries the online normaliser and the ``k`` best logits together:

  .. math::
    m_j = \max(m_{j-1}, x_j), \quad d_j = d_{j-1} e^{m_{j-1} - m_j} + e^{x_j - m_j}, \quad
    \mathrm{values} = e^{x_{(1..k)} - m_n} / d_n,

  with :math:`x_{(1..k)}` the row's ``k`` largest logits (equal logits: lower index
  first, as ``lax.top_k``). Values agree with the two-step form within float32 rounding
  (the sum is accumulated in another order). Indices are equal, ordered by probability and
  then index; where a row has fewer than ``k`` nonzero probabilities its zero slots are
  the lowest-index zero-probability entries, as ``lax.top_k`` gives (that case runs one
  extra dense pass). The one remaining difference: two *distinct* logits whose float32
  probabilities round to the same nonzero value at the k-th place may come in logit order
  rather than index order (the values are equal).

  Hidden entries (``where`` False, or ``-inf``) have probability 0; a row with none
  visible gives values 0 and indices ``0..k-1``. NaN logits make the row's values NaN.
  The gradient w.r.t. ``x`` of the values is the softmax Jacobian restricted to the
  selected entries, :math:`\partial L/\partial x_j = \sum_i g_i p_i (\delta_{ij} - p_j)`
  (in XLA, from the saved ``x`` and ``(m, d)``); the indices carry no gradient.

  Args:
    x: ``[..., n]`` logits, float (bf16 and float16 computed in float32, float64 in
      float64 where the backend has it).
    k: how many entries per row, ``1 <= k <= n``.
    where: optional boolean mask broadcastable to x (False = hidden).
    backend: "triton" (GPU) or "mosaic_tpu".
    interpret: run in the Pallas interpreter (CPU).
    block_rows: rows per program (Triton: a power of two, default 16; Mosaic: a multiple
      of 8, default 8). The program's rows ``[block_rows, n]`` are one block (Mosaic
      holds it in VMEM, double-buffered: ``2 block_rows n`` elements).
    block_cols: columns per step of the loop inside the kernel (Triton: a power of two,
      default ``min(512, n)`` rounded up; Mosaic: a multiple of 128, default up to 512).

  Returns:
    ``(values, indices)``: ``[..., k]`` probabilities in x's dtype and int32 indices.

  Examples:
    >>> from kernels_pallas import fused_top_k
    >>> x = jnp.array([[1.0, 3.0, 2.0, -1.5, 3.0], [0.5, 0.0, -2.0, 4.0, 1.0]])
    >>> f = jax.jit(lambda x: fused_top_k.softmax_top_k(x, 3, interpret=True))
    >>> values, indices = f(x)
    >>> values
    Array([[0.3977, 0.3977, 0.1463],
           [0.9084, 0.0452, 0.0274]], dtype=float32)
    >>> indices
    Array([[1, 4, 2],
           [3, 4, 0]], dtype=int32)
    >>> want = jax.lax.top_k(jax.nn.softmax(x), 3)
    >>> bool(jnp.allclose(values, want[0])), bool(jnp.all(indices == want[1]))
    (True, True)

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax"
    (arXiv 1805.02867).
  """
  if backend not in BACKENDS:
    raise _err(f"`backend` must be one of {BACKENDS}, got {backend!r}")
  x = jnp.asarray(x)
  if x.ndim < 1 or x.shape[-1] < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise _err(f"`x` must be a float array [..., n] with n >= 1, got {x.dtype}{list(x.shape)}")
  n = x.shape[-1]
  if not _is_int(k) or not 1 <= k <= n:
    raise _err(f"`k` must be an int in [1, n={n}], got {k!r}")
  for name, v in (("block_rows", block_rows), ("block_cols", block_cols)):
    if v is not None and (not _is_int(v) or v < 1):
      raise _err(f"`{name}` must be a positive int or None, got {v!r}")
  if backend == "mosaic_tpu" and x.dtype == jnp.float64:
    raise _err("Mosaic TPU has no float64: pass float32 (or bf16)")
  x = hide_masked(x, where, _err)
  x2 = x.reshape(-1, n)
  vals, idx = _call(x2, int(k), backend, interpret, block_rows, block_cols)
  return vals.reshape(*x.shape[:-1], k).astype(x.dtype), idx.reshape(*x.shape[:-1], k)
