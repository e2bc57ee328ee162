"""README.md's feature table is exactly what the registry generates (jaxsoft._features).

Regenerate it with ``python -m jaxsoft._features --write README.md``.
"""

import pathlib

import pytest

from jaxsoft import _features, normalizers

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_holds_the_generated_table():
  assert README.exists(), "README.md is missing"
  text = README.read_text(encoding="utf-8")
  assert _features.features_in(text, README).strip() == _features.feature_table(), (
      "README.md's feature table is stale: run `python -m jaxsoft._features --write README.md`")


def test_table_rows_follow_the_registry():
  lines = _features.feature_table().splitlines()
  assert lines[0].startswith("| id | name | class |")
  rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
  assert len(rows) == len(normalizers.REGISTRY)
  keys = [(r[0], r[1].strip("`")) for r in rows]
  assert keys == sorted(keys)  # catalogue id, then name
  for cid, name, cls, dense, attention, status in rows:
    spec = normalizers.get(name.strip("`"))
    assert (cid, cls, dense, status) == (spec.catalogue_id, spec.kernel_class, "dense", "tested")
    impls = attention.split(", ")
    assert impls[0] == "xla"
    blockwise = (spec.tile is not None or spec.threshold is not None
                 or spec.row_stats is not None)
    assert ("xla_chunked" in impls) == blockwise
    assert ("pallas" in impls) == blockwise


def test_pallas_column_lists_the_engine():
  table = _features.feature_table()
  softmax_row = next(line for line in table.splitlines() if "`softmax`" in line)
  assert "xla, xla_chunked, pallas" in softmax_row


def test_replace_features_in_a_file(tmp_path):
  path = tmp_path / "README.md"
  head = "# title\n\nintro\n"
  tail = "\n## more\ntext after\n"
  path.write_text(f"{head}{_features.START}\nold table\nold row\n{_features.END}{tail}")
  assert _features.write_features(path, "| a |\n|---|")
  assert path.read_text() == f"{head}{_features.START}\n| a |\n|---|\n{_features.END}{tail}"
  assert not _features.write_features(path, "| a |\n|---|")  # idempotent
  assert _features.write_features(path)  # the generated table
  assert _features.features_in(path.read_text()).strip() == _features.feature_table()


@pytest.mark.parametrize("text", [
    "no markers\n",
    f"{_features.START}\nonly a start\n",
    f"{_features.END}\n{_features.START}\nwrong order\n",
    f"{_features.START}\n{_features.START}\n{_features.END}\n",
])
def test_replace_features_rejects_bad_markers(text):
  with pytest.raises(ValueError, match="marker"):
    _features.replace_features(text, "| a |")


def test_main_prints_and_writes(tmp_path, capsys):
  assert _features.main([]) == 0
  assert capsys.readouterr().out.strip() == _features.feature_table()
  path = tmp_path / "README.md"
  path.write_text(f"{_features.START}\n{_features.END}\n")
  assert _features.main(["--write", str(path)]) == 0
  assert "updated" in capsys.readouterr().out
  assert _features.features_in(path.read_text()).strip() == _features.feature_table()
