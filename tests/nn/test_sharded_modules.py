"""``js.nn`` sequence-mixing modules on a batch sharded over a mesh (issue 37, defect 13: with
JAX's defaults, an Explicit mesh and ``jax.shard_map`` with its default ``check_vma``, 4 of 5
nn modules failed with "loop carry types differ" / "select cases must have the same
shardings" on their fast paths).

Each module (the attention layer on ``xla_chunked`` with a softmax and a threshold
normalizer, two linear-attention layers on their chunked form) is applied to a [4, 8, 16]
batch sharded over 2 fake CPU devices on an Explicit mesh (``jax.make_mesh``'s default axis
type) under ``jax.jit``, and (the two attention layers and SimpleGLA) inside
``jax.shard_map`` with its default ``check_vma`` (parameters replicated, the batch and the
cotangent split over "data"); the outputs and the input gradients equal the unsharded
call's. Each device computes its examples with the same program as the unsharded call up to
XLA's partitioning, so 1e-5 (float32, O(1) values). One subprocess (the device count is
fixed when JAX starts), under ``-m slow``."""

import textwrap

import pytest

from tests.helpers import run_on_cpu_devices

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxsoft as js

    mesh = jax.make_mesh((2,), ("data",))
    assert str(mesh.axis_types[0]).endswith("Explicit"), mesh.axis_types
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    MODULES = {
        "mha_softmax_chunked": (lambda: js.nn.MultiHeadAttention(
            2, 16, implementation="xla_chunked", rngs=nnx.Rngs(0)), True),
        "mha_sparsemax_chunked": (lambda: js.nn.MultiHeadAttention(
            2, 16, normalizer="sparsemax", implementation="xla_chunked", rngs=nnx.Rngs(0)), True),
        "gated_delta_net": (lambda: js.nn.GatedDeltaNet(16, 2, rngs=nnx.Rngs(0)), False),
        "simple_gla": (lambda: js.nn.SimpleGLA(16, 2, rngs=nnx.Rngs(0)), False),
    }
    SHARD_MAP = ("mha_softmax_chunked", "mha_sparsemax_chunked", "simple_gla")
    for name, (make, cross) in MODULES.items():
      graphdef, state = nnx.split(make())

      def value_and_grad(state, x, ct):
        apply = lambda x: nnx.merge(graphdef, state)(*((x, x) if cross else (x,)))
        out, vjp = jax.vjp(apply, x)
        return out, vjp(ct)[0]

      want = jax.jit(value_and_grad)(state, x, ct)
      with jax.set_mesh(mesh):
        xs, cts = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, ct))
        got = {"explicit": jax.jit(value_and_grad)(state, xs, cts)}
        if name in SHARD_MAP:  # check_vma=True: JAX's default
          got["shard_map"] = jax.jit(jax.shard_map(
              value_and_grad, in_specs=(P(), P("data"), P("data")),
              out_specs=(P("data"), P("data"))))(state, xs, cts)
      for mode, result in got.items():
        assert result[0].sharding.spec[0] == "data", (name, mode, result[0].sharding)
        for g, w in zip(result, want):
          np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5,
                                     err_msg=f"{name} {mode}")
        print("OK", name, mode)
""")


@pytest.mark.slow
def test_modules_on_an_explicit_mesh_and_in_shard_map_equal_unsharded():
  proc = run_on_cpu_devices(SCRIPT, 2)
  assert proc.stdout.count("OK ") == 7, proc.stdout
