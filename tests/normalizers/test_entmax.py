"""alpha-entmax (N17): entmax15 exact, entmax bisection for any alpha, d/d alpha, learned alpha."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft as js
import jaxsoft.normalizers as jn
from jaxsoft.normalizers import entmax, entmax15, learned_alpha, sparsemax
from tests import helpers
from tests.helpers import normal


@jax.jit
def reference_entmax15(x, mask=None):
  """Peters, Niculae & Martins (2019), Algorithm 2 (sort-based, exact), written for clarity.

  With z = x/2 sorted descending, for each prefix k: mean_k, the mean of squares ss_k,
  delta_k = (1 - k (ss_k - mean_k^2)) / k, tau_k = mean_k - sqrt(delta_k); the support
  size is the largest k with tau_k <= z_(k). Differentiable for a fixed support.
  """
  if mask is None:
    mask = jnp.ones(x.shape, bool)
  z = -jnp.sort(-jnp.where(mask, x / 2, -jnp.inf), axis=-1)
  visible = jnp.isfinite(z)
  zv = jnp.where(visible, z, 0.0)
  k = jnp.broadcast_to(jnp.arange(1, x.shape[-1] + 1, dtype=x.dtype), x.shape)
  mean = jnp.cumsum(zv, -1) / k
  mean_sq = jnp.cumsum(zv * zv, -1) / k
  delta = (1 - k * (mean_sq - mean**2)) / k
  safe = delta > 0  # sqrt only where defined, so the jax gradient has no NaN
  tau_k = mean - jnp.where(safe, jnp.sqrt(jnp.where(safe, delta, 1.0)), 0.0)
  in_support = visible & (tau_k <= z)
  k_z = jnp.max(jnp.where(in_support, k, 0), -1, keepdims=True).astype(jnp.int32)
  tau = jnp.take_along_axis(tau_k, jnp.maximum(k_z - 1, 0), -1)
  return jnp.where(mask, jnp.maximum(x / 2 - tau, 0) ** 2, 0.0)


def reference_entmax_bisect(x, alpha, iters=200):
  """float64 numpy bisection on tau for any alpha (the definition, no tricks)."""
  x = np.asarray(x, np.float64)
  alpha = np.broadcast_to(np.asarray(alpha, np.float64), x.shape[:-1] + (1,))
  z = (alpha - 1) * x
  lo = z.max(-1, keepdims=True) - 1
  hi = z.max(-1, keepdims=True)
  for _ in range(iters):
    mid = (lo + hi) / 2
    f = (np.maximum(z - mid, 0) ** (1 / (alpha - 1))).sum(-1, keepdims=True) - 1
    lo, hi = np.where(f >= 0, mid, lo), np.where(f >= 0, hi, mid)
  p = np.maximum(z - lo, 0) ** (1 / (alpha - 1))
  return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("shape,scale", [((32, 9), 1.0), ((16, 60), 0.2), ((16, 60), 4.0),
                                         ((4, 500), 1.0)])
def test_entmax15_exact_vs_sort_reference(shape, scale):
  x = normal(0, shape, scale)
  # The float32 sort reference loses digits in ss_k - mean_k^2 at large scales.
  chex.assert_trees_all_close(entmax15(x), reference_entmax15(x), atol=2e-6 * max(scale, 1) ** 2)
  chex.assert_trees_all_close(entmax15(x), reference_entmax_bisect(x, 1.5), atol=2e-6)


def test_entmax15_hard_rows():
  n = 50
  geo = -(1.0 - 0.9 ** jnp.arange(n)) * 2.5
  x = jnp.stack([geo, geo[::-1], jnp.linspace(0, -0.1, n), jnp.zeros(n),
                 jnp.full(n, -2.0).at[3].set(1.0)])
  chex.assert_trees_all_close(entmax15(x), reference_entmax15(x), atol=2e-6)


@pytest.mark.parametrize("alpha", [1.1, 1.25, 1.75, 2.5, 4.0])
def test_entmax_bisect_vs_float64_reference(alpha):
  x = normal(1, (16, 20), 2.0)
  chex.assert_trees_all_close(entmax(x, alpha=alpha), reference_entmax_bisect(x, alpha),
                              atol=3e-6)


def test_closed_form_special_cases():
  x = normal(2, (16, 25), 1.5)
  traced = jnp.asarray  # an array alpha takes the bisection path, not the exact dispatch
  chex.assert_trees_all_close(entmax(x, alpha=traced(2.0)), sparsemax(x), atol=2e-6)
  chex.assert_trees_all_close(entmax(x, alpha=2.0), sparsemax(x), atol=0)
  chex.assert_trees_all_close(entmax(x, alpha=traced(1.5)), entmax15(x), atol=2e-6)
  chex.assert_trees_all_close(entmax(x, alpha=1.5), entmax15(x), atol=0)
  chex.assert_trees_all_close(entmax(x, alpha=1.0005), jax.nn.softmax(x), atol=2e-3)
  chex.assert_trees_all_close(entmax(x, alpha=traced(1.0005)), jax.nn.softmax(x), atol=2e-3)


def test_sparsity_non_decreasing_in_alpha():
  x = normal(3, (32, 30), 1.5)
  zeros = [int(jnp.sum(entmax(x, alpha=jnp.asarray(a)) == 0)) for a in (1.2, 1.5, 2.0, 3.0)]
  assert zeros == sorted(zeros) and zeros[0] < zeros[-1]


def test_per_row_alpha_broadcast():
  x = normal(4, (2, 3, 5, 12))  # [B, N, T, S]
  alpha = jnp.array([1.2, 1.6, 2.5]).reshape(3, 1, 1)  # one alpha per head
  p = entmax(x, alpha=alpha)
  for h, a in enumerate([1.2, 1.6, 2.5]):
    chex.assert_trees_all_close(p[:, h], reference_entmax_bisect(x[:, h], a), atol=3e-6)
  p0 = entmax(jnp.moveaxis(x, -1, 1), alpha=alpha.reshape(3, 1), axis=1)  # x: [B, S, N, T]
  chex.assert_trees_all_close(jnp.moveaxis(p0, 1, -1), p, atol=1e-6)


def test_entmax15_gradients_vs_reference():
  x = normal(5, (6, 10), 1.5)
  mask = jax.random.bernoulli(jax.random.PRNGKey(6), 0.8, x.shape).at[0].set(False)
  # jitted: one program each rather than op by op
  helpers.vjp_close(jax.jit(lambda v: entmax15(v, where=mask)),
                    lambda v: reference_entmax15(v, mask), x,
                    atol=2e-6, rtol=1e-6, vjp_atol=2e-5, ct=normal(7, x.shape))
  alpha = jnp.asarray(1.5)  # an array: the bisection path
  chex.assert_trees_all_close(jax.jit(jax.jacfwd(lambda v: entmax(v, alpha=alpha)))(x),
                              jax.jit(jax.jacfwd(reference_entmax15))(x), atol=2e-5)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.PRNGKey(8), (3, 7), dtype=jnp.float64)
    assert entmax15(x).dtype == jnp.float64
    # jitted: check_grads compiles each derivative program once instead of op by op
    check_grads(jax.jit(entmax15), (x,), order=1, modes=("fwd", "rev"), eps=1e-6)
    check_grads(jax.jit(lambda v, a: entmax(v, alpha=a)), (x, jnp.float64(1.3)), order=1,
                modes=("fwd", "rev"), eps=1e-6)


def test_dalpha_vs_finite_differences():
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.PRNGKey(9), (4, 9), dtype=jnp.float64) * 2
    ct = jax.random.normal(jax.random.PRNGKey(10), (4, 9), dtype=jnp.float64)
    alpha = jnp.array([1.2, 1.5, 1.9, 2.6]).reshape(4, 1)
    loss = lambda a: jnp.sum(entmax(x, alpha=a) * ct)  # noqa: E731
    g = jax.grad(loss)(alpha)
    h = 1e-6
    fd = jnp.stack([(loss(alpha.at[i].add(h)) - loss(alpha.at[i].add(-h))) / (2 * h)
                    for i in range(4)]).reshape(4, 1)
    chex.assert_trees_all_close(g, fd, atol=1e-6, rtol=1e-5)
    # the float64 numpy reference by finite differences, independently of the custom rule
    ref = lambda a: np.sum(reference_entmax_bisect(x, a) * np.asarray(ct))  # noqa: E731
    fd_ref = [(ref(np.asarray(alpha).copy() + h * (np.arange(4) == i)[:, None])
               - ref(np.asarray(alpha) - h * (np.arange(4) == i)[:, None])) / (2 * h)
              for i in range(4)]
    chex.assert_trees_all_close(g[:, 0], jnp.asarray(fd_ref), atol=1e-5, rtol=1e-4)


def test_learned_alpha():
  z = jnp.array([-30.0, -1.0, 0.0, 2.0, 40.0])
  a = learned_alpha(z)
  assert bool(jnp.all(a > 1.0))
  softplus64 = np.log1p(np.exp(np.asarray(z, np.float64)))
  chex.assert_trees_all_close(a, jnp.asarray(1.001 + softplus64, jnp.float32), rtol=1e-6)
  chex.assert_trees_all_close(learned_alpha(z, min_gap=0.0),
                              jnp.asarray(1 + softplus64, jnp.float32), rtol=1e-6)
  x = normal(11, (5, 8))
  g = jax.grad(lambda w: jnp.sum(entmax(x, alpha=learned_alpha(w)[:, None]) ** 2))(
      jnp.array([-1.0, 0.0, 0.5, 1.0, 2.0]))
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0))


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 2e-2), (jnp.float16, 2e-3)])
def test_low_precision(dtype, tol):
  x = normal(12, (8, 30), 2.0)
  xr = x.astype(dtype).astype(jnp.float32)
  for fn, ref in [(entmax15, reference_entmax15(xr)),
                  (lambda v: entmax(v, alpha=1.3), reference_entmax_bisect(xr, 1.3))]:
    y = fn(x.astype(dtype))
    assert y.dtype == dtype
    chex.assert_trees_all_close(y.astype(jnp.float32), jnp.asarray(ref, jnp.float32), atol=tol)
  big = jnp.full((4,), 60000.0, dtype).at[0].set(-60000.0)
  for fn in (entmax15, lambda v: entmax(v, alpha=1.3)):
    out = fn(big).astype(jnp.float32)
    chex.assert_trees_all_close(out, jnp.array([0, 1 / 3, 1 / 3, 1 / 3]), atol=2e-3)


@pytest.mark.parametrize("fn", [entmax15, lambda v, **k: entmax(v, alpha=1.3, **k),
                                lambda v, **k: entmax(v, alpha=jnp.asarray(2.5), **k)])
def test_masks_and_fully_masked_rows(fn):
  x = normal(13, (6, 10))
  mask = helpers.check_masked_columns(fn, x, cols=(1, 4), empty_row=2, atol=2e-6)
  g = jax.jit(jax.grad(lambda v: jnp.sum(fn(v, where=mask) * jnp.arange(10.0)[None])))(x)
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(g[2] == 0))


def test_fully_masked_row_alpha_gradient_is_zero():
  x = normal(14, (3, 6))
  mask = jnp.ones(x.shape, bool).at[1].set(False)
  g = jax.grad(lambda a: jnp.sum(entmax(x, alpha=a, where=mask) * jnp.arange(6.0)[None]),
               argnums=0)(jnp.array([1.4, 1.4, 1.4]).reshape(3, 1))
  assert bool(jnp.all(jnp.isfinite(g))) and float(g[1, 0]) == 0.0


@pytest.mark.parametrize("shift", [1000.0, -1000.0])
def test_shifted_logits(shift):
  x = normal(15, (6, 20))
  chex.assert_trees_all_close(entmax15(x + shift), entmax15(x), atol=3e-4)
  chex.assert_trees_all_close(entmax(x + shift, alpha=1.3), entmax(x, alpha=1.3), atol=3e-4)


def test_jit_vmap_grad():
  x = normal(16, (3, 4, 9))
  for fn in (entmax15, lambda v: entmax(v, alpha=1.7)):
    chex.assert_trees_all_close(jax.jit(fn)(x), fn(x), atol=1e-7)
    chex.assert_trees_all_close(jax.vmap(fn)(x), fn(x), atol=1e-6)
  alphas = jnp.array([1.2, 1.5, 2.0])
  pv = jax.vmap(lambda v, a: entmax(v, alpha=a))(x, alphas)
  chex.assert_trees_all_close(pv[1], reference_entmax15(x[1]), atol=3e-6)
  g = jax.jit(jax.grad(lambda v: jnp.sum(entmax15(v)[..., 0])))(x)
  ref = jax.grad(lambda v: jnp.sum(reference_entmax15(v)[..., 0]))(x)
  chex.assert_trees_all_close(g, ref, atol=2e-5)


def test_bad_input():
  x = jnp.ones((2, 3))
  for bad in (1.0, 0.5, -2.0, float("nan")):
    with pytest.raises(ValueError, match="alpha"):
      entmax(x, alpha=bad)
  with pytest.raises(ValueError, match="alpha"):
    entmax(x, alpha=jnp.array([[1.5], [0.9]]))
  with pytest.raises(ValueError, match="alpha"):
    entmax(x, alpha=jnp.ones((2, 3)) * 1.5)  # not one value per row
  with pytest.raises(ValueError, match="n_iter"):
    entmax(x, alpha=1.3, n_iter=0)
  with pytest.raises(ValueError, match="axis"):
    entmax15(x, axis=-3)
  with pytest.raises(ValueError, match="axis"):
    entmax(x, alpha=1.3, axis=5)


def test_specs():
  for name in ("entmax15", "entmax"):
    spec = jn.get(name)
    assert spec.kernel_class == "T" and spec.catalogue_id == "N17"
    assert spec.can_be_sparse and spec.shift_invariant and spec.threshold is not None
  assert jn.get("entmax").param("alpha").low == 1.0 and jn.get("entmax").param("alpha").low_open


def test_threshold_rule_mass_has_finite_gradients_for_alpha_above_2():
  """The blockwise paths differentiate the rule's mass ``[z - tau]_+^{1/(alpha-1)}``: for
  alpha > 2 its exponent is < 1 and the entries below tau once gave 0 * inf = NaN."""
  rule = jn.get("entmax").threshold
  z = jnp.array([0.5, 0.1, -0.3, -1.0])
  tau = jnp.asarray(0.0)

  def total(z, tau, alpha):
    return jnp.sum(rule.mass(z, tau, alpha=alpha) * jnp.arange(1.0, 5.0))

  for alpha in (1.25, 2.5, 4.0):
    g = jax.grad(total, argnums=(0, 1, 2))(z, tau, jnp.asarray(alpha))
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)
    q = 1.0 / (alpha - 1.0)
    # d/dz on the support: q (z - tau)^{q-1}; exactly 0 below tau
    want = jnp.where(z > 0, q * jnp.power(jnp.maximum(z, 1e-30), q - 1.0), 0.0) * jnp.arange(
        1.0, 5.0)
    chex.assert_trees_all_close(g[0], want, rtol=1e-5)


@pytest.mark.parametrize("fn", [entmax15, lambda x: entmax(x, alpha=1.5),
                                lambda x: entmax(x, alpha=jnp.float32(1.5))],
                         ids=["entmax15", "entmax_alpha_1.5", "entmax_traced_alpha"])
def test_hessian_is_finite_when_an_output_is_exactly_zero(fn):
  # Issue 37, defect 12: the JVP rule took sqrt(p) and its derivative at p = 0 was NaN, so
  # every second derivative was NaN as soon as one weight was exactly 0. The Hessian of a
  # linear read-out must be finite and equal a finite difference of the exact gradient.
  with jax.enable_x64(True):
    z = jnp.array([1.0, 0.8, 0.1, -1.0])
    c = jnp.array([0.3, -1.2, 0.7, 2.0])
    assert fn(z)[3] == 0.0
    hess = jax.jit(jax.hessian(lambda z: fn(z) @ c))(z)
    assert np.all(np.isfinite(np.asarray(hess)))
    grad = jax.jit(jax.grad(lambda z: fn(z) @ c))  # compiled once for the 8 evaluations
    eps = 1e-6
    fd = np.stack([(grad(z + eps * e) - grad(z - eps * e)) / (2 * eps) for e in np.eye(4)], 1)
    np.testing.assert_allclose(hess, fd, atol=1e-6)
    np.testing.assert_array_equal(hess[3], 0.0)  # off the support: no curvature


def test_traced_alpha_at_most_one_gives_nan_not_a_distribution():
  # Issue 37, defect 8: a traced alpha <= 1 (a learned alpha gone wrong) returned a
  # plausible-looking distribution with a gradient that did not match it. It cannot be
  # checked at trace time, so the row is NaN; a row with alpha > 1 is unaffected.
  x = jnp.array([[1.0, 0.8, 0.1, -1.0], [1.0, 0.8, 0.1, -1.0]])
  f = jax.jit(lambda x, a: entmax(x, alpha=a))
  out = f(x, jnp.array([[0.8], [1.25]]))
  assert np.all(np.isnan(np.asarray(out[0])))
  np.testing.assert_allclose(out[1], entmax(x[1], alpha=1.25), rtol=1e-6)
  assert np.all(np.isnan(np.asarray(f(x[0], jnp.float32(1.0)))))
  # masked entries stay exactly 0, as for any NaN row
  out = jax.jit(lambda x, a: entmax(x, alpha=a, where=jnp.array([True, True, False, True])))(
      x[0], jnp.float32(0.5))
  assert out[2] == 0 and np.all(np.isnan(np.asarray(out)[[0, 1, 3]]))


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_attention_with_traced_alpha_at_most_one_is_nan(implementation):
  q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
  alpha = jnp.array([0.9, 1.5])  # per head: head 0 has no entmax

  @jax.jit
  def f(q, alpha):
    return js.attention.entmax_attention(q, q, q, alpha=alpha, is_causal=True,
                                         implementation=implementation)
  out = f(q, alpha)
  assert np.all(np.isnan(np.asarray(out[:, :, 0])))
  assert np.all(np.isfinite(np.asarray(out[:, :, 1])))
