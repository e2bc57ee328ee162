"""K06 ``approx_sigmoid``: sigmoid attention's numerator as ``0.5 + 0.5 tanh(z / 2)`` with
the GPU's ``tanh.approx.f32`` (FlashSigmoid), forward and backward, Triton only.

On CPU the interpreter cannot run PTX, so ``jnp.tanh`` stands in: the tests check that the
rewritten numerator and its derivative ``w (1 - w)`` give the exact kernel's output and
cotangents (the length-dependent bias, a learned per-head bias, rows with no visible
key), that the cuda lowering of every pass holds the ``tanh.approx.f32`` instruction (and
the flag-off one none), and that misuse is refused. The instruction's own error (PTX:
relative 2^-10.987, so each weight within 2.5e-4) is measured on a GPU by
``bench/gpu.py --sections sigmoid``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from tests.kernels_pallas.test_engine import TRITON_SMALL, assert_matches, inputs
from tests.kernels_pallas.test_lowering import export_fwd_bwd

B, T, N, KH, H = 2, 40, 4, 2, 16


def _kernel(approx, **kw):
  return lambda q, k, v, bias: kp.attention(
      q, k, v, normalizer="sigmoid", normalizer_params={"bias": bias}, interpret=True,
      block_sizes=TRITON_SMALL, approx_sigmoid=approx, **kw)


def test_approx_sigmoid_is_the_sigmoid_kernel_in_the_interpreter():
  """Same output and cotangents (q, k, v and a per-head learned bias) as the exact kernel,
  causal, GQA, a batch row with no visible key (zeros, zero gradient)."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=81)
  bias = jnp.linspace(-3.0, -1.0, N).reshape(N, 1, 1)
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([T, 0], jnp.int32))
  out, grads = assert_matches(_kernel(True, **kw), _kernel(False, **kw), (q, k, v, bias), ct,
                              fwd_tol=1e-6, bwd_tol=1e-5)
  assert bool(jnp.all(out[1] == 0)) and bool(jnp.all(grads[0][1] == 0))
  assert bool(jnp.any(grads[3] != 0))


def test_approx_sigmoid_with_the_length_dependent_default_bias():
  """Without a bias array the score map is z - log n (n the visible count)."""
  q, k, v, ct = inputs(b=1, t=T, n=2, kh=2, h=H, seed=82)
  f = lambda approx: (lambda q, k, v: kp.attention(  # noqa: E731
      q, k, v, normalizer="sigmoid", local_window_size=(7, 0), interpret=True,
      block_sizes=TRITON_SMALL, approx_sigmoid=approx))
  assert_matches(f(True), f(False), (q, k, v), ct, fwd_tol=1e-6, bwd_tol=1e-5)


def test_every_pass_lowers_to_tanh_approx_for_cuda():
  """The forward, dQ and dK/dV kernels each hold one tanh.approx.f32 (the flag-off kernels
  none): the instruction reaches the GPU in every pass."""
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)

  def text(approx):
    return export_fwd_bwd(lambda q, k, v: kp.attention(
        q, k, v, normalizer="sigmoid", is_causal=True, backend="triton",
        approx_sigmoid=approx), "triton", q, k)

  assert text(True).count("tanh.approx.f32") == 3
  assert text(False).count("tanh.approx") == 0


@pytest.mark.parametrize("kw,match", [
    (dict(normalizer="softmax"), "sigmoid normalizer"),
    (dict(normalizer="sparsemax"), "sigmoid normalizer"),
    (dict(backend="mosaic_tpu"), "Triton"),
    (dict(approx_sigmoid=1), "must be a bool"),
])
def test_approx_sigmoid_misuse_is_refused(kw, match):
  q, k, v, _ = inputs(b=1, t=16, n=2, kh=2, h=H, seed=83)
  kw = {"normalizer": "sigmoid", "approx_sigmoid": True, **kw}
  with pytest.raises(ValueError, match=match):
    kp.attention(q, k, v, interpret=True, **kw)
