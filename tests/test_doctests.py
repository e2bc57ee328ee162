"""Every docstring example under jaxsoft/ and kernels_pallas/ runs as written: doctest, one
case per module.

As in JAX's own docstrings, the examples assume the usual imports (``import jax``,
``import jax.numpy as jnp``, ``import numpy as np``, ``import jaxsoft as js`` and, as in
Flax's, ``from flax import nnx``) and print arrays with ``jnp.set_printoptions(precision=4)``,
so float32 rounding in the last digits cannot differ between JAX versions.
``EXAMPLE_GLOBALS`` and ``EXAMPLE_PRINT_OPTIONS`` are what every docstring's examples start
from. Each module gets the print options pytest started with back afterwards, so no example
leaks its settings into another test.
"""

import doctest
import importlib
import io
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsoft
import kernels_pallas

FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
_PRINT_OPTIONS = np.get_printoptions()
EXAMPLE_GLOBALS = {"jax": jax, "jnp": jnp, "np": np, "js": jaxsoft, "nnx": nnx}
EXAMPLE_PRINT_OPTIONS = {"precision": 4}


def _module_names():
  def onerror(name):  # a package that fails to import is a failure, not a silent skip
    raise ImportError(f"cannot import {name} while collecting doctests")
  names = {"jaxsoft", "kernels_pallas"}
  for package in (jaxsoft, kernels_pallas):
    names |= {m.name for m in pkgutil.walk_packages(
        package.__path__, package.__name__ + ".", onerror=onerror)}
  return sorted(n for n in names if n.rsplit(".", 1)[-1] != "__main__")


@pytest.mark.parametrize("name", _module_names())
def test_docstring_examples(name):
  module = importlib.import_module(name)
  report = io.StringIO()
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  with np.printoptions(**_PRINT_OPTIONS):
    for test in doctest.DocTestFinder(exclude_empty=True).find(
        module, name, globs={**vars(module), **EXAMPLE_GLOBALS}):
      with np.printoptions(**EXAMPLE_PRINT_OPTIONS):  # each docstring starts afresh
        runner.run(test, out=report.write)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, (
      f"{result.failed} of {result.attempted} doctest examples failed in {name}:\n"
      + report.getvalue())
