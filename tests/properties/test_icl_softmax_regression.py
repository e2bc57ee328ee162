"""E15: in-context learning as softmax regression (catalogue 000#21 / 001#26; S. Li, Z. Song,
Y. Xia, T. Yu & T. Zhou 2023, "The Closeness of In-Context Learning and Weight Shifting for
Softmax Regression"; notebooks/14_icl_softmax_regression).

L(x) = 1/2 ||softmax(Ax) - b||^2 has the gradient A^T (diag f - f f^T)(f - b). From x0 = 0 one
GD step of size eta gives the logits l_GD,i = (eta/n) sum_j (a_i . a_j)(b_j - 1/n). The
construction [R]: one softmax attention layer over the tokens (a_j, b_j) with query = key = a,
scale tau, values b_j - 1/n and output gain eta/tau gives l_ICL = l_GD + O(eta tau). Both the
weight shift and the data shift obey ||d softmax|| <= 1/2 ||A||_2 ||dx||, 1/2 ||x|| ||dA||_2.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js

P, N, D = 16, 12, 4
ETA = float(N)


def _problems(seed):
  rng = np.random.default_rng(seed)
  A = rng.normal(size=(P, N, D))
  logits = np.einsum("pnd,pd->pn", A, rng.normal(size=(P, D)))
  b = np.exp(logits - logits.max(-1, keepdims=True))
  return A, b / b.sum(-1, keepdims=True)


@jax.jit
def _grad_and_icl(A, b, x, taus):
  """jax.grad of the loss through js.normalizers.softmax at x, and the attention layer's
  logits for each tau (one program)."""
  grad = jax.vmap(jax.grad(lambda A, b, x: 0.5 * jnp.sum((js.normalizers.softmax(A @ x) - b) ** 2),
                           argnums=2))(A, b, x)
  values = (b - 1.0 / N)[:, :, None, None]

  def icl(tau):
    out = js.attention.dot_product_attention(A[:, :, None], A[:, :, None], values, scale=tau)
    return (ETA / tau) * out[:, :, 0, 0]

  return grad, jax.vmap(icl)(taus)


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_gradient_closed_form_and_one_attention_layer_equals_one_gd_step_as_tau_goes_to_0():
  A, b = _problems(0)
  x = np.random.default_rng(1).normal(size=(P, D))
  taus = np.array([1e-2, 1e-3, 1e-4])
  with jax.enable_x64(True):
    grad, l_icl = (np.asarray(a) for a in _grad_and_icl(A, b, x, taus))
  assert grad.dtype == np.float64
  # numpy float64 closed form (1e-13: a few roundoffs of terms of size |A| |f - b| ~ 1)
  f = _softmax(np.einsum("pnd,pd->pn", A, x))
  jac = np.einsum("pn,nm->pnm", f, np.eye(N)) - np.einsum("pn,pm->pnm", f, f)
  np.testing.assert_allclose(grad, np.einsum("pnd,pnm,pm->pd", A, jac, f - b), rtol=0,
                             atol=1e-13)
  # the GD step from 0 (f = 1/n, J = (I - 11^T/n)/n) and its logits
  x1 = (ETA / N) * np.einsum("pnd,pn->pd", A, b - 1.0 / N)
  l_gd = np.einsum("pnd,pd->pn", A, x1)
  centred = lambda z: z - z.mean(-1, keepdims=True)  # noqa: E731
  err = np.abs(centred(l_icl) - centred(l_gd[None])).max(axis=(1, 2))
  # O(eta tau): the error falls by 10x per decade of tau (first-order Taylor remainder; the
  # ratio is 10 up to O(tau) relative corrections, here < 1 %)
  np.testing.assert_allclose(err[:-1] / err[1:], 10.0, rtol=0.03)
  assert err[-1] < 1e-3 * np.abs(centred(l_gd)).max()
  # the predictions: changes from the uniform start point the same way
  dg, di = _softmax(l_gd) - 1.0 / N, _softmax(l_icl[-1]) - 1.0 / N
  cos = np.sum(dg * di, -1) / np.linalg.norm(dg, axis=-1) / np.linalg.norm(di, axis=-1)
  assert np.all(cos > 1 - 1e-6)
  # and the step (eta = n, a large one) descends on average: the mean loss after it is below
  # the mean loss at the uniform start (single prompts may overshoot)
  loss = lambda f: 0.5 * np.sum((f - b) ** 2, -1)  # noqa: E731
  assert np.mean(loss(_softmax(l_icl[-1]))) < 0.5 * np.mean(loss(np.full_like(b, 1.0 / N)))


def test_weight_and_data_shifts_obey_the_half_lipschitz_bounds():
  A, _ = _problems(2)
  rng = np.random.default_rng(3)
  x = 2.0 * rng.normal(size=(P, D))
  dx = rng.normal(size=(P, D)) * rng.uniform(1e-3, 1, size=(P, 1))
  dA = rng.normal(size=(P, N, D)) * rng.uniform(1e-3, 1, size=(P, 1, 1))
  with jax.enable_x64(True):
    logits = jnp.asarray(np.stack([np.einsum("pnd,pd->pn", A, x),
                                   np.einsum("pnd,pd->pn", A, x + dx),
                                   np.einsum("pnd,pd->pn", A + dA, x)]))
    f0, fw, fd = np.asarray(jax.jit(js.normalizers.softmax)(logits))
  weight = np.linalg.norm(fw - f0, axis=-1) / (
      0.5 * np.linalg.norm(A, ord=2, axis=(1, 2)) * np.linalg.norm(dx, axis=-1))
  data = np.linalg.norm(fd - f0, axis=-1) / (
      0.5 * np.linalg.norm(x, axis=-1) * np.linalg.norm(dA, ord=2, axis=(1, 2)))
  assert np.all(weight <= 1 + 1e-12) and np.all(data <= 1 + 1e-12)
  # the constant 1/2 is the sharp one: ||J||_2 reaches 1/2 for a two-point distribution
  # (f = (1/2, 1/2, 0, ...) gives the eigenvalue 1/2 along e_1 - e_2)
  f = np.zeros(N)
  f[:2] = 0.5
  assert abs(np.linalg.norm(np.diag(f) - np.outer(f, f), ord=2) - 0.5) < 1e-15
