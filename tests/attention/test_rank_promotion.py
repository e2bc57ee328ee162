"""Attention needs no implicit rank promotion (issue: sequence lengths broadcast by rank).

Under ``jax.numpy_rank_promotion("raise")``, the setting of JAX's own test suite and of
many users', every implementation takes query / key lengths, segment ids and windows,
forward and backward, and gives what it gives without the setting.
"""

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxsoft as js
from tests import helpers

Q = helpers.standard_normal(0, (2, 8, 2, 4))
LENS = jnp.array([5, 8])
SEGMENTS = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]] * 2)


def _loss(q, implementation):
  out = js.attention.dot_product_attention(
      q, q, q, query_seq_lengths=LENS, key_value_seq_lengths=LENS, segment_ids=SEGMENTS,
      local_window_size=3, is_causal=True, normalizer="ssmax", normalizer_params={"s": 0.5},
      implementation=implementation)
  return jnp.sum(out * jnp.cos(out))


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_sequence_lengths_need_no_rank_promotion(implementation):
  # jitted: the setting acts at trace time (and is part of jit's cache key), so each call
  # traces every jnp operation as op-by-op dispatch would, then compiles it as one program
  value_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnums=1)
  want = value_and_grad(Q, implementation)
  with jax.numpy_rank_promotion("raise"):
    got = value_and_grad(Q, implementation)
  chex.assert_trees_all_close(got, want, atol=1e-6)
