"""softplus_to_range, softplus_from_range (jaxsoft/attention/_parameters.py).

The round trip, the range kept at extreme free values, and the error naming the argument.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import softplus_from_range, softplus_to_range


def test_softplus_parameterisation_round_trip_and_range():
  for low, margin in ((0.0, 0.0), (1.0, 1e-3)):
    y = jnp.array([low + margin + 1e-3, low + 0.5, low + 3.0, low + 40.0])
    z = softplus_from_range(y, low, margin)
    chex.assert_trees_all_close(softplus_to_range(z, low, margin), y, rtol=1e-5)
    extreme = softplus_to_range(jnp.array([-1e4, -100.0, 0.0, 1e4]), low, margin)
    assert np.all(np.asarray(extreme) >= low + margin) and np.all(np.isfinite(extreme))
  assert float(softplus_to_range(-1e4, 1.0, 1e-3)) > 1.0


@pytest.mark.parametrize("call,arg", [
    (lambda: softplus_from_range(0.5, 1.0), "value"),
])
def test_bad_input_names_the_argument(call, arg):
  with pytest.raises(ValueError, match=arg):
    call()
