"""N32 moe_gate against a float64 numpy reference of softmax(sigmoid(x) / tau)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
MOE_GATE = jax.jit(N.moe_gate)


def _reference(x, mask, tau=1.0):
  """float64: softmax over the visible entries of sigmoid(x) / tau."""
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  z = (1.0 / (1.0 + np.exp(-x))) / np.asarray(tau, np.float64)
  e = np.where(mask, np.exp(z - z.max(-1, keepdims=True)), 0.0)  # z is bounded: no -inf
  s = e.sum(-1, keepdims=True)
  return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def test_matches_reference():
  x, mask = helpers.random_rows(0, scale=3.0)
  taus = np.linspace(0.1, 2.0, x.shape[0])[:, None]
  for tau in (1.0, 0.25, 4.0, taus):
    chex.assert_trees_all_close(MOE_GATE(x, where=mask, tau=jnp.asarray(tau, jnp.float32)),
                                _reference(x, mask, tau).astype(np.float32), atol=1e-6)
  # tanh gives the same family: sigmoid(z) = (1 + tanh(z / 2)) / 2 and softmax drops the 1/2
  chex.assert_trees_all_close(MOE_GATE(x, where=mask, tau=0.3),
                              N.softmax(jnp.tanh(x / 2) / 0.6, where=mask), atol=1e-6)


def test_activation_breaks_the_temperature_homogeneity():
  """The plain dense-to-sparse gate softmax((W h + b) / tau) is unchanged by scaling
  (W, b, tau) together (sum beta dG/dbeta + tau dG/dtau = 0); the activation gate is not."""
  h = helpers.normal(1, (4, 3))
  w = helpers.normal(2, (3, 5))
  b = helpers.normal(3, (5,))

  def scaled(gate, c):
    return gate((h @ (c * w) + c * b[None]), c * 0.7)

  plain = lambda x, t: N.softmax(x, temperature=t)  # noqa: E731
  act = lambda x, t: MOE_GATE(x, tau=t)  # noqa: E731
  _, d_plain = jax.jvp(lambda c: scaled(plain, c), (1.0,), (1.0,))
  _, d_act = jax.jvp(lambda c: scaled(act, c), (1.0,), (1.0,))
  assert float(jnp.abs(d_plain).max()) < 1e-6
  assert float(jnp.abs(d_act).max()) > 1e-2


def test_temperature_moves_from_dense_to_sparse_and_bounds_the_ratio():
  x = helpers.normal(4, (16,), 3.0)
  ws = [np.asarray(MOE_GATE(x, tau=t)) for t in (4.0, 1.0, 0.2, 0.02)]
  ents = [float(-(w * np.log(np.maximum(w, 1e-30))).sum()) for w in ws]
  assert all(a > b for a, b in zip(ents, ents[1:], strict=False))
  tops = [w.max() for w in ws]  # the largest weight grows as tau falls
  assert all(a < b for a, b in zip(tops, tops[1:], strict=False)) and tops[-1] > 0.3
  # the logits lie in (0, 1/tau): every weight is at least e^{-1/tau} times the largest
  for w, t in zip(ws[:2], (4.0, 1.0), strict=True):
    assert w.min() >= np.exp(-1.0 / t) * w.max() * (1 - 1e-6)


def test_gradients_float64_masks_low_precision():
  x, mask = helpers.random_rows(2)
  rows = x.shape[0]
  with jax.enable_x64(True):
    check_grads(lambda x, t: MOE_GATE(x, where=mask, tau=t),
                (jnp.asarray(x, jnp.float64), jnp.linspace(0.3, 2.0, rows)[:, None]),
                order=1, modes=("fwd", "rev"))
  xf, _ = helpers.random_rows(3, masked=False)
  helpers.check_low_precision(MOE_GATE, xf, tau=0.5)
  helpers.check_fully_masked(MOE_GATE, tau=0.5)
  # (mask = delete, the tile rule on random key splits and the chunked path are checked
  # for every registered spec by test_registry, test_tile_rules and test_core_registry)


def test_extreme_logits_and_bad_tau():
  big = jnp.array([[1e4, -1e4, 0.0], [-3e38, 3e38, 1.0]], jnp.float32)
  w = MOE_GATE(big, tau=0.01)
  assert np.all(np.isfinite(np.asarray(w)))
  chex.assert_trees_all_close(w.sum(-1), jnp.ones(2), atol=1e-6)
  g = jax.grad(lambda v: jnp.sum(MOE_GATE(v, tau=0.5) ** 2))(big)
  assert np.all(np.isfinite(np.asarray(g)))
  for bf in (jnp.bfloat16, jnp.float16):
    out = MOE_GATE(jnp.array([60000.0, -60000.0, 0.0], bf), tau=0.1)
    assert out.dtype == bf and np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))
  helpers.check_raises(("tau", lambda: N.moe_gate(big, tau=0.0)),
                       ("tau", lambda: N.moe_gate(big, tau=-1.0)),
                       ("tau", lambda: N.moe_gate(big, tau=jnp.ones((2, 3)))))


def test_posinf_takes_the_formula_limit():
  """sigmoid(+inf) = 1: a +inf router logit has the score 1/tau and shares the row with the
  others (numpy float64 from the formula), it does not take all the mass; its gradient is
  0 and the others' are finite."""
  inf = np.inf
  x = np.array([[inf, 1.0, 0.0, -1.0], [inf, 2.0, inf, -inf]], np.float32)
  for tau in (1.0, 0.1):
    vis = x != -inf
    s = np.where(vis, 1.0 / (1.0 + np.exp(-np.where(vis, x, 0.0).astype(np.float64))), 0.0)
    e = np.where(vis, np.exp(s / tau), 0.0)
    got = N.moe_gate(jnp.asarray(x), tau=tau)
    np.testing.assert_allclose(np.asarray(got, np.float64), e / e.sum(-1, keepdims=True),
                               rtol=1e-6, atol=1e-7)
  g = np.asarray(jax.grad(lambda v: N.moe_gate(v)[0, 1])(jnp.asarray(x)))
  assert np.all(np.isfinite(g)) and g[0, 0] == 0 and g[0, 1] > 0
