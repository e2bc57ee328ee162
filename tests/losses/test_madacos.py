"""L06 CFCD's MadaCos scale/margin and loss against a float64 NumPy reference of the
formulas (the authors' rule): the three statistics, masks, the median example's target
probability, the scale floor, the CosFace identity and its gradient, bf16, x64, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

import jaxsoft as js
from tests.helpers import check_raises, normal

L = js.losses


def _ref(x, w, y, keep, alpha, ratio=9999999.0, min_scale=32.0, statistic="example"):
  """(s, m, per-example CosFace losses) in float64 from the formulas."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  cos = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ (w / np.linalg.norm(w, axis=0))
  y, keep = np.asarray(y), np.asarray(keep, bool)
  c_y = cos[np.arange(len(y)), y]
  idx = np.flatnonzero(keep)
  med = idx[np.argsort(c_y[idx], kind="stable")[(len(idx) - 1) // 2]]   # lower median
  s = max(min_scale, np.log(ratio * (1 - alpha) / alpha) / (1 - c_y[med]))
  others = np.ones_like(cos, bool)
  others[np.arange(len(y)), y] = False
  b = np.array([np.exp(s * cos[i][others[i]]).sum() for i in range(len(y))])
  b_bar = {"example": b[med], "median": np.sort(b[idx])[(len(idx) - 1) // 2],
           "mean": b[idx].mean()}[statistic]
  m = max(0.0, c_y[med] - np.log(alpha * b_bar / (1 - alpha)) / s)
  logits = s * cos
  logits[np.arange(len(y)), y] -= s * m
  loss = logsumexp(logits, axis=1) - logits[np.arange(len(y)), y]
  return s, m, np.where(keep, loss, 0.0)


def _inputs():
  # cosines ~0.3-0.9 to the label's centre: the median target cosine ~0.8 gives a scale
  # above the floor of 32 and a positive margin
  w = normal(1, (6, 5))
  y = jnp.array([0, 1, 2, 3, 4, 0, 1])
  x = 0.6 * normal(0, (7, 6)) + w.T[y]
  return x, w, y


def test_statistics_loss_and_gradient_against_float64():
  x, w, y = _inputs()
  keep = jnp.array([True, True, False, True, True, True, True])

  @jax.jit
  def f(x):
    out = {st: L.madacos_scale_margin(x, w, y, alpha=0.1, statistic=st, where=keep)
           for st in ("example", "median", "mean")}
    out["loss"] = L.madacos_loss(x, w, y, alpha=0.1, where=keep)
    out["grad"] = jax.grad(lambda a: L.madacos_loss(a, w, y, alpha=0.1, where=keep).sum())(x)
    out["floor"] = L.madacos_scale_margin(x, w, y)   # alpha 0.02: log(4.9e8) / (1 - c)
    out["none"] = L.madacos_scale_margin(x, w, y, where=jnp.zeros(7, bool))
    out["bf16"] = L.madacos_loss(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), y, alpha=0.1)
    return out

  got = f(x)
  # float32 cosines (a few 2^-24 roundings) divided by 1 - c_med ~ 0.2, log B ~ s ~ 60:
  # 1e-5 relative on s, 1e-5 absolute on m and on losses of O(1-10)
  for st in ("example", "median", "mean"):
    s, m, _ = _ref(x, w, y, keep, 0.1, statistic=st)
    assert s > 32 and m > 0, st
    np.testing.assert_allclose(got[st][0], s, rtol=1e-5)
    np.testing.assert_allclose(got[st][1], m, atol=1e-5)
  s, m, loss = _ref(x, w, y, keep, 0.1)
  np.testing.assert_allclose(got["loss"], loss, rtol=1e-4, atol=1e-5)
  # the median example's target probability is alpha: its loss is -log 0.1
  c = np.asarray(got["loss"])[np.asarray(keep)]
  assert np.min(np.abs(c - np.log(10.0))) < 1e-4
  # the gradient holds (s, m) constant: that of cosface_loss at those floats
  g_ref = jax.jit(jax.grad(lambda a: L.cosface_loss(
      a, w, y, scale=float(got["example"][0]), margin=float(got["example"][1]),
      where=keep).sum()))(x)
  np.testing.assert_allclose(got["grad"], g_ref, rtol=1e-4, atol=1e-5)
  s_all, m_all, _ = _ref(x, w, y, np.ones(7, bool), 0.02)
  np.testing.assert_allclose(got["floor"], (s_all, m_all), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got["none"], (32.0, 0.0))
  assert got["bf16"].dtype == jnp.bfloat16
  xb, wb = (np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)) for a in (x, w))
  # float32 from the bf16-rounded inputs, the output rounded to 8 bits (2^-9: 4e-3)
  np.testing.assert_allclose(np.float32(got["bf16"]), _ref(xb, wb, y, np.ones(7, bool), 0.1)[2],
                             rtol=4e-3, atol=1e-3)


@pytest.mark.slow
def test_scale_floor_bf16_and_margin_clip():
  # far from the class centres: median cosine low, the scale sits at the floor and the
  # margin clips at 0 (MadaCos is then normalised softmax CE at scale 32)
  x = normal(3, (6, 4))
  w = normal(4, (4, 5))
  y = jnp.array([0, 1, 2, 3, 4, 0])

  @jax.jit
  def f(x):
    return (L.madacos_scale_margin(x, w, y), L.madacos_loss(x, w, y),
            L.normalized_softmax_loss(x, w, y, temperature=1 / 32),
            L.madacos_loss(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), y))

  (s, m), loss, nsl, bf16 = f(x)
  s_ref, m_ref, loss_ref = _ref(x, w, y, np.ones(6, bool), 0.02)
  assert s_ref == 32.0 and m_ref == 0.0
  np.testing.assert_array_equal((s, m), (32.0, 0.0))
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loss, nsl, rtol=1e-5, atol=1e-5)
  assert bf16.dtype == jnp.bfloat16
  xb, wb = (np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)) for a in (x, w))
  # float32 from the bf16-rounded inputs, the output rounded to 8 bits (2^-9: 4e-3)
  np.testing.assert_allclose(np.float32(bf16), _ref(xb, wb, y, np.ones(6, bool), 0.02)[2],
                             rtol=4e-3, atol=1e-3)


@pytest.mark.slow
def test_float64_inputs_stay_float64():
  x, w, y = _inputs()
  with jax.enable_x64(True):
    x64, w64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, w))
    s, m = jax.jit(lambda a: L.madacos_scale_margin(a, w64, y, alpha=0.1))(x64)
    loss = jax.jit(lambda a: L.madacos_loss(a, w64, y, alpha=0.1))(x64)
    assert s.dtype == m.dtype == loss.dtype == jnp.float64
  s_ref, m_ref, loss_ref = _ref(x, w, y, np.ones(7, bool), 0.1)
  np.testing.assert_allclose((s, m), (s_ref, m_ref), rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-11, atol=1e-12)


def test_bad_arguments_name_the_function():
  x, w, y = _inputs()
  f, g = L.madacos_scale_margin, L.madacos_loss
  check_raises(
      (r"madacos_scale_margin: `alpha` must be in \(0, 1\)", lambda: f(x, w, y, alpha=1.0)),
      (r"madacos_loss: `ratio` must be finite and > 0", lambda: g(x, w, y, ratio=0.0)),
      (r"madacos_loss: `min_scale`", lambda: g(x, w, y, min_scale=-1.0)),
      (r"madacos_scale_margin: `statistic` must be one of", lambda: f(x, w, y, statistic="max")),
      (r"madacos_loss: `labels` of shape", lambda: g(x, w, y[:3])),
      (r"madacos_scale_margin: `where` of shape", lambda: f(x, w, y, where=jnp.ones(3, bool))),
  )
