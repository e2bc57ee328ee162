"""N23 softplus_l1 (LSSA, [R] log-length scale) and lssar (power re-weighting)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

X = helpers.rows(0, (4, 10), 3.0)


def _direct(x, lam, p=1.0):
  """The formula as written: softplus(lam x)^p / sum softplus(lam x)^p."""
  a = jax.nn.softplus(lam * x) ** p
  return a / a.sum(-1, keepdims=True)


def _vjp_close(f, g, x, rtol=1e-5):
  helpers.vjp_close(f, g, x, rtol=rtol, vjp_rtol=10 * rtol)


def test_softplus_l1_with_log_512_length_scale():
  lam = np.log(10) / np.log(512)
  _vjp_close(N.softplus_l1, lambda x: _direct(x, lam), X)
  _vjp_close(lambda x: N.softplus_l1(x, base=64.0, scale=2.0),
             lambda x: _direct(x, 2.0 * np.log(10) / np.log(64)), X)
  _vjp_close(lambda x: N.softplus_l1(x, base=None), lambda x: _direct(x, 1.0), X)
  chex.assert_trees_all_close(N.length_scale(jnp.float32(512.0)), 1.0, rtol=1e-6)


def test_length_counts_visible_entries():
  keep = np.ones(10, bool)
  keep[[0, 3, 4]] = False
  out = N.softplus_l1(X, where=jnp.asarray(keep))
  lam = np.log(7) / np.log(512)
  chex.assert_trees_all_close(out[:, keep], _direct(X[:, keep], lam), atol=1e-6)
  assert np.all(np.asarray(out[:, ~keep]) == 0)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.5])
def test_lssar_is_renormalised_power(p):
  lam = np.log(10) / np.log(512)
  _vjp_close(lambda x: N.lssar(x, p=p, base=512.0), lambda x: _direct(x, lam, p), X,
             rtol=2e-5)
  a = N.softplus_l1(X)
  chex.assert_trees_all_close(N.lssar(X, p=p), a ** p / jnp.sum(a ** p, -1, keepdims=True),
                              atol=1e-6, rtol=1e-5)


def test_lssar_identity_at_p1_and_sharpens_above():
  chex.assert_trees_all_close(N.lssar(X, p=1.0), N.softplus_l1(X), atol=1e-7)
  ent = lambda w: -jnp.sum(w * jnp.log(w), -1)
  a, b = N.softplus_l1(X, base=None), N.lssar(X, p=3.0, base=None)
  assert np.all(np.asarray(b.max(-1) > a.max(-1)))
  assert np.all(np.asarray(ent(b) < ent(a)))


def test_no_overflow_for_huge_scores_and_right_limit_for_very_negative():
  x = jnp.asarray([[1e4, 2e4, -1e4], [1e30, 1e30, 0.0]])
  out = N.softplus_l1(x, base=None)
  chex.assert_trees_all_close(out[0], jnp.asarray([1 / 3, 2 / 3, 0.0]), atol=1e-6)
  chex.assert_trees_all_close(out[1], jnp.asarray([0.5, 0.5, 0.0]), atol=1e-6)
  # All softplus values underflow float32 here; softplus(z) ~ e^z so the weights are
  # softmax(z), not 0/0.
  x = jnp.asarray([[-1000.0, -999.0, -1001.0]])
  chex.assert_trees_all_close(N.softplus_l1(x, base=None), jax.nn.softmax(x), atol=1e-6)
  chex.assert_trees_all_close(N.lssar(x, p=2.0, base=None), jax.nn.softmax(2 * x), atol=1e-6)
  g = jax.jit(jax.grad(
      lambda x: jnp.sum(N.softplus_l1(x, base=None) * helpers.random_cotangent(x.shape))))(x)
  assert np.all(np.isfinite(np.asarray(g)))


def test_log_softplus_branch_seam_is_continuous():
  # -15 is where the small-z series takes over: values and gradients agree across it.
  z = jnp.asarray([[-15.001, -15.0, -14.999, 0.0]])
  with jax.enable_x64(True):
    z64 = jnp.asarray(z, jnp.float64)
    want = jax.nn.softplus(z64) / jnp.sum(jax.nn.softplus(z64))
    # jitted gradients: one program each rather than op by op
    gw = jax.jit(jax.grad(lambda z: (jax.nn.softplus(z) / jnp.sum(jax.nn.softplus(z)))[0, 3]))(
        z64)
    out = N.softplus_l1(z64, base=None)
    g = jax.jit(jax.grad(lambda z: N.softplus_l1(z, base=None)[0, 3]))(z64)
  chex.assert_trees_all_close(out, want, rtol=1e-10)
  chex.assert_trees_all_close(g, gw, rtol=1e-8, atol=1e-20)


@pytest.mark.parametrize("name", ["softplus_l1", "lssar"])
def test_mask_fully_masked_low_precision(name):
  fn = jax.jit(N.get(name).fn)  # one program per call shape instead of op by op
  helpers.check_mask_is_delete(fn, X, 5)
  helpers.check_fully_masked(fn)
  helpers.check_low_precision(fn, X)


@pytest.mark.parametrize("name,hp", [("softplus_l1", {}), ("softplus_l1", {"base": 64.0}),
                                     ("softplus_l1", {"base": None, "scale": 2.0}),
                                     ("lssar", {}), ("lssar", {"p": 3.0, "base": 64.0})])
def test_tile_rule_matches_function(name, hp):
  helpers.check_tile_rule(N.get(name), hp)


def test_gradient_in_p_and_scale():
  ct = helpers.random_cotangent(X.shape)
  lam = np.log(10) / np.log(64)
  f = lambda p, s: jnp.sum(N.lssar(X, p=p, base=64.0, scale=s) * ct)
  g = lambda p, s: jnp.sum(_direct(X, s * lam, p) * ct)
  chex.assert_trees_all_close(jax.grad(f, (0, 1))(2.0, 1.5), jax.grad(g, (0, 1))(2.0, 1.5),
                              atol=1e-5, rtol=1e-4)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)) * 3)
    check_grads(jax.jit(lambda x, p: N.lssar(x, p=p)), (x, jnp.float64(2.5)), order=2)
    p = jnp.asarray([[1.5], [2.0], [3.0]])
    lam = 1.5 * np.log(6) / np.log(64)
    chex.assert_trees_all_close(N.lssar(x, p=p, base=64.0, scale=1.5), _direct(x, lam, p),
                                atol=1e-13, rtol=1e-12)


@pytest.mark.slow  # order-2 checks compile ~10 programs each: one stays in the default run
def test_check_grads_float64_softplus_l1_order_two():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)) * 3)
    check_grads(jax.jit(lambda x, s: N.softplus_l1(x, base=64.0, scale=s)),
                (x, jnp.float64(1.5)), order=2)


def test_jit_vmap():
  chex.assert_trees_all_close(jax.jit(N.lssar)(X), N.lssar(X), atol=1e-7)
  chex.assert_trees_all_close(jax.vmap(N.softplus_l1)(X), N.softplus_l1(X), atol=1e-7)


def test_specs():
  for name in ("softplus_l1", "lssar"):
    spec = N.get(name)
    assert spec.kernel_class == "S" and spec.sums_to_one and spec.length_dependent
    assert not spec.tile.uses_max and not spec.shift_invariant


def test_bad_input():
  with pytest.raises(ValueError, match="`p`"):
    N.lssar(X, p=0.5)
  with pytest.raises(ValueError, match="`base`"):
    N.softplus_l1(X, base=1.0)
  with pytest.raises(ValueError, match="`scale`"):
    N.softplus_l1(X, scale=-1.0)
  with pytest.raises(ValueError, match="`axis`"):
    N.softplus_l1(X, axis=2)
