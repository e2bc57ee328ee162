"""N03 softmax_n / softmax_1 / softmax_sink against softmax with one extra logit."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

# --------------------------------------------------------------------------------------
# Oracles: softmax over the row with one extra logit appended, then drop it.


def _sink_oracle(x, logit):
  """softmax([x, logit])[:-1] along the last axis, logit broadcast per row."""
  logit = jnp.broadcast_to(logit, x.shape[:-1] + (1,)).astype(x.dtype)
  return jax.nn.softmax(jnp.concatenate([x, logit], axis=-1), axis=-1)[..., :-1]


X = helpers.rows(0, (4, 9), 2.0)


def test_softmax_1_is_softmax_with_a_zero_logit():
  # jitted: one program per side rather than op by op
  helpers.vjp_close(jax.jit(N.softmax_1), jax.jit(lambda x: _sink_oracle(x, 0.0)), X)


@pytest.mark.parametrize("n", [0.0, 0.5, 3.0, 100.0])
def test_softmax_n_is_softmax_with_log_n_logit(n):
  got = N.softmax_n(X, n=n)
  helpers.vjp_close(lambda x: N.softmax_n(x, n=n),
                    jax.nn.softmax if n == 0 else lambda x: _sink_oracle(x, np.log(n)), X)
  # The sink mass: sum p = S / (n + S).
  s = jnp.sum(jnp.exp(X), -1)
  chex.assert_trees_all_close(got.sum(-1), s / (n + s), rtol=1e-5)


def test_softmax_n_gradient_in_n():
  # d/dn of e^{x_i}/(n + S) = -e^{x_i}/(n + S)^2.
  n = 2.5
  ct = helpers.random_cotangent(X.shape)
  g = jax.grad(lambda n: jnp.sum(N.softmax_n(X, n=n) * ct))(n)
  s = jnp.sum(jnp.exp(X), -1, keepdims=True)
  want = jnp.sum(-jnp.exp(X) / (n + s) ** 2 * ct)
  chex.assert_trees_all_close(g, want, rtol=1e-4)


def test_softmax_sink_per_head_broadcast_and_gradient():
  rng = np.random.default_rng(1)
  b, h, t, s = 2, 3, 4, 5
  x = jnp.asarray(rng.standard_normal((b, h, t, s)), jnp.float32)
  sink = jnp.asarray(rng.standard_normal((h, 1, 1)), jnp.float32)
  ct = helpers.random_cotangent(x.shape)
  f = lambda x, sink: jnp.sum(N.softmax_sink(x, sink_logit=sink) * ct)
  oracle = lambda x, sink: jnp.sum(_sink_oracle(x, jnp.broadcast_to(sink, (b, h, t, 1))) * ct)
  chex.assert_trees_all_close(N.softmax_sink(x, sink_logit=sink),
                              _sink_oracle(x, jnp.broadcast_to(sink, (b, h, t, 1))),
                              atol=1e-6, rtol=1e-5)
  # jitted: one program per gradient rather than op by op
  chex.assert_trees_all_close(jax.jit(jax.grad(f, (0, 1)))(x, sink),
                              jax.jit(jax.grad(oracle, (0, 1)))(x, sink), atol=1e-6, rtol=1e-5)


def test_softmax_sink_on_another_axis():
  x = X.T  # [9, 4]: rows are the 4 columns
  sink = jnp.asarray([[0.3, -1.0, 2.0, 0.0]])
  got = N.softmax_sink(x, sink_logit=sink, axis=0)
  chex.assert_trees_all_close(got, _sink_oracle(X, sink.T).T, atol=1e-6, rtol=1e-5)


def test_overflow_free_at_huge_and_tiny_logits():
  x = jnp.asarray([[1000.0, 1000.0, -1000.0], [-1000.0, -1000.0, -1000.0],
                   [88.0, 89.0, 0.0]])
  out = N.softmax_1(x)
  assert np.all(np.isfinite(np.asarray(out)))
  chex.assert_trees_all_close(out[0], jnp.asarray([0.5, 0.5, 0.0]), atol=1e-6)
  assert np.all(np.asarray(out[1]) == 0)  # all mass on the sink
  chex.assert_trees_all_close(out[2], _sink_oracle(x[2:], 0.0)[0], atol=1e-6, rtol=1e-5)
  g = jax.grad(lambda x: jnp.sum(N.softmax_sink(x, sink_logit=500.0) ** 2))(x)
  assert np.all(np.isfinite(np.asarray(g)))
  chex.assert_trees_all_close(N.softmax_sink(x, sink_logit=995.0)[0],
                              _sink_oracle(x[:1], 995.0)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["softmax_1", "softmax_n", "softmax_sink"])
def test_mask_equals_delete_and_fully_masked(name):
  spec = N.get(name)
  # jitted (hyperparameters bound, so they stay Python floats): one program per call shape
  # instead of op-by-op eager dispatch
  fn = jax.jit(spec.fn)
  helpers.check_mask_is_delete(fn, X, 4)
  helpers.check_fully_masked(fn)
  for p in spec.params:
    helpers.check_fully_masked(jax.jit(functools.partial(spec.fn, **{p.name: p.sample})))


def test_sink_gradient_zero_on_fully_masked_row():
  x = X[:2]
  where = jnp.asarray([[False] * 9, [True] * 9])
  g = jax.grad(lambda s: jnp.sum(N.softmax_sink(x, sink_logit=s, where=where) ** 2), )(
      jnp.asarray([[0.4], [0.4]]))
  assert g[0, 0] == 0 and g[1, 0] != 0


@pytest.mark.parametrize("name,hp", [("softmax_1", {}), ("softmax_n", {}),
                                     ("softmax_n", {"n": 3.0}), ("softmax_n", {"n": 0.0}),
                                     ("softmax_sink", {}), ("softmax_sink", {"sink_logit": -1.5})])
def test_tile_rule_matches_function(name, hp):
  helpers.check_tile_rule(N.get(name), hp)


@pytest.mark.parametrize("name,hp", [("softmax_1", {}), ("softmax_n", {"n": 3.0}),
                                     ("softmax_sink", {"sink_logit": -1.5})])
def test_tile_rule_at_extreme_logits(name, hp):
  helpers.check_tile_rule(N.get(name), hp, scale=300.0, atol=1e-5)


def test_tile_rule_with_row_broadcast_sink():
  sink = jnp.asarray(np.linspace(-1, 2, 6)[:, None], jnp.float32)
  helpers.check_tile_rule(N.get("softmax_sink"), {"sink_logit": sink})


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)))
    check_grads(jax.jit(N.softmax_1), (x,), order=2, modes=["rev", "fwd"])
    sink = jnp.asarray([[0.1], [-0.7], [1.2]])
    assert N.softmax_1(x).dtype == jnp.float64
    # float64 end to end, per-row parameters included (no float32 round trip).
    chex.assert_trees_all_close(N.softmax_sink(x, sink_logit=sink), _sink_oracle(x, sink),
                                atol=1e-13, rtol=1e-12)
    n = jnp.asarray([[0.5], [2.0], [7.0]])
    chex.assert_trees_all_close(N.softmax_n(x, n=n), _sink_oracle(x, jnp.log(n)),
                                atol=1e-13, rtol=1e-12)


@pytest.mark.slow  # order-2 checks compile ~10 programs each: one stays in the default run
def test_check_grads_float64_order_two_with_hyperparameters():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)))
    check_grads(jax.jit(lambda x, n: N.softmax_n(x, n=n)), (x, jnp.float64(2.0)), order=2)
    sink = jnp.asarray([[0.1], [-0.7], [1.2]])
    check_grads(jax.jit(lambda x, s: N.softmax_sink(x, sink_logit=s)), (x, sink), order=2)


@pytest.mark.parametrize("name", ["softmax_1", "softmax_n", "softmax_sink"])
def test_low_precision(name):
  helpers.check_low_precision(N.get(name).fn, X)


def test_jit_vmap_grad():
  f = jax.jit(lambda x, s: N.softmax_sink(x, sink_logit=s))
  chex.assert_trees_all_close(f(X, 0.7), _sink_oracle(X, 0.7), atol=1e-6, rtol=1e-5)
  v = jax.vmap(lambda row: N.softmax_1(row))(X)
  chex.assert_trees_all_close(v, N.softmax_1(X), atol=1e-7)
  g = jax.jit(jax.grad(lambda x: N.softmax_n(x, n=2.0)[0, 0]))(X)
  gw = jax.grad(lambda x: _sink_oracle(x, np.log(2.0))[0, 0])(X)
  chex.assert_trees_all_close(g, gw, atol=1e-6, rtol=1e-5)


def test_properties_declared():
  for name in ("softmax_1", "softmax_n", "softmax_sink"):
    spec = N.get(name)
    assert spec.kernel_class == "E" and not spec.sums_to_one and spec.at_most_one
    assert not spec.shift_invariant
    assert np.all(np.asarray(spec.fn(X).sum(-1)) < 1)
    assert not np.allclose(spec.fn(X + 1.0), spec.fn(X))


def test_bad_input():
  helpers.check_raises(
      ("`n`", lambda: N.softmax_n(X, n=-1.0)),
      ("`axis`", lambda: N.softmax_1(X, axis=2)),
      ("`sink_logit`", lambda: N.softmax_sink(X, sink_logit=jnp.zeros((4, 9)))),
      ("`sink_logit`", lambda: N.softmax_sink(X, sink_logit=float("nan"))),
      ("`where`", lambda: N.softmax_1(X, where=jnp.ones((3,), bool))))
