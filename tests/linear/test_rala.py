"""Feature A37, RALA (:func:`jaxsoft.linear.rala`, :func:`jaxsoft.linear.rala_key_weights`):
against the reconstructed [R] read as a float64 loop, and uniform key weights (a zero-mean
query) giving bidirectional linear attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests.linear import cases, reference

B, T, N, K, V = 2, 9, 3, 4, 3


def test_rala_matches_reference_and_uniform_weights_give_linear_attention():
  """RALA against the float64 loop (with a gate); with a zero-mean query (α uniform) and no
  gate it is bidirectional elu+1 linear attention."""
  a = cases.random_qkv(jax.random.split(jax.random.key(19), 10), B, T, N, K, V, unit_keys=True)
  q, k, v = a["q"], a["k"], a["v"]
  gate = jax.random.normal(jax.random.key(20), v.shape)
  q0 = jnp.concatenate([q[:, :4], -q[:, :4], jnp.zeros_like(q[:, :1])], axis=1)

  @jax.jit
  def outputs(q, q0, k, v, gate):
    fq, fk = jax.nn.elu(q0) + 1, jax.nn.elu(k) + 1
    dense = jnp.einsum("btnk,bsnk->bnts", fq, fk)
    dense = dense / jnp.sum(dense, -1, keepdims=True)
    return (linear.rala(q, k, v, gate), linear.rala(q0, k, v),
            jnp.einsum("bnts,bsnv->btnv", dense, v), linear.rala_key_weights(q0, k))

  y, y0, plain, alpha = outputs(q, q0, k, v, gate)
  want = reference.rala(reference.elu1(q), reference.elu1(k), q, k, v, gate)
  np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(alpha, 1.0, rtol=1e-6)
  np.testing.assert_allclose(y0, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [
    ("`gate`", lambda: linear.rala(np.ones((1, 4, 2, 3), np.float32),
                                   np.ones((1, 4, 2, 3), np.float32),
                                   np.ones((1, 4, 2, 2), np.float32),
                                   gate=np.ones((1, 4, 2, 3)))),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
