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


def inputs(dtype=np.float32):
  """numpy inputs (no eager jax op to compile): a table, softmax weights, slots, targets."""
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(T, H, K))
  weights = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
  return (rng.normal(size=(N, DV)).astype(dtype), weights.astype(dtype),
          rng.integers(0, N, (T, H, K)).astype(np.int32), rng.normal(size=(T, DV)).astype(dtype))


def test_update_scan_causality_bf16_match_float64_loop():
  v, w, i, t = inputs()
  i[:C] %= N - 1                                             # chunk 0 leaves the last slot alone
  vb, wb, tb = (jnp.asarray(a, jnp.bfloat16) for a in (v, w, t))

  @jax.jit
  def run(v, w, i, t, vb, wb, tb):
    one = fast_weight_pkm_update(v, w[:C], i[:C], t[:C], 0.7)
    # learning rates 0.7 and 0 (the static memory) in one scan: a traced, batched rate
    (outs, static), (end, same) = jax.vmap(lambda lr: fast_weight_pkm(
        v, w, i, t, chunk_size=C, learning_rate=lr))(jnp.array([0.7, 0.0]))
    # causality: the sequence with chunk c's targets (rows 1..n) or weights (rows n+1..2n)
    # perturbed, row 0 unperturbed, in one batched scan
    n = T // C
    in_chunk = (np.arange(n)[:, None] == np.arange(T)[None, :] // C).astype(np.float32)
    scale = np.concatenate([np.zeros((1, T)), in_chunk, 0 * in_chunk]).astype(np.float32)
    wscale = np.concatenate([np.zeros((1, T)), 0 * in_chunk, in_chunk]).astype(np.float32)
    perturbed = jax.vmap(lambda a, b: fast_weight_pkm(
        v, w * (1 + 0.5 * b[:, None, None]), i, t + a[:, None], chunk_size=C,
        learning_rate=0.7)[0])(jnp.asarray(scale), jnp.asarray(wscale))
    bf16 = fast_weight_pkm(vb, wb, i, tb, chunk_size=C, learning_rate=0.7)
    return one, outs, end, static, same, perturbed, bf16

  one, outs, end, static, same, perturbed, bf16 = run(v, w, i, t, vb, wb, tb)
  want_out, want_tables = ref_loop(v, w, i, t, C, 0.7)
  # (outputs of chunk c check the table after chunk c - 1 at the rows chunk c reads)
  # float32: each entry is a sum of <= T*H*K = 48 products of O(1) terms per chunk, 4 chunks:
  # ~200 roundings of 2^-24 on values of size <= ~5 -> 1e-5 is a wide bound (measured ~1e-6)
  np.testing.assert_allclose(np.asarray(one), want_tables[0], atol=1e-5)
  np.testing.assert_allclose(np.asarray(outs), want_out, atol=1e-5)
  np.testing.assert_allclose(np.asarray(end), want_tables[-1], atol=1e-5)
  # the tables really move (the checks above are not vacuous) and touch only addressed rows
  assert np.abs(want_tables[0] - v).max() > 1e-2
  untouched = np.setdiff1d(np.arange(N), i[:C].ravel())
  assert len(untouched) > 0
  np.testing.assert_array_equal(np.asarray(one)[untouched], v[untouched])
  # learning rate 0 is the static product-key read and leaves the table as it was
  np.testing.assert_allclose(np.asarray(static), np.einsum(
      "thk,thkv->tv", w.astype(np.float64), v.astype(np.float64)[i]), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(same), v)

  # causality: chunk c reads only writes of chunks < c. Changing chunk c's targets leaves
  # chunks <= c bit for bit as they were and changes every later chunk; changing its
  # weights (its own read as well as its write) leaves chunks < c as they were
  n = T // C
  moved = np.abs(np.asarray(perturbed) - np.asarray(perturbed)[:1]).reshape(
      2 * n + 1, n, C * DV).max(-1)                            # [variant, output chunk]
  c_in, c_out = np.arange(n)[:, None], np.arange(n)[None, :]
  assert np.all((moved[1:n + 1] > 0) == (c_out > c_in))
  assert np.all((moved[n + 1:] > 0) == (c_out >= c_in))

  # bf16 inputs are computed in float32: one bf16 rounding at the end, |err| <= 2^-9 |x|
  # (+ the float32 bound above); a bf16 computation would round ~50 times per entry
  assert bf16[0].dtype == bf16[1].dtype == jnp.bfloat16
  f32 = lambda a: np.asarray(a, np.float32)
  want_out, tables = ref_loop(f32(vb), f32(wb), i, f32(tb), C, 0.7)
  for got, exp in ((bf16[0], want_out), (bf16[1], tables[-1])):
    np.testing.assert_allclose(np.asarray(got, np.float64), exp, rtol=2.0 ** -8, atol=1e-5)


@pytest.mark.slow
def test_gradients_through_scan_float64():
  with jax.enable_x64(True):
    v, w, i, t = inputs(np.float64)
    rng = np.random.default_rng(1)
    r_out, r_end = rng.normal(size=(T, DV)), rng.normal(size=(N, DV))

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
      ("`indices`", lambda: upd(indices=i.astype(np.float32))),
      ("`targets`", lambda: upd(targets=t[:, :2])),
      ("`learning_rate`", lambda: upd(learning_rate=-0.1)),
      ("`learning_rate`", lambda: upd(learning_rate=np.ones(2))),
      ("`chunk_size`", lambda: scan(chunk_size=3)),
      ("`chunk_size`", lambda: scan(chunk_size=0)),
      ("`learning_rate`", lambda: scan(learning_rate=float("nan"))),
      ("`chunk_size`", lambda: pkm(fast_weights=True)),
      ("`chunk_size`", lambda: pkm(chunk_size=2)),
      ("`inner_learning_rate`", lambda: pkm(fast_weights=True, chunk_size=2, inner_learning_rate=-1.0)),
      ("`x`", lambda: nnx.eval_shape(lambda: pkm(fast_weights=True, chunk_size=2))(np.ones(4))),
  )
