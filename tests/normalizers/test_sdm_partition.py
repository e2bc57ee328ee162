"""The SDM estimator's partition step (N10): sdm_selective_thresholds against a brute-force
NumPy search over every cut, its selective-risk property on the calibration set and on fresh
data, masks, ties and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises

N = js.normalizers
# one compilation per shape instead of one per eager operation
THRESHOLDS = jax.jit(N.sdm_selective_thresholds, static_argnums=3, static_argnames="alpha")


def _brute(s, pred, y, n_cls, alpha, keep):
  """Every observed class-y score as a cut, every stricter cut checked, the lowest valid
  one (the accuracy test in float32, as the function computes it)."""
  out = np.full(n_cls, np.inf)
  a = np.float32(alpha)
  for cls in range(n_cls):
    idx = [j for j in range(len(s)) if keep[j] and pred[j] == cls and not np.isnan(s[j])]
    cuts = sorted({s[j] for j in idx})

    def accurate(t, idx=idx):
      kept = [j for j in idx if s[j] >= t]
      return np.float32(sum(pred[j] == y[j] for j in kept)) >= a * np.float32(len(kept))

    for t in cuts:
      if all(accurate(u) for u in cuts if u >= t):
        out[cls] = t
        break
  return out


def _calibration(seed, n, n_cls=3):
  """Scores that carry information: the prediction is right with probability sigmoid(4s)."""
  rng = np.random.default_rng(seed)
  y = rng.integers(0, n_cls, n)
  s = np.round(rng.normal(size=n), 2).astype(np.float32)   # rounded: many ties
  right = rng.random(n) < 1 / (1 + np.exp(-4 * s))
  pred = np.where(right, y, (y + rng.integers(1, n_cls, n)) % n_cls)
  return s, pred.astype(np.int32), y.astype(np.int32)


def test_thresholds_equal_the_brute_force_search():
  s, pred, y = _calibration(0, 200)
  keep = np.random.default_rng(1).random(200) < 0.9
  fn = jax.jit(lambda s, p, y, k: [N.sdm_selective_thresholds(s, p, y, 3, alpha=a, where=k)
                                   for a in (0.6, 0.8, 0.95, 1.0, 0.0)])
  for a, got in zip((0.6, 0.8, 0.95, 1.0, 0.0), fn(s, pred, y, keep), strict=True):
    np.testing.assert_array_equal(got, _brute(s, pred, y, 3, a, keep))


@pytest.mark.slow
def test_selective_risk_on_calibration_and_fresh_data():
  alpha = 0.85
  s, pred, y = _calibration(2, 20000)
  psi = THRESHOLDS(s, pred, y, 3, alpha=alpha)
  assert bool(jnp.all(jnp.isfinite(psi)))
  for data, slack in (((s, pred, y), 0.0), (_calibration(3, 20000), 0.025)):
    ds, dp, dy = data
    kept = np.asarray(N.sdm_selective_accept(ds, dp, psi))
    for cls in range(3):
      sel = kept & (dp == cls)
      # calibration: exact (acc >= alpha by construction); fresh data: the sampling error of
      # the ~3500 kept points per class, sqrt(0.85 * 0.15 / 3500) = 0.006, times 4 (the
      # lowest valid cut is also slightly optimistic: -0.01 at worst over 4 seeds)
      assert sel.sum() > 1000
      assert np.mean(dp[sel] == dy[sel]) >= alpha - slack, (cls, slack)
    # the partition keeps more than it would at random and rejects the low scores
    assert 0.2 < kept.mean() < 0.9
  # a stricter target keeps fewer points
  strict = THRESHOLDS(s, pred, y, 3, alpha=0.95)
  assert bool(jnp.all(strict >= psi))


def test_ties_nan_empty_class_and_dtype():
  s = jnp.array([0.5, 0.5, 0.9, jnp.nan, 0.3])
  pred = jnp.array([0, 0, 0, 0, 0])
  y = jnp.array([0, 1, 0, 1, 0])
  # the tie at 0.5 counts together: acc(0.5) = 2/3; class 1 has no calibration prediction
  np.testing.assert_array_equal(THRESHOLDS(s, pred, y, 2, alpha=0.6),
                                np.float32([0.3, np.inf]))
  np.testing.assert_array_equal(THRESHOLDS(s, pred, y, 2, alpha=0.7),
                                np.float32([0.9, np.inf]))
  assert THRESHOLDS(jnp.zeros(0), jnp.zeros(0, int), jnp.zeros(0, int), 2,
                                    alpha=0.5).shape == (2,)
  assert not bool(N.sdm_selective_accept(jnp.array([jnp.nan]), jnp.array([0]),
                                         jnp.array([0.0]))[0])
  with jax.enable_x64(True):
    out = THRESHOLDS(jnp.asarray(s, jnp.float64), pred, y, 2, alpha=0.6)
    assert out.dtype == jnp.float64


def test_bad_input_names_the_argument():
  s, p = jnp.ones(3), jnp.zeros(3, int)
  check_raises(
      (r"sdm_selective_thresholds: `alpha` must be in \[0, 1\]",
       lambda: N.sdm_selective_thresholds(s, p, p, 2, alpha=1.5)),
      (r"sdm_selective_thresholds: `labels` must be in \[0, 2\)",
       lambda: N.sdm_selective_thresholds(s, p, p + 2, 2, alpha=0.5)),
      (r"sdm_selective_thresholds: `scores` must be a real 1-D array",
       lambda: N.sdm_selective_thresholds(jnp.ones((3, 1)), p, p, 2, alpha=0.5)),
      (r"sdm_selective_accept: `predictions` must be in \[0, 2\)",
       lambda: N.sdm_selective_accept(s, p + 5, jnp.ones(2))),
  )
