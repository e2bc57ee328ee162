"""The Pallas attention engine in interpret mode vs a dense float32 reference.

Every registered normalizer of kernel class E, S or P is covered (the list is read from
the registry, so a new normalizer is tested with no change here): output and every input
cotangent, with a random cotangent. The reference is written for clarity: the dense
logits, the dense mask, ``normalizer(logits, where=mask) @ v``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.normalizers as jn
import kernels_pallas as kp
from jaxsoft import attention
from kernels_pallas import engine

ENGINE_NAMES = sorted(n for n in jn.names() if jn.get(n).kernel_class in ("E", "S", "P")
                      and not jn.get(n).needs_key)
# Class T with a ThresholdRule runs too (tests/kernels_pallas/test_threshold.py), and class R
# with a RowStatsRule (tests/kernels_pallas/test_row_stats.py).
OTHER_NAMES = sorted(n for n in jn.names() if n not in ENGINE_NAMES
                     and not (jn.get(n).kernel_class == "T" and jn.get(n).threshold is not None)
                     and not (jn.get(n).kernel_class == "R" and jn.get(n).row_stats is not None))


def dense_mask(t, s, *, is_causal=False, window=None, q_seg=None, k_seg=None, q_len=None,
               kv_len=None):
  """Boolean [B or 1, 1, T, S]: True = query i sees key j."""
  i = np.arange(t)[:, None]
  j = np.arange(s)[None, :]
  m = np.ones((t, s), bool)
  if is_causal:
    m &= j <= i
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    m &= (j >= i - left) & (j <= i + right)
  m = jnp.asarray(m)[None, None]
  if q_seg is not None:
    m = m & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
  if q_len is not None:
    m = m & (jnp.arange(t)[None, None, :, None] < q_len[:, None, None, None])
  if kv_len is not None:
    m = m & (jnp.arange(s)[None, None, None, :] < kv_len[:, None, None, None])
  return m


def reference(q, k, v, *, normalizer="softmax", params=None, scale=None, is_causal=False,
              window=None, segment_ids=None, q_len=None, kv_len=None, soft_cap=None,
              sinks=None):
  """Dense float32 attention: ``normalizer(logits, where=mask) @ v`` per head."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  k = jnp.repeat(k, n // kh, axis=2)
  v = jnp.repeat(v, n // kh, axis=2)
  scale = 1.0 / np.sqrt(h) if scale is None else scale
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  q_seg = k_seg = None
  if segment_ids is not None:
    q_seg, k_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
  mask = dense_mask(t, s, is_causal=is_causal, window=window, q_seg=q_seg, k_seg=k_seg,
                    q_len=q_len, kv_len=kv_len)
  mask = jnp.broadcast_to(mask, logits.shape)
  fn = jn.get(normalizer).fn
  if sinks is not None:  # softmax over [logits, sink], the sink's column dropped
    col = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(
        (1,) * (4 - jnp.ndim(sinks)) + jnp.shape(sinks)), (b, n, t, 1))
    logits = jnp.concatenate([logits, col], axis=-1)
    mask = jnp.concatenate([mask, jnp.ones((b, n, t, 1), bool)], axis=-1)
    w = fn(logits, where=mask, **(params or {}))[..., :-1]
  else:
    w = fn(logits, where=mask, **(params or {}))
  return jnp.einsum("bnts,bsnh->btnh", w, v)


def inputs(b=1, t=40, s=None, n=2, kh=1, h=16, dtype=jnp.float32, seed=0):
  s = t if s is None else s
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), dtype)
  ct = jax.random.normal(ks[3], (b, t, n, h), dtype)
  return q, k, v, ct


def value_and_cotangents(fn, args, ct):
  """fn(*args) and the cotangents of every argument for the output cotangent ``ct``."""
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(ct)


def assert_matches(kernel_fn, ref_fn, args, ct, fwd_tol=1e-5, bwd_tol=1e-4):
  out, grads = jax.jit(lambda *a: value_and_cotangents(kernel_fn, a, ct))(*args)
  # the reference jitted too: one compilation instead of one per op (5x less work)
  ref_out, ref_grads = jax.jit(lambda *a: value_and_cotangents(ref_fn, a, ct))(*args)
  # Relative to the magnitude: class P outputs are unnormalised (relu^2 can be large).
  sc = max(1.0, float(jnp.max(jnp.abs(ref_out))))
  chex.assert_trees_all_close(out, ref_out, atol=fwd_tol * sc, rtol=fwd_tol)
  for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads),
                  strict=True):
    gs = max(1.0, float(jnp.max(jnp.abs(r))))
    chex.assert_trees_all_close(g, r, atol=bwd_tol * gs, rtol=bwd_tol)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
  return out, grads


TRITON_SMALL = dict(block_q=16, block_k=16)
MOSAIC_SMALL = dict(block_q=16, block_k=128)


def check_per_head_parameter(name, param, value, backend, seed):
  """``name``'s hyperparameter ``param`` per head (``value`` [N, 1, 1]) reaches the kernel
  and its gradient comes back, nonzero; segments and two batches."""
  q, k, v, ct = inputs(b=2, t=40, n=2, kh=2, seed=seed)
  seg = jnp.array([[0] * 17 + [1] * 23, [0] * 40], jnp.int32)
  blocks = TRITON_SMALL if backend == "triton" else MOSAIC_SMALL

  def kfn(q, k, v, x):
    return kp.attention(q, k, v, normalizer=name, normalizer_params={param: x},
                        segment_ids=seg, backend=backend, interpret=True, block_sizes=blocks)

  _, grads = assert_matches(kfn, lambda q, k, v, x: reference(
      q, k, v, normalizer=name, params={param: x}, segment_ids=seg), (q, k, v, value), ct)
  assert bool(jnp.all(grads[3] != 0))


def check_mosaic_causal_window(name, seed):
  """The Mosaic driver with 8 x 16 tiles, causal with a (20, 0) window."""
  q, k, v, ct = inputs(t=40, n=2, kh=1, seed=seed)
  assert_matches(kernel(backend="mosaic_tpu", block_sizes=dict(block_q=8, block_k=16),
                        normalizer=name, local_window_size=(20, 0), is_causal=True),
                 lambda q, k, v: reference(q, k, v, normalizer=name, window=(20, 0),
                                           is_causal=True), (q, k, v), ct)


def check_dot_product_attention(monkeypatch, name, seed):
  """``jaxsoft.attention.dot_product_attention(implementation="pallas")`` (interpret mode
  from the environment) matches ``implementation="xla"``, output and cotangents."""
  monkeypatch.setenv(kp.INTERPRET_ENV, "1")
  q, k, v, ct = inputs(t=24, n=2, kh=1, seed=seed)

  def run(impl, q=q, k=k, v=v, ct=ct):
    f = lambda q, k, v: attention.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, normalizer=name, implementation=impl)
    return value_and_cotangents(f, (q, k, v), ct)

  # jit closing over the inputs: XLA constant-folds the interpret-mode kernels, which
  # rounds the recomputed tiles differently from the statistics pass (the row's max and
  # the single-entry rows must still be found: a wrong dK of O(1) before they were); the
  # xla reference jitted with the inputs as arguments (one compilation, not one per op)
  chex.assert_trees_all_close(jax.jit(lambda: run("pallas"))(),
                              jax.jit(lambda *a: run("xla", *a))(q, k, v, ct), atol=1e-4,
                              rtol=1e-4)


def check_matrix(backend, name, params, shapes):
  """For each ``(t, s, h)`` of ``shapes``: T not a multiple of the block, cross-attention
  lengths (the last 7 keys hidden), soft cap; GQA with 4 query heads on 2."""
  for t, s, h in shapes:
    q, k, v, ct = inputs(t=t, s=s, n=4, kh=2, h=h, seed=t)
    kw = dict(normalizer=name, normalizer_params=params, logits_soft_cap=5.0,
              key_value_seq_lengths=jnp.array([s - 7], jnp.int32))
    blocks = TRITON_SMALL if backend == "triton" else dict(block_q=32, block_k=128)
    assert_matches(kernel(backend=backend, block_sizes=blocks, **kw),
                   lambda q, k, v, s=s: reference(
                       q, k, v, normalizer=name, params=params, soft_cap=5.0,
                       kv_len=jnp.array([s - 7], jnp.int32)), (q, k, v), ct)


def check_rows_without_visible_keys(name, params=None, seed=15):
  """Rows with no visible key (a query segment no key has; a batch of key length 0) give
  zeros with zero gradient, and the rest matches the reference."""
  q, k, v, ct = inputs(b=2, t=24, seed=seed)
  seg_q = jnp.array([[0] * 12 + [7] * 12, [0] * 24], jnp.int32)
  seg_k = jnp.zeros((2, 24), jnp.int32)
  kv_len = jnp.array([24, 0], jnp.int32)
  f = kernel(normalizer=name, normalizer_params=params, segment_ids=(seg_q, seg_k),
             key_value_seq_lengths=kv_len)
  out, (dq, dk, dv) = assert_matches(
      f, lambda q, k, v: reference(q, k, v, normalizer=name, params=params,
                                   segment_ids=(seg_q, seg_k), kv_len=kv_len), (q, k, v), ct)
  assert bool(jnp.all(out[0, 12:] == 0)) and bool(jnp.all(out[1] == 0))
  assert bool(jnp.all(dq[0, 12:] == 0)) and bool(jnp.all(dk[1] == 0))


def kernel(backend="triton", block_sizes=None, **kw):
  if block_sizes is None and backend == "triton":
    block_sizes = TRITON_SMALL
  return lambda q, k, v: kp.attention(q, k, v, backend=backend, interpret=True,
                                      block_sizes=block_sizes, **kw)


def test_registry_has_engine_normalizers():
  assert {"softmax", "sigmoid", "stablemax"} <= set(ENGINE_NAMES)


def test_softmax_matches_jax_nn():
  q, k, v, ct = inputs(t=40, n=4, kh=2, seed=4)
  assert_matches(kernel(is_causal=True),
                 lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                 (q, k, v), ct)


def test_fully_masked_rows_are_zero_with_zero_gradient():
  q, k, v, ct = inputs(b=2, t=24, seed=6)
  # Batch 0: segment 7 exists only among the queries; batch 1: no valid key at all.
  seg_q = jnp.array([[0] * 12 + [7] * 12, [0] * 24], jnp.int32)
  seg_k = jnp.array([[0] * 24, [0] * 24], jnp.int32)
  kv_len = jnp.array([24, 0], jnp.int32)
  for name in ("softmax", "stablemax", "sigmoid"):
    def kfn(q, k, v, name=name):
      return kp.attention(q, k, v, normalizer=name, segment_ids=(seg_q, seg_k),
                          key_value_seq_lengths=kv_len, backend="triton", interpret=True,
                          block_sizes=TRITON_SMALL)
    out, (dq, dk, dv) = assert_matches(
        kfn, lambda q, k, v, name=name: reference(q, k, v, normalizer=name,
                                                  segment_ids=(seg_q, seg_k), kv_len=kv_len),
        (q, k, v), ct)
    assert bool(jnp.all(out[0, 12:] == 0)) and bool(jnp.all(out[1] == 0))
    assert bool(jnp.all(dq[0, 12:] == 0)) and bool(jnp.all(dq[1] == 0))
    assert bool(jnp.all(dk[1] == 0)) and bool(jnp.all(dv[1] == 0))


def test_huge_logits_no_nan():
  q, k, v, ct = inputs(t=24, seed=7)
  q = q * 300.0
  for name in ("softmax", "softpick", "softmax_1"):
    if name not in ENGINE_NAMES:
      continue
    f = kernel(normalizer=name, is_causal=True)
    out, grads = jax.jit(lambda *a, f=f: value_and_cotangents(f, a, ct))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves((out, grads)))
    ref = jax.jit(lambda q, k, v, name=name: reference(  # one compilation, not one per op
        q, k, v, normalizer=name, is_causal=True))(q, k, v)
    chex.assert_trees_all_close(out, ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_forward():
  q, k, v, _ = inputs(t=40, n=2, kh=1, h=32, dtype=jnp.bfloat16, seed=8)
  for name in ("softmax", "sigmoid"):
    out = jax.jit(kernel(normalizer=name, is_causal=True))(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = jax.jit(lambda q, k, v, name=name: reference(  # one compilation, not one per op
        q, k, v, normalizer=name, is_causal=True))(q, k, v)
    chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", OTHER_NAMES)
def test_other_classes_raise_not_implemented(name):
  q, k, v, _ = inputs(t=16)
  params = {"key": jax.random.key(0)} if jn.get(name).needs_key else None
  with pytest.raises(NotImplementedError):
    kp.attention(q, k, v, normalizer=name, normalizer_params=params, backend="triton",
                 interpret=True)


def test_bad_arguments_raise_value_error():
  q, k, v, _ = inputs(t=16, n=3, kh=2)
  with pytest.raises(ValueError, match="multiple of the number of `key`"):
    kp.attention(q, k, v, interpret=True)
  q, k, v, _ = inputs(t=16)
  with pytest.raises(ValueError, match="block_q"):
    kp.attention(q, k, v, interpret=True, block_sizes=dict(block_q=24, block_k=16))
  with pytest.raises(ValueError, match="backend"):
    kp.attention(q, k, v, backend="cuda", interpret=True)
  with pytest.raises(ValueError, match="local_window_size"):
    kp.attention(q, k, v, local_window_size=(1, 2, 3), interpret=True)
  with pytest.raises(KeyError):
    kp.attention(q, k, v, normalizer="no_such_normalizer", interpret=True)
  with pytest.raises(NotImplementedError):
    kp.attention(q, k, v, normalizer=lambda x, axis=-1, where=None: x, interpret=True)
  with pytest.raises(ValueError, match="normalizer_params"):  # validated as jaxsoft does
    kp.attention(q, k, v, normalizer_params={"temperature": -1.0}, interpret=True)


def test_default_block_sizes():
  tpu = engine.default_block_sizes("mosaic_tpu", 4096, 4096, 128)
  assert tpu.block_q >= 512 and tpu.block_k >= 512
  assert engine.default_block_sizes("mosaic_tpu", 100, 300, 64).block_q == 128
  tri = engine.default_block_sizes("triton", 4096, 4096, 128).resolved()
  for x in dataclasses_values(tri):
    assert x & (x - 1) == 0 and 16 <= x <= 128


def dataclasses_values(bl):
  return [bl.block_q, bl.block_k, bl.block_q_dkv, bl.block_k_dkv, bl.block_q_dq, bl.block_k_dq]
