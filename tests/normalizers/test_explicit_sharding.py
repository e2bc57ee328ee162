"""Normalizers and the cross-entropy under an explicit-sharding mesh, the class axis sharded.

``jax.make_mesh`` gives ``Explicit`` axes on recent JAX; there a select between a sharded
array and a row statistic broadcast with ``broadcast_to``, or a gather along the sharded
axis, is a type error. The dense normalizers of classes E, S and P and the integer-label
cross-entropy must run there and give the unsharded values and gradients. Runs on 8 CPU
devices in a subprocess (the device count is fixed when JAX starts).
"""

import os
import subprocess
import sys
import textwrap

from tests import helpers

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jaxsoft as js

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.random.normal(jax.random.key(0), (8, 16)) * 3
    where = jnp.arange(16) < 13
    labels = jnp.array([0, 3, 5, 15, 7, 12, 1, 2], jnp.int32)
    ct = jax.random.normal(jax.random.key(1), (8, 16))

    def value_and_grad(f, x, ct):
      out, vjp = jax.vjp(f, x)
      return out, vjp(ct[0] if out.ndim == 2 else ct[1])[0]

    cases = {name: (lambda v, name=name: js.normalizers.get(name).fn(v, where=where))
             for name in ("softmax", "ssmax", "softmax_1", "stablemax", "sigmoid", "softpick")}
    cases["cross_entropy"] = lambda v: (
        js.losses.softmax_cross_entropy_with_integer_labels(v, labels, where=where[None]))
    ct = (ct, ct[:, 0])
    want = {name: jax.jit(lambda v, c, f=f: value_and_grad(f, v, c))(x, ct)
            for name, f in cases.items()}
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    cts = (jax.device_put(ct[0], NamedSharding(mesh, P("data", "model"))),
           jax.device_put(ct[1], NamedSharding(mesh, P("data"))))
    labels = jax.device_put(labels, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
      for name, f in cases.items():
        got = jax.jit(lambda v, c, f=f: value_and_grad(f, v, c))(xs, cts)
        assert got[1].sharding.spec == P("data", "model"), (name, got[1].sharding)
        for a, b in zip(got, want[name]):
          np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6,
                                     err_msg=name)
    print("ok", len(cases))
""")


def test_explicit_sharding_over_the_class_axis_gives_the_unsharded_results():
  env = dict(os.environ, XLA_FLAGS=helpers.fake_device_flags(8),
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                        env=env, cwd=root, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["ok", "7"]
