"""Checkpoints with orbax-checkpoint: async saves, max_to_keep, auto-resume, --init_from.

A checkpoint holds the whole train state (params, optimizer state, step, RNG) and, as JSON, the
data position; restoring uses the *current* shardings, so a run saved on 8 devices resumes on 1 (or
the reverse). Orbax writes each step to a temporary directory and renames it when complete, so a
process killed during an async save leaves the previous checkpoints intact and the partial one is
ignored (and cleaned up) on the next start.

A step directory that is there but does not restore (emptied, an item missing, garbage data) does
not block a run: :meth:`Checkpointer.restore_newest` resumes from the newest step that restores and
*moves* each newer, damaged step to ``checkpoints_damaged/`` in the workdir (never deletes it). It
must leave ``checkpoints/``: a damaged step left there would collide with the resumed run's save of
the same step, and max_to_keep's garbage collection would count it among the newest and could
delete the good checkpoints instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

__all__ = ["Checkpointer", "Skipped", "restore_params", "check_params", "locate"]

DAMAGED = "checkpoints_damaged"


@dataclasses.dataclass(frozen=True)
class Skipped:
  """A checkpoint step that did not restore: why, and where it was moved (kept, not deleted)."""

  step: int
  reason: str
  moved_to: str

  def describe(self) -> str:
    return (f"skipped checkpoint step {self.step}: it does not restore ({self.reason}); moved to "
            f"{self.moved_to} (kept, not deleted)")


def _reason(error: BaseException) -> str:
  """One line naming the error, for the log."""
  text = " ".join(str(error).split())
  if len(text) > 200:
    text = text[:197] + "..."
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _free_name(parent: epath.Path, name: str) -> epath.Path:
  """``parent / name``, or ``name-1``, ``name-2``, ... when that is taken."""
  candidate, n = parent / name, 0
  while candidate.exists():
    n += 1
    candidate = parent / f"{name}-{n}"
  return candidate


class Checkpointer:
  """A thin CheckpointManager wrapper: ``save``, ``restore_newest``, ``restore``, ``close``."""

  def __init__(self, workdir: str, max_to_keep: int, save_every: int):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_every, create=True,
        enable_async_checkpointing=True, cleanup_tmp_directories=True)
    self.workdir = epath.Path(workdir)
    self.directory = self.workdir / "checkpoints"
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

  def restore_newest(self, abstract_state: Any, *, is_main: bool = True
                     ) -> tuple[int | None, Any, dict[str, Any], list[Skipped]]:
    """``(step, state, meta, skipped)`` from the newest checkpoint that restores.

    Steps are tried newest first; each that raises is moved to ``checkpoints_damaged/`` (by the
    main process) and reported in ``skipped``. ``step`` is None (and ``state``/``meta`` empty)
    when no checkpoint restores: the run starts fresh, the damaged steps kept aside.
    """
    failed: list[tuple[int, str]] = []
    found: tuple[int, Any, dict[str, Any]] | None = None
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state, meta = self.restore(step, abstract_state)
      except Exception as e:  # pylint: disable=broad-except  (orbax raises many kinds)
        failed.append((step, _reason(e)))
        continue
      found = (step, state, meta)
      break
    skipped = [Skipped(step, reason, str(self._set_aside(step, is_main)))
               for step, reason in failed]
    if failed:
      ocp.multihost.sync_global_processes("jaxsoft_damaged_checkpoints_moved")
      self.manager.reload()  # forget the moved steps (saves and max_to_keep see the rest)
    if found is None:
      return None, None, {}, skipped
    return found[0], found[1], found[2], skipped

  def _set_aside(self, step: int, is_main: bool) -> epath.Path:
    """Moves a damaged step out of ``checkpoints/`` into ``checkpoints_damaged/``; its new path."""
    target_dir = self.workdir / DAMAGED
    target = _free_name(target_dir, str(step))
    if is_main:
      target_dir.mkdir(parents=True, exist_ok=True)
      (self.directory / str(step)).rename(target)
    return target

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def locate(path: str) -> tuple[epath.Path, int]:
  """The checkpoint step directory ``--init_from PATH`` names, and its step.

  ``path`` is a workdir (its latest checkpoint), its ``checkpoints/`` directory, or one step
  directory. Raises FileNotFoundError naming what is missing.
  """
  root = epath.Path(path)
  if not root.exists():
    raise FileNotFoundError(f"{path!r} does not exist")
  if (root / "checkpoints").exists():
    root = root / "checkpoints"
  if (root / "state").exists():  # a step directory
    return root, int(root.name) if root.name.isdigit() else -1
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True)) as mgr:
    step = mgr.latest_step()
  if step is None:
    raise FileNotFoundError(f"{path!r} holds no checkpoint")
  return root / str(step), step


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """``{"blocks/0/attn/q/kernel": shape}`` of the array leaves of a nested dict."""
  out = {}
  for keys, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in keys)
    out[name] = tuple(getattr(leaf, "shape", ()))
  return out


def check_params(path: str, abstract_params: Any) -> int:
  """Raises ValueError unless the checkpoint ``path`` names holds exactly these parameters.

  Reads only the checkpoint's metadata (no array data): every parameter of ``abstract_params``
  must be there with the same shape, and the checkpoint may hold no other parameter (it would
  be dropped: a checkpoint of another architecture). The message names the first mismatched
  parameter, its path and both shapes. Returns the checkpoint's step.
  """
  step_dir, step = locate(path)
  metadata = ocp.PyTreeCheckpointer().metadata(step_dir / "state")
  tree = getattr(metadata, "item_metadata", metadata)
  tree = getattr(tree, "tree", tree)
  if not isinstance(tree, dict) or "params" not in tree:
    raise ValueError(f"{str(step_dir)!r} holds no parameters (not a train.py checkpoint)")
  saved, wanted = _shapes(tree["params"]), _shapes(abstract_params)
  where = f"the checkpoint {str(step_dir)!r}"
  for name, shape in wanted.items():
    if name not in saved:
      raise ValueError(f"parameter {name} {shape} of this model is not in {where}: it was saved "
                       "by another architecture")
    if saved[name] != shape:
      raise ValueError(f"parameter {name} has shape {saved[name]} in {where} but {shape} in "
                       "this model: it was saved by another architecture")
  extra = sorted(set(saved) - set(wanted))
  if extra:
    raise ValueError(f"parameter {extra[0]} {saved[extra[0]]} of {where} is not in this model"
                     + (f" (nor {len(extra) - 1} more)" if len(extra) > 1 else "")
                     + ": it was saved by another architecture")
  return step


def restore_params(path: str, abstract_params: Any) -> tuple[Any, int]:
  """Parameters only, from a workdir (its latest checkpoint) or a checkpoint step directory.

  Returns the params laid out as ``abstract_params`` and the step they come from. The optimizer
  state, step, RNG and data position start fresh (fine-tuning / warm start). A checkpoint of
  another architecture is a ValueError naming the mismatched parameter (:func:`check_params`).
  """
  check_params(path, abstract_params)
  step_dir, step = locate(path)
  target = {"params": abstract_params}  # a partial restore: the optimizer state is not read
  args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    restored = ckptr.restore(step_dir, args=ocp.args.Composite(state=args))
  return restored["state"]["params"], step
