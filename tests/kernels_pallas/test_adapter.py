"""The adapter ``jaxsoft.attention.dot_product_attention(implementation="pallas*")`` reaches:
exact or NotImplementedError, never something different."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxsoft.normalizers as jn
from jaxsoft import attention
from jaxsoft.normalizers import NormalizerSpec
from kernels_pallas import _api
from tests.kernels_pallas.test_engine import inputs, reference


@pytest.fixture
def interpret_env(monkeypatch):
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")


def test_cpu_without_interpret_env_is_not_implemented(monkeypatch):
  monkeypatch.delenv(_api.INTERPRET_ENV, raising=False)
  q, k, v, _ = inputs(t=16)
  for impl in ("pallas", "pallas_triton", "pallas_mosaic_tpu"):
    with pytest.raises(NotImplementedError, match=_api.INTERPRET_ENV):
      attention.dot_product_attention(q, k, v, implementation=impl)


def test_pick_backend(interpret_env):
  assert _api.pick_backend(None) == ("triton", True)
  assert _api.pick_backend("mosaic_tpu") == ("mosaic_tpu", True)
  with pytest.raises(ValueError, match="backend"):
    _api.pick_backend("cudnn")


# A dense bias/mask, decay_bias, value head dims, dtypes and a traced scale reach the
# kernel now (tests/kernels_pallas/test_contract.py).
# Every registered class-T normalizer has a threshold rule now; a spec without one:
_T_WITHOUT_RULE = NormalizerSpec(name="test_t_without_rule", fn=jn.top_p_softmax,
                                 kernel_class="T", catalogue_id="")


@pytest.mark.parametrize("kwargs", [
    dict(normalizer=_T_WITHOUT_RULE),  # class T without a threshold rule
    dict(normalizer="gumbel_softmax", normalizer_params={"key": jax.random.key(0)}),
    dict(normalizer=lambda x, axis=-1, where=None: jax.nn.softmax(x, axis, where=where)),
], ids=["class_T", "stochastic", "callable"])
def test_unsupported_calls_raise_not_implemented(interpret_env, kwargs):
  q, k, v, _ = inputs(t=16)
  with pytest.raises(NotImplementedError):
    attention.dot_product_attention(q, k, v, implementation="pallas", **kwargs)


def test_adapter_matches_reference(interpret_env):
  b, t = 2, 24
  q, k, v, _ = inputs(b=b, t=t, seed=30)
  seg = jnp.array([[0] * 10 + [1] * 14, [0] * 24], jnp.int32)
  kv_len = jnp.array([24, 17], jnp.int32)
  out = jax.jit(lambda q, k, v: attention.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=seg, key_value_seq_lengths=kv_len,
      normalizer="ssmax", implementation="pallas"))(q, k, v)
  ref = jax.jit(lambda q, k, v: reference(  # one compilation, not one per op
      q, k, v, normalizer="ssmax", is_causal=True, segment_ids=seg, kv_len=kv_len))(q, k, v)
  chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)


def test_jaxsoft_dot_product_attention_uses_the_kernel(interpret_env):
  """Through the public entry point: implementation="pallas" == "xla" (a single explicit
  implementation raises instead of falling back, so this runs the kernel)."""
  q, k, v, ct = inputs(t=24, n=2, kh=1, seed=31)

  def run(impl, q=q, k=k, v=v, ct=ct):
    f = lambda q, k, v: attention.dot_product_attention(
        q, k, v, is_causal=True, normalizer="softpick", implementation=impl)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)

  got = jax.jit(lambda: run("pallas"))()
  want = jax.jit(lambda *a: run("xla", *a))(q, k, v, ct)  # one compilation, not one per op
  chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)


def test_unknown_driver_is_named():
  from kernels_pallas import core
  with pytest.raises(ValueError, match="`backend`"):
    core.driver("cudnn")
