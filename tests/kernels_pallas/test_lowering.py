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

  return export_fwd_bwd(lambda q, k, v: kp.attention(q, k, v, backend=backend, **kw),
                        backend, q, k)


def export_fwd_bwd(fn, backend, q, k):
  """The MLIR text of ``fn``'s forward + backward (cotangent = the output), exported for
  the backend's platform (``"triton"``: cuda; ``"mosaic_tpu"``: tpu); v is shaped like k."""
  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(out)

  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    exp = jax.export.export(jax.jit(fwd_bwd), platforms=[platform],
                            disabled_checks=[TRITON_CALL])(q, k, k)
  return exp.mlir_module()


def _abstract_gpu():
  """An abstract one-device H100 mesh: newer JAX (0.12) reads the target GPU from it when no
  GPU is attached; JAX 0.10 lowers without one, and the mesh changes nothing there. Its axis
  is Auto, not the Explicit default of JAX 0.12: an Explicit axis turns on sharding in
  types, under which the class-T passes' small arrays (and any compile-time constant) fail
  to trace without a concrete mesh, which a real GPU run never lacks."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=device)
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


# The attention contract (issue 15): a value head dim other than the key's, q/k/v of
# different dtypes, a traced scale, a dense bias and mask broadcast over batch, heads and
# queries (blocks of one row / one head pinned to block 0) and a FoX decay (row and
# column vectors) lower for both targets.
def _export_contract(backend, *, bias_shape, mask_shape, b=2, t=256, n=4, kh=2, h=64, hv=128):
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, t, kh, h), jnp.float32)
  v = jax.ShapeDtypeStruct((b, t, kh, hv), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct(bias_shape, jnp.float32)
  mask = jax.ShapeDtypeStruct(mask_shape, jnp.bool_)
  scale = jax.ShapeDtypeStruct((), jnp.float32)
  cq = jax.ShapeDtypeStruct((b, t, n), jnp.float32)

  def fwd_bwd(q, k, v, bias, mask, scale, cq, ck):
    f = lambda q, k, v, bias, scale, cq, ck: kp.attention(  # noqa: E731
        q, k, v, bias, mask, scale=scale, is_causal=True, normalizer="ssmax",
        decay_bias=(cq, ck), backend=backend)
    out, vjp = jax.vjp(f, q, k, v, bias, scale, cq, ck)
    return out, vjp(out)

  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    exp = jax.export.export(jax.jit(fwd_bwd), platforms=[platform],
                            disabled_checks=[TRITON_CALL])(q, k, v, bias, mask, scale, cq, cq)
  return exp.mlir_module()


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("shapes", [((256, 256), (1, 4, 256, 256)),
                                    pytest.param(((2, 1, 256, 256), (1, 1, 1, 256)),
                                                 marks=pytest.mark.slow)],
                         ids=["bias_ts_mask_heads", "bias_batch_mask_keys"])
def test_contract_lowers(backend, shapes):
  text = _export_contract(backend, bias_shape=shapes[0], mask_shape=shapes[1])
  assert text.count("jaxsoft_attention_") >= 3


@pytest.mark.parametrize("backend,normalizer", [
    ("mosaic_tpu", "sparsemax"), ("triton", "standardized_softmax"),
    pytest.param("triton", "sparsemax", marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", "standardized_softmax", marks=pytest.mark.slow)])
def test_dense_bias_lowers_for_class_t_and_r(backend, normalizer):
  cq = jnp.zeros((2, 256, 4))
  text = _export(backend, t=256, normalizer=normalizer, is_causal=True,
                 bias=jnp.zeros((1, 4, 256, 256)), mask=jnp.ones((256, 256), bool),
                 decay_bias=(cq, cq))
  assert text.count("jaxsoft_attention_") >= 3


def test_mosaic_key_blocks_of_a_dense_bias_are_lane_multiples():
  # A bias blocked along the keys in its last dimension needs 128-lane key blocks.
  with pytest.raises(ValueError, match="block_k"):
    _export("mosaic_tpu", t=256, bias=jnp.zeros((256, 256)),
            block_sizes=dict(block_q=128, block_k=64))
