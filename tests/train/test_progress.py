"""A training run shows its progress: the tqdm bar (step, loss, tokens/s, time left), the learned
hyperparameters and output gates per layer and head in metrics.jsonl, TensorBoard and
learned.png; and a run estimated to take long says so before it starts."""

import dataclasses
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train import checkpoint, config, data, model, sharding
from train import train as train_lib

# A tiny two-layer model with a learned SSMax s per head and an A07 output gate in both layers.
ARGV = ["--dataset", "text", "--seq_len", "16", "--batch_size", "8", "--d_model", "16",
        "--num_layers", "2", "--num_heads", "2", "--mlp_dim", "32", "--steps", "3",
        "--warmup_steps", "1", "--learning_rate", "3e-2", "--log_every", "1", "--eval_every", "0",
        "--eval_batches", "1", "--normalizer", "ssmax", "--learned", "s", "--layers",
        "gated,gated"]
HEADS = 2


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


def test_learned_values_and_gates_are_logged_per_layer_and_head(tmp_path, capsys, monkeypatch):
  _WRITERS.clear()
  monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=_FakeWriter))
  workdir = str(tmp_path / "run")
  argv = ARGV + ["--workdir", workdir, "--progress", "on", "--tensorboard"]
  assert train_lib.main(argv) == 0
  err = capsys.readouterr().err

  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines()]
  learned = [f"learned/s/layer{i}/head{h}" for i in range(2) for h in range(HEADS)]
  gates = [f"gate/layer{i}/head{h}" for i in range(2) for h in range(HEADS)]
  for record in records:  # every step is a log step (--log_every 1)
    assert sorted(k for k in record if "/" in k) == sorted(gates + learned), record
  # Step 1 is taken at learning rate 0 (warm-up from 0): s is still the default, 0.43.
  np.testing.assert_allclose([records[0][k] for k in learned], 0.43, rtol=1e-6)

  # The last record holds the values of the saved parameters: s is softplus of the free
  # parameter; layer 0's gate the mean over the logged sequence of sigmoid(RMSNorm(embedding)
  # W_theta) (float64 references), layer 1's the same of block 0's output (through the model).
  cfg = config.from_argv(argv)[0]
  _, graphdef, _, _, abstract_state, _, _ = train_lib.build(cfg, sharding.make_mesh(cfg))
  params, step = checkpoint.restore_params(workdir, abstract_state["params"])
  assert step == 3
  last = records[-1]
  for i in range(2):
    free = np.asarray(params["blocks"][i]["attn"]["learned"]["s"])
    # float32 softplus: a few ulp (1.2e-7 each) of relative error.
    np.testing.assert_allclose([last[f"learned/s/layer{i}/head{h}"] for h in range(HEADS)],
                               _softplus(free), rtol=1e-6)
  tokens = data.make_dataset("text", 16, 8, 0).batch(2)["inputs"][:1]  # step 3's batch, row 0
  x = np.asarray(params["embed"]["embedding"], np.float64)[tokens]
  scale = np.asarray(params["blocks"][0]["attn_norm"]["scale"], np.float64)
  x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale  # nnx.RMSNorm, eps 1e-6
  gate = 1 / (1 + np.exp(-(x @ np.asarray(params["blocks"][0]["attn"]["gate"]["kernel"],
                                          np.float64))))
  # float32 over d_model = 16 terms: ~1e-6; the gate's slope is at most 1/4.
  np.testing.assert_allclose([last[f"gate/layer0/head{h}"] for h in range(HEADS)],
                             gate.mean(axis=(0, 1)), atol=1e-5)

  @jax.jit
  def second_gate(params, tokens):
    net = nnx.merge(graphdef, params)
    x = net.blocks[0](net.embed(tokens), jnp.arange(tokens.shape[1])[None])
    block = net.blocks[1]
    return jax.nn.sigmoid(block.attn.gate(block.attn_norm(x))).mean(axis=(0, 1))

  # Two float32 programs of the same block: they may fuse differently (a few ulp apart).
  np.testing.assert_allclose([last[f"gate/layer1/head{h}"] for h in range(HEADS)],
                             second_gate(params, jnp.asarray(tokens)), rtol=1e-5)
  assert (tmp_path / "run" / "learned.png").read_bytes()[:4] == b"\x89PNG"

  # The bar: step, loss, tokens/s, time left.
  final = err.replace("\r", "\n").strip().splitlines()[-1]
  assert "step 3/3" in final and f"loss {records[-1]['loss']:.4f}" in final, final
  assert " tok/s, " in final and " left]" in final, final

  (writer,) = _WRITERS
  assert writer.logdir == str(tmp_path / "run" / "tb") and writer.closed
  tags = {(tag, step) for tag, _, step in writer.scalars}
  assert {(k, s) for k in ["loss", *learned, *gates] for s in (1, 2, 3)} <= tags
  assert ("learned/s/layer1/head1", last["learned/s/layer1/head1"], 3) in writer.scalars


def test_nothing_learned_and_no_gate_logs_nothing():
  cfg = config.from_argv(ARGV[:-4] + ["--workdir", "w"])[0]
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, 256, 0)))
  tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  assert jax.eval_shape(lambda p, t: train_lib.learned_stats(graphdef, p, t), params, tokens) == {}
  learned = dataclasses.replace(cfg, learned="s")
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(learned, 256, 0)))
  shapes = jax.eval_shape(lambda p, t: train_lib.learned_stats(graphdef, p, t), params, tokens)
  assert {k: v.shape for k, v in shapes.items()} == {"learned/s/layer0": (HEADS,),
                                                     "learned/s/layer1": (HEADS,)}
  assert train_lib.per_head({"gate/layer1": np.array([0.25, 0.5])}) == {
      "gate/layer1/head0": 0.25, "gate/layer1/head1": 0.5}


def test_tensorboard_without_tensorboardx_is_a_clear_error(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX -> ImportError
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as info:
    train_lib.main(ARGV + ["--workdir", str(workdir), "--tensorboard"])
  assert info.value.code == train_lib.EXIT_USAGE
  assert "train.py: error: --tensorboard needs the tensorboardX package" in capsys.readouterr().err
  assert not workdir.exists()
