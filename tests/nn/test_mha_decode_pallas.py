"""MultiHeadAttention's one-token decode steps through the split-K decoding kernel (K05).

With ``implementation="pallas"`` a one-token step runs
``kernels_pallas.decode.decode_attention`` (Triton driver, Pallas interpreter on CPU) when
it computes the step exactly, else the dense path. The oracles are independent of the
kernel: the full causal forward and the token-by-token decode of an identical layer with
``implementation="xla"``; a spy on ``decode_attention`` shows which path ran. Gradients
through a kernel step (its custom VJP recomputes the step densely) equal the XLA layer's.
The prefix view the kernel reads (the cache written with the new token, plus the evicted
slot of a ring buffer) is checked against the step's visibility mask for every window
shape (a sample by default, all with ``-m slow``).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft.nn import MultiHeadAttention, _kv_cache
from kernels_pallas import _api as kernels_api
from kernels_pallas import decode
from tests.helpers import BWD, FWD, normal, random_cotangent, sampled

D, N, B = 8, 4, 2

# name: (layer options, window, prefill length, T, call keywords)
CASES = {
    "softmax_gqa": (dict(normalizer="softmax", num_kv_heads=2), None, 0, 4, {}),
    # (the default run has sink_window2_gqa in test_sink_window_steps_and_gradient_...)
    "sink_window2_gqa": (dict(sink=True, num_kv_heads=2), 2, 0, 4, {}),
    "sigmoid_window3_gqa": (dict(normalizer="sigmoid", num_kv_heads=2), (3, 0), 0, 4, {}),
    "sigmoid_mqa": (dict(normalizer="sigmoid", num_kv_heads=1), None, 0, 5, {}),
    # slow: eager prefills (through the Pallas engine), caps, fixed hyperparameters
    "sink_window2_gqa_prefill3": (dict(sink=True, num_kv_heads=2), 2, 3, 6, {}),
    "sigmoid_bias_cap_prefill1": (dict(normalizer="sigmoid", normalizer_params={"bias": -1.0}),
                                  None, 1, 5, dict(logits_soft_cap=2.0, scale=0.5)),
    "sink_window0": (dict(normalizer="softmax_sink", normalizer_params={"sink_logit": 0.5}),
                     0, 0, 4, {}),
    "softmax_window_longer_than_cache": (dict(normalizer="softmax"), 9, 2, 5, {}),
}


def _pair(seed=0, **options):
  """Two identical layers (same parameters): the Pallas one and the XLA one."""
  pallas = MultiHeadAttention(N, D, implementation="pallas", rngs=nnx.Rngs(seed), **options)
  xla = MultiHeadAttention(N, D, implementation="xla", rngs=nnx.Rngs(seed), **options)
  for layer in (pallas, xla):  # distinct per-head learned values (the sink)
    for z in layer.normalizer_free.values():
      z[...] = z[...] + jnp.linspace(-0.8, 0.8, N)
  return pallas, xla


def _decode(layer, x, window, prefill, **call_kw):
  """init_cache, an optional eager prefill, then jitted one-token steps."""
  t_total = x.shape[1]
  layer.init_cache(B, t_total, local_window_size=window)
  step = nnx.jit(lambda m, xt: m(xt, decode=True, **call_kw))
  outs = [layer(x[:, :prefill], decode=True, **call_kw)] if prefill else []
  outs += [step(layer, x[:, t:t + 1]) for t in range(prefill, t_total)]
  return jnp.concatenate(outs, axis=1)


@pytest.fixture
def spy(monkeypatch):
  """Interpret mode on CPU and the normalizer of every decode_attention call (traced)."""
  monkeypatch.setenv(kernels_api.INTERPRET_ENV, "1")
  calls = []
  real = decode.decode_attention

  def wrapper(*args, **kwargs):
    calls.append(kwargs["normalizer"])
    return real(*args, **kwargs)

  monkeypatch.setattr(decode, "decode_attention", wrapper)
  return calls


@pytest.mark.parametrize("case", sampled(list(CASES), ("sigmoid_window3_gqa",)))
def test_pallas_decode_equals_forward_and_xla_decode(case, spy):
  options, window, prefill, t_total, call_kw = CASES[case]
  pallas, xla = _pair(**options)
  x = normal(1, (B, t_total, D), 1.5)
  full = nnx.jit(lambda m, x: m(x, is_causal=True, local_window_size=window, **call_kw))(
      xla, x)  # jitted: one compilation instead of one per eager operation
  steps_xla = _decode(xla, x, window, prefill, **call_kw)
  assert not spy  # the XLA layer never calls the kernel
  steps = _decode(pallas, x, window, prefill, **call_kw)
  assert spy and set(spy) == {pallas.normalizer}  # the one-token steps ran the kernel
  chex.assert_trees_all_close(steps, full, **FWD)
  chex.assert_trees_all_close(steps, steps_xla, **FWD)
  chex.assert_trees_all_close(pallas.cached_key[...], xla.cached_key[...], **FWD)


def test_unsupported_normalizer_decodes_through_the_fallback(spy):
  pallas, xla = _pair(normalizer="sparsemax", num_kv_heads=2)
  pallas.implementation = ("pallas", "xla")  # a chain whose first entry is Pallas
  x = normal(2, (B, 4, D), 1.5)
  steps = _decode(pallas, x, None, 0)
  assert not spy
  chex.assert_trees_all_close(steps, xla(x, is_causal=True), **FWD)


def test_sink_window_steps_and_gradient_equal_the_dense_path(spy):
  """softmax_sink with learned per-head sinks, GQA and a window-2 ring: three kernel steps
  fill and wrap the ring and equal the XLA decode and the full forward; the fourth step
  (reading the evicted slot) is differentiated: the kernel is forward only, and its
  custom VJP recomputes the step densely, so the gradients equal the XLA layer's."""
  pallas, xla = _pair(sink=True, num_kv_heads=2)
  x = normal(1, (B, 4, D), 1.5)
  ct = random_cotangent((B, 1, D))

  @nnx.jit
  @nnx.value_and_grad
  def loss(m, xt):
    return jnp.sum(ct * m(xt, decode=True))

  steps, results = {}, {}
  for name, layer in (("pallas", pallas), ("xla", xla)):
    layer.init_cache(B, 4, local_window_size=2)
    step = nnx.jit(lambda m, xt: m(xt, decode=True))
    steps[name] = jnp.concatenate([step(layer, x[:, t:t + 1]) for t in range(3)], axis=1)
    results[name] = loss(layer, x[:, 3:])
  assert spy and set(spy) == {"softmax_sink"}
  chex.assert_trees_all_close(steps["pallas"], steps["xla"], **FWD)
  # jitted: one compilation instead of one per eager operation
  full = nnx.jit(lambda m, x: m(x, is_causal=True, local_window_size=2))(xla, x)
  chex.assert_trees_all_close(steps["pallas"], full[:, :3], **FWD)
  chex.assert_trees_all_close(results["pallas"], results["xla"], **BWD)
  sink_grad = results["pallas"][1]["normalizer_free"]["sink_logit"][...]
  assert float(jnp.abs(sink_grad).max()) > 0


def test_no_pallas_platform_keeps_the_dense_path(monkeypatch):
  """Without a Pallas backend (CPU, no interpreter) the chain's next entry decodes."""
  monkeypatch.delenv(kernels_api.INTERPRET_ENV, raising=False)
  called = []
  monkeypatch.setattr(decode, "decode_attention", lambda *a, **k: called.append(1))
  pallas, xla = _pair(normalizer="softmax", num_kv_heads=2)
  pallas.implementation = ("pallas", "xla")
  x = normal(1, (B, 4, D), 1.5)
  chex.assert_trees_all_close(_decode(pallas, x, None, 0), xla(x, is_causal=True), **FWD)
  assert not called


# (cache window, call window, prefill, T, whether the visible keys are a prefix)
VIEWS = {
    "no_window": (None, None, 2, 6, True),
    "ring2": (2, None, 0, 4, True),
    "ring2_prefill3": (2, None, 3, 6, True),
    "ring_w0": (0, None, 2, 5, True),
    "ring_right_positive": ((3, 2), None, 0, 7, True),
    "window_longer_than_max_length": (9, None, 2, 5, True),
    "right_negative": ((3, -1), None, 2, 6, False),
    "call_window_narrower_than_ring": (3, 1, 2, 6, False),
    "call_window_on_full_cache": (None, 2, 2, 6, False),
    "call_window_covering_full_cache": (None, 6, 2, 6, True),
}


@pytest.mark.parametrize("case", sampled(list(VIEWS), ("ring2",)))
def test_prefix_view_holds_exactly_the_visible_keys(case, monkeypatch):
  """Whenever the kernel's view is given, its first n slots are the step's visible keys
  (as a set: the normalizers are permutation equivariant over them); otherwise None."""
  cache_window, call_window, prefill, t_total, expected = VIEWS[case]
  seen = []

  def record(module, step, window, q, params, kwargs):
    if q.shape[1] != 1:
      return None  # a prefill: pallas_decode takes one-token steps only
    view = _kv_cache._prefix_view(module, step, window)
    if view is None:
      jax.debug.callback(lambda: seen.append(None))
    else:
      jax.debug.callback(lambda *a: seen.append(tuple(map(np.asarray, a))), *view, step.key,
                         step.value, step.mask[0, 0, 0])
    return None  # the dense path computes the output

  monkeypatch.setattr(_kv_cache, "pallas_decode", record)
  layer = MultiHeadAttention(N, D, num_kv_heads=2, rngs=nnx.Rngs(5))
  x = normal(6, (B, t_total, D))
  layer.init_cache(B, t_total, local_window_size=cache_window)
  kw = {} if call_window is None else dict(local_window_size=call_window)
  if prefill:
    layer(x[:, :prefill], decode=True, **kw)
  assert not seen  # a prefill is not a one-token step
  step = nnx.jit(lambda m, xt: m(xt, decode=True, **kw))
  for t in range(prefill, t_total):
    step(layer, x[:, t:t + 1])
  assert len(seen) == t_total - prefill
  for rec in seen:
    assert (rec is not None) == expected
    if rec is None:
      continue
    keys, values, n, all_keys, all_values, visible = rec
    assert n == visible.sum() and n <= keys.shape[1]
    for got, want in ((keys, all_keys), (values, all_values)):
      np.testing.assert_array_equal(_sorted_rows(got[:, :n]), _sorted_rows(want[:, visible]))


def _sorted_rows(x):
  """``[B, n, K, H]`` -> each batch row's n slots in lexicographic order (a multiset)."""
  x = x.reshape(x.shape[0], x.shape[1], -1)
  return np.stack([r[np.lexsort(r.T[::-1])] for r in x])
