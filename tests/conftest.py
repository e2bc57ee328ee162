"""Shared test set-up: CPU only, deterministic, hypothesis profiles sized for CI, one JAX
compilation cache per run, and the ``kernels`` / ``subprocess`` markers applied from here
(the test files need not say so).

* ``kernels``: Pallas interpret-mode tests: everything under tests/kernels_pallas/, and any
  test that reaches a ``kernels_pallas`` module (through its module's globals, the helper
  functions of its module it calls, or the fixtures it requests);
* ``subprocess``: tests that start a Python subprocess: the same walk finds a reference to
  the ``subprocess`` module;
* ``slow``, besides the tests that say so: the parametrized cases listed in
  ``tests/default_sample.txt`` (the default suite's sample, chosen from measured durations by
  ``tests/default_sample.py``; every test function keeps a case in the default run).

The quick inner loop is ``pytest -m "not kernels and not subprocess and not slow"``
(``make test-quick``).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's HLO passes (simplification, fusion) run as always; only LLVM's code generation is not
# optimised (jax_disable_most_optimizations: backend level 0, no expensive passes). Programs
# of this size compile in about 30% less CPU time; results can differ from an optimised build
# in the last bit (no FMA contraction). JAX_DISABLE_MOST_OPTIMIZATIONS=0 tests optimised code.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Issue 37's guard: library code never relies on implicit rank promotion (the setting of
# JAX's own suite). Set here so the Python subprocesses tests start inherit it; the tests of
# this process run under it through the autouse fixture at the end of this file.
os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

# XLA's older CPU code generator where the installed XLA has it (tests/compile_settings.py).
from tests import compile_settings  # noqa: E402

compile_settings.apply()

# One compilation cache for this run's processes (the xdist workers and the subprocesses tests
# start inherit it): a program compiled by two tests, two workers or a child process is
# compiled once. Fresh per pytest run and removed at its end, so every run starts cold; an
# explicitly set JAX_COMPILATION_CACHE_DIR is used as it is and kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxsoft-tests-jit-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import pathlib  # noqa: E402
import subprocess  # noqa: E402
import types  # noqa: E402

import hypothesis  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, print_blob=True)
hypothesis.settings.register_profile("dev", max_examples=40, deadline=None)
hypothesis.settings.register_profile("slow", max_examples=200, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_TESTS = pathlib.Path(__file__).resolve().parent
# Files of Pallas interpret-mode tests outside tests/kernels_pallas/.
_KERNEL_FILES = {_TESTS / "bench" / "test_gpu.py"}


def _code_names(code):
  """Global and attribute names a code object (and the code nested in it) refers to."""
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= _code_names(const)
  return names


def _reached_globals(item):
  """The module globals a test reaches: from its function, the functions of its own module
  those call (transitively), and the fixtures it requests that are defined in tests/."""
  module = getattr(item, "module", None)
  if module is None:
    return []
  todo = [item.function]
  fixture_defs = getattr(item, "_fixtureinfo", None)
  for name in getattr(item, "fixturenames", ()):
    for fixture_def in (fixture_defs.name2fixturedefs.get(name, ()) if fixture_defs else ()):
      func = getattr(fixture_def, "func", None)
      if func is not None and _TESTS in pathlib.Path(func.__code__.co_filename).parents:
        todo.append(func)
  seen, reached = set(), []
  while todo:
    func = todo.pop()
    func = getattr(func, "__wrapped__", func)
    code = getattr(func, "__code__", None)
    if code is None or code in seen:
      continue
    seen.add(code)
    namespace = getattr(func, "__globals__", vars(module))
    for name in _code_names(code):
      value = namespace.get(name)
      if value is None:
        continue
      reached.append(value)
      if isinstance(value, types.FunctionType) and value.__module__ == namespace.get("__name__"):
        todo.append(value)
  return reached


def _module_of(value):
  try:
    name = value.__name__ if isinstance(value, types.ModuleType) else value.__module__
  except Exception:  # pylint: disable=broad-except  (no such attribute, or a lazy object)
    return ""
  return name if isinstance(name, str) else ""


def _is_kernels(value):
  return _module_of(value).split(".")[0] == "kernels_pallas"


def _is_subprocess(value):
  if value is subprocess or _module_of(value) == "subprocess":
    return True
  try:  # tests.helpers' runners say so (they live outside the test's module)
    return getattr(value, "starts_subprocess", False) is True
  except Exception:  # pylint: disable=broad-except  (a lazy object's own getattr)
    return False


def _default_sample():
  """Node ids of the parametrized cases the default suite leaves to ``-m slow``
  (``tests/default_sample.txt``, chosen from measured durations by
  ``tests/default_sample.py``: every test function keeps a case by default)."""
  path = _TESTS / "default_sample.txt"
  if not path.exists():
    return frozenset()
  lines = (line.strip() for line in path.read_text().splitlines())
  return frozenset(line for line in lines if line and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
  del config
  sampled_out = _default_sample()
  for item in items:
    if item.nodeid in sampled_out:
      item.add_marker(pytest.mark.slow)
    path = pathlib.Path(str(item.path)).resolve()
    reached = _reached_globals(item) if isinstance(item, pytest.Function) else []
    if (_TESTS / "kernels_pallas" in path.parents or path in _KERNEL_FILES
        or any(_is_kernels(v) for v in reached)):
      item.add_marker(pytest.mark.kernels)
    if any(_is_subprocess(v) for v in reached):
      item.add_marker(pytest.mark.subprocess)


# Issue 37's guard: library code never relies on implicit rank promotion. Every test runs
# under jax.numpy_rank_promotion("raise") (the setting of JAX's own suite; the environment
# above gives it to the subprocesses); each directory was run whole under
# JAX_NUMPY_RANK_PROMOTION=raise first (its default selection) before it joined.
@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
  import jax  # (conftest imports jax lazily: the environment above is set first)
  with jax.numpy_rank_promotion("raise"):
    yield
