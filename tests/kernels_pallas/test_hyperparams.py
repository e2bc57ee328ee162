"""Hyperparameters through the kernel: per-head arrays and their gradients, static values,
learned sinks (softmax_sink), and check_grads in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxsoft.normalizers as jn
import kernels_pallas as kp
from tests.helpers import registry_sample
from tests.kernels_pallas.test_engine import (
    ENGINE_NAMES,
    TRITON_SMALL,
    assert_matches,
    inputs,
    kernel,
    reference,
)


def _sample_params(name):
  """Array-valued (per-head) samples of each hyperparameter that accepts them."""
  spec = jn.get(name)
  out = {}
  for p in spec.params:
    if p.row_broadcast and p.sample is not None:
      base = float(p.sample)
      out[p.name] = jnp.asarray([[[base]], [[base * 0.8 + (0.1 if base == 0 else 0)]]],
                                jnp.float32)
  return out


PARAM_NAMES = [n for n in ENGINE_NAMES if _sample_params(n)]


@pytest.mark.parametrize("name", registry_sample(PARAM_NAMES))
def test_array_hyperparameters_and_their_gradients(name):
  q, k, v, ct = inputs(t=24, n=2, kh=2, seed=1)
  params = _sample_params(name)

  def kfn(q, k, v, params):
    return kp.attention(q, k, v, normalizer=name, normalizer_params=params, is_causal=True,
                        backend="triton", interpret=True, block_sizes=TRITON_SMALL)

  def rfn(q, k, v, params):
    return reference(q, k, v, normalizer=name, params=params, is_causal=True)

  assert_matches(kfn, rfn, (q, k, v, params), ct)


def test_static_hyperparameters():
  q, k, v, ct = inputs(t=24, seed=2)
  for name, params in (("softmax", {"temperature": 0.5}), ("softmax_n", {"n": 3.0})):
    if name not in ENGINE_NAMES:
      continue
    assert_matches(kernel(normalizer=name, normalizer_params=params),
                   lambda q, k, v, name=name, params=params: reference(
                       q, k, v, normalizer=name, params=params),
                   (q, k, v), ct)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_softmax_sink_is_an_extra_softmax_column(backend):
  """A per-head learned sink logit (softmax_sink's ``sink_logit`` [N, 1, 1]) is a softmax
  over [logits, sink] without the sink's column; its gradient comes out of the kernel.
  Segments leave rows with no visible key: they give zeros (all mass on the sink)."""
  b, t = 2, 24
  q, k, v, ct = inputs(b=b, t=t, n=2, kh=1, seed=3)
  sinks = jnp.asarray([0.5, -1.0]).reshape(2, 1, 1)
  seg = (jnp.array([[0] * 12 + [7] * 12, [0] * 24], jnp.int32), jnp.zeros((b, t), jnp.int32))
  blocks = TRITON_SMALL if backend == "triton" else dict(block_q=16, block_k=128)

  def kfn(q, k, v, sinks):
    return kp.attention(q, k, v, normalizer="softmax_sink", normalizer_params={
        "sink_logit": sinks}, is_causal=True, segment_ids=seg, backend=backend,
                        interpret=True, block_sizes=blocks)

  out, grads = assert_matches(kfn, lambda q, k, v, s: reference(
      q, k, v, sinks=s, is_causal=True, segment_ids=seg), (q, k, v, sinks), ct)
  assert bool(jnp.all(out[0, 12:] == 0))
  assert bool(jnp.all(grads[3] != 0))


@pytest.mark.parametrize("name", ["softmax", "sigmoid"])
def test_check_grads_float64(name):
  with jax.enable_x64(True):
    q, k, v, _ = inputs(t=20, n=2, kh=1, h=16, dtype=jnp.float64, seed=5)
    f = jax.jit(kernel(normalizer=name, is_causal=True))  # compiled once for every probe
    jax.test_util.check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-5, rtol=1e-5)
