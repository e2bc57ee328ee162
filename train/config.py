"""The training configuration: a frozen dataclass, presets, and a command line made from its fields.

Resolution order (later wins): the dataclass defaults, the ``--preset``, ``--set key=value`` pairs,
then explicit ``--field value`` flags. The resolved config is saved as ``config.json`` in the
workdir, and each start (fresh or resumed) appends it to ``config_history.jsonl``. Resuming with a
different *model* config (``MODEL_FIELDS``) is refused; so is a different learning-rate schedule
(``SCHEDULE_FIELDS``: --steps, --learning_rate, --warmup_steps, --min_lr_ratio) unless
``--reschedule`` says to recompute it. Files go through etils.epath, so a ``gs://`` workdir works.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import typing
import uuid
from collections.abc import Sequence
from typing import Any

from jaxsoft import normalizers
from kernels_pallas import pick_backend
from train import checkpoint, mesh_flags
from train.errors import ConfigError
from train.kinds import (
  ATTENTION_VARIANTS,
  BIDIRECTIONAL_KINDS,
  CONTROL_KINDS,
  FOX_KINDS,
  LAYER_KINDS,
  LINEAR_KINDS,
  POOLING_KINDS,
  SPARSE_KINDS,
)

__all__ = [
    "Config",
    "ConfigError",
    "PRESETS",
    "GROUPS",
    "MODEL_FIELDS",
    "SCHEDULE_FIELDS",
    "ATTENTION_VARIANTS",
    "LINEAR_KINDS",
    "BIDIRECTIONAL_KINDS",
    "SPARSE_KINDS",
    "LAYER_KINDS",
    "LOSSES",
    "layer_kinds",
    "DATASETS",
    "make_parser",
    "from_argv",
    "validate",
    "save",
    "load",
    "check_resume_compatible",
    "prepare_workdir",
    "check_implementation",
    "learned_names",
    "attention_normalizer",
    "append_history",
    "read_history",
]

# The layer kinds (ATTENTION_VARIANTS, LINEAR_KINDS, BIDIRECTIONAL_KINDS, SPARSE_KINDS,
# LAYER_KINDS) come from the tables of train.kinds: jaxsoft.nn.LINEAR_MIXER_TABLE and
# train.kinds.SPARSE_ATTENTION.
LOSSES = ("linear_ce", "dense")
DATASETS = ("text", "recall", "copy", "sort", "needle")
IMPLEMENTATIONS = (None, "xla", "xla_chunked", "pallas", "pallas_triton", "pallas_mosaic_tpu")
DTYPES = ("float32", "bfloat16")
_SWITCH = ("auto", "on", "off")
# "gspmd", then jaxsoft.attention.context_parallel's strategies (checked against its STRATEGIES).
CONTEXT_STRATEGIES = ("gspmd", "all_gather", "ulysses", "ring")


# The topics of ``train.py --help``: (key, title, description), in the order shown. Each Config
# field names its topic once, in its metadata (``_f``'s first argument); --preset, --set and
# --compare are in RUN.
DATA, MODEL, ATTENTION, OPTIMIZER, EVALUATION, RUN, DISTRIBUTION, LOGGING, TESTING = (
    "data", "model", "attention", "optimizer", "evaluation", "run", "distribution", "logging",
    "testing")
GROUPS: tuple[tuple[str, str, str], ...] = (
    (DATA, "data", "what the model is trained on"),
    (MODEL, "model", "the decoder's size, loss and compute dtype"),
    (ATTENTION, "attention / normalizer",
     "the attention normalizer, its hyperparameters (fixed or learned) and the layer kinds"),
    (OPTIMIZER, "optimizer", "AdamW, the learning-rate schedule and the batch it sees"),
    (EVALUATION, "evaluation", "the held-out loss"),
    (RUN, "checkpointing / run",
     "presets, the workdir, seeds and checkpoints; re-running a command resumes it"),
    (DISTRIBUTION, "distribution", "devices, hosts and parameter sharding"),
    (LOGGING, "logging / monitoring",
     "log lines, the progress bar, TensorBoard and the numerics checks"),
    (TESTING, "testing hooks", "drive the real signal paths in tests (not for normal runs)"),
)


def _f(group: str, default: Any, help_: str, choices: tuple[Any, ...] | None = None) -> Any:
  """A Config field: its --help topic (a key of GROUPS), its default, its --help text and,
  optionally, the values it may take."""
  return dataclasses.field(default=default,
                           metadata={"group": group, "help": help_, "choices": choices})


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on. Field names are the command-line flags."""

  # Data.
  dataset: str = _f(DATA, "text", f"one of {DATASETS}: the pydoc_data corpus (character "
                                  "level) or a synthetic probe", DATASETS)
  seq_len: int = _f(DATA, 64, "tokens per training sequence")
  batch_size: int = _f(DATA, 16, "global batch (sequences per optimizer step, all devices)")
  # Model.
  d_model: int = _f(MODEL, 64, "width of the residual stream")
  num_layers: int = _f(MODEL, 2, "decoder blocks")
  num_heads: int = _f(MODEL, 4, "query heads")
  num_kv_heads: int = _f(MODEL, 0, "key/value heads (GQA); 0 means num_heads")
  mlp_dim: int = _f(MODEL, 256, "hidden width of the MLP")
  rope_base: float = _f(MODEL, 10000.0, "RoPE base frequency")
  # Attention / normalizer.
  normalizer: str = _f(ATTENTION, "softmax",
                       "attention normalizer, a name from jaxsoft.normalizers.names()")
  normalizer_params: str = _f(ATTENTION, "{}",
                              "normalizer hyperparameters as JSON, e.g. '{\"n\": 1.0}'")
  attention: str = _f(ATTENTION, "full",
                      "the layer kind of every block: a variant of the normalizer block "
                      f"{ATTENTION_VARIANTS}, a linear mixer {LINEAR_KINDS}, a "
                      f"sparse/structured attention {SPARSE_KINDS}, an attention control "
                      f"{CONTROL_KINDS}, a pooling mixer {POOLING_KINDS} or the FoX Pro "
                      f"block {FOX_KINDS}")
  layers: str = _f(ATTENTION, "",
                   "hybrid stack: comma-separated layer kinds (any --attention value, or "
                   "'softmax' for the normalizer block with --attention's variant, 'full' "
                   "when that is not one), repeated to --num_layers; '' = --attention "
                   "everywhere")
  conv_size: int = _f(ATTENTION, 4, "width of the short causal depthwise convolution of the "
                                    "linear layers (1 = none)")
  top_k: int = _f(ATTENTION, 8, "keys kept per query (topk_attention); key blocks kept per query "
                                "block (block_sparse_attention: moba, prism; the cap for bfla)")
  block_size: int = _f(ATTENTION, 16, "positions per block of block_sparse_attention and of "
                                      "mhla, and PoNet's segments (ponet)")
  skip_threshold: float = _f(ATTENTION, 8.0,
                             "BLASST's skip threshold tau (block_sparse_attention:blasst)")
  favor_features: int = _f(ATTENTION, 64, "random features of linear:favor (Performer's FAVOR+)")
  # Model.
  tie_embeddings: bool = _f(MODEL, True, "the output matrix is the transposed input embedding")
  attention_residual_blocks: int = _f(
      MODEL, 0, "Block Attention Residuals (train.attn_residuals): decoder blocks per residual "
      "block; each sublayer's input is a learned softmax mixture of the completed blocks and "
      "the partial sum (jaxsoft.nn.block_attention_residual); 0 = the plain residual stream")
  # Attention / normalizer.
  implementation: str = _f(ATTENTION, "", "attention implementation ('' = jaxsoft's choice, xla, "
                                          "xla_chunked, pallas, ...)",
                           tuple(i or "" for i in IMPLEMENTATIONS))
  window: int = _f(ATTENTION, 32, "left window size for --attention window")
  softcap: float = _f(ATTENTION, 30.0, "logit soft cap for --attention softcap")
  learned: str = _f(ATTENTION, "",
                    "normalizer hyperparameters learned per head, comma-separated: names the "
                    "normalizer takes (alpha for entmax, s or bias for ssmax, temperature for "
                    "softmax, sink_logit for softmax_sink), or 'sink' (a learned sink logit; "
                    "softmax becomes softmax_sink). Output gates: --attention gated. Their "
                    "values per layer and head go to metrics.jsonl at each log step and to "
                    "learned.png")
  # Model.
  loss: str = _f(MODEL, "linear_ce",
                 "the LM loss: linear_ce (cross-entropy from the final hidden states and the "
                 "output matrix, never materialising the [tokens, vocab] logits) or dense "
                 "(materialised logits)", LOSSES)
  dtype: str = _f(MODEL, "float32", "compute dtype (float32 or bfloat16); parameters stay "
                                    "float32", DTYPES)
  # Optimizer.
  steps: int = _f(OPTIMIZER, 200, "optimizer steps in total")
  learning_rate: float = _f(OPTIMIZER, 3e-3, "peak learning rate")
  warmup_steps: int = _f(OPTIMIZER, 20, "linear warm-up steps before the cosine decay (capped at "
                                        "--steps)")
  min_lr_ratio: float = _f(OPTIMIZER, 0.1, "final learning rate as a fraction of the peak")
  weight_decay: float = _f(OPTIMIZER, 0.1, "AdamW weight decay (matrices only)")
  b1: float = _f(OPTIMIZER, 0.9, "Adam beta1")
  b2: float = _f(OPTIMIZER, 0.95, "Adam beta2")
  clip_norm: float = _f(OPTIMIZER, 1.0, "global gradient-norm clip (0 = off)")
  grad_accum: int = _f(OPTIMIZER, 1, "micro-batches accumulated per optimizer step")
  reschedule: bool = _f(OPTIMIZER, False,
                        "on resume, accept a different --steps, --learning_rate, --warmup_steps "
                        "or --min_lr_ratio: the learning-rate schedule is recomputed for the new "
                        "values and the run continues on it from the resumed step (without this "
                        "flag such a resume is refused)")
  # Evaluation.
  eval_every: int = _f(EVALUATION, 100, "steps between held-out evaluations (0 = only at the "
                                        "last step)")
  eval_batches: int = _f(EVALUATION, 4, "held-out batches per evaluation (always the same "
                                        "batches)")
  # Checkpointing / run.
  seed: int = _f(RUN, 0, "seed of the parameters, the data order and the step RNG")
  workdir: str = _f(RUN, "", "where config.json, metrics.jsonl and checkpoints go (re-running "
                             "with the same workdir resumes)")
  init_from: str = _f(RUN, "", "a workdir (or checkpoint step dir) to take the parameters from")
  # Logging / monitoring.
  log_every: int = _f(LOGGING, 20, "steps between log lines with attention statistics and the "
                                   "learned hyperparameters (metrics.jsonl records the loss of "
                                   "every step)")
  # Checkpointing / run.
  save_every: int = _f(RUN, 100, "steps between checkpoints (the last step is always saved)")
  max_to_keep: int = _f(RUN, 3, "checkpoints kept")
  # Distribution.
  distributed: str = _f(DISTRIBUTION, "auto",
                        "call jax.distributed.initialize(): auto (when the environment names "
                        "several processes), on (TPU pods), off", _SWITCH)
  fsdp: bool = _f(DISTRIBUTION, False, "shard the parameters and optimizer state over every "
                                       "device (FSDP): shorthand for --mesh fsdp=-1 (or adds "
                                       "fsdp=-1 to the axes --mesh names)")
  mesh: str = _f(DISTRIBUTION, "",
                 "the device mesh, outermost first: data=N,fsdp=N,context=N,tensor=N. data: "
                 "batch rows (across hosts); fsdp: batch rows and the parameters / optimizer "
                 "state; context: the sequence (attention stays exact); tensor: heads and MLP "
                 "units (Megatron). Omitted axes are 1; -1 (one axis) takes the devices left; "
                 "with no -1 and no data, data takes them. '' = data=-1 (all devices)")
  dcn_mesh: str = _f(DISTRIBUTION, "",
                     "several slices (TPU multislice, or one slice per host elsewhere): the axes' "
                     "sizes across slices, e.g. data=2; --mesh then gives them within a slice "
                     "(jax.experimental.mesh_utils.create_hybrid_device_mesh). '' = one slice")
  context_strategy: str = _f(DISTRIBUTION, "gspmd",
                             "attention with the sequence split over the context axis: gspmd "
                             "(keys and values gathered by sharding constraints) or a strategy "
                             "of jaxsoft.attention.context_parallel_attention (all_gather, "
                             "ulysses, ...), run under shard_map", CONTEXT_STRATEGIES)
  coordinator_address: str = _f(DISTRIBUTION, "",
                                "multi-host: HOST:PORT of process 0's coordinator ('' = "
                                "$JAX_COORDINATOR_ADDRESS, or detected on TPU pods / SLURM)")
  num_processes: int = _f(DISTRIBUTION, 0, "multi-host: the number of processes (0 = "
                                           "$JAX_NUM_PROCESSES, or detected)")
  process_id: int = _f(DISTRIBUTION, -1, "multi-host: this process's index (-1 = "
                                         "$JAX_PROCESS_ID, or detected)")
  num_cpu_devices: int = _f(DISTRIBUTION, 0, "fake CPU devices (0 = what the platform has)")
  # Logging / monitoring.
  progress: str = _f(LOGGING, "auto", "tqdm progress bar with the step, loss, tokens/s and time "
                                      "left: auto (on a terminal), on, off", _SWITCH)
  tensorboard: bool = _f(LOGGING, False, "also write TensorBoard event files to WORKDIR/tb at "
                                         "each log step (needs tensorboardX: pip install "
                                         "tensorboardX)")
  check_numerics: bool = _f(LOGGING, False,
                            "checkify the train step: each learned normalizer hyperparameter in "
                            "its declared range (jaxsoft.checks), the loss and every gradient "
                            "finite; a failed check stops the run with a message naming it, "
                            "saving nothing of that step. Without it a traced out-of-range "
                            "hyperparameter is computed as given and only a non-finite loss or "
                            "gradient norm stops the run")
  # Testing hooks: they drive the real signal paths so tests need no timing games.
  preempt_at_step: int = _f(TESTING, -1, "testing: send SIGTERM to this process after this step")
  kill_after_save_at_step: int = _f(TESTING, -1, "testing: SIGKILL this process right after "
                                                 "starting the async save of this step")

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def normalizer_kwargs(self) -> dict[str, Any]:
    return json.loads(self.normalizer_params)

  @property
  def micro_batch(self) -> int:
    return self.batch_size // self.grad_accum


# Fields that determine the parameter shapes or the function the model computes: a resumed run must
# match them. (--steps, --learning_rate, ... may change on resume.)
MODEL_FIELDS = ("dataset", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim",
                "rope_base", "normalizer", "normalizer_params", "attention", "window", "softcap",
                "learned", "layers", "conv_size", "top_k", "block_size", "skip_threshold",
                "favor_features", "tie_embeddings", "attention_residual_blocks")
# Fields that define the learning-rate schedule: changing them on resume needs --reschedule.
SCHEDULE_FIELDS = ("steps", "learning_rate", "warmup_steps", "min_lr_ratio")

PRESETS: dict[str, dict[str, Any]] = {
    # About a minute on 2 CPU cores, including start-up and compilation. (The times below are
    # train.estimate_seconds's; a run estimated past 10 minutes says so before it starts.)
    "smoke": dict(dataset="text", seq_len=64, batch_size=16, d_model=64, num_layers=2,
                  num_heads=4, mlp_dim=256, steps=400, warmup_steps=40, learning_rate=3e-3,
                  log_every=50, save_every=100),
    # A real character LM on the pydoc corpus: about 5 hours on 2 CPU cores (6.3 s a step
    # measured), under a minute on one H100.
    "charlm": dict(dataset="text", seq_len=256, batch_size=32, d_model=256, num_layers=4,
                   num_heads=8, mlp_dim=1024, steps=3000, warmup_steps=200, learning_rate=1e-3,
                   log_every=100, save_every=500),
    # Associative recall: the probe that separates attention normalizers quickly (about 13
    # minutes on 2 CPU cores).
    "recall": dict(dataset="recall", seq_len=64, batch_size=64, d_model=128, num_layers=2,
                   num_heads=4, mlp_dim=512, steps=2000, warmup_steps=100, learning_rate=1e-3,
                   weight_decay=0.0, log_every=100, save_every=500),
    # A TPU pod slice: bf16 compute, FSDP, a global batch spread over every host (about 70
    # minutes on a v4-32 slice, 16 chips).
    "tpu_pod": dict(dataset="text", seq_len=1024, batch_size=256, d_model=1024, num_layers=12,
                    num_heads=16, mlp_dim=4096, steps=20000, warmup_steps=1000,
                    learning_rate=3e-4, dtype="bfloat16", fsdp=True, log_every=100,
                    save_every=1000, max_to_keep=2),
}


@functools.cache
def _hints() -> dict[str, type]:
  return typing.get_type_hints(Config)


def _field_type(field: dataclasses.Field) -> type:
  return _hints()[field.name]


def _parse_bool(text: str) -> bool:
  lowered = str(text).lower()
  if lowered in ("1", "true", "yes", "on"):
    return True
  if lowered in ("0", "false", "no", "off"):
    return False
  raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _converter(field: dataclasses.Field):
  kind = _field_type(field)
  return _parse_bool if kind is bool else kind


def make_parser() -> argparse.ArgumentParser:
  """An argparse parser with one ``--flag`` per Config field, plus --preset, --set, --compare.

  The flags are shown by topic (GROUPS, each field's ``group``), each with its help and default.
  """
  parser = argparse.ArgumentParser(
      prog="train.py",
      description="Train a small decoder LM with a jaxsoft attention normalizer.\n\n"
                  "Every flag below is a field of train.config.Config. A --preset sets a group "
                  "of them,\n--set KEY=VALUE pairs override the preset, and explicit flags "
                  "override both.\nA bare boolean flag means true (--fsdp); --fsdp false also "
                  "works.",
      epilog="examples (from the repository root, after `make demo` made .venv):\n"
             "  .venv/bin/python train/train.py --preset smoke --workdir runs/smoke\n"
             "  .venv/bin/python train/train.py --preset smoke --workdir runs/ent "
             "--normalizer entmax --learned alpha\n"
             "  .venv/bin/python train/train.py --preset smoke --workdir runs/cmp "
             "--compare softmax,sigmoid,ssmax",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  groups = {key: parser.add_argument_group(title, description)
            for key, title, description in GROUPS}
  run = groups[RUN]
  run.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named starting point, one of %(choices)s; other flags override it "
                        "(default: none)")
  run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field (repeatable) (default: none)")
  run.add_argument("--compare", default="", metavar="NORMALIZERS",
                   help="comma-separated normalizers trained on identical data and seeds; "
                        "writes compare.md and compare.png in --workdir (default: '', one run)")
  for field in dataclasses.fields(Config):
    # A bare boolean flag (``--check_numerics``) means true; ``--flag false`` still works.
    bare = _field_type(field) is bool
    help_ = f"{field.metadata['help']} (default: {field.default!r})".replace("%", "%%")
    groups[field.metadata["group"]].add_argument(
        f"--{field.name}", type=_converter(field), default=None, nargs="?" if bare else None,
        const=True if bare else None, metavar="BOOL" if bare else None, help=help_)
  return parser


def _apply_set(overrides: dict[str, Any], pairs: Sequence[str]) -> None:
  fields = {f.name: f for f in dataclasses.fields(Config)}
  for pair in pairs:
    if "=" not in pair:
      raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
    key, value = pair.split("=", 1)
    if key not in fields:
      raise ConfigError(f"--set: unknown config field {key!r}; fields: {', '.join(sorted(fields))}")
    try:
      overrides[key] = _converter(fields[key])(value)
    except (ValueError, argparse.ArgumentTypeError) as e:
      raise ConfigError(f"--set {key}: cannot parse {value!r}: {e}") from None


def from_argv(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
  """Parses ``argv`` into a Config (not yet validated) and the raw namespace."""
  args = make_parser().parse_args(argv)
  overrides: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
  _apply_set(overrides, args.set)
  for field in dataclasses.fields(Config):
    value = getattr(args, field.name)
    if value is not None:
      overrides[field.name] = value
  for key in ("workdir", "init_from"):  # orbax wants absolute paths
    value = overrides.get(key)
    if value and "://" not in value:
      overrides[key] = os.path.abspath(os.path.expanduser(value))
  return Config(**overrides), args


def validate(cfg: Config, check_workdir: bool = True) -> None:
  """Checks everything that can be checked without devices; raises ConfigError naming the field.

  The workdir is created (and probed for write access) last, only when everything else is valid.
  """
  if cfg.normalizer not in normalizers.REGISTRY:
    raise ConfigError(f"--normalizer: unknown normalizer {cfg.normalizer!r}; registered: "
                      f"{', '.join(normalizers.names())}")
  spec = normalizers.get(cfg.normalizer)
  if spec.needs_key:
    raise ConfigError(f"--normalizer: {cfg.normalizer!r} is stochastic (needs a PRNG key), which "
                      "the attention layer does not thread through; pick a deterministic one")
  try:
    kwargs = cfg.normalizer_kwargs
  except json.JSONDecodeError as e:
    raise ConfigError(f"--normalizer_params: not valid JSON: {e}") from None
  if not isinstance(kwargs, dict):
    raise ConfigError(f"--normalizer_params: expected a JSON object, got {cfg.normalizer_params!r}")
  try:
    spec.validate(kwargs)
  except ValueError as e:
    raise ConfigError(f"--normalizer_params: {e}") from None
  _validate_learned(cfg, kwargs)
  for field in dataclasses.fields(Config):
    choices, value = field.metadata["choices"], getattr(cfg, field.name)
    if choices is not None and value not in choices:
      raise ConfigError(f"--{field.name}: unknown value {value!r}; one of "
                        f"{', '.join(repr(c) for c in choices)}")
  positive = ("seq_len", "batch_size", "d_model", "num_layers", "num_heads", "mlp_dim", "steps",
              "grad_accum", "log_every", "save_every", "max_to_keep", "eval_batches",
              "conv_size", "top_k", "block_size", "favor_features")
  for name in positive:
    if getattr(cfg, name) <= 0:
      raise ConfigError(f"--{name} must be positive, got {getattr(cfg, name)}")
  _validate_layers(cfg)
  if cfg.d_model % cfg.num_heads:
    raise ConfigError(
        f"--d_model ({cfg.d_model}) must be divisible by --num_heads ({cfg.num_heads})")
  if cfg.head_dim % 2:
    raise ConfigError(f"--d_model / --num_heads = {cfg.head_dim} must be even for RoPE")
  if cfg.num_heads % cfg.kv_heads:
    raise ConfigError(f"--num_heads ({cfg.num_heads}) must be divisible by --num_kv_heads "
                      f"({cfg.kv_heads})")
  if cfg.batch_size % cfg.grad_accum:
    raise ConfigError(f"--batch_size ({cfg.batch_size}) must be divisible by --grad_accum "
                      f"({cfg.grad_accum})")
  for name in ("warmup_steps", "eval_every", "attention_residual_blocks"):
    if getattr(cfg, name) < 0:
      raise ConfigError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
  _validate_distribution(cfg)
  if not cfg.workdir:
    raise ConfigError("--workdir is required")
  if cfg.init_from:
    try:
      checkpoint.locate(cfg.init_from)
    except FileNotFoundError as e:
      raise ConfigError(f"--init_from: {e}") from None
  if check_workdir:
    prepare_workdir(cfg.workdir)


def _validate_distribution(cfg: Config) -> None:
  """The mesh flags' syntax (their sizes are checked against the devices in train.sharding)."""
  sizes = mesh_flags.parse_mesh(cfg.mesh)
  if cfg.fsdp and mesh_flags.FSDP not in sizes and -1 in sizes.values():
    axis = next(k for k, v in sizes.items() if v == -1)
    raise ConfigError(f"--fsdp true means fsdp=-1, but --mesh already gives -1 to {axis!r} "
                      "(-1 twice); name the fsdp size in --mesh instead")
  mesh_flags.parse_mesh(cfg.dcn_mesh, "--dcn_mesh")
  if cfg.context_strategy != "gspmd":
    strategies = mesh_flags.context_strategies()
    if cfg.context_strategy not in strategies:
      raise ConfigError(f"--context_strategy: {cfg.context_strategy!r} is not available here; "
                        f"one of {', '.join(('gspmd', *strategies))}")
  if cfg.num_processes < 0:
    raise ConfigError(f"--num_processes must be >= 0, got {cfg.num_processes}")
  if cfg.process_id < -1 or (cfg.num_processes and cfg.process_id >= cfg.num_processes):
    raise ConfigError(f"--process_id must be -1 or in [0, --num_processes), got "
                      f"{cfg.process_id}")


def _kind_error(flag: str, name: str) -> ConfigError:
  if name in BIDIRECTIONAL_KINDS:
    return ConfigError(f"{flag}: {name!r} cannot be used: {BIDIRECTIONAL_KINDS[name]}")
  return ConfigError(f"{flag}: unknown layer kind {name!r}; valid: {', '.join(LAYER_KINDS)}"
                     + (", softmax" if flag == "--layers" else ""))


def layer_kinds(cfg: Config) -> tuple[str, ...]:
  """The layer kind of each of the ``num_layers`` blocks (``--layers`` repeated, or
  ``--attention`` everywhere); ``softmax`` resolves to --attention's variant of the normalizer
  block (``full`` when --attention is not one). Unknown names raise ConfigError listing the
  valid ones."""
  if cfg.attention not in LAYER_KINDS:
    raise _kind_error("--attention", cfg.attention)
  if not cfg.layers.strip():
    return (cfg.attention,) * cfg.num_layers
  pattern = [name.strip() for name in cfg.layers.split(",")]
  anchor = cfg.attention if cfg.attention in ATTENTION_VARIANTS else "full"
  for name in pattern:
    if name != "softmax" and name not in LAYER_KINDS:
      raise _kind_error("--layers", name)
  if len(pattern) > cfg.num_layers:
    raise ConfigError(f"--layers names {len(pattern)} layers but --num_layers is "
                      f"{cfg.num_layers}; the pattern is repeated to --num_layers, never cut")
  resolved = [anchor if name == "softmax" else name for name in pattern]
  return tuple(resolved[i % len(resolved)] for i in range(cfg.num_layers))


def _validate_layers(cfg: Config) -> None:
  kinds = layer_kinds(cfg)
  if cfg.learned and not any(kind in ATTENTION_VARIANTS for kind in kinds):
    raise ConfigError("--learned: no layer is a normalizer block (--attention/--layers name "
                      "only linear or sparse kinds)")
  if cfg.skip_threshold < 0:
    raise ConfigError(f"--skip_threshold must be >= 0, got {cfg.skip_threshold}")


def learned_names(cfg: Config) -> tuple[str, ...]:
  """The --learned names, in order, without blanks (``sink`` not yet resolved)."""
  return tuple(name.strip() for name in cfg.learned.split(",") if name.strip())


def attention_normalizer(cfg: Config) -> tuple[str, tuple[str, ...]]:
  """(normalizer, learned hyperparameter names) the attention layers use.

  ``--learned sink`` is the learned sink logit: softmax and softmax_1 become softmax_sink (as
  ``jaxsoft.nn.MultiHeadAttention(sink=True)`` does) and ``sink`` names ``sink_logit``.
  """
  names = learned_names(cfg)
  normalizer = cfg.normalizer
  if "sink" in names:
    if normalizer in ("softmax", "softmax_1"):
      normalizer = "softmax_sink"
    names = tuple("sink_logit" if n == "sink" else n for n in names)
  return normalizer, tuple(dict.fromkeys(names))


def _validate_learned(cfg: Config, fixed: dict[str, Any]) -> None:
  normalizer, names = attention_normalizer(cfg)
  if not names:
    return
  spec = normalizers.get(normalizer)
  takes = [p.name for p in spec.params]
  for name in names:
    if name not in takes:
      extra = "" if cfg.normalizer == normalizer else f" (--learned sink makes it {normalizer!r})"
      raise ConfigError(f"--learned: normalizer {normalizer!r}{extra} has no hyperparameter "
                        f"{name!r}; it takes {takes}"
                        + ("" if name == "sink_logit" else ", or 'sink' with softmax"))
    if name in fixed:
      raise ConfigError(f"--learned: {name!r} is also fixed in --normalizer_params")
    param = spec.param(name)
    if param.default is None and param.sample is None:
      raise ConfigError(f"--learned: {name!r} of {normalizer!r} has no default to start from")


def check_implementation(cfg: Config) -> None:
  """Refuses a Pallas --implementation the platform cannot run (call once devices are set up)."""
  impl = cfg.implementation
  if not impl.startswith("pallas"):
    return
  driver = {"pallas": None, "pallas_triton": "triton", "pallas_mosaic_tpu": "mosaic_tpu"}[impl]
  try:
    pick_backend(driver)
  except NotImplementedError as e:
    raise ConfigError(f"--implementation {impl}: {e}; or pick --implementation xla") from None


def prepare_workdir(workdir: str) -> None:
  """Creates ``workdir`` and writes (then removes) a probe file; any path etils.epath knows.

  A probe write, not os.access: that is fooled by root and ACLs, and knows no object store.
  """
  from etils import epath  # pylint: disable=import-outside-toplevel

  path = epath.Path(workdir)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except Exception as e:  # pylint: disable=broad-except  (OSError, or an object store's own)
    raise ConfigError(f"--workdir {workdir!r} cannot be created: {_why(e)}") from None
  probe = path / f".write_probe_{uuid.uuid4().hex}"
  try:
    probe.write_text("")
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f"--workdir {workdir!r} is not writable: {_why(e)}") from None


def _why(error: BaseException) -> str:
  return getattr(error, "strerror", None) or str(error) or type(error).__name__


def _dumps(cfg: Config) -> str:
  return json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True) + "\n"


def save(cfg: Config, path: str) -> None:
  """Writes ``cfg`` as JSON to ``path`` (a local path or an object-store URL)."""
  from etils import epath  # pylint: disable=import-outside-toplevel
  epath.Path(path).write_text(_dumps(cfg))


def load(path: str) -> dict[str, Any]:
  from etils import epath  # pylint: disable=import-outside-toplevel
  return json.loads(epath.Path(path).read_text())


HISTORY = "config_history.jsonl"


def read_history(workdir: str) -> list[dict[str, Any]]:
  """The records of ``config_history.jsonl``: one per start, ``{time, start_step, config}``."""
  from etils import epath  # pylint: disable=import-outside-toplevel
  path = epath.Path(workdir) / HISTORY
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_history(cfg: Config, start_step: int) -> None:
  """Saves ``config.json`` (the config now in force) and appends it to the history.

  The file is rewritten whole rather than opened for appending: object stores have no append.
  """
  from etils import epath  # pylint: disable=import-outside-toplevel
  workdir = epath.Path(cfg.workdir)
  record = {"time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "start_step": start_step, "config": dataclasses.asdict(cfg)}
  records = [*read_history(cfg.workdir), record]
  (workdir / HISTORY).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
  save(cfg, str(workdir / "config.json"))


def check_resume_compatible(cfg: Config, saved: dict[str, Any]) -> None:
  """Refuses to resume when the saved run's model config or learning-rate schedule differs.

  A different model would not fit the checkpoint; a different schedule would silently change the
  learning rate mid-run, unless ``cfg.reschedule`` asks for exactly that. A field missing from an
  older config.json counts as its default.
  """
  defaults = {f.name: f.default for f in dataclasses.fields(Config)}

  def canonical(key, value):
    return json.loads(value) if key == "normalizer_params" and isinstance(value, str) else value

  def diffs(fields):
    return [f"{k}: saved {saved.get(k, defaults[k])!r} != now {getattr(cfg, k)!r}"
            for k in fields
            if canonical(k, saved.get(k, defaults[k])) != canonical(k, getattr(cfg, k))]

  model = diffs(MODEL_FIELDS)
  if model:
    raise ConfigError(f"cannot resume from --workdir {cfg.workdir!r} with a different model config "
                      f"({'; '.join(model)}); use a fresh --workdir, or --init_from for a "
                      "compatible model")
  schedule = diffs(SCHEDULE_FIELDS)
  if schedule and not cfg.reschedule:
    raise ConfigError(f"cannot resume from --workdir {cfg.workdir!r} with a different learning-rate "
                      f"schedule ({'; '.join(schedule)}): it would change the learning rate "
                      "mid-run. Pass the saved values, or add --reschedule true to recompute the "
                      "schedule for the new values from the resumed step on")
