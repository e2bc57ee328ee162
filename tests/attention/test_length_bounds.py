"""Sequence lengths past the sequence (issue 37, guard "lengths and shapes").

A concrete ``query_seq_lengths`` above T or ``key_value_seq_lengths`` above S is a
ValueError naming the argument and the bound (it used to be clamped silently, hiding an
off-by-one in the caller's padding). Traced lengths cannot be checked: they are clamped,
as ``tests/attention/test_promises.py::test_promise_bad_input_traced_lengths_are_clamped``
checks.
"""

import jax.numpy as jnp
import pytest

import jaxsoft as js
from tests.helpers import make_qkv

q, k, v = make_qkv(0, B=2, T=6, S=9, N=2, K=2, H=4)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize("kwargs,match", [
    ({"key_value_seq_lengths": jnp.array([4, 10], jnp.int32)}, r"`key_value_seq_lengths` must be <= 9"),
    ({"query_seq_lengths": jnp.array([7, 2], jnp.int32)}, r"`query_seq_lengths` must be <= 6"),
    ({"key_value_seq_lengths": 12}, r"`key_value_seq_lengths` must be <= 9"),
])
def test_concrete_lengths_past_the_sequence_raise(implementation, kwargs, match):
  with pytest.raises(ValueError, match=match):
    js.attention.dot_product_attention(q, k, v, implementation=implementation, **kwargs)


def test_lengths_equal_to_the_sequence_are_the_whole_sequence():
  full = js.attention.dot_product_attention(q, k, v, implementation="xla")
  out = js.attention.dot_product_attention(
      q, k, v, query_seq_lengths=jnp.array([6, 6]), key_value_seq_lengths=jnp.array([9, 9]),
      implementation="xla")
  assert jnp.array_equal(out, full)
