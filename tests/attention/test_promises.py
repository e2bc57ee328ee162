"""The attention entry point's promises on bad and edge-case input: concrete bad values are a
ValueError naming the argument (traced ones are clamped), empty inputs give empty results,
integer inputs are promoted, float64 stays float64 in every length term, and a sink logit far
above the scores has finite gradients in every implementation."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention as dpa
from kernels_pallas import _api as kernels_api
from tests.helpers import make_qkv, value_and_grads

q, k, v = make_qkv(0, B=2, T=6, N=4, K=2, H=8)


@pytest.mark.parametrize("kwargs,argname", [
    ({"local_window_size": -1}, "`local_window_size`"),
    ({"local_window_size": (-3, 0)}, "`local_window_size`"),
    ({"key_value_seq_lengths": jnp.array([-5, 2], jnp.int32)}, "`key_value_seq_lengths`"),
    ({"query_seq_lengths": jnp.array([1, -1], jnp.int32)}, "`query_seq_lengths`"),
    ({"key_value_seq_lengths": -5}, "`key_value_seq_lengths`"),
])
def test_promise_bad_input_local_window_size_and_lengths(kwargs, argname):
  """Each of these returned all-zero attention instead of an error."""
  with pytest.raises(ValueError, match=argname):
    dpa(q, k, v, **kwargs)


def test_promise_bad_input_shifted_window_is_allowed():
  """One negative side is a shifted window, not an empty one: keys i + 1 .. i + 2."""
  out = dpa(q, k, v, local_window_size=(-1, 2), implementation="xla")
  mask = (np.arange(6)[None, :] >= np.arange(6)[:, None] + 1) & (
      np.arange(6)[None, :] <= np.arange(6)[:, None] + 2)
  ref = dpa(q, k, v, mask=jnp.asarray(mask), implementation="xla")
  chex.assert_trees_all_close(out, ref, atol=1e-6)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_promise_bad_input_traced_lengths_are_clamped(implementation):
  """Under jit the lengths cannot be checked: negative ones act as 0, large ones as T / S."""
  f = jax.jit(lambda ql, kl: dpa(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl,
                                 implementation=implementation))
  out = f(jnp.array([6, 99], jnp.int32), jnp.array([-5, 4], jnp.int32))
  ref = dpa(q, k, v, query_seq_lengths=jnp.array([6, 6], jnp.int32),
            key_value_seq_lengths=jnp.array([0, 4], jnp.int32), implementation="xla")
  chex.assert_trees_all_close(out, ref, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(out[0]), 0.0)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize("B,T,S", [(1, 0, 3), (1, 3, 0), (0, 3, 3)])
def test_promise_empty_inputs_give_empty_results(implementation, B, T, S):
  qe, ke, ve = make_qkv(1, B=B, T=T, S=S, N=2, K=2, H=4)
  out, res = dpa(qe, ke, ve, implementation=implementation, return_residual=True)
  ref, ref_res = jax.nn.dot_product_attention(qe, ke, ve, return_residual=True)
  assert out.shape == ref.shape == (B, T, 2, 4) and out.dtype == ref.dtype
  assert res.shape == ref_res.shape == (B, T, 2)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))  # zeros when S = 0
  np.testing.assert_array_equal(np.asarray(res), np.asarray(ref_res))  # -inf when S = 0
  grads = jax.grad(lambda a, b, c: dpa(a, b, c, implementation=implementation).sum(),
                   argnums=(0, 1, 2))(qe, ke, ve)
  for g, x in zip(grads, (qe, ke, ve), strict=True):
    assert g.shape == x.shape
    np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_promise_integer_and_bool_inputs_are_promoted(implementation, normalizer):
  """jax.nn returns int32 zeros for integer inputs; jaxsoft computes in float32."""
  qi, ki, vi = (jnp.round(2 * t).astype(jnp.int32) for t in (q, k, v))
  out = dpa(qi, ki, vi, is_causal=True, normalizer=normalizer, implementation=implementation)
  ref = dpa(*(t.astype(jnp.float32) for t in (qi, ki, vi)), is_causal=True,
            normalizer=normalizer, implementation="xla")
  assert out.dtype == jnp.float32
  chex.assert_trees_all_close(out, ref, atol=1e-5)
  qb, kb, vb = (t > 0 for t in (q, k, v))
  out = dpa(qb, kb, vb, normalizer=normalizer, implementation=implementation)
  assert out.dtype == jnp.float32
  chex.assert_trees_all_close(
      out, dpa(*(t.astype(jnp.float32) for t in (qb, kb, vb)), normalizer=normalizer,
               implementation="xla"), atol=1e-5)


@pytest.mark.parametrize("normalizer,params", [
    ("ssmax", {"s": 0.7}), ("sigmoid", {}), ("lssar", {})])
def test_promise_numerics_float64_counts_in_chunked(normalizer, params):
  """xla_chunked computed log n and the length scales in float32 for float64 inputs."""
  with jax.enable_x64(True):
    q64, k64, v64 = (t.astype(jnp.float64) for t in make_qkv(2, B=2, T=37, N=2, K=1, H=8))
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([37, 20], jnp.int32),
              normalizer=normalizer, normalizer_params=params)
    # jit: one compiled program each instead of op-by-op dispatch (the lengths stay concrete)
    out = jax.jit(functools.partial(dpa, implementation="xla_chunked", **kw))(q64, k64, v64)
    ref = jax.jit(functools.partial(dpa, implementation="xla", **kw))(q64, k64, v64)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-12, atol=1e-12)


def _sink_case():
  """Head 0: a sink logit 1e4 above scores near -1e4 (D overflows); head 1: an ordinary
  sink, whose gradient must survive the summation over rows."""
  qs, ks, vs = make_qkv(3, B=1, T=8, N=2, K=2, H=8)
  qs = qs.at[:, :, 0].set(1.0)
  ks = ks.at[:, :, 0].set(-1e4 / jnp.sqrt(8.0))  # every score of head 0 is -1e4
  return qs, ks, vs, jnp.array([1e4, 0.5]).reshape(2, 1, 1)


@pytest.mark.parametrize("implementation", [
    "xla_chunked", "pallas_triton", "pallas_mosaic_tpu"])
def test_promise_numerics_sink_far_above_scores_has_finite_gradients(implementation,
                                                                    monkeypatch):
  """The sink logit's gradient was NaN (0 * inf in the offset's VJP) off the dense path."""
  if implementation.startswith("pallas"):
    monkeypatch.setenv(kernels_api.INTERPRET_ENV, "1")
  qs, ks, vs, sink = _sink_case()

  def f(impl, qs, ks, vs, sink):
    return dpa(qs, ks, vs, is_causal=True, normalizer="softmax_sink",
               normalizer_params={"sink_logit": sink}, implementation=impl)

  # assert_same's checks, each side's output and gradients in one jitted program (op by op,
  # the Pallas interpreter and the eager VJP cost several times more)
  (out_a, g_a), (out_b, g_b) = (
      jax.jit(lambda *a, impl=impl: value_and_grads(functools.partial(f, impl), a))(
          qs, ks, vs, sink) for impl in (implementation, "xla"))
  chex.assert_trees_all_close(out_a, out_b, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(g_a, g_b, atol=1e-4, rtol=1e-4)
  for g in jax.tree.leaves(g_a):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
