"""The Pallas engine's ``return_residual``, against the dense xla path, in both drivers
(interpret mode): the row statistic of each class (``m + log D`` for E and S, 0 for P, the
search's tau for T), ``-inf`` on rows with no visible key, no gradient; class R (none
defined) is refused. Its lowering for both targets: tests/kernels_pallas/test_distance.py.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from jaxsoft import attention
from tests.helpers import sampled
from tests.kernels_pallas.test_distance import KH, KV_LEN, B, H, N, T, _kernel, _xla
from tests.kernels_pallas.test_engine import TRITON_SMALL, inputs

RESIDUAL_CASES = {
    "softmax": {}, "softmax_sink": {"sink_logit": 0.7}, "ssmax": {"s": 0.8},
    "sigmoid": {}, "sparsemax": {}, "top_k_softmax": {"k": 3}, "entmax15": {},
    "top_p_softmax": {"p": 0.8},
}


# by default each class once (E with and without an offset, P, T with and without the gap
# tau) over the two drivers; the full matrix under -m slow
RESIDUAL_MATRIX = [(b, name) for name in RESIDUAL_CASES for b in ("triton", "mosaic_tpu")]
RESIDUAL_DEFAULT = ("triton-softmax", "mosaic_tpu-softmax_sink", "mosaic_tpu-sigmoid",
                    "triton-sparsemax", "mosaic_tpu-top_k_softmax", "triton-top_k_softmax")


@pytest.mark.parametrize("case", sampled(
    RESIDUAL_MATRIX, RESIDUAL_DEFAULT, ids=[f"{b}-{name}" for b, name in RESIDUAL_MATRIX]))
def test_residual_matches_xla_per_class(case):
  """The residual equals the dense path's (the log-sum-exp with the sink's mass, ssmax's
  scaled one, 0 for sigmoid, tau for sparsemax / entmax15 / top-k: the search's tau, not
  the gap tau top-k weighs at), ``-inf`` on the rows with no visible key (0 for class P,
  the sink logit for softmax_sink), with no gradient; the output is the one without the residual."""
  backend, name = case
  params = RESIDUAL_CASES[name]
  q, k, v, _ = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=58)
  kw = dict(normalizer=name, normalizer_params=params, is_causal=True,
            key_value_seq_lengths=KV_LEN)
  # every call jitted: one compilation each, not one per eager op
  out, res = jax.jit(_kernel(backend, return_residual=True, **kw))(q, k, v)
  ref, ref_res = jax.jit(_xla(return_residual=True, **kw))(q, k, v)
  assert res.shape == (B, T, N) and res.dtype == q.dtype
  chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(out, jax.jit(_kernel(backend, **kw))(q, k, v))
  finite = np.isfinite(np.asarray(ref_res))
  np.testing.assert_array_equal(np.isfinite(np.asarray(res)), finite)
  np.testing.assert_allclose(np.asarray(res)[finite], np.asarray(ref_res)[finite], atol=2e-5,
                             rtol=1e-5)
  if name == "sigmoid":
    np.testing.assert_array_equal(np.asarray(res), 0.0)
  elif name == "softmax_sink":  # an empty row keeps the sink's mass: log e^sink
    np.testing.assert_allclose(np.asarray(res[1]), params["sink_logit"], rtol=1e-6)
  else:
    assert not finite[1].any() and finite[0].all()
  grad = jax.jit(jax.grad(lambda q: jnp.sum(jnp.where(
      finite, _kernel(backend, return_residual=True, **kw)(q, k, v)[1], 0.0))))(q)
  np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_residual_unbatched_and_through_the_dispatcher(monkeypatch):
  """[T, N, H] inputs give a [T, N] residual; ``implementation="pallas"`` reaches the
  kernel (a single explicit implementation raises instead of falling back) and returns
  jax.nn's log-sum-exp."""
  monkeypatch.setenv(kp._api.INTERPRET_ENV, "1")
  q, k, v, _ = inputs(b=1, t=T, n=N, kh=N, h=H, seed=59)
  # every call jitted: one compilation each, not one per eager op
  out, res = jax.jit(lambda q, k, v: kp.attention(
      q, k, v, is_causal=True, return_residual=True, interpret=True,
      block_sizes=TRITON_SMALL))(q[0], k[0], v[0])
  assert out.shape == (T, N, H) and res.shape == (T, N)
  got = jax.jit(lambda q, k, v: attention.dot_product_attention(
      q, k, v, is_causal=True, implementation="pallas", return_residual=True))(q, k, v)
  want = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, return_residual=True))(q, k, v)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(res, want[1][0], atol=1e-5, rtol=1e-5)


def test_residual_of_class_r_is_refused_and_bad_flags_raise(monkeypatch):
  monkeypatch.setenv(kp._api.INTERPRET_ENV, "1")
  q, k, v, _ = inputs(b=1, t=T, n=2, kh=2, h=H, seed=60)
  with pytest.raises(NotImplementedError, match="class R"):
    attention.dot_product_attention(q, k, v, normalizer="standardized_softmax",
                                    implementation="pallas", return_residual=True)
  with pytest.raises(ValueError, match="return_residual"):
    kp.attention(q, k, v, return_residual=1, interpret=True)
  with pytest.raises(ValueError, match="score"):
    kp.attention(q, k, v, score="cosine", interpret=True)
