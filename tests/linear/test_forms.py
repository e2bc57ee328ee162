"""Features A30, A38, A39: every form of every variant against a float64 numpy loop, the
forms against each other (outputs, final states, every gradient), bf16 against float32,
decoding steps against the full call, and the chunked form's memory (no T x T buffer)."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests.linear import cases

VARIANTS, FORMS = cases.VARIANTS, cases.FORMS


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", [pytest.param("parallel", marks=pytest.mark.slow),
                                  pytest.param("recurrent", marks=pytest.mark.slow), "chunked"])
def test_matches_float64_loop(variant, form):
  """T = 11 with chunks of 4 (not a multiple), segments, an initial state. The default run
  checks the chunked form here; the parallel and recurrent forms are checked against it
  (values and gradients) by test_forms_agree_with_gradients, and here under ``-m slow``."""
  args = cases.inputs(variant)
  seg = cases.segments(2, 11)
  o, S = cases.call(variant, args, implementation=form, chunk_size=4, segment_ids=seg)
  o_ref, S_ref = cases.reference_call(variant, args, seg)
  np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5), S, S_ref)


def _loss(variant, form, chunk, seg, args, w):
  o, S = cases.call(variant, args, implementation=form, chunk_size=chunk, segment_ids=seg)
  return jnp.sum(o * w[0]) + sum(jnp.sum(s * c) for s, c in zip(
      jax.tree.leaves(S), jax.tree.leaves(w[1]), strict=True))


def _value_and_grads(variant, form, chunk, seg, args, w):
  fn = jax.jit(jax.value_and_grad(functools.partial(_loss, variant, form, chunk, seg)))
  return fn(args, w)


def _cotangents(variant, args, seed=7):
  o, S = cases.call(variant, args, implementation="recurrent")
  keys = iter(jax.random.split(jax.random.key(seed), 4))
  return (jax.random.normal(next(keys), o.shape),
          jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape), S))


@pytest.mark.parametrize("variant", VARIANTS)
def test_forms_agree_with_gradients(variant):
  """Outputs, final states and the gradients of q, k, v, g, beta and the initial state are
  the same (float32, ~1e-5 relative) in the three forms, with segments, T = 11, chunk 4."""
  args = cases.inputs(variant)
  seg = cases.segments(2, 11, seed=1)
  w = _cotangents(variant, args)
  results = {f: _value_and_grads(variant, f, 4, seg, args, w) for f in FORMS}
  want_v, want_g = results["recurrent"]
  for form in ("parallel", "chunked"):
    got_v, got_g = results[form]
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    for path, got in jax.tree_util.tree_leaves_with_path(got_g):
      want = functools.reduce(lambda t, p: t[p.key if hasattr(p, "key") else p.idx], path, want_g)
      np.testing.assert_allclose(
          got, want, rtol=2e-5, atol=2e-5 * float(np.max(np.abs(want))),
          err_msg=f"{form} d/d{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("variant", [
    "gla", pytest.param("gated_delta_rule", marks=pytest.mark.slow)])
def test_strong_decay_is_finite_and_exact(variant):
  """Log decays down to -30 per token (e^-300 across a chunk): masked before exp, so no
  inf or NaN in values or gradients, and the chunked form matches the recurrent one."""
  args = cases.inputs(variant, T=9, state=False, strong_decay=True)
  w = _cotangents(variant, args)
  (v1, g1), (v2, g2) = (_value_and_grads(variant, f, 4, None, args, w)
                        for f in ("recurrent", "chunked"))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g2))
  np.testing.assert_allclose(v2, v1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b)))), g2, g1)


@pytest.mark.parametrize("variant", [
    pytest.param("simple_gla", marks=pytest.mark.slow), "delta_rule"])
def test_bf16_inputs_match_float32(variant):
  """bf16 inputs are computed in float32 and returned in bf16 (state float32)."""
  args = cases.inputs(variant, T=13)
  low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), args)
  o16, S16 = cases.call(variant, low, implementation="chunked", chunk_size=4)
  o32, S32 = cases.call(variant, jax.tree.map(lambda x: x.astype(jnp.float32), low),
                        implementation="chunked", chunk_size=4)
  assert o16.dtype == jnp.bfloat16 and S16.dtype == jnp.float32
  np.testing.assert_allclose(o16.astype(jnp.float32), o32, rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(S16, S32, rtol=1e-5, atol=1e-5)


def _steps(variant, args):
  """Runs ``<variant>_step`` token by token from the initial state."""
  fn = jax.jit(getattr(linear, variant + "_step"))
  state = args.get("initial_state")
  outs = []
  for t in range(args["q"].shape[1]):
    tok = {n: x[:, t] for n, x in args.items() if n != "initial_state"}
    extra = [tok[n] for n in ("g", "beta") if n in tok]
    o, state = fn(tok["q"], tok["k"], tok["v"], *extra, state)
    outs.append(o)
  return jnp.stack(outs, axis=1), state


@pytest.mark.parametrize("variant", VARIANTS)
def test_step_matches_full_call(variant):
  args = cases.inputs(variant, T=5)
  o, S = cases.call(variant, args, implementation="chunked", chunk_size=2)
  o_steps, S_steps = _steps(variant, args)
  np.testing.assert_allclose(o_steps, o, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), S_steps, S)


def _max_t_axes(jaxpr, T):
  """The largest number of axes of size >= T in any intermediate (sub-jaxprs included)."""
  worst = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      shape = getattr(var.aval, "shape", ())
      worst = max(worst, sum(d >= T for d in shape))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      worst = max(worst, _max_t_axes(sub, T))
  return worst


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_has_no_t_by_t_buffer(variant):
  """T = 100 in chunks of 16 (7 chunks, padded): forward and backward hold no array with two
  axes of length >= T; the parallel form does (the check can fail)."""
  T = 100
  args = cases.inputs(variant, B=1, T=T, N=1, K=4, V=3)
  w = _cotangents(variant, args)
  for form, want in (("chunked", 1), ("parallel", 2)):
    fn = jax.value_and_grad(functools.partial(_loss, variant, form, 16, None))
    closed = jax.make_jaxpr(fn)(args, w)
    assert _max_t_axes(closed.jaxpr, T) == want, form


def test_default_implementation_by_length():
  """None: the parallel form within one chunk, the chunked form beyond (no T x T buffer)."""
  for variant in ("linear_attention", "gla"):
    args = cases.inputs(variant, B=1, T=20, N=1, state=False)
    fn = lambda a, variant=variant: cases.call(variant, a, chunk_size=8)
    assert _max_t_axes(jax.make_jaxpr(fn)(args).jaxpr, 20) == 1
    fn = lambda a, variant=variant: cases.call(variant, a, chunk_size=32)
    assert _max_t_axes(jax.make_jaxpr(fn)(args).jaxpr, 20) == 2


def test_relu_features_zero_denominator_is_finite():
  """relu features that are all 0 give a 0 denominator: the output is 0, gradients finite."""
  q = -jnp.ones((1, 4, 1, 2))
  k, v = -jnp.ones((1, 4, 1, 2)), jnp.ones((1, 4, 1, 3))
  f = lambda q, k: jnp.sum(linear.linear_attention(q, k, v, feature_map="relu"))
  value, g = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(q, k)
  assert float(value) == 0.0
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)


def test_unnormalized_identity_is_causal_linear_attention():
  """normalize=False, identity features: ``o = tril(q k^T) v · scale`` (a dense check)."""
  args = cases.inputs("simple_gla", T=6, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  o = jax.jit(lambda q, k, v: linear.linear_attention(  # one compilation, not one per op
      q, k, v, feature_map="identity", normalize=False, scale=0.5))(q, k, v)
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))  # the dense check in numpy
  scores = np.einsum("btnk,bsnk->bnts", qn, kn) * 0.5 * np.tril(np.ones((6, 6)))
  np.testing.assert_allclose(o, np.einsum("bnts,bsnv->btnv", scores, vn), rtol=1e-5, atol=1e-5)


def test_feature_map_callable_may_change_k():
  """A callable feature map [.., K] -> [.., 2K]: the state is [B, N, 2K, V]."""
  args = cases.inputs("simple_gla", T=5, K=3, state=False)
  phi = lambda x: jnp.concatenate([jax.nn.relu(x), jax.nn.relu(-x)], axis=-1)
  o, (S, z) = jax.jit(lambda q, k, v: linear.linear_attention(  # one compilation
      q, k, v, feature_map=phi, output_final_state=True))(args["q"], args["k"], args["v"])
  assert S.shape == (2, 2, 6, 3) and z.shape == (2, 2, 6)
  o_ref, _ = cases.reference.normalized_linear_attention(
      phi(args["q"]), phi(args["k"]), args["v"])
  np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 8), (33, 8), (64, 16), (130, 32)])
@pytest.mark.parametrize("with_segments", [False, True])
def test_matrix_slow(variant, T, chunk, with_segments):
  """The full matrix: lengths 1 ... 130, chunk sizes 4 ... 32, with and without segments."""
  args = cases.inputs(variant, T=T, N=2, K=8, V=5, seed=T)
  seg = cases.segments(2, T, seed=T) if with_segments and T > 1 else None
  o_ref, S_ref = cases.reference_call(variant, args, seg)
  w = _cotangents(variant, args)
  results = {f: _value_and_grads(variant, f, chunk, seg, args, w) for f in FORMS}
  for form in FORMS:
    o, S = cases.call(variant, args, implementation=form, chunk_size=chunk, segment_ids=seg)
    np.testing.assert_allclose(o, o_ref, rtol=5e-5, atol=5e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=5e-5, atol=5e-5), S, S_ref)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=5e-5, atol=5e-5 * float(jnp.max(jnp.abs(b)))),
        results[form][1], results["recurrent"][1])


@pytest.mark.parametrize("C", [1, 5, 16])
def test_unit_lower_inverse(C):
  """The recursive block inverse of I + A (A strictly lower) against numpy, C not a power of 2."""
  from jaxsoft.linear import recurrence
  A = np.tril(np.random.default_rng(C).normal(size=(2, C, C)), -1) * 0.5
  want = np.linalg.inv(np.eye(C) + A)
  got = recurrence.unit_lower_inverse(jnp.asarray(A, jnp.float32))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
