"""train.py on two processes (two "hosts" on localhost, 2 CPU devices each) trains like one
process with the same four devices and mesh, and checkpoints across processes.

Each process runs ``train.main`` with a coordinator on a free local port
(``jax.distributed.initialize``; JAX's CPU collectives across processes are gloo, the default of
the JAX releases supported), reads only its own rows of each batch
(``jax.make_array_from_process_local_data``) and only process 0 writes the logs. The first
launch (mesh ``data=2,fsdp=2``: ``data`` across the two processes) is stopped after step 3 with
its checkpoint saved by both processes; the second launch resumes it on the hybrid mesh
``--dcn_mesh data=2 --mesh fsdp=2`` (each process a slice, through
``jax.experimental.mesh_utils.create_hybrid_device_mesh``) and finishes. The losses and
gradient norms of the six steps equal those of one process with 4 fake devices on the same mesh
within float32 round-off (the same sums, reduced across processes by gloo instead of in one
process). Slow: two launches of two processes, each compiling the train step.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests import helpers
from train import config
from train import train as train_lib

TINY = helpers.train_argv("--log_every", "100", "--eval_every", "0")
STEPS = helpers.TRAIN_STEPS
SCRIPT = "import sys\nfrom train import train as T\nsys.exit(T.main(sys.argv[1:]))\n"


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=helpers.fake_device_flags(devices))
  env["PYTHONPATH"] = str(helpers.ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(name, None)
  return env


def _launch(argv: list[str], processes: int = 2) -> list[tuple[int, str]]:
  """Runs train.main(argv) in ``processes`` processes (2 devices each) joined by a coordinator
  on a free local port; returns each one's (exit status, output)."""
  address = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, "-c", SCRIPT, *argv, "--coordinator_address", address,
       "--num_processes", str(processes), "--process_id", str(i)],
      cwd=helpers.ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(processes)]
  out = []
  try:
    for proc in procs:
      text, _ = proc.communicate(timeout=600)
      out.append((proc.returncode, text))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  return out


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume_across_meshes(tmp_path):
  two = str(tmp_path / "two")
  first = _launch(TINY + ["--workdir", two, "--mesh", "data=2,fsdp=2", "--preempt_at_step", "3"])
  for code, text in first:
    assert code == train_lib.EXIT_PREEMPTED, text[-3000:]
  # Process 0 logs; process 1 says nothing of the run.
  assert "4 device(s)" in first[0][1] and "stopped at step 3" in first[0][1], first[0][1][-3000:]
  assert "device(s)" not in first[1][1], first[1][1][-3000:]
  assert helpers.train_records(two)[0] == [1, 2, 3]

  second = _launch(TINY + ["--workdir", two, "--dcn_mesh", "data=2", "--mesh", "fsdp=2"])
  for code, text in second:
    assert code == 0, text[-3000:]
  assert "resumed from step 3" in second[0][1], second[0][1][-3000:]
  # One history record per launch, written by process 0 alone.
  history = config.read_history(two)
  assert [r["start_step"] for r in history] == [0, 3], history
  assert history[1]["config"]["dcn_mesh"] == "data=2"

  one = str(tmp_path / "one")
  proc = subprocess.run([sys.executable, "-c", SCRIPT, *TINY, "--workdir", one, "--mesh",
                         "data=2,fsdp=2"], cwd=helpers.ROOT, env=_env(4), capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "4 device(s)" in proc.stdout, proc.stdout[-3000:]

  steps, loss2, norm2 = helpers.train_records(two)
  steps1, loss1, norm1 = helpers.train_records(one)
  assert steps == steps1 == list(range(1, STEPS + 1))
  # The same global batch and sums; only the reduction order differs: float32 round-off.
  np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
  np.testing.assert_allclose(norm2, norm1, rtol=1e-4)
