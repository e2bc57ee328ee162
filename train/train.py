r"""Train a small decoder LM with a jaxsoft attention normalizer.

From the repository root (``make demo`` makes ``.venv`` with the library and its ``train`` extra):

    .venv/bin/python train/train.py --help                 # every flag, by topic, with its default
    .venv/bin/python train/train.py --preset smoke --workdir runs/smoke   # ~1 min on 2 CPU cores
    .venv/bin/python train/train.py --preset charlm --workdir runs/lm --normalizer sparsemax
    .venv/bin/python train/train.py --preset smoke --workdir runs/cmp \
        --compare softmax,sigmoid,ssmax
    .venv/bin/python train/train.py --preset smoke --workdir runs/dp --num_cpu_devices 8
    .venv/bin/python train/train.py --preset smoke --workdir runs/4d --num_cpu_devices 8 \
        --mesh data=2,fsdp=2,context=2           # tensor=N too; see docs/training.md
    .venv/bin/python train/train.py --preset smoke --workdir runs/ent --normalizer entmax \
        --learned alpha                          # alpha per layer and head: learned.png
    .venv/bin/python train/train.py --preset smoke --workdir runs/gdn --num_layers 4 \
        --layers gated_delta_rule,gated_delta_rule,gated_delta_rule,softmax   # a 3:1 hybrid
    .venv/bin/python train/sample.py --workdir runs/gdn --prompt "def " --length 200  # generate
    .venv/bin/python train/train.py --preset tpu_pod --workdir gs://BUCKET/run  # pip install .[tpu]

``main`` only wires config -> mesh -> data -> state -> loop; ``train_step(state, batch) -> (state,
metrics)`` is one pure jitted function; checkpoints and logging happen at the edges. Re-running a
command with the same --workdir resumes from its newest checkpoint that restores, bit for bit (a
damaged newer one is moved to checkpoints_damaged/ and named in the log). The held-out loss is
evaluated every --eval_every steps and at the end (``eval_loss`` in metrics.jsonl).

Progress: a run estimated (from its FLOPs against the device class, :func:`estimate_seconds`)
to take more than ten minutes says so before it starts, and the log says the measured time left
after the first steps; the tqdm bar shows the step, loss, tokens/s and time left. At each log
step the learned hyperparameters (``--learned``) and the A07 output gates go to metrics.jsonl
per layer and head (``learned/alpha/layer0/head3``, ``gate/layer1/head0``), to TensorBoard with
``--tensorboard``, and at the end to ``learned.png``.

Exit status: 0 when every step is done; 2 for a bad command line or configuration (nothing
written; an --init_from checkpoint of another architecture is one, naming the parameter);
3 when a step's loss or gradient norm is not finite, or a --check_numerics check fails (the
step is not taken and nothing of it is saved; the message names the check); 143 (128 + SIGTERM)
when SIGTERM stopped the run after saving its step: not finished, so a scheduler does not take
it for done. ``--check_numerics`` checkifies the train step with ``jaxsoft.checks``: every
learned normalizer hyperparameter in its declared range, the loss and each gradient finite.
Without it a traced hyperparameter outside its range is computed as given (for entmax's alpha,
NaN rows) and only a non-finite loss or gradient norm stops the run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

if __name__ == "__main__" and not __package__:
  # Run as a script: make the repository root importable so `train` is this package, not this file.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from etils import epath  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import checkify  # noqa: E402

from jaxsoft import checks  # noqa: E402
from jaxsoft.normalizers.common import safe_divide  # noqa: E402
from train import checkpoint, config, data, metrics, model, sharding  # noqa: E402
from train.config import Config, ConfigError  # noqa: E402

__all__ = ["main", "run", "make_optimizer", "make_train_step", "make_eval_step", "init_state",
           "check_learned", "learned_stats", "per_head", "flops_per_step", "estimate_seconds",
           "long_run_warning", "LONG_RUN_SECONDS", "EXIT_NONFINITE", "EXIT_USAGE",
           "EXIT_PREEMPTED"]

EXIT_NONFINITE = 3  # a non-finite loss or gradient norm, or a failed --check_numerics check
EXIT_USAGE = 2  # a bad command line or configuration, as argparse exits
# Stopped by SIGTERM after saving: not finished, so not 0 (a scheduler must not take the run for
# done); 128 + 15, the status a shell reports for a process that SIGTERM ended.
EXIT_PREEMPTED = 128 + signal.SIGTERM


# ---------------------------------------------------------------------------------------------
# The math: optimizer, loss, train step (pure functions).


def make_schedule(cfg: Config) -> optax.Schedule:
  """Linear warm-up to the peak, then cosine decay to ``min_lr_ratio`` of it at the last step."""
  warmup = min(cfg.warmup_steps, cfg.steps)  # a preset's warm-up may exceed a short --steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
      decay_steps=max(cfg.steps, warmup + 1),
      end_value=cfg.learning_rate * cfg.min_lr_ratio)


def decay_mask(params: Any) -> Any:
  """Weight decay on the dense matrices (and an untied output matrix) only: not on norm scales,
  biases, the (tied) embedding, the linear layers' convolution filters and decay parameters, or
  Multi-Token Attention's kernel (which starts at the identity)."""

  def decays(path, leaf):
    names = [getattr(k, "key", getattr(k, "name", "")) for k in path]
    return leaf.ndim >= 2 and names[-1] in ("kernel", "unembed") and "embed" not in names

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW with warm-up + cosine decay, after global-norm clipping."""
  adamw = optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                      mask=decay_mask)
  if cfg.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  return adamw


def loss_sums(graphdef, params, batch) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted token cross-entropies, sum of weights) of one micro-batch.

  The cross-entropy is ``Transformer.token_losses``: by default (``--loss linear_ce``) computed
  from the final hidden states and the output matrix without materialising the logits.
  """
  losses = nnx.merge(graphdef, params).token_losses(batch["inputs"], batch["targets"])
  return jnp.sum(losses * batch["weights"]), jnp.sum(batch["weights"])


def check_learned(graphdef, params) -> None:
  """``jaxsoft.checks`` checks of every learned normalizer hyperparameter, named by layer.

  The values are those the forward pass uses (``Attention.learned_values``: the free parameters
  mapped into the declared range), so what can fail is a NaN (a free parameter the optimizer
  made NaN) or a value the map rounds onto an open bound.
  """
  net = nnx.merge(graphdef, params)
  for i, block in enumerate(net.blocks):
    learned = getattr(block.attn, "learned_values", None)
    if learned is not None:
      checks.check_hparams(block.attn.normalizer, learned(),
                           context=f" (learned, layer {i}: params blocks/{i}/attn/learned)")


def learned_stats(graphdef, params, tokens: jax.Array) -> dict[str, jax.Array]:
  """The learned hyperparameters of every normalizer block, ``{key: [num_heads]}``.

  ``learned/NAME/layerI``: the values the forward pass uses (``Attention.learned_values``: alpha,
  s, sink_logit, temperature, ... as ``--learned`` names them), one per head. ``gate/layerI``:
  for ``--attention gated`` (A07), the mean over ``tokens [B, T]`` of each head's output gate
  sigma(x W_theta), which depends on the input (so it is measured on a slice of a batch, like
  ``attention_stats``). Blocks past the last gated one are not run.
  """
  net = nnx.merge(graphdef, params)
  out: dict[str, jax.Array] = {}
  gated = [i for i, block in enumerate(net.blocks)
           if block.kind in config.ATTENTION_VARIANTS and block.attn.gate is not None]
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  x = net.embed(tokens) if gated else None
  for i, block in enumerate(net.blocks):
    if block.kind in config.ATTENTION_VARIANTS:
      for name, values in block.attn.learned_values().items():
        out[f"learned/{name}/layer{i}"] = values
    if gated and i <= gated[-1]:
      if i in gated:
        gate = jax.nn.sigmoid(block.attn.gate(block.attn_norm(x)).astype(jnp.float32))
        out[f"gate/layer{i}"] = jnp.mean(gate, axis=(0, 1))
      x = block(x, positions)
  return out


def per_head(stats: dict[str, Any]) -> dict[str, float]:
  """``{key: [num_heads]}`` -> ``{key/headH: value}`` floats, the flat records of metrics.jsonl."""
  return {f"{key}/head{h}": float(v) for key, values in stats.items()
          for h, v in enumerate(list(values))}


def make_train_step(graphdef, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    check_numerics: bool = False):
  """``train_step(state, batch) -> (state, metrics)`` for batches ``[grad_accum, micro, T]``.

  Gradients of the summed loss are accumulated over the micro-batches with ``lax.scan`` and divided
  by the total weight once, so the update equals that of one big batch of the token-mean loss.

  ``check_numerics``: the step also records ``checkify`` checks (run it under
  ``checkify.checkify``): the learned hyperparameters in range (:func:`check_learned`), the loss
  and each gradient finite, named by parameter path. Without them only the caller's test of the
  loss and gradient norm sees a bad value, and a traced out-of-range hyperparameter is computed as
  given.
  """

  def train_step(state, batch):
    params = state["params"]
    if check_numerics:
      check_learned(graphdef, params)
    grad_fn = jax.value_and_grad(lambda p, mb: loss_sums(graphdef, p, mb), has_aux=True)

    def micro_step(carry, micro_batch):
      grads, loss_sum, weight_sum = carry
      (loss, weight), g = grad_fn(params, micro_batch)
      return (jax.tree.map(jnp.add, grads, g), loss_sum + loss, weight_sum + weight), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss_sum, weight_sum), _ = jax.lax.scan(
        micro_step, (zeros, jnp.float32(0), jnp.float32(0)), batch)
    grads = jax.tree.map(lambda g: safe_divide(g, weight_sum), grads)
    if check_numerics:
      checks.check_finite(loss_sum, "loss")
      checks.check_finite(grads, "gradient of params")
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    # The step key is split every step so a resumed run draws the same randomness.
    rng, _ = jax.random.split(jax.random.wrap_key_data(state["rng"]))
    new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                 "opt_state": opt_state, "rng": jax.random.key_data(rng)}
    step_metrics = {"loss": safe_divide(loss_sum, weight_sum), "grad_norm": optax.tree.norm(grads),
                    "learning_rate": schedule(state["step"])}
    return new_state, step_metrics

  return train_step


def make_eval_step(graphdef):
  """``eval_step(params, batch) -> (loss sum, weight sum)`` over a ``[grad_accum, micro, T]`` batch."""

  def eval_step(params, batch):
    def micro_step(carry, micro_batch):
      loss, weight = loss_sums(graphdef, params, micro_batch)
      return (carry[0] + loss, carry[1] + weight), None

    (loss_sum, weight_sum), _ = jax.lax.scan(micro_step, (jnp.float32(0), jnp.float32(0)), batch)
    return loss_sum, weight_sum

  return eval_step


def evaluate(eval_step, params, batches) -> float:
  """The token-mean loss over ``batches`` (the held-out split)."""
  sums = [jax.device_get(eval_step(params, batch)) for batch in batches]
  weight = sum(float(w) for _, w in sums)
  return sum(float(loss) for loss, _ in sums) / weight if weight > 0 else float("nan")


def init_state(cfg: Config, graphdef, params, optimizer) -> dict[str, Any]:
  return {"step": jnp.int32(0), "params": params, "opt_state": optimizer.init(params),
          "rng": jax.random.key_data(jax.random.key(cfg.seed + 1))}


# ---------------------------------------------------------------------------------------------
# How long a run will take: a rough estimate from its size, said before a long run starts.

LONG_RUN_SECONDS = metrics.LONG_RUN_SECONDS  # a run estimated longer says so first

# Matmul FLOP/s a train step achieves, by device class: measured on CPU (the smoke and charlm
# presets reach 14-15 GFLOP/s per core by the count of flops_per_step on a 2-core machine, 44k
# and 1.3k tokens/s), else 30% of the dense bf16 peak of the device's data sheet (GPUs run float32
# matmuls as TF32, half that peak). The first match of a substring of jax's device_kind wins.
CPU_FLOPS_PER_CORE = 15e9
_PEAK_FLOPS = (("h200", 989e12), ("h100", 989e12), ("b200", 2250e12), ("a100", 312e12),
               ("l4", 121e12), ("a10", 125e12), ("v100", 125e12), ("t4", 65e12),
               ("v6", 918e12), ("v5p", 459e12), ("v5", 197e12), ("v4", 275e12), ("v3", 123e12),
               ("v2", 45e12))
_DEFAULT_PEAK = {"gpu": 100e12, "tpu": 197e12}
_ACCELERATOR_MFU = 0.3
# Time a step costs whatever its size (dispatch, the host-side batch, the metrics fetch).
_STEP_OVERHEAD_S = {"cpu": 1e-3, "gpu": 3e-3, "tpu": 3e-3}


def flops_per_step(cfg: Config, vocab_size: int) -> float:
  """Matmul FLOPs of one optimizer step: 3x the forward pass (forward + backward) of every token.

  The forward pass of a token costs 2 FLOPs per multiply-add of: the q, k, v, o projections
  (and the A07 gate) of each block, its attention scores and weighted values against all
  ``seq_len`` keys (the dense computation; linear and sparse layers are counted as if they were
  dense attention, an upper bound), the MLP, and the output layer. Element-wise work is not
  counted.
  """
  d, t, hd = cfg.d_model, cfg.seq_len, cfg.head_dim
  per_token = 2.0 * d * vocab_size  # the output layer
  for kind in config.layer_kinds(cfg):
    projections = d * (2 * cfg.num_heads + 2 * cfg.kv_heads) * hd
    gate = d * cfg.num_heads if kind == "gated" else 0
    mixing = 2 * t * cfg.num_heads * hd  # q k^T and weights @ v
    per_token += 2.0 * (projections + gate + mixing + 2 * d * cfg.mlp_dim)
  return 3.0 * per_token * cfg.batch_size * cfg.seq_len


def _evaluations(cfg: Config) -> int:
  return (cfg.steps // cfg.eval_every if cfg.eval_every > 0 else 0) + (
      0 if cfg.eval_every > 0 and cfg.steps % cfg.eval_every == 0 else 1)


def estimate_seconds(cfg: Config, vocab_size: int, *, platform: str, device_kind: str = "",
                     devices: int = 1, cpu_cores: int = 1) -> tuple[float, str]:
  """A rough wall time of training ``cfg`` from step 0 (compilation not included), and the
  assumption it rests on: FLOPs (:func:`flops_per_step` x steps, plus the held-out evaluations
  at a third of a step's per batch of ``grad_accum`` micro-batches) against the FLOP/s of the
  device class (``CPU_FLOPS_PER_CORE`` x ``cpu_cores`` on CPU however many fake devices share
  them; 30% of the bf16 peak of each accelerator), plus a fixed overhead per step.
  """
  step_flops = flops_per_step(cfg, vocab_size)
  total = step_flops * (cfg.steps + _evaluations(cfg) * cfg.eval_batches / 3.0)
  if platform == "cpu":
    rate = CPU_FLOPS_PER_CORE * cpu_cores
    where = f"{cpu_cores} CPU core{'s' if cpu_cores > 1 else ''}"
  else:
    kind = device_kind.lower()
    peak = next((p for name, p in _PEAK_FLOPS if name in kind),
                _DEFAULT_PEAK.get(platform, 100e12))
    tf32 = platform == "gpu" and cfg.dtype == "float32"
    rate = peak * _ACCELERATOR_MFU * (0.5 if tf32 else 1.0) * devices
    where = f"{devices} x {device_kind or platform}"
  seconds = total / rate + cfg.steps * _STEP_OVERHEAD_S.get(platform, 3e-3)
  return seconds, (f"{step_flops:.2g} FLOPs per step x {cfg.steps} steps on {where} at an "
                   f"assumed {rate:.2g} FLOP/s")


def long_run_warning(cfgs: Sequence[Config], vocab_size: int, **device) -> str | None:
  """The line a run (or a --compare of several) estimated past ``LONG_RUN_SECONDS`` prints
  before it starts; None when it is shorter. ``device``: :func:`estimate_seconds`'s keywords."""
  estimates = [estimate_seconds(cfg, vocab_size, **device) for cfg in cfgs]
  seconds = sum(s for s, _ in estimates)
  if seconds <= LONG_RUN_SECONDS:
    return None
  runs = f" for the {len(cfgs)} --compare runs" if len(cfgs) > 1 else ""
  return (f"note: training {cfgs[0].steps} steps takes about {metrics.format_duration(seconds)}"
          f"{runs} on this machine "
          f"(estimated from the model's size: {estimates[0][1]}; a rough figure, compilation "
          "not included); the log shows the measured time left after the first steps.")


def _device_estimate() -> dict[str, Any]:
  """:func:`estimate_seconds`'s device keywords for the devices this process sees."""
  first = jax.devices()[0]
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return dict(platform=first.platform, device_kind=getattr(first, "device_kind", ""),
              devices=jax.device_count(), cpu_cores=cores or 1)


# ---------------------------------------------------------------------------------------------
# The edges: signals, checkpoints, logging, the loop.


class _StopFlag:
  """Set by SIGTERM: the loop saves a checkpoint after the current step and returns
  ``EXIT_PREEMPTED`` (unless that step was the last: then the run is done, status 0)."""

  def __init__(self):
    self.requested = False

  def __call__(self, signum, frame):  # signal handler
    del frame
    self.requested = True
    print(f"received signal {signum}: saving a checkpoint and stopping", flush=True)


def build(cfg: Config, mesh):
  """Model, optimizer, sharded initial state and its abstract twin (shapes + shardings)."""
  dataset = data.make_dataset(cfg.dataset, cfg.seq_len, cfg.batch_size, cfg.seed)
  wrap = sharding.shard_map_attention(mesh) if sharding.needs_shard_map(cfg) else None
  if cfg.context_strategy != "gspmd" and mesh.shape[sharding.CONTEXT] > 1:
    # (each device runs --implementation on its shards inside the strategy's shard_map)
    wrap = sharding.context_parallel_wrap(mesh, cfg.context_strategy)
  abstract_model = nnx.eval_shape(
      lambda: model.make_model(cfg, dataset.vocab_size, cfg.seed, wrap=wrap))
  graphdef, abstract_params = nnx.split(abstract_model)
  axes = sharding.logical_axes(abstract_params)  # the parameters' logical axis names
  abstract_params = nnx.to_pure_dict(abstract_params)
  optimizer = make_optimizer(cfg)

  def init():
    params = nnx.to_pure_dict(nnx.state(
        model.make_model(cfg, dataset.vocab_size, cfg.seed, wrap=wrap)))
    return init_state(cfg, graphdef, params, optimizer)

  abstract_state = jax.eval_shape(init)
  state_sharding = sharding.state_sharding(mesh, abstract_state, axes)
  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state,
      state_sharding)
  init_fn = jax.jit(init, out_shardings=state_sharding)
  return dataset, graphdef, optimizer, init_fn, abstract_state, state_sharding, wrap


def run(cfg: Config, mesh) -> int:
  """Trains ``cfg`` on ``mesh``; returns the process exit code."""
  is_main = jax.process_index() == 0
  workdir = epath.Path(cfg.workdir)
  dataset, graphdef, optimizer, init_fn, abstract_state, state_sharding, _ = build(cfg, mesh)
  schedule = make_schedule(cfg)
  ckpt = checkpoint.Checkpointer(cfg.workdir, cfg.max_to_keep, cfg.save_every)

  # The newest checkpoint that restores; damaged newer ones are moved aside (kept) and named.
  latest, state, meta, skipped = ckpt.restore_newest(abstract_state, is_main=is_main)
  if latest is not None:
    position = int(meta["data_position"])
    start = f"resumed from step {latest} in {ckpt.directory}"
  else:
    state, position = init_fn(), 0
    start = "fresh start"
    if cfg.init_from:
      params, step = checkpoint.restore_params(cfg.init_from, abstract_state["params"])
      state = dict(state, params=params)
      start = f"parameters from {cfg.init_from} (step {step})"
  if is_main:
    config.append_history(cfg, start_step=latest or 0)

  batch_sharding = sharding.batch_sharding(mesh)
  step_fn = make_train_step(graphdef, optimizer, schedule, check_numerics=cfg.check_numerics)
  out_shardings: Any = (state_sharding, None)
  if cfg.check_numerics:  # (error, (state, metrics)): the error is a small replicated pytree
    step_fn, out_shardings = checkify.checkify(step_fn), (None, out_shardings)
  step_fn = sharding.in_mesh(mesh, step_fn)  # activation constraints while it is traced
  train_step = jax.jit(step_fn, in_shardings=(state_sharding, batch_sharding),
                       out_shardings=out_shardings, donate_argnums=0)
  # At each log step: the attention statistics, and the learned hyperparameters and output
  # gates per layer and head (one program).
  stats_fn = jax.jit(lambda params, tokens: (
      model.attention_stats(nnx.merge(graphdef, params), tokens, cfg),
      learned_stats(graphdef, params, tokens)))
  eval_step = jax.jit(sharding.in_mesh(mesh, make_eval_step(graphdef)))
  held_out = dataset.held_out()
  eval_batches = [sharding.global_batch(held_out, i, cfg, batch_sharding)
                  for i in range(cfg.eval_batches)]

  step = int(jax.device_get(state["step"]))
  log = metrics.MetricsLogger(
      cfg.workdir, start_step=step, total_steps=cfg.steps,
      tokens_per_step=cfg.batch_size * cfg.seq_len, progress=cfg.progress,
      tensorboard=cfg.tensorboard, enabled=is_main)
  n_params = sum(x.size for x in jax.tree.leaves(abstract_state["params"]))
  for skip in skipped:
    log.message(skip.describe())
  mesh_text = ",".join(f"{k}={v}" for k, v in mesh.shape.items())
  log.message(f"{start}; {n_params:,} parameters; {jax.device_count()} device(s) "
              f"({jax.devices()[0].platform}, mesh {mesh_text}); normalizer={cfg.normalizer} "
              f"attention={cfg.attention}"
              + (f" layers={','.join(config.layer_kinds(cfg))}" if cfg.layers else ""))

  stop = _StopFlag()
  previous_handler = _install(signal.SIGTERM, stop)
  handler_installed = signal.getsignal(signal.SIGTERM) is stop
  code = 0
  try:
    while step < cfg.steps:
      batch = sharding.global_batch(dataset, position, cfg, batch_sharding)
      failed = None  # (what failed, details): the step is not taken, nothing of it saved
      if cfg.check_numerics:
        error, (new_state, step_metrics) = train_step(state, batch)
        if error.get() is not None:
          failed = (f"--check_numerics: {error.get()}", "")
      else:
        new_state, step_metrics = train_step(state, batch)
      step_metrics = jax.device_get(step_metrics)
      if failed is None and not all(math.isfinite(float(step_metrics[k]))
                                    for k in ("loss", "grad_norm")):
        failed = ("non-finite loss/grad_norm", f" (loss={step_metrics['loss']}, "
                  f"grad_norm={step_metrics['grad_norm']})")
      if failed is not None:
        ckpt.wait()  # let an in-flight save finish so it counts as the last good one
        last = ckpt.latest_step()
        what, details = failed
        log.message(
            f"error: {what} at step {step + 1}{details}; stopped without saving. The last good "
            f"checkpoint is step {last} in {ckpt.directory}" if last is not None else
            f"error: {what} at step {step + 1}; stopped; no checkpoint yet")
        code = EXIT_NONFINITE
        break
      state, step, position = new_state, step + 1, position + 1
      log.step_done(step, loss=float(step_metrics["loss"]))
      # Every step goes to metrics.jsonl; every log_every-th also to the console with the
      # attention statistics (one layer, one sequence: cheap).
      final = step == cfg.steps
      evaluated = final or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
      echo = step % cfg.log_every == 0 or evaluated
      if echo:
        tokens = batch["inputs"][0, :1]
        stats, learned = jax.device_get(stats_fn(state["params"], tokens))
        step_metrics = {**step_metrics, **stats, **per_head(learned)}
      if evaluated:  # the held-out loss: the same batches every time
        step_metrics = {**step_metrics,
                        "eval_loss": evaluate(eval_step, state["params"], eval_batches)}
      log.log(step, step_metrics, echo=echo)
      if echo:
        log.flush()
      if step == cfg.preempt_at_step:  # testing: exercise the real SIGTERM path
        if handler_installed:
          os.kill(os.getpid(), signal.SIGTERM)
          _wait_for(stop)
        else:  # not the main thread (signals cannot be caught here): call the handler itself
          stop(signal.SIGTERM, None)
      if ckpt.save(step, state, position, force=final or stop.requested):
        log.flush()  # metrics.jsonl holds every step up to each checkpoint
      if step == cfg.kill_after_save_at_step:  # testing: die while the async save is in flight
        os.kill(os.getpid(), signal.SIGKILL)
      if stop.requested and not final:
        ckpt.wait()  # the forced save is on disk before the exit status says "stopped"
        log.message(f"stopped at step {step} (SIGTERM); checkpoint saved in {ckpt.directory}; "
                    f"exit status {EXIT_PREEMPTED}; run the same command again to resume")
        code = EXIT_PREEMPTED
        break
  finally:
    ckpt.close()
    log.close()
    if handler_installed:
      _install(signal.SIGTERM, previous_handler)
  if code == 0 and step == cfg.steps and is_main:
    title = f"{cfg.dataset}, normalizer={cfg.normalizer}"
    plot = metrics.plot_run(cfg.workdir, title)
    learned_plot = metrics.plot_learned(cfg.workdir, title)
    log.message(f"done: {step} steps.\n  metrics:     {workdir / 'metrics.jsonl'}\n"
                f"  checkpoints: {ckpt.directory}\n  loss plot:   {plot}"
                + (f"\n  learned:     {learned_plot}" if learned_plot else ""))
  return code


def _install(signum, handler):
  """Installs a signal handler when possible (only the main thread may); returns the old one."""
  try:
    return signal.signal(signum, handler)
  except ValueError:
    return None


def _wait_for(stop: _StopFlag, timeout: float = 5.0) -> None:
  deadline = time.monotonic() + timeout
  while not stop.requested and time.monotonic() < deadline:
    time.sleep(0.01)


def compare(cfg: Config, mesh, names: Sequence[str]) -> int:
  """Trains each normalizer on identical data and seeds; writes compare.md and compare.png.

  A run that does not finish (non-finite, SIGTERM) stops the comparison with its exit status.
  """
  runs = []
  for sub in _runs(cfg, names):
    code = run(sub, mesh)
    if code:
      return code
    runs.append(sub.workdir)
  if jax.process_index() == 0:
    md, png = metrics.write_comparison(cfg.workdir, names, runs)
    print(epath.Path(md).read_text(), end="")
    print(f"table: {md}\nplot: {png}")
  return 0


def _runs(cfg: Config, names: Sequence[str]) -> list[Config]:
  """The configs that will train: ``cfg``, or one per --compare normalizer (own workdir)."""
  if not names:
    return [cfg]
  return [dataclasses.replace(cfg, normalizer=name,
                              workdir=str(epath.Path(cfg.workdir) / "compare" / name))
          for name in names]


def _check_resumable(cfg: Config) -> None:
  saved = epath.Path(cfg.workdir) / "config.json"
  if saved.exists():
    config.check_resume_compatible(cfg, config.load(str(saved)))


def _check_init_from(cfg: Config) -> None:
  """Refuses an --init_from checkpoint whose parameters are not this model's (names the first
  mismatched one, its path and shapes), from the metadata alone, before anything is written."""
  if not cfg.init_from:
    return
  vocab = data.make_dataset(cfg.dataset, cfg.seq_len, cfg.batch_size, cfg.seed).vocab_size
  abstract = nnx.eval_shape(lambda: model.make_model(cfg, vocab, cfg.seed))
  try:
    checkpoint.check_params(cfg.init_from, nnx.to_pure_dict(nnx.state(abstract)))
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"--init_from: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point: parse and check everything, then train (or compare). Returns the exit code.

  A bad command line or configuration exits with status 2 and one ``train.py: error: ...`` line
  on stderr (as argparse does), before anything is written to the workdir.
  """
  try:
    cfg, args = config.from_argv(argv)
    names = [n for n in args.compare.split(",") if n]
    # Every run must be valid (and resumable) before any starts. With --compare, the runs are
    # the configs to check: --normalizer (and what --learned names in it) is replaced by each
    # compared normalizer, so it is not checked on its own.
    if not cfg.workdir:  # (each compared run's workdir is under it)
      raise ConfigError("--workdir is required")
    for sub in _runs(cfg, names):
      config.validate(sub, check_workdir=False)
      _check_resumable(sub)
    if cfg.tensorboard:
      try:
        import tensorboardX  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
      except ImportError:
        raise ConfigError("--tensorboard needs the tensorboardX package") from None
    sharding.setup_devices(cfg)
    mesh = sharding.make_mesh(cfg)
    config.check_implementation(cfg)
    for sub in _runs(cfg, names):  # (after setup_devices: this builds the abstract model)
      _check_init_from(sub)
    config.prepare_workdir(cfg.workdir)  # the first write, once everything else is checked
  except ConfigError as e:
    print(f"train.py: error: {e}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE) from None
  if jax.process_index() == 0:  # a long run says so before it starts (resumed: the whole run)
    vocab = data.make_dataset(cfg.dataset, cfg.seq_len, cfg.batch_size, cfg.seed).vocab_size
    warning = long_run_warning(_runs(cfg, names), vocab, **_device_estimate())
    if warning:
      print(warning, flush=True)
  if names:
    return compare(cfg, mesh, names)
  return run(cfg, mesh)


if __name__ == "__main__":
  sys.exit(main())
