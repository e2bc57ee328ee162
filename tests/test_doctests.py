"""Every docstring example under jaxsoft/ and kernels_pallas/ runs as written: doctest, one
case per module.

The examples print JAX arrays (``Array([...], dtype=float32)``); they set
``jnp.set_printoptions(precision=4)`` where float32 rounding could change the last digits
between JAX versions. Each module starts from the print options pytest started with and
gets them back afterwards, so no example leaks its settings into another test.
"""

import doctest
import importlib
import io
import pkgutil

import numpy as np
import pytest

import jaxsoft
import kernels_pallas

FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
_PRINT_OPTIONS = np.get_printoptions()


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
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
      runner.run(test, out=report.write)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, (
      f"{result.failed} of {result.attempted} doctest examples failed in {name}:\n"
      + report.getvalue())
