"""A25 InfSA (jaxsoft/nn/_infinite.py): Infinite Self-Attention with a learned per-head discount.

Oracles: the discount is sigmoid of its free parameter (``gamma_init`` exactly at init), the
output is ``jaxsoft.attention.infsa_attention`` at that gamma (itself tested against numpy in
tests/attention), and the truncated series ``sum_t gamma^t A^t V`` written out in numpy
float64 for a causal softmax map.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsoft.attention import infsa_attention, linear_infsa_attention
from jaxsoft.nn import InfSA
from tests.helpers import check_raises, make_qkv

B, T, N, K, H, HV = 2, 5, 4, 2, 3, 2


def _np_series(q, k, v, gamma, terms):
  """sum_{t=1}^{terms} gamma^t A^t V, A the causal softmax map (GQA by repetition)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  G = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
  a = np.exp(logits - logits.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  out, walk = 0.0, np.transpose(v, (0, 2, 1, 3))  # [B, N, T, Hv]
  for t in range(1, terms + 1):
    walk = a @ walk
    out = out + gamma ** t * walk
  return np.transpose(out, (0, 2, 1, 3))


def test_infsa_holds_the_discount_and_computes_the_series():
  q, k, v = make_qkv(4, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  mod = InfSA(N, gamma_init=0.3, terms=4, is_causal=True)
  np.testing.assert_allclose(np.asarray(mod.gamma), 0.3, rtol=1e-6)
  out = mod(q, k, v)
  want = infsa_attention(q, k, v, gamma=jnp.full((N,), 0.3), terms=4, is_causal=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)
  np.testing.assert_allclose(np.asarray(out), _np_series(q, k, v, 0.3, 4), atol=1e-5)
  g = nnx.grad(lambda m: jnp.sum(m(q, k, v) ** 2))(mod)
  assert np.all(np.isfinite(np.asarray(g.gamma_logit[...])))
  assert np.all(np.asarray(g.gamma_logit[...]) != 0)


def test_infsa_errors_name_the_argument():
  check_raises(("`gamma_init`", lambda: InfSA(N, gamma_init=1.0)),
               ("`num_heads`", lambda: InfSA(0)),
               ("`gamma`", lambda: InfSA(N, gamma=0.5)))


def test_infsa_linear_mode_is_linear_infsa_at_the_learned_gamma():
  q, k, v = make_qkv(5, B=B, T=T, N=N, K=K, H=H, Hv=HV)
  lengths = jnp.array([5, 2])
  mod = InfSA(N, gamma_init=0.3, linear=True, iterations=2)
  out = mod(q, k, v, key_value_seq_lengths=lengths)
  want = linear_infsa_attention(q, k, v, gamma=jnp.full((N,), 0.3), iterations=2,
                                key_value_seq_lengths=lengths)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)
  g = nnx.grad(lambda m: jnp.sum(m(q, k, v) ** 2))(mod)
  assert np.all(np.isfinite(np.asarray(g.gamma_logit[...])))
  assert np.all(np.asarray(g.gamma_logit[...]) != 0)
  check_raises(("`terms`", lambda: InfSA(N, linear=True, terms=3)),
               ("`iterations`", lambda: InfSA(N, iterations=2)),
               ("`iterations`", lambda: InfSA(N, linear=True, iterations=0)),
               ("`linear`", lambda: InfSA(N, linear=1)),
               ("`mask`", lambda: mod(q, k, v, None, jnp.ones((1, 1, T, T), bool))))
