"""N16 sparsemax: the Euclidean projection of a score row onto the probability simplex.

The threshold is found without sorting: a Michelot/Newton iteration on the piecewise-linear
``f(tau) = sum_j [x_j - tau]_+ - 1`` from the lower bound ``max(x) - 1``, each step two
passes over the row (the sum at tau, the count above the next tau), stopping as soon as
the support it holds is self-consistent. The last tau is computed exactly from that support
(once more from the settled point, as two floats: see :func:`sparsemax_threshold`), so the
result is the exact projection to rounding. Rows are solved in cache-sized blocks
(:func:`threshold_by_blocks`), which entmax15 shares; they read ``x`` itself and a per-row
shift, no mask array."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, ThresholdRule, identity_score_map, register

__all__ = ["sparsemax"]


def count_above(ym, t):
  """``|{j : y_j > t}|`` over the last axis (a select-and-add: cheaper than ``ceil``/``sign``)."""
  return jnp.sum(jnp.where(ym > t, 1.0, 0.0), axis=-1, keepdims=True).astype(ym.dtype)


def relu_sum(ym, t):
  """``sum_j [y_j - t]_+`` over the last axis, written as a select: XLA:CPU writes the
  select out (from cache) and sums it in a separate reduction, about 2x faster than the
  single fused reduction it makes of ``maximum(y - t, 0)`` (measured on a [32, 1024]
  block). A NaN ``y_j`` (or ``t``) makes the sum NaN: that is how the solves find the rows
  with a visible NaN, whose row max XLA:CPU can miss (see ``common.nan_max``)."""
  return jnp.sum(jnp.where(ym <= t, 0.0, ym - t), axis=-1, keepdims=True)


ACCURATE_SUM_LANES = 128


def accurate_row_sum(a):
  """``sum(a, axis=-1, keepdims=True)`` to ``(n / L + L) eps sum|a|`` (L = 128 lanes).

  Summed as the column sums of ``[n / L, L]`` and then the L lanes (and the remainder):
  each partial sum then runs over at most ``max(n / L, L)`` terms, where a running sum of
  n terms errs by up to ``n eps sum|a|`` (1e-3 of it at n = 8192)."""
  n = a.shape[-1]
  lanes = ACCURATE_SUM_LANES
  if n <= 2 * lanes:
    return jnp.sum(a, axis=-1, keepdims=True)
  q = n // lanes
  head = a[..., : q * lanes].reshape(a.shape[:-1] + (q, lanes))
  s = jnp.sum(jnp.sum(head, axis=-2), axis=-1, keepdims=True)
  if q * lanes < n:
    s = s + jnp.sum(a[..., q * lanes:], axis=-1, keepdims=True)
  return s


# Rows are solved in blocks of about this many entries (128 KiB of float32), so the passes
# of a solve run from cache; measured on XLA:CPU, 2^13-2^17 differ by under 10% at
# n = 1024 and 8192.
FUSED_BLOCK_ENTRIES = 1 << 15


def shifted(x, mask, top, scale: float = 1.0):
  """``y = (x - top) * scale`` on visible entries, ``-inf`` elsewhere (so ``max y = 0``)."""
  y = x - top
  return jnp.where(mask, y if scale == 1.0 else y * scale, -jnp.inf)


def solve_shift(x, where, top, axis: int):
  """The per-row shift for :func:`threshold_by_blocks`: ``top``, or ``+inf`` on the rows
  that the input rules take over (a visible NaN or ``+inf``; ``prepare`` masks them).

  The visible row max is recomputed here as ``common.prepare`` computes it outside the
  input rules, which XLA merges with prepare's own reduction (no extra pass): so the solve
  needs no mask array, only ``x``, ``where`` and this per-row value. (Under the input
  rules :func:`fused_along_axis` takes prepare's NaN-propagating row max instead.)
  """
  if where is not None:
    x = jnp.where(jnp.logical_and(x != -jnp.inf, where), x, -jnp.inf)
  raw = jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
  return jnp.where(jnp.isfinite(raw), top, jnp.inf)


def threshold_by_blocks(solve, x, where, shift, scale: float = 1.0):
  """``solve(y_block) -> [rows, 1]`` over blocks of rows of ``y = (x - shift) * scale``.

  ``x`` (and ``where``, a boolean array of ``x``'s shape or None) have the normalized axis
  last, any leading shape; ``shift`` is the visible row max (keepdims, from
  :func:`solve_shift`: ``+inf`` on rows to leave out). ``y`` is ``-inf`` where ``x`` is not
  finite or ``where`` is False, and on the rows whose shift is ``+inf``, but NaN where
  ``x`` is a visible NaN: ``solve`` returns a NaN tau for such a row. Each block's
  ``y`` is formed inside the block, so neither a full-size shifted copy nor a mask is
  written: the solve reads ``x`` (and ``where``) once from memory and makes its passes
  from cache. Padding rows are fully masked (every solver here returns a finite
  threshold for them).
  """
  n = x.shape[-1]

  def block_solve(xb, sb, wb=None):
    # A visible NaN stays NaN (the solves return a NaN tau for its row), +inf is masked
    # (-inf needs no mask: x - shift is -inf already).
    ok = xb != jnp.inf
    ok = ok if wb is None else jnp.logical_and(ok, wb)
    return solve(shifted(xb, ok, sb, scale))  # -inf on rows with shift +inf: x - inf

  parts = [(x, n, 0.0), (shift, 1, jnp.inf)]
  if where is not None:
    parts.append((where, n, False))
  return c.map_blocks_of_rows(block_solve, parts, FUSED_BLOCK_ENTRIES)


def sparsemax_threshold(ym, split: bool = False):
  """tau with ``sum_j [y_j - tau]_+ = 1`` over the last axis, for rows with ``max y = 0``.

  ``ym`` holds the visible scores minus their row max and ``-inf`` at masked entries, so
  tau lies in ``[-1, 0)``. Michelot's iteration ``tau <- (sum_{y > tau} y - 1) / |{y > tau}|``
  is Newton's method on the convex, decreasing, piecewise-linear ``f(t) = sum [y - t]_+ - 1``:
  started below the root (at -1, where the max entry alone gives ``f >= 0``) it increases
  monotonically and only drops entries outside the final support. Each pass takes the
  sum at t (one pass), steps to the root ``t'`` of the support ``S = {y > t}`` and counts
  ``{y > t'}`` (a second pass): when that is still ``|S|``, the support did not change and
  ``t' = (sum_S y - 1) / |S|`` is exact. Most rows settle in 3-6 passes; the loop runs
  until every row has (at most n + 2 passes, Michelot's worst case).

  That last step is taken from the previous point t, up to 1 below tau: its sum
  ``sum_S (y - t) = 1 + |S| (tau - t)`` is up to |S| (8192 on a near-uniform row of 8192),
  and ``- 1`` then cancels ~log2|S| bits of it, so the row summed to ``1 +- 1e-4``. One
  more step from the settled t sums terms that add up to ~1 (:func:`accurate_row_sum`):
  tau = t + lo with ``lo = (sum_S (y - t) - 1) / |S|`` to a few ulps. A float tau alone
  is still rounded by up to half an ulp of |tau|, which shifts all |S| weights alike (a row
  sum off by ``|S| ulp(tau) / 2``: 1e-4 for |tau| = 0.5 and |S| = 5000), so ``split``
  returns the pair ``(t, lo)`` for :func:`from_threshold` to subtract one after the other.

  Args:
    ym: scores minus their visible row max, ``-inf`` masked, normalized axis last.
    split: return ``(t, lo)`` (tau = t + lo, ``|lo|`` a few ulps of t) instead of tau.

  Returns:
    tau of shape ``ym.shape[:-1] + (1,)`` (-1 for rows with no visible entry, NaN for
    rows with a NaN), or the pair.
  """
  def step(t, cnt):
    tot = relu_sum(ym, t)
    nan = jnp.isnan(tot)  # a NaN y: the row's tau is NaN
    # Monotone by construction (rounding could otherwise step back and loop).
    t_new = jnp.maximum(t, t + c.safe_divide(tot - 1.0, cnt))
    t_new = jnp.where(nan, jnp.asarray(jnp.nan, t.dtype), t_new)
    cnt_new = count_above(ym, t_new)
    return (t_new, cnt_new), (cnt_new == cnt) | nan  # same support: t_new is exact

  minus_one = c.row_full_like(ym, -1.0)
  t, cnt = c.passes_until_done(step, (minus_one, count_above(ym, minus_one)),
                               ym.shape[-1] + 2)
  # one more step, from the settled t itself (cnt is the size of its support)
  lo = c.safe_divide(accurate_row_sum(jnp.where(ym > t, ym - t, 0.0)) - 1.0, cnt)
  return (t, lo) if split else t + lo


def split_solve(solve):
  """``solve(ym, split=True) -> (t, lo)`` as a solve for :func:`threshold_by_blocks`, which
  takes one ``[rows, 1]`` result: the pair travels as the complex ``t + i lo`` (two floats
  of ``ym``'s dtype; :func:`unsplit` takes it apart)."""
  return lambda ym: jax.lax.complex(*solve(ym, split=True))


def unsplit(tau):
  """``(t, lo)`` of a :func:`split_solve` result (a real array: ``lo = 0``)."""
  return jnp.real(tau), jnp.imag(tau)


@jax.custom_jvp
def from_threshold(x, mask, top, tau, tau_lo=0.0):
  """sparsemax over the last axis given its threshold ``tau + tau_lo``:
  ``[(x - top - tau) - tau_lo]_+`` on ``mask`` (see :func:`sparsemax_threshold`).

  tau carries no gradient (the Jacobian below is the derivative of the whole map)."""
  d = shifted(x, mask, top) - tau
  return jnp.where(d > tau_lo, d - tau_lo, 0.0)


@from_threshold.defjvp
def _from_threshold_jvp(primals, tangents):
  # J = diag(s) - s s^T / |S|, s the support indicator (Martins & Astudillo 2016, eq. 12).
  x_dot = tangents[0]
  p = from_threshold(*primals)
  s = (p > 0).astype(p.dtype)
  sv = s * x_dot
  size = jnp.sum(s, axis=-1, keepdims=True)
  return p, sv - s * c.safe_divide(jnp.sum(sv, axis=-1, keepdims=True), size)


def _sparsemax_last(x, mask, top, shift, where):
  """sparsemax over the last axis of float32/64 ``x`` whose visible row max is ``top``."""
  # tau carries no gradient: no tangent enters the solve's loops.
  tau, lo = unsplit(threshold_by_blocks(split_solve(sparsemax_threshold),
                                        jax.lax.stop_gradient(x), where, shift))
  return from_threshold(x, mask, top, tau, lo), tau


@functools.partial(jax.jit, static_argnames=("axis",))
def sparsemax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""Sparsemax (feature N16, kernel class T; A. F. T. Martins & R. F. Astudillo 2016).

  From "From Softmax to Sparsemax: A Sparse Model of Attention and Multi-Label
  Classification" (Martins & Astudillo, ICML 2016, arXiv 1602.02068):

  .. math::
    \mathrm{sparsemax}(x) = \operatorname*{argmin}_{p \in \Delta} \|p - x\|_2^2
      = [x - \tau(x)]_+, \qquad \sum_{j \in V} [x_j - \tau]_+ = 1

  over the visible entries V of the row. tau is found without a sort (Michelot/Newton
  passes from ``max(x) - 1``, see :func:`sparsemax_threshold`) and is exact: the
  ``(sum_S x - 1) / |S|`` of the support S found (to a few ulps, kept as two floats, so a
  row of n weights sums to 1 within about ``sqrt(n)`` ulps). Shift invariant, not scale
  invariant; exact zeros wherever ``x_j <= tau``. The Jacobian is the closed form
  ``J v = s * v - s * (sum(s * v) / |S|)``, s the support indicator ``p > 0`` (a
  ``custom_jvp`` written from the output ``p``: reverse mode keeps only ``p`` and one flag
  per row, as ``jax.nn.softmax`` keeps its output).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype (computed in float32 for low-precision inputs); a
    row with no visible entry is all zeros, with zero gradient.

  Examples:
    >>> js.normalizers.sparsemax(jnp.array([1.0, 0.8, 0.1, -1.0]))  # tau = 0.4
    Array([0.6, 0.4, 0. , 0. ], dtype=float32)
    >>> js.normalizers.sparsemax(jnp.array([5.0, 4.0, 0.5, -5.0]))  # larger gaps: smaller support
    Array([1., 0., 0., 0.], dtype=float32)

  References:
    A. F. T. Martins & R. F. Astudillo, 2016, "From Softmax to Sparsemax: A Sparse Model of
    Attention and Multi-Label Classification".

    C. Michelot, 1986, "A finite algorithm for finding the projection of a point onto the
    canonical simplex of R^n".
  """
  return _sparsemax_saving_output(x, where, (), (axis,))


@c.dense_rules
def _sparsemax_rows(x, axis=-1, where=None):
  """:func:`sparsemax`'s forward pass, under the shared rules."""
  return fused_along_axis(_sparsemax_last, x, axis, where, "sparsemax")


_sparsemax_rows.__name__ = "sparsemax"  # the name the shared rules give in their errors


def on_support(y, odd):
  """``(p, p > 0)``: the output in the compute dtype, 0 on the rows the shared rules fill
  in (so their tangent is 0 in both modes), and its support."""
  cd = c.compute_dtype(y.dtype)
  p = jnp.where(odd, jnp.zeros((), cd), y.astype(cd))
  return p, p > 0


def support_jvp(g, v, axis=-1):
  """``J v`` for ``J = diag(g) - g g^T / sum(g)`` (g = p^{2 - alpha} on the support, 0 off
  it; sparsemax's g is the support indicator, Martins & Astudillo 2016, eq. 12)."""
  gv = g * v
  return gv - g * c.safe_divide(jnp.sum(gv, axis=axis, keepdims=True),
                                jnp.sum(g, axis=axis, keepdims=True))


def _sparsemax_tangent(y, odd, dx, params, dparams, static):
  # the support indicator, 0 on the rows the shared rules fill in (also NaN rows: y > 0
  # is False at a NaN)
  g = ((y > 0) & ~odd).astype(c.compute_dtype(y.dtype))
  return support_jvp(g, dx.astype(g.dtype), static[0]).astype(y.dtype)


# Reverse mode keeps p and one flag per row.
_sparsemax_saving_output = c.saving_output(
    lambda x, where, params, static: _sparsemax_rows(x, static[0], where),
    _sparsemax_tangent, "sparsemax")
# sparsemax applies the shared rules through _sparsemax_rows: the registry's mark
setattr(sparsemax, "_jaxsoft_dense_rules", True)  # noqa: B010


def fused_along_axis(fn_last, x, axis: int, where, fn_name: str):
  """``fn_last(xc, mask, top, shift, where) -> (p, tau)`` along ``axis``, with
  ``prepare``/``finish``.

  ``fn_last`` gets the upcast scores themselves (not ``prepare``'s masked copy, which
  would be one more full-size array to write and read: it reads only visible entries),
  the mask and the visible row max from the pass that ``prepare`` makes anyway, and for
  its threshold solve the per-row shift of :func:`solve_shift` and ``where`` (broadcast,
  or None), so that the solve does not read a materialised mask.

  The solve also finds the rows with a visible NaN (its tau is NaN there: its sums
  propagate the NaN), so ``prepare`` skips its own NaN check (``nan_check=False``, a pass
  over the rows) and those rows are marked NaN for :func:`common.dense_rules` here.
  """
  x = jnp.asarray(x)
  found = c._RULES.get()
  # the rules of this call, when prepare() below is the one that takes its rows out
  rules = found if found is not None and found.top is None else None
  _, mask, axis, top = c.prepare(x, axis, where, fn_name, with_max=True, nan_check=False)
  xc = x.astype(c.compute_dtype(x.dtype))
  if where is not None:
    where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
  if rules is not None and rules.top is not None:
    # prepare() took the rows with a visible +inf (or a NaN its max saw) out under the
    # input rules: its visible row max marks them, no second pass needed. (A NaN row the
    # max missed is solved as usual: its tau comes back NaN.)
    shift = jnp.where(jnp.isfinite(rules.top), top, jnp.inf)
  else:
    shift = solve_shift(xc, where, top, axis)
  last = lambda a: None if a is None else c.to_last(a, axis)  # noqa: E731
  p, tau = fn_last(last(xc), last(mask), last(top), last(shift), last(where))
  if rules is not None and rules.top is not None:
    # the rows the input rules take over as NaN rows: prepare's max can miss their NaN
    rules.top = jnp.where(jnp.isnan(c.from_last(tau, axis)),
                          jnp.asarray(jnp.nan, rules.top.dtype), rules.top)
  return c.finish(c.from_last(p, axis), mask, x.dtype)


# --- the class-T rule (a ThresholdRule): mass = weight = [z - tau]_+, target 1. ----------



def _relu_mass(z, tau, *_, **__):
  return jnp.maximum(z - tau, 0.0)


def _unit_target(length, **_):
  return jnp.ones_like(length)


def _unit_power(**_):
  return 1.0  # M(tau) is convex and piecewise linear: Newton is Michelot's iteration


def _sparsemax_bracket(m, length, **_):
  # f(m - 1) >= 1 from the max entry alone; f(m) = 0.
  return m - 1.0, m


SPARSEMAX_RULE = ThresholdRule(
    score_map=identity_score_map,
    mass=_relu_mass,
    target=_unit_target,
    bracket=_sparsemax_bracket,
    weight=_relu_mass,
    iterations=30,
    newton_power=_unit_power,
)

SPEC = register(NormalizerSpec(
    name="sparsemax",
    fn=sparsemax,
    kernel_class="T",
    catalogue_id="N16",
    can_be_sparse=True,
    smooth=False,
    threshold=SPARSEMAX_RULE,
    residuals="output",
    description="[x - tau]_+, Euclidean projection onto the simplex",
))
