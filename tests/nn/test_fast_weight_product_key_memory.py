"""A47 FwPKM fast weights: fast_weight_pkm_update / fast_weight_pkm
(jaxsoft/nn/_fast_weight_product_key_memory.py) and ProductKeyMemory(fast_weights=True).

Oracle: a numpy float64 loop written from the formula: per chunk, read
o_t = sum_{h,j} w_thj V[i_thj] from the table, then V -= lr/C sum_t w_thj (o_t - v_t) into
row i_thj (np.add.at, so repeated slots accumulate).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft.nn import ProductKeyMemory, fast_weight_pkm, fast_weight_pkm_update
from tests.helpers import check_raises, normal, numeric_grad

N, DV, T, H, K, C = 7, 3, 8, 2, 3, 2      # 7 slots read 2*3 times a token: many collisions


def ref_loop(values, weights, indices, targets, chunk, lr):
  """(outputs [T, d_v], [table after each chunk]) in float64."""
  v = np.array(values, np.float64)
  w, t = np.asarray(weights, np.float64), np.asarray(targets, np.float64)
  i = np.asarray(indices)
  outs, tables = [], []
  for s in range(0, w.shape[0], chunk):
    wc, ic, tc = w[s:s + chunk], i[s:s + chunk], t[s:s + chunk]
    o = np.einsum("thk,thkv->tv", wc, v[ic])
    outs.append(o)
    g = np.zeros_like(v)
    np.add.at(g, ic.reshape(-1), (wc[..., None] * (o - tc)[:, None, None, :]).reshape(-1, v.shape[1]))
    v = v - lr * g / wc.shape[0]
    tables.append(v)
  return np.concatenate(outs), tables


def inputs(dtype=jnp.float32):
  values = normal(0, (N, DV), dtype=dtype)
  weights = jax.nn.softmax(normal(1, (T, H, K)), -1).astype(dtype)
  indices = jax.random.randint(jax.random.key(2), (T, H, K), 0, N)
  targets = normal(3, (T, DV), dtype=dtype)
  return values, weights, indices, targets


def test_update_and_scan_match_float64_loop():
  v, w, i, t = inputs()

  @jax.jit
  def run(v, w, i, t):
    one = fast_weight_pkm_update(v, w[:C], i[:C], t[:C], 0.7)
    outs, end = fast_weight_pkm(v, w, i, t, chunk_size=C, learning_rate=0.7)
    # the table after a middle chunk: the scan's final table over a prefix of whole chunks
    prefix = fast_weight_pkm(v, w[:2 * C], i[:2 * C], t[:2 * C], chunk_size=C,
                             learning_rate=0.7)[1]
    static, same = fast_weight_pkm(v, w, i, t, chunk_size=C, learning_rate=0.0)
    return one, outs, end, prefix, static, same

  one, outs, end, prefix, static, same = run(v, w, i, t)
  want_out, want_tables = ref_loop(v, w, i, t, C, 0.7)
  # float32: each entry is a sum of <= T*H*K = 48 products of O(1) terms per chunk, 4 chunks:
  # ~200 roundings of 2^-24 on values of size <= ~5 -> 1e-4 is a wide bound (measured ~1e-6)
  np.testing.assert_allclose(np.asarray(one), want_tables[0], atol=1e-5)
  np.testing.assert_allclose(np.asarray(outs), want_out, atol=1e-5)
  np.testing.assert_allclose(np.asarray(end), want_tables[-1], atol=1e-5)
  np.testing.assert_allclose(np.asarray(prefix), want_tables[1], atol=1e-5)
  # the tables really move (the check above is not vacuous) and touch only addressed rows
  assert np.abs(want_tables[0] - np.asarray(v)).max() > 1e-2
  untouched = np.setdiff1d(np.arange(N), np.asarray(i[:C]).ravel())
  np.testing.assert_array_equal(np.asarray(one)[untouched], np.asarray(v)[untouched])
  # learning rate 0 is the static product-key read
  np.testing.assert_allclose(np.asarray(static), np.einsum(
      "thk,thkv->tv", np.asarray(w, np.float64), np.asarray(v, np.float64)[np.asarray(i)]),
      atol=1e-6)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(v))


def test_chunk_causality():
  v, w, i, t = inputs()
  f = lambda w, t: fast_weight_pkm(v, w, i, t, chunk_size=C, learning_rate=0.7)[0]
  jt, jw = jax.jit(jax.jacrev(f, argnums=(1, 0)))(w, t)     # d out[t] / d (targets, weights)
  chunk = np.arange(T) // C
  later = chunk[:, None] > chunk[None, :]                    # [t_out, s_in]: s in an earlier chunk
  dt = np.abs(np.asarray(jt)).sum((1, 3))                    # [T_out, T_in]
  dw = np.abs(np.asarray(jw)).sum((1, 3, 4))
  # chunk c reads only writes of chunks < c: exact zeros elsewhere (targets enter by writes
  # only; weights also by the token's own read, the diagonal)
  assert np.all(dt[~later] == 0) and np.all(dt[later] > 0)
  own = np.eye(T, dtype=bool)
  assert np.all(dw[~(later | own)] == 0) and np.all(dw[later | own] > 0)


@pytest.mark.slow
def test_gradients_through_scan_float64():
  with jax.enable_x64(True):
    v, w, i, t = (np.asarray(a, np.float64) if jnp.issubdtype(a.dtype, jnp.floating)
                  else np.asarray(a) for a in inputs())
    r_out, r_end = np.asarray(normal(4, (T, DV)), np.float64), np.asarray(normal(5, (N, DV)), np.float64)

    def loss(v, w, t, lr):
      outs, end = fast_weight_pkm(v, w, i, t, chunk_size=C, learning_rate=lr)
      return jnp.sum(outs * r_out) + jnp.sum(end * r_end)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(v, w, t, 0.7)
    assert all(x.dtype == jnp.float64 for x in g)

    def ref(v, w, t, lr):
      outs, tables = ref_loop(v, w, i, t, C, lr)
      return np.sum(outs * r_out) + np.sum(tables[-1] * r_end)

    want = (numeric_grad(lambda x: ref(x, w, t, 0.7), v),
            numeric_grad(lambda x: ref(v, x, t, 0.7), w),
            numeric_grad(lambda x: ref(v, w, x, 0.7), t),
            numeric_grad(lambda x: ref(v, w, t, float(x)), np.float64(0.7)))
  # central differences with h = 1e-6 on an O(1) polynomial: truncation ~h^2, cancellation
  # ~2^-52 / h ~ 2e-10 per entry times O(10) -> 1e-7
  for got, exp in zip(g, want, strict=True):
    np.testing.assert_allclose(np.asarray(got), exp, atol=1e-7)


def test_bf16_computes_in_float32():
  v, w, i, t = inputs(jnp.bfloat16)
  outs, end = jax.jit(lambda *a: fast_weight_pkm(*a, chunk_size=C, learning_rate=0.7))(v, w, i, t)
  assert outs.dtype == end.dtype == jnp.bfloat16
  want_out, tables = ref_loop(v.astype(jnp.float32), w.astype(jnp.float32), i,
                              t.astype(jnp.float32), C, 0.7)
  # float32 inside, one bf16 rounding at the end: |err| <= 2^-9 |x| (+ the float32 bound);
  # a bf16 computation would round ~50 times per entry
  for got, exp in ((outs, want_out), (end, tables[-1])):
    np.testing.assert_allclose(np.asarray(got, np.float64), exp, rtol=2.0 ** -8, atol=1e-5)


@pytest.mark.slow
def test_layer_fast_weights_matches_loop():
  kw = dict(key_dim=4, num_sub_keys=3, top_k=2, value_dim=3, num_heads=2)
  mem = ProductKeyMemory(5, fast_weights=True, chunk_size=2, inner_learning_rate=0.5,
                         rngs=nnx.Rngs(0), **kw)
  static = ProductKeyMemory(5, rngs=nnx.Rngs(0), **kw)      # same draws: w_target comes last
  x = normal(6, (2, 6, 5))

  @nnx.jit
  def run(mem, static, x):
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(mem)
    return mem(x), mem.lookup(x), static(x), grads

  y, (w, idx), y_static, grads = run(mem, static, x)
  tgt = np.asarray(x, np.float64) @ np.asarray(mem.w_target[...], np.float64)
  for b in range(2):
    want, _ = ref_loop(mem.value_table[...], w[b], idx[b], tgt[b], 2, 0.5)
    np.testing.assert_allclose(np.asarray(y[b]), want, atol=1e-5)   # float32, as above
  # the first chunk reads the initial table: the static layer's output
  np.testing.assert_allclose(np.asarray(y[:, :2]), np.asarray(y_static[:, :2]), atol=1e-6)
  assert np.abs(np.asarray(y[:, 2:]) - np.asarray(y_static[:, 2:])).max() > 1e-3
  # the write path is differentiable: the target projection gets a gradient
  assert float(jnp.abs(grads.w_target[...]).max()) > 0


def test_errors_name_the_argument():
  v, w, i, t = inputs()
  upd = lambda **kw: fast_weight_pkm_update(**{**dict(values=v, weights=w, indices=i,
                                                      targets=t, learning_rate=0.5), **kw})
  scan = lambda **kw: fast_weight_pkm(v, w, i, t, **{**dict(chunk_size=C, learning_rate=0.5), **kw})
  pkm = lambda **kw: ProductKeyMemory(4, key_dim=4, num_sub_keys=3, top_k=2, rngs=nnx.Rngs(0), **kw)
  check_raises(
      ("`values`", lambda: upd(values=v[0])),
      ("`weights`", lambda: upd(weights=w[0])),
      ("`indices`", lambda: upd(indices=i[:, :, :2])),
      ("`indices`", lambda: upd(indices=i.astype(jnp.float32))),
      ("`targets`", lambda: upd(targets=t[:, :2])),
      ("`learning_rate`", lambda: upd(learning_rate=-0.1)),
      ("`learning_rate`", lambda: upd(learning_rate=jnp.ones(2))),
      ("`chunk_size`", lambda: scan(chunk_size=3)),
      ("`chunk_size`", lambda: scan(chunk_size=0)),
      ("`learning_rate`", lambda: scan(learning_rate=float("nan"))),
      ("`chunk_size`", lambda: pkm(fast_weights=True)),
      ("`chunk_size`", lambda: pkm(chunk_size=2)),
      ("`inner_learning_rate`", lambda: pkm(fast_weights=True, chunk_size=2, inner_learning_rate=-1.0)),
      ("`x`", lambda: nnx.eval_shape(lambda: pkm(fast_weights=True, chunk_size=2))(jnp.ones(4))),
  )
