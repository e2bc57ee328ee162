"""jaxsoft.testing.weight_probe: an attention call on its (q, k, v) returns the weight row."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15", "softpick"])
def test_probe_output_is_the_normalizer_of_the_scores(normalizer):
  z = jnp.array([2.0, 1.5, -1.0, 0.25])
  q, k, v = js.testing.weight_probe(z)
  out = js.attention.dot_product_attention(q, k, v, scale=1.0, normalizer=normalizer)
  np.testing.assert_allclose(out[0, 0, 0], js.normalizers.get(normalizer)(z), rtol=1e-5,
                             atol=1e-6)


def test_probe_keeps_the_dtype():
  q, k, v = js.testing.weight_probe(jnp.array([1.0, 0.0], jnp.bfloat16))
  assert q.dtype == k.dtype == v.dtype == jnp.bfloat16
  assert (q.shape, k.shape, v.shape) == ((1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 1, 2))


@pytest.mark.parametrize("bad", [jnp.ones((2, 2)), jnp.zeros((0,)), jnp.array([1, 2])])
def test_probe_rejects_what_is_not_a_float_row(bad):
  with pytest.raises(ValueError, match="weight_probe: `scores`"):
    js.testing.weight_probe(bad)
