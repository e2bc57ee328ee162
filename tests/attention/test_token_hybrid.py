"""NAtS-L token routing and Oryx's mixer switch (A46) against a NumPy float64 loop written from
the formulas (softmax over the kept / all previous tokens, the Gated DeltaNet recurrence), their
limits (all softmax, all recurrent), causality and the straight-through route's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises

A = js.attention
B, T, N, K = 2, 7, 2, 4


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.normal(size=(B, T, N, K)) for _ in range(3))
  g = -rng.uniform(0.0, 0.5, (B, T, N))
  beta = rng.uniform(0.1, 0.9, (B, T, N))
  route = (rng.random((B, T, N)) < 0.5).astype(float)
  return q, k, v, g, beta, route


def _reference(q, k, v, g, beta, route, kind):
  """float64 loops: the softmax readout and the GDN state readout, combined per kind."""
  scale = K ** -0.5
  out = np.zeros((B, T, N, K))
  for b in range(B):
    for n in range(N):
      S = np.zeros((K, K))
      for i in range(T):
        qh = q[b, i, n] / np.linalg.norm(q[b, i, n])
        kh = k[b, i, n] / np.linalg.norm(k[b, i, n])
        write = beta[b, i, n] * ((1 - route[b, i, n]) if kind == "nats" else 1.0)
        S = np.exp(g[b, i, n]) * S
        S = S + write * np.outer(kh, v[b, i, n] - S.T @ kh)
        state = S.T @ (scale * qh)
        logits = np.array([scale * q[b, i, n] @ k[b, j, n] for j in range(i + 1)])
        w = np.exp(logits - logits.max())
        if kind == "nats":
          w = w * route[b, :i + 1, n]
        soft = (w @ v[b, :i + 1, n]) / w.sum() if w.sum() > 0 else np.zeros(K)
        if kind == "nats":
          out[b, i, n] = soft + state
        else:
          m = route[b, i, n]
          out[b, i, n] = m * soft + (1 - m) * state
  return out


FNS = {"nats": A.nats_attention, "oryx": A.oryx_attention}
# Oryx shares every piece with NAtS-L (the same two readouts): its cases run with -m slow.
KINDS = ["nats", pytest.param("oryx", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_the_float64_loop_and_the_limits(kind):
  q, k, v, g, beta, route = _inputs()
  f32 = lambda *a: [jnp.asarray(x, jnp.float32) for x in a]  # noqa: E731

  @jax.jit
  def run(q, k, v, g, beta, route):
    fn = FNS[kind]
    return (fn(q, k, v, g, beta, route), fn(q, k, v, g, beta, jnp.ones_like(route)),
            fn(q, k, v, g, beta, jnp.zeros_like(route)),
            A.dot_product_attention(q, k, v, is_causal=True),
            js.linear.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True))

  out, soft, linear, dense, gdn = run(*f32(q, k, v, g, beta, route))
  # float32 against float64 over 7 steps of O(1) values: ~1e-6 relative per step
  np.testing.assert_allclose(out, _reference(q, k, v, g, beta, route, kind), atol=2e-5)
  # all softmax: causal attention with the shared q, k, v; all recurrent: Gated DeltaNet
  np.testing.assert_allclose(soft, dense, atol=2e-6)
  np.testing.assert_allclose(linear, gdn, atol=2e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_causal_and_gradients_finite(kind):
  q, k, v, g, beta, route = (jnp.asarray(a, jnp.float32) for a in _inputs(1))
  fn = FNS[kind]

  @jax.jit
  def run(q, k, v, g, beta, route, later):
    base = fn(q, k, v, g, beta, route)
    # change every input after position 3: outputs at <= 3 stay
    bump = lambda a: a.at[:, 4:].add(later)  # noqa: E731
    moved = fn(bump(q), bump(k), bump(v), g, beta, route.at[:, 4:].set(1 - route[:, 4:]))
    z = jnp.zeros_like(route)
    grads = jax.grad(lambda z, q: jnp.sum(fn(q, k, v, g, beta,
                                             A.straight_through_route(z)) ** 2),
                     argnums=(0, 1))(z + 0.3, q)
    return base, moved, grads

  base, moved, (gz, gq) = run(q, k, v, g, beta, route, 1.5)
  np.testing.assert_array_equal(base[:, :4], moved[:, :4])
  assert not np.allclose(base[:, 4:], moved[:, 4:])
  # the router learns through the straight-through route; every gradient is finite
  assert np.all(np.isfinite(gz)) and np.any(gz != 0)
  assert np.all(np.isfinite(gq))


def test_straight_through_route_and_bad_input():
  z = jnp.array([-1.0, 0.0, 2.0])
  np.testing.assert_array_equal(A.straight_through_route(z), [0.0, 0.0, 1.0])
  s = jax.nn.sigmoid(z)
  np.testing.assert_allclose(jax.grad(lambda z: jnp.sum(A.straight_through_route(z) * z))(z),
                             A.straight_through_route(z) + z * s * (1 - s), rtol=1e-6)
  x = jnp.ones((1, 3, 2, 4))
  gate = jnp.zeros((1, 3, 2))
  check_raises(
      (r"nats_attention: `keep` must be \[B, T, N\]",
       lambda: A.nats_attention(x, x, x, gate, gate, jnp.zeros((1, 3)))),
      (r"oryx_attention: `query` must be a floating \[B, T, N, K\]",
       lambda: A.oryx_attention(x[0], x, x, gate, gate, gate)),
  )
