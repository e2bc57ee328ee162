"""A52 monotonic attention (jaxsoft/attention/_monotonic.py).

Oracles: numpy float64 loops written from the papers' formulas, not from the library's
recurrences: Raffel et al.'s alignment as the explicit sum over the previous position k
of alpha_{i-1,k} prod_{l=k}^{j-1} (1 - p_{il}) (the library uses the first-order recurrence
q_j = (1 - p_{j-1}) q_{j-1} + alpha_{i-1,j}); Chiu & Raffel's beta as the sum over the
chunks that contain key j; the hard position by a left-to-right search; each window or
segment normalised by its own softmax. Gradients: central differences of the float64
oracle along random directions (one pair of oracle calls per direction).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxsoft.attention import (
  chunkwise_attention,
  dot_product_attention,
  hard_monotonic_attention,
  local_window_attention,
  monotonic_attention,
  monotonic_attention_probs,
  segmental_attention,
)
from tests.helpers import check_raises, make_qkv

B, T, S, N, K, H = 2, 4, 7, 4, 2, 4
G = N // K
LENGTHS = np.array([7, 5])


# ----------------------------------------------------------------------------- oracles


def np_alignment(p, a0):
  """p [..., T, S], a0 [..., S] -> alpha [..., T, S] from the sum-product formula."""
  p = np.asarray(p, np.float64)
  a0 = np.broadcast_to(np.asarray(a0, np.float64), p.shape[:-2] + p.shape[-1:])
  out = np.zeros(p.shape)
  for lead in np.ndindex(p.shape[:-2]):
    prev = a0[lead]
    for i in range(p.shape[-2]):
      pi = p[lead][i]
      for j in range(p.shape[-1]):
        out[lead][i, j] = pi[j] * sum(prev[k] * np.prod(1.0 - pi[k:j]) for k in range(j + 1))
      prev = out[lead][i]
  return out


def np_logits(q, k, scale, bias=None):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  kr = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  z = scale * np.einsum("btnh,bsnh->bnts", q, kr)
  return z if bias is None else z + np.asarray(bias, np.float64)


def np_visible(lengths, shape):
  Bb, Nn, Tt, Ss = shape
  L = np.full(Bb, Ss) if lengths is None else np.asarray(lengths)
  return np.broadcast_to(np.arange(Ss)[None, None, None, :] < L[:, None, None, None], shape)


def np_softmax_where(u, where):
  z = np.where(where, u, -np.inf)
  if not where.any():
    return np.zeros_like(u)
  e = np.where(where, np.exp(z - z[where].max()), 0.0)
  return e / e.sum()


def np_window_weights(alpha, u, vis, left, right):
  """beta_ij = sum_t alpha_it softmax(u_i over [t - left, t + right] ∩ visible)_j."""
  beta = np.zeros(alpha.shape)
  Ss = alpha.shape[-1]
  j = np.arange(Ss)
  for lead in np.ndindex(alpha.shape[:-1]):
    for t in range(Ss):
      win = vis[lead] & (j >= t - left) & (j <= t + right)
      beta[lead] += alpha[lead][t] * np_softmax_where(u[lead], win)
  return beta


def np_positions(p, vis, t0, thr=0.5):
  """The hard positions [B, N, T] by a left-to-right search (S = none)."""
  Bb, Nn, Tt, Ss = p.shape
  t = np.zeros((Bb, Nn, Tt), np.int64)
  for b, n in np.ndindex(Bb, Nn):
    prev = t0
    for i in range(Tt):
      hit = Ss
      for j in range(max(prev, 0), Ss):
        if vis[b, n, i, j] and p[b, n, i, j] >= thr:
          hit = j
          break
      t[b, n, i] = prev = hit
  return t


def np_hard_weights(t, u, vis, left, right, segment=False, t0=-1):
  Bb, Nn, Tt, Ss = u.shape
  w = np.zeros(u.shape)
  j = np.arange(Ss)
  for b, n in np.ndindex(Bb, Nn):
    prev = t0
    for i in range(Tt):
      ti = t[b, n, i]
      if ti < Ss:
        if segment:
          win = (j > prev) & (j <= ti) if ti > prev else (j == ti)
        else:
          win = (j >= ti - left) & (j <= ti + right)
        w[b, n, i] = np_softmax_where(u[b, n, i], vis[b, n, i] & win)
      prev = ti
  return w


def np_attend(w, v):
  vr = np.repeat(np.asarray(v, np.float64), w.shape[1] // v.shape[2], axis=2)
  return np.einsum("bnts,bsnh->btnh", w, vr)


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def np_expected(q, k, v, bias, lengths, scale, kind, chunk=None, left=0, right=0):
  """The expected forms: kind 'mono' (monotonic), 'window' (chunk = left/right window)."""
  e = np_logits(q, k, scale, bias)
  vis = np_visible(lengths, e.shape)
  p = np.where(vis, sigmoid(e), 0.0)
  a0 = np.eye(1, e.shape[-1])[0]
  alpha = np_alignment(p, a0)
  if kind == "mono":
    return np_attend(alpha, v)
  cq, ck, cb = chunk
  u = np_logits(cq, ck, scale, cb)
  return np_attend(np_window_weights(alpha, u, vis, left, right), v)


def _inputs(seed=0, dtype=jnp.float32):
  q, k, v = make_qkv(seed, B=B, T=T, S=S, N=N, K=K, H=H, dtype=dtype)
  bias = jax.random.normal(jax.random.key(seed + 10), (1, N, T, S), jnp.float32).astype(dtype)
  return q, k, v, bias


def _directional_check(grads, ct, f_np, args, seed=3, h=1e-6, atol=1e-8):
  """Central differences of the float64 oracle along one random direction d over all
  arguments at once, <ct, (f(x + h d) - f(x - h d)) / 2h>, against sum_a <grad_a, d_a>
  from jax's VJP for the cotangent ct. Error: O(h^2 f''') ~ 1e-12 plus roundoff
  eps / h ~ 1e-10."""
  rng = np.random.default_rng(seed)
  ds = [rng.standard_normal(x.shape) for x in args]
  plus = [np.asarray(x, np.float64) + h * d for x, d in zip(args, ds, strict=True)]
  minus = [np.asarray(x, np.float64) - h * d for x, d in zip(args, ds, strict=True)]
  fd = np.sum(np.asarray(ct) * (f_np(*plus) - f_np(*minus))) / (2 * h)
  got = sum(float(np.sum(np.asarray(g) * d)) for g, d in zip(grads, ds, strict=True))
  np.testing.assert_allclose(got, fd, atol=atol, rtol=1e-6)


def _value_and_vjp(f, args, seed=4):
  out, vjp = jax.vjp(f, *args)
  ct = jax.random.normal(jax.random.key(seed), out.shape, out.dtype)
  return out, vjp(ct), ct


# ----------------------------------------------------------------------------- alignment


def test_alignment_methods_match_the_sum_product_formula_float64():
  rng = np.random.default_rng(0)
  p = rng.uniform(0.05, 0.95, (2, 3, T, S))
  where = rng.uniform(size=(2, 3, 1, S)) < 0.8
  a0 = rng.dirichlet(np.ones(S), (2, 3))
  want = np_alignment(np.where(where, p, 0.0), a0)

  @jax.jit
  def run(p, a0, where):
    return [monotonic_attention_probs(p, a0, where=where, method=m)
            for m in ("parallel", "loop", "cumprod")]

  with jax.enable_x64(True):
    got = run(jnp.asarray(p), jnp.asarray(a0), jnp.asarray(where))
    # exact algorithms: 1e-13 is ~ S^2 = 49 roundoffs of 2^-52; cumprod divides by
    # products >= 0.05^6 ~ 1.6e-8, which amplifies roundoff to ~1e-16 / 1.6e-8 ~ 1e-8
    for a, method, tol in zip(got, ("parallel", "loop", "cumprod"), (1e-13, 1e-13, 1e-8),
                              strict=True):
      assert a.dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(a), want, atol=tol, rtol=0, err_msg=method)
  got32 = run(jnp.asarray(p, jnp.float32), jnp.asarray(a0, jnp.float32), jnp.asarray(where))
  # float32: each q_j is ~2S = 14 operations on values <= 1: 14 * 2^-24 ~ 1e-6
  np.testing.assert_allclose(np.asarray(got32[0]), want, atol=2e-6, rtol=0)


def test_alignment_properties():
  rng = np.random.default_rng(1)
  f = monotonic_attention_probs

  @jax.jit
  def run(p):
    return (f(p), f(jnp.ones((6, 9))), f(jnp.ones((6, 9)), jnp.eye(1, 9, 4)[0]),
            f(jnp.eye(6, 9)), f(jnp.eye(6, 9, 1), jnp.eye(1, 9, 1)[0]), f(jnp.zeros((6, 9))))

  alpha, ones, ones4, diag, shifted, zeros = run(jnp.asarray(rng.uniform(0, 1, (6, 9)), jnp.float32))
  assert float(jnp.min(alpha)) >= 0.0
  assert float(jnp.max(jnp.sum(alpha, -1))) <= 1.0 + 1e-6  # 9 additions of 2^-24
  assert float(jnp.min(jnp.sum(alpha, -1))) < 0.99  # some mass ran off the end
  # p = 1 everywhere: the scan stops where it starts, every row is the initial one-hot
  np.testing.assert_array_equal(np.asarray(ones), np.tile(np.eye(1, 9), (6, 1)))
  np.testing.assert_array_equal(np.asarray(ones4), np.tile(np.eye(1, 9, 4), (6, 1)))
  # p = 1 exactly on the diagonal (0 elsewhere): one key per step, the identity
  np.testing.assert_array_equal(np.asarray(diag), np.eye(6, 9))
  # p = 1 one key ahead of a start at key 1: the identity shifted by one
  np.testing.assert_array_equal(np.asarray(shifted), np.eye(6, 9, 1))
  # p = 0: the scan runs off the end at once
  np.testing.assert_array_equal(np.asarray(zeros), np.zeros((6, 9)))


# ----------------------------------------------------------------------------- attention forms


def test_expected_forms_values_and_gradients_float64():
  scale = 0.7
  lengths_np = LENGTHS

  def mono(q, k, v, b):
    return monotonic_attention(q, k, v, b, scale=scale, key_value_seq_lengths=jnp.asarray(lengths_np))

  def chunk(q, k, v, b, cq, ck):
    return chunkwise_attention(q, k, v, b, chunk_size=3, chunk_query=cq, chunk_key=ck,
                               scale=scale, key_value_seq_lengths=jnp.asarray(lengths_np))

  def mono_np(q, k, v, b):
    return np_expected(q, k, v, b, lengths_np, scale, "mono")

  def chunk_np(q, k, v, b, cq, ck):
    return np_expected(q, k, v, b, lengths_np, scale, "window", (cq, ck, b), left=2, right=0)

  with jax.enable_x64(True):
    q, k, v, bias = (a.astype(jnp.float64) for a in _inputs(0))
    cq = jax.random.normal(jax.random.key(5), (B, T, N, 3), jnp.float64)
    ck = jax.random.normal(jax.random.key(6), (B, S, K, 3), jnp.float64)

    @jax.jit
    def run(q, k, v, bias, cq, ck):
      return _value_and_vjp(mono, (q, k, v, bias)), _value_and_vjp(chunk, (q, k, v, bias, cq, ck))

    (out_m, g_m, ct_m), (out_c, g_c, ct_c) = run(q, k, v, bias, cq, ck)
    # float64 sums of <= 7 x 7 products: 1e-12 is thousands of roundoffs of 2^-52
    np.testing.assert_allclose(np.asarray(out_m), mono_np(q, k, v, bias), atol=1e-12)
    np.testing.assert_allclose(np.asarray(out_c), chunk_np(q, k, v, bias, cq, ck), atol=1e-12)
    _directional_check(g_m, ct_m, mono_np, (q, k, v, bias))
    _directional_check(g_c, ct_c, chunk_np, (q, k, v, bias, cq, ck))


def test_hard_forms_match_the_search_oracle():
  q, k, v, bias = _inputs(1)
  # about half the p above 0.5; head 0 runs off the end at step 2 (p = 0 there)
  bias = (bias + 0.5).at[0, 0, 2, :].set(-jnp.inf)
  lengths = jnp.asarray(LENGTHS)
  e = np_logits(q, k, 1.0, bias)
  vis = np_visible(LENGTHS, e.shape)
  p = np.where(vis, sigmoid(e), 0.0)
  kw = dict(scale=1.0, key_value_seq_lengths=lengths, return_state=True)

  @jax.jit
  def run(q, k, v, bias):
    return (hard_monotonic_attention(q, k, v, bias, **kw),
            chunkwise_attention(q, k, v, bias, chunk_size=3, hard=True, **kw),
            local_window_attention(q, k, v, bias, window=(1, 2), hard=True, **kw),
            segmental_attention(q, k, v, bias, **kw))

  (out, t), chunk, local, seg = run(q, k, v, bias)
  t_np = np_positions(p, vis, 0)
  np.testing.assert_array_equal(np.asarray(t), t_np)
  assert np.all(np.diff(t_np, axis=-1) >= 0) and 0 < t_np.max() and t_np.min() < S
  assert np.all(t_np[:, 0, 2:] == S)  # ran off the end (and read zeros from then on)
  onehot = (np.arange(S) == t_np[..., None]).astype(float)
  np.testing.assert_allclose(np.asarray(out), np_attend(onehot, v), atol=1e-6)  # a copy

  # float32 softmax over <= 7 keys: ~10 roundoffs of 2^-24 on weights and outputs ~1
  for (out, t), left, right in ((chunk, 2, 0), (local, 1, 2)):
    np.testing.assert_array_equal(np.asarray(t), t_np)
    want = np_attend(np_hard_weights(t_np, e, vis, left, right), v)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6)

  out, t = seg
  t_seg = np_positions(p, vis, -1)
  np.testing.assert_array_equal(np.asarray(t), t_seg)
  want = np_attend(np_hard_weights(t_seg, e, vis, 0, 0, segment=True, t0=-1), v)
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-6)


def _binary_bias(seed):
  """Energies +-inf: p exactly 0 or 1 (sigmoid(+-inf))."""
  hit = jax.random.bernoulli(jax.random.key(seed), 0.3, (B, N, T, S))
  return jnp.where(hit, jnp.inf, -jnp.inf)


def test_hard_equals_expected_when_p_is_zero_or_one():
  q, k, v, _ = _inputs(2)
  bias = _binary_bias(2)
  cb = jnp.zeros((T, S))
  kw = dict(scale=1.0, key_value_seq_lengths=jnp.asarray(LENGTHS))
  alpha = jnp.array([1.2, 1.5, 2.0, 3.0])[:, None, None]  # entmax's alpha per head [N, 1, 1]

  @jax.jit
  def both(q, k, v, bias):
    pairs = [(monotonic_attention(q, k, v, bias, **kw), hard_monotonic_attention(q, k, v, bias, **kw))]
    for f in (functools.partial(chunkwise_attention, chunk_size=3),
              functools.partial(local_window_attention, window=1, normalizer="entmax",
                                normalizer_params={"alpha": alpha})):
      pairs.append((f(q, k, v, bias, chunk_bias=cb, **kw),
                    f(q, k, v, bias, chunk_bias=cb, hard=True, **kw)))
    return pairs

  for i, (expected, hard) in enumerate(both(q, k, v, bias)):
    # the alignment is exactly one-hot: the expectation is the hard result up to the
    # float32 roundoff of the window weights (~5 * 2^-24)
    np.testing.assert_allclose(np.asarray(expected), np.asarray(hard), atol=1e-6, err_msg=str(i))
    assert float(jnp.max(jnp.abs(hard))) > 0


def test_chunk_size_one_is_hard_monotonic_attention():
  q, k, v, bias = _inputs(3)
  kw = dict(key_value_seq_lengths=jnp.asarray(LENGTHS))

  @jax.jit
  def run(q, k, v, bias):
    return (chunkwise_attention(q, k, v, bias, chunk_size=1, hard=True, **kw),
            hard_monotonic_attention(q, k, v, bias, **kw),
            chunkwise_attention(q, k, v, bias, chunk_size=1, **kw),
            monotonic_attention(q, k, v, bias, **kw))

  ch, hm, ce, me = run(q, k, v, bias)
  np.testing.assert_array_equal(np.asarray(ch), np.asarray(hm))
  # expected: beta = alpha * (softmax over one key = 1): 2 roundoffs of 2^-24
  np.testing.assert_allclose(np.asarray(ce), np.asarray(me), atol=1e-6)


DECODE_CASES = (
    monotonic_attention,
    hard_monotonic_attention,
    functools.partial(chunkwise_attention, chunk_size=2),
    functools.partial(local_window_attention, window=1, hard=True),
    segmental_attention,
)


def test_decode_steps_equal_the_full_call():
  q, k, v, bias = _inputs(4)
  bias = bias + 0.5
  kw = dict(key_value_seq_lengths=jnp.asarray(LENGTHS), return_state=True)

  @jax.jit
  def full(q, bias):
    return [f(q, k, v, bias, **kw)[0] for f in DECODE_CASES]

  @jax.jit
  def steps(q, bias):
    def body(states, x):
      qi, bi = x
      res = [f(qi[:, None], k, v, bi[:, :, None], initial_state=st, **kw)
             for f, st in zip(DECODE_CASES, states, strict=True)]
      return [st[:, :, -1] for _, st in res], [out[:, 0] for out, _ in res]

    init = [jnp.tile(jnp.eye(1, S), (B, N, 1)), jnp.zeros((B, N), jnp.int32),
            jnp.tile(jnp.eye(1, S), (B, N, 1)), jnp.zeros((B, N), jnp.int32),
            jnp.full((B, N), -1, jnp.int32)]
    _, outs = lax.scan(body, init, (jnp.moveaxis(q, 1, 0), jnp.moveaxis(bias, 2, 0)))
    return [jnp.moveaxis(o, 0, 1) for o in outs]

  for i, (a, b) in enumerate(zip(full(q, bias), steps(q, bias), strict=True)):
    # the same operations on the same numbers, one step at a time
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, err_msg=str(i))


def test_key_lengths_and_mask_delete_the_keys():
  q, k, v, bias = _inputs(5)
  Lb = 4
  lengths = jnp.array([S, Lb])
  mask = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
  chunk = functools.partial(chunkwise_attention, chunk_size=3)
  zero_len = jnp.array([0, S])

  def loss(q, k, v, bias):
    return jnp.sum(chunk(q, k, v, bias, key_value_seq_lengths=zero_len) ** 2)

  @jax.jit
  def run(q, k, v, bias):
    res = [(f(q, k, v, bias, key_value_seq_lengths=lengths),
            f(q[1:], k[1:, :Lb], v[1:, :Lb], bias[:, :, :, :Lb]))
           for f in (monotonic_attention, chunk)]
    return res, chunk(q, k, v, bias, mask), jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(
        q, k, v, bias)

  res, with_mask, (value, grads) = run(q, k, v, bias)
  # the same operations on the first Lb keys (the others contribute exact zeros)
  for with_len, cut in res:
    np.testing.assert_allclose(np.asarray(with_len[1:]), np.asarray(cut), atol=1e-6)
  np.testing.assert_allclose(np.asarray(with_mask), np.asarray(res[1][0]), atol=1e-6)
  # no visible key in batch 0: zeros there, with finite gradients
  assert float(jnp.max(jnp.abs(grads[0][0]))) == 0.0 and float(value) > 0
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))


def test_windows_give_exact_zeros_and_an_infinite_window_is_global_attention():
  q, k, _ = make_qkv(6, B=1, T=3, S=S, N=2, K=2, H=4)
  eye = jnp.broadcast_to(jnp.eye(S)[None, :, None, :], (1, S, 2, S))  # output = weights
  start = jnp.full((1, 2, 3, S), -jnp.inf).at[..., 2].set(jnp.inf)  # t_i = 2 every step
  zero = jnp.zeros((3, S))

  @jax.jit
  def run(q, k):
    return (local_window_attention(q, k, eye, start, window=1, chunk_bias=zero, hard=True,
                                   normalizer="sparsemax"),
            local_window_attention(q, k, eye, start, window=S, chunk_bias=zero, hard=True),
            dot_product_attention(q, k, eye))

  sparse, wide, dense = run(q, k)
  outside = np.ones(S, bool)
  outside[1:4] = False
  assert np.all(np.asarray(sparse)[..., outside] == 0.0)
  np.testing.assert_allclose(np.asarray(jnp.sum(sparse, -1)), 1.0, atol=1e-6)
  # softmax over the same 7 logits: a few roundoffs of 2^-24
  np.testing.assert_allclose(np.asarray(wide), np.asarray(dense), atol=1e-6)


def test_bf16_computes_in_float32_vmap_and_gqa():
  q, k, v, bias = _inputs(7, jnp.bfloat16)
  lengths = jnp.asarray(LENGTHS)
  fns = (functools.partial(chunkwise_attention, chunk_size=2),
         functools.partial(local_window_attention, window=1, hard=True))

  @jax.jit
  def run(q, k, v, bias):
    f32 = [a.astype(jnp.float32) for a in (q, k, v, bias)]
    low = [f(q, k, v, bias, key_value_seq_lengths=lengths) for f in fns]
    high = [f(*f32, key_value_seq_lengths=lengths) for f in fns]
    chunk = fns[0]
    mapped = jax.vmap(lambda q, k, v: chunk(q[None], k[None], v[None], f32[3])[0])(*f32[:3])
    rep = chunk(f32[0], jnp.repeat(f32[1], G, axis=2), jnp.repeat(f32[2], G, axis=2), f32[3])
    return low, high, mapped, rep, chunk(*f32)

  low, high, mapped, rep, batched = run(q, k, v, bias)
  for out, want in zip(low, high, strict=True):
    assert out.dtype == jnp.bfloat16
    # one bf16 rounding of the output (2^-8 relative on |out| <~ 3) after a float32
    # computation on the same (bf16-representable) inputs
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=3 * 2**-8,
                               rtol=2**-8)
  np.testing.assert_allclose(np.asarray(mapped), np.asarray(batched), atol=1e-6)
  # GQA: query head n reads key/value head n // G, as repeating the key/value heads
  np.testing.assert_allclose(np.asarray(rep), np.asarray(batched), atol=1e-6)


def test_bad_input_is_a_clear_error():
  q, k, v, _ = _inputs(9)
  check_raises(
      ("must lie in \\[0, 1\\]", lambda: monotonic_attention_probs(jnp.full((2, 3), 1.5))),
      ("`method` must be one of", lambda: monotonic_attention_probs(jnp.ones((2, 3)), method="x")),
      ("`where` must be boolean", lambda: monotonic_attention_probs(jnp.ones((2, 3)),
                                                                  where=jnp.ones((2, 3)))),
      ("\\[..., T, S\\]", lambda: monotonic_attention_probs(jnp.ones(3))),
      ("`previous_alignment`", lambda: monotonic_attention_probs(jnp.ones((2, 3)), jnp.ones(4))),
      ("`query` must have shape", lambda: monotonic_attention(q[0], k, v)),
      ("multiple of the number", lambda: monotonic_attention(q[:, :, :3], k, v)),
      ("`chunk_size` must be an int >= 1", lambda: chunkwise_attention(q, k, v, chunk_size=0)),
      ("`window` must be an int >= 0", lambda: local_window_attention(q, k, v, window=-1)),
      ("`window` must be an int or a pair", lambda: local_window_attention(q, k, v, window=(1,))),
      ("`threshold` must be in", lambda: hard_monotonic_attention(q, k, v, threshold=0.0)),
      ("`initial_state` of the hard form", lambda: hard_monotonic_attention(
          q, k, v, initial_state=jnp.zeros((B, N)))),
      ("`initial_state` of the expected form", lambda: monotonic_attention(
          q, k, v, initial_state=jnp.zeros((B, N), jnp.int32))),
      ("`chunk_key`", lambda: chunkwise_attention(q, k, v, chunk_size=2, chunk_key=k[:, :3])),
      ("`hard` must be a bool", lambda: local_window_attention(q, k, v, window=1, hard=1)),
  )
  with pytest.raises(KeyError, match="unknown normalizer"):
    local_window_attention(q, k, v, window=1, normalizer="nope")


# ----------------------------------------------------------------------------- sweeps


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("w", [1, 2, 5, 9])
def test_sweep_window_sizes_values_and_gradients_float64(seed, w):
  scale = 1 / np.sqrt(H)

  def local(q, k, v, b):
    return local_window_attention(q, k, v, b, window=(w, w // 2),
                                  key_value_seq_lengths=jnp.asarray(LENGTHS))

  def local_np(q, k, v, b):
    return np_expected(q, k, v, b, LENGTHS, scale, "window", (q, k, b), left=min(w, S - 1),
                       right=min(w // 2, S - 1))

  with jax.enable_x64(True):
    q, k, v, bias = (a.astype(jnp.float64) for a in _inputs(seed))
    got = chunkwise_attention(q, k, v, bias, chunk_size=w, key_value_seq_lengths=jnp.asarray(LENGTHS))
    want = np_expected(q, k, v, bias, LENGTHS, scale, "window", (q, k, bias),
                       left=min(w - 1, S - 1), right=0)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-12)
    out, grads, ct = jax.jit(lambda *a: _value_and_vjp(local, a))(q, k, v, bias)
    np.testing.assert_allclose(np.asarray(out), local_np(q, k, v, bias), atol=1e-12)
    _directional_check(grads, ct, local_np, (q, k, v, bias), seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("normalizer", ["sparsemax", "softpick", "ssmax", "relu", "softmax_1"])
def test_sweep_normalizers_hard_equals_expected_for_binary_p(normalizer):
  q, k, v, _ = _inputs(11)
  bias = _binary_bias(11)
  kw = dict(window=(1, 1), chunk_bias=jnp.zeros((T, S)), normalizer=normalizer,
            key_value_seq_lengths=jnp.asarray(LENGTHS))
  hard = local_window_attention(q, k, v, bias, hard=True, **kw)
  expected = local_window_attention(q, k, v, bias, **kw)
  np.testing.assert_allclose(np.asarray(expected), np.asarray(hard), atol=1e-6)
  assert float(jnp.max(jnp.abs(hard))) > 0


@pytest.mark.slow
def test_infinite_window_expected_form_is_global_attention():
  q, k, _ = make_qkv(6, B=1, T=3, S=S, N=2, K=2, H=4)
  eye = jnp.broadcast_to(jnp.eye(S)[None, :, None, :], (1, S, 2, S))
  start = jnp.full((1, 2, 3, S), -jnp.inf).at[..., 2].set(jnp.inf)
  wide = local_window_attention(q, k, eye, start, window=S, chunk_bias=jnp.zeros((3, S)))
  np.testing.assert_allclose(np.asarray(wide), np.asarray(dot_product_attention(q, k, eye)),
                             atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_queries_or_keys_give_zeros(shape):
  Tq, Sk = shape
  q, k, v = jnp.ones((1, Tq, 2, 3)), jnp.ones((1, Sk, 1, 3)), jnp.ones((1, Sk, 1, 2))
  for f in (monotonic_attention, hard_monotonic_attention, segmental_attention,
            functools.partial(chunkwise_attention, chunk_size=2),
            functools.partial(local_window_attention, window=1, hard=True)):
    out = f(q, k, v)
    assert out.shape == (1, Tq, 2, 2) and not np.any(np.asarray(out))


# By default test_hard_forms_match_the_search_oracle and the expected-form tests cover this:
# tests/conftest.py runs tests/attention under numpy_rank_promotion("raise") (it failed there on
# the old code); this explicit check holds without the guard.
@pytest.mark.slow
def test_every_form_needs_no_implicit_rank_promotion():
  """Issue 37: the positions [S] met the previous positions [B, N, 1] (the hard scan, the
  hard windows and segments) and the window offsets [W] met the positions [S, 1] (the
  expected windows) by implicit rank promotion: a ValueError under
  jax.numpy_rank_promotion("raise"). Every form gives what it gives without the setting."""
  q, k, v, bias = _inputs(1)

  @jax.jit  # one program per setting (the setting is part of jit's cache key)
  def run(q, k, v, bias):
    out = [monotonic_attention(q, k, v, bias), hard_monotonic_attention(q, k, v, bias),
           segmental_attention(q, k, v, bias)]
    for hard in (False, True):
      out += [chunkwise_attention(q, k, v, bias, chunk_size=3, hard=hard),
              local_window_attention(q, k, v, bias, window=(1, 1), hard=hard)]
    return out

  want = run(q, k, v, bias)
  with jax.numpy_rank_promotion("raise"):
    got = run(q, k, v, bias)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
