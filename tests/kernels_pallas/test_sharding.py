"""sharded_attention under jit on 8 fake CPU devices (its own process: the device count is
fixed at start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import kernels_pallas as kp
    from tests.kernels_pallas.test_engine import reference

    assert jax.device_count() == 8
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    b, t, n, kh, h = 4, 32, 4, 2, 16
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, n, h))
    k = jax.random.normal(ks[1], (b, t, kh, h))
    v = jax.random.normal(ks[2], (b, t, kh, h))
    ct = jax.random.normal(ks[3], (b, t, n, h))
    temp = jnp.array([1.0, 0.5, 2.0, 1.5]).reshape(n, 1, 1)
    seg = jnp.asarray(np.repeat(np.arange(2), 16)[None].repeat(b, 0), jnp.int32)
    def ref_loss(q, k, v, temp):
      o = reference(q, k, v, params={"temperature": temp}, segment_ids=seg, is_causal=True)
      return jnp.sum(o * ct), o
    (rval, rout), rgrads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, temp)
    shard = NamedSharding(mesh, P("data", None, "model", None))
    q, k, v = (jax.device_put(x, shard) for x in (q, k, v))

    def loss(q, k, v, temp):
      o = kp.sharded_attention(mesh, q, k, v, batch_axis="data", head_axis="model",
                               normalizer_params={"temperature": temp}, segment_ids=seg,
                               is_causal=True, backend="triton", interpret=True,
                               block_sizes=dict(block_q=16, block_k=16))
      return jnp.sum(o * ct), o

    with jax.set_mesh(mesh):
      (val, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                     has_aux=True))(q, k, v, temp)
    np.testing.assert_allclose(out, rout, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, rgrads):
      np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)
    assert out.sharding.spec == P("data", None, "model", None), out.sharding
    print("SHARDED_OK")
""")


def test_sharded_attention_on_8_devices():
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "SHARDED_OK" in proc.stdout
