"""The linear family with the batch sharded, as JAX's defaults give it (issue 37, defect 13).

Under an Explicit mesh (``jax.make_mesh``'s default axis type) and inside ``jax.shard_map``
(default ``check_vma``) the forms' loops failed: their carries were built with
``jnp.zeros(shape)``, which has no sharding and no varying axes ("scan body function carry
input and carry output must have equal types", "Incompatible types for matmul arguments",
"All operands should have the same sharding"). With ``[B, T, N, ...]`` inputs sharded over
``data`` along B, every form must give the unsharded outputs, final state and gradients.

Two CPU devices, in a subprocess (the device count is fixed when JAX starts); one
subprocess runs the sampled cases, the full matrix is under ``-m slow``.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests import helpers

_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from jaxsoft import linear

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    B, T, N, K, V = 2, 7, 2, 4, 3
    # numpy's generator and one jitted normalisation: no eager compilation per op
    rng = np.random.default_rng(0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    q, k, v = (f32(rng.standard_normal((B, T, N, d))) for d in (K, K, V))
    k = jax.jit(linear.l2_normalize)(k)
    g = f32(-rng.uniform(size=(B, T, N)))
    beta = f32(rng.uniform(0.1, 1.9, size=(B, T, N)))
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]], jnp.int32)
    opts = dict(output_final_state=True, segment_ids=seg)

    # name -> (function of (q, k, v, g, beta, seg) with the form as keyword, forms)
    FORMS = ("parallel", "recurrent", "chunked")
    CALLS = {
        "linear_attention": (lambda f, q, k, v, g, b, s: linear.linear_attention(
            q, k, v, implementation=f, chunk_size=3, segment_ids=s, output_final_state=True),
            FORMS),
        "simple_gla": (lambda f, q, k, v, g, b, s: linear.simple_gla(
            q, k, v, g, implementation=f, chunk_size=3, segment_ids=s, output_final_state=True),
            FORMS),
        "gla": (lambda f, q, k, v, g, b, s: linear.gla(
            q, k, v, jnp.broadcast_to(g[..., None], q.shape), implementation=f, chunk_size=3,
            segment_ids=s, output_final_state=True), FORMS),
        "delta_rule": (lambda f, q, k, v, g, b, s: linear.delta_rule(
            q, k, v, b, implementation=f, chunk_size=3, segment_ids=s, output_final_state=True),
            FORMS),
        "gated_delta_rule": (lambda f, q, k, v, g, b, s: linear.gated_delta_rule(
            q, k, v, g, b, implementation=f, chunk_size=3, output_final_state=True), FORMS),
        "ttt_linear": (lambda f, q, k, v, g, b, s: linear.ttt_linear(
            q, k, v, 0.1 * b, mini_batch_size=3, implementation=f, output_final_state=True),
            ("recurrent", "chunked")),
        "native_hybrid_attention": (lambda f, q, k, v, g, b, s: linear.native_hybrid_attention(
            q, k, v, jnp.stack([g, 0.5 * g], -1), window=2, implementation=f, chunk_size=3,
            segment_ids=s, output_final_state=True), FORMS),
    }

    def value_and_grad(fn, *args):
      out, vjp = jax.vjp(fn, *args[:3])
      cts = jax.tree.map(lambda o: jnp.cos(3.0 * o), out)   # of the output's sharding
      return out, vjp(cts)

    # "heads": batch over data and heads over model on a (2, 2) mesh, no segment ids (the
    # run ids are then built from q); on an Explicit mesh only
    heads = sys.argv[2] == "heads"
    if heads:
      mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
      seg = None
    spec = P("data", None, "model") if heads else P("data")
    args = (q, k, v, g, beta, seg)
    sharded = tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, spec))
                    for a in args)
    cases = [c.split("/") for c in sys.argv[1].split(",")] if sys.argv[1] != "all" else [
        (name, form) for name, (_, forms) in CALLS.items() for form in forms]
    for name, form in cases:
      call, _ = CALLS[name]
      f = lambda q, k, v, g, b, s: value_and_grad(
          lambda q, k, v: call(form, q, k, v, g, b, s), q, k, v)
      want = jax.jit(f)(*args)
      with jax.set_mesh(mesh):
        explicit = jax.jit(f)(*sharded)
      modes = [("explicit", explicit)]
      if not heads:
        modes.append(("shard_map", jax.jit(jax.shard_map(
            f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(*sharded)))
      for mode, got in modes:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
          np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                     err_msg=f"{name}/{form} {mode}")
    print("ok", len(cases))
""")


def _run(cases: str, layout: str = "batch") -> str:
  env = dict(os.environ, XLA_FLAGS=helpers.fake_device_flags(4 if layout == "heads" else 2),
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, cases, layout], capture_output=True, text=True,
                        env=env, cwd=root, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.split()[-2:]


def test_sharded_batch_gives_the_unsharded_results_sampled():
  """The chunked gated delta rule (zero initial carry, UT inverse, padded run ids), on an
  Explicit mesh and in shard_map; the other variants and forms under -m slow."""
  assert _run("gated_delta_rule/chunked") == ["ok", "1"]


@pytest.mark.slow
def test_sharded_batch_gives_the_unsharded_results_every_form():
  assert _run("all")[0] == "ok"


def test_heads_sharded_without_segment_ids_gives_the_unsharded_results():
  """Heads sharded over a second Explicit axis and no ``segment_ids``: the run ids are built
  from q by a reduction (selecting head 0 of a sharded head axis raised ShardingTypeError in
  every form); the recurrent, parallel and chunked simple GLA."""
  cases = ",".join(f"simple_gla/{form}" for form in ("recurrent", "parallel", "chunked"))
  assert _run(cases, "heads") == ["ok", "3"]


@pytest.mark.slow
def test_heads_sharded_without_segment_ids_every_form():
  assert _run("all", "heads")[0] == "ok"
