"""Generation with caches (train/sample.py, Transformer.decode_step) equals the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train import checkpoint, config, model, sample, sharding
from train import train as train_lib
from train.config import LAYER_KINDS, Config

TINY = dict(d_model=16, num_heads=2, mlp_dim=32, seq_len=12, block_size=4, top_k=2,
            favor_features=8, workdir="unused")
# A hybrid stack: Gated DeltaNet, GLA (recurrent states + conv windows) and a gated normalizer
# block (KV cache + output gate).
HYBRID = dict(num_layers=3, attention="gated", layers="gated_delta_rule,gla,softmax")


def make_model(cfg, vocab=32):
  """``model.make_model`` initialised under jit (eager initialisation is slow on CPU)."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, vocab, seed=0)))
  state = jax.jit(lambda: nnx.state(model.make_model(cfg, vocab, seed=0)))()
  return nnx.merge(graphdef, state)


def forward(net, tokens):
  return nnx.jit(lambda m, t: m(t))(net, tokens)


def _decoded_logits(net, tokens):
  """Logits [B, T, V] from feeding ``tokens`` one at a time through ``decode_step``."""
  step = nnx.jit(lambda m, t, p, c: m.decode_step(t, p, c))
  cache = net.init_cache(tokens.shape[0], tokens.shape[1])
  out = []
  for p in range(tokens.shape[1]):
    logits, cache = step(net, tokens[:, p], jnp.int32(p), cache)
    out.append(logits)
  return jnp.stack(out, axis=1)


def _check_cached_equals_full(overrides):
  cfg = Config(**{**TINY, **overrides})
  net = make_model(cfg)
  tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len), 0, 32)
  full = forward(net, tokens)
  decoded = _decoded_logits(net, tokens)
  np.testing.assert_allclose(decoded, full, atol=2e-5, rtol=2e-5)
  assert bool(jnp.all(jnp.isfinite(decoded)))


@pytest.mark.slow
def test_cached_decoding_equals_the_full_forward_for_a_3_to_1_stack():
  _check_cached_equals_full(dict(num_layers=4, layers="delta_rule,simple_gla,mala,softmax"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in LAYER_KINDS if k not in ("full", "gated")])
def test_cached_decoding_equals_the_full_forward_for_every_kind(kind):
  # (the block-sparse methods choose key blocks per query token under is_causal, so every
  # kind decodes exactly as the forward, at every position)
  _check_cached_equals_full(dict(num_layers=2, layers=f"{kind},full"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A workdir with config.json and an (untrained) checkpoint at step 3 of the HYBRID model."""
  workdir = tmp_path_factory.mktemp("sample")
  cfg = Config(**{**TINY, "workdir": str(workdir), **HYBRID})
  mesh = sharding.make_mesh(cfg)
  _, _, _, init_fn, _, _, _ = train_lib.build(cfg, mesh)
  state = init_fn()
  ckpt = checkpoint.Checkpointer(cfg.workdir, max_to_keep=1, save_every=1)
  ckpt.save(3, state, data_position=3, force=True)
  ckpt.close()
  config.save(cfg, str(workdir / "config.json"))
  return workdir, cfg, state


def test_sample_restores_a_checkpoint_and_greedy_decoding_is_the_full_forwards_argmax(saved):
  """The cached logits of every position equal the full forward's (hybrid stack)."""
  workdir, cfg, state = saved
  loaded_cfg, net, step = sample.load_model(str(workdir))
  assert step == 3 and loaded_cfg == cfg
  restored = nnx.to_pure_dict(nnx.state(net))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state["params"]), strict=True):
    np.testing.assert_array_equal(a, b)
  prompt = sample.encode("def ", 256)
  tokens, logits = sample.generate(net, prompt, 6, temperature=0.0, return_logits=True)
  assert tokens[:4] == prompt and len(tokens) == 10
  full = np.asarray(forward(net, jnp.asarray([tokens[:-1]], jnp.int32))[0])
  np.testing.assert_allclose(logits, full, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(tokens[4:], np.argmax(full, axis=-1)[3:])
  # Sampling is a function of the seed; the CLI prints the prompt and its continuation.
  a = sample.generate(net, prompt, 5, temperature=1.0, top_k=4, seed=1)
  assert a == sample.generate(net, prompt, 5, temperature=1.0, top_k=4, seed=1)
  assert sample.decode(a, 256).startswith("def ")


def test_sample_cli_prints_text_and_rejects_bad_input(saved, tmp_path, capsys):
  # 4 + 6 tokens, greedy: the decode step the test above compiles (the same cache length)
  assert sample.main(["--workdir", str(saved[0]), "--prompt", "x = ", "--length", "6",
                      "--temperature", "0"]) == 0
  assert capsys.readouterr().out.startswith("x = ")
  assert sample.main(["--workdir", str(tmp_path / "missing"), "--length", "3"]) == 2
  assert "config.json" in capsys.readouterr().err
  with pytest.raises(ValueError, match="prompt"):
    sample.generate(None, [], 3)
  with pytest.raises(ValueError, match="probe token ids"):
    sample.encode("1 99", 64)


@pytest.mark.parametrize("temperature", ["-0.5", "nan", "inf"])
def test_sample_refuses_a_negative_or_nonfinite_temperature(saved, capsys, temperature):
  """Refused with the argument named, before the model is loaded (a negative temperature
  would favour the least likely tokens; NaN logits would draw garbage)."""
  assert sample.main(["--workdir", str(saved[0]), "--length", "3",
                      "--temperature", temperature]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and "temperature: must be a finite number >= 0" in captured.err
  with pytest.raises(ValueError, match=r"temperature: must be a finite number >= 0 \(0 is greedy"):
    sample.generate(None, [1, 2], 3, temperature=float(temperature))
  with pytest.raises(ValueError, match=r"top_k: must be an int >= 0"):
    sample.generate(None, [1, 2], 3, top_k=-1)
