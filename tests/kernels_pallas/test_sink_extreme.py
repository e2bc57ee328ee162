"""softmax_sink with a sink logit far above every score (s = 1e4, scores near -1e4 and
near 1e4) in every implementation: the sink is folded into the stabiliser
(``m >= s``, the tile rule's ``m_floor``), so ``e^{s - m}`` cannot overflow, nothing is
NaN, and the row's log-normaliser (``return_residual``) is s, not inf.

The logits are exact in float32 (q = [100, 1, 0...], k = [+-100, r, 0...] with r a
multiple of 1/2), so every implementation sees the same scores."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import attention
from kernels_pallas import _api
from tests import helpers
from tests.kernels_pallas.test_engine import TRITON_SMALL, reference, value_and_cotangents

T, N, H = 40, 2, 16
SINKS = jnp.asarray([1e4 + 1.0, 1e4 - 2.0]).reshape(N, 1, 1)


def _inputs():
  r = (np.arange(T) % 8) * 0.5 - 3.0
  far = np.arange(T) < 20  # keys 0..19 score -1e4 + r, the others 1e4 + r
  q = jnp.zeros((1, T, N, H)).at[..., 0].set(100.0).at[..., 1].set(1.0)
  k = jnp.zeros((1, T, 1, H)).at[0, :, 0, 0].set(np.where(far, -100.0, 100.0))
  k = k.at[0, :, 0, 1].set(r)
  v = helpers.standard_normal(0, (1, T, 1, H))
  ct = helpers.standard_normal(1, (1, T, N, H))
  return q, k, v, ct


def _call(impl, **kw):
  def f(q, k, v, s):
    return attention.dot_product_attention(
        q, k, v, normalizer="softmax_sink", normalizer_params={"sink_logit": s}, scale=1.0,
        is_causal=True, implementation=impl, **kw)
  return f


def _kernel(backend):
  blocks = TRITON_SMALL if backend == "triton" else dict(block_q=16, block_k=128)
  return lambda q, k, v, s: _api.attention(
      q, k, v, normalizer="softmax_sink", normalizer_params={"sink_logit": s}, scale=1.0,
      is_causal=True, backend=backend, interpret=True, block_sizes=blocks)


@pytest.mark.parametrize("impl", ["xla", "xla_chunked", "triton", "mosaic_tpu"])
def test_sink_far_above_the_scores(impl):
  q, k, v, ct = _inputs()
  f = _kernel(impl) if impl in ("triton", "mosaic_tpu") else _call(impl)
  out, grads = jax.jit(lambda *a: value_and_cotangents(f, a, ct))(q, k, v, SINKS)
  ref_out, ref_grads = jax.jit(lambda *a: value_and_cotangents(  # one compilation
      lambda q, k, v, s: reference(q, k, v, sinks=s, scale=1.0, is_causal=True), a, ct))(
          q, k, v, SINKS)
  for x in jax.tree.leaves((out, grads)):
    assert bool(jnp.all(jnp.isfinite(x)))
  # rows 0..19 see only keys near -1e4: everything goes to the sink
  assert bool(jnp.all(out[:, :20] == 0))
  assert float(jnp.max(jnp.abs(out[:, 20:]))) > 0.1  # the others attend
  chex.assert_trees_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
  for g, r in zip(grads, ref_grads, strict=True):
    sc = max(1.0, float(jnp.max(jnp.abs(r))))
    chex.assert_trees_all_close(g, r, atol=1e-4 * sc, rtol=1e-4)


def test_log_normaliser_is_the_sink_not_inf(monkeypatch):
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")
  q, k, v, _ = _inputs()
  for impl in ("xla", "xla_chunked", "pallas_triton", "pallas_mosaic_tpu"):
    _, res = jax.jit(_call(impl, return_residual=True))(q, k, v, SINKS)
    # rows that see only scores near -1e4: log(e^s + sum e^x) = s to float32 precision
    chex.assert_trees_all_close(res[0, :20], jnp.broadcast_to(SINKS[:, 0, 0], (20, N)))
