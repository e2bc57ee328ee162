"""A24 tensor_attention (jaxsoft/attention/_tensor.py).

Oracles: numpy float64 from the paper's formula (explicit loops over key pairs), standard
attention for the reduction (``key2 = value2 = 1``), and float64 finite differences.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention import dot_product_attention, tensor_attention
from tests.helpers import check_raises, normal

B, T, N, H = 2, 6, 2, 4


def _np_tensor(q, k1, k2, v1, v2, causal):
  q, k1, k2, v1, v2 = (np.asarray(a, np.float64) for a in (q, k1, k2, v1, v2))
  S = k1.shape[1]
  out = np.zeros(q.shape[:3] + (v1.shape[-1],))
  for b, i, n in np.ndindex(*q.shape[:3]):
    logits, vals = [], []
    for j in range(S):
      for k in range(S):
        if causal and (j > i or k > i):
          continue
        logits.append(np.sum(q[b, i, n] * k1[b, j, n] * k2[b, k, n]) / np.sqrt(H))
        vals.append(v1[b, j, n] * v2[b, k, n])
    w = np.exp(np.array(logits) - max(logits))
    out[b, i, n] = (w / w.sum()) @ np.array(vals)
  return out


def test_tensor_attention_matches_pair_loops_and_reduces_to_attention():
  args = [normal(i, (B, T, N, H)) for i in range(5)]
  for causal in (False, True):
    out = jax.jit(functools.partial(tensor_attention, is_causal=causal))(*args)
    np.testing.assert_allclose(np.asarray(out, np.float64), _np_tensor(*args, causal),
                               atol=1e-5, rtol=1e-5)
  q, k1, _, v1, _ = args
  ones = jnp.ones_like(k1)
  out = jax.jit(functools.partial(tensor_attention, is_causal=True))(q, k1, ones, v1, ones)
  chex.assert_trees_all_close(out, jax.jit(functools.partial(
      dot_product_attention, is_causal=True))(q, k1, v1), atol=1e-5, rtol=1e-5)
  lo = jax.jit(tensor_attention)(*(a.astype(jnp.bfloat16) for a in args))
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float64), _np_tensor(
      *(a.astype(jnp.bfloat16).astype(jnp.float32) for a in args), False), atol=3e-2, rtol=3e-2)


def test_tensor_attention_gradients_finite_differences():
  with jax.enable_x64(True):
    args = [normal(i, (1, 3, 1, 2)).astype(jnp.float64) for i in range(5)]
    jax.test_util.check_grads(jax.jit(functools.partial(tensor_attention, is_causal=True)),
                              args, order=1, modes=("rev",))


def test_errors_name_the_argument():
  q = jnp.zeros((1, 4, 1, 2))
  check_raises(
      ("`key2`", lambda: tensor_attention(q, q, q[:, :3], q, q)),
      ("`value2`", lambda: tensor_attention(q, q, q, q, q[..., :1])),
      ("`query`", lambda: tensor_attention(q[0], q, q, q, q)),
  )
