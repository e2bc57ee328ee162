"""Class R normalizers: weights that need a statistic of the whole row first.

N08 adaptive-temperature softmax (the entropy of softmax), N09 logit-standardised softmax
and N26 NAP (the row's mean and variance). Each computes its row statistics over the
visible entries only, then the weights from them; the gradient flows through the
statistics.

``+inf`` logits take the limit as they grow together. For N08 that is the shared rule of
``common.dense_rules`` (each of the k visible ``+inf`` entries gets 1/k). N09 and N26
standardise, which bounds the scores: as k entries of n grow together their z-scores tend
to sqrt((n-k)/k) and the others' to -sqrt(k/(n-k)) (0 for all when k = n), and the weights
are those of the limiting z-scores (softmax of z / tau; z itself).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import row_blocks as blocks
from jaxsoft.normalizers.spec import NormalizerSpec, Param, TileRule, register

__all__ = ["adaptive_temperature_softmax", "standardized_softmax", "nap"]

# Veličković et al.'s polynomial fit of beta(H), highest degree first (their released
# snippet, reproduced identically in several public ports).
_POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)

_THRESHOLD = Param("threshold", 0.5, low=0.0, sample=1.0)
_TAU = Param("tau", 1.0, low=0.0, low_open=True, sample=2.0, row_broadcast=True)
_STD_EPS = Param("eps", 1e-7, low=0.0, low_open=True, sample=1e-3)
_NAP_EPS = Param("eps", 1e-8, low=0.0, low_open=True, sample=1e-2)


def _safe_sqrt(v):
  """sqrt(v) with a zero (not infinite) gradient at v = 0."""
  pos = v > 0
  return jnp.where(pos, jnp.sqrt(jnp.where(pos, v, 1.0)), 0.0)


def _pow2_inverse(r):
  """``2^-e`` with ``r`` in ``[2^(e-1), 2^e)`` (1 for r = 0): a power of two that brings the
  row's largest magnitude ``r`` into [1/2, 1) without rounding anything. ``e`` is clamped to
  +-(maxexp - 28) (100 in float32, 996 in float64), so the factor is a normal float and
  the squares of the scaled row stay within the normal range even for a subnormal or a
  near-overflow ``r``."""
  _, e = jnp.frexp(r)
  lim = jnp.finfo(r.dtype).maxexp - 28
  return jnp.ldexp(jnp.ones_like(r), -jnp.clip(e, -lim, lim))


def scaled_moments(xs, mask, axis: int, m=None):
  """``(y, s, t)``: the visible entries of each row centred on their mean and scaled by a
  power of two ``t`` (no gradient), ``y = t (x - mean)``, and their population standard
  deviation ``s = t std(x)``; the unscaled std is ``s / t``.

  ``xs`` is ``prepare``'s masked-safe input; ``m``, a per-row constant without gradient
  (the row max), is subtracted first so a row far from 0 (``x + 1000``) keeps its
  deviations exact (Sterbenz) instead of losing them to the rounding of a large sum. ``y``
  is 0 at masked entries. ``t`` (:func:`_pow2_inverse` of the largest centred magnitude)
  brings the row into [-1, 1] without rounding anything, so the squares neither overflow
  (float32 ``x^2`` does from |x| ~ 1.8e19) nor underflow (below ~1e-19: a std of 0), and
  a formula kept in the scaled variables (``y / (s + eps t)``) never squares a tiny std in
  its derivative. This is the two-pass form; a blockwise driver merges (count, mean, M2)
  per key block with Chan et al.'s rule instead.
  """
  n = c.visible_count(mask, axis, xs.dtype)
  d = jnp.where(mask, xs - (0.0 if m is None else m), 0.0)
  mean = c.safe_divide(jnp.sum(d, axis=axis, keepdims=True), n)
  centred = jnp.where(mask, d - mean, 0.0)
  t = _pow2_inverse(jax.lax.stop_gradient(jnp.max(jnp.abs(centred), axis=axis, keepdims=True)))
  y = centred * t
  return y, _safe_sqrt(c.safe_divide(jnp.sum(y * y, axis=axis, keepdims=True), n)), t


def softmax_entropy(z, mask, axis: int):
  """(softmax p of z, its entropy H = -sum p log p in nats) over the visible entries.

  Written as ``H = log l - sum_j p_j (z_j - m)``, with ``l = sum e^{z - m}``, so entries
  whose p underflows to 0 add exactly 0 (no ``0 log 0``) and no ``1e-9`` guard is needed.
  """
  m = c.masked_max(z, mask, axis)
  zc = jnp.where(mask, z - m, 0.0)
  e = jnp.where(mask, jnp.exp(zc), 0.0)
  l = jnp.sum(e, axis=axis, keepdims=True)
  p = c.safe_divide(e, l)
  log_l = jnp.log(jnp.where(l > 0, l, 1.0))
  h = log_l - jnp.sum(p * zc, axis=axis, keepdims=True)
  return p, h


def _polyval(coefficients, h):
  """``poly(h)``, coefficients highest degree first, by Horner in Python (a static tuple):
  ``jnp.polyval`` runs a scan whose carry is built without ``h``'s sharding, which fails
  under an Explicit mesh ("carry input and carry output must have equal types")."""
  acc = jnp.full_like(h, coefficients[0])
  for a in coefficients[1:]:
    acc = acc * h + a
  return acc


def _limit_z_scores(posinf, visible, axis):
  """The z-scores of a row whose k visible ``+inf`` entries grow together: sqrt((n-k)/k)
  on them, -sqrt(k/(n-k)) on the other visible entries, 0 on all when k = n."""
  dt = jnp.result_type(float)  # float64 under x64 (the caller casts to the output dtype)
  n = jnp.sum(visible, axis=axis, keepdims=True).astype(dt)
  k = jnp.sum(posinf, axis=axis, keepdims=True).astype(dt)
  hi = jnp.sqrt(c.safe_divide(n - k, k))
  lo = -jnp.sqrt(c.safe_divide(k, n - k))
  return jnp.where(visible, jnp.where(posinf, hi, lo), 0.0)


def _standardized_inf_limit(posinf, axis, hparams, visible):
  t = c.row_param(hparams.get("tau", 1.0), posinf.shape, axis, "tau", "standardized_softmax",
                  dtype=jnp.result_type(float))
  return c.exp_normalize(_limit_z_scores(posinf, visible, axis) / t, visible, axis)


def _nap_inf_limit(posinf, axis, hparams, visible):
  return _limit_z_scores(posinf, visible, axis)


@c.dense_rules
def adaptive_temperature_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None,
                                 *, threshold: float = 0.5,
                                 coefficients: tuple[float, ...] = _POLY) -> jax.Array:
  r"""Adaptive-temperature softmax (feature N08, kernel class R; Veličković et al. 2024).

  From P. Veličković, C. Perivolaropoulos, F. Barbero, R. Pascanu, "softmax is not enough
  (for sharp out-of-distribution)" (2024, arXiv 2410.01104): the inverse temperature of
  each row is a polynomial of the entropy of its softmax,

  .. math::
    p = \mathrm{softmax}(x), \quad H = -\sum_{j \in V} p_j \log p_j, \quad
    \beta = \begin{cases} \max(\mathrm{poly}(H), 1) & H > h_0 \\ 1 & \text{otherwise}
    \end{cases}, \quad w = \mathrm{softmax}(\beta x)

  with the paper's fit ``poly`` (coefficients, highest degree first,
  ``(-0.037, 0.481, -2.3, 4.917, -1.791)``) and threshold ``h_0 = 0.5`` nats. beta >= 1,
  so the entropy never increases and a confident row (H <= h_0) is unchanged; a dispersed
  row is sharpened. The paper applies it at inference; here the gradient also flows
  through beta (the paper's snippet does not stop it either). The entropy is exact (the
  snippet's ``log(p + 1e-9)`` guard is replaced by ``log l - sum p (x - m)``).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      do not enter H.
    threshold: h_0 >= 0, the entropy (nats) below which beta = 1.
    coefficients: the polynomial beta(H), highest degree first (a tuple of Python floats;
      for direct calls: it is not a declared hyperparameter of the spec, so attention's
      ``normalizer_params`` do not take it).

  Returns:
    Weights of ``x``'s shape and dtype, summing to 1 on rows with a visible entry; a row
    with none is all zeros with zero gradient. Shift invariant (H is); beta has kinks where
    poly(H) crosses 1 and a jump where H crosses h_0 if poly(h_0) > 1 (not for the default
    fit: poly(0.5) = 0.15), so the function is only piecewise smooth.

  Row statistic (class R): the entropy of softmax, mergeable over key blocks as a carried
  ``(m, l, sum_j e^{x_j - m} x_j)``.

  Examples:
    >>> x = jnp.zeros(64).at[0].set(2.0)   # a dispersed row: H = 4.0 nats
    >>> js.normalizers.softmax(x)[0], js.normalizers.adaptive_temperature_softmax(x)[0]
    (Array(0.105, dtype=float32), Array(0.6562, dtype=float32))
    >>> y = jnp.array([5.0, 0.0, 0.0])    # confident (H < 0.5): softmax itself
    >>> js.normalizers.adaptive_temperature_softmax(y)
    Array([0.9867, 0.0066, 0.0066], dtype=float32)

  References:
    P. Veličković, C. Perivolaropoulos, F. Barbero & R. Pascanu, 2024, "softmax is not
    enough (for sharp out-of-distribution)".
  """
  name = "adaptive_temperature_softmax"
  _THRESHOLD.validate(threshold, name)
  coeffs = tuple(coefficients)
  if not coeffs:
    raise ValueError(f"{name}: `coefficients` must hold at least one number")
  xs, mask, ax, m = c.prepare(x, axis, where, name, with_max=True)
  z = xs - m
  _, h = softmax_entropy(z, mask, ax)
  poly = _polyval(coeffs, h)
  beta = jnp.where(h > threshold, jnp.maximum(poly, 1.0), 1.0)
  # beta >= 1 > 0, so the row max of beta (x - m) is 0 and exp stays <= 1.
  w = c.sum_normalize(jnp.exp(beta * z), mask, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)


@c.dense_rules(inf_limit=_standardized_inf_limit)
def standardized_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                         tau: ArrayLike = 1.0, eps: float = 1e-7) -> jax.Array:
  r"""Logit-standardised softmax (feature N09, kernel class R; Sun et al. 2024).

  From S. Sun, W. Ren, J. Li, R. Wang, X. Cao, "Logit Standardization in Knowledge
  Distillation" (CVPR 2024): a z-score of the row before a base temperature,

  .. math::
    w = \mathrm{softmax}\Big(\frac{x - \mu}{\tau\,(\sigma + \epsilon)}\Big), \qquad
    \mu = \tfrac{1}{n}\sum_{j \in V} x_j, \quad
    \sigma^2 = \tfrac{1}{n}\sum_{j \in V} (x_j - \mu)^2

  over the n visible entries: softmax with the adaptive per-row temperature
  ``tau * std(x)``. Invariant to ``x -> a x + b`` for a > 0 (up to eps). [R] The authors'
  code (sunshangquan/logit-standardization-KD, from memory) takes torch's default
  *unbiased* std; the population std is used here (so a one-entry row is defined), which is
  the same temperature scaled by sqrt((n-1)/n).

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      enter neither the mean nor the std.
    tau: base temperature tau > 0, a scalar or an array broadcast to the rows;
      differentiable.
    eps: epsilon > 0 added to the std (the code's 1e-7), so a constant row is uniform.

  Returns:
    Weights of ``x``'s shape and dtype, summing to 1 on rows with a visible entry; a row
    with none is all zeros with zero gradient. A near-constant row (std comparable to the
    rounding of its entries) is ill-conditioned, as any standardisation is.

  Row statistics (class R): the visible count, mean and variance, mergeable over key
  blocks by Chan et al.'s rule; the second pass is softmax of the standardised scores.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.standardized_softmax(x)
    Array([0.7245, 0.2129, 0.0626], dtype=float32)
    >>> js.normalizers.standardized_softmax(10.0 * x + 3.0)  # scale and shift: the same
    Array([0.7245, 0.2129, 0.0626], dtype=float32)

  References:
    S. Sun, W. Ren, J. Li, R. Wang & X. Cao, 2024, "Logit Standardization in Knowledge
    Distillation".
  """
  name = "standardized_softmax"
  _STD_EPS.validate(eps, name)
  xs, mask, ax, m, hp = c.prepare_params(x, axis, where, name, (_TAU, tau), with_max=True)
  # (x - mu) / (tau (std + eps)) in the scaled variables of scaled_moments
  y, std, t = scaled_moments(xs, mask, ax, m)
  w = c.exp_normalize(y / (hp["tau"] * (std + eps * t)), mask, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)


@c.dense_rules(inf_limit=_nap_inf_limit)
def nap(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
        eps: float = 1e-8) -> jax.Array:
  r"""NAP: z-score attention weights (feature N26, kernel class R; Richter & Wattenhofer 2020).

  From O. Richter, R. Wattenhofer, "Normalized Attention Without Probability Cage" (2020,
  arXiv 2005.09561): the softmax over keys is replaced by a normalisation of the score row,

  .. math::
    w_i = \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}}, \qquad
    \mu = \tfrac{1}{n}\sum_{j \in V} x_j, \quad
    \sigma^2 = \tfrac{1}{n}\sum_{j \in V} (x_j - \mu)^2

  over the n visible entries, so each row has mean 0 and (for sigma^2 >> eps) RMS 1. The
  weights can be negative and do not sum to 1: ``sum_j w_j v_j`` may leave the convex hull
  of the values (the paper's "probability cage"). Invariant to ``x -> a x + b``, a > 0 (up
  to eps). [R] The formula follows a public port (subtract the mean, divide by the RMS,
  eps = 1e-8); whether the paper adds a learnable gain or a 1/n factor is unknown, so
  neither is applied (multiply the result to add one). The output's scale in attention
  grows like sqrt(n) for random values.

  Args:
    x: scores.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      enter neither statistic.
    eps: epsilon > 0 added to the variance.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry (or one entry) is all
    zeros, with zero gradient when nothing is visible.

  Row statistics (class R): the visible count, mean and variance (Chan et al.'s merge
  over key blocks); the second pass is pointwise.

  Examples:
    >>> w = js.normalizers.nap(jnp.array([3.0, 1.0, 0.0, 0.0]))
    >>> w
    Array([ 1.633 ,  0.    , -0.8165, -0.8165], dtype=float32)
    >>> w.mean(), (w ** 2).mean()
    (Array(0., dtype=float32), Array(1., dtype=float32))

  References:
    O. Richter & R. Wattenhofer, 2020, "Normalized Attention Without Probability Cage".
  """
  _NAP_EPS.validate(eps, "nap")
  xs, mask, ax, m = c.prepare(x, axis, where, "nap", with_max=True)
  # (x - mu) / sqrt(var + eps) in the scaled variables of scaled_moments, the root as
  # hypot(s, sqrt(eps) t): no square of a tiny std, and a finite derivative at var = 0 for
  # any eps (rsqrt's, eps^-1.5, is inf in float32 from eps ~ 1e-26).
  y, std, t = scaled_moments(xs, mask, ax, m)
  w = y / jnp.hypot(std, jnp.sqrt(jnp.asarray(eps, std.dtype)) * t)
  return c.finish(w, mask, jnp.asarray(x).dtype)


# --- blockwise form: the rules of the chunked and Pallas attention drivers ---------------


def _adaptive_derive(stats, length, threshold=0.5, coefficients=_POLY, **_):
  _, l, t = stats
  h = jnp.log(jnp.where(l > 0, l, 1.0)) - c.safe_divide(t, l)
  poly = _polyval(tuple(coefficients), h)
  return {"beta": jnp.where(h > threshold, jnp.maximum(poly, 1.0), 1.0)}


def _beta_score_map(x, length, beta=1.0, **_):
  return beta * x


def _single_entry_scale(n, scale):
  """``scale``, or 1 on a row with at most one visible entry.

  There the weights do not depend on the scale (softmax of one entry is 1, its z-score 0),
  but a blockwise pass recomputes ``x - mu`` (exactly 0) with a rounding error, which a
  scale of ``eps`` would amplify by 1/eps into the weights and their gradient.
  """
  return jnp.where(n > 1, scale, 1.0)


# The statistics are :data:`row_blocks.MOMENTS`' (n, mean, t, q = t^2 M2), t a power of
# two: the derived scales are formed in the scaled variables and divided by t last (exact),
# so no square of the std is formed: finite for any finite row whose deviations fit the
# float range, and, where nothing overflows or underflows, equal bit for bit to the
# unscaled formulas (tau (sqrt(M2/n) + eps), sqrt(M2/n + eps)).


def _standardized_derive(stats, length, tau=1.0, eps=1e-7, **_):
  n, mean, t, q = stats
  scale = tau * ((_safe_sqrt(c.safe_divide(q, n)) + eps * t) / t)
  return {"mu": mean, "scale": _single_entry_scale(n, scale)}


def _nap_derive(stats, length, eps=1e-8, **_):
  n, mean, t, q = stats
  # sqrt(q/n + eps t^2) / t; where eps t^2 overflows (a std below ~1e-19 sqrt(eps) with t
  # at its upper limit), q/n <= 4 is below its rounding and the root is sqrt(eps).
  et2 = eps * t * t
  big = ~jnp.isfinite(et2)
  root = _safe_sqrt(c.safe_divide(q, n) + jnp.where(big, 0.0, et2)) / t
  scale = jnp.where(big, jnp.sqrt(jnp.where(big, eps, 1.0)), root)
  return {"mu": mean, "scale": _single_entry_scale(n, scale)}


@jax.custom_jvp
def _quotient(a, b):
  """``a / b`` whose derivative is formed from the quotient, ``(da - (a/b) db) / b``:
  autodiff's ``-a db / b^2`` squares b, which underflows in float32 for b past ~1e19 (a
  zero gradient for a row's scale; the scales here grow with the scores)."""
  return a / b


@_quotient.defjvp
def _quotient_jvp(primals, tangents):
  a, b = primals
  da, db = tangents
  z = a / b
  return z, (da - z * db) / b


def _standard_score_map(x, length, mu=0.0, scale=1.0, **_):
  return _quotient(x - mu, scale)


def _identity_numerator(z, m, **_):
  return z


ADAPTIVE_RULE = blocks.row_stats_rule(
    (blocks.ENTROPY,), _adaptive_derive,
    TileRule.softmax(_beta_score_map, kernel_class="E"))
STANDARDIZED_RULE = blocks.row_stats_rule(
    (blocks.MOMENTS,), _standardized_derive,
    TileRule.softmax(_standard_score_map, kernel_class="E"))
NAP_RULE = blocks.row_stats_rule(
    (blocks.MOMENTS,), _nap_derive,
    TileRule(score_map=_standard_score_map, numerator=_identity_numerator, kernel_class="P"))


SPEC_ADAPTIVE = register(NormalizerSpec(
    name="adaptive_temperature_softmax",
    fn=adaptive_temperature_softmax,
    kernel_class="R",
    catalogue_id="N08",
    # `coefficients` (a tuple) is not declared: attention's normalizer_params take scalars
    # and row arrays only; it is for direct calls.
    params=(_THRESHOLD,),
    smooth=False,  # beta(H) = max(poly(H), 1) has a kink
    row_stats=ADAPTIVE_RULE,
    description="softmax(beta x), beta = max(poly(H(softmax x)), 1) when H > 0.5",
))

SPEC_STANDARDIZED = register(NormalizerSpec(
    name="standardized_softmax",
    fn=standardized_softmax,
    kernel_class="R",
    catalogue_id="N09",
    params=(_TAU, _STD_EPS),
    row_stats=STANDARDIZED_RULE,
    description="softmax((x - mean) / (tau (std + eps))), per-row z-score",
))

SPEC_NAP = register(NormalizerSpec(
    name="nap",
    fn=nap,
    kernel_class="R",
    catalogue_id="N26",
    sums_to_one=False,
    at_most_one=False,
    nonnegative=False,
    can_be_sparse=True,
    params=(_NAP_EPS,),
    row_stats=NAP_RULE,
    description="(x - mean) / sqrt(var + eps): z-score weights, mean 0, no simplex",
))

