"""The Pallas engine's ``score="distance"`` (A18), against the dense xla path, in both
drivers (interpret mode).

``|q_i|^2`` and ``-|k_j|^2`` ride on the decay's row and column operands with scale -2
(``engine.score_tile``), the logit is the square root of the tile's squared distance and
the backward chains through it (``engine.logits_grad``); checked forward and backward (q,
k, v) with GQA, causal masks, a soft cap, rows with no visible key, classes E, T and R,
bfloat16 inputs and the exp2 flag. With FoX's decay the operands carry two terms each,
checked with every cotangent. ``return_residual``: tests/kernels_pallas/test_residual.py
(the export below keeps the residual's outputs in the program too).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from jaxsoft import attention
from tests import helpers
from tests.kernels_pallas.test_contract import MOSAIC_SMALL, _decay
from tests.kernels_pallas.test_engine import TRITON_SMALL, assert_matches, inputs
from tests.kernels_pallas.test_lowering import export_fwd_bwd

B, T, N, KH, H = 2, 24, 4, 2, 16
KV_LEN = jnp.array([T, 0], jnp.int32)  # batch row 1 sees no key


def _blocks(backend):
  return TRITON_SMALL if backend == "triton" else MOSAIC_SMALL


def _kernel(backend, **kw):
  return lambda q, k, v: kp.attention(q, k, v, backend=backend, interpret=True,
                                      block_sizes=_blocks(backend), **kw)


def _xla(**kw):
  return lambda q, k, v: attention.dot_product_attention(q, k, v, implementation="xla", **kw)


def _jit(f, *args):
  """``f(*args)`` jitted: one compilation, not one per eager op."""
  return jax.jit(f)(*args)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_distance_matches_xla_with_gqa_causal_cap_and_empty_rows(backend):
  """idw_softmax (inverse-distance weights, the normalizer distance scores are for), causal,
  GQA (|k_j|^2 repeated over the group), a soft cap, and a batch row with no visible key
  (zeros, zero and finite gradients)."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=51)
  kw = dict(normalizer="idw_softmax", score="distance", is_causal=True, logits_soft_cap=6.0,
            key_value_seq_lengths=KV_LEN)
  out, (dq, dk, dv) = assert_matches(_kernel(backend, **kw), _xla(**kw), (q, k, v), ct)
  assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(dq[1] == 0)) and bool(jnp.all(dk[1] == 0))
  assert bool(jnp.any(dq[0] != 0)) and bool(jnp.any(dk[0] != 0))


@pytest.mark.parametrize("backend,normalizer", [
    ("triton", "sparsemax"), ("mosaic_tpu", "standardized_softmax"),
    pytest.param("mosaic_tpu", "sparsemax", marks=pytest.mark.slow),
    pytest.param("triton", "standardized_softmax", marks=pytest.mark.slow),
    pytest.param("triton", "softmax", marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", "sigmoid", marks=pytest.mark.slow)])
def test_distance_runs_every_class(backend, normalizer):
  """Class T (the threshold search and its support-restricted backward) and class R (the
  statistics pass and its own backward) see the distance logits too; with a dense bias
  (added after the distance) and a mask."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=52)
  q, k = 0.3 * q, 0.3 * k  # distances of about 2: sparsemax keeps several keys
  bias = 0.5 * helpers.standard_normal(53, (T, T))
  mask = jax.random.bernoulli(jax.random.key(54), 0.8, (B, 1, T, T))
  kw = dict(normalizer=normalizer, score="distance", bias=bias, mask=mask)
  assert_matches(_kernel(backend, **kw), _xla(**kw), (q, k, v), ct)


def test_distance_bfloat16_and_exp2():
  """bfloat16 inputs: the kernel's q.k (float32 accumulation of exact bf16 products) and
  the float32 squared norms of the same bf16 values give the dense path's distances to
  float32 rounding, so the bf16 output is within its own rounding, with a FoX decay too;
  ``exp2`` (log2 e applied after the square root) changes nothing beyond float32
  rounding."""
  q, k, v, _ = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=55)
  kw = dict(normalizer="softmax", score="distance", is_causal=True)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out = _jit(_kernel("triton", **kw), qb, kb, vb)
  ref = _jit(_xla(**kw), *(x.astype(jnp.float32) for x in (qb, kb, vb)))
  assert out.dtype == jnp.bfloat16
  chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=2e-2, rtol=2e-2)
  plain, fast = (_jit(_kernel("triton", **kw), q, k, v),
                 _jit(_kernel("triton", exp2=True, **kw), q, k, v))
  chex.assert_trees_all_close(fast, plain, atol=2e-6, rtol=1e-5)
  decay = _decay(n=N)  # with a decay too (the two-term operands, float32 in the kernel)
  out = _jit(_kernel("triton", decay_bias=decay, **kw), qb, kb, vb)
  ref = _jit(_xla(decay_bias=decay, **kw), *(x.astype(jnp.float32) for x in (qb, kb, vb)))
  assert out.dtype == jnp.bfloat16
  chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=2e-2, rtol=2e-2)


def test_distance_gradient_is_finite_where_a_key_equals_its_query():
  """k_j = q_j: the squared distance is 0 up to rounding; its gradient is 0 where the
  rounded square is <= 0 (safe_distance) and finite elsewhere."""
  q, _, v, ct = inputs(b=1, t=T, n=2, kh=2, h=H, seed=56)
  f = _kernel("triton", normalizer="idw_softmax", score="distance")
  dq, dk = jax.jit(jax.grad(lambda q, k: jnp.sum(f(q, k, v) * ct), argnums=(0, 1)))(q, q)
  assert bool(jnp.all(jnp.isfinite(dq))) and bool(jnp.all(jnp.isfinite(dk)))


@pytest.mark.parametrize("backend,normalizer", [
    ("triton", "idw_softmax"), ("mosaic_tpu", "softmax"),
    ("triton", "entmax15"), ("mosaic_tpu", "standardized_softmax"),
    pytest.param("mosaic_tpu", "sparsemax", marks=pytest.mark.slow),
    pytest.param("triton", "clipped_softmax", marks=pytest.mark.slow),
    pytest.param("triton", "sigmoid", marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", "idw_softmax", marks=pytest.mark.slow)])
def test_distance_with_a_decay_matches_xla(backend, normalizer):
  """``score="distance"`` together with FoX's ``decay_bias``: the row and column operands
  carry two terms each (``engine.Config.distance_decay``: the squared norms, then cq and
  ck), the logit is ``|q_i - k_j| + cq_i - ck_j`` before the soft cap. Forward and every
  cotangent (q, k, v, cq, ck) against the dense path, with GQA, causality, a soft cap and
  a batch row with no visible key (zeros, zero gradients)."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=57)
  q, k = 0.3 * q, 0.3 * k  # distances of about 2: the threshold normalizers keep several
  cq, ck = _decay(n=N)
  kw = dict(normalizer=normalizer, score="distance", is_causal=True, logits_soft_cap=8.0,
            key_value_seq_lengths=KV_LEN)

  def kernel(q, k, v, cq, ck):
    return _kernel(backend, decay_bias=(cq, ck), **kw)(q, k, v)

  def ref(q, k, v, cq, ck):
    return attention.dot_product_attention(q, k, v, implementation="xla",
                                           decay_bias=(cq, ck), **kw)

  out, grads = assert_matches(kernel, ref, (q, k, v, cq, ck), ct)
  assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(grads[0][1] == 0))
  assert bool(jnp.all(grads[3][1] == 0)) and bool(jnp.any(grads[3][0] != 0))
  assert bool(jnp.any(grads[4][0] != 0))


def test_distance_with_a_decay_through_the_dispatcher_and_fp8_is_refused(monkeypatch):
  """``implementation="pallas"`` runs a distance with a decay (no fallback), with ACP
  pruning too: the kernel's pruned tiles are below the threshold, so the output is within
  the bound's weight of the unpruned one. fp8 quantises dot products only: ValueError."""
  monkeypatch.setenv(kp._api.INTERPRET_ENV, "1")
  q, k, v, _ = inputs(b=B, t=64, n=N, kh=KH, h=H, seed=61)
  cq = jnp.cumsum(jnp.full((B, 64, N), -0.5), axis=1)  # strong decay: far tiles prunable
  kw = dict(score="distance", is_causal=True)  # the decay an argument: no constant folding
  want = _jit(lambda q, k, v, c: attention.dot_product_attention(
      q, k, v, implementation="xla", decay_bias=(c, c), **kw), q, k, v, cq)
  got = _jit(lambda q, k, v, c: attention.dot_product_attention(
      q, k, v, implementation="pallas", decay_bias=(c, c), **kw), q, k, v, cq)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  pruned = _jit(lambda q, k, v, c: kp.attention(
      q, k, v, interpret=True, block_sizes=TRITON_SMALL, decay_prune_threshold=-12.0,
      decay_bias=(c, c), **kw), q, k, v, cq)
  chex.assert_trees_all_close(pruned, want, atol=1e-3)
  with pytest.raises(ValueError, match="fp8"):
    kp.attention(q, k, v, score="distance", fp8="e4m3", interpret=True)


@pytest.mark.parametrize("decay", [False, True], ids=["distance", "distance_decay"])
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_distance_and_residual_lower_for_both_targets(backend, decay):
  """Exported for cuda (Pallas-to-Triton) and tpu (Mosaic): the distance's row/column
  operands (with a decay: two terms each, [bq, 2] and [2, bk] blocks) and the residual's
  outputs have legal block shapes."""
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)

  def f(q, k, v):  # the residual stays in the program (its cotangent is ignored)
    cq = jnp.cumsum(-jax.nn.softplus(q[..., 0].astype(jnp.float32)), axis=1)  # [B, T, N]
    out, res = kp.attention(q, k, v, backend=backend, is_causal=True, normalizer="sparsemax",
                            score="distance", return_residual=True,
                            decay_bias=(cq, cq) if decay else None)
    return out + (0 * res)[..., None].astype(out.dtype)

  text = export_fwd_bwd(f, backend, q, k)
  assert text.count("jaxsoft_attention_") >= 3
