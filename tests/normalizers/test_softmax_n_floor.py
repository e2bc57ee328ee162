"""softmax_n's stabiliser floor is log n (none for n = 0) in all three implementations.

A fixed floor of 0 made ``n = 0`` ("n = 0 is softmax") return zeros for rows below about
-88 and NaN gradients from about -44: the dense function, the chunked XLA path and the
Pallas engine share the floor through the tile rule, and all three must agree with a
float64 closed form, ``e^{s_j} / (n + sum_k e^{s_k})``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
import kernels_pallas as kp

H = 8
T, S = 16, 128


def _inputs(level):
  """Scores ``q·k`` = level + noise in [-1, 1], over two key blocks of 64."""
  rng = np.random.default_rng(0)
  q = np.zeros((1, T, 1, H), np.float32)
  q[..., 0] = 1.0
  q[..., 1] = rng.uniform(-1, 1, (1, T, 1))
  k = np.zeros((1, S, 1, H), np.float32)
  k[..., 0] = level
  k[..., 1] = rng.uniform(-1, 1, (1, S, 1))
  v = rng.normal(size=(1, S, 1, H)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _reference(q, k, v, n):
  s = np.einsum("bthd,bshd->bhts", np.float64(q), np.float64(k))
  m = s.max(-1, keepdims=True)
  w = np.exp(s - m) / (n * np.exp(-m) + np.exp(s - m).sum(-1, keepdims=True))
  return np.einsum("bhts,bshd->bthd", w, np.float64(v))


def _paths(n):
  params = {"n": n}
  return {
      "xla": lambda q, k, v: js.attention.dot_product_attention(
          q, k, v, normalizer="softmax_n", normalizer_params=params, scale=1.0,
          implementation="xla"),
      "xla_chunked": lambda q, k, v: js.attention.dot_product_attention(
          q, k, v, normalizer="softmax_n", normalizer_params=params, scale=1.0,
          implementation="xla_chunked"),
      "pallas": lambda q, k, v: kp.attention(
          q, k, v, normalizer="softmax_n", normalizer_params=params, scale=1.0,
          interpret=True, backend="triton", block_sizes={"block_q": 16, "block_k": 64}),
  }


def test_dense_softmax_n_zero_is_softmax_below_float_range():
  x = jnp.array([-100.0, -101.0, -102.0])
  np.testing.assert_allclose(js.normalizers.softmax_n(x, n=0.0), jax.nn.softmax(x), rtol=1e-6)
  for level in (-50.0, -70.0, -100.0):  # NaN gradients used to start near -44
    g = jax.grad(lambda v, lv=level: js.normalizers.softmax_n(v + lv, n=0.0)[0])(x + 100.0)
    want = jax.grad(lambda v, lv=level: jax.nn.softmax(v + lv)[0])(x + 100.0)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
  # the gradient in n at n = 0 is finite (saturated beyond the float range)
  dn = jax.grad(lambda n: js.normalizers.softmax_n(x, n=n).sum())(0.0)
  assert np.isfinite(dn)


def test_rule_floor_is_log_n():
  rule = js.normalizers.get("softmax_n").tile
  length = jnp.ones((1, 1))
  assert float(rule.floor_value(length, {"n": 0.0})) == -np.inf
  np.testing.assert_allclose(rule.floor_value(length, {"n": 3.0}), np.log(3.0), rtol=1e-6)


@pytest.mark.parametrize("n,level", [(0.0, -100.0), (0.0, -60.0), (1.0, -60.0), (3.0, 2.0)])
def test_softmax_n_three_paths_agree_with_float64(n, level):
  q, k, v = _inputs(level)
  want = _reference(q, k, v, n)
  ct = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  grads = {}
  for name, fn in _paths(n).items():
    out, vjp = jax.vjp(jax.jit(fn), q, k, v)  # one program per path rather than op by op
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=1e-6, err_msg=name)
    grads[name] = vjp(ct)
    for g in grads[name]:
      assert bool(jnp.isfinite(g).all()), name
  for name in ("xla_chunked", "pallas"):
    for a, b in zip(grads[name], grads["xla"], strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6 * max(abs(level), 10.0), err_msg=name)
