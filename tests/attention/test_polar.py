"""A20 Polar attention [R]: against a float64 NumPy reference of the reconstruction, and the
design-level properties: unit direction, count-blindness under duplicated keys/values,
magnitude in [0, 1] (sigma(b) at the null, sigma(a log n + b) for one match), finite
gradients, masks and empty rows, bf16, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxsoft.attention import polar_attention
from tests.helpers import check_raises, make_qkv


def reference(q, k, v, *, a=1.0, b=0.0, eps=1e-6, is_causal=False, q_lengths=None):
  """float64 NumPy: softmax(q k^T / sqrt(H)) over the visible keys, then u, PR, m, o."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  out = np.zeros((B, T, N, v.shape[-1]))
  mag = np.zeros((B, T, N))
  for bb in range(B):
    for n in range(N):
      kh = n // (N // K)
      for i in range(T):
        vis = np.ones(S, bool)
        if is_causal:
          vis &= np.arange(S) <= i
        if q_lengths is not None and i >= q_lengths[bb]:
          vis[:] = False
        if not vis.any():
          continue
        z = q[bb, i, n] @ k[bb, :, kh].T / np.sqrt(H)
        e = np.where(vis, np.exp(z - z[vis].max()), 0.0)
        w = e / e.sum()
        s = w @ v[bb, :, kh]
        u = s / max(np.linalg.norm(s), eps)
        pr = w.sum() ** 2 / np.sum(w * w)
        a_n = np.broadcast_to(a, (N,))[n]
        m = 1.0 / (1.0 + np.exp(-(a_n * (np.log(vis.sum()) - np.log(pr)) + b)))
        out[bb, i, n], mag[bb, i, n] = m * u, m
  return out, mag


def test_matches_reference_causal_lengths_gqa():
  q, k, v = make_qkv(0, 2, 6, N=4, K=2, H=3, Hv=5)
  lengths = np.array([6, 4])
  a, b = np.array([0.5, 1.0, 2.0, 1.5]), -0.7
  out, u, m, pr = polar_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                  magnitude_slope=a, magnitude_bias=b, return_parts=True)
  ref_out, ref_m = reference(q, k, v, a=a, b=b, is_causal=True, q_lengths=lengths)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m, ref_m, rtol=1e-5, atol=1e-6)
  norms = np.linalg.norm(np.asarray(u), axis=-1)
  np.testing.assert_allclose(norms[0], 1.0, rtol=1e-5)  # every row of batch 0 sees keys
  np.testing.assert_array_equal(norms[1, 4:], 0.0)  # past the length: u = m = o = 0
  np.testing.assert_array_equal(np.asarray(m)[1, 4:], 0.0)
  np.testing.assert_array_equal(np.asarray(out)[1, 4:], 0.0)
  assert np.all((np.asarray(m) >= 0) & (np.asarray(m) <= 1))
  assert np.all(np.asarray(pr)[0] >= 1 - 1e-5)


# By default test_matches_reference_causal_lengths_gqa covers this: tests/conftest.py runs
# tests/attention under numpy_rank_promotion("raise") (it failed there on the old code); this
# explicit check holds without the guard.
@pytest.mark.slow
def test_per_head_magnitude_needs_no_implicit_rank_promotion():
  """Issue 37: per-head slopes [N, 1] met the rows [B, N, T] by implicit rank promotion, a
  ValueError under jax.numpy_rank_promotion("raise")."""
  q, k, v = make_qkv(1, 2, 6, N=4, K=2, H=3, Hv=5)
  a, b = np.array([0.5, 1.0, 2.0, 1.5]), -0.7
  with jax.numpy_rank_promotion("raise"):
    out = polar_attention(q, k, v, is_causal=True, magnitude_slope=a, magnitude_bias=b)
  ref_out, _ = reference(q, k, v, a=a, b=b, is_causal=True)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)


def test_count_blind_under_duplication():
  q, k, v = make_qkv(1, 1, 5, S=7, N=2, K=1, H=4)
  k2, v2 = jnp.concatenate([k, k], axis=1), jnp.concatenate([v, v], axis=1)
  f = jax.jit(functools.partial(polar_attention, return_parts=True))
  parts, parts2 = f(q, k, v), f(q, k2, v2)
  for a, b in zip(parts[:3], parts2[:3], strict=True):  # o, u and m unchanged
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(parts2[3], 2 * parts[3], rtol=1e-5)  # PR doubles with n
  # the output of ordinary softmax attention is count-blind too, the magnitude is not trivial
  assert float(jnp.min(parts[2])) > 0.5 and float(jnp.max(parts[2])) < 1.0


def test_magnitude_null_and_single_match():
  _, k, v = make_qkv(2, 1, 1, S=8, N=1, K=1, H=4)
  q = jnp.zeros((1, 1, 1, 4))  # all logits equal: uniform weights, PR = n (the null)
  f = jax.jit(functools.partial(polar_attention, return_parts=True),
              static_argnames="normalizer")
  _, _, m, pr = f(q, k, v, magnitude_bias=-3.0)
  np.testing.assert_allclose(pr, 8.0, rtol=1e-6)
  np.testing.assert_allclose(m, jax.nn.sigmoid(-3.0), rtol=1e-6)
  # sparsemax with one dominant key: one-hot weights, PR = 1, m = sigmoid(a log n + b)
  q = 50.0 * k[:, 2:3]
  j = int(jnp.argmax(k[0, :, 0] @ q[0, 0, 0]))
  _, u, m, pr = f(q, k, v, normalizer="sparsemax", magnitude_slope=2.0, magnitude_bias=-1.0)
  np.testing.assert_allclose(pr, 1.0, rtol=1e-6)
  np.testing.assert_allclose(m, jax.nn.sigmoid(2.0 * np.log(8.0) - 1.0), rtol=1e-5)
  np.testing.assert_allclose(u[0, 0, 0], v[0, j, 0] / jnp.linalg.norm(v[0, j, 0]), rtol=1e-5)


def test_gradients_float64_and_masks():
  with jax.enable_x64(True):
    q, k, v = make_qkv(3, 1, 4, S=5, N=2, K=1, H=3, dtype=jnp.float64)
    mask = jnp.ones((4, 5), bool).at[1].set(False).at[2, 3:].set(False)  # row 1: no key
    f = jax.jit(functools.partial(polar_attention, mask=mask))
    out = f(q, k, v)
    np.testing.assert_array_equal(out[0, 1], 0.0)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)
    np.testing.assert_array_equal(g[0][0, 1], 0.0)  # the empty row gets no gradient
    # the masked query row is excluded (d|o|/dq has a kink nowhere else)
    check_grads(lambda q, k, v: f(q, k, v)[:, jnp.array([0, 2, 3])], (q, k, v), order=1,
                modes=["rev"], atol=1e-5, rtol=1e-5)
    ga = jax.jit(jax.grad(lambda a, b: jnp.sum(polar_attention(
        q, k, v, magnitude_slope=a, magnitude_bias=b)), argnums=(0, 1)))(1.0, 0.0)
    assert all(np.isfinite(float(x)) and float(x) != 0 for x in ga)


def test_bf16_zero_values_and_extremes():
  q, k, v = make_qkv(4, 1, 5, N=2, K=1, H=4)
  out = jax.jit(polar_attention)(  # jitted: one program instead of op-by-op dispatch
      q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), reference(q, k, v)[0], atol=3e-2)
  g = jax.jit(jax.grad(lambda q, v: jnp.sum(polar_attention(q, k, v)), argnums=(0, 1)))(
      1e6 * q, jnp.zeros_like(v))  # saturated weights, s = 0: u = 0, finite gradients
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)
  np.testing.assert_array_equal(polar_attention(q, k, jnp.zeros_like(v)), 0.0)


def test_bad_input():
  q, k, v = make_qkv(5, 1, 3, N=2, K=1, H=2)
  check_raises(
      ("eps", lambda: polar_attention(q, k, v, eps=0.0)),
      ("magnitude_slope", lambda: polar_attention(q, k, v, magnitude_slope=0.0)),
      ("magnitude_slope", lambda: polar_attention(q, k, v, magnitude_slope=jnp.ones(3))),
      ("magnitude_bias", lambda: polar_attention(q, k, v, magnitude_bias=np.inf)),
      ("return_parts", lambda: polar_attention(q, k, v, return_parts=1)),
      ("implementation", lambda: polar_attention(q, k, v, implementation="xla")),
      ("query", lambda: polar_attention(q[0, 0], k, v)),
  )


@pytest.mark.slow
def test_other_normalizers_count_blind_direction():
  """Count-blind for normalizers whose weights do not change shape with n: sigmoid with a
  fixed bias (duplicated keys keep their weights) and relu (whose x / n halves them)."""
  q, k, v = make_qkv(6, 1, 4, S=6, N=2, K=1, H=4)
  k2, v2 = jnp.concatenate([k, k], axis=1), jnp.concatenate([v, v], axis=1)
  for name, params in (("sigmoid", {"bias": -1.0}), ("relu", None)):
    kw = dict(normalizer=name, normalizer_params=params, return_parts=True)
    a = polar_attention(q, k, v, **kw)
    b = polar_attention(q, k2, v2, **kw)
    for x, y in zip(b[:3], a[:3], strict=True):  # o, u, m; PR doubles with n
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b[3], 2 * a[3], rtol=1e-4)


@pytest.mark.slow
def test_length_dependent_normalizers_are_not_count_blind():
  """sigmoid's default bias -log n and sparsemax's threshold change the shape of the
  weights when every key is repeated: the docstring's count-blindness does not cover
  them, and the direction moves."""
  q, k, v = make_qkv(6, 1, 4, S=6, N=2, K=1, H=4)
  k2, v2 = jnp.concatenate([k, k], axis=1), jnp.concatenate([v, v], axis=1)
  for name in ("sigmoid", "sparsemax"):
    a = polar_attention(q, k, v, normalizer=name, return_parts=True)
    b = polar_attention(q, k2, v2, normalizer=name, return_parts=True)
    assert float(jnp.max(jnp.abs(b[1] - a[1]))) > 1e-3
