"""K05 and K09: softmax as low-level kernels compute it, as reference functions.

K05: the two-pass (mantissa, exponent) softmax and the unified-max softmax of split-K
decoding. K09: quantised softmax outputs (uniform, log2 and tan quantisers, the bias
correction of uniform quantisation), a table-lookup exp and softmax-aware binarisation.

These are reference functions for numerics studies: each computes what the kernel it
describes computes, in plain ``jnp``, so its error against the float64 softmax can be
measured. None is registered as an attention normalizer.
"""

from __future__ import annotations

import decimal
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers._softmax import softmax

__all__ = [
    "two_pass_softmax",
    "unified_max_softmax",
    "unified_max_fallback",
    "uniform_quantize",
    "log2_quantize",
    "tan_quantize",
    "quantized_softmax",
    "softmax_quantization_bias",
    "lut_exp",
    "lut_softmax",
    "softmax_aware_binarize",
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


@c.dense_rules
def two_pass_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
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

  Returns:
    ``softmax(x)`` of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxsoft as js
    >>> jnp.set_printoptions(precision=4)
    >>> js.normalizers.two_pass_softmax(jnp.array([2.0, 1.0, 0.0]))
    Array([0.6652, 0.2447, 0.09  ], dtype=float32)
    >>> js.normalizers.two_pass_softmax(jnp.array([1e4, 1e4 - 1.0, -3e38]))  # no overflow
    Array([0.7311, 0.2689, 0.    ], dtype=float32)
  """
  xs, mask, axis = c.prepare(x, axis, where, "two_pass_softmax")
  y = c.from_last(_two_pass_last(c.to_last(xs, axis), c.to_last(mask, axis)), axis)
  return c.finish(y, mask, jnp.asarray(x).dtype)


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
  """
  x = jnp.asarray(x)
  return _unified_parts(x, phi, axis, where, safe_range, "unified_max_fallback")[4]


@c.dense_rules
def _unified_max_softmax(x, axis=-1, where=None, *, phi, safe_range):
  xs, mask, axis, ref, _ = _unified_parts(x, phi, axis, where, safe_range, "unified_max_softmax")
  e = jnp.where(mask, jnp.exp(xs - ref), 0.0)
  w = c.safe_divide(e, jnp.sum(e, axis=axis, keepdims=True))
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

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxsoft as js
    >>> jnp.set_printoptions(precision=4)
    >>> x = jnp.array([[2.0, 1.0, 0.0], [500.0, 499.0, 498.0]])
    >>> js.normalizers.unified_max_softmax(x, phi=3.0)  # row 2: 500 - 3 > b, recomputed
    Array([[0.6652, 0.2447, 0.09  ],
           [0.6652, 0.2447, 0.09  ]], dtype=float32)
    >>> js.normalizers.unified_max_fallback(x, phi=3.0)
    Array([[False],
           [ True]], dtype=bool)
  """
  return _unified_max_softmax(x, axis, where, phi=phi, safe_range=safe_range)


# --- K09: quantisers of probabilities ---------------------------------------------------------


def _check_bits(bits, fn_name: str, high: int = 16) -> int:
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= high:
    raise ValueError(f"{fn_name}: `bits` must be an int in [1, {high}], got {bits!r}")
  return int(bits)


def _as_probs(p: ArrayLike) -> tuple[jax.Array, jnp.dtype]:
  p = jnp.asarray(p)
  dtype = c.output_dtype(p.dtype)
  return p.astype(c.compute_dtype(dtype)), dtype


def _straight_through(p, q):
  """``q`` in value, the identity in gradient (the straight-through estimator)."""
  return p + jax.lax.stop_gradient(q - p)


def uniform_quantize(p: ArrayLike, bits: int, *, scale: float | None = None,
                     key: jax.Array | None = None) -> jax.Array:
  r"""Uniform quantisation of probabilities: :math:`Q(p) = s\,\mathrm{clip}(\mathrm{round}(p/s), 0, 2^b - 1)`.

  The quantiser of Pandey, Fournarakis, Patel & Nagel, "Softmax Bias Correction for
  Quantized Generative Models" (2023), with step ``s = 1/(2^b - 1)`` by default (1 is a
  level). Rounding to nearest sends every ``p < s/2`` to 0, so in a long row
  :math:`\sum_i Q(p)_i < 1` on average: the bias :func:`quantized_softmax` corrects. With
  ``key``, stochastic rounding (``floor(p/s + u)``, ``u ~ U[0, 1)``), which is unbiased.
  The gradient is the straight-through estimator (identity), as in quantisation-aware
  training.

  Args:
    p: values in [0, 1] (probabilities).
    bits: b in [1, 16].
    scale: the step ``s > 0``; None for ``1/(2^b - 1)``.
    key: a PRNG key for stochastic rounding; None rounds to nearest.

  Returns:
    The dequantised values, ``p``'s shape and dtype.
  """
  bits = _check_bits(bits, "uniform_quantize")
  levels = 2 ** bits - 1
  s = 1.0 / levels if scale is None else scale
  if isinstance(s, (int, float)) and not (math.isfinite(s) and s > 0):
    raise ValueError(f"uniform_quantize: `scale` must be finite and > 0, got {scale!r}")
  pa, dtype = _as_probs(p)
  z = pa / s
  if key is None:
    code = jnp.round(z)
  else:
    code = jnp.floor(z + jax.random.uniform(key, pa.shape, pa.dtype))
  q = s * jnp.clip(code, 0, levels)
  return _straight_through(pa, q).astype(dtype)


def log2_quantize(p: ArrayLike, bits: int, *, shift: float = 0.0) -> jax.Array:
  r"""Power-of-two quantisation of probabilities (plain log2, or shift-uniform-log2).

  ``shift = 0``: the log2 quantiser used for post-softmax activations in post-training
  quantisation of vision transformers, levels :math:`\{2^{-k}\}_{k=0}^{2^b-2} \cup \{0\}`:

  .. math::
    Q(p) = 2^{-k},\quad k = \mathrm{round}(-\log_2 p)\ \text{if}\ k \le 2^b - 2,\ \text{else}\ 0.

  Fine near 0, coarse near 1 (nothing between 1/2 and 1). ``shift = eta > 0``: the
  shift-uniform-log2 quantiser (SULQ) of Zhong et al., "I&S-ViT: An Inclusive & Stable
  Method for Pushing the Limit of Post-Training ViTs Quantization" (2023), reconstructed
  [R]: :math:`u = -\log_2(p + \eta)` is quantised uniformly onto ``2^b`` levels spanning
  :math:`[-\log_2(1+\eta), -\log_2 \eta]` and mapped back by :math:`2^{-\hat u} - \eta`,
  so both 0 and 1 are levels (the "inclusive domain"). Gradient: straight-through.

  Args:
    p: values in [0, 1].
    bits: b in [1, 16].
    shift: eta >= 0.

  Returns:
    The dequantised values in [0, 1], ``p``'s shape and dtype.
  """
  bits = _check_bits(bits, "log2_quantize")
  if not (isinstance(shift, (int, float)) and math.isfinite(shift) and shift >= 0):
    raise ValueError(f"log2_quantize: `shift` must be a finite number >= 0, got {shift!r}")
  pa, dtype = _as_probs(p)
  levels = 2 ** bits - 1
  pc = jnp.clip(pa, 0.0, 1.0)
  if shift == 0:
    tiny = jnp.asarray(jnp.finfo(pa.dtype).tiny, pa.dtype)
    k = jnp.round(-jnp.log2(jnp.maximum(pc, tiny)))
    k = jnp.clip(k, 0, levels)  # code `levels` stands for 0
    q = jnp.where((k >= levels) | (pc <= 0), 0.0, jnp.exp2(-k))
  else:
    lo, hi = -math.log2(1.0 + shift), -math.log2(shift)
    step = (hi - lo) / levels
    code = jnp.clip(jnp.round((-jnp.log2(pc + shift) - lo) / step), 0, levels)
    q = jnp.clip(jnp.exp2(-(lo + step * code)) - shift, 0.0, 1.0)
    q = jnp.where(code == 0, 1.0, jnp.where(code == levels, 0.0, q))
  return _straight_through(pa, q.astype(pa.dtype)).astype(dtype)


def tan_quantize(p: ArrayLike, bits: int, *, theta: float = 1.3) -> jax.Array:
  r"""Tan quantisation of probabilities: fine steps near 0 and near 1 [R].

  After the TanQ quantiser of Yang et al., "DopQ-ViT: Towards Distribution-Friendly and
  Outlier-Aware Post-Training Quantization for Vision Transformers" (2024), which "focuses
  more on values near 1" for post-softmax activations. The paper's exact mapping is not
  recorded here; this reconstruction [R] quantises :math:`u = \tan(\theta(2p - 1)) /
  \tan\theta \in [-1, 1]` uniformly onto ``2^b`` levels and maps back:

  .. math::
    \hat u = -1 + \tfrac{2}{L}\,\mathrm{round}\big(\tfrac{L}{2}(u + 1)\big),\quad
    Q(p) = \tfrac12\big(1 + \arctan(\hat u \tan\theta) / \theta\big),\quad L = 2^b - 1.

  0 and 1 are levels; the steps near them are :math:`1/\cos^2\theta` times finer than in
  the middle (``theta -> 0`` is the uniform quantiser over [0, 1]). Gradient:
  straight-through.

  Args:
    p: values in [0, 1].
    bits: b in [1, 16].
    theta: in (0, pi/2).

  Returns:
    The dequantised values in [0, 1], ``p``'s shape and dtype.
  """
  bits = _check_bits(bits, "tan_quantize")
  if not (isinstance(theta, (int, float)) and 0 < theta < math.pi / 2):
    raise ValueError(f"tan_quantize: `theta` must be a number in (0, pi/2), got {theta!r}")
  pa, dtype = _as_probs(p)
  levels = 2 ** bits - 1
  t = math.tan(theta)
  u = jnp.tan(theta * (2 * jnp.clip(pa, 0.0, 1.0) - 1)) / t
  code = jnp.clip(jnp.round(0.5 * levels * (u + 1)), 0, levels)
  uq = 2.0 * code / levels - 1.0
  q = jnp.clip(0.5 * (1.0 + jnp.arctan(uq * t) / theta), 0.0, 1.0)
  q = jnp.where(code == 0, 0.0, jnp.where(code == levels, 1.0, q))
  return _straight_through(pa, q.astype(pa.dtype)).astype(dtype)


_QUANTIZERS = {"uniform": uniform_quantize, "log2": log2_quantize, "tan": tan_quantize}


def _quantize(p, bits, method, key, fn_name):
  if method not in _QUANTIZERS:
    raise ValueError(f"{fn_name}: `method` must be one of {sorted(_QUANTIZERS)}, got {method!r}")
  if key is not None and method != "uniform":
    raise ValueError(f"{fn_name}: `key` (stochastic rounding) is for method='uniform' only")
  if method == "uniform":
    return uniform_quantize(p, bits, key=key)
  if method == "log2":
    return log2_quantize(p, bits)
  return tan_quantize(p, bits)


def softmax_quantization_bias(x: ArrayLike, bits: int = 8, axis: int = -1,
                              where: ArrayLike | None = None, *, method: str = "uniform",
                              per_row: bool = False) -> jax.Array:
  r"""The bias correction of a quantised softmax, :math:`\beta = E[p - Q(p)]` (calibration).

  From Pandey, Fournarakis, Patel & Nagel, "Softmax Bias Correction for Quantized
  Generative Models" (2023): the mean, over the visible entries of a calibration batch
  ``x``, of the error the quantiser makes on ``p = softmax(x)``; per tensor (a scalar) or
  ``per_row`` (keepdims along ``axis``). Passed as ``bias`` to :func:`quantized_softmax`,
  it is folded into the quantiser's offset at deployment (no runtime cost). No gradient.

  Args:
    x: calibration scores.
    bits: b in [1, 16].
    axis: the softmax axis.
    where: optional boolean mask broadcastable to ``x``.
    method: "uniform", "log2" or "tan".
    per_row: one beta per row instead of one per tensor.

  Returns:
    beta in float32 (float64 for float64 input); 0 where nothing is visible.
  """
  p = softmax(x, axis=axis, where=where)
  ax = c.canonical_axis(axis, p.ndim, "softmax_quantization_bias")
  cd = c.compute_dtype(p.dtype)
  p = p.astype(cd)
  q = _quantize(p, bits, method, None, "softmax_quantization_bias").astype(cd)
  mask = jnp.ones(p.shape, bool) if where is None else jnp.broadcast_to(where, p.shape)
  mask = mask & (jnp.asarray(x) != -jnp.inf)
  err = jnp.where(mask, p - q, 0.0)
  axes = ax if per_row else None
  n = jnp.sum(mask, axis=axes, keepdims=per_row).astype(cd)
  return jax.lax.stop_gradient(c.safe_divide(jnp.sum(err, axis=axes, keepdims=per_row), n))


def quantized_softmax(x: ArrayLike, bits: int = 8, axis: int = -1,
                      where: ArrayLike | None = None, *, method: str = "uniform",
                      bias_correction: bool = False, bias: ArrayLike | None = None,
                      key: jax.Array | None = None) -> jax.Array:
  r"""Softmax followed by a b-bit quantiser, with optional bias correction (K09).

  .. math::
    \hat y = Q(\mathrm{softmax}(x)) + \beta \quad\text{on visible entries},

  Q uniform (:func:`uniform_quantize`; ``key`` for stochastic rounding), log2
  (:func:`log2_quantize`) or tan (:func:`tan_quantize`). Rounding small probabilities to
  0 biases the rows' sums below 1 (more so the longer the row); the correction of Pandey,
  Fournarakis, Patel & Nagel, "Softmax Bias Correction for Quantized Generative Models"
  (2023) adds :math:`\beta = E[p - Q(p)]` to every visible entry, so the expected row sum
  is 1 again. ``bias`` is a beta calibrated offline (:func:`softmax_quantization_bias`);
  with ``bias_correction=True`` and no ``bias``, beta is estimated on ``x`` itself (per
  tensor). Gradient: straight-through (that of softmax).

  Args:
    x: scores.
    bits: b in [1, 16].
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    method: "uniform", "log2" or "tan".
    bias_correction: add beta to the visible entries.
    bias: a calibrated beta (scalar, or broadcastable to the rows); needs
      ``bias_correction=True``.
    key: PRNG key: stochastic rounding (method "uniform" only).

  Returns:
    The quantised weights, ``x``'s shape and dtype; masked entries exactly 0.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxsoft as js
    >>> x = jnp.zeros((1, 1000))  # uniform row: every p = 0.001 < s/2 rounds to 0 at 8 bits
    >>> float(js.normalizers.quantized_softmax(x, bits=8).sum())
    0.0
    >>> round(float(js.normalizers.quantized_softmax(x, bits=8, bias_correction=True).sum()), 4)
    1.0
  """
  if bias is not None and not bias_correction:
    raise ValueError("quantized_softmax: `bias` was given but `bias_correction` is False")
  x = jnp.asarray(x)
  p = softmax(x, axis=axis, where=where)
  cd = c.compute_dtype(p.dtype)
  pc = p.astype(cd)
  q = _quantize(pc, bits, method, key, "quantized_softmax").astype(cd)
  mask = x != -jnp.inf
  if where is not None:
    mask = mask & jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
  if bias_correction:
    if bias is None:
      beta = softmax_quantization_bias(x, bits, axis, where, method=method)
    else:
      beta = jnp.asarray(bias, cd)
    q = q + beta
  return jnp.where(mask, q, 0.0).astype(p.dtype)


# --- K09: table-lookup exp --------------------------------------------------------------------


def _lut_args(table_size, x_min, frac_bits, fn_name):
  if isinstance(table_size, bool) or not isinstance(table_size, (int, np.integer)) \
      or table_size < 2:
    raise ValueError(f"{fn_name}: `table_size` must be an int >= 2, got {table_size!r}")
  if not (isinstance(x_min, (int, float)) and math.isfinite(x_min) and x_min < 0):
    raise ValueError(f"{fn_name}: `x_min` must be a finite number < 0, got {x_min!r}")
  if frac_bits is not None and (isinstance(frac_bits, bool)
                                or not isinstance(frac_bits, (int, np.integer))
                                or not 1 <= frac_bits <= 30):
    raise ValueError(f"{fn_name}: `frac_bits` must be None or an int in [1, 30], got {frac_bits!r}")


def _lut_lookup(d, table_size, x_min, frac_bits):
  step = -x_min / (table_size - 1)
  table = jnp.exp(-step * jnp.arange(table_size, dtype=d.dtype))
  if frac_bits is not None:
    table = jnp.round(table * 2.0 ** frac_bits) / 2.0 ** frac_bits
  idx = jnp.round(-jnp.minimum(d, 0.0) / step)
  inside = idx <= table_size - 1
  val = table[jnp.clip(jnp.where(inside, idx, 0), 0, table_size - 1).astype(jnp.int32)]
  return jnp.where(inside, val, jnp.where(jnp.isnan(d), d, jnp.zeros_like(val)))


def lut_exp(x: ArrayLike, table_size: int = 256, *, x_min: float = -16.0,
            frac_bits: int | None = None) -> jax.Array:
  r"""``exp`` by table lookup, for scores already shifted by their row max (``x <= 0``).

  The lookup-table exp of softmax kernels on integer accelerators (e.g. "Scaling LLM
  Test-Time Compute with Mobile NPU on Smartphones", 2025): with ``N = table_size`` and
  :math:`\Delta = -x_{\min}/(N - 1)`,

  .. math::
    T_k = e^{-k\Delta}\ \big(\text{or}\ \mathrm{round}(2^F e^{-k\Delta}) / 2^F\big),\quad
    \widehat{e^{x}} = T_{\mathrm{round}(-x/\Delta)}\ \text{if}\ \mathrm{round}(-x/\Delta) \le N-1,
    \ \text{else}\ 0.

  Error bound: :math:`|\widehat{e^x} - e^x| \le e^x (e^{\Delta/2} - 1) + 2^{-F-1}` while
  the index is in the table, and :math:`e^{x} < e^{x_{\min} - \Delta/2}` beyond it (the
  ``2^{-F-1}`` term only with ``frac_bits``). Positive ``x`` saturates at :math:`T_0 = 1`;
  NaN stays NaN.
  The gradient uses the table's value as the derivative of exp (``d/dx = \widehat{e^x}``).

  Args:
    x: the exponents, normally ``x - max(x) <= 0``.
    table_size: N >= 2.
    x_min: the table's last argument, finite and < 0.
    frac_bits: F, store the table in fixed point with F fractional bits; None keeps floats.

  Returns:
    The table values, ``x``'s shape and dtype.
  """
  _lut_args(table_size, x_min, frac_bits, "lut_exp")
  x = jnp.asarray(x)
  dtype = c.output_dtype(x.dtype)
  xc = x.astype(c.compute_dtype(dtype))

  @jax.custom_jvp
  def f(d):
    return _lut_lookup(d, table_size, x_min, frac_bits)

  @f.defjvp
  def f_jvp(primals, tangents):
    y = f(primals[0])
    return y, y * tangents[0]

  return f(xc).astype(dtype)


@c.dense_rules
def _lut_softmax(x, axis=-1, where=None, *, table_size, x_min, frac_bits):
  xs, mask, axis, m = c.prepare(x, axis, where, "lut_softmax", with_max=True)
  e = jnp.where(mask, lut_exp(xs - m, table_size, x_min=x_min, frac_bits=frac_bits), 0.0)
  w = c.safe_divide(e, jnp.sum(e, axis=axis, keepdims=True))
  return c.finish(w, mask, jnp.asarray(x).dtype)


def lut_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                table_size: int = 256, x_min: float = -16.0,
                frac_bits: int | None = None) -> jax.Array:
  r"""Softmax with ``exp(x - max)`` read from a table (:func:`lut_exp`), then normalized.

  With :math:`\rho = e^{\Delta/2} - 1` the table's relative error and
  :math:`\epsilon = (n-1) e^{x_{\min} - \Delta/2}` a bound on the weight of the entries
  beyond the table (``frac_bits=None``), every weight satisfies

  .. math::
    \frac{1-\rho}{1+\rho} \le \frac{\hat y_i}{y_i}\ \ (\text{in-table } i),\qquad
    \frac{\hat y_i}{y_i} \le \frac{1+\rho}{(1-\rho)(1-\epsilon)},

  and entries beyond the table get 0. The row sums to one (up to rounding).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    table_size, x_min, frac_bits: as in :func:`lut_exp`.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros.
  """
  _lut_args(table_size, x_min, frac_bits, "lut_softmax")
  return _lut_softmax(x, axis, where, table_size=table_size, x_min=x_min, frac_bits=frac_bits)


# --- K09: softmax-aware binarisation ----------------------------------------------------------


def softmax_aware_binarize(p: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                           threshold: ArrayLike | None = None) -> jax.Array:
  r"""Binarise attention probabilities per row: :math:`\hat A = \alpha\,1[A \ge \delta]` [R].

  After the softmax-aware binarisation of He et al., "BiViT: Extremely Compressed Binary
  Vision Transformers" (2023), which adapts the threshold and scale of a binary attention
  map to the long-tailed distribution of softmax outputs. The exact rule is reconstructed
  [R]: for a threshold ``delta`` the least-squares scale is the mean of the entries kept,
  :math:`\alpha = \mathrm{mean}\{A_i : A_i \ge \delta\}`; with ``threshold=None`` delta is
  chosen per row to minimise :math:`\|A - \hat A\|^2`: over the row sorted in decreasing
  order, with :math:`S_k` the sum of the k largest,

  .. math::
    \|A - \hat A\|^2 = \|A\|^2 - S_k^2 / k,\qquad k^\star = \arg\max_k S_k^2/k,\quad
    \delta = A_{(k^\star)}.

  A fixed ``threshold`` keeps the entries ``> threshold`` instead (e.g. ``1/n``). Each row
  holds exactly two values, 0 and alpha (masked entries 0). The gradient flows through
  alpha (the selection is piecewise constant).

  Args:
    p: probabilities (e.g. ``softmax(x)``).
    axis: the row axis.
    where: optional boolean mask broadcastable to ``p``.
    threshold: None (adaptive), or a scalar / row-broadcast array.

  Returns:
    The binarised rows, ``p``'s shape and dtype.
  """
  name = "softmax_aware_binarize"
  p = jnp.asarray(p)
  dtype = c.output_dtype(p.dtype)
  ax = c.canonical_axis(axis, p.ndim, name)
  pc = p.astype(c.compute_dtype(dtype))
  mask = jnp.ones(p.shape, bool) if where is None else c._broadcast_where(where, p.shape, name)
  if p.size == 0:
    return jnp.zeros(p.shape, dtype)
  if threshold is None:
    low = jnp.asarray(-jnp.inf, pc.dtype)
    srt = -jnp.sort(-jnp.where(mask, jax.lax.stop_gradient(pc), low), axis=ax)
    n_vis = jnp.sum(mask, axis=ax, keepdims=True)
    ks = jnp.arange(1, p.shape[ax] + 1, dtype=pc.dtype)
    ks = ks.reshape((-1,) + (1,) * (p.ndim - 1 - ax))
    s_k = jnp.cumsum(jnp.where(jnp.isfinite(srt), srt, 0.0), axis=ax)
    score = jnp.where(ks <= n_vis, s_k ** 2 / ks, -jnp.inf)
    best = jnp.argmax(score, axis=ax, keepdims=True)
    delta = jnp.take_along_axis(srt, best, axis=ax)
    keep = mask & (pc >= delta)
  else:
    t = c.row_param(threshold, p.shape, ax, "threshold", name, pc.dtype)
    keep = mask & (pc > t)
  count = jnp.sum(keep, axis=ax, keepdims=True).astype(pc.dtype)
  alpha = c.safe_divide(jnp.sum(jnp.where(keep, pc, 0.0), axis=ax, keepdims=True), count)
  return jnp.where(keep, alpha, 0.0).astype(dtype)
