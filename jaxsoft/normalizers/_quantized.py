"""K09: quantised softmax outputs, as reference functions.

The uniform, log2 and tan quantisers of probabilities, the quantised softmax with the bias
correction of uniform quantisation, a table-lookup exp and its softmax, and softmax-aware
binarisation.

These are reference functions for numerics studies: each computes what the kernel it
describes computes, in plain ``jnp``, so its error against the float64 softmax can be
measured. None is registered as an attention normalizer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers._kernel_softmax import pallas_backend, rows_kernel
from jaxsoft.normalizers._softmax import softmax

__all__ = [
    "uniform_quantize",
    "log2_quantize",
    "tan_quantize",
    "quantized_softmax",
    "softmax_quantization_bias",
    "lut_exp",
    "lut_softmax",
    "softmax_aware_binarize",
]


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

  Examples:
    >>> js.normalizers.uniform_quantize(jnp.array([0.7, 0.2, 0.06, 0.04]), 3)  # steps of 1/7
    Array([0.7143, 0.1429, 0.    , 0.    ], dtype=float32)

  References:
    Pandey, Fournarakis, Patel & Nagel, 2023, "Softmax Bias Correction for Quantized
    Generative Models".

    Y. Bengio, N. Léonard & A. Courville, 2013, "Estimating or Propagating Gradients
    Through Stochastic Neurons for Conditional Computation".
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

  Examples:
    >>> p = jnp.array([0.7, 0.2, 0.06, 0.04])
    >>> js.normalizers.log2_quantize(p, 3)  # powers of two
    Array([0.5   , 0.25  , 0.0625, 0.0312], dtype=float32)
    >>> js.normalizers.log2_quantize(p, 3, shift=0.01)  # SULQ: 0 and 1 are levels
    Array([0.5124, 0.2602, 0.0623, 0.0274], dtype=float32)

  References:
    Y. Zhong et al., 2023, "I&S-ViT: An Inclusive & Stable Method for Pushing the Limit of
    Post-Training ViTs Quantization".
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
    # 2^-k exactly (jnp.exp2 on XLA CPU is 4 ulps low at k = 13)
    q = jnp.where((k >= levels) | (pc <= 0), 0.0,
                  jnp.ldexp(jnp.ones_like(pc), -k.astype(jnp.int32)))
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

  Examples:
    >>> js.normalizers.tan_quantize(jnp.array([0.7, 0.2, 0.06, 0.04]), 3)
    Array([0.6828, 0.3172, 0.0384, 0.0384], dtype=float32)

  References:
    Yang et al., 2024, "DopQ-ViT: Towards Distribution-Friendly and Outlier-Aware
    Post-Training Quantization for Vision Transformers".
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

  Examples:
    >>> x = jnp.zeros((1, 1000))  # p = 0.001 everywhere, below half an 8-bit step
    >>> round(float(js.normalizers.softmax_quantization_bias(x, 8)), 6)  # every p is lost
    0.001

  References:
    Pandey, Fournarakis, Patel & Nagel, 2023, "Softmax Bias Correction for Quantized
    Generative Models".
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
                      key: jax.Array | None = None,
                      implementation: str | None = None) -> jax.Array:
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
    implementation: None or ``"xla"`` (this jnp form), ``"pallas"`` (the kernel
      :func:`kernels_pallas.quantized_softmax` on the platform's driver: methods
      "uniform" and "log2", no ``key``; beta, when asked for, is added after it; a row
      with a visible ``+inf`` is NaN there; reverse-mode gradient only),
      ``"pallas_triton"`` or ``"pallas_mosaic_tpu"``.

  Returns:
    The quantised weights, ``x``'s shape and dtype; masked entries exactly 0.

  Examples:
    >>> x = jnp.zeros((1, 1000))  # uniform row: every p = 0.001 < s/2 rounds to 0 at 8 bits
    >>> float(js.normalizers.quantized_softmax(x, bits=8).sum())
    0.0
    >>> round(float(js.normalizers.quantized_softmax(x, bits=8, bias_correction=True).sum()), 4)
    1.0

  References:
    Pandey, Fournarakis, Patel & Nagel, 2023, "Softmax Bias Correction for Quantized
    Generative Models".
  """
  if bias is not None and not bias_correction:
    raise ValueError("quantized_softmax: `bias` was given but `bias_correction` is False")
  x = jnp.asarray(x)
  if implementation not in (None, "xla") and (method not in ("uniform", "log2")
                                              or key is not None):
    raise ValueError("quantized_softmax: implementation='pallas*' supports method 'uniform' "
                     f"or 'log2' without `key`, got method={method!r}, key={key!r}")
  kernel = pallas_backend(implementation, "quantized_softmax")
  if kernel is None:
    p = softmax(x, axis=axis, where=where)
    cd = c.compute_dtype(p.dtype)
    q = _quantize(p.astype(cd), bits, method, key, "quantized_softmax").astype(cd)
  else:
    q, cd, p = _quantized_pallas(x, bits, axis, where, method, key, kernel)
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


def _quantized_pallas(x, bits, axis, where, method, key, kernel):
  """The kernel's weights (bias not added), their compute dtype, an array of the output dtype."""
  del key
  _check_bits(bits, "quantized_softmax")
  from kernels_pallas import quantized  # here: kernels_pallas imports jaxsoft.normalizers

  dtype = c.output_dtype(x.dtype)
  _, mask, ax = c.prepare(x, axis, where, "quantized_softmax")
  q = c.from_last(quantized.quantized_softmax(
      c.to_last(x.astype(dtype), ax), bits, c.to_last(mask, ax), method=method,
      backend=kernel[0], interpret=kernel[1]), ax)
  cd = c.compute_dtype(dtype)
  return q.astype(cd), cd, q


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

  Examples:
    >>> d = jnp.array([0.0, -1.0, -20.0])
    >>> js.normalizers.lut_exp(d, 64, x_min=-8.0)  # exp(-1) = 0.3679; -20 is off the table
    Array([1.    , 0.3621, 0.    ], dtype=float32)

  References:
    "Scaling LLM Test-Time Compute with Mobile NPU on Smartphones", 2025 (authors not
    recorded in docs/feature_ids.md).
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
  w = c.sum_normalize(lut_exp(xs - m, table_size, x_min=x_min, frac_bits=frac_bits), mask, axis)
  return c.finish(w, mask, jnp.asarray(x).dtype)


@c.dense_rules
def _lut_pallas(x, axis=-1, where=None, *, table_size, x_min, frac_bits, backend, interpret):
  from kernels_pallas import quantized  # here: kernels_pallas imports jaxsoft.normalizers

  return rows_kernel(lambda r, m: quantized.lut_softmax(
      r, m, table_size=table_size, x_min=x_min, frac_bits=frac_bits, backend=backend,
      interpret=interpret), x, axis, where, "lut_softmax")


_lut_pallas.__name__ = "lut_softmax"  # (errors)


def lut_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                table_size: int = 256, x_min: float = -16.0,
                frac_bits: int | None = None, implementation: str | None = None) -> jax.Array:
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
    implementation: None or ``"xla"`` (this jnp form), ``"pallas"`` (the kernel
      :func:`kernels_pallas.lut_softmax` on the platform's driver; reverse-mode gradient
      only), ``"pallas_triton"`` or ``"pallas_mosaic_tpu"``.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.lut_softmax(x, table_size=16, x_min=-4.0)  # a coarse table
    Array([0.6672, 0.2296, 0.1032], dtype=float32)
    >>> js.normalizers.softmax(x)
    Array([0.6652, 0.2447, 0.09  ], dtype=float32)

  References:
    "Scaling LLM Test-Time Compute with Mobile NPU on Smartphones", 2025 (authors not
    recorded in docs/feature_ids.md).
  """
  _lut_args(table_size, x_min, frac_bits, "lut_softmax")
  kernel = pallas_backend(implementation, "lut_softmax")
  if kernel is not None:
    return _lut_pallas(x, axis, where, table_size=table_size, x_min=x_min,
                       frac_bits=frac_bits, backend=kernel[0], interpret=kernel[1])
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

  Examples:
    >>> p = jnp.array([0.7, 0.2, 0.06, 0.04])
    >>> js.normalizers.softmax_aware_binarize(p)  # keeping only 0.7 fits best
    Array([0.7, 0. , 0. , 0. ], dtype=float32)
    >>> js.normalizers.softmax_aware_binarize(p, threshold=0.05)  # alpha: the mean kept
    Array([0.32, 0.32, 0.32, 0.  ], dtype=float32)

  References:
    Y. He et al., 2023, "BiViT: Extremely Compressed Binary Vision Transformers".
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
    ks = ks.reshape((1,) * ax + (-1,) + (1,) * (p.ndim - 1 - ax))
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
