"""The Pallas linear-recurrence kernels (``kernels_pallas.linear``, ``implementation="pallas"``
of ``jaxsoft.linear``) on a sharded batch (issue 37, item 13).

XLA does not partition a ``pallas_call``: with inputs sharded on an Explicit mesh the XLA
preparation before the kernels failed (a bare AssertionError in JAX's reshape sharding rule
when ``[B@data, N, ...]`` became ``[B*N, ...]``); the kernels now run under ``jax.shard_map``
over the batch and head axes (``kernels_pallas.sharding.call_layout``). Inside
``jax.shard_map`` (default ``check_vma``) the ``pallas_call`` output types had no varying
mesh axes, the interpreter's chunk loop (a ``scan`` for constant bounds) changed its carry
types, and the custom backward returned a varying cotangent for an invariant input (the
zero decays of ``delta_rule`` / ``lightning_attention``).

Reference: the same call on unsharded arrays on one device (the kernels themselves are
checked against float64 references in tests/kernels_pallas/test_linear.py). Tolerance 2e-5
relative (absolute floor 2e-5 of the largest entry): the same float32 arithmetic, compiled
into a different program. Four fake CPU devices in a child process (the count is fixed when
JAX starts): a (2, 2) mesh splits the batch over ``data`` and the heads over ``model``;
one child runs every case (start-up and compilation dominate), under ``-m slow`` as the
walk's (tests/test_sharded_walk.py) Pallas cases are.
"""

import textwrap

import pytest

from kernels_pallas.backends import INTERPRET_ENV
from tests import helpers

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from jaxsoft import linear

    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    B, T, N, K, V = 4, 21, 2, 8, 8       # T = 16 + 5: the last chunk is padded
    rng = np.random.default_rng(0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    q, k, v = (f32(rng.standard_normal((B, T, N, d))) for d in (K, K, V))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = f32(-rng.uniform(0.05, 1.0, size=(B, T, N)))
    beta = f32(rng.uniform(0.1, 1.9, size=(B, T, N)))
    seg = jnp.asarray(np.repeat([[0] * 9 + [1] * 12], B, 0), jnp.int32)
    kw = dict(implementation="pallas", chunk_size=16, output_final_state=True)
    CALLS = {
        "simple_gla": lambda q, k, v, g, b, s: linear.simple_gla(q, k, v, g, segment_ids=s, **kw),
        # no g: the per-head decays are constants (invariant inside shard_map)
        "lightning_attention": lambda q, k, v, g, b, s: linear.lightning_attention(
            q, k, v, segment_ids=s, **kw),
        "delta_rule": lambda q, k, v, g, b, s: linear.delta_rule(q, k, v, b, segment_ids=s, **kw),
        "gated_delta_rule": lambda q, k, v, g, b, s: linear.gated_delta_rule(
            q, k, v, g, b, segment_ids=s, **kw),
    }

    def close(got, want, what):
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and np.all(np.isfinite(b)), what
        scale = max(float(np.max(np.abs(b))), 1e-30)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * scale, err_msg=what)

    def value_and_grad(call):
      def f(q, k, v, g, b, s):
        o, S = call(q, k, v, g, b, s)
        return jnp.sum(jnp.sin(1.3 * o)) + jnp.sum(jnp.cos(S))
      return jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))

    args = (q, k, v, g, beta, seg)
    for name, call in CALLS.items():
      want_o, want_S = jax.jit(call)(*args)
      want = jax.jit(value_and_grad(call))(*args)
      # batch over data, heads over model: [B, T, N, ...]
      sharded = [jax.device_put(a, NamedSharding(mesh, P("data", None, "model") if a.ndim > 2
                                                 else P("data"))) for a in args]
      with jax.set_mesh(mesh):
        o, S = jax.jit(call)(*sharded)
        got = jax.jit(value_and_grad(call))(*sharded)
      assert o.sharding.spec[:3] == ("data", None, "model"), (name, o.sharding.spec)
      assert S.sharding.spec[:2] == ("data", "model"), (name, S.sharding.spec)
      for gr, a in zip(got[1], sharded[:5], strict=True):
        assert gr.sharding.is_equivalent_to(a.sharding, a.ndim), (name, gr.sharding.spec)
      close((o, S), (want_o, want_S), f"{name}: Explicit mesh")
      close(got, want, f"{name}: Explicit mesh, gradient")
      print("EXPLICIT", name, flush=True)

      # inside shard_map (default check_vma) over the batch: each shard is its own call
      spec = P("data")
      per = jax.shard_map(lambda *a: tuple(x[None] for x in call(*a)), mesh=mesh,
                          in_specs=spec, out_specs=spec)
      with jax.set_mesh(mesh):
        o, S = jax.jit(per)(*[jax.device_put(a, NamedSharding(mesh, spec)) for a in args])
      o, S = np.asarray(o), np.asarray(S)
      half = B // 2
      for i in range(2):
        w = jax.jit(call)(*(a[i * half:(i + 1) * half] for a in args))
        close((o[i], S[i]), w, f"{name}: shard_map, shard {i}")
      loss = lambda *a: jnp.sum(per(*a)[0] ** 2)
      with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(
            *[jax.device_put(a, NamedSharding(mesh, spec)) for a in args])
      whole = jax.jit(jax.grad(lambda *a: sum(jnp.sum(call(*(x[i * half:(i + 1) * half]
                                                            for x in a))[0] ** 2)
                                              for i in range(2)), argnums=(0, 1, 2, 3, 4)))(*args)
      close(grads, whole, f"{name}: shard_map, gradient")
      print("SHARD_MAP", name, flush=True)
""")


@pytest.mark.slow
def test_the_pallas_linear_kernels_on_a_sharded_batch_and_heads_give_the_unsharded_result():
  """Every Pallas linear family, batch and heads sharded on an Explicit (2, 2) mesh (value,
  final state, gradients of q, k, v, g, beta and their shardings) and inside shard_map."""
  proc = helpers.run_on_cpu_devices(_SCRIPT, 4, env={INTERPRET_ENV: "1"})
  for name in ("simple_gla", "lightning_attention", "delta_rule", "gated_delta_rule"):
    assert f"EXPLICIT {name}" in proc.stdout, proc.stdout[-2000:]
    assert f"SHARD_MAP {name}" in proc.stdout, proc.stdout[-2000:]
