"""Features A31 (cosFormer), A33 (Lightning Attention), A40 (Taylor linear attention):
against float64 references written from the papers (quadratic forms and loops), the three
forms against each other with gradients, decoding steps against the full call, and the
properties the papers state (λ = 1 is plain linear attention; the Taylor series converges
to softmax attention; cosFormer is invariant to scaling q)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from tests.linear import cases, reference

FORMS = cases.FORMS
B, T, N, K, V = 2, 11, 2, 3, 2


def _inputs(variant, T=T, seed=0, state=True):
  ks = jax.random.split(jax.random.key(seed), 6)
  args = {"q": jax.random.normal(ks[0], (B, T, N, K)),
          "k": jax.random.normal(ks[1], (B, T, N, K)),
          "v": jax.random.normal(ks[2], (B, T, N, V))}
  if variant == "lightning":
    args["g"] = jax.random.uniform(ks[3], (N,), minval=-1.0, maxval=0.0)
  if state:
    width = {"lightning": K, "taylor": 1 + K + K * K, "cosformer": 2 * K, "mala": K}[variant]
    S = 0.5 * jax.random.normal(ks[4], (B, N, width, V))
    z = jax.random.uniform(ks[5], (B, N, width), minval=0.5, maxval=2.0)
    if variant == "mala":   # [[Σφ(k)v^T, Σφ(k)], [Σv^T, n]] of 3 earlier tokens
      S = jnp.concatenate([jnp.concatenate([S, z[..., None]], -1),
                           jnp.concatenate([S[:, :, :1], jnp.full((B, N, 1, 1), 3.0)], -1)], -2)
    args["initial_state"] = S if variant in ("lightning", "mala") else (S, z)
  return args


def _call(variant, args, **kw):
  a = dict(args)
  q, k, v = a.pop("q"), a.pop("k"), a.pop("v")
  if variant == "lightning":
    return linear.lightning_attention(q, k, v, a.pop("g"), output_final_state=True, **a, **kw)
  if variant == "taylor":
    return linear.taylor_linear_attention(q, k, v, output_final_state=True, **a, **kw)
  if variant == "mala":
    return linear.mala(q, k, v, output_final_state=True, **a, **kw)
  return linear.cosformer(q, k, v, max_len=16, output_final_state=True, **a, **kw)


def _jit_call(variant, args, **kw):
  return jax.jit(functools.partial(_call, variant, **kw))(args)


def _reference(variant, args, seg):
  q, k, v = (np.asarray(args[n], np.float64) for n in "qkv")
  if variant == "lightning":
    g = np.broadcast_to(np.asarray(args["g"]), (B, q.shape[1], N))
    return reference.recurrence(q, k, v, g=g, segment_ids=seg)[0]
  if variant == "mala":
    return reference.mala(q, k, v, scale=K ** -0.5, segment_ids=seg)
  weight = (reference.taylor_weight(2, K ** -0.5) if variant == "taylor"
            else reference.cosformer_weight(16))
  return reference.weighted_causal_attention(weight, q, k, v, segment_ids=seg)


VARIANTS = ("lightning", "taylor", "cosformer", "mala")


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_float64_reference(variant):
  """T = 11, chunks of 4, segments; the reference is the paper's quadratic form (Taylor,
  cosFormer) or the decayed recurrence as a loop (Lightning)."""
  args = _inputs(variant, state=False)
  seg = cases.segments(B, T)
  o, _ = _jit_call(variant, args, implementation="chunked", chunk_size=4, segment_ids=seg)
  np.testing.assert_allclose(o, _reference(variant, args, np.asarray(seg)),
                             rtol=2e-5, atol=2e-5)


def _loss(variant, form, seg, args, w):
  o, S = _call(variant, args, implementation=form, chunk_size=4, segment_ids=seg)
  return jnp.sum(o * w[0]) + sum(jnp.sum(s * c) for s, c in zip(
      jax.tree.leaves(S), jax.tree.leaves(w[1]), strict=True))


@pytest.mark.parametrize("variant", VARIANTS)
def test_forms_agree_with_gradients(variant):
  """parallel = recurrent = chunked: outputs, final states and every gradient (q, k, v, the
  decay, the initial state), with segments and an initial state."""
  args = _inputs(variant)
  seg = cases.segments(B, T, seed=1)
  o, S = _jit_call(variant, args, implementation="recurrent")
  keys = iter(jax.random.split(jax.random.key(7), 4))
  w = (jax.random.normal(next(keys), o.shape),
       jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape), S))
  results = {f: jax.jit(jax.value_and_grad(functools.partial(_loss, variant, f, seg)))(args, w)
             for f in FORMS}
  want_v, want_g = results["recurrent"]
  for form in ("parallel", "chunked"):
    got_v, got_g = results[form]
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b)))), got_g, want_g)


def _steps(variant, args):
  state = args.get("initial_state")
  outs = []
  for t in range(args["q"].shape[1]):
    q, k, v = (args[n][:, t] for n in "qkv")
    if variant == "lightning":
      o, state = linear.lightning_attention_step(q, k, v, state, g=args["g"])
    elif variant == "taylor":
      o, state = linear.taylor_linear_attention_step(q, k, v, state)
    elif variant == "mala":
      o, state = linear.mala_step(q, k, v, state)
    else:
      o, state = linear.cosformer_step(q, k, v, state, position=t, max_len=16)
    outs.append(o)
  return jnp.stack(outs, axis=1), state


@pytest.mark.parametrize("variant", VARIANTS)
def test_step_matches_full_call(variant):
  args = _inputs(variant, T=5)
  o, S = _jit_call(variant, args, implementation="chunked", chunk_size=2)
  o_steps, S_steps = _steps(variant, args)
  np.testing.assert_allclose(o_steps, o, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), S_steps, S)


# A33 Lightning Attention ---------------------------------------------------------------


def test_lightning_is_the_decay_mask():
  """``o = ((Q K^T ⊙ M) V) scale``, ``M_tj = λ^{t-j}``: a dense check; g = 0 is plain causal
  linear attention (unnormalised, identity features)."""
  args = _inputs("lightning", T=6, state=False)
  q, k, v, g = args["q"], args["k"], args["v"], args["g"]
  t = jnp.arange(6)
  mask = jnp.where(t[:, None] >= t[None, :],
                   jnp.exp(g[:, None, None] * (t[:, None] - t[None, :])), 0.0)   # [N, T, T]
  scores = jnp.einsum("btnk,bsnk->bnts", q, k) * K ** -0.5 * mask
  light = jax.jit(linear.lightning_attention)
  np.testing.assert_allclose(light(q, k, v, g), jnp.einsum("bnts,bsnv->btnv", scores, v),
                             rtol=1e-5, atol=1e-5)
  plain = jax.jit(functools.partial(linear.linear_attention, feature_map="identity",
                                    normalize=False))(q, k, v)
  np.testing.assert_allclose(light(q, k, v, jnp.zeros(N)), plain, rtol=1e-5, atol=1e-5)


def test_lightning_decay_schedule():
  """ALiBi slopes (2^{-8i/N}; N = 6: those of 4, then every other one of 8), scaled by
  ``1 - l/(L-1) + 1e-5``; g = None uses it."""
  np.testing.assert_allclose(-linear.lightning_decay(8), 2.0 ** -np.arange(1, 9) * (1 + 1e-5),
                             rtol=1e-6)
  want6 = np.array([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3])
  np.testing.assert_allclose(-linear.lightning_decay(6), want6 * (1 + 1e-5), rtol=1e-6)
  np.testing.assert_allclose(-linear.lightning_decay(4, 3, 4), 1e-5 * 4.0 ** -np.arange(1, 5),
                             rtol=1e-4)
  args = _inputs("lightning", T=4, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  np.testing.assert_allclose(
      linear.lightning_attention(q, k, v, layer_idx=1, num_layers=3),
      linear.lightning_attention(q, k, v, linear.lightning_decay(N, 1, 3)), rtol=1e-6)


# A40 Taylor ----------------------------------------------------------------------------


@pytest.mark.parametrize("order", [pytest.param(0, marks=pytest.mark.slow),
                                   pytest.param(1, marks=pytest.mark.slow), 3])
def test_taylor_order_is_the_truncated_series(order):
  """Order m equals the quadratic attention with ``exp`` replaced by ``Σ_{i<=m} s^i/i!``
  (small scores, so odd orders keep a positive denominator)."""
  args = _inputs("taylor", T=7, state=False)
  q, k, v = 0.5 * args["q"], 0.5 * args["k"], args["v"]
  o = jax.jit(functools.partial(linear.taylor_linear_attention, order=order, scale=0.5))(q, k, v)
  want = reference.weighted_causal_attention(reference.taylor_weight(order, 0.5), q, k, v)
  np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_taylor_converges_to_softmax_attention():
  """For moderate scores the error against causal softmax attention falls with the order
  faster and faster (``~ s^{m+1}/(m+1)!``: the error ratios shrink), to < 5e-3 by order 8."""
  args = _inputs("taylor", T=6, state=False)
  q, k, v = 0.7 * args["q"], 0.7 * args["k"], args["v"]    # |scores| <~ 2
  logits = jnp.einsum("btnk,bsnk->bnts", q, k) * K ** -0.5
  logits = jnp.where(jnp.tril(jnp.ones((6, 6), bool)), logits, -jnp.inf)
  soft = jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(logits, axis=-1), v)
  errors = [float(jnp.max(jnp.abs(linear.taylor_linear_attention(q, k, v, order=m) - soft)))
            for m in range(2, 9, 2)]
  ratios = [b / a for a, b in zip(errors, errors[1:], strict=False)]
  assert all(r < 1 for r in ratios) and ratios == sorted(ratios, reverse=True), errors
  assert errors[-1] < 5e-3, errors


@pytest.mark.slow
def test_taylor_feature_map_registered():
  """``feature_map="taylor"`` is order 2 on unscaled q: ``taylor_linear_attention(scale=1)``."""
  args = _inputs("taylor", T=5, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  np.testing.assert_allclose(linear.linear_attention(q, k, v, feature_map="taylor"),
                             linear.taylor_linear_attention(q, k, v, scale=1.0),
                             rtol=1e-5, atol=1e-5)


# A31 cosFormer -------------------------------------------------------------------------


def test_cosformer_is_invariant_to_scaling_q_and_continues_from_a_state():
  """Scaling q by c > 0 leaves o unchanged (row normalisation); two calls chained by
  ``initial_state`` and ``start_position`` equal one call (same ``max_len``)."""
  args = _inputs("cosformer", T=8, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  cos = jax.jit(linear.cosformer, static_argnames=("max_len", "start_position",
                                                  "output_final_state"))
  o = cos(q, k, v, max_len=12)
  np.testing.assert_allclose(cos(3.0 * q, k, v, max_len=12), o, rtol=1e-5, atol=1e-6)
  o1, state = cos(q[:, :5], k[:, :5], v[:, :5], max_len=12, output_final_state=True)
  o2 = cos(q[:, 5:], k[:, 5:], v[:, 5:], max_len=12, start_position=5, initial_state=state)
  np.testing.assert_allclose(jnp.concatenate([o1, o2], axis=1), o, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cosformer_default_max_len_is_the_length():
  args = _inputs("cosformer", T=6, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  np.testing.assert_allclose(linear.cosformer(q, k, v), linear.cosformer(q, k, v, max_len=6),
                             rtol=1e-6)
  want = reference.weighted_causal_attention(reference.cosformer_weight(6), q, k, v)
  np.testing.assert_allclose(linear.cosformer(q, k, v), want, rtol=2e-5, atol=2e-5)


# A32 MALA ------------------------------------------------------------------------------


def test_mala_weights_sum_to_one_and_scaling_q_sharpens():
  """A constant v comes back unchanged (the weights sum to 1); scaling q by 4 changes the
  output (the magnitude is kept), while ReLU linear attention is invariant to it."""
  args = _inputs("mala", T=6, state=False)
  q, k, v = args["q"], args["k"], args["v"]
  o = jax.jit(functools.partial(linear.mala, eps=1e-9))(q, k, jnp.full_like(v, 2.5))
  np.testing.assert_allclose(o, 2.5, rtol=1e-4)
  relu = jax.jit(lambda x: linear.linear_attention(x, k, v, feature_map="relu", eps=1e-9))
  np.testing.assert_allclose(relu(4.0 * q), relu(q), rtol=1e-4, atol=1e-5)
  mala = jax.jit(functools.partial(linear.mala, feature_map="relu"))
  spread = lambda x: float(jnp.std(mala(x, k, v)))
  assert spread(4.0 * q) > 1.5 * spread(q)


# validation ----------------------------------------------------------------------------

_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)


def _bad_calls():
  yield "`g`", lambda: linear.lightning_attention(_q, _q, _v, np.zeros((1, 4, 2)))
  yield "`g`", lambda: linear.lightning_attention(_q, _q, _v, np.array([0.1, -1.0]))
  yield "`g`", lambda: linear.lightning_attention_step(_q[:, 0], _q[:, 0], _v[:, 0],
                                                       g=np.zeros(3))
  yield "`num_heads`", lambda: linear.lightning_decay(0)
  yield "`layer_idx`", lambda: linear.lightning_decay(2, 2, 2)
  yield "`order`", lambda: linear.taylor_linear_attention(_q, _q, _v, order=-1)
  yield "`order`", lambda: linear.taylor_features(_q, order=1.5)
  yield "`eps`", lambda: linear.taylor_linear_attention_step(_q[:, 0], _q[:, 0], _v[:, 0], eps=0)
  yield "`max_len`", lambda: linear.cosformer(_q, _q, _v, max_len=2)
  yield "`max_len`", lambda: linear.cosformer(_q, _q, _v, max_len=-1.0)
  yield "`start_position`", lambda: linear.cosformer(_q, _q, _v, start_position=-1)
  yield "`position`", lambda: linear.cosformer_step(_q[:, 0], _q[:, 0], _v[:, 0],
                                                    position=1.0, max_len=4)
  yield "`position`", lambda: linear.cosformer_step(_q[:, 0], _q[:, 0], _v[:, 0],
                                                    position=5, max_len=4)
  yield "`initial_state`", lambda: linear.mala(_q, _q, _v, initial_state=np.zeros((1, 2, 3, 2)))
  yield "`state`", lambda: linear.mala_step(_q[:, 0], _q[:, 0], _v[:, 0], np.zeros((1, 2, 3, 2)))
  yield "`feature_map`", lambda: linear.mala(_q, _q, _v, feature_map="softmax")
  yield "`initial_state`", lambda: linear.cosformer(
      _q, _q, _v, initial_state=(np.zeros((1, 2, 3, 2)), np.zeros((1, 2, 3))))


@pytest.mark.parametrize("case", range(len(list(_bad_calls()))))
def test_bad_input_names_the_argument(case):
  name, fn = list(_bad_calls())[case]
  with pytest.raises(ValueError, match=name):
    fn()


# FAVOR+ (Performer) random features for linear_attention -------------------------------


def test_favor_rows_are_orthogonal_gaussians_and_features_positive():
  """Rows in one block are orthogonal; the map is fixed by the key; features are > 0."""
  from jaxsoft.linear import _features
  W = _features._orthogonal_gaussian(jax.random.key(1), 6, 3)
  for block in (W[:3], W[3:]):
    gram = block @ block.T
    np.testing.assert_allclose(gram - jnp.diag(jnp.diag(gram)), 0.0, atol=1e-5)
  x = jax.random.normal(jax.random.key(2), (5, 3))
  phi = linear.favor_feature_map(jax.random.key(3), 3, 8)
  np.testing.assert_array_equal(phi(x), linear.favor_feature_map(jax.random.key(3), 3, 8)(x))
  assert not np.allclose(phi(x), linear.favor_feature_map(jax.random.key(4), 3, 8)(x))
  assert bool(jnp.all(phi(x) > 0))


def test_favor_kernel_is_unbiased():
  """The mean of φ(q)·φ(k) over 64 independent draws of 64 features is exp(scale q·k)
  within 4 standard errors (the estimator's own spread across the draws)."""
  q, k = 0.5 * jax.random.normal(jax.random.key(5), (2, 4))
  def draw(key):
    phi = linear.favor_feature_map(key, 4, 64)
    return phi(q) @ phi(k)
  draws = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(6), 64))
  want = float(jnp.exp(q @ k / 2.0))
  assert abs(float(draws.mean()) - want) < 4 * float(draws.std()) / 8 + 1e-6


def test_favor_attention_approaches_softmax_attention():
  """linear_attention with FAVOR+ features estimates causal softmax attention: the error,
  averaged over 3 draws, falls as the number of features grows (16 -> 256 -> 4096)."""
  args = _inputs("lightning", T=8, state=False)
  q, k, v = 0.7 * args["q"], 0.7 * args["k"], args["v"]
  logits = jnp.einsum("btnk,bsnk->bnts", q, k) * K ** -0.5
  logits = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), logits, -jnp.inf)
  soft = jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(logits, axis=-1), v)

  @functools.partial(jax.jit, static_argnums=1)
  def error(key, m):
    o = linear.linear_attention(q, k, v, feature_map=linear.favor_feature_map(key, K, m))
    return jnp.mean(jnp.abs(o - soft))

  keys = jax.random.split(jax.random.key(8), 3)
  errors = [float(np.mean([error(key, m) for key in keys])) for m in (16, 256, 4096)]
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[2] < 0.03, errors


def test_favor_forms_agree_with_gradients():
  """FAVOR+ features through the three forms of linear_attention: values and gradients."""
  args = _inputs("lightning", state=False)
  del args["g"]
  phi = linear.favor_feature_map(jax.random.key(9), K, 8)
  seg = cases.segments(B, T, seed=2)

  def loss(form, a):
    return jnp.sum(jnp.sin(linear.linear_attention(
        a["q"], a["k"], a["v"], feature_map=phi, implementation=form, chunk_size=4,
        segment_ids=seg)))

  results = {f: jax.jit(jax.value_and_grad(functools.partial(loss, f)))(args) for f in FORMS}
  for form in ("parallel", "chunked"):
    np.testing.assert_allclose(results[form][0], results["recurrent"][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b)))),
        results[form][1], results["recurrent"][1])


@pytest.mark.parametrize("bad", [
    ("`key`", lambda: linear.favor_feature_map(0, 4)),
    ("`head_dim`", lambda: linear.favor_feature_map(jax.random.key(0), 0)),
    ("`num_features`", lambda: linear.favor_feature_map(jax.random.key(0), 4, 2.0)),
    ("`scale`", lambda: linear.favor_feature_map(jax.random.key(0), 4, scale=-1.0)),
])
def test_favor_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
