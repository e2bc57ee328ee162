"""``Jitted(module)``: the module's functions called under ``jax.jit`` (test support).

A loss called eagerly compiles each of its primitives on its own, which costs several
times the CPU of one compilation of the whole call; the L10-L14 tests call through this
proxy to keep the default suite's budget. Array arguments (positional or keyword) are
traced; everything else (ints, strings, None, PRNG-free flags) stays static.
"""

import jax
import numpy as np

_ARRAY = (jax.Array, np.ndarray)


def jit_call(fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` under ``jax.jit`` with the array arguments traced."""
  pos = [i for i, a in enumerate(args) if isinstance(a, _ARRAY)]
  kw = [k for k, a in kwargs.items() if isinstance(a, _ARRAY)]

  def run(pos_arrays, kw_arrays):
    full = list(args)
    for i, a in zip(pos, pos_arrays, strict=True):
      full[i] = a
    return fn(*full, **{**kwargs, **dict(zip(kw, kw_arrays, strict=True))})

  return jax.jit(run)([args[i] for i in pos], [kwargs[k] for k in kw])


class Jitted:
  """Attribute access returns the module's function wrapped by :func:`jit_call`."""

  def __init__(self, module):
    self._module = module

  def __getattr__(self, name):
    fn = getattr(self._module, name)
    return lambda *args, **kwargs: jit_call(fn, *args, **kwargs)
