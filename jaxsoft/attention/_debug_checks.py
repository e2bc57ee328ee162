"""The blockwise attention paths under ``jax.debug_infs`` / ``jax.debug_nans``.

Those flags check the output of every primitive run eagerly and the outputs of every
jitted computation, residuals included when it is differentiated. ``jax.nn``'s attention
(one jitted computation with large finite negatives for masked logits) passes them on
finite input; the blockwise paths (``xla_chunked`` and the Pallas kernels) keep internal
sentinels that never reach their output but did trip the flags: a masked row's running
max of ``-inf`` in a ``lax.map`` carry, the ``-inf`` row statistic of a fully masked row
(or of the rows padded to a whole block), and the same values saved as residuals of their
custom VJPs. While a flag is on, :func:`checked` runs such a path as one jitted
computation whose own VJP recomputes the forward inside its backward computation: the
only values that leave it are the output (forward) and the inputs' cotangents (backward),
so the sentinels stay inside, as ``jax.nn``'s do. With the flags off (the default)
nothing changes.

The derivatives taken are those of the path without the flags: first-order reverse mode.
Forward mode (``jax.jvp``, ``jax.jacfwd``) and second order raise the same
:class:`~jaxsoft.attention.UnsupportedDifferentiation` as without them (the wrapper's
custom VJP would otherwise give JAX's bare "can't apply forward-mode autodiff (jvp) to a
custom_vjp function"), so ``implementation=None`` still moves on to the dense path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention.differentiation import refuse_unsupported_ad
from jaxsoft.normalizers.common import debug_checks_on

__all__ = ["checked"]


class _Static:
  """A non-array leaf of the call as a static jit argument: hashed by value where it can
  be (numbers, strings, tuples), else by identity (a NormalizerSpec, a callable)."""

  __slots__ = ("value", "key")

  def __init__(self, value):
    self.value = value
    self.key: tuple[Any, ...]
    try:
      hash(value)
      self.key = ("value", type(value), value)
    except TypeError:
      self.key = ("id", id(value))

  def __hash__(self) -> int:
    return hash(self.key)

  def __eq__(self, other) -> bool:
    if not isinstance(other, _Static) or self.key[0] != other.key[0]:
      return False
    return self.key == other.key if self.key[0] == "value" else self.value is other.value


def _is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray))


def _differentiable(leaf) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def checked(run: Callable[[Any], Any], name: str) -> Callable[[Any], Any]:
  """``run`` (an implementation: ``run(call) -> out`` or ``(out, residual)``) made to run
  as one jitted computation, with a VJP that recomputes inside one, while
  ``jax.debug_infs`` or ``jax.debug_nans`` is on (module docstring); ``run`` itself
  otherwise. Forward-mode and second-order derivatives raise
  :class:`~jaxsoft.attention.UnsupportedDifferentiation` naming the implementation.

  Args:
    run: the implementation; it reads the call's arrays and static fields only.
    name: the implementation's name (``implementation=`` of the call), for the errors.

  Returns:
    the wrapped implementation.
  """
  @functools.wraps(run)
  def wrapped(call):
    if not debug_checks_on():
      return run(call)
    fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}
    leaves, treedef = jax.tree_util.tree_flatten(fields)
    slots = tuple((_FLOAT if _differentiable(x) else _OTHER) if _is_array(x) else _Static(x)
                  for x in leaves)
    floats = tuple(x for x, s in zip(leaves, slots, strict=True) if s is _FLOAT)
    others = tuple(x for x, s in zip(leaves, slots, strict=True) if s is _OTHER)
    # (the custom VJP below takes first-order reverse mode only, as the path itself)
    refuse_unsupported_ad(floats, f"dot_product_attention(implementation={name!r})")
    return _call(run, type(call), treedef, slots, floats, others)

  return wrapped


_FLOAT, _OTHER = "float array", "other array"  # the slots of the call's array leaves


def _build(cls, treedef, slots, floats, others):
  """The call from its static slots and its arrays (``floats`` and ``others``: the array
  leaves split by dtype, each in the order of ``treedef``'s leaves)."""
  fl, ot = iter(floats), iter(others)
  leaves = [next(fl) if s is _FLOAT else next(ot) if s is _OTHER else s.value for s in slots]
  return cls(**jax.tree_util.tree_unflatten(treedef, leaves))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _call(run, cls, treedef, slots, floats, others):
  return _forward(run, cls, treedef, slots, floats, others)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _forward(run, cls, treedef, slots, floats, others):
  return run(_build(cls, treedef, slots, floats, others))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _backward(run, cls, treedef, slots, floats, others, cotangent):
  _, vjp = jax.vjp(lambda fl: run(_build(cls, treedef, slots, fl, others)), floats)
  return vjp(cotangent)[0]


def _fwd(run, cls, treedef, slots, floats, others):
  # the residuals are the inputs (finite where the call's inputs are): the backward
  # recomputes the forward inside its own jitted computation
  return _forward(run, cls, treedef, slots, floats, others), (floats, others)


def _bwd(run, cls, treedef, slots, residuals, cotangent):
  floats, others = residuals
  return _backward(run, cls, treedef, slots, floats, others, cotangent), None


_call.defvjp(_fwd, _bwd)
