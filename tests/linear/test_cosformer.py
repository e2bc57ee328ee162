"""Feature A31, cosFormer (:func:`jaxsoft.linear.cosformer`): against the paper's quadratic
form with the ``cos(π/2 · (i - j)/M)`` re-weighting (float64), the three forms against each
other with gradients, decoding steps against the full call, invariance to scaling q and
continuation from a state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests.linear import cases, reference

B, T, N, K, V = 2, 11, 2, 3, 2


def _inputs(T=T, seed=0, state=True):
  ks = jax.random.split(jax.random.key(seed), 6)
  args = cases.random_qkv(ks, B, T, N, K, V)
  if state:
    args["initial_state"] = (0.5 * jax.random.normal(ks[4], (B, N, 2 * K, V)),
                             jax.random.uniform(ks[5], (B, N, 2 * K), minval=0.5, maxval=2.0))
  return args


def _call(args, **kw):
  a = dict(args)
  return linear.cosformer(a.pop("q"), a.pop("k"), a.pop("v"), max_len=16,
                          output_final_state=True, **a, **kw)


def test_matches_float64_reference():
  """T = 11, chunks of 4, segments: the quadratic form of Qin et al. (M = 16)."""
  weight = reference.cosformer_weight(16)
  cases.assert_matches_reference(
      _call, _inputs(state=False), lambda a, seg: reference.weighted_causal_attention(
          weight, a["q"], a["k"], a["v"], segment_ids=seg), segment_ids=cases.segments(B, T))


def test_forms_agree_with_gradients():
  """The three forms on the position-dependent cos/sin features: outputs, final states and
  every gradient, with segments and an initial state ``(S, z)``."""
  cases.assert_forms_agree(_call, _inputs(), ("recurrent", "parallel", "chunked"),
                           segment_ids=cases.segments(B, T, seed=1), key=jax.random.key(7))


def test_step_matches_full_call():
  args = _inputs(T=5)
  step = lambda x, state: linear.cosformer_step(x["q"], x["k"], x["v"], state,
                                                position=x["t"], max_len=16)
  cases.assert_steps_match(step, {n: args[n] for n in "qkv"}, args["initial_state"],
                           *cases.chunked(_call, args, chunk_size=2))


def test_cosformer_is_invariant_to_scaling_q_and_continues_from_a_state():
  """Scaling q by c > 0 leaves o unchanged (row normalisation); two calls chained by
  ``initial_state`` and ``start_position`` equal one call (same ``max_len``)."""
  args = _inputs(T=8, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  cos = jax.jit(linear.cosformer, static_argnames=("max_len", "start_position",
                                                  "output_final_state"))
  o = cos(q, k, v, max_len=12)
  np.testing.assert_allclose(cos(3.0 * q, k, v, max_len=12), o, rtol=1e-5, atol=1e-6)
  o1, state = cos(q[:, :5], k[:, :5], v[:, :5], max_len=12, output_final_state=True)
  o2 = cos(q[:, 5:], k[:, 5:], v[:, 5:], max_len=12, start_position=5, initial_state=state)
  np.testing.assert_allclose(jnp.concatenate([o1, o2], axis=1), o, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cosformer_default_max_len_is_the_length():
  args = _inputs(T=6, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  np.testing.assert_allclose(linear.cosformer(q, k, v), linear.cosformer(q, k, v, max_len=6),
                             rtol=1e-6)
  want = reference.weighted_causal_attention(reference.cosformer_weight(6), q, k, v)
  np.testing.assert_allclose(linear.cosformer(q, k, v), want, rtol=2e-5, atol=2e-5)


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`max_len`", lambda: linear.cosformer(_q, _q, _v, max_len=2)),
    ("`max_len`", lambda: linear.cosformer(_q, _q, _v, max_len=-1.0)),
    ("`start_position`", lambda: linear.cosformer(_q, _q, _v, start_position=-1)),
    ("`position`", lambda: linear.cosformer_step(_q[:, 0], _q[:, 0], _v[:, 0],
                                                 position=1.0, max_len=4)),
    ("`position`", lambda: linear.cosformer_step(_q[:, 0], _q[:, 0], _v[:, 0],
                                                 position=5, max_len=4)),
    ("`initial_state`", lambda: linear.cosformer(
        _q, _q, _v, initial_state=(np.zeros((1, 2, 3, 2)), np.zeros((1, 2, 3))))),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
