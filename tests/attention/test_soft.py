"""A26 soft_attention, gaussian_kernel and newton_schulz_pinv (jaxsoft/attention/_soft.py).

Oracles: numpy float64 from the paper's formula (the full T x T Gaussian kernel, the
Nystrom form with numpy's pinv), jnp.linalg.pinv, and float64 finite differences.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention import gaussian_kernel, newton_schulz_pinv, soft_attention
from tests.helpers import check_raises, normal

B, T, N, H = 2, 6, 2, 4


def test_newton_schulz_converges_to_pinv():
  a = normal(0, (3, 5, 5))
  spd = a @ jnp.swapaxes(a, -1, -2) + 0.5 * jnp.eye(5)[None]
  pinv = jax.jit(newton_schulz_pinv, static_argnums=1)
  z = pinv(spd, 40)
  chex.assert_trees_all_close(z, jnp.linalg.pinv(spd), atol=1e-4, rtol=1e-4)
  errs = [float(jnp.linalg.norm(spd @ pinv(spd, i) - jnp.eye(5)[None])) for i in (5, 15)]
  assert errs[1] < errs[0]


def _np_gauss(a, b):
  d = a.shape[-1]
  sq = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
  return np.exp(-sq / (2 * np.sqrt(d)))


def test_soft_attention_with_all_landmarks_is_exact_kernel_attention():
  q, v = 0.8 * normal(1, (B, T, N, H)), normal(2, (B, T, N, 3))
  out = jax.jit(functools.partial(soft_attention, num_landmarks=T, num_iters=60))(q, v)
  qn, vn = np.asarray(q, np.float64), np.asarray(v, np.float64)
  want = np.zeros(out.shape)
  for b, n in np.ndindex(B, N):
    S = _np_gauss(qn[b, :, n], qn[b, :, n])
    assert np.all(S > 0) and np.all(S <= 1) and np.allclose(np.diag(S), 1)
    want[b, :, n] = S @ vn[b, :, n]
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-3, rtol=2e-3)


def test_soft_attention_nystrom_form_symmetric_normalization_and_grads():
  q, v = normal(3, (1, 8, 1, H)), normal(4, (1, 8, 1, 2))
  f = jax.jit(functools.partial(soft_attention, num_landmarks=2))
  qn = np.asarray(q, np.float64)[0, :, 0]
  lm = qn.reshape(2, 4, H).mean(1)
  P, A = _np_gauss(qn, lm), _np_gauss(lm, lm)
  s_hat = P @ np.linalg.pinv(A) @ P.T
  np.testing.assert_allclose(np.asarray(f(q, v))[0, :, 0], s_hat @ np.asarray(v)[0, :, 0],
                             atol=1e-4, rtol=1e-4)
  d = s_hat.sum(1)
  sym = (s_hat / np.sqrt(d)[:, None] / np.sqrt(d)[None, :]) @ np.asarray(v)[0, :, 0]
  got = jax.jit(functools.partial(soft_attention, num_landmarks=2, symmetric_normalize=True))(q, v)
  np.testing.assert_allclose(np.asarray(got)[0, :, 0], sym, atol=1e-4, rtol=1e-4)
  assert np.max(np.abs(np.linalg.eigvalsh(s_hat / np.sqrt(np.outer(d, d))))) <= 1 + 1e-6
  np.testing.assert_allclose(np.asarray(gaussian_kernel(q[0, :, 0], q[0, :, 0])),
                             _np_gauss(qn, qn), atol=1e-6)
  with jax.enable_x64(True):
    q64, v64 = q.astype(jnp.float64), v.astype(jnp.float64)
    jax.test_util.check_grads(jax.jit(functools.partial(soft_attention, num_landmarks=2)),
                              (q64, v64), order=1, modes=("rev",), atol=1e-4, rtol=1e-4)


def test_errors_name_the_argument():
  q = jnp.zeros((1, 4, 1, 2))
  check_raises(
      ("`num_landmarks`", lambda: soft_attention(q, q, num_landmarks=3)),
      ("`value`", lambda: soft_attention(q, q[:, :2], num_landmarks=2)),
      ("`num_iters`", lambda: newton_schulz_pinv(jnp.eye(2), -1)),
  )
