"""A preset that takes more than ~10 minutes on the machine it runs on says so before it starts:
the FLOP count behind the estimate, the estimate against measured runs, and the warning."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from train import config, model
from train import train as train_lib

VOCAB = 256  # the text dataset's (bytes)


def _preset(name, *extra):
  return config.from_argv(["--preset", name, "--workdir", "w", *extra])[0]


def test_flops_per_step_matches_xla_cost_analysis():
  """The matmul count against XLA's count of the lowered forward + backward pass, which also
  counts the element-wise work (norms, GELU, the normalizer, the loss): at d_model 128 that is a
  few percent more (3-4% measured), so the count is 90-100% of XLA's."""
  cfg = config.from_argv(["--workdir", "w", "--d_model", "128", "--num_heads", "4",
                          "--num_kv_heads", "2", "--seq_len", "128", "--batch_size", "2",
                          "--mlp_dim", "512", "--layers", "full,gated", "--loss", "dense",
                          "--implementation", "xla"])[0]
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, VOCAB, 0)))
  tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32)

  def loss(p, t):
    return jnp.mean(nnx.merge(graphdef, p).token_losses(t, t))

  xla = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).cost_analysis()["flops"]
  ratio = train_lib.flops_per_step(cfg, VOCAB) / xla
  assert 0.9 <= ratio <= 1.0, ratio


@pytest.mark.parametrize("preset,measured_s", [
    # Measured on the 2-core CPU machine while other jobs ran: smoke 44,049 tokens/s
    # (docs/benchmarks.md, 2026-12-03): 400 steps x 1024 tokens = 9.3 s; charlm 1,300 tokens/s
    # (8 steps, 2026-12-06): 3000 x 8192 tokens = 18,900 s.
    ("smoke", 9.3), ("charlm", 18_900.0)])
def test_cpu_estimate_is_within_2x_of_measured_runs(preset, measured_s):
  seconds, _ = train_lib.estimate_seconds(_preset(preset), VOCAB, platform="cpu", cpu_cores=2)
  assert measured_s / 2 < seconds < measured_s * 2, seconds


def test_smoke_says_nothing_and_long_presets_say_how_long():
  cpu = dict(platform="cpu", cpu_cores=2)
  assert train_lib.long_run_warning([_preset("smoke")], VOCAB, **cpu) is None
  charlm = train_lib.long_run_warning([_preset("charlm")], VOCAB, **cpu)
  assert charlm is not None and charlm.startswith("note: training 3000 steps takes about 5 h ")
  assert "1.8e+11 FLOPs per step x 3000 steps on 2 CPU cores at an assumed 3e+10 FLOP/s" in charlm
  pod = train_lib.long_run_warning([_preset("tpu_pod")], VOCAB, **cpu)
  assert pod is not None and " days " in pod, pod
  # On the pod it was made for (a v4-32 slice, 16 chips) it is about an hour: said, too.
  pod = train_lib.long_run_warning([_preset("tpu_pod")], VOCAB, platform="tpu",
                                   device_kind="TPU v4", devices=16)
  assert pod is not None and "about 72 min on this machine" in pod, pod
  # The smoke preset on one H100: seconds.
  assert train_lib.long_run_warning([_preset("smoke")], VOCAB, platform="gpu",
                                    device_kind="NVIDIA H100 80GB HBM3") is None
  # Three --compare runs of a 4-minute model: 12 minutes together.
  runs = [_preset("charlm", "--steps", "40")] * 3
  assert train_lib.estimate_seconds(runs[0], VOCAB, **cpu)[0] < train_lib.LONG_RUN_SECONDS
  both = train_lib.long_run_warning(runs, VOCAB, **cpu)
  assert both is not None and "for the 3 --compare runs" in both, both


def test_main_says_so_before_a_long_run_starts(tmp_path, capsys, monkeypatch):
  started = []

  def fake_run(cfg, mesh):
    del mesh
    started.append((cfg.steps, capsys.readouterr().out))
    return 0

  monkeypatch.setattr(train_lib, "run", fake_run)
  # tpu_pod on any CPU machine: days.
  assert train_lib.main(["--preset", "tpu_pod", "--workdir", str(tmp_path / "pod"),
                         "--distributed", "off"]) == 0
  ((steps, out),) = started
  assert steps == 20000 and out.startswith("note: training 20000 steps takes about "), out
  assert train_lib.main(["--preset", "smoke", "--workdir", str(tmp_path / "smoke")]) == 0
  assert started[1] == (400, "")
