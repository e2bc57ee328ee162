"""A20 ``nn.PolarMemoryAttention``: ATMA's combination of the Polar attention channels and
the gated-delta memory, checked against a float64 NumPy composition of its own channels
and weights (the channels themselves are tested in tests/attention/test_polar_sink.py);
the zero-initialised memory projection, causality, gradients and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft import nn as jnn
from tests import helpers
from tests.helpers import check_raises

D, N, H, T = 6, 2, 3, 5


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def _compose(layer, c, mu, mem):
  """float64: W_o (c * sigmoid(W_gate c + b)) + W_mu mu (+ W_mem mem)."""
  f = lambda a: np.asarray(a, np.float64)  # noqa: E731
  B = c.shape[0]
  cf = f(c).reshape(B, T, -1)
  gate = _sigmoid(cf @ f(layer.w_gate.kernel[...]) + f(layer.w_gate.bias[...]))
  y = (cf * gate) @ f(layer.w_o.kernel[...]) + f(mu) @ f(layer.w_mu.kernel[...])
  if mem is not None:
    y = y + f(mem).reshape(B, T, -1) @ f(layer.w_mem.kernel[...])
  return y


@nnx.jit
def _run(layer, x):
  return layer(x), layer.channels(x)


@pytest.mark.slow  # the layer's forward runs in the default suite as its doctest
def test_combination_and_zero_memory_at_init():
  layer = jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(0))
  x = helpers.standard_normal(1, (2, T, D))
  y, (c, mu, mem) = _run(layer, x)
  assert y.shape == (2, T, D) and c.shape == (2, T, N, H) and mem.shape == (2, T, N, H)
  # W_mem = 0 at init: the attention channels alone (float32 products of width 6: 1e-5)
  np.testing.assert_allclose(y, _compose(layer, c, mu, None), rtol=1e-5, atol=1e-5)
  # with a trained (nonzero) W_mem the memory channel is added
  layer.w_mem.kernel[...] = helpers.standard_normal(2, (N * H, D))
  y, (c, mu, mem) = _run(layer, x)
  assert np.abs(np.asarray(mem)).max() > 0.1
  np.testing.assert_allclose(y, _compose(layer, c, mu, mem), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_causal():
  layer = jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(0))
  layer.w_mem.kernel[...] = helpers.standard_normal(2, (N * H, D))
  x = helpers.standard_normal(1, (2, T, D))
  y, _ = _run(layer, x)
  y2, _ = _run(layer, x.at[:, 3].add(5.0))  # a change at step 3
  np.testing.assert_array_equal(np.asarray(y2)[:, :3], np.asarray(y)[:, :3])
  assert not np.allclose(np.asarray(y2)[:, 3:], np.asarray(y)[:, 3:])


@pytest.mark.slow
def test_gradients_reach_every_parameter():
  layer = jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(3))
  x = helpers.standard_normal(4, (1, T, D))
  grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(layer, x)
  leaves = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
  assert leaves
  for path, g in leaves:
    assert np.all(np.isfinite(np.asarray(g))), path
  # the zero-initialised W_mem learns (its gradient is mem ⊗ dy), the per-head sink
  # parameters and the memory's projections get a gradient through it later
  assert np.abs(np.asarray(grads.w_mem.kernel[...])).max() > 0
  assert np.abs(np.asarray(grads.null_bias[...])).max() > 0


def test_bad_input():
  check_raises(
      ("num_heads", lambda: jnn.PolarMemoryAttention(D, 0, H, rngs=nnx.Rngs(0))),
      ("null_bias", lambda: jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(0),
                                                     null_bias=1.0)),
      ("use_memory", lambda: jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(0),
                                                      use_memory=1)),
  )
  layer = jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(0), use_memory=False)
  with pytest.raises(ValueError, match=r"\[B, T, D\]"):
    layer(jnp.ones((T, D)))


@pytest.mark.slow
def test_key_value_lengths_equal_the_truncated_sequence():
  """Without causality, keys past ``key_value_seq_lengths`` are invisible: the first L rows
  equal the layer on the first L positions alone (the memory is causal either way)."""
  layer = jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(0), is_causal=False)
  layer.w_mem.kernel[...] = helpers.standard_normal(2, (N * H, D))
  x = helpers.standard_normal(1, (2, T, D))
  lengths = jnp.array([3, T])
  y = nnx.jit(lambda m, x: m(x, key_value_seq_lengths=lengths))(layer, x)
  short = nnx.jit(lambda m, x: m(x))(layer, x[:1, :3])
  np.testing.assert_allclose(np.asarray(y)[:1, :3], np.asarray(short), rtol=1e-5, atol=1e-6)
  full = nnx.jit(lambda m, x: m(x))(layer, x)
  np.testing.assert_allclose(np.asarray(y)[1:], np.asarray(full)[1:], rtol=1e-5, atol=1e-6)
  # the hidden keys did matter for batch 0 with every key visible
  assert not np.allclose(np.asarray(full)[0, :3], np.asarray(short)[0], atol=1e-4)


@pytest.mark.slow
def test_bf16_output_and_channels():
  """bf16 parameters and input: the output is bf16 and equals, within bf16 rounding, the
  float64 composition of its own channels and weights; the attention channels (computed in
  float32 inside) equal the float32 layer's on the same rounded values. (The memory channel
  is RMS-normalised over H = 3 values: at this size it is ill-conditioned in its inputs, so
  the float32 layer's memory, on projections that differ by one bf16 rounding, is no
  reference for it.)"""
  l16 = jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
  l16.w_mem.kernel[...] = helpers.standard_normal(2, (N * H, D)).astype(jnp.bfloat16)
  l32 = jnn.PolarMemoryAttention(D, N, H, rngs=nnx.Rngs(0))
  nnx.update(l32, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(l16, nnx.Param)))
  x16 = helpers.standard_normal(1, (2, T, D)).astype(jnp.bfloat16)
  y16, (c16, mu16, mem16) = _run(l16, x16)
  _, (c32, mu32, _) = _run(l32, x16.astype(jnp.float32))
  assert y16.dtype == jnp.bfloat16 and mem16.dtype == jnp.bfloat16
  y = np.asarray(y16, np.float32)
  assert np.all(np.isfinite(y))
  u = 2.0 ** -8  # bf16's unit roundoff; a handful of roundings on each path
  ref = _compose(l16, c16, mu16, mem16)
  np.testing.assert_allclose(y, ref, atol=8 * u * np.abs(ref).max())
  for a, b in ((c16, c32), (mu16, mu32)):
    b = np.asarray(b, np.float32)
    np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=8 * u * np.abs(b).max())
