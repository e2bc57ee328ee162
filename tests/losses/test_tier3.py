"""L17 tier-3 losses against float64 numpy references written from the formulas, with
gradients (check_grads in float64), masks, bf16 inputs, extreme inputs and bad input."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxsoft as js
from jaxsoft.losses import _tier3_metric
from tests.helpers import check_raises, rows

# jitted, so a test compiles a few programs instead of dispatching op by op
_STATIC = {
    "continual_cross_entropy": ("mode", "axis", "ignore_index"),
    "dice_semimetric_loss": ("axis",),
    "midam_auc_loss": ("margin",),
    "attention_entropy_penalty": ("tolerance",),
    "soft_msm": ("cost", "divergence"),
    "wcdas_loss": ("ignore_index",),
    "orthogonal_projection_loss": ("gamma",),
    "nbc_softmax_loss": ("weight", "block_size"),
    "pmrl_loss": (),
    "wrapped_cauchy_log_density": (),
    "fourier_head_cross_entropy": ("num_bins", "gamma"),
}
L = types.SimpleNamespace(**{name: jax.jit(getattr(js.losses, name), static_argnames=static)
                             for name, static in _STATIC.items()})


def _np_ce(z, y):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  return lse - np.take_along_axis(z, np.asarray(y)[..., None], -1)[..., 0]


def _np_softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _grads64(f, *args):
  with jax.enable_x64(True):
    check_grads(jax.jit(f), tuple(jnp.asarray(np.asarray(a, np.float64)) for a in args),
                order=1, modes=("rev",), atol=1e-5, rtol=1e-5, eps=1e-6)


# ------------------------------------------------------------------- continual learning CE


def test_continual_cross_entropy_against_reference_and_gradients():
  z = np.asarray(rows(0, (4, 6), 2.0), np.float64)
  y = np.array([1, 2, 4, 5])
  cur = np.array([False, True, True, False, True, True])
  zc = np.where(cur, z, -np.inf)
  p_mask = _np_softmax(zc)
  onehot = np.eye(6)[y]
  got, g = jax.value_and_grad(lambda a: L.continual_cross_entropy(a, y, cur).sum())(
      jnp.asarray(z, jnp.float32))
  np.testing.assert_allclose(got, _np_ce(zc, y).sum(), rtol=1e-5)
  np.testing.assert_allclose(g, np.where(cur, p_mask - onehot, 0.0), atol=1e-6)
  got, g = jax.value_and_grad(
      lambda a: L.continual_cross_entropy(a, y, cur, mode="stop_gradient").sum())(
          jnp.asarray(z, jnp.float32))
  np.testing.assert_allclose(got, _np_ce(z, y).sum(), rtol=1e-5)
  np.testing.assert_allclose(g, np.where(cur, _np_softmax(z) - onehot, 0.0), atol=1e-6)
  assert np.all(np.asarray(g)[:, ~cur] == 0.0), "old logits get exactly zero gradient"


def test_continual_cross_entropy_edges():
  z = rows(1, (3, 4))
  y = jnp.array([0, 1, 3])
  full = optax.softmax_cross_entropy_with_integer_labels(z, y)
  for mode in ("mask", "stop_gradient"):
    np.testing.assert_allclose(L.continual_cross_entropy(z, y, jnp.ones(4, bool), mode=mode),
                               full, rtol=1e-6)
    out = L.continual_cross_entropy(z, y, jnp.array([True, True, True, False]), mode=mode,
                                    where=jnp.array([True, False, True]))
    assert out[1] == 0.0
  # a label on a masked class: +inf (mask) or an ordinary loss (stop-gradient)
  cur = jnp.array([True, True, True, False])
  assert np.isinf(L.continual_cross_entropy(z, y, cur)[2])
  assert np.isfinite(L.continual_cross_entropy(z, y, cur, mode="stop_gradient")[2])
  big = jnp.array([[1e4, -1e4, -jnp.inf, 0.0]], jnp.bfloat16)
  for mode in ("mask", "stop_gradient"):
    val, g = jax.value_and_grad(lambda a, mode=mode: L.continual_cross_entropy(
        a, jnp.array([1]), cur, mode=mode).sum())(big)
    assert val.dtype == jnp.bfloat16 and np.isfinite(float(val))
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  check_raises(
      ("mode", lambda: js.losses.continual_cross_entropy(z, y, cur, mode="freeze")),
      ("current_classes", lambda: js.losses.continual_cross_entropy(z, y, jnp.ones(4))),
      ("current_classes", lambda: js.losses.continual_cross_entropy(z, y, jnp.ones(5, bool))))


# ---------------------------------------------------------------------------- Dice semimetric


def _np_dml(x, y, axis=-1):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return np.abs(x - y).sum(axis) / (np.abs(x).sum(axis) + np.abs(y).sum(axis))


def test_dice_semimetric_reference_properties_and_gradient():
  rng = np.random.default_rng(0)
  x = rng.random((3, 2, 5))
  y = rng.random((3, 2, 5))
  got = L.dice_semimetric_loss(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32),
                               axis=(1, 2))
  np.testing.assert_allclose(got, _np_dml(x, y, (1, 2)), rtol=1e-5)
  np.testing.assert_allclose(got, L.dice_semimetric_loss(y, x, axis=(1, 2)), rtol=1e-6)
  hard = (rng.random((3, 2, 5)) < 0.5).astype(np.float64)
  sdl = 1 - 2 * (x * hard).sum((1, 2)) / (x.sum((1, 2)) + hard.sum((1, 2)))
  np.testing.assert_allclose(L.dice_semimetric_loss(x, hard, axis=(1, 2)), sdl, rtol=1e-5)
  half = jnp.full((4,), 0.5)
  assert float(L.dice_semimetric_loss(half, half)) == 0.0  # soft Dice would give 0.5
  assert np.all((np.asarray(got) >= 0) & (np.asarray(got) <= 1))
  _grads64(lambda a, b: L.dice_semimetric_loss(a, b, axis=(1, 2)), x, y)
  g = jax.grad(lambda a: L.dice_semimetric_loss(a, a * 1.0).sum())(jnp.asarray(x))
  assert np.all(np.isfinite(g))


def test_dice_semimetric_masks_dtypes_and_errors():
  x = jnp.array([[0.2, 0.9, 0.4], [0.0, 0.0, 0.0]])
  y = jnp.array([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
  keep = jnp.array([True, True, False])
  np.testing.assert_allclose(L.dice_semimetric_loss(x, y, where=keep)[0],
                             _np_dml(x[0, :2], y[0, :2]), rtol=1e-6)
  assert float(L.dice_semimetric_loss(x, y)[1]) == 0.0  # empty pair
  out = L.dice_semimetric_loss(x.astype(jnp.bfloat16), y.astype(jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  with np.errstate(invalid="ignore"):
    want = np.nan_to_num(_np_dml(x, y))  # the empty pair: 0 / 0 -> 0
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=1e-2)
  check_raises(("targets", lambda: js.losses.dice_semimetric_loss(x, y[:, :2])),
               ("axis", lambda: js.losses.dice_semimetric_loss(x, y, axis=3)),
               ("axis", lambda: js.losses.dice_semimetric_loss(x, y, axis=(1, -1))))


# ----------------------------------------------------------------------------------- MIDAM


def _np_midam(h, labels, tau, margin, inst=None):
  h = np.asarray(h, np.float64)
  inst = np.ones(h.shape, bool) if inst is None else np.asarray(inst)
  s = np.array([tau * np.log(np.mean(np.exp(r[k] / tau))) for r, k in zip(h, inst, strict=True)])
  pos, neg = s[np.asarray(labels) == 1], s[np.asarray(labels) == 0]
  return np.mean((margin - (pos[:, None] - neg[None, :])) ** 2)


def test_midam_against_reference_gradient_and_masks():
  h = np.asarray(rows(2, (5, 4), 1.5), np.float64)
  lab = np.array([1, 0, 1, 0, 0])
  inst = np.ones((5, 4), bool)
  inst[1, 2:] = False
  got = L.midam_auc_loss(jnp.asarray(h, jnp.float32), lab, temperature=0.7, margin=0.5,
                         where=inst)
  np.testing.assert_allclose(got, _np_midam(h, lab, 0.7, 0.5, inst), rtol=1e-5)
  _grads64(lambda a: L.midam_auc_loss(a, lab, temperature=0.7, where=inst), h)
  # a masked bag is left out (as if deleted)
  bw = np.array([True, True, True, False, True])
  np.testing.assert_allclose(
      L.midam_auc_loss(h, lab, bag_where=bw),
      L.midam_auc_loss(h[bw], lab[bw]), rtol=1e-6)
  # shift invariance; no negative bag gives 0 with zero gradient
  np.testing.assert_allclose(L.midam_auc_loss(h + 3.0, lab), L.midam_auc_loss(h, lab), rtol=1e-5)
  v, g = jax.value_and_grad(lambda a: L.midam_auc_loss(a, jnp.ones(5, int)))(jnp.asarray(h))
  assert float(v) == 0.0 and not np.any(np.asarray(g))


def test_midam_extremes_bf16_and_errors():
  h = jnp.array([[1e4, -1e4], [-1e4, 3.0]], jnp.bfloat16)
  v, g = jax.value_and_grad(lambda a: L.midam_auc_loss(a, jnp.array([1, 0]), temperature=0.01))(h)
  assert np.isfinite(float(v)) and np.all(np.isfinite(np.asarray(g, np.float32)))
  check_raises(
      ("instance_scores", lambda: js.losses.midam_auc_loss(jnp.ones(3), jnp.ones(3, int))),
      ("bag_labels", lambda: js.losses.midam_auc_loss(jnp.ones((3, 2)), jnp.ones(2, int))),
      ("bag_labels", lambda: js.losses.midam_auc_loss(jnp.ones((3, 2)), jnp.ones(3))),
      ("temperature", lambda: js.losses.midam_auc_loss(jnp.ones((3, 2)), jnp.ones(3, int),
                                               temperature=0.0)),
      ("margin", lambda: js.losses.midam_auc_loss(jnp.ones((3, 2)), jnp.ones(3, int), margin=-1.0)))


# -------------------------------------------------------------------- AERO entropy penalty


def _np_aero(a, theta, gamma):
  a = np.asarray(a, np.float64)
  ent = -np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1)), 0), -1).mean(-1)
  e_max = np.log(a.shape[-1])
  d = np.abs(ent - theta * e_max)
  return np.where(d > gamma * e_max, d, 0.0)


def test_attention_entropy_penalty_reference_and_gradients():
  a = np.asarray(jax.nn.softmax(rows(3, (2, 3, 4, 5), 2.0), -1), np.float64)
  theta = np.array([0.2, 0.6, 0.95])
  got = L.attention_entropy_penalty(jnp.asarray(a, jnp.float32), theta, tolerance=0.1)
  want = _np_aero(a, theta, 0.1)
  # no head within 1e-3 of the band's edge (where the finite differences would jump)
  ent = -np.sum(a * np.log(a), -1).mean(-1)
  assert np.all(np.abs(np.abs(ent - theta * np.log(5)) - 0.1 * np.log(5)) > 1e-3)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.any(want == 0) and np.any(want > 0), "both sides of the band are exercised"
  g_theta = jax.grad(lambda t: L.attention_entropy_penalty(
      jnp.asarray(a, jnp.float32), t, tolerance=0.1).sum())(jnp.asarray(theta, jnp.float32))
  sign = np.sign(ent - theta * np.log(5))
  np.testing.assert_allclose(g_theta, np.sum(np.where(want > 0, -sign * np.log(5), 0), 0),
                             rtol=1e-5)
  _grads64(lambda p: L.attention_entropy_penalty(p, theta, tolerance=0.1), a)


def test_attention_entropy_penalty_edges():
  eye = jnp.eye(4)[None, None]  # one-hot rows: entropy 0
  uni = jnp.full((1, 1, 4, 4), 0.25)
  assert float(L.attention_entropy_penalty(eye, 0.0, tolerance=0.0)[0, 0]) == 0.0
  np.testing.assert_allclose(L.attention_entropy_penalty(uni, 0.0, tolerance=0.5)[0, 0],
                             math.log(4), rtol=1e-6)
  g = jax.grad(lambda p: L.attention_entropy_penalty(p, 0.5, tolerance=0.1).sum())(eye)
  assert np.all(np.isfinite(g))
  # masked keys: a causal mask leaves each row its own keys; fully masked rows drop out
  causal = jnp.tril(jnp.ones((4, 4), bool))
  w = jnp.where(causal, 1.0 / jnp.arange(1, 5)[:, None], 0.0)[None, None]
  got = L.attention_entropy_penalty(w, 0.0, tolerance=0.0, where=causal)[0, 0]
  np.testing.assert_allclose(got, np.mean(np.log(np.arange(1, 5))), rtol=1e-6)
  out = L.attention_entropy_penalty(uni.astype(jnp.bfloat16), 0.0, tolerance=0.5)
  np.testing.assert_allclose(out[0, 0], math.log(4), rtol=1e-2)
  check_raises(
      ("probs", lambda: js.losses.attention_entropy_penalty(jnp.ones((4, 4)), 0.5)),
      ("tolerance", lambda: js.losses.attention_entropy_penalty(uni, 0.5, tolerance=-0.1)),
      ("threshold", lambda: js.losses.attention_entropy_penalty(jnp.full((1, 2, 4, 4), 0.25),
                                                        jnp.ones(3))))


# -------------------------------------------------------------------------------- Soft-MSM


def _np_softmin(u, gamma):
  u = np.asarray(u, np.float64)
  if gamma == 0:
    return u.min()
  m = u.min()
  return m - gamma * np.log(np.sum(np.exp(-(u - m) / gamma)))


def _np_msm(x, y, gamma, c, kappa):
  """The Soft-MSM recursion written out with loops; gamma = 0, kappa = inf is hard MSM."""
  def cost(a, b, cc):
    if kappa == np.inf:
      return c if min(b, cc) <= a <= max(b, cc) else c + min(abs(a - b), abs(a - cc))
    gate = 1 / (1 + np.exp(-kappa * (a - b) * (cc - a)))
    return c + (1 - gate) * _np_softmin([abs(a - b), abs(a - cc)], gamma)
  n, m = len(x), len(y)
  d = np.full((n, m), np.inf)
  for i in range(n):
    for j in range(m):
      if i == 0 and j == 0:
        d[i, j] = abs(x[0] - y[0])
        continue
      opts = []
      if i > 0 and j > 0:
        opts.append(d[i - 1, j - 1] + abs(x[i] - y[j]))
      if i > 0:
        opts.append(d[i - 1, j] + cost(x[i], x[i - 1], y[j]))
      if j > 0:
        opts.append(d[i, j - 1] + cost(y[j], x[i], y[j - 1]))
      d[i, j] = _np_softmin(opts, gamma)
  return d[-1, -1]


def test_soft_msm_against_references():
  rng = np.random.default_rng(4)
  x, y = rng.normal(size=4), rng.normal(size=3)
  got = L.soft_msm(jnp.asarray(x), jnp.asarray(y), gamma=0.3, cost=0.5, gate_sharpness=2.0)
  np.testing.assert_allclose(got, _np_msm(x, y, 0.3, 0.5, 2.0), rtol=1e-5)
  hard = _np_msm(x, y, 0.0, 0.5, np.inf)
  near = L.soft_msm(jnp.asarray(x), jnp.asarray(y), gamma=1e-3, cost=0.5, gate_sharpness=1e5)
  np.testing.assert_allclose(near, hard, atol=1e-2)
  # each soft-min is at most the min: a softer gamma gives a smaller value
  assert float(L.soft_msm(x, y, gamma=1.0)) < float(L.soft_msm(x, y, gamma=0.1))
  div = L.soft_msm(jnp.asarray(np.stack([x, x + 1])), jnp.asarray(x), divergence=True)
  assert abs(float(div[0])) < 1e-5 and float(div[1]) > 0
  # broadcasting of the leading axes
  assert L.soft_msm(jnp.ones((2, 1, 4)), jnp.ones((3, 5))).shape == (2, 3)


def test_soft_msm_gradients_and_errors():
  rng = np.random.default_rng(5)
  _grads64(lambda a, b: L.soft_msm(a, b, gamma=0.5, gate_sharpness=3.0), rng.normal(size=3),
           rng.normal(size=4))
  g = jax.grad(lambda a: L.soft_msm(a, a, gamma=0.1, divergence=True))(jnp.array([0.0, 1e3, -1e3]))
  assert np.all(np.isfinite(g))
  out = L.soft_msm(jnp.array([0.0, 1.0], jnp.bfloat16), jnp.array([0.5], jnp.bfloat16))
  assert out.dtype == jnp.float32 and np.isfinite(float(out))
  check_raises(("`x`", lambda: js.losses.soft_msm(jnp.ones(0), jnp.ones(3))),
               ("`y`", lambda: js.losses.soft_msm(jnp.ones(2), jnp.ones(3, int))),
               ("gamma", lambda: js.losses.soft_msm(jnp.ones(2), jnp.ones(3), gamma=0.0)),
               ("cost", lambda: js.losses.soft_msm(jnp.ones(2), jnp.ones(3), cost=-1.0)),
               ("broadcast", lambda: js.losses.soft_msm(jnp.ones((2, 2)), jnp.ones((3, 3)))))


# ----------------------------------------------------------------------------------- WCDAS


def _np_wcdas(x, w, labels, rho, scale):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  if w.ndim == 2:
    w = w[..., None]
  xh = x / np.linalg.norm(x, axis=-1, keepdims=True)
  wh = w / np.linalg.norm(w, axis=0, keepdims=True)
  theta = np.arccos(np.clip(np.einsum("bd,dck->bck", xh, wh), -1, 1))
  r = np.asarray(rho, np.float64)[:, None]
  dens = (1 - r ** 2) / (2 * np.pi * (1 + r ** 2 - 2 * r * np.cos(theta)))
  logits = scale * np.log(2 * np.pi * dens.mean(-1))
  return _np_ce(logits, labels)


def test_wrapped_cauchy_density_integrates_to_one():
  t = np.linspace(0, 2 * np.pi, 4001)
  for rho in (0.0, 0.5, 0.95):
    p = np.exp(np.asarray(L.wrapped_cauchy_log_density(jnp.asarray(t), rho, 0.3), np.float64))
    assert abs(np.trapezoid(p, t) - 1) < 1e-3
  np.testing.assert_allclose(np.exp(L.wrapped_cauchy_log_density(t[:5], 0.0)), 1 / (2 * np.pi),
                             rtol=1e-6)


@pytest.mark.parametrize("kernels", [pytest.param(None, marks=pytest.mark.slow), 3])
def test_wcdas_against_reference_and_gradients(kernels):
  x = np.asarray(rows(6, (4, 3)), np.float64)
  w = np.asarray(rows(7, (3, 5) if kernels is None else (3, 5, kernels)), np.float64)
  y = np.array([0, 4, 2, 2])
  rho = np.array([0.1, 0.5, 0.7, 0.9, 0.3])
  got = L.wcdas_loss(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), y, rho, scale=2.0)
  np.testing.assert_allclose(got, _np_wcdas(x, w, y, rho, 2.0), rtol=1e-4)
  _grads64(lambda a, b, r: L.wcdas_loss(a, b, y, r, scale=2.0), x, w, rho)


def test_wcdas_edges():
  x, w = rows(8, (3, 4)), rows(9, (4, 5))
  y = jnp.array([0, 1, 4])
  np.testing.assert_allclose(L.wcdas_loss(x, w, y, 0.0), np.full(3, math.log(5)), rtol=1e-6)
  out = L.wcdas_loss(x, w, y, jnp.full(5, 0.5), where=jnp.array([True, False, True]),
                     ignore_index=4)
  assert float(out[1]) == 0.0 and float(out[2]) == 0.0
  v, g = jax.value_and_grad(lambda a: L.wcdas_loss(a, w, y, 0.999, scale=30.0).sum())(x * 1e30)
  assert np.isfinite(float(v)) and np.all(np.isfinite(g))
  bf = L.wcdas_loss(x.astype(jnp.bfloat16), w, y, 0.5)
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf, np.float32), L.wcdas_loss(x, w, y, 0.5), rtol=2e-2)
  check_raises(("class_weights", lambda: js.losses.wcdas_loss(x, jnp.ones(4), y, 0.5)),
               ("concentration", lambda: js.losses.wcdas_loss(x, w, y, jnp.ones(3) * 0.5)),
               ("concentration", lambda: js.losses.wcdas_loss(x, w, y, 1.0)),
               ("concentration", lambda: js.losses.wcdas_loss(x, w, y, -0.1)),
               ("labels", lambda: js.losses.wcdas_loss(x, w, y[:2], 0.5)),
               ("scale", lambda: js.losses.wcdas_loss(x, w, y, 0.5, scale=-1.0)))


# ------------------------------------------------------------------------------------- OPL


def _np_opl(f, y, gamma):
  f = np.asarray(f, np.float64)
  fh = f / np.linalg.norm(f, axis=-1, keepdims=True)
  cos = fh @ fh.T
  n = len(y)
  same = [cos[i, j] for i in range(n) for j in range(n) if i != j and y[i] == y[j]]
  diff = [cos[i, j] for i in range(n) for j in range(n) if y[i] != y[j]]
  return (1 - np.mean(same)) + gamma * abs(np.mean(diff))


def test_orthogonal_projection_loss():
  f = np.asarray(rows(10, (6, 4)), np.float64)
  y = np.array([0, 1, 0, 2, 1, 1])
  np.testing.assert_allclose(L.orthogonal_projection_loss(jnp.asarray(f, jnp.float32), y),
                             _np_opl(f, y, 0.5), rtol=1e-5)
  scaled = f * np.array([1.0, 3.0, 0.1, 7.0, 2.0, 1e3])[:, None]
  np.testing.assert_allclose(L.orthogonal_projection_loss(scaled, y),
                             L.orthogonal_projection_loss(f, y), rtol=1e-5)
  keep = np.array([True, True, True, False, True, False])
  np.testing.assert_allclose(L.orthogonal_projection_loss(f, y, gamma=0.7, where=keep),
                             _np_opl(f[keep], y[keep], 0.7), rtol=1e-5)
  onehot = np.eye(4)[y] * 2.5
  assert abs(float(L.orthogonal_projection_loss(onehot, y))) < 1e-6
  _grads64(lambda a: L.orthogonal_projection_loss(a, y), f)
  check_raises(("features", lambda: js.losses.orthogonal_projection_loss(jnp.ones(3), y)),
               ("labels", lambda: js.losses.orthogonal_projection_loss(f, y[:3])),
               ("gamma", lambda: js.losses.orthogonal_projection_loss(f, y, gamma=-1.0)),
               ("where", lambda: js.losses.orthogonal_projection_loss(f, y, where=jnp.ones(2, bool))))


# ----------------------------------------------------------------------------- NBC-softmax


def _np_nbc(x, w, y, lam, block, tau):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  ce = _np_ce(x @ w, y)
  xh = x / np.linalg.norm(x, axis=-1, keepdims=True)
  wh = w / np.linalg.norm(w, axis=0, keepdims=True)
  n = len(y)
  out = []
  for i in range(n):
    terms = [xh[i] @ wh[:, y[i]] / tau]
    for b in range(0, n, block):
      js_ = [j for j in range(b, min(b + block, n)) if y[j] != y[i]]
      if js_:
        terms.append(xh[i] @ xh[js_].mean(0) / tau)
    t = np.array(terms)
    out.append(ce[i] + lam * (np.log(np.exp(t - t.max()).sum()) + t.max() - t[0]))
  return np.array(out)


@pytest.mark.parametrize("block", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_nbc_softmax_against_reference(block):
  x = np.asarray(rows(11, (7, 3)), np.float64)
  w = np.asarray(rows(12, (3, 4)), np.float64)
  y = np.array([0, 1, 1, 3, 2, 0, 1])
  got = L.nbc_softmax_loss(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), y,
                           weight=0.5, block_size=block, temperature=0.5)
  np.testing.assert_allclose(got, _np_nbc(x, w, y, 0.5, block, 0.5), rtol=1e-5)
  _grads64(lambda a, b: L.nbc_softmax_loss(a, b, y, weight=0.5, block_size=block,
                                           temperature=0.5), x, w)


def test_nbc_softmax_edges():
  x, w = rows(13, (5, 3)), rows(14, (3, 4))
  y = jnp.array([0, 1, 2, 3, 0])
  np.testing.assert_allclose(L.nbc_softmax_loss(x, w, y, weight=0.0),
                             optax.softmax_cross_entropy_with_integer_labels(x @ w, y), rtol=1e-6)
  assert np.all(np.asarray(L.nbc_softmax_loss(x, w, y)) >= np.asarray(
      L.nbc_softmax_loss(x, w, y, weight=0.0)))
  keep = jnp.array([True, True, False, True, True])
  out = L.nbc_softmax_loss(x, w, y, where=keep, block_size=2)
  assert float(out[2]) == 0.0
  g = jax.grad(lambda a: L.nbc_softmax_loss(a, w, y, where=keep).sum())(x)
  assert not np.any(np.asarray(g)[2]), "a masked example neither trains nor serves as negative"
  bf = L.nbc_softmax_loss(x.astype(jnp.bfloat16), w, y)
  assert bf.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(bf, np.float32)))
  v = L.nbc_softmax_loss(x * 1e3, w, y, temperature=1e-3)
  assert np.all(np.isfinite(v))
  check_raises(("block_size", lambda: js.losses.nbc_softmax_loss(x, w, y, block_size=0)),
               ("weight", lambda: js.losses.nbc_softmax_loss(x, w, y, weight=-1.0)),
               ("class_weights", lambda: js.losses.nbc_softmax_loss(x, w.T, y)),
               ("temperature", lambda: js.losses.nbc_softmax_loss(x, w, y, temperature=0.0)))


# ------------------------------------------------------------------------------------ PMRL


def _np_pmrl(z, tau):
  z = np.asarray(z, np.float64)
  zh = z / np.linalg.norm(z, axis=-1, keepdims=True)
  s = np.linalg.svd(zh, compute_uv=False) / tau
  m = s.max(-1, keepdims=True)
  return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0] - s[..., 0]


def test_pmrl_against_reference_and_properties():
  z = np.asarray(rows(15, (3, 4, 6)), np.float64)
  got = L.pmrl_loss(jnp.asarray(z, jnp.float32), temperature=0.5)
  np.testing.assert_allclose(got, _np_pmrl(z, 0.5), rtol=1e-5)
  q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(6, 6)))
  np.testing.assert_allclose(L.pmrl_loss(z @ q, temperature=0.5), got, rtol=1e-4)
  same = np.tile(np.random.default_rng(1).normal(size=(1, 6)), (4, 1)) * np.arange(1, 5)[:, None]
  v, g = jax.value_and_grad(lambda a: L.pmrl_loss(a, temperature=0.5))(jnp.asarray(same))
  np.testing.assert_allclose(v, math.log1p(3 * math.exp(-2 / 0.5)), rtol=1e-5)
  assert np.all(np.isfinite(g)), "repeated (zero) singular values give a finite gradient"
  _grads64(lambda a: L.pmrl_loss(a, temperature=0.5), z)


def test_pmrl_masks_dtypes_and_errors():
  z = rows(16, (2, 4, 5))
  keep = jnp.array([[True, True, False, True], [True, True, True, True]])
  got = L.pmrl_loss(z, where=keep)
  np.testing.assert_allclose(got[0], L.pmrl_loss(z[0, jnp.array([0, 1, 3])]), rtol=1e-5)
  np.testing.assert_allclose(got[1], L.pmrl_loss(z[1]), rtol=1e-6)
  assert float(L.pmrl_loss(z, where=jnp.zeros(4, bool))[0]) == 0.0
  bf = L.pmrl_loss(z.astype(jnp.bfloat16))
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf, np.float32), L.pmrl_loss(z), rtol=2e-2)
  assert np.all(np.isfinite(L.pmrl_loss(z * 1e30, temperature=1e-3)))
  check_raises(("embeddings", lambda: js.losses.pmrl_loss(jnp.ones(3))),
               ("temperature", lambda: js.losses.pmrl_loss(z, temperature=0.0)),
               ("where", lambda: js.losses.pmrl_loss(z, where=jnp.ones(3, bool))))


# ------------------------------------------------------------------------ Fourier-head CE


def test_fourier_head_cross_entropy_is_reexported_and_matches_reference():
  assert js.losses.fourier_head_cross_entropy is js.normalizers.fourier_head_cross_entropy
  a = np.random.default_rng(2).normal(size=(2, 3)) + 1j * np.random.default_rng(3).normal(
      size=(2, 3))
  labels = np.array([1, 4])
  c = np.stack([np.sum(a[:, k:] * np.conj(a[:, :3 - k]), -1) for k in range(3)], -1)
  z = (np.linspace(-1, 1, 7)[:-1] + np.linspace(-1, 1, 7)[1:]) / 2
  dens = 0.5 + np.real(np.einsum("bk,kz->bz", c[:, 1:] / np.real(c[:, :1]),
                                 np.exp(1j * np.pi * np.arange(1, 3)[:, None] * z)))
  p = dens / dens.sum(-1, keepdims=True)
  want = _np_ce(np.log(p + 1e-5), labels)
  got = L.fourier_head_cross_entropy(jnp.asarray(a, jnp.complex64), labels, 6)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_private_kernel_matches_density():
  cos = jnp.array([1.0, 0.0, -1.0])
  np.testing.assert_allclose(_tier3_metric._wc_log_kernel(cos, 0.5),
                             np.log(0.75 / (1.25 - np.asarray(cos))), rtol=1e-6)
