"""``js.nn`` sequence-mixing modules on a batch sharded over a mesh (issue 37, defect 13: with
JAX's defaults, an Explicit mesh and ``jax.shard_map`` with its default ``check_vma``, 4 of 5
nn modules failed with "loop carry types differ" / "select cases must have the same
shardings" on their fast paths).

Each module (the attention layer on ``xla_chunked`` with a softmax and a threshold
normalizer, two linear-attention layers on their chunked form) is applied to a [4, 8, 16]
batch sharded over 2 fake CPU devices on an Explicit mesh (``jax.make_mesh``'s default axis
type) under ``jax.jit``; the outputs and the input gradients equal the unsharded call's.
Each device computes its examples with the same program as the unsharded call up to XLA's
partitioning, so 1e-5 (float32, O(1) values). (``jax.shard_map`` over the modules is not
covered here; the functions beneath them are, in tests/attention/test_sharded_attention.py
and tests/linear/test_sharding.py.) One subprocess (the device count is fixed when JAX
starts), under ``-m slow``.
"""

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
    for name, (make, cross) in MODULES.items():
      graphdef, state = nnx.split(make())

      def value_and_grad(state, x):
        apply = lambda x: nnx.merge(graphdef, state)(*((x, x) if cross else (x,)))
        out, vjp = jax.vjp(apply, x)
        return out, vjp(ct if out.shape == ct.shape else jnp.ones_like(out))[0]

      want = jax.jit(value_and_grad)(state, x)
      with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        explicit = jax.jit(value_and_grad)(state, xs)
      assert explicit[0].sharding.spec[0] == "data", (name, explicit[0].sharding)
      for g, w in zip(explicit, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5,
                                   err_msg=name)
      print("OK", name)
""")


@pytest.mark.slow
def test_modules_on_an_explicit_mesh_equal_unsharded():
  proc = run_on_cpu_devices(SCRIPT, 2)
  assert proc.stdout.count("OK ") == 4, proc.stdout
