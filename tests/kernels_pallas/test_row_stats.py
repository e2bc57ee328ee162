"""Class R (standardised softmax, NAP, adaptive temperature, affine, clipped, SA-normalised)
in the Pallas engine, interpret mode, against the dense float32 reference
``normalizer(logits) @ v``: the output and every cotangent (per-head hyperparameters'
included), both drivers, empty rows, the adapter, and cross-lowering for both targets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxsoft.normalizers as jn
from tests.kernels_pallas import test_engine as checks
from tests.kernels_pallas.test_lowering import _export

R_NAMES = sorted(n for n in jn.names()
                 if jn.get(n).kernel_class == "R" and jn.get(n).row_stats is not None)
# The default run covers the moments and softmax's (m, l) + the extremes (the per-head test
# below adds the Mosaic driver); every registered class-R rule runs under -m slow.
DEFAULT = ["standardized_softmax", "sa_softmax_normalized"]
PARAMS = [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in R_NAMES]


def test_every_class_r_normalizer_has_a_kernel():
  assert {s.name for s in jn.REGISTRY.values() if s.kernel_class == "R"} == set(R_NAMES)


@pytest.mark.parametrize("name", PARAMS)
def test_every_row_stats_normalizer(name):
  # Causal + GQA + T = 40 with 16-wide blocks: padding, skipped and partial blocks.
  q, k, v, ct = checks.inputs(t=40, n=2, kh=1, seed=21)
  checks.assert_matches(
      checks.kernel(normalizer=name, is_causal=True),
      lambda q, k, v: checks.reference(q, k, v, normalizer=name, is_causal=True), (q, k, v),
      ct)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.slow),
                                     "mosaic_tpu"])
def test_per_head_hyperparameter_and_its_gradient(backend):
  """standardized_softmax's tau per head reaches the kernel's statistics pass (derive)
  and its gradient comes back; segments and two batches."""
  checks.check_per_head_parameter("standardized_softmax", "tau",
                                  jnp.asarray([0.5, 2.0]).reshape(2, 1, 1), backend, seed=22)


@pytest.mark.slow
def test_mosaic_nap_causal_window():
  checks.check_mosaic_causal_window("nap", seed=23)


def test_rows_without_visible_keys_are_zero_with_zero_gradient():
  checks.check_rows_without_visible_keys("affine_softmax", {"alpha": 0.5}, seed=24)


@pytest.mark.parametrize("name", [pytest.param("standardized_softmax", marks=pytest.mark.slow),
                                  "sa_softmax_normalized"])
def test_dot_product_attention_runs_the_kernel(monkeypatch, name):
  checks.check_dot_product_attention(monkeypatch, name, seed=25)


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
  checks.check_matrix(backend, name, None, [(100, 130, 72)])


def test_no_t_by_s_value_anywhere():
  """Forward and backward of a class-R call (statistics pass, derive, the E/P engine, the
  statistics' dQ/dK kernels): no value of T x S elements, inside the kernels or around."""
  from tests.attention.test_topk import largest_intermediate  # noqa: PLC0415

  t = 256
  q, k, v, ct = checks.inputs(t=t, n=1, kh=1, h=16, seed=26)
  f = checks.kernel(normalizer="standardized_softmax", is_causal=True)
  jaxpr = jax.make_jaxpr(
      lambda q, k, v: checks.value_and_cotangents(f, (q, k, v), ct))(q, k, v)
  assert largest_intermediate(jaxpr.jaxpr) < t * t // 4
