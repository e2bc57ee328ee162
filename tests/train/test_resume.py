"""Exact resume: preempted (SIGTERM), killed-mid-save and damaged-checkpoint runs continue step
for step; the schedule on resume, the config history and the held-out loss."""

import dataclasses
import functools
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests import helpers
from train import checkpoint, config, data, metrics, sharding
from train import train as train_lib

STEPS = helpers.TRAIN_STEPS
PREEMPTED = train_lib.EXIT_PREEMPTED  # stopped by SIGTERM: saved, not finished, not 0
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
  # loop save (off the save_every=2 schedule) and return a non-zero status.
  assert train_lib.main(TINY + ["--workdir", workdir, "--preempt_at_step", "3"]) == PREEMPTED
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
  loss_sums = jax.jit(functools.partial(train_lib.loss_sums, graphdef))  # (not op by op)
  loss_sum, weight = loss_sums(params, jax.tree.map(lambda x: x[0], batch))
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


@pytest.mark.slow  # (a process of its own: ~30 s; the preempt_at_step tests check the status)
def test_sigterm_from_outside_saves_and_exits_nonzero(tmp_path):
  """A scheduler's SIGTERM (another process, mid-run): the run saves its step and exits with
  EXIT_PREEMPTED, never 0, so the scheduler does not take it for finished."""
  workdir = tmp_path / "term"
  cmd = [sys.executable, str(helpers.ROOT / "train" / "train.py"),
         *helpers.train_argv("--steps", 100000, "--save_every", 100000, "--eval_every", 0),
         "--workdir", str(workdir)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(cmd, cwd=helpers.ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 240
    # The handler is installed before the first step: wait until a step is recorded.
    while not (workdir / "metrics.jsonl").exists() or not (workdir / "metrics.jsonl").read_text():
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=240)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == PREEMPTED, out
  steps = _losses(workdir)[0]
  assert steps == list(range(1, len(steps) + 1)) and steps[-1] < 100000
  assert checkpoint.Checkpointer(str(workdir), 3, 100000).latest_step() == steps[-1], out
  assert f"stopped at step {steps[-1]} (SIGTERM)" in out


def test_init_from_another_architecture_fails_before_anything_is_written(uninterrupted, tmp_path,
                                                                        capsys):
  target = tmp_path / "wider"
  with pytest.raises(SystemExit) as info:  # the source has d_model 16
    train_lib.main(TINY + ["--workdir", str(target), "--init_from", uninterrupted[2],
                           "--d_model", "32"])
  assert info.value.code == train_lib.EXIT_USAGE
  err = capsys.readouterr().err
  assert "train.py: error: --init_from: parameter blocks/0/attn/k/kernel has shape (16, 16) in " \
         "the checkpoint" in err and "but (32, 32) in this model" in err, err
  assert not target.exists()
  with pytest.raises(SystemExit):  # a parameter the checkpoint lacks (a learned alpha) is named
    train_lib.main(TINY + ["--workdir", str(target), "--init_from", uninterrupted[2],
                           "--normalizer", "entmax", "--learned", "alpha"])
  assert "parameter blocks/0/attn/learned/alpha (2,) of this model is not in the checkpoint" \
      in capsys.readouterr().err
  assert not target.exists()


def test_check_numerics_names_an_injected_nan_hyperparameter_and_saves_nothing(tmp_path, capsys):
  """A learned alpha made NaN (as a diverging optimizer would) in the parameters a run starts
  from: --check_numerics stops step 1 with the hyperparameter, layer and normalizer named, and
  the run writes no checkpoint and no step."""
  argv = TINY + ["--normalizer", "entmax", "--learned", "alpha"]
  source, target = tmp_path / "source", tmp_path / "target"
  cfg = config.from_argv(argv + ["--workdir", str(source)])[0]
  _, _, _, init_fn, _, _, _ = train_lib.build(cfg, sharding.make_mesh(cfg))
  state = init_fn()
  poison = lambda path, x: x.at[1].set(np.nan) if "alpha" in jax.tree_util.keystr(path) else x  # noqa: E731
  state = dict(state, params=jax.tree_util.tree_map_with_path(poison, state["params"]))
  ckpt = checkpoint.Checkpointer(str(source), 1, 1)
  ckpt.save(1, state, 0, force=True)
  ckpt.close()
  code = train_lib.main(argv + ["--workdir", str(target), "--init_from", str(source),
                                "--check_numerics"])
  assert code == train_lib.EXIT_NONFINITE
  out = capsys.readouterr().out
  assert ("error: --check_numerics: entmax: `alpha` must not be NaN (learned, layer 0: params "
          "blocks/0/attn/learned) (`check` failed) at step 1; stopped; no checkpoint yet") in out, out
  assert checkpoint.Checkpointer(str(target), 3, 1).latest_step() is None
  assert metrics.read_jsonl(target / "metrics.jsonl") == []


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: resume from the newest one that restores, keep the damaged one aside.


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
  """A run stopped (SIGTERM) after step 4: checkpoints 1 (orbax saves the first), 2 and 4."""
  workdir = str(tmp_path_factory.mktemp("preempted") / "run")
  assert train_lib.main(TINY + ["--workdir", workdir, "--preempt_at_step", "4"]) == PREEMPTED
  steps = sorted(int(p.name) for p in (pathlib.Path(workdir) / "checkpoints").iterdir())
  assert steps == [1, 2, 4]
  return workdir


def _empty_step(step_dir):
  shutil.rmtree(step_dir)
  step_dir.mkdir()


def _missing_item(step_dir):
  shutil.rmtree(step_dir / "state")


def _garbage_data(step_dir):
  """Overwrites the array data files (tensorstore's d/ chunks), leaving the metadata intact."""
  rng = np.random.default_rng(0)
  data_files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert data_files
  for path in data_files:
    path.write_bytes(rng.bytes(max(64, path.stat().st_size)))


DAMAGE = {"empty_step_dir": _empty_step, "missing_item": _missing_item,
          "garbage_data_files": _garbage_data}


def _damaged_copy(preempted, tmp_path, kind):
  workdir = tmp_path / "run"
  shutil.copytree(preempted, workdir)
  step4 = workdir / "checkpoints" / "4"
  DAMAGE[kind](step4)
  return workdir, sorted(str(p.relative_to(step4)) for p in step4.rglob("*"))


# A failed tensorstore read can leave orbax's asyncio loop to be collected after it closed; that
# report comes from orbax's background thread, not from the run.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_skips_a_damaged_newest_checkpoint(uninterrupted, preempted, tmp_path, capsys,
                                                  kind):
  workdir, damaged_files = _damaged_copy(preempted, tmp_path, kind)
  assert train_lib.main(TINY + ["--workdir", str(workdir)]) == 0
  out = capsys.readouterr().out
  # Named, with the reason, and the run resumed from the newest step that restores.
  assert "skipped checkpoint step 4: it does not restore (" in out, out
  assert "resumed from step 2" in out, out
  # The damaged step is kept (moved, not deleted), exactly as it was.
  kept = workdir / checkpoint.DAMAGED / "4"
  assert str(kept) in out and kept.is_dir()
  assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*")) == damaged_files
  # Nothing lost: the run continues from step 2 exactly as the uninterrupted one.
  steps, losses, norms = _losses(str(workdir))
  assert steps == list(range(1, STEPS + 1))
  np.testing.assert_array_equal(losses, uninterrupted[0])
  np.testing.assert_array_equal(norms, uninterrupted[1])
  assert checkpoint.Checkpointer(str(workdir), 3, 2).latest_step() == STEPS


def test_max_to_keep_cannot_collect_the_good_checkpoint_for_a_damaged_one(uninterrupted, preempted,
                                                                          tmp_path):
  # Steps 1, 2 (good) and 4 (damaged). Resumed from 2 with max_to_keep=1 and a save every step, then
  # stopped at step 3: had step 4 stayed in checkpoints/, the garbage collection would keep it
  # (the newest) and delete steps 1-3, the only ones that restore.
  workdir, _ = _damaged_copy(preempted, tmp_path, "empty_step_dir")
  argv = TINY + ["--workdir", str(workdir), "--max_to_keep", "1", "--save_every", "1"]
  assert train_lib.main(argv + ["--preempt_at_step", "3"]) == PREEMPTED
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3"]
  assert (workdir / checkpoint.DAMAGED / "4").is_dir()
  assert train_lib.main(argv) == 0
  steps, losses, _ = _losses(str(workdir))
  assert steps == list(range(1, STEPS + 1))
  np.testing.assert_array_equal(losses, uninterrupted[0])


# ---------------------------------------------------------------------------------------------
# The learning-rate schedule on resume, the config history, the held-out loss.


def test_reschedule_recomputes_the_schedule_and_keeps_the_config_history(preempted, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(preempted, workdir)
  longer = STEPS + 2
  assert train_lib.main(TINY + ["--workdir", str(workdir), "--steps", str(longer),
                                "--reschedule", "true"]) == 0
  records = metrics.read_jsonl(workdir / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, longer + 1))
  cfg_old = config.from_argv(TINY + ["--workdir", str(workdir)])[0]
  cfg_new = dataclasses.replace(cfg_old, steps=longer)
  old, new = train_lib.make_schedule(cfg_old), train_lib.make_schedule(cfg_new)
  for r in records:  # steps 1-4 ran on the old schedule, 5-8 on the recomputed one
    schedule = old if r["step"] <= 4 else new
    np.testing.assert_allclose(r["learning_rate"], schedule(r["step"] - 1), rtol=1e-6)
  # config.json is the config now in force; the history keeps both starts.
  assert config.load(str(workdir / "config.json"))["steps"] == longer
  history = config.read_history(str(workdir))
  assert [(h["start_step"], h["config"]["steps"], h["config"]["reschedule"]) for h in history] == [
      (0, STEPS, False), (4, longer, True)]


def test_eval_loss_is_the_held_out_loss_of_the_final_parameters(uninterrupted):
  workdir = uninterrupted[2]
  records = metrics.read_jsonl(pathlib.Path(workdir) / "metrics.jsonl")
  evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  assert [s for s, _ in evals] == [STEPS]  # eval_every (100) > steps: at the end only
  # Oracle: the final checkpoint's parameters on the held-out batches, computed directly.
  cfg = config.from_argv(TINY + ["--workdir", workdir])[0]
  mesh = sharding.make_mesh(cfg)
  dataset, graphdef, _, _, abstract_state, _, _ = train_lib.build(cfg, mesh)
  params, step = checkpoint.restore_params(workdir, abstract_state["params"])
  assert step == STEPS
  # One compilation for every batch (the eager model would dispatch op by op).
  loss_sums = jax.jit(functools.partial(train_lib.loss_sums, graphdef))
  total, weight = 0.0, 0.0
  for i in range(cfg.eval_batches):
    batch = dataset.held_out().batch(i)
    loss_sum, w = loss_sums(params, batch)
    total, weight = total + float(loss_sum), weight + float(w)
  np.testing.assert_allclose(evals[0][1], total / weight, rtol=1e-5)
  train_loss = sum(float(loss_sums(params, dataset.batch(i))[0])
                   for i in range(cfg.eval_batches))
  assert abs(train_loss / weight - evals[0][1]) > 1e-4  # really other data


def test_held_out_text_never_overlaps_the_training_text():
  ds = data.make_dataset("text", 16, 8, seed=0)
  corpus = data.corpus_bytes()
  train_end = int(len(corpus) * 0.95)
  # Every held-out window lies in the last 5% of the corpus, whatever the seed.
  for seed in (0, 1):
    held = dataclasses.replace(ds, seed=seed).held_out()
    batch = held.batch(0)
    np.testing.assert_array_equal(batch["inputs"], ds.held_out().batch(0)["inputs"])
    tail = corpus[train_end:].tobytes()
    for row in batch["inputs"]:
      assert row.astype(np.uint8).tobytes() in tail
  assert not np.array_equal(ds.batch(0)["inputs"], ds.held_out().batch(0)["inputs"])
