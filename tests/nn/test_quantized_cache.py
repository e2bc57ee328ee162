"""MultiHeadAttention's PolyKV-quantised KV cache (K11): storage and decoding.

Oracles: the bytes of the cache against the format written out by hand (int8 q8_0 key
codes, float16 scales per 32 channels, 3-bit value codes packed 8 per 3 bytes, float32
rho); the 3-bit packing against a bit-by-bit numpy packer; the decoded outputs against the
full causal forward computed with ``dot_product_attention`` on the dequantised keys and
values (exact up to float32 rounding); a greedy decoder's logits against the float cache's
within PolyKV's documented bound (the logit error eps, weights moved by e^{2 eps} - 1,
values by their own error), propagated through the output projection and the readout
with absolute values; the Pallas path against the dense one, with a spy on the kernel.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsoft as js
from jaxsoft.nn import MultiHeadAttention
from jaxsoft.nn import _quantized_cache as qc
from kernels_pallas import _api as kernels_api
from kernels_pallas import polykv
from tests import helpers
from tests.helpers import sampled

D, N, K, V = 32, 2, 1, 12  # model width, query heads, KV heads (GQA), vocabulary
H = D // N


def _np_pack(codes):
  """Bit-by-bit 3-bit packer: code i of a group of 8 at bits 3i..3i+2, little endian."""
  codes = np.asarray(codes).reshape(-1)
  g = -(-codes.size // 8)
  bits = np.zeros(24 * g, np.uint8)
  for i, c in enumerate(codes):
    for b in range(3):
      bits[3 * i + b] = (int(c) >> b) & 1
  return np.array([sum(int(bits[8 * j + b]) << b for b in range(8)) for j in range(3 * g)],
                  np.uint8)


@pytest.mark.parametrize("n", sampled([8, 5, 19], ("8",)))
def test_pack_3bit_layout_and_roundtrip(n):
  codes = np.random.default_rng(n).integers(0, 8, (2, n)).astype(np.int8)
  packed = np.asarray(qc.pack_3bit(jnp.asarray(codes)))
  assert packed.dtype == np.uint8 and packed.shape == (2, 3 * -(-n // 8))
  for r in range(2):
    np.testing.assert_array_equal(packed[r], _np_pack(codes[r]))
  np.testing.assert_array_equal(np.asarray(qc.unpack_3bit(jnp.asarray(packed), n)), codes)


def test_cache_bytes_are_the_format():
  layer = MultiHeadAttention(N, D, num_kv_heads=K, rngs=nnx.Rngs(0))
  b, c = 3, 10
  layer.init_cache(b, c, quantization="polykv")
  # H = 16: keys padded to one 32-block: 32 int8 codes + one float16 scale; values: m = 16
  # rotated coordinates, 16 codes * 3 bits = 6 bytes; rho float32
  want = {"cached_key_codes": ((b, c, K, 32), np.int8),
          "cached_key_scales": ((b, c, K, 1), np.float16),
          "cached_value_codes": ((b, c, K, 6), np.uint8),
          "cached_value_rho": ((b, c, K), np.float32)}
  total = 0
  for name, (shape, dtype) in want.items():
    x = np.asarray(getattr(layer, name)[...])
    assert x.shape == shape and x.dtype == dtype, name
    total += x.nbytes
  assert total == b * c * K * (32 + 2 + 6 + 4) == b * c * K * qc.polykv_cache_bytes(H)
  assert not hasattr(layer, "cached_key") and not hasattr(layer, "cached_value")
  assert qc.polykv_cache_bytes(64) == 64 + 4 + 24 + 4  # head dim 64: 96 bytes, fp16: 256
  layer.init_cache(b, c)  # a reset back to the float cache
  assert layer.cached_key[...].shape == (b, c, K, H) and not hasattr(layer, "cached_key_codes")
  with pytest.raises(ValueError, match="quantization"):
    layer.init_cache(b, c, quantization="int4")


def _decode(layer, x, prefill, quantization):
  layer.init_cache(x.shape[0], x.shape[1], quantization=quantization)
  step = nnx.jit(lambda m, xt: m(xt, decode=True))
  outs = [layer(x[:, :prefill], decode=True)]
  outs += [step(layer, x[:, t:t + 1]) for t in range(prefill, x.shape[1])]
  return jnp.concatenate(outs, axis=1)


def _bound(layer, x):
  """PolyKV's bound on each head's attention output, per (batch, position, head), for
  self-attention over the prefix, from the layer's own projections (float64)."""
  q, k, v = (np.asarray(f(x), np.float64) for f in (layer.query, layer.key, layer.value))
  k_hat, v_hat = (np.asarray(a, np.float64) for a in polykv.polykv_dequantize(
      polykv.polykv_quantize(layer.key(x), layer.value(x))))
  kq = np.repeat(np.abs(k - k_hat), N // K, axis=2)  # [B, T, N, H]
  vinf = np.repeat(np.max(np.abs(v), -1), N // K, axis=2)  # [B, T, N]
  verr = np.repeat(np.linalg.norm(v - v_hat, axis=-1), N // K, axis=2)
  err = np.einsum("btnh,bsnh->btsn", np.abs(q), kq) / math.sqrt(H)  # [B, T, S, N]
  T = x.shape[1]
  causal = np.tril(np.ones((T, T), bool))[None, :, :, None]
  eps = np.max(np.where(causal, err, 0.0), axis=2)
  vinf_p = np.maximum.accumulate(vinf, axis=1)
  verr_p = np.maximum.accumulate(verr, axis=1)
  return np.expm1(2 * eps) * vinf_p + verr_p  # [B, T, N]


@pytest.mark.slow  # eager float and quantised decodes, a jitted step (~14 s of CPU)
def test_greedy_decode_logits_within_polykv_bound():
  emb = np.asarray(helpers.standard_normal(2, (V, D)))
  layer = MultiHeadAttention(N, D, num_kv_heads=K, rngs=nnx.Rngs(3))
  prompt = np.array([[1, 5, 2], [7, 0, 3]])
  steps = 3
  # greedy decoding with the float cache; the quantised one is fed the same tokens
  layer.init_cache(2, prompt.shape[1] + steps)
  toks, logits = prompt, []
  h = layer(jnp.asarray(emb[prompt]), decode=True)[:, -1]
  for _ in range(steps):
    lg = np.asarray(h) @ emb.T
    logits.append(lg)
    nxt = np.argmax(lg, -1)[:, None]
    toks = np.concatenate([toks, nxt], 1)
    h = layer(jnp.asarray(emb[nxt]), decode=True)[:, -1]
  x = jnp.asarray(emb[toks[:, :-1]])
  y_q = _decode(layer, x, prompt.shape[1], "polykv")
  # the quantised decode is attention on the dequantised cache (float32 rounding)
  k_hat, v_hat = polykv.polykv_dequantize(polykv.polykv_quantize(layer.key(x), layer.value(x)))
  y = js.attention.dot_product_attention(layer.query(x), k_hat, v_hat, is_causal=True)
  np.testing.assert_allclose(y_q, layer.out(y), rtol=1e-5, atol=2e-5)
  assert int(layer.cache_index[...]) == x.shape[1]
  logits_q = np.asarray(y_q)[:, prompt.shape[1] - 1:] @ emb.T  # the same steps' logits
  logits_f = np.stack(logits, 1)
  # |d out_d| <= sum_{n,h} |W_out[n, h, d]| delta_n; |d logit_v| <= sum_d |E_vd| |d out_d|
  delta = _bound(layer, x)[:, prompt.shape[1] - 1:]  # [B, steps, N]
  w = np.abs(np.asarray(layer.out.kernel[...], np.float64))  # [N, H, D]
  dout = np.einsum("btn,nhd->btd", delta, w)
  bound = dout @ np.abs(emb).T
  diff = np.abs(logits_q - logits_f)
  assert np.all(diff <= bound * (1 + 1e-4) + 1e-4)
  assert diff.max() > 1e-4  # the quantisation is really in the path
  # greedy choices agree wherever the float margin exceeds twice the bound
  top2 = np.sort(logits_f, -1)[..., -2:]
  sure = top2[..., 1] - top2[..., 0] > 2 * bound.max(-1)
  np.testing.assert_array_equal(np.argmax(logits_q, -1)[sure], np.argmax(logits_f, -1)[sure])


@pytest.mark.slow  # the Pallas interpreter
def test_pallas_steps_run_the_polykv_kernel(monkeypatch):
  monkeypatch.setenv(kernels_api.INTERPRET_ENV, "1")
  calls = []
  real = polykv.polykv_decode_attention

  def spy(*args, **kwargs):
    calls.append(args[1])
    return real(*args, **kwargs)

  monkeypatch.setattr(polykv, "polykv_decode_attention", spy)
  x = helpers.standard_normal(4, (2, 5, D))
  pallas = MultiHeadAttention(N, D, num_kv_heads=K, rngs=nnx.Rngs(5), implementation="pallas")
  xla = MultiHeadAttention(N, D, num_kv_heads=K, rngs=nnx.Rngs(5), implementation="xla")
  got, want = _decode(pallas, x, 3, "polykv"), _decode(xla, x, 3, "polykv")
  assert calls and all(isinstance(c, polykv.PolyKVCache) for c in calls)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
