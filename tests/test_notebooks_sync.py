"""Each notebook and its plain-text twin (jupytext percent format) hold the same cells."""

import pathlib

import jupytext
import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
TWINS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def _cells(nb):
  return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_at_least_eight_notebooks():
  assert len(TWINS) >= 8, [p.name for p in TWINS]


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_ipynb_matches_its_py_twin(twin):
  ipynb = twin.with_suffix(".ipynb")
  assert ipynb.exists(), f"{ipynb.name} is missing: run `jupytext --sync {twin}`"
  from_py = jupytext.read(twin)
  from_ipynb = nbformat.read(ipynb, as_version=4)
  assert _cells(from_py) == _cells(from_ipynb), (
      f"{ipynb.name} and {twin.name} differ: run `jupytext --sync {twin}`")


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_notebook_opens_in_colab(twin):
  nb = jupytext.read(twin)
  first = nb.cells[0]
  assert first.cell_type == "markdown" and "colab.research.google.com" in first.source
  assert f"notebooks/{twin.stem}.ipynb" in first.source, "the badge links this notebook"
  install = next(c for c in nb.cells if c.cell_type == "code")
  assert "pip" in install.source and "install" in install.source, "first code cell installs jaxsoft"
