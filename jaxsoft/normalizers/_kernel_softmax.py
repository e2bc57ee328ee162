"""K05: softmax as low-level kernels compute it, as reference functions.

The two-pass (mantissa, exponent) softmax, which spends no pass on the row max, and the
unified-max softmax of split-K decoding, whose chunks merge by plain addition.

Like the quantised softmaxes (K09), each is a plain-``jnp`` reading of one kernel's
arithmetic, for numerics studies against the float64 softmax; none is registered as an
attention normalizer.
"""

from __future__ import annotations

import decimal
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c

__all__ = [
    "two_pass_softmax",
    "unified_max_softmax",
    "unified_max_fallback",
]

# --- K05: two-pass softmax ------------------------------------------------------------------


def _ln4_chunks(count: int, bits: int = 12) -> tuple[float, ...]:
  """ln 4 as ``count`` floats of ``bits`` significant bits each (the last takes the rest).

  Products of a chunk and a 12-bit integer are exact in float32, so the Cody-Waite
  reduction ``x - k ln 4`` loses nothing before its final additions.
  """
  with decimal.localcontext() as ctx:
    ctx.prec = 80
    rem = decimal.Decimal(4).ln()
    out = []
    for _ in range(count - 1):
      e = math.floor(math.log2(abs(float(rem)))) - bits + 1
      q = float(round(rem / decimal.Decimal(2) ** e)) * 2.0 ** e
      out.append(q)
      rem -= decimal.Decimal(q)
    out.append(float(rem))
  return tuple(out)


# float32: 4 chunks (ln 4 to about 2^-60); float64: 10 chunks (about 2^-120).
_LN4 = {np.dtype(np.float32): _ln4_chunks(4), np.dtype(np.float64): _ln4_chunks(10)}
_K_PARTS = {np.dtype(np.float32): 2, np.dtype(np.float64): 5}  # 12-bit parts of k
# Beyond this |x|, two distinct values of the dtype are at least 128 (float32) / 1024
# (float64) apart, so exp of their difference is 0 in that dtype: only ties with the row
# max keep weight, and the mantissa needs no accurate reduction.
_HUGE = {np.dtype(np.float32): 2.0 ** 31, np.dtype(np.float64): 2.0 ** 63}
_LOG4E = 1.0 / math.log(4.0)


def _two_sum(a, b):
  """Knuth's TwoSum: ``s + e == a + b`` exactly, ``s = fl(a + b)``."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _split_12(k, parts: int):
  """Integer-valued ``k`` as a sum of ``parts`` floats of at most 12 significant bits.

  Veltkamp's splitting: ``c = k (2^s + 1)``, ``head = c - (c - k)`` is ``k`` rounded to
  ``precision - s = 12`` bits, and ``k - head`` is exact.
  """
  precision = jnp.finfo(k.dtype).nmant + 1
  factor = jnp.asarray(2.0 ** (precision - 12) + 1.0, k.dtype)
  out = []
  rem = k
  for _ in range(parts - 1):
    big = rem * factor
    head = big - (big - rem)
    out.append(head)
    rem = rem - head
  out.append(rem)
  return out


def _pow2(e, dtype):
  """``2^e`` exactly for integer-valued ``e`` in [2 emin, 0] (normal powers built from bits)."""
  info = jnp.finfo(dtype)
  bits = info.nmant
  itype = jnp.int32 if info.bits == 32 else jnp.int64
  emin = int(info.minexp)  # -126 / -1022: the smallest normal exponent

  def normal(k):  # 2^k for emin <= k <= 0
    return jax.lax.bitcast_convert_type(
        ((k.astype(itype) - emin + 1) << bits).astype(itype), dtype)

  a = jnp.maximum(e, emin)
  return normal(a), normal(jnp.clip(e - a, emin, 0))


def _subtract_k_ln4(hi, lo, k, parts: int, chunks):
  """``(hi, lo) - k ln 4`` in double-length arithmetic (exact products, TwoSum)."""
  ks = _split_12(k, parts)
  for ch in chunks:
    for kk in ks:
      hi, e = _two_sum(hi, -(kk * jnp.asarray(ch, hi.dtype)))
      lo = lo + e
  return hi, lo


def _exp_pairs(x):
  """``e^x = m 4^k`` with ``m = e^r``, ``r = x - k ln 4`` in [-ln 2, ln 2] (k = k0 + k1).

  Returns ``(m, k0, k1)``: k0 = round(x log_4 e) in the dtype, k1 the small correction a
  second reduction finds (k0 may be off by ulp(x log_4 e) / 2 for large x).
  """
  dt = np.dtype(x.dtype)
  chunks, parts = _LN4[dt], _K_PARTS[dt]
  huge = jnp.abs(x) >= _HUGE[dt]
  xr = jnp.where(huge, jnp.zeros_like(x), x)  # (keeps the products below finite)
  k0 = jnp.round(x * jnp.asarray(_LOG4E, x.dtype))
  k0r = jnp.where(huge, jnp.zeros_like(k0), k0)
  hi, lo = _subtract_k_ln4(xr, jnp.zeros_like(x), k0r, parts, chunks)
  k1 = jnp.round((hi + lo) * jnp.asarray(_LOG4E, x.dtype))
  hi, lo = _subtract_k_ln4(hi, lo, k1, 1, chunks)
  r = jnp.where(huge, jnp.zeros_like(x), hi + lo)
  return jnp.exp(r), k0, jnp.where(huge, jnp.zeros_like(k1), k1)


def _two_pass_core(xs, mask, axis):
  m, k0, k1 = _exp_pairs(xs)
  lowest = jnp.asarray(-jnp.inf, xs.dtype)
  # Pass 1: the (mantissa, exponent) pairs summed with the associative merge
  # (m_a, e_a) + (m_b, e_b) = (m_a 4^(e_a - e) + m_b 4^(e_b - e), e = max(e_a, e_b)),
  # written for a whole row as a max of exponents and a sum of rescaled mantissas.
  top0 = jnp.max(jnp.where(mask, k0, lowest), axis=axis, keepdims=True)
  top0 = jnp.where(jnp.isfinite(top0), top0, jnp.zeros_like(top0))
  t = (k0 - top0) + k1  # exact near the top (Sterbenz), hugely negative far from it
  top = jnp.max(jnp.where(mask, t, lowest), axis=axis, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, jnp.zeros_like(top))
  # 4^d = 2^(2d), d <= 0, as two exact normal powers of 2 (one rounding, at the second
  # product); below 2 emin - 4 every value here (m <= 4) is 0 anyway.
  lowest_exp = 2 * int(jnp.finfo(xs.dtype).minexp) - 4
  p_a, p_b = _pow2(jnp.clip(2 * (t - top), lowest_exp, 0.0), xs.dtype)
  scaled = jnp.where(mask, (m * p_a) * p_b, jnp.zeros_like(m))
  total = jnp.sum(scaled, axis=axis, keepdims=True)  # >= 1/2 with a visible entry
  # Pass 2: y_i = (m_i / m_sum) 4^(k_i - k_sum).
  return jnp.where(mask, (c.safe_divide(m, total) * p_a) * p_b, jnp.zeros_like(m))


@jax.custom_jvp
def _two_pass_last(xs, mask):
  return _two_pass_core(xs, mask, xs.ndim - 1)


@_two_pass_last.defjvp
def _two_pass_last_jvp(primals, tangents):
  xs, mask = primals
  dx, _ = tangents
  y = _two_pass_last(xs, mask)
  dx = jnp.where(mask, dx, jnp.zeros_like(dx))
  return y, y * (dx - jnp.sum(y * dx, axis=-1, keepdims=True))


IMPLEMENTATIONS = (None, "xla", "pallas", "pallas_triton", "pallas_mosaic_tpu")


def pallas_backend(implementation, fn_name: str) -> tuple[str, bool] | None:
  """None for the jnp path; ``(backend, interpret)`` for a ``"pallas*"`` implementation.

  ``"pallas"`` picks the platform's driver (:func:`kernels_pallas.backends.pick_backend`:
  Triton on GPU, Mosaic on TPU, the interpreter on CPU with ``JAXSOFT_PALLAS_INTERPRET=1``).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{fn_name}: `implementation` must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation in (None, "xla"):
    return None
  from kernels_pallas import backends  # here: kernels_pallas imports jaxsoft.normalizers

  return backends.pick_backend({"pallas": None, "pallas_triton": "triton",
                                "pallas_mosaic_tpu": "mosaic_tpu"}[implementation])


def rows_kernel(kernel, x, axis, where, fn_name: str):
  """``kernel(rows, mask) -> weights`` over ``axis`` of ``x``, inside the shared rules'
  wrapper (``x`` finite there): the rows moved last, hidden entries exact zeros."""
  xs, mask, axis = c.prepare(x, axis, where, fn_name)
  y = c.from_last(kernel(c.to_last(xs, axis), c.to_last(mask, axis)), axis)
  return c.finish(y, mask, jnp.asarray(x).dtype)


@c.dense_rules
def _two_pass_pallas(x, axis=-1, where=None, *, backend, interpret):
  from kernels_pallas import two_pass  # here: kernels_pallas imports jaxsoft.normalizers

  return rows_kernel(lambda r, m: two_pass.two_pass_softmax(
      r, m, backend=backend, interpret=interpret), x, axis, where, "two_pass_softmax")


def two_pass_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                     implementation: str | None = None) -> jax.Array:
  r"""Softmax by the two-pass (mantissa, exponent) algorithm, without a max pass (K05).

  From Dukhan & Ablavatski, "The Two-Pass Softmax Algorithm" (2020). Each ``e^{x}`` is
  kept as a pair :math:`e^{x} = m \cdot 2^{e}` with an integer exponent, so no sum can
  overflow and no pass over the row is spent on its max:

  .. math::
    e = 2\,\mathrm{round}(x \log_4 e),\quad m = e^{x - e \ln 2} \in [\tfrac12, 2];\qquad
    (m_\Sigma, e_\Sigma) = \textstyle\bigoplus_i (m_i, e_i),\quad
    y_i = \frac{m_i}{m_\Sigma}\, 2^{e_i - e_\Sigma},

  with the associative merge :math:`(m_a, e_a) \oplus (m_b, e_b) = (m_a 2^{e_a - e} + m_b
  2^{e_b - e}, e)`, :math:`e = \max(e_a, e_b)` (pass 1), and the pairs recomputed in pass 2.
  The exponent is kept even (a power of 4) so that ``x log_4 e`` cannot overflow for any
  finite ``x``. The reduction ``x - e ln 2`` is Cody-Waite's, with ln 4 and the exponent
  cut into 12-bit pieces (exact products) and TwoSum additions: the result is the float32
  softmax to within a few ulps for every finite logit, up to float32's max (beyond
  ``|x| = 2^31`` distinct float32 values are at least 128 apart, so only the entries tied
  with the row max keep weight, as in exact arithmetic).

  The gradient is softmax's, written with the output: ``dy = y (dx - <y, dx>)``.

  Args:
    x: scores (float32 or float64; low-precision inputs are computed in float32).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    implementation: None or ``"xla"`` (this jnp form), ``"pallas"`` (the kernel
      :func:`kernels_pallas.two_pass_softmax` on the platform's driver; computed in
      float32, accurate for ``|x| < 2^22``; reverse-mode gradient only),
      ``"pallas_triton"`` or ``"pallas_mosaic_tpu"``.

  Returns:
    ``softmax(x)`` of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Examples:
    >>> js.normalizers.two_pass_softmax(jnp.array([2.0, 1.0, 0.0]))
    Array([0.6652, 0.2447, 0.09  ], dtype=float32)
    >>> js.normalizers.two_pass_softmax(jnp.array([1e4, 1e4 - 1.0, -3e38]))  # no overflow
    Array([0.7311, 0.2689, 0.    ], dtype=float32)

  References:
    M. Dukhan & A. Ablavatski, 2020, "The Two-Pass Softmax Algorithm".
  """
  kernel = pallas_backend(implementation, "two_pass_softmax")
  if kernel is not None:
    return _two_pass_pallas(x, axis, where, backend=kernel[0], interpret=kernel[1])
  return _two_pass_xla(x, axis, where)


@c.dense_rules
def _two_pass_xla(x, axis=-1, where=None):
  return rows_kernel(_two_pass_last, x, axis, where, "two_pass_softmax")


_two_pass_xla.__name__ = _two_pass_pallas.__name__ = "two_pass_softmax"  # (errors)


# --- K05: unified-max softmax ---------------------------------------------------------------


def _safe_range(safe_range, dtype, n: int, fn_name: str) -> tuple[float, float]:
  info = jnp.finfo(dtype)
  b_max = math.log(float(info.max)) - math.log(max(n, 1))
  if safe_range is None:
    return math.log(float(info.tiny)) / 2, b_max - 1.0
  try:
    a, b = (float(v) for v in safe_range)
  except (TypeError, ValueError):
    raise ValueError(f"{fn_name}: `safe_range` must be a pair of numbers (a, b), "
                     f"got {safe_range!r}") from None
  if not (a < b <= b_max):
    raise ValueError(
        f"{fn_name}: `safe_range` (a, b) needs a < b <= log(max {info.dtype}) - log(n) = "
        f"{b_max:.3f} (else the sum of n terms can overflow), got {safe_range!r}")
  return a, b


def _unified_parts(x, phi, axis, where, safe_range, fn_name):
  xs, mask, axis, top = c.prepare(x, axis, where, fn_name, with_max=True)
  p = jax.lax.stop_gradient(c.row_param(phi, xs.shape, axis, "phi", fn_name, xs.dtype))
  if isinstance(phi, (int, float)) and not math.isfinite(phi):
    raise ValueError(f"{fn_name}: `phi` must be finite, got {phi!r}")
  a, b = _safe_range(safe_range, xs.dtype, xs.shape[axis], fn_name)
  visible = jnp.any(mask, axis=axis, keepdims=True)
  gap = top - p
  fallback = visible & ((gap > b) | (gap < a) | ~jnp.isfinite(gap))
  return xs, mask, axis, jnp.where(fallback, top, p), fallback


def unified_max_fallback(x: ArrayLike, phi: ArrayLike, axis: int = -1,
                         where: ArrayLike | None = None, *,
                         safe_range: tuple[float, float] | None = None) -> jax.Array:
  """The rows :func:`unified_max_softmax` recomputes with their true max (keepdims).

  True where the row's visible max ``m`` has ``m - phi`` outside ``safe_range``; False
  for a row with nothing visible.

  Args:
    x: scores.
    phi: the unified max, a scalar or an array broadcast to the rows.
    axis: the softmax axis.
    where: optional boolean mask broadcastable to ``x``.
    safe_range: ``(a, b)`` as in :func:`unified_max_softmax`; None for the default.

  Returns:
    A boolean array of ``x``'s shape with size 1 along ``axis``.

  Examples:
    >>> x = jnp.array([[2.0, 1.0, 0.0], [500.0, 499.0, 498.0]])
    >>> js.normalizers.unified_max_fallback(x, phi=3.0)  # row 2: 500 - 3 is too far
    Array([[False],
           [ True]], dtype=bool)
    >>> js.normalizers.unified_max_fallback(x, phi=jnp.array([[3.0], [500.0]]))  # per row
    Array([[False],
           [False]], dtype=bool)

  References:
    K. Hong et al., 2024, "FlashDecoding++: Faster Large Language Model Inference on GPUs".
  """
  x = jnp.asarray(x)
  return _unified_parts(x, phi, axis, where, safe_range, "unified_max_fallback")[4]


@c.dense_rules
def _unified_max_softmax(x, axis=-1, where=None, *, phi, safe_range):
  xs, mask, axis, ref, _ = _unified_parts(x, phi, axis, where, safe_range, "unified_max_softmax")
  w = c.sum_normalize(jnp.exp(xs - ref), mask, axis)
  return c.finish(w, mask, jnp.asarray(x).dtype)


def unified_max_softmax(x: ArrayLike, phi: ArrayLike, axis: int = -1,
                        where: ArrayLike | None = None, *,
                        safe_range: tuple[float, float] | None = None) -> jax.Array:
  r"""Softmax with a fixed, a-priori max ``phi`` and an overflow guard (K05).

  From Hong et al., "FlashDecoding++: Faster Large Language Model Inference on GPUs"
  (2024): softmax is invariant to the constant subtracted from the row, so with one
  ``phi`` chosen offline from statistics of the model's scores,

  .. math::
    y_i = \frac{e^{x_i - \phi}}{\sum_j e^{x_j - \phi}},

  the partial sums of key chunks computed in parallel merge by plain addition (no
  running max, no rescaling). The guard: a row whose max ``m`` has ``m - phi`` outside
  the safe range ``[a, b]`` (overflow above, underflow below) is recomputed with ``m``
  in place of ``phi`` (the synchronised softmax); :func:`unified_max_fallback` says which
  rows were. The default range ``a = log(tiny)/2`` (about -43.7 in float32: entries within
  43 of the max stay normal numbers) and ``b = log(max) - log(n) - 1`` (no sum of ``n``
  terms can overflow) makes the result equal softmax for any ``phi``.

  Args:
    x: scores.
    phi: the unified max: a scalar or an array broadcast to the rows (size 1 along
      ``axis``); no gradient flows to it (the result does not depend on it).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    safe_range: ``(a, b)`` with ``a < b <= log(max) - log(n)``; None for the default.

  Returns:
    ``softmax(x)`` of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Examples:
    >>> x = jnp.array([[2.0, 1.0, 0.0], [500.0, 499.0, 498.0]])
    >>> js.normalizers.unified_max_softmax(x, phi=3.0)  # row 2: 500 - 3 > b, recomputed
    Array([[0.6652, 0.2447, 0.09  ],
           [0.6652, 0.2447, 0.09  ]], dtype=float32)
    >>> js.normalizers.unified_max_fallback(x, phi=3.0)
    Array([[False],
           [ True]], dtype=bool)

  References:
    K. Hong et al., 2024, "FlashDecoding++: Faster Large Language Model Inference on GPUs".
  """
  return _unified_max_softmax(x, axis, where, phi=phi, safe_range=safe_range)
