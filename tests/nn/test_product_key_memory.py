"""A47 ProductKeyMemory / product_key_topk (jaxsoft/nn/_product_key_memory.py).

Oracles: brute-force top-k over all n^2 key sums (numpy float64), and the softmax-weighted
value sum written out in numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsoft.nn import ProductKeyMemory, product_key_topk
from tests.helpers import check_raises, normal


def test_product_topk_equals_brute_force():
  h, n, d, k = 2, 9, 8, 5
  q, c1, c2 = normal(0, (4, 3, h, d)), normal(1, (h, n, d // 2)), normal(2, (h, n, d // 2))
  scores, idx = jax.jit(product_key_topk, static_argnums=3)(q, c1, c2, k)
  qn, c1n, c2n = (np.asarray(a, np.float64) for a in (q, c1, c2))
  full = (np.einsum("...hd,hnd->...hn", qn[..., :d // 2], c1n)[..., :, None]
          + np.einsum("...hd,hnd->...hn", qn[..., d // 2:], c2n)[..., None, :])
  full = full.reshape(*full.shape[:-2], n * n)
  want_idx = np.argsort(-full, axis=-1)[..., :k]
  np.testing.assert_array_equal(np.asarray(idx), want_idx)
  np.testing.assert_allclose(np.asarray(scores), np.take_along_axis(full, want_idx, -1), atol=1e-5)


def test_layer_output_and_sparse_value_gradient():
  mem = ProductKeyMemory(6, key_dim=8, num_sub_keys=5, top_k=3, value_dim=4, num_heads=2,
                         rngs=nnx.Rngs(0))
  x = normal(3, (2, 6))
  y = nnx.jit(lambda m, x: m(x))(mem, x)
  w, idx = nnx.jit(lambda m, x: m.lookup(x))(mem, x)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1, rtol=1e-6)
  vals = np.asarray(mem.value_table[...], np.float64)
  want = np.einsum("bhk,bhkv->bv", np.asarray(w, np.float64), vals[np.asarray(idx)])
  np.testing.assert_allclose(np.asarray(y), want, atol=1e-5)
  # only the selected value rows get a gradient
  g = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(mem, x[:1])
  rows = np.nonzero(np.abs(np.asarray(g.value_table[...])).sum(-1))[0]
  assert set(rows) <= set(np.asarray(idx[0]).ravel()) and 0 < len(rows) <= 2 * 3
  assert float(jnp.abs(g.w_query[...]).max()) > 0


def test_errors_name_the_argument():
  check_raises(
      ("`key_dim`", lambda: ProductKeyMemory(4, key_dim=5, num_sub_keys=4, top_k=2, rngs=nnx.Rngs(0))),
      ("`top_k`", lambda: ProductKeyMemory(4, key_dim=4, num_sub_keys=2, top_k=3, rngs=nnx.Rngs(0))),
      ("`top_k`", lambda: product_key_topk(jnp.ones((1, 4)), jnp.ones((1, 3, 2)), jnp.ones((1, 3, 2)), 4)),
      ("`query`", lambda: product_key_topk(jnp.ones((1, 6)), jnp.ones((1, 3, 2)), jnp.ones((1, 3, 2)), 2)),
  )
