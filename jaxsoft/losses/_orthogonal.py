"""L04 ⊥Grad: the orthogonal-gradient fix of Prieto et al. (ICLR 2025), an optax transformation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxsoft.normalizers import common as nc

__all__ = ["orthogonal_gradient"]

# ||g_perp|| at or below this many ulps of ||g|| is rounding noise: g is parallel to
# theta, and rescaling the noise up to ||g|| would produce a random direction.
_PARALLEL_ULPS = 32


def orthogonal_gradient() -> optax.GradientTransformation:
  r"""⊥Grad: drop the part of each update parallel to its parameter (feature L04).

  L. Prieto, M. Barsbey, P. A. M. Mediano & T. Birdal ("Grokking at the Edge of Numerical
  Stability", ICLR 2025, arXiv 2501.04697) show that once the training data is fit, the
  gradient of a (near-)homogeneous model points along the weights themselves ("naive loss
  minimisation"): the logits grow, the predictions do not change, and float32 softmax
  eventually collapses. ⊥Grad removes that direction.
  For every parameter leaf :math:`\theta` (the whole tensor, flattened) and its incoming
  update :math:`g`:

  .. math::
    g_\perp = g - \frac{\langle g, \theta\rangle}{\lVert\theta\rVert^2}\,\theta,
    \qquad
    \mathrm{out} = g_\perp \, \frac{\lVert g\rVert}{\lVert g_\perp\rVert},

  i.e. the projection onto the hyperplane orthogonal to :math:`\theta`, rescaled to the
  original norm (as the authors' ``OrthoGrad`` wrapper does before the base optimizer).
  Edge cases, where the paper's ``1e-30`` epsilons would otherwise decide: a zero
  parameter leaves ``g`` unchanged; a zero update stays zero; when ``g`` is parallel to
  :math:`\theta` up to rounding (:math:`\lVert g_\perp\rVert \le 32\,\epsilon
  \lVert g\rVert`, which is always the case for a one-element leaf) the update is 0.
  Wrap with ``optax.masked`` to leave such leaves (e.g. scalar gains) untouched.
  bf16/fp16 updates are processed in float32 and returned in their dtype.

  Use it on raw gradients, before the optimizer::

    tx = optax.chain(js.losses.orthogonal_gradient(), optax.adamw(1e-3))

  Returns:
    A stateless ``optax.GradientTransformation`` whose ``update`` requires ``params``.

  Examples:
    >>> tx = js.losses.orthogonal_gradient()
    >>> params = {"w": jnp.array([1.0, 0.0])}
    >>> updates, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(params), params)
    >>> print(updates["w"])  # the part along w is gone, the norm 5 is kept
    [0. 5.]

  References:
    L. Prieto, M. Barsbey, P. A. M. Mediano & T. Birdal, 2025, "Grokking at the Edge of
    Numerical Stability" (ICLR).
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("orthogonal_gradient: `params` are required (⊥Grad projects each "
                       "update against its parameter)")
    return jax.tree.map(_orthogonalize, updates, params), state

  return optax.GradientTransformation(init_fn, update_fn)


def _orthogonalize(g, theta):
  """⊥Grad for one leaf (see :func:`orthogonal_gradient`)."""
  g = jnp.asarray(g)
  dtype = nc.compute_dtype(g.dtype)
  gc = g.astype(dtype)
  tc = jnp.asarray(theta).astype(dtype)
  tt = jnp.vdot(tc, tc)
  coef = nc.safe_divide(jnp.vdot(gc, tc), tt)
  g_perp = gc - coef * tc
  g_norm = jnp.sqrt(jnp.vdot(gc, gc))
  perp_norm = jnp.sqrt(jnp.vdot(g_perp, g_perp))
  significant = perp_norm > _PARALLEL_ULPS * jnp.finfo(dtype).eps * g_norm
  scale = jnp.where(significant, g_norm / jnp.where(significant, perp_norm, 1.0), 0.0)
  return (g_perp * scale).astype(g.dtype)
