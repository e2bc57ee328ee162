"""The wheel installs on its own and the README's usage example runs from it.

Builds a wheel from a copy of the source (so the checkout gets no ``build/`` or egg-info),
installs it with ``--no-deps --no-index`` into a fresh venv, and runs the README's "Using
it" block with that venv's interpreter from a directory outside the repository: jaxsoft
(and kernels_pallas) must come from the wheel, and ``py.typed`` must be installed. The
dependencies (jax, flax, ...) are the test interpreter's, made visible to the venv by a
``.pth`` line written after the install (the venv's base is the interpreter the test venv
was made from, which does not hold them). Nothing is downloaded.
"""

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import textwrap

import pytest

import jaxsoft
from tests.test_readme_example import _usage_block

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "jaxsoft", "kernels_pallas")

CHECK = textwrap.dedent("""
    import importlib.resources, json, pathlib, sys
    import jaxsoft, kernels_pallas
    print(json.dumps({
        "prefix": sys.prefix,
        "jaxsoft": jaxsoft.__file__,
        "kernels_pallas": kernels_pallas.__file__,
        "py_typed": importlib.resources.files("jaxsoft").joinpath("py.typed").is_file(),
        "version": jaxsoft.__version__,
    }))
""")


def _run(*args, cwd):
  # without PYTHONPATH: a checkout named there (a test run from a clone) would shadow the wheel
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False, env=env)
  assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
  return result.stdout


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
  """The interpreter of a fresh venv holding only the wheel (dependencies: a .pth line)."""
  tmp_path = tmp_path_factory.mktemp("wheel")
  source = tmp_path / "src"
  source.mkdir()
  for name in SOURCES:
    if (ROOT / name).is_dir():
      shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy2(ROOT / name, source / name)
  wheels = tmp_path / "wheels"
  _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
       "-w", str(wheels), str(source), cwd=tmp_path)
  (wheel,) = wheels.glob("jaxsoft-*.whl")

  venv = tmp_path / "venv"
  _run(sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv),
       cwd=tmp_path)
  python = venv / "bin" / "python"
  _run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
       "--no-index", str(wheel), cwd=tmp_path)
  # only now (pip must not see the test venv's editable jaxsoft as installed there): the
  # dependencies, after the venv's own site-packages on sys.path
  (purelib,) = json.loads(_run(str(python), "-c", "import json, sysconfig; print(json.dumps("
                                "[sysconfig.get_paths()['purelib']]))", cwd=tmp_path))
  pathlib.Path(purelib, "_test_dependencies.pth").write_text(
      "\n".join(site.getsitepackages()) + "\n")
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  return python, outside


def _check_report(stdout, python):
  report = json.loads(stdout.splitlines()[-1])
  prefix = pathlib.Path(report["prefix"]).resolve()
  assert prefix == python.parent.parent.resolve()
  for module in ("jaxsoft", "kernels_pallas"):
    assert prefix in pathlib.Path(report[module]).resolve().parents, report
  assert report["py_typed"], report
  assert report["version"] == jaxsoft.__version__


def test_wheel_installs_on_its_own(wheel_venv):
  python, outside = wheel_venv
  _check_report(_run(str(python), "-c", CHECK, cwd=outside), python)


@pytest.mark.slow  # the README's attention call (T = 512) takes about 20 s of CPU time
def test_readme_example_runs_from_the_wheel(wheel_venv):
  python, outside = wheel_venv
  script = outside / "readme_example.py"
  script.write_text(_usage_block() + CHECK)
  _check_report(_run(str(python), str(script), cwd=outside), python)
