"""The row kernels (two_pass, quantized, lut, single_pass, softmax_top_k) follow the shared
rule for ``where`` (``jaxsoft._validation.boolean_mask``): a non-boolean mask is refused
with a message naming the kernel and the argument, never cast to bool (a float 0/1 mask
would otherwise mean "keep every nonzero", and a mask of weights silently becomes all-True).

Issue 37: ``kernels_pallas.backends.hide_masked`` used to cast ``where`` with
``jnp.asarray(where, bool)``; these calls returned a result.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kernels_pallas import fused_top_k, quantized, single_pass, two_pass

_KERNELS = {
    "two_pass_softmax": lambda x, m: two_pass.two_pass_softmax(x, where=m, interpret=True),
    "quantized_softmax": lambda x, m: quantized.quantized_softmax(x, where=m, interpret=True),
    "lut_softmax": lambda x, m: quantized.lut_softmax(x, where=m, interpret=True),
    "single_pass_softmax": lambda x, m: single_pass.single_pass_softmax(x, where=m,
                                                                        interpret=True),
    "softmax_top_k": lambda x, m: fused_top_k.softmax_top_k(x, 2, where=m, interpret=True),
}


@pytest.mark.parametrize("name", sorted(_KERNELS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_non_boolean_where_is_refused(name, dtype):
  x = jnp.zeros((2, 8), jnp.float32)
  m = jnp.ones((2, 8), dtype)
  with pytest.raises(ValueError, match=rf"kernels_pallas\.{name}: `where` must be boolean"):
    _KERNELS[name](x, m)
