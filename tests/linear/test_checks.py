"""Bad input to the linear family raises ValueError naming the argument (NotImplementedError
for the not-yet-built Pallas form); traced values are checked for shape only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear

B, T, N, K, V = 1, 5, 2, 4, 3
# numpy inputs: no JAX work at import (collection) time.
q = k = np.ones((B, T, N, K), np.float32)
v = np.ones((B, T, N, V), np.float32)
g = -np.ones((B, T, N), np.float32)
beta = np.full((B, T, N), 0.5, np.float32)


def _set(x, index, value):
  x = x.copy()
  x[index] = value
  return x


def _bad_calls():
  yield "`q`", lambda: linear.simple_gla(q[0], k, v, g)
  yield "`k`", lambda: linear.delta_rule(q, k[..., :3], v, beta)
  yield "`v`", lambda: linear.gla(q, k, v[:, :4], -jnp.ones((B, T, N, K)))
  yield "`q`", lambda: linear.linear_attention(q.astype(jnp.complex64), k, v)
  yield "`g`", lambda: linear.simple_gla(q, k, v, -jnp.ones((B, T, N, K)))     # per channel
  yield "`g`", lambda: linear.gla(q, k, v, g)                                   # per head
  yield "`g`", lambda: linear.simple_gla(q, k, v, _set(g, (0, 2, 1), 0.1))       # g > 0
  yield "`g`", lambda: linear.gated_delta_rule(q, k, v, _set(g, (0, 0, 0), -np.inf), beta)
  yield "`beta`", lambda: linear.delta_rule(q, k, v, _set(beta, (0, 1, 0), 2.5))
  yield "`beta`", lambda: linear.gated_delta_rule(q, k, v, g, _set(beta, (0, 1, 0), -0.1))
  yield "`beta`", lambda: linear.delta_rule(q, k, v, beta[..., None])
  yield "`chunk_size`", lambda: linear.simple_gla(q, k, v, g, chunk_size=0)
  yield "`chunk_size`", lambda: linear.simple_gla(q, k, v, g, chunk_size=4.0)
  yield "`chunk_size`", lambda: linear.delta_rule(q, k, v, beta, chunk_size=True)
  yield "`initial_state`", lambda: linear.gla(
      q, k, v, -jnp.ones((B, T, N, K)), initial_state=jnp.zeros((B, N, V, K)))
  yield "`initial_state`", lambda: linear.linear_attention(
      q, k, v, initial_state=jnp.zeros((B, N, K, V)))                # normalize needs (S, z)
  yield "`initial_state[1]`", lambda: linear.linear_attention(
      q, k, v, initial_state=(jnp.zeros((B, N, K, V)), jnp.zeros((B, N, V))))
  yield "`segment_ids`", lambda: linear.simple_gla(q, k, v, g, segment_ids=jnp.zeros((B, T)))
  yield "`segment_ids`", lambda: linear.simple_gla(
      q, k, v, g, segment_ids=jnp.zeros((B, T + 1), jnp.int32))
  yield "`implementation`", lambda: linear.delta_rule(q, k, v, beta, implementation="xla")
  yield "`feature_map`", lambda: linear.linear_attention(q, k, v, feature_map="softmax")
  yield "`eps`", lambda: linear.linear_attention(q, k, v, eps=0.0)
  yield "`scale`", lambda: linear.simple_gla(q, k, v, g, scale=jnp.ones(2))
  yield "`state`", lambda: linear.simple_gla_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                                  jnp.zeros((B, N, K, K)))
  yield "`g`", lambda: linear.gla_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0])
  yield "`beta`", lambda: linear.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                                       jnp.full((B, N), 3.0))
  yield "`q`", lambda: linear.delta_rule_step(q, k[:, 0], v[:, 0], beta[:, 0])


@pytest.mark.parametrize("case", range(len(list(_bad_calls()))))
def test_bad_input_names_the_argument(case):
  name, fn = list(_bad_calls())[case]
  with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
    fn()


def test_pallas_needs_a_backend_or_interpret_mode(monkeypatch):
  """On CPU without JAXSOFT_PALLAS_INTERPRET the kernels cannot run: NotImplementedError
  naming pallas; gla's per-channel decays have no kernel at all."""
  monkeypatch.delenv("JAXSOFT_PALLAS_INTERPRET", raising=False)
  with pytest.raises(NotImplementedError, match="pallas"):
    linear.gated_delta_rule(q, k, v, g, beta, implementation="pallas")
  with pytest.raises(NotImplementedError, match="pallas"):
    linear.gla(q, k, v, jnp.broadcast_to(g[..., None], q.shape), implementation="pallas")


def test_traced_gates_are_checked_for_shape_only():
  """Under jit the values are unknown: g > 0 is not rejected (no error), shapes still are."""
  out = jax.jit(lambda g: linear.simple_gla(q, k, v, g))(-g)
  assert out.shape == (B, T, N, V)
  with pytest.raises(ValueError, match="`g`"):
    jax.jit(lambda g: linear.simple_gla(q, k, v, g))(g[..., None])


def test_beta_bounds_are_allowed():
  """beta = 0 (no write) and beta = 2 (a reflection, eigenvalue -1) are accepted."""
  for b in (0.0, 2.0):
    o = linear.delta_rule(q, k / 2.0, v, jnp.full((B, T, N), b), implementation="recurrent")
    assert bool(jnp.all(jnp.isfinite(o)))
