"""Feature A45, Native Hybrid Attention (:func:`jaxsoft.linear.native_hybrid_attention`):
against one softmax over the slots and the window as a float64 loop, the forms against each
other with every gradient, decoding steps against the full call, sliding-window softmax
attention without slots, and causality."""

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
  a["slot_log_gates"] = jax.random.uniform(ks[3], (B, T, N, R + 1), minval=-2.0, maxval=0.0)
  a["initial_state"] = (jax.random.normal(ks[4], (B, N, R + 1, K)),
                        jax.random.normal(ks[5], (B, N, R + 1, V)))
  return a


def _call(a, **kw):
  a = dict(a)
  return linear.native_hybrid_attention(a.pop("q"), a.pop("k"), a.pop("v"),
                                        a.pop("slot_log_gates"), window=3,
                                        output_final_state=True, **a, **kw)


def test_matches_float64_reference():
  """T = 11, chunks of 4, window 3, segments, initial slots."""
  cases.assert_matches_reference(
      _call, _inputs(), lambda a, seg: reference.native_hybrid_attention(
          a["q"], a["k"], a["v"], a["slot_log_gates"], window=3, segment_ids=seg,
          initial_state=a["initial_state"]), segment_ids=cases.segments(B, T))


@pytest.mark.parametrize("with_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_forms_agree_with_gradients(with_parallel):
  """Outputs, final slots and the gradients of q, k, v, the slot gates and the initial slots
  agree between the recurrent and the chunked form (and the parallel one under
  ``-m slow``)."""
  forms = ("recurrent", "chunked") + (("parallel",) if with_parallel else ())
  cases.assert_forms_agree(_call, _inputs(seed=1), forms,
                           segment_ids=cases.segments(B, T, seed=2), key=jax.random.key(3))


def test_step_matches_full_call():
  """``native_hybrid_attention_step`` token by token from the initial slots (and an empty
  window) equals the chunked call (T = 5)."""
  a = _inputs(T=5, seed=21)
  o, S = cases.chunked(_call, a, chunk_size=2)
  step = jax.jit(lambda x, state: linear.native_hybrid_attention_step(
      x["q"], x["k"], x["v"], x["slot_log_gates"], state, window=3))
  K0, V0 = a["initial_state"]
  state = (K0, V0, jnp.zeros((B, 3, N, K)), jnp.zeros((B, 3, N, V)), jnp.zeros((B, 3), bool), 0)
  xs = {n: y for n, y in a.items() if n != "initial_state"}
  state = cases.assert_steps_match(lambda x, state: step({n: x[n] for n in xs}, state), xs,
                                   state, o, None)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5),
               state[:2], S)   # the slots; the window ring is the step's own


def test_nha_without_slots_is_sliding_window_softmax_attention():
  """M = 0 slots: the window alone, i.e. jax.nn.dot_product_attention with a causal local
  window (w = 3), and with w >= T full causal attention; in every form (V = K here, as
  jax.nn requires)."""
  a = _inputs(seed=12)
  q, k, v = a["q"], a["k"], a["q"] + 0.5 * a["k"]
  none = jnp.zeros((B, T, N, 0))

  @jax.jit
  def outputs(q, k, v):
    got = {(w, f): linear.native_hybrid_attention(q, k, v, none, window=w, implementation=f,
                                                  chunk_size=4)
           for w in (3, T) for f in cases.FORMS}
    want = {3: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(2, 0)),
            T: jax.nn.dot_product_attention(q, k, v, is_causal=True)}
    return got, want

  got, want = outputs(q, k, v)
  for (w, form), o in got.items():
    np.testing.assert_allclose(o, want[w], rtol=1e-5, atol=1e-5, err_msg=f"{w} {form}")


def test_nha_is_causal():
  """Changing the last token's k and v changes no earlier output (chunked form)."""
  a = _inputs(seed=13)
  k2, v2 = a["k"].at[:, -1].add(1.0), a["v"].at[:, -1].add(1.0)
  fn = jax.jit(lambda k, v: linear.native_hybrid_attention(
      a["q"], k, v, a["slot_log_gates"], window=3, implementation="chunked", chunk_size=4))
  o1, o2 = fn(a["k"], a["v"]), fn(k2, v2)
  np.testing.assert_allclose(o1[:, :-1], o2[:, :-1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(o1[:, -1], o2[:, -1])


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)
_g = np.zeros((1, 4, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`window`", lambda: linear.native_hybrid_attention(_q, _q, _v, _g[..., None], window=0)),
    ("`slot_log_gates`", lambda: linear.native_hybrid_attention(_q, _q, _v, _g, window=2)),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
