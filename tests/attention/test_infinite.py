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

from jaxsoft.attention import dot_product_attention, infsa_attention
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
