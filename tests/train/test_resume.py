"""Exact resume: preempted (SIGTERM) and killed-mid-save runs continue step for step."""

import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import helpers
from train import checkpoint, config, sharding
from train import train as train_lib

STEPS = helpers.TRAIN_STEPS
TINY = helpers.train_argv("--save_every", 2)
_losses = helpers.train_records


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The reference run (checkpoints every 2 steps): its losses, grad norms and workdir."""
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  assert train_lib.main(TINY + ["--workdir", workdir]) == 0
  steps, losses, norms = _losses(workdir)
  assert steps == list(range(1, STEPS + 1))
  return losses, norms, workdir


def test_sigterm_then_resume_gives_the_same_losses_step_for_step(uninterrupted, tmp_path):
  workdir = str(tmp_path / "run")
  # preempt_at_step sends a real SIGTERM to this process after step 3; the handler makes the
  # loop save (off the save_every=2 schedule) and return.
  assert train_lib.main(TINY + ["--workdir", workdir, "--preempt_at_step", "3"]) == 0
  assert checkpoint.Checkpointer(workdir, 3, 2).latest_step() == 3
  assert _losses(workdir)[0] == [1, 2, 3]
  assert train_lib.main(TINY + ["--workdir", workdir]) == 0
  steps, losses, norms = _losses(workdir)
  assert steps == list(range(1, STEPS + 1))
  # Bit for bit: the same data position, RNG, optimizer state and parameters.
  np.testing.assert_array_equal(losses, uninterrupted[0])
  np.testing.assert_array_equal(norms, uninterrupted[1])


def test_kill_during_async_save_leaves_a_resumable_workdir(uninterrupted, tmp_path):
  workdir = str(tmp_path / "killed")
  cmd = [sys.executable, str(helpers.ROOT / "train" / "train.py"), *TINY, "--workdir", workdir,
         "--save_every", "1", "--kill_after_save_at_step", "4"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd, cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
  # Step 4's save was in flight: at most steps up to 4 are complete, and a restart must cope with
  # whatever the kill left (a temporary directory or a finished step).
  latest = checkpoint.Checkpointer(workdir, 3, 1).latest_step()
  assert latest is not None and 1 <= latest <= 4
  assert train_lib.main(TINY + ["--workdir", workdir, "--save_every", "1"]) == 0
  steps, losses, norms = _losses(workdir)
  assert steps == list(range(1, STEPS + 1))
  np.testing.assert_array_equal(losses, uninterrupted[0])
  np.testing.assert_array_equal(norms, uninterrupted[1])


def test_init_from_takes_only_the_parameters(uninterrupted, tmp_path):
  source = uninterrupted[2]  # its latest checkpoint is the last step
  target = str(tmp_path / "target")
  assert train_lib.main(TINY + ["--workdir", target, "--init_from", source]) == 0
  # Oracle: the loss of the source's last parameters on batch 0 (the warm-started run starts
  # over at data position 0 with a fresh optimizer).
  cfg = config.from_argv(TINY + ["--workdir", target])[0]
  mesh = sharding.make_mesh(cfg)
  dataset, graphdef, _, _, abstract_state, _, _ = train_lib.build(cfg, mesh)
  params, step = checkpoint.restore_params(source, abstract_state["params"])
  assert step == STEPS
  batch = sharding.global_batch(dataset, 0, cfg, sharding.batch_sharding(mesh))
  loss_sum, weight = train_lib.loss_sums(graphdef, params, jax.tree.map(lambda x: x[0], batch))
  first = _losses(target)[1][0]
  np.testing.assert_allclose(first, loss_sum / weight, rtol=1e-5)
  fresh_first = _losses(source)[1][0]
  assert abs(first - fresh_first) > 1e-4  # the parameters really came from the checkpoint


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
  workdir = str(tmp_path / "nan")
  # Step 1 has lr = 0 (warm-up); step 2 applies lr = 1e30, so step 3's loss is not finite.
  code = train_lib.main(TINY + ["--workdir", workdir, "--save_every", "1", "--clip_norm", "0",
                                "--learning_rate", "1e30", "--min_lr_ratio", "1"])
  assert code == train_lib.EXIT_NONFINITE
  out = capsys.readouterr().out
  assert "non-finite loss/grad_norm at step 3" in out and "last good checkpoint is step 2" in out
  assert checkpoint.Checkpointer(workdir, 3, 1).latest_step() == 2
  steps, losses, _ = _losses(workdir)
  assert steps == [1, 2] and np.all(np.isfinite(losses))
