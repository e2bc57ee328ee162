"""Feature A33, Lightning Attention / TransNormer (:func:`jaxsoft.linear.lightning_attention`):
against the decayed recurrence written as a float64 loop, the three forms against each
other with gradients, decoding steps against the full call, the decay mask of the paper
(λ = 1 is plain causal linear attention), and the released models' decay schedule."""

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
  args["g"] = jax.random.uniform(ks[3], (N,), minval=-1.0, maxval=0.0)
  if state:
    args["initial_state"] = 0.5 * jax.random.normal(ks[4], (B, N, K, V))
  return args


def _call(args, **kw):
  a = dict(args)
  return linear.lightning_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"),
                                    output_final_state=True, **a, **kw)


def test_matches_float64_reference():
  """T = 11, chunks of 4, segments: the decayed recurrence as a loop."""
  cases.assert_matches_reference(
      _call, _inputs(state=False), lambda a, seg: reference.recurrence(
          a["q"], a["k"], a["v"], g=np.broadcast_to(a["g"], (B, T, N)), segment_ids=seg)[0],
      segment_ids=cases.segments(B, T))


def test_forms_agree_with_gradients():
  """parallel = recurrent = chunked for a fixed decay per head: outputs, final states and
  every gradient (q, k, v, the decay, the initial state), with segments."""
  cases.assert_forms_agree(_call, _inputs(), ("recurrent", "parallel", "chunked"),
                           segment_ids=cases.segments(B, T, seed=1), key=jax.random.key(7))


def test_step_matches_full_call():
  args = _inputs(T=5)
  step = lambda x, state: linear.lightning_attention_step(x["q"], x["k"], x["v"], state,
                                                          g=args["g"])
  cases.assert_steps_match(step, {n: args[n] for n in "qkv"}, args["initial_state"],
                           *cases.chunked(_call, args, chunk_size=2))


def test_lightning_is_the_decay_mask():
  """``o = ((Q K^T ⊙ M) V) scale``, ``M_tj = λ^{t-j}``: a dense check; g = 0 is plain causal
  linear attention (unnormalised, identity features)."""
  args = _inputs(T=6, state=False)
  q, k, v, g = args["q"], args["k"], args["v"], args["g"]
  t = jnp.arange(6)
  mask = jnp.where(t[:, None] >= t[None, :],
                   jnp.exp(g[:, None, None] * (t[:, None] - t[None, :])[None]), 0.0)   # [N, T, T]
  scores = jnp.einsum("btnk,bsnk->bnts", q, k) * K ** -0.5 * mask[None]   # [B, N, T, T]
  light = jax.jit(linear.lightning_attention)
  np.testing.assert_allclose(light(q, k, v, g), jnp.einsum("bnts,bsnv->btnv", scores, v),
                             rtol=1e-5, atol=1e-5)
  plain = jax.jit(functools.partial(linear.linear_attention, feature_map="identity",
                                    normalize=False))(q, k, v)
  np.testing.assert_allclose(light(q, k, v, jnp.zeros(N)), plain, rtol=1e-5, atol=1e-5)


def test_lightning_decay_schedule():
  """ALiBi slopes (2^{-8i/N}; N = 6: those of 4, then every other one of 8), scaled by
  ``1 - l/(L-1) + 1e-5``; g = None uses it."""
  np.testing.assert_allclose(-linear.lightning_decay(8), 2.0 ** -np.arange(1, 9) * (1 + 1e-5),
                             rtol=1e-6)
  want6 = np.array([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3])
  np.testing.assert_allclose(-linear.lightning_decay(6), want6 * (1 + 1e-5), rtol=1e-6)
  np.testing.assert_allclose(-linear.lightning_decay(4, 3, 4), 1e-5 * 4.0 ** -np.arange(1, 5),
                             rtol=1e-4)
  args = _inputs(T=4, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  np.testing.assert_allclose(*jax.jit(lambda q, k, v: (  # one compilation, not one per op
      linear.lightning_attention(q, k, v, layer_idx=1, num_layers=3),
      linear.lightning_attention(q, k, v, linear.lightning_decay(N, 1, 3))))(q, k, v),
      rtol=1e-6)


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`g`", lambda: linear.lightning_attention(_q, _q, _v, np.zeros((1, 4, 2)))),
    ("`g`", lambda: linear.lightning_attention(_q, _q, _v, np.array([0.1, -1.0]))),
    ("`g`", lambda: linear.lightning_attention_step(_q[:, 0], _q[:, 0], _v[:, 0],
                                                    g=np.zeros(3))),
    ("`num_heads`", lambda: linear.lightning_decay(0)),
    ("`layer_idx`", lambda: linear.lightning_decay(2, 2, 2)),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
