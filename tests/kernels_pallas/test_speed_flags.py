"""K06 speed flags of the Pallas forward pass: ``exp2`` and ``rescale_threshold``.

``exp2=True`` folds log2(e) into the kernel's scale and computes the tile numerators with
exp2 (Dao 2023, "FlashAttention-2"; Shah et al. 2024, "FlashAttention-3");
``rescale_threshold=tau`` rescales the accumulator only when a key block's max exceeds the
stabiliser in use by more than tau (FlashAttention-4's conditional rescaling). Both are the
same function, so output and every cotangent must equal the flag-off kernel and the dense
float32 reference up to float32 rounding. The scores are spread wide (q x 30) so that the
lazy path skips some rescales and makes others: a float64 NumPy re-run of the block loop
says which, and the kernel's saved stabiliser must be that loop's ``m_used``.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import triton
from tests.kernels_pallas.test_engine import inputs, reference
from tests.kernels_pallas.test_lowering import _export

BLOCKS = dict(block_q=16, block_k=16)  # Triton: powers of two; Mosaic (interpret): 8 | 16
B, T, N, KH, H = 1, 48, 4, 2, 16
TAU = 8.0
SINKS = (20.0, 25.0, 30.0, 12.0)  # far above the unscaled scores (|s| of a few units)


def _case(name):
  """(kernel kwargs, reference kwargs, q, k, v, ct) of a named case."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=6)
  if name == "softmax_causal_gqa":
    return dict(is_causal=True), dict(is_causal=True), 30.0 * q, k, v, ct
  if name == "sink_far_above":
    sinks = jnp.asarray(SINKS, jnp.float32)
    return (dict(normalizer="softmax_sink", normalizer_params={"sink_logit": sinks.reshape(N, 1, 1)},
                 is_causal=True),
            dict(is_causal=True, sinks=sinks.reshape(N, 1, 1)), q, k, v, ct)
  assert name == "softcap_temperature"
  return (dict(normalizer_params={"temperature": 0.5}, logits_soft_cap=20.0),
          dict(params={"temperature": 0.5}, soft_cap=20.0), 10.0 * q, k, v, ct)


@functools.cache
def _run(backend, name, exp2=False, tau=None):
  """Output and (dq, dk, dv) of the kernel, jitted, for the case's random cotangent."""
  kw, _, q, k, v, ct = _case(name)

  def f(q, k, v):
    return kp.attention(q, k, v, backend=backend, interpret=True, block_sizes=BLOCKS,
                        exp2=exp2, rescale_threshold=tau, **kw)

  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)

  return jax.jit(fwd_bwd)(q, k, v)


def _close(got, want, tol):
  """Every leaf within ``tol`` of ``want``, relative to the leaf's largest magnitude."""
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    assert bool(jnp.all(jnp.isfinite(g)))
    sc = float(jnp.max(jnp.abs(w)))
    chex.assert_trees_all_close(g, w, atol=tol * sc, rtol=tol)


def _check(backend, name, exp2, tau, got=None):
  """Flag on == flag off (tight) and == the dense float32 reference (float32 tolerance);
  ``got``: the flagged run's (output, grads) when already computed."""
  _, ref_kw, q, k, v, ct = _case(name)
  out, grads = _run(backend, name, exp2, tau) if got is None else got
  base_out, base_grads = _run(backend, name)
  _close(out, base_out, 2e-5)
  _close(grads, base_grads, 2e-5)
  @jax.jit  # one compilation, not one per op
  def ref(q, k, v, ct):
    ref_out, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, **ref_kw), q, k, v)
    return ref_out, vjp(ct)

  ref_out, ref_grads = ref(q, k, v, ct)
  _close(out, ref_out, 1e-4)
  _close(grads, ref_grads, 1e-4)


def _numpy_lazy_loop(q, k, tau, bk):
  """The forward's key loop per row in float64 with causal masking: ``(m_used [B, N, T],
  rescales, skips, ambiguous)`` where a rescale moves a finite m_used (block max >
  m_used + tau), a skip keeps it although the block's max is above it, and ambiguous
  rows have a decision within 1e-3 of tau (float32 may decide otherwise)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, t, n, h = q.shape
  k = np.repeat(k, n // k.shape[2], axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  s = np.where(np.tril(np.ones((t, k.shape[1]), bool)), s, -np.inf)
  m_used = np.full((b, n, t), -np.inf)
  ambiguous = np.zeros((b, n, t), bool)
  rescales = skips = 0
  for j in range(0, k.shape[1], bk):
    bmax = s[..., j:j + bk].max(axis=-1)
    grow = bmax > m_used
    move = bmax > m_used + tau
    ambiguous |= np.isfinite(m_used) & (np.abs(bmax - m_used - tau) < 1e-3)
    rescales += int(np.sum(move & np.isfinite(m_used)))
    skips += int(np.sum(grow & ~move))
    m_used = np.where(move, bmax, m_used)
  return m_used, rescales, skips, ambiguous


def _lazy_check(monkeypatch, exp2):
  """Triton, softmax causal + GQA, q x 30, tau = 8: both kinds of block occur, the saved
  stabiliser is the loop's m_used (below the row max where a rescale was skipped), and
  the result equals the eager kernel and the dense reference."""
  _, _, q, k, _, _ = _case("softmax_causal_gqa")
  m_np, rescales, skips, ambiguous = _numpy_lazy_loop(q, k, TAU, BLOCKS["block_k"])
  assert rescales > 0 and skips > 0, (rescales, skips)
  saved = []
  forward = triton.forward

  def spy(*args, **kw):  # the saved stabiliser m [B, N, T_pad, 1], out of the jitted run
    out = forward(*args, **kw)
    jax.debug.callback(lambda m: saved.append(np.asarray(m)), out[1])
    return out

  monkeypatch.setattr(triton, "forward", spy)
  got = jax.block_until_ready(_run.__wrapped__("triton", "softmax_causal_gqa", exp2, TAU))
  monkeypatch.setattr(triton, "forward", forward)
  _check("triton", "softmax_causal_gqa", exp2, TAU, got)
  assert len(saved) == 1
  m_kernel = saved[0][..., :T, 0]  # [B, N, T]
  row_max = np.max(np.where(np.tril(np.ones((T, T), bool)),
                            np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64),
                                      np.repeat(np.asarray(k, np.float64), N // KH, 2)) /
                            np.sqrt(H), -np.inf), axis=-1)
  ok = ~ambiguous
  assert ok.mean() > 0.9
  np.testing.assert_allclose(m_kernel[ok], m_np[ok], rtol=1e-5, atol=1e-4)
  assert np.sum(m_kernel[ok] < row_max[ok] - 1e-3) > 0  # some rows kept a lower m_used


def test_lazy_rescale_skips_and_rescales_exp2(monkeypatch):
  """Both flags together (exp2 in the log2 domain, the lazy threshold scaled to it)."""
  _lazy_check(monkeypatch, True)


@pytest.mark.slow
def test_lazy_rescale_skips_and_rescales(monkeypatch):
  _lazy_check(monkeypatch, False)


@pytest.mark.slow
def test_rescale_threshold_zero_is_eager():
  """tau = 0 moves the stabiliser exactly when the eager loop does."""
  out, grads = _run("triton", "softmax_causal_gqa", False, 0.0)
  base_out, base_grads = _run("triton", "softmax_causal_gqa")
  _close(out, base_out, 1e-6)
  _close(grads, base_grads, 1e-6)


@pytest.mark.slow
def test_flags_mosaic_sink():
  """The Mosaic driver (interpret mode), both flags, softmax_sink with per-head sinks far
  above the scores (the floor in log2 units, the offset from the natural-unit m)."""
  _check("mosaic_tpu", "sink_far_above", True, TAU)


@pytest.mark.slow
def test_sink_gradient_with_flags():
  """The sink logits' cotangent (from the saved statistics, natural units) with exp2 and
  tau equals the flag-off kernel's and the dense reference's."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=7)
  sinks = jnp.asarray(SINKS, jnp.float32).reshape(N, 1, 1)

  def loss(sinks, **flags):
    o = kp.attention(q, k, v, normalizer="softmax_sink", normalizer_params={"sink_logit": sinks},
                     is_causal=True, backend="triton", interpret=True, block_sizes=BLOCKS,
                     **flags)
    return jnp.sum(o * ct)

  got = jax.grad(functools.partial(loss, exp2=True, rescale_threshold=TAU))(sinks)
  base = jax.grad(loss)(sinks)
  ref = jax.grad(lambda s: jnp.sum(reference(q, k, v, is_causal=True, sinks=s) * ct))(sinks)
  _close(got, base, 2e-5)
  _close(got, ref, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("name", ["softmax_causal_gqa", "sink_far_above", "softcap_temperature"])
@pytest.mark.parametrize("exp2,tau", [(True, None), (False, TAU), (True, TAU), (False, 0.0),
                                      (True, 0.0)])
def test_flags_sweep(backend, name, exp2, tau):
  _check(backend, name, exp2, tau)


@pytest.mark.parametrize("kw,match", [
    (dict(normalizer="sigmoid", exp2=True), "exp2"),
    (dict(normalizer="ssmax", exp2=True), "exp2"),
    (dict(normalizer="sparsemax", exp2=True), "exp2"),
    (dict(normalizer="stablemax", rescale_threshold=1.0), "rescale_threshold"),
    (dict(normalizer="sparsemax", rescale_threshold=1.0), "rescale_threshold"),
    (dict(rescale_threshold=-1.0), "rescale_threshold"),
    (dict(rescale_threshold=float("nan")), "rescale_threshold"),
    (dict(rescale_threshold="8"), "rescale_threshold"),
])
def test_flags_rejected(kw, match):
  q, k, v, _ = inputs(t=16)
  with pytest.raises(ValueError, match=match):
    kp.attention(q, k, v, backend="triton", interpret=True, block_sizes=BLOCKS, **kw)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_flags_lower(backend):
  """Export-lowering for CUDA (Triton) and TPU (Mosaic) with both flags on (the lazy
  path's conditional rescale and exp2 in the forward kernel)."""
  text = _export(backend, t=256, is_causal=True, exp2=True, rescale_threshold=TAU)
  if backend == "triton":
    assert text.count("jaxsoft_attention_") >= 3
  else:
    assert "tpu_custom_call" in text


@pytest.mark.slow
def test_lazy_rescale_class_r_second_pass():
  """Class R (standardized_softmax): its class-E second pass with tau equals the eager one
  and the dense reference."""
  q, k, v, ct = inputs(b=1, t=32, n=2, kh=1, h=16, seed=3)
  q = 10.0 * q

  def run(tau):
    f = lambda q, k, v: kp.attention(  # noqa: E731
        q, k, v, normalizer="standardized_softmax", is_causal=True, backend="triton",
        interpret=True, block_sizes=BLOCKS, rescale_threshold=tau)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)

  got, base = run(4.0), run(None)
  _close(got, base, 2e-5)
  ref_out, vjp = jax.vjp(
      lambda q, k, v: reference(q, k, v, normalizer="standardized_softmax", is_causal=True),
      q, k, v)
  _close(got, (ref_out, vjp(ct)), 1e-4)


def test_flags_keep_fully_masked_rows_zero():
  """With both flags, a query row with no visible key (key length 0 in batch 1, query
  length 5 in batch 0) returns zeros with zero, finite cotangents, as the flag-off kernel."""
  q, k, v, ct = inputs(b=2, t=T, n=N, kh=KH, h=H, seed=8)
  lengths = dict(query_seq_lengths=jnp.array([5, T]), key_value_seq_lengths=jnp.array([T, 0]))

  def run(exp2, tau, q, k, v, ct):  # the inputs as arguments: no constant folding
    def f(q, k, v):
      return kp.attention(q, k, v, backend="triton", interpret=True, block_sizes=BLOCKS,
                          is_causal=True, exp2=exp2, rescale_threshold=tau, **lengths)
    out, vjp = jax.vjp(f, 30.0 * q, k, v)
    return out, vjp(ct)

  out, grads = jax.jit(lambda q, k, v, ct: run(True, TAU, q, k, v, ct))(q, k, v, ct)
  base_out, base_grads = jax.jit(lambda q, k, v, ct: run(False, None, q, k, v, ct))(q, k, v, ct)
  for x in (out, *grads):
    assert bool(jnp.all(jnp.isfinite(x)))
  assert bool(jnp.all(out[1] == 0.0)) and bool(jnp.all(out[0, 5:] == 0.0))
  assert all(bool(jnp.all(g[1] == 0.0)) for g in grads)
  _close(out, base_out, 2e-5)
  _close(grads, base_grads, 2e-5)
