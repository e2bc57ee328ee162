"""Feature A34, Softmax Linear Attention (:func:`jaxsoft.linear.softmax_linear_attention`,
:func:`jaxsoft.linear.head_gates`): against the reconstructed [R] recurrence as a float64
loop, the forms against each other with every gradient, decoding steps against the full
call, and equal gates reducing to the backbone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests.linear import cases, reference

B, T, N, K, V = 2, 11, 3, 4, 3


def _inputs(T=T, seed=0):
  ks = jax.random.split(jax.random.key(seed), 10)
  a = cases.gated_delta_inputs(ks, B, T, N, K, V)
  a["q_gate_logits"] = jax.random.normal(ks[5], (B, T, N))
  a["k_gate_logits"] = jax.random.normal(ks[6], (B, T, N))
  a["initial_state"] = 0.5 * jax.random.normal(ks[7], (B, N, K, V))
  return a


def _call(a, **kw):
  a = dict(a)
  return linear.softmax_linear_attention(a.pop("q"), a.pop("k"), a.pop("v"),
                                         a.pop("q_gate_logits"), a.pop("k_gate_logits"),
                                         output_final_state=True, **a, **kw)


def test_matches_float64_reference():
  """T = 11, chunks of 4, segments, an initial state; Gated DeltaNet backbone."""
  cases.assert_matches_reference(
      _call, _inputs(), lambda a, seg: reference.softmax_linear_attention(
          a["q"], a["k"], a["v"], a["q_gate_logits"], a["k_gate_logits"], g=a["g"],
          beta=a["beta"], segment_ids=seg, initial_state=a["initial_state"])[0],
      segment_ids=cases.segments(B, T))


@pytest.mark.slow
@pytest.mark.parametrize("with_parallel", [False, True])
def test_forms_agree_with_gradients(with_parallel):
  """Outputs, final states and the gradients of every input (q, k, v, g, beta, the gate
  logits, the initial state) agree between the recurrent and the chunked form (and the
  parallel one). SLA only transforms the inputs of the base recurrence (whose forms
  test_forms.py checks), hence ``slow``."""
  forms = ("recurrent", "chunked") + (("parallel",) if with_parallel else ())
  cases.assert_forms_agree(_call, _inputs(seed=1), forms,
                           segment_ids=cases.segments(B, T, seed=2), key=jax.random.key(3))


@pytest.mark.slow
def test_step_matches_full_call():
  """``softmax_linear_attention_step`` token by token equals the chunked call (T = 5)."""
  a = _inputs(T=5, seed=21)
  step = jax.jit(lambda x, state: linear.softmax_linear_attention_step(
      x["q"], x["k"], x["v"], x["q_gate_logits"], x["k_gate_logits"], state, g=x["g"],
      beta=x["beta"]))
  xs = {n: y for n, y in a.items() if n != "initial_state"}
  cases.assert_steps_match(lambda x, state: step({n: x[n] for n in xs}, state), xs,
                           a["initial_state"],
                           *cases.chunked(_call, a, chunk_size=2))


def test_sla_uniform_gates_are_the_backbone_over_n_squared():
  """Equal gate logits: γ = 1/N for read and write, so the output is Gated DeltaNet's with
  β/N, read scaled by 1/N; without a write gate, simple GLA's output / N. The gates sum to 1."""
  a = _inputs(seed=6)
  q, k, v, g, beta = a["q"], a["k"], a["v"], a["g"], a["beta"]
  zeros = jnp.zeros((B, T, N))

  @jax.jit
  def outputs(q, k, v, g, beta):
    return (linear.softmax_linear_attention(q, k, v, zeros, zeros, g=g, beta=beta),
            linear.gated_delta_rule(q, k, v, g, beta / N) / N,
            linear.softmax_linear_attention(q, k, v, zeros, g=g),
            linear.simple_gla(q, k, v, g) / N)

  o1, want1, o2, want2 = outputs(q, k, v, g, beta)
  np.testing.assert_allclose(o1, want1, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(o2, want2, rtol=1e-5, atol=1e-6)
  gates = linear.head_gates(a["q_gate_logits"], 0.5)
  np.testing.assert_allclose(jnp.sum(gates, -1), 1.0, rtol=1e-6)
  assert bool(jnp.all(gates > 0))


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)
_g = np.zeros((1, 4, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`q_gate_logits`", lambda: linear.softmax_linear_attention(_q, _q, _v, np.zeros((1, 4)))),
    ("`temperature`", lambda: linear.softmax_linear_attention(_q, _q, _v, _g, temperature=0.0)),
    ("`beta`", lambda: linear.softmax_linear_attention(_q, _q, _v, _g, beta=_g + 3.0)),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
