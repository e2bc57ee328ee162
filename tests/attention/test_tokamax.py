"""``implementation="tokamax"``: tokamax's flash attention as an optional softmax backend.

Where tokamax imports (Python >= 3.12, JAX >= 0.11.1, ``pip install 'jaxsoft[tokamax]'``)
the explicit implementation runs its XLA reference on CPU: its output and its gradients
(q, k, v and the bias) equal the dense path's (``implementation="xla"``, an independent
computation) under causal, window, length, dense-mask, bias and soft-cap calls, GQA and a
value head dim of its own, rows with no visible key included (zeros, as jaxsoft defines
them, where tokamax alone would average the values). Where it does not import, the explicit
choice is a NotImplementedError that says how to install it. Either way: the argument
mapping through a stand-in module (what reaches ``tokamax.dot_product_attention``), the
refusals, and the automatic order (after cuDNN on a CUDA GPU, only where importable).
"""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft.attention import _api, _tokamax
from jaxsoft.attention.call import AttentionCall

B, T, S, N, K, H, HV = 2, 12, 10, 4, 2, 8, 6
A = js.attention.dot_product_attention


def _inputs(seed=0):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.standard_normal((B, T, N, H)), jnp.float32)
  k = jnp.asarray(r.standard_normal((B, S, K, H)), jnp.float32)
  v = jnp.asarray(r.standard_normal((B, S, K, HV)), jnp.float32)
  bias = jnp.asarray(r.standard_normal((1, N, T, S)), jnp.float32)
  mask = jnp.asarray(r.random((B, 1, T, S)) > 0.75)
  mask = mask.at[0, 0, 3].set(False)  # a row with no visible key
  return q, k, v, bias, mask


CASES = {
    "plain": lambda bias, mask: dict(),
    "causal_window": lambda bias, mask: dict(is_causal=True, local_window_size=(3, 0)),
    "lengths": lambda bias, mask: dict(query_seq_lengths=jnp.array([7, T]),
                                       key_value_seq_lengths=jnp.array([5, 0])),
    "mask_bias": lambda bias, mask: dict(mask=mask, bias=bias),
    "soft_cap": lambda bias, mask: dict(logits_soft_cap=2.0, is_causal=True),
}


@pytest.mark.parametrize("case", [c if c == "lengths" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_explicit_tokamax_equals_the_dense_path_or_says_how_to_install(case):
  """Values within 2e-6 and gradients within 2e-5 of the dense float32 path (both compute
  the same float32 sums in another order: a few ulps of O(1) values); without tokamax the
  error names the extra to install."""
  q, k, v, bias, mask = _inputs()
  kw = CASES[case](bias, mask)
  b = kw.pop("bias", None)

  def loss(impl):
    def f(q, k, v, b):
      out = A(q, k, v, b, implementation=impl, **kw)
      return jnp.sum(out * jnp.cos(out)), out
    return f

  if _tokamax.tokamax_module() is None:
    with pytest.raises(NotImplementedError, match=r"pip install 'jaxsoft\[tokamax\]'"):
      A(q, k, v, b, implementation="tokamax", **kw)
    return
  argnums = (0, 1, 2) + ((3,) if b is not None else ())
  (_, got), dgot = jax.value_and_grad(loss("tokamax"), argnums, has_aux=True)(q, k, v, b)
  (_, want), dwant = jax.value_and_grad(loss("xla"), argnums, has_aux=True)(q, k, v, b)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
  for g, w in zip(dgot, dwant, strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
  if case == "lengths":  # batch row 1 sees no key; rows past query length 7 none either
    assert bool(jnp.all(got[1] == 0)) and bool(jnp.all(got[0, 7:] == 0))
    assert bool(jnp.all(dgot[0][1] == 0))


def _fake_tokamax(calls):
  """A stand-in for the tokamax module: records its keyword arguments and computes with
  jax.nn (which, like tokamax, averages the values of a row with no visible key)."""

  def dot_product_attention(q, k, v, bias=None, mask=None, *, implementation=None, **kw):
    calls.append(dict(kw, implementation=implementation, bias=bias, mask=mask))
    return jax.nn.dot_product_attention(
        q, k, v, bias, mask, scale=kw["scale"], is_causal=kw["is_causal"],
        query_seq_lengths=kw["query_seq_lengths"],
        key_value_seq_lengths=kw["key_value_seq_lengths"],
        local_window_size=kw["local_window_size"])

  return types.SimpleNamespace(dot_product_attention=dot_product_attention)


def test_the_call_reaching_tokamax_and_the_zeroed_rows(monkeypatch):
  """The adapter passes the canonical call (scale as a float, lengths, window) and the
  platform's kernel name ("xla" on CPU), and zeroes the rows that see no key where the
  backend returns the average of the values."""
  calls = []
  monkeypatch.setattr(_tokamax, "tokamax_module", lambda: _fake_tokamax(calls))
  q, k, v, _, mask = _inputs(1)
  v = jnp.cos(k)  # jax.nn needs value shaped like key
  kw = dict(mask=mask, key_value_seq_lengths=jnp.array([S, 4]), local_window_size=(4, 2))
  got = jax.jit(lambda q, k, v: A(q, k, v, implementation="tokamax", **kw))(q, k, v)
  want = jax.jit(lambda q, k, v: A(q, k, v, implementation="xla", **kw))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
  (c,) = calls
  assert c["implementation"] == "xla" and c["scale"] == pytest.approx(H ** -0.5)
  assert c["local_window_size"] == (4, 2) and c["logits_soft_cap"] is None
  assert c["mask"].shape == (B, 1, T, S)
  empty = ~jnp.any(mask[0, 0, :, :], axis=-1)  # batch 0 sees every key but the mask's
  assert bool(jnp.any(empty)) and bool(jnp.all(got[0][empty] == 0))
  # (jax.nn's own result there is the values' mean, not 0: the zeroing is the adapter's)
  raw = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask, key_value_seq_lengths=jnp.array([S, 4]), local_window_size=(4, 2)))(
          q, k, v)
  assert not bool(jnp.all(raw[0][empty] == 0))


@pytest.mark.parametrize("kw,match", [
    (dict(normalizer="sigmoid"), "softmax attention only"),
    (dict(normalizer_params={"temperature": 2.0}), "softmax attention only"),
    (dict(segment_ids=jnp.zeros((B, T), jnp.int32)), "segment_ids"),
    (dict(return_residual=True), "return_residual"),
    (dict(logits_soft_cap=5.0, bias=jnp.zeros((T, T))), "after adding the bias"),
    (dict(score="distance", scale=None), "dot-product scores"),
])
def test_calls_tokamax_computes_differently_are_refused(monkeypatch, kw, match):
  """Each refusal names what differs (the dispatcher then tries the next implementation)."""
  monkeypatch.setattr(_tokamax, "tokamax_module", lambda: _fake_tokamax([]))
  q = _inputs(2)[0]
  k = v = q[:, :, :K]  # self-attention shapes (segment_ids)
  with pytest.raises(NotImplementedError, match=match):
    A(q, k, v, implementation="tokamax", **kw)


@pytest.mark.parametrize("importable", [True, False])
def test_automatic_order_tries_tokamax_after_cudnn_only_where_importable(monkeypatch,
                                                                          importable):
  """On a CUDA GPU: cudnn, then tokamax where it imports, then the Pallas kernels; on CPU
  never tokamax."""
  q, k, v, _, _ = _inputs(3)
  call = AttentionCall.create(q, k, v)
  fake = _fake_tokamax([]) if importable else None
  monkeypatch.setattr(_tokamax, "tokamax_module", lambda: fake)
  assert "tokamax_auto" not in _api._default_order(call)  # this process runs on CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  order = _api._default_order(call)
  assert order[:3] == (["cudnn_auto", "tokamax_auto", "pallas"] if importable
                       else ["cudnn_auto", "pallas", "xla"][:3])
  if not importable:  # and the runner itself refuses quietly (the next one runs)
    with pytest.raises(NotImplementedError, match="not importable"):
      _tokamax.run_tokamax_auto(call)


def test_tokamax_kernel_per_platform():
  assert _tokamax.tokamax_kernel("cuda") == "mosaic_gpu"
  with pytest.raises(NotImplementedError, match="'tpu'"):
    _tokamax.tokamax_kernel("tpu")


@pytest.mark.slow
def test_the_cuda_path_exports_tokamax_mosaic_gpu_kernel(monkeypatch):
  """On a (pretended) CUDA platform the adapter picks tokamax's Mosaic-GPU kernel, whose
  forward and backward lower for CUDA without a GPU (jax.export, an abstract H100, and
  tokamax told it runs on sm_90): the call's shapes, dtypes and masks reach a kernel
  tokamax accepts. Without tokamax: the install hint."""
  q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)

  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: A(q, k, v, is_causal=True, implementation="tokamax"),
                       q, k, v)
    return out, vjp(out)

  if _tokamax.tokamax_module() is None:
    with pytest.raises(NotImplementedError, match=r"pip install 'jaxsoft\[tokamax\]'"):
      jax.eval_shape(fwd_bwd, q, q, q)
    return
  from tokamax._src import gpu_utils  # (tokamax asks the attached device otherwise)
  for name, value in (("is_sm90", True), ("is_sm80", False), ("is_sm100", False),
                      ("has_mosaic_gpu_support", True)):
    monkeypatch.setattr(gpu_utils, name, lambda *a, value=value, **k: value)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert _tokamax.tokamax_kernel() == "mosaic_gpu"
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                       platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=device)
  checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in ("mosaic_gpu",
                                                                     "mosaic_gpu_v2")]
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.export.export(jax.jit(fwd_bwd), platforms=["cuda"], disabled_checks=checks)(
        q, q, q).mlir_module()
  calls = re.findall(r"custom_call @(\w+)", text)
  assert sum(c.startswith("mosaic_gpu") for c in calls) >= 2, calls  # forward and backward
