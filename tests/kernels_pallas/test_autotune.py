"""K06 autotuned block shapes (kernels_pallas.autotune): legal candidates per backend, the
choice follows the timer, wrong candidates are rejected, the cache avoids re-timing, and
the largest candidates lower for cuda and tpu."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import _api
from kernels_pallas import autotune as A
from kernels_pallas.engine import BlockSizes
from tests.kernels_pallas.test_lowering import export_fwd_bwd

SHAPES = [(16, 16, 64), (100, 300, 72), (1024, 1024, 64), (4096, 4096, 128),
          (4096, 16384, 256), (300, 5000, 32)]


@pytest.fixture(autouse=True)
def _fresh_cache():
  A.clear_autotune_cache()
  yield
  A.clear_autotune_cache()


def _qkv(b=1, t=32, n=2, kh=2, h=16, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(3), 3)
  return (jax.random.normal(ks[0], (b, t, n, h), dtype),
          jax.random.normal(ks[1], (b, t, kh, h), dtype),
          jax.random.normal(ks[2], (b, t, kh, h), dtype))


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("t,s,h", SHAPES)
def test_candidates_legal(backend, t, s, h):
  cands = A.candidate_block_sizes(backend, t, s, h)
  default = kp.default_block_sizes(backend, t, s, h).resolved()
  assert cands[0] == default
  assert len(set(cands)) == len(cands)
  for c in cands:
    for key_lanes in (False, True):
      assert _api.resolve_block_sizes(c, backend, t, s, h, key_lanes) == c
    if backend == "triton":
      d = max(16, 1 << (h - 1).bit_length())
      assert (c.block_q + c.block_k) * d <= A.TRITON_TILE_ELEMS or c == default
      assert c.block_q <= max(16, 1 << (t - 1).bit_length())
  if t >= 1024:  # larger than the default on long sequences
    area = lambda c: c.block_q * c.block_k  # noqa: E731
    assert max(map(area, cands)) > area(default)


# A fake attention: the tiles only change a tag that the fake timer reads, or (for the
# "wrong" tile) the result.
WRONG = BlockSizes(32, 32, 32, 32, 32, 32)


def _fake_attention(q, k, v, *, block_sizes, **kw):
  out = jnp.einsum("btnh,bsnh->btnh", q, k) * 0.0 + v
  if block_sizes.resolved() == WRONG:
    out = out * 1.5
  return out


CANDS = [BlockSizes(16, 16), BlockSizes(32, 16), WRONG, BlockSizes(16, 32)]


def _fake_timer(seconds, calls):
  def timer(fn):
    calls.append(1)
    return seconds.pop(0)
  return timer


def test_choice_follows_timer_and_rejects_wrong():
  q, k, v = _qkv(t=16)
  calls = []
  # default (16x16 for t=16) first, then 32x16, then 16x32 (WRONG is never timed).
  best = kp.autotune_block_sizes(_fake_attention, q, k, v, backend="triton", interpret=True,
                                 candidates=CANDS, timer=_fake_timer([3.0, 1.0, 2.0], calls))
  assert best == BlockSizes(32, 16).resolved()
  res = A.LAST_RESULT
  assert WRONG in res.rejected and WRONG not in res.times
  assert len(calls) == 3
  # The timer's other order picks the other shape (a fresh cache).
  kp.clear_autotune_cache()
  best = kp.autotune_block_sizes(_fake_attention, q, k, v, backend="triton", interpret=True,
                                 candidates=CANDS, timer=_fake_timer([3.0, 2.0, 0.5], []))
  assert best == BlockSizes(16, 32).resolved()


def test_wrong_fastest_is_never_chosen():
  q, k, v = _qkv(t=16)
  best = kp.autotune_block_sizes(_fake_attention, q, k, v, backend="triton", interpret=True,
                                 candidates=[WRONG], timer=_fake_timer([5.0], []))
  assert best == kp.default_block_sizes("triton", 16, 16, 16).resolved()
  assert WRONG in A.LAST_RESULT.rejected


def test_cache_avoids_retiming():
  q, k, v = _qkv(t=16)
  calls = []
  kw = dict(backend="triton", interpret=True, candidates=CANDS,
            timer=_fake_timer([3.0, 1.0, 2.0], calls))
  first = kp.autotune_block_sizes(_fake_attention, q, k, v, **kw)
  assert len(calls) == 3
  again = kp.autotune_block_sizes(_fake_attention, q, k, v, **kw)  # the timer's list is empty now
  assert again == first and len(calls) == 3 and A.LAST_RESULT.cached
  # T in the same power-of-two bucket (16 -> 13 rounds to 16): still cached.
  q2, k2, v2 = _qkv(t=13)
  assert kp.autotune_block_sizes(_fake_attention, q2, k2, v2, **kw) == first and len(calls) == 3
  # A different static flag is a different key.
  with pytest.raises(IndexError):  # it re-times, and the fake timer is exhausted
    kp.autotune_block_sizes(_fake_attention, q, k, v, is_causal=True, **kw)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_real_kernel_matches_default(backend):
  """The real interpret-mode kernel: tuning over two shapes, the choice equals the
  default's result (forward and gradients)."""
  q, k, v = _qkv(t=32, h=16)
  if backend == "triton":
    cands = [BlockSizes(32, 16, 16, 16, 16, 16)]
  else:
    cands = [BlockSizes(16, 32, 16, 32, 16, 32)]
  kw = dict(backend=backend, interpret=True, is_causal=True)
  best = kp.autotune_block_sizes(kp.attention, q, k, v, candidates=cands, timer=lambda f: 0.0,
                                 **kw)
  assert not A.LAST_RESULT.rejected, A.LAST_RESULT.rejected

  def loss(bl):  # jitted: one compilation, not one per op
    return jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(kp.attention(q, k, v, block_sizes=bl, **kw) ** 2),
        argnums=(0, 1, 2)))(q, k, v)

  got, want = loss(best), loss(None)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_candidates_bad_input_names_the_argument():
  with pytest.raises(ValueError, match="`backend`"):
    A.candidate_block_sizes("cuda", 64, 64, 64)
  for args, name in [((0, 64, 64), "`t`"), ((64, -1, 64), "`s`"), ((64, 64, 0), "`head_dim`"),
                     ((64, 64, 64.0), "`head_dim`")]:
    with pytest.raises(ValueError, match=name):
      A.candidate_block_sizes("triton", *args)


def test_block_sizes_auto_in_attention(monkeypatch):
  """``kp.attention(block_sizes="auto")`` tunes once per call key (the cache serves the
  second call), gives the default's result, and a bad string is named."""
  q, k, v = _qkv(t=32, h=16)
  calls = []
  real = A.autotune_block_sizes

  def spy(*a, **kw):
    calls.append(A.LAST_RESULT)
    return real(*a, candidates=[BlockSizes(32, 16, 16, 16, 16, 16)],
                timer=lambda f: 0.0, **kw)

  monkeypatch.setattr(A, "autotune_block_sizes", spy)
  kw = dict(backend="triton", interpret=True, is_causal=True)
  got = kp.attention(q, k, v, block_sizes="auto", **kw)
  first = A.LAST_RESULT
  assert first is not None and not first.cached and not first.rejected
  again = kp.attention(q, k, v, block_sizes="auto", **kw)
  assert A.LAST_RESULT.cached and len(calls) == 2
  want = kp.attention(q, k, v, **kw)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(got))
  with pytest.raises(ValueError, match="block_sizes"):
    kp.attention(q, k, v, block_sizes="fast", **kw)


def _largest(backend, t, h):
  cands = A.candidate_block_sizes(backend, t, t, h)
  return sorted(cands, key=lambda c: (c.block_q * c.block_k, c.block_q_dkv * c.block_k_dkv))


def _lower(backend, bl, t=1024, h=64):
  q = jax.ShapeDtypeStruct((1, t, 2, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, t, 1, h), jnp.bfloat16)
  mlir = export_fwd_bwd(lambda q, k, v: kp.attention(q, k, v, backend=backend,
                                                     block_sizes=bl, is_causal=True),
                        backend, q, k)
  assert mlir


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_largest_candidate_lowers(backend):
  _lower(backend, _largest(backend, 1024, 64)[-1])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_all_large_candidates_lower(backend):
  default = kp.default_block_sizes(backend, 1024, 1024, 64).resolved()
  for bl in _largest(backend, 1024, 64):
    if bl.block_q * bl.block_k >= default.block_q * default.block_k:
      _lower(backend, bl)


def test_under_jit_uses_stand_ins():
  """Called while tracing (as block_sizes="auto" would be), it tunes on concrete arrays."""
  q, k, v = _qkv(t=16)
  calls = []

  @jax.jit
  def f(q, k, v):
    bl = kp.autotune_block_sizes(_fake_attention, q, k, v, backend="triton", interpret=True,
                                 candidates=CANDS, timer=_fake_timer([3.0, 1.0, 2.0], calls))
    return _fake_attention(q, k, v, block_sizes=bl), bl.block_q

  out, bq = f(q, k, v)
  assert int(bq) == 32 and len(calls) == 3


def test_pipeline_stages_and_warps_reach_the_triton_call():
  """BlockSizes.num_warps / num_stages are the Triton compiler parameters of every pass
  (checked in the lowered custom calls); the autotuner offers 3 and 4 stages of the default
  tiles; the interpret kernel's result does not depend on them; bad values are named."""
  cands = A.candidate_block_sizes("triton", 4096, 4096, 128)
  default = kp.default_block_sizes("triton", 4096, 4096, 128).resolved()
  assert {c.num_stages for c in cands if c.block_q == default.block_q
          and c.block_k == default.block_k and c.block_q_dkv == default.block_q_dkv} >= {3, 4}
  assert all(c.num_stages is None for c in A.candidate_block_sizes("mosaic_tpu", 4096, 4096,
                                                                   128))
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 1, 64), jnp.bfloat16)
  bl = BlockSizes(64, 64, num_warps=2, num_stages=3)
  mlir = export_fwd_bwd(lambda q, k, v: kp.attention(q, k, v, backend="triton", block_sizes=bl,
                                                     is_causal=True), "triton", q, k)
  assert mlir.count("num_stages = 3") >= 3 and mlir.count("num_warps = 2") >= 3
  assert "num_stages = 2" not in mlir and "num_warps = 8" not in mlir

  qa, ka, va = _qkv(t=40, h=16)
  kw = dict(backend="triton", interpret=True, is_causal=True)
  np.testing.assert_array_equal(
      np.asarray(kp.attention(qa, ka, va, block_sizes=dict(block_q=16, block_k=16,
                                                           num_stages=4, num_warps=4), **kw)),
      np.asarray(kp.attention(qa, ka, va, block_sizes=dict(block_q=16, block_k=16), **kw)))
  for bad, match in ((dict(num_stages=0), "num_stages"), (dict(num_warps=3), "num_warps"),
                     (dict(num_stages=True), "num_stages")):
    with pytest.raises(ValueError, match=match):
      kp.attention(qa, ka, va, block_sizes=dict(block_q=16, block_k=16, **bad), **kw)
  with pytest.raises(ValueError, match="Triton setting"):
    kp.attention(qa, ka, va, backend="mosaic_tpu", interpret=True,
                 block_sizes=dict(block_q=128, block_k=128, num_stages=3))
