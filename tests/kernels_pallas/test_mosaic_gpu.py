"""The Mosaic-GPU (Hopper) attention forward and backward, verified without a GPU.

Two checks need no accelerator:

* ``jax.export(..., platforms=["cuda"])`` runs the whole Mosaic-GPU lowering for sm_90a
  with Hopper's 227 KiB of shared memory: layouts, wgmma shapes, TMA transforms, dtype
  and shared-memory overflow errors surface there. Every class x dtype x causal x head
  dim, for the forward and for ``jax.grad`` (the forward saving its row statistics, the
  dQ and dK/dV kernels) (under ``-m slow``; a sample covering each value by default).
* Pallas's GPU interpreter runs the kernel on a CPU (warpgroups, TMA ring and barriers
  simulated) and is compared with an independent float64 numpy reference
  (``tests/reference_f64.py``). JAX 0.10's interpreter has no rule for ``pl.run_state``
  (the accumulator handed to the second wgmma): there the test asserts the kernel's clear
  UnsupportedError instead; JAX 0.12.1 (the newest-JAX CI subset) runs the numerics, the
  gradients against the float64 gradients of the dense path (``jax.vjp`` of the
  normalizer's own function under ``jax.enable_x64``).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from jaxsoft.normalizers import get as get_spec
from kernels_pallas import mosaic_gpu as mga
from tests import reference_f64


def _export(normalizer, dtype, causal, h, *, b=1, t=200, s=None, n=4, kh=2, **kw):
  s = t if s is None else s
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  k = jax.ShapeDtypeStruct((b, s, kh, h), dtype)
  f = lambda q, k, v: kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer,
                                              is_causal=causal, **kw)
  return jax.export.export(jax.jit(f), platforms=["cuda"])(q, k, k).mlir_module()


# E (exp2 path; with an offset and floor), E (generic path: numerator != denominator, a
# floor; a length-dependent score map), P (tanh sigmoid; relu, a custom_jvp inlined), S
NORMALIZERS = ["softmax", "softmax_1", "softpick", "ssmax", "sigmoid", "relu", "stablemax"]
MATRIX = [(nm, dt, c, h) for nm in NORMALIZERS for dt in ("bfloat16", "float16")
          for c in (False, True) for h in (64, 128, 256)]
# the default sample: every class, dtype, causal flag and head dim at least once
SAMPLE = [("softmax", "bfloat16", True, 256), ("sigmoid", "float16", False, 64),
          ("stablemax", "bfloat16", True, 128)]


def _lowers(normalizer, dtype, causal, h):
  mlir = _export(normalizer, jnp.dtype(dtype), causal, h)
  # one Mosaic-GPU custom call, no fallback to anything else
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 1, mlir[:2000]


@pytest.mark.parametrize("case", SAMPLE, ids=["-".join(map(str, c)) for c in SAMPLE])
def test_lowers_for_cuda(case):
  _lowers(*case)


def test_lazy_rescaling_lowers():
  """``rescale_threshold``: the accumulator's rescale under a branch on the warpgroup's
  smallest factor (a cross-warp reduction to a scalar, then a conditional) lowers."""
  mlir = _export("softmax_1", jnp.float16, False, 64, t=256, rescale_threshold=8.0)
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 1


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=["-".join(map(str, c)) for c in MATRIX])
def test_lowers_for_cuda_full_matrix(case):
  _lowers(*case)


def test_shared_memory_overflow_is_caught_by_the_export_and_the_wrapper():
  """A ring too deep for 227 KiB: the wrapper refuses it naming the arguments, and the
  export itself (the wrapper's check bypassed) fails with the byte count that
  ``smem_bytes`` predicts (plus barriers and alignment, about 2 KiB)."""
  h, bk, stages = 256, 128, 3
  need = mga.smem_bytes(h, jnp.bfloat16, 64, bk, stages)
  assert need > mga.SMEM_LIMIT
  with pytest.raises(ValueError, match="`block_k`=128 x `num_stages`=3"):
    _export("softmax", jnp.bfloat16, False, h, t=256, s=512, block_k=bk, num_stages=stages)
  cfg = mga._Cfg(spec=get_spec("softmax"), hp=(), scale=0.1, causal=False, t=256, s=512,
                 block_q=64, block_k=bk, num_stages=stages, exp2=True,
                 approx_sigmoid=False)
  q = jax.ShapeDtypeStruct((1, 256, 1, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 512, 1, h), jnp.bfloat16)
  with pytest.raises(ValueError, match="exceeds available shared memory") as err:
    jax.export.export(jax.jit(lambda q, k, v: mga._forward(cfg, q, k, v, None)),
                      platforms=["cuda"])(q, k, k)
  found = int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1))
  assert need <= found <= need + mga.SMEM_SLACK, (need, found)
  # and the largest ring the wrapper accepts at H = 256 lowers
  assert mga.smem_bytes(h, jnp.bfloat16, 64, 64, 2) <= mga.SMEM_LIMIT


@pytest.mark.parametrize("kw, match", [
    (dict(normalizer="gumbel_softmax"), "not of class E, S or P"),  # class X
    (dict(h=96), "must be 64, 128 or 256"),
    (dict(dtype=jnp.float32), "float16 or bfloat16"),
    (dict(block_k=96), "multiple of 64"),
    (dict(block_q=128), "`block_q` must be 64"),
    (dict(num_stages=1), "at least 2"),
    (dict(kh=3), "multiple of the key/value heads"),
    (dict(normalizer_params={"temperature": jnp.ones(())}), "Python number"),
    (dict(normalizer="sigmoid", rescale_threshold=8.0), "`rescale_threshold` needs a class-E"),
    (dict(rescale_threshold=-1.0), "`rescale_threshold` must be None or a number"),
    (dict(local_window_size=-1), "`local_window_size` must be None"),
    (dict(local_window_size=(1, 2, 3)), "`local_window_size` must be None"),
    (dict(key_value_seq_lengths=jnp.ones((2,), jnp.int32)), "`key_value_seq_lengths` must be"),
    (dict(key_value_seq_lengths=jnp.ones((1,), jnp.float32)), "`key_value_seq_lengths` must be"),
])
def test_errors_name_the_argument(kw, match):
  kw = dict(kw)
  dtype, h, kh = kw.pop("dtype", jnp.bfloat16), kw.pop("h", 64), kw.pop("kh", 1)
  q = jnp.zeros((1, 128, 3 if kh == 3 else 2, h), dtype)
  k = jnp.zeros((1, 128, 2 if kh == 3 else kh, h), dtype)
  with pytest.raises((ValueError, kp.UnsupportedError), match=match):
    kp.mosaic_gpu_attention(q, k, k, **kw)


@pytest.mark.parametrize("version, refused", [(12080, True), (12090, True), (12091, False),
                                              (12060, False)])
def test_causal_refused_on_the_cuda_versions_that_miscompile_it(monkeypatch, version, refused):
  """CUDA 12.8.0 to 12.9.0 (JAX's own Mosaic-GPU attention refuses causal there): an
  UnsupportedError, not a possibly wrong answer; other versions pass the check."""
  from jax._src import lib

  class FakeCuda:
    @staticmethod
    def cuda_runtime_get_version():
      return version

  monkeypatch.setattr(lib, "cuda_versions", FakeCuda)
  if refused:
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(kp.UnsupportedError, match=f"CUDA runtime {version}"):
      kp.mosaic_gpu_attention(q, q, q, is_causal=True)
  else:
    assert mga._check_cuda_for_causal() is None


def _export_grad(normalizer, dtype, causal, h, *, b=1, t=200, s=None, n=4, kh=2, **kw):
  s = t if s is None else s
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  k = jax.ShapeDtypeStruct((b, s, kh, h), dtype)

  def loss(q, k, v):
    out = kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal, **kw)
    return out.astype(jnp.float32).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2))
  return jax.export.export(jax.jit(grad), platforms=["cuda"])(q, k, k).mlir_module()


def _grad_lowers(normalizer, dtype, causal, h):
  mlir = _export_grad(normalizer, jnp.dtype(dtype), causal, h)
  # the forward (saving its row statistics), the dQ kernel and the dK/dV kernel; class P
  # saves nothing and its backward needs no Δ = dO·O, so the forward of a loss that only
  # differentiates is dead code there
  calls = 2 if get_spec(normalizer).kernel_class == "P" else 3
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == calls, mlir[:2000]


# by default (each export of three kernels takes seconds): class E in the exp2 domain with
# an offset, causal, bf16; the matrix (every class x dtype x causal x head dim, H = 256
# with one consumer warpgroup per backward CTA) under -m slow
GRAD_SAMPLE = [("softmax_1", "bfloat16", True, 64)]


@pytest.mark.parametrize("case", GRAD_SAMPLE, ids=["-".join(map(str, c)) for c in GRAD_SAMPLE])
def test_gradient_lowers_for_cuda(case):
  _grad_lowers(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=["-".join(map(str, c)) for c in MATRIX])
def test_gradient_lowers_for_cuda_full_matrix(case):
  _grad_lowers(*case)


def test_backward_shared_memory_fits_every_head_dim():
  """The backward kernels' fixed tiles (two consumer warpgroups at H <= 128, one at 256)
  fit Hopper's 227 KiB for every class (the export of each H is in the matrix)."""
  for h in (64, 128, 256):
    for nm in ("softmax", "softpick", "stablemax", "sigmoid"):
      assert max(mga.bwd_smem_bytes(h, jnp.bfloat16, nm)) + mga.SMEM_SLACK <= mga.SMEM_LIMIT
  with pytest.raises(ValueError, match="not of class E, S or P"):
    mga.bwd_smem_bytes(64, jnp.bfloat16, "sparsemax")


@pytest.mark.slow
def test_backward_shared_memory_count_is_not_an_underestimate():
  """At H = 256 the class with the most row statistics (softpick: m, 1/D and Δ) lowers:
  the export (227 KiB assumed) accepts what bwd_smem_bytes counted."""
  mlir = _export_grad("softpick", jnp.bfloat16, True, 256, t=256, n=1, kh=1)
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 3


def _inputs(seed, b, t, s, n, kh, h, dtype):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
               for shape in ((b, t, n, h), (b, s, kh, h), (b, s, kh, h)))


def _dense_visible(b, t, s, causal, window=None, lengths=None, segments=None):
  """The mask as a dense bool [B, 1, T, S] from its definition: query i sees key j when
  j <= i (causal), i - left <= j <= i + right (window), j < lengths[b] and (``segments``
  a ``(q_ids [B, T], kv_ids [B, S])`` pair) q_ids[b, i] == kv_ids[b, j]."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  vis = np.ones((b, 1, t, s), bool)
  if causal:
    vis &= j <= i
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    vis &= (j >= i - left) & (j <= i + right)
  if lengths is not None:
    vis &= j[None, None] < np.asarray(lengths)[:, None, None, None]
  if segments is not None:
    q_ids, kv_ids = (np.asarray(x) for x in segments)
    vis &= q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  return vis


def _reference(normalizer, q, k, v, causal, scale, hp, window=None, lengths=None,
               segments=None):
  """Dense attention in float64 from the rounded inputs: weights by reference_f64."""
  q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  logits = scale * np.einsum("bthd,bshd->bhts", q, k)
  t, s = logits.shape[-2:]
  where = _dense_visible(q.shape[0], t, s, causal, window, lengths, segments)
  w = reference_f64.normalizer(normalizer, logits, where=where, **hp)
  out = np.einsum("bhts,bshd->bthd", w, v)
  bound = np.einsum("bhts,bshd->bthd", np.abs(w), np.abs(v))
  return out, bound


def _check_numerics(normalizer, causal, dtype, t, s, n, kh, h, hp=None, block_k=64,
                    interpret=True, b=1, window=None, lengths=None, segments=None):
  hp = dict(hp or {})
  q, k, v = _inputs(0, b, t, s, n, kh, h, dtype)
  lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
  call = lambda: kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                         normalizer_params=hp, block_k=block_k,
                                         interpret=interpret, local_window_size=window,
                                         key_value_seq_lengths=lens,
                                         segment_ids=_ids(segments))
  if not mga.interpreter_runs_kernel():  # JAX 0.10: the clear error, not a stack trace
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      call()
    return
  out = np.asarray(call().astype(jnp.float32), np.float64)
  ref, bound = _reference(normalizer, q, k, v, causal, 1.0 / math.sqrt(h), hp, window, lengths,
                          segments)
  # The kernel rounds the weights to the input dtype before the second matmul and the
  # output once more (unit roundoff u each; float32 sums are far below that), so
  # |O - O_ref| <= 2u sum_j |w_j| |v_j|; 10% slack for the float32 statistics.
  u = 2.0 ** -8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0 ** -11
  err = np.abs(out - ref)
  assert np.all(err <= 2.2 * u * bound + 1e-6), (err.max(), (err / (bound + 1e-30)).max())
  # not vacuous: the output is not ~0 and the bound is not loose by orders of magnitude
  assert np.abs(ref).max() > 0.1


def test_interpret_matches_float64_reference():
  """Causal class E with an offset (softmax_1), GQA, odd lengths (padded query rows, a
  masked padded key block), fp16, under the GPU interpreter."""
  _check_numerics("softmax_1", True, jnp.float16, t=100, s=100, n=2, kh=1, h=64)


INTERPRET = [
    ("softmax", True, "bfloat16", 200, 200, 2, 1, 64, {}),
    ("softmax", False, "float16", 128, 256, 2, 2, 64, {"temperature": 2.0}),
    ("sigmoid", True, "float16", 128, 300, 2, 1, 64, {}),
    ("relu", False, "float16", 128, 128, 1, 1, 64, {}),
    ("stablemax", False, "bfloat16", 130, 70, 2, 1, 128, {}),
    ("softmax_n", True, "bfloat16", 128, 128, 1, 1, 64, {"n": 2.0}),
    ("softpick", True, "bfloat16", 130, 130, 2, 1, 64, {}),
    ("ssmax", True, "float16", 128, 128, 1, 1, 64, {}),
    ("spherical_softmax", False, "bfloat16", 128, 128, 1, 1, 64, {}),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", INTERPRET, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in INTERPRET])
def test_interpret_matrix(case):
  normalizer, causal, dtype, t, s, n, kh, h, hp = case
  _check_numerics(normalizer, causal, jnp.dtype(dtype), t, s, n, kh, h, hp)


@pytest.mark.slow
def test_interpret_lazy_rescaling_matches_reference():
  """Lazy rescaling with logits whose row max grows by far more than tau across the key
  blocks (keys scaled up along the sequence), so blocks both skip and take the rescale;
  the result is the eager kernel's up to rounding and the float64 reference's."""
  if not mga.interpreter_runs_kernel():
    _check_numerics("softmax", True, jnp.bfloat16, 128, 128, 1, 1, 64)  # asserts the error
    return
  t, h = 256, 64
  q, k, v = _inputs(3, 1, t, t, 2, 1, h, jnp.float32)
  k = k * jnp.linspace(1.0, 4.0, t)[None, :, None, None]
  q, k, v = (3.0 * q).astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  outs = [np.asarray(kp.mosaic_gpu_attention(q, k, v, is_causal=True, block_k=64,
                                             rescale_threshold=tau, interpret=True)
                     .astype(jnp.float32), np.float64) for tau in (None, 2.0)]
  ref, bound = _reference("softmax", q, k, v, True, 1.0 / math.sqrt(h), {})
  u = 2.0 ** -8
  for out in outs:
    assert np.all(np.abs(out - ref) <= 2.2 * u * bound + 1e-6)
  # the logits' row max grows by more than tau = 2 between blocks somewhere
  logits = np.einsum("bthd,bshd->bhts", *(np.asarray(x.astype(jnp.float32)) for x in (q, k)))
  block_max = np.stack([logits[..., 64 * i:64 * (i + 1)].max(-1) for i in range(4)], -1)
  assert np.any(np.diff(block_max, axis=-1) / math.sqrt(h) > 2.0)


@pytest.mark.slow
def test_interpret_batch_and_default_key_block():
  """Two batch entries (the grid's batch axis) and the default 128-key ring slots."""
  _check_numerics("softmax", True, jnp.bfloat16, 256, 256, 2, 1, 128, block_k=128, b=2)


@pytest.mark.slow
def test_pipeline_has_no_data_race():
  """The GPU interpreter's happens-before race detector over the TMA ring, the consumed
  barriers and the causal epilogue (several key blocks per warpgroup, 2 ring slots)."""
  if not mga.interpreter_runs_kernel():
    _check_numerics("softmax", True, jnp.float16, 256, 256, 1, 1, 64)  # asserts the error
    return
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = mga.gpu_interpret_params(detect_races=True)
  _check_numerics("softmax", True, jnp.float16, 256, 256, 1, 1, 64, interpret=params)
  assert not ipc.get_races().races_found


def _ids(segments):
  """A test's segment ids (a numpy pair or None) as the kernel's int32 argument."""
  return None if segments is None else tuple(jnp.asarray(x, jnp.int32) for x in segments)


def _reference_grads(normalizer, q, k, v, do, causal, scale, hp, window=None, lengths=None,
                     segments=None):
  """Float64 gradients of the dense path (the normalizer's own ``fn`` on the logits,
  ``jax.vjp`` under ``jax.enable_x64``) of the rounded inputs, and elementwise bounds on the
  kernel's rounding error (docstring of :func:`_check_grads`)."""
  import jaxsoft.normalizers as jn

  spec = jn.get(normalizer)
  where = _dense_visible(q.shape[0], q.shape[1], k.shape[1], causal, window, lengths, segments)
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x.astype(jnp.float32), np.float64)) for x in (q, k, v, do)]
    grads, bounds = jax.jit(lambda *a: _grads_and_bounds(spec, *a, scale, hp))(*args, where)
    return [np.asarray(a) for a in grads], [np.asarray(a) for a in bounds]


def _grads_and_bounds(spec, q, k, v, do, where, scale, hp):
  """The reference gradients and bounds as one traced function (jitted by the caller:
  eager float64 operations would each compile); ``where`` the dense mask [B, 1, T, S]."""
  rule = spec.tile
  g = q.shape[2] // k.shape[2]

  def attend(q, k, v):
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = scale * jnp.einsum("bthd,bshd->bhts", q, k)
    w = spec.fn(logits, where=where, **hp)
    return jnp.einsum("bhts,bshd->bthd", w, v), w, logits

  (out, w, x), vjp = jax.vjp(attend, q, k, v)
  grads = vjp((do, jnp.zeros_like(w), jnp.zeros_like(x)))
  # magnitudes: dz = (num'(z) dP - den'(z) Δ) / D, dx = score_map'(x) dz (fixed m)
  kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  dp = jnp.einsum("bthd,bshd->bhts", do, vv)
  bound_o = jnp.einsum("bhts,bshd->bthd", jnp.abs(w), jnp.abs(vv))
  delta_mag = jnp.einsum("bthd,bthd->bht", jnp.abs(do), bound_o)[..., None]
  n = jnp.sum(where, axis=-1, keepdims=True).astype(jnp.float64)
  xs = jnp.where(where, x, 0.0)
  z = rule.score_map(xs, n, **hp)
  m = jnp.max(jnp.where(where, z, -jnp.inf), axis=-1, keepdims=True) if rule.uses_max \
      else jnp.zeros_like(n)
  ones = jnp.ones_like(z)
  num = lambda z_: rule.numerator(z_, m, **hp)
  _, dnum = jax.jvp(num, (z,), (ones,))
  _, dscore = jax.jvp(lambda x_: rule.score_map(x_, n, **hp), (xs,), (ones,))
  if rule.normalized:
    den_fn = rule.denominator
    den, dden = jax.jvp(lambda z_: den_fn(z_, m, **hp), (z,), (ones,))
    d = jnp.sum(jnp.where(where, den, 0.0), axis=-1, keepdims=True)
    if rule.offset is not None:
      d = d + rule.offset(m, n, **hp)
    mag = (jnp.abs(dnum) * jnp.abs(dp) + jnp.abs(dden) * delta_mag) / d
  else:
    mag = jnp.abs(dnum) * jnp.abs(dp)
  mag = jnp.where(where, jnp.abs(dscore) * mag, 0.0)
  bq = scale * jnp.einsum("bhts,bshd->bthd", mag, jnp.abs(kk))
  bk = scale * jnp.einsum("bhts,bthd->bshd", mag, jnp.abs(q))
  bv = jnp.einsum("bhts,bthd->bshd", jnp.abs(w), jnp.abs(do))
  b_, s_, kh, h = k.shape
  bk = bk.reshape(b_, s_, kh, g, h).sum(3)
  bv = bv.reshape(b_, s_, kh, g, h).sum(3)
  return grads, (bq, bk, bv)


def _check_grads(normalizer, causal, dtype, t, s, n, kh, h, hp=None, interpret=True, b=1,
                 window=None, lengths=None, segments=None):
  """Gradients of the GPU-interpreted kernel against the float64 dense gradients.

  Error bounds (u the input dtype's unit roundoff): the kernel rounds ``dx`` (and the
  weights) to the input dtype before each matmul (u relative), computes Δ from the
  rounded output (whose error is at most 2.2u sum_j |w_j||v_j|, the forward's test: so Δ
  is within 3.2u Δmag, Δmag = sum_h |dO_h| sum_j |w_j||v_jh|), and rounds each per-head
  gradient and the GQA sum once more. With ``M = |score'| (|num'| |dP| + |den'| Δmag) / D``
  bounding ``|dx|`` and its error by 4.2u M: |dQ - ref| <= 5.2u scale sum_j M|k|,
  |dK - ref| <= 6.2u scale sum_i M|q|, |dV - ref| <= 3u sum_i |w||dO|; 8u is used for
  each (float32 sums far below that). Plus 1e-6 absolute: float16 weights below 2^-14
  are subnormal, with an absolute spacing of 2^-24 (6e-8) instead of a relative u (a
  key seen by one query with a weight of 5e-6 gets a relative error of 8u in dV)."""
  hp = dict(hp or {})
  q, k, v = _inputs(0, b, t, s, n, kh, h, dtype)
  do = _inputs(1, b, t, t, n, n, h, dtype)[0]

  lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)

  def call(q, k, v):
    return kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                   normalizer_params=hp, interpret=interpret,
                                   local_window_size=window, key_value_seq_lengths=lens,
                                   segment_ids=_ids(segments))

  if not mga.interpreter_runs_kernel():  # JAX 0.10: the clear error, not a stack trace
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      jax.vjp(call, q, k, v)
    return
  _, vjp = jax.vjp(call, q, k, v)
  got = [np.asarray(a.astype(jnp.float32), np.float64) for a in vjp(do)]
  ref, bounds = _reference_grads(normalizer, q, k, v, do, causal, 1.0 / math.sqrt(h), hp,
                                 window, lengths, segments)
  u = 2.0 ** -8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0 ** -11
  for name, a, r, bound in zip("qkv", got, ref, bounds, strict=True):
    err = np.abs(a - r)
    ok = err <= 8 * u * bound + 1e-6
    assert np.all(ok), (name, err.max(), (err / (bound + 1e-30)).max() / u)
    # not vacuous: a gradient of order one, and a bound not loose by orders of magnitude
    assert np.abs(r).max() > 0.05, (name, np.abs(r).max())


GRADS = [
    ("softmax_1", True, "float16", 100, 100, 2, 1, 64),  # odd lengths, GQA, causal
    ("softmax_1", False, "bfloat16", 128, 200, 2, 2, 64),
    ("stablemax", True, "bfloat16", 130, 130, 2, 1, 64),
    ("stablemax", False, "float16", 128, 70, 1, 1, 64),
    ("sigmoid", True, "float16", 128, 128, 2, 1, 64),
    ("sigmoid", False, "bfloat16", 64, 130, 1, 1, 64),
]


@pytest.mark.parametrize("case", GRADS, ids=[f"{c[0]}-{c[1]}" for c in GRADS])
def test_interpret_gradients_match_float64_reference(case):
  """dQ, dK, dV of one normalizer per class (E with an offset in the exp2 domain, S, P's
  tanh sigmoid), causal and not, under the GPU interpreter."""
  normalizer, causal, dtype, t, s, n, kh, h = case
  _check_grads(normalizer, causal, jnp.dtype(dtype), t, s, n, kh, h)


GRADS_SLOW = [
    ("softpick", True, "bfloat16", 128, 128, 2, 1, 64, {}),  # E, numerator != denominator
    ("softmax", False, "float16", 128, 128, 1, 1, 64, {"temperature": 2.0}),
    ("ssmax", True, "float16", 128, 128, 1, 1, 64, {}),  # length-dependent score map
    ("relu", True, "bfloat16", 128, 128, 1, 1, 64, {}),  # P, custom_jvp map
    ("softmax", True, "bfloat16", 128, 128, 2, 1, 256, {}),  # one warpgroup per CTA
    ("softmax", True, "bfloat16", 256, 256, 2, 1, 128, {}),  # several blocks per loop
]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRADS_SLOW, ids=[f"{c[0]}-{c[1]}-{c[7]}" for c in GRADS_SLOW])
def test_interpret_gradients_matrix(case):
  normalizer, causal, dtype, t, s, n, kh, h, hp = case
  _check_grads(normalizer, causal, jnp.dtype(dtype), t, s, n, kh, h, hp)


@pytest.mark.slow
def test_backward_pipeline_has_no_data_race():
  """The race detector over both backward kernels' rings (causal: the dK/dV warpgroups
  start at different query blocks, the dQ warpgroups stop at different key blocks)."""
  if not mga.interpreter_runs_kernel():
    _check_grads("softmax", True, jnp.float16, 256, 256, 1, 1, 64)  # asserts the error
    return
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = mga.gpu_interpret_params(detect_races=True)
  _check_grads("softmax", True, jnp.float16, 256, 256, 1, 1, 64, interpret=params)
  assert not ipc.get_races().races_found


@pytest.mark.parametrize("kwargs, name", [({"head_dim": 100}, "head_dim"),
                                          ({"head_dim": 0}, "head_dim"),
                                          ({"dtype": jnp.int8}, "dtype"),
                                          ({"normalizer": "sparsemax"}, "normalizer")])
def test_bwd_smem_bytes_names_a_bad_argument(kwargs, name):
  """A head dimension, dtype or normalizer the backward cannot run raises, naming it."""
  args = {"head_dim": 128, "dtype": jnp.bfloat16, "normalizer": "softmax", **kwargs}
  with pytest.raises(ValueError, match=f"`{name}`"):
    mga.bwd_smem_bytes(**args)


# --- masks as block lists --------------------------------------------------------------------


def _dense_classes(vis):
  """Splash attention's classes of the tiles of a dense [rows, cols] band: (the indices
  of the blocks with a visible entry, those wholly visible)."""
  return ([i for i, blk in enumerate(vis) if blk.any()],
          [i for i, blk in enumerate(vis) if blk.all()])


# causal, window, key length, whether some band has both partial and full blocks
@pytest.mark.parametrize("causal, window, length, mixed", [
    (False, (200, 150), None, True), (True, (200, 5), 150, True), (False, (0, 0), 200, False),
    (False, (10, 300), 0, False)])
def test_block_ranges_classify_tiles_as_the_dense_mask(causal, window, length, mixed):
  """The kernels' empty / partial / full classification of (query band, key block) tiles,
  computed from the mask's parameters, equals the classification of the dense mask built
  from its definition: the visible blocks are exactly [lo, hi), the full ones exactly
  [flo, fhi) (both loops: key blocks per query band, query blocks per key band)."""
  t = s = 256
  cfg = mga._Cfg(spec=get_spec("softmax"), hp=(), scale=1.0, causal=causal, t=t, s=s,
                 block_q=64, block_k=64, num_stages=2, exp2=True, approx_sigmoid=False,
                 window=window, kv_lengths=length is not None)
  vis = _dense_visible(1, t, s, causal, window, None if length is None else [length])[0, 0]
  end = s if length is None else length
  seen_any = False
  for rows in (64, 128):  # a warpgroup's band and a CTA's
    starts = jnp.arange(0, t, rows, dtype=jnp.int32)  # every band at once (elementwise)
    for bk in (64, 128):
      got = np.stack(np.broadcast_arrays(*mga._key_block_range(cfg, starts, rows, bk, end)),
                     axis=-1)
      for q0, (lo, flo, fhi, hi) in zip(range(0, t, rows), got.tolist(), strict=True):
        blocks = [vis[q0:q0 + rows, j:j + bk] for j in range(0, s, bk)]
        want_vis, want_full = _dense_classes(blocks)
        assert list(range(lo, hi)) == want_vis, (q0, rows, bk, lo, hi)
        assert list(range(flo, fhi)) == want_full, (q0, rows, bk, flo, fhi)
        seen_any |= 0 < len(want_full) < len(want_vis)
    # (keys past the length see no query; no query padding here)
    got = np.stack(np.broadcast_arrays(*mga._query_block_range(
        cfg, starts, rows, 64, t // 64, None if length is None else end)), axis=-1)
    for k0, (lo, flo, fhi, hi) in zip(range(0, s, rows), got.tolist(), strict=True):
      blocks = [vis[i:i + 64, k0:k0 + rows].T for i in range(0, t, 64)]
      want_vis, want_full = _dense_classes(blocks)
      assert list(range(lo, hi)) == want_vis, (k0, rows, lo, hi)
      assert list(range(flo, fhi)) == want_full, (k0, rows, flo, fhi)
  assert seen_any == mixed  # (the cases cover bands with both classes)


def test_masks_lower_for_cuda():
  """Key lengths and a two-sided sliding window (their scalar reads, skipped blocks and
  partial-block masks) lower for sm_90a in the forward and both backward kernels (class
  S: the forward saves 1 / D; the other classes, dtypes and head dims under -m slow)."""
  lens = jnp.array([150, 30], jnp.int32)
  mlir = _export_grad("stablemax", jnp.bfloat16, False, 64, b=2, key_value_seq_lengths=lens,
                      local_window_size=(50, 30))
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 3


MASK_MATRIX = [(nm, dt, c, h, w) for nm in ("softmax_1", "softpick", "sigmoid", "stablemax")
               for dt in ("bfloat16", "float16") for c in (False, True) for h in (64, 128, 256)
               for w in ((64, 16), None)]


@pytest.mark.slow
@pytest.mark.parametrize("case", MASK_MATRIX, ids=["-".join(map(str, c)) for c in MASK_MATRIX])
def test_masks_lower_for_cuda_full_matrix(case):
  normalizer, dtype, causal, h, window = case
  lens = jnp.array([150, 30], jnp.int32)
  mlir = _export_grad(normalizer, jnp.dtype(dtype), causal, h, b=2, key_value_seq_lengths=lens,
                      local_window_size=window)
  calls = 2 if get_spec(normalizer).kernel_class == "P" else 3
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == calls


# normalizer, causal, dtype, T, S, window, lengths (B = 2): each mask kind alone and joined;
# bands with no visible key (length 0; a window past the keys); odd lengths
MASK_INTERPRET = [
    ("softmax", False, "bfloat16", 200, 200, None, [70, 200]),
    ("softmax_1", True, "float16", 256, 256, (70, 0), [256, 130]),
    ("stablemax", False, "bfloat16", 200, 200, (50, 30), [150, 30]),
    ("sigmoid", False, "float16", 256, 256, (64, 100), None),
    ("ssmax", True, "float16", 256, 256, (100, 0), [200, 256]),
    ("softpick", False, "bfloat16", 200, 200, (30, 30), [0, 100]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", MASK_INTERPRET,
                         ids=[f"{c[0]}-{c[1]}-{c[5]}-{c[6]}" for c in MASK_INTERPRET])
def test_interpret_masks_match_float64_reference(case):
  normalizer, causal, dtype, t, s, window, lengths = case
  _check_numerics(normalizer, causal, jnp.dtype(dtype), t, s, 1, 1, 64, b=2, window=window,
                  lengths=lengths)


MASK_GRADS = [
    ("softmax_1", True, "float16", 200, 200, (70, 0), [200, 130]),
    ("stablemax", False, "bfloat16", 200, 200, (50, 30), [150, 30]),
    ("sigmoid", False, "float16", 256, 256, (64, 100), None),
    ("softpick", False, "bfloat16", 200, 200, None, [0, 100]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", MASK_GRADS,
                         ids=[f"{c[0]}-{c[1]}-{c[5]}-{c[6]}" for c in MASK_GRADS])
def test_interpret_mask_gradients_match_float64_reference(case):
  """dQ, dK, dV with masks (keys past a length get zero gradients), against the float64
  gradients of the dense path with the same mask."""
  normalizer, causal, dtype, t, s, window, lengths = case
  _check_grads(normalizer, causal, jnp.dtype(dtype), t, s, 2, 1, 64, b=2, window=window,
               lengths=lengths)


@pytest.mark.slow
def test_masked_pipelines_have_no_data_race():
  """The race detector with a two-sided window and lengths: warpgroups that skip blocks
  before their range and release blocks after it, in the forward and both backward
  kernels."""
  if not mga.interpreter_runs_kernel():
    _check_grads("softmax", False, jnp.float16, 256, 256, 1, 1, 64, window=(64, 32))
    return
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = mga.gpu_interpret_params(detect_races=True)
  _check_grads("softmax", False, jnp.float16, 256, 256, 1, 1, 64, interpret=params, b=2,
               window=(64, 32), lengths=[256, 100])
  assert not ipc.get_races().races_found


@pytest.mark.parametrize("normalizer", ["softmax", "standardized_softmax"])
def test_forward_mode_and_second_order_are_refused(normalizer):
  """Reverse mode only (a custom VJP whose backward holds k, v and the saved statistics
  constant): jax.jvp and a second derivative raise UnsupportedDifferentiation naming the way
  out, before any kernel runs, also when the call sits inside jax.jit (class E; class R)."""
  from jaxsoft.attention import UnsupportedDifferentiation

  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  f = lambda q: kp.mosaic_gpu_attention(q, q, q, normalizer=normalizer).astype(
      jnp.float32).sum()
  with pytest.raises(UnsupportedDifferentiation, match="forward-mode.*kernels_pallas.attention"):
    jax.jvp(f, (q,), (q,))
  with pytest.raises(UnsupportedDifferentiation, match="second-.*kernels_pallas.attention"):
    jax.grad(jax.grad(lambda x: f(q * x)))(1.0)
  with pytest.raises(UnsupportedDifferentiation, match="second-.*kernels_pallas.attention"):
    jax.eval_shape(jax.grad(jax.grad(jax.jit(lambda x: f(q * x)))), 1.0)


# --- segment ids ----------------------------------------------------------------------------

# Named segment-id cases (B = 2, T = S = 200): a (q_ids, kv_ids) pair of int numpy arrays.
# "sorted": packed segments, one id of batch entry 1 shared by every row; "unsorted": the
# keys' ids cycle (each band's key interval spans the sequence: every block loaded, masked),
# batch entry 1's queries carry ids no key has (rows that see no key: zero outputs and
# gradients).
_Q_IDS = np.array([[0] * 70 + [1] * 90 + [2] * 40, [3] * 30 + [5] * 170])
SEGMENTS = {
    "sorted": (_Q_IDS, _Q_IDS),
    "unsorted": (_Q_IDS, np.tile(np.array([2, 0, 1, 1] * 50), (2, 1))),
}
# the GPU interpreter's warpgroup callbacks wait on each other's barriers; with segment ids
# XLA's concurrency-optimised CPU scheduler deadlocks them on a 2-core machine (measured
# with T = 256: two CTAs), so the interpreted segment checks run in a fresh Python with
# that scheduler off (as tests/kernels_pallas/test_mosaic_gpu_bench.py's bench run)
INTERPRETER_XLA_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _isolated(call: str) -> None:
  """Runs ``call`` (an expression of this module's helpers, the module as ``T``) in a fresh
  Python with :data:`INTERPRETER_XLA_FLAG`; on JAX 0.10 (whose interpreter cannot run the
  kernels: the helpers assert the clear error) in this process."""
  if not mga.interpreter_runs_kernel():
    import sys
    eval(call, {"T": sys.modules[__name__], "np": np, "jnp": jnp})
    return
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {INTERPRETER_XLA_FLAG}".strip()
  env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
  code = ("import numpy as np, jax.numpy as jnp\n"
          "from tests.kernels_pallas import test_mosaic_gpu as T\n" + call)
  res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                       text=True, timeout=1200)
  assert res.returncode == 0, (res.stdout[-4000:], res.stderr[-4000:])


def test_segments_lower_for_cuda():
  """Segment ids (their band tables read as scalars, the key ranks streamed through the
  ring, the rows' ranks and counts fetched with the query tiles) lower for sm_90a in the
  forward and both backward kernels (class E with causal; class P alone)."""
  ids = jnp.asarray(SEGMENTS["sorted"][0], jnp.int32)
  mlir = _export_grad("softmax_1", jnp.bfloat16, True, 64, b=2, segment_ids=ids)
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 3
  mlir = _export("sigmoid", jnp.float16, False, 128, b=2, segment_ids=(ids, ids))
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 1


SEG_MATRIX = [(nm, dt, c, h) for nm in ("softmax", "ssmax", "sigmoid", "stablemax")
              for dt in ("bfloat16", "float16") for c in (False, True) for h in (64, 128, 256)]


@pytest.mark.slow
@pytest.mark.parametrize("case", SEG_MATRIX, ids=["-".join(map(str, c)) for c in SEG_MATRIX])
def test_segments_lower_for_cuda_full_matrix(case):
  normalizer, dtype, causal, h = case
  ids = jnp.asarray(SEGMENTS["sorted"][0], jnp.int32)
  mlir = _export_grad(normalizer, jnp.dtype(dtype), causal, h, b=2, segment_ids=ids,
                      key_value_seq_lengths=jnp.array([150, 30], jnp.int32))
  calls = 2 if get_spec(normalizer).kernel_class == "P" else 3
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == calls


@pytest.mark.parametrize("segment_ids, match", [
    (np.zeros((1, 128), np.float32), "integer array"),
    (np.zeros((2, 128), np.int32), r"shape \[B, T\] = \[1, 128\]"),
    ((np.zeros((1, 128), np.int32), None), "give both"),
    ((None, np.zeros((1, 128), np.int32)), "give both"),
    ((np.zeros((1, 128), np.int32), np.zeros((1, 64), np.int32)), r"\[B, S\] = \[1, 128\]"),
])
def test_segment_id_errors_name_the_argument(segment_ids, match):
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="`segment_ids`.*" + match):
    kp.mosaic_gpu_attention(q, q, q, segment_ids=segment_ids)


def test_segment_ids_need_a_pair_for_cross_attention_and_class_t_refuses_them():
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  k = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="`segment_ids`.*give the pair"):
    kp.mosaic_gpu_attention(q, k, k, segment_ids=jnp.zeros((1, 128), jnp.int32))
  with pytest.raises(kp.UnsupportedError, match="`segment_ids` are not supported for class T"):
    kp.mosaic_gpu_attention(q, q, q, normalizer="sparsemax",
                            segment_ids=jnp.zeros((1, 128), jnp.int32))


@pytest.mark.parametrize("name", ["sorted", "unsorted"])
def test_segment_bands_hold_every_visible_key(name):
  """The band tables against the dense segment mask: every key a row of the band sees lies
  in ``[lo, hi)``; ``[full_lo, full_hi)``, when not empty, is seen by every row of the band;
  packed ids give exactly the visible keys' span."""
  q_ids, kv_ids = (jnp.asarray(x, jnp.int32) for x in SEGMENTS[name])
  tp = 256
  q_pad = jnp.pad(q_ids, ((0, 0), (0, tp - 200)), mode="edge")
  bands = np.asarray(mga._bands(q_pad, kv_ids, 200))
  same = np.asarray(q_pad)[:, :, None] == np.asarray(kv_ids)[:, None, :]
  for bi in range(2):
    for band in range(tp // mga.SEG_BAND):
      lo, hi, flo, fhi = bands[bi, band]
      seen = same[bi, band * 64:(band + 1) * 64].any(axis=0)
      cols = np.nonzero(seen)[0]
      if cols.size:
        assert lo <= cols.min() and cols.max() < hi, (bi, band, lo, hi)
        if name == "sorted":
          assert (lo, hi) == (cols.min(), cols.max() + 1)
      else:
        assert hi <= lo
      if fhi > flo:
        assert same[bi, band * 64:(band + 1) * 64, flo:fhi].all()


def test_interpret_segments_match_float64_reference():
  """Packed segment ids with causal masking, GQA and odd lengths against the float64 dense
  reference with the same mask, under the GPU interpreter."""
  _isolated('T._check_numerics("softmax_1", True, jnp.float16, 200, 200, 2, 1, 64, b=2, '
            'segments=T.SEGMENTS["sorted"])')


# normalizer, causal, dtype, segments, window, lengths (B = 2, T = S = 200, GQA 2:1)
SEG_INTERPRET = [
    ("softmax", False, "bfloat16", "sorted", None, None),
    ("softpick", True, "bfloat16", "unsorted", None, None),  # rows that see no key
    ("ssmax", False, "float16", "sorted", (50, 30), [150, 200]),  # counts from XLA
    ("sigmoid", True, "float16", "unsorted", None, [120, 200]),
    ("stablemax", False, "bfloat16", "sorted", None, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", SEG_INTERPRET, ids=["-".join(map(str, c[:4])) for c in SEG_INTERPRET])
def test_interpret_segments_matrix(case):
  normalizer, causal, dtype, name, window, lengths = case
  _isolated(f'T._check_numerics({normalizer!r}, {causal}, jnp.{dtype}, 200, 200, 2, 1, 64, '
            f'b=2, segments=T.SEGMENTS[{name!r}], window={window!r}, lengths={lengths!r})')


@pytest.mark.slow
@pytest.mark.parametrize("case", SEG_INTERPRET, ids=["-".join(map(str, c[:4])) for c in SEG_INTERPRET])
def test_interpret_segment_gradients_match_float64_reference(case):
  """dQ, dK, dV with segment ids (rows that see no key get zero gradients), against the
  float64 gradients of the dense path with the same mask."""
  normalizer, causal, dtype, name, window, lengths = case
  _isolated(f'T._check_grads({normalizer!r}, {causal}, jnp.{dtype}, 200, 200, 2, 1, 64, '
            f'b=2, segments=T.SEGMENTS[{name!r}], window={window!r}, lengths={lengths!r})')


def _check_empty_tiles_are_not_loaded():
  """Queries 0..127 carry id 0, 128..255 id 1; keys 0..63 id 0, 64..127 id 2 (no query's),
  128..255 id 1. Keys 64..127 (one 64-key block) lie outside every band's key interval:
  with NaN in their values (and keys) the output and the gradients of q and of the other
  keys are finite and equal to those of a clean run (a loaded NaN block would poison
  them: its masked weights are 0, and 0 x NaN is NaN in the P·V matmul)."""
  q, k, v = _inputs(0, 1, 256, 256, 1, 1, 64, jnp.float16)
  q_ids = jnp.asarray([[0] * 128 + [1] * 128], jnp.int32)
  kv_ids = jnp.asarray([[0] * 64 + [2] * 64 + [1] * 128], jnp.int32)
  f = lambda q, k, v: kp.mosaic_gpu_attention(q, k, v, block_k=64, interpret=True,
                                              segment_ids=(q_ids, kv_ids))
  poisoned = lambda x: x.at[:, 64:128].set(jnp.nan)
  do = _inputs(1, 1, 256, 256, 1, 1, 64, jnp.float16)[0]
  runs = []
  for kk, vv in ((k, v), (poisoned(k), poisoned(v))):
    out, vjp = jax.vjp(f, q, kk, vv)
    runs.append([np.asarray(x.astype(jnp.float32)) for x in (out, *vjp(do))])
  keep = np.r_[0:64, 128:256]
  for name, a, b in zip(["out", "dq", "dk", "dv"], *runs, strict=True):
    if name in ("dk", "dv"):
      a, b = a[:, keep], b[:, keep]
    assert np.all(np.isfinite(b)), name
    np.testing.assert_array_equal(a, b, err_msg=name)
  assert np.abs(runs[0][0]).max() > 0.1


def test_interpret_empty_tiles_are_not_loaded():
  if not mga.interpreter_runs_kernel():
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      _check_empty_tiles_are_not_loaded()
    return
  _isolated("T._check_empty_tiles_are_not_loaded()")


def _check_segment_pipelines_race_free():
  """The race detector with segment ids (sorted; unsorted with causal): the key ranks'
  ring slots, read and fenced before release, and the warpgroups' different ranges."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = mga.gpu_interpret_params(detect_races=True)
  for causal, name in ((False, "sorted"), (True, "unsorted")):
    _check_grads("softmax_1", causal, jnp.float16, 200, 200, 1, 1, 64, interpret=params, b=2,
                 segments=SEGMENTS[name])
  assert not ipc.get_races().races_found


@pytest.mark.slow
def test_segment_pipelines_have_no_data_race():
  if not mga.interpreter_runs_kernel():
    _check_grads("softmax", False, jnp.float16, 200, 200, 1, 1, 64, b=2,
                 segments=SEGMENTS["sorted"])  # asserts the clear error
    return
  _isolated("T._check_segment_pipelines_race_free()")
