"""A pytest plugin that appends each test phase's duration to a file as it finishes.

``PYTEST_ADDOPTS="-p tests.timing_plugin" TIMING_FILE=durations.tsv make test-unit`` writes
one line per phase: node id, phase, seconds, outcome, the Unix time. Under xdist only the
controller writes (each report once). ``tests/default_sample.py`` reads the file.
"""

import os
import time

_out = None


def pytest_runtest_logreport(report):
  global _out
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return
  if _out is None:
    _out = open(os.environ.get("TIMING_FILE", "durations.tsv"), "a", buffering=1)  # noqa: SIM115
  _out.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t{report.outcome}\t"
             f"{time.time():.0f}\n")
