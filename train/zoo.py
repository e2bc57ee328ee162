r"""The jaxsoft zoo: every normalizer and attention variant trained like for like.

    python -m train.zoo list                       # the entrants, the exclusions and why
    python -m train.zoo run                        # everything, resumably (make zoo)
    python -m train.zoo run --parts 2/6            # the second of six parts (one session each)
    python -m train.zoo run --only task=mqar entrant=normalizer:softmax,normalizer:sparsemax
    python -m train.zoo cost                       # seconds of one run per task, here
    python -m train.zoo report                     # bench/zoo/README.md, its plots, and the
                                                   # guide's table in docs/choosing.md

**Entrants** come from the registries (:func:`entrants`): every deterministic normalizer of
``jaxsoft.normalizers`` in the full attention block, every ``--attention`` layer kind of
``train.kinds.LAYER_KINDS`` (softmax in the normalizer blocks), a 3:1 hybrid (three Gated
DeltaNet layers per softmax layer) and, for the loss task, the loss variants (softmax CE,
StableMax CE, softmax CE with the orthogonal gradient, and the Fenchel-Young losses of
``jaxsoft.losses.fenchel_young_loss``). What is left out is left out by a declared property
and the reason is listed (:func:`exclusions`).

**Protocol** (:data:`PROTOCOL`): per task one model (``train.zoo_tasks.TASKS``), the same
batches in the same order, step budget and schedule for every entrant; the learning rate is
chosen per entrant and task by the task's fixed 3-point sweep on seed 0 (the best headline
metric), then seeds 1 and 2 train at the chosen rate: five runs per entrant and task. Each
finished run appends one JSON line to ``results.jsonl`` (key: protocol, entrant, task, seed,
lr); a rerun skips every finished key, so a stopped zoo resumes where it stopped. A run that
fails (an exception, a non-finite loss) is recorded with ``status: failed`` and its error,
and is not rerun either.

Training reuses ``train/``: the model is ``train.model.make_model`` of a ``train.config.
Config``, the optimizer ``train.train.make_optimizer`` and the step ``train.train.
make_train_step`` (the loss task, whose loss is the entrant, composes the same optimizer with
its own loss). The attention statistics (entropy, exact-zero sparsity, mass on the first
token) are those of ``train.model.attention_stats`` (the first normalizer block's dense
weights, recomputed with the registry's reference function), plus the first-token mass.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

if __name__ == "__main__" and not __package__:
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One XLA thread per process (unless XLA_FLAGS says otherwise): the zoo's models are small, and
# on a shared 2-core machine Eigen's thread pool spends ~30 % more CPU seconds for the same
# steps (the length task's step: 0.30 against 0.21 CPU s, compilation 19 against 11 s,
# measured 2026-12-07). The flags are recorded with every run.
ZOO_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", ZOO_XLA_FLAGS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxsoft import losses as js_losses  # noqa: E402
from jaxsoft import normalizers  # noqa: E402
from train import config, kinds, model  # noqa: E402
from train import train as train_lib  # noqa: E402
from train.zoo_tasks import TASKS, Task  # noqa: E402

__all__ = ["PROTOCOL", "Entrant", "entrants", "exclusions", "loss_entrants", "units",
           "run_zoo", "read_results", "record_key", "attention_weight_stats", "write_report",
           "main", "DEFAULT_OUT", "HYBRID_KIND", "GUIDE_ROWS", "GuideRow", "guide_rows",
           "guide_markdown", "write_guide", "task_summaries", "task_table"]

PROTOCOL = "zoo-1"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "bench", "zoo")
SEEDS = (0, 1, 2)
HYBRID_KIND = "gated_delta_rule"  # the 3:1 hybrid: three of these per softmax layer


@dataclasses.dataclass(frozen=True)
class Entrant:
  """One contestant: a name, the Config fields it sets and, for the loss task, its loss."""

  name: str
  fields: dict[str, Any] = dataclasses.field(default_factory=dict)
  loss: str = ""  # a key of LOSSES (loss entrants only)


# --------------------------------------------------------------------------------------------
# The entrants, from the registries.


def _normalizer_exclusion(name: str) -> str | None:
  spec = normalizers.get(name)
  if spec.needs_key:
    return ("stochastic (needs_key): train.model.Attention threads no PRNG key, so "
            "train.config.validate refuses it as an attention normalizer; its documented "
            "training-time use needs that hook first")
  return None


def exclusions() -> dict[str, str]:
  """``{entrant name: why it is not in the zoo}``: each by a declared property of its
  registry row."""
  out = {f"normalizer:{n}": why for n in normalizers.names()
         if (why := _normalizer_exclusion(n)) is not None}
  out["attention:full"] = ("the full normalizer block with softmax is normalizer:softmax "
                           "(the same config)")
  for kind, why in kinds.BIDIRECTIONAL_KINDS.items():
    out[f"attention:{kind}"] = why
  for name in js_losses.FENCHEL_YOUNG_NORMALIZERS:
    if name == "softmax":
      out["loss:fy_softmax"] = "the softmax Fenchel-Young loss is softmax CE (loss:softmax_ce)"
    elif js_losses.FENCHEL_YOUNG_NORMALIZERS[name] is None:
      out[f"loss:fy_{name}"] = ("alpha-entmax with a free alpha: its alpha = 1.5 point is "
                                "loss:fy_entmax15")
  return out


def _fy(name: str) -> Callable[..., jax.Array]:
  return lambda logits, labels: js_losses.fenchel_young_loss(logits, labels, name)


# The loss variants of the grok task: (per-example loss(logits, labels), optax transform run
# before AdamW or None).
LOSSES: dict[str, tuple[Callable[..., jax.Array], Callable[[], Any] | None]] = {
    "softmax_ce": (js_losses.softmax_cross_entropy_with_integer_labels, None),
    "stablemax_ce": (js_losses.stablemax_cross_entropy, None),
    "softmax_ce_orthogonal_gradient": (js_losses.softmax_cross_entropy_with_integer_labels,
                                       js_losses.orthogonal_gradient),
    **{f"fy_{name}": (_fy(name), None) for name, alpha in js_losses.FENCHEL_YOUNG_NORMALIZERS.items()
       if name != "softmax" and alpha is not None},
}


def loss_entrants() -> list[Entrant]:
  """The loss task's entrants (softmax attention; the loss is the variable)."""
  return [Entrant(f"loss:{name}", {}, name) for name in LOSSES]


def entrants(task: str | None = None) -> list[Entrant]:
  """The attention entrants (``task`` None or an attention task), or the loss entrants (the
  loss task), computed from the registries at call time."""
  if task is not None and TASKS[task].loss_task:
    return loss_entrants()
  out = [Entrant(f"normalizer:{n}", {"normalizer": n}) for n in normalizers.names()
         if _normalizer_exclusion(n) is None]
  out += [Entrant(f"attention:{kind}", {"attention": kind}) for kind in kinds.LAYER_KINDS
          if kind != "full"]
  hybrid = (HYBRID_KIND if HYBRID_KIND in kinds.LAYER_KINDS else kinds.LINEAR_KINDS[0])
  out.append(Entrant(f"hybrid:{hybrid}x3+softmax",
                     {"attention": "full", "layers": f"{hybrid},{hybrid},{hybrid},softmax"}))
  return out


def units(tasks: Iterable[str] | None = None) -> list[tuple[str, Entrant]]:
  """Every (task, entrant) of the zoo, in a fixed order (the order ``--parts`` splits): the
  tasks interleaved (the first entrant of every task, then the second, ...), so that a part
  started first records every task early; each task's reference entrant (softmax, softmax
  CE) first, as every comparison needs it."""
  lists = [sorted(((t, e) for e in entrants(t)),
                  key=lambda te: te[1].name not in (_SOFTMAX, REFERENCE["loss"]))
           for t in (tasks or TASKS)]
  return [lst[k] for k in range(max(map(len, lists), default=0)) for lst in lists
          if k < len(lst)]


# --------------------------------------------------------------------------------------------
# Records.


def record_key(record: dict[str, Any]) -> tuple[Any, ...]:
  """What identifies a run: (protocol, entrant, task, seed, lr)."""
  return (record["protocol"], record["entrant"], record["task"], int(record["seed"]),
          float(record["lr"]))


def read_results(path: str) -> list[dict[str, Any]]:
  """The records of ``results.jsonl`` (a torn last line, from a killed write, is skipped)."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


def _append(path: str, record: dict[str, Any]) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(record, sort_keys=True) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _commit() -> str:
  try:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def _machine() -> str:
  device = jax.devices()[0]
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return (f"{platform.node()} {platform.machine()} {cores} cores, "
          f"{device.platform} {getattr(device, 'device_kind', '')}".strip())


# --------------------------------------------------------------------------------------------
# Attention statistics.


def attention_weight_stats(net: model.Transformer, tokens: jax.Array, cfg: config.Config
                           ) -> dict[str, jax.Array]:
  r"""Entropy, exact-zero sparsity and first-token mass of the first normalizer block.

  ``attn_entropy`` and ``attn_sparsity`` are ``train.model.attention_stats``'s (the entropy
  :math:`-\sum_j p_{ij} \log p_{ij}` of each row renormalised to sum to one, the fraction of
  visible weights exactly 0); ``attn_first_token`` is the mean over heads and the rows
  :math:`i \ge 1` of the weight on key 0, :math:`\frac{1}{N (T - 1)} \sum_{n, i \ge 1}
  w_{n, i, 0}` (an attention sink puts most of a row there; row 0 sees only key 0 and is
  left out). ``{}`` when the stack has no normalizer block.

  References:
    G. Xiao, Y. Tian, B. Chen, S. Han & M. Lewis, 2024, "Efficient Streaming Language Models
    with Attention Sinks", arXiv 2309.17453.
  """
  stats = model.attention_stats(net, tokens, cfg)
  if not stats:
    return {}
  layer = next(i for i, b in enumerate(net.blocks) if b.kind in config.ATTENTION_VARIANTS)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  x = net.embed(tokens)
  for block in net.blocks[:layer]:
    x = block(x, positions)
  block = net.blocks[layer]
  q, k = block.attn.qk(block.attn_norm(x), positions)
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
  if block.kind == "softcap":
    scores = cfg.softcap * jnp.tanh(scores / cfg.softcap)
  t = tokens.shape[1]
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  mask = j <= i
  if block.kind == "window":
    mask &= j >= i - cfg.window
  w = normalizers.get(block.attn.normalizer).fn(
      scores, axis=-1, where=jnp.broadcast_to(mask, scores.shape), **block.attn.hparams())
  stats = dict(stats)
  stats["attn_first_token"] = jnp.mean(w[..., 1:, 0])
  return stats


# --------------------------------------------------------------------------------------------
# One run.


def _task_config(task: Task, entrant: Entrant, seed: int, lr: float, tiny: bool
                 ) -> config.Config:
  fields = dict(task.config)
  if tiny:
    fields.update(task.tiny)
  fields.update(entrant.fields)
  fields.update(seed=seed, learning_rate=lr, workdir="unused", eval_every=0, progress="off",
                loss="dense")
  cfg = config.Config(**fields)
  config.validate(cfg, check_workdir=False)
  return cfg


def _stack(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  return {k: jnp.asarray(v)[None] for k, v in batch.items()}  # [grad_accum = 1, B, T]


def _make_loss_step(graphdef, optimizer, loss_fn):
  """The loss task's step: ``loss_fn(logits of the answer position, labels)``, mean over the
  rows, through the same optimizer as train.train (plus the entrant's transform)."""

  def loss(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"])[:, -1]
    return jnp.mean(loss_fn(logits, batch["targets"][:, -1]))

  def step(state, batch):
    batch = {k: v[0] for k, v in batch.items()}
    value, grads = jax.value_and_grad(loss)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return ({**state, "step": state["step"] + 1, "opt_state": opt_state,
             "params": optax.apply_updates(state["params"], updates)},
            {"loss": value, "grad_norm": optax.tree.norm(grads)})

  return step


def _evaluator(graphdef):
  """``eval(params, batch) -> (loss sum, weight sum, correct sum)`` on the weighted tokens."""

  def evaluate(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    right = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    w = batch["weights"]
    return jnp.sum(ce * w), jnp.sum(w), jnp.sum(right * w)

  return jax.jit(evaluate)


def _evaluate(evaluate, params, sets: dict[str, list[dict[str, np.ndarray]]]
              ) -> dict[str, float]:
  out: dict[str, float] = {}
  losses, weights, rights = 0.0, 0.0, 0.0
  for label, batches in sets.items():
    sums = [jax.device_get(evaluate(params, {k: jnp.asarray(v) for k, v in b.items()}))
            for b in batches]
    loss, weight, right = (sum(float(s[i]) for s in sums) for i in range(3))
    out[f"{label}/loss"] = loss / weight
    out[f"{label}/accuracy"] = right / weight
    losses, weights, rights = losses + loss, weights + weight, rights + right
  out["loss"] = losses / weights
  out["accuracy"] = rights / weights
  return out


def _memory_bytes(compiled) -> int | None:
  """Arguments + outputs + temporaries of the compiled step (XLA's memory analysis): the
  step's peak memory as the compiler planned it, comparable across machines."""
  try:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
  except Exception:  # pylint: disable=broad-except  (a backend without the analysis)
    return None


class _LrState(NamedTuple):
  lr: jax.Array


def scale_by_lr_state(lr: float) -> optax.GradientTransformation:
  r"""Multiplies the updates by a learning rate held in the optimizer state.

  ``train.train.make_optimizer`` at a peak rate of 1 followed by this transform at ``lr`` is
  AdamW at peak ``lr``: AdamW's update :math:`-\eta_t (\hat m_t / (\sqrt{\hat v_t} +
  \epsilon) + \lambda \theta)` is linear in the schedule :math:`\eta_t = lr \cdot s_t`.
  With the rate in the state rather than in the program, the three rates of the sweep and the
  seeds share one compiled step.
  """

  def init(params):
    del params
    return _LrState(jnp.asarray(lr, jnp.float32))

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u: u * state.lr.astype(u.dtype), updates), state

  return optax.GradientTransformation(init, update)


@dataclasses.dataclass
class _Programs:
  """What one (task, entrant) compiles once for its five runs."""

  cfg: config.Config
  graphdef: Any
  step: Any
  evaluate: Any
  stats: Any
  optimizer: Callable[[float], optax.GradientTransformation]
  init: Any  # seed -> the initial parameters (train.model.make_model's)
  compile_s: float
  memory: int | None


_CACHE: dict[tuple[str, str, bool], _Programs] = {}


def _programs(task: Task, entrant: Entrant, tiny: bool) -> tuple[_Programs, bool]:
  """The compiled train step, evaluator and statistics of a unit (cached: only the last unit
  is kept); True when they were compiled by this call."""
  key = (task.name, entrant.name, tiny)
  if key in _CACHE:
    return _CACHE[key], False
  _CACHE.clear()
  began = time.perf_counter()
  cfg = _task_config(task, entrant, 0, 1.0, tiny)  # the model config, whatever the seed / lr
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, task.vocab_size, 0)))
  params = nnx.to_pure_dict(params)
  transform = LOSSES[entrant.loss][1] if entrant.loss else None

  def optimizer(lr: float) -> optax.GradientTransformation:
    parts = [transform()] if transform is not None else []
    return optax.chain(*parts, train_lib.make_optimizer(cfg), scale_by_lr_state(lr))

  opt = optimizer(1.0)
  if entrant.loss:
    step_fn = _make_loss_step(graphdef, opt, LOSSES[entrant.loss][0])
  else:
    step_fn = train_lib.make_train_step(graphdef, opt, train_lib.make_schedule(cfg))
  state = jax.eval_shape(lambda: train_lib.init_state(cfg, graphdef, params, opt))
  batch = jax.eval_shape(lambda: _stack(task.train_batch(0, 0, tiny)))
  compiled = jax.jit(step_fn, donate_argnums=0).lower(state, batch).compile()
  stats = jax.jit(lambda p, t: attention_weight_stats(nnx.merge(graphdef, p), t, cfg))
  # train.model.make_model's initial parameters, eagerly: its small ops compile once per shape
  # for the whole process, where a jitted initialiser costs ~8 CPU s per unit

  def init(seed):
    return nnx.to_pure_dict(nnx.state(model.make_model(cfg, task.vocab_size, int(seed))))

  programs = _Programs(cfg, graphdef, compiled, _evaluator(graphdef), stats, optimizer, init,
                       time.perf_counter() - began, _memory_bytes(compiled))
  _CACHE[key] = programs
  return programs, True


@functools.lru_cache(maxsize=4096)
def _cached_batch(task_name: str, seed: int, position: int, tiny: bool
                  ) -> dict[str, np.ndarray]:
  return TASKS[task_name].train_batch(seed, position, tiny)


def _train_batch(task_name: str, seed: int, position: int, tiny: bool
                 ) -> dict[str, np.ndarray]:
  """A task's training batch (a pure function of its arguments), kept for the next units of
  the task (the attention tasks' batches, ~12-18 KB each, ~1100 of them in all; the loss
  task's one full batch is rebuilt)."""
  if TASKS[task_name].loss_task:
    return TASKS[task_name].train_batch(seed, position, tiny)
  return _cached_batch(task_name, seed, position, tiny)


@functools.lru_cache(maxsize=8)
def _eval_sets(task_name: str, tiny: bool) -> dict[str, list[dict[str, np.ndarray]]]:
  return TASKS[task_name].eval_sets(tiny)


def train_one(task: Task, entrant: Entrant, seed: int, lr: float, tiny: bool = False
              ) -> dict[str, Any]:
  """Trains ``entrant`` on ``task`` at ``seed`` and peak learning rate ``lr``; returns the
  record's measurements (the task's evaluation, the training curve, tokens/s after the first
  step, the compiled step's memory, the attention statistics on an evaluation row)."""
  programs, compiled_now = _programs(task, entrant, tiny)
  cfg = programs.cfg
  _task_config(task, entrant, seed, lr, tiny)  # (checks the run's own config)
  params = programs.init(jnp.int32(seed))
  state = train_lib.init_state(dataclasses.replace(cfg, seed=seed), programs.graphdef, params,
                               programs.optimizer(lr))
  n_params = int(sum(x.size for x in jax.tree.leaves(params)))
  curve: list[list[float]] = []
  every = max(1, cfg.steps // 50)
  timed_from, timed_steps, tokens_per_step = time.perf_counter(), 0, 0
  loss = float("nan")
  for step in range(cfg.steps):
    batch = _stack(_train_batch(task.name, seed, step, tiny))
    tokens_per_step = int(batch["inputs"].size)
    state, metrics = programs.step(state, batch)
    if step == 0:
      jax.block_until_ready(state)
      timed_from = time.perf_counter()
    else:
      timed_steps += 1
    if (step + 1) % every == 0 or step + 1 == cfg.steps:
      loss = float(metrics["loss"])
      if not math.isfinite(loss):
        raise FloatingPointError(f"non-finite training loss {loss} at step {step + 1}")
      curve.append([step + 1, loss])
  jax.block_until_ready(state)
  train_s = time.perf_counter() - timed_from
  sets = _eval_sets(task.name, tiny)
  results = _evaluate(programs.evaluate, state["params"], sets)
  eval_tokens = jnp.asarray(next(iter(sets.values()))[0]["inputs"][:1])
  stats = jax.device_get(programs.stats(state["params"], eval_tokens))
  return {
      "metric": task.metric, "value": results[task.metric], "eval_loss": results["loss"],
      "results": results, "final_train_loss": loss, "curve": curve, "params": n_params,
      "tokens_per_s": (tokens_per_step * timed_steps / train_s) if timed_steps else None,
      "compile_s": programs.compile_s if compiled_now else 0.0,
      "peak_memory_bytes": programs.memory, **{k: float(v) for k, v in stats.items()},
  }


# --------------------------------------------------------------------------------------------
# The zoo: sweep, seeds, resume.


def _better(task: Task, a: float, b: float) -> bool:
  return a > b if task.higher_is_better else a < b


def _score(task: Task, record: dict[str, Any]) -> float:
  value = record.get("value")
  if record.get("status") != "ok" or value is None or not math.isfinite(value):
    return -math.inf if task.higher_is_better else math.inf
  return float(value)


def chosen_lr(task: Task, sweep: Sequence[dict[str, Any]]) -> float | None:
  """The sweep's learning rate with the best headline metric (ties: the smaller rate); None
  until all three seed-0 runs are recorded."""
  by_lr = {float(r["lr"]): r for r in sweep}
  if any(float(lr) not in by_lr for lr in task.lrs):
    return None
  best = task.lrs[0]
  for lr in task.lrs[1:]:
    if _better(task, _score(task, by_lr[lr]), _score(task, by_lr[best])):
      best = lr
  return float(best)


def _runs_needed(task: Task, entrant: Entrant, done: dict[tuple, dict], protocol: str
                 ) -> list[tuple[int, float]]:
  """The (seed, lr) runs of this unit not yet in ``done`` (keyed by :func:`record_key`): the
  sweep first, then the two seeds at the chosen rate."""
  sweep = [done[k] for k in done if k[1] == entrant.name and k[2] == task.name and k[3] == 0]
  todo = [(0, float(lr)) for lr in task.lrs
          if (protocol, entrant.name, task.name, 0, float(lr)) not in done]
  if todo:
    return todo
  lr = chosen_lr(task, sweep)
  assert lr is not None
  return [(s, lr) for s in SEEDS[1:] if (protocol, entrant.name, task.name, s, lr) not in done]


def _parse_only(pairs: Sequence[str]) -> dict[str, set[str]]:
  out: dict[str, set[str]] = {}
  for pair in pairs:
    key, _, values = pair.partition("=")
    if key not in ("task", "entrant") or not values:
      raise SystemExit(f"zoo: --only expects task=A,B or entrant=X,Y; got {pair!r}")
    out.setdefault(key, set()).update(v for v in values.split(",") if v)
  return out


def _parse_parts(text: str) -> tuple[int, int]:
  try:
    i, n = (int(x) for x in text.split("/"))
  except ValueError:
    raise SystemExit(f"zoo: --parts expects i/n (e.g. 2/6); got {text!r}") from None
  if not 1 <= i <= n:
    raise SystemExit(f"zoo: --parts {text!r}: need 1 <= i <= n")
  return i, n


def run_zoo(out: str = DEFAULT_OUT, only: Sequence[str] = (), parts: str = "1/1",
            limit: int | None = None, tiny: bool = False, log=print) -> int:
  """Runs every missing record of the selected units; returns how many were recorded.

  ``only``: ``task=...`` / ``entrant=...`` filters (comma-separated names); ``parts``: ``i/n``,
  the i-th of n interleaved slices of :func:`units` (each unit, all five of its runs, in one
  part); ``limit``: stop after this many new records; ``tiny``: the CI sizes (a protocol of
  their own, never mixed with the real one).
  """
  path = os.path.join(out, "results.jsonl")
  filters = _parse_only(only)
  i, n = _parse_parts(parts)
  protocol = PROTOCOL + ("-tiny" if tiny else "")
  selected = [(t, e) for k, (t, e) in enumerate(units())
              if k % n == i - 1 and t in filters.get("task", {t})
              and e.name in filters.get("entrant", {e.name})]
  for name in filters.get("entrant", set()) - {e.name for _, e in units()}:
    raise SystemExit(f"zoo: --only entrant={name}: not an entrant (python -m train.zoo list)")
  for name in filters.get("task", set()) - set(TASKS):
    raise SystemExit(f"zoo: --only task={name}: not a task; one of {', '.join(TASKS)}")
  commit, machine = _commit(), _machine()
  recorded = 0
  for task_name, entrant in selected:
    task = TASKS[task_name]
    while True:
      done = {record_key(r): r for r in read_results(path) if r["protocol"] == protocol}
      todo = _runs_needed(task, entrant, done, protocol)
      if not todo:
        break
      if limit is not None and recorded >= limit:
        return recorded
      seed, lr = todo[0]
      record = {"protocol": protocol, "entrant": entrant.name, "task": task_name, "seed": seed,
                "lr": lr, "phase": "sweep" if seed == 0 else "seed",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "commit": commit, "jax": jax.__version__, "machine": machine,
                "xla_flags": os.environ.get("XLA_FLAGS", "")}
      began, began_cpu = time.perf_counter(), time.process_time()
      try:
        record.update(train_one(task, entrant, seed, lr, tiny), status="ok")
      except Exception as e:  # pylint: disable=broad-except  (recorded, not rerun)
        record.update(status="failed", error=f"{type(e).__name__}: {e}"[:500], value=None)
      record["seconds"] = time.perf_counter() - began
      record["cpu_seconds"] = time.process_time() - began_cpu
      _append(path, record)
      recorded += 1
      log(f"{task_name:8s} {entrant.name:44s} seed {seed} lr {lr:g}: {record['status']} "
          f"{task.metric}={record.get('value')} ({record['seconds']:.1f} s)")
  return recorded


# --------------------------------------------------------------------------------------------
# The report.

DOCS_GUIDE = os.path.join(os.path.dirname(DEFAULT_OUT), os.pardir, "docs", "choosing.md")
GUIDE_BEGIN = "<!-- zoo-guide:begin (written by `python -m train.zoo report`; do not edit) -->"
GUIDE_END = "<!-- zoo-guide:end -->"
REFERENCE = {"loss": "loss:softmax_ce"}  # the entrant each guide row is compared with
_SOFTMAX = "normalizer:softmax"


@dataclasses.dataclass(frozen=True)
class GuideRow:
  """One need of the guide: which task answers it, which entrants compete (``candidates``:
  ``"all"``, ``"sparse"`` the normalizers that declare exact zeros, ``"as_good"`` those whose
  task metric ties or beats softmax's) and the key ranked (``"value"``: the task metric)."""

  need: str
  task: str
  candidates: str
  key: str
  higher_is_better: bool
  quote: tuple[str, ...] = ()  # further keys quoted with the answer


GUIDE_ROWS = (
    GuideRow("exact sparsity (weights exactly 0)", "lm", "sparse", "value", False,
             ("attn_sparsity",)),
    GuideRow("no attention sink (little mass on the first token)", "lm", "as_good",
             "attn_first_token", False, ("value",)),
    GuideRow("length robustness (trained at 256, evaluated at 4096)", "length", "all", "value",
             False, ("results.len256/loss",)),
    GuideRow("associative recall", "mqar", "all", "value", True),
    GuideRow("nested long-range structure (ListOps)", "listops", "all", "value", True),
    GuideRow("a loss that generalises (grokking; stable in float32)", "grok", "all", "value",
             True),
    GuideRow("speed at softmax's quality", "lm", "as_good", "tokens_per_s", True, ("value",)),
)


def _key_mean(summary: dict[str, Any], key: str) -> float | None:
  rs = [r for r in summary["records"] if r.get("status") == "ok"]
  if key.startswith("results."):
    return _mean_of([r.get("results", {}) for r in rs], key[len("results."):])
  return summary["mean"] if key == "value" else _mean_of(rs, key)


def _figures(complete: dict[str, dict[str, Any]], name: str | None, g: GuideRow
             ) -> dict[str, Any] | None:
  if name is None or name not in complete:
    return None
  s = complete[name]
  return {"entrant": name, "lr": s["lr"], "mean": s["mean"], "std": s["std"],
          **{k: _key_mean(s, k) for k in (g.key, *g.quote) if k != "value"}}


def guide_rows(records: Sequence[dict[str, Any]], protocol: str = PROTOCOL
               ) -> list[dict[str, Any]]:
  """The numbers the guide quotes, from ``results.jsonl``'s records: per :data:`GUIDE_ROWS`
  need, the best candidate among the entrants with all three seeds recorded, its figures
  (mean over the seeds at its chosen rate), the reference entrant's (softmax, or softmax CE on
  the loss task), and ``status``: ``"complete"`` (every entrant of the task has its three
  seeds), ``"provisional"`` (some have: the answer may change) or ``"waiting"`` (none yet: no
  number)."""
  rows = []
  for g in GUIDE_ROWS:
    task = TASKS[g.task]
    summary = _summaries(records, task, protocol)
    complete = {k: s for k, s in summary.items() if s["n"] == len(SEEDS) and s["mean"] is not None}
    reference = REFERENCE["loss"] if task.loss_task else _SOFTMAX
    pool = dict(complete)
    if g.candidates == "sparse":
      pool = {k: s for k, s in pool.items() if k.startswith("normalizer:")
              and normalizers.get(k.split(":", 1)[1]).can_be_sparse}
    elif g.candidates == "as_good":
      ref = complete.get(reference)
      pool = {} if ref is None else {
          k: s for k, s in pool.items()
          if not _better(task, ref["mean"], s["mean"])
          or abs(s["mean"] - ref["mean"]) <= s["std"] + ref["std"]}
    scored = {k: v for k, s in pool.items() if (v := _key_mean(s, g.key)) is not None}
    best = None
    if scored:
      pick = max if g.higher_is_better else min
      best = pick(scored, key=lambda k: scored[k])

    status = ("complete" if len(complete) == len(summary) else
              "provisional" if complete else "waiting")
    rows.append({"need": g.need, "task": g.task, "metric": task.metric, "key": g.key,
                 "status": status, "complete": len(complete), "entrants": len(summary),
                 "best": _figures(complete, best, g), "reference": _figures(complete, reference, g)})
  return rows


def _anchor(task: Task) -> str:
  """GitHub's anchor of the task's section in bench/zoo/README.md."""
  heading = f"{task.name}: {task.title}".lower()
  return "".join(c for c in heading if c.isalnum() or c in " -_").replace(" ", "-")


def _describe(row: dict[str, Any], which: str) -> str:
  f = row[which]
  if f is None:
    return "—"
  text = f"`{f['entrant']}`: {row['metric']} {f['mean']:.3f} ± {f['std']:.3f}"
  extra = {k: v for k, v in f.items() if k not in ("entrant", "lr", "mean", "std")}
  names = {"attn_sparsity": "exact zeros", "attn_first_token": "first-token mass",
           "tokens_per_s": "tokens/s", "results.len256/loss": "loss at 256"}
  for k, v in extra.items():
    if v is not None:
      text += f", {names.get(k, k)} {v:.0f}" if k == "tokens_per_s" else (
          f", {names.get(k, k)} {v:.3f}")
  return text


def guide_markdown(records: Sequence[dict[str, Any]], protocol: str = PROTOCOL) -> str:
  """The guide's table (:func:`guide_rows`) as Markdown, for docs/choosing.md."""
  rows = guide_rows(records, protocol)
  lines = ["| need | the zoo's answer (mean ± std over 3 seeds) | reference | status |",
           "|---|---|---|---|"]
  for row in rows:
    task = TASKS[row["task"]]
    link = f"[{row['task']}](../bench/zoo/README.md#{_anchor(task)})"
    if row["status"] == "waiting":
      status = f"waits for the zoo's runs ({link}: 0 of {row['entrants']} entrants)"
    elif row["status"] == "provisional":
      status = (f"provisional ({link}: {row['complete']} of {row['entrants']} entrants "
                "complete; the answer may change)")
    else:
      status = f"complete ({link})"
    lines.append(f"| {row['need']} | {_describe(row, 'best')} | {_describe(row, 'reference')} "
                 f"| {status} |")
  backed = sum(r["status"] == "complete" for r in rows)
  lines += ["", f"{backed} of {len(rows)} rows backed by complete zoo results; "
                f"{sum(r['status'] == 'provisional' for r in rows)} provisional; "
                f"{sum(r['status'] == 'waiting' for r in rows)} waiting for runs "
                f"({len(records)} records in bench/zoo/results.jsonl)."]
  return "\n".join(lines)


def write_guide(records: Sequence[dict[str, Any]], path: str = DOCS_GUIDE,
                protocol: str = PROTOCOL) -> None:
  """Replaces the block between :data:`GUIDE_BEGIN` and :data:`GUIDE_END` of ``path``."""
  with open(path) as f:
    text = f.read()
  start, end = text.find(GUIDE_BEGIN), text.find(GUIDE_END)
  if start < 0 or end < start:
    raise ValueError(f"path: {path} has no {GUIDE_BEGIN!r} ... {GUIDE_END!r} block")
  text = (text[:start] + GUIDE_BEGIN + "\n\n" + guide_markdown(records, protocol) + "\n\n"
          + text[end:])
  with open(path, "w") as f:
    f.write(text)


def _summaries(records: Sequence[dict[str, Any]], task: Task, protocol: str
               ) -> dict[str, dict[str, Any]]:
  """Per entrant: the chosen rate, the seeds' values at it, mean and spread (std, ddof 1)."""
  out: dict[str, dict[str, Any]] = {}
  mine = [r for r in records if r["task"] == task.name and r["protocol"] == protocol]
  for entrant in entrants(task.name):
    rs = [r for r in mine if r["entrant"] == entrant.name]
    lr = chosen_lr(task, [r for r in rs if int(r["seed"]) == 0])
    seeds = sorted((r for r in rs if lr is not None and float(r["lr"]) == lr),
                   key=lambda r: int(r["seed"]))
    values = [_score(task, r) for r in seeds]
    finite = [v for v in values if math.isfinite(v)]
    out[entrant.name] = {
        "lr": lr, "records": seeds, "sweep": {float(r["lr"]): r for r in rs
                                              if int(r["seed"]) == 0},
        "n": len(seeds), "failed": len(values) - len(finite),
        "mean": float(np.mean(finite)) if finite else None,
        "std": float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0,
    }
  return out


def task_summaries(records: Sequence[dict[str, Any]], task: str, protocol: str = PROTOCOL
                   ) -> dict[str, dict[str, Any]]:
  """Per entrant of ``task``: its chosen rate, its records at that rate, ``n`` (seeds so far),
  ``mean`` and ``std`` (ddof 1) of the task metric over the seeds (the report's cells)."""
  return _summaries(records, TASKS[task], protocol)


def task_table(records: Sequence[dict[str, Any]], task: str, protocol: str = PROTOCOL) -> str:
  """The report's Markdown table of ``task`` (ties with the best marked, missing cells —)."""
  return "\n".join(_task_table(TASKS[task], _summaries(records, TASKS[task], protocol)))


def _mean_of(records: Sequence[dict[str, Any]], key: str) -> float | None:
  values = [r[key] for r in records if r.get(key) is not None]
  return float(np.mean(values)) if values else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
  return "—" if x is None else format(x, spec)


def write_report(out: str = DEFAULT_OUT, tiny: bool = False, guide: str | None = None) -> str:
  """Writes ``out/README.md`` (a table per task, ties with the best marked, missing cells
  marked) and its plots from ``out/results.jsonl``, and the guide's table into ``guide``
  (docs/choosing.md; None: not written); returns the README's path."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  protocol = PROTOCOL + ("-tiny" if tiny else "")
  records = read_results(os.path.join(out, "results.jsonl"))
  lines = ["# The jaxsoft zoo", "",
           "Generated by `python -m train.zoo report` from `results.jsonl` (do not edit by "
           "hand). Every entrant of a task trains the same model on the same batches in the "
           "same order with the same step budget and schedule; its learning rate is the best "
           "of the task's 3-point sweep on seed 0, then seeds 1 and 2 train at that rate. A "
           "cell is the mean ± standard deviation over the three seeds; **≈** marks an "
           "entrant whose mean is within the sum of its and the best entrant's standard "
           "deviations of the best (a tie), — a missing cell, (n/3) a cell with n seeds so "
           f"far. Protocol `{protocol}`.", ""]
  lines += _cost_section(out, records, protocol)
  for task in TASKS.values():
    summary = _summaries(records, task, protocol)
    lines += _task_table(task, summary)
    plots = _plots(out, task, summary, plt)
    lines += [f"![{p}]({p})" for p in plots] + [""]
  path = os.path.join(out, "README.md")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  if guide is not None:
    write_guide(records, guide, protocol)
  return path


def _task_table(task: Task, summary: dict[str, dict[str, Any]]) -> list[str]:
  cfg = task.config
  size = (f"d_model {cfg['d_model']}, {cfg['num_layers']} layers, {cfg['num_heads']} heads, "
          f"MLP {cfg['mlp_dim']}, T = {cfg['seq_len']}, batch {cfg['batch_size']}, "
          f"{cfg['steps']} steps, sweep {', '.join(f'{x:g}' for x in task.lrs)}")
  params = sorted({r["params"] for s in summary.values() for r in s["records"]
                   if r.get("params")})
  arrow = "higher" if task.higher_is_better else "lower"
  lines = [f"## {task.name}: {task.title}", "",
           f"Model: {size}; parameters: "
           f"{', '.join(f'{p:,}' for p in params) if params else 'not yet measured'} "
           f"(layer kinds differ). Metric `{task.metric}` ({arrow} is better).", ""]
  if task.why:
    lines += [f"Why these sizes: {task.why}", ""]
  complete = {k: s for k, s in summary.items() if s["mean"] is not None}
  best = None
  if complete:
    pick = max if task.higher_is_better else min
    best = pick(complete, key=lambda k: complete[k]["mean"])
  extra = sorted({k for s in summary.values() for r in s["records"]
                  for k in r.get("results", {}) if k != task.metric and "/" in k})
  columns = ["entrant", "lr", task.metric, *extra, "eval loss", "tokens/s", "peak MiB",
             "entropy", "sparsity", "first token"]
  lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  order = sorted(summary, key=lambda k: (summary[k]["mean"] is None,
                                         -(summary[k]["mean"] or 0) if task.higher_is_better
                                         else (summary[k]["mean"] or 0)))
  for name in order:
    s = summary[name]
    rs = [r for r in s["records"] if r.get("status") == "ok"]
    if s["mean"] is None:
      cell = "—" if not s["records"] else f"failed ({s['failed']}/{s['n']})"
    else:
      cell = f"{s['mean']:.3f} ± {s['std']:.3f}"
      if s["n"] < len(SEEDS):
        cell += f" ({s['n']}/3)"
      if best is not None and name != best and abs(s["mean"] - complete[best]["mean"]) <= (
          s["std"] + complete[best]["std"]):
        cell = "**≈** " + cell
      if name == best:
        cell = f"**{cell}**"
    extras = [_fmt(_mean_of([r["results"] for r in rs], k)) for k in extra]
    memory = _mean_of(rs, "peak_memory_bytes")
    lines.append(
        f"| {name} | {_fmt(s['lr'], 'g')} | {cell} | " + "".join(f"{x} | " for x in extras)
        + f"{_fmt(_mean_of(rs, 'eval_loss'))} | {_fmt(_mean_of(rs, 'tokens_per_s'), '.0f')} | "
        f"{_fmt(memory / 2**20 if memory else None, '.1f')} | "
        f"{_fmt(_mean_of(rs, 'attn_entropy'))} | {_fmt(_mean_of(rs, 'attn_sparsity'))} | "
        f"{_fmt(_mean_of(rs, 'attn_first_token'))} |")
  missing = [k for k, s in summary.items() if s["n"] < len(SEEDS)]
  lines += ["", f"{len(summary) - len(missing)} of {len(summary)} entrants complete."
            + (f" Missing or partial: {len(missing)}." if missing else ""), ""]
  return lines


def _plots(out: str, task: Task, summary: dict[str, dict[str, Any]], plt) -> list[str]:
  done = {k: s for k, s in summary.items() if any(r.get("status") == "ok"
                                                  for r in s["records"])}
  if not done:
    return []
  names = []
  fig, ax = plt.subplots(figsize=(8, 5))
  for name, s in done.items():
    curves = [np.asarray(r["curve"]) for r in s["records"] if r.get("curve")]
    if curves:
      n = min(len(c) for c in curves)
      c = np.mean([c[:n] for c in curves], axis=0)
      ax.plot(c[:, 0], c[:, 1], lw=0.8, label=name)
  ax.set(xlabel="step", ylabel="training loss (mean over seeds)", title=task.name)
  if len(done) <= 12:
    ax.legend(fontsize=6)
  names.append(_save(fig, out, f"{task.name}_loss.png", plt))
  fig, ax = plt.subplots(figsize=(7, 5))
  for name, s in done.items():
    rs = [r for r in s["records"] if r.get("status") == "ok"]
    speed, value = _mean_of(rs, "tokens_per_s"), _mean_of(rs, "value")
    if speed and value is not None:
      ax.scatter(speed, value, s=12)
      ax.annotate(name.split(":", 1)[-1], (speed, value), fontsize=5)
  ax.set(xscale="log", xlabel="training tokens/s (this machine)", ylabel=task.metric,
         title=f"{task.name}: speed against quality")
  names.append(_save(fig, out, f"{task.name}_speed_quality.png", plt))
  lengths = sorted({int(k[3:].split("/")[0]) for s in done.values() for r in s["records"]
                    for k in r.get("results", {}) if k.startswith("len")})
  if lengths:
    kind = task.metric.split("/")[-1]  # loss or accuracy
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, s in done.items():
      rs = [r["results"] for r in s["records"] if r.get("status") == "ok"]
      ys = [_mean_of(rs, f"len{t}/{kind}") for t in lengths]
      ax.plot(lengths, ys, marker="o", lw=0.8, label=name)
    ax.set(xscale="log", xlabel="evaluation length T", ylabel=f"held-out {kind}",
           title=f"held-out {kind} against evaluation length (trained at the first)")
    if len(done) <= 12:
      ax.legend(fontsize=6)
    names.append(_save(fig, out, f"{task.name}_{kind}_vs_length.png", plt))
  return names


def _save(fig, out: str, name: str, plt) -> str:
  fig.tight_layout()
  fig.savefig(os.path.join(out, name), dpi=110)
  plt.close(fig)
  return name


def _unit_seconds(records: Sequence[dict[str, Any]], task: str, protocol: str
                  ) -> float | None:
  """The mean CPU seconds of a finished unit (its five runs, the compilation included; the
  wall time of a shared machine counts the other tenants' share too). A unit's records at rates
  outside the task's sweep (a sweep moved after they were recorded) are taken out at the
  unit's median run cost (the compilation, in its first record, stays in)."""
  summary = _summaries(records, TASKS[task], protocol)
  by_entrant: dict[str, list[float]] = {}
  for r in records:
    if r["task"] == task and r["protocol"] == protocol:
      by_entrant.setdefault(r["entrant"], []).append(r.get("cpu_seconds", r["seconds"]))
  runs = len(TASKS[task].lrs) + len(SEEDS) - 1
  full = [sum(v) - max(len(v) - runs, 0) * float(np.median(v)) for name, v in by_entrant.items()
          if name in summary and summary[name]["n"] == len(SEEDS)]
  return float(np.mean(full)) if full else None


def _cost_section(out: str, records: Sequence[dict[str, Any]], protocol: str) -> list[str]:
  lines = ["## Entrants and cost", ""]
  counts = {t: len(entrants(t)) for t in TASKS}
  per_unit = len(TASKS["lm"].lrs) + len(SEEDS) - 1
  cost_path = os.path.join(out, "cost.json")
  cost: dict[str, Any] = {}
  if os.path.exists(cost_path):
    with open(cost_path) as f:
      cost = json.load(f)
  lines += ["| task | entrants | runs (3 sweep + 2 seeds each) | compile s (wall / CPU) | "
            "s / run (wall / CPU) | hours | source |", "|---|---|---|---|---|---|---|"]
  total, unmeasured = 0.0, []
  for t in TASKS:
    measured = _unit_seconds(records, t, protocol)
    timing = cost.get("tasks", {}).get(t, {})
    if measured is not None:
      unit, source = measured, "recorded units (CPU s)"
    elif timing:
      # CPU seconds: what the work costs an unshared machine (the wall time of a shared one
      # counts the other tenants' share too); a run measured at another step budget is
      # scaled to the task's (the evaluation's share is small)
      scale = TASKS[t].config["steps"] / timing.get("steps", TASKS[t].config["steps"])
      unit = timing.get("compile_cpu_s", timing["compile_s"]) + per_unit * scale * timing.get(
          "run_cpu_s", timing["run_s"])
      source = "cost.json (CPU s" + (f", commit {timing['commit'][:7]}" if "commit" in timing
                                     else "") + ")" + (
          f", runs scaled x{scale:.2f} from {timing.get('steps')} to "
          f"{TASKS[t].config['steps']} steps" if scale != 1 else "")
    else:
      unit, source = None, "not measured"
    hours = unit * counts[t] / 3600 if unit is not None else None
    total += hours or 0.0
    if hours is None:
      unmeasured.append(t)
    lines.append(f"| {t} | {counts[t]} | {counts[t] * per_unit} | "
                 f"{_fmt(timing.get('compile_s'), '.0f')} / "
                 f"{_fmt(timing.get('compile_cpu_s'), '.0f')} | "
                 f"{_fmt(timing.get('run_s'), '.1f')} / {_fmt(timing.get('run_cpu_s'), '.1f')} "
                 f"| {_fmt(hours, '.2f')} | {source} |")
  lines += ["", f"Total: about **{total:.1f} CPU-hours**" + (
      f" for the measured tasks ({', '.join(unmeasured)} not yet: the first units of the zoo, "
      "the reference entrants', give their cost)" if unmeasured else "") + ". A unit (one entrant on one task: five "
                "runs) compiles its step once (the learning rate lives in the optimizer state, "
                "`train.zoo.scale_by_lr_state`). `cost.json`: `python -m train.zoo cost`, the "
                "softmax entrant, two runs per task"
                + (f", on {cost.get('machine', '?')}: "
                   + " ".join(dict.fromkeys(
                       f"{v.get('date', cost.get('date', '?'))} (commit "
                       f"{v.get('commit', cost.get('commit', '?'))[:7]}): "
                       f"{v.get('note', cost.get('note', ''))}"
                       for v in cost.get("tasks", {}).values()))
                   if cost else "") + "; once units are recorded their mean replaces it.", "",
            "Run it all with `make zoo` (resumable: a finished record is never rerun), or in "
            "parts across sessions: `python -m train.zoo run --parts i/n` for i = 1 .. n "
            "(interleaved slices of about equal cost), or a selection with `--only task=mqar "
            "entrant=normalizer:softmax`; then `python -m train.zoo report`.", ""]
  lines += ["Left out (by a declared property):", ""]
  lines += [f"- `{k}`: {v}" for k, v in exclusions().items()] + [""]
  return lines


def measure_cost(out: str = DEFAULT_OUT, note: str = "", tasks: Sequence[str] = ()
                 ) -> dict[str, Any]:
  """Times two runs per task of the softmax entrant (the loss task: softmax CE) at seed 0 and
  the sweep's middle rate: the first compiles (``compile_s`` = its extra time), the second is
  a unit's other runs (``run_s``); writes ``out/cost.json`` (``tasks``: only these, the other
  tasks' entries kept; each entry carries its commit and date). Nothing goes to
  results.jsonl."""
  timings = {}
  stamp = {"commit": _commit(), "date": datetime.datetime.now(datetime.UTC).isoformat(
      timespec="seconds"), "note": note, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  for name, task in TASKS.items():
    if tasks and name not in tasks:
      continue
    entrant = entrants(name)[0] if task.loss_task else Entrant("normalizer:softmax",
                                                               {"normalizer": "softmax"})
    times, values = [], []
    for seed in (0, 1):
      began, cpu = time.perf_counter(), time.process_time()
      values.append(train_one(task, entrant, seed, task.lrs[1])["results"])
      times.append((time.perf_counter() - began, time.process_time() - cpu))
    (first, first_cpu), (run_s, run_cpu) = times
    timings[name] = {"compile_s": max(first - run_s, 0.0), "run_s": run_s,
                     "steps": task.config["steps"],
                     "compile_cpu_s": max(first_cpu - run_cpu, 0.0), "run_cpu_s": run_cpu,
                     "entrant": entrant.name, "lr": task.lrs[1],
                     "results_seed0_seed1": values, **stamp}
    print(f"{name}: {timings[name]}", flush=True)
  path = os.path.join(out, "cost.json")
  previous: dict[str, Any] = {}
  if tasks and os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    # (entries of a whole-zoo measurement carry its stamp at the top level)
    previous = {t: {**{k: old[k] for k in stamp if k in old}, **v}
                for t, v in old.get("tasks", {}).items()}
  cost = {"tasks": {**previous, **timings}, "machine": _machine(), "jax": jax.__version__,
          **stamp}
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "cost.json"), "w") as f:
    json.dump(cost, f, indent=2, sort_keys=True)
  return cost


def main(argv: Sequence[str] | None = None) -> int:
  """The command line: ``list``, ``run``, ``cost``, ``report``."""
  parser = argparse.ArgumentParser(prog="python -m train.zoo", description=__doc__.split("\n")[0])
  parser.add_argument("command", choices=("list", "run", "cost", "report"))
  parser.add_argument("--out", default=DEFAULT_OUT, help="where results.jsonl, README.md go")
  parser.add_argument("--only", nargs="+", default=[], metavar="KEY=A,B",
                      help="task=... and/or entrant=... (comma-separated)")
  parser.add_argument("--parts", default="1/1", help="i/n: the i-th of n slices")
  parser.add_argument("--limit", type=int, default=None, help="stop after N new records")
  parser.add_argument("--tiny", action="store_true", help="CI sizes (a protocol of their own)")
  parser.add_argument("--note", default="", help="cost: a remark stored with the timings")
  args = parser.parse_args(argv)
  if args.command == "list":
    for t in TASKS:
      names = [e.name for e in entrants(t)]
      print(f"{t} ({len(names)}): {', '.join(names)}")
    for k, v in exclusions().items():
      print(f"excluded {k}: {v}")
  elif args.command == "run":
    run_zoo(args.out, args.only, args.parts, args.limit, args.tiny)
  elif args.command == "cost":
    measure_cost(args.out, args.note, sorted(_parse_only(args.only).get("task", ())))
  else:
    guide = DOCS_GUIDE if not args.tiny and os.path.abspath(args.out) == DEFAULT_OUT else None
    print(write_report(args.out, args.tiny, guide))
  return 0


if __name__ == "__main__":
  sys.exit(main())
