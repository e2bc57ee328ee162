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

* tokens/s: ``batch_size x seq_len`` over the median wall time of a round's steps, the
  median over ``--rounds`` rounds of ``--steps`` steps per mesh (after ``--warmup`` steps of
  every mesh that include the compilation; fewer rounds, at least 3, when the next one would
  end after ``--max-seconds`` from the start); within a round the meshes' steps are
  interleaved, in an order rotated from round to round, with the garbage collector off;
* vs first: the ratio of that rate to the baseline's within each round, its median and its
  range over the rounds (a ratio is taken between figures measured in the same seconds);
* vs first, CPU time: the same ratio with the process's CPU time per step
  (``time.process_time``, every thread of the process) instead of wall time: the work a
  layout costs, which other processes on the host change much less than the wall time, but
  which does not count a device thread's waiting (a stalled collective).

The 8 "devices" are threads of one CPU process sharing the same cores, so the figures show
what the collectives of each layout cost relative to data parallelism, not the speed of real
accelerators (tensor or context parallelism cannot be faster here: the cores are the same).
A collective waits for all 8 device threads: when other processes take the cores, a
descheduled thread stalls the rest, which costs a layout with more collectives more, so the
ratios move with the host's load, not just the noise that interleaving cancels. The header
prints the load average, and a WARNING line when the host was busy (1-minute load above the
core count) or the baseline's per-round rate moved by more than ``MAX_SPREAD``: run it on an
idle host. By default each device runs its ops on one thread
(``--xla_cpu_multi_thread_eigen=false``): 8 devices each with a pool as wide as the host
oversubscribe the cores (``--multi-thread-eigen`` restores XLA's default).

  python bench/train_mesh_cpu.py    # the default meshes, at most about 7 minutes (--max-seconds)
  python bench/train_mesh_cpu.py --meshes data=8 fsdp=8 --rounds 2 --steps 1  # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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
MIN_ROUNDS = 3  # rounds run whatever --max-seconds says
MAX_SPREAD = 1.25  # the baseline's largest over smallest per-round tokens/s before a warning




def losses_agree(losses, baseline, rtol: float = RTOL) -> bool:
  """Whether every step's loss equals the baseline's within ``rtol`` (relative); False for a
  different number of steps or any non-finite loss."""
  if len(losses) != len(baseline) or not losses:
    return False
  return all(abs(a - b) <= rtol * abs(b) for a, b in zip(losses, baseline, strict=True))


def row_cells(mesh: str, losses, baseline, rates, baseline_rates, cpu_rates=None,
              baseline_cpu_rates=None, rtol: float = RTOL) -> str:
  """One markdown row: the mesh, its losses' largest relative difference from the baseline's,
  the median over rounds of its tokens/s, and the median and range over rounds of the ratio
  to the baseline (``summary``); with ``cpu_rates`` (tokens per CPU-second of the process),
  the same median and range of that ratio. FAILED and no figures when the losses disagree."""
  agree = losses_agree(losses, baseline, rtol)
  diff = max((abs(a - b) / abs(b) for a, b in zip(losses, baseline, strict=False)),
             default=float("nan"))
  if not agree:
    return f"| {mesh} | FAILED (losses differ by {diff:.1e}) | - | - | - |" + (
        "" if cpu_rates is None else " - | - |")
  rate, ratio, low, high = summary(rates, baseline_rates)
  row = f"| {mesh} | {diff:.1e} | {rate:,.0f} | {ratio:.2f} | {low:.2f}-{high:.2f} |"
  if cpu_rates is not None:
    _, ratio, low, high = summary(cpu_rates, baseline_cpu_rates)
    row += f" {ratio:.2f} | {low:.2f}-{high:.2f} |"
  return row


def prepare(cfg, count: int):
  """``cfg.mesh``'s jitted train step, its initial state and its first ``count`` batches."""
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
             for i in range(count)]
  return step, init_fn(), batches


def round_order(n: int, r: int) -> list[int]:
  """The order of the ``n`` meshes' steps in round ``r``: rotated by ``r``, so no mesh always
  runs first (right after the host's other work) or last."""
  return [(r + i) % n for i in range(n)]


def measure(runs, warmup: int, rounds: int, steps: int, tokens: int,
            deadline: float | None = None):
  """Per run (the ``prepare`` triples): (per-step losses, per-round tokens/s, per-round
  tokens per CPU-second of this process).

  ``warmup`` steps of every mesh first (they include the compilation), then ``rounds``
  rounds of ``steps`` steps each; within a round the steps are interleaved (step i of every
  mesh, in the round's rotated order, then step i + 1), so a change in the host's load
  reaches every mesh alike, and a round's figure is tokens over the median of its steps'
  wall times. The garbage collector is run between rounds and disabled within them. With a
  ``deadline`` (a ``time.perf_counter()`` value), no round starts after ``MIN_ROUNDS`` rounds
  that the last round's duration says would end past it."""
  import jax

  states = [state for _, state, _ in runs]
  losses: list[list[float]] = [[] for _ in runs]
  rates: list[list[float]] = [[] for _ in runs]
  cpu_rates: list[list[float]] = [[] for _ in runs]

  def step(r: int, i: int) -> tuple[float, float]:
    fn, _, batches = runs[r]
    t0, c0 = time.perf_counter(), time.process_time()
    states[r], metrics = fn(states[r], batches[i])
    losses[r].append(float(jax.block_until_ready(metrics["loss"])))
    return time.perf_counter() - t0, time.process_time() - c0

  for i in range(warmup):
    for r in range(len(runs)):
      step(r, i)
  enabled = gc.isenabled()
  try:
    last = 0.0
    for rnd in range(rounds):
      if (deadline is not None and rnd >= MIN_ROUNDS
          and time.perf_counter() + last > deadline):
        break
      start = time.perf_counter()
      gc.collect()
      gc.disable()
      times: list[list[tuple[float, float]]] = [[] for _ in runs]
      for j in range(steps):
        i = warmup + rnd * steps + j
        for r in round_order(len(runs), rnd):
          times[r].append(step(r, i))
      if enabled:
        gc.enable()
      for r, t in enumerate(times):
        rates[r].append(tokens / statistics.median(wall for wall, _ in t))
        cpu_rates[r].append(tokens / max(statistics.median(cpu for _, cpu in t), 1e-9))
      last = time.perf_counter() - start
  finally:
    if enabled:
      gc.enable()
  return list(zip(losses, rates, cpu_rates, strict=True))


def summary(rates, baseline_rates) -> tuple[float, float, float, float]:
  """(median tokens/s, median, min and max of the per-round ratios to the baseline): each
  round's ratio compares two figures measured in the same minutes."""
  ratios = [a / b for a, b in zip(rates, baseline_rates, strict=True)]
  return statistics.median(rates), statistics.median(ratios), min(ratios), max(ratios)


def host_note(load: float, cores: int, spread: float) -> str | None:
  """A warning line when the figures cannot be trusted: the host was busy (load average over
  its cores) or the baseline's rate moved across rounds by more than ``MAX_SPREAD``."""
  reasons = []
  if load > cores:
    reasons.append(f"the 1-minute load average reached {load:.1f} on {cores} cores")
  if spread > MAX_SPREAD:
    reasons.append(f"the baseline's tokens/s moved by {spread:.2f}x across rounds")
  if not reasons:
    return None
  return ("# WARNING: " + " and ".join(reasons) + ": other work shared the cores, and a "
          "descheduled device thread stalls every collective, so the ratios are not reliable")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--meshes", nargs="+", default=list(MESHES),
                      help="mesh shapes (--mesh syntax); the first is the baseline")
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps of every mesh first (they include the compilation)")
  parser.add_argument("--rounds", type=int, default=12, help="at most this many rounds")
  parser.add_argument("--steps", type=int, default=6, help="timed steps per mesh and round")
  parser.add_argument("--max-seconds", type=float, default=420.0,
                      help="start no round (after the first 3) that would end later than this "
                      "many seconds after the script started")
  parser.add_argument("--rtol", type=float, default=RTOL)
  parser.add_argument("--model", default=" ".join(MODEL),
                      help="train.py flags of the model and batch")
  parser.add_argument("--multi-thread-eigen", action="store_true",
                      help="let each fake device's ops use XLA's multi-threaded Eigen pool "
                      "(default: one thread per device, --xla_cpu_multi_thread_eigen=false)")
  args = parser.parse_args(argv)
  if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
    parser.error("--warmup, --rounds and --steps must be >= 1")
  started = time.perf_counter()
  if not args.multi_thread_eigen:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false"
  setup_fake_devices()
  import jax

  from train import config

  assert jax.device_count() == DEVICES, jax.devices()
  base, _ = config.from_argv(args.model.split() + ["--workdir", "/unused"])
  cores = os.cpu_count() or 1
  load = os.getloadavg()[0]
  print(f"# train.py step on {DEVICES} CPU devices ({cores} cores): {args.model}; "
        f"{args.warmup} warm-up steps, then up to {args.rounds} rounds of {args.steps} timed steps "
        f"per mesh; XLA_FLAGS={os.environ.get('XLA_FLAGS', '').strip()}")
  print("# CPU figures show what each layout's collectives cost, not accelerator speed; "
        "tokens/s: median over rounds; vs first: median (and range) over rounds of the ratio "
        "measured within the round, from wall time, then from the process's CPU time")
  runs = [prepare(dataclasses.replace(base, mesh=text), args.warmup + args.rounds * args.steps)
          for text in args.meshes]
  t0 = time.perf_counter()
  results = measure(runs, args.warmup, args.rounds, args.steps, base.batch_size * base.seq_len,
                    deadline=started + args.max_seconds)
  load = max(load, os.getloadavg()[0])
  baseline, baseline_rates, baseline_cpu = results[0]
  print(f"# {len(baseline_rates)} rounds in {time.perf_counter() - t0:.0f} s of steps "
        f"(compilation included); 1-minute load average up to {load:.1f}")
  note = host_note(load, cores, max(baseline_rates) / min(baseline_rates))
  if note:
    print(note)
  print("| mesh | max rel. loss diff vs first | tokens/s | vs first | range over rounds | "
        "vs first, CPU time | range over rounds |")
  print("|---|---|---|---|---|---|---|")
  failed = False
  for text, (losses, rates, cpu_rates) in zip(args.meshes, results, strict=True):
    failed |= not losses_agree(losses, baseline, args.rtol)
    print(row_cells(text, losses, baseline, rates, baseline_rates, cpu_rates, baseline_cpu,
                    args.rtol), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
