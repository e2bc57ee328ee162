"""CPU benchmark of train.py's step on 8 fake devices: tokens/s per mesh shape against data-only.

Each mesh shape of ``--meshes`` (``--mesh`` syntax: ``data=N,fsdp=N,context=N,tensor=N``)
trains the same model from the same initial state on the same batches: the train step of
``train/train.py`` (forward, backward, AdamW update; ``train.train.build`` lays the state out
by ``train.sharding.LOGICAL_AXIS_RULES`` and the batch ``P(None, ('data', 'fsdp'),
'context')``), jitted for that mesh. The first mesh (``data=8`` by default) is the baseline.

Checked first: a mesh's per-step losses must equal the baseline's within ``--rtol`` (the
same sums in another order: float32 round-off, a few ulps per step that the optimizer
carries on); a mesh whose losses disagree reports FAILED with no figures, and the script
exits 1. The figures:

* tokens/s: ``batch_size x seq_len`` over the median wall time of the ``--steps`` timed steps
  (after ``--warmup`` steps that include the compilation), the meshes' steps interleaved;
* vs data-only: that rate over the baseline's, measured in the same run.

The 8 "devices" are threads of one CPU process sharing the same cores, so the figures show
what the collectives of each layout cost relative to data parallelism, not the speed of real
accelerators (tensor or context parallelism cannot be faster here: the cores are the same).

  python bench/train_mesh_cpu.py                                   # the default meshes
  python bench/train_mesh_cpu.py --meshes data=8 fsdp=8 --steps 2  # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the bench scripts beside it
from context_parallel_cpu import setup_fake_devices  # noqa: E402

DEVICES = 8  # (setup_fake_devices's default)
MESHES = ("data=8", "fsdp=8", "data=2,fsdp=2,context=2", "data=4,tensor=2",
          "fsdp=2,tensor=2,context=2", "data=2,context=4")
MODEL = ("--dataset", "text", "--d_model", "64", "--num_layers", "2", "--num_heads", "4",
         "--mlp_dim", "256", "--seq_len", "128", "--batch_size", "16", "--warmup_steps", "1",
         "--progress", "off")
RTOL = 1e-4




def losses_agree(losses, baseline, rtol: float = RTOL) -> bool:
  """Whether every step's loss equals the baseline's within ``rtol`` (relative); False for a
  different number of steps or any non-finite loss."""
  if len(losses) != len(baseline) or not losses:
    return False
  return all(abs(a - b) <= rtol * abs(b) for a, b in zip(losses, baseline, strict=True))


def row_cells(mesh: str, losses, baseline, tokens_per_s: float, baseline_tokens_per_s: float,
              rtol: float = RTOL) -> str:
  """One markdown row: the mesh, its losses' largest relative difference from the baseline's,
  tokens/s and the ratio to the baseline; FAILED and no figures when the losses disagree."""
  agree = losses_agree(losses, baseline, rtol)
  diff = max((abs(a - b) / abs(b) for a, b in zip(losses, baseline, strict=False)),
             default=float("nan"))
  if not agree:
    return f"| {mesh} | FAILED (losses differ by {diff:.1e}) | - | - |"
  return (f"| {mesh} | {diff:.1e} | {tokens_per_s:,.0f} | "
          f"{tokens_per_s / baseline_tokens_per_s:.2f} |")


def prepare(cfg, warmup: int, steps: int):
  """``cfg.mesh``'s jitted train step, its initial state and its ``warmup + steps`` batches."""
  import jax

  from train import sharding
  from train import train as train_lib

  mesh = sharding.make_mesh(cfg)
  dataset, graphdef, optimizer, init_fn, _, state_sharding, _ = train_lib.build(cfg, mesh)
  batch_sharding = sharding.batch_sharding(mesh)
  step_fn = train_lib.make_train_step(graphdef, optimizer, train_lib.make_schedule(cfg))
  step = jax.jit(sharding.in_mesh(mesh, step_fn), in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, None), donate_argnums=0)
  batches = [sharding.global_batch(dataset, i, cfg, batch_sharding)
             for i in range(warmup + steps)]
  return step, init_fn(), batches


def measure(runs, warmup: int, steps: int, tokens: int):
  """Per run (the ``prepare`` triples): (per-step losses, tokens/s). The steps are interleaved
  (step i of every mesh, then step i + 1), so a change in the machine's load while the
  benchmark runs reaches every mesh alike."""
  import jax

  states = [state for _, state, _ in runs]
  losses: list[list[float]] = [[] for _ in runs]
  times: list[list[float]] = [[] for _ in runs]
  for i in range(warmup + steps):
    for r, (step, _, batches) in enumerate(runs):
      t0 = time.perf_counter()
      states[r], metrics = step(states[r], batches[i])
      losses[r].append(float(jax.block_until_ready(metrics["loss"])))
      if i >= warmup:
        times[r].append(time.perf_counter() - t0)
  return [(loss, tokens / statistics.median(t)) for loss, t in zip(losses, times, strict=True)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--meshes", nargs="+", default=list(MESHES),
                      help="mesh shapes (--mesh syntax); the first is the baseline")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--rtol", type=float, default=RTOL)
  parser.add_argument("--model", default=" ".join(MODEL),
                      help="train.py flags of the model and batch")
  args = parser.parse_args(argv)
  if args.warmup < 1 or args.steps < 1:
    parser.error("--warmup and --steps must be >= 1")
  setup_fake_devices()
  import jax

  from train import config

  assert jax.device_count() == DEVICES, jax.devices()
  base, _ = config.from_argv(args.model.split() + ["--workdir", "/unused"])
  print(f"# train.py step on {DEVICES} CPU devices: {args.model}; {args.warmup} warm-up + "
        f"{args.steps} timed steps")
  print("# CPU figures show what each layout's collectives cost, not accelerator speed")
  print("| mesh | max rel. loss diff vs first | tokens/s | vs first |")
  print("|---|---|---|---|")
  runs = [prepare(dataclasses.replace(base, mesh=text), args.warmup, args.steps)
          for text in args.meshes]
  results = measure(runs, args.warmup, args.steps, base.batch_size * base.seq_len)
  baseline, baseline_rate = results[0]
  failed = False
  for text, (losses, rate) in zip(args.meshes, results, strict=True):
    failed |= not losses_agree(losses, baseline, args.rtol)
    print(row_cells(text, losses, baseline, rate, baseline_rate, args.rtol), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
