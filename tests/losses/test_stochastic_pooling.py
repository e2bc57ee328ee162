"""midam_pool_init / midam_pool_update (MIDAM's moving-average smoothed-max pooling, feature
L17) against a float64 NumPy recurrence written from the paper's formula: it tracks the exact
pooled value, its gradient is the variance-reduced estimator, masks, bf16 and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises, rows

TAU, GAMMA = 0.5, 0.1
B, N, K, STEPS = 4, 12, 3, 300


def _np_exact(h, tau):
  h = np.asarray(h, np.float64)
  return tau * np.log(np.mean(np.exp(h / tau), -1))


@jax.jit
def _run(h, picks):
  """STEPS updates, each with K sampled instances of every bag; tau log u after each."""
  def step(state, idx):
    pooled, state = js.losses.midam_pool_update(
        state, jnp.take_along_axis(h, idx, 1), jnp.arange(B), temperature=TAU, gamma=GAMMA)
    return state, pooled
  return jax.lax.scan(step, js.losses.midam_pool_init(B), picks)[1]


def test_tracks_the_exact_pooled_value_as_the_numpy_recurrence():
  h = np.asarray(rows(0, (B, N), 0.4), np.float64)
  picks = np.random.default_rng(0).integers(0, N, size=(STEPS, B, K))
  got = np.asarray(_run(jnp.asarray(h, jnp.float32), jnp.asarray(picks)), np.float64)
  u = np.zeros(B)
  want = []
  for t in range(STEPS):
    m = np.mean(np.exp(np.take_along_axis(h, picks[t], 1) / TAU), -1)
    u = m if t == 0 else (1 - GAMMA) * u + GAMMA * m
    want.append(TAU * np.log(u))
  # float32 log-domain recurrence over 300 steps: errors stay ~1e-6 of |s| ~ 1
  np.testing.assert_allclose(got, np.array(want), rtol=1e-5, atol=1e-5)
  exact = _np_exact(h, TAU)
  # after burn-in (1 - gamma)^100 ~ 3e-5, the estimate's average is the exact value up to the
  # sampling noise: |error| of the mean over 200 steps < 0.04 (seeds 0-4 give at most 0.023)
  assert np.all(np.abs(got[100:].mean(0) - exact) < 0.04)
  # (whole bags, exact at the first visit: test_feeds_midam_auc_loss_bf16_and_errors)


def test_gradient_is_the_variance_reduced_estimator_and_masks():
  h0 = rows(1, (3, 5), 1.0)
  h1 = rows(2, (3, 5), 1.0)
  ids = jnp.array([2, 0, 1])
  inst = np.ones((3, 5), bool)
  inst[1, 3:] = False
  inst[2] = False  # no visible instance: bag 1 is left alone

  @jax.jit
  def two_steps(h0, h1):
    s0 = js.losses.midam_pool_init(3)
    _, s1 = js.losses.midam_pool_update(s0, h0, ids, temperature=TAU, gamma=0.3)
    f = lambda h: js.losses.midam_pool_update(s1, h, ids, temperature=TAU, gamma=0.3,
                                              where=inst)
    (pooled, s2), vjp = jax.vjp(f, h1)
    return s1, pooled, s2, vjp((jnp.ones(3), jax.tree.map(jnp.zeros_like, s2)))[0]

  s1, pooled, s2, g = two_steps(h0, h1)
  h0, h1 = np.asarray(h0, np.float64), np.asarray(h1, np.float64)
  u0 = np.mean(np.exp(h0 / TAU), -1)
  m1 = np.array([np.mean(np.exp(r[k] / TAU)) for r, k in zip(h1, inst, strict=True)
                 if k.any()] + [np.nan])
  u1 = 0.7 * u0 + 0.3 * m1
  np.testing.assert_allclose(pooled[:2], TAU * np.log(u1[:2]), rtol=1e-5)
  assert float(pooled[2]) == 0.0
  # state: bags 2 and 0 moved, bag 1 (the masked row) kept its first value
  np.testing.assert_allclose(np.asarray(s2.log_u)[[2, 0]], np.log(u1[:2]), rtol=1e-5)
  assert float(s2.log_u[1]) == float(s1.log_u[1]) and bool(s2.seen.all())
  # d pooled / dh = (tau / u) d mean(e^{h / tau}) / dh = e^{h / tau} / (n u) on visible entries
  e = np.where(inst, np.exp(h1 / TAU), 0.0)
  want = e / np.maximum(inst.sum(-1, keepdims=True), 1) / np.where(np.isnan(u1), 1, u1)[:, None]
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_feeds_midam_auc_loss_bf16_and_errors():
  h = jnp.asarray(rows(3, (4, 6), 1.0))
  labels = jnp.array([1, 0, 1, 0])

  @jax.jit
  def both(h):
    pooled, _ = js.losses.midam_pool_update(js.losses.midam_pool_init(4), h, jnp.arange(4),
                                            temperature=TAU)
    return (js.losses.midam_auc_loss(pooled[:, None], labels, temperature=TAU),
            js.losses.midam_auc_loss(h, labels, temperature=TAU),
            js.losses.midam_pool_update(js.losses.midam_pool_init(4),
                                        h.astype(jnp.bfloat16), jnp.arange(4),
                                        temperature=TAU)[0])

  via_state, direct, low = both(h)
  np.testing.assert_allclose(via_state, direct, rtol=1e-5)  # whole bags: the same pooled values
  assert low.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(low, np.float32),
                             _np_exact(np.asarray(h.astype(jnp.bfloat16), np.float64), TAU),
                             rtol=1e-2, atol=1e-2)  # bf16 output: 8 bits
  s = js.losses.midam_pool_init(4)
  f = js.losses.midam_pool_update
  check_raises(
      ("num_bags", lambda: js.losses.midam_pool_init(0)),
      ("state", lambda: f((jnp.zeros(4), jnp.zeros(4, bool)), h, jnp.arange(4))),
      ("bag_ids", lambda: f(s, h, jnp.array([0, 1, 1, 2]))),
      ("bag_ids", lambda: f(s, h, jnp.array([0, 1, 2, 4]))),
      ("bag_ids", lambda: f(s, h, jnp.arange(3))),
      ("gamma", lambda: f(s, h, jnp.arange(4), gamma=0.0)),
      ("temperature", lambda: f(s, h, jnp.arange(4), temperature=-1.0)),
      ("temperature", lambda: f(s, h, jnp.arange(4), temperature=jnp.ones(4))),
      ("instance_scores", lambda: f(s, h[0], jnp.arange(4))),
      ("where", lambda: f(s, h, jnp.arange(4), where=jnp.ones((4, 5), bool))))
