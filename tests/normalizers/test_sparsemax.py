"""sparsemax (N16) against optax's simplex projection and a sort-based reference.

Also the dense evaluation of the class-T ThresholdRules of this family (sparsemax,
entmax15, entmax, top_k_softmax): bisection on ``mass`` then ``weight / sum(weight)``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as jn
from jaxsoft.normalizers import sparsemax
from tests import helpers
from tests.helpers import normal


@jax.jit
def reference_sparsemax(x, mask=None):
  """Martins & Astudillo (2016), Algorithm 1 over the last axis, written for clarity.

  Sort the visible entries descending, find k(z) = max{k : 1 + k z_(k) > sum_{j<=k} z_(j)},
  tau = (sum_{j<=k} z_(j) - 1) / k, p = [z - tau]_+. Differentiable with jax (the sort
  permutes, the rest is smooth for a fixed support), so its jacfwd is a gradient oracle.
  """
  if mask is None:
    mask = jnp.ones(x.shape, bool)
  z = -jnp.sort(-jnp.where(mask, x, -jnp.inf), axis=-1)  # descending, masked last
  visible = jnp.isfinite(z)
  k = jnp.broadcast_to(jnp.arange(1, x.shape[-1] + 1, dtype=x.dtype), x.shape)
  cumsum = jnp.cumsum(jnp.where(visible, z, 0.0), axis=-1)
  in_support = visible & (1 + k * z > cumsum)
  k_z = jnp.max(jnp.where(in_support, k, 0), axis=-1, keepdims=True).astype(jnp.int32)
  sum_top = jnp.take_along_axis(cumsum, jnp.maximum(k_z - 1, 0), axis=-1)
  tau = (sum_top - 1) / jnp.maximum(k_z, 1)
  return jnp.where(mask, jnp.maximum(x - tau, 0), 0.0)


@pytest.mark.parametrize("shape,scale", [((64, 7), 1.0), ((32, 50), 0.1), ((32, 50), 3.0),
                                         ((16, 300), 1.0), ((8, 1), 1.0)])
def test_matches_optax_projection(shape, scale):
  x = normal(0, shape, scale)
  chex.assert_trees_all_close(sparsemax(x), jax.vmap(optax.projections.projection_simplex)(x),
                              atol=2e-6, rtol=1e-5)


def test_hard_rows_many_michelot_passes():
  # Geometric gaps put almost every entry just outside the support of the previous pass,
  # the slow case of the Newton/Michelot iteration; the result must still be exact.
  n = 60
  geo = -(1.0 - 0.9 ** jnp.arange(n)) * 1.2
  flat = jnp.linspace(0.0, -0.05, n)
  x = jnp.stack([geo, flat, geo[::-1], jnp.zeros(n), jnp.full(n, 3.0).at[7].set(5.0)])
  chex.assert_trees_all_close(sparsemax(x), reference_sparsemax(x), atol=1e-6)
  chex.assert_trees_all_close(sparsemax(x), jax.vmap(optax.projections.projection_simplex)(x),
                              atol=1e-6)


def test_closed_forms_and_simplex():
  t = jnp.linspace(-3, 3, 25)
  p = sparsemax(jnp.stack([t, jnp.zeros_like(t)], -1))
  chex.assert_trees_all_close(p[:, 0], jnp.clip((t + 1) / 2, 0, 1), atol=1e-6)
  q = jax.nn.softmax(normal(1, (8, 9)))  # idempotent on the simplex
  chex.assert_trees_all_close(sparsemax(q), q, atol=1e-6)
  x = normal(2, (50, 20), 2.0)
  p = sparsemax(x)
  assert bool(jnp.all(p >= 0)) and bool(jnp.any(p == 0))
  chex.assert_trees_all_close(p.sum(-1), jnp.ones(50), atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_axis(axis):
  x = normal(3, (5, 6, 7))
  want = jnp.moveaxis(reference_sparsemax(jnp.moveaxis(x, axis, -1)), -1, axis)
  chex.assert_trees_all_close(sparsemax(x, axis=axis), want, atol=1e-6)


def test_gradients_match_reference_with_random_cotangent():
  x = normal(4, (6, 11), 1.5)
  mask = jax.random.bernoulli(jax.random.PRNGKey(5), 0.8, x.shape).at[0].set(False)
  helpers.vjp_close(lambda v: sparsemax(v, where=mask), lambda v: reference_sparsemax(v, mask), x,
                    atol=1e-6, rtol=1e-6, vjp_atol=1e-5, ct=normal(6, x.shape))
  chex.assert_trees_all_close(jax.jacfwd(lambda v: sparsemax(v, where=mask))(x),
                              jax.jacfwd(lambda v: reference_sparsemax(v, mask))(x), atol=1e-5)


def test_check_grads_float64_away_from_kinks():
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.PRNGKey(7), (3, 7), dtype=jnp.float64)
    p = sparsemax(x)
    tau = (jnp.sum(jnp.where(p > 0, x, 0), -1, keepdims=True) - 1) / jnp.sum(p > 0, -1,
                                                                               keepdims=True)
    assert float(jnp.min(jnp.abs(x - tau))) > 1e-3  # no entry sits on a support change
    assert sparsemax(x).dtype == jnp.float64
    check_grads(sparsemax, (x,), order=1, modes=("fwd", "rev"), eps=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 2e-2), (jnp.float16, 2e-3)])
def test_low_precision_computed_in_float32(dtype, tol):
  x = normal(8, (16, 40), 2.0)
  y = sparsemax(x.astype(dtype))
  assert y.dtype == dtype
  want = reference_sparsemax(x.astype(dtype).astype(jnp.float32))
  chex.assert_trees_all_close(y.astype(jnp.float32), want, atol=tol)
  big = sparsemax(jnp.full((3,), 60000.0, dtype).at[1].set(-60000.0))
  assert not bool(jnp.any(jnp.isnan(big.astype(jnp.float32))))
  chex.assert_trees_all_close(big.astype(jnp.float32), jnp.array([0.5, 0.0, 0.5]), atol=1e-3)


def test_mask_equals_deleting_the_column_and_inf_logits():
  x = normal(9, (10, 12))
  keep = np.ones(12, bool)
  keep[[2, 5, 11]] = False
  p = sparsemax(x, where=keep)
  chex.assert_trees_all_close(p[:, keep], sparsemax(x[:, keep]), atol=1e-6)
  assert bool(jnp.all(p[:, ~keep] == 0))
  chex.assert_trees_all_close(sparsemax(jnp.where(keep, x, -jnp.inf)), p, atol=0)


def test_fully_masked_rows_are_zero_with_zero_gradient():
  x = normal(10, (3, 5))
  mask = jnp.array([[True] * 5, [False] * 5, [True, False, True, False, False]])
  p = sparsemax(x, where=mask)
  assert bool(jnp.all(p[1] == 0))
  g = jax.grad(lambda v: jnp.sum(sparsemax(v, where=mask) * jnp.arange(5.0)[None]))(x)
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(g[1] == 0))
  g_inf = jax.grad(lambda v: jnp.sum(sparsemax(v) ** 2))(jnp.full((2, 4), -jnp.inf))
  assert bool(jnp.all(g_inf == 0))


@pytest.mark.parametrize("shift", [1000.0, -1000.0])
def test_shifted_logits(shift):
  x = normal(11, (8, 30))
  chex.assert_trees_all_close(sparsemax(x + shift), sparsemax(x), atol=2e-4)


def test_jit_vmap_grad():
  x = normal(12, (4, 3, 8))
  chex.assert_trees_all_close(jax.jit(sparsemax)(x), sparsemax(x), atol=0)
  chex.assert_trees_all_close(jax.vmap(sparsemax)(x), sparsemax(x), atol=1e-7)
  chex.assert_trees_all_close(jax.vmap(sparsemax, in_axes=1, out_axes=1)(x), sparsemax(x),
                              atol=1e-7)
  g = jax.jit(jax.grad(lambda v: jnp.sum(sparsemax(v)[..., 0])))(x)
  ref = jax.grad(lambda v: jnp.sum(reference_sparsemax(v)[..., 0]))(x)
  chex.assert_trees_all_close(g, ref, atol=1e-5)


def test_bad_input():
  with pytest.raises(ValueError, match="axis"):
    sparsemax(jnp.ones((2, 3)), axis=2)
  with pytest.raises(ValueError, match="where"):
    sparsemax(jnp.ones((2, 3)), where=jnp.ones((4,), bool))
  with pytest.raises(ValueError, match="x"):
    sparsemax(jnp.float32(1.0))


def test_spec():
  spec = jn.get("sparsemax")
  assert spec.fn is sparsemax and spec.kernel_class == "T" and spec.catalogue_id == "N16"
  assert spec.can_be_sparse and spec.sums_to_one and spec.threshold is not None


# --- dense evaluation of the class-T rules of this family ---------------------------------


def dense_threshold_rule(spec, x, mask, **hp):
  """Evaluates ``spec.threshold`` by plain bisection over whole rows (the docstring's recipe)."""
  rule = spec.threshold
  n = jnp.sum(mask, -1, keepdims=True).astype(jnp.float32)
  z = rule.score_map(x, n, **hp)
  m = jnp.max(jnp.where(mask, z, -jnp.inf), -1, keepdims=True)
  lo, hi = rule.bracket(m, n, **hp)
  target = rule.target(n, **hp)
  for _ in range(rule.iterations):
    mid = 0.5 * (lo + hi)
    mass = jnp.sum(jnp.where(mask, rule.mass(z, mid, **hp), 0.0), -1, keepdims=True)
    lo, hi = jnp.where(mass >= target, mid, lo), jnp.where(mass >= target, hi, mid)
  w = jnp.where(mask, rule.weight(z, lo, m, **hp), 0.0)
  return w / jnp.sum(w, -1, keepdims=True)


@pytest.mark.parametrize("name,hp", [("sparsemax", {}), ("entmax15", {}),
                                     ("entmax", {"alpha": 1.5}), ("entmax", {"alpha": 1.25}),
                                     ("entmax", {"alpha": 3.0}), ("top_k_softmax", {"k": 3}),
                                     ("top_k_softmax", {"k": 8})])
def test_threshold_rule_matches_fn(name, hp):
  spec = jn.get(name)
  x = normal(13, (12, 16), 2.0)
  mask = jax.random.bernoulli(jax.random.PRNGKey(14), 0.8, x.shape).at[:, 0].set(True)
  # alpha > 2 has p ~ (z - tau)^{1/(alpha-1)} with an infinite slope at the support's edge,
  # which magnifies the float32 resolution of tau.
  atol = 2e-5 if hp.get("alpha", 1.5) > 2 else 2e-6
  chex.assert_trees_all_close(dense_threshold_rule(spec, x, mask, **hp),
                              spec.fn(x, where=mask, **hp), atol=atol, rtol=1e-5)
