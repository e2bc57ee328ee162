"""Which derivatives the blockwise attention paths take, and the clear refusal of the rest.

``implementation="xla_chunked"`` and the Pallas kernels compute their gradient with a custom
VJP (a recomputing backward pass): first-order reverse mode (``jax.grad``, ``jax.vjp``,
``jax.jacrev``), exact against the dense path. Their backward holds the keys, values and
class T's threshold constant, so differentiating it again would silently drop terms (the key
Hessian came out ~0). Forward mode (``jax.jvp``, ``jax.jacfwd``) and second or higher order
raise :class:`UnsupportedDifferentiation`, naming the implementation and
``implementation="xla"`` (which supports every transformation); ``implementation=None``
catches it and uses the dense path.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax._src.interpreters import ad as _ad  # LinearizeTracer (not re-exported)
from jax._src.interpreters import batching  # BatchTracer (not re-exported)
from jax.interpreters import ad

__all__ = ["UnsupportedDifferentiation", "refuse_unsupported_ad", "first_order_only", "forward_mode"]


_SECOND_ORDER = ("a second- or higher-order derivative (jax.hessian, jax.grad of jax.grad, "
                 "jax.jvp of jax.grad)")


_DENSE_ADVICE = ("Use implementation='xla' (the dense path), which supports jax.jvp, jax.jacfwd, "
                 "jax.hessian and any nesting; note that implementation=None picks "
                 "'xla_chunked' on CPU once T*S >= 1024*1024.")


def _ad_message(where: str, what: str, advice: str | None = None) -> str:
  return (
      f"{where}: {what} is not supported: the blockwise path computes its gradient with a "
      "custom VJP (a recomputing backward pass), which gives first-order reverse mode "
      f"(jax.grad, jax.vjp, jax.jacrev) only. {advice or _DENSE_ADVICE}")


class UnsupportedDifferentiation(NotImplementedError, TypeError):
  """A derivative the blockwise paths cannot take (forward mode, second order). A
  NotImplementedError, so the automatic ``implementation=None`` moves on to the dense
  path; a TypeError, as JAX's own refusals of a transformation.

  Examples:
    >>> q = jnp.linspace(-1.0, 1.0, 32).reshape(1, 4, 1, 8)
    >>> def f(q, implementation):
    ...   out = js.attention.dot_product_attention(q, q, q, implementation=implementation)
    ...   return out.sum()
    >>> try:
    ...   jax.hessian(f)(q, "xla_chunked")
    ... except js.attention.UnsupportedDifferentiation as e:
    ...   print(type(e).__name__)
    UnsupportedDifferentiation
    >>> jax.hessian(f)(q, "xla").shape  # the dense path takes any derivative
    (1, 4, 1, 8, 1, 4, 1, 8)
  """


def _ad_levels(x) -> tuple[bool, int]:
  """``(forward, depth)`` of one leaf: whether its outermost derivative is forward mode
  (a JVP tracer; reverse mode traces with linearize tracers) and how many nested
  derivatives trace it (vmaps looked through)."""
  forward, depth = None, 0
  while isinstance(x, jax.core.Tracer):
    if isinstance(x, batching.BatchTracer):
      x = x.val
    elif isinstance(x, (ad.JVPTracer, _ad.LinearizeTracer)):
      if forward is None:
        forward = isinstance(x, ad.JVPTracer)
      depth += 1
      x = x.primal
    else:
      break
  return bool(forward), depth


def refuse_unsupported_ad(tree, where: str, advice: str | None = None) -> None:
  """:class:`UnsupportedDifferentiation` naming ``where`` when ``tree`` (the
  differentiable inputs) is differentiated in forward mode (``jax.jvp``, ``jax.jacfwd``)
  or twice (``jax.hessian``, ``jax.grad`` of ``jax.grad``, ``jax.jvp`` of ``jax.grad``).

  Seen here only when the derivative retraces the call; one taken of a ``jax.jit``-compiled
  function holding the call is caught later: the second order by
  :func:`first_order_only` (a TypeError with this message), forward mode by JAX's own
  "can't apply forward-mode autodiff (jvp) to a custom_vjp function". ``advice`` replaces
  the message's pointer to the dense path where that is not the way out.
  """
  levels = [_ad_levels(x) for x in jax.tree.leaves(tree)]
  if any(depth >= 2 for _, depth in levels):
    raise UnsupportedDifferentiation(_ad_message(where, _SECOND_ORDER, advice))
  if any(forward for forward, _ in levels):
    raise UnsupportedDifferentiation(
        _ad_message(where, "forward-mode differentiation (jax.jvp, jax.jacfwd)", advice))


def forward_mode(tree) -> bool:
  """Whether some leaf of ``tree`` (the differentiable inputs) is traced by a forward-mode
  derivative (``jax.jvp``, ``jax.jacfwd``; a JVP tracer at any level, vmaps looked through).

  A path with a custom VJP dispatches on it to a plain differentiable form of the same
  arithmetic (or raises :func:`refuse_unsupported_ad`'s error), since JAX cannot push a
  tangent through a ``custom_vjp``. As for :func:`refuse_unsupported_ad`, seen only when the
  derivative retraces the call (not for ``jax.jvp`` of a ``jax.jit``-compiled function).
  """
  for x in jax.tree.leaves(tree):
    while isinstance(x, jax.core.Tracer):
      if isinstance(x, ad.JVPTracer):
        return True
      if isinstance(x, batching.BatchTracer):
        x = x.val
      elif isinstance(x, _ad.LinearizeTracer):
        x = x.primal
      else:
        break
  return False


def first_order_only(fn: Callable, where: str, advice: str | None = None) -> Callable:
  """``fn`` (a custom VJP's forward or backward computation) made to raise
  :class:`UnsupportedDifferentiation` naming ``where`` when it is itself differentiated, i.e. under a second- or
  higher-order derivative (``jax.hessian``, ``jax.grad`` of ``jax.grad``, ``jax.jvp`` of
  ``jax.grad``). Its first-order result is unchanged; without the guard the backward's
  internal constants (the transposed keys and values, the threshold's stopped gradient)
  would silently drop terms of the Hessian."""

  @jax.custom_jvp
  def guarded(*args):
    return fn(*args)

  @guarded.defjvp
  def _refuse(primals, tangents):
    raise UnsupportedDifferentiation(_ad_message(where, _SECOND_ORDER, advice))

  return guarded


# ------------------------------------------------------------------------------ arrays
