r"""K05 / K06: the two-pass (mantissa, exponent) softmax as a Pallas kernel, and a
polynomial ``exp2`` for kernels.

:func:`two_pass_softmax` is the algorithm of Dukhan & Ablavatski (2020) over rows of
``[rows, n]``: pass 1 turns every entry into a pair ``e^x = m 2^k`` (``k`` an integer,
``m = e^r`` with ``r = x - k ln 2`` in ``[-ln 2 / 2, ln 2 / 2]``) and accumulates the pairs
lane by lane, ``(M, K) <- (M 2^{K - K'} + m 2^{k - K'}, K' = max(K, k))``, without a pass
for the row max; the lanes merge at the end of the row; pass 2 recomputes the pairs and
writes ``y = (m / M) 2^{k - K}``. Each pass reads the row once (the three-pass softmax
reads it twice before writing it). The reference is the plain-jnp
:func:`jaxsoft.normalizers.two_pass_softmax`.

:func:`exp2_poly` is ``2^x`` by range reduction into the exponent bits and a polynomial
(K06, "software exp2": the exponential off the special-function unit);
``two_pass_softmax(..., exp="poly")`` computes its mantissas with it.

The drivers (Triton, Mosaic TPU) share :func:`row_call`: a program owns ``block_rows``
whole rows (the tile ``[block_rows, n_pad]``) and loops over column chunks of it, so the
kernel bodies here and in :mod:`kernels_pallas.quantized` are written once.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kernels_pallas.backends import BACKENDS, hide_masked, row_grid_params

__all__ = ["two_pass_softmax", "exp2_poly", "EXP2_POLY_COEFFS", "EXP2_POLY_MAX_REL_ERR",
           "row_call", "round_half_even", "pow2_int"]

_NAME = "two_pass_softmax"
_LOG2E = 1.0 / math.log(2.0)


def _err(name: str, msg: str) -> ValueError:
  return ValueError(f"kernels_pallas.{name}: {msg}")


# --- float helpers that lower in Triton and Mosaic (no lax.round in Pallas Triton) ---------


def round_half_even(z):
  """``jnp.round(z)`` (half to even) from ``floor``, exactly, for every float32 ``z``.

  ``z + 1/2`` is exact below ``2^23`` (and above, ``z`` is an integer already); a tie is
  ``floor(z + 1/2) - z == 1/2``, sent to the even neighbour. Pallas Triton has no
  ``round`` primitive.
  """
  r = jnp.floor(z + 0.5)
  odd = (r - 2.0 * jnp.floor(0.5 * r)) != 0.0
  r = jnp.where(((r - z) == 0.5) & odd, r - 1.0, r)
  return jnp.where(jnp.abs(z) >= 2.0 ** 23, z, r)


def pow2_int(d):
  """``2^d`` for integer-valued float32 ``d``, exactly, built from the exponent bits.

  Normal powers only: ``d < -126`` gives 0 (flushed, as the hardware's FTZ does) and
  ``d > 127`` gives ``+inf``; NaN gives 0 (callers keep NaN themselves).
  """
  dc = jnp.clip(jnp.where(jnp.isnan(d), -127.0, d), -127.0, 128.0)
  bits = jax.lax.shift_left(dc.astype(jnp.int32) + 127, jnp.int32(23))
  p = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return jnp.where(dc < -126.0, 0.0, p)


# --- K06: polynomial exp2 ------------------------------------------------------------------


def _exp2_coeffs(degree: int = 6) -> tuple[float, ...]:
  """Power-basis coefficients (low to high) of the Chebyshev interpolant of ``2^f`` on
  ``[-1/2, 1/2]`` (near-minimax: within a factor ~1.1 of the best error), float64 then
  rounded to float32."""
  cheb = np.polynomial.chebyshev.Chebyshev.interpolate(
      lambda f: np.exp2(f), degree, domain=[-0.5, 0.5])
  power = cheb.convert(kind=np.polynomial.Polynomial, domain=[-1, 1], window=[-1, 1])
  return tuple(float(np.float32(c)) for c in power.coef)


EXP2_POLY_COEFFS = _exp2_coeffs()
# max |exp2_poly(x) / 2^x - 1| over every float32 x in [-1/2, 1/2] (2^24 of them) and over
# the normal range on a dense grid, in float64 (tests/kernels_pallas/test_two_pass.py
# measures it): the degree-6 interpolant itself is within 1.2e-9; float32 Horner adds the
# rest (measured: 8.3e-8, 1.39 units of 2^-24)
EXP2_POLY_MAX_REL_ERR = 1.2e-7


def exp2_poly(x):
  r"""``2^x`` in software: range reduction into the exponent bits, a polynomial for the rest (K06).

  .. math::
    n = \mathrm{round}(x),\quad f = x - n \in [-\tfrac12, \tfrac12],\quad
    2^x = 2^n \cdot p(f),\quad p(f) = \sum_{i=0}^{6} c_i f^i\ \text{(Horner)},

  ``p`` the degree-6 Chebyshev interpolant of ``2^f`` on ``[-1/2, 1/2]``
  (:data:`EXP2_POLY_COEFFS`), ``2^n`` written straight into the exponent field. Only
  multiply-adds, a floor and integer bit operations: usable inside Pallas kernels
  (Triton and Mosaic) in place of the special-function unit's ``ex2``. Error: the
  relative error against float64 ``2^x`` is below :data:`EXP2_POLY_MAX_REL_ERR`
  (``1.2e-7``, 2 units of 2^-24; measured 8.3e-8) for ``x`` in ``[-126, 128)`` (normal results); below ``-126``
  the result is flushed to 0, from 128 on it is ``+inf``; NaN stays NaN. Computed in
  float32.

  Args:
    x: exponents (any float dtype; computed in float32).

  Returns:
    ``2^x`` in float32, ``x``'s shape.

  Examples:
    >>> from kernels_pallas.two_pass import exp2_poly
    >>> exp2_poly(jnp.array([0.0, 0.5, -3.25, 10.0]))
    Array([1.0000e+00, 1.4142e+00, 1.0511e-01, 1.0240e+03], dtype=float32)

  References:
    W. J. Cody & W. Waite, 1980, "Software Manual for the Elementary Functions".

    M. Dukhan & A. Ablavatski, 2020, "The Two-Pass Softmax Algorithm".
  """
  x = jnp.asarray(x).astype(jnp.float32)
  xc = jnp.clip(x, -200.0, 200.0)
  n = jnp.floor(xc + 0.5)
  f = xc - n  # exact
  p = jnp.full_like(f, EXP2_POLY_COEFFS[-1])
  for c in EXP2_POLY_COEFFS[-2::-1]:
    p = p * f + c
  # 2^n p in two exact steps, so that p < 1 at n = 128 stays finite only if it should
  half = jnp.floor(0.5 * n)
  y = (p * pow2_int(half)) * pow2_int(n - half)
  y = jnp.where(n < -126.0, 0.0, y)
  return jnp.where(jnp.isnan(x), x, y)


# --- the row driver shared with kernels_pallas.quantized -----------------------------


def _pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def check_block_rows(block_rows, name: str) -> None:
  if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(
      block_rows, (int, np.integer)) or block_rows < 1):
    raise _err(name, f"`block_rows` must be a positive int or None, got {block_rows!r}")


def prepare_rows(x, where, name: str):
  """``x [..., n]`` (float) and ``where`` -> rows ``[R, n]`` in x's dtype (float64 ->
  float32), hidden entries -inf."""
  x = jnp.asarray(x)
  if x.ndim < 1 or x.shape[-1] < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise _err(name, f"`x` must be a float array [..., n] with n >= 1, got {x.dtype}{list(x.shape)}")
  x2 = hide_masked(x.astype(jnp.float32) if x.dtype == jnp.float64 else x, where,
                   lambda message: _err(name, message)).reshape(-1, x.shape[-1])
  return x, x2


def row_call(body, x2, *, backend: str, interpret: Any, block_rows: int | None, name: str,
             chunk: int = 512):
  """Run ``body(x_ref, o_ref, n_chunks, chunk)`` over ``x2 [R, n]``: one program per
  ``block_rows`` whole rows, padded with -inf (rows and columns) where needed.

  Triton: ``block_rows`` a power of two (default 8), ``n`` padded to a power of two, chunks
  of ``min(n_pad, chunk)`` columns. Mosaic: ``block_rows`` a multiple of 8 (default 8, 16
  for 16-bit dtypes),
  ``n`` padded to a multiple of the chunk (a multiple of 128). Returns ``[R, n]`` in x2's
  dtype.
  """
  r, n = x2.shape
  if backend == "triton":
    br = _pow2(block_rows or 8)
    n_pad = _pow2(max(n, 16))
    ch = min(n_pad, chunk)
  else:  # 16-bit dtypes tile by 16 sublanes
    br = block_rows or (8 if x2.dtype.itemsize >= 4 else 16)
    if br % 8:
      raise _err(name, f"`block_rows` must be a multiple of 8 for Mosaic TPU, got {block_rows!r}")
    ch = min(-(-n // 128) * 128, chunk)
    n_pad = -(-n // ch) * ch
  r_pad = -(-r // br) * br
  xp = x2
  if (r_pad, n_pad) != (r, n):
    xp = jnp.pad(x2, ((0, r_pad - r), (0, n_pad - n)), constant_values=-jnp.inf)
  kernel = functools.partial(body, n_chunks=n_pad // ch, chunk=ch)
  spec = pl.BlockSpec((br, n_pad), lambda i: (i, 0))
  params, interp = row_grid_params(backend, interpret)
  out = pl.pallas_call(
      kernel, grid=(r_pad // br,), in_specs=[spec], out_specs=spec,
      out_shape=jax.ShapeDtypeStruct((r_pad, n_pad), x2.dtype), compiler_params=params,
      interpret=interp, name=f"jaxsoft_{name}")(xp)
  return out[:r, :n] if (r_pad, n_pad) != (r, n) else out


def chunk_slice(c, chunk: int):
  """The columns of chunk ``c`` (aligned: Mosaic needs multiples of 128 on lanes)."""
  return pl.ds(pl.multiple_of(c * chunk, chunk), chunk)


def row_reduce(body, init, x_ref, n_chunks: int, chunk: int):
  """``fori_loop`` over the column chunks of the tile: ``state = body(x_chunk, state)``."""
  def step(c, state):
    return body(x_ref[:, chunk_slice(c, chunk)].astype(jnp.float32), state)
  return jax.lax.fori_loop(0, n_chunks, step, init)


def row_write(fn, x_ref, o_ref, n_chunks: int, chunk: int):
  """``o[:, chunk] = fn(x[:, chunk])`` for every column chunk."""
  def step(c, carry):
    sl = chunk_slice(c, chunk)
    o_ref[:, sl] = fn(x_ref[:, sl].astype(jnp.float32)).astype(o_ref.dtype)
    return carry
  jax.lax.fori_loop(0, n_chunks, step, 0)


# --- K05: the two-pass softmax kernel --------------------------------------------------------

# ln 2 in three pieces, the first two of 12 significant bits: with k cut into two 12-bit
# halves every product k_i * C_j of the first two pieces is exact in float32
def _ln2_pieces() -> tuple[float, float, float]:
  ln2 = math.log(2.0)
  c1 = math.ldexp(round(math.ldexp(ln2, 12)), -12)
  c2 = math.ldexp(round(math.ldexp(ln2 - c1, 24)), -24)
  return c1, c2, float(np.float32(ln2 - c1 - c2))


_LN2 = _ln2_pieces()
_SPLIT = float(2 ** 12 + 1)  # Veltkamp: k = head + tail, 12 bits each (k < 2^24)
# beyond |x| = 2^22 the pairs are rough: k = round(x log2 e) alone (see the docstring)
_BIG = 2.0 ** 22
_LOW = -(2.0 ** 100)  # the exponent of a hidden entry (its mantissa is 0)


def _pairs(x, exp: str):
  """``e^x = m 2^k`` per entry: ``(m, k)``, ``m = 0`` and ``k = _LOW`` where x = -inf."""
  visible = x != -jnp.inf  # (NaN is visible: it propagates to its row)
  big = jnp.abs(x) >= _BIG
  xs = jnp.where(visible, jnp.clip(x, -1e38, 1e38), 0.0)  # (x log2 e stays finite)
  k = jnp.floor(xs * _LOG2E + 0.5)
  xr = jnp.where(big, 0.0, xs)
  kr = jnp.where(big, 0.0, k)
  big_k = kr * _SPLIT
  head = big_k - (big_k - kr)
  tail = kr - head
  r = xr
  for c in _LN2:  # Cody-Waite: x - k ln 2, largest terms first (exact until the last)
    r = (r - head * c) - tail * c
  m = jnp.exp(r) if exp == "native" else exp2_poly(r * _LOG2E)
  m = jnp.where(big, 1.0, m)
  m = jnp.where(jnp.isnan(x), x, m)
  return jnp.where(visible, m, 0.0), jnp.where(visible, k, _LOW)


def _two_pass_kernel(x_ref, o_ref, *, n_chunks: int, chunk: int, exp: str):
  br = x_ref.shape[0]

  def accumulate(xc, state):  # pass 1: lane-wise merge of (m, k) pairs, no max pass
    acc_m, acc_k = state
    m, k = _pairs(xc, exp)
    top = jnp.maximum(acc_k, k)
    return acc_m * pow2_int(acc_k - top) + m * pow2_int(k - top), top

  init = (jnp.zeros((br, chunk), jnp.float32), jnp.full((br, chunk), _LOW, jnp.float32))
  acc_m, acc_k = row_reduce(accumulate, init, x_ref, n_chunks, chunk)
  top = jnp.max(acc_k, axis=1, keepdims=True)  # the lanes merge once per row
  total = jnp.sum(acc_m * pow2_int(acc_k - top), axis=1, keepdims=True)
  inv = jnp.where(total == 0, 0.0, 1.0 / jnp.where(total == 0, 1.0, total))  # (NaN stays)

  def normalise(xc):  # pass 2: y = (m / M) 2^(k - K)
    m, k = _pairs(xc, exp)
    return (m * inv) * pow2_int(k - top)

  row_write(normalise, x_ref, o_ref, n_chunks, chunk)


def _forward(x2, exp, backend, interpret, block_rows):
  body = functools.partial(_two_pass_kernel, exp=exp)
  return row_call(body, x2, backend=backend, interpret=interpret, block_rows=block_rows,
                  name=_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _call(x2, exp, backend, interpret, block_rows):
  return _forward(x2, exp, backend, interpret, block_rows)


def _call_fwd(x2, exp, backend, interpret, block_rows):
  y = _forward(x2, exp, backend, interpret, block_rows)
  return y, y


def _call_bwd(exp, backend, interpret, block_rows, y, g):
  p = y.astype(jnp.float32)
  gf = g.astype(jnp.float32)
  return ((p * (gf - jnp.sum(p * gf, axis=-1, keepdims=True))).astype(y.dtype),)


_call.defvjp(_call_fwd, _call_bwd)


def two_pass_softmax(x, where=None, *, exp: str = "native", backend: str = "triton",
                     interpret: Any = False, block_rows: int | None = None) -> jax.Array:
  r"""Softmax over the last axis by the two-pass (mantissa, exponent) algorithm, as a Pallas kernel (K05).

  Dukhan & Ablavatski's algorithm: every ``e^{x_i}`` is a pair ``m_i 2^{k_i}``, so the sum
  cannot overflow and no pass is spent on the row max:

  .. math::
    k_i = \mathrm{round}(x_i \log_2 e),\ m_i = e^{x_i - k_i \ln 2};\quad
    (M, K) = \textstyle\bigoplus_i (m_i, k_i);\quad y_i = \frac{m_i}{M}\, 2^{k_i - K},

  :math:`(m_a, k_a) \oplus (m_b, k_b) = (m_a 2^{k_a - k} + m_b 2^{k_b - k}, k = \max(k_a,
  k_b))`, accumulated lane by lane over the row (pass 1), the pairs recomputed for the
  output (pass 2). ``x - k ln 2`` is Cody-Waite's reduction with ln 2 in three pieces and
  ``k`` cut into two 12-bit halves (exact products), so for ``|x| < 2^22`` the result is the
  float32 softmax to a few ulps whatever the row's offset (``[1e4, 1e4 - 1]`` as well as
  ``[-1e4, ...]``, where a max-free ``e^x`` would overflow or vanish). Beyond ``|x| = 2^22``
  the pair is ``(1, round(x log_2 e))``: weights within a factor ``2^{1/2 + 2^{-22}|x|}``
  of the truth, exact for ties (the jnp reference :func:`jaxsoft.normalizers.two_pass_softmax`
  is exact for every finite x). Hidden entries (``where`` False, ``-inf``) get 0; a row
  with none visible is 0; NaN propagates to its row.

  ``exp="poly"`` computes the mantissas with :func:`exp2_poly` (K06: a degree-6
  polynomial instead of the special-function unit), relative error up to 1.2e-7 more per mantissa.

  The gradient (``jax.custom_vjp``) uses the output only: ``dx = y (g - <y, g>)``.

  Args:
    x: ``[..., n]`` scores (float32, bfloat16 or float16 read as they are and computed
      in float32; float64 is computed in float32).
    where: optional boolean mask broadcastable to x.
    exp: "native" (``jnp.exp``) or "poly" (:func:`exp2_poly`).
    backend: "triton" (GPU) or "mosaic_tpu".
    interpret: run in the Pallas interpreter (CPU).
    block_rows: rows per program (Triton: a power of two; Mosaic: a multiple of 8;
      default 8, on Mosaic 16 for 16-bit dtypes). A program's tile is ``[block_rows, n_pad]`` (n padded to a power of two
      on Triton, to a multiple of 128 on Mosaic, where the tile is in VMEM twice).

  Returns:
    x's shape and dtype.

  Examples:
    >>> from kernels_pallas import two_pass
    >>> x = jnp.array([[2.0, 1.0, 0.0, -1.0], [1e4, 1e4 - 1.0, -3e4, 0.0]])
    >>> two_pass.two_pass_softmax(x, interpret=True)
    Array([[0.6439, 0.2369, 0.0871, 0.0321],
           [0.7311, 0.2689, 0.    , 0.    ]], dtype=float32)
    >>> y = two_pass.two_pass_softmax(x, exp="poly", interpret=True)
    >>> bool(jnp.allclose(y, js.normalizers.two_pass_softmax(x), atol=1e-6))
    True

  References:
    M. Dukhan & A. Ablavatski, 2020, "The Two-Pass Softmax Algorithm".

    W. J. Cody & W. Waite, 1980, "Software Manual for the Elementary Functions".
  """
  if backend not in BACKENDS:
    raise _err(_NAME, f"`backend` must be one of {BACKENDS}, got {backend!r}")
  if exp not in ("native", "poly"):
    raise _err(_NAME, f"`exp` must be 'native' or 'poly', got {exp!r}")
  check_block_rows(block_rows, _NAME)
  x, x2 = prepare_rows(x, where, _NAME)
  out = _call(x2, exp, backend, interpret, block_rows)
  return out.reshape(x.shape).astype(x.dtype)
