"""Training throughput: the smoke model with jaxsoft's attention vs flax.nnx's default attention.

    .venv/bin/python bench/train_tokens.py                 # smoke preset, then sequence length 2048
    .venv/bin/python bench/train_tokens.py --seq_lens 64 --reps 3

Both models are the `smoke` preset's decoder (same parameters, RoPE, projections, MLP, AdamW
step); only the attention function differs: ``jaxsoft.attention.dot_product_attention`` (its
default implementation choice, causal softmax) against ``flax.nnx.dot_product_attention``, the
default ``attention_fn`` of ``flax.nnx.MultiHeadAttention`` (dense ``[B, N, T, S]`` weights with
an explicit causal mask). Tokens/s of the whole jitted train step (forward, backward, optimizer)
are measured in one process, interleaved, median of ``--reps`` repetitions. A row is reported only
if both models give the same loss and gradient norm on the same batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from train import config, data, model  # noqa: E402
from train import train as train_lib  # noqa: E402


def nnx_default_attention(q, k, v, hparams=None):
  """flax.nnx.MultiHeadAttention's default attention_fn, with the causal mask it would be given.

  ``hparams`` (the model's learned normalizer hyperparameters) is empty for softmax.
  """
  del hparams
  t, s = q.shape[1], k.shape[1]
  mask = nnx.make_causal_mask(jnp.ones((1, t), jnp.int32))[..., :s]
  return nnx.dot_product_attention(q, k, v, mask=mask)


def make_runner(cfg: config.Config, baseline: bool):
  wrap = (lambda _jaxsoft_attend: nnx_default_attention) if baseline else None
  net = model.make_model(cfg, 256, cfg.seed, wrap=wrap)
  graphdef, params = nnx.split(net)
  params = nnx.to_pure_dict(params)
  optimizer = train_lib.make_optimizer(cfg)
  step = jax.jit(train_lib.make_train_step(graphdef, optimizer, train_lib.make_schedule(cfg)))
  return step, train_lib.init_state(cfg, graphdef, params, optimizer)


def batch_for(cfg: config.Config) -> dict[str, jax.Array]:
  ds = data.make_dataset("text", cfg.seq_len, cfg.batch_size, cfg.seed)
  return {k: jnp.asarray(v)[None] for k, v in ds.batch(0).items()}  # [grad_accum=1, B, T]


def time_steps(step, state, batch, n: int) -> tuple[float, object]:
  start = time.perf_counter()
  for _ in range(n):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return time.perf_counter() - start, state


def measure(cfg: config.Config, reps: int, steps_per_rep: int) -> dict[str, float]:
  runners = {name: make_runner(cfg, baseline) for name, baseline in
             (("jaxsoft", False), ("nnx", True))}
  batch = batch_for(cfg)
  # Correctness first: the same loss and gradient norm from identical parameters.
  checks = {name: jax.device_get(step(state, batch)[1]) for name, (step, state) in runners.items()}
  for key in ("loss", "grad_norm"):
    a, b = float(checks["jaxsoft"][key]), float(checks["nnx"][key])
    if not np.isclose(a, b, rtol=1e-4):
      raise SystemExit(
          f"refusing to report: {key} differs (jaxsoft {a} vs nnx {b}) at T={cfg.seq_len}")
  states = {name: state for name, (_, state) in runners.items()}
  times: dict[str, list[float]] = {name: [] for name in runners}
  for _ in range(reps):  # interleaved so both see the same machine load
    for name, (step, _) in runners.items():
      seconds, states[name] = time_steps(step, states[name], batch, steps_per_rep)
      times[name].append(seconds)
  tokens = cfg.batch_size * cfg.seq_len * steps_per_rep
  return {name: tokens / statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq_lens", default="64,2048", help="sequence lengths (64 = smoke preset)")
  parser.add_argument("--long_batch", type=int, default=2,
                      help="batch size for sequence lengths above the preset's")
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--steps_per_rep", type=int, default=10,
                      help="steps timed together (a fifth of it for the long sequences)")
  args = parser.parse_args(argv)
  smoke = config.Config(**config.PRESETS["smoke"], workdir="unused")
  rows = ["| seq len | batch | jaxsoft tokens/s | nnx default tokens/s | jaxsoft / nnx |",
          "|---|---|---|---|---|"]
  for seq_len in (int(s) for s in args.seq_lens.split(",")):
    batch = smoke.batch_size if seq_len <= smoke.seq_len else args.long_batch
    cfg = dataclasses.replace(smoke, seq_len=seq_len, batch_size=batch)
    steps = args.steps_per_rep if seq_len <= smoke.seq_len else max(1, args.steps_per_rep // 5)
    result = measure(cfg, args.reps, steps)
    rows.append(f"| {seq_len} | {batch} | {result['jaxsoft']:,.0f} | {result['nnx']:,.0f} | "
                f"{result['jaxsoft'] / result['nnx']:.2f}x |")
    print(rows[-1], flush=True)
  print(f"\nsmoke model, {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"train step (fwd+bwd+AdamW), median of {args.reps} repetitions\n")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
