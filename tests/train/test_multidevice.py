"""8 fake CPU devices (own process) train like 1 device, on a data-parallel mesh and on the 4-axis
meshes (data, fsdp, context, tensor); a checkpoint written under one mesh restores under another
and on 1 device."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests import helpers
from train import train as train_lib

TINY = helpers.train_argv("--save_every", 3)

# Runs in a fresh process that sees 8 CPU devices.
SCRIPT = textwrap.dedent("""
    import sys
    from train import train as T
    tiny, root = sys.argv[1].split(), sys.argv[2]
    try:
      T.main(tiny + ["--workdir", root + "/bad", "--batch_size", "12"])
      print("BAD_BATCH_ACCEPTED")
    except SystemExit as e:
      print("BAD_BATCH_ERROR", e.code)
    assert T.main(tiny + ["--workdir", root + "/dp8"]) == 0
    # The shard_map wrapper Pallas calls go through computes the same attention per data shard.
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxsoft.attention import dot_product_attention
    from train import sharding
    # (q, k, v split over the batch axes and the heads over tensor: the wrapper gathers heads)
    mesh = jax.make_mesh((2, 2, 1, 2), sharding.MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))) for x
               in jax.random.normal(jax.random.key(0), (3, 8, 16, 2, 8)))
    attend = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    wrapped = jax.jit(sharding.shard_map_attention(mesh)(attend))(q, k, v)
    # (the unwrapped reference jitted too: eager, every op would compile for the 8 devices)
    np.testing.assert_allclose(wrapped, jax.jit(attend)(q, k, v), rtol=1e-5, atol=1e-6)
    print("SHARD_MAP_OK")
    # The layout the state gets on (fsdp=2, tensor=2, context=2): Megatron + FSDP.
    from train import config as C
    cfg, _ = C.from_argv(tiny + ["--workdir", root + "/x", "--mesh", "fsdp=2,tensor=2,context=2"])
    layout = T.build(cfg, sharding.make_mesh(cfg))[5]["params"]
    print("LAYOUT", tuple(layout["blocks"][0]["attn"]["q"]["kernel"].spec),
          tuple(layout["blocks"][0]["down"]["kernel"].spec), tuple(layout["embed"]["embedding"].spec))
    # A mixer of train.layers (simple GLA: the linear kinds' fused [W_q; W_k; W_v], convolution,
    # output gate and projection, and a per-head decay gate) laid out by its logical names on
    # (data=2, fsdp=2, tensor=2): its loss and gradients are the one-device ones.
    from flax import nnx
    from train import layers
    make = lambda: layers.make_mixer(cfg, "simple_gla", 1, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(nnx.eval_shape(make))
    params = nnx.to_pure_dict(jax.jit(lambda: nnx.state(make()))())  # (one program, not eager)
    mesh = jax.make_mesh((2, 2, 1, 2), sharding.MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    specs = sharding.state_specs(dict(mesh.shape), params, sharding.logical_axes(state))
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda s: isinstance(s, P)))
    print("MIXER_LAYOUT", *(f"{k}={tuple(placed[k]['kernel'].sharding.spec)}"
                            for k in ("qkv", "gk", "o")))
    x = jax.random.normal(jax.random.key(1), (4, 16, 16))
    loss = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x)))
    sharded = jax.jit(sharding.in_mesh(mesh, jax.value_and_grad(loss)))(
        placed, jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp")))))
    # (float32 sums in another order: round-off of a few ulps of the terms)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), sharded,
                 jax.jit(jax.value_and_grad(loss))(params, x))
    print("MIXER_OK")
    # Steps 1-2 on (data=2, fsdp=2, context=2) (--fsdp true is fsdp=-1) with jaxsoft's
    # context_parallel_attention, steps 3-4 resumed on (fsdp=2, tensor=2, context=2) with the
    # keys and values gathered by GSPMD; the parent finishes on 1 device.
    quiet = ["--log_every", "100"]
    assert T.main(tiny + quiet + ["--workdir", root + "/mesh", "--mesh", "data=2,context=2",
                                  "--fsdp", "true", "--context_strategy", "all_gather",
                                  "--preempt_at_step", "2"]) == T.EXIT_PREEMPTED
    assert T.main(tiny + quiet + ["--workdir", root + "/mesh", "--mesh",
                                  "fsdp=2,tensor=2,context=2",
                                  "--preempt_at_step", "4"]) == T.EXIT_PREEMPTED
""")


_run = helpers.train_records


def test_eight_devices_match_one_device(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=helpers.fake_device_flags(8), PYTHONPATH=str(helpers.ROOT))
  proc = subprocess.run([sys.executable, "-c", SCRIPT, " ".join(TINY), str(tmp_path)],
                        cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=600)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  # The batch check fires before any work: it names the batch and the device count.
  assert "BAD_BATCH_ERROR" in out and "--batch_size (12)" in out and \
      "number of devices (8)" in out, out
  assert not (tmp_path / "bad" / "config.json").exists()
  assert "8 device(s)" in out and "SHARD_MAP_OK" in out, out
  # (the embedding split by vocabulary entry over tensor: vocab-parallel)
  assert "LAYOUT ('fsdp', 'tensor') ('tensor', 'fsdp') ('tensor', 'fsdp')" in out, out
  # train.layers' mixers by train.layers.PARAMETER_NAMES: column-parallel in, row-parallel out.
  assert "MIXER_LAYOUT qkv=('fsdp', 'tensor') gk=('fsdp', 'tensor') o=('tensor', 'fsdp')" in out
  assert "MIXER_OK" in out, out

  one = str(tmp_path / "one")
  assert train_lib.main(TINY + ["--workdir", one]) == 0
  steps, loss1, norm1 = _run(one)
  assert steps == list(range(1, 7))
  steps8, loss8, norm8 = _run(str(tmp_path / "dp8"))
  assert steps8 == steps
  # Same math, different reduction order: equal within float32 round-off.
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  np.testing.assert_allclose(norm8, norm1, rtol=1e-4)

  # Two steps on each 4-axis mesh (the checkpoint of the first restored under the second), then
  # resumed on this 1-device process: every step as the 1-device run's. The batch split over
  # (data, fsdp) and the sequence over context (attention over the gathered keys), the
  # parameters over fsdp and tensor (the embedding by vocabulary entry): the same sums in
  # another order, float32 round-off.
  chain = str(tmp_path / "mesh")
  assert "resumed from step 2" in out
  assert _run(chain)[0] == [1, 2, 3, 4]
  assert train_lib.main(TINY + ["--workdir", chain]) == 0
  steps_m, loss_m, norm_m = _run(chain)
  assert steps_m == steps
  np.testing.assert_allclose(loss_m, loss1, rtol=1e-5)
  np.testing.assert_allclose(norm_m, norm1, rtol=1e-4)


# One layer of each mixer class of train.layers: linear, sparse attention, attention control
# (half the heads real attention), pooling, FoX.
MIXER_STACK = "gated_delta_rule,topk_attention,hybrid:static_qk,ponet,fox_pro"


@pytest.mark.slow
def test_mixers_on_fsdp_and_tensor_match_one_device(tmp_path):
  # The mixers' parameters laid out by their logical names (Megatron over tensor, rows over
  # fsdp), the untied output matrix and the dense logits split by vocabulary entry over tensor
  # (a vocab-parallel softmax cross-entropy) and the batch over (data, fsdp): the same losses
  # as one device, float32 round-off.
  argv = helpers.train_argv("--num_layers", "5", "--layers", MIXER_STACK, "--steps", "3",
                            "--tie_embeddings", "false", "--loss", "dense")
  mesh = str(tmp_path / "mesh")
  helpers.run_on_cpu_devices(
      "from train import train as T\n"
      f"assert T.main({argv!r} + ['--workdir', {mesh!r}, '--mesh', 'fsdp=2,tensor=2']) == 0\n",
      8)
  one = str(tmp_path / "one")
  assert train_lib.main(argv + ["--workdir", one]) == 0
  steps, loss1, norm1 = _run(one)
  steps8, loss8, norm8 = _run(mesh)
  assert steps8 == steps == [1, 2, 3]
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  np.testing.assert_allclose(norm8, norm1, rtol=1e-4)
