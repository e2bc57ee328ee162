"""Mixed query/key/value dtypes promote as jnp does; the output is never narrower than an
input (issue 37, defect 16: bf16 query with float32 key/value came back bf16)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests import helpers

Q = helpers.standard_normal(0, (1, 8, 2, 4))


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize("dtypes", [(jnp.bfloat16, jnp.float32, jnp.float32),
                                    (jnp.float32, jnp.bfloat16, jnp.float32),
                                    (jnp.float16, jnp.float16, jnp.float32)])
def test_mixed_dtypes_promote_and_match_the_promoted_call(implementation, dtypes):
  q, k, v = (Q.astype(d) for d in dtypes)
  out = js.attention.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=implementation)
  assert out.dtype == jnp.float32
  # the same numbers as casting the inputs up front: nothing was rounded to 16 bits
  want = js.attention.dot_product_attention(*(t.astype(jnp.float32) for t in (q, k, v)),
                                            is_causal=True, implementation=implementation)
  np.testing.assert_array_equal(out, want)


def test_one_dtype_keeps_it():
  q = Q.astype(jnp.bfloat16)
  assert js.attention.dot_product_attention(q, q, q).dtype == jnp.bfloat16
