"""A18 inverse-distance attention: ``dot_product_attention(score="distance",
normalizer="idw_softmax")`` on "xla" and "xla_chunked" against a float64 NumPy reference
``softmax(-p log ||q_i - k_j||) @ v``; gradients, masks, GQA, the IDW properties (scale
invariance, interpolation), bf16, extreme inputs and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from tests.helpers import check_raises, make_qkv

IMPLS = ["xla", "xla_chunked"]
IDW = dict(score="distance", normalizer="idw_softmax")


@pytest.fixture
def blocks(monkeypatch):
  """Small blocks: the short sequences below span several (padded) blocks."""
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)


def reference(q, k, v, *, power=1.0, eps=1e-12, is_causal=False, kv_lengths=None):
  """float64 NumPy: w_ij ∝ (||q_i - k_j||^2 + eps)^(-p/2) over the visible keys."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  out = np.zeros((B, T, N, v.shape[-1]))
  for b in range(B):
    for n in range(N):
      kh = n // (N // K)
      d2 = np.sum((q[b, :, n, None, :] - k[b, None, :, kh, :]) ** 2, axis=-1)  # [T, S]
      vis = np.ones((T, S), bool)
      if is_causal:
        vis &= np.arange(S)[None, :] <= np.arange(T)[:, None]
      if kv_lengths is not None:
        vis &= np.arange(S)[None, :] < kv_lengths[b]
      z = np.where(vis, -0.5 * power * np.log(d2 + eps), -np.inf)
      m = np.max(z, axis=-1, keepdims=True)
      e = np.where(vis, np.exp(z - np.where(np.isfinite(m), m, 0.0)), 0.0)
      w = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
      out[b, :, n] = w @ v[b, :, kh]
  return out


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference_causal_lengths_gqa(impl, blocks):
  q, k, v = make_qkv(0, 2, 9, S=9, N=4, K=2, H=3)
  lengths = np.array([9, 6])
  out = jax.jit(functools.partial(  # jitted: one program instead of op-by-op dispatch
      dpa, is_causal=True, key_value_seq_lengths=lengths, implementation=impl,
      normalizer_params={"power": 2.0}, **IDW))(q, k, v)
  ref = reference(q, k, v, power=2.0, is_causal=True, kv_lengths=lengths)
  np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5)


def test_gradients_float64(blocks):
  """xla: against finite differences; xla_chunked's recomputing backward (through the
  distance and a soft cap, causal, lengths, GQA) against xla's autodiff."""
  with jax.enable_x64(True):
    q, k, v = make_qkv(1, 1, 6, S=7, N=2, K=1, H=3, dtype=jnp.float64)
    f = jax.jit(functools.partial(dpa, is_causal=True, implementation="xla", **IDW))
    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-5, rtol=1e-5)
    q, k, v = make_qkv(2, 2, 6, S=7, N=4, K=2, H=3, dtype=jnp.float64)
    kw = dict(is_causal=True, logits_soft_cap=2.0, key_value_seq_lengths=np.array([7, 5]), **IDW)
    ct = jax.random.normal(jax.random.PRNGKey(3), q.shape[:3] + v.shape[-1:], jnp.float64)
    ga, gb = (jax.jit(lambda q, k, v, impl=impl: jax.vjp(
        functools.partial(dpa, implementation=impl, **kw), q, k, v)[1](ct))(q, k, v)
        for impl in IMPLS)
    for a, b in zip(ga, gb, strict=True):
      assert float(jnp.max(jnp.abs(a))) > 1e-3  # the comparison is not vacuous
      np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("impl", IMPLS)
def test_idw_properties(impl, blocks):
  """Scale invariance, interpolation (q = k_j gives w_j -> 1) and a finite gradient at
  d = 0; one-hot values make the output the weights."""
  _, k, _ = make_qkv(3, 1, 1, S=6, N=1, K=1, H=4)
  v = jnp.eye(6).reshape(1, 6, 1, 6)
  f = jax.jit(functools.partial(dpa, implementation=impl, **IDW))
  q = 0.3 * k[:, 1:2] + 0.2
  w = f(q, k, v)
  np.testing.assert_allclose(f(3.7 * q, 3.7 * k, v), w, rtol=1e-4, atol=1e-5)
  assert not np.allclose(f(q, 3.7 * k, v), w, atol=1e-3)
  j = 4
  q = k[:, j:j + 1]  # q = k_j exactly: d_ij = 0
  assert float(f(q, k, v)[0, 0, 0, j]) > 0.999
  g = jax.jit(jax.grad(lambda q, k: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1)))(q, k)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)


def test_default_dispatch_pallas_computes_and_cudnn_refuses(monkeypatch):
  """The automatic order and the Pallas kernels (interpret mode; see
  tests/kernels_pallas/test_distance.py) give the float64 reference; cuDNN
  computes dot products only."""
  q, k, v = make_qkv(4, 1, 5, N=2, K=1, H=4)
  out = dpa(q, k, v, **IDW)
  np.testing.assert_allclose(out, reference(q, k, v), rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(
      dpa(q, k, v, implementation=["cudnn", "xla"], **IDW), out, rtol=1e-6)
  with pytest.raises(NotImplementedError, match="score"):
    dpa(q, k, v, implementation="cudnn", **IDW)
  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")
  np.testing.assert_allclose(dpa(q, k, v, implementation="pallas", **IDW), out, rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", pytest.param("xla_chunked", marks=pytest.mark.slow)])
def test_bf16_and_extreme_inputs(impl, blocks):
  q, k, v = make_qkv(5, 1, 6, N=2, K=1, H=4)
  out = jax.jit(functools.partial(dpa, implementation=impl, **IDW))(
      q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), reference(q, k, v), atol=5e-2)
  fg = jax.jit(jax.value_and_grad(
      lambda a, b: jnp.sum(dpa(a, b, v, implementation=impl, **IDW)), argnums=(0, 1)))
  # tiny and huge distances, and all-equal queries and keys (every d = 0)
  for qq, kk in ((1e-20 * q, 1e-20 * k), (1e18 * q, 1e18 * k), (jnp.ones_like(q), jnp.ones_like(k))):
    out, g = fg(qq, kk)
    assert bool(jnp.isfinite(out)) and all(bool(jnp.all(jnp.isfinite(x))) for x in g)


def test_dot_score_unchanged():
  q, k, v = make_qkv(6, 1, 5, N=2, K=1, H=4)
  np.testing.assert_allclose(dpa(q, k, v, score="dot"), jax.nn.dot_product_attention(q, k, v),
                             rtol=1e-5, atol=1e-6)


def test_bad_input():
  q, k, v = make_qkv(7, 1, 3, N=1, K=1, H=2)
  check_raises(
      ("score", lambda: dpa(q, k, v, score="cosine")),
      ("score", lambda: dpa(q, k, v, score=None)),
      ("scale", lambda: dpa(q, k, v, score="distance", scale=1.0)),
  )


@pytest.mark.parametrize("impl", ["xla", "xla_chunked"])
def test_fully_masked_rows_are_zero_with_zero_gradient(impl, blocks):
  """A batch with no visible key (length 0): zeros and zero, finite gradients, no NaN."""
  q, k, v = make_qkv(31, B=2, T=9, N=2, K=1, H=4)
  lengths = np.array([9, 0])

  def f(q, k, v):
    return dpa(q, k, v, key_value_seq_lengths=lengths, implementation=impl, **IDW)

  def loss(*a):
    out = f(*a)
    return jnp.sum(out ** 2), out

  # the output and the gradients in one jitted program (the lengths stay concrete constants)
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(jnp.isfinite(out)))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  assert bool(jnp.all(grads[0][1] == 0)) and bool(jnp.all(grads[1][1] == 0))
