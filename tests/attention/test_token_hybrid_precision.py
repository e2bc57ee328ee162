"""NAtS-L and Oryx (A46) beyond float32: bf16 inputs against the float64 loop of
tests/attention/test_token_hybrid.py (on the same bf16-rounded values), and the gradients
of every input in float64 against central differences (jax.test_util.check_grads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.attention.test_token_hybrid import FNS, _inputs, _reference


@pytest.mark.parametrize("kind", ["nats", pytest.param("oryx", marks=pytest.mark.slow)])
def test_bf16_inputs_follow_the_float64_loop(kind):
  q, k, v, g, beta, route = _inputs(2)
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  out = jax.jit(FNS[kind])(*bf, *(jnp.asarray(x, jnp.float32) for x in (g, beta, route)))
  assert out.dtype == jnp.bfloat16
  want = _reference(*(np.asarray(x, np.float64) for x in bf), g, beta, route, kind)
  # the inputs are the bf16 values exactly; what is left is the bf16 rounding of O(1)
  # intermediate and output values (2^-8 relative each), a few of them per step
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=3e-2, rtol=3e-2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nats", "oryx"])
def test_float64_gradients_match_central_differences(kind):
  with jax.enable_x64(True):
    q, k, v, g, beta, route = (jnp.asarray(x, jnp.float64) for x in _inputs(3))
    # a soft route (in (0, 1)): its gradient is that of the mixture, not of a step
    route = 0.25 + 0.5 * route
    f = jax.jit(lambda *a: FNS[kind](*a))
    assert f(q, k, v, g, beta, route).dtype == jnp.float64
    jax.test_util.check_grads(f, (q, k, v, g, beta, route), order=1, modes=("rev",),
                              atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_the_route_gradient_reaches_the_router():
  # the straight-through route: d out / d z = d out / d keep * sigmoid'(z), nonzero
  q, k, v, g, beta, _ = (jnp.asarray(x, jnp.float32) for x in _inputs(4))
  z = jnp.full(g.shape, 0.2)
  grad = jax.jit(jax.grad(lambda z: jnp.sum(js.attention.nats_attention(
      q, k, v, g, beta, js.attention.straight_through_route(z)) ** 2)))(z)
  assert np.all(np.isfinite(grad)) and np.count_nonzero(grad) > grad.size // 2


@pytest.mark.parametrize("kind", ["nats", pytest.param("oryx", marks=pytest.mark.slow)])
def test_float64_inputs_are_computed_in_float64(kind):
  # every token routed to softmax: the float64 loop's softmax readout to rounding (the
  # softmax part was computed in float32 before, 1e-7 off)
  with jax.enable_x64(True):
    q, k, v, g, beta, route = _inputs(5)
    route = np.ones_like(route)
    out = jax.jit(FNS[kind])(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, g, beta, route)))
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, g, beta, route, kind),
                               atol=1e-12, rtol=1e-12)
