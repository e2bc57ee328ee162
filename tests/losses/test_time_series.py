"""soft_msm (feature L17) against the Soft-MSM recursion written out with loops (and hard
MSM in the limit): gradients, the divergence, broadcasting and bad input."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.helpers import check_raises
from tests.losses.references import grads64, jitted_losses

L = jitted_losses({
    "soft_msm": ("cost", "divergence"),
})


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
  grads64(lambda a, b: L.soft_msm(a, b, gamma=0.5, gate_sharpness=3.0), rng.normal(size=3),
           rng.normal(size=4))
  g = jax.grad(lambda a: L.soft_msm(a, a, gamma=0.1, divergence=True))(jnp.array([0.0, 1e3, -1e3]))
  assert np.all(np.isfinite(g))
  out = L.soft_msm(jnp.array([0.0, 1.0], jnp.bfloat16), jnp.array([0.5], jnp.bfloat16))
  assert out.dtype == jnp.float32 and np.isfinite(float(out))
  check_raises(("`x`", lambda: js.losses.soft_msm(jnp.ones(0), jnp.ones(3))),
               ("`y`", lambda: js.losses.soft_msm(jnp.ones(2), jnp.ones(3, jnp.complex64))),
               ("gamma", lambda: js.losses.soft_msm(jnp.ones(2), jnp.ones(3), gamma=0.0)),
               ("cost", lambda: js.losses.soft_msm(jnp.ones(2), jnp.ones(3), cost=-1.0)),
               ("broadcast", lambda: js.losses.soft_msm(jnp.ones((2, 2)), jnp.ones((3, 3)))))
