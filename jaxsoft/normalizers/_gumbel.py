"""N13 Gumbel-softmax (Concrete) relaxation with the straight-through hard variant."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, register

__all__ = ["gumbel_softmax"]

_TAU = Param("tau", 1.0, low=0.0, low_open=True, sample=0.5, row_broadcast=True)


def _inf_limit(posinf, axis, hparams, visible=None):
  """The +inf rule: 1/k on the k ``+inf`` entries; ``hard``: one-hot at the first of them."""
  if not hparams.get("hard", False):
    return c.share_among_inf(posinf, axis, hparams, visible)
  first = jnp.argmax(posinf, axis=axis, keepdims=True)
  return jax.lax.broadcasted_iota(jnp.int32, posinf.shape, axis) == first


@c.dense_rules(keyed=True, inf_limit=_inf_limit)
def gumbel_softmax(key: jax.Array, x: ArrayLike, axis: int = -1,
                   where: ArrayLike | None = None, *, tau: ArrayLike = 1.0,
                   hard: bool = False) -> jax.Array:
  r"""Gumbel-softmax sample (feature N13, kernel class X; E. Jang, S. Gu & B. Poole 2017).

  From "Categorical Reparameterization with Gumbel-Softmax" (Jang, Gu & Poole, ICLR 2017,
  arXiv 1611.01144), also known as the Concrete distribution (C. J. Maddison, A. Mnih &
  Y. W. Teh, "The Concrete Distribution: A Continuous Relaxation of Discrete Random
  Variables", ICLR 2017, arXiv 1611.00712):

  .. math::
    y_i = \frac{e^{(x_i + g_i)/\tau}}{\sum_{j \in V} e^{(x_j + g_j)/\tau}},
    \qquad g_i = -\log(-\log u_i),\ u_i \sim U(0, 1)

  with ``x`` the (unnormalised) log-probabilities ``log pi`` and the noise drawn from the
  explicit ``key`` (deterministic given the key). Gumbel-max: ``argmax_i (x_i + g_i)`` is
  distributed as ``softmax(x)`` for any tau. ``hard=True`` is the straight-through
  estimator: the forward value is ``one_hot(argmax y)`` (exactly one 1 per row), the
  gradient is that of the soft sample ``y`` (``y_hard + y - stop_gradient(y)``).

  Args:
    key: a ``jax.random`` key.
    x: logits (log pi up to a per-row constant; the sample is invariant to it).
    tau: temperature tau > 0, a scalar or an array broadcast to the rows; differentiable.
      tau -> 0 approaches one-hot samples, tau -> inf the uniform vector.
    hard: return the straight-through one-hot sample.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; masked entries get exactly 0 and
      are never the argmax.

  Returns:
    A sample of ``x``'s shape and dtype on the simplex of the visible entries (noise and
    softmax in float32); a row with no visible entry is all zeros with zero gradient.

  Examples:
    >>> key = jax.random.key(0)
    >>> logits = jnp.log(jnp.array([0.5, 0.3, 0.2]))
    >>> y = js.normalizers.gumbel_softmax(key, logits, tau=0.5)
    >>> y.shape, y.sum()  # a point on the simplex
    ((3,), Array(1., dtype=float32))
    >>> h = js.normalizers.gumbel_softmax(key, logits, hard=True)
    >>> h.sum(), h.max()  # one-hot forward value
    (Array(1., dtype=float32), Array(1., dtype=float32))
    >>> bool(jnp.argmax(h) == jnp.argmax(y))  # same key, same noise, same winner
    True

  References:
    E. Jang, S. Gu & B. Poole, 2017, "Categorical Reparameterization with Gumbel-Softmax".

    C. J. Maddison, A. Mnih & Y. W. Teh, 2017, "The Concrete Distribution: A Continuous
    Relaxation of Discrete Random Variables".
  """
  xs, mask, ax, hp = c.prepare_params(x, axis, where, "gumbel_softmax", (_TAU, tau))
  g = jax.random.gumbel(key, xs.shape, xs.dtype)
  z = (xs + g) / hp["tau"]
  y = c.exp_normalize(z, mask, ax)
  if hard:
    idx = jnp.argmax(jnp.where(mask, z, -jnp.inf), axis=ax, keepdims=True)
    pos = jax.lax.broadcasted_iota(jnp.int32, xs.shape, ax)
    y_hard = (pos == idx).astype(y.dtype)
    # Parenthesised so the forward value is exactly one-hot: (y - y) is exactly 0, whereas
    # (y_hard + y) - y can round away from 1.
    y = y_hard + (y - jax.lax.stop_gradient(y))
  return c.finish(y, mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="gumbel_softmax",
    fn=gumbel_softmax,
    kernel_class="X",
    catalogue_id="N13",
    params=(_TAU,),
    needs_key=True,
    description="softmax((x + Gumbel noise) / tau), explicit PRNG key",
))

SPEC_HARD = register(NormalizerSpec(
    name="gumbel_softmax_hard",
    fn=functools.partial(gumbel_softmax, hard=True),
    kernel_class="X",
    catalogue_id="N13",
    can_be_sparse=True,
    params=(_TAU,),
    needs_key=True,
    smooth=False,
    description="straight-through one-hot Gumbel sample (gradient of the soft sample)",
))
