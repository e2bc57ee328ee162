"""A49 attention controls (no_mixing_attention, fixed_map_attention, embedding_qk_attention)
against numpy float64 oracles written from the formulas: values, gradients, causal masks
(a perturbed future value never reaches an earlier output), bf16 and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js

B, T, N, K, H = 2, 6, 4, 2, 3
RNG = np.random.default_rng(49)
SCORES = RNG.standard_normal((N, T, T)).astype(np.float32)
VALUE = RNG.standard_normal((B, T, K, H)).astype(np.float32)
QE = RNG.standard_normal((T, N, H)).astype(np.float32)
KE = RNG.standard_normal((T, K, H)).astype(np.float32)
G = RNG.standard_normal((B, T, N, H))  # weights of the scalar loss whose gradient is checked

fixed = jax.jit(js.attention.fixed_map_attention, static_argnames=("is_causal", "normalizer"))
embedded = jax.jit(js.attention.embedding_qk_attention,
                   static_argnames=("is_causal", "normalizer", "scale"))


# ------------------------------------------------------------------------- float64 oracles


def o_weights(scores, causal, normalizer="softmax", mask=None):
  """Row by row: softmax or sparsemax of the visible scores, 0 elsewhere."""
  s = np.asarray(scores, np.float64)
  n_, t_, s_ = s.shape
  w = np.zeros(s.shape)
  for n in range(n_):
    for i in range(t_):
      vis = [j for j in range(s_) if (j <= i or not causal)
             and (mask is None or mask[n, i, j])]
      if not vis:
        continue
      z = s[n, i, vis]
      if normalizer == "softmax":
        p = np.exp(z - z.max())
        w[n, i, vis] = p / p.sum()
      else:  # sparsemax: the Euclidean projection onto the simplex
        u = np.sort(z)[::-1]
        cs = np.cumsum(u)
        r = np.arange(1, len(u) + 1)
        k = r[1 + r * u > cs].max()
        w[n, i, vis] = np.maximum(z - (cs[k - 1] - 1) / k, 0.0)
  return w


def o_apply(w, value):
  """o[b, i, n] = sum_j w[n, i, j] v[b, j, n // G] (GQA)."""
  v = np.asarray(value, np.float64)
  rep = np.repeat(v, w.shape[0] // v.shape[-2], axis=-2)
  return np.einsum("nij,bjnh->binh", w, rep)


def o_embedding_scores(qe, ke, scale):
  q = np.asarray(qe, np.float64)
  k = np.repeat(np.asarray(ke, np.float64), q.shape[1] // ke.shape[1], axis=1)
  return scale * np.einsum("ind,jnd->nij", q, k)


# float32: a softmax and a weighted sum over <= 6 keys of O(1) values (~20 roundings of
# 2^-24 each): 1e-5 absolute and relative is ample.
TOL = {"rtol": 1e-5, "atol": 1e-5}


# ---------------------------------------------------------------------------------- values


def test_no_mixing_is_each_positions_own_value_with_gqa_heads():
  out = js.attention.no_mixing_attention(VALUE, num_heads=N)
  want = np.repeat(VALUE, N // K, axis=-2)  # head n reads value head n // 2
  assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(js.attention.no_mixing_attention(VALUE), VALUE)


@pytest.mark.parametrize("normalizer, causal", [
    ("softmax", True), ("sparsemax", False),
    *(pytest.param(n, c, marks=pytest.mark.slow) for n, c in (("softmax", False),
                                                              ("sparsemax", True)))])
def test_fixed_map_matches_the_oracle_per_head(normalizer, causal):
  out = fixed(SCORES, VALUE, is_causal=causal, normalizer=normalizer)
  assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, o_apply(o_weights(SCORES, causal, normalizer), VALUE), **TOL)


@pytest.mark.slow
def test_fixed_map_zero_scores_is_the_causal_average_and_one_map_serves_every_head():
  out = fixed(np.zeros((T, T), np.float32), VALUE, is_causal=True)   # [T, S]: one map
  want = np.cumsum(VALUE.astype(np.float64), axis=1) / np.arange(1, T + 1)[None, :, None, None]
  assert out.shape == (B, T, K, H)
  np.testing.assert_allclose(out, want, **TOL)


@pytest.mark.slow
def test_fixed_map_mask_and_a_row_with_no_visible_key():
  mask = RNG.random((N, T, T)) < 0.6
  mask[1, 3] = False  # row 3 of head 1 sees nothing: zeros
  out = jax.jit(js.attention.fixed_map_attention)(SCORES, VALUE, mask=mask)
  np.testing.assert_allclose(out, o_apply(o_weights(SCORES, True, mask=mask), VALUE), **TOL)
  np.testing.assert_array_equal(np.asarray(out)[:, 3, 1], 0.0)


@pytest.mark.slow
def test_fixed_map_leading_axes_are_rows_of_one_shared_map():
  v5 = RNG.standard_normal((3, B, T, K, H)).astype(np.float32)
  out = fixed(SCORES, v5, is_causal=True)
  w = o_weights(SCORES, True)
  for a in range(3):
    np.testing.assert_allclose(out[a], o_apply(w, v5[a]), **TOL)


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_embedding_qk_matches_the_oracle(causal):
  out = embedded(QE, KE, VALUE, is_causal=causal, scale=0.7)
  want = o_apply(o_weights(o_embedding_scores(QE, KE, 0.7), causal), VALUE)
  assert out.shape == (B, T, N, H)
  np.testing.assert_allclose(out, want, **TOL)


@pytest.mark.slow
def test_embedding_qk_default_scale_is_one_over_sqrt_h():
  default = jax.jit(js.attention.embedding_qk_attention)(QE, KE, VALUE)
  want = o_apply(o_weights(o_embedding_scores(QE, KE, H ** -0.5), True), VALUE)
  np.testing.assert_allclose(default, want, **TOL)


# ------------------------------------------------------------------------------- gradients


def o_grads(scores, value, causal):
  """d/dS and d/dV of L = sum(G * o) for softmax: dW_ij = g_i . v_j,
  dS = W * (dW - sum_k W_ik dW_ik), dV_j = sum_i W_ij g_i (summed over a GQA group)."""
  w = o_weights(scores, causal)
  v = np.repeat(np.asarray(value, np.float64), N // K, axis=-2)
  dw = np.einsum("binh,bjnh->nij", G, v)
  ds = w * (dw - np.sum(w * dw, axis=-1, keepdims=True))
  dv = np.einsum("nij,binh->bjnh", w, G)
  dv = dv.reshape(B, T, K, N // K, H).sum(axis=3)
  return ds, dv


def test_fixed_map_gradients_match_the_oracle_and_the_future_gets_none():
  grad = jax.jit(jax.grad(lambda s, v: jnp.sum(G * js.attention.fixed_map_attention(s, v)),
                          argnums=(0, 1)))
  ds, dv = grad(SCORES, VALUE)
  want_ds, want_dv = o_grads(SCORES, VALUE, True)
  np.testing.assert_allclose(ds, want_ds, **TOL)
  np.testing.assert_allclose(dv, want_dv, **TOL)
  assert np.all(np.asarray(ds)[:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)


def test_embedding_qk_gradient_through_the_embeddings():
  def loss(qe, ke):
    return jnp.sum(G * js.attention.embedding_qk_attention(qe, ke, VALUE, scale=0.5))

  dq, dk = jax.jit(jax.grad(loss, argnums=(0, 1)))(QE, KE)
  ds, _ = o_grads(o_embedding_scores(QE, KE, 0.5), VALUE, True)
  k_rep = np.repeat(KE.astype(np.float64), N // K, axis=1)
  want_dq = 0.5 * np.einsum("nij,jnd->ind", ds, k_rep)
  want_dk = (0.5 * np.einsum("nij,ind->jnd", ds, QE.astype(np.float64))
             ).reshape(T, K, N // K, H).sum(axis=2)
  np.testing.assert_allclose(dq, want_dq, **TOL)
  np.testing.assert_allclose(dk, want_dk, **TOL)


# --------------------------------------------------------------------- causality and dtypes


@pytest.mark.parametrize("fn", ["fixed", pytest.param("embedded", marks=pytest.mark.slow),
                                "none"])
def test_a_future_value_never_reaches_an_earlier_output(fn):
  call = {"fixed": lambda v: fixed(SCORES, v, is_causal=True),
          "embedded": lambda v: embedded(QE, KE, v, is_causal=True, scale=1.0),
          "none": lambda v: js.attention.no_mixing_attention(v, num_heads=N)}[fn]
  changed = VALUE.copy()
  changed[:, 4] += 100.0
  a, b = np.asarray(call(VALUE)), np.asarray(call(changed))
  np.testing.assert_array_equal(a[:, :4], b[:, :4])
  seen = np.abs(a - b).max(axis=(0, 2, 3))  # per position
  if fn == "none":  # no mixing: only position 4 itself sees its value
    assert seen[4] > 1.0 and seen[5] == 0
  else:
    assert np.min(seen[4:]) > 1.0  # the mixing ones see it from 4 on


def test_bf16_values_compute_in_float32_and_keep_their_dtype():
  v16 = jnp.asarray(VALUE, jnp.bfloat16)
  want = o_apply(o_weights(SCORES, True), np.asarray(v16, np.float64))
  out = fixed(jnp.asarray(SCORES, jnp.bfloat16), v16, is_causal=True)
  assert out.dtype == jnp.bfloat16
  # bf16 scores (rounded by 2^-9 relative: logits of |s| < 4 move by < 0.01, so weights by
  # < 1 %) and the bf16 output (2^-9): 3e-2 on O(1) outputs.
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=3e-2, atol=3e-2)
  mixed = fixed(SCORES, v16, is_causal=True)  # float32 map: the output promotes to float32
  assert mixed.dtype == jnp.float32
  np.testing.assert_allclose(mixed, want, **TOL)
  assert js.attention.no_mixing_attention(v16).dtype == jnp.bfloat16


def test_float64_stays_float64():
  with jax.enable_x64(True):
    out = jax.jit(js.attention.fixed_map_attention)(SCORES.astype(np.float64),
                                                    VALUE.astype(np.float64))
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, o_apply(o_weights(SCORES, True), VALUE), rtol=1e-12)


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, match", [
    (lambda: js.attention.no_mixing_attention(VALUE, num_heads=3), r"multiple of the 2 heads"),
    (lambda: js.attention.no_mixing_attention(VALUE, num_heads=0), r"positive int"),
    (lambda: js.attention.no_mixing_attention(VALUE[0, 0]), r"\[\.\.\., S, K, Hv\]"),
    (lambda: js.attention.fixed_map_attention(SCORES[None], VALUE), r"no batch axis"),
    (lambda: js.attention.fixed_map_attention(SCORES[:, :, :4], VALUE), r"4 keys .* 6 pos"),
    (lambda: js.attention.fixed_map_attention(SCORES[:3], VALUE), r"multiple of the 2"),
    (lambda: js.attention.fixed_map_attention(SCORES, VALUE, mask=np.ones((B, N, T, T), bool)),
     r"`mask` must broadcast to \[N, T, S\]"),
    (lambda: js.attention.embedding_qk_attention(QE[None], KE, VALUE), r"no batch axis"),
    (lambda: js.attention.embedding_qk_attention(QE, KE[:4], VALUE), r"positions and heads"),
    (lambda: js.attention.embedding_qk_attention(QE[..., :2], KE, VALUE), r"one width H"),
    (lambda: js.attention.fixed_map_attention(SCORES.astype(np.complex64), VALUE), r"real"),
])
def test_bad_input_raises_naming_the_argument(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call()


@pytest.mark.slow
def test_the_chunked_implementation_gives_the_same_maps():
  out = js.attention.fixed_map_attention(SCORES, VALUE, implementation="xla_chunked")
  np.testing.assert_allclose(out, o_apply(o_weights(SCORES, True), VALUE), **TOL)
  out = js.attention.embedding_qk_attention(QE, KE, VALUE, implementation="xla_chunked")
  want = o_apply(o_weights(o_embedding_scores(QE, KE, H ** -0.5), True), VALUE)
  np.testing.assert_allclose(out, want, **TOL)
