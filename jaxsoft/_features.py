"""The README's feature table, generated from the normalizer registry.

``python -m jaxsoft._features`` prints the table; ``python -m jaxsoft._features --write
README.md`` replaces the text between the lines ``<!-- features:start -->`` and
``<!-- features:end -->`` of that file. tests/test_readme_features.py checks that the
README holds exactly what :func:`feature_table` generates, so the table cannot drift from
the code.

Columns: feature id and kernel class (E/S/P/T/R/X; both explained in docs/feature_ids.md),
registry name, the implementations a user can call (normalizer: the dense function;
attention: "xla" always, "xla_chunked" and "pallas" for a spec with a tile, threshold or row-statistics rule) and the status
("tested": every registered spec runs the generated suite of
tests/normalizers/test_registry.py).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jaxsoft import normalizers

__all__ = ["START", "END", "feature_table", "replace_features", "write_features"]

START = "<!-- features:start -->"
END = "<!-- features:end -->"


def _implementations(spec) -> tuple[str, str]:
  attention = ["xla"]
  if spec.tile is not None or spec.threshold is not None or spec.row_stats is not None:
    # E/S/P through the tile rule, T through the threshold kernels, R through the
    # statistics pass and the tile rule of its second pass
    attention += ["xla_chunked", "pallas"]
  return "dense", ", ".join(attention)


def feature_table() -> str:
  """A markdown table of every registered normalizer, sorted by catalogue id then name."""
  specs = sorted(normalizers.REGISTRY.values(), key=lambda s: (s.catalogue_id, s.name))
  lines = [
      "| id | name | class | normalizer | attention | status |",
      "|---|---|---|---|---|---|",
  ]
  for spec in specs:
    dense, attention = _implementations(spec)
    lines.append(f"| {spec.catalogue_id} | `{spec.name}` | {spec.kernel_class} | {dense} | "
                 f"{attention} | tested |")
  return "\n".join(lines)


def _marker_lines(lines: list[str], path) -> tuple[int, int]:
  starts = [i for i, line in enumerate(lines) if line.strip() == START]
  ends = [i for i, line in enumerate(lines) if line.strip() == END]
  if len(starts) != 1 or len(ends) != 1 or starts[0] > ends[0]:
    raise ValueError(f"{path}: expected one line {START!r} followed by one line {END!r}, found "
                     f"{len(starts)} start and {len(ends)} end marker(s)")
  return starts[0], ends[0]


def replace_features(text: str, table: str, path="text") -> str:
  """``text`` with the lines between the feature markers replaced by ``table``.

  The marker lines themselves and everything outside them are kept byte for byte.
  Raises ValueError (naming ``path``) unless there is exactly one start marker line
  before exactly one end marker line.
  """
  lines = text.splitlines(keepends=True)
  start, end = _marker_lines(lines, path)
  body = table if table.endswith("\n") else table + "\n"
  return "".join(lines[:start + 1]) + body + "".join(lines[end:])


def features_in(text: str, path="text") -> str:
  """The text between the feature markers (without the marker lines)."""
  lines = text.splitlines(keepends=True)
  start, end = _marker_lines(lines, path)
  return "".join(lines[start + 1:end])


def write_features(path, table: str | None = None) -> bool:
  """Rewrites the feature table in the file at ``path``; returns whether it changed."""
  path = pathlib.Path(path)
  text = path.read_text(encoding="utf-8")
  new = replace_features(text, feature_table() if table is None else table, path)
  if new != text:
    path.write_text(new, encoding="utf-8")
  return new != text


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxsoft._features", description=__doc__.split(
      "\n")[0])
  parser.add_argument("--write", metavar="README", help="replace the table between the "
                      f"{START} and {END} lines of this file")
  args = parser.parse_args(argv)
  if args.write:
    changed = write_features(args.write)
    print(f"{args.write}: feature table {'updated' if changed else 'already up to date'}")
  else:
    print(feature_table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
