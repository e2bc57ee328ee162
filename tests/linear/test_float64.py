"""Under x64, float64 inputs are computed in float64 throughout the linear family (issue 37,
defect 2): the outputs and the final states are float64 and match the float64 numpy loops of
tests/linear/reference.py (written from the recurrences) to ~1e-12, and gradients pass
``check_grads`` in float64. float32 inputs still compute (bit for bit) and return float32,
bf16 inputs compute in float32. Also the sampled-softmax proposal, normalised in float64 for
float64 inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft as js
from jaxsoft import linear
from jaxsoft.linear import _dispatch
from kernels_pallas import backends
from tests.linear import cases, reference

TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _f64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _assert_float64_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == jnp.float64, g.dtype
    np.testing.assert_allclose(g, w, **TOL)


# ------------------------------------------------------------------ the base variants' forms


@pytest.mark.parametrize("form", cases.FORMS)
@pytest.mark.parametrize("variant", cases.VARIANTS)
def test_forms_compute_float64_inputs_in_float64(x64, variant, form):
  """Every form of linear attention, simple GLA, GLA and the two delta rules, with segments
  and an initial state (T = 11, chunks of 4): float64 output and final state, equal to the
  float64 loop to 1e-12 (computed in float32 they were ~3e-7 off)."""
  args = cases.inputs(variant, B=2, T=11, N=2, K=3, V=2, dtype=jnp.float64)
  seg = cases.segments(2, 11)
  got = cases.call(variant, args, implementation=form, chunk_size=4, segment_ids=seg)
  _assert_float64_close(got, cases.reference_call(variant, args, seg))


def test_lightning_attention_float64(x64):
  """lightning_attention builds its default decay schedule in float64 too."""
  a = cases.random_qkv(jax.random.split(jax.random.key(1), 3), 1, 9, 2, 3, 2)
  q, k, v = (a[x].astype(jnp.float64) for x in "qkv")
  o, S = jax.jit(functools.partial(linear.lightning_attention, layer_idx=1, num_layers=3,
                                   chunk_size=4, output_final_state=True))(q, k, v)
  slopes = 2.0 ** (-8.0 * np.arange(1, 3) / 2)            # ALiBi: 2^(-8n/N), N = 2 heads
  g = np.broadcast_to(-slopes * (1.0 - 1 / 2 + 1e-5), (1, 9, 2))   # layer 1 of 3
  _assert_float64_close((o, S), reference.recurrence(q, k, v, g=g))


# ------------------------------------------------------------------ decoding steps


def _steps(step, per_token, state, T):
  outs = []
  for t in range(T):
    o, state = step(*(x[:, t] for x in per_token), state)
    outs.append(o)
  return jnp.stack(outs, axis=1), state


STEPS = {
    "simple_gla_step": ("simple_gla", lambda a: (a["q"], a["k"], a["v"], a["g"]),
                        linear.simple_gla_step),
    "gla_step": ("gla", lambda a: (a["q"], a["k"], a["v"], a["g"]), linear.gla_step),
    "delta_rule_step": ("delta_rule", lambda a: (a["q"], a["k"], a["v"], a["beta"]),
                        linear.delta_rule_step),
    "gated_delta_rule_step": ("gated_delta_rule",
                              lambda a: (a["q"], a["k"], a["v"], a["g"], a["beta"]),
                              linear.gated_delta_rule_step),
    "linear_attention_step": ("linear_attention", lambda a: (a["q"], a["k"], a["v"]),
                              linear.linear_attention_step),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_steps_compute_float64_inputs_in_float64(x64, name):
  """Decoding token by token from a float64 state: float64 outputs and state, equal to the
  float64 loop to 1e-12 (the steps cast the state to float32 before)."""
  variant, per_token, step = STEPS[name]
  args = cases.inputs(variant, B=2, T=5, N=2, K=3, V=2, dtype=jnp.float64)
  got = _steps(jax.jit(step), per_token(args), args["initial_state"], 5)
  _assert_float64_close(got, cases.reference_call(variant, args))


def test_lightning_and_taylor_steps_float64(x64):
  """lightning_attention_step (a decay per head) and taylor_linear_attention_step (Taylor
  features and the (S, z) state built from None) against their float64 loops."""
  a = cases.inputs("simple_gla", B=1, T=4, N=2, K=2, V=2, dtype=jnp.float64)
  g = jnp.log(jnp.array([0.5, 0.9], jnp.float64))
  step = jax.jit(functools.partial(linear.lightning_attention_step, g=g))
  got = _steps(step, (a["q"], a["k"], a["v"]), a["initial_state"], 4)
  want = reference.recurrence(a["q"], a["k"], a["v"], g=np.broadcast_to(np.log([0.5, 0.9]),
                                                                        (1, 4, 2)),
                              initial_state=a["initial_state"])
  _assert_float64_close(got, want)
  o, (S, z) = _steps(jax.jit(functools.partial(linear.taylor_linear_attention_step, order=2)),
                     (a["q"], a["k"], a["v"]), None, 4)
  want = reference.weighted_causal_attention(reference.taylor_weight(2, 2 ** -0.5), a["q"],
                                             a["k"], a["v"])
  _assert_float64_close(o, want)
  assert S.dtype == z.dtype == jnp.float64


# ------------------------------------------------------------------ the other variants


def _others(a):
  """jaxsoft's outputs of the variants beyond the base five (default forms), by name."""
  q, k, v = a["q"], a["k"], a["v"]
  return {
      "taylor_linear_attention": linear.taylor_linear_attention(q, k, v, order=2),
      "cosformer": linear.cosformer(q, k, v, max_len=8),
      "mala": linear.mala(q, k, v),
      "ttt_linear": linear.ttt_linear(q, k, v, a["eta"], mini_batch_size=4),
      "softmax_linear_attention": linear.softmax_linear_attention(
          q, k, v, a["logits"], -a["logits"], g=a["g"], beta=a["beta"]),
      "ccq": linear.ccq(q, k, v, a["g"], a["beta"]),
      "interdomain_attention": linear.interdomain_attention(q, k, v, a["basis"], 1 - a["basis"],
                                                            a["log_decay"]),
      "native_hybrid_attention": linear.native_hybrid_attention(q, k, v, a["slot_gates"],
                                                                window=2),
      "mhla": linear.mhla(q, k, v, a["mixing"], block_size=2),
      "rala": linear.rala(q, k, v, a["gate"]),
  }


def _others_reference(n):
  """The float64 loops for :func:`_others` (``n``: the inputs as numpy float64)."""
  qkv = (n["q"], n["k"], n["v"])
  fq, fk = reference.elu1(n["q"]), reference.elu1(n["k"])
  K = n["q"].shape[-1]
  return {
      "taylor_linear_attention": reference.weighted_causal_attention(
          reference.taylor_weight(2, K ** -0.5), *qkv),
      "cosformer": reference.weighted_causal_attention(reference.cosformer_weight(8), *qkv),
      "mala": reference.mala(*qkv, scale=K ** -0.5),
      "ttt_linear": reference.ttt_linear(*qkv, n["eta"], mini_batch_size=4)[0],
      "softmax_linear_attention": reference.softmax_linear_attention(
          *qkv, n["logits"], -n["logits"], g=n["g"], beta=n["beta"])[0],
      "ccq": reference.ccq(*qkv, g=n["g"], beta=n["beta"]),
      "interdomain_attention": reference.interdomain(
          fq, fk, n["v"], n["basis"], 1 - n["basis"], n["log_decay"], scale=K ** -0.5),
      "native_hybrid_attention": reference.native_hybrid_attention(*qkv, n["slot_gates"],
                                                                   window=2),
      "mhla": reference.mhla(fq, fk, n["v"], np.broadcast_to(n["mixing"], (2, 3, 3)), block=2,
                             causal=True),
      "rala": reference.rala(fq, fk, *qkv, n["gate"]),
  }


def _other_inputs():
  return _other_inputs_jit(jax.random.key(3))


@jax.jit  # the draws in one compilation, not one per op
def _other_inputs_jit(key):
  B, T, N, K, V = 1, 6, 2, 3, 2
  keys = jax.random.split(key, 10)
  a = cases.random_qkv(keys, B, T, N, K, V)
  a["k"] = linear.l2_normalize(a["k"])
  u = lambda i, shape, lo, hi: jax.random.uniform(keys[i], shape, minval=lo, maxval=hi)
  a.update(eta=u(3, (B, T, N), 0.0, 0.5), logits=jax.random.normal(keys[4], (B, T, N)),
           g=u(5, (B, T, N), -1.0, 0.0), beta=u(6, (B, T, N), 0.1, 1.0),
           basis=u(7, (B, T, N, 2), 0.1, 0.9), log_decay=u(8, (N, 2), -1.0, -0.1),
           slot_gates=u(9, (B, T, N, 2), -1.0, -0.1), mixing=u(3, (3, 3), 0.5, 1.5),
           gate=u(4, (B, T, N, V), 0.5, 1.5))
  return {x: jnp.asarray(y, jnp.float64) for x, y in a.items()}


def test_other_variants_compute_float64_inputs_in_float64(x64):
  """Taylor, cosFormer, MALA, TTT-Linear, SLA, CCQ, interdomain, NHA, MHLA and RALA: float64
  outputs equal to their float64 loops to 1e-12 (feature maps, gates and slot states were
  float32)."""
  a = _other_inputs()
  got, want = jax.jit(_others)(a), _others_reference(_f64(a))
  assert got.keys() == want.keys()
  for name in got:
    assert got[name].dtype == jnp.float64, name
    np.testing.assert_allclose(got[name], want[name], **TOL, err_msg=name)


# ------------------------------------------------------------------ gradients


# every variant's recurrent and chunked (custom VJP) forms; the parallel form (autodiff of
# the one-chunk form) where it has its own derivative rules: the UT inverse, GLA's scores
GRAD_CASES = ([(v, f) for v in cases.VARIANTS for f in ("recurrent", "chunked")]
              + [("gla", "parallel"), ("gated_delta_rule", "parallel")])


@pytest.mark.parametrize(("variant", "form"), GRAD_CASES)
def test_gradients_pass_check_grads_in_float64(x64, variant, form):
  """Reverse-mode gradients of the output and the final state with respect to every input,
  against finite differences in float64 (the float32 computation was 9e-4 off)."""
  args = cases.inputs(variant, B=1, T=6, N=1, K=2, V=2, dtype=jnp.float64)
  f = jax.jit(lambda a: cases._call(variant, a, implementation=form, chunk_size=4))
  check_grads(f, (args,), order=1, modes=["rev"])


def test_step_gradients_pass_check_grads_in_float64(x64):
  """gated_delta_rule_step's gradients in every input, the state included, in float64."""
  a = cases.inputs("gated_delta_rule", B=1, T=1, N=1, K=2, V=2, dtype=jnp.float64)
  f = jax.jit(lambda q, k, v, g, b, S: linear.gated_delta_rule_step(q, k, v, g, b, S))
  check_grads(f, (a["q"][:, 0], a["k"][:, 0], a["v"][:, 0], a["g"][:, 0], a["beta"][:, 0],
                  a["initial_state"]), order=1, modes=["rev"])


# ------------------------------------------------------------------ float32 and bf16


@pytest.mark.parametrize("variant", ["simple_gla", "gated_delta_rule", "linear_attention"])
def test_float32_inputs_stay_float32_under_x64(variant):
  """float32 inputs under x64 give float32 outputs and states, bit for bit the values
  computed without x64."""
  args = cases.inputs(variant, B=1, T=7, N=2, K=3, V=2)
  seg = cases.segments(1, 7)
  want = cases.call(variant, args, implementation="chunked", chunk_size=4, segment_ids=seg)
  with jax.enable_x64(True):
    got = cases.call(variant, args, implementation="chunked", chunk_size=4, segment_ids=seg)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("variant", ["simple_gla", "gated_delta_rule", "linear_attention"])
def test_bf16_inputs_compute_in_float32(x64, variant):
  """bf16 inputs: a bf16 output and a float32 state, the state within float32 rounding of
  the float64 loop on the same (bf16) values, far below bf16's 4e-3."""
  args = cases.inputs(variant, B=1, T=7, N=2, K=3, V=2, dtype=jnp.bfloat16)
  o, S = cases.call(variant, args, implementation="chunked", chunk_size=4)
  o_ref, S_ref = cases.reference_call(variant, _f64(args))
  assert o.dtype == jnp.bfloat16
  for s, s_ref in zip(jax.tree.leaves(S), jax.tree.leaves(S_ref), strict=True):
    assert s.dtype == jnp.float32
    np.testing.assert_allclose(s, s_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(o, np.float64), o_ref, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------ Pallas


def test_pallas_kernels_compute_float64_in_float64(x64, monkeypatch):
  """implementation="pallas" (the interpreter here) hands float64 to the kernels, which
  compute in float64."""
  monkeypatch.setenv(backends.INTERPRET_ENV, "1")
  args = cases.inputs("gated_delta_rule", B=1, T=16, N=1, K=4, V=4, dtype=jnp.float64)
  got = cases.call("gated_delta_rule", args, implementation="pallas", chunk_size=16)
  _assert_float64_close(got, cases.reference_call("gated_delta_rule", args))


def test_mosaic_refuses_float64(x64, monkeypatch):
  """Mosaic TPU kernels have no float64: a ValueError naming the function, not float32."""
  monkeypatch.setattr(_dispatch.backends, "pick_backend", lambda _: ("mosaic_tpu", True))
  args = cases.inputs("simple_gla", B=1, T=8, N=1, K=2, V=2, dtype=jnp.float64)
  with pytest.raises(ValueError, match="simple_gla: implementation='pallas'.*float64"):
    linear.simple_gla(args["q"], args["k"], args["v"], args["g"], implementation="pallas",
                      chunk_size=8)


# ------------------------------------------------------------------ sampled softmax


def test_sampled_softmax_float64_proposal_stays_float64(x64):
  """A float64 proposal is normalised in float64: the loss equals the float64 formula
  ``log(e^{o_y} + Σ_{s_i != y} e^{o_{s_i} - log(S Q(s_i))}) - o_y`` to 1e-12."""
  rng = np.random.default_rng(0)
  h, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
  b, y = rng.standard_normal(5), np.array([0, 3, 4])
  proposal = rng.uniform(0.1, 1.0, 5) * 1.37
  sampled = np.array([1, 3, 3, 0, 2, 4])
  loss = jax.jit(lambda h, w, y, proposal, b, sampled: js.losses.sampled_softmax_loss(
      None, h, w, y, 0, proposal=proposal, bias=b, sampled=sampled))(  # one compilation
          h, w, y, proposal, b, sampled)
  Q = proposal / proposal.sum()
  o = h @ w + b
  want = []
  for i in range(3):
    terms = [np.exp(o[i, y[i]])] + [np.exp(o[i, s] - np.log(len(sampled) * Q[s]))
                                    for s in sampled if s != y[i]]
    want.append(np.log(np.sum(terms)) - o[i, y[i]])
  assert loss.dtype == jnp.float64
  np.testing.assert_allclose(loss, want, **TOL)
