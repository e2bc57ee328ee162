"""The sort-free threshold solvers of sparsemax (N16) and 1.5-entmax (N17) themselves.

Checked against a float64 sort-based oracle (Martins & Astudillo 2016, Alg. 1; Peters,
Niculae & Martins 2019, Alg. 2), and for the number of passes they take: the loop runs
until the slowest row of a block has settled, so a row that never settles (rounding)
would cost its block the loop's cap of n + 2 passes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.normalizers import _entmax, _sparsemax, entmax, entmax15, softmax, sparsemax
from jaxsoft.normalizers import common as c


def oracle_tau(y, mapping):
  """float64 tau of rows ``y`` (``-inf`` masked) by sorting; NaN for empty rows."""
  y = np.asarray(y, np.float64)
  z = -np.sort(-y, axis=-1)
  vis = np.isfinite(z)
  zv = np.where(vis, z, 0.0)
  k = np.arange(1, y.shape[-1] + 1)
  cs = np.cumsum(zv, -1)
  if mapping == "sparsemax":
    tau_k = (cs - 1) / k
  else:
    mean = cs / k
    delta = (1 - k * (np.cumsum(zv * zv, -1) / k - mean**2)) / k
    tau_k = mean - np.sqrt(np.maximum(delta, 0))
  ok = vis & (tau_k < z)
  kz = np.max(np.where(ok, k, 0), -1, keepdims=True)
  tau = np.take_along_axis(tau_k, np.maximum(kz - 1, 0), -1)
  return np.where(kz > 0, tau, np.nan)


def hard_rows(n, rng):
  """Rows with max 0 that are slow or delicate for a support iteration."""
  geo = -(1.0 - 0.9 ** np.arange(n)) * 1.5
  rows = [
      geo, geo[::-1] - geo[-1] if n > 1 else geo,  # many entries just outside each support
      np.linspace(0.0, -0.05, n),  # all close: full support
      np.zeros(n),  # all tied
      np.where(np.arange(n) == 3, 0.0, -2.5),  # one entry
      np.where(np.arange(n) < n // 2, 0.0, -1.0 + 1e-7),  # a cluster at the bracket's end
      -np.abs(rng.standard_normal(n)) * 0.01,  # a tiny spread
      -np.abs(rng.standard_normal(n)) * 30.0,  # a huge spread
  ]
  y = np.stack(rows).astype(np.float32)
  return y - y.max(-1, keepdims=True)


SOLVERS = [("sparsemax", _sparsemax.sparsemax_threshold, 1.0),
           ("entmax15", _entmax.entmax15_threshold, 0.5)]


@pytest.mark.parametrize("mapping,solve,scale", SOLVERS)
@pytest.mark.parametrize("n", [1, 7, 300])
def test_tau_matches_sorted_oracle(mapping, solve, scale, n):
  rng = np.random.default_rng(n)
  y = np.concatenate([hard_rows(n, rng),
                      (rng.standard_normal((24, n)) * rng.choice([0.1, 1.0, 5.0], (24, 1)))])
  y[-1, : n // 2] = -np.inf  # a masked part
  y[-2] = -np.inf  # nothing visible
  top = np.max(y, -1, keepdims=True)
  y = ((y - np.where(np.isfinite(top), top, 0.0)) * scale).astype(np.float32)
  tau = np.asarray(jax.jit(solve)(jnp.asarray(y)))
  want = oracle_tau(y, mapping)
  assert np.all(np.isfinite(tau))
  vis = ~np.isnan(want[:, 0])
  np.testing.assert_allclose(tau[vis], want[vis], atol=2e-6, rtol=1e-6)


def passes_per_row(monkeypatch, solve, y):
  """The number of passes ``solve`` makes on each row of ``y`` when solved on its own."""
  box = {}
  real = c.passes_until_done

  def counting(step, init, n_max):
    def counted(i, *state):
      new, now_done = step(*state)
      return (i + 1, *new), now_done
    i, *state = real(counted, (jnp.zeros_like(init[0]), *init), n_max)
    box["i"] = i
    return tuple(state)

  monkeypatch.setattr(c, "passes_until_done", counting)

  def one_row(row):
    solve(row[None])
    return box["i"][0, 0]

  return np.asarray(jax.jit(jax.vmap(one_row))(y))


@pytest.mark.parametrize("mapping,solve,scale", SOLVERS)
def test_every_row_settles_in_a_few_passes(monkeypatch, mapping, solve, scale):
  # Gaussian rows (the first 64 of the benchmark's [4096, 1024] array): without the
  # rounding guards of entmax15 (an r a few ulps past the Newton point; a pass that moves
  # nothing), some of these rows never settled and took all n + 2 passes.
  x = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
  y = jnp.asarray((x - x.max(-1, keepdims=True)) * np.float32(scale))
  tau = jax.jit(solve)(y)
  np.testing.assert_allclose(tau, oracle_tau(y, mapping), atol=2e-6, rtol=1e-6)
  passes = passes_per_row(monkeypatch, solve, y)
  assert passes.max() <= 7, np.bincount(passes.astype(int))


@pytest.mark.parametrize("fn,mapping,scale", [(sparsemax, "sparsemax", 1.0),
                                              (entmax15, "entmax15", 0.5)])
def test_row_blocks_mask_and_odd_rows(fn, mapping, scale):
  # 9 rows of 5000: blocks of 6 rows (the second one padded), a `where` mask, a row the
  # input rules take over (a visible +inf), which the solve leaves out without reading a
  # mask array, and a masked NaN, which is ignored. (A visible NaN in rows this long:
  # test_visible_nan_in_long_rows.)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((9, 5000)).astype(np.float32) * 2.0
  where = rng.random(x.shape) < 0.9
  x[2, [5, 7]], where[2, [5, 7]] = np.inf, True
  x[3, 4], where[3, 4] = np.nan, False
  x[4, :] = -np.inf
  x[4, 3] = 1.0
  p = np.asarray(jax.jit(fn)(jnp.asarray(x), where=jnp.asarray(where)))
  ok = [0, 1, 3, 4, 5, 6, 7, 8]
  z = np.where(where, x, -np.inf)[ok] * scale
  z = z - z.max(-1, keepdims=True)
  tau = oracle_tau(z, mapping)
  want = np.maximum(z - tau, 0) ** (1 if mapping == "sparsemax" else 2)
  np.testing.assert_allclose(p[ok], np.where(np.isfinite(want), want, 0.0), atol=2e-6)
  np.testing.assert_array_equal(p[2], np.where(np.isinf(x[2]), 0.5, 0.0))


@pytest.mark.parametrize("n", [5000, 8192])
@pytest.mark.parametrize("fn", [sparsemax, entmax15, lambda x, where: entmax(x, where=where),
                                softmax], ids=["sparsemax", "entmax15", "entmax1.5", "softmax"])
def test_visible_nan_in_long_rows(fn, n):
  # XLA:CPU's vectorised row max can drop a NaN (a [9, 5000] row with one NaN had a
  # finite max; -inf with the NaN last), so these rows came out finite: a visible NaN
  # must make its row NaN (visible entries; masked ones 0) wherever it is, next to +inf
  # or -inf entries too, with a zero gradient; a masked NaN changes nothing.
  rng = np.random.default_rng(5)
  x = rng.standard_normal((8, n)).astype(np.float32)
  where = np.ones(x.shape, bool)
  where[:, 1] = False
  x[0, n - 1] = np.nan  # last
  x[1, 0] = np.nan  # first
  x[2, n // 2 + 3] = np.nan
  x[3, [7, 9]], x[3, 8] = np.nan, np.inf  # with a +inf: still a NaN row
  x[4, 11], x[4, :5] = np.nan, -np.inf  # with -inf entries
  x[5, 1] = np.nan  # masked: ignored
  x[6, [2, n - 2]] = np.inf  # +inf only: 1/2 each
  nan_rows = [0, 1, 2, 3, 4]
  f = jax.jit(lambda v: fn(v, where=jnp.asarray(where)))
  p = np.asarray(f(jnp.asarray(x)))
  vis = where & (x != -np.inf)
  np.testing.assert_array_equal(np.isnan(p[nan_rows]), vis[nan_rows])
  np.testing.assert_array_equal(p[nan_rows][~vis[nan_rows]], 0.0)
  np.testing.assert_array_equal(p[6], np.where(np.isinf(x[6]) & where[6], 0.5, 0.0))
  clean = np.where(np.isnan(x), 0.0, x)
  np.testing.assert_array_equal(p[[5, 7]], np.asarray(f(jnp.asarray(clean)))[[5, 7]])
  g = np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(jnp.where(jnp.isnan(f(v)), 0.0, f(v))
                                                    * jnp.arange(n)[None])))(jnp.asarray(x)))
  assert np.isfinite(g).all()
  np.testing.assert_array_equal(g[nan_rows + [6]], 0.0)
