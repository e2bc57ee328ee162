"""The shape of the house: no import cycle, no cross-package private import, no importlib.

Read from the source with ``ast`` (nothing is imported), over the library code: the
``jaxsoft`` package, ``kernels_pallas`` and ``train``. Every import counts, including the
ones inside functions, which is where cycles used to hide.

* A module imports no module that imports it back, directly or through others (edges go
  to the module a name comes from: ``from jaxsoft.attention import masks`` is an edge to
  ``jaxsoft.attention.masks``, ``from jaxsoft.attention import dot_product_attention`` one
  to ``jaxsoft.attention``'s ``__init__``).
* A name with a leading underscore (a module or an attribute) is private to the package
  that contains it: ``jaxsoft/losses/x.py`` may use ``jaxsoft.losses._common`` and
  ``jaxsoft._validation`` (``jaxsoft`` contains ``jaxsoft.losses``), but not
  ``jaxsoft.normalizers._softmax``; ``kernels_pallas`` and ``train`` use only names without
  a leading underscore from ``jaxsoft`` (the project-shared modules such as
  ``jaxsoft.normalizers.tile`` and ``jaxsoft.attention.call``).
* No ``importlib``: every dependency is a plain import that a reader and mypy can follow.
* Concept names: no module, test file or notebook is named for the project's planning (a
  tier, a phase, a round) or a catalogue id (N01, A12, L06, K05, E15...): the ids live in
  docstrings and ``docs/feature_ids.md``.

One check runs Python: each top-level package imports on its own (the graph does not see
the parent packages' ``__init__`` that an import runs first).
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxsoft", "kernels_pallas", "train")


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


SOURCES = _sources()


def _is_package(name: str) -> bool:
  return (ROOT / name.replace(".", "/") / "__init__.py").exists()


def _own_package(module: str) -> str:
  return module if _is_package(module) else module.rpartition(".")[0]


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """``(line, dotted name)`` of everything the file imports from the project (a module,
  or ``module.attribute`` for ``from module import attribute``)."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
  return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def _target_module(name: str) -> str:
  """The project module an imported dotted name lives in."""
  while name and name not in SOURCES:
    name = name.rpartition(".")[0]
  return name


def _graph() -> dict[str, set[str]]:
  graph: dict[str, set[str]] = {}
  for module, path in SOURCES.items():
    targets = {_target_module(name) for _, name in _imports(path)}
    graph[module] = {t for t in targets if t and t != module}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def _private_violation(importer: str, name: str) -> str | None:
  """The private part of ``name`` that ``importer`` may not see, or None."""
  package = _own_package(importer)
  parts = name.split(".")
  for i, part in enumerate(parts):
    if part.startswith("_") and not part.startswith("__"):
      container = _own_package(_target_module(".".join(parts[:i])))
      if not (package == container or package.startswith(container + ".")):
        return part
  return None


def test_the_graph_reads_the_project():
  graph = _graph()
  assert len(graph) > 100
  assert "kernels_pallas" in graph["jaxsoft.attention._api"]
  assert "jaxsoft.attention.call" in graph["kernels_pallas._api"]


def test_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_private_rule_examples():
  assert _private_violation("jaxsoft.losses._heads", "jaxsoft.losses._common.x") is None
  assert _private_violation("jaxsoft.losses._heads", "jaxsoft._validation.concrete") is None
  assert _private_violation("jaxsoft.losses._heads", "jaxsoft.normalizers._softmax.f") == "_softmax"
  assert _private_violation("kernels_pallas.engine", "jaxsoft.normalizers.tile.x") is None
  assert _private_violation("kernels_pallas.engine", "jaxsoft._validation.concrete") == "_validation"
  assert _private_violation("train.model", "jaxsoft.nn._linear.causal_conv") == "_linear"


def test_no_import_cycle():
  cycles = _cycles(_graph())
  assert not cycles, "import cycles among the project's modules:\n" + "\n".join(
      " <-> ".join(c) for c in cycles)


def test_no_cross_package_private_import():
  bad = []
  for module, path in SOURCES.items():
    for line, name in _imports(path):
      part = _private_violation(module, name)
      if part is not None:
        bad.append(f"{path.relative_to(ROOT)}:{line}: {name} ({part} is private to its package)")
  assert not bad, "cross-package private imports:\n" + "\n".join(bad)


def test_no_importlib():
  bad = []
  for path in SOURCES.values():
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      if any(n.split(".")[0] == "importlib" for n in names):
        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  assert not bad, "importlib used (import the module plainly): " + ", ".join(bad)


def test_kernels_pallas_imports_before_jaxsoft():
  """The module graph above cannot see package ``__init__`` edges: importing kernels_pallas
  first (kernels_pallas._api -> jaxsoft.attention.call -> jaxsoft -> jaxsoft.attention._api
  -> kernels_pallas.sharding) once met a partially initialised kernels_pallas._api."""
  done = subprocess.run([sys.executable, "-c", "import kernels_pallas, jaxsoft"], cwd=ROOT,
                        capture_output=True, text=True, check=False,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert done.returncode == 0, done.stderr[-2000:]


# A catalogue id (a letter N, A, L, K or E and two digits) or a planning word standing as a
# word of a file name (between the start or an underscore and an underscore, a dot or the end).
_PLANNING_NAME = re.compile(r"(?:^|_)(?:[nalke]\d{2}|tier\d*|phase\d*|round\d*)(?=_|\.|$)",
                            re.IGNORECASE)


def _planning_names(paths) -> list[str]:
  return [p for p in paths if _PLANNING_NAME.search(pathlib.PurePath(p).name)]


def test_planning_name_rule_examples():
  assert _planning_names(["tests/properties/test_e15_icl.py", "jaxsoft/attention/_tier3.py",
                          "tests/linear/test_phase2.py", "tests/linear/test_k06_flags.py",
                          "notebooks/a12.ipynb"]) == [
      "tests/properties/test_e15_icl.py", "jaxsoft/attention/_tier3.py",
      "tests/linear/test_phase2.py", "tests/linear/test_k06_flags.py", "notebooks/a12.ipynb"]
  assert not _planning_names(["jaxsoft/normalizers/_entmax.py", "tests/test_e2e.py",
                              "notebooks/12_linear_attention.ipynb", "jaxsoft/linear/_rala.py"])


def test_no_planning_names():
  """Every module, test file and notebook is named for what it holds (issue: the house)."""
  files = [str(p.relative_to(ROOT)) for top in (*PACKAGES, "tests", "notebooks", "bench")
           for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".ipynb")]
  bad = _planning_names(files)
  assert not bad, "files named for a tier, phase or catalogue id: " + ", ".join(sorted(bad))
