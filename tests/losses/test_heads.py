"""L15 non-softmax heads (ovr_bce_loss, gol_loss, l2_svm_loss) against optax and float64 numpy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, normal, value_and_vjp

L = js.losses


def _bce(z, y):
  return np.logaddexp(0.0, z) - y * z, 1 / (1 + np.exp(-z)) - y


def _gol(z, y):
  t = np.exp(-z)
  loss = y * t - (1 - y) * np.log(-np.expm1(-t))
  with np.errstate(over="ignore"):  # t / expm1(t) -> 0 as t -> inf
    return loss, -y * t + (1 - y) * t / np.expm1(t)


def _svm(z, y):
  s = 2 * y - 1
  h = np.maximum(0.0, 1 - s * z)
  return h**2, -2 * s * h


REFS = {"ovr_bce_loss": _bce, "gol_loss": _gol, "l2_svm_loss": _svm}


@pytest.mark.parametrize("name", list(REFS))
@pytest.mark.parametrize("targets", ["integer", "multi_hot"])
def test_matches_float64_reference_with_masks(name, targets):
  x = normal(0, (5, 6), 2.0)
  labels = jnp.array([0, 5, 2, 2, -1])
  mask = np.ones((5, 6), bool)
  mask[1, 3] = mask[2, 0] = False
  if targets == "integer":
    y = np.eye(6)[np.asarray(labels)]
    y[4] = 0.0
    args = dict(labels=labels, ignore_index=-1)
  else:
    y = np.asarray(jax.random.bernoulli(jax.random.key(1), 0.4, (5, 6)), np.float64)
    args = dict(labels=jnp.asarray(y, jnp.float32))
  out, (dx,), ct = value_and_vjp(lambda a: getattr(L, name)(a, where=mask, **args), x)
  loss, grad = REFS[name](np.asarray(x, np.float64), y)
  want = np.where(mask, loss, 0.0).sum(-1)
  want_dx = np.where(mask, grad, 0.0) * np.asarray(ct)[:, None]
  if targets == "integer":
    want[4], want_dx[4] = 0.0, 0.0
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-6)


def test_against_optax():
  x, y = normal(2, (4, 5), 2.0), jax.random.bernoulli(jax.random.key(3), 0.5, (4, 5))
  y = y.astype(jnp.float32)
  got = jax.jit(lambda a: (L.ovr_bce_loss(a, y), L.l2_svm_loss(a, y)))(x)
  np.testing.assert_allclose(got[0], optax.sigmoid_binary_cross_entropy(x, y).sum(-1), rtol=1e-6)
  np.testing.assert_allclose(got[1], (optax.hinge_loss(x, 2 * y - 1) ** 2).sum(-1), rtol=1e-6)


def test_per_class_jacobian_is_diagonal_and_svm_is_flat_beyond_the_margin():
  x = normal(4, (6,), 2.0)
  moved = x[None] + 0.5 * jnp.eye(6)  # row j: logit j moved
  for fn in (L.ovr_bce_loss, L.gol_loss, L.l2_svm_loss):
    grad = jax.jit(jax.vmap(jax.grad(lambda a, fn=fn: fn(a, jnp.array(2)))))(
        jnp.concatenate([x[None], moved]))
    changed = np.asarray(grad[1:] != grad[:1])
    assert not np.any(changed & ~np.eye(6, dtype=bool))   # only the moved logit's gradient
    assert np.all(np.diag(changed))
  confident = jnp.array([[3.0, -2.0, -1.5]])
  loss, dx = jax.value_and_grad(lambda a: L.l2_svm_loss(a, jnp.array([0])).sum())(confident)
  assert loss == 0.0 and np.all(dx == 0.0)


def test_gol_gumbel_properties_and_extremes():
  # eta(0) = 1/e: a positive at z = 0 costs exactly 1, a negative costs -log(1 - 1/e)
  np.testing.assert_allclose(L.gol_loss(jnp.zeros((1, 2)), jnp.array([0])),
                             [1.0 - np.log(1 - np.exp(-1.0))], rtol=1e-6)
  z = jnp.linspace(-30.0, 30.0, 121)[None]
  # the squared hinge of a logit past ~1.8e19 on the wrong side overflows float32 itself
  huge = jnp.array([[-1e18, -100.0, 100.0, 1e18, 1e18]])
  farthest = jnp.array([[3e38, -3e38, 0.0]])
  targets = (jnp.array([0]), jnp.array([4]), jnp.full((1, 5), 0.5))

  @jax.jit
  def run(z, huge, farthest):
    def vg(f, a):
      out, vjp = jax.vjp(f, a)
      return out, vjp(jnp.ones_like(out))[0]
    gol = [vg(lambda a, y=y: L.gol_loss(a, y), z) for y in (jnp.zeros_like(z), jnp.ones_like(z))]
    ext = [vg(lambda a, fn=fn, y=y: fn(a, y), huge)
           for fn in (L.ovr_bce_loss, L.gol_loss, L.l2_svm_loss) for y in targets]
    ext += [vg(lambda a, fn=fn: fn(a, jnp.array([0])), farthest)
            for fn in (L.ovr_bce_loss, L.gol_loss)]
    return gol, ext

  gol, ext = run(z, huge, farthest)
  for (out, dx), y in zip(gol, (0.0, 1.0), strict=True):
    loss, _ = _gol(np.asarray(z, np.float64), y)
    np.testing.assert_allclose(out, loss.sum(-1), rtol=1e-5)
    assert np.all(np.isfinite(dx))
  for out, dx in ext:
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(dx))
  # below z = -80 the positive term holds its value at -80 and keeps a push
  out, dx = jax.value_and_grad(lambda a: L.gol_loss(a, jnp.array([1.0])).sum())(jnp.array([-200.0]))
  np.testing.assert_allclose(out, np.exp(80.0), rtol=1e-5)
  assert dx[0] < 0 and np.isfinite(dx[0])


def test_bfloat16_and_masked_examples():
  x, labels = normal(5, (4, 7), 2.0), jnp.array([0, 3, 6, 1])
  example = jnp.array([True, False, True, True])
  for fn in (L.ovr_bce_loss, L.gol_loss, L.l2_svm_loss):
    lo = fn(x.astype(jnp.bfloat16), labels, where=example)
    assert lo.dtype == jnp.bfloat16 and lo[1] == 0.0
    hi = fn(x.astype(jnp.bfloat16).astype(jnp.float32), labels, where=example)
    chex.assert_trees_all_close(lo.astype(jnp.float32), hi, rtol=1e-2)


def test_bad_input_names_the_argument():
  x = normal(6, (3, 4))
  check_raises(
      ("`labels`", lambda: L.ovr_bce_loss(x, jnp.array([0, 1]))),
      ("`labels`", lambda: L.gol_loss(x, jnp.ones((3, 5)))),
      ("`ignore_index`", lambda: L.l2_svm_loss(x, jnp.ones((3, 4)), ignore_index=0)),
      ("`axis`", lambda: L.l2_svm_loss(x, jnp.array([0, 1, 2]), axis=2)),
      ("`where`", lambda: L.ovr_bce_loss(x, jnp.array([0, 1, 2]), where=jnp.ones((2, 4), bool))),
  )
