r"""K12: Edge-MoE's single-pass softmax as a Pallas kernel (Triton and Mosaic TPU).

The recurrence of :func:`jaxsoft.normalizers.single_pass_softmax`, in its dataflow: a
block of rows is processed in parallel (the rows lie along the lanes: the input is read
transposed, ``[S, rows]``), and the row's entries stream one at a time through the
running maximum ``b`` and sum ``s`` (:func:`jaxsoft.normalizers.single_pass.single_pass_update`,
the same function, so the kernel and the reference do the same float operations in the
same order); a second loop over chunks of the (VMEM- or cache-resident) tile writes
``q(q(e^{q(x - b)}) q(1/s))``. In Edge-MoE the accelerator streams the keys of
``ATTN_MATMUL_PARALLEL`` query rows one per cycle in the same way
(R. Sarkar et al. 2023, "Edge-MoE", ICCAD; sharc-lab/Edge-MoE ``src/attention.cpp``).

The gradient (``jax.custom_vjp``) is softmax's, computed in XLA from the saved input:
the straight-through rule of the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxsoft.normalizers import single_pass as sp
from kernels_pallas.backends import BACKENDS, hide_masked, row_grid_params

__all__ = ["single_pass_softmax"]

_NAME = "single_pass_softmax"


def _err(msg: str) -> ValueError:
  return ValueError(f"kernels_pallas.{_NAME}: {msg}")


def _pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _state(xj, state, fmt):
  """One streamed entry per row (``xj [1, br]``, -inf = hidden) into ``(b, s)``."""
  b, s = state
  visible = xj > -jnp.inf
  xq = sp.fixed_point_quantize(jnp.where(visible, xj, 0.0), fmt)
  return sp.single_pass_update(b, s, xq, fmt, visible)


def _weights(xc, b, s, fmt):
  visible = xc > -jnp.inf
  xq = sp.fixed_point_quantize(jnp.where(visible, xc, 0.0), fmt)
  return jnp.where(visible, sp.single_pass_weights(xq, b, s, fmt), 0.0)


def _kernel(x_ref, o_ref, *, fmt, chunk: int, s_len: int, unroll: int):
  br = x_ref.shape[1]
  floor = -(2.0 ** (fmt[1] - 1)) if fmt is not None else float(np.finfo(np.float32).min)
  init = (jnp.full((1, br), floor, jnp.float32), jnp.zeros((1, br), jnp.float32))
  if unroll == 1:  # Triton: one row of the tile per step (a [1, br] load)
    def entry(j, state):
      return _state(x_ref[pl.ds(j, 1), :].astype(jnp.float32), state, fmt)

    b, s = jax.lax.fori_loop(0, s_len, entry, init)
  else:  # Mosaic: an aligned block of `unroll` sublanes per step, its rows in order
    def group(g, state):
      xs = x_ref[pl.ds(pl.multiple_of(g * unroll, unroll), unroll), :].astype(jnp.float32)
      for r in range(unroll):
        state = _state(xs[r:r + 1, :], state, fmt)
      return state

    b, s = jax.lax.fori_loop(0, -(-s_len // unroll), group, init)

  def out(c, _):
    sl = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    o_ref[sl, :] = _weights(x_ref[sl, :].astype(jnp.float32), b, s, fmt).astype(o_ref.dtype)
    return 0

  jax.lax.fori_loop(0, x_ref.shape[0] // chunk, out, 0)


def _forward(x2, fmt, backend: str, interpret: Any, block_rows: int | None):
  """``x2 [R, S]`` (-inf = hidden) -> weights ``[R, S]`` in x2's dtype."""
  r, s_len = x2.shape
  if backend == "triton":
    br = _pow2(max(16, min(block_rows or 32, r)))
    s_pad, unroll = _pow2(max(s_len, 16)), 1
    chunk = min(s_pad, 64)
  else:
    br, unroll = block_rows or 128, 8
    if br % 128:
      raise _err(f"`block_rows` must be a multiple of 128 for Mosaic TPU, got {block_rows!r}")
    s_pad = -(-s_len // 8) * 8
    chunk = 8
  r_pad = -(-r // br) * br
  xt = jnp.pad(x2.T, ((0, s_pad - s_len), (0, r_pad - r)), constant_values=-jnp.inf)
  kernel = functools.partial(_kernel, fmt=fmt, chunk=chunk, s_len=s_len, unroll=unroll)
  spec = pl.BlockSpec((s_pad, br), lambda i: (0, i))
  params, interp = row_grid_params(backend, interpret)
  out = pl.pallas_call(
      kernel, grid=(r_pad // br,), in_specs=[spec], out_specs=spec,
      out_shape=jax.ShapeDtypeStruct((s_pad, r_pad), x2.dtype), compiler_params=params,
      interpret=interp, name="jaxsoft_single_pass_softmax")(xt)
  return out[:s_len, :r].T


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _call(x2, fmt, backend, interpret, block_rows):
  return _forward(x2, fmt, backend, interpret, block_rows)


def _call_fwd(x2, fmt, backend, interpret, block_rows):
  return _forward(x2, fmt, backend, interpret, block_rows), x2


def _call_bwd(fmt, backend, interpret, block_rows, x2, g):
  visible = x2 > -jnp.inf
  w = jax.nn.softmax(x2.astype(jnp.float32), axis=-1, where=visible)
  w = jnp.where(visible, w, 0.0)
  gf = g.astype(jnp.float32)
  return ((w * (gf - jnp.sum(w * gf, axis=-1, keepdims=True))).astype(x2.dtype),)


_call.defvjp(_call_fwd, _call_bwd)


def single_pass_softmax(x, where=None, *, fixed_point=sp.EDGE_MOE_FIXED_POINT,
                        backend: str = "triton", interpret: Any = False,
                        block_rows: int | None = None) -> jax.Array:
  r"""Edge-MoE's single-pass softmax over the last axis, as a Pallas kernel (K12).

  The entries of each row stream in order through the running maximum and sum, then the
  weights are formed from ``(b, 1/s)``, every step truncated to ``ap_fixed<W, I>``
  (:func:`jaxsoft.normalizers.single_pass_softmax`, which it equals up to float rounding
  flipping a truncation: a few grid steps ``2^{-(W - I)}``):

  .. math::
    w_j = q\big(q(e^{q(\hat x_j - b)})\, q(1/s)\big), \qquad
    |w_j - \operatorname{softmax}(x)_j| \le (2n + 6)\, 2^{-(W - I)}.

  Hidden entries (``where`` False, or ``-inf``) are skipped and get 0; a row with none
  visible is 0. NaN and ``+inf`` follow the arithmetic (no special rule: the reference
  function has the library's rules). Forward in the kernel, gradient softmax's
  (straight-through, in XLA).

  Args:
    x: ``[..., S]`` scores (float; computed in float32).
    where: optional boolean mask broadcastable to x.
    fixed_point: ``(W, I)`` total and integer bits (default Edge-MoE's ``(32, 10)``) or
      None for float32.
    backend: "triton" (GPU) or "mosaic_tpu".
    interpret: run in the Pallas interpreter (CPU).
    block_rows: rows per program (Triton: default 32, a power of two; Mosaic: a multiple
      of 128, default 128). The tile ``[S, block_rows]`` (S padded: Triton to a power of
      two, Mosaic to a multiple of 8) is one block: Mosaic needs it in VMEM twice (input
      and output, double-buffered), about ``16 S block_rows`` bytes.

  Returns:
    x's shape and dtype.

  Examples:
    >>> from kernels_pallas import single_pass
    >>> x = jnp.array([[1.0, 3.0, 2.0, -1.5], [0.5, 0.5, -2.0, 0.0]])
    >>> w = jax.jit(functools.partial(single_pass.single_pass_softmax, interpret=True))(x)
    >>> w
    Array([[0.0894, 0.6604, 0.2429, 0.0073],
           [0.3719, 0.3719, 0.0305, 0.2256]], dtype=float32)
    >>> bool(jnp.allclose(w, js.normalizers.single_pass_softmax(x), atol=1e-6))
    True

  References:
    R. Sarkar, H. Liang, Z. Fan, Z. Wang & C. Hao, 2023, "Edge-MoE: Memory-Efficient
    Multi-Task Vision Transformer Architecture with Task-level Sparsity via
    Mixture-of-Experts" (ICCAD).

    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".
  """
  if backend not in BACKENDS:
    raise _err(f"`backend` must be one of {BACKENDS}, got {backend!r}")
  try:
    fmt = sp.check_fixed_point(fixed_point, _NAME)
  except ValueError as e:
    raise _err(str(e).split(": ", 1)[1]) from None
  x = jnp.asarray(x)
  if x.ndim < 1 or x.shape[-1] < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise _err(f"`x` must be a float array [..., S] with S >= 1, got {x.dtype}{list(x.shape)}")
  if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(
      block_rows, (int, np.integer)) or block_rows < 1):
    raise _err(f"`block_rows` must be a positive int or None, got {block_rows!r}")
  x = hide_masked(x, where, _err)
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  out = _call(x2, fmt, backend, interpret, block_rows)
  return out.reshape(x.shape).astype(x.dtype)
