"""The layer kinds come from tables (train/kinds.py): the linear rows of
jaxsoft.nn.LINEAR_MIXER_TABLE, the sparse rows of train.kinds.SPARSE_ATTENTION, the attention
controls of train.kinds.CONTROL_ATTENTION (A49) and the pooling kinds (PoNet, A51).

Every row reaches the kinds lists, the mixers' table (train.layers.MIXERS) and the command
line's choices; a row added to a table shows up there (the derivation is checked, not a
list written out twice).
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxsoft import nn as js_nn
from train import config, kinds, layers, model
from train.config import Config

TINY = dict(d_model=16, num_heads=2, mlp_dim=32, seq_len=8, block_size=4, top_k=2,
            favor_features=8, workdir="unused")
TABLE = js_nn.LINEAR_MIXER_TABLE


def _attention_choices() -> str:
  """The --attention help text: the values the command line offers."""
  return next(a.help for a in config.make_parser()._actions if "--attention" in a.option_strings)


def test_the_linear_kinds_are_the_causal_rows_of_the_nn_table():
  causal = [name for name, row in TABLE.items() if row.direction != "bidirectional"]
  assert list(dict.fromkeys(k.partition(":")[0] for k in config.LINEAR_KINDS)) == causal
  assert set(config.BIDIRECTIONAL_KINDS) == set(TABLE) - set(causal)
  for name in causal:  # every layer decodes: a forward and a step
    assert callable(TABLE[name].forward) and callable(TABLE[name].step), name
  for name in kinds.FEATURE_MAP_KINDS:  # `linear` once per feature map it accepts
    assert [k for k in config.LINEAR_KINDS if k.startswith(f"{name}:")] == [
        f"{name}:{feature_map}" for feature_map in TABLE[name].feature_maps]
  for name, why in config.BIDIRECTIONAL_KINDS.items():
    assert why.startswith(f"{TABLE[name].title} is bidirectional: ")


def test_the_sparse_kinds_are_the_tables_keys_and_their_needs_are_known():
  assert config.SPARSE_KINDS == tuple(kinds.SPARSE_ATTENTION)
  for name, row in kinds.SPARSE_ATTENTION.items():
    assert callable(row.fn) and set(row.needs) <= set(layers.NEEDS), name


def test_the_control_kinds_are_every_nn_control_alone_and_as_a_hybrid():
  assert set(kinds.CONTROLS.values()) == set(js_nn.ATTENTION_CONTROLS)
  assert kinds.CONTROL_KINDS == tuple(kinds.CONTROL_ATTENTION)
  for name, control in kinds.CONTROLS.items():
    assert kinds.CONTROL_ATTENTION[name] == kinds.ControlKind(control)
    assert kinds.CONTROL_ATTENTION[f"hybrid:{name}"] == kinds.ControlKind(control, hybrid=True)
  assert len(kinds.CONTROL_KINDS) == 2 * len(kinds.CONTROLS)
  assert kinds.POOLING_KINDS == ("ponet",)


def test_every_kind_reaches_the_mixers_and_the_command_line():
  new = kinds.CONTROL_KINDS + kinds.POOLING_KINDS + kinds.FOX_KINDS
  assert config.LAYER_KINDS == (config.ATTENTION_VARIANTS + config.LINEAR_KINDS
                                + config.SPARSE_KINDS + new)
  assert tuple(layers.MIXERS) == config.LINEAR_KINDS + config.SPARSE_KINDS + new
  choices = _attention_choices()
  for kind in config.LAYER_KINDS:
    assert repr(kind) in choices, kind
    config.layer_kinds(Config(**TINY, attention=kind))  # accepted
  for kind in config.BIDIRECTIONAL_KINDS:
    assert kind not in config.LAYER_KINDS and repr(kind) not in choices


def test_a_row_added_to_the_linear_table_reaches_the_kinds():
  new = dataclasses.replace(TABLE["gla"], title="a new gated layer")
  assert kinds.linear_kinds({**TABLE, "new": new}) == config.LINEAR_KINDS + ("new",)
  assert kinds.bidirectional_kinds({**TABLE, "new": new}) == config.BIDIRECTIONAL_KINDS
  one_way = dataclasses.replace(TABLE["rala"], title="A new bidirectional layer")
  assert kinds.linear_kinds({**TABLE, "new": one_way}) == config.LINEAR_KINDS
  assert kinds.bidirectional_kinds({**TABLE, "new": one_way})["new"].startswith(
      "A new bidirectional layer is bidirectional: its key weights")
  fewer_maps = {**TABLE, "linear": dataclasses.replace(TABLE["linear"],
                                                       feature_maps=("relu", "favor"))}
  assert [k for k in kinds.linear_kinds(fewer_maps) if k.startswith("linear")] == [
      "linear:relu", "linear:favor"]


@pytest.mark.parametrize("kind", tuple(layers.MIXERS))
def test_make_mixer_builds_the_tables_layer(kind):
  cfg = Config(**TINY)
  layer = nnx.eval_shape(lambda: layers.make_mixer(cfg, kind, 0, rngs=nnx.Rngs(0)))
  assert type(layer) is layers.MIXERS[kind]
  if kind in kinds.SPARSE_ATTENTION:
    assert (layer.mta_kernel is not None) == ("kernel" in kinds.SPARSE_ATTENTION[kind].needs)
  if kind in kinds.CONTROL_ATTENTION:
    row = kinds.CONTROL_ATTENTION[kind]
    assert layer.control == row.control and layer.real_heads == (1 if row.hybrid else 0)


@pytest.mark.parametrize("variant", config.ATTENTION_VARIANTS)
def test_the_normalizer_block_owns_its_cache_and_step(variant):
  cfg = Config(**TINY, attention=variant, num_kv_heads=1)
  attn = nnx.eval_shape(lambda: model.Attention(cfg, rngs=nnx.Rngs(0)))
  cache = attn.init_cache(2, 8)
  assert {name: c.shape for name, c in cache.items()} == {"k": (2, 8, 1, 8), "v": (2, 8, 1, 8)}
  graphdef, state = nnx.split(attn)
  x = jax.ShapeDtypeStruct((2, 1, 16), jax.numpy.float32)
  out, after = jax.eval_shape(lambda s, x, c: nnx.merge(graphdef, s).step(x, 3, c), state, x,
                              cache)
  assert out.shape == (2, 1, 16) and jax.tree.map(lambda a: a.shape, after) == {
      "k": (2, 8, 1, 8), "v": (2, 8, 1, 8)}


# A46: the token-level hybrids (NAtS-L routing, Oryx's switch) and the 3:1 linear:softmax stack
# with gated-softmax anchors train a few steps on the tiny model with a falling, finite loss.
def _trains(tmp_path, *extra):
  from tests import helpers
  from train import train as train_lib
  workdir = str(tmp_path / "run")
  assert train_lib.main(helpers.train_argv("--workdir", workdir, "--learning_rate", "1e-2",
                                           *extra)) == 0
  _, losses, grads = helpers.train_records(workdir)
  assert np.all(np.isfinite(losses)) and np.all(np.isfinite(grads))
  assert losses[-1] < losses[0], losses


@pytest.mark.slow  # ~13 s of compilation on one core: the default suite builds the layers
@pytest.mark.parametrize("extra", [          # (test_make_mixer_builds_the_tables_layer)
    ("--attention", "nats_attention"),
    ("--attention", "oryx_attention"),
    ("--num_layers", "4", "--layers", kinds.hybrid_layers()),
    ("--num_layers", "2", "--layers", "oryx_attention,nats_attention")], ids=str)
def test_token_hybrid_and_anchor_stacks_train(tmp_path, extra):
  _trains(tmp_path, *extra)


def test_hybrid_layers_gives_the_three_to_one_pattern():
  assert kinds.hybrid_layers() == "gla,gla,gla,gated"
  cfg = Config(**{**TINY, "num_layers": 8}, layers=kinds.hybrid_layers("gated_delta_rule"))
  assert config.layer_kinds(cfg) == ("gated_delta_rule",) * 3 + ("gated",) + (
      "gated_delta_rule",) * 3 + ("gated",)
  with pytest.raises(ValueError, match="`anchor` 'nope' is not a layer kind"):
    kinds.hybrid_layers(anchor="nope")
