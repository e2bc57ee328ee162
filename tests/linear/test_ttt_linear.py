"""Feature A39, TTT-Linear (:func:`jaxsoft.linear.ttt_linear`): against mini-batch gradient
descent written out as a float64 loop, the recurrent and dual (chunked) forms against each
other with every gradient, decoding steps against the full call, and online gradient descent
(mini-batches of one token) being the delta rule."""

import functools

import jax
import numpy as np
import pytest

from jaxsoft import linear
from tests.linear import cases, reference

B, T, N, K, V = 2, 11, 3, 4, 3


def _inputs(T=T, seed=0):
  ks = jax.random.split(jax.random.key(seed), 10)
  a = cases.random_qkv(ks, B, T, N, K, V, unit_keys=True)
  a["eta"] = jax.random.uniform(ks[3], (B, T, N), minval=0.1, maxval=1.0)
  a["initial_state"] = 0.5 * jax.random.normal(ks[4], (B, N, K, V))
  return a


def _call(a, **kw):
  """The shared call convention: ``chunk_size`` is the mini-batch size, there are no
  segments and no parallel form (the dual form stands in)."""
  a = dict(a)
  kw.pop("segment_ids", None)
  if kw.get("implementation") == "parallel":
    kw["implementation"] = "chunked"
  kw["mini_batch_size"] = kw.pop("chunk_size", 4)
  return linear.ttt_linear(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("eta"),
                           output_final_state=True, **a, **kw)


def test_matches_float64_reference():
  """T = 11, mini-batches of 4, an initial state."""
  cases.assert_matches_reference(
      _call, _inputs(), lambda a, _: reference.ttt_linear(
          a["q"], a["k"], a["v"], a["eta"], mini_batch_size=4,
          initial_state=a["initial_state"])[0], segment_ids=None)


@pytest.mark.parametrize("with_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_forms_agree_with_gradients(with_parallel):
  """Outputs, final states and the gradients of q, k, v, eta and the initial state agree
  between the recurrent and the dual form (there is no parallel form: ``with_parallel``
  runs the same check)."""
  del with_parallel
  cases.assert_forms_agree(_call, _inputs(seed=1), ("recurrent", "chunked"), segment_ids=None,
                           key=jax.random.key(3))


def test_ttt_online_gradient_descent_is_the_delta_rule():
  """Mini-batches of one token: online GD on ½‖W^T k - v‖² is the delta rule with β = η."""
  a = _inputs(seed=4)

  @jax.jit
  def outputs(a):
    ttt = functools.partial(linear.ttt_linear, a["q"], a["k"], a["v"], a["eta"],
                            initial_state=a["initial_state"])
    return (ttt(mini_batch_size=1, output_final_state=True), ttt(mini_batch_size=4),
            linear.delta_rule(a["q"], a["k"], a["v"], a["eta"], output_final_state=True,
                              initial_state=a["initial_state"], implementation="recurrent"))

  (o, W), o4, (o_d, W_d) = outputs(a)
  np.testing.assert_allclose(o, o_d, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(W, W_d, rtol=1e-5, atol=1e-5)
  assert not np.allclose(o4, o, atol=1e-3)   # larger mini-batches are a different model


def test_ttt_step_matches_full_call():
  a = _inputs(T=7, seed=5)
  o, W = jax.jit(functools.partial(linear.ttt_linear, mini_batch_size=3,
                                   output_final_state=True))(
      a["q"], a["k"], a["v"], a["eta"], initial_state=a["initial_state"])
  step = jax.jit(functools.partial(linear.ttt_linear_step, mini_batch_size=3))
  state = cases.assert_steps_match(
      lambda x, state: step(x["q"], x["k"], x["v"], x["eta"], state),
      {n: a[n] for n in ("q", "k", "v", "eta")},
      (a["initial_state"], a["initial_state"], 0), o, None)
  np.testing.assert_allclose(state[1], W, rtol=1e-5, atol=1e-5)


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)
_g = np.zeros((1, 4, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`eta`", lambda: linear.ttt_linear(_q, _q, _v, -np.ones((1, 4, 2), np.float32))),
    ("`eta`", lambda: linear.ttt_linear(_q, _q, _v, np.ones((1, 4), np.float32))),
    ("`mini_batch_size`", lambda: linear.ttt_linear(_q, _q, _v, _g, mini_batch_size=0)),
    ("`implementation`", lambda: linear.ttt_linear(_q, _q, _v, _g, implementation="parallel")),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
