"""A11 TokenSelect's Selection Cache with bf16 inputs: the decode scan of
tests/attention/test_topk_reuse.py against its float64 loop run on the same bf16 values
(the reselect decisions, the kept keys and the outputs), and float64 inputs stay float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.attention.test_topk_reuse import H, _decode, _decode_inputs, _np_decode


@pytest.mark.slow  # a scan compile per dtype: ~3 s each
def test_selection_cache_bf16_follows_the_float64_loop():
  qs, k, v, lengths = _decode_inputs()
  qs, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (qs, k, v))
  out, re, idx = _decode(qs, k, v, lengths, "soft_vote")
  assert out.dtype == jnp.bfloat16
  want, want_re, want_idx = _np_decode(*(np.asarray(a, np.float64) for a in (qs, k, v)),
                                       lengths, 0.9, "soft_vote", H ** -0.5)
  # the cosines are ~0.999 or ~0.2 and the chosen keys' votes well apart: the same
  # decisions; the outputs carry one bf16 rounding of O(1) values (2^-8 relative) and the
  # bf16 logits' (a few 2^-8 of logits ~3 inside the softmax)
  np.testing.assert_array_equal(np.asarray(re), want_re)
  np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(want_idx, -1))
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=5e-2, rtol=5e-2)


@pytest.mark.slow
def test_selection_cache_float64_stays_float64():
  with jax.enable_x64(True):
    qs, k, v, lengths = _decode_inputs()
    qs, k, v = (jnp.asarray(a, jnp.float64) for a in (qs, k, v))
    out, _, _ = _decode(qs, k, v, lengths, "soft_vote")
    assert out.dtype == jnp.float64
    want = _np_decode(qs, k, v, lengths, 0.9, "soft_vote", H ** -0.5)[0]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=1e-12)
