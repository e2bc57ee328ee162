"""A16 tropical attention (js.attention.tropical_attention) against a float64 NumPy loop
reference of the paper's formulas: Hilbert and max-plus scores, hard and smooth max-plus
aggregation, masks, grouped heads, gradients, properties, bf16/x64 and errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises, normal

B, T, S, N, K, H, HV = 2, 4, 5, 4, 2, 3, 2
attn = js.attention.tropical_attention


def _reference(q, k, v, visible, score="hilbert", eps=0.0):
  """Loops in float64: S_ij = -d_H(q_i, k_j) or max_r(q_ir + k_jr);
  o_ir = max_j (S_ij + v_jr) or eps LSE_j((S_ij + v_jr) / eps) over visible j; 0 if none."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, n, _ = q.shape
  g = n // k.shape[2]
  out = np.zeros((b, t, n, v.shape[3]))
  for bi, ti, ni in itertools.product(range(b), range(t), range(n)):
    js_ = [j for j in range(k.shape[1]) if visible[bi, ni, ti, j]]
    if not js_:
      continue
    rows = []
    for j in js_:
      d = q[bi, ti, ni] - k[bi, j, ni // g]
      s = -(d.max() - d.min()) if score == "hilbert" else (q[bi, ti, ni] + k[bi, j, ni // g]).max()
      rows.append(s + v[bi, j, ni // g])
    a = np.array(rows)                                   # [visible keys, Hv]
    top = a.max(0)
    out[bi, ti, ni] = top if eps == 0 else top + eps * np.log(np.exp((a - top) / eps).sum(0))
  return out


def _inputs(seed=0):
  return normal(seed, (B, T, N, H)), normal(seed + 1, (B, S, K, H)), normal(seed + 2, (B, S, K, HV))


def _visible(mask=None, causal=False, kv_len=None):
  vis = np.ones((B, N, T, S), bool)
  if mask is not None:
    vis &= np.broadcast_to(mask, vis.shape)
  if causal:
    vis &= np.arange(S)[None, :] <= np.arange(T)[:, None]
  if kv_len is not None:
    vis &= np.arange(S) < np.asarray(kv_len)[:, None, None, None]
  return vis


def test_values_against_float64_with_masks_and_groups():
  q, k, v = _inputs()
  mask = np.random.default_rng(5).random((B, N, T, S)) < 0.7
  mask[0, 1, 2] = False                     # a query that sees no key: output 0
  kv_len = jnp.array([S, 3])

  @jax.jit
  def run(q, k, v, mask):
    return [attn(q, k, v, mask, score=sc, eps=e, is_causal=True, key_value_seq_lengths=kv_len)
            for sc in ("hilbert", "max_plus") for e in (0.0, 0.3)] + [
        attn(q, k, v), attn(q, k, v, query_seq_lengths=jnp.array([T, 2]))]

  got = run(q, k, v, mask)
  vis = _visible(mask, True, kv_len)
  # float32: a few roundings of values ~3 (max/min of differences, one add, an LSE)
  for out, (sc, e) in zip(got[:4], itertools.product(("hilbert", "max_plus"), (0.0, 0.3)),
                          strict=True):
    np.testing.assert_allclose(out, _reference(q, k, v, vis, sc, e), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got[0])[0, 2, 1] == 0)
  np.testing.assert_allclose(got[4], _reference(q, k, v, _visible()), rtol=1e-5, atol=1e-5)
  want = _reference(q, k, v, _visible())
  want[1, 2:] = 0                           # queries past their length
  np.testing.assert_allclose(got[5], want, rtol=1e-5, atol=1e-5)


# By default test_values_against_float64_with_masks_and_groups covers this: tests/conftest.py runs
# tests/attention under numpy_rank_promotion("raise") (it failed there on the old code); this
# explicit check holds without the guard.
@pytest.mark.slow
def test_sequence_lengths_need_no_implicit_rank_promotion():
  """Issue 37: the positions [T, S] met the lengths [B, 1, 1, 1] by implicit rank promotion,
  a TypeError under jax.numpy_rank_promotion("raise")."""
  q, k, v = _inputs(3)
  lengths = dict(query_seq_lengths=jnp.array([T, 2]), key_value_seq_lengths=jnp.array([S, 3]))
  with jax.numpy_rank_promotion("raise"):
    got = attn(q, k, v, is_causal=True, **lengths)
  want = _reference(q, k, v, _visible(None, True, lengths["key_value_seq_lengths"]))
  want[1, 2:] = 0                           # queries past their length
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gradients_against_float64_finite_differences():
  q, k, v = _inputs(10)
  mask = jnp.asarray(np.random.default_rng(6).random((B, N, T, S)) < 0.8)
  vis = _visible(np.asarray(mask))
  ct = np.asarray(normal(13, (B, T, N, HV)), np.float64)

  @jax.jit
  def grads(q, k, v):
    return [jax.grad(lambda *a, sc=sc, e=e: jnp.sum(attn(*a, mask, score=sc, eps=e) * ct),
                     argnums=(0, 1, 2))(q, k, v)
            for sc, e in (("hilbert", 0.0), ("hilbert", 0.5), ("max_plus", 0.0))]

  rng = np.random.default_rng(7)
  cases = (("hilbert", 0.0), ("hilbert", 0.5), ("max_plus", 0.0))
  for (sc, e), g in zip(cases, grads(q, k, v), strict=True):
    for i in range(3):
      # central differences of the float64 reference along a random direction; the hard
      # version is piecewise linear, exact while h = 1e-6 crosses no tie (random data);
      # float32 gradients: 1e-4 relative
      d = rng.normal(size=np.shape(g[i]))
      args = [np.asarray(a, np.float64) for a in (q, k, v)]

      def f(t, i=i, d=d, args=args, sc=sc, e=e):
        shifted = [a + t * d if j == i else a for j, a in enumerate(args)]
        return np.sum(_reference(*shifted, vis, sc, e) * ct)

      fd = (f(1e-6) - f(-1e-6)) / 2e-6
      np.testing.assert_allclose(np.sum(np.asarray(g[i]) * d), fd, rtol=1e-4, atol=1e-4)
  # a query with no visible key: zero gradient everywhere it could reach
  none = jnp.zeros((B, N, T, S), bool)
  g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v, none, eps=0.5)), argnums=(0, 1, 2)))(
      q, k, v)
  for gi in g:
    np.testing.assert_array_equal(gi, 0.0)


@pytest.mark.slow  # properties and dtypes (~3 s); values and gradients run by default
def test_properties_and_dtypes():
  q, k, v = _inputs(20)
  # translation equivariance in the values and in the queries' projective class; appended
  # dominated keys (far from every query in d_H, small values) change nothing; eps -> 0
  far_k = jnp.concatenate([k, 50.0 * normal(21, (B, 3, K, H))], axis=1)
  far_v = jnp.concatenate([v, jnp.full((B, 3, K, HV), -100.0)], axis=1)

  @jax.jit
  def run(q, k, v):
    return (attn(q, k, v), attn(q, k, v + 2.5), attn(q + 7.0, k, v), attn(q, far_k, far_v),
            attn(q, k, v, eps=1e-3), attn(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                          v.astype(jnp.bfloat16)))

  base, shifted, q_shift, longer, smooth, low = run(q, k, v)
  np.testing.assert_allclose(shifted, base + 2.5, rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(q_shift, base, rtol=1e-6, atol=1e-5)   # d_H(q + c 1, k) = d_H(q, k)
  np.testing.assert_array_equal(longer, base)
  gap = np.asarray(smooth - base)             # 0 <= o^eps - o <= eps log S
  assert np.all(gap >= -1e-6) and np.all(gap <= 1e-3 * np.log(S) + 1e-6)
  # bf16 in, bf16 out, computed in float32 from the rounded inputs (8-bit output: 2^-9
  # relative of values up to ~4)
  assert low.dtype == jnp.bfloat16
  rb = [np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)) for a in (q, k, v)]
  np.testing.assert_allclose(np.asarray(low, np.float32), _reference(*rb, _visible()),
                             atol=2e-2)
  with jax.enable_x64(True):
    q64, k64, v64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v))
    out64 = jax.jit(lambda q, k, v: attn(q, k, v, eps=0.2))(q64, k64, v64)
    assert out64.dtype == jnp.float64
  np.testing.assert_allclose(out64, _reference(q, k, v, _visible(), eps=0.2), rtol=1e-12,
                             atol=1e-12)


def test_errors_name_the_function_and_argument():
  q, k, v = _inputs(20)
  check_raises(
      (r"tropical_attention: `query` must have shape \[B, T, N, H\]", lambda: attn(q[0], k, v)),
      (r"tropical_attention: `key` must be \[B, S, K, H\]", lambda: attn(q, k[..., :2], v)),
      (r"query heads \(4\) must be a multiple of the key/value heads \(3\)",
       lambda: attn(q, jnp.ones((B, S, 3, H)), jnp.ones((B, S, 3, HV)))),
      (r"`score` must be one of", lambda: attn(q, k, v, score="dot")),
      (r"`eps` must be >= 0", lambda: attn(q, k, v, eps=-1.0)),
      (r"`mask` must be boolean", lambda: attn(q, k, v, jnp.ones((T, S)))),
      (r"`mask` of shape \(3, 5\) does not broadcast",
       lambda: attn(q, k, v, jnp.ones((3, S), bool))),
      (r"`key_value_seq_lengths` must be an integer array of shape \[B\]",
       lambda: attn(q, k, v, key_value_seq_lengths=jnp.array([1.0, 2.0]))),
      (r"`value` must have a real dtype", lambda: attn(q, k, v.astype(jnp.complex64))),
  )
