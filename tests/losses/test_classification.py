"""L01 softmax cross-entropy and L03 top-k sparse-softmax CE against optax and dense references."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxsoft as js
from tests.helpers import LOW_PRECISION, normal, value_and_vjp

sce = js.losses.softmax_cross_entropy
sce_int = js.losses.softmax_cross_entropy_with_integer_labels
topk_ce = js.losses.top_k_cross_entropy
_logits = functools.partial(normal, scale=2.0)


def _probs(seed, shape):
  return jax.nn.softmax(jax.random.normal(jax.random.key(seed), shape) * 2.0)


def _labels(seed, shape, n):
  return jax.random.randint(jax.random.key(seed), shape, 0, n)


# ---------------------------------------------------------------- L01, probability targets


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_soft_targets_match_optax(smoothing):
  x, y = _logits(0, (5, 7)), _probs(1, (5, 7))
  ours = value_and_vjp(lambda a, b: sce(a, b, label_smoothing=smoothing), x, y)
  ref = value_and_vjp(
      lambda a, b: optax.losses.softmax_cross_entropy(a, optax.smooth_labels(b, smoothing)), x, y)
  chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_soft_targets_class_axis_and_rank():
  x, y = _logits(2, (3, 6, 4)), _probs(3, (3, 6, 4))
  ours = value_and_vjp(lambda a, b: sce(a, b, axis=1), x, y)
  ref = value_and_vjp(lambda a, b: optax.losses.softmax_cross_entropy(a, b, axis=1), x, y)
  chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_soft_targets_class_mask_matches_optax_and_deleting_the_column():
  x, y = _logits(4, (4, 6)), _probs(5, (4, 6))
  where = jnp.ones((4, 6), bool).at[:, 2].set(False)
  ours = value_and_vjp(lambda a: sce(a, y, where=where), x)
  ref = value_and_vjp(lambda a: optax.losses.softmax_cross_entropy(a, y, where=where), x)
  chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)
  keep = np.array([0, 1, 3, 4, 5])
  deleted = value_and_vjp(lambda a: optax.losses.softmax_cross_entropy(a, y[:, keep]), x[:, keep])
  chex.assert_trees_all_close(ours[0], deleted[0], rtol=1e-5)
  chex.assert_trees_all_close(ours[1][0][:, keep], deleted[1][0], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(ours[1][0][:, 2], 0.0)


def test_soft_targets_smoothing_spreads_over_visible_classes_only():
  x, y = _logits(6, (3, 5)), _probs(7, (3, 5))
  where = jnp.array([True, True, False, True, True])[None]
  ours = sce(x, y, where=where, label_smoothing=0.2)
  ref = optax.losses.softmax_cross_entropy(
      x, optax.smooth_labels(y, 0.2, where=jnp.broadcast_to(where, x.shape)),
      where=jnp.broadcast_to(where, x.shape))
  chex.assert_trees_all_close(ours, ref, rtol=1e-5)


def test_soft_targets_minus_inf_logit_is_a_masked_class():
  x = _logits(8, (2, 4)).at[:, 1].set(-jnp.inf)
  y = _probs(9, (2, 4)).at[:, 1].set(0.0)
  y = y / y.sum(-1, keepdims=True)
  ours = value_and_vjp(lambda a: sce(a, y), x)
  keep = np.array([0, 2, 3])
  ref = value_and_vjp(lambda a: optax.losses.softmax_cross_entropy(a, y[:, keep]), x[:, keep])
  chex.assert_trees_all_close(ours[0], ref[0], rtol=1e-5)
  chex.assert_trees_all_close(ours[1][0][:, keep], ref[1][0], rtol=1e-5, atol=1e-6)
  assert np.all(np.isfinite(ours[1][0]))


# ------------------------------------------------------------------ L01, integer labels


@pytest.mark.parametrize("smoothing", [0.0, 0.25])
def test_integer_labels_match_optax(smoothing):
  x, labels = _logits(10, (6, 9)), _labels(11, (6,), 9)
  ours = value_and_vjp(lambda a: sce_int(a, labels, label_smoothing=smoothing), x)
  ref = value_and_vjp(
      lambda a: optax.losses.softmax_cross_entropy(
          a, optax.smooth_labels(jax.nn.one_hot(labels, 9), smoothing)), x)
  chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)
  if smoothing == 0.0:
    plain = optax.losses.softmax_cross_entropy_with_integer_labels(x, labels)
    chex.assert_trees_all_close(ours[0], plain, rtol=1e-6)


def test_integer_labels_other_axis():
  x, labels = _logits(12, (3, 8, 5)), _labels(13, (3, 5), 8)
  ours = value_and_vjp(lambda a: sce_int(a, labels, axis=1), x)
  ref = value_and_vjp(
      lambda a: optax.losses.softmax_cross_entropy_with_integer_labels(a, labels, axis=1), x)
  chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_integer_labels_example_mask_and_ignore_index():
  x, labels = _logits(14, (6, 5)), _labels(15, (6,), 5)
  labels = labels.at[1].set(-100)
  where = jnp.array([True, True, False, True, True, True])
  loss, (dx,), _ = value_and_vjp(lambda a: sce_int(a, labels, where=where, ignore_index=-100), x)
  loss, dx = np.asarray(loss), np.asarray(dx)
  optax_int = lambda a: optax.losses.softmax_cross_entropy_with_integer_labels(
      a, jnp.maximum(labels, 0))
  ref, (ref_dx,), _ = value_and_vjp(optax_int, x)  # the same cotangent (seed 99), jitted
  ref, ref_dx = np.asarray(ref), np.asarray(ref_dx)
  dropped = np.array([1, 2])
  kept = np.array([0, 3, 4, 5])
  np.testing.assert_array_equal(loss[dropped], 0.0)
  np.testing.assert_array_equal(dx[dropped], 0.0)
  chex.assert_trees_all_close(loss[kept], ref[kept], rtol=1e-6)
  chex.assert_trees_all_close(dx[kept], ref_dx[kept], rtol=1e-5, atol=1e-6)


def test_integer_labels_class_mask_equals_deleting_the_column():
  x = _logits(16, (4, 6))
  labels = jnp.array([0, 5, 3, 1])
  where = jnp.ones((1, 6), bool).at[0, 2].set(False)
  loss, (dx,), _ = value_and_vjp(lambda a: sce_int(a, labels, where=where), x)
  keep = np.array([0, 1, 3, 4, 5])
  new_labels = jnp.array([0, 4, 2, 1])
  ref, (rdx,), _ = value_and_vjp(
      lambda a: optax.losses.softmax_cross_entropy_with_integer_labels(a, new_labels),
      jnp.asarray(np.asarray(x)[:, keep]))
  dx = np.asarray(dx)
  chex.assert_trees_all_close(loss, ref, rtol=1e-6)
  chex.assert_trees_all_close(dx[:, keep], rdx, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(dx[:, 2], 0.0)
  # smoothing over the visible classes only, as the optax-checked probability version
  smooth, (sdx,), _ = value_and_vjp(
      lambda a: sce_int(a, labels, where=where, label_smoothing=0.3), x)
  ref_smooth, (rsdx,), _ = value_and_vjp(
      lambda a: sce(a, jax.nn.one_hot(labels, 6), where=where, label_smoothing=0.3), x)
  chex.assert_trees_all_close((smooth, sdx), (ref_smooth, rsdx), rtol=1e-5, atol=1e-6)
  # a single example (rank-1 logits, scalar label), jitted: one compilation per call
  single = jax.jit(sce_int)
  chex.assert_trees_all_close(single(x[1], labels[1]), single(x, labels)[1], rtol=1e-6)


def test_fully_masked_rows_and_invisible_labels():
  x = _logits(17, (4, 5)).at[3].set(-jnp.inf)
  labels = jnp.array([1, 2, 7, 0])          # row 2: out of range; row 3: no visible class
  where = jnp.ones((4, 5), bool).at[1, 2].set(False)  # row 1: the label's class is masked
  loss, (dx,), _ = value_and_vjp(lambda a: sce_int(a, labels, where=where), x)
  assert loss[1] == jnp.inf and loss[2] == jnp.inf
  assert loss[3] == 0.0
  assert np.all(np.isfinite(dx))
  np.testing.assert_array_equal(dx[1:], 0.0)
  soft_loss, (sdx,), _ = value_and_vjp(lambda a: sce(a, jax.nn.one_hot(labels, 5)), x)
  assert soft_loss[3] == 0.0 and np.all(sdx[3] == 0.0) and np.all(np.isfinite(sdx))


def test_huge_and_shifted_logits_are_finite_and_shift_invariant():
  x64 = np.random.default_rng(0).normal(size=(4, 6)) * 3
  labels = jnp.array([0, 1, 2, 3])
  base = jax.jit(sce_int)(jnp.asarray(x64, jnp.float32), labels)
  for shift in (1000.0, -1000.0):
    shifted, (dx,), _ = value_and_vjp(lambda a: sce_int(a, labels), jnp.asarray(x64 + shift,
                                                                              jnp.float32))
    chex.assert_trees_all_close(shifted, base, atol=2e-3)
    assert np.all(np.isfinite(dx))
  huge = jnp.array([[3e38, -3e38, 0.0, 1e30]], jnp.float32)
  for fn in (lambda a: sce_int(a, jnp.array([1])), lambda a: sce(a, jnp.full((1, 4), 0.25)),
             lambda a: sce_int(a, jnp.array([1]), label_smoothing=0.1)):
    out, (dx,), _ = value_and_vjp(fn, huge)
    assert not np.any(np.isnan(out)) and np.all(np.isfinite(dx))
  # with the label on the largest logit the loss is exactly 0 (not NaN)
  assert jax.jit(sce_int)(huge, jnp.array([0]))[0] == 0.0


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_is_computed_in_float32(dtype):
  x, labels = _logits(18, (4, 7), dtype=dtype), _labels(19, (4,), 7)
  y = _probs(20, (4, 7))

  @jax.jit  # one compilation instead of one per eager operation
  def run(x):
    x32 = x.astype(jnp.float32)
    return (sce_int(x, labels, label_smoothing=0.1), sce_int(x32, labels, label_smoothing=0.1),
            jax.grad(lambda a: sce_int(a, labels).astype(jnp.float32).sum())(x),
            jax.grad(lambda a: sce_int(a, labels).sum())(x32), sce(x, y), sce(x32, y))

  out, ref, dx, ref_dx, soft, soft32 = run(x)
  assert out.dtype == dtype
  chex.assert_trees_all_close(out.astype(jnp.float32), ref, rtol=1e-2)
  assert dx.dtype == dtype
  chex.assert_trees_all_close(dx.astype(jnp.float32), ref_dx, atol=1e-2)
  assert soft.dtype == dtype
  chex.assert_trees_all_close(soft.astype(jnp.float32), soft32, rtol=1e-2)


def test_jit_and_vmap():
  x, labels, y = _logits(21, (3, 4, 6)), _labels(22, (3, 4), 6), _probs(23, (3, 4, 6))
  f = jax.jit(lambda a, b: sce_int(a, b, label_smoothing=0.1, ignore_index=-1))
  chex.assert_trees_all_close(jax.vmap(f)(x, labels), f(x, labels), rtol=1e-6)
  g = jax.jit(lambda a, b: sce(a, b, label_smoothing=0.1))
  chex.assert_trees_all_close(jax.vmap(g)(x, y), g(x, y), rtol=1e-6)
  h = jax.jit(lambda a, b: topk_ce(a, b, 3))
  chex.assert_trees_all_close(jax.vmap(h)(x, labels), h(x, labels), rtol=1e-6)


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(24), (3, 5), jnp.float64)
    y = jax.nn.softmax(jax.random.normal(jax.random.key(25), (3, 5), jnp.float64))
    labels = jnp.array([0, 4, 2])
    where = jnp.array([[True, True, False, True, True]])
    check_grads(jax.jit(lambda a, b: sce(a, b, where=where, label_smoothing=0.1)), (x, y),
                order=1, modes=["rev"])
    check_grads(jax.jit(lambda a: sce_int(a, labels, label_smoothing=0.1)), (x,), order=2,
                modes=["rev"])
    check_grads(jax.jit(lambda a: topk_ce(a, labels, 3)), (x,), order=1, modes=["rev"])


def test_bad_input_names_the_argument():
  x = _logits(26, (4, 5))
  with pytest.raises(ValueError, match="labels"):
    sce(x, jnp.ones((4, 4)))
  with pytest.raises(ValueError, match="labels"):
    sce(x, jnp.array([0, 1, 2, 3]))          # integer labels to the probability version
  with pytest.raises(ValueError, match="labels"):
    sce_int(x, jnp.array([0, 1, 2]))
  with pytest.raises(ValueError, match="labels"):
    sce_int(x, jnp.zeros((4,), jnp.float32))
  for bad in (1.0, -0.1, 1.5):
    with pytest.raises(ValueError, match="label_smoothing"):
      sce(x, jnp.ones((4, 5)) / 5, label_smoothing=bad)
    with pytest.raises(ValueError, match="label_smoothing"):
      sce_int(x, jnp.zeros((4,), jnp.int32), label_smoothing=bad)
  with pytest.raises(ValueError, match="axis"):
    sce_int(x, jnp.zeros((4,), jnp.int32), axis=2)
  with pytest.raises(ValueError, match="logits"):  # (integer logits promote, as in jax.nn)
    sce_int(jnp.zeros((4, 5), jnp.complex64), jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="ignore_index"):
    sce_int(x, jnp.zeros((4,), jnp.int32), ignore_index=0.5)
  with pytest.raises(ValueError, match="where"):
    sce_int(x, jnp.zeros((4,), jnp.int32), where=jnp.ones((3, 5), bool))


# --------------------------------------------------------------------------- L03 top-k


def _top_k_reference(x, labels, k):
  """float64 numpy: Omega = k largest (ties: lower index) plus the target; loss and grad."""
  x = np.asarray(x, np.float64)
  loss, grad = np.zeros(x.shape[0]), np.zeros_like(x)
  for r, (row, t) in enumerate(zip(x, np.asarray(labels), strict=True)):
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))
    omega = sorted(set(order[:k]) | {int(t)})
    z = row[omega]
    m = z.max()
    lse = m + np.log(np.sum(np.exp(z - m)))
    loss[r] = lse - row[t]
    grad[r, omega] = np.exp(z - lse)
    grad[r, t] -= 1.0
  return loss, grad


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3, 8])
def test_top_k_matches_dense_reference(k):
  x, labels = _logits(30, (6, 8)), _labels(31, (6,), 8)
  loss, (dx,), _ = value_and_vjp(lambda a: topk_ce(a, labels, k), x, seed=None)
  ref_loss, ref_dx = _top_k_reference(x, labels, k)
  chex.assert_trees_all_close(loss, ref_loss.astype(np.float32), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(dx, ref_dx.astype(np.float32), rtol=1e-5, atol=1e-6)
  ce = optax.losses.softmax_cross_entropy_with_integer_labels(x, labels)
  assert np.all(loss <= ce + 1e-6)
  if k == 8:
    chex.assert_trees_all_close(loss, ce, rtol=1e-6)


def test_top_k_random_cotangent_and_zero_gradient_outside_support():
  x, labels = _logits(32, (5, 10)), _labels(33, (5,), 10)
  out, (dx,), ct = value_and_vjp(lambda a: topk_ce(a, labels, 4), x)
  _, ref_dx = _top_k_reference(x, labels, 4)
  chex.assert_trees_all_close(dx, (ct[:, None] * ref_dx).astype(np.float32), rtol=1e-5, atol=1e-6)
  support = ref_dx != 0
  assert np.all(support.sum(-1) >= 4) and np.all(support.sum(-1) <= 5)
  np.testing.assert_array_equal(np.asarray(dx)[~support], 0.0)


def test_top_k_target_outside_top_k_still_learns():
  x = jnp.array([[5.0, 4.0, 3.0, -2.0]])
  loss, dx = jax.jit(jax.value_and_grad(lambda a: topk_ce(a, jnp.array([3]), 2).sum()))(x)
  ref = np.log(np.exp(5.0) + np.exp(4.0) + np.exp(-2.0)) + 2.0
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
  assert dx[0, 3] < 0 and dx[0, 2] == 0.0


def test_top_k_ties_break_to_the_lower_index():
  x = jnp.array([[1.0, 2.0, 2.0, 2.0, 0.0]])
  labels = jnp.array([4])
  # the loss and its gradient in one compilation
  loss, dx = jax.jit(jax.value_and_grad(lambda a: topk_ce(a, labels, 2).sum()))(x)
  ref_loss, ref_dx = _top_k_reference(x, labels, 2)  # keeps indices 1 and 2 (+ target 4)
  chex.assert_trees_all_close(dx, ref_dx.astype(np.float32), rtol=1e-6)
  assert dx[0, 3] == 0.0 and dx[0, 1] > 0 and dx[0, 2] > 0
  chex.assert_trees_all_close(loss, ref_loss.sum().astype(np.float32), rtol=1e-6)


def test_top_k_masks_and_edge_cases():
  x, labels = _logits(34, (4, 6)), jnp.array([0, 1, 2, -100])
  where = jnp.ones((4, 6), bool).at[:, 0].set(False).at[0, :].set(True)
  # masked class 0 is never selected: equal to the reference on the remaining columns
  out, (dx,), cts = value_and_vjp(
      lambda a: topk_ce(a, labels, 2, where=where, ignore_index=-100), x)
  out, dx, cts = np.asarray(out), np.asarray(dx), np.asarray(cts)  # index in numpy, not eagerly
  for r in (1, 2):
    cols = np.arange(1, 6)
    ref_loss, ref_dx = _top_k_reference(np.asarray(x)[r:r + 1, cols],
                                        np.asarray(labels)[r:r + 1] - 1, 2)
    ct = cts[r]
    chex.assert_trees_all_close(out[r], ref_loss[0].astype(np.float32), rtol=1e-5)
    chex.assert_trees_all_close(dx[r, cols], (ct * ref_dx[0]).astype(np.float32), rtol=1e-5,
                                atol=1e-6)
    assert dx[r, 0] == 0.0
  assert out[3] == 0.0 and np.all(dx[3] == 0.0)
  # fewer visible classes than k: plain softmax CE over the visible ones
  few = jnp.array([[True, False, True, False, False, False]])
  chex.assert_trees_all_close(*jax.jit(lambda x, labels: (  # one compilation for both
      topk_ce(x[:1], labels[:1], 4, where=few),
      optax.losses.softmax_cross_entropy_with_integer_labels(x[:1, ::2][:, :2], labels[:1])))(
          x, labels), rtol=1e-6)
  huge = jnp.array([[3e38, -3e38, 1e30, 0.0]])
  out, (dx,), _ = value_and_vjp(lambda a: topk_ce(a, jnp.array([1]), 2), huge)
  assert not np.isnan(out).any() and np.all(np.isfinite(dx))


def test_top_k_bad_k():
  x, labels = _logits(35, (2, 5)), jnp.array([0, 1])
  for bad in (0, 6, 2.5, True):
    with pytest.raises(ValueError, match="`k`"):
      topk_ce(x, labels, bad)
  with pytest.raises(ValueError, match="labels"):
    topk_ce(x, jnp.array([0, 1, 2]), 2)


def test_top_k_gradient_is_top_k_softmax_minus_one_hot():
  """Against the top_k_softmax normalizer (another helper's N15)."""
  x, labels = _logits(36, (6, 9)), _labels(37, (6,), 9)
  k = 4

  @jax.jit  # one compilation instead of one per eager operation
  def run(x):
    p = js.normalizers.top_k_softmax(x, k=k)
    in_top = jnp.take_along_axis(p, labels[:, None], axis=-1)[:, 0] > 0
    dx = jax.grad(lambda a: topk_ce(a, labels, k).sum())(x)
    return in_top, dx, p - jax.nn.one_hot(labels, 9)

  in_top, dx, expected = (np.asarray(a) for a in run(x))
  assert in_top.any()
  chex.assert_trees_all_close(dx[in_top], expected[in_top], rtol=1e-5, atol=1e-6)
