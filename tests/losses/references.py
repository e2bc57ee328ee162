"""Float64 NumPy references and gradient checks shared by the loss tests (test support)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft as js


def jitted_losses(static_argnames):
  """``name -> static argument names`` as a namespace of ``jax.jit``-ed ``js.losses``
  functions, so a test compiles a few programs instead of dispatching op by op."""
  return types.SimpleNamespace(**{
      name: jax.jit(getattr(js.losses, name), static_argnames=static)
      for name, static in static_argnames.items()})


def np_ce(z, y):
  """Softmax cross-entropy of integer labels over the last axis, in float64."""
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  return lse - np.take_along_axis(z, np.asarray(y)[..., None], -1)[..., 0]


def np_softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def grads64(f, *args):
  """First-order reverse-mode gradients of ``f`` checked in float64 (finite differences)."""
  with jax.enable_x64(True):
    check_grads(jax.jit(f), tuple(jnp.asarray(np.asarray(a, np.float64)) for a in args),
                order=1, modes=("rev",), atol=1e-5, rtol=1e-5, eps=1e-6)
