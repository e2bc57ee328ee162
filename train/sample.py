r"""Generate text from a trained char-LM checkpoint.

    .venv/bin/python train/sample.py --workdir /tmp/run --prompt "def " --length 200
    .venv/bin/python train/sample.py --workdir /tmp/run --temperature 0 --length 80      # greedy

The model is rebuilt from the workdir's ``config.json`` and its parameters restored from the
newest checkpoint (``train.checkpoint.restore_params``). Tokens are generated one at a time by
``Transformer.decode_step``: a KV cache for the normalizer blocks, the recurrent state (and
the short-convolution window) for the linear layers, advanced by jaxsoft.linear's ``*_step``
functions, and the input history for the sparse attention layers, so a step costs O(1) in the
length for a linear layer. The prompt is fed through the same steps. Sampling draws from
``softmax(logits / temperature)`` restricted to the ``--top_k`` most likely tokens (0: all);
temperature 0 is greedy (the argmax, the limit of temperature -> 0). A negative or non-finite
temperature, or a negative top_k, is refused with a message naming it (a negative temperature
would favour the least likely tokens).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

if __name__ == "__main__" and not __package__:
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from etils import epath  # noqa: E402
from flax import nnx  # noqa: E402

from train import checkpoint, config, data, model  # noqa: E402
from train.config import Config, ConfigError  # noqa: E402

__all__ = ["load_model", "generate", "check_sampling", "encode", "decode", "main"]


def load_model(workdir: str) -> tuple[Config, model.Transformer, int]:
  """(config, model with the restored parameters, checkpoint step) of a training workdir."""
  saved = epath.Path(workdir) / "config.json"
  if not saved.exists():
    raise ConfigError(f"--workdir {workdir!r} has no config.json (not a training workdir)")
  fields = {f for f in Config.__dataclass_fields__}
  cfg = Config(**{k: v for k, v in config.load(str(saved)).items() if k in fields})
  vocab = data.make_dataset(cfg.dataset, cfg.seq_len, cfg.batch_size, cfg.seed).vocab_size
  abstract = nnx.eval_shape(lambda: model.make_model(cfg, vocab, cfg.seed))
  graphdef, abstract_params = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                        nnx.to_pure_dict(abstract_params))
  try:
    params, step = checkpoint.restore_params(workdir, target)
  except FileNotFoundError as e:
    raise ConfigError(f"--workdir: {e}") from None
  state = nnx.state(abstract)
  nnx.replace_by_pure_dict(state, params)
  return cfg, nnx.merge(graphdef, state), step


def encode(text: str, vocab_size: int) -> list[int]:
  """UTF-8 bytes for the char-LM (vocab 256); space-separated token ids for the probes."""
  if vocab_size == 256:
    return list(text.encode("utf-8"))
  ids = [int(t) for t in text.split()]
  if any(not 0 <= t < vocab_size for t in ids):
    raise ValueError(f"prompt: probe token ids must lie in [0, {vocab_size}), got {ids}")
  return ids


def decode(tokens: Sequence[int], vocab_size: int) -> str:
  if vocab_size == 256:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
  return " ".join(str(int(t)) for t in tokens)


def check_sampling(temperature: float, top_k: int) -> None:
  """Raises ValueError naming the argument unless ``temperature`` is a finite number >= 0 (0 is
  greedy) and ``top_k`` an int >= 0 (0: all tokens)."""
  try:
    t = float(temperature)
  except (TypeError, ValueError):
    raise ValueError(f"temperature: must be a number >= 0 (0 is greedy), got "
                     f"{temperature!r}") from None
  if not math.isfinite(t) or t < 0:
    raise ValueError(f"temperature: must be a finite number >= 0 (0 is greedy; a negative "
                     f"temperature would favour the least likely tokens), got {temperature!r}")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"top_k: must be an int >= 0 (0: all tokens), got {top_k!r}")


def _pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
  if temperature <= 0:
    return jnp.argmax(logits, axis=-1)
  logits = logits / temperature
  if 0 < top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1)


def _decode(net, cache, token, position, key, temperature, top_k):
  logits, cache = net.decode_step(token, position, cache)
  return logits, cache, _pick(logits, key, temperature, top_k)


_step: Any = nnx.jit(_decode, static_argnames=("temperature", "top_k"))


def generate(net: model.Transformer, prompt: Sequence[int], length: int, *,
             temperature: float = 1.0, top_k: int = 0, seed: int = 0,
             return_logits: bool = False) -> Any:
  """``prompt`` followed by ``length`` generated tokens (a list of ints).

  ``temperature`` 0 is greedy; a negative or non-finite one is a ValueError (:func:`check_sampling`).

  With ``return_logits`` also the ``[len(prompt) + length - 1, vocab]`` logits each step
  produced (row i predicts token i + 1).
  """
  check_sampling(temperature, top_k)
  if not prompt:
    raise ValueError("prompt: at least one token is needed")
  if length < 0:
    raise ValueError(f"length: must be >= 0, got {length}")
  total = len(prompt) + length
  if any(b.kind == "cosformer" for b in net.blocks) and total > net.cfg.seq_len + 1:
    raise ValueError(f"length: a cosformer layer's re-weighting spans --seq_len = "
                     f"{net.cfg.seq_len} positions; prompt + length must be <= "
                     f"{net.cfg.seq_len + 1}, got {total}")
  if any(b.kind == "mhla" for b in net.blocks) and total > net.cfg.seq_len + 1:
    raise ValueError(f"length: an mhla layer's mixing matrix covers the blocks of --seq_len = "
                     f"{net.cfg.seq_len} positions; prompt + length must be <= "
                     f"{net.cfg.seq_len + 1}, got {total}")
  step = functools.partial(_step, net, temperature=float(temperature), top_k=int(top_k))
  cache = net.init_cache(1, total)
  key = jax.random.key(seed)
  tokens = list(prompt)
  all_logits = []
  for position in range(total - 1):
    key, sub = jax.random.split(key)
    logits, cache, nxt = step(cache, jnp.asarray([tokens[position]], jnp.int32),
                              jnp.int32(position), sub)
    all_logits.append(logits[0])
    if position + 1 >= len(prompt):
      tokens.append(int(nxt[0]))
  if return_logits:
    return tokens, np.asarray(jnp.stack(all_logits)) if all_logits else np.zeros((0,))
  return tokens


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="sample.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a training workdir (its newest checkpoint)")
  parser.add_argument("--prompt", default="\n", help="the text to continue (probes: token ids)")
  parser.add_argument("--length", type=int, default=200, help="tokens to generate")
  parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  parser.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest (0: all)")
  parser.add_argument("--seed", type=int, default=0)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = make_parser().parse_args(argv)
  try:
    check_sampling(args.temperature, args.top_k)  # before the model is loaded
    cfg, net, step = load_model(os.path.abspath(os.path.expanduser(args.workdir)))
    vocab = net.output_matrix().shape[-1]
    tokens = generate(net, encode(args.prompt, vocab), args.length,
                      temperature=args.temperature, top_k=args.top_k, seed=args.seed)
  except (ConfigError, ValueError) as e:
    print(f"sample.py: error: {e}", file=sys.stderr, flush=True)
    return 2
  print(f"# {cfg.dataset} model, checkpoint step {step}, layers "
        f"{','.join(b.kind for b in net.blocks)}", file=sys.stderr)
  print(decode(tokens, vocab))
  return 0


if __name__ == "__main__":
  sys.exit(main())
