"""The blockwise threshold search of class T (``tile.search_*``) on its own.

xla_chunked and the Pallas Triton kernel run this search one pass over the key blocks per
step; here a small driver runs it over the blocks of dense rows, so the threshold it finds
and the number of steps it takes can be checked against a float64 sort-based oracle
(Martins & Astudillo 2016; Peters, Niculae & Martins 2019) and against multisection.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.normalizers import _entmax, _sparsemax, _topk, tile
from tests.normalizers.test_threshold_solver import hard_rows, oracle_tau

BLOCK = 128


def search(rule, x, hp=None, early_exit=True, iterations=None):
  """Runs the search on rows ``x`` [rows, n] (-inf = masked) in key blocks of BLOCK, as the
  blockwise drivers do; returns (tau, steps, every Newton point seen [steps, rows])."""
  hp = hp or {}
  x = jnp.asarray(x, jnp.float32)
  mask = jnp.isfinite(x)
  length = jnp.sum(mask, -1, keepdims=True).astype(x.dtype)
  z_all = tile.scores(rule, x, mask, jnp.zeros_like(length), length, hp)
  m = jnp.max(jnp.where(mask, z_all, -jnp.inf), -1, keepdims=True)
  m, state, target = tile.search_start(rule, m, length, hp)
  count, steps, newton = tile.search_schedule(rule, iterations or rule.iterations, early_exit)
  blocks = range(0, x.shape[-1], BLOCK)
  points = []
  done_steps = 0
  for _ in range(steps):
    if bool(jnp.all(tile.search_done(state))):
      break
    taus = tile.search_candidates(*state, count)
    sums = [jnp.zeros_like(m)] * (count * (1 + int(newton)))
    for j in blocks:
      sl = slice(j, j + BLOCK)
      z = tile.scores(rule, x[:, sl], mask[:, sl], m, length, hp)
      sums = tile.search_sums(rule, z, mask[:, sl], taus, sums, hp, newton)
    state = tile.search_update(rule, state, taus, sums, target, hp, newton)
    points.append(np.asarray(state[2][:, 0]))
    done_steps += 1
  return np.asarray(tile.search_threshold(state, newton)), done_steps, np.array(points)


def tolerance(tau):
  """What the search promises: the middle of a bracket of SEARCH_ULPS ulps of 1 + |tau|
  (measured: within 0.9 of those ulps of the float64 tau, mean bias under 0.1)."""
  return tile.SEARCH_ULPS * np.finfo(np.float32).eps * (1.0 + np.abs(tau))


def gaussian_rows(n, scale, seed, rows=32):
  return (scale * np.random.default_rng(seed).standard_normal((rows, n))).astype(np.float32)


RULES = [("sparsemax", _sparsemax.SPARSEMAX_RULE, 1.0),
         ("entmax15", _entmax.ENTMAX15_RULE, 0.5)]


@pytest.mark.parametrize("mapping,rule,half", RULES)
@pytest.mark.parametrize("n", [1, 7, 300, 4096])
def test_tau_matches_the_sorted_oracle(mapping, rule, half, n):
  rng = np.random.default_rng(n)
  x = np.concatenate([hard_rows(n, rng) / half, gaussian_rows(n, 3.0, n, rows=8)])
  x[-1, : n // 2] = -np.inf  # a masked part
  tau, _, _ = search(rule, x)
  want = oracle_tau(np.where(np.isfinite(x), half * x, -np.inf), mapping)
  np.testing.assert_allclose(tau, want, rtol=0, atol=float(np.max(tolerance(want))))


@pytest.mark.parametrize("mapping,rule,half", RULES)
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_fewer_steps_than_multisection(mapping, rule, half, scale):
  """Newton with a bisection companion settles every row of a 4096-wide block in at most
  7 passes (3-4 at scales 1 and 10); multisection with the same stopping rule needs 9-11,
  and the fixed count of a driver without early exit is ceil(30 / 2) = 15."""
  x = gaussian_rows(4096, scale, seed=int(10 * scale))
  tau, steps, _ = search(rule, x)
  _, multi_steps, _ = search(rule, x, early_exit=False)
  assert steps <= (7 if scale < 1 else 4), steps
  assert multi_steps >= steps + 4, (steps, multi_steps)
  assert tile.search_schedule(rule, rule.iterations, early_exit=False)[1] == 15
  want = oracle_tau(half * x, mapping)
  np.testing.assert_allclose(tau, want, rtol=0, atol=float(np.max(tolerance(want))))


@pytest.mark.parametrize("mapping,rule,half", RULES)
def test_newton_points_stay_below_the_root(mapping, rule, half):
  """M^p is convex for these rules, so every tangent root is a lower bound of tau (up to
  the rounding of the sums)."""
  x = np.concatenate([gaussian_rows(300, 2.0, seed=3), hard_rows(300, np.random.default_rng(3))
                      / half])
  tau, _, points = search(rule, x)
  want = oracle_tau(half * x, mapping)[:, 0]
  finite = np.isfinite(points)
  assert finite.any()
  slack = tolerance(want)
  assert np.all(np.where(finite, points <= want + slack, True))


@pytest.mark.parametrize("alpha", [1.25, 3.0])
def test_entmax_any_alpha(alpha):
  """alpha = 3 has no convex power (its Newton points can overshoot): the bisection
  companion still closes the bracket on tau."""
  x = np.concatenate([gaussian_rows(1000, 2.0, seed=5), hard_rows(1000, np.random.default_rng(5))])
  tau, steps, _ = search(_entmax.ENTMAX_RULE, x, {"alpha": alpha})
  z = (alpha - 1.0) * x.astype(np.float64)
  lo, hi = z.max(-1, keepdims=True) - 1.0, z.max(-1, keepdims=True)
  for _ in range(200):  # float64 bisection on sum [z - t]_+^{1/(alpha-1)} = 1
    mid = 0.5 * (lo + hi)
    ok = np.sum(np.maximum(z - mid, 0.0) ** (1.0 / (alpha - 1.0)), -1, keepdims=True) >= 1.0
    lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
  np.testing.assert_allclose(tau, lo, rtol=0, atol=float(np.max(tolerance(lo))))
  assert steps <= 30


def test_top_k_keeps_multisection():
  """top-k's mass is a step function (no slope): multisection, and exactly k entries at or
  above tau."""
  rule, k = _topk.TOP_K_RULE, 5
  count, _, newton = tile.search_schedule(rule, rule.iterations, early_exit=True)
  assert (count, newton) == (3, False)
  x = gaussian_rows(700, 1.0, seed=7)
  tau, _, points = search(rule, x, {"k": k})
  assert np.all(np.isneginf(points))
  np.testing.assert_array_equal(np.sum(x >= tau, -1), k)


def test_rows_with_nothing_visible_start_done():
  rule = _sparsemax.SPARSEMAX_RULE
  m = jnp.array([[-jnp.inf], [0.5]])
  _, state, _ = tile.search_start(rule, m, jnp.array([[0.0], [3.0]]), {})
  np.testing.assert_array_equal(np.asarray(tile.search_done(state))[:, 0], [True, False])
  x = np.full((2, 9), -np.inf, np.float32)
  _, steps, _ = search(rule, x)
  assert steps == 0


def test_candidates_bracket_a_newton_point_on_the_root():
  """With a Newton point r inside the bracket: r - e, r + e (one ulp of 1 + |r|) and the
  middle of [r + e, hi]; without one, points splitting [lo, hi] into quarters."""
  lo, hi = jnp.array([[0.0], [0.0]]), jnp.array([[1.0], [1.0]])
  r = jnp.array([[0.5], [-jnp.inf]])
  c = np.asarray(jnp.concatenate(tile.search_candidates(lo, hi, r, 3), -1))
  e = np.finfo(np.float32).eps * 1.5
  np.testing.assert_allclose(c[0], [0.5 - e, 0.5 + e, 0.75 + e / 2], rtol=1e-7)
  np.testing.assert_allclose(c[1], [0.25, 0.5, 0.75])
  assert np.all(np.diff(c, axis=-1) > 0)


def test_kernel_search_uses_the_same_schedule():
  """The Triton kernel and xla_chunked stop early; the Mosaic TPU grid fixes its sweeps."""
  rule = _sparsemax.SPARSEMAX_RULE
  assert tile.search_schedule(rule, 30, early_exit=True) == (3, 30, True)
  assert tile.search_schedule(rule, 30, early_exit=False) == (3, 15, False)


@pytest.mark.parametrize("name,hp,newton", [
    ("sparsemax", {}, True), ("entmax", {"alpha": jnp.array([[1.2], [1.5], [2.5]])}, True),
    ("top_k", {"k": 3}, False)])
def test_stacked_sums_equal_the_list_form(name, hp, newton):
  """xla_chunked sums the candidates along a leading axis, the kernels one tile each."""
  rule = {"sparsemax": _sparsemax.SPARSEMAX_RULE, "entmax": _entmax.ENTMAX_RULE,
          "top_k": _topk.TOP_K_RULE}[name]
  z = jnp.asarray(gaussian_rows(40, 1.0, seed=9, rows=3))
  mask = jnp.arange(40)[None, :] < jnp.array([[40], [25], [3]])
  taus = [jnp.full((3, 1), t) for t in (-0.5, 0.2, 0.9)]
  zero = [jnp.zeros((3, 1))] * (3 * (1 + int(newton)))
  listed = tile.search_sums(rule, z, mask, taus, zero, hp, newton)
  stacked = tile.search_sums(rule, z, mask, taus, zero, hp, newton, stacked=True)
  for a, b in zip(listed, stacked, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
  assert any(float(jnp.max(jnp.abs(a))) > 0 for a in listed)
