"""The Pallas engine takes the calls xla_chunked takes for a registered E/S/P/T/R normalizer.

A value head dim other than the key's, q/k/v of different dtypes, a traced (learned)
``scale``, a dense ``bias``/``mask`` broadcast over batch, heads, queries or keys (read per
tile, never copied to [B, N, T, S]; the bias's gradient from the dQ pass), and Forgetting
attention's ``decay_bias``. Each case runs both drivers in interpret
mode against the dense xla path: the output and every cotangent (q, k, v, bias, scale,
cq, ck), fully masked rows (zeros, zero and finite gradients), GQA, and
``dot_product_attention(implementation="pallas")`` reaching the kernel (a single explicit
implementation raises instead of falling back). Last, every normalizer the engine runs
(read from the registry) takes one call with all of these at once, with either score and
``return_residual``: traced forward and backward, so no such call falls back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from jaxsoft import attention
from jaxsoft import normalizers as jn
from kernels_pallas import _api
from tests import helpers
from tests.helpers import registry_sample
from tests.kernels_pallas.test_engine import TRITON_SMALL, assert_matches, inputs

# Mosaic: key blocks of 128 lanes once a bias, mask or decay is blocked along the keys.
MOSAIC_SMALL = dict(block_q=8, block_k=128)
B, T, N, KH, H = 2, 24, 2, 1, 16


def _blocks(backend):
  return TRITON_SMALL if backend == "triton" else MOSAIC_SMALL


def _bias(shape, seed=31):
  """A random bias of ``shape`` (broadcastable to [B, N, T, S]) with ``-inf`` entries: one
  key of every row, and the whole of row 5 (a row with no visible key)."""
  x = jax.random.normal(jax.random.key(seed), shape)
  x = x.at[..., 3].set(-jnp.inf)
  if shape[-2] > 1:
    x = x.at[..., 5, :].set(-jnp.inf)
  return x


def _mask(shape, seed=32):
  """A random boolean mask of ``shape``; row 7 hides every key (where it has rows)."""
  m = jax.random.bernoulli(jax.random.key(seed), 0.75, shape)
  return m.at[..., 7, :].set(False) if shape[-2] > 1 else m


def _reference(normalizer, **kw):
  return lambda q, k, v, *a: attention.dot_product_attention(
      q, k, v, *a, normalizer=normalizer, implementation="xla", **kw)


def _decay(b=B, t=T, n=N, seed=37):
  """FoX-style decay terms: cq = cumulative log forget gates (small: with the soft cap,
  large decays saturate the logits into ties), ck = cq plus noise."""
  gates = -0.2 * jax.nn.softplus(jax.random.normal(jax.random.key(seed), (b, t, n)))
  cq = jnp.cumsum(gates, axis=1)
  return cq, cq + 0.1 * jax.random.normal(jax.random.key(seed + 1), (b, t, n))


def _check_empty_rows(out, grads, rows, bias_at=3):
  """Rows without a visible key: zero output, zero dq (``grads[0]``), zero bias gradient
  (``grads[bias_at]``, when the bias has rows), every gradient finite."""
  dbias = grads[bias_at]
  for r in rows:
    assert bool(jnp.all(out[:, r] == 0))
    assert bool(jnp.all(grads[0][:, r] == 0))
    if dbias.shape[-2] > 1:
      assert bool(jnp.all(dbias[..., r, :] == 0))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_dot_product_attention_takes_the_whole_contract(monkeypatch):
  """One call with everything: value head dim 8 != 16, v in bfloat16 with float32 q/k, a
  learned scale under grad, a [T, S] bias with -inf entries, a [B, 1, T, S] mask, a
  decay, GQA, causal; implementation="pallas" alone raises instead of falling back, so
  this runs the kernel."""
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")
  q, k, _, _ = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=33)
  v = helpers.standard_normal(34, (B, T, KH, 8)).astype(jnp.bfloat16)
  ct = helpers.standard_normal(35, (B, T, N, 8))
  bias, mask = _bias((T, T)), _mask((B, 1, T, T))

  # v (bfloat16) is closed over: a bfloat16 cotangent would differ from the reference's
  # by its rounding; the float32 ones check the promoted kernel.
  def run(impl):
    return lambda q, k, bias, scale, cq, ck: attention.dot_product_attention(
        q, k, v, bias, mask, scale=scale, is_causal=True, decay_bias=(cq, ck),
        implementation=impl)

  out, grads = assert_matches(run("pallas"), run("xla"),
                              (q, k, bias, jnp.float32(0.4), *_decay()), ct)
  assert out.dtype == jnp.float32 and out.shape == (B, T, N, 8)
  assert grads[2].shape == (T, T) and float(grads[3]) != 0.0
  assert bool(jnp.any(grads[4] != 0)) and bool(jnp.any(grads[5] != 0))
  _check_empty_rows(out, grads, (5, 7), bias_at=2)


def test_mosaic_per_head_bias_key_mask_and_decay_length_dependent():
  """Mosaic: a per-head bias [1, N, T, S], a key mask [1, 1, 1, S] and a decay with ssmax
  (whose logits scale with log n: the visible counts must include the mask and the -inf
  bias, per head), several tiles, GQA (the dK/dV pass's per-head d ck), a soft cap."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=36)
  bias = _bias((1, N, T, T)).at[0, 1, :, 10:14].set(-jnp.inf)
  mask = jnp.arange(T)[None, None, None, :] % 5 != 1
  kw = dict(logits_soft_cap=4.0)
  out, grads = assert_matches(
      lambda q, k, v, b, cq, ck: kp.attention(
          q, k, v, b, mask, normalizer="ssmax", decay_bias=(cq, ck), backend="mosaic_tpu",
          interpret=True, block_sizes=MOSAIC_SMALL, **kw),
      lambda q, k, v, b, cq, ck: _reference("ssmax", decay_bias=(cq, ck), **kw)(q, k, v, b, mask),
      (q, k, v, bias, *_decay()), ct)
  assert grads[3].shape == (1, N, T, T)
  _check_empty_rows(out, grads, (5,))


# ------------------------------------------------------------------- slow: the matrix


BIAS_SHAPES = [(T, T), (1, N, T, T), (B, 1, T, T), (B, N, 1, T)]
MASK_SHAPES = [(B, N, T, T), (T, T), (1, N, T, T), (B, 1, T, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid", "stablemax", "ssmax", "sparsemax",
                                        "top_k_softmax", "standardized_softmax", "nap"])
@pytest.mark.parametrize("shape", range(len(BIAS_SHAPES)))
def test_bias_and_mask_matrix(backend, normalizer, shape):
  """Every broadcast shape of bias and mask, per driver and kernel class (E, P, S, a
  length-dependent map, T and R), causal with segments and GQA."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=40 + shape)
  bias_shape = BIAS_SHAPES[shape]
  bias, mask = _bias(bias_shape), _mask(MASK_SHAPES[shape])
  seg = jnp.array([[0] * 10 + [1] * 14, [0] * 24], jnp.int32)
  kw = dict(is_causal=True, segment_ids=seg)
  out, grads = assert_matches(
      lambda q, k, v, b: kp.attention(q, k, v, b, mask, normalizer=normalizer, backend=backend,
                                      interpret=True, block_sizes=_blocks(backend), **kw),
      lambda q, k, v, b: _reference(normalizer, **kw)(q, k, v, b, mask), (q, k, v, bias), ct)
  assert grads[3].shape == bias_shape
  if bias_shape[-2] > 1:
    _check_empty_rows(out, grads, (5,))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_mask_only_and_bias_only(backend):
  q, k, v, ct = inputs(b=B, t=T, s=40, n=N, kh=KH, h=H, seed=50)
  mask = _mask((B, N, T, 40))
  assert_matches(
      lambda q, k, v: kp.attention(q, k, v, None, mask, normalizer="softmax_1", backend=backend,
                                   interpret=True, block_sizes=_blocks(backend)),
      lambda q, k, v: _reference("softmax_1")(q, k, v, None, mask), (q, k, v), ct)
  bias = _bias((T, 40))
  assert_matches(
      lambda q, k, v, b: kp.attention(q, k, v, b, normalizer="softpick", backend=backend,
                                      interpret=True, block_sizes=_blocks(backend)),
      lambda q, k, v, b: _reference("softpick")(q, k, v, b), (q, k, v, bias), ct)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid", "sparsemax",
                                        "adaptive_temperature_softmax"])
def test_value_head_dim_scale_and_dtypes(backend, normalizer):
  """Hv = 24 != H = 16 (both padded apart), a learned scale, k in bfloat16 (promoted), for
  E, P, T and R (not standardized_softmax: invariant to the scale, its scale gradient is
  rounding noise)."""
  q, k, _, _ = inputs(b=B, t=40, n=4, kh=2, h=H, seed=51)
  k = k.astype(jnp.bfloat16)  # closed over (a bfloat16 cotangent differs by its rounding)
  v = helpers.standard_normal(52, (B, 40, 2, 24))
  ct = helpers.standard_normal(53, (B, 40, 4, 24))
  kw = dict(is_causal=True)
  out, grads = assert_matches(
      lambda q, v, sc: kp.attention(q, k, v, scale=sc, normalizer=normalizer,
                                    backend=backend, interpret=True,
                                    block_sizes=_blocks(backend), **kw),
      lambda q, v, sc: _reference(normalizer, scale=sc, **kw)(q, k, v),
      (q, v, jnp.float32(0.3)), ct)
  assert out.shape == (B, 40, 4, 24) and out.dtype == jnp.float32
  assert np.isfinite(float(grads[2])) and float(grads[2]) != 0.0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid", "stablemax", "softmax_1",
                                        "sparsemax", "top_k_softmax", "standardized_softmax",
                                        "nap"])
def test_decay_matrix(backend, normalizer):
  """decay_bias with GQA (G = 2), cross-attention lengths and a soft cap, for classes E,
  P, S, T and R (the search and statistics passes and their gradients)."""
  t, s = 24, 40
  q, k, v, ct = inputs(b=B, t=t, s=s, n=4, kh=2, h=H, seed=60)
  cq, _ = _decay(t=t, n=4, seed=61)
  _, ck = _decay(t=s, n=4, seed=62)
  kv_len = jnp.array([40, 17], jnp.int32)
  kw = dict(logits_soft_cap=5.0, key_value_seq_lengths=kv_len)
  assert_matches(
      lambda q, k, v, cq, ck: kp.attention(q, k, v, normalizer=normalizer, decay_bias=(cq, ck),
                                           backend=backend, interpret=True,
                                           block_sizes=_blocks(backend), **kw),
      lambda q, k, v, cq, ck: _reference(normalizer, decay_bias=(cq, ck), **kw)(q, k, v),
      (q, k, v, cq, ck), ct)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("normalizer,name", [("softmax_sink", "sink_logit"), ("entmax", "alpha"),
                                             ("standardized_softmax", "tau")])
def test_bias_with_array_hyperparameters(backend, normalizer, name):
  """A per-head hyperparameter (its cotangent comes out of the dQ pass beside dS) with a
  per-head bias and a mask, for classes E, T and R."""
  q, k, v, ct = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=70)
  bias, mask = _bias((1, N, T, T)), _mask((T, T))
  hp = jnp.asarray([1.3, 1.7] if name == "alpha" else [0.5, 1.5]).reshape(N, 1, 1)
  _, grads = assert_matches(
      lambda q, k, v, b, a: kp.attention(q, k, v, b, mask, normalizer=normalizer,
                                         normalizer_params={name: a}, backend=backend,
                                         interpret=True, block_sizes=_blocks(backend)),
      lambda q, k, v, b, a: _reference(normalizer, normalizer_params={name: a})(
          q, k, v, b, mask), (q, k, v, bias, hp), ct)
  assert bool(jnp.all(grads[4] != 0))


KERNEL_NAMES = sorted(  # every registered normalizer the engine runs (E/S/P, T and R with
    n for n in jn.names()  # their blockwise rules), read from the registry
    if not jn.get(n).needs_key and (
        jn.get(n).kernel_class in ("E", "S", "P")
        or (jn.get(n).kernel_class == "T" and jn.get(n).threshold is not None)
        or (jn.get(n).kernel_class == "R" and jn.get(n).row_stats is not None)))


@pytest.mark.parametrize("name", registry_sample(KERNEL_NAMES))
@pytest.mark.parametrize("score", ["dot", "distance"])
def test_every_kernel_normalizer_takes_every_argument(monkeypatch, name, score):
  """``implementation="pallas"`` (which raises instead of falling back) takes, for every
  normalizer the engine runs, one call with everything xla_chunked takes: a bias, a mask,
  a FoX decay, GQA, causality, a soft cap, a value head dim of its own, a key length, the
  dot-product or the distance score, and ``return_residual`` wherever a row statistic is
  defined (not class R). Traced forward and backward (``jax.eval_shape`` of the VJP: every
  pass's kernel is built, none is run); the numbers are checked by the tests above and
  per class."""
  monkeypatch.setenv(_api.INTERPRET_ENV, "1")
  q, k, _, _ = inputs(b=B, t=T, n=N, kh=KH, h=H, seed=39)
  v = helpers.standard_normal(40, (B, T, KH, 8))
  residual = jn.get(name).kernel_class != "R"
  kw = dict(normalizer=name, is_causal=True, logits_soft_cap=20.0, score=score,
            key_value_seq_lengths=jnp.array([T, T - 5], jnp.int32), decay_bias=_decay(),
            return_residual=residual, implementation="pallas")

  def loss(q, k, v, bias):
    out = attention.dot_product_attention(q, k, v, bias, _mask((B, 1, T, T)), **kw)
    return jnp.sum(out[0] if residual else out)

  shapes = jax.eval_shape(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), q, k, v,
                          _bias((T, T)))
  assert shapes[1][3].shape == (T, T) and shapes[1][2].shape == v.shape
