"""N15 basis-aware truncation (``basis_aware_softmax``) against an independent float64
oracle: one LP per token on the raw constraints (no orthonormalised basis, no shortcut
through other LPs' solutions), with each truncation's witness checked in numpy; the
limits (full-rank basis: softmax; no basis: epsilon truncation), masks, gradient, bf16,
jit/vmap and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import linprog

from jaxsoft import normalizers as N

RNG = np.random.default_rng(7)
V, D, TAU = 8, 3, 0.05
W = RNG.integers(-2, 3, (V, D)).astype(np.float32)
H = RNG.standard_normal((6, D)).astype(np.float32) * 1.5
X = (H @ W.T).astype(np.float32)  # logits W h: rows in the basis' span
BAT = jax.jit(N.basis_aware_softmax, static_argnames=("axis", "tau", "tol"))


def o_p_hat(x, mask):
  z = np.where(mask, np.asarray(x, np.float64), -np.inf)
  e = np.exp(z - z[mask].max())
  return e / e.sum()


def o_min_p(i, p_hat, mask, w, tau):
  """min p_i over {p >= max(p_hat - tau, 0), sum p = 1, W^T p = W^T p_hat, p = 0 off the
  mask}, with its minimiser."""
  w = np.asarray(w, np.float64)
  a_eq = np.concatenate([w.T, np.ones((1, len(p_hat)))])
  bounds = [(max(p_hat[j] - tau, 0.0), 1.0) if mask[j] else (0.0, 0.0)
            for j in range(len(p_hat))]
  cost = np.eye(len(p_hat))[i]
  res = linprog(cost, A_eq=a_eq, b_eq=a_eq @ p_hat, bounds=bounds, method="highs-ipm")
  assert res.status == 0
  return res.fun, res.x


def o_keep(x, mask, w, tau, tol=1e-8):
  p_hat = o_p_hat(x, mask)
  keep = np.zeros(len(p_hat), bool)
  for i in np.flatnonzero(mask):
    if p_hat[i] > tau or p_hat[i] >= p_hat.max():
      keep[i] = True
      continue
    fun, p = o_min_p(i, p_hat, mask, w, tau)
    keep[i] = fun > tol
    if not keep[i]:  # the witness: a distribution of the constraint set with p_i = 0
      assert abs(p[i]) <= 1e-7 and np.all(p >= -1e-9) and abs(p.sum() - 1.0) < 1e-7
      assert np.all(p[mask] >= p_hat[mask] - tau - 1e-7)
      np.testing.assert_allclose(w.astype(np.float64).T @ p, w.astype(np.float64).T @ p_hat,
                                 atol=1e-7)
  return keep


def o_weights(x, keep):
  p = o_p_hat(x, keep) if keep.any() else np.zeros(len(keep))
  return np.where(keep, p, 0.0)


def test_matches_the_lp_oracle_and_keeps_more_than_the_threshold():
  mask = np.ones(X.shape, bool)
  mask[2, [1, 5]] = False
  mask[4] = False  # an empty row
  out = np.asarray(BAT(jnp.asarray(X), jnp.asarray(W), where=jnp.asarray(mask), tau=TAU))
  keeps = [o_keep(X[r], mask[r], W, TAU) if mask[r].any() else np.zeros(V, bool)
           for r in range(X.shape[0])]
  np.testing.assert_array_equal(out > 0, np.stack(keeps))
  want = np.stack([o_weights(X[r], keeps[r]) for r in range(X.shape[0])])
  # float32 softmax over <= 8 entries: a few ulp, tol 1e-6
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  assert np.all(out[4] == 0.0) and np.all(out[~mask] == 0.0)
  # K contains the threshold set {p_hat > tau}, and here the basis proves more tokens
  p_hat = np.stack([o_p_hat(X[r], mask[r]) if mask[r].any() else np.zeros(V)
                    for r in range(X.shape[0])])
  assert np.all((out > 0)[p_hat > TAU])
  assert np.sum((out > 0) & (p_hat <= TAU) & mask) > 0


def test_limits_full_rank_is_softmax_and_no_basis_is_epsilon():
  x = X[:3]
  full = RNG.standard_normal((V, V)).astype(np.float32)  # rank V: P = {p_hat}
  ones = np.ones((V, 1), np.float32)  # only sum p = 1: the threshold alone
  both = jax.jit(lambda x, a, b: (N.basis_aware_softmax(x, a, tau=TAU),
                                  N.basis_aware_softmax(x, b, tau=TAU)))
  out_full, out_ones = both(jnp.asarray(x), jnp.asarray(full), jnp.asarray(ones))
  allv = np.ones(V, bool)
  p_hat = np.stack([o_p_hat(r, allv) for r in x])
  np.testing.assert_allclose(out_full, p_hat, rtol=1e-5, atol=1e-7)  # a few float32 ulp
  eps = (p_hat > TAU) | (p_hat >= p_hat.max(axis=1, keepdims=True))
  want = np.stack([o_weights(r, k) for r, k in zip(x, eps, strict=True)])
  np.testing.assert_allclose(out_ones, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_axis_and_vmap_match_row_by_row():
  x = jnp.asarray(X[:2])
  ref = BAT(x, jnp.asarray(W), tau=TAU)
  np.testing.assert_array_equal(BAT(x.T, jnp.asarray(W), axis=0, tau=TAU), ref.T)
  vm = jax.jit(jax.vmap(lambda r: N.basis_aware_softmax(r, jnp.asarray(W), tau=TAU)))(x)
  np.testing.assert_array_equal(vm, ref)


def test_gradient_inside_the_kept_set():
  x = jnp.asarray(X[:2])
  # gradient: the softmax over the (fixed) kept set, d w_i / d x_j = w_i (delta_ij - w_j)
  r = RNG.standard_normal(V)
  def loss(y):
    return jnp.sum(r * N.basis_aware_softmax(y, jnp.asarray(W), tau=TAU))

  w, g = jax.jit(lambda z: (N.basis_aware_softmax(z, jnp.asarray(W), tau=TAU),
                            jax.grad(loss)(z)))(x[0])
  w = np.asarray(w, np.float64)
  assert np.sum(w == 0) > 0  # some token truncated: its gradient must be 0
  np.testing.assert_allclose(g, w * (r - np.sum(r * w)), rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(g)[w == 0] == 0.0)


@pytest.mark.slow
def test_bf16_computes_in_float32():
  xb = jnp.asarray(X[:2]).astype(jnp.bfloat16)
  out = BAT(xb, jnp.asarray(W), tau=TAU)
  assert out.dtype == jnp.bfloat16
  want = np.stack([o_weights(row, o_keep(row, np.ones(V, bool), W, TAU))
                   for row in np.asarray(xb, np.float64)])
  # one bf16 rounding of each weight: relative 2^-8
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"basis": jnp.ones((V - 1, 2))}, "basis"),
    ({"basis": jnp.ones(V)}, "basis"),
    ({"tau": 0.0}, "tau"),
    ({"tau": 1.0}, "tau"),
    ({"tol": -1.0}, "tol"),
])
def test_bad_input(kwargs, match):
  args = {"basis": jnp.ones((V, 2)), "tau": TAU, **kwargs}
  with pytest.raises(ValueError, match=match):
    N.basis_aware_softmax(jnp.zeros(V), args.pop("basis"), **args)


def test_traced_tau_is_refused():
  with pytest.raises(ValueError, match="static float"):
    jax.jit(lambda t: N.basis_aware_softmax(jnp.zeros(V), jnp.ones((V, 1)), tau=t))(0.1)
