"""L02 Fenchel-Young losses against optax, the definition computed densely, and p - y."""

import functools

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxsoft as js
from tests import helpers
from tests.helpers import LOW_PRECISION, normal, value_and_vjp

fy = js.losses.fenchel_young_loss
_logits = functools.partial(normal, scale=1.5)


# ------------------------------------------------------- dense float64 references (numpy)


def _ref_weights(z, alpha):
  """argmax_p <z, p> - Omega_alpha(p) over the simplex, one row, float64."""
  z = np.asarray(z, np.float64)
  if alpha == 1.0:
    e = np.exp(z - z.max())
    return e / e.sum()
  if alpha == 2.0:  # sparsemax by sorting (Martins & Astudillo 2016)
    s = np.sort(z)[::-1]
    cs = np.cumsum(s)
    k = np.arange(1, len(z) + 1)
    support = k[1 + k * s > cs].max()
    tau = (cs[support - 1] - 1) / support
    return np.maximum(z - tau, 0.0)
  # alpha-entmax by bisection on tau: p = [(alpha-1) z - tau]_+^(1/(alpha-1)), sum p = 1
  zs = (alpha - 1) * z
  lo, hi = zs.max() - 1.0, zs.max()
  for _ in range(200):
    mid = (lo + hi) / 2
    if np.sum(np.maximum(zs - mid, 0.0) ** (1 / (alpha - 1))) >= 1:
      lo = mid
    else:
      hi = mid
  p = np.maximum(zs - lo, 0.0) ** (1 / (alpha - 1))
  return p / p.sum()


def _ref_omega(p, alpha):
  p = np.asarray(p, np.float64)
  if alpha == 1.0:
    return float(np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)))
  return float((np.sum(p ** alpha) - 1.0) / (alpha * (alpha - 1.0)))


def _ref_loss_and_grad(x, y, alpha):
  """The definition Omega(y) - Omega(p) + <x, p - y> and its gradient p - y, per row."""
  x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
  y = np.asarray(y, np.float64).reshape(x.shape)
  alphas = np.broadcast_to(np.asarray(alpha, np.float64).reshape(-1), (x.shape[0],))
  loss, grad = np.zeros(x.shape[0]), np.zeros_like(x)
  for r in range(x.shape[0]):
    p = _ref_weights(x[r], alphas[r])
    loss[r] = _ref_omega(y[r], alphas[r]) - _ref_omega(p, alphas[r]) + x[r] @ (p - y[r])
    grad[r] = p - y[r]
  return loss, grad


NAMES = [("softmax", {}, 1.0), ("sparsemax", {}, 2.0), ("entmax15", {}, 1.5),
         ("entmax", {"alpha": 1.3}, 1.3),
         pytest.param("entmax", {"alpha": 1.5}, 1.5, marks=pytest.mark.slow),
         pytest.param("entmax", {"alpha": 2.5}, 2.5, marks=pytest.mark.slow)]


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name,hp,alpha", NAMES)
def test_matches_definition_and_gradient_is_p_minus_y(name, hp, alpha):
  x = _logits(0, (6, 7))
  labels = jax.random.randint(jax.random.key(1), (6,), 0, 7)
  targets = jax.nn.softmax(2 * helpers.standard_normal(2, (6, 7)))
  targets = targets.at[0].set(jnp.array([0.5, 0.5, 0, 0, 0, 0, 0]))  # zeros in the target
  for y_arg, y_dense in ((labels, jax.nn.one_hot(labels, 7)), (targets, targets)):
    out, (dx,), ct = value_and_vjp(lambda a, y=y_arg: fy(a, y, name, **hp), x)
    ref_loss, ref_grad = _ref_loss_and_grad(x, y_dense, alpha)
    chex.assert_trees_all_close(out, ref_loss.astype(np.float32), rtol=1e-4, atol=2e-5)
    chex.assert_trees_all_close(dx, (ct[:, None] * ref_grad).astype(np.float32), rtol=1e-4,
                                atol=2e-5)
    assert np.all(out >= 0.0)


def _matches_optax(name, optax_loss, seed, shape):
  """fy(x, labels, name) and its VJP equal ``optax_loss``'s on random logits and labels
  (drawn with seeds ``seed`` and ``seed + 1``); returns x, labels, dx and the cotangent."""
  x = _logits(seed, shape)
  labels = jax.random.randint(jax.random.key(seed + 1), shape[:1], 0, shape[1])
  out, (dx,), ct = value_and_vjp(lambda a: fy(a, labels, name), x)
  ref, (rdx,), _ = value_and_vjp(lambda a: optax_loss(a, labels), x)
  chex.assert_trees_all_close((out, dx), (ref, rdx), rtol=1e-5, atol=1e-6)
  return x, labels, dx, ct


def test_softmax_is_cross_entropy_and_kl():
  x, _, _, _ = _matches_optax("softmax", optax.losses.softmax_cross_entropy_with_integer_labels,
                              3, (5, 6))
  y = jax.nn.softmax(helpers.standard_normal(5, (5, 6)))
  # one compilation instead of one per eager operation
  ours, kl = jax.jit(lambda x, y: (fy(x, y, "softmax"), optax.losses.softmax_cross_entropy(x, y)
                                   + jnp.sum(y * jnp.log(y), -1)))(x, y)
  chex.assert_trees_all_close(ours, kl, rtol=1e-5, atol=1e-6)


def test_sparsemax_matches_optax_multiclass_sparsemax_loss():
  x, labels, dx, ct = _matches_optax("sparsemax", optax.losses.multiclass_sparsemax_loss, 6,
                                     (8, 5))
  p = jax.jit(jax.vmap(optax.projections.projection_simplex))(x)
  chex.assert_trees_all_close(dx, ct[:, None] * (p - jax.nn.one_hot(labels, 5)), atol=1e-6)


def test_zero_iff_prediction_equals_target():
  f = jax.jit(fy, static_argnames="normalizer")
  labels = jnp.array([0, 0, 0, 0])
  # sparsemax: margins 1, 0.5, -0.1 (0 iff the margin is >= 1); entmax15: margins 2, 1.9
  # (0 iff the margin is >= 1/(alpha - 1) = 2); softmax is never exactly 0
  x = jnp.array([[2.0, 1.0, 0.5], [1.5, 1.0, 0.0], [0.9, 1.0, 0.0], [3.0, 1.0, 0.5]])
  x15 = jnp.array([[3.0, 1.0, 0.5], [2.9, 1.0, 0.0], [3.0, 1.0, 0.5], [3.0, 1.0, 0.5]])
  out, dx = jax.jit(jax.value_and_grad(lambda a: fy(a, labels, "sparsemax")[0]))(x)
  assert out == 0.0 and np.all(dx == 0.0)
  out = f(x, labels, normalizer="sparsemax")
  assert out[0] == 0.0 and out[1] > 0 and out[2] > 0
  out15 = f(x15, labels, normalizer="entmax15")
  assert out15[0] == 0.0 and out15[1] > 0
  assert f(x15, labels, normalizer="softmax")[0] > 0
  # a probability target equal to the prediction gives 0
  z = jnp.array([[0.3, 0.1, -0.2], [0.25, 0.2, 0.0], [2.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
  y = jax.jit(jax.vmap(optax.projections.projection_simplex))(z)
  np.testing.assert_allclose(f(z, y, normalizer="sparsemax"), 0.0, atol=1e-6)


def test_alpha_limits_and_per_row_alpha():
  x = _logits(8, (4, 6))
  labels = jnp.array([0, 1, 2, 3])
  # every limit in one compilation instead of one per eager operation
  (e1, soft), (e2, sparse), (e15, ent15) = jax.jit(lambda x: [
      (fy(x, labels, "entmax", alpha=a), fy(x, labels, n))
      for a, n in ((1.001, "softmax"), (2.0, "sparsemax"), (1.5, "entmax15"))])(x)
  chex.assert_trees_all_close(e1, soft, rtol=1e-2, atol=1e-3)
  chex.assert_trees_all_close(e2, sparse, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(e15, ent15, rtol=1e-5, atol=1e-6)
  alpha = jnp.array([1.2, 1.5, 2.0, 3.0])[:, None]
  out, (dx,), ct = value_and_vjp(lambda a: fy(a, labels, "entmax", alpha=alpha), x)
  ref_loss, ref_grad = _ref_loss_and_grad(x, jax.nn.one_hot(labels, 6), np.asarray(alpha))
  chex.assert_trees_all_close(out, ref_loss.astype(np.float32), rtol=1e-4, atol=2e-5)
  chex.assert_trees_all_close(dx, (ct[:, None] * ref_grad).astype(np.float32), rtol=1e-4,
                              atol=2e-5)


def test_gradient_in_alpha_matches_finite_differences():
  y = jax.nn.softmax(helpers.standard_normal(9, (3, 5)))
  x = _logits(10, (3, 5))

  def f(alpha):
    return fy(x, y, "entmax", alpha=alpha).sum()

  g = jax.jit(jax.grad(f))(jnp.float32(1.6))
  h = 1e-3
  ref = [(_ref_loss_and_grad(x, y, a + h)[0].sum() - _ref_loss_and_grad(x, y, a - h)[0].sum())
         / (2 * h) for a in (1.6,)][0]
  np.testing.assert_allclose(g, ref, rtol=2e-3, atol=1e-5)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(11), (3, 5), jnp.float64)
    y = jax.nn.softmax(jax.random.normal(jax.random.key(12), (3, 5), jnp.float64))
    labels = jnp.array([0, 4, 2])
    check_grads(jax.jit(lambda a: fy(a, labels, "softmax")), (x,), order=1, modes=["rev"])
    check_grads(jax.jit(lambda a: fy(a, y, "sparsemax")), (x,), order=1, modes=["rev"])
    check_grads(jax.jit(lambda a, al: fy(a, y, "entmax", alpha=al)),
                (x, jnp.array([[1.3], [1.7], [2.2]])), order=1, modes=["rev"], eps=1e-6)


def test_masks_and_ignored_labels():
  x = _logits(13, (5, 6))
  labels = jnp.array([1, 2, -100, 0, 3])
  where = jnp.array([[True, True, True, False, True, True]])
  out, (dx,), ct = value_and_vjp(
      lambda a: fy(a, labels, "sparsemax", where=where, ignore_index=-100), x)
  cols = np.array([0, 1, 2, 4, 5])
  keep = np.array([0, 1, 3])
  ref_fn = lambda a: optax.losses.multiclass_sparsemax_loss(a, labels[keep])
  ref, rdx = jax.jit(lambda a: (ref_fn(a), jax.grad(lambda b: jnp.sum(ref_fn(b) * ct[keep]))(a)))(
      x[keep][:, cols])
  chex.assert_trees_all_close(out[keep], ref, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(dx[keep][:, cols], rdx, rtol=1e-5, atol=1e-6)
  assert out[2] == 0.0 and np.all(dx[2] == 0.0)
  assert out[4] == jnp.inf                     # the label names the masked class 3
  assert np.all(dx[4] == 0.0) and np.all(dx[:, 3] == 0.0)
  # per-example mask and fully masked rows: 0 with zero gradient, never NaN
  rows = jnp.array([True, False, True, True, True])
  xm = np.array(x)
  xm[3] = -np.inf
  xm = jnp.asarray(xm)
  for name in ("softmax", "sparsemax", "entmax15"):
    out, (dx,), _ = value_and_vjp(lambda a, n=name: fy(a, labels, n, where=rows,
                                                      ignore_index=-100), xm)
    assert out[1] == 0.0 and out[3] == 0.0
    assert np.all(dx[1] == 0.0) and np.all(dx[3] == 0.0) and np.all(np.isfinite(dx))


def test_huge_logits_no_nan_and_shift_invariance():
  x = _logits(14, (4, 6))
  labels = jnp.array([0, 1, 2, 3])
  huge = jnp.array([[3e38, -3e38, 0.0, 1e30, 1.0, 2.0]])
  for name in ("softmax", "sparsemax", "entmax15"):
    # one compilation per normalizer instead of one per eager operation
    base, shifted, out0 = jax.jit(lambda x, n=name: (
        fy(x, labels, n), fy(x + 1000.0, labels, n), fy(huge, jnp.array([0]), n)))(x)
    chex.assert_trees_all_close(shifted, base, atol=1e-3)
    out, (dx,), _ = value_and_vjp(lambda a, n=name: fy(a, jnp.array([1]), n), huge)
    assert not np.isnan(out).any() and np.all(np.isfinite(dx))
    assert out0[0] == 0.0


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_is_computed_in_float32(dtype):
  x = _logits(15, (4, 6), dtype=dtype)
  labels = jnp.array([0, 1, 2, 3])
  for name in ("sparsemax", "entmax15"):
    out = fy(x, labels, name)
    assert out.dtype == dtype
    chex.assert_trees_all_close(out.astype(jnp.float32), fy(x.astype(jnp.float32), labels, name),
                                rtol=1e-2, atol=1e-3)
    dx = jax.grad(lambda a, n=name: fy(a, labels, n).astype(jnp.float32).sum())(x)
    assert dx.dtype == dtype


def test_jit_and_vmap():
  x = _logits(16, (3, 4, 6))
  labels = jax.random.randint(jax.random.key(17), (3, 4), 0, 6)
  for name, hp in (("sparsemax", {}), ("entmax", {"alpha": 1.7})):
    f = jax.jit(lambda a, b, n=name, h=hp: fy(a, b, n, **h))
    chex.assert_trees_all_close(jax.vmap(f)(x, labels), f(x, labels), rtol=1e-5, atol=1e-6)


def test_class_axis():
  x = _logits(18, (5, 3))
  labels = jnp.array([0, 4, 2])
  chex.assert_trees_all_close(fy(x, labels, "entmax15", axis=0), fy(x.T, labels, "entmax15"),
                              rtol=1e-6)


def test_registered_spec_is_accepted():
  x = _logits(19, (2, 4))
  labels = jnp.array([0, 3])
  chex.assert_trees_all_close(fy(x, labels, js.normalizers.get("softmax")),
                              fy(x, labels, "softmax"))


def test_bad_input_names_the_argument():
  x = _logits(20, (3, 5))
  labels = jnp.array([0, 1, 2])
  with pytest.raises(KeyError, match="normalizer"):
    fy(x, labels, "no_such_normalizer")
  with pytest.raises(KeyError, match="normalizer"):
    fy(x, labels, "softpick")            # a registered normalizer without a Tsallis entropy
  for bad in (1.0, 0.5, np.array([[1.5], [1.0], [2.0]])):
    with pytest.raises(ValueError, match="alpha"):
      fy(x, labels, "entmax", alpha=bad)
  with pytest.raises(ValueError, match="temperature"):
    fy(x, labels, "sparsemax", temperature=2.0)
  with pytest.raises(ValueError, match="labels"):
    fy(x, jnp.array([0, 1]), "sparsemax")
  with pytest.raises(ValueError, match="labels"):
    fy(x, jnp.ones((3, 4)) / 4, "sparsemax")
  with pytest.raises(ValueError, match="ignore_index"):
    fy(x, jnp.ones((3, 5)) / 5, "sparsemax", ignore_index=0)
  with pytest.raises(ValueError, match="axis"):
    fy(x, labels, "sparsemax", axis=3)


_PROPERTY_FN = jax.jit(lambda x, labels, alpha: (
    jax.value_and_grad(lambda a: fy(a, labels, "entmax", alpha=alpha).sum())(x),
    js.normalizers.entmax(x, alpha=alpha), fy(x, labels, "entmax", alpha=alpha)))


@hypothesis.given(
    x=hnp.arrays(np.float32, (3, 5), elements=st.floats(-30, 30, width=32)),
    labels=hnp.arrays(np.int32, (3,), elements=st.integers(0, 4)),
    alpha=st.floats(1.05, 3.0))
def test_property_nonnegative_and_gradient_is_entmax_minus_one_hot(x, labels, alpha):
  """Hypothesis rows: L >= 0, and dL/dx = entmax(x) - e_y with N17 (another helper's
  normalizer) as the independent p; L = 0 exactly where that p is the one-hot target."""
  (loss, dx), p, per_row = _PROPERTY_FN(x, labels, jnp.float32(alpha))
  assert np.all(per_row >= 0.0)
  one_hot = np.eye(5, dtype=np.float32)[labels]
  chex.assert_trees_all_close(dx, p - one_hot, atol=2e-5)
  one_hot_rows = np.all(np.asarray(p) == one_hot, axis=-1)
  np.testing.assert_array_equal(np.asarray(per_row)[one_hot_rows], 0.0)
