"""Feature A36, MHLA (:func:`jaxsoft.linear.mhla`): both forms against the reconstructed [R]
block-mixed weights (float64) with the gradients of q, k, v and C agreeing between them,
C = 1 being linear attention, and the rank bound that MHLA lifts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests.linear import cases, reference

B, T, N, K, V = 2, 11, 3, 4, 3


def _qkv(T=T, seed=0):
  return cases.random_qkv(jax.random.split(jax.random.key(seed), 10), B, T, N, K, V,
                          unit_keys=True)


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_mhla_matches_reference_and_forms_agree(causal):
  """T = 11 in blocks of 4 (3 blocks, the last short), C > 0 per head: both forms against
  the float64 weights, and the gradients of q, k, v and C agree between the forms."""
  a = _qkv(seed=14)
  C = jax.random.uniform(jax.random.key(15), (N, 3, 3), minval=0.1, maxval=2.0)
  w = jax.random.normal(jax.random.key(16), a["v"].shape)
  want = reference.mhla(reference.elu1(a["q"]), reference.elu1(a["k"]), a["v"], C,
                        block=4, causal=causal)

  def loss(form, q, k, v, C):
    o = linear.mhla(q, k, v, C, block_size=4, causal=causal, implementation=form)
    return jnp.sum(o * w), o

  results = {f: jax.jit(jax.value_and_grad(functools.partial(loss, f), argnums=(0, 1, 2, 3),
                                           has_aux=True))(a["q"], a["k"], a["v"], C)
             for f in ("parallel", "chunked")}
  for form, ((_, o), _) in results.items():
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-5, err_msg=form)
  for got, ref in zip(results["chunked"][1], results["parallel"][1], strict=True):
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(ref))))


def test_mhla_all_ones_is_linear_attention_and_raises_the_rank():
  """C = 1 is vanilla linear attention; a non-uniform C gives an attention matrix of rank
  above the feature dimension K' = K (vanilla linear attention's bound)."""
  a = _qkv(T=16, seed=17)
  q, k, v = a["q"], a["k"], a["v"]
  ones = jnp.ones((4, 4))
  np.testing.assert_allclose(jax.jit(functools.partial(linear.mhla, block_size=4))(q, k, v, ones),
                             jax.jit(linear.linear_attention)(q, k, v), rtol=1e-5, atol=1e-5)
  C = jax.random.uniform(jax.random.key(18), (4, 4), minval=0.1, maxval=2.0)
  fq, fk = reference.elu1(q[0, :, 0]), reference.elu1(k[0, :, 0])
  blk = np.arange(16) // 4
  plain = fq @ fk.T
  weights = plain * np.asarray(C, np.float64)[blk][:, blk]
  rank = lambda x: int(np.linalg.matrix_rank(x, tol=1e-9 * np.linalg.norm(x, 2)))
  assert rank(plain) <= K < rank(weights), (rank(plain), rank(weights))


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`mixing`", lambda: linear.mhla(_q, _q, _v, np.ones((3, 3)), block_size=2)),
    ("`block_size`", lambda: linear.mhla(_q, _q, _v, np.ones((1, 1)), block_size=0)),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
