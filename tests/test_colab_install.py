"""Every notebook's Colab install cell installs the repository where it is published.

The published URL is written once, as the `url` of setup.cfg: each install cell must use
that URL and no other, the Colab badge must open the notebook from the same repository,
and running the cell (with pip and git replaced by a recorder) must install from that URL,
or from `JAXSOFT_REPO` when a reader points it at a fork, without upgrading Colab's JAX.
"""

import configparser
import pathlib
import re
import subprocess
import sys
import types

import jupytext
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TWINS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
URL_RE = re.compile(r"https?://[^\s\"'()\]]+")


def published_url():
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  url = cfg["metadata"]["url"].strip()
  assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), url
  return url


def install_cell(twin):
  nb = jupytext.read(twin)
  return next(c for c in nb.cells if c.cell_type == "code").source


def run_install_cell(source, monkeypatch, env=None):
  """Runs the cell as on a fresh Colab runtime (jaxsoft not importable) and records commands."""
  calls = []

  def fake_run(cmd, *args, **kwargs):
    calls.append(list(cmd))
    return subprocess.CompletedProcess(cmd, 0)

  monkeypatch.setattr(subprocess, "run", fake_run)
  monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
  monkeypatch.setattr("os.chdir", lambda path: calls.append(["chdir", path]))
  monkeypatch.delenv("JAXSOFT_REPO", raising=False)
  for k, v in (env or {}).items():
    monkeypatch.setenv(k, v)
  exec(compile(source, "install-cell", "exec"), {"__name__": "__main__"})  # noqa: S102
  return calls


def test_setup_cfg_declares_the_published_url():
  assert published_url().startswith("https://github.com/")


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_install_cell_names_only_the_setup_cfg_url(twin):
  urls = URL_RE.findall(install_cell(twin))
  assert urls and set(urls) == {published_url()}, (
      f"{twin.name}: the install cell must name setup.cfg's url {published_url()} and nothing else; found {urls}")


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_colab_badge_opens_the_published_repository(twin):
  badge = jupytext.read(twin).cells[0].source
  owner_name = published_url().removeprefix("https://github.com/")
  expected = f"https://colab.research.google.com/github/{owner_name}/blob/main/notebooks/{twin.stem}.ipynb"
  assert expected in badge, f"{twin.name}: the badge must link {expected}"


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_install_cell_installs_the_published_url_without_upgrading_jax(twin, monkeypatch):
  calls = run_install_cell(install_cell(twin), monkeypatch)
  pip = [c for c in calls if c[:3] == [sys.executable, "-m", "pip"]]
  assert len(pip) == 1 and pip[0][3] == "install", calls
  assert not {"-U", "--upgrade", "--force-reinstall"} & set(pip[0]), (
      f"{twin.name}: pip must keep Colab's preinstalled JAX (no --upgrade): {pip[0]}")
  assert not any(a.startswith("jax") for a in pip[0][4:]), f"{twin.name}: jax is not pinned here: {pip[0]}"
  fetched = [a for c in calls for a in c if published_url() in a]
  assert fetched, f"{twin.name}: nothing was installed from {published_url()}: {calls}"


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_install_cell_follows_jaxsoft_repo_for_a_fork(twin, monkeypatch):
  fork = "https://github.com/someone/jaxsoft-fork"
  calls = run_install_cell(install_cell(twin), monkeypatch, env={"JAXSOFT_REPO": fork})
  args = [a for c in calls for a in c]
  assert any(fork in a for a in args), f"{twin.name}: JAXSOFT_REPO was ignored: {calls}"
  assert not any(published_url() in a for a in args), f"{twin.name}: still installs the default: {calls}"


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_install_cell_does_nothing_in_a_checkout(twin, monkeypatch):
  calls = []
  monkeypatch.setattr(subprocess, "run", lambda cmd, *a, **k: calls.append(cmd))
  monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: types.SimpleNamespace(name=name))
  exec(compile(install_cell(twin), "install-cell", "exec"), {"__name__": "__main__"})  # noqa: S102
  assert calls == [], f"{twin.name}: the cell must not install when jaxsoft is importable"
