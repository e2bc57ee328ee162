"""A50 norm-aware distance attention: ``dot_product_attention(score="neg_sq_distance")``,
logits ``-(s/2)||q_i - k_j||^2``, against a float64 NumPy oracle written from the squared
distance itself (not from the expansion the library uses): outputs, residuals, gradients
(reverse and forward mode), masks and fully masked rows, GQA, cross-attention, bias, soft
cap, a caller's decay, a non-shift-invariant normalizer (sigmoid sees the row term),
bf16 (computed in float32), float64 under x64, the Pallas kernels (interpret mode) and
bad input.

Tolerances follow the error bound of ``neg_sq_distance_terms``: the float32 logit error is
at most ``(H + 4) u s (|q|^2 + |k|^2)`` with u = 2^-24 (about 3e-6 for H = 4, s = 1/2 and
norms^2 ~ 12 below), and a softmax weight's relative error at most about twice that; the
tolerances leave a 30x-100x margin above it and stay far below the effects they check.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from tests import helpers
from tests.helpers import check_raises, make_qkv

NSD = dict(score="neg_sq_distance")


@pytest.fixture
def blocks(monkeypatch):
  """Small blocks: the short sequences below span several (padded) chunked blocks."""
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)


def logits_ref(q, k, *, scale=None, cap=None, bias=None, decay=None):
  """float64 [B, N, T, S]: -(s/2)||q_i - k_{j, n // G}||^2 (+ decay, cap, bias)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, N, H = q.shape
  K = k.shape[2]
  s = 1.0 / np.sqrt(H) if scale is None else scale
  kg = np.repeat(k, N // K, axis=2)  # [B, S, N, H]: query head n uses key head n // G
  diff = q.transpose(0, 2, 1, 3)[:, :, :, None, :] - kg.transpose(0, 2, 1, 3)[:, :, None, :, :]
  z = -0.5 * s * np.sum(diff ** 2, axis=-1)
  if decay is not None:
    cq, ck = (np.asarray(a, np.float64).transpose(0, 2, 1) for a in decay)
    z = z + cq[..., :, None] - ck[..., None, :]
  if cap is not None:
    z = cap * np.tanh(z / cap)
  if bias is not None:
    z = z + np.asarray(bias, np.float64)
  return z


def visible_ref(B, N, T, S, *, mask=None, causal=False, kv_lengths=None):
  vis = np.ones((B, N, T, S), bool)
  if mask is not None:
    vis &= np.broadcast_to(np.asarray(mask), vis.shape)
  if causal:
    vis &= np.arange(S)[None, :] <= np.arange(T)[:, None]
  if kv_lengths is not None:
    vis &= (np.arange(S)[None, :] < np.asarray(kv_lengths)[:, None])[:, None, None, :]
  return vis


def softmax_ref(z, vis):
  """Weights (zeros on fully masked rows) and the log-sum-exp residual (-inf there)."""
  m = np.max(np.where(vis, z, -np.inf), axis=-1, keepdims=True)
  e = np.where(vis, np.exp(z - np.where(np.isfinite(m), m, 0.0)), 0.0)
  d = e.sum(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    lse = np.where(d[..., 0] > 0, np.log(d[..., 0]) + m[..., 0], -np.inf)
  return e / np.maximum(d, 1e-300), lse


def apply_ref(w, v, N):
  """sum_j w_ij v_{j, n // G} -> [B, T, N, Hv]."""
  vg = np.repeat(np.asarray(v, np.float64), N // v.shape[2], axis=2).transpose(0, 2, 1, 3)
  return np.einsum("bnts,bnsh->btnh", w, vg)


def case(seed, B=2, T=5, S=7, N=4, K=2, H=4):
  q, k, v = make_qkv(seed, B, T, S=S, N=N, K=K, H=H)
  rng = np.random.default_rng(seed)
  mask = rng.random((B, 1, T, S)) < 0.8
  bias = 0.3 * rng.standard_normal((1, N, T, S))
  return q, k, v, mask, bias


@pytest.mark.parametrize("impl", ["xla", "xla_chunked"])
def test_softmax_matches_oracle_with_masks_gqa_cross_bias_cap(impl, blocks):
  """Cross-attention (T != S), GQA, a random mask, a bias, a soft cap, key lengths with a
  batch that sees no key (zeros, residual -inf), the residual, and a non-default scale
  (it multiplies the whole squared distance). Causal masks: the gradient test below."""
  q, k, v, mask, bias = case(0)
  lengths = np.array([7, 0])
  kw = dict(mask=mask, bias=bias, key_value_seq_lengths=lengths, logits_soft_cap=3.0,
            scale=0.7, return_residual=True, implementation=impl, **NSD)
  out, res = jax.jit(functools.partial(dpa, **kw))(q, k, v)
  z = logits_ref(q, k, scale=0.7, cap=3.0, bias=bias)
  w, lse = softmax_ref(z, visible_ref(2, 4, 5, 7, mask=mask, kv_lengths=lengths))
  np.testing.assert_allclose(out, apply_ref(w, v, 4), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(res), lse.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)
  assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(jnp.isneginf(res[1])))


def test_sigmoid_sees_the_query_norm_and_a_decay_adds_on():
  """Sigmoid (no normalisation: not shift-invariant) gets the distances themselves, so the
  -(s/2)|q|^2 row term must be there; a caller's decay_bias adds to the distance logits."""
  q, k, v, _, _ = case(1)
  cq = helpers.standard_normal(2, (2, 5, 4))
  ck = helpers.standard_normal(3, (2, 7, 4))
  f = jax.jit(functools.partial(dpa, normalizer="sigmoid", normalizer_params={"bias": 0.0},
                                implementation="xla", **NSD))
  out = f(q, k, v, decay_bias=(cq, ck))
  w = 1.0 / (1.0 + np.exp(-logits_ref(q, k, decay=(cq, ck))))
  np.testing.assert_allclose(out, apply_ref(w, v, 4), rtol=1e-4, atol=1e-5)
  # without the row term the weights would differ by far more than the tolerance
  w_no_row = 1.0 / (1.0 + np.exp(-(logits_ref(q, k) + 0.25 * np.sum(
      np.asarray(q, np.float64) ** 2, -1).transpose(0, 2, 1)[..., None])))
  assert np.max(np.abs(apply_ref(w_no_row, v, 4) - np.asarray(f(q, k, v)))) > 0.1


def grads_ref(q, k, v, ct, vis, s):
  """float64 cotangents of sum(ct * out) for softmax over -(s/2)||q - k||^2, from the
  chain rule: g_ij = w_ij (ct_i·v_j - sum_l w_il ct_i·v_l), dl_ij/dq_i = -s (q_i - k_j),
  dl_ij/dk_j = s (q_i - k_j); GQA sums the key and value cotangents over each group."""
  q, k, v, ct = (np.asarray(a, np.float64) for a in (q, k, v, ct))
  N, K = q.shape[2], k.shape[2]
  G = N // K
  w, _ = softmax_ref(logits_ref(q, k, scale=s), vis)
  qt = q.transpose(0, 2, 1, 3)  # [B, N, T, H]
  kg = np.repeat(k, G, axis=2).transpose(0, 2, 1, 3)  # [B, N, S, H]
  vg = np.repeat(v, G, axis=2).transpose(0, 2, 1, 3)
  cv = np.einsum("btnh,bnsh->bnts", ct, vg)
  g = w * (cv - np.sum(w * cv, -1, keepdims=True))
  diff = qt[:, :, :, None] - kg[:, :, None]  # [B, N, T, S, H]
  dq = -s * np.einsum("bnts,bntsh->btnh", g, diff)
  dk = s * np.einsum("bnts,bntsh->bsnh", g, diff)
  dv = np.einsum("bnts,btnh->bsnh", w, ct)
  B, S = k.shape[:2]
  dk = dk.reshape(B, S, K, G, -1).sum(3)
  dv = dv.reshape(B, S, K, G, -1).sum(3)
  return dq, dk, dv


def tangent_ref(q, k, v, dq, dk, dv, vis, s):
  """float64 jvp of the output: dl_ij = -s (q_i - k_j)·(dq_i - dk_j),
  dw_ij = w_ij (dl_ij - sum_l w_il dl_il), dout_i = sum_j dw_ij v_j + w_ij dv_j."""
  q, k, v, dq, dk, dv = (np.asarray(a, np.float64) for a in (q, k, v, dq, dk, dv))
  N, K = q.shape[2], k.shape[2]
  w, _ = softmax_ref(logits_ref(q, k, scale=s), vis)
  t = lambda x, G: np.repeat(x, G, axis=2).transpose(0, 2, 1, 3)
  diff = t(q, 1)[:, :, :, None] - t(k, N // K)[:, :, None]
  ddiff = t(dq, 1)[:, :, :, None] - t(dk, N // K)[:, :, None]
  dl = -s * np.sum(diff * ddiff, -1)
  dw = w * (dl - np.sum(w * dl, -1, keepdims=True))
  return apply_ref(dw, v, N) + apply_ref(w, dv, N)


@pytest.mark.parametrize("impl", ["xla", pytest.param("xla_chunked", marks=pytest.mark.slow)])
def test_gradients_and_jvp_against_the_oracle_float64(impl, blocks):
  """Under x64: the output is float64, and its cotangents (jax.grad) and, on xla, its jvp
  and the derivative in a traced scale match the chain rule written from ||q - k||^2 to
  1e-9 (float64 rounding of logits of size ~10 is ~1e-14); one batch row has no visible
  key (zero gradients). One jitted program per implementation."""
  with jax.enable_x64(True):
    q, k, v = make_qkv(4, 2, 5, S=6, N=4, K=2, H=3, dtype=jnp.float64)
    ct = jax.random.normal(jax.random.key(5), (2, 5, 4, 3), jnp.float64)
    tangents = tuple(jax.random.normal(jax.random.key(6 + i), a.shape, jnp.float64)
                     for i, a in enumerate((q, k, v)))
    lengths = np.array([6, 0])
    s = 1.0 / np.sqrt(3.0)
    vis = visible_ref(2, 4, 5, 6, causal=True, kv_lengths=lengths)
    f = functools.partial(dpa, is_causal=True, key_value_seq_lengths=lengths,
                          implementation=impl, **NSD)
    loss = lambda q, k, v, sc=None: jnp.sum(ct * f(q, k, v, scale=sc))

    def program(q, k, v):
      outs = (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
      if impl == "xla":  # forward mode and the scale (xla_chunked: reverse mode, documented)
        outs += (jax.jvp(f, (q, k, v), tangents)[1],
                 jax.grad(lambda sc: loss(q, k, v, sc))(jnp.float64(s)))
      return outs

    out, grads, *more = jax.jit(program)(q, k, v)
    assert out.dtype == jnp.float64
    w, _ = softmax_ref(logits_ref(q, k), vis)
    np.testing.assert_allclose(out, apply_ref(w, v, 4), rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, grads_ref(q, k, v, ct, vis, s), strict=True):
      assert np.max(np.abs(want)) > 1e-2  # not vacuous
      np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)
    assert bool(jnp.all(grads[0][1] == 0)) and bool(jnp.all(grads[1][1] == 0))
    if impl == "xla":
      tout, dscale = more
      np.testing.assert_allclose(tout, tangent_ref(q, k, v, *tangents, vis, s),
                                 rtol=1e-9, atol=1e-11)
      # d loss / d s = sum_ij g_ij l_ij / s (every logit is linear in s), g as in grads_ref
      qt = np.asarray(q).transpose(0, 2, 1, 3)
      kg = np.repeat(np.asarray(k), 2, axis=2).transpose(0, 2, 1, 3)
      vg = np.repeat(np.asarray(v), 2, axis=2).transpose(0, 2, 1, 3)
      cv = np.einsum("btnh,bnsh->bnts", np.asarray(ct), vg)
      g = w * (cv - np.sum(w * cv, -1, keepdims=True))
      d2 = np.sum((qt[:, :, :, None] - kg[:, :, None]) ** 2, -1)
      # AttentionCall keeps a traced scale in float32: its rounding (6e-8 relative) bounds
      # the agreement here, 1e-6 leaves a 10x margin for the sum's conditioning
      np.testing.assert_allclose(dscale, np.sum(g * -0.5 * d2), rtol=1e-6)


def test_bf16_computes_in_float32():
  """bf16 inputs whose norms are large (|q|, |k| ~ 20 around a common centre) and whose
  distances are small: in bf16 the norms (~400) would carry errors of ~1 (the bf16 ulp is 2
  there) and scramble the weights; in float32 the logits are exact to ~1e-4. The oracle is
  float64 on the bf16-rounded inputs; the output is bf16 (rounding 2^-9 relative, |out| < 4:
  atol 1e-2)."""
  q, k, v = make_qkv(7, 1, 6, S=8, N=2, K=1, H=4)
  centre = 10.0 * jnp.ones((1, 1, 1, 4))
  qb, kb, vb = ((x + c).astype(jnp.bfloat16) for x, c in ((q, centre), (k, centre), (v, 0.0)))
  out = jax.jit(functools.partial(dpa, implementation="xla", **NSD))(qb, kb, vb)
  assert out.dtype == jnp.bfloat16
  w, _ = softmax_ref(logits_ref(qb.astype(jnp.float32), kb.astype(jnp.float32)),
                     visible_ref(1, 2, 6, 8))
  np.testing.assert_allclose(np.asarray(out, np.float32), apply_ref(w, vb.astype(jnp.float32), 2),
                             atol=1e-2)


@pytest.mark.slow  # interpret mode: ~15 s each on a loaded CPU
@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_mosaic_tpu"])
def test_pallas_kernels_and_dispatch(impl, monkeypatch):
  """Each Pallas driver (interpret mode) gives the xla path's output and cotangents (the
  norms ride on its decay operands); the automatic order computes; cuDNN refuses (a decay)."""
  q, k, v = make_qkv(8, 2, 8, N=4, K=2, H=4)
  ct = jax.random.normal(jax.random.key(9), q.shape)
  kw = dict(is_causal=True, key_value_seq_lengths=np.array([8, 0]), **NSD)

  def run(impl):
    f = functools.partial(dpa, implementation=impl, **kw)
    return jax.jit(lambda q, k, v: jax.vjp(f, q, k, v))(q, k, v)

  xla_out, xla_vjp = run("xla")
  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")
  pl_out, pl_vjp = run(impl)
  np.testing.assert_allclose(pl_out, xla_out, rtol=1e-5, atol=1e-6)
  for a, b in zip(pl_vjp(ct), xla_vjp(ct), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dpa(q, k, v, **kw), xla_out, rtol=1e-5, atol=1e-6)
  with pytest.raises(NotImplementedError, match="cudnn"):  # a decay, or no CUDA GPU
    dpa(q, k, v, implementation="cudnn", **kw)


def test_bad_input():
  q, k, v = make_qkv(10, 1, 3, N=1, K=1, H=2)
  cq, ck = jnp.zeros((1, 3, 1)), jnp.zeros((1, 3, 1))
  check_raises(
      ("neg_sq_distance", lambda: dpa(q, k, v, score="sq_distance")),
      ("score", lambda: dpa(q, k, v, score=None)),
      ("decay_prune_threshold", lambda: dpa(q, k, v, decay_bias=(cq, ck),
                                            decay_prune_threshold=-5.0, **NSD)),
      ("head dimension", lambda: dpa(q, k[..., :1], v, **NSD)),
  )
