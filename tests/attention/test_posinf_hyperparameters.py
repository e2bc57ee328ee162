"""Learned (array) hyperparameters on rows with a ``+inf`` score: the blockwise paths give
the dense path's gradient (issue 37).

A row with k visible ``+inf`` logits takes the normalizer's limit (1/k on them for the
default rule; ``α/k + β`` and ``β`` for affine softmax, the clipped limit for clipped
softmax). The dense path differentiates that limit in the hyperparameters; the blockwise
paths (``xla_chunked``, Pallas) replace those rows beside the tiles
(``jaxsoft.attention.posinf``) and used to give them no hyperparameter gradient, so a
learned α of affine softmax got a different (still finite, so silent) gradient on a batch
with a ``+inf`` bias. The reference is the dense path (which the posinf tests check
against float64 numpy); the values and the q, k, v and bias gradients are compared too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from kernels_pallas.backends import INTERPRET_ENV
from tests.attention.test_posinf_bias import _inputs

N = 2  # query heads of tests.attention.test_posinf_bias._inputs

# Per-head hyperparameters [N, 1, 1] (learned values are arrays, always traced).
CASES = {
    "affine_softmax": {"alpha": (0.7, 1.3)},
    "clipped_softmax": {"zeta": (1.2, 1.05), "gamma": (-0.1, -0.3)},
    "softmax_sink": {"sink_logit": (0.3, -1.0)},
    "entmax": {"alpha": (1.3, 1.7)},
    "ssmax": {"s": (0.8, 1.2)},
    "softmax_n": {"n": (1.0, 0.5)},
}


@pytest.fixture
def small_blocks(monkeypatch):
  """Blocks of 4 x 4: T = S = 6 spans two query and two key blocks (with padding)."""
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)


def _run(impl, normalizer):
  q, k, v, bias, cot = _inputs()
  hp = {name: jnp.asarray(np.reshape(val, (N, 1, 1)), jnp.float32)
        for name, val in CASES[normalizer].items()}

  def loss(hp, q, k, v, bias):
    out = dpa(q, k, v, bias=bias, is_causal=True, normalizer=normalizer,
              normalizer_params=hp, implementation=impl)
    return jnp.sum(out * cot), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
      hp, *(jnp.asarray(a, jnp.float32) for a in (q, k, v, bias)))
  return out, grads


def _check(impl, normalizer):
  ref_out, ref_grads = _run("xla", normalizer)
  out, grads = _run(impl, normalizer)
  # float32 paths that differ in summation order and blocking over <= 6 keys: 1e-5
  # relative to O(1) values and gradients; the missing +inf rows' share of a
  # hyperparameter's gradient is O(1) (e.g. 2.22 against 0.66 for affine softmax's α).
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-4, atol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_chunked_affine_softmax_alpha_gradient_on_posinf_rows(small_blocks):
  _check("xla_chunked", "affine_softmax")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla_chunked", "pallas"])
@pytest.mark.parametrize("normalizer", sorted(CASES))
def test_blockwise_hyperparameter_gradients_match_dense(impl, normalizer, small_blocks,
                                                        monkeypatch):
  monkeypatch.setenv(INTERPRET_ENV, "1")
  _check(impl, normalizer)
