"""N02 log_softmax, logsumexp, smooth_max / smooth_min against jax.nn and closed forms."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

X, MASK = helpers.rows_and_mask(0, (4, 7), 3.0, p=0.7)


def test_logsumexp_matches_jax_nn_with_mask_and_gradient():
  ct = helpers.random_cotangent((4,))
  for where in (None, MASK):
    out, vjp = jax.vjp(lambda x, w=where: N.logsumexp(x, where=w), X)
    want, vjp_want = jax.vjp(lambda x, w=where: jax.nn.logsumexp(x, axis=-1, where=w), X)
    chex.assert_trees_all_close(out, want, atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(vjp(ct), vjp_want(ct), atol=1e-6, rtol=1e-6)
    # The gradient is the (masked) softmax.
    (g,) = vjp(jnp.ones(4))
    chex.assert_trees_all_close(g, jax.nn.softmax(X, where=where) if where is not None
                                else jax.nn.softmax(X), atol=1e-6)


def test_logsumexp_axis_keepdims():
  out = N.logsumexp(X, axis=0, keepdims=True)
  assert out.shape == (1, 7)
  chex.assert_trees_all_close(out, jax.nn.logsumexp(X, axis=0, keepdims=True), rtol=1e-6)


def test_logsumexp_fully_masked_is_minus_inf_with_zero_gradient():
  where = jnp.asarray([[False] * 7, [True] * 7, [False] * 7, [True] * 7])
  out = N.logsumexp(X, where=where)
  assert out[0] == -jnp.inf and out[2] == -jnp.inf and np.isfinite(out[1])
  g = jax.grad(lambda x: jnp.sum(jnp.where(jnp.isfinite(N.logsumexp(x, where=where)),
                                           N.logsumexp(x, where=where), 0.0)))(X)
  assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g[0]) == 0)
  # Scores that are all -inf are masked too.
  assert N.logsumexp(jnp.full((3,), -jnp.inf)) == -jnp.inf
  g = jax.grad(lambda x: N.logsumexp(x, where=jnp.zeros(3, bool)))(jnp.ones(3))
  assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_log_softmax_matches_jax_nn(temperature):
  helpers.vjp_close(lambda x: N.log_softmax(x, temperature=temperature),
                    lambda x: jax.nn.log_softmax(x / temperature), X, atol=1e-5, rtol=1e-6,
                    vjp_rtol=1e-5)


def test_log_softmax_row_temperature_is_differentiable():
  t = jnp.asarray([[0.5], [1.0], [2.0], [3.0]])
  ct = helpers.random_cotangent(X.shape)
  f = lambda x, t: jnp.sum(N.log_softmax(x, temperature=t) * ct)
  g = lambda x, t: jnp.sum(jax.nn.log_softmax(x / t) * ct)
  chex.assert_trees_all_close(jax.grad(f, (0, 1))(X, t), jax.grad(g, (0, 1))(X, t),
                              atol=1e-5, rtol=1e-5)


def test_log_softmax_where_mask_matches_jax_nn():
  # JAX's testSoftmaxWhereMask: the visible entries are log_softmax of the visible scores,
  # and a masked entry is -inf (the log of its weight 0), exactly as jax.nn gives it.
  x = jnp.array([5.5, 1.3, -4.2, 0.9])
  m = jnp.array([True, False, True, True])
  out = N.log_softmax(x, where=m)
  chex.assert_trees_all_close(out[m], jax.nn.log_softmax(x[m]), atol=1e-6)
  assert out[1] == -jnp.inf
  chex.assert_trees_all_close(jnp.exp(out).sum(), 1.0, atol=1e-6)
  keep = np.ones(7, bool)
  keep[2] = False
  out = N.log_softmax(X, where=jnp.asarray(keep))
  chex.assert_trees_all_close(out[:, keep], jax.nn.log_softmax(X[:, keep]), atol=1e-6)
  assert np.all(np.asarray(out[:, 2]) == -np.inf)
  # With a random mask: equal to jax.nn.log_softmax(where=...) everywhere, -inf included.
  chex.assert_trees_all_close(N.log_softmax(X, where=MASK), jax.nn.log_softmax(X, where=MASK),
                              atol=1e-6)


def test_log_softmax_empty_mask_is_minus_inf_with_zero_gradient():
  # JAX's testSoftmaxEmptyMask: a row with nothing visible is all -inf.
  x = jnp.array([5.5, 1.3, -4.2, 0.9])
  assert np.all(np.asarray(N.log_softmax(x, where=jnp.zeros(4, bool))) == -np.inf)
  where = jnp.asarray([[False] * 7] + [[True] * 7] * 3)
  out = N.log_softmax(X, where=where)
  assert np.all(np.asarray(out[0]) == -np.inf) and np.all(np.isfinite(np.asarray(out[1:])))
  # The gradient of anything finite built from it is 0 at the masked row, never NaN.
  cot = helpers.random_cotangent(X.shape)
  g = jax.grad(lambda x: jnp.sum(jnp.where(where, N.log_softmax(x, where=where), 0.0) * cot))(X)
  assert np.all(np.asarray(g[0]) == 0) and np.all(np.isfinite(np.asarray(g)))
  # Scores that are all -inf are masked too.
  assert np.all(np.asarray(N.log_softmax(jnp.full((2, 3), -jnp.inf))) == -np.inf)


def test_log_softmax_masked_entries_get_no_gradient():
  # JAX's testSoftmaxWhereGrad: the cotangent at a masked entry never reaches x.
  x = jnp.array([36.0, 10.0, -4.0, 2.0])
  m = jnp.array([True, False, True, False])
  g = jax.grad(lambda x: jnp.sum(jnp.where(m, N.log_softmax(x, where=m), 0.0)))(x)
  want = jax.grad(lambda x: jnp.sum(jnp.where(m, jax.nn.log_softmax(x, where=m), 0.0)))(x)
  chex.assert_trees_all_close(g, want, atol=1e-6)
  assert g[1] == 0 and g[3] == 0


def test_log_softmax_huge_logits():
  x = jnp.asarray([[1000.0, -1000.0, 999.0], [-1000.0, -1001.0, -1000.0]])
  out = N.log_softmax(x)
  want = np.asarray(x, np.float64)
  want = want - want.max(-1, keepdims=True)
  want = want - np.log(np.exp(want).sum(-1, keepdims=True))
  chex.assert_trees_all_close(out, want.astype(np.float32), atol=1e-5)
  assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("eps", [1.0, 0.1, 5.0])
def test_smooth_max_gradient_is_softmax_and_bounds(eps):
  ct = helpers.random_cotangent((4,))
  out, vjp = jax.vjp(lambda x: N.smooth_max(x, eps=eps), X)
  # Gradient = softmax(x / eps) (the cotangent scales each row).
  chex.assert_trees_all_close(vjp(ct)[0], ct[:, None] * jax.nn.softmax(X / eps), atol=1e-6,
                              rtol=1e-5)
  chex.assert_trees_all_close(out, eps * jax.nn.logsumexp(X / eps, axis=-1), rtol=1e-6)
  mx = X.max(-1)
  assert np.all(np.asarray(out >= mx - 1e-5))
  assert np.all(np.asarray(out <= mx + eps * np.log(7) + 1e-5))


def test_smooth_max_tends_to_max_and_smooth_min_to_min():
  chex.assert_trees_all_close(N.smooth_max(X, eps=1e-3), X.max(-1), atol=1e-2)
  chex.assert_trees_all_close(N.smooth_min(X, eps=1e-3), X.min(-1), atol=1e-2)
  mn = N.smooth_min(X, eps=0.5)
  assert np.all(np.asarray(mn <= X.min(-1) + 1e-6))
  assert np.all(np.asarray(mn >= X.min(-1) - 0.5 * np.log(7) - 1e-5))
  g = jax.grad(lambda x: N.smooth_min(x, eps=0.5).sum())(X)
  chex.assert_trees_all_close(g, jax.nn.softmax(-X / 0.5), atol=1e-6)


def test_smooth_min_treats_minus_inf_as_masked():
  x = jnp.asarray([1.0, -jnp.inf, 2.0])
  chex.assert_trees_all_close(N.smooth_min(x, eps=0.5),
                              N.smooth_min(jnp.asarray([1.0, 2.0]), eps=0.5), rtol=1e-6)
  assert N.smooth_min(x, where=jnp.zeros(3, bool)) == jnp.inf
  assert N.smooth_max(x, where=jnp.zeros(3, bool)) == -jnp.inf


def test_smooth_max_row_eps_gradient():
  eps = jnp.asarray([[0.5], [1.0], [2.0], [0.1]])
  f = lambda x, e: jnp.sum(N.smooth_max(x, eps=e, keepdims=True) * eps)
  g = lambda x, e: jnp.sum(e * jax.nn.logsumexp(x / e, axis=-1, keepdims=True) * eps)
  chex.assert_trees_all_close(jax.grad(f, (0, 1))(X, eps), jax.grad(g, (0, 1))(X, eps),
                              atol=1e-5, rtol=1e-5)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5)))
    where = jnp.asarray(np.random.default_rng(3).random((3, 5)) < 0.7).at[:, 0].set(True)
    check_grads(jax.jit(lambda x, t: jnp.where(  # -inf at masked entries: compare the rest
        where, N.log_softmax(x, temperature=t, where=where), 0.0)), (x, jnp.float64(0.7)),
                order=2)
    assert N.logsumexp(x).dtype == jnp.float64

@pytest.mark.slow  # order-2 checks compile ~10 programs each: one stays in the default run
def test_check_grads_float64_order_two_reductions():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5)))
    where = jnp.asarray(np.random.default_rng(3).random((3, 5)) < 0.7).at[:, 0].set(True)
    check_grads(jax.jit(lambda x: N.logsumexp(x, where=where)), (x,), order=2)
    check_grads(jax.jit(lambda x, e: N.smooth_max(x, eps=e)), (x, jnp.float64(0.3)), order=2)
    check_grads(jax.jit(lambda x: N.smooth_min(x, eps=2.0)), (x,), order=2)


def test_low_precision():
  for dt in (jnp.bfloat16, jnp.float16):
    xl = X.astype(dt)
    for f in (N.logsumexp, N.log_softmax, N.smooth_max, N.smooth_min):
      out = f(xl)
      assert out.dtype == dt
      chex.assert_trees_all_close(out.astype(jnp.float32), f(xl.astype(jnp.float32)),
                                  atol=5e-2, rtol=1e-2)
  # fp16 cannot hold e^{20}: computing in f32 avoids the overflow of a naive sum.
  big = jnp.asarray([20.0, 20.0, 0.0], jnp.float16)
  chex.assert_trees_all_close(N.logsumexp(big).astype(jnp.float32), 20.0 + np.log(2.0),
                              atol=2e-2)


def test_jit_and_vmap():
  f = jax.jit(lambda x: N.log_softmax(x, where=MASK))
  chex.assert_trees_all_close(f(X), N.log_softmax(X, where=MASK), atol=1e-6)
  v = jax.vmap(lambda r, m: N.logsumexp(r, where=m))(X, MASK)
  chex.assert_trees_all_close(v, jax.nn.logsumexp(X, axis=-1, where=MASK), atol=1e-6)


def test_bad_input():
  helpers.check_raises(
      ("`temperature`", lambda: N.log_softmax(X, temperature=-1.0)),
      ("`eps`", lambda: N.smooth_max(X, eps=0.0)),
      ("`eps`", lambda: N.smooth_min(X, eps=-2.0)),
      ("`axis`", lambda: N.logsumexp(X, axis=-3)),
      ("`axis`", lambda: N.log_softmax(X, axis=2)),
      ("`temperature`", lambda: N.log_softmax(X, temperature=jnp.ones((4, 7)))))
