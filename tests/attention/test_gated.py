"""A07 gated_attention_output (jaxsoft/attention/_gated.py).

Checked against the formula written here (an explicit sigmoid gate) on the output and on
every input cotangent, the open-gate identity and float64 finite differences.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxsoft.attention import gated_attention_output
from tests.attention.reference import assert_fn_close
from tests.helpers import FWD, normal


def test_gated_output_matches_formula():
  y = normal(0, (2, 5, 3, 4))
  x = normal(1, (2, 5, 6))
  w = normal(2, (6, 3, 4), 0.5)
  b = normal(3, (3, 4))

  def ref(y, x, w, b):
    gate = 1.0 / (1.0 + jnp.exp(-(jnp.einsum("btd,dnh->btnh", x, w) + b[None, None])))
    return y * gate

  assert_fn_close(gated_attention_output, ref, (y, x, w, b))


def test_gated_output_headwise_scalar_gate():
  y = normal(4, (2, 5, 3, 4))
  x = normal(5, (2, 5, 6))
  w = normal(6, (6, 3))
  out = gated_attention_output(y, x, w)
  gate = jax.nn.sigmoid(jnp.einsum("btd,dn->btn", x, w))
  chex.assert_trees_all_close(out, y * gate[..., None], **FWD)


def test_gated_output_open_gate_is_identity_and_shrinks():
  y = normal(7, (1, 4, 2, 3))
  x = normal(8, (1, 4, 5))
  w = jnp.zeros((5, 2, 3))
  chex.assert_trees_all_close(gated_attention_output(y, x, w, jnp.full((2, 3), 40.0)), y)
  out = gated_attention_output(y, x, normal(9, (5, 2, 3)))
  assert np.all(np.abs(out) <= np.abs(y))


def test_gated_output_check_grads_f64():
  with jax.enable_x64(True):
    ks = jax.random.split(jax.random.key(0), 4)
    y = jax.random.normal(ks[0], (1, 3, 2, 2), jnp.float64)
    x = jax.random.normal(ks[1], (1, 3, 4), jnp.float64)
    w = jax.random.normal(ks[2], (4, 2, 2), jnp.float64)
    b = jax.random.normal(ks[3], (2, 2), jnp.float64)
    # jit: check_grads evaluates the function many times; one program instead of op by op
    check_grads(jax.jit(gated_attention_output), (y, x, w, b), order=1, modes=("rev",))


@pytest.mark.parametrize("call,arg", [
    (lambda: gated_attention_output(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 5)),
                                    jnp.ones((5, 3, 3))), "w_gate"),
    (lambda: gated_attention_output(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 3, 5)),
                                    jnp.ones((5, 3, 4))), "x"),
])
def test_bad_input_names_the_argument(call, arg):
  with pytest.raises(ValueError, match=arg):
    call()
