"""A float32 ``q·k`` that overflows to ``+inf`` follows the ``+inf`` rule on the blockwise
paths, as it does on the dense path (issue 37).

With ``|q|, |k| ~ 1e20`` some scores are ``+inf`` (and some ``-inf``) in float32. The
dense path gives such a row its normalizer's ``+inf`` limit (1/k on the ``+inf`` keys for
softmax) with a zero logit cotangent. With a bias, ``xla_chunked`` and the Pallas kernels
hid those keys like ``-inf`` ones and, looking for ``+inf`` only in the bias, computed the
row from the remaining keys: a finite, wrong answer (17.3 where the limit gives 2.0).
Without a bias the tiles keep such scores visible and the rows came out NaN (value and
gradient). Compared with the dense path (which the posinf tests check against float64
numpy): values and the gradients in q, k, v and the bias.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from kernels_pallas.backends import INTERPRET_ENV
from tests.attention.test_posinf_bias import SWEEP

T = S = 6
N, K, H = 2, 1, 4


def _inputs():
  """Queries 1 and 4 overflow against every key (q_0 = 1e20, |k_0| in [1e20, 2e20]): +inf
  on the even keys (k_0 > 0), -inf on the odd ones. The other rows have q_0 = 0, so their
  scores are ordinary (a small q_0 would make them saturated one-hot rows whose gradients
  are rounding noise times 1e20)."""
  rng = np.random.default_rng(2)
  q = rng.normal(size=(1, T, N, H))
  k = rng.normal(size=(1, S, K, H))
  v = rng.normal(size=(1, S, K, H))
  q[0, :, :, 0] = 0.0
  q[0, [1, 4], :, 0] = 1e20
  k[0, :, 0, 0] = 1e20 * np.where(np.arange(S) % 2 == 0, 1.0, -1.0) * (1 + rng.random(S))
  bias = rng.normal(size=(1, 1, T, S))
  cot = rng.normal(size=(1, T, N, H))
  return q, k, v, bias, cot


def _run(impl, normalizer, params=None, with_bias=True, is_causal=False):
  q, k, v, bias, cot = _inputs()
  if not with_bias:
    bias = None

  def loss(q, k, v, bias):
    out = dpa(q, k, v, bias=bias, is_causal=is_causal, normalizer=normalizer,
              normalizer_params=params, implementation=impl)
    return jnp.sum(out * cot), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      *(None if a is None else jnp.asarray(a, jnp.float32) for a in (q, k, v, bias)))
  return out, grads


def _check(impl, normalizer, params=None, **kw):
  ref_out, ref_grads = _run("xla", normalizer, params, **kw)
  out, grads = _run(impl, normalizer, params, **kw)
  assert np.all(np.isfinite(np.asarray(ref_out)))
  # float32 paths that differ in summation order and blocking: 1e-4 relative (the k
  # gradient carries q ~ 1e20 from the ordinary rows' products, hence relative); a row
  # computed without its +inf keys differs by O(1).
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-4, atol=1e-5)
  for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
    if r is None:  # no bias
      assert g is None
      continue
    g, r = np.asarray(g), np.asarray(r)
    assert np.all(np.isfinite(g))
    if i == 0 and kw.get("is_causal"):
      # causal row 0 sees key 0 only: its weight is 1 and its dq is 0, computed on both
      # paths as a rounding error of the weight (~1e-7) times k_0 ~ 1e20 (finite, checked
      # above); the other rows and q's other features are compared
      g, r = g[:, 1:], r[:, 1:]
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@pytest.fixture
def small_blocks(monkeypatch):
  """Blocks of 4 x 4: T = S = 6 spans two query and two key blocks (with padding)."""
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)


def test_chunked_softmax_overflowing_scores(small_blocks):
  """The values (the old code's finite wrong answer); the gradients are in the slow sweep."""
  q, k, v, bias, _ = _inputs()
  f = jax.jit(lambda impl, *a: dpa(*a[:3], bias=a[3], implementation=impl), static_argnums=0)
  args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, bias)]
  out, ref = f("xla_chunked", *args), f("xla", *args)
  assert np.all(np.isfinite(np.asarray(ref)))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla_chunked", "pallas"])
@pytest.mark.parametrize("normalizer,params", SWEEP, ids=[s[0] for s in SWEEP])
def test_blockwise_overflowing_scores_match_dense(impl, normalizer, params, small_blocks,
                                                  monkeypatch):
  monkeypatch.setenv(INTERPRET_ENV, "1")
  _check(impl, normalizer, params)


def test_chunked_overflowing_scores_without_bias(small_blocks):
  """No bias (the tiles' fast path): the +inf rows were NaN in value and in every gradient;
  the rows are now found beside the pass (the queries enter it as zeros there). Causal:
  rows 1 and 4 see their +inf keys 0 and 2, and row 4's +inf key 4 too; values and the
  gradients in q, k and v against the dense path."""
  _check("xla_chunked", "softmax", is_causal=True, with_bias=False)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla_chunked", "pallas"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("normalizer,params", SWEEP, ids=[s[0] for s in SWEEP])
def test_blockwise_overflowing_scores_without_bias_match_dense(impl, normalizer, params,
                                                               is_causal, small_blocks,
                                                               monkeypatch):
  monkeypatch.setenv(INTERPRET_ENV, "1")
  _check(impl, normalizer, params, with_bias=False, is_causal=is_causal)
