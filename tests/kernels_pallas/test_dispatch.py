"""The dispatcher adapter: exact or NotImplementedError, never something different."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import dispatch
from tests.kernels_pallas.test_engine import inputs, reference


@pytest.fixture
def interpret_env(monkeypatch):
  monkeypatch.setenv(dispatch.INTERPRET_ENV, "1")


def test_cpu_without_interpret_env_is_not_implemented(monkeypatch):
  monkeypatch.delenv(dispatch.INTERPRET_ENV, raising=False)
  q, k, v, _ = inputs(t=16)
  for backend in (None, "triton", "mosaic_tpu"):
    with pytest.raises(NotImplementedError):
      dispatch.dot_product_attention(q, k, v, backend=backend)


def test_pick_backend(interpret_env):
  assert dispatch.pick_backend(None) == ("triton", True)
  assert dispatch.pick_backend("mosaic_tpu") == ("mosaic_tpu", True)
  assert dispatch.pick_backend("pallas_triton") == ("triton", True)
  with pytest.raises(ValueError, match="backend"):
    dispatch.pick_backend("cudnn")


@pytest.mark.parametrize("kwargs", [
    dict(bias=jnp.zeros((1, 1, 16, 16))),
    dict(mask=jnp.ones((1, 1, 16, 16), bool)),
    dict(decay_bias=(jnp.zeros((1, 16, 2)), jnp.zeros((1, 16, 2)))),
    dict(spec="sparsemax"),
    dict(spec="gumbel_softmax", normalizer_params={"key": jax.random.key(0)}),
])
def test_unsupported_calls_raise_not_implemented(interpret_env, kwargs):
  q, k, v, _ = inputs(t=16)
  kwargs = dict(kwargs)
  if isinstance(kwargs.get("spec"), str):
    import jaxsoft.normalizers as jn
    kwargs["spec"] = jn.get(kwargs["spec"])
  with pytest.raises(NotImplementedError):
    dispatch.dot_product_attention(q, k, v, backend=None, **kwargs)


def test_value_head_dim_differs_is_not_implemented(interpret_env):
  q, k, v, _ = inputs(t=16)
  with pytest.raises(NotImplementedError):
    dispatch.dot_product_attention(q, k, jnp.concatenate([v, v], -1), backend=None)


def test_adapter_matches_reference(interpret_env):
  import jaxsoft.normalizers as jn
  b, t = 2, 24
  q, k, v, _ = inputs(b=b, t=t, seed=30)
  seg = jnp.array([[0] * 10 + [1] * 14, [0] * 24], jnp.int32)
  kv_len = jnp.array([24, 17], jnp.int32)
  out = jax.jit(lambda q, k, v: dispatch.dot_product_attention(
      q, k, v, backend=None, is_causal=True, segment_ids=(seg, seg),
      key_value_seq_lengths=kv_len, spec=jn.get("ssmax"), normalizer_params={}))(q, k, v)
  ref = reference(q, k, v, normalizer="ssmax", is_causal=True, segment_ids=seg, kv_len=kv_len)
  chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)


def test_jaxsoft_dot_product_attention_uses_the_kernel(interpret_env):
  """Through the public entry point: implementation="pallas" == "xla" (a single explicit
  implementation raises instead of falling back, so this runs the kernel)."""
  from jaxsoft import attention
  q, k, v, ct = inputs(t=24, n=2, kh=1, seed=31)

  def run(impl):
    f = lambda q, k, v: attention.dot_product_attention(
        q, k, v, is_causal=True, normalizer="softpick", implementation=impl)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)

  got = jax.jit(lambda: run("pallas"))()
  want = run("xla")
  chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)
