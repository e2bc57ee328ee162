"""MHLA as a layer kind of the char-LM (train/config.py, train/layers.py), RALA refused.

Oracles: the train step's loss against the token cross-entropy written out with log_softmax;
cached one-token decoding against the full forward (the MHLA cache carries the block
summaries); the learned block mixing C moves under training.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train import config, layers, sample, sharding
from train import train as train_lib
from train.config import LINEAR_KINDS, Config, ConfigError

# seq_len 12 in blocks of 4 (3 blocks); the decoding check runs over all 12 positions
TINY = dict(dataset="text", seq_len=12, block_size=4, batch_size=4, d_model=16, num_heads=2,
            mlp_dim=32, steps=4, warmup_steps=1, workdir="unused", seed=0)


def _mixing(params):
  found = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
           if "mixing" in jax.tree_util.keystr(path)]
  assert len(found) == 1
  return found[0]


def test_mhla_is_a_linear_kind_and_rala_is_refused_saying_why():
  assert "mhla" in LINEAR_KINDS and "rala" not in config.LAYER_KINDS
  config.validate(Config(**{**TINY, "attention": "mhla"}), check_workdir=False)
  for overrides in (dict(attention="rala"), dict(num_layers=2, layers="mhla,rala")):
    with pytest.raises(ConfigError, match=r"'rala' cannot be used: RALA .* is bidirectional"):
      config.validate(Config(**{**TINY, **overrides}), check_workdir=False)
  with pytest.raises(ValueError, match=r"kind: 'rala' cannot be a layer here: .*bidirectional"):
    layers.LinearMixer(Config(**TINY), "rala", 0, rngs=nnx.Rngs(0))


def _build(**overrides):
  cfg = Config(**{**TINY, **overrides})
  mesh = sharding.make_mesh(cfg)
  dataset, graphdef, optimizer, init_fn, _, _, _ = train_lib.build(cfg, mesh)
  batch = sharding.global_batch(dataset, 0, cfg, sharding.batch_sharding(mesh))
  return cfg, graphdef, optimizer, init_fn(), batch


def _full_logits(net, batch):
  inputs = batch["inputs"].reshape(-1, batch["inputs"].shape[-1])
  return inputs, nnx.jit(lambda m, t: m(t))(net, inputs)


def test_two_train_steps_of_an_mhla_model():
  cfg, graphdef, optimizer, state, batch = _build(num_layers=1, attention="mhla")
  mixing = np.asarray(_mixing(state["params"]))
  np.testing.assert_array_equal(mixing, np.broadcast_to(np.tril(np.ones((3, 3))), (2, 3, 3)))
  step = jax.jit(train_lib.make_train_step(graphdef, optimizer, train_lib.make_schedule(cfg)))
  inputs, logits = _full_logits(nnx.merge(graphdef, state["params"]), batch)
  # log_softmax in numpy (float64): the oracle, without eager jnp dispatch
  logits = np.asarray(logits, np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.sum(np.exp(logp), axis=-1, keepdims=True))
  targets = np.asarray(batch["targets"]).reshape(inputs.shape)
  loss = -np.mean(np.take_along_axis(logp, targets[..., None], axis=-1))

  state, metrics = step(state, batch)  # step 0: lr = 0 (warm-up), Adam's moments fill
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
  assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
  state, metrics = step(state, batch)
  moved = np.asarray(_mixing(state["params"])) - mixing
  assert np.isfinite(float(metrics["loss"])) and float(np.max(np.abs(moved))) > 0
  np.testing.assert_array_equal(moved[:, 0, 1:], 0.0)  # causal: no gradient above the diagonal


@pytest.mark.slow
def test_generation_carries_the_block_summaries_and_equals_the_full_forward():
  cfg, graphdef, _, state, batch = _build(num_layers=2, layers="mhla,full")
  net = nnx.merge(graphdef, state["params"])
  inputs, logits = _full_logits(net, batch)
  tokens = inputs[:2]
  decode_step = nnx.jit(lambda m, t, p, c: m.decode_step(t, p, c))
  cache = net.init_cache(2, cfg.seq_len)
  out = []
  for p in range(cfg.seq_len):
    step_logits, cache = decode_step(net, tokens[:, p], jnp.int32(p), cache)
    out.append(step_logits)
  np.testing.assert_allclose(jnp.stack(out, axis=1), logits[:2], rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match=r"length: an mhla layer"):
    sample.generate(net, [1, 2], cfg.seq_len)
  assert len(sample.generate(net, [1, 2], cfg.seq_len - 1, temperature=0.0)) == cfg.seq_len + 1
