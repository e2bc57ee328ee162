"""Class R (standardised softmax, NAP, adaptive temperature, affine, clipped, SA-normalised)
in the Pallas engine, interpret mode, against the dense float32 reference
``normalizer(logits) @ v``: the output and every cotangent (per-head hyperparameters'
included), both drivers, empty rows, the adapter, and cross-lowering for both targets."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxsoft.normalizers as jn
from jaxsoft import attention
from kernels_pallas import _api
from tests.kernels_pallas.test_engine import (
    TRITON_SMALL,
    assert_matches,
    check_rows_without_visible_keys,
    inputs,
    kernel,
    reference,
    value_and_cotangents,
)
from tests.kernels_pallas.test_lowering import _export

R_NAMES = sorted(n for n in jn.names()
                 if jn.get(n).kernel_class == "R" and jn.get(n).row_stats is not None)
MOSAIC_SMALL = dict(block_q=16, block_k=128)
# The default run covers the moments and softmax's (m, l) + the extremes (the per-head test
# below adds the Mosaic driver); every registered class-R rule runs under -m slow.
DEFAULT = ["standardized_softmax", "sa_softmax_normalized"]
PARAMS = [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in R_NAMES]


def test_every_class_r_normalizer_has_a_kernel():
  assert {s.name for s in jn.REGISTRY.values() if s.kernel_class == "R"} == set(R_NAMES)


@pytest.mark.parametrize("name", PARAMS)
def test_every_row_stats_normalizer(name):
  # Causal + GQA + T = 40 with 16-wide blocks: padding, skipped and partial blocks.
  q, k, v, ct = inputs(t=40, n=2, kh=1, seed=21)
  assert_matches(kernel(normalizer=name, is_causal=True),
                 lambda q, k, v: reference(q, k, v, normalizer=name, is_causal=True),
                 (q, k, v), ct)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.slow),
                                     "mosaic_tpu"])
def test_per_head_hyperparameter_and_its_gradient(backend):
  """standardized_softmax's tau per head reaches the kernel's statistics pass (derive)
  and its gradient comes back; segments and two batches."""
  q, k, v, ct = inputs(b=2, t=40, n=2, kh=2, seed=22)
  seg = jnp.array([[0] * 17 + [1] * 23, [0] * 40], jnp.int32)
  tau = jnp.asarray([0.5, 2.0]).reshape(2, 1, 1)
  blocks = TRITON_SMALL if backend == "triton" else MOSAIC_SMALL

  def kfn(q, k, v, tau):
    return _api.attention(q, k, v, normalizer="standardized_softmax",
                          normalizer_params={"tau": tau}, segment_ids=seg, backend=backend,
                          interpret=True, block_sizes=blocks)

  _, grads = assert_matches(kfn, lambda q, k, v, t: reference(
      q, k, v, normalizer="standardized_softmax", params={"tau": t}, segment_ids=seg),
      (q, k, v, tau), ct)
  assert bool(jnp.all(grads[3] != 0))


@pytest.mark.slow
def test_mosaic_nap_causal_window():
  q, k, v, ct = inputs(t=40, n=2, kh=1, seed=23)
  assert_matches(kernel(backend="mosaic_tpu", block_sizes=dict(block_q=8, block_k=16),
                        normalizer="nap", local_window_size=(20, 0), is_causal=True),
                 lambda q, k, v: reference(q, k, v, normalizer="nap", window=(20, 0),
                                           is_causal=True), (q, k, v), ct)


def test_rows_without_visible_keys_are_zero_with_zero_gradient():
  check_rows_without_visible_keys("affine_softmax", {"alpha": 0.5}, seed=24)


@pytest.mark.parametrize("name", [pytest.param("standardized_softmax", marks=pytest.mark.slow),
                                  "sa_softmax_normalized"])
def test_dot_product_attention_runs_the_kernel(monkeypatch, name):
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")
  q, k, v, ct = inputs(t=24, n=2, kh=1, seed=25)

  def run(impl):
    f = lambda q, k, v: attention.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, normalizer=name, implementation=impl)
    return value_and_cotangents(f, (q, k, v), ct)

  # jit closing over the inputs: XLA constant-folds the interpret-mode kernels, which
  # rounds the recomputed tiles differently from the statistics pass (the row's max and
  # the single-entry rows must still be found: a wrong dK of O(1) before they were)
  chex.assert_trees_all_close(jax.jit(lambda: run("pallas"))(), run("xla"), atol=1e-4,
                              rtol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_row_stats_kernels_lower(backend):
  text = _export(backend, t=384, normalizer="standardized_softmax", is_causal=True,
                 normalizer_params={"tau": jnp.full((4, 1, 1), 0.7)})
  assert text.count("jaxsoft_attention_r") >= 3  # statistics, dQ and dK of the statistics


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("name", R_NAMES)
def test_row_stats_matrix(backend, name):
  """T not a multiple of the block, cross-attention lengths, head dim 72, soft cap."""
  t, s, h = 100, 130, 72
  q, k, v, ct = inputs(t=t, s=s, n=4, kh=2, h=h, seed=t)
  kw = dict(normalizer=name, logits_soft_cap=5.0,
            key_value_seq_lengths=jnp.array([s - 7], jnp.int32))
  blocks = TRITON_SMALL if backend == "triton" else dict(block_q=32, block_k=128)
  assert_matches(kernel(backend=backend, block_sizes=blocks, **kw),
                 lambda q, k, v: reference(q, k, v, normalizer=name, soft_cap=5.0,
                                           kv_len=jnp.array([s - 7], jnp.int32)),
                 (q, k, v), ct)


def test_no_t_by_s_value_anywhere():
  """Forward and backward of a class-R call (statistics pass, derive, the E/P engine, the
  statistics' dQ/dK kernels): no value of T x S elements, inside the kernels or around."""
  from tests.attention.test_topk import largest_intermediate  # noqa: PLC0415

  t = 256
  q, k, v, ct = inputs(t=t, n=1, kh=1, h=16, seed=26)
  f = kernel(normalizer="standardized_softmax", is_causal=True)
  jaxpr = jax.make_jaxpr(lambda q, k, v: value_and_cotangents(f, (q, k, v), ct))(q, k, v)
  assert largest_intermediate(jaxpr.jaxpr) < t * t // 4
