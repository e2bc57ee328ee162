"""Checkpoints with orbax-checkpoint: async saves, max_to_keep, auto-resume, --init_from.

A checkpoint holds the whole train state (params, optimizer state, step, RNG) and, as JSON, the
data position; restoring uses the *current* shardings, so a run saved on 8 devices resumes on 1 (or
the reverse). Orbax writes each step to a temporary directory and renames it when complete, so a
process killed during an async save leaves the previous checkpoints intact and the partial one is
ignored (and cleaned up) on the next start.
"""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp
from etils import epath

__all__ = ["Checkpointer", "restore_params"]


class Checkpointer:
  """A thin CheckpointManager wrapper: ``save``, ``latest_step``, ``restore``, ``close``."""

  def __init__(self, workdir: str, max_to_keep: int, save_every: int):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_every, create=True,
        enable_async_checkpointing=True, cleanup_tmp_directories=True)
    self.directory = epath.Path(workdir) / "checkpoints"
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_position: int, force: bool = False) -> bool:
    """Starts an async save (returns at once); ``force`` ignores save_every (last step, SIGTERM)."""
    meta = {"step": step, "data_position": data_position}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    return self.manager.save(step, args=args, force=force)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """The state at ``step`` laid out as ``abstract_state`` (ShapeDtypeStructs with shardings)."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    return out["state"], dict(out["meta"])

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def restore_params(path: str, abstract_params: Any) -> tuple[Any, int]:
  """Parameters only, from a workdir (its latest checkpoint) or a checkpoint step directory.

  Returns the params laid out as ``abstract_params`` and the step they come from. The optimizer
  state, step, RNG and data position start fresh (fine-tuning / warm start).
  """
  root = epath.Path(path)
  if (root / "checkpoints").exists():
    root = root / "checkpoints"
  if (root / "state").exists():  # a step directory
    step_dir, step = root, int(root.name) if root.name.isdigit() else -1
  else:
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True)) as mgr:
      step = mgr.latest_step()
    if step is None:
      raise FileNotFoundError(f"--init_from {path!r}: no checkpoint found")
    step_dir = root / str(step)
  target = {"params": abstract_params}  # a partial restore: the optimizer state is not read
  args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    restored = ckptr.restore(step_dir, args=ocp.args.Composite(state=args))
  return restored["state"]["params"], step
