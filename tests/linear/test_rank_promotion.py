"""The linear family needs no implicit rank promotion (issue 37).

Under ``jax.numpy_rank_promotion("raise")`` (JAX's own test setting, and many users') every
variant runs each of its forms (parallel, recurrent, chunked, as it has them) forward and
backward, with segments, and its decoding step; the forms agree with each other and the
first step with the full call's first token. One jitted program per variant: the setting
acts at trace time (and is part of jit's cache key), so the jitted call traces every jnp
operation as op-by-op dispatch would. Before the fix the chunked forms' masks
(``[B, nC, C, C] & [C, C]``), Hedgehog's bias, MHLA's step, the layers' short convolution,
RMSNorm scale and Gated DeltaNet decay raised ValueError here.

Tolerance: the forms sum the same ``T = 6`` terms of ``K, V <= 8`` products in different
orders (chunks of 4, a scan, one T x T matmul), float32: ~ T·K·eps ≈ 6·8·1.2e-7 ≈ 6e-6 of
the largest entry; 3e-5 of it leaves 5x for the feature maps' and normalisers' divisions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft import linear
from jaxsoft import nn as js_nn

B, T, N, K, V, C = 2, 6, 2, 4, 3, 4          # T = 6 in chunks of 4: a padded second chunk
TOL = 3e-5
SEGMENTS = jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])


def _args(seed=0):
  """The inputs, drawn by numpy (no eager JAX op to compile)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape)
  uniform = lambda low, high, *shape: rng.uniform(low, high, shape)
  k = normal(B, T, N, K)
  a = {
      "q": normal(B, T, N, K),
      "k": k / np.linalg.norm(k, axis=-1, keepdims=True),   # unit keys (delta rules, CCQ)
      "v": normal(B, T, N, V),
      "g": uniform(-1.0, 0.0, B, T, N),
      "gk": uniform(-1.0, 0.0, B, T, N, K),
      "beta": uniform(0.05, 1.5, B, T, N),
      "eta": uniform(0.0, 0.5, B, T, N),
      "logits": normal(B, T, N),
      "basis_in": normal(B, T, N, 2),
      "basis_out": normal(B, T, N, 2),
      "slots": uniform(-2.0, 0.0, B, T, N, 2),
      "gate": normal(B, T, N, V),
  }
  return {n: jnp.asarray(x, jnp.float32) for n, x in a.items()}


# the feature maps are built inside the traced programs (under the setting too)
_FAVOR = lambda: linear.favor_feature_map(jax.random.key(7), K, 8)
_HEDGEHOG = lambda: linear.hedgehog_feature_map(
    linear.hedgehog_init(N, K, 3, key=jax.random.key(8), noise=0.1))
_LOG_DECAY = -np.array([[0.1, 0.5], [0.2, 1.0]], np.float32)   # interdomain's [N, R]
_MIXING = np.tril(np.ones((2, 2), np.float32)) + 0.5             # MHLA's [M, M], M = T / 3 blocks
_SEG = dict(segment_ids=SEGMENTS)

ALL, NO_PARALLEL, NO_RECURRENT = ("parallel", "recurrent", "chunked"), ("recurrent", "chunked"), (
    "parallel", "chunked")

# name: (forms, full call (a, implementation) -> o, first step a_0 -> o_0 or None)
CASES = {
    "linear_attention": (
        ALL, lambda a, f: linear.linear_attention(a["q"], a["k"], a["v"], implementation=f,
                                                  chunk_size=C, **_SEG),
        lambda a: linear.linear_attention_step(a["q"], a["k"], a["v"])[0]),
    "favor": (
        ALL, lambda a, f: linear.linear_attention(a["q"], a["k"], a["v"],
                                                  feature_map=_FAVOR(), implementation=f,
                                                  chunk_size=C, **_SEG),
        lambda a: linear.linear_attention_step(a["q"], a["k"], a["v"],
                                               feature_map=_FAVOR())[0]),
    "hedgehog": (
        ALL, lambda a, f: linear.linear_attention(a["q"], a["k"], a["v"],
                                                  feature_map=_HEDGEHOG(), implementation=f,
                                                  chunk_size=C, **_SEG),
        lambda a: linear.linear_attention_step(a["q"], a["k"], a["v"],
                                               feature_map=_HEDGEHOG())[0]),
    "simple_gla": (
        ALL, lambda a, f: linear.simple_gla(a["q"], a["k"], a["v"], a["g"], implementation=f,
                                            chunk_size=C, **_SEG),
        lambda a: linear.simple_gla_step(a["q"], a["k"], a["v"], a["g"])[0]),
    "gla": (
        ALL, lambda a, f: linear.gla(a["q"], a["k"], a["v"], a["gk"], implementation=f,
                                     chunk_size=C, **_SEG),
        lambda a: linear.gla_step(a["q"], a["k"], a["v"], a["gk"])[0]),
    "delta_rule": (
        ALL, lambda a, f: linear.delta_rule(a["q"], a["k"], a["v"], a["beta"], implementation=f,
                                            chunk_size=C, **_SEG),
        lambda a: linear.delta_rule_step(a["q"], a["k"], a["v"], a["beta"])[0]),
    "gated_delta_rule": (
        ALL, lambda a, f: linear.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                                  implementation=f, chunk_size=C, **_SEG),
        lambda a: linear.gated_delta_rule_step(a["q"], a["k"], a["v"], a["g"], a["beta"])[0]),
    "lightning_attention": (
        ALL, lambda a, f: linear.lightning_attention(a["q"], a["k"], a["v"], implementation=f,
                                                     chunk_size=C, **_SEG),
        lambda a: linear.lightning_attention_step(a["q"], a["k"], a["v"])[0]),
    "taylor": (
        ALL, lambda a, f: linear.taylor_linear_attention(a["q"], a["k"], a["v"],
                                                         implementation=f, chunk_size=C, **_SEG),
        lambda a: linear.taylor_linear_attention_step(a["q"], a["k"], a["v"])[0]),
    "cosformer": (
        ALL, lambda a, f: linear.cosformer(a["q"], a["k"], a["v"], implementation=f,
                                           chunk_size=C, **_SEG),
        lambda a: linear.cosformer_step(a["q"], a["k"], a["v"], position=0, max_len=T)[0]),
    "mala": (
        ALL, lambda a, f: linear.mala(a["q"], a["k"], a["v"], implementation=f, chunk_size=C,
                                      **_SEG),
        lambda a: linear.mala_step(a["q"], a["k"], a["v"])[0]),
    "ttt_linear": (
        NO_PARALLEL, lambda a, f: linear.ttt_linear(a["q"], a["k"], a["v"], a["eta"],
                                                    mini_batch_size=C, implementation=f),
        lambda a: linear.ttt_linear_step(a["q"], a["k"], a["v"], a["eta"],
                                         mini_batch_size=C)[0]),
    "softmax_linear_attention": (
        ALL, lambda a, f: linear.softmax_linear_attention(
            a["q"], a["k"], a["v"], a["logits"], -a["logits"], g=a["g"], beta=a["beta"],
            implementation=f, chunk_size=C, **_SEG),
        lambda a: linear.softmax_linear_attention_step(
            a["q"], a["k"], a["v"], a["logits"], -a["logits"], g=a["g"], beta=a["beta"])[0]),
    "ccq": (
        ALL, lambda a, f: linear.ccq(a["q"], a["k"], a["v"], a["g"], a["beta"], strength=0.5,
                                     implementation=f, chunk_size=C, **_SEG),
        lambda a: linear.ccq_step(a["q"], a["k"], a["v"], a["g"], a["beta"], strength=0.5)[0]),
    "interdomain": (
        ALL, lambda a, f: linear.interdomain_attention(
            a["q"], a["k"], a["v"], a["basis_in"], a["basis_out"], _LOG_DECAY,
            implementation=f, chunk_size=C, **_SEG),
        lambda a: linear.interdomain_attention_step(
            a["q"], a["k"], a["v"], a["basis_in"], a["basis_out"], _LOG_DECAY)[0]),
    "native_hybrid": (
        ALL, lambda a, f: linear.native_hybrid_attention(
            a["q"], a["k"], a["v"], a["slots"], window=3, implementation=f, chunk_size=C,
            **_SEG),
        lambda a: linear.native_hybrid_attention_step(a["q"], a["k"], a["v"], a["slots"],
                                                      window=3)[0]),
    "mhla": (
        NO_RECURRENT, lambda a, f: linear.mhla(a["q"], a["k"], a["v"], _MIXING, block_size=3,
                                               implementation=f),
        lambda a: linear.mhla_step(a["q"], a["k"], a["v"], _MIXING, position=0,
                                   block_size=3)[0]),
    "rala": (
        (None,), lambda a, f: linear.rala(a["q"], a["k"], a["v"], a["gate"]), None),
}


def _everything(name, a, w, grad_forms):
  """Each form's output (with, for the forms in ``grad_forms``, the gradient of ``Σ o · w``
  with respect to every input) and the first decoding step's output."""
  forms, full, step = CASES[name]

  def loss(form, a):
    o = full(a, form)
    return jnp.sum(o * w), o

  outs = {f: (jax.value_and_grad(functools.partial(loss, f), has_aux=True)(a) if f in grad_forms
              else ((None, full(a, f)), None)) for f in forms}
  first = None if step is None else step({n: x[:, 0] for n, x in a.items()})
  return outs, first


def _close(got, want, what):
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * scale, err_msg=what)


# The gradients that run code of this library: the chunked forms' custom VJP and, with a
# delta rule's beta, the parallel form's UT inverse (custom JVP) and Gram matrix (custom VJP).
# Autodiff of anything else transposes lax primitives, which never broadcast by rank.
_BETA = ("delta_rule", "gated_delta_rule", "softmax_linear_attention", "ccq")


def _own_gradients(name):
  return ("parallel", "chunked") if name in _BETA else ("chunked",)


@pytest.mark.parametrize("name", list(CASES))
def test_every_form_traces_without_rank_promotion(name):
  """The jitted program of every form, the gradients above and the first step, traced under
  the setting (where it acts; no compilation: the values are the slow test's). Before the
  fix every chunked form raised ValueError here."""
  a = _args()
  w = jax.ShapeDtypeStruct((B, T, N, V), jnp.float32)
  with jax.numpy_rank_promotion("raise"):
    traced = jax.jit(functools.partial(_everything, name, grad_forms=_own_gradients(name))
                     ).trace(a, w)
  outs, first = traced.out_info
  for form, ((_, o), grads) in outs.items():
    assert o.shape == (B, T, N, V), (form, o.shape)
    if grads is not None:
      assert {n: g.shape for n, g in grads.items()} == {n: x.shape for n, x in a.items()}
  assert first is None or first.shape == (B, N, V)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_form_runs_without_rank_promotion(name):
  """Compiled and run under the setting: the forms agree with each other, forward and every
  gradient, and the first step with the full call's first token."""
  a = _args()
  w = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, N, V)), jnp.float32)
  forms = CASES[name][0]
  with jax.numpy_rank_promotion("raise"):
    outs, first = jax.jit(functools.partial(_everything, name, grad_forms=forms))(a, w)
  (_, o0), g0 = outs[forms[0]]
  assert bool(jnp.all(jnp.isfinite(o0))) and float(jnp.max(jnp.abs(o0))) > 0
  for form in forms[1:]:
    (_, o), g = outs[form]
    _close(o, o0, f"{name} {form}")
    for n in a:
      _close(g[n], g0[n], f"{name} {form} d/d{n}")
  if first is not None:   # token 0 of every sequence is the step from no state
    _close(first, o0[:, 0], f"{name} step")


def test_hedgehog_distillation_traces_without_rank_promotion():
  """The Hedgehog attention map and the distillation loss with its gradient."""
  params = {"W": jax.ShapeDtypeStruct((N, K, 3), jnp.float32),
            "b": jax.ShapeDtypeStruct((N, 3), jnp.float32)}
  a = _args()

  def fn(params, q, k):
    return (linear.hedgehog_attention_weights(params, q, k),
            jax.value_and_grad(linear.hedgehog_distillation_loss)(params, q, k))

  with jax.numpy_rank_promotion("raise"):
    weights, (loss, grads) = jax.jit(fn).trace(params, a["q"], a["k"]).out_info
  assert weights.shape == (B, N, T, T) and loss.shape == ()
  assert jax.tree.map(lambda g: g.shape, grads) == {"W": (N, K, 3), "b": (N, 3)}


@pytest.mark.parametrize("kind", ["gated_delta_rule", "linear"])
def test_layer_traces_without_rank_promotion(kind):
  """The layer's forward (short convolution, per-kind gates, RMSNorm scale) with the
  gradient of its parameters, and one decoding step."""
  d = N * K
  graphdef, params = nnx.split(nnx.eval_shape(
      lambda: js_nn.LinearMixer(kind, d, N, K, conv_size=3, rngs=nnx.Rngs(0))))
  x = jax.ShapeDtypeStruct((B, T, d), jnp.float32)

  def fn(params, x):
    def loss(p):
      y = nnx.merge(graphdef, p)(x)
      return jnp.sum(y * y), y

    (_, y), grads = jax.value_and_grad(loss, has_aux=True)(params)
    layer = nnx.merge(graphdef, params)
    y0, _ = layer.step(x[:, 0], layer.init_state(B))
    return y, y0, grads

  with jax.numpy_rank_promotion("raise"):
    full, first, grads = jax.jit(fn).trace(params, x).out_info
  assert full.shape == (B, T, d) and first.shape == (B, d)
  assert jax.tree.map(lambda g: g.shape, grads) == jax.tree.map(lambda p: p.shape, params)
