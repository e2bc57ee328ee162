"""A25 infsa_attention (jaxsoft/attention/_infinite.py).

The jaxsoft.nn module that holds the learned discount is tested in tests/nn/test_infinite.py.

Oracles: the Neumann kernel by numpy.linalg.solve on a masked softmax map (float64), exact
reductions (gamma = 0 is attention), closed forms (row-stochastic kernels, the truncation
bound), causality by perturbing the future, and float64 finite differences.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention, infsa_attention, linear_infsa_attention
from tests.attention.reference import (
    assert_masked_row_is_zero,
    np_apply,
    np_softmax_map,
    np_visible,
    rand_mask,
)
from tests.helpers import check_raises, make_qkv

B, T, N, K, H, HV = 2, 5, 4, 2, 3, 2


def _np_infsa(q, k, v, gamma, vis, normalize=False):
  a = np_softmax_map(q, k, vis)
  g = np.broadcast_to(np.asarray(gamma, np.float64), (N,))[None, :, None, None]
  kern = np.linalg.solve(np.eye(a.shape[-1]) - g * a, a)  # (I - gamma A)^-1 A
  kern = ((1 - g) if normalize else g) * kern
  return np_apply(kern, v)


def test_infsa_exact_matches_numpy_and_series_converges():
  q, k, v = make_qkv(0, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  mask = rand_mask(1, B, T, T)
  gamma = jnp.array([0.9, -0.5, 0.3, 0.7])
  for causal in (False, True):
    vis = np_visible(mask, causal, B, N, T, T)
    exact = jax.jit(functools.partial(infsa_attention, gamma=gamma, is_causal=causal))(
        q, k, v, None, mask)
    np.testing.assert_allclose(np.asarray(exact, np.float64), _np_infsa(q, k, v, gamma, vis),
                               atol=1e-5, rtol=1e-5)
  want = _np_infsa(q, k, v, 0.8, np_visible(None, True, B, N, T, T))
  bound_scale = float(jnp.max(jnp.abs(v))) / (1 - 0.8)
  errs = []
  for terms in (1, 3, 9, 80):
    got = jax.jit(functools.partial(infsa_attention, gamma=0.8, terms=terms, is_causal=True))(
        q, k, v)
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    assert err <= 0.8 ** (terms + 1) * bound_scale + 1e-5
    errs.append(err)
  assert errs[0] > errs[1] > errs[2] > errs[3] and errs[-1] < 1e-5


def test_infsa_normalized_kernel_causality_gamma_zero_and_bf16():
  q, k, v = make_qkv(3, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  lengths = jnp.array([5, 3])
  ones = jnp.ones_like(v)
  for terms in (None, 200):
    out = jax.jit(functools.partial(
        infsa_attention, gamma=0.6, terms=terms, normalize=True, is_causal=True))(
            q, k, ones, key_value_seq_lengths=lengths)
    np.testing.assert_allclose(np.asarray(out), 1.0, atol=1e-5)  # row-stochastic kernel
  np.testing.assert_allclose(
      np.asarray(jax.jit(functools.partial(infsa_attention, gamma=0.0, normalize=True,
                                           is_causal=True))(q, k, v)),
      np.asarray(jax.jit(functools.partial(dot_product_attention, is_causal=True))(q, k, v)),
      atol=1e-6)
  # causal: changing the last token changes no earlier output
  k2, v2 = k.at[:, -1].add(3.0), v.at[:, -1].add(5.0)
  for terms in (None, 4):
    f = jax.jit(functools.partial(infsa_attention, gamma=0.9, terms=terms, is_causal=True))
    np.testing.assert_allclose(np.asarray(f(q, k, v)[:, :-1]), np.asarray(f(q, k2, v2)[:, :-1]),
                               atol=1e-5, rtol=1e-5)
    assert float(jnp.max(jnp.abs(f(q, k, v)[:, -1] - f(q, k2, v2)[:, -1]))) > 1e-3
  lo = jax.jit(functools.partial(infsa_attention, gamma=0.5))(
      *(a.astype(jnp.bfloat16) for a in (q, k, v)))
  assert lo.dtype == jnp.bfloat16
  want = _np_infsa(*(a.astype(jnp.bfloat16) for a in (q, k, v)), 0.5,
                   np_visible(None, False, B, N, T, T))
  np.testing.assert_allclose(np.asarray(lo, np.float64), want, atol=3e-2, rtol=3e-2)
  big = jax.jit(functools.partial(infsa_attention, gamma=0.99, terms=3))(q * 1e30, k * 1e30, v)
  assert np.all(np.isfinite(np.asarray(big)))


def test_infsa_gradients_finite_differences():
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in make_qkv(6, B=1, T=3, N=2, K=1, H=2, Hv=2))
    g = jnp.array([0.6, -0.4])
    for terms in (None, 3):
      fn = jax.jit(lambda q, k, v, g, terms=terms: infsa_attention(
          q, k, v, gamma=g, terms=terms, is_causal=True))
      jax.test_util.check_grads(fn, (q, k, v, g), order=1, modes=("rev",))


def test_fully_masked_row_is_zero_with_zero_gradient():
  q, k, v = make_qkv(8, B=1, T=4, N=2, K=1, H=3, Hv=2)
  mask = jnp.ones((1, 1, 4, 4), bool).at[:, :, 2].set(False)  # query 2 sees no key
  for terms in (None, 3):
    assert_masked_row_is_zero(
        lambda q, k, v, terms=terms: infsa_attention(q, k, v, None, mask, gamma=0.7,
                                                     terms=terms), q, k, v, 2)


def test_errors_name_the_argument():
  q, k, v = make_qkv(0, B=1, T=4, N=2, K=1, H=2)
  sig = dict(normalizer="sigmoid", normalizer_params={"bias": 0.0})
  check_raises(
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=1.0)),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=-1.5)),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=float("nan"))),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=jnp.array([0.5, 1.0]))),
      ("`gamma`", lambda: infsa_attention(q, k, v, gamma=True)),
      # sigmoid(0) = 1/2 on 4 keys: rho(A) = 2, checked since the rows sum to more than 1
      ("`gamma`", lambda: infsa_attention(q * 0, k, v, gamma=0.6, **sig)),
      ("`terms`", lambda: infsa_attention(q, k, v, gamma=0.5, terms=0)),
      ("`normalize`", lambda: infsa_attention(q, k, v, gamma=0.5, normalize=1)),
      ("`key`", lambda: infsa_attention(q, k[:, :3], v[:, :3], gamma=0.5)),
  )
  # with a small enough gamma it is accepted, and equals the numpy kernel
  out = infsa_attention(q * 0, k, v, gamma=0.45, **sig)
  a = np.full((4, 4), 0.5)
  want = 0.45 * np.linalg.solve(np.eye(4) - 0.45 * a, a) @ np.asarray(v[0, :, 0], np.float64)
  np.testing.assert_allclose(np.asarray(out[0, :, 1], np.float64), want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
@pytest.mark.parametrize("causal", [False, True])
def test_infsa_series_equals_solve_matrix(normalizer, causal):
  q, k, v = make_qkv(7, B=2, T=9, N=4, K=2, H=4, Hv=3)
  f = functools.partial(infsa_attention, gamma=0.7, is_causal=causal, normalizer=normalizer)
  np.testing.assert_allclose(np.asarray(f(q, k, v, terms=120)), np.asarray(f(q, k, v)),
                             atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ Linear-InfSA


def _np_linear(q, k, v, gamma, iterations, lengths=None, eps=1e-6):
  """The reference-code algorithm in numpy float64, token by token: energy-weighted query
  summary, ReLU'd scores against the keys, normalised, repeated; the pooled value for all."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  Bq, Tq, Nq, Hq = q.shape
  G = Nq // k.shape[2]
  g = np.broadcast_to(np.asarray(gamma, np.float64), (Nq,))
  lengths = [Tq] * Bq if lengths is None else list(np.asarray(lengths))
  out = np.zeros((Bq, Tq, Nq, v.shape[-1]))
  for b, n in np.ndindex(Bq, Nq):
    L = lengths[b]
    qs = q[b, :L, n] / np.sqrt(Hq)
    ks = k[b, :L, n // G] / np.sqrt(Hq)
    e = np.sqrt(np.sum(qs ** 2, axis=-1))
    x = e / (e.sum() + eps)
    for _ in range(iterations):
      a = np.maximum(ks @ (x @ qs), 0.0)
      x = a / (a.sum() + eps)
    out[b, :, n] = g[n] * (x @ v[b, :L, n // G])
  return out


def _dense_relu_map(q, k):
  """A = ReLU(Q K^T / H) [B, N, T, T] in float64 (GQA)."""
  q, k = (np.asarray(a, np.float64) for a in (q, k))
  kk = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  return np.maximum(np.einsum("btnh,bsnh->bnts", q, kk) / q.shape[-1], 0.0)


def test_linear_infsa_matches_the_reference_formula_with_gqa_and_padding():
  q, k, v = make_qkv(11, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  gamma = jnp.array([0.9, -0.5, 0.3, 0.7])
  lengths = jnp.array([5, 3])

  @jax.jit
  def run(q, k, v, gamma):  # one program: 1 and 3 iterations, padded; bf16 inputs
    lin = functools.partial(linear_infsa_attention, gamma=gamma, key_value_seq_lengths=lengths)
    lo = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    return lin(q, k, v), lin(q, k, v, iterations=3), lin(*lo)

  one, three, lo = run(q, k, v, gamma)
  np.testing.assert_allclose(np.asarray(one, np.float64),
                             _np_linear(q, k, v, gamma, 1, lengths), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(three, np.float64),
                             _np_linear(q, k, v, gamma, 3, lengths), atol=1e-5, rtol=1e-5)
  # padding is deletion: the second sequence equals its first 3 tokens alone
  short = jax.jit(functools.partial(linear_infsa_attention, gamma=gamma))(
      q[1:, :3], k[1:, :3], v[1:, :3])
  np.testing.assert_allclose(np.asarray(one[1:, :3]), np.asarray(short), atol=1e-6)
  # bf16 inputs rounded first, float32 inside, output rounded once (2^-8 relative)
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(
      np.asarray(lo, np.float64),
      _np_linear(*(a.astype(jnp.bfloat16) for a in (q, k, v)), gamma, 1, lengths),
      atol=2e-2, rtol=2e-2)


def test_linear_infsa_is_power_iteration_on_positive_maps_and_the_exact_limit():
  # q, k > 0: every logit is positive, the ReLU is the identity on A's entries
  q, k, v = make_qkv(12, B=1, T=6, N=2, K=1, H=3, Hv=2)
  q, k = jnp.abs(q) + 0.2, jnp.abs(k) + 0.2
  A = _dense_relu_map(q, k)[0]  # [N, T, T]
  M = (1, 3, 60)

  @jax.jit
  def run(q, k, v):
    return [linear_infsa_attention(q, k, v, gamma=1.0, iterations=m) for m in M]

  outs = run(q, k, v)
  qs = np.asarray(q, np.float64)[0] / np.sqrt(3)
  vv = np.repeat(np.asarray(v, np.float64)[0], 2, axis=1)  # [T, N, Hv]
  for n in range(2):
    e = np.linalg.norm(qs[:, n], axis=-1)
    x0 = e / e.sum()
    for m, out in zip(M, outs, strict=True):
      # M dense power steps x <- A^T x / |A^T x|_1 from the energy weights (eps = 1e-6 on
      # sums ~10: 1e-7 relative)
      x = x0
      for _ in range(m):
        x = A[n].T @ x
        x = x / x.sum()
      np.testing.assert_allclose(np.asarray(out[0, :, n], np.float64),
                                 np.broadcast_to(x @ vv[:, n], (6, 2)), atol=1e-5, rtol=1e-5)
    # 60 steps: the principal left eigenvector (A > 0 has rank 3: |lambda_2 / lambda_1|^60
    # is negligible here)
    w, vecs = np.linalg.eig(A[n].T)
    xe = np.abs(np.real(vecs[:, np.argmax(np.real(w))]))
    xe /= xe.sum()
    np.testing.assert_allclose(np.asarray(outs[-1][0, 0, n], np.float64), xe @ vv[:, n],
                               atol=1e-5)
  # the exact form's limit: x0^T O_exact / x0^T O_exact(V=1) tends to x^T V / x^T 1 as
  # gamma rho(A) -> 1; with gamma rho = 1 - 1e-3 the other eigen-directions keep a share
  # of about 1e-3 |lambda_2| / (1 - |lambda_2| / rho) (measured < 1e-3 here): atol 5e-3
  rho = np.max(np.abs(np.linalg.eigvals(A)), axis=-1)  # [N]
  g = jnp.asarray((1 - 1e-3) / rho, jnp.float32)
  exact = functools.partial(infsa_attention, gamma=g, normalizer="relu", scale=1 / 3)
  o_v = np.asarray(jax.jit(exact)(q, k, v), np.float64)[0]  # [T, N, Hv]
  o_1 = np.asarray(jax.jit(exact)(q, k, jnp.ones_like(v)), np.float64)[0]
  for n in range(2):
    e = np.linalg.norm(qs[:, n], axis=-1)
    pooled = (e @ o_v[:, n]) / (e @ o_1[:, n])
    np.testing.assert_allclose(pooled, np.asarray(outs[-1][0, 0, n], np.float64), atol=5e-3)


def test_linear_infsa_gap_with_mixed_signs():
  # mixed-sign logits: ReLU(s qbar . k_j) <= sum_t x_t ReLU(s q_t . k_j) (Jensen), so the
  # linear weights differ from one dense power step; the weights are read back with
  # one-hot values (v_j = e_j gives o = gamma x)
  q, k, _ = make_qkv(13, B=1, T=8, N=1, K=1, H=4)
  onehot = jnp.eye(8)[None, :, None, :]
  x_lin = np.asarray(jax.jit(functools.partial(linear_infsa_attention, gamma=1.0))(
      q, k, onehot), np.float64)[0, 0, 0]
  qs = np.asarray(q, np.float64)[0, :, 0] / 2
  ks = np.asarray(k, np.float64)[0, :, 0] / 2
  e = np.linalg.norm(qs, axis=-1)
  x0 = e / (e.sum() + 1e-6)
  a_dense = x0 @ np.maximum(qs @ ks.T, 0.0)  # one dense power step (A^T x0)
  a_lin = np.maximum(ks @ (x0 @ qs), 0.0)
  np.testing.assert_allclose(x_lin, a_lin / (a_lin.sum() + 1e-6), atol=1e-6)
  assert np.all(a_lin <= a_dense + 1e-12)  # Jensen
  # keys that some queries favour but the pooled query does not get weight 0 here only
  only_dense = (a_lin == 0) & (a_dense > 1e-3)
  assert only_dense.any() and np.all(x_lin[only_dense] < 1e-7)
  x_dense = a_dense / a_dense.sum()
  assert np.abs(x_lin - x_dense).sum() > 0.1  # the gap (measured L1 ~0.5)


@pytest.mark.slow  # ~3.5 s of CPU (compiles): out of the default run's budget
def test_linear_infsa_gradients_and_empty_sequence():
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in make_qkv(14, B=1, T=4, N=2, K=1, H=3, Hv=2))
    g = jnp.array([0.6, -0.4])
    fn = jax.jit(lambda q, k, v, g: linear_infsa_attention(
        q, k, v, gamma=g, iterations=2, key_value_seq_lengths=jnp.array([3])))
    jax.test_util.check_grads(fn, (q, k, v, g), order=1, modes=("rev",))
  # a length-0 sequence pools nothing: zeros, with finite (zero) gradients
  q, k, v = make_qkv(15, B=1, T=3, N=2, K=1, H=2, Hv=2)
  empty = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(linear_infsa_attention(
      q, k, v, gamma=0.5, key_value_seq_lengths=jnp.array([0]))), argnums=(0, 1, 2)))
  val, grads = empty(q, k, v)
  assert float(val) == 0.0
  assert all(np.all(np.asarray(d) == 0) for d in grads)
  with jax.enable_x64(True):
    assert linear_infsa_attention(q.astype(jnp.float64), k, v, gamma=0.5).dtype == jnp.float64


def test_linear_infsa_errors_name_the_argument():
  q, k, v = make_qkv(15, B=1, T=3, N=2, K=1, H=2, Hv=2)
  check_raises(
      ("`gamma`", lambda: linear_infsa_attention(q, k, v, gamma=True)),
      ("`gamma`", lambda: linear_infsa_attention(q, k, v, gamma=float("nan"))),
      ("`gamma`", lambda: linear_infsa_attention(q, k, v, gamma=jnp.ones(3))),
      ("`iterations`", lambda: linear_infsa_attention(q, k, v, gamma=0.5, iterations=0)),
      ("`iterations`", lambda: linear_infsa_attention(q, k, v, gamma=0.5, iterations=2.0)),
      ("`scale`", lambda: linear_infsa_attention(q, k, v, gamma=0.5, scale=-1.0)),
      ("`eps`", lambda: linear_infsa_attention(q, k, v, gamma=0.5, eps=0.0)),
      ("`key`", lambda: linear_infsa_attention(q, k[:, :2], v, gamma=0.5)),
      ("`key`", lambda: linear_infsa_attention(q, jnp.concatenate([k] * 3, 2), v, gamma=0.5)),
      ("`value`", lambda: linear_infsa_attention(q, k, v[:, :2], gamma=0.5)),
      ("`query`", lambda: linear_infsa_attention(q[0], k, v, gamma=0.5)),
      ("`key_value_seq_lengths`", lambda: linear_infsa_attention(
          q, k, v, gamma=0.5, key_value_seq_lengths=jnp.array([1.0]))),
  )
