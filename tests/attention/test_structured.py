"""A24 tensor_attention, A26 soft_attention / newton_schulz_pinv, A27 nonlocal_block
(jaxsoft/attention/_structured.py).

Oracles: numpy float64 from each paper's formula (explicit loops over key pairs, the full
T x T Gaussian kernel, the quadratic (Theta Phi^T) G order), jnp.linalg.pinv, standard
attention for the reductions, and float64 finite differences for the gradients.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention import dot_product_attention
from jaxsoft.attention._structured import (
    gaussian_kernel,
    newton_schulz_pinv,
    nonlocal_block,
    soft_attention,
    tensor_attention,
)
from tests.helpers import check_raises, normal

B, T, N, H = 2, 6, 2, 4


def _np_tensor(q, k1, k2, v1, v2, causal):
  q, k1, k2, v1, v2 = (np.asarray(a, np.float64) for a in (q, k1, k2, v1, v2))
  S = k1.shape[1]
  out = np.zeros(q.shape[:3] + (v1.shape[-1],))
  for b, i, n in np.ndindex(*q.shape[:3]):
    logits, vals = [], []
    for j in range(S):
      for k in range(S):
        if causal and (j > i or k > i):
          continue
        logits.append(np.sum(q[b, i, n] * k1[b, j, n] * k2[b, k, n]) / np.sqrt(H))
        vals.append(v1[b, j, n] * v2[b, k, n])
    w = np.exp(np.array(logits) - max(logits))
    out[b, i, n] = (w / w.sum()) @ np.array(vals)
  return out


def test_tensor_attention_matches_pair_loops_and_reduces_to_attention():
  args = [normal(i, (B, T, N, H)) for i in range(5)]
  for causal in (False, True):
    out = jax.jit(functools.partial(tensor_attention, is_causal=causal))(*args)
    np.testing.assert_allclose(np.asarray(out, np.float64), _np_tensor(*args, causal),
                               atol=1e-5, rtol=1e-5)
  q, k1, _, v1, _ = args
  ones = jnp.ones_like(k1)
  out = jax.jit(functools.partial(tensor_attention, is_causal=True))(q, k1, ones, v1, ones)
  chex.assert_trees_all_close(out, jax.jit(functools.partial(
      dot_product_attention, is_causal=True))(q, k1, v1), atol=1e-5, rtol=1e-5)
  lo = jax.jit(tensor_attention)(*(a.astype(jnp.bfloat16) for a in args))
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float64), _np_tensor(
      *(a.astype(jnp.bfloat16).astype(jnp.float32) for a in args), False), atol=3e-2, rtol=3e-2)


def test_tensor_attention_gradients_finite_differences():
  with jax.enable_x64(True):
    args = [normal(i, (1, 3, 1, 2)).astype(jnp.float64) for i in range(5)]
    jax.test_util.check_grads(jax.jit(functools.partial(tensor_attention, is_causal=True)),
                              args, order=1, modes=("rev",))


def test_newton_schulz_converges_to_pinv():
  a = normal(0, (3, 5, 5))
  spd = a @ jnp.swapaxes(a, -1, -2) + 0.5 * jnp.eye(5)
  pinv = jax.jit(newton_schulz_pinv, static_argnums=1)
  z = pinv(spd, 40)
  chex.assert_trees_all_close(z, jnp.linalg.pinv(spd), atol=1e-4, rtol=1e-4)
  errs = [float(jnp.linalg.norm(spd @ pinv(spd, i) - jnp.eye(5))) for i in (5, 15)]
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


def _nl_params(seed, C=5, D=4, Dv=6):
  return [normal(seed + i, s, 0.5) for i, s in enumerate([(C, D), (C, D), (C, Dv), (Dv, C)])]


def test_nonlocal_block_reassociation_equals_quadratic_order():
  x = normal(0, (B, 7, 5))
  wt, wp, wg, wo = _nl_params(1)
  xn, wt_, wp_, wg_, wo_ = (np.asarray(a, np.float64) for a in (x, wt, wp, wg, wo))
  for heads, use_softmax in ((1, False), (2, False), (2, True)):
    f = jax.jit(functools.partial(nonlocal_block, num_heads=heads, use_softmax=use_softmax))
    out = f(x, wt, wp, wg, wo)
    th, ph, g = (np.einsum("btc,cd->btd", xn, w).reshape(B, 7, heads, -1) for w in (wt_, wp_, wg_))
    a = np.einsum("binh,bjnh->bnij", th, ph)  # the T x T map the block never builds
    if use_softmax:
      a = np.exp(a - a.max(-1, keepdims=True))
      a = a / a.sum(-1, keepdims=True)
    else:
      a = a / 7
    y = np.einsum("bnij,bjnh->binh", a, g).reshape(B, 7, -1)
    np.testing.assert_allclose(np.asarray(out), xn + y @ wo_, atol=1e-5, rtol=1e-5)
  with jax.enable_x64(True):
    args = [a.astype(jnp.float64) for a in (x, wt, wp, wg, wo)]
    jax.test_util.check_grads(jax.jit(functools.partial(nonlocal_block, num_heads=2)), args,
                              order=1, modes=("rev",))
  lo = jax.jit(nonlocal_block)(x.astype(jnp.bfloat16), wt, wp, wg, wo)
  assert lo.dtype == jnp.bfloat16


def test_errors_name_the_argument():
  q = jnp.zeros((1, 4, 1, 2))
  w = jnp.zeros((3, 2))
  x = jnp.zeros((1, 4, 3))
  check_raises(
      ("`key2`", lambda: tensor_attention(q, q, q[:, :3], q, q)),
      ("`value2`", lambda: tensor_attention(q, q, q, q, q[..., :1])),
      ("`query`", lambda: tensor_attention(q[0], q, q, q, q)),
      ("`num_landmarks`", lambda: soft_attention(q, q, num_landmarks=3)),
      ("`value`", lambda: soft_attention(q, q[:, :2], num_landmarks=2)),
      ("`num_iters`", lambda: newton_schulz_pinv(jnp.eye(2), -1)),
      ("`w_theta`", lambda: nonlocal_block(x, w[:2], w, w, w.T)),
      ("`w_out`", lambda: nonlocal_block(x, w, w, w, w)),
      ("`num_heads`", lambda: nonlocal_block(x, w, w, w, w.T, num_heads=3)),
  )
