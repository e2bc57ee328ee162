"""How the test runs compile: XLA's older CPU code generator where the installed XLA has it.

XLA's CPU compiler emits fused loops with its MLIR "fusion emitters" by default; its older
elemental emitters (the other code generator it ships, selected by
``--xla_cpu_use_fusion_emitters=false``) compile this suite's small programs in about half
the time. Measured with JAX 0.10.2, one process: tests/normalizers/test_ssmax.py 42 -> 25 s,
tests/kernels_pallas/test_engine.py 46 -> 23 s, tests/attention/test_chunked.py 57 -> 36 s,
with the same results (XLA's HLO passes, which decide what is computed, are the same).
Newer XLA removed the flag and aborts on an unknown one, so a probe (one child process, in
the first pytest process only; xdist workers, notebook kernels and the children of tests
inherit the outcome through the environment) decides. ``JAXSOFT_TEST_XLA_DEFAULTS=1`` keeps
XLA's defaults (the newest-JAX subset of .ci/run has them anyway: its XLA lacks the flag).
"""

import os
import subprocess
import sys

FAST_COMPILE_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"


def xla_accepts(flag: str) -> bool:
  """Whether a fresh Python starts JAX's CPU backend with ``flag`` added to ``XLA_FLAGS``."""
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip())
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, timeout=300, check=False)
  return probe.returncode == 0


def apply() -> None:
  """Adds ``FAST_COMPILE_XLA_FLAG`` to ``XLA_FLAGS`` when the installed XLA accepts it
  (before JAX starts its backend; once per run)."""
  if (os.environ.get("JAXSOFT_TEST_XLA_DEFAULTS", "0") == "1"
      or "JAXSOFT_TEST_XLA_PROBED" in os.environ):
    return
  os.environ["JAXSOFT_TEST_XLA_PROBED"] = "1"
  if xla_accepts(FAST_COMPILE_XLA_FLAG):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAG}".strip()
