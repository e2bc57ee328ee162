"""Under ``JAX_ENABLE_X64`` a float64 layer computes in float64 (DESIGN numerics policy).

``rms_norm`` (the linear mixers' output norm, FoX Pro's QK and output norms) and
``MultiHeadAttention.log_forget_gates`` (the forgetting-attention decay) once computed in
float32 always, rounding a float64 model's values to ~1e-7; each is compared with a numpy
float64 oracle to 1e-12 (float64 rounding over a handful of operations is ~1e-15, float32
rounding 6e-8: the tolerance tells them apart by four orders).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsoft as js
from jaxsoft.nn._linear import rms_norm


def test_rms_norm_stays_float64_and_float32_for_float32():
  rng = np.random.default_rng(0)
  x, scale = rng.normal(size=(3, 2, 5)), rng.normal(size=(2, 5))   # a per-head [N, D] scale
  want = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * scale
  with jax.enable_x64(True):
    got = jax.jit(rms_norm)(jnp.asarray(x), jnp.asarray(scale))
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
    got32 = rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32))
    assert got32.dtype == jnp.float32
  bf = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(scale, jnp.float32))
  assert bf.dtype == jnp.bfloat16        # computed in float32, returned in the input's dtype
  np.testing.assert_allclose(np.asarray(bf, np.float64), want, rtol=2e-2, atol=2e-2)


def test_log_forget_gates_stay_float64():
  with jax.enable_x64(True):
    layer = js.nn.MultiHeadAttention(2, 4, forget_gate=True, forget_bias_init=0.3,
                                     param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 3, 4)))
    got = layer.log_forget_gates(x)
    w = np.asarray(layer.forget_kernel[...], np.float64)
    b = np.asarray(layer.forget_bias[...], np.float64)
    logits = np.asarray(x) @ w + b
    want = -np.log1p(np.exp(-logits))                       # log sigmoid
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
