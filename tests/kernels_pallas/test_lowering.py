"""Cross-lowering for the real targets on CPU, so illegal block shapes fail in CI.

``jax.export(..., platforms=["tpu"])`` runs the whole Mosaic lowering (block-shape rules:
the last two block dims divisible by (8, 128) or equal to the array's), and
``platforms=["cuda"]`` runs the Pallas-to-Triton lowering (power-of-two tensor shapes)
for the Triton driver. Neither needs an accelerator in this JAX version: no abstract GPU
mesh is required. The Triton custom call has no serialization-compatibility guarantee,
so that one safety check is disabled (we export to lower, not to store).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp

TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def _export(backend, *, b=2, t=384, s=None, n=4, kh=2, h=64, dtype=jnp.bfloat16, **kw):
  s = t if s is None else s
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  k = jax.ShapeDtypeStruct((b, s, kh, h), dtype)

  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: kp.attention(q, k, v, backend=backend, **kw), q, k, v)
    return out, vjp(out)

  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    exp = jax.export.export(jax.jit(fwd_bwd), platforms=[platform],
                            disabled_checks=[TRITON_CALL])(q, k, k)
  return exp.mlir_module()


def _abstract_gpu():
  """An abstract one-device H100 mesh: newer JAX (0.12) reads the target GPU from it when no
  GPU is attached; JAX 0.10 lowers without one, and the mesh changes nothing there."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


CONFIGS = [
    dict(h=64),
    dict(h=128, is_causal=True, normalizer="sigmoid"),
    dict(h=72, t=1000, local_window_size=(128, 0), normalizer="stablemax",
         logits_soft_cap=30.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["h64", "h128_causal_sigmoid", "h72_window"])
def test_triton_lowers_for_cuda(cfg):
  text = _export("triton", **cfg)
  assert "__gpu$xla.gpu.triton" in text
  assert text.count("jaxsoft_attention_") >= 3  # forward, dQ and dK/dV kernels


@pytest.mark.parametrize("cfg", CONFIGS, ids=["h64", "h128_causal_sigmoid", "h72_window"])
def test_mosaic_lowers_for_tpu(cfg):
  text = _export("mosaic_tpu", **cfg)
  assert "tpu_custom_call" in text


def test_segments_and_params_lower_for_both():
  seg = jnp.zeros((2, 512), jnp.int32)
  sinks = jnp.zeros((4, 1, 1))  # a per-head learned sink: an array hyperparameter
  for backend in ("triton", "mosaic_tpu"):
    _export(backend, t=512, segment_ids=seg, normalizer="softmax_sink",
            normalizer_params={"sink_logit": sinks})


def test_illegal_mosaic_block_fails_in_lowering():
  # A query block of 12 rows breaks Mosaic's (8, 128) tiling rule; the argument check
  # catches it before lowering.
  with pytest.raises(ValueError, match="block_q"):
    _export("mosaic_tpu", t=48, block_sizes=dict(block_q=12, block_k=128))
