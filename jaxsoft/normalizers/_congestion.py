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

# The iteration stops when every row's residual max|S(p) - p| is below this (per compute
# dtype), or after MAX_ITERATIONS steps; the contraction factor is gamma / (gamma + 4 T), so
# gamma / T = 100 needs about 750 steps in float64.
_TOL = {jnp.dtype(jnp.float32): 2e-7, jnp.dtype(jnp.float64): 1e-14}
MAX_ITERATIONS = 4000


def _best_response(p, z, mask, gamma, t):
  """S(p) = softmax((z - gamma p) / T) over the visible entries of the last axis."""
  u = jnp.where(mask, (z - gamma * p) / t, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, u, -jnp.inf), axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return c.sum_normalize(jnp.exp(jnp.where(mask, u, m) - m), mask, -1)


def _solve(z, mask, gamma, t):
  """The fixed point by the damped iteration p <- (1 - eta) p + eta S(p).

  The Jacobian of S is -(gamma/T)(diag p - p p^T), whose eigenvalues lie in
  [-gamma/(2T), 0]; eta = 4T/(4T + gamma) puts those of the damped map in
  [-gamma/(gamma + 4T), gamma/(gamma + 4T)], a contraction for every gamma >= 0 (gamma = 0:
  eta = 1 and one step gives softmax(q/T)).
  """
  eta = 4.0 * t / (4.0 * t + gamma)
  tol = _TOL.get(jnp.dtype(z.dtype), 2e-7)
  p0 = _best_response(jnp.zeros_like(z), z, mask, gamma, t)

  def cond(carry):
    i, _, err = carry
    return jnp.logical_and(i < MAX_ITERATIONS, err > tol)

  def body(carry):
    i, p, _ = carry
    s = _best_response(p, z, mask, gamma, t)
    return i + 1, (1.0 - eta) * p + eta * s, jnp.max(jnp.abs(s - p))

  return jax.lax.while_loop(cond, body, (jnp.asarray(0), p0, jnp.asarray(jnp.inf, z.dtype)))[1]


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
  p = _solve(z, mask, gamma, t)
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

  Forward: the damped iteration ``p <- (1 - eta) p + eta softmax((q - gamma p)/T)`` with
  ``eta = 4T / (4T + gamma)``, a contraction (factor gamma / (gamma + 4T)), run until every
  row's residual is below 2e-7 (float32) or 1e-14 (float64), at most 4000 steps. Backward:
  the implicit function theorem at the fixed point (a custom JVP, solved in closed form
  by Sherman-Morrison, O(n) per row; reverse mode transposes it), not differentiation
  through the iterations.

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
