"""Class R (row-statistics normalizers) on the Mosaic-GPU engine, verified without a GPU.

As ``test_mosaic_gpu.py``: ``jax.export(..., platforms=["cuda"])`` runs the whole
Mosaic-GPU lowering for sm_90a (the statistics kernel, then the forward kernel with the
derived per-row operands): a sample covering every row statistic (moments, softmax's
(m, l), the entropy, the extremes) and both second-pass classes by default, every class-R
spec causal and not under ``-m slow``. Pallas's GPU interpreter (JAX 0.12.1, the
newest-JAX CI subset; JAX 0.10's interpreter cannot run the kernels and the test asserts
its clear error) runs the kernels on a CPU against a float64 dense reference
(``tests/reference_f64.py``): one case by default, every spec with masks under ``-m slow``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from jaxsoft.normalizers import spec as _spec
from kernels_pallas import mosaic_gpu as mga
from tests.kernels_pallas.test_mosaic_gpu import _inputs, _reference

# every registered class-R normalizer (each has a row-statistics rule)
CLASS_R = sorted(n for n, s in _spec.REGISTRY.items() if s.kernel_class == "R")
# the default sample: moments with an E second pass (standardized) and a P one (nap), the
# entropy (adaptive temperature: a derived score map), softmax's (m, l) and the extremes
# (sa_softmax_normalized: ldexp in the second pass), epsilon (a kept set); causal and not
SAMPLE = [("standardized_softmax", True), ("nap", False), ("adaptive_temperature_softmax", False),
          ("sa_softmax_normalized", True), ("epsilon_softmax", False)]
MATRIX = [(nm, c) for nm in CLASS_R for c in (False, True)]


def test_every_class_r_spec_is_covered():
  """The matrix is the registry's class R (a new spec is exported and checked by -m slow),
  and each has the row-statistics rule the engine runs."""
  assert len(CLASS_R) >= 8
  for name in CLASS_R:
    rule = _spec.REGISTRY[name].row_stats
    assert rule is not None and rule.second.kernel_class in ("E", "P"), name
  assert {nm for nm, _ in SAMPLE} <= set(CLASS_R)


def _export(normalizer, causal, *, dtype=jnp.bfloat16, t=200, h=64, grad=False, **kw):
  q = jax.ShapeDtypeStruct((1, t, 4, h), dtype)
  k = jax.ShapeDtypeStruct((1, t, 2, h), dtype)
  f = lambda q, k, v: kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer,
                                              is_causal=causal, **kw)
  if grad:
    g = f
    f = lambda q, k, v: jax.grad(lambda *a: g(*a).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
  return jax.export.export(jax.jit(f), platforms=["cuda"])(q, k, k).mlir_module()


def _lowers(normalizer, causal):
  mlir = _export(normalizer, causal)
  # the statistics kernel and the attention kernel, nothing else
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 2, mlir[:2000]


@pytest.mark.parametrize("case", SAMPLE, ids=[f"{n}-{c}" for n, c in SAMPLE])
def test_class_r_lowers_for_cuda(case):
  _lowers(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=[f"{n}-{c}" for n, c in MATRIX])
def test_class_r_lowers_for_cuda_full_matrix(case):
  _lowers(*case)


@pytest.mark.slow
def test_class_r_lowers_with_masks_and_head_dim_256():
  """Window and key lengths (the statistics kernel's flushes of the other warpgroup's
  blocks), float16, H = 256 (64-key blocks)."""
  for causal, window in ((False, (30, 10)), (True, 40)):
    mlir = _export("standardized_softmax", causal, dtype=jnp.float16, h=256,
                   local_window_size=window,
                   key_value_seq_lengths=jnp.array([150], jnp.int32))
    assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 2


def _check(normalizer, causal, dtype, *, b=1, t=100, s=150, n=2, kh=1, h=64, hp=None,
           window=None, lengths=None, block_k=64):
  hp = dict(hp or {})
  q, k, v = _inputs(0, b, t, s, n, kh, h, dtype)
  lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
  call = lambda: kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                         normalizer_params=hp, block_k=block_k,
                                         interpret=True, local_window_size=window,
                                         key_value_seq_lengths=lens)
  if not mga.interpreter_runs_kernel():  # JAX 0.10: the clear error, not a stack trace
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      call()
    return
  out = np.asarray(call().astype(jnp.float32), np.float64)
  ref, bound = _reference(normalizer, q, k, v, causal, 1.0 / math.sqrt(h), hp, window, lengths)
  # as test_mosaic_gpu._check_numerics: the weights rounded to the input dtype before the
  # second matmul and the output once more, |O - O_ref| <= 2u sum_j |w_j| |v_j|, with 10%
  # slack for the float32 statistics (measured: at most 1.7u on every spec)
  u = 2.0 ** -8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0 ** -11
  err = np.abs(out - ref)
  assert np.all(err <= 2.2 * u * bound + 1e-6), (err.max(), (err / (bound + 1e-30)).max())
  assert np.abs(ref).max() > 0.1  # not vacuous
  if lengths is not None:  # a batch entry with no visible key: zero output
    for bi, length in enumerate(lengths):
      if length == 0:
        assert np.all(out[bi] == 0.0)


def test_interpret_class_r_matches_float64_reference():
  """Standardised softmax (moments, a per-row score map of the E second pass), causal,
  GQA, odd lengths (padded query rows and keys), float16, under the GPU interpreter."""
  _check("standardized_softmax", True, jnp.float16, n=2, kh=1, hp={"tau": 0.7})


INTERPRET = [(nm, c, dt) for nm in CLASS_R for c, dt in ((False, "bfloat16"), (True, "float16"))]


@pytest.mark.slow
@pytest.mark.parametrize("case", INTERPRET, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in INTERPRET])
def test_interpret_class_r_matrix(case):
  normalizer, causal, dtype = case
  _check(normalizer, causal, jnp.dtype(dtype))


MASKS = [(nm, c, w, lens) for nm in ("standardized_softmax", "nap", "sa_softmax_normalized",
                                     "eta_softmax")
         for c, w, lens in ((False, (20, 5), [90, 0]), (True, None, [130, 37]))]


@pytest.mark.slow
@pytest.mark.parametrize("case", MASKS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in MASKS])
def test_interpret_class_r_masks(case):
  """A window (the warpgroups' different key ranges), key lengths (an empty batch entry:
  zero output), batch 2, T = 130 (two CTAs), 64-key blocks."""
  normalizer, causal, window, lengths = case
  _check(normalizer, causal, jnp.bfloat16, b=2, t=130, s=150, window=window, lengths=lengths)


@pytest.mark.slow
def test_interpret_class_r_hyperparameters_and_default_blocks():
  """Declared hyperparameters reach derive and the second pass (affine's alpha, clipped's
  zeta and gamma, nap's eps), with the default 128-key blocks."""
  for name, hp in (("affine_softmax", {"alpha": 0.8}),
                   ("clipped_softmax", {"zeta": 1.1, "gamma": -0.1}), ("nap", {"eps": 0.5})):
    _check(name, False, jnp.bfloat16, t=128, s=300, hp=hp, block_k=128)


def test_class_r_gradient_is_refused_naming_the_other_engine():
  """Forward only: differentiating raises UnsupportedError naming kernels_pallas.attention
  (traced only: no kernel runs)."""
  q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
  f = lambda q: kp.mosaic_gpu_attention(q, q, q, normalizer="nap").astype(jnp.float32).sum()
  with pytest.raises(kp.UnsupportedError, match="class R .*'nap'.* kernels_pallas.attention"):
    jax.eval_shape(jax.grad(f), q)


def test_class_r_refuses_what_it_cannot_run():
  """Lazy rescaling needs an exp2 rule (class R's second passes are not), named."""
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="`rescale_threshold` needs a class-E"):
    kp.mosaic_gpu_attention(q, q, q, normalizer="standardized_softmax", rescale_threshold=4.0)
