"""L09 DEXML's soft top-k operator loss against a float64 NumPy reference of its formula
(the threshold by scipy's brentq, gradients by central differences of that reference):
values, gradients, masks, per-row k, saturation, bf16, x64 and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import expit

import jaxsoft as js
from tests.helpers import check_raises, normal

L = js.losses


def _ref(s, pos, k, tau=1.0, cand=None, keep=None):
  """Per-row loss in float64: t solves sum_{visible} sigmoid(s/tau - t) = k, the loss is
  -mean_{positives} log sigmoid(s_p/tau - t); 0 if k >= #visible, no positive, or dropped."""
  s = np.asarray(s, np.float64) / tau
  b, m = s.shape
  cand = np.ones((b, m), bool) if cand is None else np.broadcast_to(np.asarray(cand), (b, m))
  keep = np.ones(b, bool) if keep is None else np.asarray(keep)
  k = np.broadcast_to(np.asarray(k, np.float64), (b,))
  out = np.zeros(b)
  for i in range(b):
    v, p = s[i][cand[i]], np.asarray(pos[i], bool)[cand[i]]
    if not keep[i] or not p.any() or k[i] >= v.size:
      continue
    t = brentq(lambda t, v=v, ki=k[i]: expit(v - t).sum() - ki, v.min() - 60, v.max() + 60,
               xtol=1e-15, rtol=1e-15)
    out[i] = -np.mean(np.log(expit(v[p] - t)))
  return out


def _num_grad(f, s, h=1e-5):
  """Central differences of sum(f) (float64): error ~ h^2 f''' ~ 1e-10 plus the root's
  1e-15 / h ~ 1e-10."""
  s = np.asarray(s, np.float64)
  g = np.zeros_like(s)
  for idx in np.ndindex(s.shape):
    e = np.zeros_like(s)
    e[idx] = h
    g[idx] = (f(s + e).sum() - f(s - e).sum()) / (2 * h)
  return g


def _inputs():
  s = normal(0, (5, 7), 2.0)
  pos = np.zeros((5, 7), bool)
  pos[0, [1, 4]] = pos[1, 2] = pos[2, [0, 3, 5]] = pos[4, 6] = True   # row 3: no positive
  cand = np.ones((5, 7), bool)
  cand[0, 6] = cand[2, 1] = cand[4, [0, 1, 2, 3]] = False   # row 4: 3 visible, k = 3
  k = np.array([2.0, 3.0, 2.5, 2.0, 3.0])
  return s, jnp.asarray(pos), jnp.asarray(cand), jnp.asarray(k)


def test_values_and_gradients_against_float64():
  s, pos, cand, k = _inputs()
  # one program: the rows of s and of s + 3 (adding a constant moves the threshold only)
  s2, pos2, cand2, k2 = (jnp.concatenate([a, b]) for a, b in
                         ((s, s + 3.0), (pos, pos), (cand, cand), (k, k)))

  @jax.jit
  def f(s2):
    per_row = lambda a: L.soft_top_k_loss(a, pos2, k=k2, temperature=0.5, where=cand2)  # noqa: E731
    return jax.value_and_grad(lambda a: per_row(a).sum(), has_aux=False)(s2), per_row(s2)

  ref = lambda a: _ref(a, pos, k, 0.5, cand)  # noqa: E731
  (_, g), val = f(s2)
  want = ref(s)
  assert want[0] > 0 and want[1] > 0 and want[2] > 0 and want[3] == 0 and want[4] == 0
  # float32: the threshold to a few 2^-24 roundings of |s/tau| ~ 10, softplus of O(10):
  # 1e-5 relative; gradients ~0.1-1 to 1e-5 absolute
  np.testing.assert_allclose(val, np.concatenate([want, want]), rtol=1e-5, atol=1e-6)
  gref = _num_grad(ref, s)
  np.testing.assert_allclose(g, np.concatenate([gref, gref]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_float64_inputs_stay_float64():
  s, pos, cand, _ = _inputs()
  # float64 in, float64 out, to a few float64 roundings (the reference's root is to 1e-15)
  with jax.enable_x64(True):
    s64 = jnp.asarray(np.asarray(s, np.float64))
    val64, g64 = jax.jit(jax.value_and_grad(lambda a: L.soft_top_k_loss(
        a, pos, k=2.0, where=cand).sum()))(s64)
    assert val64.dtype == g64.dtype == jnp.float64
  ref1 = lambda a: _ref(a, pos, 2.0, 1.0, cand)  # noqa: E731
  np.testing.assert_allclose(val64, ref1(s).sum(), rtol=1e-12)
  np.testing.assert_allclose(g64, _num_grad(ref1, s), rtol=1e-7, atol=1e-9)


def test_hard_limit_saturation_and_bf16():
  # separated scores: at a small temperature the soft top-2 is the hard top-2
  s = jnp.array([[4.0, 3.0, 1.0, 0.0, -2.0], [100.0, -100.0, 0.0, 3.0, 50.0]])
  pos = jnp.array([[True, True, False, False, False], [True, True, False, False, False]])

  @jax.jit
  def f(s):
    loss = lambda a: L.soft_top_k_loss(a, pos2, k=2)  # noqa: E731
    # the rows at temperature 0.05 (s / 0.05) and at 1, in one call
    pos2 = jnp.concatenate([pos, pos])
    rows = jnp.concatenate([s / 0.05, s])
    grad = jax.grad(lambda a: loss(a).sum())(rows)
    val = loss(rows)
    return dict(cold=val[:2], hot=val[2:], grad=grad[2:],
                bf16=L.soft_top_k_loss(s.astype(jnp.bfloat16), pos, k=2))

  got = f(s)
  # row 0: positives are the top 2 (margin 2 / 0.05 = 40: sigmoid(-20) ~ 2e-9);
  # row 1: positive -100 is far out of the top 2, sigma' underflows without NaN
  assert got["cold"][0] < 1e-8
  np.testing.assert_allclose(got["hot"], _ref(s, pos, 2), rtol=1e-5)
  g = np.asarray(got["grad"])
  assert np.all(np.isfinite(g))
  np.testing.assert_allclose(g.sum(axis=1), 0.0, atol=1e-6)   # shift invariance
  assert got["bf16"].dtype == jnp.bfloat16
  sb = np.asarray(s.astype(jnp.bfloat16).astype(jnp.float32))
  # computed in float32 from the bf16 inputs, the output rounded to 8 bits (2^-9: 4e-3)
  np.testing.assert_allclose(np.float32(got["bf16"]), _ref(sb, pos, 2), rtol=4e-3)


def test_bad_arguments_name_the_function():
  s, pos, _, _ = _inputs()
  f = L.soft_top_k_loss
  check_raises(
      (r"soft_top_k_loss: `k` must be finite and > 0", lambda: f(s, pos, k=0)),
      (r"soft_top_k_loss: `k` must be finite and > 0", lambda: f(s, pos, k=float("inf"))),
      (r"soft_top_k_loss: `k` must be a scalar or \[B\]", lambda: f(s, pos, k=jnp.ones(3))),
      (r"soft_top_k_loss: `temperature`", lambda: f(s, pos, k=2, temperature=0.0)),
      (r"soft_top_k_loss: `positives` of shape", lambda: f(s, pos[:, :3], k=2)),
      (r"soft_top_k_loss: `scores` must be \[B, M\]", lambda: f(s[0], pos[0], k=2)),
  )
  check_raises((r"soft_top_k_loss: `k` must be a number", lambda: f(s, pos, k=True)),
               error=TypeError)
