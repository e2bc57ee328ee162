"""N42 sinusoid and step output activations against tests/reference_f64.py (float64 numpy),
their closed-form derivatives, the straight-through surrogate and the tile rule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import normalizers as N
from jaxsoft import testing
from tests import reference_f64 as ref64
from tests.helpers import check_raises

NAMES = ("sinusoid", "step", "step_straight_through")


def _x():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 9)) * 2.0
  x[0, 2] = 0.0          # the step's tie: 1/2
  x[1, 3] = np.inf       # +inf: 1
  x[2, 4] = -np.inf      # -inf: masked
  x[3, :2] = (-math.pi / 2 - 0.3, math.pi / 2 + 0.3)  # past the clip points
  where = rng.random((4, 9)) < 0.8
  where[:, 0] = True
  return x.astype(np.float32), where


HP = {"sinusoid": [{}, {"levels": 4}, {"levels": 3, "theta": 0.5}],
      "step": [{}, {"threshold": 0.5}], "step_straight_through": [{"threshold": -0.25}]}


def test_values_against_float64_reference_with_masks_and_infinities():
  x, where = _x()
  cases = [(n, hp) for n in NAMES for hp in HP[n]]

  @jax.jit
  def f(x):
    return [N.get(n).fn(x, where=where, **hp) for n, hp in cases]

  for (name, hp), got in zip(cases, f(jnp.asarray(x)), strict=True):
    want = ref64.normalizer(name, x, where, **hp)
    # float32: sin and a few operations, each 2^-24 relative, on values <= 1
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{name} {hp}")
    assert np.all(np.asarray(got)[~where] == 0) and np.all(np.asarray(got) >= 0)
  # NaN rule: a visible NaN makes its row's visible entries NaN
  out = np.asarray(jax.jit(N.sinusoid)(jnp.array([[0.0, jnp.nan, 1.0], [0.0, 1.0, 2.0]])))
  assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def test_gradients_closed_forms():
  x, where = _x()
  x = np.where(np.isfinite(x), x, 0.0).astype(np.float32)
  x[0, 2] = 0.1  # the derivative of H at its jump is not asked for
  t = jnp.full((4, 1), 0.25)

  @jax.jit
  def f(x, t):
    g = lambda fn: jax.grad(lambda v: jnp.sum(fn(v)))(x)  # noqa: E731
    return dict(
        sin=g(lambda v: N.sinusoid(v, where=where)),
        stair=g(lambda v: N.sinusoid(v, where=where, levels=4, theta=0.7)),
        hard=g(lambda v: N.step(v, where=where)),
        st=g(lambda v: N.step(v, where=where, threshold=t, straight_through=True)),
        st_t=jax.grad(lambda s: jnp.sum(N.step(x, where=where, threshold=s,
                                               straight_through=True)))(t),
        theta=jax.grad(lambda th: jnp.sum(N.sinusoid(x, levels=4, theta=th)))(0.7))

  got = f(jnp.asarray(x), t)
  x64 = np.asarray(x, np.float64)
  inside = np.abs(x64) < np.pi / 2
  du = np.where(inside, 0.5 * np.cos(x64), 0.0)
  u = 0.5 * (1 + np.sin(np.clip(x64, -np.pi / 2, np.pi / 2)))
  sig = 1.0 / (1.0 + np.exp(-(x64 - 0.25)))
  # float32: cos and a product, ~1e-7 relative
  np.testing.assert_allclose(got["sin"], np.where(where, du, 0.0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["stair"], np.where(where, du * (1 - 0.7 * np.cos(8 * np.pi * u)),
                                                    0.0), rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got["hard"]) == 0)  # the hard step: zero gradient
  np.testing.assert_allclose(got["st"], np.where(where, sig * (1 - sig), 0.0), rtol=1e-5,
                             atol=1e-7)
  np.testing.assert_allclose(got["st_t"][:, 0], -np.sum(np.where(where, sig * (1 - sig), 0.0),
                                                        -1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["theta"], -np.sum(np.sin(8 * np.pi * u) / (8 * np.pi)),
                             rtol=1e-4, atol=1e-6)


def test_shape_properties_staircase_levels_and_symmetry():
  z = jnp.linspace(-3.0, 3.0, 2001)

  @jax.jit
  def f(z):
    levels = jnp.arange(5) / 4.0                        # u at the annotator fractions
    z_at = jnp.arcsin(2 * levels - 1)                  # the scores where u = k/4
    stair = lambda v: N.sinusoid(v, levels=4)  # noqa: E731
    return dict(sin=N.sinusoid(z), neg=N.sinusoid(-z), stair=stair(z), at=stair(z_at),
                slope=jax.grad(lambda v: stair(v).sum())(z_at[1:-1]),  # pointwise
                vm=jax.vmap(lambda r: N.sinusoid(r, levels=4))(z.reshape(3, -1)[:, :667]),
                step=N.step(z), st=N.get("step_straight_through").fn(z))

  got = {k: np.asarray(v, np.float64) for k, v in f(z).items()}
  for k in ("sin", "stair", "step"):
    assert np.all(np.diff(got[k]) >= -1e-7), k          # non-decreasing (float32 rounding)
    assert got[k].min() >= 0 and got[k].max() <= 1 + 1e-7, k
  np.testing.assert_allclose(got["sin"] + got["neg"], 1.0, atol=1e-6)  # u(-x) = 1 - u(x)
  np.testing.assert_allclose(got["at"], np.arange(5) / 4.0, atol=2e-6)  # fixed points k/a
  np.testing.assert_allclose(got["slope"], 0.0, atol=1e-5)              # flat there (θ = 1)
  np.testing.assert_allclose(got["vm"], got["stair"][:2001 // 3 * 3].reshape(3, -1)[:, :667],
                             rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(got["st"], got["step"])  # straight-through: same values
  assert got["sin"][0] == 0 and got["sin"][-1] == 1     # exact at the clip points


@pytest.mark.parametrize("name", NAMES)
def test_tile_rule_and_low_precision(name):
  x, where = _x()
  x = np.where(np.isfinite(x), x, 1.0).astype(np.float32)
  spec = N.get(name)
  hp = HP[name][-1]
  cot = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)

  @jax.jit
  def f(x):
    w_rule, vjp_rule = jax.vjp(lambda v: testing.evaluate_tile_rule(spec, v, where=where, **hp),
                               x)
    w_fn, vjp_fn = jax.vjp(lambda v: spec.fn(v, where=where, **hp), x)
    return w_rule, w_fn, vjp_rule(cot)[0], vjp_fn(cot)[0], spec.fn(x.astype(jnp.bfloat16),
                                                                  where=where, **hp)

  w_rule, w_fn, g_rule, g_fn, lo = f(jnp.asarray(x))
  np.testing.assert_allclose(w_rule, w_fn, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(g_rule, g_fn, rtol=1e-5, atol=1e-6)
  # bf16: the rounded input's float64 reference, the output rounded to 8 bits (2^-9)
  assert lo.dtype == jnp.bfloat16
  xb = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
  np.testing.assert_allclose(np.asarray(lo, np.float32), ref64.normalizer(name, xb, where, **hp),
                             rtol=0, atol=4e-3)


def test_float64_stays_float64_values_and_gradients():
  """Under x64, float64 rows are computed in float64: the values against the float64
  reference and the staircase's derivative u' (1 - theta cos(2 pi a u)) to 1e-14 (float64
  sin / cos of arguments up to 6 pi, a few ulps each; float32 arithmetic would miss both by
  ~1e-7)."""
  x, where = _x()
  x = np.where(np.isfinite(x), x, 0.5).astype(np.float64)
  x[0, 2] = 0.1  # off the step's jump
  with jax.enable_x64(True):
    x64 = jnp.asarray(x)

    @jax.jit
    def f(x):
      outs = [N.get(n).fn(x, where=where, **hp) for n, hp in (
          ("sinusoid", {"levels": 3, "theta": 0.5}), ("step", {"threshold": 0.5}),
          ("step_straight_through", {}))]
      g = jax.grad(lambda v: jnp.sum(N.sinusoid(v, where=where, levels=3, theta=0.5)))(x)
      return outs, g

    (stair, hard, st), g = f(x64)
    assert {a.dtype for a in (stair, hard, st, g)} == {jnp.dtype(jnp.float64)}
  np.testing.assert_allclose(stair, ref64.normalizer("sinusoid", x, where, levels=3, theta=0.5),
                             rtol=0, atol=1e-14)
  np.testing.assert_array_equal(hard, ref64.normalizer("step", x, where, threshold=0.5))
  np.testing.assert_array_equal(st, ref64.normalizer("step_straight_through", x, where))
  u = 0.5 * (1 + np.sin(np.clip(x, -np.pi / 2, np.pi / 2)))
  du = np.where(np.abs(x) < np.pi / 2, 0.5 * np.cos(x), 0.0)
  np.testing.assert_allclose(g, np.where(where, du * (1 - 0.5 * np.cos(6 * np.pi * u)), 0.0),
                             rtol=0, atol=1e-14)


def test_registration_and_bad_inputs():
  for name in NAMES:
    spec = N.get(name)
    assert (spec.kernel_class, spec.catalogue_id, spec.sums_to_one) == ("P", "N42", False)
  x = jnp.zeros((2, 3))
  check_raises(
      ("`levels`", lambda: N.sinusoid(x, levels=0)),
      ("`levels`", lambda: N.sinusoid(x, levels=2.5)),
      ("`theta`", lambda: N.sinusoid(x, levels=2, theta=1.5)),
      ("`threshold`", lambda: N.step(x, threshold=float("nan"))),
      ("`straight_through`", lambda: N.step(x, straight_through="yes")),
      ("`axis`", lambda: N.step(x, axis=2)),
      ("`where`", lambda: N.sinusoid(x, where=jnp.ones((4,), bool))),
  )
