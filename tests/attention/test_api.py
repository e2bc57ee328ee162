"""The entry point: argument validation (errors name the argument) and dispatch
(implementation names, sequences, NotImplementedError fallback, the automatic choice)."""


import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from jaxsoft.attention import _api
from jaxsoft.attention import dot_product_attention as dpa
from jaxsoft.attention.call import AttentionCall
from tests.helpers import make_qkv, normal

q, k, v = make_qkv(0, 2, 5, N=4, K=2, H=8)


@pytest.mark.parametrize("kwargs,argname", [
    ({"k": jnp.zeros((2, 5, 3, 8)), "v": jnp.zeros((2, 5, 3, 8))}, "heads"),  # N=4, K=3
    ({"k": jnp.zeros((2, 5, 2, 6)), "v": jnp.zeros((2, 5, 2, 6))}, "head dimension"),
    ({"v": jnp.zeros((2, 4, 2, 8))}, "`value`"),
    ({"mask": jnp.ones((2, 4, 3, 5), bool)}, "`mask`"),
    ({"mask": jnp.ones((2, 4, 5, 5), jnp.float32)}, "`mask`"),
    ({"bias": jnp.ones((3, 4, 5, 5))}, "`bias`"),
    ({"bias": jnp.ones((1, 1, 1, 5, 5))}, "`bias`"),
    ({"bias": jnp.ones((2, 4, 5, 5), bool)}, "`bias`.*`mask`"),  # jax.nn adds it as 0/1
    ({"query_seq_lengths": jnp.array([1, 2, 3], jnp.int32)}, "`query_seq_lengths`"),
    ({"key_value_seq_lengths": jnp.array([1.0, 2.0])}, "`key_value_seq_lengths`"),
    ({"local_window_size": (1, 2, 3)}, "`local_window_size`"),
    ({"local_window_size": 1.5}, "`local_window_size`"),
    ({"segment_ids": jnp.zeros((2, 4), jnp.int32)}, "`segment_ids`"),
    ({"logits_soft_cap": -1.0}, "`logits_soft_cap`"),
    ({"implementation": "flash"}, "`implementation`"),
    ({"implementation": ["xla", "fast"]}, "`implementation`"),
    ({"normalizer": 3}, "`normalizer`"),
    ({"normalizer_params": {"temperature": -1.0}}, "temperature"),
    ({"normalizer_params": {"nope": 1.0}}, "nope"),
    ({"normalizer_params": {"temperature": jnp.ones((4, 5, 5))}}, "['temperature']"),
    ({"normalizer_params": {"temperature": jnp.ones((3, 1, 1))}}, "['temperature']"),
    ({"decay_prune_threshold": -1.0}, "`decay_prune_threshold`"),
    ({"decay_bias": (jnp.zeros((2, 5, 4)), jnp.zeros((2, 5, 4))),
      "decay_prune_threshold": 1.0}, "`decay_prune_threshold`"),
    ({"decay_bias": (jnp.zeros((2, 5, 3)), jnp.zeros((2, 5, 4)))}, "`decay_bias`"),
])
def test_bad_input_names_the_argument(kwargs, argname):
  args = {"q": q, "k": k, "v": v, **kwargs}
  with pytest.raises(ValueError, match=argname.replace("[", r"\[").replace("]", r"\]")):
    dpa(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_unknown_normalizer_is_a_key_error_naming_it():
  with pytest.raises(KeyError, match="normalizer.*no_such_thing"):
    dpa(q, k, v, normalizer="no_such_thing")


def test_stochastic_normalizer_needs_its_key():
  with pytest.raises(ValueError, match=r"normalizer_params\['key'\]"):
    dpa(q, k, v, normalizer="gumbel_softmax")


@pytest.fixture
def calls(monkeypatch):
  """Records which implementations the dispatcher runs, in order."""
  seen = []
  for name, fn in list(_api._RUNNERS.items()):
    def wrapped(call, name=name, fn=fn):
      seen.append(name)
      return fn(call)
    monkeypatch.setitem(_api._RUNNERS, name, wrapped)
  return seen


def test_default_small_problem_uses_xla(calls):
  out = dpa(q, k, v, is_causal=True)
  assert calls == ["xla"]
  chex.assert_trees_all_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True),
                              atol=1e-6)


def test_default_large_problem_uses_chunked(calls, monkeypatch):
  monkeypatch.setattr(_api, "CHUNKED_MIN_SCORES", 25)  # T·S = 25 counts as large
  out = dpa(q, k, v, is_causal=True)
  assert calls == ["xla_chunked"]
  chex.assert_trees_all_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True),
                              atol=1e-5)


def test_fallback_when_chunked_cannot(calls, monkeypatch):
  monkeypatch.setattr(_api, "CHUNKED_MIN_SCORES", 25)
  fn = lambda x, axis=-1, where=None: jax.nn.softmax(x, axis=axis, where=where)  # noqa: E731
  out = dpa(q, k, v, normalizer=fn)
  assert calls == ["xla_chunked", "xla"]
  chex.assert_trees_all_close(out, jax.nn.dot_product_attention(q, k, v), atol=1e-6)


def test_explicit_single_implementation_reraises(calls):
  fn = lambda x, axis=-1, where=None: jax.nn.softmax(x, axis=axis, where=where)  # noqa: E731
  with pytest.raises(NotImplementedError, match="xla_chunked"):
    dpa(q, k, v, normalizer=fn, implementation="xla_chunked")


def test_pallas_on_cpu_falls_back_in_a_sequence(calls, monkeypatch):
  monkeypatch.delenv("JAXSOFT_PALLAS_INTERPRET", raising=False)
  out = dpa(q, k, v, is_causal=True, implementation=("pallas", "xla"))
  assert calls == ["pallas", "xla"]
  chex.assert_trees_all_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True),
                              atol=1e-6)
  with pytest.raises(NotImplementedError, match="pallas"):
    dpa(q, k, v, implementation="pallas_mosaic_tpu")


def test_pallas_receives_the_canonical_call(monkeypatch):
  """The Pallas adapter gets the validated AttentionCall (with its MaskStructure)."""
  got = {}

  def attention_from_call(call, backend):
    got.update(call=call, backend=backend)
    return jnp.zeros(call.q.shape[:3] + call.v.shape[-1:], call.q.dtype)

  monkeypatch.setattr(kernels_pallas, "attention_from_call", attention_from_call)
  seg = jnp.zeros((2, 5), jnp.int32)
  out = dpa(q[0], k[0], v[0], is_causal=True, local_window_size=2,
            segment_ids=seg[0], logits_soft_cap=5.0, implementation="pallas_triton")
  assert out.shape == (5, 4, 8)
  call = got["call"]
  assert got["backend"] == "triton" and isinstance(call, AttentionCall)
  assert call.q.shape == (1, 5, 4, 8) and call.local_window_size == (2, 2)
  assert call.scale == pytest.approx(1 / np.sqrt(8)) and call.logits_soft_cap == 5.0
  assert call.spec.name == "softmax" and call.params == {}
  st = call.structure
  assert st.is_causal and st.window == (2, 2) and st.q_segment_ids.shape == (1, 5)


def test_unbatched_inputs_and_value_head_dim():
  qq, kk, _ = make_qkv(1, 1, 6, N=2, K=2, H=8)
  vv = normal(3, (1, 6, 2, 3))
  for impl in ("xla", "xla_chunked"):
    # jitted: one program instead of op-by-op dispatch
    out = jax.jit(functools.partial(dpa, is_causal=True, implementation=impl))(
        qq[0], kk[0], vv[0])
    assert out.shape == (6, 2, 3)
    w = jax.nn.softmax(jnp.einsum("tnh,snh->nts", qq[0], kk[0]) / np.sqrt(8), axis=-1,
                       where=jnp.tril(jnp.ones((6, 6), bool)))
    np.testing.assert_allclose(out, jnp.einsum("nts,snh->tnh", w, vv[0]), atol=1e-5)


def test_automatic_order_tries_cudnn_first_on_a_cuda_gpu(monkeypatch):
  """On a CUDA GPU the automatic order is cudnn (for calls no row of which can be fully
  masked), Pallas, then XLA; jax.nn's own refusals fall through to the next one."""
  calls = []
  real = jax.nn.dot_product_attention

  def fake_cudnn(*args, implementation=None, **kw):
    if implementation != "cudnn":
      return real(*args, implementation=implementation, **kw)
    calls.append(implementation)
    if kw["local_window_size"] is not None:
      raise ValueError("an unsupported configuration (jax.nn's own refusal)")
    return real(*args, implementation="xla", **kw)

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
  monkeypatch.setitem(_api._RUNNERS, "pallas", lambda call: (_ for _ in ()).throw(
      NotImplementedError("no Pallas here")))
  want = dpa(q, k, v, implementation="xla")
  # jax.nn's XLA path (behind the fake cuDNN) and jaxsoft's differ by float rounding
  np.testing.assert_allclose(dpa(q, k, v), want, rtol=1e-5, atol=1e-6)
  assert calls == ["cudnn"]
  # masks, lengths and the residual keep cudnn out of the automatic choice
  for kw in (dict(mask=jnp.ones((1, 1, 5, 5), bool)),
             dict(key_value_seq_lengths=jnp.array([5, 3], jnp.int32)),
             dict(return_residual=True)):
    dpa(q, k, v, **kw)
  assert calls == ["cudnn"]
  # a refusal by jax.nn (ValueError) falls through to XLA, the same result
  np.testing.assert_allclose(dpa(q, k, v, local_window_size=(2, 0)),
                             dpa(q, k, v, local_window_size=(2, 0), implementation="xla"),
                             rtol=1e-5, atol=1e-6)
  assert calls == ["cudnn", "cudnn"]
  # other normalizers never reach jax.nn's cuDNN
  dpa(q, k, v, normalizer="sparsemax")
  assert calls == ["cudnn", "cudnn"]
  # and an explicit "cudnn" still raises jax.nn's error as it is
  with pytest.raises(ValueError, match="refusal"):
    dpa(q, k, v, local_window_size=(2, 0), implementation="cudnn")


def test_automatic_order_per_platform(monkeypatch):
  api = _api
  for platform, first in (("gpu", "cudnn_auto"), ("tpu", "pallas"), ("cpu", "xla")):
    monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
    order = api._default_order(_DummyCall(64))
    assert order[0] == first, (platform, order)
  monkeypatch.setattr(jax, "default_backend", lambda: "rocm")
  assert "cudnn_auto" not in api._default_order(_DummyCall(64))


class _DummyCall:
  """What _default_order reads: the shapes of q and k."""

  def __init__(self, t):
    self.q = self.k = jnp.zeros((1, t, 1, 8))
