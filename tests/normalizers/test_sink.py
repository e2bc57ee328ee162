"""N03 softmax_n / softmax_1 / softmax_sink, plus checks shared by the N02-N24 test files.

The shared helpers (``tile_eval``, ``check_tile_rule``, ``check_mask_is_delete``,
``check_fully_masked``, ``check_low_precision``) are plain functions other test modules
import; they compare against independent computations, never the function itself.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.normalizers as N

# --------------------------------------------------------------------------------------
# Shared helpers.


def tile_eval(spec, x, mask, hp=None, splits=()):
  """Evaluates ``spec.tile`` on rows ``x [..., S]`` with an online (m, l) merge over key
  blocks cut at ``splits`` (empty = one dense block), as a blockwise driver would.

  Each block's numerators are computed at the running max of that moment and rescaled
  to the final max at the end (the FlashAttention merge), so a tile rule whose numerator
  and denominator do not rescale by ``e^{m_old - m_new}`` fails here.
  """
  hp = dict(hp or {})
  rule = spec.tile
  x = jnp.asarray(x, jnp.float32)
  mask = jnp.broadcast_to(mask, x.shape)
  xs = jnp.where(mask, x, 0.0)
  length = jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32)
  z = rule.score_map(xs, length, **hp)
  zero = jnp.zeros_like(length)
  if rule.denominator is None:  # class P
    return jnp.where(mask, rule.numerator(z, zero, **hp), 0.0)
  edges = [0, *sorted(splits), x.shape[-1]]
  m = jnp.full_like(length, -jnp.inf)
  den = zero
  parts = []
  for a, b in zip(edges[:-1], edges[1:], strict=True):
    zb, mb = z[..., a:b], mask[..., a:b]
    if rule.uses_max:
      blk = jnp.max(jnp.where(mb, zb, -jnp.inf), axis=-1, keepdims=True)
      m_new = jnp.maximum(m, blk)
      floor = getattr(rule, "m_floor", None)  # a declared floor of the stabiliser
      if floor is not None:
        m_new = jnp.where(jnp.isneginf(m_new), m_new, jnp.maximum(m_new, floor))
      m_new = jax.lax.stop_gradient(m_new)
    else:
      m_new = zero
    m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    scale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_use), 0.0) if rule.uses_max else 1.0
    den = den * scale + jnp.sum(jnp.where(mb, rule.denominator(zb, m_use, **hp), 0.0), -1,
                                keepdims=True)
    parts.append((jnp.where(mb, rule.numerator(zb, m_use, **hp), 0.0), m_use, mb))
    m = m_new
  m_f = jnp.where(jnp.isfinite(m), m, 0.0)
  num = jnp.concatenate(
      [jnp.where(mb, nb * (jnp.exp(mu - m_f) if rule.uses_max else 1.0), 0.0)
       for nb, mu, mb in parts], axis=-1)
  den = den + (rule.offset(m_f, length, **hp) if rule.offset is not None else 0.0)
  ok = den != 0
  w = jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)
  return jnp.where(mask, w, 0.0)


def random_rows(seed, shape=(6, 11), scale=1.5, masked=True):
  """Random scores and a random mask with one fully masked row and one full row."""
  rng = np.random.default_rng(seed)
  x = (scale * rng.standard_normal(shape)).astype(np.float32)
  mask = rng.random(shape) < 0.75
  mask[0] = False
  mask[1] = True
  if not masked:
    mask[:] = True
  return jnp.asarray(x), jnp.asarray(mask)


def check_tile_rule(spec, hp=None, seed=0, scale=1.5, atol=2e-6, rtol=2e-5):
  """Dense and blockwise (random key splits) tile evaluation == spec.fn, values and VJP."""
  hp = dict(hp or {})
  x, mask = random_rows(seed, scale=scale)
  rng = np.random.default_rng(seed + 1)
  fn = lambda x: spec.fn(x, where=mask, **hp)
  want, vjp = jax.vjp(fn, x)
  ct = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  (want_dx,) = vjp(ct)
  for splits in [(), (3,), tuple(sorted(rng.choice(np.arange(1, 11), 3, replace=False)))]:
    got, tvjp = jax.vjp(lambda x, sp=splits: tile_eval(spec, x, mask, hp, sp), x)
    chex.assert_trees_all_close(got, want, atol=atol, rtol=rtol)
    chex.assert_trees_all_close(tvjp(ct)[0], want_dx, atol=10 * atol, rtol=10 * rtol)


def check_mask_is_delete(fn, x, col, **hp):
  """Masking column ``col`` (where=False or x=-inf) == deleting it; its weight is 0."""
  keep = np.ones(x.shape[-1], bool)
  keep[col] = False
  want = fn(x[..., keep], **hp)
  for masked in (fn(x, where=jnp.asarray(keep), **hp),
                 fn(x.at[..., col].set(-jnp.inf), **hp)):
    chex.assert_trees_all_close(masked[..., keep], want, atol=1e-6, rtol=1e-5)
    assert np.all(np.asarray(masked[..., col]) == 0)
  # The gradient of the kept entries is unchanged, the masked entry gets none.
  ct = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), x.dtype)
  g_mask = jax.grad(lambda x: jnp.sum(fn(x, where=jnp.asarray(keep), **hp) * ct))(x)
  g_del = jax.grad(lambda y: jnp.sum(fn(y, **hp) * ct[..., keep]))(x[..., keep])
  chex.assert_trees_all_close(g_mask[..., keep], g_del, atol=1e-6, rtol=1e-5)
  assert np.all(np.asarray(g_mask[..., col]) == 0)


def check_fully_masked(fn, width=5, **hp):
  """A row with no visible entry: zeros, zero gradient, no NaN (also with -inf scores)."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, width)), jnp.float32)
  where = jnp.asarray([[False] * width, [True] * width])
  for args in [dict(x=x, where=where),
               dict(x=x.at[0].set(-jnp.inf), where=None)]:
    out = fn(args["x"], where=args["where"], **hp)
    assert np.all(np.asarray(out[0]) == 0), out
    assert np.all(np.isfinite(np.asarray(out)))
    g = jax.grad(lambda x, w=args["where"]: jnp.sum(jnp.sin(fn(x, where=w, **hp))))(args["x"])
    assert np.all(np.asarray(g[0]) == 0), g
    assert np.all(np.isfinite(np.asarray(g)))


def check_low_precision(fn, x, atol=(1e-2, 2e-3), **hp):
  """bf16/fp16 in -> same dtype out, close to the f32 result of the rounded input."""
  for dt, tol in zip((jnp.bfloat16, jnp.float16), atol, strict=True):
    xl = x.astype(dt)
    out = fn(xl, **hp)
    assert out.dtype == dt
    want = fn(xl.astype(jnp.float32), **hp)
    chex.assert_trees_all_close(out.astype(jnp.float32), want, atol=tol, rtol=tol)
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


def random_cotangent(shape, seed=7, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# --------------------------------------------------------------------------------------
# Oracles: softmax over the row with one extra logit appended, then drop it.


def _sink_oracle(x, logit):
  """softmax([x, logit])[:-1] along the last axis, logit broadcast per row."""
  logit = jnp.broadcast_to(logit, x.shape[:-1] + (1,)).astype(x.dtype)
  return jax.nn.softmax(jnp.concatenate([x, logit], axis=-1), axis=-1)[..., :-1]


X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 9)) * 2, jnp.float32)


def test_softmax_1_is_softmax_with_a_zero_logit():
  ct = random_cotangent(X.shape)
  got, vjp = jax.vjp(N.softmax_1, X)
  want, vjp_want = jax.vjp(lambda x: _sink_oracle(x, 0.0), X)
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(vjp(ct), vjp_want(ct), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [0.0, 0.5, 3.0, 100.0])
def test_softmax_n_is_softmax_with_log_n_logit(n):
  ct = random_cotangent(X.shape)
  got, vjp = jax.vjp(lambda x: N.softmax_n(x, n=n), X)
  if n == 0:
    want, vjp_want = jax.vjp(jax.nn.softmax, X)
  else:
    want, vjp_want = jax.vjp(lambda x: _sink_oracle(x, np.log(n)), X)
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(vjp(ct), vjp_want(ct), atol=1e-6, rtol=1e-5)
  # The sink mass: sum p = S / (n + S).
  s = jnp.sum(jnp.exp(X), -1)
  chex.assert_trees_all_close(got.sum(-1), s / (n + s), rtol=1e-5)


def test_softmax_n_gradient_in_n():
  # d/dn of e^{x_i}/(n + S) = -e^{x_i}/(n + S)^2.
  n = 2.5
  ct = random_cotangent(X.shape)
  g = jax.grad(lambda n: jnp.sum(N.softmax_n(X, n=n) * ct))(n)
  s = jnp.sum(jnp.exp(X), -1, keepdims=True)
  want = jnp.sum(-jnp.exp(X) / (n + s) ** 2 * ct)
  chex.assert_trees_all_close(g, want, rtol=1e-4)


def test_softmax_sink_per_head_broadcast_and_gradient():
  rng = np.random.default_rng(1)
  b, h, t, s = 2, 3, 4, 5
  x = jnp.asarray(rng.standard_normal((b, h, t, s)), jnp.float32)
  sink = jnp.asarray(rng.standard_normal((h, 1, 1)), jnp.float32)
  ct = random_cotangent(x.shape)
  f = lambda x, sink: jnp.sum(N.softmax_sink(x, sink_logit=sink) * ct)
  oracle = lambda x, sink: jnp.sum(_sink_oracle(x, jnp.broadcast_to(sink, (b, h, t, 1))) * ct)
  chex.assert_trees_all_close(N.softmax_sink(x, sink_logit=sink),
                              _sink_oracle(x, jnp.broadcast_to(sink, (b, h, t, 1))),
                              atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(jax.grad(f, (0, 1))(x, sink), jax.grad(oracle, (0, 1))(x, sink),
                              atol=1e-6, rtol=1e-5)


def test_softmax_sink_on_another_axis():
  x = X.T  # [9, 4]: rows are the 4 columns
  sink = jnp.asarray([[0.3, -1.0, 2.0, 0.0]])
  got = N.softmax_sink(x, sink_logit=sink, axis=0)
  chex.assert_trees_all_close(got, _sink_oracle(X, sink.T).T, atol=1e-6, rtol=1e-5)


def test_overflow_free_at_huge_and_tiny_logits():
  x = jnp.asarray([[1000.0, 1000.0, -1000.0], [-1000.0, -1000.0, -1000.0],
                   [88.0, 89.0, 0.0]])
  out = N.softmax_1(x)
  assert np.all(np.isfinite(np.asarray(out)))
  chex.assert_trees_all_close(out[0], jnp.asarray([0.5, 0.5, 0.0]), atol=1e-6)
  assert np.all(np.asarray(out[1]) == 0)  # all mass on the sink
  chex.assert_trees_all_close(out[2], _sink_oracle(x[2:], 0.0)[0], atol=1e-6, rtol=1e-5)
  g = jax.grad(lambda x: jnp.sum(N.softmax_sink(x, sink_logit=500.0) ** 2))(x)
  assert np.all(np.isfinite(np.asarray(g)))
  chex.assert_trees_all_close(N.softmax_sink(x, sink_logit=995.0)[0],
                              _sink_oracle(x[:1], 995.0)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["softmax_1", "softmax_n", "softmax_sink"])
def test_mask_equals_delete_and_fully_masked(name):
  spec = N.get(name)
  check_mask_is_delete(spec.fn, X, 4)
  check_fully_masked(spec.fn)
  for p in spec.params:
    check_fully_masked(spec.fn, **{p.name: p.sample})


def test_sink_gradient_zero_on_fully_masked_row():
  x = X[:2]
  where = jnp.asarray([[False] * 9, [True] * 9])
  g = jax.grad(lambda s: jnp.sum(N.softmax_sink(x, sink_logit=s, where=where) ** 2), )(
      jnp.asarray([[0.4], [0.4]]))
  assert g[0, 0] == 0 and g[1, 0] != 0


@pytest.mark.parametrize("name,hp", [("softmax_1", {}), ("softmax_n", {}),
                                     ("softmax_n", {"n": 3.0}), ("softmax_n", {"n": 0.0}),
                                     ("softmax_sink", {}), ("softmax_sink", {"sink_logit": -1.5})])
def test_tile_rule_matches_function(name, hp):
  check_tile_rule(N.get(name), hp)


@pytest.mark.parametrize("name,hp", [("softmax_1", {}), ("softmax_n", {"n": 3.0}),
                                     ("softmax_sink", {"sink_logit": -1.5})])
def test_tile_rule_at_extreme_logits(name, hp):
  check_tile_rule(N.get(name), hp, scale=300.0, atol=1e-5)


def test_tile_rule_with_row_broadcast_sink():
  sink = jnp.asarray(np.linspace(-1, 2, 6)[:, None], jnp.float32)
  check_tile_rule(N.get("softmax_sink"), {"sink_logit": sink})


def test_check_grads_float64():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)))
    check_grads(jax.jit(N.softmax_1), (x,), order=2, modes=["rev", "fwd"])
    check_grads(jax.jit(lambda x, n: N.softmax_n(x, n=n)), (x, jnp.float64(2.0)), order=2)
    sink = jnp.asarray([[0.1], [-0.7], [1.2]])
    check_grads(jax.jit(lambda x, s: N.softmax_sink(x, sink_logit=s)), (x, sink), order=2)
    assert N.softmax_1(x).dtype == jnp.float64
    # float64 end to end, per-row parameters included (no float32 round trip).
    chex.assert_trees_all_close(N.softmax_sink(x, sink_logit=sink), _sink_oracle(x, sink),
                                atol=1e-13, rtol=1e-12)
    n = jnp.asarray([[0.5], [2.0], [7.0]])
    chex.assert_trees_all_close(N.softmax_n(x, n=n), _sink_oracle(x, jnp.log(n)),
                                atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("name", ["softmax_1", "softmax_n", "softmax_sink"])
def test_low_precision(name):
  check_low_precision(N.get(name).fn, X)


def test_jit_vmap_grad():
  f = jax.jit(lambda x, s: N.softmax_sink(x, sink_logit=s))
  chex.assert_trees_all_close(f(X, 0.7), _sink_oracle(X, 0.7), atol=1e-6, rtol=1e-5)
  v = jax.vmap(lambda row: N.softmax_1(row))(X)
  chex.assert_trees_all_close(v, N.softmax_1(X), atol=1e-7)
  g = jax.jit(jax.grad(lambda x: N.softmax_n(x, n=2.0)[0, 0]))(X)
  gw = jax.grad(lambda x: _sink_oracle(x, np.log(2.0))[0, 0])(X)
  chex.assert_trees_all_close(g, gw, atol=1e-6, rtol=1e-5)


def test_properties_declared():
  for name in ("softmax_1", "softmax_n", "softmax_sink"):
    spec = N.get(name)
    assert spec.kernel_class == "E" and not spec.sums_to_one and spec.at_most_one
    assert not spec.shift_invariant
    assert np.all(np.asarray(spec.fn(X).sum(-1)) < 1)
    assert not np.allclose(spec.fn(X + 1.0), spec.fn(X))


def test_bad_input():
  with pytest.raises(ValueError, match="`n`"):
    N.softmax_n(X, n=-1.0)
  with pytest.raises(ValueError, match="`axis`"):
    N.softmax_1(X, axis=2)
  with pytest.raises(ValueError, match="`sink_logit`"):
    N.softmax_sink(X, sink_logit=jnp.zeros((4, 9)))
  with pytest.raises(ValueError, match="`sink_logit`"):
    N.softmax_sink(X, sink_logit=float("nan"))
  with pytest.raises(ValueError, match="`where`"):
    N.softmax_1(X, where=jnp.ones((3,), bool))
