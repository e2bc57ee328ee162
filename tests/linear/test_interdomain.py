"""Feature A41, interdomain attention (:func:`jaxsoft.linear.interdomain_attention`): against
the reconstructed [R] recurrence over the basis as a float64 loop, the forms against each
other with every gradient, decoding steps against the full call, and one basis function
being decayed linear attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests.linear import cases, reference

B, T, N, K, V, R = 2, 11, 3, 4, 3, 2


def _inputs(T=T, seed=0):
  ks = jax.random.split(jax.random.key(seed), 10)
  a = cases.random_qkv(ks, B, T, N, K, V, unit_keys=True)
  a["basis_in"] = jax.random.normal(ks[3], (B, T, N, R))
  a["basis_out"] = jax.random.normal(ks[4], (B, T, N, R))
  a["log_decay"] = jax.random.uniform(ks[5], (N, R), minval=-1.0, maxval=-0.01)
  return a


def _call(a, **kw):
  return linear.interdomain_attention(a["q"], a["k"], a["v"], a["basis_in"], a["basis_out"],
                                      a["log_decay"], output_final_state=True, **kw)


def test_matches_float64_reference():
  """T = 11, chunks of 4, segments; elu + 1 features."""
  cases.assert_matches_reference(
      _call, _inputs(), lambda a, seg: reference.interdomain(
          reference.elu1(a["q"]), reference.elu1(a["k"]), a["v"], a["basis_in"], a["basis_out"],
          a["log_decay"], scale=K ** -0.5, segment_ids=seg), segment_ids=cases.segments(B, T))


@pytest.mark.slow
@pytest.mark.parametrize("with_parallel", [False, True])
def test_forms_agree_with_gradients(with_parallel):
  """Outputs, final states and the gradients of q, k, v, the basis arrays and the decays
  agree between the recurrent and the chunked form (and the parallel one). Interdomain
  attention only transforms the inputs of GLA's recurrence (whose forms test_forms.py
  checks), hence ``slow``."""
  cases.assert_forms_agree(
      _call, _inputs(seed=1), ("recurrent", "chunked", "parallel")[:3 if with_parallel else 2],
      segment_ids=cases.segments(B, T, seed=2), key=jax.random.key(3))


@pytest.mark.slow
def test_step_matches_full_call():
  """``interdomain_attention_step`` token by token from zeros equals the chunked call."""
  a = _inputs(T=5, seed=21)
  step = jax.jit(lambda x, state: linear.interdomain_attention_step(
      x["q"], x["k"], x["v"], x["basis_in"], x["basis_out"], a["log_decay"], state))
  xs = {n: y for n, y in a.items() if n != "log_decay"}
  cases.assert_steps_match(lambda x, state: step({n: x[n] for n in xs}, state), xs, None,
                           *cases.chunked(_call, a, chunk_size=2))


def test_interdomain_one_basis_function_is_decayed_linear_attention():
  """R = 1 with b = ψ = 1: simple GLA on elu+1 features with the constant decay a."""
  a = _inputs(seed=9)
  q, k, v = a["q"], a["k"], a["v"]
  ones = jnp.ones((B, T, N, 1))
  decay = jnp.array([[-0.3], [-0.1], [-0.7]])

  @jax.jit
  def outputs(q, k, v):
    fq, fk = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1
    return (linear.interdomain_attention(q, k, v, ones, ones, decay),
            linear.simple_gla(fq, fk, v, jnp.broadcast_to(decay[:, 0], (B, T, N))))

  o, want = outputs(q, k, v)
  np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)
_g = np.zeros((1, 4, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`basis_in`", lambda: linear.interdomain_attention(_q, _q, _v, _g, _g, np.zeros((2, 1)))),
    ("`log_decay`", lambda: linear.interdomain_attention(
        _q, _q, _v, _g[..., None], _g[..., None], np.ones((2, 1)))),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
