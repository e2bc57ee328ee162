r"""K12: Edge-MoE's single-pass softmax, as a reference function (K09 family).

The softmax of a streamed row in one pass over its entries (R. Sarkar, H. Liang, Z. Fan,
Z. Wang & C. Hao, 2023, "Edge-MoE"): for each entry, in order, the running maximum
("bias") ``b`` and the running sum ``s`` of ``e^{x - b}`` are updated together, the sum
rescaled when the maximum moves (the online normaliser of Milakov & Gimelshein, 2018, one
entry at a time),

.. math::
  a = b - x_j:\quad
  \begin{cases} s \leftarrow s\, e^{a} + 1,\ \ b \leftarrow x_j & a < 0 \text{ (a new maximum)}\\
  s \leftarrow s + e^{-a} & \text{otherwise,}\end{cases}

from ``b = `` the format's minimum and ``s = 0``; only ``(1 / s, b)`` is kept per row and
the weights ``e^{x_j - b} / s`` are formed when they are used (in Edge-MoE, inside the
attention-times-V product). Each exponential has a non-positive argument, so nothing
overflows.

The approximation is the arithmetic: the accelerator computes in the fixed-point type
``ap_fixed<32, 10>`` (32 bits, 10 of them integer bits with the sign: 22 fraction bits,
range ``[-512, 512)``). ``fixed_point=(W, I)`` emulates it: every intermediate (the input,
``a``, each exponential, each product, the sum, ``1/s`` and the weights) is truncated
toward minus infinity to the grid ``2^{-(W - I)}`` (AP_TRN, ap_fixed's default rounding) and
saturated to the range; ``fixed_point=None`` runs the same recurrence in floating point,
which is softmax up to rounding.

[R] reconstructed: the paper names the method only ("a fast single-pass softmax
approximation"); the recurrence, the type and the fused normalisation are read from the
authors' HLS code (sharc-lab/Edge-MoE, ``src/attention.cpp``, ``include/datatypes.hpp``).
Overflow saturates here where ap_fixed's default wraps (AP_WRAP): the two agree whenever
nothing overflows, which the source's ranges ensure (logits within ``[-256, 256)``, rows
shorter than 511); the HLS ``hls::exp`` is replaced by an exact exponential truncated to
the grid. The emulation computes in float32 (float64 under ``jax_enable_x64`` with
float64 input): exact on the grid while a value needs at most 24 significant bits
(``|v| < 4`` for 22 fraction bits); beyond, float32 rounding (relative ``2^{-24}``) comes
on top of the truncation.

Error (per weight, with ``delta = 2^{-(W - I)}``, n visible entries, no saturation):
``|w_j - softmax(x)_j| <= (2n + 6) delta`` -- the input's truncation moves the weights by at
most ``2 delta``; the n exponentials and up to n products each lose at most delta from the
sum ``s >= 1``; ``1/s`` and the final product lose delta each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers._softmax import softmax

__all__ = ["single_pass_softmax", "fixed_point_quantize", "single_pass_update",
           "single_pass_weights", "check_fixed_point", "EDGE_MOE_FIXED_POINT"]

EDGE_MOE_FIXED_POINT = (32, 10)  # ap_fixed<32, 10>, Edge-MoE's feature-map type fm_t


def check_fixed_point(fixed_point, fn_name: str) -> tuple[int, int] | None:
  """``fixed_point`` as ``(W, I)`` ints (or None), or a ValueError naming ``fn_name``.

  Args:
    fixed_point: None or ``(W, I)``, total and integer bits, ``2 <= I < W <= 64``.
    fn_name: the caller's name, for the message.

  Returns:
    ``(W, I)`` as Python ints, or None.

  Examples:
    >>> from jaxsoft.normalizers import single_pass
    >>> single_pass.check_fixed_point((32, 10), "f")
    (32, 10)
    >>> single_pass.check_fixed_point((8, 8), "f")
    Traceback (most recent call last):
    ...
    ValueError: f: `fixed_point` must be None or (W, I) ints with 2 <= I < W <= 64 (total and integer bits), got (8, 8)

  References:
    Xilinx (AMD), Vitis HLS User Guide (UG1399), "Arbitrary Precision Fixed-Point Data
    Types".
  """
  if fixed_point is None:
    return None
  try:
    w, i = fixed_point
    ok = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (w, i))
  except (TypeError, ValueError):
    ok = False
  if not ok or not 2 <= int(i) < int(w) <= 64:
    raise ValueError(f"{fn_name}: `fixed_point` must be None or (W, I) ints with "
                     f"2 <= I < W <= 64 (total and integer bits), got {fixed_point!r}")
  return int(w), int(i)


def fixed_point_quantize(v, fixed_point):
  r"""``v`` truncated to the ``ap_fixed<W, I>`` grid and saturated to its range.

  .. math::
    q(v) = \operatorname{clip}\big(2^{-F} \lfloor 2^{F} v \rfloor,\ -2^{I-1},\
    2^{I-1} - 2^{-F}\big), \qquad F = W - I

  (``fixed_point=None``: the identity).

  Args:
    v: a float array.
    fixed_point: ``(W, I)``, total and integer bits (the sign included in I), or None.

  Returns:
    ``q(v)`` in v's dtype.

  Examples:
    >>> from jaxsoft.normalizers import single_pass
    >>> single_pass.fixed_point_quantize(jnp.array([0.3, -0.3, 9.0]), (8, 4))  # F = 4
    Array([ 0.25  , -0.3125,  7.9375], dtype=float32)

  References:
    Xilinx (AMD), Vitis HLS User Guide (UG1399), "Arbitrary Precision Fixed-Point Data
    Types" (ap_fixed, AP_TRN and the range).
  """
  fmt = check_fixed_point(fixed_point, "fixed_point_quantize")
  if fmt is None:
    return v
  w, i = fmt
  step = 2.0 ** -(w - i)
  top = 2.0 ** (i - 1)
  return jnp.clip(jnp.floor(v / step) * step, -top, top - step)


def single_pass_update(b, s, x, fixed_point=EDGE_MOE_FIXED_POINT, visible=None):
  r"""One entry of the single-pass recurrence: ``(b, s)`` after ``x`` (elementwise).

  ``a = b - x``; a new maximum (``a < 0``) gives ``s = q(q(s e^{a}) + 1)``, ``b = x``;
  otherwise ``s = q(s + q(e^{-a}))``, with q :func:`fixed_point_quantize` (each
  exponential truncated too). Entries where ``visible`` is False leave the state as it is.

  Args:
    b, s: the running maximum and sum (float arrays of one shape).
    x: the next entry of each row (already on the grid: ``q(x)``).
    fixed_point: ``(W, I)`` or None (floating point).
    visible: optional boolean array; False skips the entry.

  Returns:
    ``(b, s)``.

  Examples:
    >>> from jaxsoft.normalizers import single_pass
    >>> b, s = jnp.array(-512.0), jnp.array(0.0)
    >>> for x in (1.0, 3.0, 2.0):
    ...   b, s = single_pass.single_pass_update(b, s, jnp.array(x), None)
    >>> float(b), round(float(s), 4), round(float(jnp.exp(-2.0) + 1 + jnp.exp(-1.0)), 4)
    (3.0, 1.5032, 1.5032)

  References:
    R. Sarkar, H. Liang, Z. Fan, Z. Wang & C. Hao, 2023, "Edge-MoE: Memory-Efficient
    Multi-Task Vision Transformer Architecture with Task-level Sparsity via
    Mixture-of-Experts" (ICCAD).
  """
  q = _quantizer(fixed_point)
  a = q(b - x)
  new = a < 0
  e = q(jnp.exp(jnp.where(new, a, -a)))
  s_new = jnp.where(new, q(q(s * e) + 1.0), q(s + e))
  b_new = jnp.where(new, x, b)
  if visible is not None:
    s_new, b_new = jnp.where(visible, s_new, s), jnp.where(visible, b_new, b)
  return b_new, s_new


def single_pass_weights(x, b, s, fixed_point=EDGE_MOE_FIXED_POINT):
  r"""The weights from the row's final state: ``q(q(e^{q(x - b)}) q(1 / s))``.

  Args:
    x: the entries (on the grid), broadcastable against ``b`` and ``s``.
    b, s: the final running maximum and sum of the row (``s = 0``: no visible entry,
      weights 0).
    fixed_point: ``(W, I)`` or None.

  Returns:
    The weights, x's shape.

  Examples:
    >>> from jaxsoft.normalizers import single_pass
    >>> x = jnp.array([1.0, 3.0, 2.0])
    >>> single_pass.single_pass_weights(x, 3.0, jnp.sum(jnp.exp(x - 3.0)), None)
    Array([0.09  , 0.6652, 0.2447], dtype=float32)

  References:
    R. Sarkar, H. Liang, Z. Fan, Z. Wang & C. Hao, 2023, "Edge-MoE".
  """
  q = _quantizer(fixed_point)
  r = q(jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0))
  return q(q(jnp.exp(q(x - b))) * r)


def _quantizer(fixed_point):
  fmt = check_fixed_point(fixed_point, "single_pass_softmax")
  if fmt is None:
    return lambda v: v
  return lambda v: fixed_point_quantize(v, fmt)


def _floor_of(fixed_point, dtype):
  return -(2.0 ** (fixed_point[1] - 1)) if fixed_point is not None else jnp.finfo(dtype).min


@c.dense_rules
def _single_pass(x, axis=-1, where=None, *, fixed_point):
  xs, mask, axis = c.prepare(x, axis, where, "single_pass_softmax")
  q = _quantizer(fixed_point)
  xq = q(xs)
  rows = jnp.moveaxis(xq, axis, 0)
  vis = jnp.moveaxis(mask, axis, 0)
  init = (jnp.full(rows.shape[1:], _floor_of(fixed_point, xs.dtype), xs.dtype),
          jnp.zeros(rows.shape[1:], xs.dtype))

  def step(state, xv):
    b, s = state
    return single_pass_update(b, s, xv[0], fixed_point, xv[1]), None

  (b, s), _ = jax.lax.scan(step, init, (rows, vis))
  w = single_pass_weights(xq, jnp.expand_dims(b, axis), jnp.expand_dims(s, axis), fixed_point)
  # the gradient is softmax's (straight-through): the truncations have none
  exact = softmax(xs, axis=axis, where=mask)
  w = exact + jax.lax.stop_gradient(jnp.where(mask, w, 0.0) - exact)
  return c.finish(w, mask, jnp.asarray(x).dtype)


def single_pass_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                        fixed_point: tuple[int, int] | None = EDGE_MOE_FIXED_POINT
                        ) -> jax.Array:
  r"""Edge-MoE's single-pass softmax in fixed point (feature K12, K09 family; not registered).

  One pass over each row's visible entries, in order along ``axis``, carries the running
  maximum ``b`` and the sum ``s`` of ``e^{x - b}`` (:func:`single_pass_update`); the weights
  are ``e^{x_j - b} / s`` (:func:`single_pass_weights`), each step truncated to the
  ``ap_fixed<W, I>`` grid (see the module docstring, which also marks what is
  reconstructed [R]):

  .. math::
    w_j = q\big(q(e^{q(\hat x_j - b)})\, q(1/s)\big), \qquad \hat x = q(x), \qquad
    |w_j - \operatorname{softmax}(x)_j| \le (2n + 6)\, 2^{-(W - I)}

  for n visible entries (no saturation: logits within the range, ``n < 2^{I-1}``).
  ``fixed_point=None`` is the same recurrence in floating point (softmax up to rounding).
  The gradient is softmax's (straight-through: the truncations have none). This is a
  reference function for numerics studies, like the K09 quantisers; the Pallas kernel of
  the same recurrence is :func:`kernels_pallas.single_pass.single_pass_softmax`.

  Args:
    x: scores.
    axis: the axis to normalise over (the order of the pass is along it).
    where: optional boolean mask broadcastable to ``x``; False entries are skipped and
      get exactly 0.
    fixed_point: ``(W, I)`` total and integer bits (default ``(32, 10)``, Edge-MoE's
      ``ap_fixed<32, 10>``), or None for floating point.

  Returns:
    Weights of ``x``'s shape and dtype (bf16 input: computed in float32); a row with no
    visible entry is all zeros.

  Examples:
    ``ap_fixed<32, 10>`` (the default) agrees with softmax to about ``1e-6``; with 8
    fraction bits the truncation shows:

    >>> x = jnp.array([1.0, 3.0, 2.0, -1.5])
    >>> js.normalizers.single_pass_softmax(x, fixed_point=(12, 4))
    Array([0.0859, 0.6602, 0.2422, 0.0039], dtype=float32)
    >>> js.normalizers.softmax(x)
    Array([0.0894, 0.6604, 0.2429, 0.0073], dtype=float32)

  References:
    R. Sarkar, H. Liang, Z. Fan, Z. Wang & C. Hao, 2023, "Edge-MoE: Memory-Efficient
    Multi-Task Vision Transformer Architecture with Task-level Sparsity via
    Mixture-of-Experts" (ICCAD; "a fast single-pass softmax approximation").

    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".
  """
  fmt = check_fixed_point(fixed_point, "single_pass_softmax")
  return _single_pass_jit(x, axis, where, fmt)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _single_pass_jit(x, axis, where, fixed_point):
  return _single_pass(x, axis, where, fixed_point=fixed_point)
