"""N17 alpha-entmax: 1.5-entmax exact (sort-free), any alpha > 1 by bisection, learned alpha.

alpha-entmax (B. Peters, V. Niculae & A. F. T. Martins, "Sparse Sequence-to-Sequence
Models", ACL 2019, arXiv 1905.05702; G. M. Correia, V. Niculae & A. F. T. Martins,
"Adaptively Sparse Transformers", EMNLP 2019, arXiv 1909.00015)
maps scores to ``p = [(alpha - 1) x - tau]_+^{1/(alpha - 1)}`` with tau such that the row sums
to 1. alpha -> 1 is softmax, alpha = 2 is sparsemax, alpha = 1.5 has an exact closed form
once the support is known.
"""

from __future__ import annotations

import functools
import numbers
from typing import TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.normalizers import _sparsemax
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, ThresholdRule, register

__all__ = ["entmax15", "entmax", "learned_alpha"]

_ALPHA = Param("alpha", 1.5, low=1.0, low_open=True, sample=1.25, row_broadcast=True)
_N_ITER = Param("n_iter", None, low=1, sample=40, static=True)


# --- 1.5-entmax: exact ----------------------------------------------------------------------


def entmax15_threshold(ym, split: bool = False):
  """tau with ``sum_j [y_j - tau]_+^2 = 1`` over the last axis, for rows with ``max y = 0``.

  ``ym`` holds ``x/2`` minus its row max, ``-inf`` at masked entries, so tau lies in
  ``[-1, -n^{-1/2}]``, where ``f(t) = sum [y - t]_+^2 - 1`` is convex and decreasing. A
  pass at a point t computes, over its support ``S = {y > t}`` (whose size the previous
  pass counted), ``s1 = sum (y - t)`` and ``s2 = sum (y - t)^2``, and from them the root
  of the support's quadratic ``q(t + d) = |S| d^2 - 2 s1 d + s2 - 1``,
  ``r = t + (s2 - 1) / (s1 + sqrt(s1^2 - |S|(s2 - 1)))`` (Peters et al. 2019, Alg. 2,
  without the sort). The next point is r, and a third pass counts ``{y > r}``: when that
  is still ``|S|``, S is r's own support and ``tau = r`` exactly.

  Otherwise r lies on the other side of the root: from a point below it (``f(t) >= 0``,
  S a superset of the final support) ``q >= f`` beyond t, so ``f(r) <= 0``; from a point
  above it (S a subset) ``q <= f`` below t, so ``f(r) >= 0``. The points thus alternate
  around tau with supports closing in on the final one from both sides. A bracket
  ``[lo, hi]`` of the points seen guards against rounding and an r without a real root
  (far below the root, where the support is wide); then the next point is lo, which every
  pass raises by a Newton step on ``h(t) = sqrt(s2(t)) - 1``, ``t + (s2 - sqrt(s2)) / s1``:
  h is convex (the 2-norm of convex, non-negative functions), so the step lands below the
  root from either side, and it is never behind Newton on f, ``t + (s2 - 1) / (2 s1)``,
  which only halves the distance far from the root. Most rows settle in 3-4 passes of
  three reductions each; the loop runs until every row of the block has.

  The sums of that last pass are taken at the previous point, up to 1 below tau, where
  ``s2 ~ |S| (t - tau)^2`` can be thousands: ``s2 - 1`` cancels ~log2 s2 bits and the row
  summed to ``1 +- 1e-3`` (n = 8192; 1e-2 at n = 65536). So the closed form is taken once
  more from the settled t, where ``s2 ~ 1``, with :func:`_sparsemax.accurate_row_sum`:
  tau = t + lo, ``lo`` a few ulps of t. ``split`` returns the pair ``(t, lo)`` (see
  :func:`_sparsemax.sparsemax_threshold`: a float tau alone shifts every weight alike).

  Args:
    ym: ``x / 2`` minus its visible row max, ``-inf`` masked, normalized axis last.
    split: return ``(t, lo)`` (tau = t + lo) instead of tau.

  Returns:
    tau of shape ``ym.shape[:-1] + (1,)`` (0 for rows with no visible entry, NaN for rows
    with a NaN), or the pair.
  """
  def step(t, cnt, lo, hi):
    # Select-and-add reductions (the fastest form on XLA:CPU; see _sparsemax.relu_sum),
    # the second made to depend on the first (c.decouple) so that they stay two loops.
    s1 = _sparsemax.relu_sum(ym, t)
    nan = jnp.isnan(s1)  # a NaN y: the row's tau is NaN (see _sparsemax.relu_sum)
    t1 = c.decouple(t, s1)
    s2 = jnp.sum(jnp.where(ym > t1, jnp.square(ym - t1), 0.0), axis=-1, keepdims=True)
    f = s2 - 1.0
    below = f >= 0.0
    lo = jnp.where(below, jnp.maximum(lo, t), lo)
    hi = jnp.where(below, hi, jnp.minimum(hi, t))
    # Newton on the convex h(t) = ||[y - t]_+||_2 - 1 (a norm of convex, non-negative
    # functions): below the root from either side, and never behind Newton on f.
    lo = jnp.maximum(lo, t + c.safe_divide(s2 - jnp.sqrt(s2), s1))
    disc = s1 * s1 - cnt * f
    r = t + c.safe_divide(f, s1 + jnp.sqrt(jnp.maximum(disc, 0.0)))
    # r within the bracket, widened by its width and a few ulps for rounding (an r just
    # past the Newton point: the support can already be the final one).
    slack = jnp.maximum(hi - lo, 64.0 * jnp.finfo(ym.dtype).eps * (1.0 - t))
    use_r = (disc >= 0.0) & (r >= lo - slack) & (r <= hi + slack)
    t_new = jnp.where(use_r, r, lo)
    t_new = jnp.where(nan, jnp.asarray(jnp.nan, t.dtype), t_new)
    cnt_new = _sparsemax.count_above(ym, t_new)
    same = cnt_new == cnt
    # Done: r's own support is S (exact), or no step moves t any more (the root to
    # rounding: f(t) = 0 in floating point), or nothing is visible.
    now_done = (use_r & same) | ((t_new == t) & same) | (cnt == 0) | nan
    return (jnp.where((cnt > 0) | nan, t_new, 0.0), cnt_new, lo, hi), now_done

  minus_one = c.row_full_like(ym, -1.0)
  init = (minus_one, _sparsemax.count_above(ym, minus_one), minus_one, jnp.zeros_like(minus_one))
  t, cnt, _, _ = c.passes_until_done(step, init, ym.shape[-1] + 2)
  # the root of the support's quadratic once more, from t itself (cnt: its support's size)
  d = jnp.where(ym > t, ym - t, 0.0)
  s1 = _sparsemax.accurate_row_sum(d)
  s2 = _sparsemax.accurate_row_sum(jnp.square(c.decouple(d, s1)))
  f = s2 - 1.0
  lo = c.safe_divide(f, s1 + jnp.sqrt(jnp.maximum(s1 * s1 - cnt * f, 0.0)))
  return (t, lo) if split else t + lo


@jax.custom_jvp
def _entmax15_from_threshold(x, mask, top, tau, tau_lo=0.0):
  """1.5-entmax over the last axis given its threshold ``tau + tau_lo`` (no gradient)."""
  # (x - top) / 2 is formed in the same loop: no full-size x / 2 is written.
  d = (_sparsemax.shifted(x, mask, top, 0.5) - tau) - tau_lo
  return jnp.where(d > 0.0, d * d, 0.0)


@_entmax15_from_threshold.defjvp
def _entmax15_from_threshold_jvp(primals, tangents):
  x_dot = tangents[0]
  p = _entmax15_from_threshold(*primals)
  # g = sqrt(p) on the support, 0 off it, with the sqrt taken only where p > 0: its own
  # derivative (second order) is then 1 / (2 sqrt p) on the support and 0 off it, never
  # the NaN of sqrt differentiated at 0.
  on = p > 0.0
  g = jnp.where(on, jnp.sqrt(jnp.where(on, p, 1.0)), 0.0)
  return p, _support_jvp(g, x_dot)


def _entmax15_last(x, mask, top, shift, where):
  """1.5-entmax over the last axis of float32/64 ``x`` whose visible row max is ``top``."""
  tau, lo = _sparsemax.unsplit(_sparsemax.threshold_by_blocks(
      _sparsemax.split_solve(entmax15_threshold), jax.lax.stop_gradient(x), where, shift, 0.5))
  return _entmax15_from_threshold(x, mask, top, tau, lo), tau


_support_jvp = _sparsemax.support_jvp


@functools.partial(jax.jit, static_argnames=("axis",))
def entmax15(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""1.5-entmax, exact (feature N17, kernel class T; Peters, Niculae & Martins, ACL 2019).

  .. math::
    \mathrm{entmax}_{1.5}(x)_i = \left[\tfrac{x_i}{2} - \tau\right]_+^2, \qquad
    \sum_{j \in V} \left[\tfrac{x_j}{2} - \tau\right]_+^2 = 1

  over the visible entries V of the row: ``argmax_{p in simplex} p.x + H_1.5(p)`` with the
  Tsallis entropy ``H_a(p) = sum(p - p^a) / (a (a - 1))``. tau is exact (the closed form of
  the support's quadratic, found without a sort by Newton passes, see
  :func:`entmax15_threshold`; to a few ulps, kept as two floats, so a row of n weights sums
  to 1 within about ``sqrt(n)`` ulps). Sparse, shift invariant, differentiable; the Jacobian is
  ``J v = g v - g (sum g v) / sum g`` with ``g = sqrt(p)`` (a ``custom_jvp`` written from
  the output: reverse mode keeps only ``p`` and one flag per row).

  Args:
    x, axis, where: as in :func:`sparsemax`.

  Returns:
    Weights as :func:`sparsemax` returns them.

  Examples:
    >>> x = jnp.array([1.0, 0.8, 0.1, -1.0])
    >>> js.normalizers.entmax15(x)  # between softmax (no zeros) and sparsemax ([0.6, 0.4, 0, 0])
    Array([0.5292, 0.3937, 0.077 , 0.    ], dtype=float32)

  References:
    B. Peters, V. Niculae & A. F. T. Martins, 2019, "Sparse Sequence-to-Sequence Models".
  """
  return _entmax15_saving_output(x, where, (), (axis, 1.5))


@c.dense_rules
def _entmax15_rows(x, axis=-1, where=None):
  """:func:`entmax15`'s forward pass, under the shared rules."""
  return _sparsemax.fused_along_axis(_entmax15_last, x, axis, where, "entmax15")


_entmax15_rows.__name__ = "entmax15"  # the name the shared rules give in their errors


def _support_weights(p, on, exponent):
  """``g = p^exponent`` on the support, 0 off it, the power taken only where ``p > 0``: its
  own derivative (second order) is then finite, never the NaN of ``sqrt`` at 0."""
  p_on = jnp.where(on, p, jnp.ones((), p.dtype))
  if isinstance(exponent, (int, float)) and exponent == 0.5:
    g = jnp.sqrt(p_on)
  elif isinstance(exponent, (int, float)) and exponent == 0.0:
    return on.astype(p.dtype)
  else:
    g = jnp.power(p_on, exponent)
  return jnp.where(on, g, jnp.zeros((), p.dtype))


def _entmax_tangent(y, odd, dx, params, dparams, static):
  r"""``dp = J dx + (dp/dalpha) dalpha`` from the output ``p`` (and alpha) alone.

  ``J v = g v - g (sum g v) / sum g``, ``g = p^{2 - alpha}`` on the support; for a traced
  alpha, ``dp/dalpha = (p - p~) / (alpha - 1)^2 - (p log p - p~ sum(p log p)) / (alpha - 1)``
  with ``p~ = g / sum g`` (Correia, Niculae & Martins 2019, App. B). Rows the shared rules
  fill in get a zero tangent.
  """
  axis, alpha_static = static[0], static[1]
  p, on = _sparsemax.on_support(y, odd)
  if alpha_static is not None:
    g = _support_weights(p, on, 2.0 - alpha_static)
    return _support_jvp(g, dx.astype(p.dtype), axis).astype(y.dtype)
  (alpha,), (dalpha,) = params, dparams
  am1 = c.row_value(alpha, y.ndim, p.dtype) - 1.0
  g = _support_weights(p, on, 1.0 - am1)  # p^{2 - alpha}
  parts = []
  if not c.is_zero_tangent(dx):
    parts.append(_support_jvp(g, dx.astype(p.dtype), axis))
  if not c.is_zero_tangent(dalpha):
    p_on = jnp.where(on, p, jnp.ones((), p.dtype))
    plogp = jnp.where(on, p_on * jnp.log(p_on), jnp.zeros((), p.dtype))
    skew = c.safe_divide(g, jnp.sum(g, axis=axis, keepdims=True))
    ent = jnp.sum(plogp, axis=axis, keepdims=True)
    dp_dalpha = (p - skew) / (am1 * am1) - (plogp - skew * ent) / am1
    parts.append(dp_dalpha * c.row_value(dalpha, y.ndim, p.dtype))
  return sum(parts[1:], parts[0]).astype(y.dtype)


# Reverse mode keeps p and one flag per row.
_entmax15_saving_output = c.saving_output(
    lambda x, where, params, static: _entmax15_rows(x, static[0], where),
    _entmax_tangent, "entmax15")
# entmax15 applies the shared rules through _entmax15_rows: the registry's mark
setattr(entmax15, "_jaxsoft_dense_rules", True)  # noqa: B010


# --- any alpha > 1: bisection --------------------------------------------------------------


def _power(d, q):
  """``d ** q`` for ``d >= 0``; integer q (static) uses repeated multiplication."""
  if isinstance(q, float) and q.is_integer() and 1 <= q <= 8:
    return jax.lax.integer_pow(d, int(q))
  return jnp.power(d, q)


def _traced_power(d, q):
  """``d ** q`` for ``d >= 0`` and an array ``q > 0``, as ``exp(q log d)`` (0 at d = 0, with
  finite gradients there). In the blockwise attention tiles XLA:CPU runs ``pow`` with an
  array exponent slower than this exp and log; the dense row solver keeps ``pow``, which
  is the faster of the two inside its fused bisection sums. Relative error about
  ``(1 + |q log d|)`` ulps: at most 8 where ``d^q >= e^-7``."""
  pos = d > 0
  return jnp.where(pos, jnp.exp(q * jnp.log(jnp.where(pos, d, 1.0))), 0.0)


def entmax_bisect_threshold(ym, am1, n_visible, n_iter: int, q=None):
  """tau for ``sum_j [y_j - tau]_+^{1/(alpha-1)} = 1`` by ``n_iter`` bisection steps.

  ``ym = (alpha - 1) x`` minus its row max (``-inf`` masked). The bracket is the one of
  Peters et al. (2019): ``f(-1) >= 0`` from the max entry alone and ``f(-n^{1-alpha}) <= 0``
  since every entry then contributes at most ``1/n``. Returns the lower end ``lo`` (where
  ``f(lo) >= 0``, so the support is never empty).
  """
  q = 1.0 / am1 if q is None else q
  n_safe = jnp.maximum(n_visible, 1.0)
  lo = c.row_full_like(ym, -1.0)
  hi = -jnp.power(n_safe, -am1) + jnp.zeros_like(lo)

  def body(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    f = jnp.sum(_power(jnp.maximum(ym - mid, 0.0), q), axis=-1, keepdims=True) - 1.0
    return jnp.where(f >= 0, mid, lo), jnp.where(f >= 0, hi, mid)

  return jax.lax.fori_loop(0, n_iter, body, (lo, hi))[0]


def _entmax_bisect_forward(x, mask, alpha, n_iter, q):
  am1 = alpha - 1.0
  z = x * am1
  ym = jnp.where(mask, z - c.masked_max(z, mask, -1), -jnp.inf)
  n = c.visible_count(mask, -1, x.dtype)
  if q is None:
    # A traced alpha: XLA:CPU does not vectorise a per-row exponent inside row blocks.
    tau = entmax_bisect_threshold(ym, am1, n, n_iter)
  else:
    solve = lambda y, k: entmax_bisect_threshold(y, am1, k, n_iter, q)  # noqa: E731
    tau = c.map_row_blocks(solve, ym, n)
  p = _power(jnp.maximum(ym - tau, 0.0), 1.0 / am1 if q is None else q)
  return c.safe_divide(p, jnp.sum(p, axis=-1, keepdims=True))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _entmax_bisect_last(x, mask, alpha, n_iter, q):
  return _entmax_bisect_forward(x, mask, alpha, n_iter, q)


@_entmax_bisect_last.defjvp
def _entmax_bisect_last_jvp(n_iter, q, primals, tangents):
  x, mask, alpha = primals
  x_dot, _, alpha_dot = tangents
  p = _entmax_bisect_last(x, mask, alpha, n_iter, q)
  am1 = alpha - 1.0
  on = p > 0
  p_on = jnp.where(on, p, 1.0)
  g = jnp.where(on, jnp.power(p_on, 1.0 - am1), 0.0)  # p^{2 - alpha}
  dx = _support_jvp(g, x_dot)
  # dp/dalpha in closed form (Correia, Niculae & Martins 2019, App. B): with
  # p~ = g / sum g and the Shannon terms p log p,
  #   dp/dalpha = (p - p~) / (alpha - 1)^2 - (p log p - p~ sum(p log p)) / (alpha - 1).
  plogp = jnp.where(on, p_on * jnp.log(p_on), 0.0)
  skew = c.safe_divide(g, jnp.sum(g, axis=-1, keepdims=True))
  ent = jnp.sum(plogp, axis=-1, keepdims=True)
  dp_dalpha = (p - skew) / (am1 * am1) - (plogp - skew * ent) / am1
  return p, dx + dp_dalpha * alpha_dot


def _is_python_scalar(v: object) -> TypeGuard[numbers.Real]:
  return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _check_alpha(alpha):
  if _is_python_scalar(alpha):
    _ALPHA.validate(alpha, "entmax")
    return
  if isinstance(alpha, jax.core.Tracer):
    return  # checked when concrete; learned_alpha keeps a traced alpha > 1
  a = np.asarray(alpha)
  if a.size and (np.any(np.isnan(a)) or np.any(a <= 1.0)):
    raise ValueError(f"entmax: `alpha` must be > 1 everywhere, got min {np.nanmin(a)!r}"
                     + (" (and NaN)" if np.any(np.isnan(a)) else ""))


def entmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
           alpha: ArrayLike = 1.5, n_iter: int | None = None) -> jax.Array:
  r"""alpha-entmax for any alpha > 1 (feature N17, kernel class T; Peters et al. 2019).

  .. math::
    \mathrm{entmax}_\alpha(x)_i = [(\alpha - 1) x_i - \tau]_+^{1/(\alpha - 1)}, \qquad
    \sum_{j \in V} [(\alpha - 1) x_j - \tau]_+^{1/(\alpha - 1)} = 1

  over the visible entries V: ``argmax_{p in simplex} p.x + H_alpha(p)`` with the Tsallis
  entropy (Peters, Niculae & Martins 2019). alpha -> 1 approaches softmax, alpha = 2 is
  sparsemax. tau is found by ``n_iter`` bisection steps in float32 (also for bf16/fp16 x)
  on ``[max - 1, max - n^{1-alpha}]``, and p renormalised. A Python-number alpha of exactly
  1.5 or 2 takes the exact sort-free solvers of :func:`entmax15` / ``sparsemax`` instead.

  Differentiable in x (``J v = g v - g (sum g v)/sum g``, ``g = p^{2-alpha}`` on the
  support) and in alpha (the closed form of Correia, Niculae & Martins, EMNLP 2019,
  "Adaptively Sparse Transformers"), both through a ``custom_jvp`` written from the
  output: reverse mode keeps only ``p`` and one flag per row. For a learned alpha use
  ``alpha = learned_alpha(z)``, which is > 1 by construction.

  Args:
    x: scores.
    alpha: > 1; a Python float or an array broadcast to the rows (shape broadcastable
      against ``x`` with size 1 along ``axis``, e.g. ``[N, 1, 1]`` per head of
      ``[B, N, T, S]`` scores).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.
    n_iter: bisection steps; default 30 (float32; the bracket is narrower than 1, so this
      reaches float32 resolution), 60 for float64 inputs.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros, with zero
    gradient.

  Raises:
    ValueError: alpha <= 1 (checked for concrete values), bad ``n_iter``, ``axis`` or
      ``where``. A traced alpha cannot be checked: where it is <= 1 the row's weights are
      NaN (and so is everything computed from them), never a plausible distribution.

  Examples:
    >>> x = jnp.array([1.0, 0.8, 0.1, -1.0])
    >>> js.normalizers.entmax(x, alpha=1.25)  # close to softmax: no zero yet
    Array([0.4787, 0.3736, 0.1356, 0.0121], dtype=float32)
    >>> js.normalizers.entmax(x, alpha=4.0)  # larger alpha, smaller support
    Array([0.8452, 0.1548, 0.    , 0.    ], dtype=float32)
    >>> js.normalizers.entmax(jnp.stack([x, x]), alpha=jnp.array([[1.25], [2.0]]))  # per row
    Array([[0.4787, 0.3736, 0.1356, 0.0121],
           [0.6   , 0.4   , 0.    , 0.    ]], dtype=float32)

  References:
    B. Peters, V. Niculae & A. F. T. Martins, 2019, "Sparse Sequence-to-Sequence Models".

    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers".

    M. Blondel, A. F. T. Martins & V. Niculae, 2020, "Learning with Fenchel-Young Losses".
  """
  _check_alpha(alpha)
  _check_n_iter(n_iter)
  n_iter = None if n_iter is None else int(n_iter)
  if _is_python_scalar(alpha):  # static: the exact solvers, a static exponent
    return _entmax_saving_output(x, where, (), (axis, float(alpha), n_iter))
  return _entmax_saving_output(x, where, (alpha,), (axis, None, n_iter))


def _check_n_iter(n_iter):
  if n_iter is not None and (not isinstance(n_iter, (int, np.integer)) or n_iter < 1):
    raise ValueError(f"entmax: `n_iter` must be a positive int, got {n_iter!r}")


@c.dense_rules
def _entmax_rows(x, axis=-1, where=None, *, alpha=1.5, n_iter=None):
  """:func:`entmax`'s forward pass, under the shared rules."""
  _check_alpha(alpha)
  _check_n_iter(n_iter)
  # The exact solvers run inside this call's rules (calling the decorated entmax15 or
  # sparsemax would apply the input rules twice: two more passes over the rows).
  if _is_python_scalar(alpha) and float(alpha) == 1.5:
    return _sparsemax.fused_along_axis(_entmax15_last, x, axis, where, "entmax")
  if _is_python_scalar(alpha) and float(alpha) == 2.0:
    return _sparsemax.fused_along_axis(_sparsemax._sparsemax_last, x, axis, where, "entmax")
  # A Python alpha gives a static exponent (integer powers become multiplications).
  q = 1.0 / (float(alpha) - 1.0) if _is_python_scalar(alpha) else None
  return _entmax_bisect(x, alpha, where, axis=axis, n_iter=n_iter, q=q)


_entmax_rows.__name__ = "entmax"  # the name the shared rules give in their errors


def _entmax_rows_of(x, where, params, static):
  axis, alpha, n_iter = static
  return _entmax_rows(x, axis, where, alpha=params[0] if alpha is None else alpha,
                      n_iter=n_iter)


# Reverse mode keeps p and one flag per row.
_entmax_saving_output = c.saving_output(_entmax_rows_of, _entmax_tangent, "entmax")
# entmax applies the shared rules through _entmax_rows: the registry's mark
setattr(entmax, "_jaxsoft_dense_rules", True)  # noqa: B010


@functools.partial(jax.jit, static_argnames=("axis", "n_iter", "q"))
def _entmax_bisect(x, alpha, where, axis, n_iter, q):
  xs, mask, axis = c.prepare(x, axis, where, "entmax")
  if n_iter is None:
    n_iter = 60 if xs.dtype == jnp.float64 else 30
  a_rows = c.row_param(alpha, xs.shape, axis, "alpha", "entmax", xs.dtype)
  a = c.to_last(a_rows, axis) if a_rows.ndim else a_rows
  p = _entmax_bisect_last(c.to_last(xs, axis), c.to_last(mask, axis), a, int(n_iter), q)
  p = c.from_last(p, axis)
  if q is None:  # a traced alpha <= 1 (no entmax) gives NaN, never a plausible distribution
    p = jnp.where(a_rows > 1.0, p, jnp.nan)
  return c.finish(p, mask, jnp.asarray(x).dtype)


def learned_alpha(z: ArrayLike, min_gap: float = 1e-3) -> jax.Array:
  """``alpha = 1 + min_gap + softplus(z)``: an unconstrained parameter mapped into alpha > 1.

  ``min_gap`` keeps alpha > 1 also in float32, where ``1 + softplus(z)`` rounds to exactly 1
  for z below about -17 (and alpha - 1 = 0 has no entmax); at ``alpha - 1 = 1e-3`` entmax
  is already within about 1e-3 of softmax. ``min_gap=0`` gives the plain ``1 + softplus(z)``.

  Examples:
    >>> js.normalizers.learned_alpha(jnp.array([-5.0, 0.0, 5.0]))  # always > 1
    Array([1.0077, 1.6941, 6.0077], dtype=float32)

  References:
    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers".
  """
  return 1.0 + min_gap + jax.nn.softplus(z)


# --- class-T rules (ThresholdRule: the blockwise paths solve tau over key blocks) ---------


def _half_score_map(x, length, **_):
  return 0.5 * x


def _sq_relu(z, tau, *_, **__):
  d = jnp.maximum(z - tau, 0.0)
  return d * d


def _entmax15_bracket(m, length, **_):
  # max(length, 1) as jnp.clip, a jitted function (the Pallas interpreter inside
  # jax.shard_map: see _topk_target in _topk.py)
  return m - 1.0, m - jax.lax.rsqrt(jnp.clip(length, min=1.0))


def _alpha_score_map(x, length, alpha=1.5, **_):
  return (alpha - 1.0) * x


def _alpha_mass(z, tau, *_, alpha=1.5, **__):
  # [z - tau]_+^{1/(alpha-1)} with a double where: for alpha > 2 the exponent is < 1 and
  # the power's derivative at 0 is inf, which times the clamp's 0 made the blockwise
  # gradients (xla_chunked, Pallas) NaN. An array alpha (per head, learned) goes through
  # exp and log (_traced_power: pow with an array exponent is 3.4x slower on XLA:CPU).
  d = z - tau
  if not isinstance(alpha, (int, float)):
    return _traced_power(d, 1.0 / (alpha - 1.0))
  pos = d > 0
  return jnp.where(pos, jnp.power(jnp.where(pos, d, 1.0), 1.0 / (alpha - 1.0)), 0.0)


def _alpha_weight(z, tau, *args, alpha=1.5, **kwargs):
  # The final weights: as the mass, and NaN for a traced alpha <= 1 (there is no entmax
  # there; a plausible-looking distribution would be a silent wrong answer).
  w = _alpha_mass(z, tau, *args, alpha=alpha, **kwargs)
  if isinstance(alpha, (int, float)):
    return w
  return jnp.where(alpha > 1.0, w, jnp.nan)


def _alpha_bracket(m, length, alpha=1.5, **_):
  # jnp.clip: see _entmax15_bracket
  return m - 1.0, m - jnp.power(jnp.clip(length, min=1.0), 1.0 - alpha)


def _alpha_newton_power(alpha=1.5, **_):
  # (sum_j [z_j - tau]_+^{1/(alpha-1)})^{alpha-1}: a norm of convex functions (alpha <= 2)
  return alpha - 1.0


def _half_newton_power(**_):
  return 0.5


ENTMAX15_RULE = ThresholdRule(
    score_map=_half_score_map, mass=_sq_relu, target=_sparsemax._unit_target,
    bracket=_entmax15_bracket, weight=_sq_relu, iterations=30,
    newton_power=_half_newton_power)

ENTMAX_RULE = ThresholdRule(
    score_map=_alpha_score_map, mass=_alpha_mass, target=_sparsemax._unit_target,
    bracket=_alpha_bracket, weight=_alpha_weight, iterations=30,
    newton_power=_alpha_newton_power)

SPEC15 = register(NormalizerSpec(
    name="entmax15",
    fn=entmax15,
    kernel_class="T",
    catalogue_id="N17",
    can_be_sparse=True,
    threshold=ENTMAX15_RULE,
    residuals="output",
    description="[x/2 - tau]_+^2, exact 1.5-entmax",
))

SPEC = register(NormalizerSpec(
    name="entmax",
    fn=entmax,
    kernel_class="T",
    catalogue_id="N17",
    can_be_sparse=True,
    params=(_ALPHA, _N_ITER),
    threshold=ENTMAX_RULE,
    residuals="output",
    description="[(alpha-1)x - tau]_+^(1/(alpha-1)), bisection for any alpha > 1",
))
