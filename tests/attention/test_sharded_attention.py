"""Data parallelism with JAX's defaults on the blockwise attention path (issue 37, item 13).

Under an Explicit mesh (``jax.make_mesh``'s default axis type) and inside ``jax.shard_map``
(default ``check_vma``), xla_chunked failed with "loop carry types differ" and "select cases
must have the same shardings": its loop carries were built from shapes (replicated,
invariant) while the loop bodies produce batch-sharded / device-varying values. Each case
runs on 2 CPU devices in a subprocess and compares the batch-sharded forward and gradient
with the unsharded ones.
"""

import os
import subprocess
import sys

import pytest

from tests import helpers

_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxsoft.attention import _chunked
from jaxsoft.attention.call import AttentionCall

B, T, N, H = 2, 64, 2, 8
q, k, v = (jax.random.normal(key, (B, T, N, H)) for key in jax.random.split(jax.random.key(0), 3))
mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
data = NamedSharding(mesh, P("data"))
pallas = sys.argv[2] == "pallas"
for normalizer in sys.argv[1].split(","):
  def attend(q, k, v):  # blocks of 32: two query blocks, a skipped and a masked tile
    if pallas:
      import kernels_pallas
      return kernels_pallas.attention(q, k, v, is_causal=True, normalizer=normalizer,
                                      backend="triton", interpret=True,
                                      block_sizes={"block_q": 32, "block_k": 32})
    call = AttentionCall.create(q, k, v, is_causal=True, normalizer=normalizer)
    return _chunked.chunked_attention(call, block_q=32, block_k=32)

  def forward_and_grad(q, k, v):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(jnp.cos(out)))

  want = jax.jit(forward_and_grad)(q, k, v)
  qs, ks, vs = (jax.device_put(a, data) for a in (q, k, v))
  with jax.set_mesh(mesh):
    explicit = None if pallas else jax.jit(forward_and_grad)(qs, ks, vs)
    spec = (P("data"),) * 4
    mapped = jax.jit(jax.shard_map(forward_and_grad, in_specs=spec[:3], out_specs=spec))(
        qs, ks, vs)
  for mode, got in (("explicit", explicit), ("shard_map", mapped)):
    if got is None:  # Pallas under an Explicit mesh: not partitioned (see the test)
      continue
    assert got[0].sharding.spec[0] == "data", (normalizer, mode, got[0].sharding)
    for a, b in zip(got, want, strict=True):
      # the same float32 program on a half batch, to float32 rounding of the array's scale:
      # the interpreter's class-R variance of a two-key row (causal row 1) cancels, and with
      # JAX_DISABLE_MOST_OPTIMIZATIONS both Pallas runs of standardized_softmax's dq (max 8.3)
      # are 2e-5 from float64 (measured; the dense float32 path 4e-6), 2e-5 apart
      scale = max(1.0, float(np.abs(np.asarray(b)).max()))
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=(1e-5 if pallas else 1e-6) * scale,
                                 err_msg=f"{normalizer} {mode}")
  print("ok", normalizer)
"""


def _run(normalizers, implementation="xla_chunked"):
  env = dict(os.environ, XLA_FLAGS=helpers.fake_device_flags(2),
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, ",".join(normalizers), implementation],
                        capture_output=True, text=True, env=env, cwd=root, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert proc.stdout.split() == [w for n in normalizers for w in ("ok", n)], proc.stdout


def test_chunked_batch_sharded_equals_unsharded_softmax_and_sparsemax():
  """softmax (class E) and sparsemax (class T: the threshold search's carries)."""
  _run(["softmax", "sparsemax"])


@pytest.mark.slow
def test_chunked_batch_sharded_equals_unsharded_other_classes():
  """sigmoid (class P), ssmax (class E with a length term), standardized_softmax (class R),
  top_k_softmax (class T with a jump at tau)."""
  _run(["sigmoid", "ssmax", "standardized_softmax", "top_k_softmax"])


@pytest.mark.slow
def test_pallas_inside_shard_map_equals_unsharded():
  """The Pallas kernels (interpret mode) inside ``jax.shard_map`` with its default
  ``check_vma``: their outputs now carry the inputs' varying axes. softmax (class E) and
  standardized_softmax (class R). Not covered: class T in interpret mode (the interpreter
  indexes a varying block table with an invariant loop index, which check_vma refuses),
  and Pallas under an Explicit mesh outside shard_map (a pallas_call is not partitioned;
  ``kernels_pallas.sharded_attention`` is the supported route)."""
  _run(["softmax", "standardized_softmax"], "pallas")
