"""L04 StableMax CE and the softmax-collapse diagnostic (E02), against float64 references."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxsoft as js
from tests import helpers
from tests.helpers import LOW_PRECISION, normal, value_and_vjp

smce = js.losses.stablemax_cross_entropy
collapse = js.losses.softmax_collapse_fraction
_logits = functools.partial(normal, scale=3.0)


def _s(x):
  """StableMax's score, exactly as the paper writes it (float64 numpy)."""
  x = np.asarray(x, np.float64)
  return np.where(x >= 0, x + 1.0, 1.0 / (1.0 - np.minimum(x, 0.0)))


def _reference(x, y_dense):
  """-sum_j y_j log(s(x_j) / sum_k s(x_k)) and its gradient (p_j sum(y) - y_j) / (1 + |x_j|)."""
  x = np.asarray(x, np.float64)
  y = np.asarray(y_dense, np.float64)
  s = _s(x)
  p = s / s.sum(-1, keepdims=True)
  loss = -np.sum(y * np.log(p), -1)
  grad = (p * y.sum(-1, keepdims=True) - y) / (1.0 + np.abs(x))
  return loss, grad


def test_integer_and_soft_targets_match_dense_reference():
  x = _logits(0, (6, 7))
  x = x.at[0, :3].set(jnp.array([0.0, -0.0, 1e-8]))  # both sides of the kink at 0
  labels = jax.random.randint(jax.random.key(1), (6,), 0, 7)
  y = jax.nn.softmax(helpers.standard_normal(2, (6, 7)))
  for y_arg, y_dense in ((labels, jax.nn.one_hot(labels, 7)), (y, y)):
    out, (dx,), ct = value_and_vjp(lambda a, t=y_arg: smce(a, t), x)
    ref, ref_grad = _reference(x, y_dense)
    chex.assert_trees_all_close(out, ref.astype(np.float32), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(dx, (ct[:, None] * ref_grad).astype(np.float32), rtol=1e-5,
                                atol=1e-6)


def test_equals_minus_log_of_the_stablemax_normalizer():
  """Against N19 (another helper's js.normalizers.stablemax) on moderate logits."""
  x = _logits(3, (4, 5))
  labels = jnp.array([0, 1, 2, 4])

  @jax.jit  # one compilation instead of one per eager operation
  def reference(x):
    p = js.normalizers.stablemax(x)
    return -jnp.log(jnp.take_along_axis(p, labels[:, None], -1)[:, 0])

  chex.assert_trees_all_close(smce(x, labels), reference(x), rtol=1e-5, atol=1e-6)


def test_other_axis_masks_and_ignored_labels():
  f = jax.jit(smce, static_argnames=("axis", "ignore_index"))  # one compilation per call form
  x = _logits(4, (5, 3))
  labels = jnp.array([0, 2, 1])
  chex.assert_trees_all_close(f(x, labels, axis=0), f(x.T, labels), rtol=1e-6)
  x = _logits(5, (5, 6))
  labels = jnp.array([1, 2, -1, 0, 3])
  where = jnp.array([[True, True, True, False, True, True]])
  out, (dx,), ct = value_and_vjp(lambda a: smce(a, labels, where=where, ignore_index=-1), x)
  out, dx, ct = np.asarray(out), np.asarray(dx), np.asarray(ct)  # index in numpy, not eagerly
  cols = np.array([0, 1, 2, 4, 5])
  keep = np.array([0, 1, 3])
  ref, ref_grad = _reference(np.asarray(x)[keep][:, cols], np.eye(5)[np.asarray(labels)[keep]])
  chex.assert_trees_all_close(out[keep], ref.astype(np.float32), rtol=1e-5)
  chex.assert_trees_all_close(dx[keep][:, cols], (ct[keep, None] * ref_grad).astype(np.float32),
                              rtol=1e-5, atol=1e-6)
  assert out[2] == 0.0 and np.all(dx[2] == 0.0)       # ignored
  assert out[4] == np.inf and np.all(dx[4] == 0.0)    # label on the masked class
  rows = jnp.array([True, False, True, True, True])
  x_inf = np.array(x)
  x_inf[3] = -np.inf
  out, (dx,), _ = value_and_vjp(lambda a: smce(a, labels, where=rows, ignore_index=-1),
                                 jnp.asarray(x_inf))
  assert out[1] == 0.0 and out[3] == 0.0 and np.all(dx[1] == 0.0) and np.all(dx[3] == 0.0)
  assert np.all(np.isfinite(dx))


def test_huge_logits_are_finite():
  x = jnp.array([[3e38, -3e38, 0.0, 1e30], [1e6, 1e6, -1e6, 0.0]], jnp.float32)
  labels = jnp.array([1, 2])
  out, (dx,), _ = value_and_vjp(lambda a: smce(a, labels), x)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(dx))
  ref, _ = _reference(np.asarray(x, np.float64), jax.nn.one_hot(labels, 4))
  chex.assert_trees_all_close(out, ref.astype(np.float32), rtol=1e-5)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_is_computed_in_float32(dtype):
  x = _logits(6, (4, 6), dtype=dtype)
  labels = jnp.array([0, 1, 2, 3])

  @jax.jit  # one compilation instead of one per eager operation
  def run(x):
    grad = jax.grad(lambda a: smce(a, labels).astype(jnp.float32).sum())(x)
    return smce(x, labels), smce(x.astype(jnp.float32), labels), grad

  out, out32, grad = run(x)
  assert out.dtype == dtype
  chex.assert_trees_all_close(out.astype(jnp.float32), out32, rtol=1e-2)
  assert grad.dtype == dtype


def test_jit_vmap_and_check_grads_float64():
  x = _logits(7, (3, 4, 5))
  labels = jax.random.randint(jax.random.key(8), (3, 4), 0, 5)
  f = jax.jit(smce)
  chex.assert_trees_all_close(jax.vmap(f)(x, labels), f(x, labels), rtol=1e-6)
  with jax.enable_x64(True):
    x64 = jax.random.normal(jax.random.key(9), (3, 5), jnp.float64) * 2
    y = jax.nn.softmax(jax.random.normal(jax.random.key(10), (3, 5), jnp.float64))
    check_grads(jax.jit(lambda a: smce(a, jnp.array([0, 3, 4]))), (x64,), order=2,
                modes=["rev"])
    check_grads(jax.jit(lambda a, b: smce(a, b)), (x64, y), order=1, modes=["rev"])


def test_bad_input_names_the_argument():
  x = _logits(11, (3, 5))
  with pytest.raises(ValueError, match="labels"):
    smce(x, jnp.array([0, 1]))
  with pytest.raises(ValueError, match="labels"):
    smce(x, jnp.ones((3, 4)))
  with pytest.raises(ValueError, match="ignore_index"):
    smce(x, jnp.ones((3, 5)) / 5, ignore_index=0)
  with pytest.raises(ValueError, match="axis"):
    smce(x, jnp.array([0, 1, 2]), axis=-3)
  with pytest.raises(ValueError, match="labels"):
    collapse(x, jnp.ones((3, 5)))


# ------------------------------------------------------------------------ E02 collapse


def test_collapse_fraction_counts_exact_zero_float32_losses():
  gaps = jnp.array([5.0, 15.0, 16.0, 17.0, 30.0, 100.0])
  x = jnp.zeros((6, 3)).at[:, 0].set(gaps)
  labels = jnp.zeros((6,), jnp.int32)
  optax_loss = jax.jit(optax.losses.softmax_cross_entropy_with_integer_labels)(x, labels)
  expected = float(np.mean(np.asarray(optax_loss) == 0.0))
  assert collapse(x, labels) == pytest.approx(expected)   # eager
  assert collapse(x, labels) == pytest.approx(4 / 6)   # from g = 16 on, as the notes observe
  c = jax.jit(collapse, static_argnames="ignore_index")  # one compilation per call form
  # float64 has no collapse at these gaps; the diagnostic always measures float32
  assert c(x.astype(jnp.bfloat16), labels) == pytest.approx(expected)
  # masked and ignored examples count neither way
  rows = jnp.array([True, True, False, False, True, True])
  assert c(x, labels, where=rows) == pytest.approx(2 / 4)
  assert c(x, labels.at[0].set(-1), ignore_index=-1) == pytest.approx(4 / 5)
  assert c(x, labels, where=jnp.zeros((6,), bool)) == 0.0
  assert jax.jit(collapse)(x, labels) == pytest.approx(expected)


def test_stablemax_keeps_learning_where_float32_softmax_collapsed():
  """E02 in miniature: once the margin is large, softmax CE and its gradient are exactly 0
  in float32, so training stops; StableMax CE still has a loss and a gradient."""
  x = jnp.array([[120.0, 0.0, 0.0], [0.0, 0.0, 130.0]], jnp.float32)
  labels = jnp.array([0, 2])
  ce = lambda a: optax.losses.softmax_cross_entropy_with_integer_labels(a, labels).sum()
  sm = lambda a: smce(a, labels).sum()

  @jax.jit  # every float32 quantity below in one compilation
  def at(a):
    return (jax.value_and_grad(ce)(a),
            js.losses.softmax_cross_entropy_with_integer_labels(a, labels).sum(),
            collapse(a, labels), jax.value_and_grad(sm)(a))

  (ce_x, ce_dx), js_ce_x, collapsed, (sm_x, sm_dx) = at(x)
  assert ce_x == 0.0 and np.all(ce_dx == 0.0)
  assert js_ce_x == 0.0
  assert collapsed == 1.0
  assert sm_x > 0.0 and np.all(sm_dx != 0.0)
  with jax.enable_x64(True):  # the float64 softmax gradient is nonzero: it is a rounding artefact
    assert np.any(jax.jit(jax.grad(ce))(x.astype(jnp.float64)) != 0.0)

  # a tiny model already fitting its data with a large scale: SGD on softmax CE is stuck
  # bit for bit, SGD on StableMax CE still moves the weights and lowers the loss.
  @jax.jit
  def problem():
    feats = helpers.standard_normal(12, (16, 4))
    w_true = helpers.standard_normal(13, (4, 3))
    logits = feats @ w_true
    top2 = jax.lax.top_k(logits, 2)[0]
    # scale so every margin exceeds 110: e^-110 underflows float32, the softmax is one-hot
    return feats, jnp.argmax(logits, -1), (110.0 / jnp.min(top2[:, 0] - top2[:, 1])) * w_true

  feats, y, w0 = problem()

  def train(loss_fn, w, steps=10):  # the whole SGD run in one compilation
    grad = jax.grad(lambda w: loss_fn(feats @ w, y).mean())
    return jax.jit(lambda w: jax.lax.fori_loop(0, steps, lambda _, w: w - 1.0 * grad(w), w))(w)

  @jax.jit
  def evaluate(w):
    return collapse(feats @ w, y), smce(feats @ w, y).mean()

  collapsed0, loss0 = evaluate(w0)
  assert collapsed0 == 1.0
  w_softmax = train(js.losses.softmax_cross_entropy_with_integer_labels, w0)
  w_stable = train(smce, w0)
  np.testing.assert_array_equal(w_softmax, w0)
  assert not np.array_equal(w_stable, w0)
  assert evaluate(w_stable)[1] < loss0
