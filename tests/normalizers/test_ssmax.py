"""N05 SSMax against softmax((s log n + b) x) with n counted independently."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

X = helpers.rows(0, (4, 9), 2.0)


def test_s_log_n_equal_one_is_softmax():
  n = X.shape[-1]
  helpers.vjp_close(lambda x: N.ssmax(x, s=1.0 / np.log(n)), jax.nn.softmax, X)


@pytest.mark.parametrize("s,bias", [(0.43, 0.0), (1.0, 0.0), (0.7, 0.5)])
def test_matches_scaled_softmax(s, bias):
  n = X.shape[-1]
  helpers.vjp_close(lambda x: N.ssmax(x, s=s, bias=bias),
                    lambda x: jax.nn.softmax((s * np.log(n) + bias) * x), X)


def test_default_s_is_documented_value():
  assert N.get("ssmax").param("s").default == 0.43
  chex.assert_trees_all_close(N.ssmax(X), jax.nn.softmax(0.43 * np.log(9) * X), atol=1e-6)


def test_explicit_n_overrides_visible_count():
  out = N.ssmax(X, s=0.5, n=512.0)
  chex.assert_trees_all_close(out, jax.nn.softmax(0.5 * np.log(512.0) * X), atol=1e-6)
  ns = jnp.asarray([[2.0], [16.0], [100.0], [1.0]])
  out = N.ssmax(X, s=0.5, n=ns)
  chex.assert_trees_all_close(out, jax.nn.softmax(0.5 * jnp.log(ns) * X), atol=1e-6)


def test_causal_rows_use_their_own_n():
  t = 6
  x = helpers.rows(1, (t, t))
  causal = jnp.tril(jnp.ones((t, t), bool))
  out = N.ssmax(x, s=1.0, where=causal)
  for i in range(t):
    want = jax.nn.softmax(np.log(i + 1) * x[i, : i + 1])
    chex.assert_trees_all_close(out[i, : i + 1], want, atol=1e-6)
    assert np.all(np.asarray(out[i, i + 1:]) == 0)


def test_mask_counts_visible_only_and_equals_delete():
  keep = np.ones(9, bool)
  keep[[1, 5]] = False
  out = N.ssmax(X, s=0.8, where=jnp.asarray(keep))
  chex.assert_trees_all_close(out[:, keep], N.ssmax(X[:, keep], s=0.8), atol=1e-6)
  chex.assert_trees_all_close(out[:, keep], jax.nn.softmax(0.8 * np.log(7) * X[:, keep]),
                              atol=1e-6)
  assert np.all(np.asarray(out[:, ~keep]) == 0)


def test_needle_max_weight_closed_form():
  # One logit delta above n - 1 equal ones: max weight = n^{s delta} / (n^{s delta} + n - 1).
  s, delta = 1.0, 1.5
  ssmax = jax.jit(lambda x: N.ssmax(x, s=s))  # one program per length, not op by op
  for n in (16, 256, 4096):
    x = jnp.zeros((n,)).at[0].set(delta)
    want = n ** (s * delta) / (n ** (s * delta) + n - 1)
    chex.assert_trees_all_close(ssmax(x)[0], want, rtol=1e-5)
  # With s delta > 1 the needle's weight grows with n, whereas softmax's decays.
  w = [float(ssmax(jnp.zeros((n,)).at[0].set(delta))[0]) for n in (16, 4096)]
  assert w[1] > w[0]


def test_single_entry_row_and_fully_masked():
  chex.assert_trees_all_close(N.ssmax(jnp.asarray([[3.0]])), jnp.ones((1, 1)))
  helpers.check_fully_masked(N.ssmax)
  helpers.check_fully_masked(N.ssmax, s=1.0, bias=0.25)


def test_gradient_in_s_and_bias():
  ct = helpers.random_cotangent(X.shape)
  f = lambda s, b: jnp.sum(N.ssmax(X, s=s, bias=b) * ct)
  g = lambda s, b: jnp.sum(jax.nn.softmax((s * np.log(9) + b) * X) * ct)
  chex.assert_trees_all_close(jax.grad(f, (0, 1))(0.6, 0.1), jax.grad(g, (0, 1))(0.6, 0.1),
                              atol=1e-5, rtol=1e-4)
  s_head = jnp.asarray([[0.2], [0.4], [0.6], [0.8]])
  chex.assert_trees_all_close(N.ssmax(X, s=s_head),
                              jax.nn.softmax(s_head * np.log(9) * X), atol=1e-6)


@pytest.mark.parametrize("hp", [{}, {"s": 1.0}, {"s": 0.9, "bias": 0.25}, {"n": 64.0}])
def test_tile_rule_matches_function(hp):
  helpers.check_tile_rule(N.get("ssmax"), hp)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)))
    where = jnp.asarray(np.random.default_rng(3).random((3, 6)) < 0.7).at[:, :2].set(True)
    check_grads(jax.jit(lambda x, s, b: N.ssmax(x, s=s, bias=b, where=where)),
                (x, jnp.float64(0.6), jnp.float64(0.2)), order=2)


def test_low_precision_and_huge_logits():
  helpers.check_low_precision(N.ssmax, X)
  big = jnp.asarray([[1000.0, -1000.0, 999.0]])
  out = N.ssmax(big, s=1.0)
  assert np.all(np.isfinite(np.asarray(out)))
  # float64 reference: float32 jax.nn.softmax(log(3) * big) is itself 1.5e-5 off here
  z = np.log(3.0) * np.asarray(big, np.float64)
  want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()   # [0.75, 0, 0.25]
  np.testing.assert_allclose(out, want, atol=1e-6)


def test_jit_vmap():
  f = jax.jit(lambda x, s: N.ssmax(x, s=s))
  chex.assert_trees_all_close(f(X, 0.5), N.ssmax(X, s=0.5), atol=1e-7)
  chex.assert_trees_all_close(jax.vmap(N.ssmax)(X), N.ssmax(X), atol=1e-7)


def test_bad_input():
  helpers.check_raises(
      ("`s`", lambda: N.ssmax(X, s=-0.1)),
      ("`n`", lambda: N.ssmax(X, n=0.5)),
      ("`axis`", lambda: N.ssmax(X, axis=5)),
      ("`bias`", lambda: N.ssmax(X, bias=jnp.zeros((4, 9)))))
