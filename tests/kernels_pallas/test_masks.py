"""Structure masks, block skipping, boundary shapes and head dims (interpret mode vs dense).

The block tables and visible counts themselves are MaskStructure's, tested in
tests/attention/test_core_masks.py."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from tests.kernels_pallas.test_engine import (
  ENGINE_NAMES,
  TRITON_SMALL,
  assert_matches,
  inputs,
  reference,
)

# A sampled normalizer per structural case (the full cross product runs under -m slow):
# each class E, S and P appears in the default set.
CASES = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(5, 3)),
    "causal_window": dict(is_causal=True, local_window_size=(7, 0)),
    "soft_cap": dict(is_causal=True, logits_soft_cap=2.0),
}
DEFAULT_PAIRS = [("causal", "softpick"), ("window", "stablemax"),
                 ("causal_window", "softmax"), ("soft_cap", "sigmoid")]


def _ref_kwargs(kw):
  out = dict(kw)
  if "local_window_size" in out:
    out["window"] = out.pop("local_window_size")
  if "logits_soft_cap" in out:
    out["soft_cap"] = out.pop("logits_soft_cap")
  return out


def _run(case_kw, name, t=40, s=None, backend="triton", block_sizes=None, n=2, kh=1, h=16,
         seed=0):
  q, k, v, ct = inputs(t=t, s=s, n=n, kh=kh, h=h, seed=seed)
  bs = block_sizes or (TRITON_SMALL if backend == "triton" else None)

  def kfn(q, k, v):
    return kp.attention(q, k, v, normalizer=name, backend=backend, interpret=True,
                        block_sizes=bs, **case_kw)

  return assert_matches(kfn, lambda q, k, v: reference(q, k, v, normalizer=name,
                                                       **_ref_kwargs(case_kw)), (q, k, v), ct)


@pytest.mark.parametrize("case,name", DEFAULT_PAIRS)
def test_structure(case, name):
  if name not in ENGINE_NAMES:
    pytest.fail(f"{name} is not registered")
  _run(CASES[case], name)


@pytest.mark.slow
@pytest.mark.parametrize("case,name", list(itertools.product(CASES, ENGINE_NAMES)))
def test_structure_every_normalizer(case, name):
  _run(CASES[case], name)


def _segments(b, t, seed, sorted_=True):
  rng = np.random.default_rng(seed)
  if sorted_:
    ids = np.sort(rng.integers(0, 3, size=(b, t)), axis=1)
  else:
    ids = rng.integers(0, 3, size=(b, t))
  return jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("name", ["softmax", "ssmax"])
def test_segments_and_lengths(name):
  # Packed sequences plus padding: the length-dependent ssmax sees n = visible count.
  b, t = 2, 40
  q, k, v, ct = inputs(b=b, t=t, seed=3)
  seg = _segments(b, t, 0)
  q_len = jnp.array([40, 29], jnp.int32)
  kv_len = jnp.array([33, 40], jnp.int32)

  def kfn(q, k, v):
    return kp.attention(q, k, v, normalizer=name, segment_ids=seg, is_causal=True,
                        query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                        backend="triton", interpret=True, block_sizes=TRITON_SMALL)

  out, _ = assert_matches(kfn, lambda q, k, v: reference(
      q, k, v, normalizer=name, segment_ids=seg, is_causal=True, q_len=q_len,
      kv_len=kv_len), (q, k, v), ct)
  assert bool(jnp.all(out[1, 29:] == 0))


def test_cross_attention_with_unsorted_segment_pairs():
  b, t, s = 2, 24, 56
  q, k, v, ct = inputs(b=b, t=t, s=s, n=4, kh=2, seed=4)
  seg = (_segments(b, t, 1, sorted_=False), _segments(b, s, 2, sorted_=False))

  def kfn(q, k, v):
    return kp.attention(q, k, v, normalizer="sigmoid", segment_ids=seg, backend="triton",
                        interpret=True, block_sizes=TRITON_SMALL)

  assert_matches(kfn, lambda q, k, v: reference(q, k, v, normalizer="sigmoid",
                                                segment_ids=seg), (q, k, v), ct)


def test_long_sequence_not_multiple_of_block():
  # T = 384 with Triton's default blocks (128 x 64 forward, 64 x 64 backward).
  q, k, v, ct = inputs(t=384, n=2, kh=1, h=32, seed=5)

  def kfn(q, k, v):
    return kp.attention(q, k, v, is_causal=True, local_window_size=(100, 0), backend="triton",
                        interpret=True)

  assert_matches(kfn, lambda q, k, v: reference(q, k, v, is_causal=True, window=(100, 0)),
                 (q, k, v), ct)


@pytest.mark.slow
@pytest.mark.parametrize("t,name", [(128, "softmax"), (384, "stablemax"), (1000, "softmax"),
                                    (1000, "sigmoid")])
def test_lengths_sweep(t, name):
  _run(dict(is_causal=True), name, t=t, block_sizes=dict(block_q=64, block_k=64), h=32)


@pytest.mark.parametrize("h", [64, 128, 72])
def test_head_dims(h):
  q, k, v, ct = inputs(t=32, n=2, kh=1, h=h, seed=6)

  def kfn(q, k, v):
    return kp.attention(q, k, v, is_causal=True, backend="triton", interpret=True,
                        block_sizes=dict(block_q=32, block_k=32))

  assert_matches(kfn, lambda q, k, v: reference(q, k, v, is_causal=True), (q, k, v), ct)


def test_skipped_blocks_do_no_work():
  """With causal masking the kernel must not read key blocks above the diagonal: poison
  them with NaN (they are masked for every query) and expect a finite, exact result."""
  t = 64
  q, k, v, _ = inputs(t=t, n=1, kh=1, h=16, seed=11)
  out_clean = jax.jit(lambda q, k, v: kp.attention(
      q, k, v, is_causal=True, backend="triton", interpret=True,
      block_sizes=dict(block_q=16, block_k=16)))(q, k, v)
  # Keys/values 48..63 are visible to queries 48..63 only; rows < 48 never load them.
  poisoned_v = v.at[:, 48:].set(jnp.nan)
  out = jax.jit(lambda q, k, v: kp.attention(
      q, k, v, is_causal=True, backend="triton", interpret=True,
      block_sizes=dict(block_q=16, block_k=16)))(q, k, poisoned_v)
  assert bool(jnp.all(jnp.isfinite(out[:, :48])))
  np.testing.assert_array_equal(np.asarray(out[:, :48]), np.asarray(out_clean[:, :48]))
