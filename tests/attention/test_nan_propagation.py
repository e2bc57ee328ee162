"""A NaN logit makes its attention row NaN on every path, as on the dense one (issue 37).

jax.nn's rule, which the dense path follows: a NaN at a visible logit (from q, k or the
bias) makes the row NaN. Two paths returned a plausible finite row instead:
``xla_chunked`` and the Pallas kernels read visibility as ``logit > -inf``, so a NaN
*bias* entry hid its key (the row came out finite); the Triton driver's threshold pass
(sparsemax, entmax) found no live key block once the row max was NaN and returned zeros
for a NaN in k. The check compares the NaN pattern of each path's output with the dense
path's, and the finite entries with the dense values. Default: the two broken cases on
the paths that had them; ``-m slow``: the whole matrix.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from kernels_pallas import _api as kernels_api
from tests.helpers import make_qkv

q, k, v = make_qkv(0, B=1, T=4, S=6, N=2, K=1, H=8)
NAN_BIAS = jnp.zeros((1, 2, 4, 6)).at[0, 0, 1, 2].set(jnp.nan)  # one row of head 0
NAN_KEY = k.at[0, 2, 0, 1].set(jnp.nan)                          # every row sees it

DEFAULT = {("xla_chunked", "softmax", "bias"), ("pallas_triton", "sparsemax", "bias"),
           ("pallas_triton", "sparsemax", "key")}
CASES = [pytest.param(impl, norm, where, id=f"{impl}-{norm}-{where}",
                      marks=() if (impl, norm, where) in DEFAULT else pytest.mark.slow)
         for impl in ("xla_chunked", "pallas_triton", "pallas_mosaic_tpu")
         for norm in ("softmax", "sparsemax", "entmax15", "sigmoid")
         for where in ("bias", "key")]


@pytest.mark.parametrize("implementation,normalizer,where", CASES)
def test_nan_logit_gives_a_nan_row_as_the_dense_path(implementation, normalizer, where,
                                                     monkeypatch):
  if implementation.startswith("pallas"):
    monkeypatch.setenv(kernels_api.INTERPRET_ENV, "1")
  kk, bias = (k, NAN_BIAS) if where == "bias" else (NAN_KEY, None)
  run = lambda impl: np.asarray(js.attention.dot_product_attention(
      q, kk, v, bias, implementation=impl, normalizer=normalizer))
  want, got = run("xla"), run(implementation)
  assert np.isnan(want).any()  # the case holds a NaN row
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=2e-5, atol=2e-6)
