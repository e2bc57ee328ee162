r"""K09: the quantised softmax and the table-lookup softmax as Pallas kernels.

:func:`quantized_softmax` computes softmax over the last axis and the uniform or log2
quantiser of its output in one kernel (the quantiser applied where the weights are
written, as an int8 / int4 attention-probability kernel does); :func:`lut_softmax`
computes softmax with ``exp(x - max)`` replaced by the value of a table
(:func:`jaxsoft.normalizers.lut_exp`). Both run three passes over a row held by one
program (the max, the sum, the write), through the driver of
:mod:`kernels_pallas.two_pass`; their jnp references are
:func:`jaxsoft.normalizers.quantized_softmax` and :func:`jaxsoft.normalizers.lut_softmax`,
whose float operations the kernels repeat in the same order (the codes agree except where
a weight lies within a rounding of a level boundary).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import two_pass as tp
from kernels_pallas.backends import BACKENDS

__all__ = ["quantized_softmax", "lut_softmax"]

_METHODS = ("uniform", "log2")


def _err(name: str, msg: str) -> ValueError:
  return ValueError(f"kernels_pallas.{name}: {msg}")


def _row_max(x_ref, n_chunks, chunk):
  br = x_ref.shape[0]
  init = jnp.full((br, chunk), -jnp.inf, jnp.float32)
  lanes = tp.row_reduce(lambda xc, acc: jnp.maximum(acc, xc), init, x_ref, n_chunks, chunk)
  top = jnp.max(lanes, axis=1, keepdims=True)  # NaN if the row has one: it propagates
  return jnp.where(top == -jnp.inf, 0.0, top)  # a row with nothing visible: e = 0


def _row_sum(x_ref, n_chunks, chunk, expf):
  br = x_ref.shape[0]
  init = jnp.zeros((br, chunk), jnp.float32)
  lanes = tp.row_reduce(lambda xc, acc: acc + expf(xc), init, x_ref, n_chunks, chunk)
  return jnp.sum(lanes, axis=1, keepdims=True)


def _quantize(p, bits: int, method: str):
  """The reference quantisers' arithmetic (jaxsoft.normalizers.uniform_quantize /
  log2_quantize, shift 0, round to nearest), with ``round`` from ``floor``."""
  levels = 2 ** bits - 1
  if method == "uniform":
    s = jnp.float32(1.0 / levels)
    q = s * jnp.clip(tp.round_half_even(p / s), 0.0, float(levels))
  else:
    pc = jnp.clip(p, 0.0, 1.0)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    k = jnp.clip(tp.round_half_even(-jnp.log2(jnp.maximum(pc, tiny))), 0.0, float(levels))
    q = jnp.where((k >= levels) | (pc <= 0), 0.0, tp.pow2_int(-k))
  return p + (q - p)  # the straight-through form's value, as the reference computes it


def _quantized_kernel(x_ref, o_ref, *, n_chunks: int, chunk: int, bits: int, method: str,
                      bias: float | None):
  top = _row_max(x_ref, n_chunks, chunk)

  def expf(xc):
    return jnp.where(xc != -jnp.inf, jnp.exp(xc - top), 0.0)

  d = _row_sum(x_ref, n_chunks, chunk, expf)
  d = jnp.where(d > 0, d, 1.0)

  def write(xc):
    q = _quantize(expf(xc) / d, bits, method)
    if bias is not None:
      q = q + jnp.float32(bias)
    return jnp.where(xc != -jnp.inf, q, 0.0)

  tp.row_write(write, x_ref, o_ref, n_chunks, chunk)


def _lut_value(dx, table_size: int, x_min: float, frac_bits: int | None):
  """:func:`jaxsoft.normalizers.lut_exp`'s table entry, recomputed (no gather in the kernel):
  ``T_k = exp(-step k)`` (rounded to ``frac_bits``) at ``k = round(-min(d, 0) / step)``."""
  step = -x_min / (table_size - 1)
  idx = tp.round_half_even(-jnp.minimum(dx, 0.0) / jnp.float32(step))
  inside = idx <= table_size - 1
  val = jnp.exp(jnp.float32(-step) * jnp.where(inside, idx, 0.0))
  if frac_bits is not None:
    val = tp.round_half_even(val * 2.0 ** frac_bits) / 2.0 ** frac_bits
  return jnp.where(inside, val, jnp.where(jnp.isnan(dx), dx, 0.0))


def _lut_kernel(x_ref, o_ref, *, n_chunks: int, chunk: int, table_size: int, x_min: float,
                frac_bits: int | None):
  top = _row_max(x_ref, n_chunks, chunk)

  def expf(xc):
    return jnp.where(xc != -jnp.inf, _lut_value(xc - top, table_size, x_min, frac_bits), 0.0)

  d = _row_sum(x_ref, n_chunks, chunk, expf)
  inv_ok = d != 0
  d = jnp.where(inv_ok, d, 1.0)
  tp.row_write(lambda xc: jnp.where(inv_ok, expf(xc) / d, 0.0), x_ref, o_ref, n_chunks, chunk)


# --- gradients -------------------------------------------------------------------------------


def _softmax_vjp(p, g):
  gf = g.astype(jnp.float32)
  return p * (gf - jnp.sum(p * gf, axis=-1, keepdims=True))


def _row_kernel_call(kernel, name: str, residual, bwd):
  """``kernel`` over the rows of ``x2`` as ``f(x2, static, backend, interpret, block_rows)``
  (:func:`kernels_pallas.two_pass.row_call`, ``static`` the kernel's keyword arguments as
  pairs), with the gradient ``bwd(static, backend, interpret, block_rows, r, g)`` from the
  residual ``r = residual(x2, y)``."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
  def call(x2, static, backend, interpret, block_rows):
    body = functools.partial(kernel, **dict(static))
    return tp.row_call(body, x2, backend=backend, interpret=interpret, block_rows=block_rows,
                       name=name)

  def fwd(x2, static, backend, interpret, block_rows):
    y = call(x2, static, backend, interpret, block_rows)
    return y, residual(x2, y)

  call.defvjp(fwd, bwd)
  return call


def _quantized_bwd(static, backend, interpret, block_rows, x2, g):
  visible = x2 > -jnp.inf  # straight-through: softmax's gradient, from the saved input
  p = jnp.where(visible, jax.nn.softmax(x2.astype(jnp.float32), axis=-1, where=visible), 0.0)
  return (_softmax_vjp(p, g).astype(x2.dtype),)


def _lut_bwd(static, backend, interpret, block_rows, y, g):
  return (_softmax_vjp(y.astype(jnp.float32), g).astype(y.dtype),)


_quantized_call = _row_kernel_call(_quantized_kernel, "quantized_softmax",
                                   lambda x2, y: x2, _quantized_bwd)
_lut_call = _row_kernel_call(_lut_kernel, "lut_softmax", lambda x2, y: y, _lut_bwd)


def _check_common(name, backend, block_rows):
  if backend not in BACKENDS:
    raise _err(name, f"`backend` must be one of {BACKENDS}, got {backend!r}")
  tp.check_block_rows(block_rows, name)


def quantized_softmax(x, bits: int = 8, where=None, *, method: str = "uniform",
                      bias: float | None = None, backend: str = "triton",
                      interpret: Any = False, block_rows: int | None = None) -> jax.Array:
  r"""Softmax over the last axis followed by a b-bit quantiser, as a Pallas kernel (K09).

  .. math::
    \hat y = Q(\mathrm{softmax}(x)) + \beta \quad\text{on visible entries},\qquad
    Q_{\text{uniform}}(p) = s\,\mathrm{clip}(\mathrm{round}(p/s), 0, 2^b - 1),\ s = \tfrac{1}{2^b - 1},

  or :math:`Q_{\text{log2}}(p) = 2^{-k}`, :math:`k = \mathrm{round}(-\log_2 p)` (0 when
  :math:`k \ge 2^b - 1`): what :func:`jaxsoft.normalizers.quantized_softmax` computes with
  ``method="uniform"`` or ``"log2"``, round to nearest, and ``bias`` a calibrated beta
  (:func:`jaxsoft.normalizers.softmax_quantization_bias`; ``bias_correction=True`` there).
  The kernel repeats the reference's float operations (max, ``exp(x - max)``, the sum, a
  division, the quantiser's ``p/s``, round, clip, ``s * code``): the output equals the
  reference's except where a float rounding of the sum, summed in another order, moves a
  weight across a level boundary (one level; on CPU in interpret mode, none in the
  tests). Hidden entries (``where`` False, ``-inf``) get 0; a NaN makes its row NaN
  (NaN in the quantiser's clip: the codes there are unspecified), a ``+inf`` too.

  Gradient: straight-through, softmax's (``dx = p (g - <p, g>)``, ``p`` recomputed in XLA).

  Args:
    x: ``[..., n]`` scores (read in their dtype, computed in float32).
    bits: b in [1, 16].
    where: optional boolean mask broadcastable to x.
    method: "uniform" or "log2".
    bias: a calibrated beta added to the visible entries (a Python float), or None.
    backend: "triton" (GPU) or "mosaic_tpu".
    interpret: run in the Pallas interpreter (CPU).
    block_rows: rows per program, as :func:`kernels_pallas.two_pass_softmax`.

  Returns:
    x's shape and dtype.

  Examples:
    >>> from kernels_pallas import quantized as qs
    >>> x = jnp.array([[2.0, 1.0, 0.0, -3.0]])
    >>> qs.quantized_softmax(x, 3, interpret=True)  # steps of 1/7
    Array([[0.7143, 0.2857, 0.1429, 0.    ]], dtype=float32)
    >>> qs.quantized_softmax(x, 3, method="log2", interpret=True)
    Array([[0.5  , 0.25 , 0.125, 0.   ]], dtype=float32)

  References:
    Pandey, Fournarakis, Patel & Nagel, 2023, "Softmax Bias Correction for Quantized
    Generative Models".
  """
  name = "quantized_softmax"
  _check_common(name, backend, block_rows)
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 16:
    raise _err(name, f"`bits` must be an int in [1, 16], got {bits!r}")
  if method not in _METHODS:
    raise _err(name, f"`method` must be one of {_METHODS}, got {method!r}")
  if bias is not None and not (isinstance(bias, (int, float, np.floating))
                               and not isinstance(bias, bool) and math.isfinite(bias)):
    raise _err(name, f"`bias` must be a finite Python float or None, got {bias!r}")
  x, x2 = tp.prepare_rows(x, where, name)
  static = (("bits", int(bits)), ("method", method),
            ("bias", None if bias is None else float(bias)))
  out = _quantized_call(x2, static, backend, interpret, block_rows)
  return out.reshape(x.shape).astype(x.dtype)


def lut_softmax(x, where=None, *, table_size: int = 256, x_min: float = -16.0,
                frac_bits: int | None = None, backend: str = "triton", interpret: Any = False,
                block_rows: int | None = None) -> jax.Array:
  r"""Softmax over the last axis with ``exp(x - max)`` from a table, as a Pallas kernel (K09).

  :func:`jaxsoft.normalizers.lut_softmax`: with :math:`\Delta = -x_{\min}/(N - 1)`,

  .. math::
    \widehat{e^{d}} = T_{\mathrm{round}(-d/\Delta)},\quad T_k = e^{-k\Delta}
    \ \big(\text{or}\ \mathrm{round}(2^F T_k)/2^F\big),\quad
    \hat y_i = \widehat{e^{x_i - m}} \big/ \textstyle\sum_j \widehat{e^{x_j - m}},

  0 beyond the table (``round(-d/Δ) > N - 1``). A gather per entry is slow in Triton and
  Mosaic, so the kernel recomputes the table entry ``exp(-Δ k)`` with the reference's
  float operations (the same value as the table's, in interpret mode exactly) instead of
  reading it; the arithmetic is then that of a hardware LUT.

  The gradient uses the output, as the reference's (``d/dx`` of the table is the table):
  ``dx = y (g - <y, g>)``.

  Args:
    x: ``[..., n]`` scores (read in their dtype, computed in float32).
    where: optional boolean mask broadcastable to x.
    table_size, x_min, frac_bits: as in :func:`jaxsoft.normalizers.lut_exp`.
    backend, interpret, block_rows: as in :func:`quantized_softmax`.

  Returns:
    x's shape and dtype.

  Examples:
    >>> from kernels_pallas import quantized as qs
    >>> qs.lut_softmax(jnp.array([2.0, 1.0, 0.0]), table_size=16, x_min=-4.0, interpret=True)
    Array([0.6672, 0.2296, 0.1032], dtype=float32)

  References:
    "Scaling LLM Test-Time Compute with Mobile NPU on Smartphones", 2025 (authors not
    recorded in docs/feature_ids.md).
  """
  name = "lut_softmax"
  _check_common(name, backend, block_rows)
  if isinstance(table_size, bool) or not isinstance(table_size, (int, np.integer)) \
      or table_size < 2:
    raise _err(name, f"`table_size` must be an int >= 2, got {table_size!r}")
  if not (isinstance(x_min, (int, float)) and math.isfinite(x_min) and x_min < 0):
    raise _err(name, f"`x_min` must be a finite number < 0, got {x_min!r}")
  if frac_bits is not None and (isinstance(frac_bits, bool) or not isinstance(
      frac_bits, (int, np.integer)) or not 1 <= frac_bits <= 30):
    raise _err(name, f"`frac_bits` must be None or an int in [1, 30], got {frac_bits!r}")
  x, x2 = tp.prepare_rows(x, where, name)
  static = (("table_size", int(table_size)), ("x_min", float(x_min)),
            ("frac_bits", None if frac_bits is None else int(frac_bits)))
  out = _lut_call(x2, static, backend, interpret, block_rows)
  return out.reshape(x.shape).astype(x.dtype)
