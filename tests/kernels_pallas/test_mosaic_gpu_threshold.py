"""Class T (sparsemax, entmax15, top_k_softmax) on the Mosaic-GPU engine, verified without a
GPU (kernels_pallas/mosaic_gpu_threshold.py).

* ``jax.export(..., platforms=["cuda"])`` of ``kp.mosaic_gpu_attention`` for a class-T
  normalizer lowers both kernels (the threshold search and the pass over the live key
  blocks) for sm_90a with 227 KiB of shared memory: a sample by default, every normalizer
  x dtype x causal x head dim (64, 128) under ``-m slow``.
* Pallas's GPU interpreter (JAX 0.12.1; on JAX 0.10 the clear UnsupportedError is asserted
  instead) runs both kernels on a CPU and is compared with the float64 dense reference
  (``tests/reference_f64.py``), including odd lengths, GQA and a causal case where whole key
  blocks below the diagonal have zero weights: the block list must skip them (its count
  is below the causal bound) and the output must still match.
* The race detector (``gpu_interpret_params(detect_races=True)``) over both rings.
* The backward (``kernels_pallas.mosaic_gpu_threshold_backward``): ``jax.export`` of
  ``jax.grad`` lowers the four kernels (search, attention pass saving W, dQ, dK/dV; a
  sample by default, every normalizer x dtype x causal x head dim 64/128/256 under
  ``-m slow``); under the interpreter dQ, dK, dV match ``jax.vjp`` of the dense float64
  path within 8u of elementwise bounds from the normalizer's row Jacobians (one case by
  default, the rest, a shortened block list and the race detector under ``-m slow``);
  forward mode and second order raise UnsupportedDifferentiation.
* Key lengths and local windows (with or without causal): the CUDA export of the forward
  and of ``jax.grad`` (a sample, the matrix under ``-m slow``); under the interpreter the
  forward and dQ, dK, dV against the float64 dense path with the same mask (one case by
  default; lengths with an entry of 0, windows, window + causal, top-k with |V| < k under
  ``-m slow``), rows that see no key and keys no row sees exactly 0; and NaN keys and
  values in whole key blocks no row may see leave the output and the gradients
  bit-identical to zeros there (the block lists skip them; ``-m slow``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import mosaic_gpu as mga
from kernels_pallas import mosaic_gpu_threshold as mgt
from tests import reference_f64


def _export(normalizer, dtype, causal, h, *, t=200, n=4, kh=2, **kw):
  q = jax.ShapeDtypeStruct((1, t, n, h), dtype)
  k = jax.ShapeDtypeStruct((1, t, kh, h), dtype)
  f = lambda q, k, v: kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer,
                                              is_causal=causal, **kw)
  return jax.export.export(jax.jit(f), platforms=["cuda"])(q, k, k).mlir_module()


def _lowers(normalizer, dtype, causal, h, t=200):
  mlir = _export(normalizer, jnp.dtype(dtype), causal, h, t=t)
  # the search kernel and the attention pass, nothing else Mosaic
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 2, mlir[:2000]


MATRIX = [(nm, dt, c, h) for nm in mgt.SUPPORTED for dt in ("bfloat16", "float16")
          for c in (False, True) for h in (64, 128)]
# every normalizer, dtype, causal flag and head dim at least once; one key block of 128
# (T = 100: the search's ring holds the same block in both slots)
SAMPLE = [("sparsemax", "bfloat16", True, 64), ("entmax15", "float16", False, 128, 100),
          ("top_k_softmax", "float16", True, 128)]


@pytest.mark.parametrize("case", SAMPLE, ids=["-".join(map(str, c)) for c in SAMPLE])
def test_lowers_for_cuda(case):
  _lowers(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=["-".join(map(str, c)) for c in MATRIX])
def test_lowers_for_cuda_full_matrix(case):
  _lowers(*case)


def _export_grad(normalizer, dtype, causal, h, *, t=200, n=4, kh=2, **kw):
  q = jax.ShapeDtypeStruct((1, t, n, h), dtype)
  k = jax.ShapeDtypeStruct((1, t, kh, h), dtype)

  def loss(q, k, v):
    out = kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal, **kw)
    return out.astype(jnp.float32).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2))
  return jax.export.export(jax.jit(grad), platforms=["cuda"])(q, k, k).mlir_module()


def _grad_lowers(normalizer, dtype, causal, h):
  mlir = _export_grad(normalizer, jnp.dtype(dtype), causal, h)
  # the search, the attention pass (saving W), the dQ kernel and the dK/dV kernel
  assert mlir.count("stablehlo.custom_call @mosaic_gpu") == 4, mlir[:2000]


# every normalizer, causal and not, both dtypes and H = 64, 128 (two consumer warpgroups
# per backward CTA); H = 256 (one) and the rest of the matrix under -m slow
GRAD_SAMPLE = [("sparsemax", "bfloat16", True, 64), ("entmax15", "float16", False, 128),
               ("top_k_softmax", "float16", True, 64), ("top_k_softmax", "bfloat16", False, 64)]
GRAD_MATRIX = [(nm, dt, c, h) for nm in mgt.SUPPORTED for dt in ("bfloat16", "float16")
               for c in (False, True) for h in (64, 128, 256)]


@pytest.mark.parametrize("case", GRAD_SAMPLE, ids=["-".join(map(str, c)) for c in GRAD_SAMPLE])
def test_gradient_lowers_for_cuda(case):
  _grad_lowers(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", GRAD_MATRIX, ids=["-".join(map(str, c)) for c in GRAD_MATRIX])
def test_gradient_lowers_for_cuda_full_matrix(case):
  _grad_lowers(*case)


def test_forward_mode_and_second_order_are_refused():
  """Reverse mode only (a custom VJP): jax.jvp and jax.grad of jax.grad raise
  UnsupportedDifferentiation naming kernels_pallas.attention, before any kernel runs."""
  from jaxsoft.attention import UnsupportedDifferentiation

  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  f = lambda q: kp.mosaic_gpu_attention(q, q, q, normalizer="sparsemax").astype(
      jnp.float32).sum()
  with pytest.raises(UnsupportedDifferentiation, match="forward-mode.*kernels_pallas.attention"):
    jax.jvp(f, (q,), (q,))
  with pytest.raises(UnsupportedDifferentiation, match="second-.*kernels_pallas.attention"):
    jax.grad(jax.grad(lambda x: f(q * x)))(1.0)


@pytest.mark.parametrize("kw, match", [
    (dict(normalizer="top_p_softmax"), "`normalizer` 'top_p_softmax'"),
    (dict(normalizer="sparsemax", rescale_threshold=8.0), "`rescale_threshold`"),
])
def test_errors_name_the_argument(kw, match):
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  with pytest.raises(kp.UnsupportedError, match=match):
    kp.mosaic_gpu_attention(q, q, q, **kw)


def _inputs(seed, t, s, n, kh, h, dtype, b=1):
  rng = np.random.default_rng(seed)
  # logits of standard deviation ~2 (q scaled by 2): sparse rows with a support of a few
  # keys to a few dozen
  q = 2.0 * rng.standard_normal((b, t, n, h), np.float32)
  k, v = (rng.standard_normal((b, s, kh, h), np.float32) for _ in range(2))
  return tuple(jnp.asarray(x).astype(dtype) for x in (q, k, v))


def _where(b, t, s, causal, lengths=None, window=None):
  """The dense path's visibility ``[B, T, S]``: key j of batch entry b visible to query i
  when ``j < L_b``, ``i - left <= j <= i + right`` (``window``: an int w is ``(w, w)``)
  and ``j <= i`` (causal)."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  vis = np.ones((b, t, s), bool)
  if lengths is not None:
    vis &= j[None] < np.asarray(lengths).reshape(b, 1, 1)
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    vis &= (j >= i - left) & (j <= i + right)
  if causal:
    vis &= j <= i
  return vis


def _reference(normalizer, q, k, v, causal, scale, hp, where=None):
  """Dense attention in float64 from the rounded inputs (weights by reference_f64) and the
  bound sum_j |w_j| |v_j|; ``where`` ([B, T, S]) the visibility (None: causal or not)."""
  q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  logits = scale * np.einsum("bthd,bshd->bhts", q, k)
  t, s = logits.shape[-2:]
  if where is None:
    where = _where(q.shape[0], t, s, causal)
  w = reference_f64.normalizer(normalizer, logits, where=where[:, None], **hp)
  return (np.einsum("bhts,bshd->bthd", w, v), np.einsum("bhts,bshd->bthd", np.abs(w), np.abs(v)),
          w)


def _check(out, ref, bound, dtype):
  """The kernel rounds the weights to the input dtype before the second matmul and the
  output once more (unit roundoff u each), so |O - O_ref| <= 2u sum_j |w_j| |v_j|, with
  10% slack for the float32 logits, threshold (a few ulps of float32) and sums."""
  u = 2.0 ** -8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0 ** -11
  err = np.abs(np.asarray(out.astype(jnp.float32), np.float64) - ref)
  assert np.all(err <= 2.2 * u * bound + 1e-6), (err.max(), (err / (bound + 1e-30)).max() / u)
  assert np.abs(ref).max() > 0.1  # not vacuous


def _check_numerics(normalizer, causal, dtype, t, s, n, kh, h, hp=None, block_k=64,
                    interpret=True, lengths=None, window=None):
  """``lengths`` (a list: the batch's key lengths) and ``window`` pass as
  ``key_value_seq_lengths`` and ``local_window_size``; the batch is ``len(lengths)``."""
  hp = dict(hp or {})
  b = 1 if lengths is None else len(lengths)
  q, k, v = _inputs(0, t, s, n, kh, h, dtype, b)
  lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
  call = lambda: kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                         normalizer_params=hp, block_k=block_k,
                                         interpret=interpret, key_value_seq_lengths=lens,
                                         local_window_size=window)
  if not mga.interpreter_runs_kernel():  # JAX 0.10: the clear error, not a stack trace
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      call()
    return
  where = _where(b, t, s, causal, lengths, window)
  ref, bound, w = _reference(normalizer, q, k, v, causal, 1.0 / math.sqrt(h), hp, where)
  # sparse rows, not all but one entry zero (a narrow mask leaves fewer zeros)
  sparse = np.mean(w[np.broadcast_to(where[:, None], w.shape)] == 0)
  assert (0.3 if where.all() else 0.1) < sparse < 1.0, sparse
  out = call()
  _check(out, ref, bound, dtype)
  empty = ~where.any(axis=2)  # [B, T]: rows that see no key give exact zeros
  assert np.all(np.asarray(out.astype(jnp.float32))[empty] == 0)


def test_interpret_matches_float64_reference():
  """Causal sparsemax, GQA, odd lengths (padded query rows, a padded key block), fp16,
  under the GPU interpreter."""
  _check_numerics("sparsemax", True, jnp.float16, t=100, s=100, n=2, kh=1, h=64)


INTERPRET = [
    ("entmax15", False, "bfloat16", 130, 70, 2, 1, 64, {}),
    ("entmax15", True, "float16", 128, 128, 1, 1, 64, {}),
    ("top_k_softmax", True, "float16", 130, 130, 2, 1, 64, {}),
    ("top_k_softmax", False, "bfloat16", 128, 200, 1, 1, 64, {"k": 3}),
    ("sparsemax", False, "bfloat16", 128, 256, 2, 2, 128, {}),
    ("sparsemax", True, "float16", 100, 100, 1, 1, 128, {}, 128),  # one key block
]


@pytest.mark.slow
@pytest.mark.parametrize("case", INTERPRET, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in INTERPRET])
def test_interpret_matrix(case):
  normalizer, causal, dtype, t, s, n, kh, h, hp, *block_k = case
  _check_numerics(normalizer, causal, jnp.dtype(dtype), t, s, n, kh, h, hp, *block_k)


def test_interpret_skips_empty_key_blocks():
  """Causal, 4 key blocks of 64: the keys of block 2 align with every query (q·k ~ 256
  there, ~N(0, 8) elsewhere, scale 1/8), so for the rows 128..255 of the second CTA all
  of sparsemax's weight is on block 2, and blocks 0, 1 and 3 (structurally visible) have
  zero weights. The block list holds block 2 only (count 1, where the causal bound is 4),
  the first CTA keeps both its blocks, and the output matches the float64 reference."""
  t, h, dtype = 256, 64, jnp.float16
  rng = np.random.default_rng(4)
  u = np.ones(h, np.float32)
  q = 0.5 * rng.standard_normal((1, t, 1, h)).astype(np.float32) + u
  k = 0.5 * rng.standard_normal((1, t, 1, h)).astype(np.float32)
  k[:, 128:192] += 4.0 * u
  v = rng.standard_normal((1, t, 1, h)).astype(np.float32)
  q, k, v = (jnp.asarray(x).astype(dtype) for x in (q, k, v))
  call = lambda interpret: kp.mosaic_gpu_attention(q, k, v, normalizer="sparsemax",
                                                   is_causal=True, block_k=64,
                                                   interpret=interpret)
  if not mga.interpreter_runs_kernel():
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      call(True)
    return
  ref, bound, w = _reference("sparsemax", q, k, v, True, 1.0 / math.sqrt(h), {})
  # the premise: rows 128.. put no weight outside keys 128..191
  assert np.all(w[..., 128:, :128] == 0) and np.all(w[..., 128:, 192:] == 0)
  _, _, idx, cnt = mgt.threshold_blocks(q, k, normalizer="sparsemax", is_causal=True,
                                        block_k=64, interpret=mga.gpu_interpret_params())
  assert cnt.shape == (1, 1, 2) and int(cnt[0, 0, 1]) == 1 and int(idx[0, 0, 1, 0]) == 2
  assert int(cnt[0, 0, 0]) == 2 and list(np.asarray(idx[0, 0, 0, :2])) == [0, 1]
  _check(call(True), ref, bound, dtype)


@pytest.mark.slow
def test_pipeline_has_no_data_race():
  """The GPU interpreter's happens-before race detector over both kernels: the search's
  key ring reused over every pass (several key blocks, causal: the CTAs' bounds differ),
  the flags' scalar stores, and the attention pass's ring over the block list."""
  if not mga.interpreter_runs_kernel():
    _check_numerics("sparsemax", True, jnp.float16, 256, 256, 1, 1, 64)  # asserts the error
    return
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = mga.gpu_interpret_params(detect_races=True)
  _check_numerics("entmax15", True, jnp.float16, 256, 256, 1, 1, 64, interpret=params)
  assert not ipc.get_races().races_found


@pytest.mark.slow
def test_interpret_nan_logit_makes_its_row_nan():
  """A NaN in one query row: that row's output is NaN (as on the dense path), not a
  plausible 0 from an empty block list; every other row is finite."""
  q, k, v = _inputs(2, 128, 128, 1, 1, 64, jnp.float16)
  q = q.at[0, 5, 0, 3].set(jnp.nan)
  call = lambda: kp.mosaic_gpu_attention(q, k, v, normalizer="sparsemax", block_k=64,
                                         interpret=True)
  if not mga.interpreter_runs_kernel():
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      call()
    return
  out = np.asarray(call().astype(jnp.float32))
  assert np.isnan(out[0, 5]).all()
  assert np.isfinite(np.delete(out, 5, axis=1)).all()


def _aligned_inputs(t, h, dtype):
  """:func:`test_interpret_skips_empty_key_blocks`'s inputs: the keys 128..191 align with
  every query, so rows 128.. put all their weight there."""
  rng = np.random.default_rng(4)
  u = np.ones(h, np.float32)
  q = 0.5 * rng.standard_normal((1, t, 1, h)).astype(np.float32) + u
  k = 0.5 * rng.standard_normal((1, t, 1, h)).astype(np.float32)
  k[:, 128:192] += 4.0 * u
  v = rng.standard_normal((1, t, 1, h)).astype(np.float32)
  return tuple(jnp.asarray(x).astype(dtype) for x in (q, k, v))


def _reference_grads(normalizer, q, k, v, do, causal, scale, hp, where=None):
  """Float64 gradients of the dense path (the normalizer's own ``fn`` on the logits,
  ``jax.vjp`` under ``jax.enable_x64``) of the rounded inputs, and elementwise bounds on
  the kernel's rounding error (:func:`_check_grads`); ``where`` ([B, T, S]) the
  visibility (None: causal or not)."""
  import jaxsoft.normalizers as jn

  spec = jn.get(normalizer)
  t, s = q.shape[1], k.shape[1]
  if where is None:
    where = _where(q.shape[0], t, s, causal)
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x.astype(jnp.float32), np.float64)) for x in (q, k, v, do)]
    grads, bounds = jax.jit(lambda *a: _grads_and_bounds(spec, *a, scale, hp))(
        *args, jnp.asarray(where))
    return [np.asarray(a) for a in grads], [np.asarray(a) for a in bounds]


def _grads_and_bounds(spec, q, k, v, do, where, scale, hp):
  """The reference gradients and bounds as one traced function. With ``J_i = d p_i / d x_i``
  the normalizer's Jacobian on row i (``p`` the weights, ``x`` the scaled logits),
  ``dx_i = J_i^T dP_i``; its magnitude ``M_i = |J_i|^T (|dP_i| + Δmag_i)`` (``Δmag_i =
  sum_h |dO_ih| sum_j |p_ij| |v_jh|``) bounds ``|dx|`` and the error the rounded output's
  Δ puts into it."""
  g = q.shape[2] // k.shape[2]
  kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)

  def weights(x):
    return spec.fn(x, where=where[:, None], **hp)

  def attend(q, k, v):
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = scale * jnp.einsum("bthd,bshd->bhts", q, k)
    return jnp.einsum("bhts,bshd->bthd", weights(logits), v)

  _, vjp = jax.vjp(attend, q, k, v)
  grads = vjp(do)
  x = scale * jnp.einsum("bthd,bshd->bhts", q, kk)
  p = weights(x)
  # the rows' Jacobians [B, N, T, S(out), S(in)]: each row's weights depend on that row only
  row = lambda xi, wi: spec.fn(xi, where=wi, **hp)
  jac = jax.vmap(jax.vmap(jax.vmap(jax.jacrev(row), (0, 0)), (0, None)), (0, 0))(x, where)
  dp = jnp.einsum("bthd,bshd->bhts", do, vv)
  delta_mag = jnp.einsum("bthd,bthd->bht", jnp.abs(do),
                         jnp.einsum("bhts,bshd->bthd", jnp.abs(p), jnp.abs(vv)))[..., None]
  mag = jnp.einsum("bhtkj,bhtk->bhtj", jnp.abs(jac), jnp.abs(dp) + delta_mag)
  bq = scale * jnp.einsum("bhts,bshd->bthd", mag, jnp.abs(kk))
  bk = scale * jnp.einsum("bhts,bthd->bshd", mag, jnp.abs(q))
  bv = jnp.einsum("bhts,bthd->bshd", jnp.abs(p), jnp.abs(do))
  b_, s_, kh, h = k.shape
  return grads, (bq, bk.reshape(b_, s_, kh, g, h).sum(3), bv.reshape(b_, s_, kh, g, h).sum(3))


def _check_grads(normalizer, causal, dtype, t, s, n, kh, h, hp=None, block_k=64,
                 interpret=True, inputs=None, lengths=None, window=None):
  """dQ, dK, dV of the GPU-interpreted kernels against the float64 dense gradients.

  As ``test_mosaic_gpu._check_grads``: the kernels round ``dx`` and the normalised
  weights to the input dtype before each matmul, compute Δ from the rounded output and
  round each per-head gradient and the GQA sum once more, so (u the unit roundoff)
  ``|dQ - ref| <= 8u scale sum_j M|k|``, ``|dK - ref| <= 8u scale sum_i M|q|``,
  ``|dV - ref| <= 8u sum_i |p||dO|`` (:func:`_grads_and_bounds`), plus 1e-6 absolute for
  float16's subnormal weights. ``lengths`` and ``window`` as in :func:`_check_numerics`
  (keys past a batch entry's length and rows that see no key: zero gradients). Returns
  the largest error over its tolerance (<= 1)."""
  hp = dict(hp or {})
  b = 1 if lengths is None else len(lengths)
  q, k, v = _inputs(0, t, s, n, kh, h, dtype, b) if inputs is None else inputs
  do = _inputs(1, t, t, n, n, h, dtype, b)[0] / 2.0
  lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)

  def call(q, k, v):
    return kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                   normalizer_params=hp, block_k=block_k, interpret=interpret,
                                   key_value_seq_lengths=lens, local_window_size=window)

  if not mga.interpreter_runs_kernel():  # JAX 0.10: the clear error, not a stack trace
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      jax.vjp(call, q, k, v)
    return None
  out, vjp = jax.vjp(call, q, k, v)
  got = [np.asarray(a.astype(jnp.float32), np.float64) for a in vjp(do)]
  where = _where(b, t, s, causal, lengths, window)
  if inputs is None:  # the forward too (its own tests cover the aligned inputs)
    ref_out, bound, _ = _reference(normalizer, q, k, v, causal, 1.0 / math.sqrt(h), hp, where)
    _check(out, ref_out, bound, dtype)
    assert np.all(np.asarray(out.astype(jnp.float32))[~where.any(axis=2)] == 0)
  ref, bounds = _reference_grads(normalizer, q, k, v, do, causal, 1.0 / math.sqrt(h), hp,
                                 where)
  u = 2.0 ** -8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0 ** -11
  worst = 0.0
  for name, a, r, bound in zip("qkv", got, ref, bounds, strict=True):
    ratio = np.abs(a - r) / (8 * u * bound + 1e-6)
    assert np.all(ratio <= 1.0), (name, np.abs(a - r).max(), ratio.max())
    # not vacuous: a gradient of order one
    assert np.abs(r).max() > 0.05, (name, np.abs(r).max())
    worst = max(worst, float(ratio.max()))
  if not where.all():  # invisible keys and rows that see no key: exact zeros
    assert np.all(got[0][~where.any(axis=2)] == 0)
    assert np.all(got[1][~where.any(axis=1)] == 0) and np.all(got[2][~where.any(axis=1)] == 0)
  return worst


def test_interpret_gradients_match_float64_reference():
  """Causal sparsemax, GQA, odd lengths (padded query rows, a padded key block), fp16:
  dQ, dK, dV under the GPU interpreter against the float64 dense gradients."""
  _check_grads("sparsemax", True, jnp.float16, t=100, s=100, n=2, kh=1, h=64)


GRADS = [
    ("sparsemax", False, "bfloat16", 128, 200, 2, 2, 64, {}),
    ("entmax15", True, "float16", 130, 130, 2, 1, 64, {}),
    ("entmax15", False, "bfloat16", 128, 70, 1, 1, 64, {}),
    ("top_k_softmax", True, "float16", 128, 128, 2, 1, 64, {}),
    ("top_k_softmax", False, "bfloat16", 100, 200, 1, 1, 64, {"k": 3}),
    ("sparsemax", True, "bfloat16", 256, 256, 1, 1, 128, {}, 128),  # 128-key forward blocks
    ("entmax15", True, "float16", 128, 128, 1, 1, 256, {}),  # one warpgroup per CTA
]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRADS, ids=[f"{c[0]}-{c[1]}-{c[7]}" for c in GRADS])
def test_interpret_gradients_matrix(case):
  normalizer, causal, dtype, t, s, n, kh, h, hp, *block_k = case
  _check_grads(normalizer, causal, jnp.dtype(dtype), t, s, n, kh, h, hp, *block_k)


@pytest.mark.slow
def test_backward_pipeline_has_no_data_race():
  """The race detector over both backward kernels' rings: dQ's two sweeps over its key
  list (coef, then dQ) and dK/dV's query list with five streamed row statistics."""
  if not mga.interpreter_runs_kernel():
    _check_grads("sparsemax", True, jnp.float16, 256, 256, 1, 1, 64)  # asserts the error
    return
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = mga.gpu_interpret_params(detect_races=True)
  _check_grads("sparsemax", True, jnp.float16, 256, 256, 1, 1, 64, interpret=params)
  assert not ipc.get_races().races_found


@pytest.mark.slow
def test_interpret_gradients_skip_empty_key_blocks():
  """The backward over the live blocks only: causal sparsemax where the second CTA's rows
  keep key block 2 alone (:func:`test_interpret_skips_empty_key_blocks`), so the dQ
  lists and the dK/dV lists (key blocks 0, 1 and 3 are live for the first CTA's rows only)
  are shorter than the causal ones; dQ, dK, dV still match the float64 gradients."""
  from jaxsoft.normalizers import spec as _spec
  from kernels_pallas import mosaic_gpu_threshold_backward as mgtb

  t, h, dtype = 256, 64, jnp.float16
  inputs = _aligned_inputs(t, h, dtype)
  _check_grads("sparsemax", True, dtype, t, t, 1, 1, h, inputs=inputs)
  if not mga.interpreter_runs_kernel():
    return
  # the premise: the backward's lists (64-row dQ CTAs x 2, 128-key dK/dV CTAs)
  cfg = mgt._cfg(_spec.resolve("sparsemax"), {}, 1.0 / math.sqrt(h), True, t, t, 64, 2)
  qp, kp, _ = mgt._pad(cfg, *inputs)
  flags = mgt._blocks(cfg, qp, kp, mga.gpu_interpret_params())[4]
  _, cnt, idx_t, cnt_t = mgtb.backward_tables(flags[..., :4], 64, 2, 4)
  assert cnt[0, 0].tolist() == [2, 1]  # rows 128..255: key block 2 only (causal: 4)
  assert cnt_t[0, 0].tolist() == [2, 2]  # keys 0..127: query blocks 0, 1 (causal: 4)
  assert idx_t[0, 0, 0, :2].tolist() == [0, 1]


# --- key lengths and local windows ---------------------------------------------------------

# (normalizer, causal, dtype, T, S, N, K, H, hp, key lengths (the batch), window, block_k)
MASKED = [
    # a batch entry with no key: its rows give zeros and zero gradients
    ("entmax15", True, "bfloat16", 130, 130, 2, 1, 64, {}, [90, 0], None, 64),
    ("sparsemax", False, "float16", 100, 200, 1, 1, 64, {}, [200, 37], None, 64),
    ("sparsemax", False, "float16", 200, 200, 1, 1, 64, {}, None, (20, 5), 64),
    ("entmax15", True, "bfloat16", 256, 256, 1, 1, 64, {}, None, 30, 64),  # window + causal
    ("sparsemax", True, "float16", 256, 256, 1, 1, 128, {}, [256, 150], (40, 0), 128),
    # top-k with |V| < k: the first rows and the second entry keep every visible key
    ("top_k_softmax", True, "float16", 128, 128, 2, 1, 64, {"k": 8}, [128, 5], (12, 0), 64),
    ("top_k_softmax", False, "bfloat16", 130, 130, 1, 1, 64, {}, [130, 6], (50, 3), 64),
]
_MASKED_IDS = [f"{c[0]}-{'causal' if c[1] else 'full'}-L{c[9]}-w{c[10]}".replace(" ", "")
               for c in MASKED]


def _export_masked(normalizer, causal, grad, *, lengths=None, window=None, h=64, t=200):
  """The CUDA export of the forward (or ``jax.grad``) with the key lengths as an argument:
  the number of Mosaic-GPU kernels in it."""
  q = jax.ShapeDtypeStruct((2, t, 2, h), jnp.bfloat16)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)

  def loss(q, k, v, lens):
    out = kp.mosaic_gpu_attention(q, k, v, normalizer=normalizer, is_causal=causal,
                                  key_value_seq_lengths=lens if lengths else None,
                                  local_window_size=window)
    return out.astype(jnp.float32).sum()

  f = jax.grad(loss, argnums=(0, 1, 2)) if grad else loss
  mlir = jax.export.export(jax.jit(f), platforms=["cuda"])(q, q, q, lens).mlir_module()
  return mlir.count("stablehlo.custom_call @mosaic_gpu")


EXPORT_MASKED = [(nm, c, lens, w) for nm in mgt.SUPPORTED for c in (False, True)
                 for lens, w in ((True, None), (False, 24), (False, (30, 7)), (True, (9, 0)))]


@pytest.mark.parametrize("grad", [False, True])
def test_masked_lowers_for_cuda(grad):
  """Key lengths and a window, forward and gradient (a sample; the matrix under -m slow)."""
  assert _export_masked("sparsemax", False, grad, lengths=True,
                        window=(30, 7)) == (4 if grad else 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", EXPORT_MASKED, ids=["-".join(map(str, c)) for c in EXPORT_MASKED])
def test_masked_lowers_for_cuda_full_matrix(case):
  nm, causal, lengths, window = case
  assert _export_masked(nm, causal, False, lengths=lengths, window=window) == 2
  assert _export_masked(nm, causal, True, lengths=lengths, window=window) == 4


def _check_masked(case):
  normalizer, causal, dtype, t, s, n, kh, h, hp, lengths, window, block_k = case
  return _check_grads(normalizer, causal, jnp.dtype(dtype), t, s, n, kh, h, hp, block_k,
                      lengths=lengths, window=window)


def test_interpret_masked_matches_float64_reference():
  """Key lengths (one batch entry sees keys 0..36 only), a (20, 5) window and GQA under the
  GPU interpreter: the forward and dQ, dK, dV against the float64 dense path with the
  same mask; invisible keys get exact zero gradients."""
  _check_grads("sparsemax", False, jnp.float16, 100, 200, 2, 1, 64, lengths=[200, 37],
               window=(20, 5))


@pytest.mark.slow
@pytest.mark.parametrize("case", MASKED, ids=_MASKED_IDS)
def test_interpret_masked_matrix(case):
  _check_masked(case)


@pytest.mark.slow
def test_interpret_masked_never_loads_invisible_blocks():
  """NaN keys and values in whole key blocks no row may see, with key lengths [100, 256]
  and a (10, 10) window (T = 128, S = 256, 64-key blocks): entry 0's keys 128.. (past its
  length) and entry 1's keys 192.. (past row 127 + 10). The block lists skip them, so the
  output and the gradients are those of the same inputs with zeros there, bit for bit (a
  loaded NaN block would poison its rows through the matmuls' 0 x NaN), the invisible
  keys' dK, dV are 0, and the search's lists hold none of those blocks."""
  t, s, h, dtype = 128, 256, 64, jnp.float16
  q, k, v = _inputs(0, t, s, 1, 1, h, dtype, 2)
  do = _inputs(1, t, t, 1, 1, h, dtype, 2)[0]
  lens, window = jnp.asarray([100, 256], jnp.int32), (10, 10)
  poisoned = np.zeros((2, s), bool)
  poisoned[0, 128:] = True  # blocks 2, 3
  poisoned[1, 192:] = True  # block 3
  nan = jnp.asarray(poisoned)[:, :, None, None]
  k_nan, v_nan = jnp.where(nan, jnp.nan, k), jnp.where(nan, jnp.nan, v)
  k0, v0 = jnp.where(nan, 0.0, k), jnp.where(nan, 0.0, v)
  f = lambda q, k, v: kp.mosaic_gpu_attention(q, k, v, normalizer="sparsemax", block_k=64,
                                              key_value_seq_lengths=lens,
                                              local_window_size=window, interpret=True)
  if not mga.interpreter_runs_kernel():
    with pytest.raises(kp.UnsupportedError, match="GPU interpreter of jax .* cannot run"):
      f(q, k_nan, v_nan)
    return

  def run(k, v):
    out, vjp = jax.vjp(f, q, k, v)
    return [np.asarray(a.astype(jnp.float32)) for a in (out, *vjp(do))]

  got, clean = run(k_nan, v_nan), run(k0, v0)
  for a, c in zip(got, clean, strict=True):
    assert np.all(np.isfinite(a)) and np.array_equal(a, c)
  assert np.abs(got[0]).max() > 0.1
  assert np.all(got[2][poisoned] == 0) and np.all(got[3][poisoned] == 0)
  _, _, idx, cnt = mgt.threshold_blocks(
      q, k_nan, normalizer="sparsemax", block_k=64, interpret=mga.gpu_interpret_params(),
      key_value_seq_lengths=lens, local_window_size=window)
  for entry, dead in ((0, {2, 3}), (1, {3})):
    live = {int(j) for j in np.asarray(idx[entry, 0, 0, :int(cnt[entry, 0, 0])])}
    assert live and not live & dead, (entry, live)
