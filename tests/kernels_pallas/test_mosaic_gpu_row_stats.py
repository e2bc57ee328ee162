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
from tests.kernels_pallas.test_mosaic_gpu import (  # SEGMENTS: read by _isolated calls
    SEGMENTS,  # noqa: F401
    _ids,
    _inputs,
    _reference,
)

# every registered class-R normalizer (each has a row-statistics rule)
CLASS_R = sorted(n for n, s in _spec.REGISTRY.items() if s.kernel_class == "R")
# the default sample: moments with an E second pass (standardized) and a P one (nap), the
# entropy (adaptive temperature: a derived score map), softmax's (m, l) and the extremes
# (sa_softmax_normalized: ldexp in the second pass), epsilon (a kept set); causal and not
SAMPLE = [("standardized_softmax", True), ("nap", False), ("adaptive_temperature_softmax", False),
          ("sa_softmax_normalized", True), ("epsilon_softmax", False)]
MATRIX = [(nm, c) for nm in CLASS_R for c in (False, True)]
# the gradient's default sample: moments under both second-pass classes, the extremes
GRAD_SAMPLE = [("standardized_softmax", False), ("nap", True), ("sa_softmax_normalized", False)]


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


def _grad_lowers(normalizer, causal):
  mlir = _export(normalizer, causal, grad=True)
  # statistics, the second pass's dQ sweep (with dθ), the statistics' dQ sweep, dK/dV
  # (with the statistics' tile cotangent), and the forward when the backward reads its
  # output (class E's Δ; class P needs none)
  second = _spec.REGISTRY[normalizer].row_stats.second.kernel_class
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == (5 if second == "E" else 4)


@pytest.mark.parametrize("case", SAMPLE, ids=[f"{n}-{c}" for n, c in SAMPLE])
def test_class_r_lowers_for_cuda(case):
  _lowers(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=[f"{n}-{c}" for n, c in MATRIX])
def test_class_r_lowers_for_cuda_full_matrix(case):
  _lowers(*case)


@pytest.mark.parametrize("case", GRAD_SAMPLE, ids=[f"{n}-{c}" for n, c in GRAD_SAMPLE])
def test_class_r_gradient_lowers_for_cuda(case):
  _grad_lowers(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=[f"{n}-{c}" for n, c in MATRIX])
def test_class_r_gradient_lowers_for_cuda_full_matrix(case):
  _grad_lowers(*case)


@pytest.mark.slow
def test_class_r_lowers_with_masks_and_head_dim_256():
  """Window and key lengths (the statistics kernels' flushes of the other warpgroup's
  blocks), float16, H = 256 (64-key blocks; one consumer warpgroup in the backward's
  dQ and dK/dV kernels), forward and gradient."""
  for causal, window in ((False, (30, 10)), (True, 40)):
    for grad in (False, True):
      mlir = _export("standardized_softmax", causal, dtype=jnp.float16, h=256,
                     local_window_size=window, grad=grad,
                     key_value_seq_lengths=jnp.array([150], jnp.int32))
      assert mlir.count("stablehlo.custom_call @mosaic_gpu") == (5 if grad else 2)


def _check(normalizer, causal, dtype, *, b=1, t=100, s=150, n=2, kh=1, h=64, hp=None,
           window=None, lengths=None, block_k=64, segments=None):
  hp = dict(hp or {})
  q, k, v = _inputs(0, b, t, s, n, kh, h, dtype)
  lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
  call = lambda: kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                         normalizer_params=hp, block_k=block_k,
                                         interpret=True, local_window_size=window,
                                         key_value_seq_lengths=lens,
                                         segment_ids=_ids(segments))
  if not mga.interpreter_runs_kernel():  # JAX 0.10: the clear error, not a stack trace
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      call()
    return
  out = np.asarray(call().astype(jnp.float32), np.float64)
  ref, bound = _reference(normalizer, q, k, v, causal, 1.0 / math.sqrt(h), hp, window, lengths,
                          segments)
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


def test_class_r_refuses_what_it_cannot_run():
  """Lazy rescaling needs an exp2 rule (class R's second passes are not), named."""
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="`rescale_threshold` needs a class-E"):
    kp.mosaic_gpu_attention(q, q, q, normalizer="standardized_softmax", rescale_threshold=4.0)


def _check_grads(normalizer, causal, dtype, *, b=1, t=100, s=150, n=2, kh=1, h=64, hp=None,
                 window=None, lengths=None, interpret=True, segments=None):
  """dQ, dK, dV of the GPU-interpreted kernels against the float64 gradients of the dense
  path (``jax.vjp`` of the normalizer's own function on the logits, under
  ``jax.enable_x64``), as ``max |got - ref| <= 4u max |ref|`` per gradient: measured at
  most 2u on every spec; leaving out the statistics' own gradient (their dQ sweep and the
  tile cotangent in dK/dV) gives 26u to 108u (standardized_softmax, affine_softmax)."""
  import jaxsoft.normalizers as jn
  from tests.kernels_pallas.test_mosaic_gpu import _dense_visible

  hp = dict(hp or {})
  q, k, v = _inputs(0, b, t, s, n, kh, h, dtype)
  do = _inputs(1, b, t, t, n, n, h, dtype)[0]
  lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)

  def call(q, k, v):
    return kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                   normalizer_params=hp, block_k=64, interpret=interpret,
                                   local_window_size=window, key_value_seq_lengths=lens,
                                   segment_ids=_ids(segments))

  if not mga.interpreter_runs_kernel():  # JAX 0.10: the clear error, not a stack trace
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      jax.vjp(call, q, k, v)
    return
  _, vjp = jax.vjp(call, q, k, v)
  got = [np.asarray(a.astype(jnp.float32), np.float64) for a in vjp(do)]
  spec, scale, g = jn.get(normalizer), 1.0 / math.sqrt(h), n // kh
  where = _dense_visible(b, t, s, causal, window, lengths, segments)
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x.astype(jnp.float32), np.float64)) for x in (q, k, v, do)]

    def attend(q, k, v):
      k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
      w = spec.fn(scale * jnp.einsum("bthd,bshd->bhts", q, k), where=where, **hp)
      return jnp.einsum("bhts,bshd->bthd", w, v)

    ref = [np.asarray(a) for a in jax.jit(lambda *a: jax.vjp(attend, *a[:3])[1](a[3]))(*args)]
  u = 2.0 ** -8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0 ** -11
  for name, a, r in zip("qkv", got, ref, strict=True):
    err = np.abs(a - r).max()
    assert err <= 4 * u * np.abs(r).max(), (name, err / u / np.abs(r).max())
    assert np.abs(r).max() > 0.05, (name, np.abs(r).max())  # not vacuous
  if lengths is not None:  # a batch entry with no visible key: zero dQ
    for bi, length in enumerate(lengths):
      if length == 0:
        assert np.all(got[0][bi] == 0.0)


def test_interpret_class_r_gradients_match_float64_reference():
  """Standardised softmax's dQ, dK, dV (moments: the statistics' gradient through
  derive's mean and scale), causal, GQA, odd lengths, float16, under the GPU interpreter."""
  _check_grads("standardized_softmax", True, jnp.float16)


GRADS = [(nm, c, dt) for nm in CLASS_R for c, dt in ((False, "bfloat16"), (True, "float16"))]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRADS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in GRADS])
def test_interpret_class_r_gradients_matrix(case):
  normalizer, causal, dtype = case
  _check_grads(normalizer, causal, jnp.dtype(dtype))


@pytest.mark.slow
@pytest.mark.parametrize("case", MASKS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in MASKS])
def test_interpret_class_r_gradient_masks(case):
  """The masks of :func:`test_interpret_class_r_masks` in the backward (an empty batch
  entry: zero gradients)."""
  normalizer, causal, window, lengths = case
  _check_grads(normalizer, causal, jnp.bfloat16, b=2, t=130, s=150, window=window,
               lengths=lengths)


@pytest.mark.slow
def test_class_r_pipelines_have_no_data_race():
  """The statistics kernel, the forward with per-row operands and the three backward
  kernels under the interpreter's race detector (causal standardized_softmax, T = 256:
  several blocks per loop); on JAX 0.10 the interpreter's clear error."""
  if not mga.interpreter_runs_kernel():
    _check_grads("standardized_softmax", True, jnp.bfloat16)  # asserts the error
    return
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = mga.gpu_interpret_params(detect_races=True)
  _check_grads("standardized_softmax", True, jnp.bfloat16, t=256, s=256, n=1,
               interpret=params)
  assert not ipc.get_races().races_found


# --- segment ids ----------------------------------------------------------------------------


def _isolated(call: str) -> None:
  """``test_mosaic_gpu._isolated`` for this module's helpers (``R``): the interpreted
  segment checks in a fresh Python with XLA's concurrency-optimised scheduler off."""
  from tests.kernels_pallas import test_mosaic_gpu as T
  if not mga.interpreter_runs_kernel():
    import sys
    eval(call, {"R": sys.modules[__name__], "np": np, "jnp": jnp})
    return
  T._isolated("from tests.kernels_pallas import test_mosaic_gpu_row_stats as R\n" + call)


def test_class_r_segments_lower_for_cuda():
  """Segment ids in the statistics kernel, the second pass saving its statistics, and the
  backward's three kernels (the statistics' dQ sweep too), for sm_90a."""
  ids = jnp.zeros((1, 200), jnp.int32).at[:, 90:].set(1)
  mlir = _export("standardized_softmax", True, grad=True, segment_ids=ids)
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 5


# normalizer, causal, segments (B = 2, T = S = 200): the visible counts reach derive
SEG_CASES = [("standardized_softmax", True, "sorted"), ("nap", False, "unsorted"),
             ("sa_softmax_normalized", False, "sorted"), ("eta_softmax", True, "unsorted")]


@pytest.mark.slow
@pytest.mark.parametrize("case", SEG_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in SEG_CASES])
def test_interpret_class_r_segments(case):
  """Forward and gradients with segment ids (rows that see no key: zeros) against the
  float64 dense path with the same mask."""
  normalizer, causal, name = case
  _isolated(f"R._check({normalizer!r}, {causal}, jnp.bfloat16, b=2, t=200, s=200, "
            f"segments=R.SEGMENTS[{name!r}])")
  _isolated(f"R._check_grads({normalizer!r}, {causal}, jnp.bfloat16, b=2, t=200, s=200, "
            f"segments=R.SEGMENTS[{name!r}])")
