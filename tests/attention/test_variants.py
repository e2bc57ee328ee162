"""Tests of the attention variants A03, A07-A10 (jaxsoft/attention/_variants.py).

Every check compares to a dense reference written here for clarity (explicit sums,
jax.nn.softmax, optax's simplex projection, a plain bisection for entmax) on the output
and on every input cotangent (random cotangent), plus float64 finite differences.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from jaxsoft.attention import _variants as V
from tests.helpers import BWD, FWD, normal

IMPLS = ("xla", "xla_chunked")


def _vjp_all(f, args, ct_key=99):
  """(output, input cotangents) of f at args for a random output cotangent (jitted)."""

  def run(*args):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(normal(ct_key, out.shape))

  return jax.jit(run)(*args)


def _assert_fn_close(f, ref, args, fwd=FWD, bwd=BWD):
  out, grads = _vjp_all(f, args)
  out_r, grads_r = _vjp_all(ref, args)
  chex.assert_trees_all_close(out, out_r, **fwd)
  chex.assert_trees_all_close(grads, grads_r, **bwd)
  chex.assert_tree_all_finite((out, grads))


def _masked_softmax(logits, visible):
  z = jnp.where(visible, logits, -jnp.inf)
  return jnp.where(visible, jax.nn.softmax(z, axis=-1), 0.0)


def _apply(w, v):
  return jnp.einsum("bnts,bsnh->btnh", w, v)


def _logits(q, k, scale=None):
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  return scale * jnp.einsum("btnh,bsnh->bnts", q, k)


def _causal(t, s):
  return jnp.tril(jnp.ones((t, s), bool))


def _simplex(x):
  """Sparsemax of the rows of x by optax's Euclidean projection onto the simplex."""
  rows = jax.vmap(optax.projections.projection_simplex)(x.reshape(-1, x.shape[-1]))
  return rows.reshape(x.shape)


# ----------------------------------------------------------------------------- A03 Hopfield


def _softmax_1_ref(z):
  zz = jnp.concatenate([z, jnp.zeros(z.shape[:-1] + (1,), z.dtype)], axis=-1)
  return jax.nn.softmax(zz, axis=-1)[..., :-1]


def _hopfield_ref(xi, mem, beta, iters, normalize):
  for _ in range(iters):
    xi = normalize(beta * xi @ mem.T) @ mem
  return xi


def _patterns(m=8, d=32):
  mem = normal(0, (m, d))
  return mem / jnp.linalg.norm(mem, axis=-1, keepdims=True) * math.sqrt(d)


@pytest.mark.parametrize("normalizer", ["softmax", "softmax_1"])
def test_hopfield_large_beta_retrieves_stored_pattern(normalizer):
  mem = _patterns()
  noisy = mem[jnp.array([3, 5])] + normal(1, (2, 32), 0.3)
  out = V.hopfield_retrieval(noisy, mem, beta=4.0, num_iters=1, normalizer=normalizer)
  chex.assert_trees_all_close(out, mem[jnp.array([3, 5])], atol=1e-4)


@pytest.mark.parametrize("normalizer,ref", [
    ("softmax", lambda z: jax.nn.softmax(z, axis=-1)),
    ("softmax_1", _softmax_1_ref),
])
def test_hopfield_matches_explicit_iteration(normalizer, ref):
  mem = normal(2, (6, 5), 0.7)
  xi = normal(3, (3, 5))
  beta = jnp.float32(0.8)
  f = lambda x, m, b: V.hopfield_retrieval(x, m, beta=b, num_iters=3, normalizer=normalizer)
  r = lambda x, m, b: _hopfield_ref(x, m, b, 3, ref)
  _assert_fn_close(f, r, (xi, mem, beta))


def test_hopfield_callable_normalizer_and_where():
  mem = normal(4, (6, 5))
  xi = normal(5, (2, 5))
  where = jnp.array([True, False, True, True, False, True])
  out = V.hopfield_retrieval(
      xi, mem, beta=0.5, num_iters=2,
      normalizer=lambda z, axis=-1, where=None: jax.nn.softmax(z, axis=axis, where=where),
      where=where)
  ref = _hopfield_ref(xi, mem[where], 0.5, 2, lambda z: jax.nn.softmax(z, axis=-1))
  chex.assert_trees_all_close(out, ref, **FWD)


@pytest.mark.parametrize("normalizer,offset", [("softmax", 0.0), ("softmax_1", 1.0)])
def test_hopfield_energy_does_not_increase(normalizer, offset):
  mem = normal(6, (10, 8))
  xi = normal(7, (4, 8))

  @jax.jit
  def energies(xi):
    es = [V.hopfield_energy(xi, mem, beta=0.3, offset=offset)]
    for _ in range(5):
      xi = V.hopfield_retrieval(xi, mem, beta=0.3, num_iters=1, normalizer=normalizer)
      es.append(V.hopfield_energy(xi, mem, beta=0.3, offset=offset))
    return jnp.stack(es)

  e = np.asarray(energies(xi))
  assert np.all(np.diff(e, axis=0) <= 1e-4), e
  assert np.all(e[-1] < e[0] - 1e-3), e  # and it does descend


def test_hopfield_energy_closed_form():
  mem = normal(8, (5, 3))
  xi = normal(9, (2, 3))
  z = 0.7 * xi @ mem.T
  want = -np.log(1.0 + np.exp(np.asarray(z, np.float64)).sum(-1)) / 0.7 + 0.5 * np.sum(
      np.asarray(xi, np.float64) ** 2, -1)
  np.testing.assert_allclose(V.hopfield_energy(xi, mem, beta=0.7), want, rtol=1e-5)


def test_hopfield_check_grads_f64():
  with jax.enable_x64(True):
    mem = jax.random.normal(jax.random.key(0), (5, 4), jnp.float64)
    xi = jax.random.normal(jax.random.key(1), (2, 4), jnp.float64)
    f = lambda x, m, b: V.hopfield_retrieval(x, m, beta=b, num_iters=2, normalizer="softmax_1")
    check_grads(f, (xi, mem, jnp.float64(0.6)), order=1, modes=("rev",))


def test_hopfield_bf16_in_float32():
  mem = normal(10, (6, 8))
  xi = normal(11, (2, 8))
  out = V.hopfield_retrieval(xi.astype(jnp.bfloat16), mem.astype(jnp.bfloat16), beta=0.5,
                             num_iters=2)
  assert out.dtype == jnp.bfloat16
  ref = _hopfield_ref(xi.astype(jnp.bfloat16).astype(jnp.float32),
                      mem.astype(jnp.bfloat16).astype(jnp.float32), 0.5, 2, _softmax_1_ref)
  chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=3e-2, rtol=2e-2)


# ------------------------------------------------------------------------------ A07 gating


def test_gated_output_matches_formula():
  y = normal(0, (2, 5, 3, 4))
  x = normal(1, (2, 5, 6))
  w = normal(2, (6, 3, 4), 0.5)
  b = normal(3, (3, 4))

  def ref(y, x, w, b):
    gate = 1.0 / (1.0 + jnp.exp(-(jnp.einsum("btd,dnh->btnh", x, w) + b)))
    return y * gate

  _assert_fn_close(V.gated_attention_output, ref, (y, x, w, b))


def test_gated_output_headwise_scalar_gate():
  y = normal(4, (2, 5, 3, 4))
  x = normal(5, (2, 5, 6))
  w = normal(6, (6, 3))
  out = V.gated_attention_output(y, x, w)
  gate = jax.nn.sigmoid(jnp.einsum("btd,dn->btn", x, w))
  chex.assert_trees_all_close(out, y * gate[..., None], **FWD)


def test_gated_output_open_gate_is_identity_and_shrinks():
  y = normal(7, (1, 4, 2, 3))
  x = normal(8, (1, 4, 5))
  w = jnp.zeros((5, 2, 3))
  chex.assert_trees_all_close(V.gated_attention_output(y, x, w, jnp.full((2, 3), 40.0)), y)
  out = V.gated_attention_output(y, x, normal(9, (5, 2, 3)))
  assert np.all(np.abs(out) <= np.abs(y))


def test_gated_output_check_grads_f64():
  with jax.enable_x64(True):
    ks = jax.random.split(jax.random.key(0), 4)
    y = jax.random.normal(ks[0], (1, 3, 2, 2), jnp.float64)
    x = jax.random.normal(ks[1], (1, 3, 4), jnp.float64)
    w = jax.random.normal(ks[2], (4, 2, 2), jnp.float64)
    b = jax.random.normal(ks[3], (2, 2), jnp.float64)
    check_grads(V.gated_attention_output, (y, x, w, b), order=1, modes=("rev",))


# ------------------------------------------------------------------------------ A08 FoX


def _fox_reference(q, k, v, log_f, keep=None):
  """Causal softmax attention with D_ij = sum_{l=j+1}^{i} log f_l as an explicit sum."""
  t = q.shape[1]
  terms = np.zeros((t, t, t), np.float32)  # terms[i, j, l] = 1 iff j < l <= i
  for i in range(t):
    for j in range(i + 1):
      terms[i, j, j + 1:i + 1] = 1.0
  d = jnp.einsum("btn,ijt->bnij", log_f, terms.astype(log_f.dtype))
  visible = _causal(t, t) if keep is None else _causal(t, t) & keep
  w = _masked_softmax(_logits(q, k) + d, visible)
  return _apply(w, v)


@pytest.fixture
def small_blocks(monkeypatch):
  """Chunked attention with 16 x 16 blocks, so short test sequences span many blocks."""
  from jaxsoft.attention import _chunked
  monkeypatch.setattr(_chunked, "BLOCK_Q", 16)
  monkeypatch.setattr(_chunked, "BLOCK_K", 16)
  return 16


def _fox_inputs(t=7, n=2, h=4, seed=0):
  q, k, v = (normal(seed + i, (2, t, n, h)) for i in range(3))
  log_f = jax.nn.log_sigmoid(normal(seed + 3, (2, t, n), 2.0) + 1.0)
  return q, k, v, log_f


def test_forget_gate_decay_is_cumulative_sum():
  log_f = jax.nn.log_sigmoid(normal(0, (2, 6, 3)))
  cq, ck = V.forget_gate_decay(log_f)
  lf = np.asarray(log_f, np.float64)
  for i in range(6):
    for j in range(i + 1):
      np.testing.assert_allclose(cq[:, i] - ck[:, j], lf[:, j + 1:i + 1].sum(1), atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_forgetting_attention_matches_explicit_sum(impl):
  q, k, v, log_f = _fox_inputs()
  f = lambda q, k, v, lf: V.forgetting_attention(q, k, v, lf, implementation=impl)
  _assert_fn_close(f, _fox_reference, (q, k, v, log_f))


def test_forgetting_attention_gqa():
  q, _, _, log_f = _fox_inputs(n=4)
  k, v = normal(10, (2, 7, 2, 4)), normal(11, (2, 7, 2, 4))
  out = V.forgetting_attention(q, k, v, log_f)
  ref = _fox_reference(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), log_f)
  chex.assert_trees_all_close(out, ref, **FWD)


def test_forgetting_attention_unit_gate_is_causal_softmax():
  q, k, v, log_f = _fox_inputs()
  out = V.forgetting_attention(q, k, v, jnp.zeros_like(log_f))
  chex.assert_trees_all_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), **FWD)


def test_forgetting_attention_check_grads_f64():
  with jax.enable_x64(True):
    q, k, v, log_f = (a.astype(jnp.float64) for a in _fox_inputs(t=5, n=1, h=2))
    f = lambda lf, q: V.forgetting_attention(q, k, v, lf, implementation="xla")
    check_grads(f, (log_f, q), order=1, modes=("rev",))


def test_forgetting_attention_very_negative_threshold_prunes_nothing(small_blocks):
  q, k, v, log_f = _fox_inputs(t=40)
  log_f = 4.0 * log_f  # fast forgetting: a real threshold would prune here
  pruned = lambda q, k, v, lf: V.forgetting_attention(
      q, k, v, lf, implementation="xla_chunked", prune_threshold=-1e30)
  _assert_fn_close(pruned, _fox_reference, (q, k, v, log_f))


def test_forgetting_attention_prunes_exactly_the_decayed_blocks(small_blocks):
  # A (query block, key block) pair is skipped when max_i c_i - min_j c_j < threshold
  # (over the block pair, batches and heads): equal to masking those pairs out.
  t, b = 80, small_blocks
  q, k, v, _ = _fox_inputs(t=t, seed=60)
  log_f = jax.nn.log_sigmoid(normal(64, (2, t, 2), 0.5) - 1.0)
  thr = -8.0
  c = np.asarray(jnp.cumsum(log_f, axis=1))  # [B, T, N]
  nb = t // b
  cmax = c.reshape(2, nb, b, 2).max(axis=(0, 2, 3))
  cmin = c.reshape(2, nb, b, 2).min(axis=(0, 2, 3))
  skip = (cmax[:, None] - cmin[None, :]) < thr  # [query block, key block]
  assert skip[np.tril_indices(nb, -1)].any()  # the test prunes something
  keep = ~np.kron(skip, np.ones((b, b), bool))
  out = V.forgetting_attention(q, k, v, log_f, implementation="xla_chunked",
                               prune_threshold=thr)
  chex.assert_trees_all_close(out, _fox_reference(q, k, v, log_f, jnp.asarray(keep)), **FWD)
  assert float(jnp.max(jnp.abs(out - _fox_reference(q, k, v, log_f)))) > 1e-7


def test_acp_threshold_bounds_every_pruned_weight():
  # Fast-forgetting heads: many pairs fall below the threshold.
  t = 48
  q, k, v, _ = _fox_inputs(t=t)
  log_f = jnp.full((2, t, 2), -1.5)
  eps = 1e-3
  thr = V.acp_prune_threshold(q, k, epsilon=eps)
  cq, ck = V.forget_gate_decay(log_f)
  d = jnp.transpose(cq, (0, 2, 1))[..., :, None] - jnp.transpose(ck, (0, 2, 1))[..., None, :]
  causal = _causal(t, t)
  w = _masked_softmax(_logits(q, k) + d, causal)
  pruned = causal & (d < thr)
  assert int(pruned.sum()) > 0.3 * int(causal.sum()) * 2  # the bound actually prunes
  assert float(jnp.max(jnp.where(pruned, w, 0.0))) < eps
  # The pruned pairs of each row are a prefix of the causal row (contiguous in the past).
  first_kept = jnp.argmin(pruned, axis=-1)
  j = jnp.arange(t)
  assert bool(jnp.all(pruned == (causal & (j < first_kept[..., None]))))


def test_forgetting_attention_acp_error_within_bound(small_blocks):
  t, eps = 96, 1e-2
  q, k, v, _ = _fox_inputs(t=t, seed=20)
  log_f = jnp.full((2, t, 2), -1.0)
  thr = float(V.acp_prune_threshold(q, k, epsilon=eps))
  assert -thr < 0.5 * t  # blocks far enough in the past fall below the threshold
  out = V.forgetting_attention(q, k, v, log_f, implementation="xla_chunked",
                               prune_threshold=thr)
  ref = _fox_reference(q, k, v, log_f)
  bound = 2 * t * eps * float(jnp.max(jnp.abs(v)))
  assert float(jnp.max(jnp.abs(out - ref))) <= bound
  chex.assert_tree_all_finite(out)


# ------------------------------------------------------------------------------ A09 SSMax


def _ssmax_reference(q, k, v, s):
  t = q.shape[1]
  n = jnp.arange(1, t + 1, dtype=jnp.float32)[:, None]  # causal: query i sees i + 1 keys
  z = (s[:, None, None] * jnp.log(n)) * _logits(q, k)
  return _apply(_masked_softmax(z, _causal(t, t)), v)


def test_ssmax_attention_per_head_s():
  q, k, v, _ = _fox_inputs(t=9, n=3)
  s = jnp.array([0.3, 0.9, 1.6])
  f = lambda q, k, v, s: V.ssmax_attention(q, k, v, s=s, is_causal=True,
                                           implementation="xla_chunked")
  _assert_fn_close(f, _ssmax_reference, (q, k, v, s))


def test_ssmax_attention_scalar_s_broadcasts():
  q, k, v, _ = _fox_inputs(t=6, n=2)
  out = V.ssmax_attention(q, k, v, s=0.7, is_causal=True)
  chex.assert_trees_all_close(out, _ssmax_reference(q, k, v, jnp.array([0.7, 0.7])), **FWD)


# ------------------------------------------------------------------------------ A10 entmax


def _entmax_bisect_ref(z, alpha, iters=80):
  """alpha-entmax of the rows of z by plain bisection on tau (float64 numpy)."""
  z = np.asarray(z, np.float64) * (alpha - 1.0)
  lo = z.max(-1, keepdims=True) - 1.0
  hi = z.max(-1, keepdims=True)
  for _ in range(iters):
    tau = (lo + hi) / 2
    mass = (np.maximum(z - tau, 0.0) ** (1.0 / (alpha - 1.0))).sum(-1, keepdims=True)
    lo = np.where(mass >= 1.0, tau, lo)
    hi = np.where(mass >= 1.0, hi, tau)
  p = np.maximum(z - (lo + hi) / 2, 0.0) ** (1.0 / (alpha - 1.0))
  return p / p.sum(-1, keepdims=True)


def test_entmax_attention_per_head_alpha_matches_references():
  q, k, v, _ = _fox_inputs(t=6, n=2, seed=30)
  q = 3.0 * q  # sharper logits: sparse rows
  alpha = jnp.array([2.0, 1.5])
  out = V.entmax_attention(q, k, v, alpha=alpha)
  logits = _logits(q, k)
  w0 = _simplex(logits[:, 0])  # alpha = 2: sparsemax
  w1 = _entmax_bisect_ref(logits[:, 1], 1.5)
  w = jnp.stack([w0, jnp.asarray(w1, jnp.float32)], axis=1)
  assert float(jnp.mean(w == 0)) > 0.1  # the test sees exact zeros
  chex.assert_trees_all_close(out, _apply(w, v), atol=2e-5, rtol=1e-4)


def test_sparsemax_attention_matches_projection():
  q, k, v, _ = _fox_inputs(t=6, n=2, seed=40)
  out = V.sparsemax_attention(3.0 * q, k, v)
  w = _simplex(_logits(3.0 * q, k))
  chex.assert_trees_all_close(out, _apply(w, v), atol=2e-5, rtol=1e-4)


def test_learned_alpha_gets_a_gradient():
  q, k, v, _ = _fox_inputs(t=6, n=2, seed=50)
  free = jnp.array([0.3, -0.5])

  def loss(free):
    alpha = V.softplus_to_range(free, 1.0)
    return jnp.sum(V.entmax_attention(2.0 * q, k, v, alpha=alpha) * normal(51, q.shape))

  g = jax.grad(loss)(free)
  chex.assert_tree_all_finite(g)
  assert np.all(np.abs(np.asarray(g)) > 1e-6), g
  # and it is the right gradient (central differences, float32 with a coarse step)
  for h in range(2):
    e = jnp.zeros(2).at[h].set(1e-2)
    fd = (loss(free + e) - loss(free - e)) / 2e-2
    np.testing.assert_allclose(g[h], fd, rtol=5e-2, atol=1e-3)


# --------------------------------------------------------------- parameterisations, errors


def test_softplus_parameterisation_round_trip_and_range():
  for low, margin in ((0.0, 0.0), (1.0, 1e-3)):
    y = jnp.array([low + margin + 1e-3, low + 0.5, low + 3.0, low + 40.0])
    z = V.softplus_from_range(y, low, margin)
    chex.assert_trees_all_close(V.softplus_to_range(z, low, margin), y, rtol=1e-5)
    extreme = V.softplus_to_range(jnp.array([-1e4, -100.0, 0.0, 1e4]), low, margin)
    assert np.all(np.asarray(extreme) >= low + margin) and np.all(np.isfinite(extreme))
  assert float(V.softplus_to_range(-1e4, 1.0, 1e-3)) > 1.0


@pytest.mark.parametrize("call,arg", [
    (lambda: V.hopfield_retrieval(jnp.ones((2, 3)), jnp.ones((4, 3)), beta=1.0, num_iters=0),
     "num_iters"),
    (lambda: V.hopfield_retrieval(jnp.ones((2, 3)), jnp.ones((4, 3)), beta=-1.0), "beta"),
    (lambda: V.hopfield_retrieval(jnp.ones((2, 3)), jnp.ones((4, 2)), beta=1.0),
     "query_state"),
    (lambda: V.gated_attention_output(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 5)),
                                      jnp.ones((5, 3, 3))), "w_gate"),
    (lambda: V.gated_attention_output(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 3, 5)),
                                      jnp.ones((5, 3, 4))), "x"),
    (lambda: V.forgetting_attention(jnp.ones((1, 4, 2, 3)), jnp.ones((1, 4, 2, 3)),
                                    jnp.ones((1, 4, 2, 3)), jnp.ones((1, 4, 3))), "log_f"),
    (lambda: V.forgetting_attention(jnp.ones((1, 4, 2, 3)), jnp.ones((1, 5, 2, 3)),
                                    jnp.ones((1, 5, 2, 3)), jnp.ones((1, 4, 2))), "T=4"),
    (lambda: V.acp_prune_threshold(jnp.ones((1, 2, 1, 2)), jnp.ones((1, 2, 1, 2)),
                                   epsilon=1.5), "epsilon"),
    (lambda: V.entmax_attention(jnp.ones((1, 2, 2, 3)), jnp.ones((1, 2, 2, 3)),
                                jnp.ones((1, 2, 2, 3)), alpha=1.0), "alpha"),
    (lambda: V.ssmax_attention(jnp.ones((1, 2, 2, 3)), jnp.ones((1, 2, 2, 3)),
                               jnp.ones((1, 2, 2, 3)), s=jnp.ones(3)), "`s`"),
    (lambda: V.ssmax_attention(jnp.ones((1, 2, 2, 3)), jnp.ones((1, 2, 2, 3)),
                               jnp.ones((1, 2, 2, 3)), s=1.0, normalizer_params={"s": 2.0}),
     "`s`"),
    (lambda: V.softplus_from_range(0.5, 1.0), "value"),
])
def test_bad_input_names_the_argument(call, arg):
  with pytest.raises(ValueError, match=arg):
    call()


def test_unknown_normalizer_is_a_key_error():
  with pytest.raises(KeyError, match="nope"):
    V.hopfield_retrieval(jnp.ones((2, 3)), jnp.ones((4, 3)), beta=1.0, normalizer="nope")
