"""Class T (sparsemax, entmax15, entmax with per-head alpha, top_k_softmax) in the Pallas
engine, interpret mode, against the dense float32 reference ``normalizer(logits) @ v``:
the output and every cotangent (alpha's included), the live-block skipping (skipped
blocks are never read), empty rows, the adapter, and cross-lowering for both targets."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxsoft.normalizers as jn
from tests.kernels_pallas.test_engine import (
    TRITON_SMALL,
    assert_matches,
    check_dot_product_attention,
    check_matrix,
    check_mosaic_causal_window,
    check_per_head_parameter,
    check_rows_without_visible_keys,
    inputs,
    kernel,
    reference,
    value_and_cotangents,
)
from tests.kernels_pallas.test_lowering import _export

T_NAMES = sorted(n for n in jn.names()
                 if jn.get(n).kernel_class == "T" and jn.get(n).threshold is not None)
ALPHA = jnp.asarray([1.25, 2.5]).reshape(2, 1, 1)  # per head, differentiable; > 2 too


def _params(name):
  return {"top_k_softmax": {"k": 3}, "entmax": {"alpha": 1.3}}.get(name)


def test_threshold_normalizers_are_covered():
  assert {"sparsemax", "entmax15", "entmax", "top_k_softmax"} <= set(T_NAMES)


# The default run covers the named ones (entmax also through the per-head test below);
# every registered threshold rule runs under -m slow.
DEFAULT = ["sparsemax", "entmax15", "top_k_softmax"]
PARAMS = [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in T_NAMES]


@pytest.mark.parametrize("name", PARAMS)
def test_every_threshold_normalizer(name):
  # Causal + GQA + T = 40 with 16-wide blocks: padding, skipped and partial blocks.
  q, k, v, ct = inputs(t=40, n=2, kh=1, seed=11)
  q = q * 2.0  # larger logits: sparse rows, so some key blocks are skipped
  assert_matches(kernel(normalizer=name, normalizer_params=_params(name), is_causal=True),
                 lambda q, k, v: reference(q, k, v, normalizer=name, params=_params(name),
                                           is_causal=True), (q, k, v), ct)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_entmax_per_head_alpha_and_its_gradient(backend):
  check_per_head_parameter("entmax", "alpha", ALPHA, backend, seed=12)


@pytest.mark.slow
def test_mosaic_sparsemax_causal_window():
  check_mosaic_causal_window("sparsemax", seed=13)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_blocks_below_tau_are_never_read(backend):
  """Keys 16..47 score far below every row's tau: their weights are exactly 0, so the
  weighted and backward passes skip their blocks. NaN values there prove it (a pass that
  read them would spread the NaN); their dK and dV are exactly 0."""
  q, k, v, ct = inputs(t=64, n=1, kh=1, seed=14)
  q = q.at[..., 0].set(1.0)
  k = k.at[:, 16:48, :, 0].set(-50.0).at[:, :16, :, 0].set(8.0).at[:, 48:, :, 0].set(8.0)
  blocks = TRITON_SMALL if backend == "triton" else dict(block_q=16, block_k=16)
  v_nan = v.at[:, 16:48].set(jnp.nan)
  f = kernel(backend=backend, block_sizes=blocks, normalizer="sparsemax", scale=1.0)
  out, (dq, dk, dv) = jax.jit(lambda *a: value_and_cotangents(f, a, ct))(q, k, v_nan)
  ref_out, (rdq, rdk, rdv) = jax.jit(lambda *a: value_and_cotangents(  # one compilation
      lambda q, k, v: reference(q, k, v, normalizer="sparsemax", scale=1.0), a, ct))(q, k, v)
  chex.assert_trees_all_close((out, dq), (ref_out, rdq), atol=1e-4, rtol=1e-4)
  chex.assert_trees_all_close((dk, dv), (rdk, rdv), atol=1e-4, rtol=1e-4)
  assert bool(jnp.all(dk[:, 16:48] == 0)) and bool(jnp.all(dv[:, 16:48] == 0))


def test_rows_without_visible_keys_are_zero_with_zero_gradient():
  check_rows_without_visible_keys("sparsemax")


def test_dot_product_attention_runs_the_kernel(monkeypatch):
  check_dot_product_attention(monkeypatch, "sparsemax", seed=16)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_threshold_kernels_lower(backend):
  text = _export(backend, t=384, normalizer="entmax", is_causal=True,
                 normalizer_params={"alpha": jnp.full((4, 1, 1), 1.3)})
  assert text.count("jaxsoft_attention_t") >= 4  # search, weighted, dQ, dK/dV


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("name", T_NAMES)
def test_threshold_matrix(backend, name):
  """T not a multiple of the block, cross-attention lengths, head dims 72/128, soft cap."""
  check_matrix(backend, name, _params(name), [(100, 130, 72), (64, 64, 128)])


@pytest.mark.slow
def test_check_grads_float64_entmax15():
  with jax.enable_x64(True):
    q, k, v, _ = inputs(t=20, n=2, kh=1, h=16, dtype=jnp.float64, seed=17)
    f = kernel(normalizer="entmax15", is_causal=True)
    jax.test_util.check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-5, rtol=1e-5)
