"""A float32 ``q·k`` that overflows to ``-inf`` on the blockwise paths (issue 37).

The dense path reads a ``-inf`` logit as a hidden key (the package's rule): weight 0, left
out of a row's length count n and of its moments. The blockwise paths (``xla_chunked``,
the Pallas kernels) hid it in the softmax-like tiles but, without a bias, kept it in a
class-R row's moments (standardized softmax, NAP: the row came out NaN), and, with or
without a bias, in the length count n of a length-dependent normalizer (ssmax: a finite
answer of another n, 0.03 off the dense path's). Now the class-R rows equal the dense
path's (values and gradients in k and v), and a length-dependent normalizer's row with a
visible ``-inf`` score (and no ``+inf`` one) is NaN in value and gradient, never the
number of another n; the rows without one are unchanged.

Queries 1 and 4 have q_0 = 1e20 and key 0 has k_0 = -2e20: their score with key 0 is
``-inf`` in float32, every other score is ordinary (q_0 = 0 elsewhere, k_0 = 0 on the other
keys). The reference is the dense path (checked against float64 numpy by the posinf
tests), with the tolerances of tests/attention/test_posinf_overflow.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from kernels_pallas.backends import INTERPRET_ENV

T = S = 6
N, K, H = 2, 1, 4
ROWS = [1, 4]


def _inputs():
  rng = np.random.default_rng(2)
  q = rng.normal(size=(1, T, N, H))
  k = rng.normal(size=(1, S, K, H))
  v = rng.normal(size=(1, S, K, H))
  q[0, :, :, 0] = 0.0
  q[0, ROWS, :, 0] = 1e20
  k[0, :, 0, 0] = 0.0
  k[0, 0, 0, 0] = -2e20
  bias = rng.normal(size=(1, 1, T, S))
  cot = rng.normal(size=(1, T, N, H))
  return [jnp.asarray(a, jnp.float32) for a in (q, k, v, bias, cot)]


def _run(impl, normalizer, with_bias, grads=True):
  """The output and (with ``grads``) the gradients in k and v of ``sum(out * cot)``."""
  q, k, v, bias, cot = _inputs()

  def loss(k, v, bias):
    out = dpa(q, k, v, bias=bias if with_bias else None, normalizer=normalizer,
              implementation=impl)
    return jnp.sum(out * cot), out

  if not grads:
    return np.asarray(jax.jit(loss)(k, v, bias)[1]), None
  (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(k, v, bias)
  return np.asarray(out), [np.asarray(a) for a in g]


@pytest.fixture
def small_blocks(monkeypatch):
  """Blocks of 4 x 4: T = S = 6 spans two query and two key blocks (with padding)."""
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)


def _check_moments(impl, normalizer, with_bias, grads=True):
  ref_out, ref_grads = _run("xla", normalizer, with_bias, grads)
  out, got_grads = _run(impl, normalizer, with_bias, grads)
  assert np.all(np.isfinite(ref_out)) and np.all(np.isfinite(out))
  np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-5)
  for g, r in zip(got_grads or (), ref_grads or (), strict=True):  # (k's carries q ~ 1e20: relative)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def _check_length_dependent(impl, normalizer, with_bias, grads=True):
  ref_out, _ = _run("xla", normalizer, with_bias, grads=False)
  out, got_grads = _run(impl, normalizer, with_bias, grads)
  hit = np.zeros(out.shape[:-1], bool)
  hit[:, ROWS] = True
  assert np.all(np.isnan(out[hit])), out[hit]        # never the number of another n
  np.testing.assert_allclose(out[~hit], ref_out[~hit], rtol=1e-4, atol=1e-5)
  if got_grads is not None:
    assert np.isnan(got_grads[1]).any()              # ... nor its gradient (v's)


def test_chunked_length_count_refuses_an_overflowing_neginf_score(small_blocks):
  """The values (the old code's finite answer of another n); gradients: the slow sweep."""
  _check_length_dependent("xla_chunked", "ssmax", with_bias=False, grads=False)


# (5 s: the slow sweep only; its standardized_softmax-False-xla_chunked case was NaN before)
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla_chunked", "pallas"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("normalizer", ["standardized_softmax", "nap",
                                        "adaptive_temperature_softmax"])
def test_blockwise_moment_rows_hide_an_overflowing_neginf_score(impl, normalizer, with_bias,
                                                                small_blocks, monkeypatch):
  monkeypatch.setenv(INTERPRET_ENV, "1")
  # the Pallas kernels run no zero-bias pass (its dS would be T x S): the rows whose
  # moments saw the overflowing -inf score are NaN there, never a finite number
  if impl == "pallas" and not with_bias:
    _check_length_dependent(impl, normalizer, with_bias)
  else:
    _check_moments(impl, normalizer, with_bias)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla_chunked", "pallas"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("normalizer", ["ssmax", "affine_softmax", "softplus_l1"])
def test_blockwise_length_count_refuses_an_overflowing_neginf_score(impl, normalizer,
                                                                    with_bias, small_blocks,
                                                                    monkeypatch):
  monkeypatch.setenv(INTERPRET_ENV, "1")
  _check_length_dependent(impl, normalizer, with_bias)
