"""Feature A32, MALA, magnitude-aware linear attention (:func:`jaxsoft.linear.mala`): against
the paper's weights written per query (float64), the three forms against each other with
gradients, decoding steps against the full call, and the magnitude the paper restores (the
weights sum to one; scaling q sharpens them)."""

import functools

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
  if state:   # [[Σφ(k)v^T, Σφ(k)], [Σv^T, n]] of 3 earlier tokens
    S = 0.5 * jax.random.normal(ks[4], (B, N, K, V))
    z = jax.random.uniform(ks[5], (B, N, K), minval=0.5, maxval=2.0)
    args["initial_state"] = jnp.concatenate(
        [jnp.concatenate([S, z[..., None]], -1),
         jnp.concatenate([S[:, :, :1], jnp.full((B, N, 1, 1), 3.0)], -1)], -2)
  return args


def _call(args, **kw):
  a = dict(args)
  return linear.mala(a.pop("q"), a.pop("k"), a.pop("v"), output_final_state=True, **a, **kw)


def test_matches_float64_reference():
  """T = 11, chunks of 4, segments: Fan et al.'s weights per query."""
  cases.assert_matches_reference(
      _call, _inputs(state=False), lambda a, seg: reference.mala(
          a["q"], a["k"], a["v"], scale=K ** -0.5, segment_ids=seg),
      segment_ids=cases.segments(B, T))


def test_forms_agree_with_gradients():
  """The three forms of the augmented recurrence (two query sets): outputs, the augmented
  final state and every gradient, with segments and an initial state."""
  cases.assert_forms_agree(_call, _inputs(), ("recurrent", "parallel", "chunked"),
                           segment_ids=cases.segments(B, T, seed=1), key=jax.random.key(7))


def test_step_matches_full_call():
  args = _inputs(T=5)
  step = lambda x, state: linear.mala_step(x["q"], x["k"], x["v"], state)
  cases.assert_steps_match(step, {n: args[n] for n in "qkv"}, args["initial_state"],
                           *cases.chunked(_call, args, chunk_size=2))


def test_mala_weights_sum_to_one_and_scaling_q_sharpens():
  """A constant v comes back unchanged (the weights sum to 1); scaling q by 4 changes the
  output (the magnitude is kept), while ReLU linear attention is invariant to it."""
  args = _inputs(T=6, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  o = jax.jit(functools.partial(linear.mala, eps=1e-9))(q, k, jnp.full_like(v, 2.5))
  np.testing.assert_allclose(o, 2.5, rtol=1e-4)
  relu = jax.jit(lambda x: linear.linear_attention(x, k, v, feature_map="relu", eps=1e-9))
  np.testing.assert_allclose(relu(4.0 * q), relu(q), rtol=1e-4, atol=1e-5)
  mala = jax.jit(functools.partial(linear.mala, feature_map="relu"))
  spread = lambda x: float(jnp.std(mala(x, k, v)))
  assert spread(4.0 * q) > 1.5 * spread(q)


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`initial_state`", lambda: linear.mala(_q, _q, _v, initial_state=np.zeros((1, 2, 3, 2)))),
    ("`state`", lambda: linear.mala_step(_q[:, 0], _q[:, 0], _v[:, 0], np.zeros((1, 2, 3, 2)))),
    ("`feature_map`", lambda: linear.mala(_q, _q, _v, feature_map="softmax")),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
