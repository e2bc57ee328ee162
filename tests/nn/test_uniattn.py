"""A22 UniAttnCompensation (jaxsoft/nn/_uniattn.py): the module that holds UniAttn's W_c.

Oracles: at init (W_c = 0) the output is ``jaxsoft.attention.uniattn`` without compensation
(itself tested in tests/attention), and the gradient of W_c is the float64 ``X^T ct`` of
``o_l = A V_l + X_l W_{c,l}`` written out in numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsoft.attention import uniattn
from jaxsoft.nn import UniAttnCompensation
from tests.helpers import check_raises, normal

B, T, N, K, HV = 2, 5, 4, 2, 2


def test_uniattn_compensation_starts_at_map_sharing_and_learns_w_c():
  a = jax.nn.softmax(normal(0, (B, N, T, 4)), -1)
  values, x = normal(1, (2, B, 4, K, HV)), normal(2, (2, B, T, 3))
  comp = UniAttnCompensation(2, 3, N, HV)
  assert comp.w_c.shape == (2, 3, N, HV)
  np.testing.assert_array_equal(np.asarray(comp(a, values, x)), np.asarray(uniattn(a, values)))
  ct = normal(3, (2, B, T, N, HV))
  grads = nnx.grad(lambda m: jnp.sum(m(a, values, x) * ct))(comp)
  np.testing.assert_allclose(np.asarray(grads.w_c[...]), np.einsum(
      "lbtc,lbtnh->lcnh", np.asarray(x, np.float64), np.asarray(ct, np.float64)),
      atol=1e-4, rtol=1e-5)


def test_uniattn_compensation_errors_name_the_argument():
  check_raises(("`head_dim`", lambda: UniAttnCompensation(2, 3, N, 0)),
               ("`num_layers`", lambda: UniAttnCompensation(True, 3, N, HV)),
               ("`in_features`", lambda: UniAttnCompensation(2, 1.5, N, HV)))
