"""Feature A40, Taylor linear attention (:func:`jaxsoft.linear.taylor_linear_attention`,
:func:`jaxsoft.linear.taylor_features`): against the quadratic form with ``exp`` replaced by
its Taylor polynomial (float64), the three forms against each other with gradients, decoding
steps against the full call, and the series converging to softmax attention."""

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
  if state:
    width = 1 + K + K * K
    args["initial_state"] = (0.5 * jax.random.normal(ks[4], (B, N, width, V)),
                             jax.random.uniform(ks[5], (B, N, width), minval=0.5, maxval=2.0))
  return args


def _call(args, **kw):
  a = dict(args)
  return linear.taylor_linear_attention(a.pop("q"), a.pop("k"), a.pop("v"),
                                        output_final_state=True, **a, **kw)


def test_matches_float64_reference():
  """T = 11, chunks of 4, segments: the quadratic form with weights ``P_2(scale q·k)``."""
  weight = reference.taylor_weight(2, K ** -0.5)
  cases.assert_matches_reference(
      _call, _inputs(state=False), lambda a, seg: reference.weighted_causal_attention(
          weight, a["q"], a["k"], a["v"], segment_ids=seg), segment_ids=cases.segments(B, T))


def test_forms_agree_with_gradients():
  """The three forms on the order-2 features (13 per key): outputs, final states ``(S, z)``
  and every gradient, with segments and an initial state."""
  cases.assert_forms_agree(_call, _inputs(), ("recurrent", "parallel", "chunked"),
                           segment_ids=cases.segments(B, T, seed=1), key=jax.random.key(7))


def test_step_matches_full_call():
  args = _inputs(T=5)
  step = lambda x, state: linear.taylor_linear_attention_step(x["q"], x["k"], x["v"], state)
  cases.assert_steps_match(step, {n: args[n] for n in "qkv"}, args["initial_state"],
                           *cases.chunked(_call, args, chunk_size=2))


@pytest.mark.parametrize("order", [pytest.param(0, marks=pytest.mark.slow),
                                   pytest.param(1, marks=pytest.mark.slow), 3])
def test_taylor_order_is_the_truncated_series(order):
  """Order m equals the quadratic attention with ``exp`` replaced by ``Σ_{i<=m} s^i/i!``
  (small scores, so odd orders keep a positive denominator)."""
  args = _inputs(T=7, state=False)
  q, k, v = 0.5 * args["q"], 0.5 * args["k"], args["v"]
  o = jax.jit(functools.partial(linear.taylor_linear_attention, order=order, scale=0.5))(q, k, v)
  want = reference.weighted_causal_attention(reference.taylor_weight(order, 0.5), q, k, v)
  np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_taylor_converges_to_softmax_attention():
  """For moderate scores the error against causal softmax attention falls with the order
  faster and faster (``~ s^{m+1}/(m+1)!``: the error ratios shrink), to < 5e-3 by order 8."""
  args = _inputs(T=6, state=False)
  q, k, v = 0.7 * args["q"], 0.7 * args["k"], args["v"]    # |scores| <~ 2
  logits = jnp.einsum("btnk,bsnk->bnts", q, k) * K ** -0.5
  logits = jnp.where(jnp.tril(jnp.ones((6, 6), bool)), logits, -jnp.inf)
  soft = jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(logits, axis=-1), v)
  errors = [float(jnp.max(jnp.abs(linear.taylor_linear_attention(q, k, v, order=m) - soft)))
            for m in range(2, 9, 2)]
  ratios = [b / a for a, b in zip(errors, errors[1:], strict=False)]
  assert all(r < 1 for r in ratios) and ratios == sorted(ratios, reverse=True), errors
  assert errors[-1] < 5e-3, errors


@pytest.mark.slow
def test_taylor_feature_map_registered():
  """``feature_map="taylor"`` is order 2 on unscaled q: ``taylor_linear_attention(scale=1)``."""
  args = _inputs(T=5, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  np.testing.assert_allclose(linear.linear_attention(q, k, v, feature_map="taylor"),
                             linear.taylor_linear_attention(q, k, v, scale=1.0),
                             rtol=1e-5, atol=1e-5)


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`order`", lambda: linear.taylor_linear_attention(_q, _q, _v, order=-1)),
    ("`order`", lambda: linear.taylor_features(_q, order=1.5)),
    ("`eps`", lambda: linear.taylor_linear_attention_step(_q[:, 0], _q[:, 0], _v[:, 0], eps=0)),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
