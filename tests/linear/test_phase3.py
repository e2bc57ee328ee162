"""Features A34 (softmax_linear_attention), A35 (ccq), A39 (ttt_linear), A41
(interdomain_attention) and the Hedgehog feature map (A30): against float64 loops written
from the papers' recurrences (the reconstructions [R] where the paper's equations are not
public), the forms against each other with every gradient, decoding steps, the reductions
the papers state, and Hedgehog's distillation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsoft import linear
from jaxsoft.linear import _ccq, _dispatch
from tests.linear import cases, reference

B, T, N, K, V, R = 2, 11, 3, 4, 3, 2
elu1 = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _inputs(variant, T=T, seed=0):
  ks = iter(jax.random.split(jax.random.key(seed), 10))
  a = {"q": jax.random.normal(next(ks), (B, T, N, K)),
       "k": linear.l2_normalize(jax.random.normal(next(ks), (B, T, N, K))),
       "v": jax.random.normal(next(ks), (B, T, N, V))}
  if variant == "ttt":
    a["eta"] = jax.random.uniform(next(ks), (B, T, N), minval=0.1, maxval=1.0)
    a["initial_state"] = 0.5 * jax.random.normal(next(ks), (B, N, K, V))
  if variant in ("sla", "ccq"):
    a["g"] = jax.random.uniform(next(ks), (B, T, N), minval=-1.0, maxval=0.0)
    a["beta"] = jax.random.uniform(next(ks), (B, T, N), minval=0.05, maxval=1.5)
  if variant == "sla":
    a["q_gate_logits"] = jax.random.normal(next(ks), (B, T, N))
    a["k_gate_logits"] = jax.random.normal(next(ks), (B, T, N))
    a["initial_state"] = 0.5 * jax.random.normal(next(ks), (B, N, K, V))
  if variant == "nha":
    a["slot_log_gates"] = jax.random.uniform(next(ks), (B, T, N, R + 1), minval=-2.0, maxval=0.0)
    a["initial_state"] = (jax.random.normal(next(ks), (B, N, R + 1, K)),
                          jax.random.normal(next(ks), (B, N, R + 1, V)))
  if variant == "interdomain":
    a["basis_in"] = jax.random.normal(next(ks), (B, T, N, R))
    a["basis_out"] = jax.random.normal(next(ks), (B, T, N, R))
    a["log_decay"] = jax.random.uniform(next(ks), (N, R), minval=-1.0, maxval=-0.01)
  return a


def _call(variant, a, **kw):
  a = dict(a)
  q, k, v = a.pop("q"), a.pop("k"), a.pop("v")
  if variant == "ttt":
    kw.pop("segment_ids", None)
    if kw.get("implementation") == "parallel":
      kw["implementation"] = "chunked"
    kw["mini_batch_size"] = kw.pop("chunk_size", 4)
    return linear.ttt_linear(q, k, v, a.pop("eta"), output_final_state=True, **a, **kw)
  if variant == "sla":
    return linear.softmax_linear_attention(q, k, v, a.pop("q_gate_logits"),
                                           a.pop("k_gate_logits"), output_final_state=True,
                                           **a, **kw)
  if variant == "nha":
    return linear.native_hybrid_attention(q, k, v, a.pop("slot_log_gates"), window=3,
                                          output_final_state=True, **a, **kw)
  if variant == "ccq":
    return linear.ccq(q, k, v, a.pop("g"), a.pop("beta"), strength=0.8,
                      output_final_state=True, **kw)
  return linear.interdomain_attention(q, k, v, a.pop("basis_in"), a.pop("basis_out"),
                                      a.pop("log_decay"), output_final_state=True, **kw)


def _reference(variant, a, seg):
  a = {n: jax.tree.map(lambda x: np.asarray(x, np.float64), x) for n, x in a.items()}
  if variant == "ttt":
    return reference.ttt_linear(a["q"], a["k"], a["v"], a["eta"], mini_batch_size=4,
                                initial_state=a["initial_state"])[0]
  if variant == "sla":
    return reference.softmax_linear_attention(
        a["q"], a["k"], a["v"], a["q_gate_logits"], a["k_gate_logits"], g=a["g"],
        beta=a["beta"], segment_ids=seg, initial_state=a["initial_state"])[0]
  if variant == "nha":
    return reference.native_hybrid_attention(
        a["q"], a["k"], a["v"], a["slot_log_gates"], window=3, segment_ids=seg,
        initial_state=(a["initial_state"][0], a["initial_state"][1]))
  if variant == "ccq":
    return reference.ccq(a["q"], a["k"], a["v"], g=a["g"], beta=a["beta"], strength=0.8,
                         segment_ids=seg)
  fq, fk = elu1(a["q"]), elu1(a["k"])
  return reference.interdomain(fq, fk, a["v"], a["basis_in"], a["basis_out"], a["log_decay"],
                               scale=K ** -0.5, segment_ids=seg)


VARIANTS = ("ttt", "sla", "ccq", "interdomain", "nha")


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_float64_reference(variant):
  """T = 11, chunks (TTT: mini-batches) of 4, segments (not TTT), initial states where the
  reference takes them."""
  a = _inputs(variant)
  seg = None if variant == "ttt" else cases.segments(B, T)
  o, _ = jax.jit(functools.partial(_call, variant, implementation="chunked", chunk_size=4,
                                   segment_ids=seg))(a)
  want = _reference(variant, a, None if seg is None else np.asarray(seg))
  np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", [
    "ttt", pytest.param("sla", marks=pytest.mark.slow), "ccq",
    pytest.param("interdomain", marks=pytest.mark.slow), "nha"])
@pytest.mark.parametrize("with_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_forms_agree_with_gradients(variant, with_parallel):
  """Outputs, final states and the gradients of every input (q, k, v, g, beta, gate
  logits, basis arrays, decays, eta, initial state) agree between the recurrent and the
  chunked form (and the parallel one under ``-m slow``; TTT has no parallel form). SLA and
  interdomain attention only transform the inputs of the base recurrences (whose forms
  test_forms.py checks): their gradients run under ``-m slow``."""
  forms = ("recurrent", "chunked") + (("parallel",) if with_parallel and variant != "ttt"
                                      else ())
  a = _inputs(variant, seed=1)
  seg = None if variant == "ttt" else cases.segments(B, T, seed=2)
  o, S = _call(variant, a, implementation="recurrent", segment_ids=seg)
  keys = iter(jax.random.split(jax.random.key(3), 4))
  w = (jax.random.normal(next(keys), o.shape),
       jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape), S))

  def loss(form, a):
    o, S = _call(variant, a, implementation=form, chunk_size=4, segment_ids=seg)
    return jnp.sum(o * w[0]) + sum(jnp.sum(s * c) for s, c in zip(
        jax.tree.leaves(S), jax.tree.leaves(w[1]), strict=True))

  results = {f: jax.jit(jax.value_and_grad(functools.partial(loss, f)))(a)
             for f in forms}
  want_v, want_g = results["recurrent"]
  for form in forms[1:]:
    np.testing.assert_allclose(results[form][0], want_v, rtol=1e-5)
    for name in a:
      for got, want in zip(jax.tree.leaves(results[form][1][name]),
                           jax.tree.leaves(want_g[name]), strict=True):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0, name
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale,
                                   err_msg=f"{form} d/d{name}")


@pytest.mark.parametrize("variant", [
    pytest.param("sla", marks=pytest.mark.slow), "ccq",
    pytest.param("interdomain", marks=pytest.mark.slow), "nha"])
def test_step_matches_full_call(variant):
  """``*_step`` token by token from the initial state equals the chunked call (T = 5)."""
  a = _inputs(variant, T=5, seed=21)
  o, S = jax.jit(functools.partial(_call, variant, implementation="chunked", chunk_size=2))(a)
  if variant == "sla":
    step = jax.jit(lambda x, state: linear.softmax_linear_attention_step(
        x["q"], x["k"], x["v"], x["q_gate_logits"], x["k_gate_logits"], state, g=x["g"],
        beta=x["beta"]))
    state = a["initial_state"]
  elif variant == "nha":
    step = jax.jit(lambda x, state: linear.native_hybrid_attention_step(
        x["q"], x["k"], x["v"], x["slot_log_gates"], state, window=3))
    K0, V0 = a["initial_state"]
    state = (K0, V0, jnp.zeros((B, 3, N, K)), jnp.zeros((B, 3, N, V)),
             jnp.zeros((B, 3), bool), 0)
  elif variant == "ccq":
    step = jax.jit(lambda x, state: linear.ccq_step(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                    state, strength=0.8))
    state = None
  else:
    step = jax.jit(lambda x, state: linear.interdomain_attention_step(
        x["q"], x["k"], x["v"], x["basis_in"], x["basis_out"], a["log_decay"], state))
    state = None
  outs = []
  for t in range(5):
    x = {n: y[:, t] for n, y in a.items() if n not in ("initial_state", "log_decay")}
    o_t, state = step(x, state)
    outs.append(o_t)
  np.testing.assert_allclose(jnp.stack(outs, 1), o, rtol=1e-5, atol=1e-5)
  if variant == "nha":
    state = state[:2]   # the slots; the window ring is the step's own
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5), state, S)


# A39 TTT-Linear ------------------------------------------------------------------------


def test_ttt_online_gradient_descent_is_the_delta_rule():
  """Mini-batches of one token: online GD on ½‖W^T k - v‖² is the delta rule with β = η."""
  a = _inputs("ttt", seed=4)

  @jax.jit
  def outputs(a):
    ttt = functools.partial(linear.ttt_linear, a["q"], a["k"], a["v"], a["eta"],
                            initial_state=a["initial_state"])
    return (ttt(mini_batch_size=1, output_final_state=True), ttt(mini_batch_size=4),
            linear.delta_rule(a["q"], a["k"], a["v"], a["eta"], output_final_state=True,
                              initial_state=a["initial_state"], implementation="recurrent"))

  (o, W), o4, (o_d, W_d) = outputs(a)
  np.testing.assert_allclose(o, o_d, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(W, W_d, rtol=1e-5, atol=1e-5)
  assert not np.allclose(o4, o, atol=1e-3)   # larger mini-batches are a different model


def test_ttt_step_matches_full_call():
  a = _inputs("ttt", T=7, seed=5)
  o, W = jax.jit(functools.partial(linear.ttt_linear, mini_batch_size=3,
                                   output_final_state=True))(
      a["q"], a["k"], a["v"], a["eta"], initial_state=a["initial_state"])
  state = (a["initial_state"], a["initial_state"], 0)
  step = jax.jit(functools.partial(linear.ttt_linear_step, mini_batch_size=3))
  outs = []
  for t in range(7):
    o_t, state = step(a["q"][:, t], a["k"][:, t], a["v"][:, t], a["eta"][:, t], state)
    outs.append(o_t)
  np.testing.assert_allclose(jnp.stack(outs, 1), o, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(state[1], W, rtol=1e-5, atol=1e-5)


# A34 Softmax Linear Attention ----------------------------------------------------------


def test_sla_uniform_gates_are_the_backbone_over_n_squared():
  """Equal gate logits: γ = 1/N for read and write, so the output is Gated DeltaNet's with
  β/N, read scaled by 1/N; without a write gate, simple GLA's output / N. The gates sum to 1."""
  a = _inputs("sla", seed=6)
  q, k, v, g, beta = a["q"], a["k"], a["v"], a["g"], a["beta"]
  zeros = jnp.zeros((B, T, N))

  @jax.jit
  def outputs(q, k, v, g, beta):
    return (linear.softmax_linear_attention(q, k, v, zeros, zeros, g=g, beta=beta),
            linear.gated_delta_rule(q, k, v, g, beta / N) / N,
            linear.softmax_linear_attention(q, k, v, zeros, g=g),
            linear.simple_gla(q, k, v, g) / N)

  o1, want1, o2, want2 = outputs(q, k, v, g, beta)
  np.testing.assert_allclose(o1, want1, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(o2, want2, rtol=1e-5, atol=1e-6)
  gates = linear.head_gates(a["q_gate_logits"], 0.5)
  np.testing.assert_allclose(jnp.sum(gates, -1), 1.0, rtol=1e-6)
  assert bool(jnp.all(gates > 0))


# A35 CCQ -------------------------------------------------------------------------------


def test_ccq_curvature_is_the_hessian_of_the_log_partition():
  """Without decay, C_t q_t is the Hessian of ``x -> log Σ_{j<=t} exp(x·k_j)`` at x = 0
  applied to q_t (and that Hessian is the key covariance): jax.hessian as the oracle."""
  a = _inputs("ccq", T=6, seed=7)
  q, k = a["q"][:1, :, :1], 2.0 * a["k"][:1, :, :1]

  @jax.jit
  def both(q, k):
    call = _dispatch.prepare("ccq", q, k, q, scale=None, segment_ids=None,
                             implementation="chunked", chunk_size=4)
    cq = _ccq.curvature_query(call, call.q, call.k, None, None)[0][0, :, 0]
    keys = k[0, :, 0]

    def hessian(t):
      f = lambda x: jax.nn.logsumexp(jnp.where(jnp.arange(6) <= t, keys @ x, -jnp.inf))
      return jax.hessian(f)(jnp.zeros(K))

    return cq, jnp.einsum("tij,tj->ti", jax.vmap(hessian)(jnp.arange(6)), q[0, :, 0])

  cq, want = both(q, k)
  np.testing.assert_allclose(cq, want, rtol=1e-5, atol=1e-5)


def test_ccq_strength_zero_is_the_backbone_and_contracts():
  """λ = 0: Gated DeltaNet exactly; λ = 1 with unit keys: ``‖q~‖ <= ‖q‖``, shrinking most
  along the keys' dominant direction."""
  a = _inputs("ccq", seed=8)
  q, k, v, g, beta = a["q"], a["k"], a["v"], a["g"], a["beta"]

  @jax.jit
  def outputs(q, k, v, g, beta):
    call = _dispatch.prepare("ccq", q, k, v, scale=None, segment_ids=None,
                             implementation="chunked", chunk_size=4)
    cq = _ccq.curvature_query(call, call.q, call.k, g, None)[0]
    return (linear.ccq(q, k, v, g, beta, strength=0.0), linear.gated_delta_rule(q, k, v, g, beta),
            cq)

  o, want, cq = outputs(q, k, v, g, beta)
  np.testing.assert_allclose(o, want, rtol=1e-6, atol=1e-6)
  norm = lambda x: jnp.linalg.norm(x, axis=-1)
  assert bool(jnp.all(norm(q - cq) <= norm(q) + 1e-5))
  assert not np.allclose(cq, 0.0, atol=1e-3)


# A41 Interdomain attention ---------------------------------------------------------------


def test_interdomain_one_basis_function_is_decayed_linear_attention():
  """R = 1 with b = ψ = 1: simple GLA on elu+1 features with the constant decay a."""
  a = _inputs("interdomain", seed=9)
  q, k, v = a["q"], a["k"], a["v"]
  ones = jnp.ones((B, T, N, 1))
  decay = jnp.array([[-0.3], [-0.1], [-0.7]])

  @jax.jit
  def outputs(q, k, v):
    fq, fk = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1
    return (linear.interdomain_attention(q, k, v, ones, ones, decay),
            linear.simple_gla(fq, fk, v, jnp.broadcast_to(decay[:, 0], (B, T, N))))

  o, want = outputs(q, k, v)
  np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)


# A45 Native Hybrid Attention -----------------------------------------------------------


def test_nha_without_slots_is_sliding_window_softmax_attention():
  """M = 0 slots: the window alone, i.e. jax.nn.dot_product_attention with a causal local
  window (w = 3), and with w >= T full causal attention; in every form (V = K here, as
  jax.nn requires)."""
  a = _inputs("nha", seed=12)
  q, k, v = a["q"], a["k"], a["q"] + 0.5 * a["k"]
  none = jnp.zeros((B, T, N, 0))

  @jax.jit
  def outputs(q, k, v):
    got = {(w, f): linear.native_hybrid_attention(q, k, v, none, window=w, implementation=f,
                                                  chunk_size=4)
           for w in (3, T) for f in cases.FORMS}
    want = {3: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(2, 0)),
            T: jax.nn.dot_product_attention(q, k, v, is_causal=True)}
    return got, want

  got, want = outputs(q, k, v)
  for (w, form), o in got.items():
    np.testing.assert_allclose(o, want[w], rtol=1e-5, atol=1e-5, err_msg=f"{w} {form}")


def test_nha_is_causal():
  """Changing the last token's k and v changes no earlier output (chunked form)."""
  a = _inputs("nha", seed=13)
  k2, v2 = a["k"].at[:, -1].add(1.0), a["v"].at[:, -1].add(1.0)
  fn = jax.jit(lambda k, v: linear.native_hybrid_attention(
      a["q"], k, v, a["slot_log_gates"], window=3, implementation="chunked", chunk_size=4))
  o1, o2 = fn(a["k"], a["v"]), fn(k2, v2)
  np.testing.assert_allclose(o1[:, :-1], o2[:, :-1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(o1[:, -1], o2[:, -1])


# A36 MHLA, A37 RALA --------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_mhla_matches_reference_and_forms_agree(causal):
  """T = 11 in blocks of 4 (3 blocks, the last short), C > 0 per head: both forms against
  the float64 weights, and the gradients of q, k, v and C agree between the forms."""
  a = _inputs("mhla", seed=14)
  C = jax.random.uniform(jax.random.key(15), (N, 3, 3), minval=0.1, maxval=2.0)
  w = jax.random.normal(jax.random.key(16), a["v"].shape)
  want = reference.mhla(elu1(np.asarray(a["q"])), elu1(np.asarray(a["k"])), a["v"], C,
                        block=4, causal=causal)

  def loss(form, q, k, v, C):
    o = linear.mhla(q, k, v, C, block_size=4, causal=causal, implementation=form)
    return jnp.sum(o * w), o

  results = {f: jax.jit(jax.value_and_grad(functools.partial(loss, f), argnums=(0, 1, 2, 3),
                                           has_aux=True))(a["q"], a["k"], a["v"], C)
             for f in ("parallel", "chunked")}
  for form, ((_, o), _) in results.items():
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-5, err_msg=form)
  for got, ref in zip(results["chunked"][1], results["parallel"][1], strict=True):
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(ref))))


def test_mhla_all_ones_is_linear_attention_and_raises_the_rank():
  """C = 1 is vanilla linear attention; a non-uniform C gives an attention matrix of rank
  above the feature dimension K' = K (vanilla linear attention's bound)."""
  a = _inputs("mhla", T=16, seed=17)
  q, k, v = a["q"], a["k"], a["v"]
  ones = jnp.ones((4, 4))
  np.testing.assert_allclose(jax.jit(functools.partial(linear.mhla, block_size=4))(q, k, v, ones),
                             jax.jit(linear.linear_attention)(q, k, v), rtol=1e-5, atol=1e-5)
  C = jax.random.uniform(jax.random.key(18), (4, 4), minval=0.1, maxval=2.0)
  fq, fk = elu1(np.asarray(q[0, :, 0], np.float64)), elu1(np.asarray(k[0, :, 0], np.float64))
  blk = np.arange(16) // 4
  plain = fq @ fk.T
  weights = plain * np.asarray(C, np.float64)[blk][:, blk]
  rank = lambda x: int(np.linalg.matrix_rank(x, tol=1e-9 * np.linalg.norm(x, 2)))
  assert rank(plain) <= K < rank(weights), (rank(plain), rank(weights))


def test_rala_matches_reference_and_uniform_weights_give_linear_attention():
  """RALA against the float64 loop (with a gate); with a zero-mean query (α uniform) and no
  gate it is bidirectional elu+1 linear attention."""
  a = _inputs("rala", T=9, seed=19)
  q, k, v = a["q"], a["k"], a["v"]
  gate = jax.random.normal(jax.random.key(20), v.shape)
  q0 = jnp.concatenate([q[:, :4], -q[:, :4], jnp.zeros_like(q[:, :1])], axis=1)

  @jax.jit
  def outputs(q, q0, k, v, gate):
    fq, fk = jax.nn.elu(q0) + 1, jax.nn.elu(k) + 1
    dense = jnp.einsum("btnk,bsnk->bnts", fq, fk)
    dense = dense / jnp.sum(dense, -1, keepdims=True)
    return (linear.rala(q, k, v, gate), linear.rala(q0, k, v),
            jnp.einsum("bnts,bsnv->btnv", dense, v), linear.rala_key_weights(q0, k))

  y, y0, plain, alpha = outputs(q, q0, k, v, gate)
  want = reference.rala(elu1(np.asarray(q)), elu1(np.asarray(k)), q, k, v, gate)
  np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(alpha, 1.0, rtol=1e-6)
  np.testing.assert_allclose(y0, plain, rtol=1e-5, atol=1e-5)


# Hedgehog ------------------------------------------------------------------------------


def test_hedgehog_features_give_the_attention_map_of_linear_attention():
  """linear_attention with Hedgehog features applies hedgehog_attention_weights (rows sum to
  1, positive on j <= i), and the loss is the cross-entropy written in numpy."""
  a = _inputs("sla", T=7, seed=10)
  params = linear.hedgehog_init(N, K, 5, key=jax.random.key(1), noise=0.3)

  @jax.jit
  def outputs(params, q, k, v):
    phi = linear.hedgehog_feature_map(params)
    return (linear.linear_attention(q, k, v, feature_map=phi),
            linear.hedgehog_attention_weights(params, q, k),
            linear.hedgehog_distillation_loss(params, q, k))

  o, weights, loss = outputs(params, a["q"], a["k"], a["v"])
  np.testing.assert_allclose(o, jnp.einsum("bnts,bsnv->btnv", weights, a["v"]),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jnp.sum(weights, -1), 1.0, rtol=1e-5)
  tril = np.tril(np.ones((7, 7), bool))
  assert bool(jnp.all(jnp.where(tril, weights > 0, weights == 0)))
  s = np.einsum("btnk,bsnk->bnts", a["q"], a["k"]) * K ** -0.5
  s = np.where(tril, s, -np.inf)
  teacher = np.exp(s - s.max(-1, keepdims=True))
  teacher /= teacher.sum(-1, keepdims=True)
  ce = -np.sum(np.where(tril, teacher * np.log(np.where(tril, weights, 1.0)), 0.0), -1).mean()
  np.testing.assert_allclose(loss, ce, rtol=1e-5)


def test_hedgehog_distillation_lowers_the_attention_kl():
  """40 Adam steps of attention distillation on a fixed batch of spiky softmax attention
  (scores scaled by 3) lower the mean KL(softmax ‖ Hedgehog) by more than half, and the
  distilled map is closer than elu+1 linear attention's."""
  a = _inputs("sla", T=16, seed=11)
  q, k = 3.0 * a["q"], 3.0 * a["k"]
  tril = jnp.tril(jnp.ones((16, 16), bool))
  s = jnp.where(tril, jnp.einsum("btnk,bsnk->bnts", q, k) * K ** -0.5, -jnp.inf)
  teacher = jax.nn.softmax(s, -1)
  entropy = -jnp.mean(jnp.sum(jnp.where(tril, teacher * jnp.log(teacher), 0.0), -1))
  kl = jax.jit(lambda p: linear.hedgehog_distillation_loss(p, q, k) - entropy)

  params = linear.hedgehog_init(N, K, 8)
  opt = optax.adam(0.05)

  @jax.jit
  def step(p, state):
    grads = jax.grad(linear.hedgehog_distillation_loss)(p, q, k)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  before = float(kl(params))
  state = opt.init(params)
  for _ in range(40):
    params, state = step(params, state)
  after = float(kl(params))
  fq, fk = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1
  elu = jnp.where(tril, jnp.einsum("btnk,bsnk->bnts", fq, fk), 0.0)
  elu = elu / jnp.sum(elu, -1, keepdims=True)
  kl_elu = float(jnp.mean(jnp.sum(jnp.where(
      tril, teacher * (jnp.log(teacher) - jnp.log(jnp.where(tril, elu, 1.0))), 0.0), -1)))
  assert after < 0.5 * before, (before, after)
  assert after < kl_elu, (after, kl_elu)


# validation ----------------------------------------------------------------------------

_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)
_g = np.zeros((1, 4, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`eta`", lambda: linear.ttt_linear(_q, _q, _v, -np.ones((1, 4, 2), np.float32))),
    ("`eta`", lambda: linear.ttt_linear(_q, _q, _v, np.ones((1, 4), np.float32))),
    ("`mini_batch_size`", lambda: linear.ttt_linear(_q, _q, _v, _g, mini_batch_size=0)),
    ("`implementation`", lambda: linear.ttt_linear(_q, _q, _v, _g, implementation="parallel")),
    ("`q_gate_logits`", lambda: linear.softmax_linear_attention(_q, _q, _v, np.zeros((1, 4)))),
    ("`temperature`", lambda: linear.softmax_linear_attention(_q, _q, _v, _g, temperature=0.0)),
    ("`beta`", lambda: linear.softmax_linear_attention(_q, _q, _v, _g, beta=_g + 3.0)),
    ("`g`", lambda: linear.ccq(_q, _q, _v, _g + 0.5)),
    ("`initial_state`", lambda: linear.ccq(_q, _q, _v, initial_state=np.zeros((1, 2, 3, 2)))),
    ("`strength`", lambda: linear.ccq(_q, _q, _v, strength="big")),
    ("`basis_in`", lambda: linear.interdomain_attention(_q, _q, _v, _g, _g, np.zeros((2, 1)))),
    ("`log_decay`", lambda: linear.interdomain_attention(
        _q, _q, _v, _g[..., None], _g[..., None], np.ones((2, 1)))),
    ("`feature_dim`", lambda: linear.hedgehog_init(2, 3, 0)),
    ("`mixing`", lambda: linear.mhla(_q, _q, _v, np.ones((3, 3)), block_size=2)),
    ("`block_size`", lambda: linear.mhla(_q, _q, _v, np.ones((1, 1)), block_size=0)),
    ("`gate`", lambda: linear.rala(_q, _q, _v, gate=np.ones((1, 4, 2, 3)))),
    ("`window`", lambda: linear.native_hybrid_attention(_q, _q, _v, _g[..., None], window=0)),
    ("`slot_log_gates`", lambda: linear.native_hybrid_attention(_q, _q, _v, _g, window=2)),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
