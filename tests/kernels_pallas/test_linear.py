"""Feature K07: the Pallas chunk kernels of the scalar-decay linear recurrences
(``kernels_pallas.linear``; ``implementation="pallas"`` of simple_gla, lightning_attention,
delta_rule and gated_delta_rule), in interpret mode on CPU and cross-lowered for CUDA
(Triton) and TPU (Mosaic).

References: the float64 numpy loop of ``tests/linear/reference.py`` (outputs, final states)
and a float64 ``lax.scan`` written here from the recurrence (gradients); the kernels' custom
VJP by ``check_grads`` in float64; the XLA chunked form (itself checked against the loop
and the other forms in tests/linear) under ``-m slow``. T is never a multiple of the chunk.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.test_util import check_grads

from jaxsoft import linear
from jaxsoft.linear import chunk as _chunk
from jaxsoft.linear import recurrence as _recurrence
from kernels_pallas import linear as kl
from tests.linear import cases

INTERPRET = "JAXSOFT_PALLAS_INTERPRET"
TRITON_CALL = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
B, T, N, K, V, C = 2, 37, 2, 4, 3, 16   # T = 2 C + 5: the last chunk is padded


@pytest.fixture
def interpret(monkeypatch):
  """The public functions' ``implementation="pallas"`` on CPU: the Triton driver in the
  Pallas interpreter."""
  monkeypatch.setenv(INTERPRET, "1")


def _internal(variant, seed=0, dtype=jnp.float32, v_dim=V, **kw):
  """``[B, N, T, ...]`` arguments of :func:`kl.chunked` (q unscaled: scale is 1 there)."""
  a = cases.inputs(variant, B=B, T=T, N=N, K=K, V=v_dim, seed=seed, **kw)
  bn = lambda x: None if x is None else jnp.moveaxis(x, 1, 2).astype(dtype)
  return (bn(a["q"]), bn(a["k"]), bn(a["v"]), bn(a.get("g")), bn(a.get("beta")),
          a["initial_state"].astype(dtype))


def _scan_reference(args, segment_ids=None):
  """float64 ``(o, S_T)`` of the recurrence, by a ``lax.scan`` over tokens written from
  ``S_t = e^{g_t} S_{t-1}`` (0 at a segment change), ``S_t += k_t u_t^T``, ``u_t = v_t`` or
  ``beta_t (v_t - S_t^T k_t)``, ``o_t = S_t^T q_t K^{-1/2}``; differentiable (call it under
  ``jax.enable_x64``)."""
  a = {n: jnp.asarray(x, jnp.float64) for n, x in args.items()}
  q, k, v = a["q"], a["k"], a["v"]
  Bq, Tq, Nq, Kq = q.shape
  g = a.get("g", jnp.zeros((Bq, Tq, Nq), jnp.float64))
  g = jnp.broadcast_to(g, (Bq, Tq, Nq))
  beta = a.get("beta")
  keep = jnp.ones((Bq, Tq), bool)
  if segment_ids is not None:
    seg = jnp.asarray(segment_ids)
    keep = keep.at[:, 1:].set(seg[:, 1:] == seg[:, :-1])

  def body(S, x):
    q_t, k_t, v_t, g_t, b_t, keep_t = x
    S = jnp.where(keep_t[:, None, None, None], S, 0.0) * jnp.exp(g_t)[..., None, None]
    u = v_t if b_t is None else b_t[..., None] * (v_t - jnp.einsum("bnkv,bnk->bnv", S, k_t))
    S = S + k_t[..., :, None] * u[..., None, :]
    return S, jnp.einsum("bnkv,bnk->bnv", S, q_t * Kq ** -0.5)

  t_first = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
  S_T, o = jax.lax.scan(body, a["initial_state"], (t_first(q), t_first(k), t_first(v),
                                                   t_first(g), t_first(beta), keep.T))
  return jnp.moveaxis(o, 0, 1), S_T


def _loss(fn, args, w):
  o, S = fn(args)
  return jnp.sum(o.astype(w[0].dtype) * w[0]) + jnp.sum(S.astype(w[1].dtype) * w[1])


def _weights(args, seed=3):
  k1, k2 = jax.random.split(jax.random.key(seed))
  shape_o = args["q"].shape[:3] + (args["v"].shape[-1],)
  return (jax.random.normal(k1, shape_o), jax.random.normal(k2, args["initial_state"].shape))


def _assert_tree_close(got, want, rtol, name=""):
  for path, x in jax.tree_util.tree_leaves_with_path(want):
    y = functools.reduce(lambda t, p: t[p.key], path, got)
    x = np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), x, rtol=rtol,
                               atol=rtol * float(np.max(np.abs(x))),
                               err_msg=f"{name} d/d{jax.tree_util.keystr(path)}")


def _check_public(variant, seg, chunk=C, **input_kw):
  """Outputs and final state against the numpy loop, every gradient against the float64
  scan's (the public call, jitted, through the dispatcher)."""
  args = cases.inputs(variant, B=B, T=T, N=N, K=K, V=V, **input_kw)
  w = _weights(args)
  call = lambda a: cases._call(variant, a, implementation="pallas", chunk_size=chunk,
                               segment_ids=seg)

  def loss(a, w):  # the outputs ride along (has_aux): one compilation, not two
    o, S = call(a)
    return _loss(lambda _: (o, S), a, w), (o, S)

  grads, (o, S) = jax.jit(jax.grad(loss, has_aux=True))(args, w)
  o_ref, S_ref = cases.reference_call(variant, args, seg)
  np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(S, S_ref, rtol=2e-5, atol=2e-5)
  with jax.enable_x64(True):
    w64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), w)
    args64 = jax.tree.map(lambda x: np.asarray(x, np.float64), args)
    want = jax.jit(jax.grad(lambda a: _loss(lambda b: _scan_reference(b, seg), a, w64)))(args64)
    want = jax.tree.map(np.asarray, want)
  _assert_tree_close(grads, want, 2e-4, variant)
  return args, grads


# ----------------------------------------------------------------------------- the VJP


def _check_vjp_float64(backend, delta, segments):
  """``check_grads`` (reverse mode, float64) of the kernels' custom VJP: every input, with
  an initial state, segments (a change inside a chunk and one on a chunk boundary) and a
  padded last chunk. Triton: V = 20 (padded to 32) in two programs of 16 columns."""
  block_v = 16 if backend == "triton" else None
  with jax.enable_x64(True):
    q, k, v, g, beta, S0 = _internal("gated_delta_rule", dtype=jnp.float64,
                                     v_dim=20 if backend == "triton" else V)
    seg = np.zeros((B, T), np.int32)
    seg[0, 3:16] = 1
    seg[1, 20:] = 2
    run = _chunk.run_ids(jnp.asarray(seg), B, T) if segments else jnp.zeros((B, T), jnp.int32)

    def f(q, k, v, g, beta, S0):
      return kl.chunked(q, k, v, g, beta if delta else None, run, S0, chunk=C,
                        backend=backend, interpret=True, segments=segments, block_v=block_v)

    f = jax.jit(f)
    check_grads(f, (q, k, v, g, beta, S0), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    # and against the float64 loop
    o, S_T = f(q, k, v, g, beta, S0)
    o_ref, S_ref = cases.reference.recurrence(
        np.moveaxis(np.asarray(q), 1, 2), np.moveaxis(np.asarray(k), 1, 2),
        np.moveaxis(np.asarray(v), 1, 2), g=np.moveaxis(np.asarray(g), 1, 2),
        beta=np.moveaxis(np.asarray(beta), 1, 2) if delta else None,
        initial_state=np.asarray(S0), segment_ids=seg if segments else None, scale=1.0)
    np.testing.assert_allclose(np.moveaxis(np.asarray(o), 1, 2), o_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(S_T, S_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend, delta", [
    ("mosaic_tpu", True), ("triton", True),
    pytest.param("triton", False, marks=pytest.mark.slow),
    pytest.param("mosaic_tpu", False, marks=pytest.mark.slow)])
def test_custom_vjp_check_grads_float64(backend, delta):
  _check_vjp_float64(backend, delta, segments=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_custom_vjp_check_grads_without_segments(backend):
  _check_vjp_float64(backend, True, segments=False)


@pytest.mark.parametrize("delta", [False, True])
def test_backward_keeps_no_chunk_by_chunk_arrays(delta):
  """Autodiff keeps the inputs, O(T) decay terms and the chunk-start states
  ``[BN, T / C, K, V]``: no ``[C, C]`` array (scores, the delta rule's A or UT inverse,
  which are rematerialised), ``C = 32`` here, and nothing of size ``T x T``."""
  Tr, Cr = 100, 32
  a = cases.inputs("gated_delta_rule", B=1, T=Tr, N=1, K=K, V=V, state=True)
  bn = lambda x: jnp.moveaxis(x, 1, 2)
  run = jnp.zeros((1, Tr), jnp.int32)

  def loss(q, k, v, g, beta, S0):
    o, S = kl.chunked(q, k, v, g, beta if delta else None, run, S0, chunk=Cr,
                      backend="triton", interpret=True, segments=False)
    return jnp.sum(o) + jnp.sum(S)

  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(
        loss, bn(a["q"]), bn(a["k"]), bn(a["v"]), bn(a["g"]), bn(a["beta"]),
        a["initial_state"])
  shapes = [tuple(int(d) for d in m.group(1).split(",") if d)
            for m in re.finditer(r"\w+\[([\d,]*)\]", out.getvalue())]
  assert shapes, out.getvalue()
  assert (1, 4, 16, 16) in shapes   # the chunk-start states (K, V padded to 16 for Triton)
  assert not [s for s in shapes if s[-2:] == (Cr, Cr) or Tr in s[-2:] and s[-1] == s[-2]]
  # O(T·K) in all: at most T_pad · (4 K_pad + K + V + 16) + (T / C) · K_pad · V_pad numbers
  # (one [C, C] array per chunk would add 4 · 32 · 32 and break the bound)
  assert sum(int(np.prod(s)) for s in shapes) <= 128 * (4 * 16 + K + V + 16) + 4 * 16 * 16


@pytest.mark.slow
def test_mosaic_tpu_interpret_mode_nan_memory_no_races():
  """The Mosaic driver in TPU interpret mode, uninitialised memory reading NaN (a scratch or
  output block the kernel forgets to write shows up) and race detection; values and every
  gradient equal the XLA chunked form's."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

  q, k, v, g, beta, S0 = _internal("gated_delta_rule", seed=8)
  seg = cases.segments(B, T, seed=8)
  run = _chunk.run_ids(seg, B, T)
  params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
  w = _weights({"q": jnp.moveaxis(q, 1, 2), "v": jnp.moveaxis(v, 1, 2), "initial_state": S0})
  w = (jnp.moveaxis(w[0], 1, 2), w[1])

  def loss(pallas, *xs):
    if pallas:
      o, S = kl.chunked(*xs[:5], run, xs[5], chunk=C, backend="mosaic_tpu", interpret=params)
    else:
      o, S = _recurrence.chunked(*xs[:5], run, xs[5], chunk=C)
    return jnp.sum(o * w[0]) + jnp.sum(S * w[1])

  got, want = (jax.jit(jax.value_and_grad(functools.partial(loss, p), argnums=tuple(range(6))))(
      q, k, v, g, beta, S0) for p in (True, False))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(got))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for a, b in zip(got[1], want[1], strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b))))
  assert ipc.races is not None and not ipc.races.races_found


# ------------------------------------------------------------------- the public functions


def test_simple_gla_matches_references(interpret):
  """The default run's public check (the Mosaic driver's delta-rule VJP is checked above;
  the other variants, with and without segments, under ``-m slow``)."""
  _check_public("simple_gla", cases.segments(B, T, seed=2))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["simple_gla", "delta_rule", "gated_delta_rule"])
@pytest.mark.parametrize("with_segments", [False, True])
def test_public_matches_references_slow(interpret, variant, with_segments):
  _check_public(variant, cases.segments(B, T, seed=4) if with_segments else None)


def _lightning_args(seed=0):
  a = cases.inputs("simple_gla", B=B, T=T, N=N, K=K, V=V, seed=seed)
  a["g"] = jnp.log(jnp.array([0.7, 0.95]))
  return a


def test_lightning_attention_forward(interpret):
  """g [N] (one decay per head), segments: outputs and final state against the loop."""
  args = _lightning_args()
  seg = cases.segments(B, T, seed=5)
  fn = jax.jit(lambda a: linear.lightning_attention(
      a["q"], a["k"], a["v"], a["g"], initial_state=a["initial_state"], segment_ids=seg,
      implementation="pallas", chunk_size=C, output_final_state=True))
  o, S = fn(args)
  o_ref, S_ref = cases.reference.recurrence(
      args["q"], args["k"], args["v"], g=np.broadcast_to(np.asarray(args["g"]), (B, T, N)),
      initial_state=args["initial_state"], segment_ids=np.asarray(seg))
  np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(S, S_ref, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_lightning_attention_gradients(interpret):
  args = _lightning_args(seed=1)
  w = _weights(args)

  def call(a):
    return linear.lightning_attention(a["q"], a["k"], a["v"], a["g"],
                                      initial_state=a["initial_state"],
                                      implementation="pallas", chunk_size=C,
                                      output_final_state=True)

  grads = jax.jit(jax.grad(functools.partial(_loss, call)))(args, w)
  with jax.enable_x64(True):
    w64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), w)
    args64 = jax.tree.map(lambda x: np.asarray(x, np.float64), args)
    want = jax.jit(jax.grad(lambda a: _loss(_scan_reference, a, w64)))(args64)
    want = jax.tree.map(np.asarray, want)
  _assert_tree_close(grads, want, 2e-4, "lightning_attention")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["simple_gla", "gated_delta_rule"])
def test_pallas_equals_chunked(interpret, variant):
  """Values and every gradient equal the XLA chunked form's (float32, ~1e-5)."""
  args = cases.inputs(variant, B=B, T=T, N=N, K=K, V=V, seed=6)
  seg = cases.segments(B, T, seed=6)
  w = _weights(args)
  out = {}
  for impl in ("pallas", "chunked"):
    call = lambda a, impl=impl: cases._call(variant, a, implementation=impl, chunk_size=C,
                                            segment_ids=seg)
    out[impl] = jax.jit(jax.value_and_grad(functools.partial(_loss, call)))(args, w)
  np.testing.assert_allclose(out["pallas"][0], out["chunked"][0], rtol=1e-5)
  _assert_tree_close(out["pallas"][1], out["chunked"][1], 2e-5, variant)


def test_bf16_and_strong_decay_simple_gla(interpret):
  """bf16 inputs (computed in float32, returned in bf16; state float32) with log decays down
  to -30 per token: finite, and equal to the loop on the rounded inputs."""
  args = cases.inputs("simple_gla", B=B, T=T, N=N, K=K, V=V, strong_decay=True,
                      dtype=jnp.bfloat16)
  o, S = cases.call("simple_gla", args, implementation="pallas", chunk_size=C)
  assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
  o_ref, S_ref = cases.reference_call("simple_gla",
                                      jax.tree.map(lambda x: x.astype(jnp.float32), args))
  assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(S)))
  np.testing.assert_allclose(o.astype(jnp.float32), o_ref, rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(S, S_ref, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["simple_gla", "gated_delta_rule"])
def test_strong_decay_gradients_are_finite(interpret, variant):
  """Log decays down to -30 per token: finite gradients, equal to the float64 scan's."""
  _, grads = _check_public(variant, None, strong_decay=True)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(grads))


# ------------------------------------------------------------------------------- errors


def test_without_a_backend_pallas_is_not_implemented(monkeypatch):
  monkeypatch.delenv(INTERPRET, raising=False)
  x = jnp.ones((1, 5, 1, 4))
  gate = -jnp.ones((1, 5, 1))
  if jax.default_backend() == "cpu":
    with pytest.raises(NotImplementedError, match="pallas"):
      linear.gated_delta_rule(x, x, x, gate, -gate, implementation="pallas", chunk_size=16)
  with pytest.raises(NotImplementedError, match="pallas"):   # per-channel decays: no kernel
    linear.gla(x, x, x, -x, implementation="pallas", chunk_size=16)


def test_bad_chunk_names_the_argument(interpret):
  args = cases.inputs("simple_gla", T=5)
  with pytest.raises(ValueError, match="`chunk_size`"):
    cases.call("simple_gla", args, implementation="pallas", chunk_size=24)
  with pytest.raises(ValueError, match="`chunk_size`"):
    kl.check_chunk(12, 100, "mosaic_tpu")
  assert kl.check_chunk(64, 5, "triton") == 16 and kl.check_chunk(64, 5, "mosaic_tpu") == 8


# ---------------------------------------------------------------------------- lowering


def _abstract_gpu():
  """An abstract H100 mesh (newer JAX reads the target GPU from it when none is attached;
  JAX 0.10 lowers without one)."""
  try:
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                         platform="gpu")
  except (AttributeError, TypeError):
    return contextlib.nullcontext()
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def _export(backend, delta, chunk, t=200, k=64, v=128):
  """Forward and backward (every gradient) of the kernels, exported for the backend's
  platform: the Triton / Mosaic lowering runs with its block-shape rules."""
  b, n = 1, 2

  def fn(q, kk, vv, g, beta, S0, seg):
    run = _chunk.run_ids(seg, b, t)

    def loss(q, kk, vv, g, beta, S0):
      o, S = kl.chunked(q, kk, vv, g, beta if delta else None, run, S0, chunk=chunk,
                        backend=backend)
      return jnp.sum(o) + jnp.sum(S)
    return jax.grad(loss, argnums=tuple(range(6)))(q, kk, vv, g, beta, S0)

  sd = jax.ShapeDtypeStruct
  f32 = jnp.float32
  args = (sd((b, n, t, k), f32), sd((b, n, t, k), f32), sd((b, n, t, v), f32),
          sd((b, n, t), f32), sd((b, n, t), f32), sd((b, n, k, v), f32), sd((b, t), jnp.int32))
  platform = "cuda" if backend == "triton" else "tpu"
  with _abstract_gpu() if backend == "triton" else contextlib.nullcontext():
    exp = jax.export.export(jax.jit(fn), platforms=[platform],
                            disabled_checks=[TRITON_CALL])(*args)
  return exp.mlir_module()


@pytest.mark.parametrize("delta", [pytest.param(False, marks=pytest.mark.slow), True])
def test_lowers_for_cuda_and_tpu(delta):
  text = _export("triton", delta, 64)
  assert "__gpu$xla.gpu.triton" in text
  assert "jaxsoft_linear_fwd" in text and "jaxsoft_linear_bwd" in text
  text = _export("mosaic_tpu", delta, 64)
  assert "tpu_custom_call" in text


def test_illegal_chunks_fail_in_lowering(monkeypatch):
  """Without the argument check, a chunk of 24 breaks Triton's power-of-two rule and one of
  12 Mosaic's (8, 128) tiling rule: the lowering itself rejects them."""
  monkeypatch.setattr(kl, "check_chunk", lambda chunk, T, backend, fn_name="": chunk)
  with pytest.raises(ValueError, match="power of 2"):
    _export("triton", True, 24, t=48, k=16, v=16)
  with pytest.raises(ValueError, match="divisible by 8"):
    _export("mosaic_tpu", True, 12, t=48, k=16, v=16)
