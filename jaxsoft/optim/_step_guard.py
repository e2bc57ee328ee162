r"""The safe step radius of softmax cross-entropy (its "ghosts") and a step guard for optax.

Catalogue experiment E08 (P. Sao 2026, "Ghosts of Softmax: Complex Singularities That Limit
Safe Step Sizes in Cross-Entropy", arXiv 2603.13552). Along an update direction
``v`` the logits are, to first order, ``z_k(τ) = z_k + a_k τ`` with ``a_k = ∇z_k · v``
(one JVP). The cross-entropy ``ℓ(τ) = log F(τ) − z_y − a_y τ`` with

.. math::
  F(τ) = \sum_k e^{z_k + a_k τ}

is analytic except where ``F`` vanishes: ``F`` has complex zeros (the "ghosts"), and the
Taylor series of ``ℓ`` around ``τ = 0`` converges exactly inside the disk that reaches the
nearest one. For two classes the zeros are ``τ = (−δ + iπ(2m + 1)) / (a_1 − a_2)``
(``δ = z_1 − z_2``), so the radius is ``ρ^* = \sqrt{δ^2 + π^2} / Δ_a``. For any number of
classes ``ρ_a = π / Δ_a`` with ``Δ_a = \max_k a_k − \min_k a_k`` is a lower bound: inside
it every term's phase ``a_k \operatorname{Im} τ`` lies in an arc shorter than π, so the
terms cannot cancel. ``r = τ / ρ_a`` is the normalised step; the paper finds no collapse
for ``r < 1`` and collapse from ``r ≈ 1``, and a controller that enforces ``τ ≤ ρ_a``
survives learning-rate spikes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from jaxsoft._validation import finite_float

__all__ = ["SoftmaxStepGuardState", "binary_ghost_radius", "ghost_radius", "softmax_step_guard"]


def _float(x: jax.Array) -> jax.Array:
  """``x`` as a float array: float64 stays, bf16/fp16 and integers compute in float32."""
  dtype = jnp.promote_types(x.dtype, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) \
      else jnp.float32
  return x.astype(dtype)


def _spread(a: jax.Array, axis: int, where: ArrayLike | None) -> jax.Array:
  """``max_k a_k − min_k a_k`` over ``axis`` (visible entries only; 0 with fewer than two)."""
  if where is None:
    return jnp.max(a, axis=axis) - jnp.min(a, axis=axis)
  mask = jnp.broadcast_to(jnp.asarray(where, bool), a.shape)
  hi = jnp.max(jnp.where(mask, a, -jnp.inf), axis=axis)
  lo = jnp.min(jnp.where(mask, a, jnp.inf), axis=axis)
  return jnp.where(jnp.sum(mask, axis=axis) >= 2, hi - lo, 0.0)


def ghost_radius(logit_tangent: ArrayLike, axis: int = -1,
                 where: ArrayLike | None = None) -> jax.Array:
  r"""The safe step radius ``ρ_a = π / Δ_a`` of softmax cross-entropy along a direction.

  With the logits moving as ``z + a τ`` (``a`` the JVP of the logits along the update),
  ``F(τ) = Σ_k e^{z_k + a_k τ}`` has no zero in the complex disk ``|τ| < π / Δ_a``,
  ``Δ_a = max_k a_k − min_k a_k``, so the Taylor series of the cross-entropy (and of
  ``log F``) along the step converges for every step ``τ < ρ_a``, whatever the logits and
  the label. It is a lower bound of the true radius (for two classes the exact one is
  :func:`binary_ghost_radius`).

  Args:
    logit_tangent: ``a``, the change of the logits per unit step, ``[..., K, ...]``.
    axis: the class axis.
    where: optional mask broadcastable to ``logit_tangent``; classes where it is False are
      not in the sum (a logit at −inf). A row with fewer than two classes has ``Δ_a = 0``.

  Returns:
    ``π / Δ_a`` per row (``axis`` removed), float32 (float64 for float64 input); ``inf``
    where ``Δ_a = 0`` (the loss does not change along the step).

  Examples:
    >>> js.optim.ghost_radius(jnp.array([[1.0, -1.0, 0.5], [0.0, 0.0, 0.0]]))
    Array([1.5708,    inf], dtype=float32)

  References:
    P. Sao, 2026, "Ghosts of Softmax: Complex Singularities That Limit Safe Step Sizes in
    Cross-Entropy", arXiv 2603.13552.
  """
  a = _float(jnp.asarray(logit_tangent))
  return jnp.pi / _spread(a, axis, where)


def binary_ghost_radius(logits: ArrayLike, logit_tangent: ArrayLike,
                        axis: int = -1) -> jax.Array:
  r"""The exact step radius ``ρ^* = sqrt(δ² + π²) / Δ_a`` of two-class cross-entropy.

  For two classes ``F(τ) = e^{z_2 + a_2 τ}(1 + e^{δ + Δ τ})`` with ``δ = z_1 − z_2`` and
  ``Δ = a_1 − a_2``: its zeros are ``τ = (−δ + iπ(2m + 1)) / Δ`` and the nearest lies at
  distance ``sqrt(δ² + π²) / |Δ|``, the radius of convergence of the loss's Taylor series
  along the step. It is at least :func:`ghost_radius` (``δ = 0`` gives equality).

  Args:
    logits: ``z``, with exactly two entries along ``axis``.
    logit_tangent: ``a``, the change of the logits per unit step, ``logits``' shape.
    axis: the class axis.

  Returns:
    ``ρ^*`` per row (``axis`` removed); ``inf`` where ``a_1 = a_2``.

  Examples:
    >>> js.optim.binary_ghost_radius(jnp.array([0.0, 0.0]), jnp.array([1.0, -1.0]))
    Array(1.5708, dtype=float32)
    >>> js.optim.binary_ghost_radius(jnp.array([3.0, 0.0]), jnp.array([1.0, -1.0]))
    Array(2.172, dtype=float32)

  References:
    P. Sao, 2026, "Ghosts of Softmax: Complex Singularities That Limit Safe Step Sizes in
    Cross-Entropy", arXiv 2603.13552.
  """
  z = _float(jnp.asarray(logits))
  a = _float(jnp.asarray(logit_tangent)).astype(z.dtype)
  if z.shape != a.shape:
    raise ValueError(f"binary_ghost_radius: logits {z.shape} and logit_tangent {a.shape} "
                     "must have the same shape")
  if z.ndim == 0 or z.shape[axis] != 2:
    raise ValueError(f"binary_ghost_radius: needs exactly 2 classes along axis {axis}, "
                     f"got shape {z.shape}")
  first = lambda x: jnp.take(x, 0, axis=axis)
  second = lambda x: jnp.take(x, 1, axis=axis)
  delta = first(z) - second(z)
  return jnp.hypot(delta, jnp.pi) / jnp.abs(first(a) - second(a))


class SoftmaxStepGuardState(NamedTuple):
  """The state of :func:`softmax_step_guard`: what the last update looked like.

  ``step_ratio`` is ``r = Δ_a / π`` of the proposed update (the step ``τ = 1`` over the
  radius ``ρ_a``), before the guard, the largest over the batch; ``scale`` is the factor the
  guard applied to that update (1 when ``r`` was within bounds).

  Examples:
    >>> js.optim.SoftmaxStepGuardState(step_ratio=jnp.zeros(()), scale=jnp.ones(()))
    SoftmaxStepGuardState(step_ratio=Array(0., dtype=float32), scale=Array(1., dtype=float32))
  """

  step_ratio: jax.Array
  scale: jax.Array


def softmax_step_guard(logits_fn: Callable[..., Any], *,
                       max_ratio: float = 1.0) -> optax.GradientTransformationExtraArgs:
  r"""An optax transformation that keeps each step inside softmax cross-entropy's safe radius.

  Given the update ``u`` an optimizer proposes (put the guard last in the chain, after the
  learning rate), it computes the logits' change per unit step ``a = J_z(params) u`` with
  one JVP of ``logits_fn``, the normalised step ``r = Δ_a / π`` (the step ``τ = 1`` over
  :func:`ghost_radius`; ``Δ_a`` the largest spread ``max_k a_k − min_k a_k`` over the
  examples of the batch, since the batch loss is singular wherever one example's is) and
  returns

  .. math::
    u' = u \cdot \min\!\left(1, \frac{r_{\max}}{r}\right).

  Guarantee: the JVP is linear in ``u``, so the guarded step has ``r' ≤ r_max``: no
  example's ``F(τ) = Σ_k e^{z_k + a'_k τ}`` vanishes for ``|τ| < 1 / r_max``. With
  ``r_max < 1`` the step taken (``τ = 1``) lies strictly inside the disk where the Taylor
  series of each example's linearised loss converges; with the default ``r_max = 1`` it
  lies on the disk's edge at worst (the bound is tight only in special cases, such as two
  classes with equal logits). And since ``|dℓ/dτ| = |Σ_k p_k a_k − a_y| ≤ Δ_a``, each
  example's loss changes by at most ``π r_max`` when the logits are linear in the
  parameters (a linear head on fixed features), whatever the learning rate. An update that
  is already safe passes unchanged. Unlike gradient clipping, the bound is on the change of
  the logits, not on the norm of the update: the step is shrunk only when it would move
  some logits too far apart relative to the others.
  Classes whose logit is −inf (masked) are left out of the spread.

  Args:
    logits_fn: ``logits_fn(params)`` or ``logits_fn(params, batch)``, the logits
      ``[..., K]`` (classes last) that the loss applies softmax cross-entropy to.
    max_ratio: ``r_max > 0``, the largest normalised step allowed (the paper's controller
      uses 1; below 1 leaves a margin for the curvature of the model itself).

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its ``update(updates, state, params,
    batch=None)`` needs ``params`` (the point the JVP is taken at) and passes ``batch``
    to ``logits_fn`` when given; its state is a :class:`SoftmaxStepGuardState`.

  Examples:
    >>> W = jnp.eye(2, 3)
    >>> logits_fn = lambda W, x: x @ W
    >>> guard = js.optim.softmax_step_guard(logits_fn)
    >>> state = guard.init(W)
    >>> x = jnp.array([[1.0, 0.0]])
    >>> u = jnp.array([[10.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # moves logit 0 by 10
    >>> u2, state = guard.update(u, state, W, batch=x)
    >>> state.step_ratio  # 10 / π: the step would leave the safe radius
    Array(3.1831, dtype=float32)
    >>> u2[0, 0]  # shrunk to a logit change of π
    Array(3.1416, dtype=float32)

  References:
    P. Sao, 2026, "Ghosts of Softmax: Complex Singularities That Limit Safe Step Sizes in
    Cross-Entropy", arXiv 2603.13552.
  """
  if not callable(logits_fn):
    raise TypeError(f"softmax_step_guard: `logits_fn` must be callable, got {logits_fn!r}")
  r_max = finite_float(max_ratio, "max_ratio", "softmax_step_guard")
  if r_max <= 0:
    raise ValueError(f"softmax_step_guard: `max_ratio` must be > 0, got {max_ratio!r}")

  def init_fn(params):
    del params
    return SoftmaxStepGuardState(step_ratio=jnp.zeros((), jnp.float32),
                                 scale=jnp.ones((), jnp.float32))

  def update_fn(updates, state, params=None, *, batch=None, **extra_args):
    del state, extra_args
    if params is None:
      raise ValueError("softmax_step_guard: update() needs `params` (the JVP of the logits is "
                       "taken there)")
    call = (lambda p: logits_fn(p)) if batch is None else (lambda p: logits_fn(p, batch))
    tangents = jax.tree.map(lambda u, p: jnp.asarray(u).astype(jnp.asarray(p).dtype),
                            updates, params)
    logits, a = jax.jvp(call, (params,), (tangents,))
    logits, a = jnp.asarray(logits), _float(jnp.asarray(a))
    if logits.ndim == 0:
      raise ValueError("softmax_step_guard: `logits_fn` must return logits [..., K] (classes "
                       "last), got a scalar")
    visible = jnp.asarray(logits) > -jnp.inf
    spread = jnp.max(_spread(a, -1, visible))
    ratio = spread / jnp.pi
    scale = jnp.where(ratio > r_max, r_max / jnp.maximum(ratio, r_max), 1.0)
    new = jax.tree.map(lambda u: (u * scale.astype(jnp.asarray(u).dtype)), updates)
    return new, SoftmaxStepGuardState(step_ratio=ratio.astype(jnp.float32),
                                      scale=scale.astype(jnp.float32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
