"""N41 stochastic_softmax_pool (STAR): the evaluation form against a numpy float64 oracle, the
draw's frequencies against softmax within binomial bounds, gradients (the drawn value's, or
straight-through), masks, bf16, jit/vmap and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import pooling

RNG = np.random.default_rng(41)
X = (1.5 * RNG.standard_normal((4, 6))).astype(np.float32)
MASK = np.ones((4, 6), bool)
MASK[1, [0, 3]] = False
MASK[2, :] = False
MASK[2, 4] = True  # one visible entry
MASK[3, :] = False  # no visible entry

STATIC = ("axis", "keepdims", "deterministic", "straight_through")
pool = jax.jit(pooling.stochastic_softmax_pool, static_argnames=STATIC)


def o_softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def o_eval_rows(x, mask, t=1.0):
  """Σ softmax(x/T)·x over each row's visible entries (0 for none), float64."""
  x = np.asarray(x, np.float64)
  return np.array([np.sum(o_softmax(r[m] / t) * r[m]) if m.any() else 0.0
                   for r, m in zip(x, mask, strict=True)])


def o_eval_grad_rows(x, mask, t=1.0):
  """d/dx of the evaluation form, row by row: p_i (1 + (x_i - out) / T) on V, 0 elsewhere."""
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  for i, (r, m) in enumerate(zip(x, mask, strict=True)):
    if m.any():
      p = o_softmax(r[m] / t)
      g[i, m] = p * (1.0 + (r[m] - np.sum(p * r[m])) / t)
  return g


def test_evaluation_form_matches_float64_oracle():
  for t in (1.0, 0.6):
    out = pool(jnp.asarray(X), where=jnp.asarray(MASK), deterministic=True, temperature=t)
    assert out.shape == (4,) and out.dtype == jnp.float32
    # a softmax and a weighted sum of 6 float32 terms: ~20 roundings of 2^-24 relative to
    # |x| <= 5 gives < 1e-5; 2e-5 leaves a margin.
    np.testing.assert_allclose(out, o_eval_rows(X, MASK, t), rtol=2e-5, atol=2e-5)
  out = pool(jnp.asarray(X), axis=0, keepdims=True, deterministic=True)
  assert out.shape == (1, 6)
  np.testing.assert_allclose(out[0], o_eval_rows(X.T, np.ones((6, 4), bool)), rtol=2e-5,
                             atol=2e-5)


@pytest.mark.parametrize("t", [1.0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_draw_frequencies_match_softmax_within_a_binomial_bound(t):
  """N pools of one row, one key: each entry's count is Binomial(N, p_i)."""
  n = 20000
  row = np.array([1.3, -0.4, 0.2, 2.0, -1.1, 0.7], np.float32)  # distinct: value -> index
  keep = np.array([True, True, False, True, True, True])
  x = jnp.broadcast_to(jnp.asarray(row), (n, 6))
  draws = np.asarray(pool(x, where=jnp.asarray(keep), key=jax.random.key(7), temperature=t))
  idx = np.argmax(draws[:, None] == row[None, :], axis=1)
  assert np.all(draws == row[idx])  # every draw is an entry, exactly
  counts = np.bincount(idx, minlength=6)
  assert counts[~keep].sum() == 0  # a masked entry is never drawn
  p = np.zeros(6)
  p[keep] = o_softmax(row[keep].astype(np.float64) / t)
  # |f_i - p_i| <= 5 sd of a Binomial(N, p_i) frequency (a false failure has probability
  # ~6e-7 per entry); the bound is 0.018 at p = 0.5, so a wrong law cannot pass (at T = 1,
  # softmax(x/2) moves the largest p by 0.16, a uniform draw by 0.32).
  bound = 5.0 * np.sqrt(p * (1 - p) / n)
  np.testing.assert_array_less(np.abs(counts / n - p), bound + 1e-12)
  # The mean of the draws is the evaluation form, within 5 sd of the sample mean.
  mean = np.sum(p * row)
  sd = np.sqrt(np.sum(p * row.astype(np.float64) ** 2) - mean ** 2)
  assert abs(draws.mean() - mean) < 5.0 * sd / np.sqrt(n)


def test_masked_entries_are_never_drawn_and_may_hold_anything():
  x = jnp.asarray(X).at[1, 0].set(jnp.nan).at[1, 3].set(1e30).at[0, 2].set(-jnp.inf)
  mask = jnp.asarray(MASK)
  keys = jax.random.split(jax.random.key(3), 500)
  draws = jax.jit(jax.vmap(lambda k: pooling.stochastic_softmax_pool(x, where=mask, key=k)))(keys)
  draws = np.asarray(draws)
  # row 0: -inf counts as masked; row 1: the NaN and 1e30 are masked.
  visible0 = set(X[0, [0, 1, 3, 4, 5]].tolist())
  visible1 = set(X[1, MASK[1]].tolist())
  assert set(draws[:, 0].tolist()) <= visible0 and set(draws[:, 1].tolist()) <= visible1
  assert len(set(draws[:, 1].tolist())) > 1  # it does draw (not always the same entry)
  np.testing.assert_array_equal(draws[:, 2], X[2, 4])  # one visible entry: always it
  np.testing.assert_array_equal(draws[:, 3], 0.0)  # none: 0


@jax.jit
def _grads(x, mask, key):
  def total(v, st):
    return jnp.sum(pooling.stochastic_softmax_pool(v, where=mask, key=key, temperature=0.8,
                                                   straight_through=st))
  draw = pooling.stochastic_softmax_pool(x, where=mask, key=key, temperature=0.8)
  st = pooling.stochastic_softmax_pool(x, where=mask, key=key, temperature=0.8,
                                       straight_through=True)
  return draw, st, jax.grad(total)(x, False), jax.grad(total)(x, True)


def test_gradients_drawn_value_and_straight_through():
  x, mask = jnp.asarray(X), jnp.asarray(MASK)
  draw, st, g_draw, g_st = (np.asarray(a) for a in _grads(x, mask, jax.random.key(11)))
  # default: the gradient of the gather, one-hot on the drawn entry, 0 for an empty pool
  want = np.zeros_like(X)
  for i in range(3):
    want[i, np.flatnonzero((X[i] == draw[i]) & MASK[i])[0]] = 1.0
  np.testing.assert_array_equal(g_draw, want)
  # straight-through: the same forward value exactly, the evaluation form's gradient
  np.testing.assert_array_equal(st, draw)
  # p_i (1 + (x_i - out)/T): ~20 float32 roundings on terms <= 5 -> 2e-5
  np.testing.assert_allclose(g_st, o_eval_grad_rows(X, MASK, 0.8), rtol=2e-5, atol=2e-5)
  assert np.all(g_st[~MASK] == 0.0)


def test_evaluation_form_gradient_and_float64():
  with jax.enable_x64(True):
    x64 = jnp.asarray(X, jnp.float64)
    f = jax.jit(jax.value_and_grad(lambda v: jnp.sum(pooling.stochastic_softmax_pool(
        v, where=jnp.asarray(MASK), deterministic=True, temperature=0.8))))
    val, g = f(x64)
    assert g.dtype == jnp.float64
    np.testing.assert_allclose(val, o_eval_rows(X, MASK, 0.8).sum(), rtol=1e-12)
    np.testing.assert_allclose(g, o_eval_grad_rows(X, MASK, 0.8), rtol=1e-12, atol=1e-14)
    drawn = pool(x64, key=jax.random.key(0))
    assert drawn.dtype == jnp.float64 and np.all(np.any(np.asarray(drawn)[:, None] == X, 1))


def test_bf16_draws_a_bf16_entry_and_evaluates_close_to_float32():
  xb = jnp.asarray(X, jnp.bfloat16)
  mask = jnp.asarray(MASK)
  drawn = pool(xb, where=mask, key=jax.random.key(5))
  assert drawn.dtype == jnp.bfloat16
  xbf = np.asarray(xb, np.float32)
  for i in range(3):
    assert np.asarray(drawn, np.float32)[i] in xbf[i, MASK[i]]
  out = pool(xb, where=mask, deterministic=True)
  assert out.dtype == jnp.bfloat16
  # computed in float32 from the bf16 inputs, rounded once to bf16: 2^-8 relative, |out| < 4
  np.testing.assert_allclose(np.asarray(out, np.float32), o_eval_rows(xbf, MASK),
                             rtol=2 ** -8, atol=2e-2)


def test_jit_vmap_and_determinism():
  x, mask = jnp.asarray(X[:3]), jnp.asarray(MASK[:3])
  key = jax.random.key(9)
  rows = [pool(x[i], where=mask[i], key=key) for i in range(3)]
  np.testing.assert_array_equal(pool(x[0], where=mask[0], key=key), rows[0])  # same key, same draw
  # vmap over the pools with one key: each slice as its own call with that key
  mapped = jax.jit(jax.vmap(lambda v, m: pooling.stochastic_softmax_pool(v, where=m, key=key)))(
      x, mask)
  np.testing.assert_array_equal(mapped, rows)
  # (vmap over keys: test_masked_entries_are_never_drawn_and_may_hold_anything)


def test_empty_axis_keepdims_and_bad_input():
  assert pool(jnp.zeros((3, 0)), key=jax.random.key(0)).shape == (3,)
  out = pool(jnp.asarray(X), key=jax.random.key(0), keepdims=True)
  assert out.shape == (4, 1)
  with pytest.raises(ValueError, match="`key`"):
    pooling.stochastic_softmax_pool(jnp.asarray(X))
  with pytest.raises(ValueError, match="`deterministic`"):
    pooling.stochastic_softmax_pool(jnp.asarray(X), deterministic=1)
  with pytest.raises(ValueError, match="`straight_through`"):
    pooling.stochastic_softmax_pool(jnp.asarray(X), key=jax.random.key(0), straight_through="y")
  for t in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="`temperature`"):
      pooling.stochastic_softmax_pool(jnp.asarray(X), key=jax.random.key(0), temperature=t)
  with pytest.raises(ValueError, match="where"):
    pooling.stochastic_softmax_pool(jnp.asarray(X), where=jnp.ones((3, 6), bool),
                                    key=jax.random.key(0))
