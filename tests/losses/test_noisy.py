"""L12 Noisy Softmax against a float64 numpy reference and its defining properties."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, numeric_grad, rows
from tests.losses.jitted import Jitted

L = Jitted(js.losses)  # every call under jax.jit (see tests/losses/jitted.py)
E = js.losses          # eager: checks that need concrete values
ce_int = jax.jit(optax.losses.softmax_cross_entropy_with_integer_labels)


def _ref(x, w, y, xi, alpha, annealed=True):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  y = np.asarray(y)
  f = x @ w
  rows = np.arange(len(y))
  scale = np.linalg.norm(x, axis=-1) * np.linalg.norm(w[:, y], axis=0)
  amp = scale - f[rows, y] if annealed else scale
  f[rows, y] -= alpha * amp * np.abs(xi)
  m = f.max(-1)
  return m + np.log(np.exp(f - m[:, None]).sum(-1)) - f[rows, y]


def test_noisy_softmax_matches_reference_forward_and_backward():
  x, w = rows(0, (4, 3)), rows(1, (3, 5))
  y = jnp.array([0, 4, 2, 2])
  key = jax.random.key(7)
  xi = np.asarray(jax.random.normal(key, (4,)), np.float64)
  for annealed in (True, False):
    f = jax.jit(lambda a, b, an=annealed: L.noisy_softmax_loss(key, a, b, y, alpha=0.5,
                                                               annealed=an))
    np.testing.assert_allclose(f(x, w), _ref(x, w, y, xi, 0.5, annealed), rtol=1e-5)
  ct = np.asarray(rows(3, (4,)), np.float64)
  f = jax.jit(lambda a, b: L.noisy_softmax_loss(key, a, b, y, alpha=0.5))
  _, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(jnp.asarray(ct, jnp.float32))
  np.testing.assert_allclose(dx, numeric_grad(lambda a: _ref(a, w, y, xi, 0.5) @ ct, x),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, numeric_grad(lambda a: _ref(x, a, y, xi, 0.5) @ ct, w),
                             rtol=1e-4, atol=1e-5)
  # deterministic under the key, another key gives another draw
  np.testing.assert_array_equal(f(x, w), f(x, w))
  assert not np.allclose(L.noisy_softmax_loss(jax.random.key(8), x, w, y, alpha=0.5), f(x, w))


def test_noisy_softmax_properties():
  x, w = rows(0, (6, 3)), rows(1, (3, 5))
  y = jnp.array([0, 4, 2, 2, 1, 3])
  clean = ce_int(x @ w, y)
  key = jax.random.key(0)
  np.testing.assert_allclose(L.noisy_softmax_loss(key, x, w, y, alpha=0.0), clean, rtol=1e-6)
  assert np.all(np.asarray(L.noisy_softmax_loss(key, x, w, y, alpha=1.0)) >= clean - 1e-6)
  # the annealed noise vanishes when x points along w_y (θ_y = 0)
  x_al = 2.0 * w[:, y].T
  np.testing.assert_allclose(L.noisy_softmax_loss(key, x_al, w, y, alpha=3.0),
                             ce_int(x_al @ w, y), rtol=1e-5)



@pytest.mark.slow
def test_noisy_softmax_desaturates():
  # on a saturated example the expected gradient is larger than the clean CE's
  w = rows(1, (3, 5))
  xs = 6.0 * rows(5, (1, 3))
  ys = jnp.argmax(xs @ w, -1)
  assert jax.nn.softmax(xs @ w)[0, ys[0]] > 0.95
  keys = jax.random.split(jax.random.key(1), 64)
  g = jax.jit(jax.vmap(lambda k: jax.grad(
      lambda a: L.noisy_softmax_loss(k, a, w, ys, alpha=1.0).sum())(xs)))(keys)
  g_clean = jax.grad(lambda a: ce_int(a @ w, ys).sum())(xs)
  assert np.linalg.norm(np.asarray(g).mean(0)) > 3.0 * np.linalg.norm(g_clean)


def test_noisy_softmax_masks_extremes_and_bf16():
  x, w = rows(0, (4, 3)), rows(1, (3, 5))
  y = jnp.array([0, 4, 2, 2])
  key = jax.random.key(2)
  out, g = jax.value_and_grad(lambda a: L.noisy_softmax_loss(
      key, a, w, y, alpha=0.5, where=jnp.array([True, False, True, True])).sum())(x)
  assert np.all(np.asarray(g)[1] == 0.0) and np.isfinite(out)
  cls = jnp.array([True, True, False, True, True])
  np.testing.assert_allclose(
      L.noisy_softmax_loss(key, x, w, y % 2, alpha=0.5, where=cls[None]),
      L.noisy_softmax_loss(key, x, w[:, jnp.array([0, 1, 3, 4])], y % 2, alpha=0.5), rtol=1e-6)
  ign = L.noisy_softmax_loss(key, x, w, jnp.array([0, -100, 9, 1]), alpha=0.5, ignore_index=-100)
  assert ign[1] == 0.0 and np.isinf(ign[2])
  # huge and all-zero embeddings (the norm at 0) in one batch: finite gradients
  edge = jnp.concatenate([1e4 * x, jnp.zeros((4, 3))])
  g = jax.jit(jax.grad(lambda a: E.noisy_softmax_loss(key, a, w, jnp.concatenate([y, y]),
                                                      alpha=2.0).sum()))(edge)
  assert np.isfinite(g).all()
  lo = L.noisy_softmax_loss(key, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), y, alpha=0.5)
  assert lo.dtype == jnp.bfloat16
  xi = np.asarray(jax.random.normal(key, (4,)), np.float64)
  np.testing.assert_allclose(np.asarray(lo, np.float32), _ref(
      np.asarray(x.astype(jnp.bfloat16)), np.asarray(w.astype(jnp.bfloat16)), y, xi, 0.5),
                             rtol=2e-2)


def test_bad_inputs_name_the_argument():
  x, w = rows(0, (4, 3)), rows(1, (3, 5))
  y = jnp.array([0, 4, 2, 2])
  key = jax.random.key(0)
  check_raises(
      ("`alpha`", lambda: E.noisy_softmax_loss(key, x, w, y, alpha=-1.0)),
      ("`class_weights`", lambda: E.noisy_softmax_loss(key, x, w[:2], y)),
      ("`labels`", lambda: E.noisy_softmax_loss(key, x, w, y[:2])),
      ("`key`", lambda: E.noisy_softmax_loss(None, x, w, y)),
      ("`embeddings`", lambda: E.noisy_softmax_loss(key, y[:, None], w, y)),
  )
