"""L06 CFCD's progressive MadaCos schedule (`madacos_alpha_schedule`) and its use as the
`alpha` of `madacos_scale_margin` / `madacos_loss` with a traced `step`: the schedule against
its float64 formula, the loss at each step against a float64 NumPy reference of MadaCos at
the scheduled alpha, the scale and margin non-decreasing over steps, the gradient (alpha,
scale and margin held constant), masks, bf16, x64 and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

import jaxsoft as js
from tests.helpers import check_raises, normal

L = js.losses
STEPS = np.array([0, 40, 100, 175, 250, 400])   # begin 100, 150 steps: before, in, after


def _alpha_ref(t, a0, a1, steps, begin):
  """The schedule in float64: linear in the log-odds log((1 - a) / a)."""
  f = np.clip((np.asarray(t, np.float64) - begin) / steps, 0.0, 1.0)
  odds = (1 - f) * np.log((1 - a0) / a0) + f * np.log((1 - a1) / a1)
  return 1.0 / (1.0 + np.exp(odds))


def _madacos_ref(x, w, y, keep, alpha, ratio=9999999.0, min_scale=32.0):
  """(s, m, per-example losses) of MadaCos in float64 (statistic "example")."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  cos = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ (w / np.linalg.norm(w, axis=0))
  rows, y, keep = np.arange(len(y)), np.asarray(y), np.asarray(keep, bool)
  c_y = cos[rows, y]
  idx = np.flatnonzero(keep)
  med = idx[np.argsort(c_y[idx], kind="stable")[(len(idx) - 1) // 2]]
  s = max(min_scale, np.log(ratio * (1 - alpha) / alpha) / (1 - c_y[med]))
  b_med = np.exp(s * np.delete(cos[med], y[med])).sum()
  m = max(0.0, c_y[med] - np.log(alpha * b_med / (1 - alpha)) / s)
  logits = s * cos
  logits[rows, y] -= s * m
  return s, m, np.where(keep, logsumexp(logits, axis=1) - logits[rows, y], 0.0)


def _inputs():
  # near the class centres: median target cosine ~0.8, scale above the floor, margin > 0
  w = normal(1, (6, 5))
  y = jnp.array([0, 1, 2, 3, 4, 0, 1])
  return 0.6 * normal(0, (7, 6)) + w.T[y], w, y


def _ref_at_steps(x, w, y, keep):
  a_ref = _alpha_ref(STEPS, 0.3, 0.02, 150, 100)
  return a_ref, [_madacos_ref(x, w, y, keep, a) for a in a_ref]


SCHED = dict(init_alpha=0.3, end_alpha=0.02, transition_steps=150, transition_begin=100)
KEEP = jnp.array([True, True, False, True, True, True, True])


def test_schedule_and_loss_over_steps_against_float64():
  x, w, y = _inputs()
  sched = L.madacos_alpha_schedule(**SCHED)

  @jax.jit
  def f(steps):
    def at(t):
      s, m = L.madacos_scale_margin(x, w, y, alpha=sched, step=t, where=KEEP)
      return sched(t), s, m, L.madacos_loss(x, w, y, alpha=sched, step=t, where=KEEP)
    return jax.vmap(at)(steps)

  alpha, s, m, loss = f(jnp.asarray(STEPS))
  a_ref, refs = _ref_at_steps(x, w, y, KEEP)
  # float32 sigmoid of log-odds ~ 4: a few 2^-24 relative roundings
  np.testing.assert_allclose(alpha, a_ref, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(alpha)[[0, 1, 2, 4, 5]], [0.3, 0.3, 0.3, 0.02, 0.02],
                             rtol=1e-6)
  # as test_madacos: float32 cosines over 1 - c_med ~ 0.2 and log B ~ s ~ 60: 1e-5 relative
  # on s, 1e-5 on m; 1e-4 relative on losses of O(1-10)
  np.testing.assert_allclose(s, [r[0] for r in refs], rtol=1e-5)
  np.testing.assert_allclose(m, [r[1] for r in refs], atol=1e-5)
  np.testing.assert_allclose(loss, np.stack([r[2] for r in refs]), rtol=1e-4, atol=1e-5)
  # progressive: with alpha falling, the scale and the margin never fall and both grow
  assert np.all(np.diff(s) >= 0) and np.all(np.diff(m) >= -1e-6)
  assert s[-1] > s[0] and m[-1] > m[0] > 0
  # the median kept example's target probability is the scheduled alpha at every step
  lk = np.asarray(loss)[:, np.asarray(KEEP)]
  assert np.all(np.min(np.abs(lk + np.log(a_ref)[:, None]), axis=1) < 1e-4)


@pytest.mark.slow
def test_gradient_and_bf16_at_a_scheduled_step():
  x, w, y = _inputs()
  sched = L.madacos_alpha_schedule(**SCHED)

  @jax.jit
  def f(x, t):
    grad = jax.grad(lambda a: L.madacos_loss(a, w, y, alpha=sched, step=t, where=KEEP).sum())(x)
    bf16 = L.madacos_loss(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), y, alpha=sched,
                          step=t)
    return grad, bf16

  grad, bf16 = f(x, STEPS[3])
  a_ref, refs = _ref_at_steps(x, w, y, KEEP)
  # the gradient holds alpha, s and m constant: cosface_loss's at those floats
  s3, m3 = float(refs[3][0]), float(refs[3][1])
  g_ref = jax.jit(jax.grad(lambda a: L.cosface_loss(a, w, y, scale=s3, margin=m3,
                                                    where=KEEP).sum()))(x)
  # (s, m) from float64 vs float32: 1e-5 relative, so 1e-4 on the gradient
  np.testing.assert_allclose(grad, g_ref, rtol=1e-4, atol=1e-4)
  assert bf16.dtype == jnp.bfloat16
  xb, wb = (np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)) for a in (x, w))
  # float32 from the bf16-rounded inputs, the output rounded to 8 bits (2^-9: 4e-3)
  np.testing.assert_allclose(np.float32(bf16),
                             _madacos_ref(xb, wb, y, np.ones(7, bool), a_ref[3])[2],
                             rtol=4e-3, atol=1e-3)


@pytest.mark.slow
def test_array_alpha_and_float64():
  x, w, y = _inputs()
  keep = np.ones(7, bool)
  with jax.enable_x64(True):
    sched = L.madacos_alpha_schedule(0.5, 0.01, transition_steps=10)
    x64, w64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, w))
    a = jax.jit(sched)(jnp.asarray(3, jnp.int64))
    s, m = jax.jit(lambda t: L.madacos_scale_margin(x64, w64, y, alpha=sched, step=t))(3)
    loss = jax.jit(lambda t: L.madacos_loss(x64, w64, y, alpha=sched, step=t))(3.0)
    loss_arr = L.madacos_loss(x64, w64, y, alpha=jnp.asarray(a))   # a concrete array alpha
    assert a.dtype == s.dtype == m.dtype == loss.dtype == jnp.float64
  a_ref = _alpha_ref(3, 0.5, 0.01, 10, 0)
  np.testing.assert_allclose(a, a_ref, rtol=1e-14)
  s_ref, m_ref, l_ref = _madacos_ref(x, w, y, keep, a_ref)
  np.testing.assert_allclose((s, m), (s_ref, m_ref), rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(loss, l_ref, rtol=1e-11, atol=1e-12)
  np.testing.assert_allclose(loss_arr, l_ref, rtol=1e-11, atol=1e-12)


def test_bad_arguments_name_the_function():
  x, w, y = _inputs()
  sched = L.madacos_alpha_schedule()
  S, f, g = L.madacos_alpha_schedule, L.madacos_scale_margin, L.madacos_loss
  check_raises(
      (r"madacos_alpha_schedule: `init_alpha` must be in \(0, 1\)", lambda: S(init_alpha=1.0)),
      (r"madacos_alpha_schedule: `end_alpha` must be in \(0, 1\)", lambda: S(end_alpha=0.0)),
      (r"madacos_alpha_schedule: `transition_steps`", lambda: S(transition_steps=0)),
      (r"madacos_alpha_schedule: `transition_begin`", lambda: S(transition_begin=-1)),
      (r"madacos_alpha_schedule: the step must be a scalar", lambda: sched(jnp.zeros(2))),
      (r"madacos_loss: a schedule `alpha` needs `step`", lambda: g(x, w, y, alpha=sched)),
      (r"madacos_scale_margin: `step` is given but `alpha` is not a schedule",
       lambda: f(x, w, y, alpha=0.1, step=3)),
      (r"madacos_loss: `alpha` must be in \(0, 1\)", lambda: g(x, w, y, alpha=jnp.asarray(1.5))),
      (r"madacos_loss: `alpha` must be a float scalar", lambda: g(x, w, y, alpha=jnp.ones(2))),
  )
