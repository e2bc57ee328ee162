"""8 fake CPU devices (own process) train like 1 device; FSDP checkpoints restore on 1 device."""

import os
import subprocess
import sys
import textwrap

import numpy as np

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
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in
               jax.random.normal(jax.random.key(0), (3, 8, 16, 2, 8)))
    attend = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    wrapped = jax.jit(sharding.shard_map_attention(mesh)(attend))(q, k, v)
    # (the unwrapped reference jitted too: eager, every op would compile for the 8 devices)
    np.testing.assert_allclose(wrapped, jax.jit(attend)(q, k, v), rtol=1e-5, atol=1e-6)
    print("SHARD_MAP_OK")
    assert T.main(tiny + ["--workdir", root + "/fsdp8", "--fsdp", "true",
                          "--preempt_at_step", "3"]) == T.EXIT_PREEMPTED
""")


_run = helpers.train_records


def test_eight_devices_match_one_device(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=str(helpers.ROOT))
  proc = subprocess.run([sys.executable, "-c", SCRIPT, " ".join(TINY), str(tmp_path)],
                        cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=600)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  # The batch check fires before any work: it names the batch and the device count.
  assert "BAD_BATCH_ERROR" in out and "--batch_size (12)" in out and \
      "number of devices (8)" in out, out
  assert not (tmp_path / "bad" / "config.json").exists()
  assert "8 device(s)" in out and "SHARD_MAP_OK" in out, out

  one = str(tmp_path / "one")
  assert train_lib.main(TINY + ["--workdir", one]) == 0
  steps, loss1, norm1 = _run(one)
  assert steps == list(range(1, 7))
  steps8, loss8, norm8 = _run(str(tmp_path / "dp8"))
  assert steps8 == steps
  # Same math, different reduction order: equal within float32 round-off.
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  np.testing.assert_allclose(norm8, norm1, rtol=1e-4)

  # FSDP over 8 devices for 3 steps, then resumed from its checkpoint on this 1-device process.
  fsdp = str(tmp_path / "fsdp8")
  assert _run(fsdp)[0] == [1, 2, 3]
  assert train_lib.main(TINY + ["--workdir", fsdp]) == 0
  steps_f, loss_f, norm_f = _run(fsdp)
  assert steps_f == steps
  np.testing.assert_allclose(loss_f, loss1, rtol=1e-5)
  np.testing.assert_allclose(norm_f, norm1, rtol=1e-4)
