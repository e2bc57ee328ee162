"""Choose the generated test cases the default suite leaves to ``-m slow``.

The default suite must stay within its time budget (30 minutes on 2 cores for unit tests,
notebooks and the newest-JAX subset) however many rows the catalogue gains, so parametrized
tests are sampled: every test function keeps its cheapest case in the default run, and the
most expensive of its other cases move to ``-m slow`` (which runs the full matrix) until the
measured saving reaches the target. Docstring examples: a module's examples that take
``DOCTEST_SLOW_SECONDS`` or more move to ``-m slow`` (``slow_doctests``). The chosen node ids are written to
``tests/default_sample.txt``; ``tests/conftest.py`` marks them ``slow``.

Usage (durations from ``tests/timing_plugin.py`` over a default run)::

  PYTEST_ADDOPTS="-p tests.timing_plugin" TIMING_FILE=/tmp/d.tsv make test-unit
  python tests/default_sample.py /tmp/d.tsv --save 1200

A case already in the file stays there; run with ``--reset`` to choose afresh.
"""

import argparse
import collections
import pathlib
import subprocess

HERE = pathlib.Path(__file__).resolve().parent
SAMPLE_FILE = HERE / "default_sample.txt"
# Docstring examples are not sampled like the other cases (one test function over every
# module: "keep the cheapest case" would drop nearly all of them). A module's examples stay
# in the default suite unless they take DOCTEST_SLOW_SECONDS or more (a handful of modules
# whose examples run whole attention layers eagerly): those run under -m slow.
EXEMPT = ("tests/test_doctests.py::",)
DOCTEST_SLOW_SECONDS = 3.0
# The entry point's examples run in every default run, whatever they cost.
DOCTEST_ALWAYS = ("tests/test_doctests.py::test_docstring_examples[jaxsoft.attention._api]",)


def slow_doctests(seconds: dict[str, float]) -> list[str]:
  """The doctest cases (one per module) measured at ``DOCTEST_SLOW_SECONDS`` or more."""
  return [n for n, s in seconds.items() if n.startswith(EXEMPT) and s >= DOCTEST_SLOW_SECONDS
          and n not in DOCTEST_ALWAYS]


def read_sample(path=SAMPLE_FILE):
  """The node ids in ``path`` (comments and blank lines skipped)."""
  if not path.exists():
    return set()
  lines = (line.strip() for line in path.read_text().splitlines())
  return {line for line in lines if line and not line.startswith("#")}


def test_seconds(tsv: pathlib.Path) -> dict[str, float]:
  """Seconds per unit-test node id (setup + call + teardown); records after the first
  non-``tests/`` one (the notebook and newest-JAX runs of ``.ci/run``) are ignored."""
  seconds: dict[str, float] = collections.defaultdict(float)
  for line in tsv.read_text().splitlines():
    nodeid, _, dur, *_ = line.split("\t")
    if not nodeid.startswith("tests/"):
      break
    seconds[nodeid] += float(dur)
  return dict(seconds)


def choose(seconds: dict[str, float], save: float, keep: set[str]) -> list[str]:
  """Parametrized cases to move to ``-m slow``: per function all but its cheapest case are
  candidates; the most expensive go first until ``save`` seconds are saved."""
  cases = collections.defaultdict(list)
  for nodeid, s in seconds.items():
    if "[" in nodeid and not nodeid.startswith(EXEMPT):
      cases[nodeid.split("[", 1)[0]].append((s, nodeid))
  candidates = []
  for group in cases.values():
    group.sort()
    candidates += group[1:]
  chosen, saved = [], sum(seconds.get(n, 0.0) for n in keep)
  for s, nodeid in sorted(candidates, reverse=True):
    if saved >= save:
      break
    if nodeid not in keep:
      chosen.append(nodeid)
      saved += s
  return chosen


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("durations", type=pathlib.Path)
  parser.add_argument("--save", type=float, required=True,
                      help="worker-seconds of default-run time to move to -m slow")
  parser.add_argument("--reset", action="store_true")
  args = parser.parse_args(argv)
  seconds = test_seconds(args.durations)
  keep = set() if args.reset else read_sample()
  chosen = sorted(keep | set(choose(seconds, args.save, keep)) | set(slow_doctests(seconds)))
  total = sum(seconds.values())
  moved = sum(seconds.get(n, 0.0) for n in chosen)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=HERE, check=False).stdout.strip()
  header = [
      "# Parametrized cases the default suite leaves to -m slow (tests/default_sample.py).",
      f"# Chosen from a default run at {commit}: {total:.0f} worker-seconds measured,",
      f"# {moved:.0f} of them in these {len(chosen)} cases. Every test function keeps a case.",
  ]
  SAMPLE_FILE.write_text("\n".join(header + chosen) + "\n")
  print(f"{len(chosen)} cases, {moved:.0f} of {total:.0f} worker-seconds -> {SAMPLE_FILE}")


if __name__ == "__main__":
  main()
