"""``python -m jaxsoft``'s command line (jaxsoft/_cli.py), run in-process with argv lists."""

import contextlib
import io
import re

import pytest

import jaxsoft as js
from jaxsoft import _cli


def run(*argv):
  """(exit status, stdout, stderr) of the CLI on ``argv``; argparse's SystemExit included."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      status = _cli.main(list(argv), out=out, err=err)
    except SystemExit as exit_:
      status = exit_.code
  return status, out.getvalue(), err.getvalue()


def test_help_lists_every_subcommand():
  status, out, _ = run("--help")
  assert status == 0
  for command in ("list", "info", "gallery"):
    assert re.search(rf"^\s+{command}\s+\S", out, flags=re.M), (command, out)
  status, out, _ = run("list", "--help")
  assert status == 0
  for category in ("normalizers", "attention", "linear", "losses", "kernels", "pooling"):
    assert category in out


def test_list_normalizers_shows_every_registered_name_with_id_and_class():
  status, out, _ = run("list", "normalizers")
  assert status == 0
  rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
  assert sorted(rows) == js.normalizers.names()
  for name, fields in rows.items():
    spec = js.normalizers.get(name)
    assert fields[1:3] == [spec.catalogue_id, spec.kernel_class], fields


@pytest.mark.parametrize("category, package", [
    ("attention", js.attention), ("linear", js.linear), ("losses", js.losses),
    ("pooling", js.pooling)])
def test_list_shows_every_public_name(category, package):
  status, out, _ = run("list", category)
  assert status == 0
  listed = [line.split()[0] for line in out.splitlines()[2:]]
  assert listed == list(package.__all__)


def test_list_kernels_and_feature_ids_from_docstrings():
  import kernels_pallas  # noqa: PLC0415
  status, out, _ = run("list", "kernels")
  assert status == 0
  rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
  assert list(rows) == list(kernels_pallas.__all__)
  assert rows["decode_attention"][1] == "K05"  # "... split-K (K05)." in its first line
  _, out, _ = run("list", "attention")
  rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
  assert rows["topk_attention"][1] == "A11"


def test_info_sparsemax():
  status, out, _ = run("info", "sparsemax")
  assert status == 0
  assert "jaxsoft.normalizers.sparsemax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None)" in out
  assert "feature N16" in out and "kernel class T" in out
  assert "From Softmax to Sparsemax" in out  # the References section
  assert "xla, xla_chunked, pallas" in out
  assert "Hyperparameters:\n  (none)" in out


def test_info_shows_hyperparameter_ranges():
  status, out, _ = run("info", "entmax")
  assert status == 0
  alpha = js.normalizers.get("entmax").param("alpha")
  assert f"alpha = {alpha.default!r}  in (1, inf)" in out  # entmax needs alpha > 1


def test_info_class_x_runs_dense_xla_only():
  status, out, _ = run("info", "gumbel_softmax")
  assert status == 0
  assert "attention (dot_product_attention implementation=): xla\n" in out


def test_info_of_a_function_and_of_a_qualified_name():
  status, out, _ = run("info", "topk_attention")
  assert status == 0
  assert out.startswith("topk_attention (attention, feature A11)")
  assert "jaxsoft.attention.topk_attention(" in out
  status, out, _ = run("info", "kernels.attention")
  assert status == 0
  assert out.startswith("attention (Pallas kernel API")


def test_unknown_name_exits_2_with_close_matches():
  status, out, err = run("info", "sparsemx")
  assert status == 2 and out == ""
  assert "unknown name 'sparsemx'" in err and "did you mean: sparsemax" in err
  status, _, err = run("list", "normaliser")
  assert status == 2 and "invalid choice" in err


def test_gallery_is_the_default(monkeypatch):
  monkeypatch.setattr(_cli, "gallery", lambda: "GALLERY")
  assert run() == (0, "GALLERY\n", "")
  assert run("gallery") == (0, "GALLERY\n", "")
