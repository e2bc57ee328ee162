"""Each notebook and its plain-text twin (jupytext percent format) hold the same cells, and the
committed .ipynb carries the outputs of a full-size run (figures included) for readers on the
repository. Only the sources are compared: outputs live in the .ipynb alone."""

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


MAX_NOTEBOOK_BYTES = 1_500_000  # PNG figures at modest dpi; no huge outputs


def _outputs(cell):
  return cell.get("outputs", [])


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_committed_notebook_has_the_outputs_of_a_full_size_run(twin):
  nb = nbformat.read(twin.with_suffix(".ipynb"), as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  counts = [c.execution_count for c in code]
  assert None not in counts and counts == sorted(counts), (
      f"{twin.stem}.ipynb: every code cell executed, in order (nbconvert --execute); got {counts}")
  text = "".join(o.get("text", "") for c in code for o in _outputs(c) if o.output_type == "stream")
  assert "sizes: full" in text, f"{twin.stem}.ipynb: outputs must come from a full-size run"
  errors = [o for c in code for o in _outputs(c) if o.output_type == "error"]
  assert not errors, f"{twin.stem}.ipynb: committed with an error output"
  for c in code:
    shows = c.source.count("plt.show()") + c.source.count("display(Image(")
    images = [o for o in _outputs(c) if "image/png" in o.get("data", {})]
    assert len(images) >= shows, (
        f"{twin.stem}.ipynb: a cell that shows {shows} figure(s) has {len(images)} PNG output(s)")
  assert any("plt.show()" in c.source or "display(Image(" in c.source for c in code), "it draws figures"


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_committed_notebook_is_reasonably_small(twin):
  size = twin.with_suffix(".ipynb").stat().st_size
  assert size < MAX_NOTEBOOK_BYTES, f"{twin.stem}.ipynb is {size} bytes"
