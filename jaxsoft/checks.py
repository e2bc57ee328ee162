r"""Runtime checks of traced hyperparameters and non-finite values (``jax.experimental.checkify``).

A hyperparameter that is a Python number or a concrete array is checked when the function
is called: a value outside the range its :class:`~jaxsoft.normalizers.NormalizerSpec`
declares is a ``ValueError`` naming the function and the argument. A *traced* value (a
learned ``alpha``, ``s``, ``temperature`` or sink logit; anything under ``jit``, ``grad``
or ``vmap``) has no value at trace time, so the library cannot check it there. Without
this module such a value is computed as given: ``entmax`` with a traced ``alpha <= 1``
returns NaN rows (never a plausible-looking distribution), while a function whose formula
is defined outside the declared range returns that formula's value (a negative softmax
``temperature`` reverses the order of the weights, silently).

This module turns every declared range into a ``checkify`` check, so such a value is
reported at run time, under ``jit``, ``grad``, ``vmap`` and ``scan``, with the function
and the argument named:

* :func:`check_hparams` checks the hyperparameters of one normalizer (a mapping, as
  ``normalizer_params`` of the attention functions or the keyword arguments of a normalizer);
* :func:`checked` wraps a normalizer so that every call checks its hyperparameters;
* :func:`check_finite` checks that every leaf of a pytree (a loss, the gradients) is finite,
  naming the leaf.

The checks are ``checkify.check`` calls: run the function under ``checkify.checkify`` (the
default ``errors=checkify.user_checks`` suffices) and read the returned error
(``err.get()``, or ``err.throw()`` outside ``jit``). A check that is not under
``checkify.checkify`` is an error once traced, so call these only in code you checkify.
``train/train.py --check_numerics`` checkifies its train step with them.

Examples:
  >>> from jax.experimental import checkify
  >>> entmax = js.checks.checked("entmax")
  >>> run = jax.jit(checkify.checkify(lambda x, a: entmax(x, alpha=a)))
  >>> err, p = run(jnp.array([1.0, 0.5, -1.0]), 1.5)
  >>> print(err.get())
  None
  >>> err, p = run(jnp.array([1.0, 0.5, -1.0]), 0.5)   # traced alpha <= 1
  >>> print(err.get())
  entmax: `alpha` must be > 1.0, got 0.5 (`check` failed)

References:
  JAX authors, "The checkify transformation" (``jax.experimental.checkify``),
  https://docs.jax.dev/en/latest/debugging/checkify_guide.html.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxsoft._validation import concrete
from jaxsoft.normalizers import spec as _spec

__all__ = ["check_hparams", "checked", "check_finite"]


def _spec_of(normalizer: Any, fn_name: str) -> _spec.NormalizerSpec:
  """The NormalizerSpec ``normalizer`` names; TypeError for a callable without declared ranges."""
  found = _spec.resolve(normalizer)
  if not isinstance(found, _spec.NormalizerSpec):
    raise TypeError(f"{fn_name}: `normalizer` must be a registered name or a NormalizerSpec "
                    f"(whose hyperparameter ranges are declared), got {normalizer!r}")
  return found


def _literal(text: str) -> str:
  """``text`` inside a checkify message: its braces are not format fields."""
  return text.replace("{", "{{").replace("}", "}}")


def _is_traced(value: Any) -> bool:
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value))


def _first(values: jax.Array, bad: jax.Array) -> jax.Array:
  """The first entry of ``values`` where ``bad`` holds (a scalar, for the message)."""
  flat = jnp.ravel(values)
  return flat[jnp.argmax(jnp.ravel(bad))]


def _check_one(param: _spec.Param, value: Any, fn_name: str, context: str) -> None:
  """The checkify checks of one traced hyperparameter against its declared range."""
  fn_name, context = _literal(fn_name), _literal(context)
  v = jnp.asarray(value)
  if not (jnp.issubdtype(v.dtype, jnp.floating) or jnp.issubdtype(v.dtype, jnp.integer)):
    return  # not a number: nothing declared to check
  if jnp.issubdtype(v.dtype, jnp.floating):
    nan = jnp.isnan(v)
    checkify.check(~jnp.any(nan), f"{fn_name}: `{param.name}` must not be NaN{context}")
  if param.low is not None:
    below = (v <= param.low) if param.low_open else (v < param.low)
    op = ">" if param.low_open else ">="
    checkify.check(~jnp.any(below), f"{fn_name}: `{param.name}` must be {op} {param.low}, "
                   f"got {{}}{context}", _first(v, below))
  if param.high is not None:
    above = (v >= param.high) if param.high_open else (v > param.high)
    op = "<" if param.high_open else "<="
    checkify.check(~jnp.any(above), f"{fn_name}: `{param.name}` must be {op} {param.high}, "
                   f"got {{}}{context}", _first(v, above))


def check_hparams(normalizer: Any, hparams: Mapping[str, Any], *, context: str = "") -> None:
  r"""Checks hyperparameters against the ranges their normalizer declares.

  For each ``name, value`` of ``hparams``, with ``[low, high]`` (or open ends) the range of
  ``spec.param(name)``:

  .. math::
    \text{fails} \iff \exists i:\ \mathrm{isnan}(v_i) \lor v_i \notin [\mathit{low},
    \mathit{high}]

  A concrete value is checked at once (``ValueError`` naming the function and the argument,
  as the normalizer itself does); a traced one becomes ``checkify.check`` calls whose
  message names the function, the argument, the range and the first offending value.
  ``None`` (a data-dependent default) and non-numeric values are not checked.

  Args:
    normalizer: a registered name or a :class:`~jaxsoft.normalizers.NormalizerSpec`.
    hparams: ``{name: value}``, e.g. the ``normalizer_params`` given to an attention function.
    context: text appended to each message (e.g. ``" in layer 0"``).

  Returns:
    None. Raises ``ValueError`` for an unknown name or an out-of-range concrete value,
    ``TypeError`` when ``normalizer`` is a plain callable (no declared ranges).

  Examples:
    >>> from jax.experimental import checkify
    >>> def attend(q, t):
    ...   js.checks.check_hparams("softmax", {"temperature": t})
    ...   return js.attention.dot_product_attention(q, q, q, normalizer="softmax",
    ...                                             normalizer_params={"temperature": t})
    >>> q = jnp.ones((1, 3, 1, 2))
    >>> err, _ = jax.jit(checkify.checkify(attend))(q, -0.5)
    >>> print(err.get())
    softmax: `temperature` must be > 0.0, got -0.5 (`check` failed)

  References:
    JAX authors, "The checkify transformation" (``jax.experimental.checkify``),
    https://docs.jax.dev/en/latest/debugging/checkify_guide.html.
  """
  spec = _spec_of(normalizer, "check_hparams")
  for name, value in hparams.items():
    try:
      param = spec.param(name)
    except KeyError:
      raise ValueError(f"check_hparams: normalizer {spec.name!r} has no hyperparameter "
                       f"`{name}`; it takes {[p.name for p in spec.params]}") from None
    if value is None:
      continue
    if not _is_traced(value):
      a = concrete(value)
      if a is None or not (np.issubdtype(a.dtype, np.floating)
                           or np.issubdtype(a.dtype, np.integer)):
        continue
      for v in np.ravel(a):  # every entry of a concrete array, as a traced one is checked
        try:
          param.validate(v.item(), spec.name)
        except ValueError as e:
          raise ValueError(f"{e}{context}") from None
      continue
    _check_one(param, value, spec.name, context)


def checked(normalizer: Any) -> Callable[..., jax.Array]:
  """A normalizer that checks its hyperparameters on every call (:func:`check_hparams`).

  The returned function has the normalizer's signature, ``fn([key,] x, axis=-1,
  where=None, **hparams)``, and computes the same weights; run it under
  ``checkify.checkify`` so that a traced hyperparameter outside its declared range is
  reported instead of computed.

  Args:
    normalizer: a registered name or a :class:`~jaxsoft.normalizers.NormalizerSpec`.

  Returns:
    The checking normalizer function.

  Examples:
    >>> from jax.experimental import checkify
    >>> softmax = js.checks.checked("softmax")
    >>> x = jnp.array([0.0, 1.0])
    >>> err, w = checkify.checkify(jax.grad(lambda t: softmax(x, temperature=t)[1]))(-1.0)
    >>> print(err.get())
    softmax: `temperature` must be > 0.0, got -1.0 (`check` failed)

  References:
    As in :func:`check_hparams`.
  """
  spec = _spec_of(normalizer, "checked")

  @functools.wraps(spec.fn)
  def fn(*args, **hparams):
    check_hparams(spec, hparams)
    return spec.fn(*args, **hparams)

  return fn


def check_finite(tree: Any, what: str) -> None:
  """Checks that every leaf of ``tree`` is finite (no NaN, no ``±inf``), naming the leaf.

  One ``checkify.check`` per floating-point leaf, whose message names ``what`` and the
  leaf's path, e.g. ``"non-finite gradient at ['blocks'][0]['attn']['q']['kernel']"``.
  Integer leaves are always finite and not checked.

  Args:
    tree: a pytree of arrays (a loss, gradients, parameters).
    what: what the tree is, for the message ("loss", "gradient").

  Returns:
    None (the checks are recorded by ``checkify.checkify``).

  Examples:
    >>> from jax.experimental import checkify
    >>> grads = {"w": jnp.array([1.0, jnp.inf]), "b": jnp.zeros(2)}
    >>> err, _ = checkify.checkify(js.checks.check_finite)(grads, "gradient")
    >>> print(err.get())
    non-finite gradient at ['w'] (`check` failed)

  References:
    As in :func:`check_hparams`.
  """
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    leaf = jnp.asarray(leaf)
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      continue
    where = f" at {jax.tree_util.keystr(path)}" if path else ""
    checkify.check(jnp.all(jnp.isfinite(leaf)), _literal(f"non-finite {what}{where}"))
