"""Blockwise row statistics past float32's squares (issue 37: no silent wrong answer).

The class-R rules of ``nap`` and ``standardized_softmax`` merge per-block (count, mean,
M2) over key blocks. M2 was a plain sum of squared deviations: it overflowed once a
deviation passed ~1.8e19 (``d * d > 3.4e38``: nap became NaN, standardized softmax uniform)
and underflowed below ~1e-19 (a std of 0: standardized softmax one-hot), where the dense
functions, which scale the row by a power of two, are finite and right. The statistic now
carries M2 scaled by a power of two. References: numpy float64 formulas on the float32
inputs, and the dense functions' gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft import normalizers as nz
from jaxsoft import testing
from jaxsoft.attention import _chunked
from jaxsoft.normalizers import common as c
from tests import helpers
from tests.helpers import run_on_cpu_devices

S = 12
BLOCKS = (5, 3, 4)


def _rows():
  """Rows of very different magnitudes (``x = u * scale``, u of order 1, so gradients in u
  are of order 1 for every row) and a mask with a one-entry row."""
  rng = np.random.default_rng(37)
  u = rng.normal(size=(7, S))
  u[0] += 13.0                       # ordinary, away from 0
  u[3, :6] *= 1e5                    # two magnitudes in one row: 1e25 and 1e20
  u[5] = 3.0                         # constant row (std 0) at 3e30
  scale = np.array([1.0, 1e20, 1e30, 1e20, 1e-22, 1e30, 1e25])[:, None]
  mask = rng.uniform(size=u.shape) < 0.75
  mask[:, 0] = True
  mask[6] = False
  mask[6, 7] = True                  # one visible entry
  return u, scale, mask


def _ref_weights(name, x, mask, hp):
  """float64 weights of the visible entries from the paper's formula (0 elsewhere)."""
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  for i in range(x.shape[0]):
    v = x[i, mask[i]]
    d = v - v.mean()
    std = np.sqrt(np.mean(d * d))
    if name == "nap":
      w = d / np.sqrt(std * std + hp["eps"]) if v.size > 1 else np.zeros_like(v)
    else:
      z = d / (hp["tau"] * (std + hp["eps"])) if v.size > 1 else np.zeros_like(v)
      w = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    out[i, mask[i]] = w
  return out


# eps = 1e-30 lets the 1e-22 row's std (whose square underflows float32) decide its weights
HP = {"nap": {"eps": 1e-8}, "standardized_softmax": {"tau": 1.0, "eps": 1e-30}}


def _blockwise(name, mask, scale):
  """Statistics merged over BLOCKS, then the second pass online, fused with V."""
  rule = nz.get(name).row_stats

  def f(u, v):
    x = u * scale
    xs, vis, _ = c.prepare(x, -1, mask, "blockwise")
    derived = rule.over_blocks(xs, vis, c.visible_count(vis, -1, xs.dtype), BLOCKS,
                               **HP[name])
    return testing.evaluate_tile_rule_online(rule.second, x, v, BLOCKS, where=mask,
                                             **HP[name], **derived)

  return f


@pytest.mark.parametrize("name", ["standardized_softmax", pytest.param("nap",
                                                                      marks=pytest.mark.slow)])
def test_blockwise_rule_is_right_from_tiny_to_huge_rows(name):
  """Rows at 1e-22 .. 1e30 (and 1e25 next to 1e20 in one row): the merged statistics give
  the float64 formula's weights, and the gradients in u equal the dense function's
  evaluated in float64.

  Tolerances: the weights are O(1) functions of z-scores computed in float32 from ~12
  entries (a few dozen roundings of relative size 6e-8), so 2e-5; the gradient goes
  through the same z-scores, 2e-4 of the row's largest gradient entry (the package's
  other blockwise tests use 2e-4). Standardized softmax's constant row is left out of the
  gradient: its true gradient, 1 / (tau eps) = 1e30 times its scale 3e30, is past float32.
  """
  u, scale, mask = _rows()
  u32 = jnp.asarray(u, jnp.float32)
  scale32, mask_j = jnp.asarray(scale, jnp.float32), jnp.asarray(mask)
  v = jnp.eye(S)  # w @ v: the weights themselves
  blockwise = _blockwise(name, mask_j, scale32)
  got = jax.jit(blockwise)(u32, v)
  x32 = np.asarray(u32 * scale32, np.float64)  # the float32 inputs, exactly
  want = _ref_weights(name, x32, mask, HP[name])
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)

  ct = np.random.default_rng(1).normal(size=u.shape)
  grad = jax.jit(jax.grad(lambda u: jnp.sum(jnp.asarray(ct, jnp.float32) * blockwise(u, v))))
  got_g = np.asarray(grad(u32))
  with jax.enable_x64(True):
    u64 = jnp.asarray(np.asarray(u32), jnp.float64)
    s64 = jnp.asarray(np.asarray(scale32), jnp.float64)
    want_g = np.asarray(jax.jit(jax.grad(lambda u: jnp.sum(
        jnp.asarray(ct) * nz.get(name).fn(u * s64, where=mask_j, **HP[name]))))(u64))
  rows = [i for i in range(u.shape[0]) if not (name == "standardized_softmax" and i == 5)]
  for i in rows:
    bound = 2e-4 * max(1.0, np.abs(want_g[i]).max())
    assert np.abs(got_g[i] - want_g[i]).max() <= bound, (i, got_g[i], want_g[i])


def test_merged_moments_keep_ordinary_rows_tight():
  """No accuracy lost on ordinary rows (scores of order 1 to 100, shifted away from 0):
  the merged mean and std equal float64's to a few roundings, under uneven blockings,
  for float32 and float64 statistics (float32: ~40 entries, a few dozen roundings of
  6e-8; float64: of 1.1e-16)."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(16, 40)) * np.exp(rng.uniform(-2, 4, (16, 1))) + rng.uniform(-50, 50,
                                                                                    (16, 1))
  mask = rng.uniform(size=x.shape) < 0.8
  mask[:, 0] = True
  rule = nz.get("nap").row_stats
  for dtype, tol in ((jnp.float32, 2e-6), (jnp.float64, 1e-14)):
    with jax.enable_x64(dtype == jnp.float64):
      xj, mj = jnp.asarray(x, dtype), jnp.asarray(mask)
      xr = np.where(mask, np.asarray(xj, np.float64), np.nan)
      mean, std = np.nanmean(xr, -1), np.nanstd(xr, -1)
      for blocks in ((7, 13, 20), (16, 16, 8)):
        theta = jax.jit(lambda x, m, blocks=blocks: rule.over_blocks(
            x, m, c.visible_count(m, -1, x.dtype), blocks, eps=0.0))(xj, mj)
        np.testing.assert_allclose(np.asarray(theta["mu"])[:, 0], mean, rtol=0,
                                   atol=tol * np.nanmax(np.abs(xr)))
        np.testing.assert_allclose(np.asarray(theta["scale"])[:, 0], std, rtol=4 * tol)


def _attention(logits, name, implementation, **hp):
  """Attention whose logits are ``logits`` (zero q and k, the logits as a bias), with the
  identity as values: the output is the weight matrix."""
  t, s = logits.shape
  q, k = jnp.zeros((1, t, 1, 2)), jnp.zeros((1, s, 1, 2))
  v = jnp.eye(s)[None, :, None, :]
  out = js.attention.dot_product_attention(q, k, v, bias=logits[None, None],
                                           implementation=implementation, normalizer=name,
                                           normalizer_params=hp or None)
  return out[0, :, 0, :]


@pytest.mark.parametrize("name", ["nap", pytest.param("standardized_softmax",
                                                      marks=pytest.mark.slow)])
def test_chunked_attention_equals_float64_past_the_float32_square(name, monkeypatch):
  """implementation='xla_chunked' (key blocks of 4) on logits at 1e20 and 1e30 gives the
  float64 formula's weights (it gave NaN for nap and a uniform row for standardized
  softmax), and its gradient in the (unit-scaled) logits equals the dense path's."""
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)
  u, scale, mask = _rows()
  u, scale = u[:4], scale[:4]
  x = jnp.asarray(u * scale, jnp.float32)
  got = _attention(x, name, "xla_chunked")
  want = _ref_weights(name, np.asarray(x, np.float64), np.ones(x.shape, bool),
                      {"eps": nz.get(name).defaults["eps"], "tau": 1.0})
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  s32 = jnp.asarray(scale, jnp.float32)
  ct = helpers.normal(1, x.shape)

  def loss(impl):
    return jax.jit(jax.grad(lambda u: jnp.sum(ct * _attention(u * s32, name, impl))))

  u32 = jnp.asarray(u, jnp.float32)
  np.testing.assert_allclose(loss("xla_chunked")(u32), loss("xla")(u32), rtol=2e-4, atol=2e-4)


_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxsoft.attention import _chunked
from jaxsoft.attention.call import AttentionCall
import jaxsoft as js
import kernels_pallas

B, T, N, H = 2, 64, 1, 4
q, k, v = (jax.random.normal(key, (B, T, N, H)) for key in jax.random.split(jax.random.key(0), 3))
k = k.at[:, ::3].multiply(1e19)  # logits of order 1e19..1e20 on every third key
mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
data = NamedSharding(mesh, P("data"))
for impl in ("chunked", "pallas"):
  for name in ("nap", "standardized_softmax"):
    def attend(q, k, v):
      if impl == "pallas":
        return kernels_pallas.attention(q, k, v, normalizer=name, backend="triton",
                                        interpret=True, block_sizes={"block_q": 32, "block_k": 32})
      call = AttentionCall.create(q, k, v, normalizer=name)
      return _chunked.chunked_attention(call, block_q=32, block_k=32)

    def forward_and_grad(q, k, v):
      out, vjp = jax.vjp(attend, q, k, v)
      return (out, *vjp(jnp.cos(out)))

    want = jax.jit(forward_and_grad)(q, k, v)
    out_dense = js.attention.dot_product_attention(q, k, v, implementation="xla",
                                                   normalizer=name)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in want), (impl, name)
    np.testing.assert_allclose(want[0], out_dense, rtol=1e-4, atol=1e-4, err_msg=f"{impl} {name}")
    qs, ks, vs = (jax.device_put(a, data) for a in (q, k, v))
    with jax.set_mesh(mesh):
      spec = (P("data"),) * 4
      got = jax.jit(jax.shard_map(forward_and_grad, in_specs=spec[:3], out_specs=spec))(qs, ks, vs)
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{impl} {name}")
    print("ok", impl, name)
"""


@pytest.mark.slow
def test_blockwise_nap_and_standardized_inside_shard_map_on_huge_logits():
  """Inside ``jax.shard_map`` (default check_vma, 2 CPU devices, one subprocess): the
  chunked and the Pallas (interpret) class-R paths run with the statistic's carries typed
  by the drivers, are finite on logits of order 1e20, equal the dense forward and equal
  the unsharded forward and gradients."""
  proc = run_on_cpu_devices(_SCRIPT, 2)
  assert proc.stdout.split().count("ok") == 4, proc.stdout


def _ref_spherical(x, eps):
  x = np.asarray(x, np.float64)
  num = x * x + eps
  return num / num.sum(-1, keepdims=True)


def _ref_taylor(x, order):
  x = np.asarray(x, np.float64)
  num = sum(x ** j / np.prod(np.arange(1, j + 1, dtype=np.float64)) for j in range(order + 1))
  return num / num.sum(-1, keepdims=True)


@pytest.mark.parametrize("name", ["spherical_softmax", "taylor_softmax"])
def test_class_s_tile_rule_past_the_float32_square(name):
  """The tile rules of spherical and Taylor softmax (what the chunked and Pallas paths
  run), online over key blocks: finite and equal to the float64 formula on rows whose
  squares or whose row sum pass float32's range (1e20; 16 keys at 1e19, each square
  finite: the sum overflowed and every weight came out 0), and on an ordinary row.
  Tolerance: a handful of float32 roundings per weight, 1e-5."""
  rng = np.random.default_rng(11)
  x = np.stack([rng.normal(size=16) * 1e20, np.full(16, 1e19) * (1 + 0.1 * rng.normal(size=16)),
                rng.normal(size=16) * 3.0, rng.normal(size=16) * 1e25])
  x32 = jnp.asarray(x, jnp.float32)
  hp = {"eps": 0.01} if name == "spherical_softmax" else {"order": 2}
  got = testing.evaluate_tile_rule_online(nz.get(name), x32, jnp.eye(16), (5, 7, 4), **hp)
  x64 = np.asarray(x32, np.float64)
  want = _ref_spherical(x64, 0.01) if name == "spherical_softmax" else _ref_taylor(x64, 2)
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7)
