"""N39 max-plus aggregation and its LSE_eps smoothing, against a numpy loop and the semiring's
properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.normalizers import _tropical as TR
from tests import helpers

RNG = np.random.default_rng(0)
S = RNG.normal(size=(2, 5, 7)).astype(np.float32)
V = RNG.normal(size=(2, 7, 3)).astype(np.float32)
MASK = RNG.random((2, 5, 7)) < 0.7
MASK[0, 1] = False  # a query row with no visible key


def _ref(s, v, mask, eps):
  s, v = np.asarray(s, np.float64), np.asarray(v, np.float64)
  out = np.zeros(s.shape[:-1] + (v.shape[-1],))
  for b, t in np.ndindex(s.shape[:2]):
    vis = mask[b, t]
    if not vis.any():
      continue
    a = s[b, t, vis][:, None] + v[b, vis]  # [visible keys, H]
    if eps == 0:
      out[b, t] = a.max(0)
    else:
      out[b, t] = eps * np.log(np.exp(a / eps).sum(0))
  return out


@pytest.mark.parametrize("eps", [0.0, 0.5])
def test_matches_numpy_with_masks(eps):
  got = TR.tropical_max_plus(S, V, where=MASK, eps=eps)
  np.testing.assert_allclose(got, _ref(S, V, MASK, eps), rtol=1e-5, atol=1e-5)
  # a -inf score is a masked key
  np.testing.assert_array_equal(TR.tropical_max_plus(np.where(MASK, S, -np.inf), V, eps=eps),
                                got)
  g = jax.jit(jax.grad(lambda s: jnp.sum(TR.tropical_max_plus(s, V, where=MASK, eps=eps))))(S)
  assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[~MASK] == 0)
  assert np.all(np.asarray(g)[0, 1] == 0)


def test_smoothing_tends_to_the_max_within_eps_log_n():
  hard = np.asarray(TR.tropical_max_plus(S, V, where=MASK), np.float64)
  n = MASK.sum(-1)[..., None]
  prev = None
  for eps in (1.0, 0.1, 0.01, 1e-3):
    soft = np.asarray(TR.tropical_max_plus(S, V, where=MASK, eps=eps), np.float64)
    assert np.all(soft >= hard - 1e-5)
    assert np.all(soft <= hard + eps * np.log(np.maximum(n, 1)) + 1e-5)
    if prev is not None:
      assert np.all(soft <= prev + 1e-6)  # decreasing in eps
    prev = soft
  np.testing.assert_allclose(prev, hard, atol=1e-2)
  # the smooth gradient in the scores: softmax weights per channel, summed over channels
  g = jax.grad(lambda s: jnp.sum(TR.tropical_max_plus(s, V, eps=0.5)))(S)
  w = jax.nn.softmax((S[..., :, :, None] + V[..., None, :, :]) / 0.5, axis=-2)
  np.testing.assert_allclose(g, w.sum(-1), rtol=1e-5, atol=1e-6)


def test_semiring_properties_equivariance_no_dilution_lipschitz():
  o = np.asarray(TR.tropical_max_plus(S, V))
  np.testing.assert_allclose(TR.tropical_max_plus(S, V + 2.5), o + 2.5, rtol=1e-6)
  np.testing.assert_allclose(TR.tropical_max_plus(S - 1.0, V), o - 1.0, rtol=1e-6)
  # 100 extra keys dominated in every channel leave the hard output unchanged
  s_more = np.concatenate([S, np.full((2, 5, 100), -50.0, np.float32)], -1)
  v_more = np.concatenate([V, np.zeros((2, 100, 3), np.float32)], -2)
  np.testing.assert_array_equal(TR.tropical_max_plus(s_more, v_more), o)
  # 1-Lipschitz in the sup norm of the values
  dv = RNG.uniform(-0.3, 0.3, V.shape).astype(np.float32)
  assert np.abs(np.asarray(TR.tropical_max_plus(S, V + dv)) - o).max() <= 0.3 + 1e-6


def test_hilbert_metric_scores():
  q = RNG.normal(size=(4, 6))
  k = RNG.normal(size=(5, 6))
  s = np.asarray(TR.tropical_hilbert_scores(q, k))
  d = q[:, None] - k[None]
  np.testing.assert_allclose(s, -(d.max(-1) - d.min(-1)), rtol=1e-6)
  assert np.all(s <= 0)
  np.testing.assert_allclose(TR.tropical_hilbert_scores(q, q + 3.0).diagonal(), 0.0, atol=1e-6)


def test_low_precision_and_bad_input():
  sb, vb = jnp.asarray(S, jnp.bfloat16), jnp.asarray(V, jnp.bfloat16)
  got = TR.tropical_max_plus(sb, vb, where=MASK, eps=0.5)
  assert got.dtype == jnp.bfloat16
  want = _ref(np.asarray(sb.astype(jnp.float32)), np.asarray(vb.astype(jnp.float32)), MASK, 0.5)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2)
  helpers.check_raises(("eps", lambda: TR.tropical_max_plus(S, V, eps=-1.0)),
                       ("keys", lambda: TR.tropical_max_plus(S, V[:, :6])),
                       ("where", lambda: TR.tropical_max_plus(S, V, where=np.ones((3, 7), bool))),
                       ("last dimension", lambda: TR.tropical_hilbert_scores(S, V)))
