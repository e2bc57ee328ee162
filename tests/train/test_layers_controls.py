"""The attention-control layers (A49, train.layers.ControlAttention) and PoNet (A51,
train.layers.PoNetLayer) as train/ layer kinds: a few train steps of a tiny stack, causality
(a changed token never reaches an earlier position), decoding = the full forward, and the
refusals (a hybrid with one head, a cache longer than the map)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train.test_train_step import TINY as STEP_TINY
from tests.train.test_train_step import _setup
from train import kinds, layers, model
from train import train as train_lib
from train.config import Config

# the tiny config of tests/train/test_train_step.py, with PoNet segments of 4 tokens and a
# learning rate that fits one batch in 3 steps
TINY = dict(block_size=4, learning_rate=1e-2)
# one stack of both new families: a hybrid of real heads and Q/K from learned position
# embeddings, and PoNet (one compile for the default run; each kind alone under slow)
STACK = dict(num_layers=2, layers="hybrid:static_qk,ponet")
NEW_KINDS = kinds.CONTROL_KINDS + kinds.POOLING_KINDS + kinds.FOX_KINDS


@functools.cache
def _trained(overrides):
  """Losses of 3 train steps on one batch, and the model before and after."""
  cfg, graphdef, state, batch, step = _setup(**TINY, **dict(overrides))
  first = state
  losses = []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return cfg, graphdef, first, state, losses


def _check_trains(overrides):
  _, _, first, last, losses = _trained(tuple(sorted(overrides.items())))
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < losses[0], losses  # 3 steps on the same batch at lr 1e-2 fit it
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                       first["params"], last["params"])
  mixer = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(moved)
           if "['attn']" in jax.tree_util.keystr(p)}
  assert mixer and all(v > 0 for v in mixer.values()), mixer  # every mixer parameter learns


def test_a_stack_of_the_new_kinds_traces_a_train_step_under_rank_promotion_raise():
  """Default run: the loss and its gradient of the stack, traced (shapes, dtypes, no implicit
  rank promotion; no compile); the training itself is the slow test below."""
  cfg = Config(**{**STEP_TINY, **TINY, **STACK})
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, 256, 0)))
  batch = {name: jax.ShapeDtypeStruct((4, cfg.seq_len), dtype) for name, dtype in
           (("inputs", jnp.int32), ("targets", jnp.int32), ("weights", jnp.float32))}
  (loss, weight), grads = jax.eval_shape(jax.value_and_grad(
      lambda p, b: train_lib.loss_sums(graphdef, p, b), has_aux=True), params, batch)
  assert loss.shape == () and loss.dtype == jnp.float32
  assert jax.tree.structure(grads) == jax.tree.structure(params)


@pytest.mark.slow
def test_a_stack_of_the_new_kinds_trains():
  _check_trains(STACK)


@pytest.mark.slow
def test_the_trained_stack_is_causal_and_decodes_as_its_forward():
  # (every kind alone: tests/train/test_layers.py::test_every_kind_is_causal_and_finite and
  # tests/train/test_sample.py::test_cached_decoding_equals_the_full_forward_for_every_kind)
  cfg, graphdef, _, state, _ = _trained(tuple(sorted(STACK.items())))
  net = nnx.merge(graphdef, state["params"])
  assert [b.kind for b in net.blocks] == ["hybrid:static_qk", "ponet"]
  tokens = jax.random.randint(jax.random.key(3), (2, cfg.seq_len), 0, 32)
  changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % 32)
  fwd = nnx.jit(lambda m, x: m(x))
  a, b = np.asarray(fwd(net, tokens)), np.asarray(fwd(net, changed))
  np.testing.assert_array_equal(a[:, :5], b[:, :5])
  assert np.min(np.abs(a[:, 5:] - b[:, 5:]).max(axis=(0, 2))) > 0  # seen from 5 on
  # decoding one token at a time (each layer recomputed over its input history)
  decode = nnx.jit(lambda m, t, p, c: m.decode_step(t, p, c))
  cache, outs = net.init_cache(2, cfg.seq_len), []
  for p in range(cfg.seq_len):
    logits, cache = decode(net, tokens[:, p], jnp.int32(p), cache)
    outs.append(np.asarray(logits))
  # float32, the same ops over the same history: a few roundings of O(1) logits
  np.testing.assert_allclose(np.stack(outs, 1), a, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_each_new_kind_trains_alone(kind):
  _check_trains(dict(attention=kind))


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in NEW_KINDS if k.startswith("hybrid:")])
def test_layer_hybrids_with_softmax_train(kind):
  _check_trains(dict(num_layers=2, layers=f"softmax,{kind.partition(':')[2]}"))


def test_refusals_name_the_problem():
  one_head = Config(**{**STEP_TINY, **TINY, "num_heads": 1, "attention": "hybrid:fixed_map"})
  with pytest.raises(ValueError, match=r"'hybrid:fixed_map' makes half the heads real "
                                       r"attention: it needs --num_heads >= 2, got 1"):
    layers.make_mixer(one_head, "hybrid:fixed_map", 0, rngs=nnx.Rngs(0))
  cfg = Config(**STEP_TINY, **TINY)
  fixed = nnx.eval_shape(lambda: layers.make_mixer(cfg, "fixed_map", 0, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"covers --seq_len = 16 positions, got 17"):
    fixed.init_cache(1, 17)
  no_mixing = nnx.eval_shape(lambda: layers.make_mixer(cfg, "no_mixing", 0,
                                                       rngs=nnx.Rngs(0)))
  assert no_mixing.init_cache(1, 17)["x"].shape == (1, 17, 16)  # no map: any length
  with pytest.raises(ValueError, match=r"'ponet' is not an attention control"):
    layers.ControlAttention(cfg, "ponet", 0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"'fixed_map' is not a pooling kind"):
    layers.PoNetLayer(cfg, "fixed_map", 0, rngs=nnx.Rngs(0))


def test_the_control_layers_use_the_configs_normalizer_and_random_qk_the_layer_index():
  cfg = Config(**{**STEP_TINY, **TINY, "normalizer": "sparsemax"})
  layer = nnx.eval_shape(lambda: layers.make_mixer(cfg, "hybrid:random_qk", 3,
                                                   rngs=nnx.Rngs(0)))
  assert layer.normalizer == "sparsemax" and layer.seed == 3 and layer.real_heads == 1
  ponet = nnx.eval_shape(lambda: layers.make_mixer(cfg, "ponet", 0, rngs=nnx.Rngs(0)))
  assert ponet.causal and ponet.segment_size == 4 and ponet.window == kinds.PONET_WINDOW
