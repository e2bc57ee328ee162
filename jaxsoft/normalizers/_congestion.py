"""N37 congestion-penalised softmax: the logit equilibrium p = softmax((q - gamma p) / T)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, register

__all__ = ["congestion_softmax"]

_GAMMA = Param("gamma", 1.0, low=0.0, sample=4.0, row_broadcast=True)
_TEMPERATURE = Param("temperature", 1.0, low=0.0, low_open=True, sample=0.5, row_broadcast=True)

# The equilibrium p = softmax((q - gamma p) / T) is, with c = gamma / T and the row's
# multiplier lambda, the solution of ``log p_i + c p_i = (q_i - lambda) / T`` with sum p = 1.
# Per entry that is a Lambert-W equation in l = log p_i, solved by Newton from a point at
# or above its root (:func:`_log_weights`); lambda is the root of the convex decreasing
# F(lambda) = sum_i p_i(lambda) - 1, found by Newton from a point below it (monotone: no
# step overshoots in exact arithmetic). A row stops once F <= _TOL_ULPS ulps of 1 + sqrt(n);
# a row that has not after MAX_ITERATIONS steps (never seen: about 5-40 are needed for
# gamma / T from 0 to 1e8) comes back NaN, not an unconverged answer.
_INNER_STEPS = 8
_TOL_ULPS = 8.0
MAX_ITERATIONS = 200


def _log_weights(u, c):
  """l = log p solving ``l + c e^l = u`` elementwise (c >= 0; c = 0 gives l = u).

  f(l) = l + c e^l - u is convex and increasing, so Newton from a point at or above the
  root decreases monotonically onto it. With s = u + log c the root is below u, and for
  s > 1 below log(s / c) (the root w of w + log w = s is below s) by at most 0.45: the
  start is u for s <= 1 (c e^u <= e) and log(s / c) otherwise, so c e^l starts at most
  max(e, s) and never overflows; _INNER_STEPS steps reach the root to rounding.
  """
  s = u + jnp.log(c)
  big = s > 1.0
  l = jnp.where(big, jnp.log(jnp.where(big, s, 1.0)) - jnp.log(jnp.where(big, c, 1.0)), u)
  for _ in range(_INNER_STEPS):
    g = c * jnp.exp(l)
    l = l - (l + g - u) / (1.0 + g)
  return l


def _weights_at(lam, z, mask, cc, t):
  """(p(lambda), F(lambda) = sum p - 1, -F'(lambda)) for each row; p = 0 where masked."""
  l = _log_weights(jnp.where(mask, (z - lam) / t, 0.0), cc)
  p = jnp.where(mask, jnp.exp(l), 0.0)
  slope = jnp.sum(p / (t * (1.0 + cc * p)), axis=-1, keepdims=True)
  return p, jnp.sum(p, axis=-1, keepdims=True) - 1.0, slope


def _solve(z, mask, gamma, t):
  """The fixed point, by Newton on the row multiplier lambda (see the comment above).

  ``z`` has its visible max at 0. With L = T log sum_j e^{z_j / T} (visible j), lambda lies
  in [L - gamma, L]: at lambda = L - gamma every p_i >= softmax(z / T)_i (so F >= 0). Newton
  on the convex decreasing F from there increases lambda monotonically to the root. Rows
  with nothing visible are zeros; rows that do not settle are NaN.
  """
  gamma = jnp.asarray(gamma, z.dtype)
  t = jnp.asarray(t, z.dtype)
  cc = gamma / t
  eps = jnp.finfo(z.dtype).eps
  n = jnp.sum(mask, axis=-1, keepdims=True).astype(z.dtype)
  empty = n == 0
  tol = _TOL_ULPS * eps * (1.0 + jnp.sqrt(n))
  lse = jnp.log(jnp.sum(jnp.where(mask, jnp.exp(jnp.where(mask, z / t, 0.0)), 0.0), axis=-1,
                        keepdims=True))
  lam0 = jnp.where(empty, 0.0, t * lse - gamma)
  _, f0, slope0 = _weights_at(lam0, z, mask, cc, t)

  def cond(carry):
    i, _, f, _ = carry
    return jnp.logical_and(i < MAX_ITERATIONS, jnp.any(f > tol))

  def body(carry):
    i, lam, f, slope = carry
    active = f > tol  # (False on empty rows: F = -1 there)
    step = jnp.where(active, f / jnp.where(active, slope, 1.0), 0.0)
    lam = lam + step
    _, f, slope = _weights_at(lam, z, mask, cc, t)
    return i + 1, lam, f, slope

  _, lam, f, _ = jax.lax.while_loop(cond, body, (jnp.asarray(0), lam0, f0, slope0))
  done = f <= tol
  p, _, _ = _weights_at(lam, z, mask, cc, t)
  p = c.safe_divide(p, jnp.sum(p, axis=-1, keepdims=True))
  return jnp.where(done, p, jnp.nan)


def _best_response(p, z, mask, gamma, t):
  """S(p) = softmax((z - gamma p) / T) over the visible entries of the last axis."""
  u = jnp.where(mask, (z - gamma * p) / t, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, u, -jnp.inf), axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return c.sum_normalize(jnp.exp(jnp.where(mask, u, m) - m), mask, -1)


def _implicit_solve(p, mask, cc, r):
  """``(I + c B)^{-1} r`` with B = diag(p) - p p^T (symmetric) and c = gamma / T.

  I + c B is Lambda - c p p^T with Lambda = I + c diag(p); Sherman-Morrison gives
  ``Lambda^{-1} r + c Lambda^{-1} p (p^T Lambda^{-1} r) / (1 - c p^T Lambda^{-1} p)``,
  whose denominator is ``sum_i p_i / (1 + c p_i) > 0`` when sum p = 1 (1 on an empty row).
  """
  lam = 1.0 + cc * p
  lr, lp = r / lam, p / lam
  total = jnp.sum(p, axis=-1, keepdims=True)
  den = jnp.sum(lp, axis=-1, keepdims=True) + (1.0 - total)
  return jnp.where(mask, lr + cc * lp * jnp.sum(p * lr, axis=-1, keepdims=True) / den, 0.0)


@jax.custom_jvp
def _equilibrium(z, mask, gamma, t):
  return _solve(z, mask, gamma, t)


@_equilibrium.defjvp
def _equilibrium_jvp(primals, tangents):
  """Implicit function theorem at p = S(p; z, gamma, T): with dS/dp = -(gamma/T) B,
  ``dp = (I + (gamma/T) B)^{-1} dS``, dS the tangent of S at fixed p. Linear in the
  tangents, so reverse mode transposes it (B is symmetric: the same solve)."""
  z, mask, gamma, t = primals
  dz, _, dgamma, dt = tangents
  # p through _equilibrium itself (not _solve), so this rule is differentiable again:
  # grad of grad differentiates p by this same rule, never the loop.
  p = _equilibrium(z, mask, gamma, t)
  _, ds = jax.jvp(lambda z_, g_, t_: _best_response(p, z_, mask, g_, t_), (z, gamma, t),
                  (dz, dgamma, dt))
  return p, _implicit_solve(p, mask, gamma / t, ds)


@c.dense_rules
def congestion_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                       gamma: ArrayLike = 1.0, temperature: ArrayLike = 1.0) -> jax.Array:
  r"""Congestion-penalised softmax: a logit equilibrium (feature N37, kernel class X) [R].

  Reconstructed from the analysis "MoE routing as a congestion game" (authors and year not
  recorded in the catalogue; a 2025 preprint): a router whose experts' quality scores ``q``
  are penalised by their own load ``p`` settles at the quantal-response (logit) mean-field
  equilibrium

  .. math::
    p = \mathrm{softmax}\Big(\frac{q - \gamma\, p}{T}\Big),

  the unique maximiser of the strictly concave
  :math:`\langle p, q\rangle - \tfrac{\gamma}{2}\lVert p\rVert^2 + T\,H(p)` on the simplex.
  gamma = 0 is ``softmax(q / T)``; a larger gamma spreads the load (the largest weight
  falls and the entropy rises). [R] The exact model of the paper is unknown; this is the
  standard logit equilibrium its note reconstructs.

  Forward: with c = gamma / T the equilibrium solves ``T log p_i + gamma p_i = q_i -
  lambda`` (lambda the row's simplex multiplier, sum p = 1). Per entry that is a
  Lambert-W equation in ``log p_i``, solved by Newton from above (monotone); lambda is
  the root of the convex decreasing ``sum_i p_i(lambda) - 1``, found by Newton from below
  (monotone), from the bracket ``[T lse(q / T) - gamma, T lse(q / T)]``. A few to a few
  dozen steps for any gamma / T (tested to 1e8); a row whose sum does not settle within
  200 steps (never observed) is NaN, never an unconverged answer. Derivatives: the
  implicit function theorem at the fixed point (a custom JVP, solved in closed form by
  Sherman-Morrison, O(n) per row; reverse mode transposes it), not differentiation
  through the iterations. The rule evaluates p through the function itself, so it is
  differentiable again: grad of grad and ``jax.hessian`` work.

  Args:
    x: quality scores q.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      carry no load.
    gamma: congestion penalty gamma >= 0, a scalar or an array broadcast to the rows;
      differentiable.
    temperature: T > 0, a scalar or an array broadcast to the rows; differentiable.

  Returns:
    Weights of ``x``'s shape and dtype summing to 1 on rows with a visible entry; a row
    with none is all zeros with zero gradient. Shift invariant (a per-row constant cancels
    in the softmax).

  Examples:
    >>> q = jnp.array([2.0, 1.0, 0.0])
    >>> js.normalizers.congestion_softmax(q, gamma=0.0)  # softmax
    Array([0.6652, 0.2447, 0.09  ], dtype=float32)
    >>> p = js.normalizers.congestion_softmax(q, gamma=2.0)  # load-balanced
    >>> p
    Array([0.5354, 0.3095, 0.1551], dtype=float32)
    >>> jnp.abs(p - js.normalizers.softmax(q - 2.0 * p)).max() < 1e-6  # the fixed point
    Array(True, dtype=bool)

  References:
    "MoE routing as a congestion game", 2025 (a preprint; authors not recorded in
    docs/feature_ids.md).
  """
  name = "congestion_softmax"
  xs, mask, ax, m, hp = c.prepare_params(x, axis, where, name, (_GAMMA, gamma),
                                         (_TEMPERATURE, temperature), with_max=True)
  gv, tv = hp["gamma"], hp["temperature"]
  last = functools.partial(c.to_last, axis=ax)
  p = _equilibrium(last(xs - m), last(mask), last(gv) if gv.ndim else gv,
                   last(tv) if tv.ndim else tv)
  return c.finish(c.from_last(p, ax), mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="congestion_softmax",
    fn=congestion_softmax,
    kernel_class="X",
    catalogue_id="N37",
    params=(_GAMMA, _TEMPERATURE),
    description="the fixed point p = softmax((x - gamma p) / T), implicit gradient",
))
