"""The threshold normalizers under data parallelism and ``jax.export`` (issue 37, defects 13, 14).

* Defect 13: a batch sharded on an ``Explicit`` mesh (``jax.make_mesh``'s default axis type)
  and the same batch inside ``jax.shard_map`` (default ``check_vma``) gave "loop carry types
  differ" / "select cases must have the same shardings": the solves' carries were built
  with ``jnp.full(shape)``, which has neither the rows' sharding nor their varying axes.
  Runs on 2 CPU devices in a subprocess (the device count is fixed when JAX starts).
* Defect 14: ``jax.export`` with a symbolic batch failed on ``int(np.prod(lead))`` in
  ``common.map_blocks_of_rows`` and ``np.broadcast_shapes`` in ``common.row_param``.

Each result (and gradient) equals the unsharded, directly called one.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers
from tests.helpers import sampled

_CASES = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jaxsoft import normalizers as N
    CASES = {
        "sparsemax": lambda v: N.sparsemax(v),
        "entmax15": lambda v: N.entmax15(v),
        "entmax_1.3": lambda v: N.entmax(v, alpha=1.3),
        "entmax_traced_alpha": lambda v: N.entmax(v, alpha=jnp.asarray(1.7)),
        "asentmax": lambda v: N.asentmax(v, beta=jnp.full((1, 1), 0.7)),
    }
""")

_SCRIPT = _CASES + textwrap.dedent("""
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    row = NamedSharding(mesh, P("data", None))

    def value_and_grad(f, x, ct):
      out, vjp = jax.vjp(f, x)
      return out, vjp(ct)[0]

    # [8, 16]: one block of rows; [8, 8192]: the unsharded solve takes 2 blocks of 4 rows
    # (the default run: sparsemax and entmax's bisection, only sparsemax at [8, 8192];
    # -m slow: every case at both shapes)
    import sys
    full = sys.argv[1:] == ["full"]
    for shape in ((8, 16), (8, 8192)):
      x = jax.random.normal(jax.random.key(0), shape) * 3
      ct = jax.random.normal(jax.random.key(1), shape)
      xs, cts = jax.device_put(x, row), jax.device_put(ct, row)
      for name, f in CASES.items():
        if not full and name not in ("sparsemax", "entmax_1.3")[:1 if shape[1] > 16 else 2]:
          continue
        want = jax.jit(lambda v, c, f=f: value_and_grad(f, v, c))(x, ct)
        with jax.set_mesh(mesh):
          got = jax.jit(lambda v, c, f=f: value_and_grad(f, v, c))(xs, cts)
          assert got[0].sharding.spec == P("data", None), (name, got[0].sharding)
          mapped = jax.jit(jax.shard_map(lambda v, c, f=f: value_and_grad(f, v, c),
                                         mesh=mesh, in_specs=P("data"),
                                         out_specs=P("data")))(xs, cts)
        for a, b in zip((*got, *mapped), want * 2):
          np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                     err_msg=f"{name} {shape}")
    print("ok")
""")


@pytest.mark.parametrize("matrix", [pytest.param("sample"), pytest.param("full", marks=pytest.mark.slow)])
def test_threshold_normalizers_on_an_explicit_mesh_and_in_shard_map_equal_unsharded(matrix):
  env = dict(os.environ, XLA_FLAGS=helpers.fake_device_flags(2),
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, matrix], capture_output=True, text=True,
                        env=env, cwd=root, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["ok"]


_EXPORT_CASES: dict = {}
exec(_CASES, _EXPORT_CASES)  # noqa: S102 (the same cases as the sharded test)


@pytest.mark.parametrize("name", sampled(list(_EXPORT_CASES["CASES"]), ("sparsemax", "entmax_1.3")))
def test_export_with_a_symbolic_batch_round_trips(name):
  f = _EXPORT_CASES["CASES"][name]
  loss = lambda v: jnp.sum(f(v)[:, :3] ** 2)  # noqa: E731
  spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 16"), jnp.float32)
  exported = jax.export.export(jax.jit(f))(spec)
  grad = jax.export.export(jax.jit(jax.grad(loss)))(spec)
  x = helpers.standard_normal(2, (7, 16)) * 3
  for b in (3, 7):  # two batch sizes through the one exported program
    np.testing.assert_allclose(np.asarray(exported.call(x[:b])),
                               np.asarray(jax.jit(f)(x[:b])), rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(np.asarray(grad.call(x[:b])),
                               np.asarray(jax.jit(jax.grad(loss))(x[:b])), rtol=1e-5, atol=1e-6,
                               err_msg=name)
