"""Class R normalizers (N08, N09, N26) against float64 numpy formulas written from the papers.

The gradients are compared with central differences of the numpy formula (independent of
JAX's autodiff), masks with the formula on the visible entries only.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import normalizers as nz
from jaxsoft import testing
from jaxsoft.normalizers import _row_stats as R
from jaxsoft.normalizers import common as c
from tests import helpers
from tests.helpers import sampled

POLY = (-0.037, 0.481, -2.3, 4.917, -1.791)


# ----------------------------------------------------------------------- numpy references


def _ref_adaptive(x, threshold=0.5, coefficients=POLY):
  x = np.asarray(x, np.float64)
  p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
  h = -np.sum(p * np.log(p))
  beta = max(np.polyval(coefficients, h), 1.0) if h > threshold else 1.0
  e = np.exp(beta * (x - x.max()))
  return e / e.sum()


def _ref_standardized(x, tau=1.0, eps=1e-7):
  x = np.asarray(x, np.float64)
  z = (x - x.mean()) / (tau * (x.std() + eps))
  e = np.exp(z - z.max())
  return e / e.sum()


def _ref_nap(x, eps=1e-8):
  x = np.asarray(x, np.float64)
  return (x - x.mean()) / np.sqrt(x.var() + eps)


def _ref_rows(ref, x, mask, **hp):
  """The formula on each row's visible entries; 0 elsewhere."""
  out = np.zeros(x.shape, np.float64)
  for i in range(x.shape[0]):
    if mask[i].any():
      out[i, mask[i]] = ref(x[i, mask[i]], **hp)
  return out


def _fd_vjp(ref, x, mask, ct, h=1e-6, **hp):
  """<ct, d ref / dx> by central differences in float64."""
  g = np.zeros(x.shape, np.float64)
  for idx in zip(*np.nonzero(mask), strict=True):
    xp, xm = x.copy(), x.copy()
    xp[idx] += h
    xm[idx] -= h
    g[idx] = np.sum(ct * (_ref_rows(ref, xp, mask, **hp) - _ref_rows(ref, xm, mask, **hp))) / (2 * h)
  return g


CASES = {
    "adaptive": (R.adaptive_temperature_softmax, _ref_adaptive,
                 [{}, {"threshold": 1.0}, {"coefficients": (1.0, 1.0)}]),
    "standardized": (R.standardized_softmax, _ref_standardized, [{}, {"tau": 0.5}]),
    "nap": (R.nap, _ref_nap, [{}, {"eps": 1e-2}]),
}


def _rows_mask():
  x, mask = helpers.rows_and_mask(3, (5, 9), 1.5, p=0.7)
  mask = np.asarray(mask).copy()
  mask[0] = True          # a full row
  mask[1] = False         # a fully masked row
  mask[2, :] = False
  mask[2, 4] = True       # one visible entry
  return np.asarray(x, np.float64), mask


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradient_match_float64_formula(case):
  fn, ref, settings = CASES[case]
  x, mask = _rows_mask()
  ct = np.random.default_rng(5).normal(size=x.shape)
  with jax.enable_x64(True):
    for hp in settings:
      got = fn(jnp.asarray(x), where=jnp.asarray(mask), **hp)
      assert got.dtype == jnp.float64
      np.testing.assert_allclose(got, _ref_rows(ref, x, mask, **hp), rtol=1e-10, atol=1e-12)
      g = jax.jit(jax.grad(  # one program rather than op by op
          lambda v, hp=hp: jnp.sum(fn(v, where=jnp.asarray(mask), **hp) * ct)))(jnp.asarray(x))
      np.testing.assert_allclose(g, _fd_vjp(ref, x, mask, ct, **hp), rtol=1e-5, atol=1e-7,
                                 err_msg=str(hp))
      assert np.all(np.asarray(g)[~mask] == 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_close_to_float32(case):
  fn = CASES[case][0]
  x, mask = _rows_mask()
  xb = jnp.asarray(x, jnp.bfloat16)
  got = fn(xb, where=jnp.asarray(mask))
  assert got.dtype == jnp.bfloat16
  want = _ref_rows(CASES[case][1], np.asarray(xb.astype(jnp.float32), np.float64), mask)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=1e-2)
  assert np.all(np.asarray(got)[~mask] == 0)


def test_adaptive_temperature_sharpens_dispersed_rows_only():
  # A needle among n equal entries (n = 16 and 256: masked columns are deleted ones):
  # softmax disperses as n grows, the adaptive one less.
  x = jnp.zeros((2, 256)).at[:, 0].set(2.0)
  where = jnp.arange(256)[None, :] < jnp.array([[16], [256]])
  ada = np.asarray(jax.jit(R.adaptive_temperature_softmax)(x, where=where), np.float64)
  for i, n in enumerate((16, 256)):
    row = np.asarray(x[i, :n], np.float64)
    p = np.exp(row) / np.exp(row).sum()
    beta = max(np.polyval(POLY, -(p * np.log(p)).sum()), 1.0)
    want = np.exp(beta * row) / np.exp(beta * row).sum()
    np.testing.assert_allclose(ada[i, :n], want, rtol=1e-5)
    assert beta > 1 and ada[i, 0] > p[0]
  # A confident row (H <= 0.5) is softmax itself, bit for bit.
  y = jnp.array([[6.0, 0.0, -1.0, 0.5]])
  assert float(R.softmax_entropy(y, y > -jnp.inf, 1)[1][0, 0]) < 0.5
  np.testing.assert_array_equal(R.adaptive_temperature_softmax(y),
                                R.adaptive_temperature_softmax(y, threshold=10.0))
  np.testing.assert_allclose(R.adaptive_temperature_softmax(y), jax.nn.softmax(y), rtol=1e-6)


def test_adaptive_temperature_never_raises_entropy():
  x = jnp.asarray(helpers.rows(8, (64, 12), 1.0))
  mask = x > -jnp.inf
  _, h0 = R.softmax_entropy(x, mask, 1)
  w = R.adaptive_temperature_softmax(x)
  h1 = -jnp.sum(w * jnp.log(w), axis=1, keepdims=True)
  assert np.all(np.asarray(h1) <= np.asarray(h0) + 1e-5)
  assert np.any(np.asarray(h1) < np.asarray(h0) - 1e-2)  # some rows were sharpened


def test_standardized_softmax_is_affine_invariant_and_a_temperature():
  x = jnp.asarray(helpers.rows(2, (4, 10), 2.0))
  f = jax.jit(R.standardized_softmax)
  w = f(x, tau=0.7)
  np.testing.assert_allclose(f(5.0 * x - 3.0, tau=0.7), w, rtol=2e-5, atol=1e-7)
  # softmax with the per-row temperature tau * (std + eps)
  t = 0.7 * (np.asarray(x, np.float64).std(-1, keepdims=True) + 1e-7)
  np.testing.assert_allclose(w, jax.nn.softmax(x / t), rtol=2e-5, atol=1e-7)
  # a constant row is uniform, with a finite gradient
  flat = jnp.full((1, 5), 3.0)
  np.testing.assert_allclose(R.standardized_softmax(flat), np.full((1, 5), 0.2), rtol=1e-6)
  g = jax.jit(jax.grad(lambda v: R.standardized_softmax(v)[0, 0]))(flat)
  assert np.all(np.isfinite(np.asarray(g)))


def test_nap_rows_have_mean_zero_rms_one_and_leave_the_simplex():
  x, mask = helpers.rows_and_mask(4, (6, 20), 3.0, p=0.8)
  w = np.asarray(R.nap(jnp.asarray(x), where=jnp.asarray(mask)), np.float64)
  for i in range(6):
    vis = w[i, mask[i]]
    if vis.size > 1:
      np.testing.assert_allclose(vis.mean(), 0.0, atol=1e-6)
      np.testing.assert_allclose(np.sqrt((vis ** 2).mean()), 1.0, rtol=1e-5)
  assert np.any(w < 0)
  # the output sum_j w_j v_j leaves the convex hull of one-hot values: a negative coordinate
  assert np.any(w @ np.eye(20) < 0)
  # one visible entry: 0 (its own mean), finite gradient
  one = R.nap(jnp.array([[1.0, 2.0]]), where=jnp.array([[False, True]]))
  np.testing.assert_array_equal(one, [[0.0, 0.0]])


@pytest.mark.parametrize("fn", [R.standardized_softmax, R.nap], ids=["standardized", "nap"])
def test_shift_by_1000_keeps_deviations(fn):
  # the row max is subtracted before the moments, so a far shift keeps float32 precision
  x = jnp.asarray(helpers.rows(6, (3, 16), 1.0))
  np.testing.assert_allclose(fn(x + 1000.0), fn(x), rtol=1e-4, atol=2e-5)


def test_bad_hyperparameters_raise_naming_them():
  x = jnp.ones((2, 3))
  helpers.check_raises(
      ("tau", lambda: R.standardized_softmax(x, tau=0.0)),
      ("eps", lambda: R.standardized_softmax(x, eps=-1.0)),
      ("eps", lambda: R.nap(x, eps=0.0)),
      ("threshold", lambda: R.adaptive_temperature_softmax(x, threshold=-0.1)),
      ("coefficients", lambda: R.adaptive_temperature_softmax(x, coefficients=())),
      ("tau", lambda: R.standardized_softmax(x, tau=jnp.ones((2, 3)))),
  )


# ----------------------------------------------------------------------- blockwise class R


ROW_RULES = sorted(name for name, spec in nz.REGISTRY.items() if spec.row_stats is not None)


def test_every_class_r_normalizer_has_a_blockwise_rule():
  assert {s.name for s in nz.REGISTRY.values() if s.kernel_class == "R"} == set(ROW_RULES)


ROW_DEFAULT = ("adaptive_temperature_softmax", "sa_softmax_normalized", "standardized_softmax")


@pytest.mark.parametrize("name", sampled(ROW_RULES, ROW_DEFAULT))
def test_blockwise_rule_matches_dense_values_and_gradients(name):
  """Statistics merged over uneven key blocks, then the second pass online (fused with V):
  equal to the dense normalizer times V, and so are the gradients in x and V."""
  spec = nz.get(name)
  rule = spec.row_stats
  x, mask = _rows_mask()
  x = jnp.asarray(x + 20.0, jnp.float32)  # away from 0: the merges keep their precision
  mask = jnp.asarray(mask)
  v = helpers.normal(9, (9, 3))
  blocks = (4, 1, 4)
  hp = {p.name: p.sample for p in spec.params if p.sample is not None}

  def blockwise(x, v):
    xs, vis, _ = c.prepare(x, -1, mask, "blockwise")
    derived = rule.over_blocks(xs, vis, c.visible_count(vis, -1, xs.dtype), blocks, **hp)
    return testing.evaluate_tile_rule_online(rule.second, x, v, blocks, where=mask, **hp,
                                             **derived)

  def dense(x, v):
    return spec.fn(x, where=mask, **hp) @ v

  helpers.assert_same(jax.jit(blockwise), jax.jit(dense), (x, v), fwd_tol=2e-5, bwd_tol=2e-4)


@pytest.mark.parametrize("name", sampled(ROW_RULES, ROW_DEFAULT))
def test_tangent_gives_the_derivative_of_the_merged_statistics(name):
  """Summed over the blocks, vjp(tangent) at the final statistics equals autodiff through
  the blockwise fold (block + merge), for every statistic."""
  rule = nz.get(name).row_stats
  x, mask = _rows_mask()
  x = jnp.asarray(x, jnp.float32)
  mask = jnp.asarray(mask)
  blocks = ((0, 4), (4, 5), (5, 9))

  def fold(x):
    stats = rule.init(x.shape[:-1] + (1,), x.dtype)
    for lo, hi in blocks:
      stats = rule.merge(stats, rule.block(x[:, lo:hi], mask[:, lo:hi]))
    return stats

  final = fold(x)
  cot = tuple(helpers.normal(20 + i, s.shape) for i, s in enumerate(final))
  _, vjp = jax.vjp(fold, x)
  want = jnp.where(mask, vjp(cot)[0], 0.0)
  parts = []
  for lo, hi in blocks:
    _, vjp_t = jax.vjp(lambda xb, lo=lo, hi=hi: rule.tangent(xb, mask[:, lo:hi], final),
                       x[:, lo:hi])
    parts.append(vjp_t(cot)[0])
  got = jnp.where(mask, jnp.concatenate(parts, axis=-1), 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


_SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jaxsoft as js

f = js.normalizers.adaptive_temperature_softmax
mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
x = jax.random.normal(jax.random.key(0), (4, 64)) * 0.3  # dispersed rows: beta > 1
x = x.at[0, 0].set(5.0)                                    # and a confident one
ct = jax.random.normal(jax.random.key(1), (4, 64))

def value_and_grad(v, c):
  out, vjp = jax.vjp(f, v)
  return out, vjp(c)[0]

want = jax.jit(value_and_grad)(x, ct)
xs, cs = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, ct))
with jax.set_mesh(mesh):
  explicit = jax.jit(value_and_grad)(xs, cs)
mapped = jax.jit(jax.shard_map(value_and_grad, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=(P("data"), P("data"))))(xs, cs)
for got in (explicit, mapped):
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
print("ok")
"""


def test_adaptive_temperature_batch_sharded_equals_unsharded():
  """Under an Explicit mesh and inside shard_map (its default checks), the batch sharded
  over 2 CPU devices: the values and the VJP equal the unsharded ones (the polynomial's
  loop carry was built without the input's sharding: "carry types differ")."""
  env = dict(os.environ, XLA_FLAGS=helpers.fake_device_flags(2),
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], capture_output=True,
                        text=True, env=env, cwd=root, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["ok"]
