"""The mesh flags (--mesh, --dcn_mesh, --fsdp), the logical-axis rule table and the batch
arithmetic of train.sharding, without devices (the multi-device runs are in
test_multidevice.py, the two-process run in test_multihost.py)."""

import types

import jax
import numpy as np
import pytest
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import PartitionSpec as P

from tests import helpers
from train import config, mesh_flags, model, sharding
from train import train as train_lib
from train.config import ConfigError


def test_parse_mesh():
  assert sharding.parse_mesh("") == {}
  assert sharding.parse_mesh("data=2, fsdp=-1,tensor=1") == {"data": 2, "fsdp": -1, "tensor": 1}


@pytest.mark.parametrize("text, needle", [
    ("model=2", "unknown mesh axis 'model'; axes: data, fsdp, context, tensor"),
    ("data=-1,fsdp=-1", "-1 (fill the rest) may be given for one axis only"),
    ("data=2,data=2", "axis 'data' given twice"),
    ("data", "expected AXIS=SIZE pairs, got 'data'"),
    ("tensor=two", "size of 'tensor' must be an integer, got 'two'"),
    ("context=0", "size of 'context' must be positive or -1, got 0"),
    ("context=-2", "size of 'context' must be positive or -1, got -2"),
])
def test_parse_mesh_errors_name_the_flag_and_the_problem(text, needle):
  with pytest.raises(ConfigError) as info:
    sharding.parse_mesh(text)
  assert str(info.value).startswith("--mesh: ") and needle in str(info.value), info.value


@pytest.mark.parametrize("mesh, fsdp, devices, shape", [
    ("", False, 8, (8, 1, 1, 1)),                      # the old 1-axis data mesh
    ("", True, 8, (1, 8, 1, 1)),                       # --fsdp true is fsdp=-1
    ("tensor=2", False, 8, (4, 1, 1, 2)),              # no -1, no data: data takes the rest
    ("data=2", True, 8, (2, 4, 1, 1)),                 # --fsdp adds fsdp=-1
    ("fsdp=2", True, 8, (4, 2, 1, 1)),                 # --fsdp with fsdp named: nothing added
    ("data=2,fsdp=2,context=2", False, 8, (2, 2, 2, 1)),
    ("fsdp=2,tensor=2,context=-1", False, 8, (1, 2, 2, 2)),
    ("data=1,fsdp=1,context=1,tensor=1", False, 1, (1, 1, 1, 1)),
])
def test_mesh_shape(mesh, fsdp, devices, shape):
  assert sharding.mesh_shape(mesh, fsdp, devices) == shape


@pytest.mark.parametrize("mesh, fsdp, devices, needle", [
    ("data=3", False, 8, "the sizes (product 3) must divide the number of devices (8)"),
    ("data=2,fsdp=2", False, 8, "the sizes multiply to 4, not the number of devices (8)"),
    ("context=-1,tensor=2", True, 8, "--fsdp true means fsdp=-1, but --mesh already gives -1 "
                                     "to 'context' (-1 twice)"),
    ("data=16", False, 8, "must divide the number of devices (8)"),
])
def test_mesh_shape_errors(mesh, fsdp, devices, needle):
  with pytest.raises(ConfigError) as info:
    sharding.mesh_shape(mesh, fsdp, devices)
  assert needle in str(info.value), info.value


def test_mesh_flags_are_checked_by_validate(tmp_path):
  argv = helpers.train_argv("--workdir", str(tmp_path), "--mesh", "data=2,expert=2")
  cfg, _ = config.from_argv(argv)
  with pytest.raises(ConfigError, match="--mesh: unknown mesh axis 'expert'"):
    config.validate(cfg, check_workdir=False)
  cfg, _ = config.from_argv(helpers.train_argv("--workdir", str(tmp_path), "--dcn_mesh",
                                               "data=-1,fsdp=-1"))
  with pytest.raises(ConfigError, match="--dcn_mesh: -1"):
    config.validate(cfg, check_workdir=False)


def test_hybrid_mesh_shapes_and_device_layout():
  # 4 slices of 4 devices: 2 x 2 slices across (data, fsdp), (fsdp=2, tensor=2) within each.
  ici, dcn = sharding.hybrid_mesh_shapes("fsdp=2,tensor=2", "data=2,fsdp=2", False, 16, 4)
  assert (ici, dcn) == ((1, 2, 1, 2), (2, 2, 1, 1))
  assert sharding.hybrid_mesh_shapes("", "", True, 8, 2) == ((1, 4, 1, 1), (2, 1, 1, 1))
  with pytest.raises(ConfigError, match=r"--dcn_mesh data=3: .*number of slices \(4\)"):
    sharding.hybrid_mesh_shapes("", "data=3", False, 16, 4)
  with pytest.raises(ConfigError, match=r"--mesh tensor=8: .*devices per slice \(4\)"):
    sharding.hybrid_mesh_shapes("tensor=8", "data=4", False, 16, 4)
  with pytest.raises(ConfigError, match="16 devices do not split into 3 equal slices"):
    sharding.hybrid_mesh_shapes("", "", False, 16, 3)
  # The device array JAX builds for these shapes (stand-in devices, 4 per slice): each slice's
  # devices form one contiguous (fsdp, tensor) block; slices differ along data and fsdp.
  devices = [types.SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 4,
                                   platform="cpu", device_kind="cpu") for i in range(16)]
  grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
  assert grid.shape == tuple(a * b for a, b in zip(ici, dcn, strict=True)) == (2, 4, 1, 2)
  slice_of = np.vectorize(lambda d: d.slice_index)(grid)[:, :, 0, :]
  np.testing.assert_array_equal(slice_of[0], [[0, 0], [0, 0], [1, 1], [1, 1]])
  np.testing.assert_array_equal(slice_of[1], [[2, 2], [2, 2], [3, 3], [3, 3]])
  assert sharding._num_slices(devices) == (4, False)
  assert sharding._num_slices([types.SimpleNamespace(process_index=i // 2) for i in range(8)]
                              ) == (4, True)
  # CPU and GPU devices say slice 0: each process is a slice.
  assert sharding._num_slices([types.SimpleNamespace(process_index=i // 2, slice_index=0)
                               for i in range(8)]) == (4, True)


def test_logical_spec_drops_axes_that_do_not_divide():
  sizes = {"data": 2, "fsdp": 2, "context": 2, "tensor": 4}
  assert sharding.logical_spec(("embed", "heads"), (16, 32), sizes) == P("fsdp", "tensor")
  assert sharding.logical_spec(("embed", "heads"), (16, 6), sizes) == P("fsdp")
  assert sharding.logical_spec(("embed", "heads"), (3, 6), sizes) == P()
  assert sharding.logical_spec(("act_batch", "act_length", None), (8, 4, 5), sizes) == \
      P(("data", "fsdp"), "context")
  # Only the axes that divide are kept (data alone for 2 rows); size-1 axes are left out.
  assert sharding.logical_spec(("act_batch", "act_length"), (2, 3), sizes) == P("data")
  assert sharding.logical_spec(("act_batch",), (8,), {"data": 1, "fsdp": 8}) == P("fsdp")
  with pytest.raises(ValueError, match="logical axis 'expert' is not in LOGICAL_AXIS_RULES"):
    sharding.logical_spec(("expert",), (4,), sizes)
  with pytest.raises(ValueError, match="2 logical names for an array of rank 1"):
    sharding.logical_spec(("embed", "mlp"), (4,), sizes)


def _specs(sizes, *extra):
  """The PartitionSpec of every leaf of the tiny model's train state on a mesh of ``sizes``."""
  cfg, _ = config.from_argv(helpers.train_argv("--workdir", "/unused", *extra))
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, 256, 0)))
  axes = sharding.logical_axes(params)
  optimizer = train_lib.make_optimizer(cfg)
  state = jax.eval_shape(lambda: train_lib.init_state(cfg, graphdef, nnx.to_pure_dict(params),
                                                      optimizer))
  return sharding.state_specs(sizes, state, axes)


def test_rule_table_gives_the_megatron_fsdp_layout():
  # The tiny model: d_model 16, 2 heads of 8, MLP 32, vocab 256.
  specs = _specs({"data": 2, "fsdp": 2, "context": 2, "tensor": 2})
  block = specs["params"]["blocks"][0]
  assert specs["params"]["embed"]["embedding"] == P("tensor", "fsdp")   # (vocab, embed)
  assert block["attn"]["q"]["kernel"] == P("fsdp", "tensor")         # column-parallel
  assert block["attn"]["k"]["kernel"] == P("fsdp", "tensor")
  assert block["attn"]["v"]["kernel"] == P("fsdp", "tensor")
  assert block["attn"]["o"]["kernel"] == P("tensor", "fsdp")         # row-parallel
  assert block["up"]["kernel"] == P("fsdp", "tensor")                # column-parallel
  assert block["up"]["bias"] == P("tensor")
  assert block["down"]["kernel"] == P("tensor", "fsdp")              # row-parallel
  assert block["down"]["bias"] == P()
  assert block["attn_norm"]["scale"] == P() and specs["params"]["final_norm"]["scale"] == P()
  # Adam's moments are laid out as their parameters; counters, step and RNG replicated.
  adam = specs["opt_state"][1][0]
  assert adam.mu["blocks"][0]["attn"]["o"]["kernel"] == P("tensor", "fsdp")
  assert adam.nu["embed"]["embedding"] == P("tensor", "fsdp")
  assert adam.count == P() and specs["step"] == P() and specs["rng"] == P()


def test_unnamed_parameters_get_the_fsdp_rule():
  # The A07 gate [16, 2] has no logical names: its largest dimension goes to fsdp; with fsdp
  # of size 1 it is replicated. The untied output matrix is (embed, vocab): vocab-parallel.
  specs = _specs({"data": 1, "fsdp": 4, "context": 1, "tensor": 2}, "--attention", "gated",
                 "--tie_embeddings", "false")
  assert specs["params"]["blocks"][0]["attn"]["gate"]["kernel"] == P("fsdp")
  assert specs["params"]["unembed"] == P("fsdp", "tensor")
  specs = _specs({"data": 8, "fsdp": 1, "context": 1, "tensor": 1}, "--attention", "gated")
  assert specs["params"]["blocks"][0]["attn"]["gate"]["kernel"] == P()
  assert specs["params"]["blocks"][0]["attn"]["q"]["kernel"] == P()


def test_batch_arithmetic():
  sharding.check_batch(16, 2, 4, 2, seq_len=16, context=2, total_devices=8)
  with pytest.raises(ConfigError, match=r"--batch_size \(6\) must be divisible by the batch "
                                        r"devices data x fsdp \(4\)"):
    sharding.check_batch(6, 1, 4, 1, total_devices=8)
  with pytest.raises(ConfigError, match=r"--seq_len \(15\) must be divisible by the context "
                                        r"axis \(2\)"):
    sharding.check_batch(8, 1, 4, 1, seq_len=15, context=2, total_devices=8)
  with pytest.raises(ConfigError, match=r"micro-batch \(2\) must be divisible by the number of "
                                        r"hosts \(4\)"):
    sharding.check_batch(2, 1, 1, 4)


def test_the_worked_example_of_docs_training():
  # docs/training.md: --mesh data=2,fsdp=4,tensor=2 with the tpu_pod preset's sizes.
  specs = _specs({"data": 2, "fsdp": 4, "context": 1, "tensor": 2}, "--d_model", "1024",
                 "--num_heads", "16", "--mlp_dim", "4096")["params"]
  block = specs["blocks"][0]
  assert specs["embed"]["embedding"] == P("tensor", "fsdp")
  assert block["attn"]["q"]["kernel"] == block["attn"]["k"]["kernel"] == P("fsdp", "tensor")
  assert block["attn"]["o"]["kernel"] == P("tensor", "fsdp")
  assert block["up"]["kernel"] == P("fsdp", "tensor") and block["up"]["bias"] == P("tensor")
  assert block["down"]["kernel"] == P("tensor", "fsdp") and block["down"]["bias"] == P()
  assert block["mlp_norm"]["scale"] == P()


def test_context_strategy_is_checked(monkeypatch):
  # The strategies the flag takes are jaxsoft.attention.context_parallel's, plus gspmd.
  from jaxsoft.attention import context_parallel
  assert set(config.CONTEXT_STRATEGIES) == {"gspmd", *context_parallel.STRATEGIES}
  assert sharding.context_strategies() == tuple(context_parallel.STRATEGIES)

  def check(strategy):
    cfg, _ = config.from_argv(helpers.train_argv("--workdir", "/unused", "--context_strategy",
                                                 strategy))
    config.validate(cfg, check_workdir=False)

  check("ring")
  with pytest.raises(ConfigError, match="--context_strategy: unknown value 'rings'"):
    check("rings")
  # A jaxsoft without a strategy (or without the module): refused, naming what there is.
  monkeypatch.setattr(mesh_flags, "context_strategies", lambda: ("all_gather",))
  with pytest.raises(ConfigError, match="'ring' is not available here; one of gspmd, all_gather"):
    check("ring")


def test_every_mixer_parameter_has_logical_names():
  # Every parameter of every train.layers kind is named (none falls back to the FSDP rule),
  # with one name per dimension, each a row of LOGICAL_AXIS_RULES.
  from train import layers
  cfg, _ = config.from_argv(helpers.train_argv("--workdir", "/unused"))
  rules = dict(sharding.LOGICAL_AXIS_RULES)
  for kind in layers.MIXERS:
    state = nnx.state(nnx.eval_shape(lambda kind=kind: layers.make_mixer(
        cfg, kind, 1, rngs=nnx.Rngs(0))), nnx.Param)
    shapes = {tuple(map(str, path)): v.shape for path, v in nnx.to_flat_state(state)}
    for path, names in sharding.logical_axes(state).items():
      assert names is not None, (kind, path)
      assert len(names) == len(shapes[path]) and all(n is None or n in rules for n in names), \
          (kind, path, names)
  with pytest.raises(ValueError, match=r"1 logical names for 'kernel' of shape \(4, 6\)"):
    layers.name_parameters(nnx.Linear(4, 6, rngs=nnx.Rngs(0)), {"kernel": ("embed",)})


def test_mixers_get_the_megatron_fsdp_layout():
  # Tiny model (d 16, 2 heads of 8, kv_heads 2): in-projections (embed, heads) column-parallel,
  # out-projections (heads, embed) row-parallel, per-head vectors with their heads, norms whole.
  specs = _specs({"data": 2, "fsdp": 2, "context": 1, "tensor": 2}, "--num_layers", "6",
                 "--layers", "gated_delta_rule,gla,topk_attention,hybrid:static_qk,ponet,fox_pro"
                 )["params"]["blocks"]
  gdn, gla, sparse, control, ponet, fox = (specs[i]["attn"] for i in range(6))
  assert gdn["qkv"]["kernel"] == gdn["gate"]["kernel"] == P("fsdp", "tensor")
  assert gdn["conv"] == P(None, "tensor") and gdn["o"]["kernel"] == P("tensor", "fsdp")
  assert gdn["a"]["kernel"] == gdn["beta"]["kernel"] == P("fsdp", "tensor")
  assert gdn["A_log"] == gdn["dt_bias"] == P("tensor") and gdn["o_norm"] == P()
  # GLA's rank-16 gate: W^1 (embed, 16) over fsdp only, W^2 (16, heads) over tensor.
  assert gla["gk"]["kernel"] == P("fsdp") and gla["gk2"]["kernel"] == P(None, "tensor")
  assert sparse["q"]["kernel"] == sparse["k"]["kernel"] == P("fsdp", "tensor")
  assert sparse["o"]["kernel"] == P("tensor", "fsdp")
  assert control["query"]["kernel"] == control["value"]["kernel"] == P("fsdp", "tensor")
  assert control["out"]["kernel"] == P("tensor", "fsdp") and control["positions"] == P(None, "fsdp")
  assert ponet["segment"]["kernel"] == P("fsdp", "tensor") and ponet["segment"]["bias"] == \
      P("tensor")
  assert ponet["out"]["kernel"] == P("tensor", "fsdp") and ponet["out"]["bias"] == P()
  assert fox["attn"]["query"]["kernel"] == fox["attn"]["key"]["kernel"] == P("fsdp", "tensor")
  assert fox["attn"]["out"]["kernel"] == P("tensor", None, "fsdp")
  assert fox["q_norm_scale"] == P("tensor") and fox["attn"]["forget_bias"] == P("tensor")
