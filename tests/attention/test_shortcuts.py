"""A09 ssmax_attention, A10 entmax_attention and sparsemax_attention
(jaxsoft/attention/_shortcuts.py).

Checked against dense references written here (the SSMax scaling by log n, optax's simplex
projection for sparsemax, a plain float64 bisection for entmax) on the output and on every
input cotangent, and the learned alpha's gradient against central differences.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import (
    entmax_attention,
    softplus_to_range,
    sparsemax_attention,
    ssmax_attention,
)
from tests.attention.reference import (
    apply_weights,
    assert_fn_close,
    causal_mask,
    fox_inputs,
    masked_softmax,
    scaled_logits,
    simplex,
)
from tests.helpers import FWD, normal


def _ssmax_reference(q, k, v, s):
  t = q.shape[1]
  n = jnp.arange(1, t + 1, dtype=jnp.float32)[:, None]  # causal: query i sees i + 1 keys
  z = (s[None, :, None, None] * jnp.log(n)[None, None]) * scaled_logits(q, k)
  return apply_weights(masked_softmax(z, causal_mask(t, t)), v)


def test_ssmax_attention_per_head_s():
  q, k, v, _ = fox_inputs(t=9, n=3)
  s = jnp.array([0.3, 0.9, 1.6])
  f = lambda q, k, v, s: ssmax_attention(q, k, v, s=s, is_causal=True,
                                         implementation="xla_chunked")
  assert_fn_close(f, _ssmax_reference, (q, k, v, s))


def test_ssmax_attention_scalar_s_broadcasts():
  q, k, v, _ = fox_inputs(t=6, n=2)
  # jitted (s stays the Python float): one program each instead of op-by-op dispatch
  out = jax.jit(functools.partial(ssmax_attention, s=0.7, is_causal=True))(q, k, v)
  chex.assert_trees_all_close(out, jax.jit(_ssmax_reference)(q, k, v, jnp.array([0.7, 0.7])),
                              **FWD)


def _entmax_bisect_ref(z, alpha, iters=80):
  """alpha-entmax of the rows of z by plain bisection on tau (float64 numpy)."""
  z = np.asarray(z, np.float64) * (alpha - 1.0)
  lo = z.max(-1, keepdims=True) - 1.0
  hi = z.max(-1, keepdims=True)
  for _ in range(iters):
    tau = (lo + hi) / 2
    mass = (np.maximum(z - tau, 0.0) ** (1.0 / (alpha - 1.0))).sum(-1, keepdims=True)
    lo = np.where(mass >= 1.0, tau, lo)
    hi = np.where(mass >= 1.0, hi, tau)
  p = np.maximum(z - (lo + hi) / 2, 0.0) ** (1.0 / (alpha - 1.0))
  return p / p.sum(-1, keepdims=True)


def test_entmax_attention_per_head_alpha_matches_references():
  q, k, v, _ = fox_inputs(t=6, n=2, seed=30)
  q = 3.0 * q  # sharper logits: sparse rows
  alpha = jnp.array([2.0, 1.5])
  out = entmax_attention(q, k, v, alpha=alpha)
  logits = scaled_logits(q, k)
  w0 = simplex(logits[:, 0])  # alpha = 2: sparsemax
  w1 = _entmax_bisect_ref(logits[:, 1], 1.5)
  w = jnp.stack([w0, jnp.asarray(w1, jnp.float32)], axis=1)
  assert float(jnp.mean(w == 0)) > 0.1  # the test sees exact zeros
  chex.assert_trees_all_close(out, apply_weights(w, v), atol=2e-5, rtol=1e-4)


def test_sparsemax_attention_matches_projection():
  q, k, v, _ = fox_inputs(t=6, n=2, seed=40)
  out = sparsemax_attention(3.0 * q, k, v)
  w = simplex(scaled_logits(3.0 * q, k))
  chex.assert_trees_all_close(out, apply_weights(w, v), atol=2e-5, rtol=1e-4)


def test_learned_alpha_gets_a_gradient():
  q, k, v, _ = fox_inputs(t=6, n=2, seed=50)
  free = jnp.array([0.3, -0.5])

  def loss(free):
    alpha = softplus_to_range(free, 1.0)
    return jnp.sum(entmax_attention(2.0 * q, k, v, alpha=alpha) * normal(51, q.shape))

  g = jax.grad(loss)(free)
  chex.assert_tree_all_finite(g)
  assert np.all(np.abs(np.asarray(g)) > 1e-6), g
  # and it is the right gradient (central differences, float32 with a coarse step)
  for h in range(2):
    e = jnp.zeros(2).at[h].set(1e-2)
    fd = (loss(free + e) - loss(free - e)) / 2e-2
    np.testing.assert_allclose(g[h], fd, rtol=5e-2, atol=1e-3)


@pytest.mark.parametrize("call,arg", [
    (lambda: entmax_attention(jnp.ones((1, 2, 2, 3)), jnp.ones((1, 2, 2, 3)),
                              jnp.ones((1, 2, 2, 3)), alpha=1.0), "alpha"),
    (lambda: ssmax_attention(jnp.ones((1, 2, 2, 3)), jnp.ones((1, 2, 2, 3)),
                             jnp.ones((1, 2, 2, 3)), s=jnp.ones(3)), "`s`"),
    (lambda: ssmax_attention(jnp.ones((1, 2, 2, 3)), jnp.ones((1, 2, 2, 3)),
                             jnp.ones((1, 2, 2, 3)), s=1.0, normalizer_params={"s": 2.0}),
     "`s`"),
])
def test_bad_input_names_the_argument(call, arg):
  with pytest.raises(ValueError, match=arg):
    call()
