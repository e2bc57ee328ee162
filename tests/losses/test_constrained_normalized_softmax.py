"""L06 the open-set latent-space constraints under the normalised softmax loss
(`constrained_normalized_softmax_loss`, `class_separation_penalty`) against a float64 NumPy
reference of the formulas: masks and ignore_index, the gradient (float64 central
differences), zero weights giving `normalized_softmax_loss`, scale invariance, the penalty's
zeros (orthogonal centres, the regular simplex), bf16, x64 and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

import jaxsoft as js
from tests.helpers import check_raises, numeric_grad, rows

L = js.losses
HP = dict(temperature=0.25, compactness=0.7, separation=2.0, max_cosine=-0.1)


def _penalty_ref(w, mu):
  w = np.asarray(w, np.float64)
  w_hat = w / np.linalg.norm(w, axis=0)
  gram = w_hat.T @ w_hat
  n = gram.shape[0]
  off = ~np.eye(n, dtype=bool)
  return np.sum(np.maximum(gram[off] - mu, 0.0) ** 2) / (n * (n - 1))


def _loss_ref(x, w, y, keep, temperature, compactness, separation, max_cosine):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  cos = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ (w / np.linalg.norm(w, axis=0))
  c_y = cos[np.arange(len(y)), np.asarray(y)]
  loss = (logsumexp(cos / temperature, axis=1) - c_y / temperature
          + compactness * (1.0 - c_y) + separation * _penalty_ref(w, max_cosine))
  return np.where(np.asarray(keep, bool), loss, 0.0)


def _inputs():
  return rows(0, (5, 4)), rows(1, (4, 3)), np.array([0, 1, 2, 1, 0])


KEEP = jnp.array([True, True, False, True, True])


def test_loss_and_penalty_against_float64():
  x, w, y = _inputs()

  @jax.jit
  def f(x, w):
    return dict(
        loss=L.constrained_normalized_softmax_loss(x, w, y, where=KEEP, **HP),
        penalty=L.class_separation_penalty(w, max_cosine=-0.1),
        zero=L.constrained_normalized_softmax_loss(x, w, y, temperature=0.25, compactness=0.0,
                                                   separation=0.0),
        nsl=L.normalized_softmax_loss(x, w, y, temperature=0.25))

  got = f(x, w)
  ref = _loss_ref(x, w, y, KEEP, **HP)
  assert _penalty_ref(w, -0.1) > 0 and np.all(ref[np.asarray(KEEP)] > 0)
  # float32 cosines (a few 2^-24 roundings) times 1 / T = 4 and the weights ~2: 1e-5
  np.testing.assert_allclose(got["loss"], ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["penalty"], _penalty_ref(w, -0.1), rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(got["zero"], got["nsl"])


@pytest.mark.slow
def test_ignore_index_gradients_scale_invariance_and_bf16():
  x, w, y = _inputs()
  y_ign = np.asarray(y).copy()
  y_ign[3] = -1

  @jax.jit
  def f(x, w):
    loss_fn = lambda a, b: L.constrained_normalized_softmax_loss(a, b, y, where=KEEP, **HP)
    return dict(
        ignored=L.constrained_normalized_softmax_loss(x, w, y_ign, ignore_index=-1, **HP),
        loss=loss_fn(x, w),
        grads=jax.grad(lambda a, b: loss_fn(a, b).sum(), argnums=(0, 1))(x, w),
        scaled=loss_fn(3.0 * x, w * jnp.array([[0.5, 2.0, 7.0]])),
        bf16=L.constrained_normalized_softmax_loss(x.astype(jnp.bfloat16),
                                                   w.astype(jnp.bfloat16), y, **HP))

  got = f(x, w)
  # as the default test: 1e-5
  np.testing.assert_allclose(got["ignored"], _loss_ref(x, w, y, y_ign != -1, **HP),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["scaled"], got["loss"], rtol=1e-5, atol=1e-5)
  # gradients: float64 central differences (step 1e-6: truncation ~1e-12, rounding ~1e-10)
  # against float32 autodiff (loss sums of O(10), a few 2^-24 roundings): 1e-4
  gx = numeric_grad(lambda a: _loss_ref(a, w, y, KEEP, **HP).sum(), x)
  gw = numeric_grad(lambda b: _loss_ref(x, b, y, KEEP, **HP).sum(), w)
  np.testing.assert_allclose(got["grads"][0], gx, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got["grads"][1], gw, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(got["grads"][0])[2], 0.0)   # the masked example
  assert got["bf16"].dtype == jnp.bfloat16
  xb, wb = (np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)) for a in (x, w))
  # float32 from the bf16-rounded inputs, the output rounded to 8 bits (2^-9: 4e-3)
  np.testing.assert_allclose(np.float32(got["bf16"]),
                             _loss_ref(xb, wb, y, np.ones(5, bool), **HP), rtol=4e-3, atol=1e-3)


@pytest.mark.slow
def test_penalty_zeros_and_float64():
  # orthogonal centres (C <= d) have no penalty at mu = 0; the regular simplex of C = d + 1
  # centres has every cosine -1/(C-1): no penalty at that mu, some just above it
  c = 4
  simplex = np.eye(c) - 1.0 / c               # columns: a regular simplex in a 3-d subspace
  basis = np.linalg.svd(simplex)[0][:, :c - 1]
  w_simplex = jnp.asarray(basis.T @ simplex, jnp.float32)      # [3, 4]
  w_orth = jnp.asarray(np.diag([1.0, 2.0, 0.5]), jnp.float32)[:, :2]
  assert float(L.class_separation_penalty(w_orth)) == 0.0
  # float32 cosines of the simplex: -1/3 to a few 2^-24: the hinge at -1/3 + 1e-6 is 0
  assert float(L.class_separation_penalty(w_simplex, max_cosine=-1 / 3 + 1e-6)) == 0.0
  np.testing.assert_allclose(L.class_separation_penalty(w_simplex, max_cosine=-0.5),
                             (1 / 6) ** 2, rtol=1e-5)
  x, w, y = _inputs()
  with jax.enable_x64(True):
    x64, w64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, w))
    loss = jax.jit(lambda a: L.constrained_normalized_softmax_loss(a, w64, y, **HP))(x64)
    pen = L.class_separation_penalty(w64, max_cosine=-0.1)
    assert loss.dtype == pen.dtype == jnp.float64
  np.testing.assert_allclose(loss, _loss_ref(x, w, y, np.ones(5, bool), **HP), rtol=1e-12)
  np.testing.assert_allclose(pen, _penalty_ref(w, -0.1), rtol=1e-12)


def test_bad_arguments_name_the_function():
  x, w, y = _inputs()
  f, P = L.constrained_normalized_softmax_loss, L.class_separation_penalty
  check_raises(
      (r"constrained_normalized_softmax_loss: `temperature`", lambda: f(x, w, y, temperature=0)),
      (r"constrained_normalized_softmax_loss: `compactness` must be in \[0, inf\)",
       lambda: f(x, w, y, compactness=-1.0)),
      (r"constrained_normalized_softmax_loss: `separation`", lambda: f(x, w, y, separation=-1)),
      (r"constrained_normalized_softmax_loss: `max_cosine` must be in \[-1, 1\)",
       lambda: f(x, w, y, max_cosine=1.0)),
      (r"constrained_normalized_softmax_loss: `class_weights` must be \[d, C\]",
       lambda: f(x, w[..., None], y)),
      (r"class_separation_penalty: `class_weights` needs at least 2 classes",
       lambda: P(w[:, :1])),
      (r"class_separation_penalty: `max_cosine`", lambda: P(w, max_cosine=-2.0)),
  )
