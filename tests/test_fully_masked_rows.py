"""A fully masked row gives zeros, never NaN, for this round's new functions that take a mask.

(The losses are covered by tests/losses/test_masked_batches.py; these are the kernels, the
pooling and the attention functions.) One row of each input hides everything; the other
rows stay finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
import kernels_pallas as kp

X = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)), jnp.float32)
MASK = jnp.ones((4, 16), bool).at[1].set(False)      # row 1 hides every entry


def _zero_row_rest_finite(out, row=1):
  out = np.asarray(out, np.float64)
  assert np.all(out[row] == 0.0), out[row]
  assert np.all(np.isfinite(out)), out


def test_row_kernels_give_a_zero_row():
  _zero_row_rest_finite(kp.two_pass_softmax(X, MASK, interpret=True))
  _zero_row_rest_finite(kp.quantized_softmax(X, 8, MASK, interpret=True))
  values, _ = kp.softmax_top_k(X, 4, MASK, interpret=True)
  _zero_row_rest_finite(values)


def test_ada_unpool_gives_a_zero_row():
  y = jnp.ones((4,), jnp.float32)
  _zero_row_rest_finite(js.pooling.ada_unpool(y, X, where=MASK))


def test_polar_sink_attention_with_no_visible_key():
  q, k, v = (jnp.asarray(np.random.default_rng(i).normal(size=(1, 4, 2, 8)), jnp.float32)
             for i in (1, 2, 3))
  mask = jnp.ones((1, 2, 4, 4), bool).at[:, :, 2].set(False)   # query 2 sees no key
  attend = jax.jit(lambda q: js.attention.polar_sink_attention(q, k, v, mask=mask))
  c, mu = attend(q)
  c, mu = np.asarray(c), np.asarray(mu)
  assert np.all(c[:, 2] == 0.0) and np.all(mu[:, 2] == 0.0)
  assert np.all(np.isfinite(c)) and np.all(np.isfinite(mu))
  g = jax.jit(jax.grad(lambda q: jnp.sum(attend(q)[0])))(q)
  assert np.all(np.isfinite(np.asarray(g)))


def test_sparse_state_expansion_with_no_visible_key():
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 6, 2, 4)), jnp.float32) for _ in range(3))
  r = jnp.asarray(rng.normal(size=(2, 6, 2, 3)), jnp.float32)
  lens = jnp.array([0, 6])                                     # batch 0 has no key
  f = lambda q: js.attention.sparse_state_expansion(q, k, v, r, top_k=2,
                                                    key_value_seq_lengths=lens, chunk_size=4)
  _zero_row_rest_finite(f(q), row=0)
  assert np.all(np.isfinite(np.asarray(jax.grad(lambda q: jnp.sum(f(q)))(q))))
