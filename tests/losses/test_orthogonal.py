"""L04 ⊥Grad (orthogonal_gradient) against a float64 numpy reference and inside optax.chain."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests import helpers


def _reference(g, theta):
  """float64: g_perp = g - <g,theta>/|theta|^2 theta, rescaled to |g| (Prieto et al. 2025)."""
  g = np.asarray(g, np.float64).ravel()
  t = np.asarray(theta, np.float64).ravel()
  g_perp = g - (g @ t) / (t @ t) * t
  return (g_perp * np.linalg.norm(g) / np.linalg.norm(g_perp)).reshape(np.shape(theta))


def _tree(seed):
  keys = jax.random.split(jax.random.key(seed), 6)
  params = {"w": jax.random.normal(keys[0], (5, 4)), "b": jax.random.normal(keys[1], (4,)),
            "emb": {"table": jax.random.normal(keys[2], (3, 2, 6)).astype(jnp.bfloat16)}}
  grads = {"w": jax.random.normal(keys[3], (5, 4)), "b": jax.random.normal(keys[4], (4,)),
           "emb": {"table": jax.random.normal(keys[5], (3, 2, 6)).astype(jnp.bfloat16)}}
  return params, grads


def test_matches_reference_orthogonal_and_norm_preserving():
  params, grads = _tree(0)
  tx = js.losses.orthogonal_gradient()
  out, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert isinstance(state, optax.EmptyState)
  for path in (("w",), ("b",), ("emb", "table")):
    g, t, o = grads, params, out
    for k in path:
      g, t, o = g[k], t[k], o[k]
    assert o.dtype == g.dtype and o.shape == g.shape
    tol = 1e-2 if g.dtype == jnp.bfloat16 else 1e-5
    chex.assert_trees_all_close(np.asarray(o, np.float64), _reference(g, t), rtol=tol, atol=tol)
    o64, t64, g64 = (np.asarray(a, np.float64).ravel() for a in (o, t, g))
    assert abs(o64 @ t64) <= tol * np.linalg.norm(o64) * np.linalg.norm(t64)
    np.testing.assert_allclose(np.linalg.norm(o64), np.linalg.norm(g64), rtol=tol)


def test_edge_cases():
  tx = js.losses.orthogonal_gradient()
  theta = jnp.array([1.0, 2.0, -1.0])
  params = {"perp": theta, "par": theta, "zero_param": jnp.zeros(3), "zero_grad": theta,
            "scalar": jnp.array(2.0)}
  g_perp = jnp.array([2.0, -1.0, 0.0])    # already orthogonal to theta
  grads = {"perp": g_perp, "par": -3.0 * theta, "zero_param": jnp.array([1.0, 2.0, 3.0]),
           "zero_grad": jnp.zeros(3), "scalar": jnp.array(0.7)}
  out, _ = tx.update(grads, tx.init(params), params)
  chex.assert_trees_all_close(out["perp"], g_perp, rtol=1e-6)       # unchanged when g ⊥ θ
  np.testing.assert_array_equal(out["par"], 0.0)                     # g ∥ θ: nothing is left
  chex.assert_trees_all_close(out["zero_param"], grads["zero_param"])  # θ = 0: no projection
  np.testing.assert_array_equal(out["zero_grad"], 0.0)
  np.testing.assert_array_equal(out["scalar"], 0.0)                  # one element: always ∥
  assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(out))


def test_requires_params():
  tx = js.losses.orthogonal_gradient()
  params, grads = _tree(1)
  with pytest.raises(ValueError, match="params"):
    tx.update(grads, tx.init(params))


def test_inside_chain_with_adamw():
  params, grads = _tree(2)
  params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  grads = jax.tree.map(lambda a: a.astype(jnp.float32), grads)
  tx = optax.chain(js.losses.orthogonal_gradient(), optax.adamw(1e-2, weight_decay=1e-3))
  adamw = optax.adamw(1e-2, weight_decay=1e-3)
  state, ref_state = tx.init(params), adamw.init(params)
  p, ref_p = params, params
  step = jax.jit(tx.update)
  for i in range(3):
    g = jax.tree.map(lambda a, i=i: a * (1.0 + i), grads)
    updates, state = step(g, state, p)
    g_perp = jax.tree.map(lambda gg, pp: jnp.asarray(_reference(gg, pp), jnp.float32), g, ref_p)
    ref_updates, ref_state = adamw.update(g_perp, ref_state, ref_p)
    chex.assert_trees_all_close(updates, ref_updates, rtol=1e-4, atol=1e-7)
    p, ref_p = optax.apply_updates(p, updates), optax.apply_updates(ref_p, ref_updates)
  chex.assert_trees_all_close(p, ref_p, rtol=1e-5, atol=1e-6)


def test_removes_the_weight_growth_direction():
  """On separable data the softmax-CE gradient of a linear model has a component along W
  (naive loss minimisation: scaling W up lowers the loss). ⊥Grad's step has none, so it
  does not change the loss to first order along W, and a small step barely grows |W|."""
  feats = helpers.standard_normal(3, (32, 5))
  w_true = helpers.standard_normal(4, (5, 3))
  y = jnp.argmax(feats @ w_true, -1)
  w = 3.0 * w_true
  loss = lambda w: js.losses.softmax_cross_entropy_with_integer_labels(feats @ w, y).mean()
  g = jax.grad(loss)(w)
  assert float(jnp.vdot(g, w)) < 0          # descent along -g grows |W|
  tx = js.losses.orthogonal_gradient()
  u, _ = tx.update({"w": g}, tx.init({"w": w}), {"w": w})
  np.testing.assert_allclose(float(jnp.vdot(u["w"], w)), 0.0,
                             atol=1e-5 * float(jnp.linalg.norm(g) * jnp.linalg.norm(w)))
  lr = 1e-2
  grown_plain = jnp.linalg.norm(w - lr * g) - jnp.linalg.norm(w)
  grown_perp = jnp.linalg.norm(w - lr * u["w"]) - jnp.linalg.norm(w)
  assert grown_plain > 0 and abs(grown_perp) < 0.1 * grown_plain
