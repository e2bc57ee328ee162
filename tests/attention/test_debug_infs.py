"""Dense attention under ``jax.debug_infs`` / ``jax.debug_nans`` (issue 37, defect 3).

JAX's own ``testDotProductAttentionFloat64MaskDebugInfs`` (tests/nn_test.py) runs
``jax.nn.dot_product_attention`` with a mask under ``jax.debug_infs``; jaxsoft's dense path
raised ``FloatingPointError`` there with any mask or ``is_causal`` (the masked logits'
sentinels). On finite inputs, with every kind of mask, forward and gradient, neither flag
may trip, and the values are those of the unchecked call.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import sampled

B, T, N, H = 2, 6, 2, 4


def _inputs(dtype):
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(kk, (B, T, N, H), dtype) for kk in ks[:3])
  ct = jax.random.normal(ks[3], (B, T, N, H), dtype)
  return q, k, v, ct


_MASKS = {
    "causal": dict(is_causal=True),
    "mask": dict(mask=jnp.tril(jnp.ones((T, T), bool), -1)),  # query 0 sees no key
    "lengths": dict(key_value_seq_lengths=jnp.array([4, 6], jnp.int32),
                    query_seq_lengths=jnp.array([6, 3], jnp.int32)),
    "segments": dict(segment_ids=jnp.array([[0, 0, 1, 1, 1, 2]] * B, jnp.int32),
                     local_window_size=(1, 0)),
}
# every kind at once (the default run): one compilation per normalizer
_MASKS["all"] = {k: v for kind in ("mask", "lengths", "segments") for k, v in _MASKS[kind].items()}
_MASKS["all"]["is_causal"] = True


def _value_and_grads(q, k, v, ct, normalizer, masks):
  def f(q, k, v):
    return js.attention.dot_product_attention(q, k, v, implementation="xla",
                                              normalizer=normalizer, **masks)
  out, vjp = jax.vjp(f, q, k, v)
  return (out, *vjp(ct))


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
@pytest.mark.parametrize("kind", sampled(list(_MASKS), ("all",)))
def test_dense_attention_passes_debug_infs_and_nans(kind, normalizer):
  q, k, v, ct = _inputs(jnp.float32)
  masks = _MASKS[kind]
  want = jax.jit(lambda *a: _value_and_grads(*a, normalizer, masks))(q, k, v, ct)
  with jax.debug_infs(True), jax.debug_nans(True):
    got = _value_and_grads(q, k, v, ct, normalizer, masks)
  for a, b in zip(got, want, strict=True):  # a few float32 ulps: both jitted, fused apart
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_float64_mask_debug_infs_as_jax_nn():
  # JAX's testDotProductAttentionFloat64MaskDebugInfs, with jaxsoft's attention, against a
  # numpy float64 softmax attention (jax.nn's own result is 2e-7 off it on CPU)
  with jax.enable_x64(True):
    q = jax.random.normal(jax.random.key(1), (1, 8, 2, 4), jnp.float64)
    mask = np.tril(np.ones((8, 8), bool))
    with jax.debug_infs(True):
      got = js.attention.dot_product_attention(q, q, q, mask=jnp.asarray(mask))
      causal = js.attention.dot_product_attention(q, q, q, is_causal=True)
    assert got.dtype == jnp.float64
  qn = np.asarray(q)
  logits = np.where(mask, np.einsum("btnh,bsnh->bnts", qn, qn) / 2.0, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("bnts,bsnh->btnh", w / w.sum(-1, keepdims=True), qn)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(np.asarray(causal), want, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------ the blockwise paths

# xla_chunked with 4 x 4 blocks (T = 6: two query and two key blocks, with padding) and the
# Pallas kernels in interpret mode: finite inputs, masked entries and a fully masked row
# (query 0 of the "mask" kind, and the rows past query_seq_lengths), forward and backward.
_BLOCKWISE = [pytest.param(impl, norm, kind, id=f"{impl}-{norm}-{kind}",
                           marks=() if (impl, norm, kind) in {
                               ("xla_chunked", "softmax", "mask")} else pytest.mark.slow)
              for impl in ("xla_chunked", "pallas")
              for norm in ("softmax", "sparsemax", "sigmoid", "standardized_softmax")
              for kind in _MASKS]


@pytest.mark.parametrize("impl,normalizer,kind", _BLOCKWISE)
def test_blockwise_attention_passes_debug_infs_and_nans(impl, normalizer, kind, monkeypatch):
  from jaxsoft.attention import _chunked
  from kernels_pallas.backends import INTERPRET_ENV
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)
  monkeypatch.setenv(INTERPRET_ENV, "1")
  q, k, v, ct = _inputs(jnp.float32)
  masks = _MASKS[kind]

  def value_and_grads(q, k, v, ct):
    def f(q, k, v):
      return js.attention.dot_product_attention(q, k, v, implementation=impl,
                                                normalizer=normalizer, **masks)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(ct))

  want = jax.jit(value_and_grads)(q, k, v, ct)
  with jax.debug_infs(True), jax.debug_nans(True):
    got = value_and_grads(q, k, v, ct)
  ref = jax.jit(lambda *a: _value_and_grads(*a, normalizer, masks))(q, k, v, ct)  # dense
  for a, b, r in zip(got, want, ref, strict=True):
    # both jitted, fused apart: a few float32 ulps; the dense path: blockwise order, 1e-5
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-5)
