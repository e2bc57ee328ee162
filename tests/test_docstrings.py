"""Every public function and class carries a docstring in optax's shape with a runnable example.

Public means: named in the ``__all__`` (or, without one, any name without a leading
underscore that is not a module) of a user-facing package (``jaxsoft.normalizers``,
``attention``, ``linear``, ``losses``, ``nn``, ``pooling``, ``jaxsoft.testing`` and
``kernels_pallas``). Each needs a first line that says what it is, and an ``Examples:``
section with at least one ``>>>`` line, which ``tests/test_doctests.py`` runs. Constants
(tuples, dicts, numbers) need neither.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

PACKAGES = ("jaxsoft.normalizers", "jaxsoft.attention", "jaxsoft.linear", "jaxsoft.losses",
            "jaxsoft.nn", "jaxsoft.pooling", "jaxsoft.testing", "jaxsoft.optim", "kernels_pallas")


def _public():
  for package in PACKAGES:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None) or [
        n for n in dir(module) if not n.startswith("_")
        and not inspect.ismodule(getattr(module, n))]
    for name in names:
      obj = getattr(module, name)
      if inspect.isfunction(obj) or inspect.isclass(obj) or hasattr(obj, "__wrapped__"):
        yield f"{package}.{name}", obj


PUBLIC = dict(_public())


def test_there_are_public_names():
  assert len(PUBLIC) > 200


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_name_has_a_runnable_example(name):
  doc = inspect.getdoc(PUBLIC[name]) or ""
  first = doc.strip().splitlines()[0] if doc.strip() else ""
  assert first, f"{name} has no docstring"
  assert "Examples:" in doc and ">>>" in doc.split("Examples:", 1)[1], (
      f"{name}: the docstring needs an `Examples:` section with a `>>>` example")
