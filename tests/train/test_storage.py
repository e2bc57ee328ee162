"""A ``gs://`` workdir: config, metrics, plots and the comparison go through etils.epath.

No network: fsspec's protocol ``gcs`` (what etils.epath uses for ``gs://`` without TensorFlow) is
pointed at an in-memory object store that, like GCS, cannot append to an object. Everything but
the checkpoints (orbax writes them with tensorstore's own GCS driver) takes the same code path as
on a real bucket; the checkpoints go to a local directory here.
"""

import importlib
import json

import fsspec
import numpy as np
import pytest
from etils import epath
from fsspec.implementations.memory import MemoryFileSystem

from tests import helpers
from train import checkpoint, config, metrics
from train import train as train_lib

BUCKET = "gs://jaxsoft-test-bucket"
# The module (the package attribute ``fsspec.registry`` is a read-only view of its dict).
_REGISTRY = importlib.import_module("fsspec.registry")._registry  # pylint: disable=protected-access


class FakeGCS(MemoryFileSystem):
  """An in-memory object store answering ``gs://`` paths; objects cannot be appended to."""

  protocol = ("gs", "gcs")
  root_marker = ""

  def __init__(self, *args, finalize_on_close=False, **kwargs):
    del finalize_on_close  # gcsfs's option, which etils.epath passes
    super().__init__(*args, **kwargs)

  @classmethod
  def _strip_protocol(cls, path):
    path = str(path)
    for prefix in ("gs://", "gcs://"):
      path = path.removeprefix(prefix)
    return super()._strip_protocol(path)

  def _open(self, path, mode="rb", **kwargs):
    if "a" in mode:
      raise NotImplementedError(f"an object store cannot append ({mode!r}): {path}")
    return super()._open(path, mode=mode, **kwargs)


@pytest.fixture
def bucket(monkeypatch):
  """``gs://`` served from memory for this test; yields a function reading an object."""
  monkeypatch.setattr(FakeGCS, "store", {})
  monkeypatch.setattr(FakeGCS, "pseudo_dirs", [""])
  monkeypatch.setitem(_REGISTRY, "gcs", FakeGCS)
  monkeypatch.setitem(_REGISTRY, "gs", FakeGCS)
  fsspec.AbstractFileSystem.clear_instance_cache()
  epath.backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  assert epath.Path(BUCKET)._backend is epath.backend.fsspec_backend  # pylint: disable=protected-access
  yield lambda name: FakeGCS.store[FakeGCS._strip_protocol(name)].getvalue()
  epath.backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  fsspec.AbstractFileSystem.clear_instance_cache()


@pytest.fixture
def local_checkpoints(monkeypatch, tmp_path):
  """Checkpoints of a gs:// workdir go to tmp_path/<run>/checkpoints (orbax needs real GCS)."""

  class LocalCheckpointer(checkpoint.Checkpointer):
    def __init__(self, workdir, *args):
      super().__init__(str(tmp_path / workdir.replace("://", "/")), *args)

  monkeypatch.setattr(checkpoint, "Checkpointer", LocalCheckpointer)
  return tmp_path


def test_workdir_object_store_holds_config_metrics_and_plots(bucket, local_checkpoints, capsys):
  workdir = f"{BUCKET}/run"
  argv = helpers.train_argv("--workdir", workdir, "--eval_every", 3)
  assert train_lib.main(argv) == 0
  assert "fresh start" in capsys.readouterr().out
  saved = json.loads(bucket(f"{workdir}/config.json"))
  assert saved["workdir"] == workdir and saved["steps"] == helpers.TRAIN_STEPS
  records = [json.loads(line) for line in bucket(f"{workdir}/metrics.jsonl").splitlines()]
  assert [r["step"] for r in records] == list(range(1, helpers.TRAIN_STEPS + 1))
  assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
  assert bucket(f"{workdir}/loss.png")[:8] == b"\x89PNG\r\n\x1a\n"
  assert not list(local_checkpoints.glob("**/metrics.jsonl"))  # nothing escaped to local disk

  # Resuming reads the config back from the store and appends to the history.
  assert train_lib.main(argv) == 0
  assert f"resumed from step {helpers.TRAIN_STEPS}" in capsys.readouterr().out
  history = config.read_history(workdir)
  assert [h["start_step"] for h in history] == [0, helpers.TRAIN_STEPS]
  # A changed schedule is refused from the store's config.json too, before any write.
  before = dict(FakeGCS.store)
  with pytest.raises(SystemExit) as info:
    train_lib.main(helpers.train_argv("--workdir", workdir, "--steps", 9))
  assert info.value.code == 2 and "--reschedule" in capsys.readouterr().err
  assert FakeGCS.store.keys() == before.keys()

  # The comparison table and plot land in the store as well.
  md, png = metrics.write_comparison(BUCKET, ["softmax"], [workdir])
  table = bucket(md).decode().splitlines()
  cells = [c.strip() for c in table[2].split("|")[1:-1]]
  np.testing.assert_allclose(float(cells[2]), records[-1]["eval_loss"], atol=1e-4)
  assert bucket(png)[:8] == b"\x89PNG\r\n\x1a\n"


def test_workdir_object_store_unwritable_is_named(bucket, monkeypatch):
  def refuse(self, path, mode="rb", **kwargs):
    if "w" in mode:
      raise PermissionError(f"403 Forbidden: {path}")
    return MemoryFileSystem._open(self, path, mode=mode, **kwargs)

  monkeypatch.setattr(FakeGCS, "_open", refuse)
  with pytest.raises(config.ConfigError, match=r"--workdir 'gs://.*/run' is not writable: 403"):
    config.prepare_workdir(f"{BUCKET}/run")
