"""A22 uniattn and uniattn_shared_map (jaxsoft/attention/_uniattn.py).

The jaxsoft.nn module that holds the compensation is tested in tests/nn/test_uniattn.py.

Oracles: exact reductions (UniAttn with the first block's own queries and keys is
attention), a masked softmax map and the compensation in numpy float64, and float64 finite
differences.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention import dot_product_attention, uniattn, uniattn_shared_map
from tests.attention.reference import (
    assert_masked_row_is_zero,
    f64,
    np_apply,
    np_softmax_map,
    np_visible,
    rand_mask,
)
from tests.helpers import check_raises, make_qkv, normal

B, T, N, K, H, HV = 2, 5, 4, 2, 3, 2


def test_uniattn_with_the_blocks_own_map_is_exact_attention():
  q, k, _ = make_qkv(0, B=B, T=T, N=N, K=K, H=H)
  values = normal(1, (3, B, T, K, HV))
  mask = rand_mask(2, B, T, T)
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([5, 3]))
  a = jax.jit(functools.partial(uniattn_shared_map, **kw))(q, k, None, mask)
  # rows are stochastic where a key is visible
  np.testing.assert_allclose(np.asarray(jnp.sum(a, -1)), 1.0, atol=1e-6)
  x = normal(3, (3, B, T, 6))
  w0 = jnp.zeros((3, 6, N, HV))
  out = jax.jit(uniattn)(a, values, x, w0)
  dpa = jax.jit(functools.partial(dot_product_attention, **kw))
  for layer in range(3):
    want = dpa(q, k, values[layer], None, mask)
    np.testing.assert_allclose(np.asarray(out[layer]), np.asarray(want), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(a, np.float64), np_softmax_map(
      q, k, np_visible(mask, True, B, N, T, T) & (np.arange(T) < np.array([5, 3])[:, None])[
          :, None, None, :]), atol=1e-6)
  single = jax.jit(uniattn)(a, values[1])
  np.testing.assert_allclose(np.asarray(single), np.asarray(out[1]), atol=1e-6)


def test_uniattn_compensation_matches_numpy_bf16_and_grads():
  a = jax.nn.softmax(normal(0, (B, N, T, 4)), -1)
  values = normal(1, (2, B, 4, K, HV))
  x = normal(2, (2, B, T, 3))
  w_c = normal(3, (2, 3, N, HV))
  out = jax.jit(uniattn)(a, values, x, w_c)
  want = np.stack([np_apply(np.asarray(a, np.float64), values[i])
                   + np.einsum("btc,cnh->btnh", *f64(x[i], w_c[i])) for i in range(2)])
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-5, rtol=1e-5)
  lo = jax.jit(uniattn)(a, values.astype(jnp.bfloat16), x.astype(jnp.bfloat16), w_c)
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float64), want, atol=6e-2, rtol=3e-2)
  with jax.enable_x64(True):
    args = [jnp.asarray(t, jnp.float64) for t in (a[:1, :, :3], values[:, :1], x[:, :1, :3],
                                                  w_c)]
    jax.test_util.check_grads(jax.jit(uniattn), args, order=1, modes=("rev",))
    q, k, _ = (t.astype(jnp.float64) for t in make_qkv(4, B=1, T=3, N=2, K=1, H=2))
    jax.test_util.check_grads(jax.jit(functools.partial(uniattn_shared_map, is_causal=True)),
                              (q, k),
                              order=1, modes=("rev",))


def test_fully_masked_row_is_zero_with_zero_gradient():
  q, k, v = make_qkv(8, B=1, T=4, N=2, K=1, H=3, Hv=2)
  mask = jnp.ones((1, 1, 4, 4), bool).at[:, :, 2].set(False)  # query 2 sees no key
  assert_masked_row_is_zero(
      lambda q, k, v: uniattn(uniattn_shared_map(q, k, None, mask), v), q, k, v, 2)


def test_errors_name_the_argument():
  q, k, _ = make_qkv(0, B=1, T=4, N=2, K=1, H=2)
  amap = jnp.ones((1, 2, 4, 4)) / 4
  vals = jnp.zeros((3, 1, 4, 1, 2))
  check_raises(
      ("`attn_map`", lambda: uniattn(amap[0], vals)),
      ("`attn_map`", lambda: uniattn(amap[..., :3], vals)),
      ("`values`", lambda: uniattn(amap, vals[0, 0])),
      ("`values`", lambda: uniattn(amap, jnp.zeros((3, 1, 4, 3, 2)))),
      ("`w_c`", lambda: uniattn(amap, vals, jnp.zeros((3, 1, 4, 5)))),
      ("`w_c`", lambda: uniattn(amap, vals, jnp.zeros((3, 1, 4, 5)), jnp.zeros((3, 4, 2, 2)))),
      ("`x`", lambda: uniattn(amap, vals, jnp.zeros((2, 1, 4, 5)), jnp.zeros((3, 5, 2, 2)))),
      ("`key`", lambda: uniattn_shared_map(q, k[0])),
      ("`implementation`", lambda: uniattn_shared_map(q, k, implementation="xla")),
  )
