"""N03 softmax with an implicit sink: softmax_n, softmax_1 (off-by-one) and a learned sink logit.

All three are softmax over the row plus one extra, invisible logit whose weight is dropped,
so a row can "attend to nothing": weights sum to ``S / (c + S) < 1`` with ``S = sum e^x``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import (
    NormalizerSpec,
    Param,
    TileRule,
    identity_score_map,
    register,
)

__all__ = ["softmax_n", "softmax_1", "softmax_sink"]

_N = Param("n", 1.0, low=0.0, sample=3.0, row_broadcast=True)
_SINK = Param("sink_logit", 0.0, sample=-1.5, row_broadcast=True)


def _exp_capped(z):
  """``e^z`` with the exponent capped just below float overflow (finite value and gradient)."""
  cap = float(np.log(np.finfo(np.dtype(z.dtype)).max)) - 1.0
  return jnp.exp(jnp.minimum(z, cap))


def sink_mass(n, s_minus_m):
  """``n e^{s - m}``, the sink's share of the denominator, finite in value and gradient.

  With the stabiliser ``m >= s + log n`` it is at most 1 for ``n > 0``; for ``n = 0`` it
  is 0, and the exponent is capped just below float overflow so the gradient in ``n``
  (``e^{s - m}``, beyond the float range only when every score is ~88 below the sink)
  saturates instead of making ``0·inf = NaN``.
  """
  return n * _exp_capped(s_minus_m)


def sink_floor(sink_logit, n):
  """``s + log n``: the sink logit of ``softmax([x, s + log n])``, ``-inf`` when ``n = 0``.

  The stabiliser floor that keeps ``n e^{s - m} <= 1`` (no gradient: it cancels).
  """
  n = jnp.asarray(n)
  pos = n > 0
  log_n = jnp.where(pos, jnp.log(jnp.where(pos, n, 1.0)), -jnp.inf)
  return jax.lax.stop_gradient(sink_logit + log_n)


def _stabilised(xs, mask, axis, coef, logit):
  """``(e^{x - M}, n e^{s - M} + sum_V e^{x - M}, M)`` over the visible entries V.

  ``M = max(max_V x, s + log n)`` (no floor when n = 0: plain softmax), so neither
  ``e^{x - M}`` nor ``n e^{s - M}`` can overflow and the weights do not underflow before
  the true values do (for softmax_1, ``M = max(max x, 0)``). ``M`` cancels, so it carries
  no gradient; ``n`` and ``s`` do.
  """
  m = jnp.maximum(c.masked_max(xs, mask, axis), sink_floor(logit, coef))
  e = jnp.where(mask, jnp.exp(xs - m), 0.0)
  return e, jnp.sum(e, axis=axis, keepdims=True) + sink_mass(coef, logit - m), m


def _sink_rows(fn_name):
  """The forward pass of ``fn_name`` under the shared rules: ``e^{x_i} / (n e^{s} + sum_j
  e^{x_j})`` over visible entries, ``softmax([x, s + log n])`` without the sink's entry.

  ``n`` and ``s`` are row parameters in the compute dtype (float64 stays float64).
  """
  def rows(x, axis=-1, where=None, *, n=1.0, sink_logit=0.0):
    xs, mask, axis = c.prepare(x, axis, where, fn_name)
    coef = c.row_param(n, xs.shape, axis, "n", fn_name, xs.dtype)
    logit = c.row_param(sink_logit, xs.shape, axis, "sink_logit", fn_name, xs.dtype)
    e, den, _ = _stabilised(xs, mask, axis, coef, logit)
    return c.finish(c.safe_divide(e, den), mask, jnp.asarray(x).dtype)

  rows.__name__ = fn_name  # the name the shared rules give in their errors
  return c.dense_rules(rows)


_ROWS = {name: _sink_rows(name) for name in __all__}


def _log_denominator(x, where, odd, params, static):
  """``log(n e^s + sum_V e^x)`` per row (keepdims), in the compute dtype, differentiable.

  Rows the shared rules fill in (``odd``) count as fully masked, and a row whose
  denominator is 0 (nothing visible, n = 0) gets ``M``: both have all-zero weights, so
  the value only has to be finite (also its derivatives, for the second order).
  """
  axis, fn_name = static
  xs, mask, axis = c.prepare(x, axis, where, fn_name)
  mask = jnp.logical_and(mask, jnp.logical_not(odd))
  xs = jnp.where(mask, xs, jnp.zeros((), xs.dtype))  # the odd rows' NaN / +inf leave
  coef, logit = (c.row_param(v, xs.shape, axis, k, fn_name, xs.dtype)
                 for v, k in zip(params, ("n", "sink_logit"), strict=True))
  _, den, m = _stabilised(xs, mask, axis, coef, logit)
  return m + jnp.log(jnp.where(den > 0, den, jnp.ones((), den.dtype)))


def _sink_tangent(y, odd, log_den, dx, params, dparams, static):
  r"""``dy = y (dx - <y, dx>) - y a (dn + n ds)``, ``a = e^{s - log D}``, from ``y`` (and
  ``log D`` when ``n`` or ``s`` moves).

  The Jacobian in ``x`` is ``diag(y) - y y^T`` (the sink takes no output entry), as
  softmax's; the sink's mass ``n e^s`` enters ``D`` only, so ``dy = -y d(n e^s) / D``.
  Rows the shared rules fill in (a visible NaN or ``+inf``) get a zero tangent.
  """
  axis = static[0]
  cd = c.compute_dtype(y.dtype)
  zero = jnp.zeros((), cd)
  parts = []
  if not c.is_zero_tangent(dx):
    # the selects on both sides keep the odd rows at 0, also through the transpose
    p = y.astype(cd)
    v = jnp.where(odd, zero, dx.astype(cd))
    parts.append(p * (v - jnp.sum(p * v, axis=axis, keepdims=True)))
  if log_den is not None:
    n, s = (c.row_value(v, y.ndim, cd) for v in params)
    dn, ds = dparams
    d = sum(term for term in (None if c.is_zero_tangent(dn) else c.row_value(dn, y.ndim, cd),
                              None if c.is_zero_tangent(ds) else n * c.row_value(ds, y.ndim, cd))
            if term is not None)
    p = jnp.where(odd, zero, y.astype(cd))  # finite: the coefficient of dn and ds
    parts.append(-(p * jnp.where(odd, zero, _exp_capped(s - log_den))) * d)
  return jnp.where(odd, zero, sum(parts[1:], parts[0])).astype(y.dtype)


_OUT, _ODD, _LOG_DEN = "jaxsoft_sink_output", "jaxsoft_sink_rows", "jaxsoft_sink_log_den"


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _from_output(x, where, params, static):
  return _ROWS[static[1]](x, static[0], where, n=params[0], sink_logit=params[1])


@functools.partial(_from_output.defjvp, symbolic_zeros=True)
def _from_output_jvp(static, primals, tangents):
  # common.saving_output's rule, with one more per-row statistic (log D) that the
  # parameters' term needs: from the output alone it would be 1 - sum y (cancellation
  # when sum y ~ 1) divided by n (0/0 at n = 0)
  x, where, params = primals
  dx, _, dparams = tangents
  y = checkpoint_name(_from_output(x, where, params, static), _OUT)
  if c.is_zero_tangent(dx) and all(c.is_zero_tangent(d) for d in dparams):
    return y, jnp.zeros_like(y)
  odd = checkpoint_name(c.odd_rows(x, where, static[0]), _ODD)
  log_den = None
  if not all(c.is_zero_tangent(d) for d in dparams):
    log_den = checkpoint_name(_log_denominator(x, where, odd, params, static), _LOG_DEN)
  return y, _sink_tangent(y, odd, log_den, dx, params, dparams, static)


# Reverse mode keeps y, one flag per row, and log D per row when n or s is differentiated.
_saving = jax.checkpoint(_from_output, policy=c.output_residuals(_OUT, _ODD, _LOG_DEN),
                         static_argnums=(3,))


def _sink_softmax(x, axis, where, n, sink_logit, fn_name):
  """``e^{x_i} / (n * e^{s} + sum_j e^{x_j})`` over visible entries (see :func:`_sink_rows`),
  with its derivative written from the output (reverse mode keeps only the output)."""
  return _saving(jnp.asarray(x), None if where is None else jnp.asarray(where),
                 (n, sink_logit), (axis, fn_name))


def softmax_n(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
              n: ArrayLike = 1.0) -> jax.Array:
  r"""Softmax with ``n`` units of sink mass (feature N03, kernel class E; Hu et al. 2024).

  .. math::
    \mathrm{softmax}_n(x)_i = \frac{e^{x_i}}{n + \sum_{j \in V} e^{x_j}}
    = \mathrm{softmax}([x, \log n])_{1..|x|}

  over the visible entries V of the row. ``n = 0`` is softmax, ``n = 1`` is softmax_1
  (E. Miller 2023, "Attention Is Off By One", a blog post; the attention that the
  OutEffHop Hopfield model of J. Hu et al. 2024, "Outlier-Efficient Hopfield Layers for
  Large Transformer-Based Models", ICML 2024, arXiv 2404.03828, approximates). Not shift
  invariant: the sink logit is fixed at ``log n``. Computed max-stabilised with
  ``m = max(max_V x, log n)``: the stabiliser's floor is the sink's own logit ``log n``,
  so the sink term ``n e^{-m} <= 1`` cannot overflow, and no floor at all when ``n = 0``
  (a fixed floor such as 0 would make ``e^{x - m}`` underflow to 0 for rows below about
  -88, where softmax is still well defined). ``x = +-1000`` is fine; the chunked and
  Pallas paths use the same floor (the tile rule's ``m_floor``).

  The derivative is written from the output ``y`` (a ``custom_jvp``, as ``jax.nn.softmax``;
  the sink takes no output entry, so the Jacobian in ``x`` is softmax's),

  .. math::
    dy = y \odot (dx - \langle y, dx \rangle) - y \, \frac{dn}{n + S},

  so reverse mode keeps ``y`` and one flag per row, and ``\log(n + S)`` per row when ``n``
  is differentiated (the same holds for :func:`softmax_1` and :func:`softmax_sink`).

  Args:
    x: scores.
    n: sink mass n >= 0, a scalar or an array broadcast to the rows (size 1 along
      ``axis``); differentiable.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype, summing to ``S / (n + S) <= 1``; a row with no
    visible entry is all zeros with zero gradient.

  Tile rule: ``e^{z - m}`` as numerator and denominator plus the offset ``n e^{-m}``.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> w = js.normalizers.softmax_n(x, n=3.0)
    >>> w
    Array([0.5238, 0.1927, 0.0709], dtype=float32)
    >>> w.sum()  # S / (n + S) with S = sum(exp(x)): below 1
    Array(0.7873, dtype=float32)
    >>> js.normalizers.softmax_n(x, n=0.0)  # n = 0 is softmax
    Array([0.6652, 0.2447, 0.09  ], dtype=float32)

  References:
    E. Miller, 2023, "Attention Is Off By One" (blog post).

    J. Y.-C. Hu et al., 2024, "Outlier-Efficient Hopfield Layers for Large Transformer-Based
    Models".
  """
  _N.validate(n, "softmax_n")
  return _sink_softmax(x, axis, where, n, 0.0, "softmax_n")


def softmax_1(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""Softmax_1 = ``e^{x_i} / (1 + sum_j e^{x_j}) = softmax([x, 0])[:-1]`` (N03, class E).

  Softmax with an implicit zero logit (E. Miller 2023, "Attention Is Off By One"; the
  attention of OutEffHop, J. Hu et al., ICML 2024, arXiv 2404.03828): all weights tend
  to 0 as every ``x_j -> -inf``, so a row can attend to nothing. See :func:`softmax_n`.

  Examples:
    >>> w = js.normalizers.softmax_1(jnp.array([-2.0, -3.0, -4.0]))  # no score is high
    >>> w
    Array([0.1125, 0.0414, 0.0152], dtype=float32)
    >>> w.sum()  # softmax would give 1 here
    Array(0.169, dtype=float32)

  References:
    E. Miller, 2023, "Attention Is Off By One" (blog post).

    J. Y.-C. Hu et al., 2024, "Outlier-Efficient Hopfield Layers for Large Transformer-Based
    Models".
  """
  return _sink_softmax(x, axis, where, 1.0, 0.0, "softmax_1")


def softmax_sink(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                 sink_logit: ArrayLike = 0.0) -> jax.Array:
  r"""Softmax with a (learned) sink logit (feature N03, kernel class E; see docs/feature_ids.md).

  .. math::
    w_i = \frac{e^{x_i}}{e^{s} + \sum_{j \in V} e^{x_j}} = \mathrm{softmax}([x, s])_{1..|x|}

  The sink ``s`` absorbs the mass a row does not want to give to any key; the sink's own
  weight is dropped. ``s = log n`` is :func:`softmax_n`. Softmax attention tends to grow
  such a sink on its own (often on the first token: X. Gu et al. 2025, "When Attention
  Sink Emerges in Language Models: An Empirical View", ICLR 2025, arXiv 2410.10781); a
  learned sink logit per head gives it that escape explicitly.

  Args:
    x: scores, e.g. ``[B, N, T, S]``.
    sink_logit: ``s``, a scalar or an array broadcast to the rows (size 1 along ``axis``),
      e.g. one learned logit per head ``[N, 1, 1]``; differentiable.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype (sum < 1); a row with no visible entry is all
    zeros with zero gradient (also in ``sink_logit``).

  Examples:
    >>> w = js.normalizers.softmax_sink(jnp.array([2.0, 1.0, 0.0]), sink_logit=3.0)
    >>> w
    Array([0.2369, 0.0871, 0.0321], dtype=float32)
    >>> w.sum()  # the sink took the rest
    Array(0.3561, dtype=float32)

  References:
    G. Xiao, Y. Tian, B. Chen, S. Han & M. Lewis, 2024, "Efficient Streaming Language
    Models with Attention Sinks".

    X. Gu et al., 2025, "When Attention Sink Emerges in Language Models: An Empirical View".

    E. Miller, 2023, "Attention Is Off By One" (blog post).
  """
  _SINK.validate(sink_logit, "softmax_sink")
  return _sink_softmax(x, axis, where, 1.0, sink_logit, "softmax_sink")


# the shared rules apply through _ROWS: the registry's mark
for _fn in (softmax_n, softmax_1, softmax_sink):
  setattr(_fn, "_jaxsoft_dense_rules", True)  # noqa: B010

def _n_offset(m, length, n=1.0, **_):
  """Sink mass ``n e^{-m}``; with the rule's floor ``m >= log n`` it is at most 1."""
  m = jnp.asarray(m)
  return sink_mass(jnp.asarray(n, m.dtype), -m)


def _n_floor(length, n=1.0, **_):
  """softmax_n's stabiliser floor: ``log n`` (``-inf``, no floor, for n = 0)."""
  return sink_floor(0.0, jnp.asarray(n, jnp.asarray(length).dtype))


def _one_offset(m, length, **_):
  return jnp.exp(-m)


def _sink_offset(m, length, sink_logit=0.0, **_):
  """The sink's mass ``e^{s - m}``: at most 1 with the rule's floor ``m >= s`` (and capped,
  so a row with nothing visible, whose m is 0, cannot overflow either)."""
  m = jnp.asarray(m)
  return sink_mass(jnp.ones((), m.dtype), jnp.asarray(sink_logit, m.dtype) - m)


def _sink_floor(length, sink_logit=0.0, **_):
  """softmax_sink's stabiliser floor: the sink's own logit ``s`` (the function's
  ``max(max x, s)``), so a sink far above every score (s = 1e4 over scores near -1e4)
  cannot overflow ``e^{s - m}`` and the row's ``log D`` stays ``s``, not ``inf``."""
  # sink_floor(s, 1) without its n = 0 branch (a -inf constant Triton cannot lower here)
  return jax.lax.stop_gradient(jnp.asarray(sink_logit, jnp.asarray(length).dtype))


_COMMON: dict[str, Any] = dict(kernel_class="E", catalogue_id="N03", sums_to_one=False,
                               at_most_one=True, nonnegative=True, shift_invariant=False,
                               can_be_sparse=False, length_dependent=False, smooth=True)

SPEC_N = register(NormalizerSpec(
    name="softmax_n", fn=softmax_n, params=(_N,),
    # m_floor = log n (the function's max(max x, log n)): n e^{-m} <= 1; none for n = 0.
    tile=TileRule.softmax(identity_score_map, offset=_n_offset, m_floor=_n_floor),
    residuals="output", description="exp(x) / (n + sum exp(x))", **_COMMON))

SPEC_1 = register(NormalizerSpec(
    name="softmax_1", fn=softmax_1,
    tile=TileRule.softmax(identity_score_map, offset=_one_offset, m_floor=0.0),
    residuals="output", description="exp(x) / (1 + sum exp(x)) = softmax([x, 0])[:-1]",
    **_COMMON))

SPEC_SINK = register(NormalizerSpec(
    name="softmax_sink", fn=softmax_sink, params=(_SINK,),
    tile=TileRule.softmax(identity_score_map, offset=_sink_offset, m_floor=_sink_floor),
    residuals="output", description="exp(x) / (exp(s) + sum exp(x)), s a learned sink logit",
    **_COMMON))
