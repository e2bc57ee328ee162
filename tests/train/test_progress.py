"""A training run shows its progress: the tqdm bar (step, loss, tokens/s, time left), the learned
hyperparameters and output gates per layer and head in metrics.jsonl, TensorBoard and
learned.png."""

import dataclasses
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import helpers
from train import checkpoint, config, data, model, sharding
from train import train as train_lib

# The tiny test model with a learned sink logit per head: the very programs of test_learned.py's
# default case, so the run's compilation cache serves whichever of the two runs second.
LEARNED_SINK = helpers.train_argv("--learning_rate", "3e-2", "--warmup_steps", "1",
                                  "--normalizer", "softmax", "--learned", "sink")
HEADS = 2  # helpers.TRAIN_ARGV's --num_heads


class _FakeWriter:
  """tensorboardX.SummaryWriter's interface, recording what it is given."""

  def __init__(self, logdir):
    self.logdir, self.scalars, self.closed = logdir, [], False
    _WRITERS.append(self)

  def add_scalar(self, tag, value, step):
    self.scalars.append((tag, float(value), step))

  def close(self):
    self.closed = True


_WRITERS: list[_FakeWriter] = []


def _softplus(z):
  return np.logaddexp(0.0, np.asarray(z, np.float64))


def test_a_run_logs_its_learned_values_per_head_shows_a_bar_and_writes_tensorboard(
    tmp_path, capsys, monkeypatch):
  _WRITERS.clear()
  monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=_FakeWriter))
  workdir = str(tmp_path / "run")
  argv = LEARNED_SINK + ["--workdir", workdir, "--progress", "on", "--tensorboard"]
  assert train_lib.main(argv) == 0
  err = capsys.readouterr().err

  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines()]
  assert [r["step"] for r in records] == list(range(1, helpers.TRAIN_STEPS + 1))
  learned = [f"learned/sink_logit/layer0/head{h}" for h in range(HEADS)]
  for record in records:  # every step is a log step (--log_every 1)
    assert sorted(k for k in record if "/" in k) == learned, record
  # Step 1 is taken at learning rate 0 (warm-up from 0): the sink logit is still its default, 0.
  assert [records[0][k] for k in learned] == [0.0] * HEADS
  # The last record holds the saved parameters' values (a sink logit is not mapped: itself).
  cfg = config.from_argv(argv)[0]
  abstract_state = train_lib.build(cfg, sharding.make_mesh(cfg))[4]
  params, step = checkpoint.restore_params(workdir, abstract_state["params"])
  assert step == helpers.TRAIN_STEPS
  free = np.asarray(params["blocks"][0]["attn"]["learned"]["sink_logit"], np.float64)
  assert [records[-1][k] for k in learned] == list(free)  # float32 -> JSON float: exact
  assert np.ptp([records[-1][k] for k in learned]) > 0  # the heads moved apart
  assert (tmp_path / "run" / "learned.png").read_bytes()[:4] == b"\x89PNG"

  # The bar: step, loss, tokens/s, time left.
  final = err.replace("\r", "\n").strip().splitlines()[-1]
  assert f"step {helpers.TRAIN_STEPS}/{helpers.TRAIN_STEPS}" in final, final
  assert f"loss {records[-1]['loss']:.4f}, " in final, final
  assert " tok/s, " in final and " left]" in final, final

  (writer,) = _WRITERS
  assert writer.logdir == str(tmp_path / "run" / "tb") and writer.closed
  tags = {(tag, step) for tag, _, step in writer.scalars}
  assert {(k, s) for k in ["loss", *learned] for s in range(1, helpers.TRAIN_STEPS + 1)} <= tags
  assert ("learned/sink_logit/layer0/head1", records[-1]["learned/sink_logit/layer0/head1"],
          helpers.TRAIN_STEPS) in writer.scalars


def test_learned_values_and_gates_of_each_layer():
  """Two gated layers (A07) with a learned s: s per layer and head, and each layer's mean gate
  over the tokens: layer 0's against a float64 reference (sigmoid(RMSNorm(embedding) W_theta)),
  layer 1's against the model's own modules applied to block 0's output."""
  cfg = config.from_argv(["--workdir", "w", "--seq_len", "16", "--d_model", "16", "--num_heads",
                          str(HEADS), "--mlp_dim", "32", "--num_layers", "2", "--normalizer",
                          "ssmax", "--learned", "s", "--layers", "gated,gated"])[0]
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, 256, 0)))
  rng = np.random.default_rng(0)  # random parameters (no initialiser to compile)
  params = jax.tree.map(lambda a: np.asarray(rng.normal(0.0, 0.5, a.shape), a.dtype),
                        nnx.to_pure_dict(abstract))
  # Free parameters other than the start (0.43) so that each head differs.
  for i in range(2):
    params["blocks"][i]["attn"]["learned"]["s"] = jnp.array([-1.0, 0.5]) * (i + 1)
  tokens = jnp.asarray(data.make_dataset("text", 16, 8, 0).batch(0)["inputs"][:1])

  @jax.jit
  def stats_and_second_gate(params, tokens):
    net = nnx.merge(graphdef, params)
    x = net.blocks[0](net.embed(tokens), jnp.arange(tokens.shape[1])[None])
    block = net.blocks[1]
    gate = jax.nn.sigmoid(block.attn.gate(block.attn_norm(x))).mean(axis=(0, 1))
    return train_lib.learned_stats(graphdef, params, tokens), gate

  stats, second_gate = stats_and_second_gate(params, tokens)
  assert sorted(stats) == ["gate/layer0", "gate/layer1", "learned/s/layer0", "learned/s/layer1"]
  for i in range(2):
    # float32 softplus: a few ulp of relative error.
    np.testing.assert_allclose(stats[f"learned/s/layer{i}"],
                               _softplus(np.array([-1.0, 0.5]) * (i + 1)), rtol=1e-6)
  x = np.asarray(params["embed"]["embedding"], np.float64)[np.asarray(tokens)]
  scale = np.asarray(params["blocks"][0]["attn_norm"]["scale"], np.float64)
  x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale  # nnx.RMSNorm, eps 1e-6
  kernel = np.asarray(params["blocks"][0]["attn"]["gate"]["kernel"], np.float64)
  # float32 sums of 16 products (~1e-6 relative); the sigmoid's slope is at most 1/4.
  np.testing.assert_allclose(stats["gate/layer0"],
                             (1 / (1 + np.exp(-(x @ kernel)))).mean(axis=(0, 1)), atol=1e-5)
  # The same float32 operations in one program: at most a few ulp apart after fusion.
  np.testing.assert_allclose(stats["gate/layer1"], second_gate, rtol=1e-5)
  assert np.ptp(np.asarray(stats["gate/layer1"])) > 0  # per head, not one value broadcast
  assert train_lib.per_head({"gate/layer1": np.array([0.25, 0.5])}) == {
      "gate/layer1/head0": 0.25, "gate/layer1/head1": 0.5}


def test_nothing_learned_and_no_gate_logs_nothing():
  cfg = config.from_argv(LEARNED_SINK[:-4] + ["--workdir", "w"])[0]
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, 256, 0)))
  tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  assert jax.eval_shape(lambda p, t: train_lib.learned_stats(graphdef, p, t), params, tokens) == {}
  learned = dataclasses.replace(cfg, learned="s", normalizer="ssmax", num_layers=2)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(learned, 256, 0)))
  shapes = jax.eval_shape(lambda p, t: train_lib.learned_stats(graphdef, p, t), params, tokens)
  assert {k: v.shape for k, v in shapes.items()} == {"learned/s/layer0": (HEADS,),
                                                     "learned/s/layer1": (HEADS,)}


def test_tensorboard_without_tensorboardx_is_a_clear_error(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX -> ImportError
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as info:
    train_lib.main(LEARNED_SINK + ["--workdir", str(workdir), "--tensorboard"])
  assert info.value.code == train_lib.EXIT_USAGE
  assert "train.py: error: --tensorboard needs the tensorboardX package" in capsys.readouterr().err
  assert not workdir.exists()
